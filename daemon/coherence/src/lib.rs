//! The coherence core of kvmesh: a per-node state machine with no IO.
//!
//! A [`Node`] is fed [`Event`]s (client calls, peer message batches,
//! transfer completions, membership views, timer ticks; the time is passed
//! in as a value) and answers with [`Action`]s (send a batch to a peer,
//! start a one-sided read, commit or free a slot, answer a client). The
//! daemon drives it with tokio, gRPC and UCX; the simulator in
//! `cluster-tests/` drives many of them with a seeded RNG, dropping,
//! duplicating and reordering messages, partitioning, crashing and
//! restarting nodes, skewing clocks and tearing reads, and checks the
//! protocol invariants after every step. The protocol, its states and why
//! each invariant holds are described in `docs/COHERENCE.md`.
#![forbid(unsafe_code)]

mod codec;
pub mod membership;
mod metrics;
mod msg;
mod node;

pub use codec::{ANNOUNCE_ENTRIES_MAX, CODEC_VERSION, DECODE_ENTRIES_MAX, DecodeError};

/// Highest epoch a view may have: a version is `epoch << 32 | counter`,
/// so epochs live in 32 bits. Epochs from peers or etcd above it are
/// refused; a coordinator that reached it publishes no further view.
pub const EPOCH_MAX: u64 = (1 << 32) - 2;

/// Most read grants one reader may hold at a holder (a protocol constant:
/// a reader holds at most one per get in flight, and `ops_max` is at most
/// half of it).
pub const GRANTS_PER_READER_MAX: u64 = 1 << 20;
pub use metrics::{
    HISTOGRAM_BUCKETS, HISTOGRAM_SUB_BUCKETS, Histogram, Metrics, histogram_bucket, histogram_bucket_end,
    quantile_of_buckets,
};
pub use msg::{Batch, GrantResult, LocateResult, Msg, PublishResult, Registration};
pub use node::{DirView, Node, TABLE_SOURCES_MAX, TableChanges, TableEntry, TableHeader, TableRead, Trace};

/// Identifies a node (daemon) in the cluster.
pub type NodeId = u32;
/// Identifies a client operation on one node.
pub type OpId = u64;
/// Microseconds on the clock of the node being driven. Clocks of different
/// nodes are not comparable; they drift within `Config::drift_ppm`.
pub type Time = u64;

/// A block's identity: namespace fingerprint and 128-bit key. Packed to
/// 8-byte alignment (24 bytes, not 32): one is kept per cached block in
/// several maps. Fields are read by value (no references into it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(C, packed(8))]
pub struct BlockKey {
    /// Namespace fingerprint.
    pub ns: u64,
    /// Chained prefix hash.
    pub key: u128,
}

/// One use of one local slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotRef {
    /// Slot index in the node's pool.
    pub slot: u32,
    /// Generation of the slot (bumped on every reuse).
    pub generation: u64,
}

/// What a slot's header (or trailer) says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotMeta {
    /// Block.
    pub key: BlockKey,
    /// Version of the block.
    pub version: u64,
    /// Slot generation.
    pub generation: u64,
    /// xxh3-64 of the payload.
    pub checksum: u64,
}

/// What a one-sided read of a whole remote slot observed. Untrusted until
/// validated against what the grant promised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotImage {
    /// Header as read.
    pub header: SlotMeta,
    /// Trailer as read.
    pub trailer: SlotMeta,
    /// Checksum of the payload bytes as read.
    pub payload_checksum: u64,
}

impl SlotImage {
    /// Whether the image is exactly the promised block: header and trailer
    /// agree with each other and with `expect`, and the payload hashes to
    /// the promised checksum.
    pub fn matches(&self, expect: &SlotMeta) -> bool {
        self.header == *expect && self.trailer == *expect && self.payload_checksum == expect.checksum
    }
}

/// A member of a membership view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// Node id.
    pub id: NodeId,
    /// Incarnation (bumped on every restart of the node).
    pub incarnation: u64,
    /// Relative capacity (weight in rendezvous hashing).
    pub capacity: u32,
}

/// A membership view: the live members of one epoch.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct View {
    /// Membership generation; grows with every change.
    pub epoch: u64,
    /// Live members.
    pub members: Vec<Member>,
}

impl View {
    /// The member record of `id`, if it is a member.
    pub fn member(&self, id: NodeId) -> Option<&Member> {
        self.members.iter().find(|m| m.id == id)
    }

    /// Home of a key: highest weighted rendezvous score over the members.
    pub fn home_of(&self, key: &BlockKey) -> Option<NodeId> {
        self.members
            .iter()
            .map(|m| (rendezvous_score(key, m), m.id))
            .max_by(|a, b| a.0.partial_cmp(&b.0).expect("scores are finite").then(a.1.cmp(&b.1)))
            .map(|(_, id)| id)
    }
}

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Weighted rendezvous score (Schindelhauer & Schomaker): capacity / -ln(u).
fn rendezvous_score(key: &BlockKey, m: &Member) -> f64 {
    let h = mix(key.ns ^ mix(key.key as u64 ^ mix((key.key >> 64) as u64 ^ mix(m.id as u64))));
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64; // in (0, 1)
    m.capacity.max(1) as f64 / -u.ln()
}

/// Protocol settings (all bounds and timeouts).
#[derive(Clone, Debug)]
pub struct Config {
    /// Most entries in one batch to a peer.
    pub batch_entries_max: usize,
    /// Longest an entry waits in a peer queue before its batch is flushed.
    pub ack_flush_delay_us_max: u64,
    /// Deadline of a client operation.
    pub op_timeout_us: u64,
    /// Interval of retransmissions (invalidations, publishes, announces).
    pub retransmit_us: u64,
    /// Lease of a read grant.
    pub grant_lease_us: u64,
    /// Membership lease: a node serves nothing once this long has passed
    /// since the send time of its last acknowledged keepalive.
    pub membership_lease_us: u64,
    /// Interval of keepalives to the membership service.
    pub keepalive_us: u64,
    /// Bound on clock rate error, parts per million.
    pub drift_ppm: u64,
    /// Extra safety margin on every lease.
    pub drift_margin_us: u64,
    /// Most client operations in flight on one node.
    pub ops_max: usize,
    /// Most entries in one announce message: a node's copies homed at one
    /// member travel in parts of at most this many, each in a batch of its
    /// own (a million copies would not fit one decodable message).
    pub announce_entries_max: usize,
    /// Copies this node expects to hold at most (its pool slots): the
    /// copy and directory maps are sized for that many at start, so they
    /// never rehash millions of entries while the driver's lock is held
    /// (at 4 million, a rehash stalls the node for about a second). 0:
    /// grow as needed.
    pub expected_copies: usize,
    /// Readers ask the home to register them (pending) when it answers
    /// their locate, and make a fetched copy Valid as soon as it validates
    /// (one round trip less per remote get). Off: the copy becomes Valid
    /// only when the home answers its `AddHolderReq` (homes of either kind
    /// serve both kinds of readers; a home from before the setting cannot
    /// decode such a locate: the daemon sends those a plain one, and the
    /// get registers after its read).
    pub register_at_locate: bool,
    /// Planted bugs, for checking that the simulator catches them.
    pub bug: Option<Bug>,
    /// Record protocol facts in `Node::take_trace` (for checkers).
    pub trace: bool,
    /// Keep this node's lookup-table changes for the driver
    /// (`Node::take_table_changes`), which must then take them after every
    /// step (they are kept until taken).
    pub lookup_table: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            batch_entries_max: 512,
            ack_flush_delay_us_max: 200,
            op_timeout_us: 200_000,
            retransmit_us: 20_000,
            grant_lease_us: 50_000,
            membership_lease_us: 100_000,
            keepalive_us: 20_000,
            drift_ppm: 200,
            drift_margin_us: 2_000,
            ops_max: 100_000,
            announce_entries_max: 65_536,
            expected_copies: 0,
            register_at_locate: true,
            bug: None,
            trace: false,
            lookup_table: false,
        }
    }
}

/// Bugs that can be planted to prove the simulator's checks can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// The home completes an overwrite without waiting for acks.
    SkipAckWait,
    /// A reader uses a transferred slot without validating it.
    SkipValidation,
    /// A holder frees a slot while read grants on it are live.
    ReuseGrantedSlot,
    /// A holder acks an invalidation but keeps serving its copy.
    AckWithoutInvalidate,
    /// A restarted static coordinator grants leases and publishes views at
    /// once, without waiting out the leases its previous incarnation
    /// granted (read by the membership, not by the core).
    CoordinatorNoWait,
    /// etcd membership with a lease TTL below the protocol lease (the rule
    /// the daemon's config check enforces, broken; simulator only).
    EtcdShortTtl,
    /// A draining daemon asks the membership to remove it before its core
    /// has stopped serving (read by drivers: the daemon and the simulator).
    LeaveBeforeStop,
    /// A lookup reports a key this node is still writing (its put not yet
    /// answered by the home) as present here: a Pending slot counted as
    /// Valid.
    LookupCountsPendingPut,
    /// A home takes a registration of an older copy than the one the
    /// holder has registered (a late duplicate, held on a stream that
    /// broke and came back), replacing the live registration.
    TakeLateRegistration,
    /// A reader makes a fetched copy Valid on its locate-time registration
    /// even after a view change (the registration went with the old
    /// epoch's directory).
    EarlyValidAcrossEpochs,
    /// The static coordinator takes a member's capacity from every
    /// keepalive (a member naming another one each time makes it publish a
    /// view per keepalive), not from the first of its incarnation.
    CapacityPerKeepalive,
    /// The static coordinator admits every new incarnation of a node at
    /// once (a daemon in a crash loop, or a member naming a new one in
    /// every keepalive, makes it publish a view per restart), not at most
    /// one per removal time.
    IncarnationPerKeepalive,
    /// Dropping a Valid copy leaves the node's lookup table as it was (the
    /// table still says the home holds it).
    TableMissesDroppedCopy,
}

impl Bug {
    /// Parses the command-line name of a bug.
    pub fn parse(s: &str) -> Option<Bug> {
        Some(match s {
            "skip-ack-wait" => Bug::SkipAckWait,
            "skip-validation" => Bug::SkipValidation,
            "reuse-granted-slot" => Bug::ReuseGrantedSlot,
            "ack-without-invalidate" => Bug::AckWithoutInvalidate,
            "coordinator-no-wait" => Bug::CoordinatorNoWait,
            "etcd-short-ttl" => Bug::EtcdShortTtl,
            "leave-before-stop" => Bug::LeaveBeforeStop,
            "lookup-counts-pending-put" => Bug::LookupCountsPendingPut,
            "take-late-registration" => Bug::TakeLateRegistration,
            "early-valid-across-epochs" => Bug::EarlyValidAcrossEpochs,
            "capacity-per-keepalive" => Bug::CapacityPerKeepalive,
            "incarnation-per-keepalive" => Bug::IncarnationPerKeepalive,
            "table-misses-dropped-copy" => Bug::TableMissesDroppedCopy,
            _ => return None,
        })
    }
    /// Command-line names of all bugs.
    pub const NAMES: [&'static str; 13] = [
        "skip-ack-wait",
        "skip-validation",
        "reuse-granted-slot",
        "ack-without-invalidate",
        "coordinator-no-wait",
        "etcd-short-ttl",
        "leave-before-stop",
        "lookup-counts-pending-put",
        "take-late-registration",
        "early-valid-across-epochs",
        "capacity-per-keepalive",
        "incarnation-per-keepalive",
        "table-misses-dropped-copy",
    ];
}

/// Why a transfer failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferError {
    /// The peer is unreachable or gone.
    PeerGone,
    /// No local slot to receive into.
    NoSpace,
    /// The transfer ran past its deadline.
    Timeout,
}

/// Inputs of the state machine.
/// Client operations carry an `OpId` chosen by the driver, unique among
/// those in flight, and never 0 (reserved for registration confirmations).
#[derive(Clone, Debug)]
pub enum Event {
    /// An engine asks for a block.
    ClientGet {
        /// Operation id (unique on this node).
        op: OpId,
        /// Block.
        key: BlockKey,
    },
    /// An engine has written a block into `slot` (Pending) and publishes
    /// it; the version is assigned by the key's home.
    ClientPut {
        /// Operation id.
        op: OpId,
        /// Block.
        key: BlockKey,
        /// Slot holding the new content.
        slot: SlotRef,
        /// Checksum of the new content.
        checksum: u64,
    },
    /// An engine asks where `keys` are Valid in the cluster, without
    /// pinning, granting or moving anything: local copies answer here,
    /// the rest is one `LookupReq` per home. Ends with
    /// `Action::LookupDone` (or `ClientDone` with an error when this node
    /// may not serve).
    ClientLookup {
        /// Operation id.
        op: OpId,
        /// Blocks, in the caller's order (repeats allowed).
        keys: Vec<BlockKey>,
    },
    /// An engine asks that no node serve the current version of `key`.
    ClientInvalidate {
        /// Operation id.
        op: OpId,
        /// Block.
        key: BlockKey,
    },
    /// An engine releases one pin of a slot it got from a hit.
    Unpin {
        /// The slot.
        slot: SlotRef,
    },
    /// The pool wants the copy of `key` gone (memory pressure, or an
    /// engine's `Remove`).
    Evict {
        /// Block.
        key: BlockKey,
        /// The slot the pool freed, when it did: only a copy in that slot is
        /// dropped (the copy may have moved to another slot since: a newer
        /// version committed in the same step). `None`: whichever slot.
        slot: Option<SlotRef>,
    },
    /// A batch from a peer.
    Receive {
        /// Sender.
        from: NodeId,
        /// The batch.
        batch: Batch,
    },
    /// A read started by `Action::StartRead` ended.
    TransferDone {
        /// The get it belongs to.
        op: OpId,
        /// Local slot the bytes landed in (absent when none was allocated).
        dest: Option<SlotRef>,
        /// What was read, or why nothing was.
        result: Result<SlotImage, TransferError>,
    },
    /// The membership service published a view.
    View(View),
    /// The membership service acknowledged the keepalive sent at `sent_at`.
    KeepAliveAck {
        /// Local time the keepalive was sent.
        sent_at: Time,
    },
    /// Time passed: does what is due (O(log n) per timer due).
    Tick,
    /// This node leaves the cluster for good (a drain before the process
    /// exits): every operation in flight fails, every copy is dropped and
    /// its home told (`RemoveHolder`), and from now on the node serves
    /// nothing, answers no peer and sends no keepalive. Only after this
    /// may the driver ask the membership to remove the node (a view that
    /// leaves it out must never find it serving: M1).
    Leave,
}

/// What a client call ended with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The block is in local `slot` (pinned once for the caller).
    Hit {
        /// Version served.
        version: u64,
        /// Local slot (unpin with `Event::Unpin`).
        slot: SlotRef,
    },
    /// Not cached (or not servable now).
    Miss,
    /// The put is visible at `version`.
    Stored {
        /// Version assigned by the home.
        version: u64,
    },
    /// No node serves the old version any more.
    Invalidated,
    /// Explicit failure.
    Error(ErrorKind),
}

/// Why a client call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Another write or invalidation of the key is in progress, or the
    /// directory is rebuilding after a membership change.
    Busy,
    /// The call passed its deadline.
    Timeout,
    /// This node is not a live member (its membership lease lapsed).
    NotMember,
    /// Too many calls in flight.
    Overloaded,
}

/// Outputs of the state machine.
#[derive(Clone, Debug)]
pub enum Action {
    /// Send a batch to a peer (the driver may drop it; the protocol
    /// retransmits what matters).
    Send {
        /// Destination.
        to: NodeId,
        /// The batch.
        batch: Batch,
    },
    /// Read the whole remote slot `remote` of `from` into a fresh local
    /// slot, then report `Event::TransferDone`.
    StartRead {
        /// The get it belongs to.
        op: OpId,
        /// Holder.
        from: NodeId,
        /// Remote slot.
        remote: SlotRef,
        /// What the grant promised (for the driver's logs; the core
        /// validates).
        expect: SlotMeta,
        /// Local time after which the grant is no longer trusted: a
        /// transfer ending later is discarded. Drivers should cancel it.
        deadline: Time,
    },
    /// Make a written slot Valid: write `meta` into its header and trailer.
    CommitSlot {
        /// The slot.
        slot: SlotRef,
        /// Final metadata (with the version assigned by the home).
        meta: SlotMeta,
    },
    /// The slot holds nothing the protocol needs; the pool may reuse it.
    FreeSlot {
        /// The slot.
        slot: SlotRef,
    },
    /// Ask the membership service to extend this node's lease.
    KeepAlive {
        /// Local send time (echoed in `Event::KeepAliveAck`).
        sent_at: Time,
    },
    /// A cluster-wide lookup ended. For each key asked, in order: a node
    /// with a Valid copy and its version, or `None`. A key reported at
    /// node `n` with version `v`: `v` was the key's current version (no
    /// change in progress at its home) when this node (`n` itself) or the
    /// key's home answered, and `n` held a Valid copy of it then, or had
    /// just dropped it with the news still on its way to the home. A
    /// later pin may miss.
    LookupDone {
        /// The call.
        op: OpId,
        /// Per key: `(node, version)` or absent.
        found: Vec<Option<(NodeId, u64)>>,
        /// Every home asked answered (otherwise the keys of those that did
        /// not were reported absent: deadline, view change or leave).
        complete: bool,
    },
    /// A client call ended.
    ClientDone {
        /// The call.
        op: OpId,
        /// Its outcome.
        outcome: Outcome,
    },
}
