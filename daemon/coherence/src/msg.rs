//! Messages between nodes. Every batch carries the sender's membership epoch
//! and incarnation; a receiver drops batches of another epoch or of an
//! incarnation that is not the member's current one (counted as stale).

use crate::{BlockKey, OpId, SlotMeta, SlotRef};

/// Messages to one peer within a flush window, sent as one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Sender's epoch.
    pub epoch: u64,
    /// Sender's incarnation.
    pub incarnation: u64,
    /// Entries.
    pub msgs: Vec<Msg>,
}

/// What a home registered (a pending holder) before answering a locate
/// that carried a copy id: the reader's copy `copy` of `key` at `version`.
/// Echoed in the answer so that a reader whose get ended meanwhile (or
/// whose grant the home's driver refused) can still take it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registration {
    /// Block.
    pub key: BlockKey,
    /// The version registered.
    pub version: u64,
    /// The reader's copy id.
    pub copy: u64,
}

/// Answer of a home to a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishResult {
    /// Visible at this version.
    Stored(u64),
    /// Another change of the key is in progress, or the directory is being
    /// rebuilt: retry later.
    Busy,
}

/// Answer of a home to a locate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocateResult {
    /// `holder` has `version`.
    Found {
        /// Current version.
        version: u64,
        /// A holder of it.
        holder: crate::NodeId,
    },
    /// Nobody holds the key.
    Miss,
    /// The key is changing or the directory is rebuilding.
    Busy,
}

/// Answer of a holder to a grant request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrantResult {
    /// Read `slot` within `lease_us` of asking.
    Granted {
        /// Holder's slot.
        slot: SlotRef,
        /// What the slot holds.
        meta: SlotMeta,
        /// Grant lease.
        lease_us: u64,
        /// Grant id (for release).
        grant: u64,
    },
    /// Not held (any more) at that version.
    Refused,
}

/// One protocol message.
#[allow(missing_docs)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Writer -> home: make my pending copy (`copy`, a node-local id) the
    /// key's next version.
    PublishReq { op: OpId, key: BlockKey, checksum: u64, copy: u64 },
    /// Home -> writer.
    PublishResp { op: OpId, key: BlockKey, result: PublishResult, copy: u64 },
    /// Writer -> home: I gave up on this publish.
    PublishAbort { op: OpId, key: BlockKey },
    /// Home -> holder: stop serving `version` (and anything older) and
    /// ack. `change` names the overwrite or invalidation it belongs to.
    Invalidate { key: BlockKey, version: u64, change: u64 },
    /// Holder -> home: I serve no `version` of `key` any more. Counts only
    /// for the change it names, once (duplicates and stale acks are ignored).
    InvalidateAck { key: BlockKey, version: u64, change: u64 },
    /// Engine's invalidation -> home.
    InvalidateReq { op: OpId, key: BlockKey },
    /// Home -> requester: done (`ok`) or busy.
    InvalidateResp { op: OpId, key: BlockKey, ok: bool },
    /// Reader -> home: who holds the key? With a copy id (not 0), a home
    /// that names a holder (or grants its own copy) first registers the
    /// reader as a pending holder of that version under this copy id.
    LocateReq { op: OpId, key: BlockKey, copy: u64 },
    /// Home -> reader.
    /// `reg`: what the home registered (pending) before answering.
    LocateResp { op: OpId, key: BlockKey, result: LocateResult, reg: Option<Registration> },
    /// Reader -> holder: let me read your copy of `version`.
    GrantReq { op: OpId, key: BlockKey, version: u64 },
    /// Holder -> reader.
    /// `reg`: as in `LocateResp`, when a home grants its own copy in answer
    /// to a locate; `None` otherwise.
    GrantResp { op: OpId, result: GrantResult, reg: Option<Registration> },
    /// Reader -> holder: done reading.
    GrantRelease { slot: SlotRef, grant: u64 },
    /// Reader -> home: I now hold a validated copy (`copy`) of `version`.
    /// With `op` 0, only a confirmation of the registration the home made
    /// at locate time (accepted only while that registration stands).
    AddHolderReq { op: OpId, key: BlockKey, version: u64, copy: u64 },
    /// Home -> reader: registered (`ok`) or refused (version moved on).
    AddHolderResp { op: OpId, key: BlockKey, version: u64, copy: u64, ok: bool },
    /// Holder -> home: I dropped copy `copy` of `version` (eviction, or a
    /// registration I gave up on). Ignored unless that copy is registered,
    /// so a late RemoveHolder never unregisters a newer copy.
    RemoveHolder { key: BlockKey, version: u64, copy: u64 },
    /// Holder -> home after a membership change: the copies I hold whose
    /// home you now are (all of them, possibly none): key, version, copy;
    /// in `parts` messages of one `round` (each (re)send is a new round), of
    /// which this is number `part`. The home counts the holder announced
    /// when it has every part of one round.
    Announce { round: u64, part: u32, parts: u32, entries: Vec<(BlockKey, u64, u64)> },
    /// Home -> holder: announce received.
    AnnounceAck,
    /// Asker -> home: where are these keys Valid? (a cluster-wide lookup:
    /// no pin, no grant, nothing moves).
    LookupReq { op: OpId, keys: Vec<BlockKey> },
    /// Home -> asker: for each key asked, in order, `(version, holder)`
    /// of a registered holder other than the asker, or `(0, 0)` when the
    /// key is held nowhere else, changing, or the directory is not ready.
    LookupResp { op: OpId, found: Vec<(u64, crate::NodeId)> },
}
