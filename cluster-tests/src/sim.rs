//! Deterministic simulation of the coherence core.
//!
//! A seeded world drives N `kvmesh_coherence::Node`s: random client calls on
//! random nodes; batches dropped, duplicated, delayed and reordered;
//! partitions that heal; crashes and restarts (new incarnation, empty pool);
//! clocks whose rates drift within the configured bound; the daemon's own
//! static membership code (`kvmesh_coherence::membership`: the coordinator
//! on node 0, which crashes, restarts fast or slow and is partitioned like
//! any node, its epoch persisted across restarts); and a model of
//! each node's pool memory in which one-sided reads can return torn images
//! or images of a reused slot. After every step it checks the invariants
//! (see `docs/COHERENCE.md`); after the faults stop and the network heals it
//! checks liveness. Everything is a function of the seed.

use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};

use kvmesh_coherence::membership::{
    EtcdMember, KeepAlive, Membership, MembershipAction, StaticConfig, etcd_member_value, etcd_view, parse_etcd_view,
    static_membership,
};
use kvmesh_coherence::{
    Action, Batch, BlockKey, Bug, Config, Event, Node, NodeId, OpId, Outcome, SlotImage, SlotMeta, SlotRef, TableEntry,
    Trace, TransferError, View,
};

/// The node that runs the membership coordinator (the daemon's default:
/// the lowest id).
pub const COORDINATOR: NodeId = 0;

/// Settings of one simulation run.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Nodes.
    pub nodes: usize,
    /// Distinct keys (few, so that operations collide).
    pub keys: usize,
    /// Read-mostly keys besides those: a fifth of client calls pick one;
    /// 91 in 100 of those are gets, 8 evictions and 1 a put, so a version
    /// lives long, is fetched again and again, and late messages meet
    /// directory entries that have not moved on.
    pub cold_keys: usize,
    /// Slots in each node's pool.
    pub slots: usize,
    /// Events processed while faults are injected.
    pub steps: u64,
    /// Planted bug.
    pub bug: Option<Bug>,
    /// Membership from a model of etcd (the daemon's `EtcdMember` state
    /// machine on every node) instead of the static coordinator.
    pub etcd: bool,
    /// Scale: keys (namespace 8) put across the nodes before the fault
    /// phase, a fifth of them also read by a second node; one client call
    /// in ten then works on one of them. Each node gets room for them.
    pub background: usize,
    /// Run the O(state) checks (every copy for S1, each core's
    /// `check_incremental`) every this many events; the per-key checks of
    /// the keys the workload touches run after every event.
    pub check_every: u64,
    /// Batches (per thousand) delayed 20–300 ms: the long tail.
    pub long_delay_per_mille: u32,
    /// Sends (per thousand) that find their stream broken: every batch
    /// the sender puts on that link for up to one operation timeout is
    /// held, and arrives one to three operation timeouts after the hold
    /// ended, behind batches sent on the link since (a TCP connection that
    /// comes back after its link flapped).
    pub stuck_link_per_mille: u32,
    /// Batches (per thousand) delivered once more, one to three operation
    /// timeouts later (resent on a new stream after a reconnect while the
    /// old stream also got through).
    pub late_duplicate_per_mille: u32,
    /// Every other lookup reads the homes' lookup tables one-sided
    /// (`Node::lookup_tables`) instead of asking them.
    pub one_sided_lookups: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            nodes: 4,
            keys: 6,
            cold_keys: 4,
            slots: 8,
            steps: 4000,
            bug: None,
            etcd: false,
            background: 0,
            check_every: 1,
            long_delay_per_mille: 4,
            stuck_link_per_mille: 1,
            late_duplicate_per_mille: 10,
            one_sided_lookups: true,
        }
    }
}

/// A linearizable etcd: one revision counter, keys with mod revisions,
/// leases that expire on the real clock (renewed to a full TTL when etcd
/// restarts, as a new leader does), a log of changes for watches.
#[derive(Default)]
struct EtcdModel {
    down_until: u64,
    rev: i64,
    kv: BTreeMap<String, (String, i64, Option<i64>)>,
    leases: BTreeMap<i64, u64>,
    next_lease: i64,
    log: Vec<(String, String, i64, bool)>,
}

impl EtcdModel {
    fn put(&mut self, key: &str, value: String, lease: Option<i64>) -> i64 {
        self.rev += 1;
        self.kv.insert(key.to_string(), (value.clone(), self.rev, lease));
        self.log.push((key.to_string(), value, self.rev, false));
        self.rev
    }

    fn expire(&mut self, now: u64) {
        let dead: Vec<i64> = self.leases.iter().filter(|(_, e)| **e <= now).map(|(l, _)| *l).collect();
        for l in dead {
            self.revoke(l);
        }
    }

    /// Ends a lease now and deletes its keys (a revoke, or its expiry).
    fn revoke(&mut self, l: i64) {
        if self.leases.remove(&l).is_some() {
            let keys: Vec<String> = self.kv.iter().filter(|(_, v)| v.2 == Some(l)).map(|(k, _)| k.clone()).collect();
            for k in keys {
                self.kv.remove(&k);
                self.rev += 1;
                self.log.push((k, String::new(), self.rev, true));
            }
        }
    }
}

/// One node's session with etcd.
struct EtcdSession {
    id: u64,
    lease: i64,
    /// Next log entry to deliver by the watch.
    watch_next: usize,
    /// Send times of keepalives etcd has not answered.
    pending: VecDeque<u64>,
    /// A watch delivery was lost: the stream is broken (as a real watch
    /// stream is: ordered, without gaps, or failed). Nothing more is
    /// delivered on it; the session fails and restarts from a snapshot.
    watch_broken: bool,
}

/// An invariant that failed.
#[derive(Clone, Debug)]
pub struct Violation {
    /// Seed that reproduces it.
    pub seed: u64,
    /// Invariant name (S1..S5, S7, M1, L1..L3, PIN, DATA, PROGRESS).
    pub invariant: &'static str,
    /// What was seen.
    pub detail: String,
    /// The last events before the violation.
    pub trace: Vec<String>,
}

/// Figures of a passing run.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// Events processed (fault phase and healing).
    pub events: u64,
    /// Client calls issued.
    pub ops: u64,
    /// Gets answered with data.
    pub hits: u64,
    /// Puts stored.
    pub stored: u64,
    /// Invalidations completed.
    pub invalidated: u64,
    /// Validation failures caught by the core.
    pub validation_failures: u64,
    /// Grants a home gave of its own copy in answer to a locate.
    pub locate_grants: u64,
    /// Fetched copies made Valid on their locate-time registration.
    pub early_registrations: u64,
    /// Membership epochs.
    pub epochs: u64,
    /// Crashes injected.
    pub crashes: u64,
    /// Drains injected (leave, then exit and restart).
    pub drains: u64,
    /// Copies held across the cluster when the prefill ended (scale runs).
    pub prefilled: u64,
    /// Cluster-wide lookups answered.
    pub lookups: u64,
    /// Keys those lookups reported present (on another node than the asker).
    pub lookup_remote_hits: u64,
    /// Of `lookups`, those that read the homes' tables one-sided.
    pub lookups_one_sided: u64,
    /// Keys those reported present on another node than the asker.
    pub lookup_one_sided_remote_hits: u64,
    /// Crash loops injected (`SimNode::crash_loop`).
    pub crash_loops: u64,
    /// Keepalives of new incarnations the static coordinator held back.
    pub incarnations_held_back: u64,
}

/// Small fast deterministic RNG (xorshift64*).
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

#[derive(Clone, Copy)]
struct Clock {
    offset: u64,
    rate_ppm: i64,
}

impl Clock {
    fn local(&self, real: u64) -> u64 {
        let skew = (real as i128 * self.rate_ppm as i128 / 1_000_000) as i64;
        (self.offset as i64 + real as i64 + skew) as u64
    }
    fn real(&self, local: u64) -> u64 {
        let x = local as i128 - self.offset as i128;
        let r = x * 1_000_000 / (1_000_000 + self.rate_ppm as i128);
        r.max(0) as u64
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CellState {
    Free,
    Used,
}

#[derive(Clone, Copy, Debug)]
struct Cell {
    state: CellState,
    generation: u64,
    header: SlotMeta,
    trailer: SlotMeta,
    content: u64,
}

struct SimNode {
    core: Option<Node>,
    /// The membership service as this node runs it (the coordinator on
    /// node 0, a forwarder elsewhere); gone while the node is down.
    membership: Option<Box<dyn Membership>>,
    /// etcd mode: the daemon's etcd state machine and its session.
    etcd: Option<EtcdMember>,
    session: Option<EtcdSession>,
    next_session: u64,
    /// Cut off from etcd (only) until then.
    etcd_cut_until: u64,
    /// FIFO links with etcd: when the last message each way arrives.
    to_etcd_at: u64,
    from_etcd_at: u64,
    incarnation: u64,
    clock: Clock,
    mem: Vec<Cell>,
    /// Indices of the Free cells of `mem` (the lowest is used first).
    free: BTreeSet<u32>,
    tick_at: Option<u64>,
    isolated_until: u64,
    /// Stalled (SIGSTOP, a scheduling stall) until then: it handles
    /// nothing; what arrives meanwhile waits and is handled, in arrival
    /// order, when it resumes.
    paused_until: u64,
    down_until: u64,
    /// Restarts left in a crash loop (a daemon that fails soon after each
    /// start, restarted by its service manager).
    crash_loop: u32,
    /// The node's lookup table as its driver keeps it: the changes the
    /// core hands out after each event, applied (gone with the process).
    table: HashMap<BlockKey, TableEntry>,
}

/// For each member: the incarnation a coordinator's views list, and since
/// when (its clock).
type ListedSince = BTreeMap<NodeId, (u64, u64)>;

#[derive(Debug)]
enum Ev {
    Deliver {
        to: NodeId,
        from: NodeId,
        batch: Batch,
    },
    Tick {
        node: NodeId,
    },
    ClientOp,
    ReadExec(Read),
    TransferDone {
        reader: NodeId,
        reader_inc: u64,
        op: OpId,
        result: Result<Cell, TransferError>,
    },
    /// A keepalive arriving at the coordinator `to`.
    KeepAlive {
        to: NodeId,
        ka: KeepAlive,
    },
    /// `local`: the coordinator's own (no network, isolation or not).
    KeepAliveAck {
        node: NodeId,
        inc: u64,
        sent_at: u64,
        view: View,
        local: bool,
    },
    View {
        node: NodeId,
        inc: u64,
        view: View,
        local: bool,
    },
    MembershipTick,
    /// etcd mode: a node (re)connects: lease, registration, snapshot.
    EtcdConnect {
        node: NodeId,
        inc: u64,
    },
    EtcdSessionUp {
        node: NodeId,
        inc: u64,
        sid: u64,
        lease: i64,
        reg: i64,
        snapshot: Vec<(String, String, i64)>,
        watch_next: usize,
    },
    EtcdKeepAlive {
        node: NodeId,
        inc: u64,
        sid: u64,
        lease: i64,
    },
    EtcdKeepAliveResp {
        node: NodeId,
        inc: u64,
        sid: u64,
        ok: bool,
    },
    EtcdTxn {
        node: NodeId,
        expect: i64,
        value: String,
    },
    EtcdWatch {
        node: NodeId,
        inc: u64,
        sid: u64,
        entries: Vec<(String, String, i64, bool)>,
    },
    EtcdFail {
        node: NodeId,
        inc: u64,
        sid: u64,
    },
    EtcdTick,
    Unpin {
        node: NodeId,
        inc: u64,
        slot: SlotRef,
    },
    Crash {
        node: NodeId,
    },
    /// A crash of incarnation `inc` of `node` in a crash loop.
    LoopCrash {
        node: NodeId,
        inc: u64,
    },
    Restart {
        node: NodeId,
    },
    Isolate {
        node: NodeId,
        until: u64,
    },
    /// A daemon drains: its core leaves, it asks the membership to remove
    /// it, and its process exits a little later.
    Drain {
        node: NodeId,
    },
    /// A drained daemon's process exits (and starts again later).
    Exit {
        node: NodeId,
        inc: u64,
    },
    /// A leave message arriving at the coordinator `to`.
    Leave {
        to: NodeId,
        node: NodeId,
        inc: u64,
    },
    /// etcd mode: a drained daemon revokes its lease.
    EtcdRevoke {
        lease: i64,
    },
}

/// A one-sided read the simulated NIC will execute.
#[derive(Debug)]
struct Read {
    reader: NodeId,
    reader_inc: u64,
    op: OpId,
    holder: NodeId,
    holder_inc: u64,
    remote: SlotRef,
    /// Real time until which the reader trusts its grant.
    deadline_real: u64,
}

struct Queued {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq)) // min-heap
    }
}

#[derive(Clone, Copy, Debug)]
enum OpInfo {
    Get {
        key: BlockKey,
        start: u64,
    },
    Put {
        key: BlockKey,
    },
    Invalidate,
    /// Its keys and start are in `World::lookups`.
    Lookup,
}

/// The simulated cluster.
pub struct World {
    cfg: SimConfig,
    core_cfg: Config,
    seed: u64,
    rng: Rng,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Queued>,
    nodes: Vec<SimNode>,
    /// The coordinator's durable epoch (survives its crashes).
    persisted_epoch: u64,
    /// Shortest message delay.
    min_delay: u64,
    /// etcd mode: the etcd cluster, and the TTL of its leases.
    etcd: EtcdModel,
    etcd_ttl: u64,
    // checker state
    /// Highest epoch ever published (M1).
    max_published: u64,
    /// The last view published, by which coordinator (node, incarnation)
    /// (CAP).
    last_published: Option<(NodeId, u64, View)>,
    /// INC: by which coordinator (node, incarnation), and for each member
    /// the incarnation its views list and since when (coordinator's clock).
    listed_since: Option<(NodeId, u64, ListedSince)>,
    /// Crash loops (`SimNode::crash_loop`) happen in one seed in eight,
    /// drawn from their own stream so that the other seeds run as before.
    loop_rng: Option<Rng>,
    /// When a home assigned each version (real time): the order of changes.
    assigned_at: HashMap<(BlockKey, u64), u64>,
    /// Puts reported stored: (when answered, when their version was assigned).
    acked_puts: HashMap<BlockKey, Vec<(u64, u64)>>,
    /// Engine pins of hits: (node, incarnation, slot) -> (count, content).
    pins: HashMap<(NodeId, u64, SlotRef), (u32, u64)>,
    ops: BTreeMap<(NodeId, u64, OpId), OpInfo>,
    next_op: OpId,
    truth: HashMap<(BlockKey, u64), u64>,
    max_committed: HashMap<BlockKey, u64>,
    completed: HashMap<BlockKey, Vec<(u64, u64)>>,
    /// Lookups in flight: their keys and when they started (real time).
    lookups: HashMap<(NodeId, u64, OpId), (Vec<BlockKey>, u64)>,
    /// Every (node, key, version) that was ever a Valid copy (committed by
    /// a put, served as a hit) or registered at its home as one (a put the
    /// home completed, a fetch it registered: the node may not have it
    /// yet, or have given it up).
    ever_held: HashSet<(NodeId, BlockKey, u64)>,
    pending_fail: Option<(&'static str, String)>,
    /// Events fed to cores (paces the O(state) checks).
    drives: u64,
    /// Keys S1 and S3 check after every event: the workload's keys and
    /// the background keys it touched.
    watched: BTreeSet<BlockKey>,
    pending_s3: Vec<(BlockKey, u64)>,
    /// Incarnation of the holder that granted each slot use (a grant, like
    /// an rkey, dies with its process).
    granted_by: HashMap<(NodeId, SlotRef), u64>,
    /// One-sided reads not yet executed, and until when (real time) their
    /// readers trust the grant: (holder, slot) -> (holder incarnation,
    /// deadline) per read.
    trusted: HashMap<(NodeId, SlotRef), Vec<(u64, u64)>>,
    faults: bool,
    /// Node faults (crash, stall, drain, isolation) are drawn this much
    /// rarer (a calm seed: 10).
    calm: u32,
    /// Broken streams: (from, to) -> (batches sent before this are held,
    /// and arrive from then on).
    stuck: HashMap<(NodeId, NodeId), (u64, u64)>,
    /// Client calls are being issued.
    workload: bool,
    log: VecDeque<String>,
    stats: RunStats,
    trace_log: bool,
}

const KEEPALIVE_DELAY_MAX: u64 = 2_000;
/// How often the membership service gets a tick.
const MEMBERSHIP_TICK: u64 = 5_000;
/// etcd: how often leases expire and watches deliver.
const ETCD_TICK: u64 = 1_000;
/// etcd: a session that cannot reach etcd fails after this long.
const ETCD_DIAL_TIMEOUT: u64 = 20_000;

impl World {
    /// A world for `seed`.
    pub fn new(seed: u64, cfg: SimConfig) -> World {
        let mut rng = Rng::new(seed);
        let mut core_cfg = Config { bug: cfg.bug, trace: true, lookup_table: true, ..Config::default() };
        // One seed in four runs with short operation deadlines, so that
        // aborted changes (and their late messages) are common.
        if rng.below(4) == 0 {
            core_cfg.op_timeout_us = rng.range(15_000, 60_000);
        }
        // One seed in four with clocks ten times worse and thin margins,
        // and messages as fast as 1 us: every lease and grant margin is
        // then what stands between a slow clock and a reused slot.
        // Half the seeds announce in parts of 1-3 entries (each a batch
        // that can be lost, duplicated or reordered on its own).
        if rng.below(2) == 0 {
            core_cfg.announce_entries_max = rng.range(1, 4) as usize;
        }
        // One seed in four is calm: crashes, stalls, drains and isolations
        // ten times rarer, so epochs last and late messages (a stuck
        // stream's) meet the same view, directory and copies.
        let calm = rng.below(4) == 0;
        let tight = rng.below(4) == 0;
        if tight {
            core_cfg.drift_ppm = 2_000;
            core_cfg.drift_margin_us = 100;
        }
        let nodes = (0..cfg.nodes)
            .map(|_| SimNode {
                core: None,
                membership: None,
                etcd: None,
                session: None,
                next_session: 0,
                etcd_cut_until: 0,
                to_etcd_at: 0,
                from_etcd_at: 0,
                incarnation: 0,
                clock: Clock {
                    offset: rng.range(0, 1_000_000),
                    rate_ppm: rng.range(0, 2 * core_cfg.drift_ppm) as i64 - core_cfg.drift_ppm as i64,
                },
                mem: vec![
                    Cell {
                        state: CellState::Free,
                        generation: 0,
                        header: blank_meta(),
                        trailer: blank_meta(),
                        content: 0
                    };
                    cfg.slots + 2 * cfg.background
                ],
                free: (0..(cfg.slots + 2 * cfg.background) as u32).collect(),
                tick_at: None,
                isolated_until: 0,
                paused_until: 0,
                down_until: 0,
                crash_loop: 0,
                table: HashMap::new(),
            })
            .collect();
        let mut w = World {
            cfg,
            core_cfg,
            seed,
            rng,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            nodes,
            persisted_epoch: 0,
            min_delay: if tight { 1 } else { 20 },
            etcd: EtcdModel::default(),
            etcd_ttl: 0,
            max_published: 0,
            last_published: None,
            listed_since: None,
            loop_rng: (seed.wrapping_mul(0xd6e8_feb8_6659_fd93) >> 61 == 0).then(|| Rng::new(seed ^ 0x5eed_100b)),
            assigned_at: HashMap::new(),
            acked_puts: HashMap::new(),
            pins: HashMap::new(),
            ops: BTreeMap::new(),
            next_op: 0,
            truth: HashMap::new(),
            max_committed: HashMap::new(),
            completed: HashMap::new(),
            lookups: HashMap::new(),
            ever_held: HashSet::new(),
            pending_fail: None,
            drives: 0,
            watched: BTreeSet::new(),
            pending_s3: Vec::new(),
            granted_by: HashMap::new(),
            trusted: HashMap::new(),
            faults: true,
            calm: if calm { 10 } else { 1 },
            stuck: HashMap::new(),
            workload: true,
            log: VecDeque::new(),
            stats: RunStats::default(),
            trace_log: false,
        };
        for n in 0..w.cfg.nodes as NodeId {
            w.boot(n);
        }
        w.watched = (0..(w.cfg.keys + w.cfg.cold_keys) as u128).map(|key| BlockKey { ns: 7, key }).collect();
        w.push(1_000, Ev::ClientOp);
        w.push(MEMBERSHIP_TICK, Ev::MembershipTick);
        // The daemon requires lease_ttl > protocol lease + 2 margins; the
        // planted bug breaks that rule.
        let lease = w.core_cfg.membership_lease_us;
        w.etcd_ttl = if w.cfg.bug == Some(Bug::EtcdShortTtl) { lease / 2 } else { lease * 3 / 2 };
        if w.cfg.etcd {
            w.push(ETCD_TICK, Ev::EtcdTick);
        }
        w
    }

    /// Log every event to stderr (for debugging one seed).
    pub fn verbose(&mut self) {
        self.trace_log = true;
    }

    fn push(&mut self, delay: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Queued { at: self.now + delay, seq: self.seq, ev });
    }

    fn note(&mut self, s: String) {
        if self.trace_log {
            eprintln!("{s}");
        }
        if self.log.len() >= 40 {
            self.log.pop_front();
        }
        self.log.push_back(s);
    }

    fn violation(&self, invariant: &'static str, detail: String) -> Violation {
        Violation { seed: self.seed, invariant, detail, trace: self.log.iter().cloned().collect() }
    }

    fn boot(&mut self, n: NodeId) {
        let sn = &mut self.nodes[n as usize];
        sn.incarnation += 1;
        // Locate-time registration on, except in one seed in four, where
        // each incarnation of each node picks (readers of both kinds meet
        // the same homes, as in a rolling change of the setting). Drawn
        // from the seed, not from the world's random stream.
        let mut cfg = self.core_cfg.clone();
        if self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 62 == 0 {
            let h = (self.seed ^ ((n as u64) << 32) ^ sn.incarnation).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            cfg.register_at_locate = h >> 63 == 0;
        }
        sn.core = Some(Node::new(n, sn.incarnation, cfg));
        sn.table.clear();
        for c in sn.mem.iter_mut() {
            c.state = CellState::Free;
        }
        sn.free = (0..sn.mem.len() as u32).collect();
        sn.tick_at = None;
        let local = self.local_now(n);
        let mcfg = StaticConfig {
            me: n,
            coordinator: COORDINATOR,
            removal_us: self.core_cfg.membership_lease_us + 2 * self.core_cfg.drift_margin_us,
            epoch_floor: if n == COORDINATOR { self.persisted_epoch } else { 0 },
            skip_restart_wait: self.cfg.bug == Some(Bug::CoordinatorNoWait),
            take_capacity_changes: self.cfg.bug == Some(Bug::CapacityPerKeepalive),
            admit_every_incarnation: self.cfg.bug == Some(Bug::IncarnationPerKeepalive),
        };
        if self.cfg.etcd {
            let inc = self.nodes[n as usize].incarnation;
            let sn = &mut self.nodes[n as usize];
            sn.etcd = Some(EtcdMember::new(n, inc));
            sn.session = None;
            self.push(0, Ev::EtcdConnect { node: n, inc });
        } else {
            self.nodes[n as usize].membership = Some(static_membership(mcfg, local));
        }
        let sn = &mut self.nodes[n as usize];
        if sn.crash_loop > 0 {
            // In a crash loop: fails again soon, once its first keepalive
            // has (mostly) reached the coordinator.
            sn.crash_loop -= 1;
            let inc = sn.incarnation;
            if let Some(r) = self.loop_rng.as_mut() {
                let up = r.range(2_000, 20_000);
                self.push(up, Ev::LoopCrash { node: n, inc });
            }
        }
        self.drive(n, Event::Tick);
    }

    fn up(&self, n: NodeId) -> bool {
        self.nodes[n as usize].core.is_some()
    }

    fn reachable(&self, n: NodeId) -> bool {
        self.up(n) && self.nodes[n as usize].isolated_until <= self.now
    }

    fn local_now(&self, n: NodeId) -> u64 {
        self.nodes[n as usize].clock.local(self.now)
    }

    /// Feeds an event to a node and carries out its actions.
    fn drive(&mut self, n: NodeId, ev: Event) {
        let local = self.local_now(n);
        let Some(core) = self.nodes[n as usize].core.as_mut() else { return };
        let actions = core.handle(local, ev);
        self.after_drive(n, actions);
    }

    /// A lookup of node `n` answered from the homes' lookup tables, read
    /// one-sided at this instant: a home's table is readable while the
    /// home is up, paused or not (a stopped process's memory stays
    /// mapped), and unreadable while it is down or either side is cut off.
    fn drive_lookup_tables(&mut self, n: NodeId, op: OpId, keys: Vec<BlockKey>) {
        let local = self.local_now(n);
        let Some(mut core) = self.nodes[n as usize].core.take() else { return };
        let asker_cut = self.nodes[n as usize].isolated_until > self.now;
        let nodes = &self.nodes;
        let now = self.now;
        let mut read = |h: NodeId, k: &BlockKey| {
            let sn = nodes.get(h as usize)?;
            if asker_cut || sn.isolated_until > now {
                return None;
            }
            let c = sn.core.as_ref()?;
            Some((c.table_header(), sn.table.get(k).copied()))
        };
        let actions = core.lookup_tables(local, op, keys, &mut read);
        self.nodes[n as usize].core = Some(core);
        self.after_drive(n, actions);
    }

    /// The checks and actions that follow feeding node `n` an event.
    fn after_drive(&mut self, n: NodeId, actions: Vec<Action>) {
        let sn = &mut self.nodes[n as usize];
        let core = sn.core.as_mut().expect("driven");
        let changes = core.take_table_changes();
        if changes.reset {
            sn.table.clear();
        }
        for (k, e) in changes.entries {
            match e {
                Some(e) => sn.table.insert(k, e),
                None => sn.table.remove(&k),
            };
        }
        let core = sn.core.as_ref().expect("driven");
        self.drives += 1;
        if self.drives.is_multiple_of(self.cfg.check_every) {
            if let Err(e) = core.check_incremental() {
                self.pending_fail.get_or_insert_with(|| ("INCR", format!("node {n}: {e}")));
            }
            // TABLE: the table kept from the changes is what the directory
            // says now, key by key.
            let wrong = sn
                .table
                .keys()
                .copied()
                .chain(core.directory().map(|(k, _)| k))
                .find(|k| sn.table.get(k).copied() != core.table_entry(k));
            if let Some(k) = wrong {
                let f = format!(
                    "node {n}: table says {:?} of {:?}, the directory {:?}",
                    sn.table.get(&k),
                    { k.key },
                    core.table_entry(&k)
                );
                self.pending_fail.get_or_insert(("TABLE", f));
            }
        }
        let core = self.nodes[n as usize].core.as_mut().expect("driven");
        let traces = core.take_trace();
        let next = core.next_timeout();
        let inc = core.incarnation();
        for t in traces {
            if let Trace::Registered { key, version, holder } = t {
                self.ever_held.insert((holder, key, version));
            }
            if let Trace::ChangeCompleted { key, old_version, new_version } = t {
                self.completed.entry(key).or_default().push((old_version, self.now));
                self.pending_s3.push((key, old_version));
                if let Some(v) = new_version {
                    self.assigned_at.entry((key, v)).or_insert(self.now);
                }
            }
        }
        for a in actions {
            self.act(n, inc, a);
        }
        if let Some(t) = next {
            // Timers fire late sometimes (a busy or descheduled driver): a
            // lapsed lease or a deadline may meet other events before its
            // tick.
            let late = if self.faults && self.rng.chance(0.3) { self.rng.range(0, 4_000) } else { 0 };
            let real = self.nodes[n as usize].clock.real(t).max(self.now + 1) + late;
            let sn = &mut self.nodes[n as usize];
            if sn.tick_at.is_none_or(|cur| real < cur || cur <= self.now) {
                sn.tick_at = Some(real);
                let d = real - self.now;
                self.push(d, Ev::Tick { node: n });
            }
        }
    }
}

fn blank_meta() -> SlotMeta {
    SlotMeta { key: BlockKey { ns: 0, key: 0 }, version: 0, generation: 0, checksum: 0 }
}

impl World {
    fn alloc(&mut self, n: NodeId) -> Option<SlotRef> {
        let sn = &mut self.nodes[n as usize];
        let i = *sn.free.first()? as usize;
        // S4 at the moment of reuse: no reader may still trust a grant of
        // the slot's previous use (a grant of a process that died with its
        // memory does not count: one-sided reads of it fail).
        let old = SlotRef { slot: i as u32, generation: sn.mem[i].generation };
        if let Some(reads) = self.trusted.remove(&(n, old))
            && let Some(&(_, until)) =
                reads.iter().filter(|(inc, until)| *inc == sn.incarnation && *until > self.now).max_by_key(|r| r.1)
        {
            self.pending_fail.get_or_insert_with(|| {
                ("S4", format!("node {n} reuses slot {old:?} while a read not yet done trusts its grant until {until}"))
            });
        }
        let sn = &mut self.nodes[n as usize];
        sn.free.remove(&(i as u32));
        let c = &mut sn.mem[i];
        c.state = CellState::Used;
        c.generation += 1;
        Some(SlotRef { slot: i as u32, generation: c.generation })
    }

    fn act(&mut self, n: NodeId, inc: u64, a: Action) {
        match a {
            Action::Send { to, batch } => {
                for m in &batch.msgs {
                    if let kvmesh_coherence::Msg::GrantResp {
                        result: kvmesh_coherence::GrantResult::Granted { slot, .. },
                        ..
                    } = m
                    {
                        self.granted_by.insert((n, *slot), inc);
                    }
                }
                if self.faults && self.reachable(n) {
                    let op_timeout = self.core_cfg.op_timeout_us;
                    let held = match self.stuck.get(&(n, to)) {
                        Some(&(until, release)) if self.now < until => Some(release),
                        _ if self.rng.chance(self.cfg.stuck_link_per_mille as f64 / 1000.0) => {
                            // (Some seeds' op timeouts are below the
                            // retransmit interval.)
                            let lo = self.core_cfg.retransmit_us.min(op_timeout / 2);
                            let until = self.now + self.rng.range(lo, op_timeout);
                            let release = until + self.rng.range(op_timeout, 3 * op_timeout);
                            self.stuck.insert((n, to), (until, release));
                            self.note(format!(
                                "t={} n{n}->n{to} stream stuck until {until}, held until {release}",
                                self.now
                            ));
                            Some(release)
                        }
                        _ => None,
                    };
                    if let Some(release) = held {
                        if self.trace_log {
                            self.note(format!("t={} n{n}->n{to} held until {release}: {:?}", self.now, batch.msgs));
                        }
                        let d = release - self.now + self.rng.range(0, 1_000);
                        self.push(d, Ev::Deliver { to, from: n, batch });
                        return;
                    }
                    if self.rng.chance(self.cfg.late_duplicate_per_mille as f64 / 1000.0) {
                        // Delivered once more, long after (sent again on a
                        // new stream after a reconnect, the old one also
                        // got through).
                        let d = self.rng.range(op_timeout, 3 * op_timeout);
                        self.push(d, Ev::Deliver { to, from: n, batch: batch.clone() });
                    }
                }
                if !self.faults || (self.rng.chance(0.97) && self.reachable(n)) {
                    let copies = if self.faults && self.rng.chance(0.03) { 2 } else { 1 };
                    for _ in 0..copies {
                        let d = if self.faults && self.rng.chance(self.cfg.long_delay_per_mille as f64 / 1000.0) {
                            // The long tail: a batch of a change (or epoch)
                            // that ended long ago.
                            self.rng.range(20_000, 300_000)
                        } else if self.rng.chance(0.05) {
                            self.rng.range(2_000, 8_000)
                        } else {
                            self.rng.range(self.min_delay, 600)
                        };
                        self.push(d, Ev::Deliver { to, from: n, batch: batch.clone() });
                    }
                }
            }
            Action::StartRead { op, from, remote, expect: _, deadline } => {
                let deadline_real = self.nodes[n as usize].clock.real(deadline);
                let d = if self.rng.chance(0.01) {
                    self.rng.range(20_000, 80_000) // a read slower than the grant
                } else {
                    self.rng.range(5, 2_000)
                };
                let holder_inc = self.granted_by.get(&(from, remote)).copied().unwrap_or(0);
                self.trusted.entry((from, remote)).or_default().push((holder_inc, deadline_real));
                self.push(
                    d,
                    Ev::ReadExec(Read {
                        reader: n,
                        reader_inc: inc,
                        op,
                        holder: from,
                        holder_inc,
                        remote,
                        deadline_real,
                    }),
                );
            }
            Action::CommitSlot { slot, meta } => {
                self.ever_held.insert((n, meta.key, meta.version));
                let c = &mut self.nodes[n as usize].mem[slot.slot as usize];
                c.header = meta;
                c.trailer = meta;
                let content = c.content;
                self.commit_check(n, meta, content);
            }
            Action::FreeSlot { slot } => {
                let sn = &mut self.nodes[n as usize];
                let c = &mut sn.mem[slot.slot as usize];
                if c.state == CellState::Used && c.generation == slot.generation {
                    c.state = CellState::Free;
                    sn.free.insert(slot.slot);
                }
            }
            Action::KeepAlive { sent_at } if self.cfg.etcd => self.etcd_keepalive(n, inc, sent_at),
            Action::KeepAlive { sent_at } => {
                let epoch_seen = self.nodes[n as usize].core.as_ref().map_or(0, |c| c.view().epoch);
                // The last node is a member that names another capacity in
                // every other keepalive (buggy or hostile: a daemon's
                // capacity changes only with a restart); the others 1.
                let flapping = n as usize + 1 == self.nodes.len() && n > 0;
                let capacity = if flapping { 1 + (sent_at / 1000 % 2) as u32 } else { 1 };
                let ka = KeepAlive { node: n, incarnation: inc, sent_at_us: sent_at, epoch_seen, capacity };
                let local = self.local_now(n);
                let Some(m) = self.nodes[n as usize].membership.as_mut() else { return };
                let actions = m.keepalive(ka, local);
                self.membership_actions(n, actions);
            }
            Action::ClientDone { op, outcome } => self.client_done(n, inc, op, outcome),
            Action::LookupDone { op, found, complete: _ } => self.lookup_done(n, inc, op, found),
        }
    }

    fn commit_check(&mut self, n: NodeId, meta: SlotMeta, content: u64) {
        if let Some(&max) = self.max_committed.get(&meta.key)
            && meta.version <= max
        {
            self.pending_fail.get_or_insert_with(|| {
                ("S5", format!("node {n} committed {:?} v{:#x}, not above v{max:#x}", { meta.key.key }, meta.version))
            });
        }
        self.max_committed.insert(meta.key, meta.version);
        if let Some(&c) = self.truth.get(&(meta.key, meta.version))
            && c != content
        {
            self.pending_fail
                .get_or_insert_with(|| ("S5", format!("two contents for one version {:#x}", meta.version)));
        }
        self.truth.insert((meta.key, meta.version), content);
        self.stats.stored += 1;
    }

    fn client_done(&mut self, n: NodeId, inc: u64, op: OpId, outcome: Outcome) {
        let Some(info) = self.ops.remove(&(n, inc, op)) else {
            self.pending_fail.get_or_insert_with(|| ("L2", format!("node {n} answered unknown op {op}")));
            return;
        };
        self.note(format!("t={} n{n} op{op} {info:?} -> {outcome:?}", self.now));
        if let OpInfo::Lookup = info {
            // Refused (not a member, overloaded): an error, never an answer.
            self.lookups.remove(&(n, inc, op));
            if !matches!(outcome, Outcome::Error(_)) {
                self.pending_fail
                    .get_or_insert_with(|| ("LOOKUP", format!("node {n} ended lookup {op} with {outcome:?}")));
            }
        }
        if let (OpInfo::Put { key }, Outcome::Stored { version }) = (info, outcome) {
            match self.assigned_at.get(&(key, version)) {
                Some(&at) => self.acked_puts.entry(key).or_default().push((self.now, at)),
                None => {
                    self.pending_fail.get_or_insert_with(|| {
                        (
                            "S7",
                            format!("node {n} reported {:?} stored at v{version:#x}, a version no home assigned", {
                                key.key
                            }),
                        )
                    });
                }
            }
        }
        if let (OpInfo::Get { key, start }, Outcome::Hit { version, slot }) = (info, outcome) {
            self.stats.hits += 1;
            self.ever_held.insert((n, key, version));
            // S7: a put reported stored before this read started is not
            // undone by an older version.
            match self.assigned_at.get(&(key, version)).copied() {
                None => {
                    self.pending_fail.get_or_insert_with(|| {
                        (
                            "S7",
                            format!("node {n} served {:?} v{version:#x}, a version no client call created", {
                                key.key
                            }),
                        )
                    });
                }
                Some(at) => {
                    if let Some(&(acked, newer)) =
                        self.acked_puts.get(&key).and_then(|l| l.iter().find(|(t, a)| *t < start && *a > at))
                    {
                        self.pending_fail.get_or_insert_with(|| {
                            ("S7", format!("node {n} served {:?} v{version:#x} (assigned at {at}) to a read started at {start}, after a put assigned at {newer} was reported stored at {acked}", { key.key }))
                        });
                    }
                }
            }
            let cell = self.nodes[n as usize].mem[slot.slot as usize];
            let want = self.truth.get(&(key, version)).copied();
            if cell.state != CellState::Used
                || cell.generation != slot.generation
                || cell.header.key != key
                || cell.header.version != version
                || Some(cell.content) != want
            {
                self.pending_fail.get_or_insert_with(|| {
                    (
                        "DATA",
                        format!(
                            "node {n} served {:?} v{version:#x} from slot {slot:?} holding {cell:?}, truth {want:?}",
                            { key.key }
                        ),
                    )
                });
            }
            if let Some(&(old, at)) =
                self.completed.get(&key).and_then(|l| l.iter().find(|(old, at)| version <= *old && *at < start))
            {
                self.pending_fail.get_or_insert_with(|| {
                    ("S2", format!("change of {:?} away from v{old:#x} completed at {at}; a read started at {start} on node {n} returned v{version:#x}", { key.key }))
                });
            }
            // Engines read for a while, then unpin; until then the slot
            // keeps its bytes (checked after every event).
            self.pins.entry((n, inc, slot)).or_insert((0, cell.content)).0 += 1;
            let d = self.rng.range(10, 5_000);
            self.push(d, Ev::Unpin { node: n, inc, slot });
        }
        if outcome == Outcome::Invalidated {
            self.stats.invalidated += 1;
        }
    }

    /// LOOKUP: a key a lookup reported at node `h` with version `v`: `v`
    /// is a version a home assigned; no change away from `v` (or a later
    /// version) completed before the lookup started (`v` was current at
    /// some moment of the call); and `h` held a Valid copy of `v`, or its
    /// home registered `h` as holding it, at some point (the answer is the
    /// directory's, never a put the home has not answered or a node it
    /// never registered).
    fn lookup_done(&mut self, n: NodeId, inc: u64, op: OpId, found: Vec<Option<(NodeId, u64)>>) {
        let (Some(OpInfo::Lookup), Some((keys, start))) =
            (self.ops.remove(&(n, inc, op)), self.lookups.remove(&(n, inc, op)))
        else {
            self.pending_fail.get_or_insert_with(|| ("L2", format!("node {n} ended unknown lookup {op}")));
            return;
        };
        self.note(format!(
            "t={} n{n} op{op} lookup {:?} -> {found:?}",
            self.now,
            keys.iter().map(|k| k.key).collect::<Vec<_>>()
        ));
        self.stats.lookups += 1;
        let one_sided = self.cfg.one_sided_lookups && op.is_multiple_of(2);
        self.stats.lookups_one_sided += u64::from(one_sided);
        if found.len() != keys.len() {
            self.pending_fail.get_or_insert_with(|| {
                ("LOOKUP", format!("node {n}: {} answers for {} keys", found.len(), keys.len()))
            });
            return;
        }
        for (key, f) in keys.iter().zip(found) {
            let Some((h, v)) = f else { continue };
            if h != n {
                self.stats.lookup_remote_hits += 1;
                self.stats.lookup_one_sided_remote_hits += u64::from(one_sided);
            }
            let fail = if !self.assigned_at.contains_key(&(*key, v)) {
                Some(format!("node {n} reported {:?} at node {h} v{v:#x}, a version no home assigned", { key.key }))
            } else if let Some(&(old, at)) =
                self.completed.get(key).and_then(|l| l.iter().find(|(old, at)| v <= *old && *at < start))
            {
                Some(format!(
                    "node {n} reported {:?} at node {h} v{v:#x} to a lookup started at {start}; a change away from v{old:#x} completed at {at}",
                    { key.key }
                ))
            } else if !self.ever_held.contains(&(h, *key, v)) {
                Some(format!(
                    "node {n} reported {:?} at node {h} v{v:#x}, a copy node {h} never held nor was registered for",
                    { key.key }
                ))
            } else {
                None
            };
            if let Some(f) = fail {
                self.pending_fail.get_or_insert(("LOOKUP", f));
                return;
            }
        }
    }

    fn client_lookup(&mut self, n: NodeId) {
        self.next_op += 1;
        let op = self.next_op;
        let inc = self.nodes[n as usize].incarnation;
        let len = self.rng.range(1, 9);
        let keys: Vec<BlockKey> =
            (0..len).map(|_| BlockKey { ns: 7, key: self.rng.below(self.cfg.keys as u64) as u128 }).collect();
        self.ops.insert((n, inc, op), OpInfo::Lookup);
        self.lookups.insert((n, inc, op), (keys.clone(), self.now));
        // Every other lookup reads the homes' tables one-sided (chosen by
        // the op number: no draw from the RNG).
        if self.cfg.one_sided_lookups && op.is_multiple_of(2) {
            self.drive_lookup_tables(n, op, keys);
        } else {
            self.drive(n, Event::ClientLookup { op, keys });
        }
    }

    fn client_op(&mut self) {
        let n = self.rng.below(self.cfg.nodes as u64) as NodeId;
        if !self.up(n) || self.nodes[n as usize].paused_until > self.now {
            return;
        }
        let mut cold = false;
        let key = if self.cfg.background > 0 && self.rng.below(10) == 0 {
            let k = BlockKey { ns: 8, key: self.rng.below(self.cfg.background as u64) as u128 };
            self.watched.insert(k);
            k
        } else if self.cfg.cold_keys > 0 && self.rng.below(5) == 0 {
            cold = true;
            BlockKey { ns: 7, key: (self.cfg.keys as u64 + self.rng.below(self.cfg.cold_keys as u64)) as u128 }
        } else {
            BlockKey { ns: 7, key: self.rng.below(self.cfg.keys as u64) as u128 }
        };
        self.stats.ops += 1;
        let mut roll = self.rng.below(100);
        if cold {
            // Gets, evictions (the next get fetches the same version
            // again), rare puts.
            roll = match roll {
                0..91 => 0,
                91..99 => 99,
                _ => 55,
            };
        }
        if roll < 47 {
            self.client_get(n, key);
        } else if roll < 55 {
            self.client_lookup(n);
        } else if roll < 80 {
            self.client_put(n, key);
        } else if roll < 88 {
            self.next_op += 1;
            let op = self.next_op;
            let inc = self.nodes[n as usize].incarnation;
            self.ops.insert((n, inc, op), OpInfo::Invalidate);
            self.drive(n, Event::ClientInvalidate { op, key });
        } else {
            self.drive(n, Event::Evict { key, slot: None });
        }
    }

    fn client_get(&mut self, n: NodeId, key: BlockKey) {
        self.next_op += 1;
        let op = self.next_op;
        let inc = self.nodes[n as usize].incarnation;
        self.ops.insert((n, inc, op), OpInfo::Get { key, start: self.now });
        self.drive(n, Event::ClientGet { op, key });
    }

    fn client_put(&mut self, n: NodeId, key: BlockKey) {
        self.next_op += 1;
        let op = self.next_op;
        let inc = self.nodes[n as usize].incarnation;
        // The engine writes the block into a free slot first.
        let slot = match self.alloc(n) {
            Some(s) => Some(s),
            None => {
                let keys: Vec<BlockKey> = self.nodes[n as usize]
                    .core
                    .as_ref()
                    .map(|c| c.copies().map(|(k, _, _)| k).collect())
                    .unwrap_or_default();
                for k in keys {
                    self.drive(n, Event::Evict { key: k, slot: None });
                }
                self.alloc(n)
            }
        };
        let Some(slot) = slot else { return };
        let content = self.rng.next_u64();
        let c = &mut self.nodes[n as usize].mem[slot.slot as usize];
        c.content = content;
        c.header = SlotMeta { key, version: 0, generation: slot.generation, checksum: content };
        c.trailer = c.header;
        self.ops.insert((n, inc, op), OpInfo::Put { key });
        self.drive(n, Event::ClientPut { op, key, slot, checksum: content });
    }

    /// Scale runs: puts every background key (on node `key % nodes`), then
    /// reads a fifth of them on the next node, without faults, before the
    /// fault phase starts.
    fn prefill(&mut self) -> Result<(), Violation> {
        self.faults = false;
        self.workload = false;
        self.run_for(3_000_000)?;
        let nodes = self.cfg.nodes as u64;
        for i in 0..self.cfg.background as u64 {
            self.client_put((i % nodes) as NodeId, BlockKey { ns: 8, key: i as u128 });
            if i % 512 == 511 {
                self.run_for(2_000)?;
            }
        }
        self.run_for(500_000)?;
        for i in (0..self.cfg.background as u64).step_by(5) {
            self.client_get(((i + 1) % nodes) as NodeId, BlockKey { ns: 8, key: i as u128 });
            if i % 2560 == 2555 {
                self.run_for(2_000)?;
            }
        }
        self.run_for(500_000)?;
        self.stats.prefilled = self.nodes.iter().filter_map(|n| n.core.as_ref()).map(|c| c.copy_count() as u64).sum();
        self.faults = true;
        self.workload = true;
        self.push(1, Ev::ClientOp);
        Ok(())
    }

    fn read_exec(&mut self, r: Read) {
        let Read { reader, reader_inc, op, holder, holder_inc, remote, deadline_real } = r;
        if let Some(reads) = self.trusted.get_mut(&(holder, remote))
            && let Some(i) = reads.iter().position(|&x| x == (holder_inc, deadline_real))
        {
            reads.swap_remove(i);
        }
        let ok = self.reachable(holder)
            && self.nodes[holder as usize].incarnation == holder_inc
            && self.reachable(reader)
            && (!self.faults || self.rng.chance(0.98));
        let result = if !ok {
            Err(TransferError::PeerGone)
        } else {
            let cell = self.nodes[holder as usize].mem[remote.slot as usize];
            // S4: the slot must still hold the granted use while the reader
            // can trust its grant.
            if (cell.state != CellState::Used || cell.generation != remote.generation) && self.now < deadline_real {
                self.pending_fail.get_or_insert_with(|| {
                    ("S4", format!("node {holder} reused slot {remote:?} (now gen {}) while node {reader}'s grant was usable until {deadline_real}", cell.generation))
                });
            }
            let mut img = cell;
            if self.faults && self.rng.chance(0.05) {
                match self.rng.below(3) {
                    0 => img.trailer.generation += 1,            // torn: reused during the read
                    1 => img.content ^= 1 << self.rng.below(64), // torn payload
                    _ => {
                        img.header.generation += 1; // another occupant, consistent image
                        img.trailer.generation += 1;
                        img.content = self.rng.next_u64();
                        img.header.checksum = img.content;
                        img.trailer.checksum = img.content;
                    }
                }
            }
            Ok(img)
        };
        let d = self.rng.range(5, 500);
        self.push(d, Ev::TransferDone { reader, reader_inc, op, result });
    }

    fn transfer_done(&mut self, reader: NodeId, reader_inc: u64, op: OpId, result: Result<Cell, TransferError>) {
        if self.nodes[reader as usize].incarnation != reader_inc || !self.up(reader) {
            return;
        }
        let (dest, res) = match result {
            Err(e) => (None, Err(e)),
            Ok(img) => match self.alloc(reader) {
                None => (None, Err(TransferError::NoSpace)),
                Some(dest) => {
                    let c = &mut self.nodes[reader as usize].mem[dest.slot as usize];
                    c.content = img.content;
                    // The copy lands in a slot of our own generation; header
                    // and trailer say what was read.
                    c.header = SlotMeta { generation: dest.generation, ..img.header };
                    c.trailer = SlotMeta { generation: dest.generation, ..img.trailer };
                    (
                        Some(dest),
                        Ok(SlotImage { header: img.header, trailer: img.trailer, payload_checksum: img.content }),
                    )
                }
            },
        };
        self.drive(reader, Event::TransferDone { op, dest, result: res });
    }

    // ----- membership service -----

    /// Carries out what node `n`'s membership service asks, over the
    /// simulated network (the coordinator's own acknowledgements and views
    /// are local events, queued like the daemon queues them).
    fn membership_actions(&mut self, n: NodeId, actions: Vec<MembershipAction>) {
        for a in actions {
            match a {
                MembershipAction::Forward { to, ka } => {
                    if self.reachable(n) && (!self.faults || self.rng.chance(0.97)) {
                        let d = self.rng.range(10, KEEPALIVE_DELAY_MAX);
                        self.push(d, Ev::KeepAlive { to, ka });
                    }
                }
                MembershipAction::Ack { to, sent_at_us, view } => {
                    let Some(inc) = view.member(to).map(|m| m.incarnation) else { continue };
                    if self.reachable(n) && (!self.faults || self.rng.chance(0.97)) {
                        let d = self.rng.range(10, KEEPALIVE_DELAY_MAX);
                        self.push(d, Ev::KeepAliveAck { node: to, inc, sent_at: sent_at_us, view, local: false });
                    }
                }
                MembershipAction::AckLocal { sent_at_us } => {
                    let inc = self.nodes[n as usize].incarnation;
                    let view = self.nodes[n as usize].core.as_ref().map(|c| c.view().clone()).unwrap_or_default();
                    self.push(0, Ev::KeepAliveAck { node: n, inc, sent_at: sent_at_us, view, local: true });
                }
                MembershipAction::Persist(e) => self.persisted_epoch = e,
                MembershipAction::Publish(view) => self.publish(n, view),
                MembershipAction::ForwardLeave { to, node, incarnation } => {
                    if self.reachable(n) && (!self.faults || self.rng.chance(0.97)) {
                        let d = self.rng.range(10, KEEPALIVE_DELAY_MAX);
                        self.push(d, Ev::Leave { to, node, inc: incarnation });
                    }
                }
            }
        }
    }

    /// A view published by the coordinator on node `n`: checks M1, then
    /// sends it to every member.
    fn publish(&mut self, n: NodeId, view: View) {
        self.check_m1(&view);
        self.check_cap(n, &view);
        self.check_inc(n, &view);
        for m in &view.members {
            if m.id == n {
                self.push(0, Ev::View { node: n, inc: m.incarnation, view: view.clone(), local: true });
            } else if self.reachable(n) && (!self.faults || self.rng.chance(0.97)) {
                let d = self.rng.range(10, KEEPALIVE_DELAY_MAX);
                self.push(d, Ev::View { node: m.id, inc: m.incarnation, view: view.clone(), local: false });
            }
        }
    }

    /// M1 at the moment a view is published: its epoch is above every
    /// earlier one (across restarts of the coordinator, or of etcd and
    /// every daemon), and it leaves out no node that may still serve under
    /// a lease granted before it.
    /// CAP: between two views one coordinator incarnation publishes, a
    /// member incarnation listed in both keeps its capacity (a capacity
    /// changes only with a restart; a coordinator taking it from each
    /// keepalive publishes a view per keepalive of a member that names
    /// another one each time, and every view rebuilds every directory).
    fn check_cap(&mut self, n: NodeId, view: &View) {
        let inc = self.nodes[n as usize].incarnation;
        if let Some((pn, pinc, prev)) = &self.last_published
            && (*pn, *pinc) == (n, inc)
        {
            for m in &view.members {
                if let Some(p) = prev.member(m.id).filter(|p| p.incarnation == m.incarnation)
                    && p.capacity != m.capacity
                {
                    self.pending_fail.get_or_insert_with(|| {
                        (
                            "CAP",
                            format!(
                                "view e{} lists node {} (incarnation {}) with capacity {}, e{} with {}",
                                view.epoch, m.id, m.incarnation, m.capacity, prev.epoch, p.capacity
                            ),
                        )
                    });
                }
            }
        }
        self.last_published = Some((n, inc, view.clone()));
    }

    /// INC: one coordinator incarnation lists a new incarnation of a node
    /// at most once per removal time (by its clock): each admission is a
    /// view, and every view clears and rebuilds every directory, so a
    /// daemon in a crash loop, or a member naming a new incarnation in
    /// every keepalive, must not make it publish a view per restart.
    fn check_inc(&mut self, n: NodeId, view: &View) {
        let (inc, local) = (self.nodes[n as usize].incarnation, self.local_now(n));
        let removal = self.core_cfg.membership_lease_us + 2 * self.core_cfg.drift_margin_us;
        if self.listed_since.as_ref().is_none_or(|(pn, pinc, _)| (*pn, *pinc) != (n, inc)) {
            self.listed_since = Some((n, inc, BTreeMap::new()));
        }
        let Some((_, _, since)) = self.listed_since.as_mut() else { return };
        let mut fail = None;
        for m in &view.members {
            match since.get(&m.id) {
                Some(&(i, _)) if i == m.incarnation => {}
                Some(&(i, at)) if local.saturating_sub(at) < removal => {
                    fail.get_or_insert(format!(
                        "view e{} lists node {} as incarnation {}, {} µs after incarnation {i} (removal time {removal} µs)",
                        view.epoch,
                        m.id,
                        m.incarnation,
                        local.saturating_sub(at)
                    ));
                    since.insert(m.id, (m.incarnation, local));
                }
                _ => {
                    since.insert(m.id, (m.incarnation, local));
                }
            }
        }
        if let Some(f) = fail {
            self.pending_fail.get_or_insert(("INC", f));
        }
    }

    fn check_m1(&mut self, view: &View) {
        self.stats.epochs += 1;
        self.note(format!("t={} publish view e{} {:?}", self.now, view.epoch, view.members));
        if view.epoch <= self.max_published {
            self.pending_fail
                .get_or_insert_with(|| ("M1", format!("view e{} published after e{}", view.epoch, self.max_published)));
        }
        self.max_published = self.max_published.max(view.epoch);
        for (i, sn) in self.nodes.iter().enumerate() {
            let Some(core) = &sn.core else { continue };
            let member = view.member(i as NodeId).is_some_and(|m| m.incarnation == sn.incarnation);
            if !member && core.serving_at(sn.clock.local(self.now)) {
                self.pending_fail.get_or_insert_with(|| {
                    (
                        "M1",
                        format!(
                            "view e{} leaves out node {i} (incarnation {}), which still serves in e{} under its lease",
                            view.epoch,
                            sn.incarnation,
                            core.view().epoch
                        ),
                    )
                });
            }
        }
    }

    // ----- etcd model -----

    fn etcd_reachable(&self, n: NodeId) -> bool {
        self.etcd.down_until <= self.now && self.reachable(n) && self.nodes[n as usize].etcd_cut_until <= self.now
    }

    fn send_to_etcd(&mut self, n: NodeId, ev: Ev) {
        let at = (self.now + self.rng.range(10, 500)).max(self.nodes[n as usize].to_etcd_at);
        self.nodes[n as usize].to_etcd_at = at;
        self.push(at - self.now, ev);
    }

    fn send_from_etcd(&mut self, n: NodeId, ev: Ev) {
        let at = (self.now + self.rng.range(10, 500)).max(self.nodes[n as usize].from_etcd_at);
        self.nodes[n as usize].from_etcd_at = at;
        self.push(at - self.now, ev);
    }

    /// The session of node `n` cannot reach etcd: it fails after the dial
    /// timeout, like a gRPC stream that stopped answering.
    fn etcd_unreachable(&mut self, n: NodeId) {
        if let Some(sid) = self.nodes[n as usize].session.as_ref().map(|s| s.id) {
            let inc = self.nodes[n as usize].incarnation;
            self.push(ETCD_DIAL_TIMEOUT, Ev::EtcdFail { node: n, inc, sid });
        }
    }

    fn etcd_keepalive(&mut self, n: NodeId, inc: u64, sent_at: u64) {
        let Some(s) = self.nodes[n as usize].session.as_mut() else { return };
        if s.pending.len() >= 64 {
            return;
        }
        s.pending.push_back(sent_at);
        let (sid, lease) = (s.id, s.lease);
        if self.etcd_reachable(n) {
            self.send_to_etcd(n, Ev::EtcdKeepAlive { node: n, inc, sid, lease });
        } else {
            self.etcd_unreachable(n);
        }
    }

    /// What the node's etcd state machine says after new keys: hand a newer
    /// view to the core, propose the next one.
    fn etcd_after_keys(&mut self, n: NodeId, inc: u64) {
        let Some(m) = self.nodes[n as usize].etcd.as_mut() else { return };
        if m.registration_lost() {
            let sid = self.nodes[n as usize].session.as_ref().map_or(0, |s| s.id);
            self.push(0, Ev::EtcdFail { node: n, inc, sid });
            return;
        }
        let view = m.take_view();
        let proposal = m.proposal();
        if let Some(v) = view {
            self.drive(n, Event::View(v));
        }
        if let Some((expect, _, value)) = proposal
            && self.etcd_reachable(n)
        {
            self.send_to_etcd(n, Ev::EtcdTxn { node: n, expect, value });
        }
    }

    fn etcd_event(&mut self, ev: Ev) {
        match ev {
            Ev::EtcdConnect { node, inc } => {
                if self.nodes[node as usize].incarnation != inc || !self.up(node) {
                    return;
                }
                if !self.etcd_reachable(node) {
                    let d = self.rng.range(5_000, 50_000);
                    self.push(d, Ev::EtcdConnect { node, inc });
                    return;
                }
                self.etcd.next_lease += 1;
                let lease = self.etcd.next_lease;
                self.etcd.leases.insert(lease, self.now + self.etcd_ttl);
                let reg = self.etcd.put(&format!("/members/{node}"), etcd_member_value(inc, 1, "sim"), Some(lease));
                let snapshot = self.etcd.kv.iter().map(|(k, v)| (k.clone(), v.0.clone(), v.1)).collect();
                let sid = {
                    let sn = &mut self.nodes[node as usize];
                    sn.next_session += 1;
                    sn.next_session
                };
                let watch_next = self.etcd.log.len();
                self.send_from_etcd(node, Ev::EtcdSessionUp { node, inc, sid, lease, reg, snapshot, watch_next });
            }
            Ev::EtcdSessionUp { node, inc, sid, lease, reg, snapshot, watch_next } => {
                if self.nodes[node as usize].incarnation != inc || !self.up(node) {
                    return; // the lease expires on its own
                }
                if !self.reachable(node) {
                    // The answer never arrives: the connect times out and
                    // is retried (the lease expires on its own).
                    self.push(ETCD_DIAL_TIMEOUT, Ev::EtcdConnect { node, inc });
                    return;
                }
                let Some(m) = self.nodes[node as usize].etcd.as_mut() else { return };
                m.start_session(reg);
                for (k, v, r) in &snapshot {
                    m.apply(k, v, *r, false);
                }
                self.nodes[node as usize].session =
                    Some(EtcdSession { id: sid, lease, watch_next, pending: VecDeque::new(), watch_broken: false });
                self.etcd_after_keys(node, inc);
            }
            Ev::EtcdKeepAlive { node, inc, sid, lease } => {
                if !self.etcd_reachable(node) {
                    self.etcd_unreachable(node);
                    return;
                }
                let now = self.now;
                let ttl = self.etcd_ttl;
                let ok = match self.etcd.leases.get_mut(&lease) {
                    Some(e) => {
                        *e = now + ttl;
                        true
                    }
                    None => false,
                };
                self.send_from_etcd(node, Ev::EtcdKeepAliveResp { node, inc, sid, ok });
            }
            Ev::EtcdKeepAliveResp { node, inc, sid, ok } => {
                if self.nodes[node as usize].incarnation != inc {
                    return;
                }
                if !self.reachable(node) {
                    self.etcd_unreachable(node);
                    return;
                }
                let Some(s) = self.nodes[node as usize].session.as_mut().filter(|s| s.id == sid) else { return };
                let sent_at = s.pending.pop_front();
                if !ok {
                    self.push(0, Ev::EtcdFail { node, inc, sid });
                    return;
                }
                if let Some(sent_at) = sent_at
                    && self.nodes[node as usize].etcd.as_ref().is_some_and(|m| m.admits())
                {
                    self.drive(node, Event::KeepAliveAck { sent_at });
                }
            }
            Ev::EtcdTxn { node, expect, value } => {
                if self.etcd.down_until > self.now {
                    return;
                }
                let cur = self.etcd.kv.get("/view").map_or(0, |v| v.1);
                if cur == expect {
                    self.note(format!("t={} n{node} view txn at rev {cur}: {value}", self.now));
                    match parse_etcd_view(&value) {
                        Some((epoch, m)) => self.check_m1(&etcd_view(epoch, &m)),
                        // (Every proposal is a view `format_etcd_view` wrote:
                        // one that does not parse is a bug, not a view M1
                        // may skip.)
                        None => {
                            self.pending_fail
                                .get_or_insert(("M1", format!("n{node} proposed an unparsable view {value:?}")));
                        }
                    }
                    self.etcd.put("/view", value, None);
                }
            }
            Ev::EtcdWatch { node, inc, sid, entries } => {
                if self.nodes[node as usize].incarnation != inc {
                    return;
                }
                let reachable = self.reachable(node);
                let Some(s) = self.nodes[node as usize].session.as_mut().filter(|s| s.id == sid) else { return };
                if s.watch_broken {
                    return;
                }
                if !reachable {
                    // Lost: later deliveries would leave a gap in what the
                    // node knows (a stale member set it could propose).
                    s.watch_broken = true;
                    self.etcd_unreachable(node);
                    return;
                }
                let Some(m) = self.nodes[node as usize].etcd.as_mut() else { return };
                for (k, v, r, deleted) in &entries {
                    m.apply(k, v, *r, *deleted);
                }
                self.etcd_after_keys(node, inc);
            }
            Ev::EtcdFail { node, inc, sid } => {
                let sn = &mut self.nodes[node as usize];
                if sn.incarnation != inc || sn.session.as_ref().is_none_or(|s| s.id != sid) {
                    return;
                }
                sn.session = None;
                if let Some(m) = sn.etcd.as_mut() {
                    m.end_session();
                }
                self.note(format!("t={} n{node} etcd session {sid} failed", self.now));
                let d = self.rng.range(5_000, 50_000);
                self.push(d, Ev::EtcdConnect { node, inc });
            }
            Ev::EtcdTick => {
                if self.etcd.down_until <= self.now {
                    self.etcd.expire(self.now);
                    let len = self.etcd.log.len();
                    for n in 0..self.cfg.nodes as NodeId {
                        let Some(s) = self.nodes[n as usize].session.as_ref() else { continue };
                        if s.watch_next >= len || s.watch_broken {
                            continue;
                        }
                        if !self.etcd_reachable(n) {
                            self.etcd_unreachable(n);
                            continue;
                        }
                        let (sid, from) = (s.id, s.watch_next);
                        let entries = self.etcd.log[from..].to_vec();
                        self.nodes[n as usize].session.as_mut().expect("session").watch_next = len;
                        let inc = self.nodes[n as usize].incarnation;
                        self.send_from_etcd(n, Ev::EtcdWatch { node: n, inc, sid, entries });
                    }
                }
                self.push(ETCD_TICK, Ev::EtcdTick);
            }
            _ => unreachable!("not an etcd event"),
        }
    }

    fn membership_tick(&mut self) {
        for n in 0..self.cfg.nodes as NodeId {
            if self.nodes[n as usize].paused_until > self.now {
                continue;
            }
            let local = self.local_now(n);
            let Some(m) = self.nodes[n as usize].membership.as_mut() else { continue };
            let actions = m.tick(local);
            self.membership_actions(n, actions);
        }
        self.push(MEMBERSHIP_TICK, Ev::MembershipTick);
    }

    // ----- faults -----

    fn maybe_fault(&mut self) {
        if !self.faults {
            return;
        }
        if self.cfg.etcd {
            if self.rng.chance(0.0005) && self.etcd.down_until <= self.now {
                // etcd down (its state is durable); a new leader renews
                // every lease to a full TTL.
                let down = self.rng.range(5_000, 400_000);
                self.etcd.down_until = self.now + down;
                let renewed = self.now + down + self.etcd_ttl;
                for e in self.etcd.leases.values_mut() {
                    *e = (*e).max(renewed);
                }
                self.note(format!("t={} ETCD DOWN until {}", self.now, self.now + down));
            } else if self.rng.chance(0.001) {
                let n = self.rng.below(self.cfg.nodes as u64) as NodeId;
                let until = self.now + self.rng.range(5_000, 400_000);
                self.nodes[n as usize].etcd_cut_until = until;
                self.note(format!("t={} n{n} CUT FROM ETCD until {until}", self.now));
            }
        }
        let n = self.rng.below(self.cfg.nodes as u64) as NodeId;
        if self.calm > 1 && !self.rng.below(self.calm as u64).is_multiple_of(self.calm as u64) {
            return;
        }
        if self.rng.chance(0.001) && self.up(n) && self.nodes[n as usize].paused_until <= self.now {
            // A stall, sometimes past the node's lease.
            let until = self.now + self.rng.range(5_000, 300_000);
            self.nodes[n as usize].paused_until = until;
            self.note(format!("t={} PAUSE n{n} until {until}", self.now));
        } else if self.rng.chance(0.0015) && self.up(n) {
            self.push(0, Ev::Crash { node: n });
        } else if self.rng.chance(if self.cfg.bug == Some(Bug::LeaveBeforeStop) { 0.004 } else { 0.001 }) && self.up(n)
        {
            self.push(0, Ev::Drain { node: n });
        } else if self.rng.chance(0.002) && self.up(n) {
            let until = self.now + self.rng.range(5_000, 400_000);
            self.push(0, Ev::Isolate { node: n, until });
        }
    }

    /// The process of `n` ends (a crash, or the exit after a drain): it
    /// starts again later, mostly fast (inside the leases it, or as
    /// coordinator, granted), sometimes slowly.
    fn stop_process(&mut self, node: NodeId) {
        let inc = self.nodes[node as usize].incarnation;
        self.stats.incarnations_held_back +=
            self.nodes[node as usize].membership.as_ref().map_or(0, |m| m.incarnations_held_back());
        self.nodes[node as usize].core = None;
        self.nodes[node as usize].table.clear();
        self.nodes[node as usize].membership = None;
        self.nodes[node as usize].session = None;
        self.nodes[node as usize].etcd = None;
        self.ops.retain(|(n, i, _), _| !(*n == node && *i == inc));
        self.lookups.retain(|(n, i, _), _| !(*n == node && *i == inc));
        self.pins.retain(|(n, _, _), _| *n != node);
        let down = match self.loop_rng.as_mut() {
            Some(r) if self.nodes[node as usize].crash_loop > 0 => r.range(500, 5_000),
            _ if self.rng.chance(0.8) => self.rng.range(1_000, 60_000),
            _ => self.rng.range(60_000, 300_000),
        };
        self.nodes[node as usize].down_until = self.now + down;
        self.push(down, Ev::Restart { node });
    }

    /// A drain as the daemon does it: the core leaves first (it serves
    /// nothing from here on), then the membership is asked to remove the
    /// node (static: a message to the coordinator; etcd: the lease is
    /// revoked and the session ends for good); the process exits a little
    /// later. The planted bug asks the membership first and stops the core
    /// only at the exit.
    fn drain(&mut self, node: NodeId) {
        let inc = self.nodes[node as usize].incarnation;
        if self.cfg.bug != Some(Bug::LeaveBeforeStop) {
            self.drive(node, Event::Leave);
        }
        if self.cfg.etcd {
            let sn = &mut self.nodes[node as usize];
            sn.etcd = None;
            if let Some(s) = sn.session.take()
                && self.etcd_reachable(node)
            {
                self.send_to_etcd(node, Ev::EtcdRevoke { lease: s.lease });
            }
        } else {
            let local = self.local_now(node);
            if let Some(m) = self.nodes[node as usize].membership.as_mut() {
                let actions = m.leave(node, inc, local);
                self.membership_actions(node, actions);
            }
        }
        let d = self.rng.range(1_000, 30_000);
        self.push(d, Ev::Exit { node, inc });
    }

    fn check_invariants(&mut self) -> Result<(), Violation> {
        if let Some((inv, detail)) = self.pending_fail.take() {
            return Err(self.violation(inv, detail));
        }
        // H1: every node here is honest, so none refuses a peer's value as
        // impossible (the checks for hostile peers never bite honest ones).
        for (i, sn) in self.nodes.iter().enumerate() {
            if let Some(c) = sn.core.as_ref()
                && c.metrics().peer_refusals + c.metrics().versions_exhausted != 0
            {
                let m = c.metrics();
                return Err(self.violation(
                    "H1",
                    format!("node {i} refused {} peer values, {} changes", m.peer_refusals, m.versions_exhausted),
                ));
            }
        }
        // S1: the servable copies of a key all have one version. Every
        // copy is compared every `check_every` events; the keys the
        // workload touched (and those of changes that just completed)
        // after every event.
        let full = self.stats.events.is_multiple_of(self.cfg.check_every);
        let mut seen: HashMap<BlockKey, (u64, NodeId)> = HashMap::new();
        let keys: Vec<BlockKey> = if full {
            Vec::new()
        } else {
            self.watched.iter().copied().chain(self.pending_s3.iter().map(|(k, _)| *k)).collect()
        };
        for (i, sn) in self.nodes.iter().enumerate() {
            let Some(core) = &sn.core else { continue };
            if !core.serving_at(sn.clock.local(self.now)) {
                continue;
            }
            let copies: Box<dyn Iterator<Item = (BlockKey, u64)>> = if full {
                Box::new(core.copies().map(|(k, v, _)| (k, v)))
            } else {
                Box::new(keys.iter().filter_map(|k| core.copy_of(k).map(|(v, _)| (*k, v))))
            };
            for (k, v) in copies {
                if let Some(&(v0, n0)) = seen.get(&k) {
                    if v0 != v {
                        return Err(self.violation(
                            "S1",
                            format!("{:?} Valid at v{v0:#x} on node {n0} and v{v:#x} on node {i}", { k.key }),
                        ));
                    }
                } else {
                    seen.insert(k, (v, i as NodeId));
                }
                if let Some(detail) = self.unregistered(i as NodeId, core, k, v) {
                    return Err(self.violation("REG", detail));
                }
            }
        }
        // PIN: a slot an engine pinned keeps its bytes and stays allocated
        // until the engine unpins it.
        for (&(n, inc, slot), &(_, content)) in &self.pins {
            let sn = &self.nodes[n as usize];
            if sn.incarnation != inc || sn.core.is_none() {
                continue;
            }
            let c = sn.mem[slot.slot as usize];
            if c.state != CellState::Used || c.generation != slot.generation || c.content != content {
                return Err(self.violation(
                    "PIN",
                    format!("node {n}: slot {slot:?} pinned by an engine was freed or overwritten: {c:?}"),
                ));
            }
        }
        // S3: when a change completes, no node serves the retired version.
        for (k, old) in std::mem::take(&mut self.pending_s3) {
            if let Some(&(v, n)) = seen.get(&k)
                && v <= old
                && old != 0
            {
                return Err(self.violation(
                    "S3",
                    format!("change of {:?} away from v{old:#x} completed while node {n} serves v{v:#x}", { k.key }),
                ));
            }
        }
        Ok(())
    }

    /// REG: a Valid copy on a serving node is registered at its home
    /// (when the home is ready and serving in the same epoch and the key is
    /// not changing): a home that forgot a holder completes the next change
    /// without invalidating it (S3 then catches it, but only if the copy
    /// outlives that change). What is wrong, if anything.
    fn unregistered(&self, i: NodeId, core: &Node, k: BlockKey, v: u64) -> Option<String> {
        let h = core.view().home_of(&k)?;
        let home = self.nodes[h as usize].core.as_ref()?;
        if home.view().epoch != core.view().epoch
            || !home.directory_ready()
            || !home.serving_at(self.nodes[h as usize].clock.local(self.now))
        {
            return None;
        }
        let entry = home.directory_entry(&k);
        match &entry {
            Some(e) if e.version != v || e.changing || e.holders.contains(&i) => None,
            _ => Some(format!("node {i} holds {:?} v{v:#x} Valid; its home, node {h}, does not list it: {entry:?}", {
                k.key
            })),
        }
    }

    /// Processes one event. `Ok(false)` when the queue is empty.
    fn step(&mut self) -> Result<bool, Violation> {
        let Some(q) = self.queue.pop() else { return Ok(false) };
        self.now = q.at;
        self.stats.events += 1;
        if let Some(n) = target(&q.ev)
            && self.nodes[n as usize].paused_until > self.now
        {
            // Handled right after the stall, in arrival order (streams such
            // as an etcd watch stay ordered).
            let at = self.nodes[n as usize].paused_until;
            if let Ev::Tick { node } = &q.ev {
                let sn = &mut self.nodes[*node as usize];
                if sn.tick_at != Some(self.now) {
                    return Ok(true);
                }
                sn.tick_at = Some(at);
            }
            self.push(at - self.now, q.ev);
            return Ok(true);
        }
        match q.ev {
            Ev::Deliver { to, from, batch } => {
                if self.reachable(to) {
                    if self.trace_log {
                        self.note(format!("t={} n{from}->n{to} e{} {:?}", self.now, batch.epoch, batch.msgs));
                    }
                    self.drive(to, Event::Receive { from, batch });
                }
            }
            Ev::Tick { node } => {
                if self.nodes[node as usize].tick_at == Some(self.now) {
                    self.nodes[node as usize].tick_at = None;
                    self.drive(node, Event::Tick);
                }
            }
            Ev::ClientOp => {
                if self.workload {
                    self.client_op();
                    self.maybe_fault();
                    let d = self.rng.range(1, 400);
                    self.push(d, Ev::ClientOp);
                }
            }
            Ev::ReadExec(r) => self.read_exec(r),
            Ev::TransferDone { reader, reader_inc, op, result } => self.transfer_done(reader, reader_inc, op, result),
            Ev::KeepAlive { to, ka } => {
                if self.reachable(to) {
                    let local = self.local_now(to);
                    if let Some(m) = self.nodes[to as usize].membership.as_mut() {
                        let actions = m.peer_keepalive(ka, local);
                        self.membership_actions(to, actions);
                    }
                }
            }
            Ev::KeepAliveAck { node, inc, sent_at, view, local } => {
                if self.nodes[node as usize].incarnation == inc && (self.reachable(node) || local && self.up(node)) {
                    self.drive(node, Event::View(view));
                    self.drive(node, Event::KeepAliveAck { sent_at });
                }
            }
            Ev::View { node, inc, view, local } => {
                if self.nodes[node as usize].incarnation == inc && (self.reachable(node) || local && self.up(node)) {
                    self.drive(node, Event::View(view));
                }
            }
            Ev::MembershipTick => self.membership_tick(),
            ev @ (Ev::EtcdConnect { .. }
            | Ev::EtcdSessionUp { .. }
            | Ev::EtcdKeepAlive { .. }
            | Ev::EtcdKeepAliveResp { .. }
            | Ev::EtcdTxn { .. }
            | Ev::EtcdWatch { .. }
            | Ev::EtcdFail { .. }
            | Ev::EtcdTick) => self.etcd_event(ev),
            Ev::Unpin { node, inc, slot } => {
                if let Some(p) = self.pins.get_mut(&(node, inc, slot)) {
                    p.0 -= 1;
                    if p.0 == 0 {
                        self.pins.remove(&(node, inc, slot));
                    }
                }
                if self.nodes[node as usize].incarnation == inc {
                    self.drive(node, Event::Unpin { slot });
                }
            }
            Ev::Crash { node } => {
                self.note(format!("t={} CRASH n{node}", self.now));
                self.stats.crashes += 1;
                if node != COORDINATOR
                    && self.nodes[node as usize].crash_loop == 0
                    && let Some(r) = self.loop_rng.as_mut()
                    && r.chance(0.5)
                {
                    let restarts = r.range(2, 5) as u32;
                    self.nodes[node as usize].crash_loop = restarts;
                    self.stats.crash_loops += 1;
                    self.note(format!("t={} n{node} CRASH LOOP of {restarts} restarts", self.now));
                }
                self.stop_process(node);
            }
            Ev::LoopCrash { node, inc } => {
                if self.faults && self.up(node) && self.nodes[node as usize].incarnation == inc {
                    self.note(format!("t={} CRASH n{node} (crash loop)", self.now));
                    self.stats.crashes += 1;
                    self.stop_process(node);
                }
            }
            Ev::Drain { node } => {
                if self.up(node) && self.nodes[node as usize].core.as_ref().is_some_and(|c| !c.has_left()) {
                    self.note(format!("t={} DRAIN n{node}", self.now));
                    self.stats.drains += 1;
                    self.drain(node);
                }
            }
            Ev::Exit { node, inc } => {
                if self.up(node) && self.nodes[node as usize].incarnation == inc {
                    self.note(format!("t={} EXIT n{node} (drained)", self.now));
                    // With the planted bug, the core stops only now.
                    self.drive(node, Event::Leave);
                    self.stop_process(node);
                }
            }
            Ev::Leave { to, node, inc } => {
                if self.reachable(to) {
                    let local = self.local_now(to);
                    if let Some(m) = self.nodes[to as usize].membership.as_mut() {
                        let actions = m.peer_leave(node, inc, local);
                        self.membership_actions(to, actions);
                    }
                }
            }
            Ev::EtcdRevoke { lease } => {
                if self.etcd.down_until <= self.now {
                    self.etcd.revoke(lease);
                }
            }
            Ev::Restart { node } => {
                if !self.up(node) {
                    self.note(format!("t={} RESTART n{node}", self.now));
                    self.boot(node);
                }
            }
            Ev::Isolate { node, until } => {
                self.note(format!("t={} ISOLATE n{node} until {until}", self.now));
                self.nodes[node as usize].isolated_until = until;
            }
        }
        self.check_invariants()?;
        Ok(true)
    }

    /// Runs the fault phase, heals, and checks liveness.
    pub fn run(mut self) -> Result<RunStats, Violation> {
        if self.cfg.background > 0 {
            self.prefill()?;
        }
        let mut steps = 0;
        while steps < self.cfg.steps {
            if !self.step()? {
                break;
            }
            steps += 1;
        }
        // Heal: no more faults or client calls; crashed nodes restart.
        self.faults = false;
        self.workload = false;
        self.note(format!("t={} HEAL", self.now));
        if self.etcd.down_until > self.now {
            let renewed = self.now + self.etcd_ttl;
            for e in self.etcd.leases.values_mut() {
                *e = (*e).max(renewed);
            }
            self.etcd.down_until = self.now;
        }
        for n in 0..self.cfg.nodes {
            self.nodes[n].isolated_until = 0;
            self.nodes[n].etcd_cut_until = 0;
            // A stall runs its course (at most 300 ms): what waited for it
            // is handled in order when it ends.
            if !self.up(n as NodeId) {
                self.boot(n as NodeId);
            }
        }
        self.run_for(3_000_000)?;
        self.check_liveness()?;
        // Liveness with progress: the healed cluster serves a workload
        // (without faults), and every call of it ends.
        let before = self.stats.clone();
        self.note(format!("t={} WORKLOAD AFTER HEALING", self.now));
        self.workload = true;
        self.push(1, Ev::ClientOp);
        self.run_for(100_000)?;
        self.workload = false;
        self.run_for(1_000_000)?;
        self.check_liveness()?;
        let (hits, stored, invalidated) = (
            self.stats.hits - before.hits,
            self.stats.stored - before.stored,
            self.stats.invalidated - before.invalidated,
        );
        if hits == 0 || stored == 0 || invalidated == 0 {
            return Err(self.violation(
                "PROGRESS",
                format!("the healed cluster made no progress: {hits} hits, {stored} puts, {invalidated} invalidations"),
            ));
        }
        self.stats.validation_failures =
            self.nodes.iter().filter_map(|n| n.core.as_ref()).map(|c| c.metrics().validation_failures).sum();
        self.stats.locate_grants =
            self.nodes.iter().filter_map(|n| n.core.as_ref()).map(|c| c.metrics().locate_grants).sum();
        self.stats.early_registrations =
            self.nodes.iter().filter_map(|n| n.core.as_ref()).map(|c| c.metrics().early_registrations).sum();
        self.stats.incarnations_held_back +=
            self.nodes.iter().filter_map(|n| n.membership.as_ref()).map(|m| m.incarnations_held_back()).sum::<u64>();
        Ok(self.stats)
    }

    /// Processes events for `us` of simulated time.
    fn run_for(&mut self, us: u64) -> Result<(), Violation> {
        let end = self.now + us;
        while self.queue.peek().is_some_and(|q| q.at <= end) {
            self.step()?;
        }
        self.now = self.now.max(end);
        Ok(())
    }

    fn check_liveness(&self) -> Result<(), Violation> {
        if let Some(((n, _, op), info)) = self.ops.iter().next() {
            return Err(self.violation("L2", format!("op {op} on node {n} ({info:?}) never ended")));
        }
        for (i, sn) in self.nodes.iter().enumerate() {
            let core = sn.core.as_ref().expect("all up after healing");
            if core.ops_in_flight() != 0 {
                return Err(self.violation("L2", format!("node {i} still has {} ops in flight", core.ops_in_flight())));
            }
            if let Some((k, _)) = core.directory().find(|(_, d)| d.changing) {
                return Err(self.violation("L1", format!("node {i}: change of {:?} never completed", { k.key })));
            }
            if !core.serving() {
                return Err(self.violation("L1", format!("node {i} is not serving after healing")));
            }
            if !core.directory_ready() {
                return Err(self.violation("L1", format!("node {i}: directory not ready after healing")));
            }
            // L3: nothing leaked: every used slot backs a Valid copy.
            let used = sn.mem.iter().filter(|c| c.state == CellState::Used).count();
            let copies = core.copies().count();
            if used != copies || core.slots_held() != copies {
                return Err(self.violation(
                    "L3",
                    format!(
                        "node {i}: {used} slots in use, {} held by the core, {copies} valid copies",
                        core.slots_held()
                    ),
                ));
            }
            if core.metrics().grants_outstanding != 0 {
                return Err(
                    self.violation("L3", format!("node {i}: {} grants outstanding", core.metrics().grants_outstanding))
                );
            }
        }
        // Every member agrees on the view and directories cover the copies.
        let epochs: BTreeSet<u64> = self.nodes.iter().filter_map(|n| n.core.as_ref()).map(|c| c.view().epoch).collect();
        if epochs.len() != 1 {
            return Err(self.violation("L1", format!("nodes disagree on the epoch after healing: {epochs:?}")));
        }
        Ok(())
    }
}

/// The node an event is handled by (None: the world, or the NIC).
fn target(ev: &Ev) -> Option<NodeId> {
    Some(match ev {
        Ev::Deliver { to, .. } => *to,
        Ev::Tick { node }
        | Ev::KeepAliveAck { node, .. }
        | Ev::View { node, .. }
        | Ev::Unpin { node, .. }
        | Ev::EtcdSessionUp { node, .. }
        | Ev::EtcdKeepAliveResp { node, .. }
        | Ev::EtcdWatch { node, .. }
        | Ev::EtcdFail { node, .. }
        | Ev::Drain { node }
        | Ev::Exit { node, .. } => *node,
        Ev::TransferDone { reader, .. } => *reader,
        Ev::KeepAlive { to, .. } | Ev::Leave { to, .. } => *to,
        _ => return None,
    })
}

/// Runs one seed.
pub fn run_seed(seed: u64, cfg: &SimConfig) -> Result<RunStats, Violation> {
    World::new(seed, cfg.clone()).run()
}
