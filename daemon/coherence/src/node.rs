//! The per-node state machine: holder, reader, writer and home roles.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::msg::{Batch, GrantResult, LocateResult, Msg, PublishResult, Registration};
use crate::{
    Action, BlockKey, Bug, Config, ErrorKind, Event, Metrics, NodeId, OpId, Outcome, SlotImage, SlotMeta, SlotRef,
    Time, TransferError, View,
};

/// Keepalive send times remembered to check acknowledgements against (a
/// few leases' worth at the configured ratio; an older acknowledgement
/// would grant no lease anyway).
const KEEPALIVES_REMEMBERED: usize = 64;

/// Most parts of one announce round taken from a peer: a round's parts
/// are remembered until it completes. Honest rounds have copies /
/// `announce_entries_max` parts (a pool of 2^32 slots at 1,024 per part).
const ANNOUNCE_PARTS_MAX: u32 = 1 << 22;

/// One grant of `reader` ended.
fn forget_grant(by_reader: &mut BTreeMap<NodeId, u64>, reader: NodeId) {
    if let Some(n) = by_reader.get_mut(&reader) {
        *n -= 1;
        if *n == 0 {
            by_reader.remove(&reader);
        }
    }
}

/// The op id of an `AddHolderReq` that only confirms a registration the
/// home made at locate time (drivers number their operations from 1).
const CONFIRM: OpId = 0;

/// One copy in an announce: key, version, copy id.
type AnnounceEntry = (BlockKey, u64, u64);

/// Buckets of the version floor (see `Node::version_floor`): 512 KiB per
/// node, so a key's version counter in one epoch is shared by 1/65536 of
/// the keys that churn.
const VERSION_BUCKETS: usize = 1 << 16;

fn version_bucket(key: &BlockKey) -> usize {
    let k = key.key;
    let h = (k as u64 ^ (k >> 64) as u64 ^ key.ns).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h >> 48) as usize
}

/// A Valid local copy (40 bytes: one per cached block). Its slot is the
/// copy's for as long as the copy lives.
#[derive(Clone, Copy, Debug)]
struct Copy {
    slot: SlotRef,
    version: u64,
    checksum: u64,
    /// Node-local id under which the home registered this copy.
    id: u64,
}

impl Copy {
    /// What the slot's header and trailer say.
    fn meta(&self, key: BlockKey) -> SlotMeta {
        SlotMeta { key, version: self.version, generation: self.slot.generation, checksum: self.checksum }
    }
}

/// Engine pins and read grants on a local slot. Exists only while there
/// are some: a slot is otherwise kept by whoever references it (a Valid
/// copy, a put in flight, a fetched copy being registered), and freed when
/// its referencer lets go ([`Node::unreference`]).
#[derive(Debug)]
struct SlotHold {
    /// Still referenced by a copy or an operation; when false the slot is
    /// freed as soon as its pins and grants are gone.
    referenced: bool,
    /// Engine pins.
    pins: u32,
    /// Read grants: id -> (deadline (local clock), reader).
    grants: BTreeMap<u64, (Time, NodeId)>,
}

impl SlotHold {
    fn new() -> SlotHold {
        SlotHold { referenced: true, pins: 0, grants: BTreeMap::new() }
    }
}

/// A registered holder of a key at its home: the node, the copy id it
/// registered, and whether the registration is still *pending* — made by
/// the home when it answered the node's locate (`Msg::LocateReq` with a
/// copy id), before the copy exists. A pending holder is invalidated like
/// any other (the reader may make its copy Valid as soon as it validates,
/// without waiting for the home), but it is never named as a source to
/// other readers or to lookups until its `AddHolderReq` confirms it.
#[derive(Clone, Copy, Debug)]
struct Holder {
    id: NodeId,
    pending: bool,
    copy: u64,
}

/// Registered holders of a key at its home, by node id. Usually one or
/// two: one kept inline.
#[derive(Debug, Default)]
struct Holders(SmallVec<[Holder; 1]>);

impl Holders {
    fn single(h: NodeId, copy: u64) -> Holders {
        Holders(smallvec::smallvec![Holder { id: h, pending: false, copy }])
    }
    /// Registers `h` (confirmed, or pending) with copy `copy`, replacing
    /// its earlier registration.
    fn set(&mut self, h: NodeId, copy: u64, pending: bool) {
        let e = Holder { id: h, pending, copy };
        match self.0.binary_search_by_key(&h, |e| e.id) {
            Ok(i) => self.0[i] = e,
            Err(i) => self.0.insert(i, e),
        }
    }
    fn insert(&mut self, h: NodeId, copy: u64) {
        self.set(h, copy, false);
    }
    fn remove(&mut self, h: NodeId) {
        if let Ok(i) = self.0.binary_search_by_key(&h, |e| e.id) {
            self.0.remove(i);
        }
    }
    fn entry(&self, h: NodeId) -> Option<Holder> {
        self.0.binary_search_by_key(&h, |e| e.id).ok().map(|i| self.0[i])
    }
    fn get(&self, h: NodeId) -> Option<u64> {
        self.entry(h).map(|e| e.copy)
    }
    fn contains(&self, h: NodeId) -> bool {
        self.get(h).is_some()
    }
    /// Every registered holder, pending ones included (all must ack a
    /// change).
    fn ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.0.iter().map(|e| e.id)
    }
    /// Holders whose copy is confirmed: the ones a reader may be sent to.
    fn sources(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.0.iter().filter(|e| !e.pending).map(|e| e.id)
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn clear(&mut self) {
        self.0.clear();
    }
}

#[derive(Debug)]
enum GetStage {
    /// Asked `home` at `sent_at`. A home that holds the block itself may
    /// answer with a grant straight away (one round trip less).
    Locating {
        home: NodeId,
        sent_at: Time,
    },
    Granting {
        holder: NodeId,
        version: u64,
        sent_at: Time,
    },
    Reading {
        holder: NodeId,
        version: u64,
        remote: SlotRef,
        expect: SlotMeta,
        grant: u64,
        read_deadline: Time,
    },
    Registering {
        version: u64,
        dest: SlotRef,
        meta: SlotMeta,
        copy: u64,
    },
}

/// A get that asked its home to register it at locate time
/// (`Config::register_at_locate`).
#[derive(Clone, Copy, Debug)]
struct Early {
    /// The copy id sent with the locate (the copy's id if it becomes
    /// Valid).
    copy: u64,
    /// The epoch the locate was sent in: the registration lives in that
    /// epoch's directory only.
    epoch: u64,
    /// The version the home registered this node for (pending), once its
    /// answer (a holder, or its own grant) said so.
    registered: Option<u64>,
}

#[derive(Debug)]
enum OpKind {
    Get {
        key: BlockKey,
        stage: GetStage,
        waiters: Vec<OpId>,
        doomed: bool,
        early: Option<Early>,
    },
    /// Waits for another get of the same key on this node.
    Waiting,
    Put {
        key: BlockKey,
        slot: SlotRef,
        checksum: u64,
        copy: u64,
        last_sent: Time,
    },
    Invalidate {
        key: BlockKey,
        last_sent: Time,
    },
    /// A cluster-wide lookup waiting for the homes in `asked`.
    Lookup {
        keys: Vec<BlockKey>,
        found: Vec<Option<(NodeId, u64)>>,
        /// Homes not answered yet, and the indices of the keys each was
        /// asked about (the question is resent to them until the deadline).
        asked: BTreeMap<NodeId, Vec<u32>>,
        last_sent: Time,
    },
}

#[derive(Debug)]
struct Op {
    deadline: Time,
    kind: OpKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChangeKind {
    Overwrite { writer: NodeId, op: OpId, checksum: u64, copy: u64 },
    Invalidate { requester: NodeId, op: OpId },
}

#[derive(Debug)]
struct Change {
    id: u64,
    kind: ChangeKind,
    old_version: u64,
    /// Holders that have not acked: last time Invalidate was sent.
    waiting: BTreeMap<NodeId, Time>,
    started: Time,
    /// When this change's timer fires (its entry in `Timers::changes`): no
    /// later than the earliest `waiting` send plus the retransmit interval.
    resend_at: Time,
}

/// Directory entry at the key's home.
#[derive(Debug, Default)]
struct DirEntry {
    version: u64,
    /// Registered holders and the copy id each registered.
    holders: Holders,
    /// Boxed: few entries are changing at a time.
    change: Option<Box<Change>>,
}

impl DirEntry {
    fn view(&self) -> DirView {
        DirView { version: self.version, holders: self.holders.ids().collect(), changing: self.change.is_some() }
    }
}

#[derive(Debug, Default)]
struct OutQueue {
    msgs: Vec<Msg>,
    since: Time,
}

/// Every deadline of the core, ordered by time, so that what a tick must
/// do, and when the next one is needed, is found without scanning the
/// state: O(log n) to set, clear or fire a timer, O(work due) per tick,
/// whatever the number of cached blocks, grants, operations or peers.
/// Each entry mirrors one piece of state exactly (it is removed when that
/// state ends); `Node::check_incremental` recomputes them by a full scan.
#[derive(Debug, Default)]
struct Timers {
    /// Client operations: (deadline, op).
    deadlines: BTreeSet<(Time, OpId)>,
    /// Puts and invalidations: (last request sent + retransmit, op).
    resends: BTreeSet<(Time, OpId)>,
    /// Changes at their home: (`Change::resend_at`, key).
    changes: BTreeSet<(Time, BlockKey)>,
    /// Announces not yet acknowledged: (sent + retransmit, member).
    announces: BTreeSet<(Time, NodeId)>,
    /// Read grants: (deadline + drift margin, slot, grant).
    grants: BTreeSet<(Time, SlotRef, u64)>,
    /// Non-empty outgoing queues: (first message queued + flush delay, peer).
    flushes: BTreeSet<(Time, NodeId)>,
}

impl Timers {
    fn first(set: &BTreeSet<(Time, impl Ord)>) -> Time {
        set.first().map_or(Time::MAX, |e| e.0)
    }
}

/// Protocol facts recorded when `Config::trace` is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trace {
    /// This node acked an invalidation of `version` (and older) of `key`.
    Acked {
        /// Block.
        key: BlockKey,
        /// Version.
        version: u64,
    },
    /// This home registered `holder` as holding `version` of `key` (a
    /// completed put, an accepted fetch registration; announces re-register
    /// copies their holder already held and are not traced).
    Registered {
        /// Block.
        key: BlockKey,
        /// Version.
        version: u64,
        /// The node registered.
        holder: NodeId,
    },
    /// This home completed a change of `key` away from `old_version`.
    ChangeCompleted {
        /// Block.
        key: BlockKey,
        /// Version retired.
        old_version: u64,
        /// New version (overwrite) or `None` (invalidation).
        new_version: Option<u64>,
    },
}

/// The holder a locate answer names, if any.
fn result_holder(r: &LocateResult) -> Option<NodeId> {
    match r {
        LocateResult::Found { holder, .. } => Some(*holder),
        _ => None,
    }
}

/// Read-only view of a home's directory entry (for drivers and checkers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirView {
    /// Current version.
    pub version: u64,
    /// Registered holders.
    pub holders: Vec<NodeId>,
    /// An overwrite or invalidation is waiting for acks.
    pub changing: bool,
}

/// Most holders a lookup-table entry names besides the home (what three
/// 64-bit words hold with the version and the flags: [`TableEntry::to_words`]).
pub const TABLE_SOURCES_MAX: usize = 3;

/// The header of a home's lookup table: whose table it is and under which
/// view it was written. Askers believe entries only under a header that
/// matches their own view ([`Node::lookup_tables`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableHeader {
    /// The home.
    pub node: NodeId,
    /// Its incarnation.
    pub incarnation: u64,
    /// The epoch of its view.
    pub epoch: u64,
    /// Its directory is rebuilt for that view.
    pub ready: bool,
}

/// Reads home `h`'s lookup table for a key, one-sided: its header and
/// its entry for the key as read at one moment (`None`: unreadable).
pub type TableRead<'a> = dyn FnMut(NodeId, &BlockKey) -> Option<(TableHeader, Option<TableEntry>)> + 'a;

impl TableEntry {
    /// The entry as three words: the version; the flags (bit 0: the home's
    /// own copy; bits 8-15: how many sources) and the first source in the
    /// high half; the second and third sources.
    pub fn to_words(&self) -> [u64; 3] {
        let s = |i: usize| u64::from(self.sources[i]);
        let flags = u64::from(self.home_copy) | u64::from(self.len) << 8;
        [self.version, flags | s(0) << 32, s(1) | s(2) << 32]
    }

    /// An entry from words a peer wrote (anything at all): `None` where
    /// they could not come from [`TableEntry::to_words`].
    pub fn from_words(w: [u64; 3]) -> Option<TableEntry> {
        let flags = w[1] as u32;
        let len = (flags >> 8) as u8;
        if flags & !0xff01 != 0 || usize::from(len) > TABLE_SOURCES_MAX {
            return None;
        }
        let sources = [(w[1] >> 32) as u32, w[2] as u32, (w[2] >> 32) as u32];
        Some(TableEntry { version: w[0], home_copy: flags & 1 == 1, sources, len })
    }
}

/// Lookup-table changes for the driver ([`Node::take_table_changes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableChanges {
    /// Clear the table before applying `entries` (they are all it holds).
    pub reset: bool,
    /// Keys and their entries now (`None`: remove it).
    pub entries: Vec<(BlockKey, Option<TableEntry>)>,
}

/// A home's lookup-table entry for one key ([`Node::table_entry`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableEntry {
    /// Current version.
    pub version: u64,
    /// The home holds a Valid copy of it.
    pub home_copy: bool,
    /// Other registered (not pending) holders, the first `len`.
    pub sources: [NodeId; TABLE_SOURCES_MAX],
    /// How many of `sources` are set.
    pub len: u8,
}

/// One node's coherence state.
pub struct Node {
    id: NodeId,
    incarnation: u64,
    cfg: Config,
    view: View,
    now: Time,
    lease_until: Option<Time>,
    /// The node left the cluster (`Event::Leave`): it never serves again.
    left: bool,
    last_keepalive: Option<Time>,
    /// Send times of the last keepalives (an acknowledgement must echo one).
    keepalives_sent: VecDeque<Time>,
    /// Valid copies. Hashed (one or two cache misses per lookup at a
    /// million keys, where a B-tree walks six levels).
    copies: FxHashMap<BlockKey, Copy>,
    slots: BTreeMap<SlotRef, SlotHold>,
    next_grant: u64,
    ops: BTreeMap<OpId, Op>,
    fetching: BTreeMap<BlockKey, OpId>,
    /// Gets that ended while their one-sided read was in flight: the
    /// holder and grant to release when the read completes (until then the
    /// holder's slot must stay as granted). At most one per read in flight;
    /// the driver answers every `StartRead` with a `TransferDone`.
    abandoned_reads: BTreeMap<OpId, (NodeId, SlotRef, u64)>,
    writes: BTreeMap<BlockKey, OpId>,
    /// Home: directory entries (hashed, as `copies`).
    dir: FxHashMap<BlockKey, DirEntry>,
    announced: BTreeSet<NodeId>,
    /// Home: announces being received, per holder: its round, its parts,
    /// and the parts received (a newer round starts over).
    announce_rx: BTreeMap<NodeId, (u64, u32, BTreeSet<u32>)>,
    /// Grants outstanding per reader (at most `GRANTS_PER_READER_MAX`).
    grants_by_reader: BTreeMap<NodeId, u64>,
    /// Holder: round number of the last announce sent (any member).
    announce_round: u64,
    ready: bool,
    /// Announces not yet acknowledged: when each was (re)sent, and its
    /// entries (a retransmission resends those still held, without
    /// recomputing every copy's home).
    announce_pending: BTreeMap<NodeId, (Time, Vec<AnnounceEntry>)>,
    out: BTreeMap<NodeId, OutQueue>,
    timers: Timers,
    inbox: VecDeque<(NodeId, Msg)>,
    actions: Vec<Action>,
    metrics: Metrics,
    next_change: u64,
    trace: Vec<Trace>,
    /// Highest version of each key this node has acked an invalidation of
    /// while a put or get of the key was in flight here: a late publish or
    /// registration answer for such a version must not make a copy Valid.
    /// An entry goes when the key's last operation ends.
    retired: BTreeMap<BlockKey, u64>,
    /// Home: publishes completed lately, (writer, op) -> (key, version,
    /// forgotten at), to answer a retransmitted request with its version
    /// (and to unregister a writer that aborted) without a per-key record.
    published: BTreeMap<(NodeId, OpId), (BlockKey, u64, Time)>,
    /// `published` in expiry order (entries of replaced records are
    /// skipped when they come up).
    published_expiry: VecDeque<(Time, NodeId, OpId)>,
    /// Home: per bucket of keys, the highest version a directory entry
    /// had when it was dropped (no holders, no change). A new entry's
    /// first version is above it, so a key's versions grow within an
    /// epoch without keeping an entry per key ever seen.
    version_floor: Vec<u64>,
    next_copy: u64,
    /// Keys whose lookup-table entry may have changed since the driver
    /// last took the changes (`cfg.lookup_table` only; duplicates allowed).
    table_dirty: Vec<BlockKey>,
    /// The whole table must be rewritten (a view change, the directory
    /// rebuilt or cleared): `table_dirty` is not kept meanwhile.
    table_reset: bool,
}

impl Node {
    /// A fresh node (empty pool) of incarnation `incarnation`.
    pub fn new(id: NodeId, incarnation: u64, cfg: Config) -> Node {
        let expected = cfg.expected_copies;
        Node {
            id,
            incarnation,
            cfg,
            view: View::default(),
            now: 0,
            lease_until: None,
            left: false,
            last_keepalive: None,
            keepalives_sent: VecDeque::new(),
            copies: FxHashMap::with_capacity_and_hasher(expected, Default::default()),
            slots: BTreeMap::new(),
            next_grant: 0,
            ops: BTreeMap::new(),
            fetching: BTreeMap::new(),
            abandoned_reads: BTreeMap::new(),
            writes: BTreeMap::new(),
            dir: FxHashMap::with_capacity_and_hasher(expected, Default::default()),
            announced: BTreeSet::new(),
            announce_rx: BTreeMap::new(),
            grants_by_reader: BTreeMap::new(),
            announce_round: 0,
            ready: false,
            announce_pending: BTreeMap::new(),
            out: BTreeMap::new(),
            timers: Timers::default(),
            inbox: VecDeque::new(),
            actions: Vec::new(),
            metrics: Metrics::default(),
            next_change: 0,
            trace: Vec::new(),
            retired: BTreeMap::new(),
            published: BTreeMap::new(),
            published_expiry: VecDeque::new(),
            version_floor: vec![0; VERSION_BUCKETS],
            next_copy: 0,
            table_dirty: Vec::new(),
            table_reset: true,
        }
    }

    /// Protocol facts recorded since the last call (empty unless
    /// `Config::trace`).
    pub fn take_trace(&mut self) -> Vec<Trace> {
        std::mem::take(&mut self.trace)
    }

    /// Whether this node would serve blocks at local time `now`.
    pub fn serving_at(&self, now: Time) -> bool {
        self.lease_until.is_some_and(|u| now < u)
            && self.view.member(self.id).is_some_and(|m| m.incarnation == self.incarnation)
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// This node's incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The view this node acts on.
    pub fn view(&self) -> &View {
        &self.view
    }

    /// Counters.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Whether this node may serve blocks now: it is a member of its view
    /// and its membership lease has not lapsed.
    pub fn serving(&self) -> bool {
        self.lease_until.is_some_and(|u| self.now < u)
            && self.view.member(self.id).is_some_and(|m| m.incarnation == self.incarnation)
    }

    /// Valid local copies: key, version, slot.
    pub fn copies(&self) -> impl Iterator<Item = (BlockKey, u64, SlotRef)> + '_ {
        self.copies.iter().map(|(k, c)| (*k, c.version, c.slot))
    }

    /// This node's Valid copy of `key`, if any: version and slot.
    pub fn copy_of(&self, key: &BlockKey) -> Option<(u64, SlotRef)> {
        self.copies.get(key).map(|c| (c.version, c.slot))
    }

    /// Number of Valid copies.
    pub fn copy_count(&self) -> usize {
        self.copies.len()
    }

    /// Number of directory entries this node keeps as a home (keys held
    /// somewhere or changing).
    pub fn directory_len(&self) -> usize {
        self.dir.len()
    }

    /// The directory entries this node keeps as a home.
    pub fn directory(&self) -> impl Iterator<Item = (BlockKey, DirView)> + '_ {
        self.dir.iter().map(|(k, e)| (*k, e.view()))
    }

    /// The directory entry of `key`, if this node keeps one as a home.
    pub fn directory_entry(&self, key: &BlockKey) -> Option<DirView> {
        self.dir.get(key).map(DirEntry::view)
    }

    /// Whether this node's directory is complete for its epoch (every
    /// member announced its copies); until then, as a home, it answers
    /// busy.
    pub fn directory_ready(&self) -> bool {
        self.ready
    }

    /// Client operations not yet answered.
    pub fn ops_in_flight(&self) -> usize {
        self.ops.len()
    }

    /// Slots the core still holds: backing a copy, a put in flight or a
    /// fetched copy being registered, or no longer referenced but pinned
    /// or granted. O(state): for tests and checkers.
    pub fn slots_held(&self) -> usize {
        let by_ops = self
            .ops
            .values()
            .filter(|o| matches!(o.kind, OpKind::Put { .. } | OpKind::Get { stage: GetStage::Registering { .. }, .. }))
            .count();
        self.copies.len() + by_ops + self.slots.values().filter(|h| !h.referenced).count()
    }

    /// Whether grant `grant` of slot `slot` is still held (not released by
    /// its reader, not expired).
    pub fn grant_outstanding(&self, slot: SlotRef, grant: u64) -> bool {
        self.slots.get(&slot).is_some_and(|h| h.grants.contains_key(&grant))
    }

    /// Whether `slot` is pinned or granted (the slot of a copy, or of one
    /// dropped since that a reader still holds): a slot its driver's store
    /// must not free. A store that evicts on its own asks this first, so
    /// every copy the core keeps has its bytes behind it and every grant
    /// its slot.
    pub fn slot_held(&self, slot: SlotRef) -> bool {
        self.slots.get(&slot).is_some_and(|h| h.pins > 0 || !h.grants.is_empty())
    }

    /// Whether a copy of `key` could be evicted now (no pins, no grants).
    pub fn can_evict(&self, key: &BlockKey) -> bool {
        self.copies.get(key).is_some_and(|c| self.slots.get(&c.slot).is_none_or(|h| h.pins == 0 && h.grants.is_empty()))
    }

    /// Sends everything queued now, whatever the flush windows say: for
    /// drivers that flush when their input runs dry (a burst of received
    /// batches processed, one engine call's keys fed), so a batch holds
    /// what the burst produced without waiting for a timer.
    pub fn flush_now(&mut self, now: Time) -> Vec<Action> {
        self.now = self.now.max(now);
        self.flush(true);
        std::mem::take(&mut self.actions)
    }

    /// When the node next needs a `Tick` (local clock), if ever. O(log n):
    /// the earliest of its ordered timers. A node that left sends no more
    /// keepalives, so its keepalive time (passed, and never advanced again)
    /// is not one: counted, it asked for a `Tick` at once after every step
    /// until the process exited (the daemon's timer task ticked on each
    /// turn of tokio's 1 ms timer wheel through a drain's wait).
    pub fn next_timeout(&self) -> Option<Time> {
        let mut t =
            if self.left { Time::MAX } else { self.last_keepalive.map_or(self.now, |l| l + self.cfg.keepalive_us) };
        if let Some(u) = self.lease_until
            && !self.copies.is_empty()
        {
            t = t.min(u);
        }
        let ts = &self.timers;
        t = t
            .min(Timers::first(&ts.deadlines))
            .min(Timers::first(&ts.resends))
            .min(Timers::first(&ts.changes))
            .min(Timers::first(&ts.announces))
            .min(ts.grants.first().map_or(Time::MAX, |e| e.0))
            .min(Timers::first(&ts.flushes))
            .min(self.published_expiry.front().map_or(Time::MAX, |e| e.0));
        (t != Time::MAX).then(|| t.max(self.now))
    }

    /// Recomputes every incrementally kept structure (the timers, the
    /// outstanding-grant count) by a full scan of the state and compares.
    /// O(state): for tests and the simulator, never on a hot path.
    pub fn check_incremental(&self) -> Result<(), String> {
        fn same<T: Ord + std::fmt::Debug>(what: &str, kept: &BTreeSet<T>, scanned: BTreeSet<T>) -> Result<(), String> {
            if *kept == scanned {
                return Ok(());
            }
            let extra: Vec<_> = kept.difference(&scanned).take(3).collect();
            let missing: Vec<_> = scanned.difference(kept).take(3).collect();
            Err(format!("timers.{what}: kept but not due {extra:?}, due but not kept {missing:?}"))
        }
        let rt = self.cfg.retransmit_us;
        let ts = &self.timers;
        same("deadlines", &ts.deadlines, self.ops.iter().map(|(&id, o)| (o.deadline, id)).collect())?;
        let resends = self
            .ops
            .iter()
            .filter_map(|(&id, o)| match o.kind {
                OpKind::Put { last_sent, .. }
                | OpKind::Invalidate { last_sent, .. }
                | OpKind::Lookup { last_sent, .. } => Some((last_sent + rt, id)),
                _ => None,
            })
            .collect();
        same("resends", &ts.resends, resends)?;
        let mut changes = BTreeSet::new();
        for (k, e) in &self.dir {
            if let Some(c) = &e.change {
                if let Some(&first) = c.waiting.values().min()
                    && c.resend_at > first + rt
                {
                    return Err(format!(
                        "change of {k:?} fires at {} after its first resend {}",
                        c.resend_at,
                        first + rt
                    ));
                }
                changes.insert((c.resend_at, *k));
            }
        }
        same("changes", &ts.changes, changes)?;
        same("announces", &ts.announces, self.announce_pending.iter().map(|(&m, (t, _))| (t + rt, m)).collect())?;
        let mut grants = BTreeSet::new();
        let mut per_reader: BTreeMap<NodeId, u64> = BTreeMap::new();
        for (&slot, h) in &self.slots {
            for (&g, &(d, r)) in &h.grants {
                grants.insert((d + self.cfg.drift_margin_us, slot, g));
                *per_reader.entry(r).or_default() += 1;
            }
        }
        if per_reader != self.grants_by_reader {
            return Err(format!("grants per reader {:?} but {per_reader:?} held", self.grants_by_reader));
        }
        if grants.len() as u64 != self.metrics.grants_outstanding {
            return Err(format!(
                "grants_outstanding {} but {} grants held",
                self.metrics.grants_outstanding,
                grants.len()
            ));
        }
        same("grants", &ts.grants, grants)?;
        let flushes = self
            .out
            .iter()
            .filter(|(_, q)| !q.msgs.is_empty())
            .map(|(&to, q)| (q.since + self.cfg.ack_flush_delay_us_max, to))
            .collect();
        same("flushes", &ts.flushes, flushes)?;
        if let Some((k, _)) = self.dir.iter().find(|(_, e)| e.holders.is_empty() && e.change.is_none()) {
            return Err(format!("directory keeps an entry of {k:?} with no holders and no change"));
        }
        if let Some(k) = self.retired.keys().find(|k| !self.writes.contains_key(k) && !self.fetching.contains_key(k)) {
            return Err(format!("retired version of {k:?} kept with no operation of the key in flight"));
        }
        let queued: BTreeSet<(Time, NodeId, OpId)> = self.published_expiry.iter().copied().collect();
        if let Some((w, _)) = self.published.iter().find(|((w, o), (_, _, t))| !queued.contains(&(*t, *w, *o))) {
            return Err(format!("published record of {w:?} has no expiry queued"));
        }
        Ok(())
    }

    /// Feeds one event at local time `now`; returns the actions to carry out.
    pub fn handle(&mut self, now: Time, ev: Event) -> Vec<Action> {
        self.begin_step(now);
        match ev {
            Event::ClientGet { op, key } => self.client_get(op, key),
            Event::ClientPut { op, key, slot, checksum } => self.client_put(op, key, slot, checksum),
            Event::ClientInvalidate { op, key } => self.client_invalidate(op, key),
            Event::ClientLookup { op, keys } => self.client_lookup(op, keys),
            Event::Unpin { slot } => {
                if let Some(h) = self.slots.get_mut(&slot) {
                    h.pins = h.pins.saturating_sub(1);
                }
                self.maybe_free(slot);
            }
            Event::Evict { key, slot } => {
                if slot.is_none_or(|s| self.copies.get(&key).is_some_and(|c| c.slot == s)) {
                    self.evict(key)
                }
            }
            Event::Receive { from, batch } => self.receive(from, batch),
            Event::TransferDone { op, dest, result } => self.transfer_done(op, dest, result),
            Event::View(v) => self.new_view(v),
            Event::KeepAliveAck { .. } if self.left => {}
            Event::KeepAliveAck { sent_at } if !self.keepalives_sent.contains(&sent_at) => {
                self.metrics.unsolicited_keepalive_acks += 1;
            }
            Event::KeepAliveAck { sent_at } => {
                let lease = self.cfg.membership_lease_us;
                let shrink = (lease.saturating_mul(2).saturating_mul(self.cfg.drift_ppm) / 1_000_000)
                    .saturating_add(self.cfg.drift_margin_us);
                let until = sent_at.saturating_add(lease.saturating_sub(shrink));
                self.lease_until = Some(self.lease_until.map_or(until, |u| u.max(until)));
            }
            Event::Tick => self.tick(),
            Event::Leave => self.leave(),
        }
        self.end_step()
    }

    /// What every step starts with: the time, and a lapsed lease ends
    /// every copy before anything else is done (the membership may have
    /// moved on without this node — a restarted coordinator, a removal —,
    /// so nothing held under the lapsed lease may be served, granted or
    /// re-announced into a later view).
    fn begin_step(&mut self, now: Time) {
        self.now = self.now.max(now);
        if !self.copies.is_empty() && !self.serving() {
            self.metrics.lease_lapses += 1;
            self.metrics.copies_dropped_lapsed += self.copies.len() as u64;
            self.drop_all_copies();
        }
    }

    /// What every step ends with: messages to itself handled, due batches
    /// flushed, the actions handed out.
    fn end_step(&mut self) -> Vec<Action> {
        self.drain_inbox();
        self.flush(false);
        std::mem::take(&mut self.actions)
    }

    // ----- plumbing -----

    fn send(&mut self, to: NodeId, msg: Msg) {
        if to == self.id {
            self.inbox.push_back((to, msg));
            return;
        }
        match msg {
            Msg::InvalidateAck { .. } => self.metrics.acks_sent += 1,
            Msg::Invalidate { .. } => self.metrics.invalidates_sent += 1,
            _ => {}
        }
        let q = self.out.entry(to).or_default();
        if q.msgs.is_empty() {
            q.since = self.now;
            self.timers.flushes.insert((q.since + self.cfg.ack_flush_delay_us_max, to));
        }
        q.msgs.push(msg);
        if q.msgs.len() >= self.cfg.batch_entries_max {
            self.flush_peer(to);
        }
    }

    fn flush_peer(&mut self, to: NodeId) {
        let Some(q) = self.out.get_mut(&to) else { return };
        if q.msgs.is_empty() {
            return;
        }
        let msgs = std::mem::take(&mut q.msgs);
        self.timers.flushes.remove(&(q.since + self.cfg.ack_flush_delay_us_max, to));
        self.metrics.batches_sent += 1;
        self.metrics.msgs_sent += msgs.len() as u64;
        if msgs.iter().any(|m| matches!(m, Msg::InvalidateAck { .. })) {
            self.metrics.ack_batches_sent += 1;
        }
        let batch = Batch { epoch: self.view.epoch, incarnation: self.incarnation, msgs };
        self.actions.push(Action::Send { to, batch });
    }

    fn flush(&mut self, force: bool) {
        let due: Vec<NodeId> =
            self.timers.flushes.iter().take_while(|&&(t, _)| force || t <= self.now).map(|&(_, to)| to).collect();
        for to in due {
            self.flush_peer(to);
        }
    }

    fn drain_inbox(&mut self) {
        if self.left {
            // Nothing is answered once the node left (not even itself).
            self.inbox.clear();
            return;
        }
        while let Some((from, msg)) = self.inbox.pop_front() {
            self.dispatch(from, msg);
        }
    }

    fn done(&mut self, op: OpId, outcome: Outcome) {
        self.actions.push(Action::ClientDone { op, outcome });
    }

    fn resend_time(&self, op: &Op) -> Option<Time> {
        match op.kind {
            OpKind::Put { last_sent, .. } | OpKind::Invalidate { last_sent, .. } | OpKind::Lookup { last_sent, .. } => {
                Some(last_sent + self.cfg.retransmit_us)
            }
            _ => None,
        }
    }

    /// Starts tracking a client operation (and its timers).
    fn insert_op(&mut self, id: OpId, op: Op) {
        self.timers.deadlines.insert((op.deadline, id));
        if let Some(t) = self.resend_time(&op) {
            self.timers.resends.insert((t, id));
        }
        if let Some(old) = self.ops.insert(id, op) {
            // Op ids are unique per node; a driver reusing one loses the
            // old op's answer but never leaves a timer behind.
            self.timers.deadlines.remove(&(old.deadline, id));
            if let Some(t) = self.resend_time(&old) {
                self.timers.resends.remove(&(t, id));
            }
        }
    }

    /// Stops tracking a client operation (and its timers).
    fn remove_op(&mut self, id: OpId) -> Option<Op> {
        let op = self.ops.remove(&id)?;
        self.timers.deadlines.remove(&(op.deadline, id));
        if let Some(t) = self.resend_time(&op) {
            self.timers.resends.remove(&(t, id));
        }
        Some(op)
    }

    fn is_home(&self, key: &BlockKey) -> bool {
        self.view.home_of(key) == Some(self.id)
    }

    /// Pins a slot that backs a Valid copy.
    fn pin(&mut self, slot: SlotRef) {
        self.slots.entry(slot).or_insert_with(SlotHold::new).pins += 1;
    }

    /// Drops a slot's hold once its pins and grants are gone, freeing the
    /// slot if nothing references it any more.
    fn maybe_free(&mut self, slot: SlotRef) {
        let Some(h) = self.slots.get(&slot) else { return };
        let grants_ok = h.grants.is_empty() || (!h.referenced && self.cfg.bug == Some(Bug::ReuseGrantedSlot));
        if h.pins == 0 && grants_ok {
            let h = self.slots.remove(&slot).expect("present");
            self.metrics.grants_outstanding -= h.grants.len() as u64;
            for (g, (d, r)) in h.grants {
                forget_grant(&mut self.grants_by_reader, r);
                self.timers.grants.remove(&(d + self.cfg.drift_margin_us, slot, g));
            }
            if !h.referenced {
                self.actions.push(Action::FreeSlot { slot });
            }
        }
    }

    /// The copy or operation that referenced `slot` lets go of it: freed
    /// now, or when its last pin or grant goes.
    fn unreference(&mut self, slot: SlotRef) {
        match self.slots.get_mut(&slot) {
            Some(h) => {
                h.referenced = false;
                self.maybe_free(slot);
            }
            None => self.actions.push(Action::FreeSlot { slot }),
        }
    }

    /// Drops a Valid copy (it stays readable by existing pins and grants
    /// until they drain).
    fn drop_copy(&mut self, key: &BlockKey) -> Option<Copy> {
        let c = self.copies.remove(key)?;
        if self.cfg.bug != Some(Bug::TableMissesDroppedCopy) {
            self.touch(*key);
        }
        self.unreference(c.slot);
        Some(c)
    }

    fn drop_all_copies(&mut self) {
        let keys: Vec<BlockKey> = self.copies.keys().copied().collect();
        for k in keys {
            self.drop_copy(&k);
        }
        for op in self.ops.values_mut() {
            if let OpKind::Get { doomed, .. } = &mut op.kind {
                *doomed = true;
            }
        }
    }

    // ----- client calls -----

    fn admit(&mut self, op: OpId) -> bool {
        if self.ops.len() >= self.cfg.ops_max {
            self.done(op, Outcome::Error(ErrorKind::Overloaded));
            return false;
        }
        if !self.serving() {
            self.done(op, Outcome::Error(ErrorKind::NotMember));
            return false;
        }
        true
    }

    fn client_get(&mut self, op: OpId, key: BlockKey) {
        if !self.admit(op) {
            return;
        }
        if let Some(c) = self.copies.get(&key).copied() {
            self.pin(c.slot);
            self.done(op, Outcome::Hit { version: c.version, slot: c.slot });
            return;
        }
        let deadline = self.now + self.cfg.op_timeout_us;
        if let Some(&leader) = self.fetching.get(&key)
            && let Some(Op { kind: OpKind::Get { waiters, .. }, .. }) = self.ops.get_mut(&leader)
        {
            waiters.push(op);
            self.insert_op(op, Op { deadline, kind: OpKind::Waiting });
            return;
        }
        let Some(home) = self.view.home_of(&key) else {
            self.done(op, Outcome::Miss);
            return;
        };
        // Registered at the home when it answers (pending), the copy can
        // become Valid as soon as it validates: one round trip less.
        let early = self.cfg.register_at_locate.then(|| {
            self.next_copy += 1;
            Early { copy: self.next_copy, epoch: self.view.epoch, registered: None }
        });
        self.insert_op(
            op,
            Op {
                deadline,
                kind: OpKind::Get {
                    key,
                    stage: GetStage::Locating { home, sent_at: self.now },
                    waiters: Vec::new(),
                    doomed: false,
                    early,
                },
            },
        );
        self.fetching.insert(key, op);
        self.send(home, Msg::LocateReq { op, key, copy: early.map_or(0, |e| e.copy) });
    }

    fn client_put(&mut self, op: OpId, key: BlockKey, slot: SlotRef, checksum: u64) {
        let refuse = |me: &mut Self, why| {
            me.actions.push(Action::FreeSlot { slot });
            me.done(op, Outcome::Error(why));
        };
        if self.ops.len() >= self.cfg.ops_max {
            return refuse(self, ErrorKind::Overloaded);
        }
        if !self.serving() {
            return refuse(self, ErrorKind::NotMember);
        }
        if self.writes.contains_key(&key) {
            return refuse(self, ErrorKind::Busy);
        }
        let Some(home) = self.view.home_of(&key) else { return refuse(self, ErrorKind::NotMember) };
        let deadline = self.now + self.cfg.op_timeout_us;
        self.next_copy += 1;
        let copy = self.next_copy;
        self.insert_op(op, Op { deadline, kind: OpKind::Put { key, slot, checksum, copy, last_sent: self.now } });
        self.writes.insert(key, op);
        self.send(home, Msg::PublishReq { op, key, checksum, copy });
    }

    fn client_invalidate(&mut self, op: OpId, key: BlockKey) {
        if !self.admit(op) {
            return;
        }
        let Some(home) = self.view.home_of(&key) else {
            self.done(op, Outcome::Error(ErrorKind::NotMember));
            return;
        };
        let deadline = self.now + self.cfg.op_timeout_us;
        self.insert_op(op, Op { deadline, kind: OpKind::Invalidate { key, last_sent: self.now } });
        self.send(home, Msg::InvalidateReq { op, key });
    }

    fn client_lookup(&mut self, op: OpId, keys: Vec<BlockKey>) {
        if !self.admit(op) {
            return;
        }
        self.metrics.lookups += 1;
        let mut found = vec![None; keys.len()];
        let mut asked: BTreeMap<NodeId, Vec<u32>> = BTreeMap::new();
        for (i, k) in keys.iter().enumerate() {
            match self.lookup_here(k) {
                Ok(f) => found[i] = f,
                Err(h) => asked.entry(h).or_default().push(i as u32),
            }
        }
        if asked.is_empty() {
            self.actions.push(Action::LookupDone { op, found, complete: true });
            return;
        }
        for (&h, idx) in &asked {
            let question = idx.iter().map(|&i| keys[i as usize]).collect();
            self.send(h, Msg::LookupReq { op, keys: question });
            // An engine call waits for it: no flush delay.
            self.flush_peer(h);
        }
        let deadline = self.now + self.cfg.op_timeout_us;
        self.insert_op(op, Op { deadline, kind: OpKind::Lookup { keys, found, asked, last_sent: self.now } });
    }

    /// How a lookup started here answers `k` without another node: a copy
    /// this node holds, or its own directory where it is the home (`Ok`,
    /// `None` where no home is known); `Err(h)`: home `h` must say.
    fn lookup_here(&self, k: &BlockKey) -> Result<Option<(NodeId, u64)>, NodeId> {
        let me = self.id;
        if let Some(c) = self.copies.get(k) {
            return Ok(Some((me, c.version)));
        }
        if self.cfg.bug == Some(Bug::LookupCountsPendingPut) && self.writes.contains_key(k) {
            return Ok(Some((me, 0)));
        }
        match self.view.home_of(k) {
            Some(h) if h == me => Ok(self.lookup_at_home(me, k)),
            Some(h) => Err(h),
            None => Ok(None),
        }
    }

    /// A home's answer to a lookup of `key` by `asker`: a copy it holds
    /// itself (checked against its own state, so exact now), else a
    /// registered holder other than the asker (the asker has no copy; a
    /// registration of it is stale). Nothing while the key changes, the
    /// directory rebuilds or this node may not serve.
    fn lookup_at_home(&self, asker: NodeId, key: &BlockKey) -> Option<(NodeId, u64)> {
        if !self.ready || !self.is_home(key) || !self.serving() {
            return None;
        }
        let e = self.dir.get(key)?;
        if e.change.is_some() {
            return None;
        }
        if e.holders.contains(self.id) && self.copies.get(key).is_some_and(|c| c.version == e.version) {
            return Some((self.id, e.version));
        }
        e.holders.sources().find(|&h| h != asker && h != self.id).map(|h| (h, e.version))
    }

    /// The lookup-table changes since the last call (`cfg.lookup_table`;
    /// otherwise always empty): each key whose entry may have changed with
    /// its entry now, or — `reset` — every entry the table holds now (the
    /// driver clears its table first). The driver applies them under the
    /// same lock as the step that made them, so a table read between steps
    /// is the directory of that moment; the header is
    /// [`Node::table_header`], written beside them.
    pub fn take_table_changes(&mut self) -> TableChanges {
        if !self.cfg.lookup_table {
            return TableChanges { reset: false, entries: Vec::new() };
        }
        if std::mem::take(&mut self.table_reset) {
            self.table_dirty.clear();
            let entries = self.dir.keys().filter_map(|k| self.table_entry(k).map(|e| (*k, Some(e)))).collect();
            return TableChanges { reset: true, entries };
        }
        let mut keys = std::mem::take(&mut self.table_dirty);
        keys.sort_unstable();
        keys.dedup();
        let entries = keys.into_iter().map(|k| (k, self.table_entry(&k))).collect();
        TableChanges { reset: false, entries }
    }

    /// `key`'s lookup-table entry may have changed.
    fn touch(&mut self, key: BlockKey) {
        if self.cfg.lookup_table && !self.table_reset {
            self.table_dirty.push(key);
        }
    }

    /// Every lookup-table entry may have changed.
    fn table_reset(&mut self) {
        self.table_reset = true;
        self.table_dirty = Vec::new();
    }

    /// What this node's lookup table says now (see [`TableHeader`]).
    pub fn table_header(&self) -> TableHeader {
        // A node that left keeps no directory: its table answers nothing
        // (not "absent"), whatever view its readers are still in.
        let ready = self.ready && !self.left;
        TableHeader { node: self.id, incarnation: self.incarnation, epoch: self.view.epoch, ready }
    }

    /// What this node's lookup table holds for `key` now: the directory's
    /// answer to a lookup ([`Node::lookup_at_home`] without the asker and
    /// without this node's lease check, which askers make on their side).
    /// `None`: nothing to report (not its home, directory not rebuilt, no
    /// entry, a change waiting for acks, or no Valid source).
    pub fn table_entry(&self, key: &BlockKey) -> Option<TableEntry> {
        if !self.ready || !self.is_home(key) {
            return None;
        }
        let e = self.dir.get(key)?;
        if e.change.is_some() {
            return None;
        }
        let home_copy = e.holders.contains(self.id) && self.copies.get(key).is_some_and(|c| c.version == e.version);
        let mut sources = [0; TABLE_SOURCES_MAX];
        let mut len = 0;
        for h in e.holders.sources().filter(|&h| h != self.id).take(TABLE_SOURCES_MAX) {
            sources[len] = h;
            len += 1;
        }
        (home_copy || len > 0).then_some(TableEntry { version: e.version, home_copy, sources, len: len as u8 })
    }

    /// A cluster-wide lookup answered from the homes' lookup tables, read
    /// one-sided by `read` (the header of home `h`'s table and its entry
    /// for the key, as read at one moment during this call; `None`: the
    /// table cannot be read), instead of a `LookupReq` to each home. The
    /// answer is `Action::LookupDone` (or `ClientDone` with an error), as
    /// for `Event::ClientLookup`. A table is believed only where its
    /// header names the home this node's view has for the key, of the
    /// incarnation in that view, with the same epoch and a rebuilt
    /// directory; keys of any other are not answered (`complete: false`).
    /// The home's lease is not checked by the home: this node must be
    /// serving, which under M1 means no later view serves anywhere yet
    /// (docs/COHERENCE.md, "Lookups read one-sided").
    pub fn lookup_tables(&mut self, now: Time, op: OpId, keys: Vec<BlockKey>, read: &mut TableRead<'_>) -> Vec<Action> {
        self.begin_step(now);
        if self.admit(op) {
            let me = self.id;
            let epoch = self.view.epoch;
            let mut found = vec![None; keys.len()];
            let mut complete = true;
            let mut refused = 0;
            for (i, k) in keys.iter().enumerate() {
                let h = match self.lookup_here(k) {
                    Ok(f) => {
                        found[i] = f;
                        continue;
                    }
                    Err(h) => h,
                };
                let inc = self.view.member(h).map(|m| m.incarnation);
                let entry = match read(h, k) {
                    Some((hd, entry))
                        if hd.node == h && Some(hd.incarnation) == inc && hd.epoch == epoch && hd.ready =>
                    {
                        entry
                    }
                    _ => {
                        complete = false;
                        continue;
                    }
                };
                let Some(e) = entry else { continue };
                let holder = if e.home_copy {
                    Some(h)
                } else {
                    e.sources[..usize::from(e.len).min(TABLE_SOURCES_MAX)].iter().copied().find(|&s| s != me && s != h)
                };
                let Some(holder) = holder else { continue };
                if e.version == 0 || !plausible_holder(&self.view, me, holder, e.version) {
                    refused += 1;
                    continue;
                }
                found[i] = Some((holder, e.version));
            }
            self.metrics.peer_refusals += refused;
            // An incomplete answer is the driver's to complete (it asks the
            // homes: a lookup of its own, counted there).
            if complete {
                self.metrics.lookups += 1;
                self.metrics.lookups_one_sided += 1;
            } else {
                self.metrics.lookup_table_fallbacks += 1;
            }
            self.actions.push(Action::LookupDone { op, found, complete });
        }
        self.end_step()
    }

    fn on_lookup_resp(&mut self, from: NodeId, op: OpId, answers: Vec<(u64, NodeId)>) {
        let me = self.id;
        let Some(Op { kind: OpKind::Lookup { found, asked, .. }, .. }) = self.ops.get_mut(&op) else { return };
        // Only the home asked answers, once, about exactly what it was asked.
        let Some(idx) = asked.get(&from) else { return };
        if idx.len() != answers.len() {
            self.metrics.peer_refusals += 1;
            return;
        }
        let mut refused = 0;
        for (&i, &(version, holder)) in idx.iter().zip(&answers) {
            if version == 0 {
                continue;
            }
            if !plausible_holder(&self.view, me, holder, version) {
                refused += 1;
                continue;
            }
            found[i as usize] = Some((holder, version));
        }
        asked.remove(&from);
        let finished = asked.is_empty();
        self.metrics.peer_refusals += refused;
        if finished {
            self.finish_lookup(op);
        }
    }

    /// Ends a lookup with what it has (keys of homes that did not answer
    /// are absent).
    fn finish_lookup(&mut self, op: OpId) {
        let Some(Op { kind: OpKind::Lookup { found, asked, .. }, .. }) = self.remove_op(op) else { return };
        let complete = asked.is_empty();
        if !complete {
            self.metrics.lookups_incomplete += 1;
        }
        self.actions.push(Action::LookupDone { op, found, complete });
    }

    fn evict(&mut self, key: BlockKey) {
        if !self.can_evict(&key) {
            return;
        }
        if let Some(c) = self.drop_copy(&key)
            && let Some(home) = self.view.home_of(&key)
        {
            self.send(home, Msg::RemoveHolder { key, version: c.version, copy: c.id });
        }
    }

    /// Ends a get (and the gets waiting on it).
    fn finish_get(&mut self, op: OpId, outcome: Outcome) {
        let Some(o) = self.remove_op(op) else { return };
        let OpKind::Get { key, waiters, early, .. } = o.kind else { unreachable!("finish_get on a non-get") };
        // The home registered us at locate time and the get ends without
        // that copy becoming Valid: take it back (a lost `RemoveHolder`
        // leaves a registration of a copy we do not hold: we ack its
        // invalidations, and our next registration replaces it).
        if let Some(Early { copy, epoch, registered: Some(version) }) = early
            && epoch == self.view.epoch
            && let Some(home) = self.view.home_of(&key)
        {
            self.take_back(home, Registration { key, version, copy });
        }
        if self.fetching.get(&key) == Some(&op) {
            self.fetching.remove(&key);
            self.key_ops_done(&key);
        }
        self.done(op, outcome);
        for w in waiters {
            if self.remove_op(w).is_some() {
                if let Outcome::Hit { slot, .. } = outcome {
                    self.pin(slot);
                }
                self.done(w, outcome);
            }
        }
    }

    /// The locate-time registration of get `op`, if it asked for one.
    fn early_mut(&mut self, op: OpId) -> Option<&mut Early> {
        match self.ops.get_mut(&op) {
            Some(Op { kind: OpKind::Get { early, .. }, .. }) => early.as_mut(),
            _ => None,
        }
    }

    fn get_stage(&mut self, op: OpId) -> Option<(&mut GetStage, BlockKey, bool)> {
        match self.ops.get_mut(&op) {
            Some(Op { kind: OpKind::Get { stage, key, doomed, .. }, .. }) => Some((stage, *key, *doomed)),
            _ => None,
        }
    }

    fn transfer_done(&mut self, op: OpId, dest: Option<SlotRef>, result: Result<SlotImage, TransferError>) {
        let free_dest = |me: &mut Self| {
            if let Some(d) = dest {
                me.actions.push(Action::FreeSlot { slot: d });
            }
        };
        let Some((stage, key, doomed)) = self.get_stage(op) else {
            // The get ended meanwhile: release the holder's grant now that
            // the read is over (not before: the holder must not reuse the
            // slot under a read in flight), instead of leaving its slot
            // held until the grant lease runs out.
            if let Some((holder, slot, grant)) = self.abandoned_reads.remove(&op) {
                self.send(holder, Msg::GrantRelease { slot, grant });
            }
            return free_dest(self);
        };
        let GetStage::Reading { holder, version, remote, expect, grant, read_deadline } = *stage else {
            return free_dest(self);
        };
        self.send(holder, Msg::GrantRelease { slot: remote, grant });
        let image = match result {
            Ok(image) => image,
            Err(_) => {
                free_dest(self);
                return self.finish_get(op, Outcome::Miss);
            }
        };
        let Some(dest) = dest else { return self.finish_get(op, Outcome::Miss) };
        if self.now > read_deadline {
            // The holder may have reused the slot during the read.
            self.metrics.late_transfers += 1;
            free_dest(self);
            return self.finish_get(op, Outcome::Miss);
        }
        if self.cfg.bug != Some(Bug::SkipValidation) && !image.matches(&expect) {
            self.metrics.validation_failures += 1;
            free_dest(self);
            return self.finish_get(op, Outcome::Miss);
        }
        if doomed {
            free_dest(self);
            return self.finish_get(op, Outcome::Miss);
        }
        let meta = SlotMeta { generation: dest.generation, ..expect };
        // Registered (pending) at the home in this epoch when it answered
        // the locate: the home sends every change of the key to us from
        // then on and waits for our ack, and none has reached us (the get
        // is not doomed, the version not retired), so the copy is Valid
        // now. The home is told it exists (it then names us as a source);
        // its answer is not waited for. After a view change that
        // registration is gone with the old directory: register as before.
        let epoch = self.view.epoch;
        if let Some(Early { copy, epoch: e, registered: Some(v) }) = self.early_mut(op).copied()
            && v == version
            && (e == epoch || self.cfg.bug == Some(Bug::EarlyValidAcrossEpochs))
            && let Some(home) = self.view.home_of(&key)
        {
            let retired = self.retired.get(&key).is_some_and(|&r| version <= r);
            if retired || !self.serving() || self.copies.contains_key(&key) {
                // As a refused registration: the copy never becomes Valid
                // (`finish_get` takes the registration back).
                self.unreference(dest);
                return self.finish_get(op, Outcome::Miss);
            }
            self.metrics.early_registrations += 1;
            self.copies.insert(key, Copy { slot: dest, version, checksum: meta.checksum, id: copy });
            self.touch(key);
            self.pin(dest);
            self.send(home, Msg::AddHolderReq { op: CONFIRM, key, version, copy });
            return self.finish_get(op, Outcome::Hit { version, slot: dest });
        }
        // (A registration in an earlier epoch's directory went with it:
        // register as before; `finish_get` takes back only this epoch's.)
        self.next_copy += 1;
        let copy = self.next_copy;
        if let Some((stage, _, _)) = self.get_stage(op) {
            *stage = GetStage::Registering { version, dest, meta, copy };
        }
        match self.view.home_of(&key) {
            Some(home) => self.send(home, Msg::AddHolderReq { op, key, version, copy }),
            None => {
                self.unreference(dest);
                self.finish_get(op, Outcome::Miss);
            }
        }
    }

    // ----- timers -----

    fn tick(&mut self) {
        let now = self.now;
        if !self.left && self.last_keepalive.is_none_or(|l| now >= l + self.cfg.keepalive_us) {
            self.last_keepalive = Some(now);
            if self.keepalives_sent.len() >= KEEPALIVES_REMEMBERED {
                self.keepalives_sent.pop_front();
            }
            self.keepalives_sent.push_back(now);
            self.actions.push(Action::KeepAlive { sent_at: now });
        }
        if !self.serving() && !self.copies.is_empty() {
            self.drop_all_copies();
        }
        // Client deadlines and retransmissions.
        while let Some(&(t, id)) = self.timers.deadlines.first()
            && t <= now
        {
            self.expire_op(id);
            // expire_op removed the op and its timers; never loop on one.
            self.timers.deadlines.remove(&(t, id));
        }
        while let Some(&(t, id)) = self.timers.resends.first()
            && t <= now
        {
            self.timers.resends.remove(&(t, id));
            let Some(o) = self.ops.get_mut(&id) else { continue };
            if let OpKind::Lookup { keys, asked, last_sent, .. } = &mut o.kind {
                *last_sent = now;
                let questions: Vec<(NodeId, Msg)> = asked
                    .iter()
                    .map(|(&h, idx)| {
                        (h, Msg::LookupReq { op: id, keys: idx.iter().map(|&i| keys[i as usize]).collect() })
                    })
                    .collect();
                self.timers.resends.insert((now + self.cfg.retransmit_us, id));
                for (h, m) in questions {
                    self.send(h, m);
                    self.flush_peer(h);
                }
                continue;
            }
            let m = match &mut o.kind {
                OpKind::Put { key, checksum, copy, last_sent, .. } => {
                    *last_sent = now;
                    (*key, Msg::PublishReq { op: id, key: *key, checksum: *checksum, copy: *copy })
                }
                OpKind::Invalidate { key, last_sent } => {
                    *last_sent = now;
                    (*key, Msg::InvalidateReq { op: id, key: *key })
                }
                _ => continue,
            };
            self.timers.resends.insert((now + self.cfg.retransmit_us, id));
            if let Some(home) = self.view.home_of(&m.0) {
                self.send(home, m.1);
            }
        }
        // Home: resend invalidations; holders that left the view count as acked.
        while let Some(&(t, key)) = self.timers.changes.first()
            && t <= now
        {
            self.timers.changes.remove(&(t, key));
            self.change_timer(key);
        }
        // Announces not yet acknowledged.
        while let Some(&(t, m)) = self.timers.announces.first()
            && t <= now
        {
            self.timers.announces.remove(&(t, m));
            self.resend_announce(m);
        }
        // Publish records past their time.
        while let Some(&(t, w, op)) = self.published_expiry.front()
            && t <= now
        {
            self.published_expiry.pop_front();
            if self.published.get(&(w, op)).is_some_and(|r| r.2 == t) {
                self.published.remove(&(w, op));
            }
        }
        // Grants past their lease (plus the drift margin).
        while let Some(&(t, slot, g)) = self.timers.grants.first()
            && t <= now
        {
            self.timers.grants.remove(&(t, slot, g));
            if let Some(h) = self.slots.get_mut(&slot)
                && let Some((_, r)) = h.grants.remove(&g)
            {
                forget_grant(&mut self.grants_by_reader, r);
                self.metrics.grants_outstanding -= 1;
                self.maybe_free(slot);
            }
        }
    }

    /// Leaves the cluster for good (`Event::Leave`): fails every operation
    /// in flight, drops every copy and tells its home (so no change waits
    /// for this node's ack until a view leaves it out), gives up the lease
    /// and sends everything queued now.
    fn leave(&mut self) {
        if self.left {
            return;
        }
        let ops: Vec<OpId> = self.ops.keys().copied().collect();
        for id in ops {
            self.expire_op(id);
        }
        let keys: Vec<BlockKey> = self.copies.keys().copied().collect();
        for key in keys {
            if let Some(c) = self.drop_copy(&key)
                && let Some(home) = self.view.home_of(&key)
                && home != self.id
            {
                self.send(home, Msg::RemoveHolder { key, version: c.version, copy: c.id });
            }
        }
        self.left = true;
        self.lease_until = None;
        self.dir.clear();
        self.table_reset();
        self.timers.changes.clear();
        self.timers.announces.clear();
        self.announce_pending.clear();
        self.flush(true);
    }

    /// Whether this node left the cluster (`Event::Leave`).
    pub fn has_left(&self) -> bool {
        self.left
    }

    /// A change's retransmission timer fired (its entry already removed):
    /// resends the invalidation to holders that have not acked for a
    /// retransmit interval, and sets the timer again.
    fn change_timer(&mut self, key: BlockKey) {
        let now = self.now;
        let rt = self.cfg.retransmit_us;
        self.touch(key);
        let Some(e) = self.dir.get_mut(&key) else { return };
        let Some(c) = &mut e.change else { return };
        let gone: Vec<NodeId> = c.waiting.keys().copied().filter(|h| self.view.member(*h).is_none()).collect();
        for h in gone {
            c.waiting.remove(&h);
            e.holders.remove(h);
        }
        let mut to_send = Vec::new();
        for (h, sent) in c.waiting.iter_mut() {
            if now >= *sent + rt {
                *sent = now;
                to_send.push(*h);
            }
        }
        let (version, change) = (c.old_version, c.id);
        if c.waiting.is_empty() {
            self.complete_change(key); // its timer entry is already gone
        } else {
            c.resend_at = c.waiting.values().min().expect("non-empty") + rt;
            self.timers.changes.insert((c.resend_at, key));
        }
        for h in to_send {
            self.send(h, Msg::Invalidate { key, version, change });
        }
    }

    fn expire_op(&mut self, id: OpId) {
        let Some(o) = self.ops.get(&id) else { return };
        match &o.kind {
            OpKind::Get { stage, .. } => {
                match *stage {
                    // The read still runs: TransferDone will free the slot
                    // and release the grant (bounded: past `ops_max` the
                    // grant lease frees the holder's slot).
                    GetStage::Reading { holder, remote, grant, .. }
                        if self.abandoned_reads.len() < self.cfg.ops_max =>
                    {
                        self.abandoned_reads.insert(id, (holder, remote, grant));
                    }
                    GetStage::Registering { dest, .. } => self.unreference(dest),
                    _ => {}
                }
                self.finish_get(id, Outcome::Miss);
            }
            OpKind::Waiting => {
                self.remove_op(id);
                self.done(id, Outcome::Miss);
            }
            &OpKind::Put { key, slot, .. } => {
                self.remove_op(id);
                self.writes.remove(&key);
                self.key_ops_done(&key);
                if let Some(home) = self.view.home_of(&key) {
                    self.send(home, Msg::PublishAbort { op: id, key });
                }
                self.unreference(slot);
                self.done(id, Outcome::Error(ErrorKind::Timeout));
            }
            OpKind::Invalidate { .. } => {
                self.remove_op(id);
                self.done(id, Outcome::Error(ErrorKind::Timeout));
            }
            OpKind::Lookup { .. } => self.finish_lookup(id),
        }
    }

    // ----- membership -----

    fn new_view(&mut self, v: View) {
        if v.epoch <= self.view.epoch || self.left {
            return;
        }
        if v.epoch > crate::EPOCH_MAX {
            self.metrics.peer_refusals += 1;
            return;
        }
        self.view = v;
        // Lookups end with what they have: the homes they asked are gone
        // or rebuilding (a new-epoch home answers nothing until it is
        // ready), and a caller wants an answer now, not at the deadline.
        let lookups: Vec<OpId> =
            self.ops.iter().filter(|(_, o)| matches!(o.kind, OpKind::Lookup { .. })).map(|(&id, _)| id).collect();
        for id in lookups {
            self.finish_lookup(id);
        }
        // Queued messages were meant for the old epoch: drop them; whatever
        // matters is retransmitted.
        self.out.clear();
        self.timers.flushes.clear();
        // Directories are rebuilt from scratch in every epoch; a change in
        // progress is dropped (its writer or requester retries with the new
        // home until its deadline).
        self.dir.clear();
        self.table_reset();
        self.timers.changes.clear();
        self.retired.clear();
        self.published.clear();
        self.published_expiry.clear();
        self.announced.clear();
        self.announce_rx.clear();
        self.ready = false;
        self.announce_pending.clear();
        self.timers.announces.clear();
        if self.view.member(self.id).is_none_or(|m| m.incarnation != self.incarnation) {
            self.drop_all_copies();
            return;
        }
        // One pass over the copies (each key's home computed once).
        let mut entries: BTreeMap<NodeId, Vec<AnnounceEntry>> =
            self.view.members.iter().map(|m| (m.id, Vec::new())).collect();
        for (k, c) in &self.copies {
            if let Some(home) = self.view.home_of(k) {
                entries.entry(home).or_default().push((*k, c.version, c.id));
            }
        }
        for (m, e) in entries {
            self.send_announce(m, e);
        }
    }

    fn send_announce(&mut self, to: NodeId, entries: Vec<AnnounceEntry>) {
        let sent = self.now;
        self.announce_round += 1;
        let round = self.announce_round;
        let per = self.cfg.announce_entries_max.max(1);
        let parts = entries.len().div_ceil(per).max(1) as u32;
        for part in 0..parts {
            let lo = part as usize * per;
            let chunk = entries[lo.min(entries.len())..(lo + per).min(entries.len())].to_vec();
            self.send(to, Msg::Announce { round, part, parts, entries: chunk });
            // Each part in a batch of its own (bounded message size).
            self.flush_peer(to);
        }
        if let Some((old, _)) = self.announce_pending.insert(to, (sent, entries)) {
            self.timers.announces.remove(&(old + self.cfg.retransmit_us, to));
        }
        self.timers.announces.insert((sent + self.cfg.retransmit_us, to));
    }

    /// An announce was not acknowledged in time: resend the entries still
    /// held (a copy dropped since is left out; copies made since were
    /// registered with their home by the protocol itself).
    fn resend_announce(&mut self, to: NodeId) {
        let Some((_, entries)) = self.announce_pending.remove(&to) else { return };
        let entries: Vec<_> = entries
            .into_iter()
            .filter(|(k, v, id)| self.copies.get(k).is_some_and(|c| c.version == *v && c.id == *id))
            .collect();
        self.send_announce(to, entries);
    }

    // ----- messages -----

    fn receive(&mut self, from: NodeId, batch: Batch) {
        let known = self.view.member(from).is_some_and(|m| m.incarnation == batch.incarnation);
        if self.left || batch.epoch != self.view.epoch || !known || self.view.member(self.id).is_none() {
            self.metrics.stale_epoch_drops += 1;
            return;
        }
        for m in batch.msgs {
            self.dispatch(from, m);
        }
    }

    fn dispatch(&mut self, from: NodeId, msg: Msg) {
        match msg {
            Msg::PublishReq { op, key, checksum, copy } => self.on_publish_req(from, op, key, checksum, copy),
            Msg::PublishResp { op, key, result, copy } => self.on_publish_resp(from, op, key, result, copy),
            Msg::PublishAbort { op, key } => self.on_publish_abort(from, op, key),
            Msg::Invalidate { key, version, change } => self.on_invalidate(from, key, version, change),
            Msg::InvalidateAck { key, version, change } => self.on_ack(from, key, version, change),
            Msg::InvalidateReq { op, key } => self.on_invalidate_req(from, op, key),
            Msg::InvalidateResp { op, key: _, ok } => {
                // A busy answer is retransmitted until the deadline.
                if let Some(Op { kind: OpKind::Invalidate { .. }, .. }) = self.ops.get(&op)
                    && ok
                {
                    self.remove_op(op);
                    self.done(op, Outcome::Invalidated);
                }
            }
            Msg::LocateReq { op, key, copy } => self.on_locate_req(from, op, key, copy),
            Msg::LocateResp { op, key, result, reg } => self.on_locate_resp(from, op, key, result, reg),
            Msg::GrantReq { op, key, version } => self.on_grant_req(from, op, key, version),
            Msg::GrantResp { op, result, reg } => self.on_grant_resp(from, op, result, reg),
            Msg::GrantRelease { slot, grant } => {
                // Only the reader a grant went to releases it.
                if let Some(h) = self.slots.get_mut(&slot)
                    && h.grants.get(&grant).is_some_and(|&(_, r)| r == from)
                    && let Some((d, r)) = h.grants.remove(&grant)
                {
                    forget_grant(&mut self.grants_by_reader, r);
                    self.timers.grants.remove(&(d + self.cfg.drift_margin_us, slot, grant));
                    self.metrics.grants_outstanding -= 1;
                    self.maybe_free(slot);
                }
            }
            Msg::AddHolderReq { op, key, version, copy } => {
                // A registration of an older copy than the one this holder
                // has registered (a late duplicate, held on a stream that
                // broke and came back) is refused and changes nothing: taken,
                // the holder's "I gave that copy up" would then unregister
                // the copy it holds now, and the next change would complete
                // without invalidating it. Copy ids only grow within an
                // incarnation; a new incarnation comes with a new view.
                let older = self.cfg.bug != Some(Bug::TakeLateRegistration)
                    && self.dir.get(&key).and_then(|e| e.holders.get(from)).is_some_and(|c| c > copy);
                // The reader's copy of a locate-time registration exists
                // (and may already be served): confirmed, it can be named
                // as a source. A change under way keeps waiting for its ack.
                let registered = self
                    .dir
                    .get(&key)
                    .is_some_and(|e| e.version == version && e.holders.entry(from).is_some_and(|h| h.copy == copy));
                // A confirmation (op `CONFIRM`) only confirms: a registration
                // taken back meanwhile (its `RemoveHolder` overtook it) is
                // not made again for a copy the reader may have dropped.
                let ok = registered
                    || op != CONFIRM
                        && !older
                        && self.ready
                        && self.is_home(&key)
                        && self.dir.get(&key).is_some_and(|e| e.version == version && e.change.is_none());
                if ok {
                    self.dir.get_mut(&key).expect("checked").holders.insert(from, copy);
                    self.touch(key);
                    if self.cfg.trace {
                        self.trace.push(Trace::Registered { key, version, holder: from });
                    }
                }
                self.send(from, Msg::AddHolderResp { op, key, version, copy, ok });
            }
            Msg::AddHolderResp { op, key, version, copy, ok } => {
                self.on_add_holder_resp(from, op, key, version, copy, ok)
            }
            Msg::RemoveHolder { key, version, copy } => {
                self.touch(key);
                if let Some(e) = self.dir.get_mut(&key)
                    && e.version == version
                    && e.holders.get(from) == Some(copy)
                {
                    e.holders.remove(from);
                    if let Some(c) = &mut e.change {
                        c.waiting.remove(&from);
                        if c.waiting.is_empty() {
                            self.complete_change(key);
                        }
                    }
                    self.gc_entry(&key);
                }
            }
            Msg::Announce { round, part, parts, entries } => self.on_announce(from, round, part, parts, entries),
            Msg::AnnounceAck => {
                if let Some((sent, _)) = self.announce_pending.remove(&from) {
                    self.timers.announces.remove(&(sent + self.cfg.retransmit_us, from));
                }
            }
            Msg::LookupReq { op, keys } => {
                let found = keys.iter().map(|k| self.lookup_at_home(from, k).map_or((0, 0), |(h, v)| (v, h))).collect();
                self.metrics.lookup_questions_answered += 1;
                self.send(from, Msg::LookupResp { op, found });
                // An engine call waits for it: no flush delay.
                self.flush_peer(from);
            }
            Msg::LookupResp { op, found } => self.on_lookup_resp(from, op, found),
        }
    }

    /// The version a change of `key` (now at `old`) assigns: above `old`,
    /// in this epoch, and above every version of the key's bucket whose
    /// entry was dropped in it.
    ///
    /// `None` when the epoch's 2^32 versions are used up (or a version
    /// above the epoch got in): the change is abandoned, never wrapped.
    fn next_version(&self, key: &BlockKey, old: u64) -> Option<u64> {
        let base = self.view.epoch.checked_shl(32).filter(|b| b >> 32 == self.view.epoch)?;
        let floor = self.version_floor[version_bucket(key)].checked_add(1)?;
        let next = old.checked_add(1)?.max(base | 1).max(floor);
        (next >> 32 == self.view.epoch).then_some(next)
    }

    /// Drops a directory entry with no holders and no change in progress
    /// (remembering its version in the bucket's floor): the directory
    /// holds only keys cached somewhere or changing.
    fn gc_entry(&mut self, key: &BlockKey) {
        if let Some(e) = self.dir.get(key)
            && e.holders.is_empty()
            && e.change.is_none()
        {
            let f = &mut self.version_floor[version_bucket(key)];
            *f = (*f).max(e.version);
            self.dir.remove(key);
            self.touch(*key);
        }
    }

    /// The last put or get of `key` here ended: its retired version is no
    /// longer needed.
    fn key_ops_done(&mut self, key: &BlockKey) {
        if !self.writes.contains_key(key) && !self.fetching.contains_key(key) {
            self.retired.remove(key);
        }
    }

    fn on_publish_req(&mut self, w: NodeId, op: OpId, key: BlockKey, checksum: u64, copy: u64) {
        if !self.ready || !self.is_home(&key) || !self.serving() {
            return self.send(w, Msg::PublishResp { op, key, result: PublishResult::Busy, copy });
        }
        if let Some(&(k, v, _)) = self.published.get(&(w, op))
            && k == key
        {
            return self.send(w, Msg::PublishResp { op, key, result: PublishResult::Stored(v), copy });
        }
        self.touch(key);
        let e = self.dir.entry(key).or_default();
        if let Some(c) = &e.change {
            if c.kind == (ChangeKind::Overwrite { writer: w, op, checksum, copy }) {
                return; // duplicate of the change in progress
            }
            return self.send(w, Msg::PublishResp { op, key, result: PublishResult::Busy, copy });
        }
        self.start_change(key, ChangeKind::Overwrite { writer: w, op, checksum, copy });
    }

    /// Starts a change of `key` (which must have a directory entry): every
    /// registered holder is sent an invalidation; the change completes when
    /// all have acked (at once when there are none).
    fn start_change(&mut self, key: BlockKey, kind: ChangeKind) {
        let now = self.now;
        self.next_change += 1;
        let id = self.next_change;
        self.touch(key);
        let e = self.dir.get_mut(&key).expect("a change needs a directory entry");
        let old_version = e.version;
        let holders: Vec<NodeId> = e.holders.ids().collect();
        let resend_at = now + self.cfg.retransmit_us;
        e.change = Some(Box::new(Change {
            id,
            kind,
            old_version,
            waiting: holders.iter().map(|&h| (h, now)).collect(),
            started: now,
            resend_at,
        }));
        self.timers.changes.insert((resend_at, key));
        for &h in &holders {
            self.send(h, Msg::Invalidate { key, version: old_version, change: id });
        }
        if holders.is_empty() || self.cfg.bug == Some(Bug::SkipAckWait) {
            self.complete_change(key);
        }
    }

    /// Ends the change of `key` without a new version: its writer hears
    /// Busy, its requester "not done" (they retry, or fail at their
    /// deadline); holders it invalidated stay invalid, which is always safe.
    fn abandon_change(&mut self, key: BlockKey) {
        self.touch(key);
        let e = self.dir.get_mut(&key).expect("entry of a change");
        let Some(c) = e.change.take() else { return };
        self.timers.changes.remove(&(c.resend_at, key));
        match c.kind {
            ChangeKind::Overwrite { writer, op, copy, .. } => {
                self.send(writer, Msg::PublishResp { op, key, result: PublishResult::Busy, copy })
            }
            ChangeKind::Invalidate { requester, op } => {
                self.send(requester, Msg::InvalidateResp { op, key, ok: false })
            }
        }
        self.gc_entry(&key);
    }

    fn complete_change(&mut self, key: BlockKey) {
        if !self.serving() {
            // A home whose lease lapsed may already have been replaced (a
            // view without it, a new home for the key): it assigns no
            // version; the writer or requester retries with the home of
            // its next view.
            return self.abandon_change(key);
        }
        let next = {
            let e = self.dir.get(&key).expect("entry of a change");
            self.next_version(&key, e.version)
        };
        let Some(next) = next else {
            // No version left in this epoch (the next epoch has some).
            self.metrics.versions_exhausted += 1;
            return self.abandon_change(key);
        };
        self.touch(key);
        let e = self.dir.get_mut(&key).expect("entry of a change");
        let Some(c) = e.change.take() else { return };
        self.timers.changes.remove(&(c.resend_at, key));
        self.metrics.changes_completed += 1;
        if self.cfg.trace {
            let new_version = matches!(c.kind, ChangeKind::Overwrite { .. }).then_some(next);
            self.trace.push(Trace::ChangeCompleted { key, old_version: c.old_version, new_version });
        }
        match c.kind {
            ChangeKind::Overwrite { writer, op, copy, .. } => {
                e.version = next;
                e.holders = Holders::single(writer, copy);
                if self.cfg.trace {
                    self.trace.push(Trace::Registered { key, version: next, holder: writer });
                }
                let forget = self.now + 2 * self.cfg.op_timeout_us;
                self.published.insert((writer, op), (key, next, forget));
                self.published_expiry.push_back((forget, writer, op));
                self.send(writer, Msg::PublishResp { op, key, result: PublishResult::Stored(next), copy });
            }
            ChangeKind::Invalidate { requester, op } => {
                // The key moves to a tombstone version with no holders, so a
                // reader that fetched the old version under an earlier grant
                // can no longer register it, and the next put is newer.
                e.version = next;
                e.holders.clear();
                self.send(requester, Msg::InvalidateResp { op, key, ok: true });
                self.gc_entry(&key);
            }
        }
    }

    fn on_publish_resp(&mut self, home: NodeId, op: OpId, key: BlockKey, result: PublishResult, copy: u64) {
        let Some(Op { kind: OpKind::Put { key: k, slot, checksum, copy: c, .. }, .. }) = self.ops.get(&op) else {
            if let PublishResult::Stored(v) = result
                && self.copies.get(&key).is_none_or(|c| c.id != copy)
            {
                // We gave up on this put (or this is a duplicate answer for a
                // copy we dropped since): tell the home we hold nothing.
                self.send(home, Msg::RemoveHolder { key, version: v, copy });
            }
            return;
        };
        let (k, slot, checksum) = (*k, *slot, *checksum);
        if k != key || *c != copy {
            return;
        }
        self.remove_op(op);
        self.writes.remove(&key);
        match result {
            PublishResult::Stored(version) if version >> 32 != self.view.epoch => {
                // A home of this epoch assigns versions of this epoch (the
                // batch carried it): anything else is refused, never
                // committed or announced onwards.
                self.metrics.peer_refusals += 1;
                self.send(home, Msg::RemoveHolder { key, version, copy });
                self.unreference(slot);
                self.done(op, Outcome::Error(ErrorKind::Busy));
            }
            PublishResult::Stored(_) if !self.serving() => {
                // This node may no longer serve: the copy must not become
                // Valid, and whether the put survives the membership
                // change is unknown — an error, never "stored".
                self.unreference(slot);
                self.done(op, Outcome::Error(ErrorKind::NotMember));
            }
            PublishResult::Stored(version) if self.retired.get(&key).is_some_and(|&r| version <= r) => {
                // Stored, then overwritten or invalidated before the answer
                // reached us: the copy must not become Valid.
                self.unreference(slot);
                self.done(op, Outcome::Stored { version });
            }
            PublishResult::Stored(version) => {
                let meta = SlotMeta { key, version, generation: slot.generation, checksum };
                self.actions.push(Action::CommitSlot { slot, meta });
                self.drop_copy(&key);
                self.copies.insert(key, Copy { slot, version, checksum, id: copy });
                self.touch(key);
                if let Some(&f) = self.fetching.get(&key)
                    && let Some(Op { kind: OpKind::Get { doomed, .. }, .. }) = self.ops.get_mut(&f)
                {
                    *doomed = true;
                }
                self.done(op, Outcome::Stored { version });
            }
            PublishResult::Busy => {
                self.unreference(slot);
                self.done(op, Outcome::Error(ErrorKind::Busy));
            }
        }
        self.key_ops_done(&key);
    }

    fn on_publish_abort(&mut self, w: NodeId, op: OpId, key: BlockKey) {
        self.touch(key);
        let Some(e) = self.dir.get_mut(&key) else { return };
        if let Some(c) = &e.change
            && matches!(c.kind, ChangeKind::Overwrite { writer, op: o, .. } if writer == w && o == op)
        {
            // Holders that acked were already removed.
            if let Some(c) = e.change.take() {
                self.timers.changes.remove(&(c.resend_at, key));
            }
        }
        if let Some(&(k, v, _)) = self.published.get(&(w, op))
            && k == key
            && e.version == v
        {
            e.holders.remove(w);
        }
        self.gc_entry(&key);
    }

    fn on_invalidate(&mut self, home: NodeId, key: BlockKey, version: u64, change: u64) {
        if self.cfg.bug != Some(Bug::AckWithoutInvalidate) {
            if self.copies.get(&key).is_some_and(|c| c.version <= version) {
                self.drop_copy(&key);
            }
            if let Some(&f) = self.fetching.get(&key)
                && let Some(Op { kind: OpKind::Get { doomed, .. }, .. }) = self.ops.get_mut(&f)
            {
                *doomed = true;
            }
        }
        if self.cfg.bug != Some(Bug::AckWithoutInvalidate)
            && (self.writes.contains_key(&key) || self.fetching.contains_key(&key))
        {
            let r = self.retired.entry(key).or_insert(version);
            *r = (*r).max(version);
        }
        if self.cfg.trace {
            self.trace.push(Trace::Acked { key, version });
        }
        self.send(home, Msg::InvalidateAck { key, version, change });
    }

    fn on_ack(&mut self, h: NodeId, key: BlockKey, version: u64, change: u64) {
        let now = self.now;
        self.touch(key);
        let Some(e) = self.dir.get_mut(&key) else {
            self.metrics.ignored_acks += 1;
            return;
        };
        let counted = match &mut e.change {
            Some(c) if c.id == change && c.old_version == version && c.waiting.contains_key(&h) => {
                c.waiting.remove(&h);
                self.metrics.inval_to_ack_us.record(now.saturating_sub(c.started));
                e.holders.remove(h);
                Some(c.waiting.is_empty())
            }
            _ => None,
        };
        match counted {
            Some(true) => self.complete_change(key),
            Some(false) => {}
            None => self.metrics.ignored_acks += 1,
        }
    }

    fn on_invalidate_req(&mut self, r: NodeId, op: OpId, key: BlockKey) {
        if !self.ready || !self.is_home(&key) || !self.serving() {
            return self.send(r, Msg::InvalidateResp { op, key, ok: false });
        }
        self.touch(key);
        let Some(e) = self.dir.get_mut(&key) else {
            return self.send(r, Msg::InvalidateResp { op, key, ok: true });
        };
        if let Some(c) = &e.change {
            if c.kind == (ChangeKind::Invalidate { requester: r, op }) {
                return;
            }
            return self.send(r, Msg::InvalidateResp { op, key, ok: false });
        }
        if e.holders.is_empty() {
            return self.send(r, Msg::InvalidateResp { op, key, ok: true });
        }
        self.start_change(key, ChangeKind::Invalidate { requester: r, op });
    }

    /// A reader's locate. With a copy id (`copy != 0`), a home that
    /// answers with a holder or with its own grant registers the reader as
    /// a pending holder of that version first (see [`Holder`]).
    fn on_locate_req(&mut self, r: NodeId, op: OpId, key: BlockKey, copy: u64) {
        // The reader is registered already with a newer copy: this locate
        // is a late duplicate (that get ended); it registers nothing and
        // gets no holder (its answer is ignored). An older registration
        // of the reader — pending or confirmed — is replaced: the reader
        // held no copy of the key when it sent this locate, and if it holds
        // one when the answer comes (its own put completed meanwhile) it
        // relabels it (`take_back`).
        let older = copy != 0
            && self.cfg.bug != Some(Bug::TakeLateRegistration)
            && self.dir.get(&key).and_then(|e| e.holders.get(r)).is_some_and(|c| c > copy);
        // The home holds the current version itself: grant it right away
        // (the reader treats it as the answer of a grant request).
        if self.ready
            && !older
            && r != self.id
            && self.is_home(&key)
            && let Some(e) = self.dir.get(&key)
            && e.change.is_none()
            && e.holders.contains(self.id)
            && self.copies.get(&key).is_some_and(|c| c.version == e.version)
        {
            let version = e.version;
            self.metrics.locate_grants += 1;
            let result = self.grant(r, key, version);
            let reg = (copy != 0 && matches!(result, GrantResult::Granted { .. }))
                .then(|| self.register_pending(key, r, copy));
            return self.send(r, Msg::GrantResp { op, result, reg });
        }
        let result = if !self.ready || !self.is_home(&key) || older {
            LocateResult::Busy
        } else {
            match self.dir.get(&key) {
                None => LocateResult::Miss,
                Some(e) if e.change.is_some() => LocateResult::Busy,
                Some(e) => match e.holders.sources().find(|&h| h != r) {
                    Some(holder) => LocateResult::Found { version: e.version, holder },
                    None => LocateResult::Miss,
                },
            }
        };
        let reg =
            (copy != 0 && matches!(result, LocateResult::Found { .. })).then(|| self.register_pending(key, r, copy));
        self.send(r, Msg::LocateResp { op, key, result, reg });
    }

    /// Registers reader `r` as a pending holder of `key`'s current version
    /// (its entry exists and is not changing: the caller checked).
    fn register_pending(&mut self, key: BlockKey, r: NodeId, copy: u64) -> Registration {
        self.touch(key);
        let e = self.dir.get_mut(&key).expect("checked by the caller");
        e.holders.set(r, copy, true);
        self.metrics.pending_registrations += 1;
        Registration { key, version: e.version, copy }
    }

    /// A registration of this node the home made at locate time that no
    /// get will use (the get ended, missed, or got a refused grant): the
    /// home is told to drop it — unless this node holds a copy of that
    /// version with an older id, whose registration the new one replaced
    /// (the node's own put completed while the get was on its way): that
    /// copy takes the registration's id, and the home is told it exists.
    fn take_back(&mut self, home: NodeId, reg: Registration) {
        let Registration { key, version, copy } = reg;
        match self.copies.get_mut(&key) {
            Some(c) if c.id == copy => {}
            Some(c) if c.version == version && c.id < copy => {
                c.id = copy;
                self.send(home, Msg::AddHolderReq { op: CONFIRM, key, version, copy });
            }
            _ => self.send(home, Msg::RemoveHolder { key, version, copy }),
        }
    }

    /// The registration a home echoed in its answer to get `op`'s locate:
    /// recorded when it is that get's, taken back at once when no get will
    /// use it. A registration of a key this node does not home there is no
    /// honest node's: refused.
    fn take_registration(&mut self, from: NodeId, op: OpId, reg: Registration) {
        if self.view.home_of(&reg.key) != Some(from) {
            self.metrics.peer_refusals += 1;
            return;
        }
        let (ours, first) = match self.ops.get(&op) {
            Some(Op { kind: OpKind::Get { key, stage, early: Some(e), .. }, .. })
                if *key == reg.key && e.copy == reg.copy && e.registered.is_none_or(|v| v == reg.version) =>
            {
                let first = e.registered.is_none() && matches!(stage, GetStage::Locating { home, .. } if *home == from);
                (true, first)
            }
            _ => (false, false),
        };
        if !ours {
            return self.take_back(from, reg);
        }
        // (A duplicate of the answer while the get goes on changes nothing;
        // one of another version — a duplicate locate answered after the
        // key changed — is not the get's: taken back.)
        if first && let Some(e) = self.early_mut(op) {
            e.registered = Some(reg.version);
        }
    }

    fn on_locate_resp(
        &mut self,
        from: NodeId,
        op: OpId,
        key: BlockKey,
        result: LocateResult,
        reg: Option<Registration>,
    ) {
        let now = self.now;
        let me = self.id;
        if let Some(reg) = reg {
            self.take_registration(from, op, reg);
        }
        let Some((stage, k, _)) = self.get_stage(op) else { return };
        if k != key || !matches!(stage, GetStage::Locating { home, .. } if *home == from) {
            return; // not the answer of the home asked
        }
        let member = |h: NodeId| self.view.member(h).is_some();
        let known = match result {
            LocateResult::Found { holder, .. } => member(holder),
            _ => true,
        };
        if !known {
            self.metrics.peer_refusals += 1; // a holder outside the view
        }
        let Some((stage, _, _)) = self.get_stage(op) else { return };
        // A grant from the home itself may answer the locate (a duplicate
        // of it, handled once the home's copy was current) rather than the
        // grant request sent now: trust any grant of it only from when the
        // locate was sent (the earlier request), or the reader would count
        // the holder's lease from later than the holder started it (S4).
        let asked_at = match *stage {
            GetStage::Locating { sent_at, .. } if result_holder(&result) == Some(from) => sent_at,
            _ => now,
        };
        match result {
            LocateResult::Found { version, holder } if holder != me && known => {
                *stage = GetStage::Granting { holder, version, sent_at: asked_at };
                self.send(holder, Msg::GrantReq { op, key, version });
            }
            _ => self.finish_get(op, Outcome::Miss),
        }
    }

    fn on_grant_req(&mut self, r: NodeId, op: OpId, key: BlockKey, version: u64) {
        let result = self.grant(r, key, version);
        self.send(r, Msg::GrantResp { op, result, reg: None });
    }

    /// Grants reader `r` a read of this node's copy of `key` at `version`,
    /// if it has one.
    fn grant(&mut self, r: NodeId, key: BlockKey, version: u64) -> GrantResult {
        let held = self.grants_by_reader.get(&r).copied().unwrap_or(0);
        if held >= crate::GRANTS_PER_READER_MAX {
            // More grants than any reader has gets in flight (each holds
            // at most one, duplicates are released at once; `ops_max` is
            // at most half of this): refused.
            self.metrics.peer_refusals += 1;
            return GrantResult::Refused;
        }
        match self.copies.get(&key) {
            Some(c) if self.serving() && c.version == version => {
                self.next_grant += 1;
                let grant = self.next_grant;
                let deadline = self.now + self.cfg.grant_lease_us;
                self.slots.entry(c.slot).or_insert_with(SlotHold::new).grants.insert(grant, (deadline, r));
                *self.grants_by_reader.entry(r).or_default() += 1;
                self.timers.grants.insert((deadline + self.cfg.drift_margin_us, c.slot, grant));
                self.metrics.grants_outstanding += 1;
                GrantResult::Granted { slot: c.slot, meta: c.meta(key), lease_us: self.cfg.grant_lease_us, grant }
            }
            _ => GrantResult::Refused,
        }
    }

    fn on_grant_resp(&mut self, holder: NodeId, op: OpId, result: GrantResult, reg: Option<Registration>) {
        let now = self.now;
        let drift = self.cfg.drift_ppm;
        let margin = self.cfg.drift_margin_us;
        let lease_max = self.cfg.grant_lease_us;
        if let Some(reg) = reg {
            // The home answered the locate with its own grant (or with a
            // refusal its driver made of it), registering us first.
            self.take_registration(holder, op, reg);
        }
        let staged = match self.get_stage(op) {
            Some((stage, key, _)) => match *stage {
                GetStage::Granting { holder: h, version, sent_at } if h == holder => {
                    Some((stage, key, version, sent_at))
                }
                // The home granted its own copy in answer to the locate: the
                // version is the one it granted (its current one).
                GetStage::Locating { home, sent_at } if home == holder => {
                    let version = match result {
                        GrantResult::Granted { meta, .. } => meta.version,
                        GrantResult::Refused => 0,
                    };
                    Some((stage, key, version, sent_at))
                }
                _ => None,
            },
            None => None,
        };
        let Some((stage, key, version, sent_at)) = staged else {
            // Not waiting for a grant: release it, unless it is a duplicate
            // of the grant this get is reading under right now.
            if let GrantResult::Granted { slot, grant, .. } = result {
                let in_use = matches!(
                    self.get_stage(op),
                    Some((GetStage::Reading { remote, grant: g, holder: h, .. }, _, _))
                        if *remote == slot && *g == grant && *h == holder
                ) || self.abandoned_reads.get(&op) == Some(&(holder, slot, grant));
                if !in_use {
                    self.send(holder, Msg::GrantRelease { slot, grant });
                }
            }
            return;
        };
        match result {
            GrantResult::Granted { slot, meta, lease_us, grant } => {
                // Trust the grant for its lease measured from when we asked,
                // shortened by the worst clock drift and the margin.
                // The holder's lease is taken at most as long as ours
                // (a peer's value, never trusted beyond what we grant).
                let lease_us = lease_us.min(lease_max);
                let shrink = lease_us.saturating_mul(2).saturating_mul(drift) / 1_000_000;
                let usable = lease_us.saturating_sub(shrink.saturating_add(margin));
                let read_deadline = sent_at.saturating_add(usable);
                if meta.key != key || meta.version != version || now >= read_deadline {
                    self.send(holder, Msg::GrantRelease { slot, grant });
                    return self.finish_get(op, Outcome::Miss);
                }
                *stage = GetStage::Reading { holder, version, remote: slot, expect: meta, grant, read_deadline };
                self.actions.push(Action::StartRead {
                    op,
                    from: holder,
                    remote: slot,
                    expect: meta,
                    deadline: read_deadline,
                });
            }
            GrantResult::Refused => self.finish_get(op, Outcome::Miss),
        }
    }

    fn on_add_holder_resp(&mut self, home: NodeId, op: OpId, key: BlockKey, version: u64, copy: u64, ok: bool) {
        let registering = match self.get_stage(op) {
            Some((GetStage::Registering { version: v, dest, meta, copy: c }, k, doomed))
                if k == key && *v == version && *c == copy =>
            {
                Some((*dest, *meta, doomed))
            }
            _ => None,
        };
        let Some((dest, meta, doomed)) = registering else {
            let live = self.copies.get(&key).is_some_and(|c| c.id == copy);
            if ok && !live {
                // The get ended meanwhile: we hold nothing (tell the home),
                // or a copy of our own put the registration replaced.
                self.take_back(home, Registration { key, version, copy });
            } else if !ok && live {
                // A copy made Valid on its locate-time registration, which
                // the home no longer has (an honest home keeps it until we
                // ack a change or remove it): not registered, not kept.
                self.drop_copy(&key);
            }
            return;
        };
        let retired = self.retired.get(&key).is_some_and(|&r| version <= r);
        let keep = ok && !doomed && !retired && self.serving() && !self.copies.contains_key(&key);
        if !keep {
            if ok {
                // Taken back — or, when our own put completed at this
                // version meanwhile (its registration was just replaced by
                // this one), kept for that copy.
                self.take_back(home, Registration { key, version, copy });
            }
            self.unreference(dest);
            return self.finish_get(op, Outcome::Miss);
        }
        self.copies.insert(key, Copy { slot: dest, version: meta.version, checksum: meta.checksum, id: copy });
        self.touch(key);
        self.pin(dest);
        self.finish_get(op, Outcome::Hit { version, slot: dest });
    }

    fn on_announce(&mut self, h: NodeId, round: u64, part: u32, parts: u32, entries: Vec<AnnounceEntry>) {
        if part >= parts || parts > ANNOUNCE_PARTS_MAX {
            // Not a part of anything an honest node sends (a part count
            // bounds what is remembered of a round).
            self.metrics.peer_refusals += 1;
            return;
        }
        // Parts of a round older than one under way are ignored; a newer
        // round starts over (its parts may split the copies differently).
        // A part already taken (a duplicate, or any part once the holder
        // counts as announced) registers nothing again: since it was taken,
        // the holder may have dropped those copies and told us, and a
        // change may have retired their version; registering them again
        // would bring a retired version back into the directory (a late
        // fetch registration of it would then be accepted).
        let fresh = !self.announced.contains(&h) && {
            let rx = self.announce_rx.entry(h).or_insert((round, parts, BTreeSet::new()));
            if round < rx.0 {
                return;
            }
            if round > rx.0 || parts != rx.1 {
                *rx = (round, parts, BTreeSet::new());
            }
            rx.2.insert(part)
        };
        for (key, version, copy) in entries {
            if !self.is_home(&key) {
                continue;
            }
            if version >> 32 >= self.view.epoch {
                // No home assigned it: copies announced into this epoch
                // were made in earlier ones (no home of this epoch is ready
                // before every member announced), and the batch's epoch is
                // ours. Taken, it could end the key's version space. The
                // holder is told to drop it (a copy its home does not know
                // of must not stay Valid).
                self.metrics.peer_refusals += 1;
                self.send(h, Msg::Invalidate { key, version, change: 0 });
                continue;
            }
            if !fresh {
                continue;
            }
            self.touch(key);
            let e = self.dir.entry(key).or_default();
            if e.holders.is_empty() && version >= e.version {
                e.version = version;
                e.holders.insert(h, copy);
            } else if version == e.version {
                e.holders.insert(h, copy);
            } else if version > e.version {
                // Two versions announced: keep the newer, retire the older.
                let old: Vec<NodeId> = std::mem::take(&mut e.holders).ids().collect();
                let old_version = e.version;
                e.version = version;
                e.holders.insert(h, copy);
                for o in old {
                    self.send(o, Msg::Invalidate { key, version: old_version, change: 0 });
                }
            } else {
                self.send(h, Msg::Invalidate { key, version, change: 0 });
            }
        }
        if self.announced.contains(&h) {
            // A retransmission after we had it all: the ack was lost.
            return self.send(h, Msg::AnnounceAck);
        }
        if self.announce_rx.get(&h).is_some_and(|rx| rx.2.len() as u32 == rx.1) {
            self.announce_rx.remove(&h);
            self.announced.insert(h);
            let was = self.ready;
            self.ready = self.view.members.iter().all(|m| self.announced.contains(&m.id));
            if self.ready && !was {
                self.table_reset();
            }
            self.send(h, Msg::AnnounceAck);
        }
    }
}

/// H1, for a holder another node names in a lookup answer (a home's
/// `LookupResp` or its table): a member of the view, not the asker (homes
/// leave the asker out), a version of this epoch or an earlier one.
fn plausible_holder(view: &View, me: NodeId, holder: NodeId, version: u64) -> bool {
    holder != me && view.member(holder).is_some() && version >> 32 <= view.epoch
}
