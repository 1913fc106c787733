//! Coherence in the running daemon: drives the protocol core
//! (`kvmesh_coherence::Node`) with real IO.
//!
//! - **Events in**: engine calls (get, publish, invalidate, evict), peer
//!   batches from the `Exchange` streams, transfer completions from the data
//!   plane, membership views and keepalive acknowledgements, timer ticks.
//! - **Actions out**: batches go to per-peer bounded queues (a full queue
//!   drops the batch and counts it: the protocol retransmits what matters,
//!   and a slow peer never blocks the driver or the other peers);
//!   `StartRead` allocates a local slot and moves the holder's whole slot
//!   with UCX; `CommitSlot`/`FreeSlot` act on the store; `ClientDone`
//!   answers the engine call waiting for it.
//! - **Streams**: every daemon dials every peer once (`Exchange`) and sends
//!   everything it has for that peer on it; the callee answers pings. A
//!   stream silent for three heartbeats is redialled. Every batch carries
//!   the sender's epoch and incarnation, so whatever a stale stream
//!   delivers after a restart or a view change is dropped (and counted) by
//!   the core.
//! - **Membership**: static (the configured peers) with a coordinator (one
//!   daemon, `coherence.coordinator`) that plays the membership service of
//!   the protocol: members send keepalives on their streams, the
//!   coordinator acknowledges them (the member's lease runs from its own
//!   send time), removes a member silent for the lease plus twice the
//!   margin, and publishes a new view (epoch + 1) on every change. A
//!   restarted coordinator continues above the highest epoch its members
//!   report. The driver reaches it only through the
//!   [`crate::membership::Membership`] trait; etcd will implement it too.
//!
//! Lock order: `Cluster::inner`, then the store. Everything under `inner`
//! is synchronous and short; transfers run in tasks of their own.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvmesh_coherence::{
    Action, Batch, BlockKey, Config as CoreConfig, ErrorKind, Event, GrantResult, Member, Msg, Node, NodeId, OpId,
    Outcome, SlotImage, SlotMeta as CoreMeta, SlotRef as CoreSlot, TableEntry, TableHeader, TransferError, View,
};
use kvmesh_common::Key;
use kvmesh_common::slot::{HEADER_BYTES, SlotMeta as LayoutMeta, SlotState, TRAILER_BYTES, trailer_offset};
use kvmesh_common::table::{Header as TableWords, Probe, TableReader, TableWriter};
use kvmesh_proto::peer::v1 as pb;
use kvmesh_ucx::RegionWords;
use parking_lot::{Mutex, MutexGuard};
use tokio::sync::{Notify, mpsc, oneshot};
use tonic::Status;

use crate::config::{CoherenceConfig, MembershipConfig, PeerEntry};
use crate::dataplane::{Control, Mode, TransferItem, TransferOutcome};
use crate::peers::{Peers, TestHook};
use crate::staging::is_staged;
use crate::store::{Detached, FETCH_SESSION, PEER_SESSION_BASE, PinOutcome, SessionId, SlotRef, Store};
use kvmesh_coherence::membership::{KeepAlive, Membership, MembershipAction, StaticConfig, static_membership};

mod push;
pub(crate) use push::PUSHES_MAX;
pub use push::PushCounters;

/// Response stream of `Exchange`.
pub type FrameStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::Frame, Status>> + Send>>;

/// Slots per pool fit in 24 bits (`config::POOL_SLOTS_MAX`): the core's
/// slot number is `pool << 24 | slot`.
const SLOT_BITS: u32 = 24;

fn to_core(r: SlotRef) -> CoreSlot {
    CoreSlot { slot: (r.pool << SLOT_BITS) | r.slot, generation: r.generation }
}

fn to_store(r: CoreSlot) -> SlotRef {
    SlotRef { pool: r.slot >> SLOT_BITS, slot: r.slot & ((1 << SLOT_BITS) - 1), generation: r.generation }
}

/// A block key as the core sees it.
pub fn block_key(fingerprint: u64, k: Key) -> BlockKey {
    BlockKey { ns: fingerprint, key: k.0 }
}

/// How an engine-facing protocol operation ended.
#[derive(Debug)]
pub enum OpResult {
    /// Pinned for the engine's session.
    Hit(PinOutcome),
    /// Not cached anywhere (or not servable now).
    Miss,
    /// Published at this version.
    Stored(u64),
    /// No daemon serves the old version any more.
    Invalidated,
    /// Failed.
    Error(ErrorKind),
    /// A cluster-wide lookup: per key, the node holding it; whether every
    /// home answered.
    Located(Vec<Option<NodeId>>, bool),
}

/// An engine call to feed the core (the op id is assigned on submission).
enum Call {
    Get(BlockKey),
    Put(BlockKey, CoreSlot, u64),
    Invalidate(BlockKey),
    Lookup(Vec<BlockKey>),
}

enum WaitKind {
    Get { session: SessionId, lease_ms: u64 },
    Other,
}

struct Waiter {
    kind: WaitKind,
    tx: oneshot::Sender<OpResult>,
    started: Instant,
    /// A fetch: when the core asked for the read, and when it ended.
    read_started: Option<Instant>,
    read_done: Option<Instant>,
}

/// This daemon's way to one peer: the open coherence stream's queue when
/// there is one, else the relay, whose frames the link task moves into the
/// next stream when it opens (nothing enters the relay while a stream is
/// published).
struct Link {
    relay: mpsc::Sender<pb::Frame>,
    stream: Mutex<Option<mpsc::Sender<pb::Frame>>>,
}

struct Inner {
    node: Node,
    next_op: OpId,
    waiters: HashMap<OpId, Waiter>,
    membership: Box<dyn Membership>,
    /// Highest epoch seen (reported in keepalives).
    epoch_seen: u64,
    /// Where the coordinator persists the epoch of every view it publishes.
    epoch_file: PathBuf,
    /// Slots being fetched: what the grant promised (the checksum is
    /// needed to commit them).
    fetching: HashMap<CoreSlot, CoreMeta>,
    /// Read grants this daemon gave: (peer, grant id) -> store pin and its
    /// expiry.
    grant_pins: HashMap<(NodeId, u64), (SlotRef, Instant)>,
    /// The same grants in expiry order (all share one lease, so insertion
    /// order is expiry order): expired ones are forgotten in O(expired).
    /// Entries of grants released early stay until their expiry.
    grant_expiry: VecDeque<(Instant, NodeId, u64)>,
    /// Reads the core started while handling the current input, sent to
    /// the data plane as one batch per holder when the input is done.
    pending_reads: Vec<Read>,
    /// This daemon's lookup table (`coherence.lookup_tables`), which peers
    /// that map it read in place: written from the core's changes after
    /// every input, under this lock, so a reader between two inputs sees
    /// the directory of that moment; and its header as last written.
    table: Option<TableWriter<RegionWords>>,
    table_header: Option<TableWords>,
    /// Test hook `KVMESH_TEST_HOOK=delay-table-apply-ms:N`: every table
    /// write that changes entries waits N ms first (under the core lock),
    /// so a test sees what a late write would let readers see.
    table_delay: Option<Duration>,
    /// Slots pushed with their grants (tcp): receives posted, invitations
    /// to answer (push.rs).
    push: push::PushState,
    /// The core time (µs) the timer task last set out to wake at for the
    /// core (`Node::next_timeout` as it computed it, `u64::MAX` before it
    /// ran): an input only has to wake it when the core's next timeout
    /// became earlier than that ([`Cluster::kick_timer`]).
    timer_armed: u64,
    /// Bytes of pushed reads that had landed before the core started them
    /// and were checked under this lock in the current input
    /// ([`LANDED_INLINE_BYTES_MAX`]); reset at each outermost input.
    landed_inline_bytes: u64,
    /// Inputs being fed, nested (a flush inside an input feeds what it
    /// produced): the budget above resets only at the outermost.
    feed_depth: u32,
}

/// One read the core asked for, with the local slot reserved for it.
#[derive(Clone, Copy, Debug)]
struct Read {
    op: OpId,
    from: NodeId,
    remote: CoreSlot,
    expect: CoreMeta,
    dest: CoreSlot,
    deadline: u64,
    /// When the core asked for it.
    started: Instant,
}

/// Reads of one holder posted where the core asked for them at most
/// ([`Cluster::post_reads_now`]); larger batches are posted by their task.
const POST_NOW_READS_MAX: usize = 64;

/// Reads of one holder (posted where the core asked for them) whose
/// outcomes are validated and fed to the core on the data-plane thread as
/// each copy ends, with no task to wake first. Larger batches hand their
/// outcomes to a task, which hashes the copies on the other core while the
/// data-plane thread goes on copying.
const INLINE_DONE_READS_MAX: usize = 4;

/// Slot bytes (a block with its header and trailer) of pushed reads,
/// already landed when the core starts them, that one input (a peer's
/// batch) checks (xxh3) under the core lock and reports in the same input
/// (push.rs, `read_pushed`): ~15–30 µs of hashing at most, against a
/// task's wake-up per read. Past it — always for blocks of 1 MiB and more,
/// whose slot is larger — reads take their task as before.
const LANDED_INLINE_BYTES_MAX: u64 = 1 << 20;

/// Counters of the driver (the core counts the protocol).
#[derive(Default)]
pub struct ClusterCounters {
    /// Frames dropped because a peer's queue was full (or its stream down).
    pub queue_drops: AtomicU64,
    /// Frames that did not decode.
    pub decode_errors: AtomicU64,
    /// Batches received.
    pub batches_received: AtomicU64,
    /// Reads that failed (peer gone, UCX error).
    pub transfer_failures: AtomicU64,
    /// Reads past their deadline.
    pub transfer_timeouts: AtomicU64,
    /// Engine gets that found the key nowhere in the cluster (or could not
    /// read it).
    pub remote_misses: AtomicU64,
    /// Keepalive acknowledgements and views dropped because they came from
    /// a daemon that is not the coordinator.
    pub membership_foreign_drops: AtomicU64,
    /// Views whose epoch could not be persisted (coordinator).
    pub epoch_persist_failures: AtomicU64,
    /// Inputs that woke the timer task (the core's next timeout moved
    /// earlier than it was armed for).
    pub timer_kicks: AtomicU64,
}

/// The coherence driver of one daemon.
pub struct Cluster {
    id: NodeId,
    incarnation: u64,
    coordinator: NodeId,
    start: Instant,
    cfg: CoherenceConfig,
    grant_lease: Duration,
    inner: Mutex<Inner>,
    store: Arc<Mutex<Store>>,
    peers: Arc<Peers>,
    links: HashMap<NodeId, Link>,
    /// Per peer: the state of this daemon's stream to it.
    link_stats: HashMap<NodeId, LinkStats>,
    /// Histograms of gets and transfers (rendered by `/metrics`).
    pub remote_metrics: Arc<crate::metrics::RemoteMetrics>,
    timer: Notify,
    /// Driver counters.
    pub counters: ClusterCounters,
    /// Reads in flight (when the last one ends, what they produced leaves).
    reads_in_flight: AtomicU64,
    /// Health of the etcd session (etcd membership only).
    etcd_status: Option<Arc<crate::etcd::EtcdStatus>>,
    /// Flush barriers: a ping sent on a peer's stream after what must
    /// arrive, and who waits for its pong (which proves the peer handled
    /// every frame before it). Keyed by (peer, ping number).
    barriers: Mutex<HashMap<(NodeId, u64), oneshot::Sender<()>>>,
    next_barrier: AtomicU64,
    /// Test-only (`KVMESH_TEST_HOOK=hold-first-registration-ms:N`).
    held: Option<Mutex<HeldFrame>>,
    /// Coherence batches go as UCX active messages where the data plane
    /// can take them (`peer.control`, `DataPlane::send_control`); gRPC
    /// streams carry the rest (membership frames, and batches it refused).
    control_ucx: bool,
    /// Getter side of `peer.push_with_grants` is on: tcp sends, coherence
    /// on the gRPC streams (push.rs).
    push_invites: bool,
    /// Pushes counted (stats).
    pub push_counters: PushCounters,
}

/// Test-only: the first batch that registers a fetched copy at its home
/// is sent N ms late, behind everything sent after it (a stream that broke
/// with the batch on it and came back), as `kvmesh-nemesis` saw happen
/// around a flapping link. One batch per process.
enum HeldFrame {
    /// Waiting for the first registration: hold it this long.
    Armed(Duration),
    /// Held: send it to the peer at that time.
    Holding(Instant, NodeId, pb::Frame),
    Sent,
}

fn held_frame_hook() -> Option<Mutex<HeldFrame>> {
    let ms = crate::peers::test_hook_ms("hold-first-registration-ms")?;
    tracing::warn!("TEST HOOK ACTIVE: the first registration batch is sent {ms} ms late");
    Some(Mutex::new(HeldFrame::Armed(Duration::from_millis(ms))))
}

/// The state of the coherence stream to one peer (for `Stats`).
#[derive(Default)]
struct LinkStats {
    up: std::sync::atomic::AtomicBool,
    /// When the peer last answered a ping (µs on the driver's clock; 0:
    /// never).
    last_pong_us: AtomicU64,
    queue_drops: AtomicU64,
}

/// One peer as the coherence driver sees it.
#[derive(Clone, Debug)]
pub struct LinkInfo {
    /// Peer.
    pub id: NodeId,
    /// The stream to it is up.
    pub up: bool,
    /// Since its last pong (None: never).
    pub last_pong_ago: Option<Duration>,
    /// Frames to it dropped.
    pub queue_drops: u64,
    /// Its incarnation in the current view, if a member.
    pub view_incarnation: Option<u64>,
}

/// Ping numbers from here up are flush barriers (heartbeats count from 1).
const BARRIER_BASE: u64 = 1 << 63;

/// What leaving the cluster did (`Cluster::leave`).
#[derive(Clone, Debug, Default)]
pub struct LeaveReport {
    /// Copies dropped (their homes told).
    pub copies_dropped: usize,
    /// Peers of the view that confirmed they handled the leave.
    pub peers_confirmed: usize,
    /// Peers of the view (other than this daemon).
    pub peers: usize,
    /// etcd: the lease was revoked (the task ended) in time.
    pub etcd_left: Option<bool>,
}

/// Where the etcd task delivers views and lease refreshes.
struct EtcdSink(Arc<Cluster>);

impl crate::etcd::Sink for EtcdSink {
    fn view(&self, view: View) {
        self.0.on_view(view);
    }

    fn ack(&self, sent_at: u64) {
        self.0.feed(Event::KeepAliveAck { sent_at });
    }
}

impl Cluster {
    /// Starts the driver: peer links, timers, membership.
    pub fn start(
        cfg: CoherenceConfig,
        mcfg: &MembershipConfig,
        state_dir: &Path,
        peers: Arc<Peers>,
        store: Arc<Mutex<Store>>,
    ) -> anyhow::Result<Arc<Cluster>> {
        let id = peers.node_id();
        let incarnation = peers.incarnation();
        let grant_lease = Duration::from_millis(peers.config().grant_lease_ms);
        let expected_copies: usize = store.lock().pools().iter().map(|p| p.slot_count() as usize).sum();
        let table = if cfg.lookup_tables { make_table(&peers, expected_copies) } else { None };
        let core_cfg = CoreConfig {
            batch_entries_max: cfg.batch_entries_max,
            ack_flush_delay_us_max: cfg.flush_delay_us,
            op_timeout_us: cfg.op_timeout_ms * 1000,
            retransmit_us: cfg.retransmit_ms * 1000,
            grant_lease_us: grant_lease.as_micros() as u64,
            membership_lease_us: cfg.membership_lease_ms * 1000,
            keepalive_us: cfg.keepalive_ms * 1000,
            drift_ppm: cfg.drift_ppm,
            drift_margin_us: cfg.drift_margin_ms * 1000,
            ops_max: cfg.ops_max,
            announce_entries_max: cfg.announce_entries_max,
            expected_copies,
            register_at_locate: cfg.register_at_locate,
            bug: planted_bug(),
            trace: false,
            lookup_table: table.is_some(),
        };
        let etcd = mcfg.kind == "etcd";
        let coordinator = if etcd {
            NodeId::MAX // nobody: views and leases come from etcd
        } else {
            cfg.coordinator.unwrap_or_else(|| peers.entries().map(|e| e.id).chain([id]).min().expect("self"))
        };
        // A member is removed after the lease plus twice the margin without
        // a keepalive: by then it has stopped serving on its own clock. A
        // (re)started coordinator waits as long before its first lease.
        let removal_us = (cfg.membership_lease_ms + 2 * cfg.drift_margin_ms) * 1000;
        let epoch_file = state_dir.join(format!("node-{id}.coordinator-epoch"));
        let epoch_floor = if id == coordinator && !etcd { read_epoch(&epoch_file)? } else { 0 };
        let mut etcd_task = None;
        let membership: Box<dyn Membership> = if etcd {
            let (m, rx, status) = crate::etcd::channel();
            let settings = crate::etcd::EtcdSettings {
                endpoints: mcfg.endpoints.clone(),
                prefix: mcfg.key_prefix.trim_end_matches('/').to_string(),
                ttl_s: mcfg.lease_ttl_s,
                dial_timeout: Duration::from_millis(mcfg.dial_timeout_ms),
                me: id,
                incarnation,
                capacity: cfg.capacity,
                addr: peers.config().listen.clone().unwrap_or_default(),
                tls: mcfg.tls.as_ref().map(crate::etcd::load_tls).transpose().map_err(anyhow::Error::msg)?,
            };
            tracing::info!(endpoints = ?mcfg.endpoints, prefix = %settings.prefix, ttl_s = mcfg.lease_ttl_s, "membership: etcd");
            etcd_task = Some((settings, rx, Arc::clone(&status)));
            Box::new(m)
        } else {
            static_membership(
                StaticConfig {
                    me: id,
                    coordinator,
                    removal_us,
                    epoch_floor,
                    skip_restart_wait: core_cfg.bug == Some(kvmesh_coherence::Bug::CoordinatorNoWait),
                    take_capacity_changes: core_cfg.bug == Some(kvmesh_coherence::Bug::CapacityPerKeepalive),
                    admit_every_incarnation: core_cfg.bug == Some(kvmesh_coherence::Bug::IncarnationPerKeepalive),
                },
                0,
            )
        };
        if id == coordinator {
            tracing::info!(
                epoch_floor,
                wait_ms = removal_us / 1000,
                file = %epoch_file.display(),
                "membership coordinator: no lease and no view until every lease a previous incarnation could have granted has run out"
            );
        }
        // Batches over UCX only without peer TLS: an active message's
        // sender is its own claim, as on a peer stream without TLS. `auto`:
        // on shared memory only — on tcp, lone gets measured slower that
        // way (DATAPLANE.md).
        let control_ucx = peers.tls().is_none()
            && match peers.config().control.as_str() {
                "ucx" => true,
                "auto" => peers.config().transports == "sm",
                _ => false,
            };
        tracing::info!(
            over = if control_ucx { "UCX active messages (gRPC streams where no endpoint)" } else { "gRPC streams" },
            "coherence batches"
        );
        // Invitations travel in the frames of the batches they go with
        // (on the stream, or as one active message where the peer takes
        // frames that way).
        let push_invites = peers.config().push_with_grants && peers.mode() == Mode::Recv;
        store.lock().set_coherent();
        let mut links = HashMap::new();
        let mut link_stats = HashMap::new();
        let mut link_rx = Vec::new();
        for e in peers.entries() {
            let (tx, rx) = mpsc::channel(cfg.peer_queue_frames);
            links.insert(e.id, Link { relay: tx, stream: Mutex::new(None) });
            link_stats.insert(e.id, LinkStats::default());
            link_rx.push((e.clone(), rx));
        }
        tracing::info!(node = id, coordinator, "coherence driver started");
        let cluster = Arc::new(Cluster {
            id,
            incarnation,
            coordinator,
            start: Instant::now(),
            cfg,
            grant_lease,
            inner: Mutex::new(Inner {
                node: Node::new(id, incarnation, core_cfg),
                next_op: 1,
                waiters: HashMap::new(),
                membership,
                epoch_seen: 0,
                epoch_file,
                fetching: HashMap::new(),
                grant_pins: HashMap::new(),
                grant_expiry: VecDeque::new(),
                pending_reads: Vec::new(),
                table,
                table_header: None,
                table_delay: crate::peers::test_hook_ms("delay-table-apply-ms").map(Duration::from_millis),
                push: push::PushState::default(),
                timer_armed: u64::MAX,
                landed_inline_bytes: 0,
                feed_depth: 0,
            }),
            store,
            peers,
            links,
            link_stats,
            remote_metrics: Arc::default(),
            timer: Notify::new(),
            counters: ClusterCounters::default(),
            reads_in_flight: AtomicU64::new(0),
            etcd_status: etcd_task.as_ref().map(|t| Arc::clone(&t.2)),
            barriers: Mutex::new(HashMap::new()),
            next_barrier: AtomicU64::new(BARRIER_BASE),
            held: held_frame_hook(),
            control_ucx,
            push_invites,
            push_counters: PushCounters::default(),
        });
        for (entry, rx) in link_rx {
            tokio::spawn(Arc::clone(&cluster).link_task(entry, rx));
        }
        if cluster.peers.tls().is_none() {
            // Taken whatever `peer.control` says here (peers may send them:
            // the handshake told them so). Handled on the data-plane thread
            // as they arrive (no hop to a task); what they start on the
            // runtime starts there. Weak: the data plane (owned through
            // `peers`) holds the closure.
            let weak = Arc::downgrade(&cluster);
            let runtime = tokio::runtime::Handle::current();
            cluster.peers.dataplane().serve_control(Box::new(move |msgs| {
                if let Some(c) = weak.upgrade() {
                    let _entered = runtime.enter();
                    c.on_controls(msgs);
                }
            }));
        }
        tokio::spawn(Arc::clone(&cluster).timer_task());
        if let Some((settings, rx, status)) = etcd_task {
            let sink: Arc<dyn crate::etcd::Sink> = Arc::new(EtcdSink(Arc::clone(&cluster)));
            tokio::spawn(crate::etcd::run(settings, rx, sink, status));
        }
        Ok(cluster)
    }

    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    fn instant_of(&self, t: u64) -> Instant {
        self.start + Duration::from_micros(t)
    }

    // ----- feeding the core -----

    fn feed(self: &Arc<Self>, ev: Event) {
        let mut g = self.inner.lock();
        self.feed_locked(&mut g, ev);
        self.kick_timer_locked(&g);
    }

    /// Wakes the timer task if the core now wants to wake earlier than the
    /// task set out to (an input added an earlier deadline or resend). Most
    /// inputs do not — their timers fall after one already armed — and
    /// waking the task for each (a runtime worker unparked per locate,
    /// grant and read, on the thread that handled them) cost every remote
    /// get wake-ups on the cores its own hops needed.
    fn kick_timer(&self) {
        self.kick_timer_locked(&self.inner.lock());
    }

    /// [`Cluster::kick_timer`] under the core lock the caller holds. The
    /// task arms under the same lock, so an input either sees what it
    /// armed, or the task computes its wake from the input's state.
    fn kick_timer_locked(&self, g: &Inner) {
        if g.node.next_timeout().is_some_and(|t| t < g.timer_armed) {
            self.counters.timer_kicks.fetch_add(1, Ordering::Relaxed);
            self.timer.notify_one();
        }
    }

    fn feed_locked(self: &Arc<Self>, g: &mut Inner, ev: Event) {
        self.feed_locked_at(g, ev, self.now_us());
    }

    /// Feeds at a given time: the events of one input unit (an engine call's
    /// keys) share one instant, so no flush window ends in the middle.
    fn feed_locked_at(self: &Arc<Self>, g: &mut Inner, ev: Event, now: u64) {
        if g.feed_depth == 0 {
            g.landed_inline_bytes = 0;
        }
        g.feed_depth += 1;
        let mut queue = VecDeque::from([ev]);
        while let Some(ev) = queue.pop_front() {
            let actions = g.node.handle(now, ev);
            // Before any of the step's messages or answers leave: a change
            // the step completed must be in the table by the time anyone
            // hears of it.
            apply_table(g);
            for a in actions {
                self.execute(g, a, &mut queue);
            }
        }
        self.dispatch_reads(g);
        g.feed_depth -= 1;
    }

    /// Sends the reads started by the input just handled to the data plane:
    /// one batch per holder (posted and progressed together).
    fn dispatch_reads(self: &Arc<Self>, g: &mut Inner) {
        if g.pending_reads.is_empty() {
            return;
        }
        let mut by_holder: HashMap<NodeId, Vec<Read>> = HashMap::new();
        for r in g.pending_reads.drain(..) {
            by_holder.entry(r.from).or_default().push(r);
        }
        for (from, reads) in by_holder {
            let inline = reads.len() <= INLINE_DONE_READS_MAX;
            let posted = self.post_reads_now(g, from, &reads, inline);
            if inline && let Some(Wave { refused, posted: None }) = posted {
                // The posted reads report themselves from the data-plane
                // thread; what was refused, from a task (the core lock is
                // held here).
                if !refused.is_empty() {
                    let me = Arc::clone(self);
                    tokio::spawn(async move {
                        for (i, e) in refused {
                            me.read_ended(reads[i], Err(e));
                        }
                    });
                }
                continue;
            }
            let me = Arc::clone(self);
            // (A task the runtime drops unstarted — it is shutting down —
            // leaves its reads unreported, posted or not: nothing waits
            // for them any more.)
            tokio::spawn(async move { me.read_batch_task(from, reads, posted).await });
        }
    }

    /// The input ran dry: what it produced leaves now, one batch per peer,
    /// instead of waiting for the flush timer (whose resolution is a
    /// millisecond). Under load inputs come in bursts, and a burst's
    /// output is one batch per peer.
    fn flush_locked(self: &Arc<Self>, g: &mut Inner) {
        let mut queue = VecDeque::new();
        let actions = g.node.flush_now(self.now_us());
        apply_table(g);
        for a in actions {
            self.execute(g, a, &mut queue);
        }
        while let Some(ev) = queue.pop_front() {
            self.feed_locked(g, ev);
        }
        self.decline_leftover_invites(g);
    }

    fn flush(self: &Arc<Self>) {
        let mut g = self.inner.lock();
        self.flush_locked(&mut g);
    }

    fn execute(self: &Arc<Self>, g: &mut Inner, a: Action, queue: &mut VecDeque<Event>) {
        match a {
            Action::LookupDone { op, found, complete } => {
                if let Some(w) = g.waiters.remove(&op) {
                    let _ =
                        w.tx.send(OpResult::Located(found.into_iter().map(|f| f.map(|(n, _)| n)).collect(), complete));
                }
            }
            Action::Send { to, mut batch } => {
                tracing::trace!(to, msgs = batch.msgs.len(), first = ?batch.msgs.first(), "send batch");
                self.note_grants(g, to, &mut batch);
                if !self.peers.takes_locate_registration(to) {
                    // A daemon from before locate-time registration (or one
                    // not handshaken yet) cannot decode it: a plain locate;
                    // its answer then registers nothing, and the get
                    // registers after its read.
                    for m in batch.msgs.iter_mut() {
                        if let Msg::LocateReq { copy, .. } = m {
                            *copy = 0;
                        }
                    }
                }
                let (push_answers, push_sends) = self.answer_invites(g, to, &batch);
                let push_invites = self.invite_pushes(g, to, &batch, queue);
                let frame =
                    pb::Frame { body: Some(pb::frame::Body::Batch(batch.encode())), push_invites, push_answers };
                if let Some(h) = &self.held {
                    let mut h = h.lock();
                    if let HeldFrame::Armed(delay) = *h
                        && batch.msgs.iter().any(|m| matches!(m, Msg::AddHolderReq { .. }))
                    {
                        tracing::warn!(to, ?delay, msgs = ?batch.msgs, "TEST HOOK: holding a registration batch");
                        // Its pushes are not sent: its answers say so.
                        let mut frame = frame;
                        frame.push_answers.iter_mut().for_each(|a| a.pushed = false);
                        *h = HeldFrame::Holding(Instant::now() + delay, to, frame);
                        return;
                    }
                }
                // One frame: what it says about pushes arrives with the
                // answers it goes with.
                let incarnation = g.node.view().member(to).map(|m| m.incarnation);
                self.send_batch(to, incarnation, frame);
                // The answer first: it has further to go (the getter's
                // core must see the grant before it uses the slot).
                self.send_pushes(push_sends);
            }
            Action::StartRead { op, from, remote, expect, deadline }
                if let Some(p) = self.take_pushed(g, op, from, remote) =>
            {
                // The holder pushed the slot with its grant (push.rs).
                let read = self
                    .begin_read(g, Read { op, from, remote, expect, dest: p.dest, deadline, started: Instant::now() });
                self.read_pushed(g, from, read, p, queue);
            }
            Action::StartRead { op, from, remote, expect, deadline } => match self
                .alloc_fetch_slot(&g.node, &expect, queue)
            {
                Some(dest) => {
                    let read =
                        self.begin_read(g, Read { op, from, remote, expect, dest, deadline, started: Instant::now() });
                    g.pending_reads.push(read);
                }
                None => queue.push_back(Event::TransferDone { op, dest: None, result: Err(TransferError::NoSpace) }),
            },
            Action::CommitSlot { slot, meta } => {
                if !self.store.lock().commit_core(to_store(slot), meta.version, meta.checksum, false) {
                    tracing::error!(?slot, "coherence: commit of a slot the store does not hold for it");
                }
            }
            Action::FreeSlot { slot } => {
                g.fetching.remove(&slot);
                self.store.lock().free_core(to_store(slot));
            }
            Action::KeepAlive { sent_at } => {
                let ka = KeepAlive {
                    node: self.id,
                    incarnation: self.incarnation,
                    sent_at_us: sent_at,
                    epoch_seen: g.epoch_seen,
                    capacity: self.cfg.capacity,
                };
                let actions = g.membership.keepalive(ka, self.now_us());
                self.membership_actions(g, actions, queue);
            }
            Action::ClientDone { op, outcome } => {
                tracing::trace!(op, "client op done");
                self.end_pushes(g, op);
                let waiter = g.waiters.remove(&op);
                let mut fetched = false;
                let result = match outcome {
                    Outcome::Hit { version, slot } => {
                        // A fetched copy the core accepted: make it Valid in
                        // the store (header rewritten with our generation).
                        if let Some(meta) = g.fetching.remove(&slot) {
                            fetched = true;
                            if !self.store.lock().commit_core(to_store(slot), version, meta.checksum, true) {
                                tracing::error!(?slot, "coherence: fetched slot lost before commit");
                            }
                        }
                        let pinned = match &waiter {
                            Some(Waiter { kind: WaitKind::Get { session, lease_ms }, .. }) => self
                                .store
                                .lock()
                                .pin_slots(*session, &[to_store(slot)], *lease_ms, Instant::now())
                                .ok()
                                .and_then(|(mut v, _)| v.pop().flatten()),
                            _ => None,
                        };
                        // The engine's pin lives in the store from here on.
                        queue.push_back(Event::Unpin { slot });
                        match pinned {
                            Some(p) => OpResult::Hit(p),
                            None => OpResult::Miss,
                        }
                    }
                    Outcome::Miss => {
                        // Local copies answer Hit at once: a miss was asked of
                        // the cluster.
                        self.counters.remote_misses.fetch_add(1, Ordering::Relaxed);
                        OpResult::Miss
                    }
                    Outcome::Stored { version } => OpResult::Stored(version),
                    Outcome::Invalidated => OpResult::Invalidated,
                    Outcome::Error(e) => OpResult::Error(e),
                };
                if let Some(w) = waiter {
                    if matches!(w.kind, WaitKind::Get { .. }) {
                        let result = match &result {
                            OpResult::Hit(_) if fetched => "fetched",
                            OpResult::Hit(_) => "local_hit",
                            OpResult::Miss => "miss",
                            _ => "error",
                        };
                        let m = &self.remote_metrics;
                        m.observe_get(result, w.started.elapsed().as_secs_f64());
                        if fetched && let (Some(rs), Some(rd)) = (w.read_started, w.read_done) {
                            let stage = |stage: &'static str, d: Duration| m.observe_stage(stage, d.as_secs_f64());
                            stage("locate", rs.saturating_duration_since(w.started));
                            stage("read", rd.saturating_duration_since(rs));
                            stage("register", rd.elapsed());
                        }
                    }
                    let _ = w.tx.send(result);
                }
            }
        }
    }

    /// Carries out what the membership service asks; views and local acks
    /// become core events (`queue`).
    fn membership_actions(
        self: &Arc<Self>,
        g: &mut Inner,
        actions: Vec<MembershipAction>,
        queue: &mut VecDeque<Event>,
    ) {
        use pb::frame::Body;
        for a in actions {
            match a {
                MembershipAction::Forward { to, ka } => {
                    let k = pb::KeepAlive {
                        sent_at_us: ka.sent_at_us,
                        incarnation: ka.incarnation,
                        epoch_seen: ka.epoch_seen,
                        capacity: ka.capacity,
                    };
                    self.send_frame(to, pb::Frame { body: Some(Body::Keepalive(k)), ..Default::default() });
                }
                MembershipAction::Ack { to, sent_at_us, view } => {
                    let ack = pb::KeepAliveAck { sent_at_us, view: Some(pb_view(&view)) };
                    self.send_frame(to, pb::Frame { body: Some(Body::KeepaliveAck(ack)), ..Default::default() });
                }
                MembershipAction::AckLocal { sent_at_us } => {
                    queue.push_back(Event::KeepAliveAck { sent_at: sent_at_us })
                }
                MembershipAction::Persist(epoch) => {
                    if let Err(e) = write_epoch(&g.epoch_file, epoch) {
                        // Epochs still continue above what members report;
                        // only a restart that no member witnesses could
                        // reuse an epoch.
                        self.counters.epoch_persist_failures.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(file = %g.epoch_file.display(), epoch, "membership: cannot persist the epoch: {e}");
                    }
                }
                MembershipAction::Publish(view) => {
                    self.publish_view(&view);
                    self.renew_stale_handshakes(view.clone());
                    g.epoch_seen = g.epoch_seen.max(view.epoch);
                    queue.push_back(Event::View(view));
                }
                MembershipAction::ForwardLeave { to, node: _, incarnation } => {
                    self.send_frame(
                        to,
                        pb::Frame { body: Some(Body::Leave(pb::Leave { incarnation })), ..Default::default() },
                    );
                }
            }
        }
    }

    /// Runs membership actions outside an action loop.
    fn run_membership(self: &Arc<Self>, g: &mut Inner, actions: Vec<MembershipAction>) {
        let mut queue = VecDeque::new();
        self.membership_actions(g, actions, &mut queue);
        while let Some(ev) = queue.pop_front() {
            self.feed_locked(g, ev);
        }
    }

    /// Grants in an outgoing batch become store pins of the peer's session
    /// (so the pool neither evicts nor reuses the slot before the peer's
    /// read); a grant whose slot the store no longer holds is refused.
    fn note_grants(&self, g: &mut Inner, to: NodeId, batch: &mut Batch) {
        let hook = self.peers.hook();
        for m in batch.msgs.iter_mut() {
            let Msg::GrantResp { result, .. } = m else { continue };
            let GrantResult::Granted { slot, grant, .. } = *result else { continue };
            let r = to_store(slot);
            // Outlives the core's hold (lease + margin) on the peer's clock.
            let lease = self.grant_lease + Duration::from_millis(2 * self.cfg.drift_margin_ms);
            let now = Instant::now();
            let mut st = self.store.lock();
            let pinned = st
                .pin_slots(PEER_SESSION_BASE + to as u64, &[r], lease.as_millis() as u64, now)
                .ok()
                .and_then(|(mut v, _)| v.pop().flatten())
                .is_some();
            if pinned {
                st.counters.grants_given += 1;
                g.grant_pins.insert((to, grant), (r, now + lease));
                g.grant_expiry.push_back((now + lease, to, grant));
                if hook == Some(TestHook::CorruptGrantedSlots) {
                    st.test_corrupt_header(r);
                }
            } else {
                *result = GrantResult::Refused;
            }
        }
    }

    /// Releases the store pins of grants a peer is done with, once the core
    /// took their release: a release in a batch the core drops (of another
    /// epoch, during a view change) leaves the core's grant in place, and
    /// its store pin with it (else the store could evict a slot the core
    /// still counts granted: a copy it holds but cannot serve).
    fn release_grants(&self, g: &mut Inner, from: NodeId, releases: &[(CoreSlot, u64)]) {
        let mut refs = Vec::new();
        for &(slot, grant) in releases {
            if g.node.grant_outstanding(slot, grant) {
                continue;
            }
            if let Some((r, _)) = g.grant_pins.remove(&(from, grant)) {
                refs.push(r);
            }
        }
        if !refs.is_empty() {
            let mut st = self.store.lock();
            for chunk in refs.chunks(st.config().limits.batch_keys_max as usize) {
                let _ = st.unpin(PEER_SESSION_BASE + from as u64, chunk);
            }
        }
    }

    /// Sends a coherence batch for `to` (at `incarnation` in this node's
    /// view), with any push invitations or answers beside it (or those
    /// alone): as a UCX active message when the data plane has an endpoint
    /// to that incarnation — a frame with pushes whole, where the peer
    /// takes frames — else on the peer's gRPC stream.
    fn send_batch(&self, to: NodeId, incarnation: Option<u64>, f: pb::Frame) {
        use prost::Message as _;
        if self.control_ucx
            && let Some(inc) = incarnation
        {
            let dp = self.peers.dataplane();
            let sent = if !f.push_invites.is_empty() || !f.push_answers.is_empty() {
                dp.send_control_frame(to, inc, self.id, &f.encode_to_vec())
            } else {
                matches!(&f.body, Some(pb::frame::Body::Batch(bytes)) if dp.send_control(to, inc, self.id, bytes))
            };
            if sent {
                return;
            }
        }
        self.send_frame(to, f);
    }

    fn send_frame(&self, to: NodeId, f: pb::Frame) {
        match self.links.get(&to) {
            Some(link) => {
                // Straight into the open stream (no relay task in between:
                // one wake-up less per message); through the relay while no
                // stream is open. One lock for both, so frames keep their
                // order across the switch.
                let stream = link.stream.lock();
                let sent = match stream.as_ref() {
                    Some(tx) => tx.try_send(f).is_ok(),
                    None => link.relay.try_send(f).is_ok(),
                };
                if !sent {
                    self.counters.queue_drops.fetch_add(1, Ordering::Relaxed);
                    if let Some(l) = self.link_stats.get(&to) {
                        l.queue_drops.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            None => tracing::warn!(peer = to, "coherence: no link to node (not in [[peers]])"),
        }
    }

    fn publish_view(&self, view: &View) {
        tracing::info!(epoch = view.epoch, members = ?view.members.iter().map(|m| m.id).collect::<Vec<_>>(), "membership: new view");
        let v = pb_view(view);
        for m in &view.members {
            if m.id != self.id {
                self.send_frame(m.id, pb::Frame { body: Some(pb::frame::Body::View(v.clone())), ..Default::default() });
            }
        }
    }

    /// A read the core started, into its reserved slot: counted in flight,
    /// its slot's grant kept for the commit, its start time noted.
    fn begin_read(&self, g: &mut Inner, read: Read) -> Read {
        g.fetching.insert(read.dest, read.expect);
        self.reads_in_flight.fetch_add(1, Ordering::SeqCst);
        if let Some(w) = g.waiters.get_mut(&read.op) {
            w.read_started = Some(read.started);
        }
        read
    }

    /// Reserves a local slot for a fetch (owned by the core until it
    /// commits or frees it).
    fn alloc_fetch_slot(&self, node: &Node, expect: &CoreMeta, queue: &mut VecDeque<Event>) -> Option<CoreSlot> {
        let mut st = self.store.lock();
        let ns = st.namespace_by_fingerprint(expect.key.ns)?;
        fetch_slot_in(&mut st, node, ns.id, expect.key, queue)
    }

    /// Reads a batch of slots from one holder (`posted`: already handed
    /// to the data plane); each read is reported to the core as it ends.
    async fn read_batch_task(self: Arc<Self>, from: NodeId, reads: Vec<Read>, posted: Option<Wave>) {
        let t0 = Instant::now();
        let n = reads.len();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mover = {
            let me = Arc::clone(&self);
            let reads = reads.clone();
            async move {
                match posted {
                    Some(wave) => me.finish_wave(from, &reads, 0, wave, &tx).await,
                    None => me.read_slots(from, &reads, tx).await,
                }
            }
        };
        let consume = async {
            let mut done = 0usize;
            while let Some((i, result)) = rx.recv().await {
                done += 1;
                self.read_ended(reads[i], result);
            }
            done
        };
        let (moved, done) = tokio::join!(mover, consume);
        // Whatever the mover did not report ended with it.
        if done < n {
            for (i, r) in reads.iter().enumerate() {
                if !moved.get(i).copied().unwrap_or(false) {
                    self.read_ended(*r, Err(TransferError::PeerGone));
                }
            }
        }
        tracing::trace!(from, reads = n, us = t0.elapsed().as_micros() as u64, "read batch done");
    }

    /// One read ended: quarantine on timeout, then tell the core; the last
    /// read in flight flushes what the reads produced.
    fn read_ended(self: &Arc<Self>, r: Read, result: Result<SlotImage, TransferError>) {
        self.read_ended_under(self.inner.lock(), r, result);
    }

    /// [`Cluster::read_ended`] if the core is free at this instant; else
    /// the read is handed back (to a caller that must not wait: the
    /// data-plane thread, which would stop moving bytes meanwhile).
    fn try_read_ended(
        self: &Arc<Self>,
        r: Read,
        result: Result<SlotImage, TransferError>,
    ) -> Option<(Read, Result<SlotImage, TransferError>)> {
        if crate::peers::test_hook() == Some(crate::peers::TestHook::InlineReportsFindCoreBusy) {
            return Some((r, result));
        }
        let Some(g) = self.inner.try_lock() else {
            tracing::trace!(op = r.op, "read ended with the core busy: a task reports it");
            return Some((r, result));
        };
        self.read_ended_under(g, r, result);
        None
    }

    fn read_ended_under(
        self: &Arc<Self>,
        mut g: MutexGuard<'_, Inner>,
        r: Read,
        result: Result<SlotImage, TransferError>,
    ) {
        let (ev, last) = self.read_outcome(&mut g, r, result);
        self.feed_locked(&mut g, ev);
        // The last read of a burst ended: its registrations and grant
        // releases leave now, together.
        if last && self.cfg.flush_when_idle {
            self.flush_locked(&mut g);
        }
        self.kick_timer_locked(&g);
        drop(g);
    }

    /// The bookkeeping of a read that ended (quarantine on timeout, the
    /// count in flight, the get's timing): the event that tells the core,
    /// and whether it was the last read in flight.
    fn read_outcome(&self, g: &mut Inner, r: Read, result: Result<SlotImage, TransferError>) -> (Event, bool) {
        let (dest, result) = match result {
            Ok(image) => (Some(r.dest), Ok(image)),
            Err(TransferError::Timeout) => {
                // UCX may still write the slot: never reuse it.
                self.counters.transfer_timeouts.fetch_add(1, Ordering::Relaxed);
                g.fetching.remove(&r.dest);
                self.store.lock().quarantine_core(to_store(r.dest));
                (None, Err(TransferError::Timeout))
            }
            Err(e) => {
                self.counters.transfer_failures.fetch_add(1, Ordering::Relaxed);
                (Some(r.dest), Err(e))
            }
        };
        let last = self.reads_in_flight.fetch_sub(1, Ordering::SeqCst) == 1;
        if let Some(w) = g.waiters.get_mut(&r.op) {
            w.read_done = Some(Instant::now());
        }
        (Event::TransferDone { op: r.op, dest, result }, last)
    }

    /// Moves the holder's whole slots into the reserved local slots, and
    /// reports on `tx` what arrived for each (the core validates it against
    /// the grant). Returns which reads were reported.
    ///
    /// Reads into a staged pool (GPU memory UCX cannot reach) land in
    /// staging slots first: they go in waves of at most the read staging
    /// slots, each waiting for its slots (until the reads' deadline).
    async fn read_slots(
        &self,
        from: NodeId,
        reads: &[Read],
        tx: tokio::sync::mpsc::UnboundedSender<(usize, Result<SlotImage, TransferError>)>,
    ) -> Vec<bool> {
        let staged = {
            let st = self.store.lock();
            reads.iter().any(|r| st.pools().get(to_store(r.dest).pool as usize).is_some_and(|p| is_staged(&p.memory)))
        };
        let Some(staging) = self.peers.staging().filter(|_| staged) else {
            return self.read_wave(from, reads, 0, Vec::new(), &tx).await;
        };
        let limit = Instant::now() + Duration::from_millis(self.peers.config().transfer_timeout_ms);
        let mut reported = Vec::with_capacity(reads.len());
        // `base`: where each wave starts in `reads` (its outcomes are
        // reported by index from there). A wave is as large as the read
        // slots not quarantined *now*: their count shrinks as slots are
        // quarantined, in this batch or another.
        let mut base = 0;
        while base < reads.len() {
            let n = staging.recv_slots().min(reads.len() - base);
            if n == 0 {
                // Every read staging slot quarantined: the staged reads
                // left are refused (misses), host ones still move.
                tracing::warn!(
                    peer = from,
                    reads = reads.len() - base,
                    "no read staging slot left (all quarantined): staged reads refused"
                );
                reported.extend(self.read_wave(from, &reads[base..], base, Vec::new(), &tx).await);
                break;
            }
            let wave = &reads[base..base + n];
            let earliest = wave.iter().map(|r| r.deadline).min().expect("waves are not empty");
            let slots = staging.take_recv(wave.len(), self.instant_of(earliest).min(limit)).await;
            if slots.is_none() {
                tracing::debug!(peer = from, reads = wave.len(), "no staging slot in time: reads refused (misses)");
            }
            reported.extend(self.read_wave(from, wave, base, slots.unwrap_or_default(), &tx).await);
            base += n;
        }
        reported
    }

    /// One wave of [`Cluster::read_slots`]: `reads` are its reads from
    /// `base` on; `slots`, staging slots for those landing in a staged
    /// pool (one each; a read without one is refused).
    async fn read_wave(
        &self,
        from: NodeId,
        reads: &[Read],
        base: usize,
        slots: Vec<crate::staging::StagingSlot>,
        tx: &tokio::sync::mpsc::UnboundedSender<(usize, Result<SlotImage, TransferError>)>,
    ) -> Vec<bool> {
        // The holder is a live member that just granted us these reads: if
        // the background handshake has not reached it yet, or reached an
        // earlier incarnation (its pool is gone), shake hands now.
        let member_inc = self.inner.lock().node.view().member(from).map(|m| m.incarnation);
        match self.peers.conn_info(from).await {
            Some((inc, _, _)) if Some(inc) == member_inc => {}
            Some((stale, _, _)) => {
                self.peers.reset_if(from, stale).await;
                self.peers.connect_to(from).await;
            }
            None => {
                self.peers.connect_to(from).await;
            }
        }
        let conn = self.peers.conn_info(from).await.filter(|(inc, _, _)| Some(*inc) == member_inc);
        let wave = match conn {
            Some((inc, pools, _)) => self.post_wave(from, inc, &pools, reads, slots, None),
            None => Wave { refused: (0..reads.len()).map(|i| (i, TransferError::PeerGone)).collect(), posted: None },
        };
        self.finish_wave(from, reads, base, wave, tx).await
    }

    /// Posts the reads of a batch whose holder is connected (handshake
    /// state free at this instant) and whose slots land straight in our
    /// pools, from where the core asked for them: no task hop before the
    /// data plane starts moving (on the data-plane thread, where locate
    /// answers arrive, the reads start on its next turn). `None`: the read
    /// task does it (handshake first, or staging slots to wait for).
    ///
    /// `inline`: the posted reads report their outcomes on the data-plane
    /// thread ([`InlineReads`]); the wave returned then holds only what was
    /// refused.
    fn post_reads_now(self: &Arc<Self>, g: &Inner, from: NodeId, reads: &[Read], inline: bool) -> Option<Wave> {
        // Posting holds the core lock: a large batch (whose copies take far
        // longer than a wake-up) is posted by its task.
        if reads.len() > POST_NOW_READS_MAX {
            return None;
        }
        let member_inc = g.node.view().member(from).map(|m| m.incarnation)?;
        let (inc, pools) = self.peers.try_conn_info(from).filter(|(inc, _)| *inc == member_inc)?;
        {
            let st = self.store.lock();
            let staged = reads
                .iter()
                .any(|r| st.pools().get(to_store(r.dest).pool as usize).is_none_or(|p| is_staged(&p.memory)));
            if staged {
                return None;
            }
        }
        let inline = match (inline, tokio::runtime::Handle::try_current()) {
            (true, Ok(runtime)) => Some((Arc::downgrade(self), runtime)),
            _ => None,
        };
        Some(self.post_wave(from, inc, &pools, reads, Vec::new(), inline))
    }

    /// Checks the reads of a wave against the holder's pools (`inc`,
    /// `pools`: its handshake) and hands those that can be made to the
    /// data plane; the rest are refused.
    fn post_wave(
        &self,
        from: NodeId,
        inc: u64,
        pools: &[pb::PoolDesc],
        reads: &[Read],
        mut slots: Vec<crate::staging::StagingSlot>,
        inline: Option<(std::sync::Weak<Cluster>, tokio::runtime::Handle)>,
    ) -> Wave {
        let mut refused = Vec::new();
        // Whole slots are copied: the holder's pool must have our layout.
        let mut items = Vec::with_capacity(reads.len());
        let mut index = Vec::with_capacity(reads.len());
        let mut send_items = Vec::new();
        let mut geometry = Vec::with_capacity(reads.len());
        let mut any_staged_remote = false;
        // Our pools' geometry, under one lock for the whole batch.
        let locals: Vec<_> = {
            let st = self.store.lock();
            reads
                .iter()
                .map(|r| {
                    let p = st.pools().get(to_store(r.dest).pool as usize)?;
                    Some((p.stride, p.slot_payload_bytes, p.memory.clone()))
                })
                .collect()
        };
        for ((i, r), local) in reads.iter().enumerate().zip(locals) {
            let d = to_store(r.dest);
            let rs = to_store(r.remote);
            let Some((stride, cap, memory)) = local else {
                refused.push((i, TransferError::NoSpace));
                continue;
            };
            let Some(rp) = pools.iter().find(|p| p.index == rs.pool) else {
                // A grant naming a pool the holder never advertised.
                self.peers.refusals.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(peer = from, pool = rs.pool, "peer granted a slot of a pool it has not advertised");
                refused.push((i, TransferError::PeerGone));
                continue;
            };
            if rp.slot_stride_bytes != stride || rp.slot_payload_bytes != cap {
                tracing::warn!(peer = from, pool = rs.pool, "peer pool layout differs from ours; cannot read its slot");
                refused.push((i, TransferError::PeerGone));
                continue;
            }
            if u64::from(rs.slot) >= rp.bytes / stride {
                // Past the end of the pool the holder advertised.
                self.peers.refusals.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(peer = from, pool = rs.pool, slot = rs.slot, "peer granted a slot outside its pool");
                refused.push((i, TransferError::PeerGone));
                continue;
            }
            // Where the bytes land: our pool, or — for a pool UCX cannot
            // reach (GPU) — a staging slot, validated there and then
            // copied into the pool.
            let (dest, local_pool, local_offset) = match memory.host().filter(|_| !is_staged(&memory)) {
                Some(m) => (Dest::Pool(Arc::clone(m)), d.pool, d.slot as u64 * stride),
                _ => match slots.pop() {
                    Some(slot) => {
                        let (region, offset) = (slot.region(), slot.offset());
                        (Dest::Staged { slot, memory }, region, offset)
                    }
                    None => {
                        tracing::debug!(peer = from, "no staging slot: read refused (a miss)");
                        refused.push((i, TransferError::NoSpace));
                        continue;
                    }
                },
            };
            any_staged_remote |= rp.staged;
            let tag = self.peers.next_tag();
            items.push(TransferItem {
                remote_pool: rs.pool,
                remote_offset: rs.slot as u64 * stride,
                len: stride,
                local_pool,
                local_offset,
                tag,
            });
            send_items.push(pb::SendItem { pool: rs.pool, slot: rs.slot, generation: rs.generation, tag });
            index.push(i);
            geometry.push((stride, cap, Some(dest)));
        }
        if items.is_empty() {
            return Wave { refused, posted: None };
        }
        let limit = Instant::now() + Duration::from_millis(self.peers.config().transfer_timeout_ms);
        let earliest = index.iter().map(|&i| reads[i].deadline).min().expect("non-empty");
        let until = self.instant_of(earliest).min(limit);
        let dp = self.peers.dataplane();
        // A staged pool of the holder is never read one-sided: it sends.
        let mode = if any_staged_remote { Mode::Recv } else { self.peers.mode() };
        let t_post = Instant::now();
        if let Some(first) = index.iter().map(|&i| reads[i].started).min() {
            self.remote_metrics.transfer_post_seconds.observe(t_post.saturating_duration_since(first).as_secs_f64());
        }
        // tcp: the send order goes to the holder as active messages once
        // the receives are posted (split to stay under the message limit).
        let orders = if mode == Mode::Recv {
            send_items
                .chunks(SEND_ORDER_ITEMS)
                .map(|chunk| {
                    prost::Message::encode_to_vec(&pb::SendRequest {
                        node_id: self.id,
                        incarnation: self.incarnation,
                        holder_incarnation: inc,
                        items: chunk.to_vec(),
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        if let Some((cluster, runtime)) = inline {
            let n = index.len();
            let mut done = InlineReads {
                cluster,
                runtime,
                from,
                inc,
                reads: reads.to_vec(),
                index,
                geometry,
                reported: vec![false; n],
                mode,
                t_post,
                moved: 0,
                validating: Duration::ZERO,
                failed: false,
            };
            // Not taken: `done` is dropped with the command, and reports
            // its reads as failed from a task.
            let _ = dp.transfer_inline(mode, from, inc, items, orders, until, Box::new(move |k, o| done.ended(k, o)));
            return Wave { refused, posted: None };
        }
        let (_, rx) = dp.transfer_ordered(mode, from, inc, items, orders, until);
        Wave { refused, posted: Some(Posted { rx, index, geometry, mode, t_post, inc }) }
    }

    /// A batch of reads ended: its time, its hashing time, its bytes.
    fn read_batch_done(&self, t_post: Instant, validating: Duration, moved: u64) {
        let m = &self.remote_metrics;
        m.transfer_batch_seconds.observe(t_post.elapsed().as_secs_f64());
        m.transfer_validate_seconds.observe(validating.as_secs_f64());
        m.transfer_batch_bytes.observe(moved as f64);
        m.bytes_read.inc_by(moved);
    }

    /// Reports what a wave refused at once, then each posted read as it
    /// ends (what arrived, checked where it landed; the core validates it
    /// against the grant). Returns which reads were reported.
    async fn finish_wave(
        &self,
        from: NodeId,
        reads: &[Read],
        base: usize,
        wave: Wave,
        tx: &tokio::sync::mpsc::UnboundedSender<(usize, Result<SlotImage, TransferError>)>,
    ) -> Vec<bool> {
        let mut reported = vec![false; reads.len()];
        let report = |i: usize, r: Result<SlotImage, TransferError>, reported: &mut Vec<bool>| {
            reported[i] = true;
            let _ = tx.send((base + i, r));
        };
        for (i, e) in wave.refused {
            report(i, Err(e), &mut reported);
        }
        let Some(Posted { mut rx, index, mut geometry, mode, t_post, inc }) = wave.posted else {
            return reported;
        };
        let mut failed = false;
        let mut pending = index.len();
        let mut moved = 0u64;
        let mut validating = Duration::ZERO;
        while pending > 0 {
            let Some((k, outcome)) = rx.recv().await else { break };
            pending -= 1;
            let i = index[k];
            let result = match outcome {
                TransferOutcome::Done => {
                    let (stride, cap, dest) = &mut geometry[k];
                    let (stride, cap) = (*stride, *cap);
                    moved += stride;
                    let d = to_store(reads[i].dest);
                    let ns = reads[i].expect.key.ns;
                    let tv = Instant::now();
                    let r = match dest.take() {
                        Some(Dest::Pool(mapping)) => landed_in_pool(&mapping, d.slot, stride, cap, ns),
                        Some(Dest::Staged { slot, memory }) => {
                            // Checked where it arrived (header, trailer and
                            // the CPU form of the pool's checksum, against
                            // the grant), and only then copied into the
                            // pool; the core checks the same image again
                            // before it registers the copy. What was
                            // hashed is what is copied.
                            let image = slot.bytes(stride).map(|b| slot_image(&b, cap, ns, memory.is_gpu()));
                            match image {
                                Ok(im) if !im.matches(&reads[i].expect) => Ok(im), // refused by the core
                                Ok(im) => match slot.copy_to(&memory, d.slot as u64 * stride, stride) {
                                    Ok(()) => {
                                        if let Some(s) = self.peers.staging() {
                                            s.staged_reads.fetch_add(1, Ordering::Relaxed);
                                        }
                                        Ok(im)
                                    }
                                    Err(e) => {
                                        tracing::warn!(peer = from, "staged read: copy into the pool: {e}");
                                        Err(TransferError::NoSpace)
                                    }
                                },
                                Err(e) => {
                                    tracing::warn!(peer = from, "staged read: {e}");
                                    Err(TransferError::NoSpace)
                                }
                            }
                        }
                        None => Err(TransferError::NoSpace),
                    };
                    validating += tv.elapsed();
                    r
                }
                TransferOutcome::TimedOut => match geometry[k].2.take() {
                    // UCX may still write the staging slot it was receiving
                    // into: that one is never reused. The pool's slot was
                    // never UCX's: it is freed, not quarantined.
                    Some(Dest::Staged { slot, .. }) => {
                        slot.quarantine();
                        Err(TransferError::PeerGone)
                    }
                    _ => Err(TransferError::Timeout),
                },
                TransferOutcome::Failed(e) => {
                    tracing::debug!(peer = from, "transfer failed: {e}");
                    failed = true;
                    Err(TransferError::PeerGone)
                }
            };
            report(i, result, &mut reported);
        }
        tracing::trace!(from, reads = index.len(), move_us = t_post.elapsed().as_micros() as u64, "slots read");
        self.read_batch_done(t_post, validating, moved);
        if failed && mode != Mode::Recv {
            // (Only the handshake the reads went through: a newer one, with
            // the peer's next incarnation, stays.)
            self.peers.reset_if(from, inc).await;
        }
        reported
    }

    // ----- streams -----

    async fn link_task(self: Arc<Self>, entry: PeerEntry, mut rx: mpsc::Receiver<pb::Frame>) {
        let heartbeat = Duration::from_millis(self.cfg.heartbeat_ms);
        loop {
            match self.run_link(&entry, &mut rx, heartbeat).await {
                Ok(()) => return, // the driver is gone
                Err(e) => tracing::debug!(peer = entry.id, "coherence stream down: {e}"),
            }
            // Frames queued while down are for a stream that no longer
            // exists; the protocol retransmits what matters.
            let mut dropped = 0;
            while rx.try_recv().is_ok() {
                dropped += 1;
            }
            self.counters.queue_drops.fetch_add(dropped, Ordering::Relaxed);
            if let Some(l) = self.link_stats.get(&entry.id) {
                l.up.store(false, Ordering::Relaxed);
                l.queue_drops.fetch_add(dropped, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn run_link(
        &self,
        entry: &PeerEntry,
        rx: &mut mpsc::Receiver<pb::Frame>,
        heartbeat: Duration,
    ) -> Result<(), String> {
        let ep = self
            .peers
            .endpoint(entry.id, &entry.addr)?
            .connect_timeout(crate::dataplane::CONTROL_TIMEOUT)
            .tcp_nodelay(true);
        let channel = ep.connect().await.map_err(|e| format!("connect: {e}"))?;
        let mut client = pb::peer_client::PeerClient::new(channel).max_decoding_message_size(64 << 20);
        let (tx, out) = mpsc::channel::<pb::Frame>(self.cfg.peer_queue_frames);
        let hello = pb::StreamHello { node_id: self.id, incarnation: self.incarnation };
        tx.send(pb::Frame { body: Some(pb::frame::Body::Hello(hello)), ..Default::default() })
            .await
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(
            crate::dataplane::CONTROL_TIMEOUT,
            client.exchange(tokio_stream::wrappers::ReceiverStream::new(out)),
        )
        .await
        .map_err(|_| "stream open timed out".to_string())?
        .map_err(|s| format!("exchange: {}", s.message()))?;
        let mut inbound = resp.into_inner();
        tracing::info!(peer = entry.id, "coherence stream up");
        // From now on frames go straight into the stream: what the relay
        // holds first, under the lock senders take, so none overtakes it.
        let link = self.links.get(&entry.id).ok_or_else(|| "no link to this peer".to_string())?;
        {
            let mut stream = link.stream.lock();
            while let Ok(f) = rx.try_recv() {
                if tx.try_send(f).is_err() {
                    self.counters.queue_drops.fetch_add(1, Ordering::Relaxed);
                    if let Some(l) = self.link_stats.get(&entry.id) {
                        l.queue_drops.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            *stream = Some(tx.clone());
        }
        // Back to the relay when this stream ends, however it ends.
        struct Unpublish<'a>(&'a Link);
        impl Drop for Unpublish<'_> {
            fn drop(&mut self) {
                *self.0.stream.lock() = None;
            }
        }
        let _unpublish = Unpublish(link);
        let stats = self.link_stats.get(&entry.id);
        if let Some(l) = stats {
            l.up.store(true, Ordering::Relaxed);
        }
        let mut ping = tokio::time::interval(heartbeat);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_pong = Instant::now();
        let mut seq = 0u64;
        // A frame the stream takes no more of for three heartbeats (HTTP/2
        // flow control stalled: a peer or path gone without the connection
        // closing) ends the stream like three missed pongs: waiting on it
        // would stop this loop, and the pong check with it, until TCP gave
        // up (minutes), with the membership keepalives that ride here.
        let stalled = 3 * heartbeat;
        let send = |f: pb::Frame| {
            let tx = &tx;
            async move {
                match tokio::time::timeout(stalled, tx.send(f)).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(_)) => Err("stream closed".to_string()),
                    Err(_) => Err(format!("the stream took no frame for {stalled:?} (three heartbeats)")),
                }
            }
        };
        loop {
            tokio::select! {
                f = rx.recv() => {
                    let Some(f) = f else { return Ok(()) };
                    send(f).await?;
                }
                m = inbound.message() => match m {
                    Ok(Some(pb::Frame { body: Some(pb::frame::Body::Pong(x)), .. })) => {
                        last_pong = Instant::now();
                        if let Some(l) = stats {
                            l.last_pong_us.store(self.now_us().max(1), Ordering::Relaxed);
                        }
                        self.pong_received(entry.id, x);
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => return Err("peer closed the stream".into()),
                    Err(s) => return Err(format!("stream error: {}", s.message())),
                },
                _ = ping.tick() => {
                    if last_pong.elapsed() > 3 * heartbeat {
                        return Err("no pong for three heartbeats".into());
                    }
                    seq += 1;
                    send(pb::Frame { body: Some(pb::frame::Body::Ping(seq)), ..Default::default() }).await?;
                }
            }
        }
    }

    /// Serves a stream a peer dialled: its frames in, pongs out.
    pub async fn serve_stream(
        self: Arc<Self>,
        mut inbound: tonic::Streaming<pb::Frame>,
        authenticate: impl FnOnce(u32) -> Result<(), Status>,
    ) -> Result<FrameStream, Status> {
        let first = tokio::time::timeout(crate::dataplane::CONTROL_TIMEOUT, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no hello on the coherence stream"))??;
        let Some(pb::Frame { body: Some(pb::frame::Body::Hello(hello)), .. }) = first else {
            return Err(Status::invalid_argument("the first frame of a coherence stream must be a hello"));
        };
        let from = hello.node_id;
        authenticate(from)?;
        if !self.links.contains_key(&from) {
            return Err(Status::permission_denied(format!("node {from} is not in this daemon's peer list")));
        }
        tracing::debug!(peer = from, incarnation = hello.incarnation, "coherence stream from peer");
        let (tx, rx) = mpsc::channel::<Result<pb::Frame, Status>>(64);
        tokio::spawn(async move {
            let mut unflushed = false;
            loop {
                // Another frame already here? Process it before flushing, so
                // a burst's answers leave together.
                let next = tokio::select! {
                    biased;
                    m = inbound.message() => Some(m),
                    _ = std::future::ready(()) => None,
                };
                let m = match next {
                    Some(m) => m,
                    None => {
                        if unflushed && self.cfg.flush_when_idle {
                            self.flush();
                            self.kick_timer();
                        }
                        unflushed = false;
                        inbound.message().await
                    }
                };
                match m {
                    Ok(Some(f)) => {
                        unflushed |= matches!(f.body, Some(pb::frame::Body::Batch(_)));
                        self.on_frame(from, hello.incarnation, f, &tx);
                    }
                    Ok(None) => break,
                    Err(s) => {
                        tracing::debug!(peer = from, "coherence stream ended: {}", s.message());
                        break;
                    }
                }
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    /// Handles the coherence messages peers sent as UCX active messages
    /// (see `send_batch`), on the data-plane thread, those of one of its
    /// turns together: their answers leave together when they are done.
    fn on_controls(self: &Arc<Self>, msgs: Vec<Control>) {
        let mut batches: Vec<(NodeId, push::PushFrame)> = Vec::new();
        let mut pings = Vec::new();
        for c in msgs {
            match c {
                Control::Batch { from, .. }
                | Control::Frame { from, .. }
                | Control::Ping { from, .. }
                | Control::Pong { from, .. }
                    if !self.links.contains_key(&from) =>
                {
                    // A claim no configured peer makes (only reachable
                    // without peer TLS, like the stream's hello).
                    self.peers.refusals.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(peer = from, "coherence message from a node not in [[peers]] dropped");
                }
                Control::Batch { from, batch } => match Batch::decode(&batch) {
                    Ok(batch) => batches
                        .push((from, push::PushFrame { batch: Some(batch), answers: Vec::new(), invites: Vec::new() })),
                    Err(e) => {
                        self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(peer = from, "undecodable coherence batch: {e}");
                    }
                },
                Control::Frame { from, frame } => match push::decode_push_frame(&frame) {
                    Ok(f) => batches.push((from, f)),
                    Err(e) => {
                        self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(peer = from, "undecodable coherence frame: {e}");
                    }
                },
                Control::Ping { from, seq } => pings.push((from, seq)),
                Control::Pong { from, seq } => self.pong_received(from, seq),
            }
        }
        if batches.is_empty() && pings.is_empty() {
            return;
        }
        // One lock for the turn's batches and their answers.
        let pongs: Vec<(NodeId, Option<u64>, u64)> = {
            let mut g = self.inner.lock();
            for (from, f) in batches {
                // A peer's answers to our push invitations come before the
                // answers of the batch beside them.
                if !f.answers.is_empty() {
                    self.on_push_answers(&mut g, from, &f.answers);
                }
                if let Some(batch) = f.batch {
                    self.take_invites(&mut g, from, &f.invites, &batch);
                    self.receive_locked(&mut g, from, batch);
                }
            }
            if self.cfg.flush_when_idle {
                self.flush_locked(&mut g);
            }
            self.kick_timer_locked(&g);
            let view = g.node.view();
            pings.into_iter().map(|(from, seq)| (from, view.member(from).map(|m| m.incarnation), seq)).collect()
        };
        // Every batch the endpoint carried before a ping is handled now.
        for (from, incarnation, seq) in pongs {
            let dp = self.peers.dataplane();
            if !incarnation.is_some_and(|inc| dp.send_pong(from, inc, self.id, seq)) {
                self.send_frame(from, pb::Frame { body: Some(pb::frame::Body::Pong(seq)), ..Default::default() });
            }
        }
    }

    fn receive_locked(self: &Arc<Self>, g: &mut Inner, from: NodeId, batch: Batch) {
        tracing::trace!(from, msgs = batch.msgs.len(), first = ?batch.msgs.first(), "received batch");
        self.counters.batches_received.fetch_add(1, Ordering::Relaxed);
        let releases: Vec<(CoreSlot, u64)> = batch
            .msgs
            .iter()
            .filter_map(|m| match m {
                Msg::GrantRelease { slot, grant } => Some((*slot, *grant)),
                _ => None,
            })
            .collect();
        self.feed_locked(g, Event::Receive { from, batch });
        if !releases.is_empty() {
            self.release_grants(g, from, &releases);
        }
    }

    /// A flush barrier's ping came back.
    fn pong_received(&self, from: NodeId, seq: u64) {
        if seq >= BARRIER_BASE
            && let Some(w) = self.barriers.lock().remove(&(from, seq))
        {
            let _ = w.send(());
        }
    }

    /// A batch from a peer's stream, with the push invitations it carried.
    fn on_batch(self: &Arc<Self>, from: NodeId, bytes: &[u8], invites: &[pb::PushInvite]) {
        match Batch::decode(bytes) {
            Ok(batch) => {
                let mut g = self.inner.lock();
                self.take_invites(&mut g, from, invites, &batch);
                self.receive_locked(&mut g, from, batch);
                self.kick_timer_locked(&g);
                drop(g);
            }
            Err(e) => {
                self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(peer = from, "undecodable coherence batch: {e}");
            }
        }
    }

    fn on_frame(
        self: &Arc<Self>,
        from: NodeId,
        incarnation: u64,
        f: pb::Frame,
        pong: &mpsc::Sender<Result<pb::Frame, Status>>,
    ) {
        use pb::frame::Body;
        // A peer's answers to our push invitations come before the
        // answers of the batch beside them.
        let answered = !f.push_answers.is_empty();
        if answered {
            // Test-only (`KVMESH_TEST_HOOK=delay-push-answers-ms:N`, read
            // once): a frame with push answers that came on a stream is
            // handled N ms late (on this runtime thread, before the core
            // lock), so the pushed blocks land before the core starts
            // their reads.
            static DELAY_MS: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
            let delay = *DELAY_MS.get_or_init(|| {
                let ms = crate::peers::test_hook_ms("delay-push-answers-ms");
                if let Some(ms) = ms {
                    tracing::warn!("TEST HOOK ACTIVE: push answers from streams are handled {ms} ms late");
                }
                ms
            });
            if let Some(ms) = delay {
                std::thread::sleep(Duration::from_millis(ms));
            }
            self.on_push_answers(&mut self.inner.lock(), from, &f.push_answers);
        }
        match f.body {
            Some(Body::Batch(bytes)) => self.on_batch(from, &bytes, &f.push_invites),
            Some(Body::Keepalive(ka)) => {
                let ka = KeepAlive {
                    node: from,
                    incarnation: ka.incarnation,
                    sent_at_us: ka.sent_at_us,
                    epoch_seen: ka.epoch_seen,
                    capacity: ka.capacity,
                };
                {
                    let mut g = self.inner.lock();
                    let actions = g.membership.peer_keepalive(ka, self.now_us());
                    self.run_membership(&mut g, actions);
                }
                self.kick_timer();
            }
            Some(Body::Leave(l)) => {
                tracing::info!(peer = from, incarnation = l.incarnation, "membership: peer left the cluster");
                {
                    let mut g = self.inner.lock();
                    let actions = g.membership.peer_leave(from, l.incarnation, self.now_us());
                    self.run_membership(&mut g, actions);
                }
                self.kick_timer();
            }
            Some(Body::KeepaliveAck(_)) | Some(Body::View(_)) if from != self.coordinator => {
                // Only the configured coordinator grants leases and
                // publishes views.
                self.counters.membership_foreign_drops.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(peer = from, "membership frame from a daemon that is not the coordinator; dropped");
            }
            Some(Body::KeepaliveAck(ack)) => {
                if let Some(v) = ack.view {
                    self.on_view(from_pb_view(&v));
                }
                self.feed(Event::KeepAliveAck { sent_at: ack.sent_at_us });
            }
            Some(Body::View(v)) => self.on_view(from_pb_view(&v)),
            Some(Body::Ping(x)) => {
                let _ = pong.try_send(Ok(pb::Frame { body: Some(Body::Pong(x)), ..Default::default() }));
            }
            // A ping that came as an active message, answered on the stream.
            Some(Body::Pong(x)) => self.pong_received(from, x),
            None if answered => {}
            Some(Body::Hello(_)) | None => {
                tracing::debug!(peer = from, incarnation, "unexpected frame on a coherence stream");
            }
        }
    }

    fn on_view(self: &Arc<Self>, view: View) {
        if let Err((why, impossible)) = self.check_view(&view) {
            // Kept out of the core and of the epoch this daemon reports. A
            // member outside `[[peers]]` is a configuration mismatch (the
            // daemons list different nodes) as much as a hostile view:
            // logged; counted as a refusal only when no honest coordinator
            // could have sent it.
            if impossible {
                self.peers.refusals.fetch_add(1, Ordering::Relaxed);
            }
            tracing::warn!(epoch = view.epoch, "membership: view refused: {why}");
            return;
        }
        let newer = {
            let mut g = self.inner.lock();
            let newer = view.epoch > g.node.view().epoch;
            g.epoch_seen = g.epoch_seen.max(view.epoch);
            if newer {
                self.feed_locked(&mut g, Event::View(view.clone()));
            }
            newer
        };
        self.kick_timer();
        if newer {
            self.renew_stale_handshakes(view);
        }
    }

    /// Handshakes with members of `view` that restarted are stale: forgets
    /// them (the background task shakes hands with the new incarnation,
    /// which gives the data plane an endpoint to it).
    fn renew_stale_handshakes(self: &Arc<Self>, view: View) {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            for m in &view.members {
                if m.id == me.id {
                    continue;
                }
                // Only the handshake read here: one made meanwhile (a
                // read that met the restart reconnected) stays.
                if let Some((inc, _, _)) = me.peers.conn_info(m.id).await
                    && inc != m.incarnation
                {
                    me.peers.reset_if(m.id, inc).await;
                }
            }
        });
    }

    /// Wakes the core when it needs time to pass: `Node::next_timeout` is
    /// O(log n) (the earliest of its ordered timers), so it is recomputed
    /// after every event that may have changed it; a `Tick` does only the
    /// work due. Idle, the task wakes for keepalives and housekeeping only.
    async fn timer_task(self: Arc<Self>) {
        let keepalive = Duration::from_millis(self.cfg.keepalive_ms);
        let mut next_housekeeping = Instant::now();
        loop {
            let next = {
                let mut g = self.inner.lock();
                let next = g.node.next_timeout();
                g.timer_armed = next.unwrap_or(u64::MAX);
                next
            }
            .map(|t| self.instant_of(t));
            let wake = next.map_or(next_housekeeping, |t| t.min(next_housekeeping));
            tokio::select! {
                _ = tokio::time::sleep_until(wake.into()) => {}
                _ = self.timer.notified() => continue,
            }
            let now = Instant::now();
            if now >= next_housekeeping {
                next_housekeeping = now + keepalive;
                self.housekeeping(now);
                self.send_held_frame(now);
            }
            if next.is_some_and(|t| t <= now) {
                self.feed(Event::Tick);
            }
        }
    }

    /// Test-only: sends the frame the hold hook kept back, once due.
    fn send_held_frame(&self, now: Instant) {
        let Some(h) = &self.held else { return };
        let due = {
            let mut h = h.lock();
            match std::mem::replace(&mut *h, HeldFrame::Sent) {
                HeldFrame::Holding(at, to, f) if at <= now => Some((to, f)),
                other => {
                    *h = other;
                    None
                }
            }
        };
        if let Some((to, f)) = due {
            tracing::warn!(to, "TEST HOOK: sending the held registration batch");
            self.send_frame(to, f);
        }
    }

    /// Membership failure detection; forgetting expired grant pins.
    fn housekeeping(self: &Arc<Self>, now: Instant) {
        let mut g = self.inner.lock();
        while let Some(&(until, peer, grant)) = g.grant_expiry.front()
            && until <= now
        {
            g.grant_expiry.pop_front();
            if g.grant_pins.get(&(peer, grant)).is_some_and(|&(_, u)| u == until) {
                g.grant_pins.remove(&(peer, grant));
            }
        }
        self.sweep_pushes(&mut g, now);
        let actions = g.membership.tick(self.now_us());
        self.run_membership(&mut g, actions);
    }

    // ----- engine calls -----

    /// Registers ops and feeds their events under one lock.
    fn submit(self: &Arc<Self>, ops: Vec<(WaitKind, Call)>) -> Vec<oneshot::Receiver<OpResult>> {
        let mut rxs = Vec::with_capacity(ops.len());
        {
            let mut g = self.inner.lock();
            let now = self.now_us();
            for (kind, make) in ops {
                let op = g.next_op;
                g.next_op += 1;
                let (tx, rx) = oneshot::channel();
                g.waiters.insert(op, Waiter { kind, tx, started: Instant::now(), read_started: None, read_done: None });
                rxs.push(rx);
                let ev = match make {
                    Call::Get(key) => Event::ClientGet { op, key },
                    Call::Put(key, slot, checksum) => Event::ClientPut { op, key, slot, checksum },
                    Call::Invalidate(key) => Event::ClientInvalidate { op, key },
                    Call::Lookup(keys) => Event::ClientLookup { op, keys },
                };
                self.feed_locked_at(&mut g, ev, now);
            }
            if self.cfg.flush_when_idle {
                self.flush_locked(&mut g);
            }
            self.kick_timer_locked(&g);
        }
        rxs
    }

    async fn collect(&self, rxs: Vec<oneshot::Receiver<OpResult>>) -> Vec<OpResult> {
        // Every op has a deadline in the core; this bound only guards
        // against a driver bug leaving a waiter behind.
        let bound = Duration::from_millis(self.cfg.op_timeout_ms) * 2 + Duration::from_secs(1);
        let mut out = Vec::with_capacity(rxs.len());
        for rx in rxs {
            out.push(match tokio::time::timeout(bound, rx).await {
                Ok(Ok(r)) => r,
                _ => OpResult::Error(ErrorKind::Timeout),
            });
        }
        out
    }

    /// Gets blocks for an engine session: local copies or fetched from
    /// their holders; each hit is pinned for `session`.
    pub async fn get(
        self: &Arc<Self>,
        session: SessionId,
        fingerprint: u64,
        keys: &[Key],
        lease_ms: u64,
    ) -> Vec<Option<PinOutcome>> {
        let ops = keys
            .iter()
            .map(|&k| {
                let key = block_key(fingerprint, k);
                (WaitKind::Get { session, lease_ms }, Call::Get(key))
            })
            .collect();
        let rxs = self.submit(ops);
        self.collect(rxs)
            .await
            .into_iter()
            .map(|r| match r {
                OpResult::Hit(p) => Some(p),
                _ => None,
            })
            .collect()
    }

    /// Where `keys` are Valid in the cluster (see `Event::ClientLookup`):
    /// per key the node holding it, and whether every home answered.
    /// Nothing is pinned, granted or moved.
    pub async fn lookup(
        self: &Arc<Self>,
        fingerprint: u64,
        keys: &[Key],
    ) -> Result<(Vec<Option<NodeId>>, bool), String> {
        let keys: Vec<BlockKey> = keys.iter().map(|&k| block_key(fingerprint, k)).collect();
        // From the homes' tables where this process maps them (no question
        // sent, nobody woken); asked of the homes when a table cannot say.
        if let Some(rx) = self.lookup_tables(&keys) {
            match rx.await {
                Ok(OpResult::Located(found, true)) => return Ok((found, true)),
                Ok(OpResult::Error(e)) => return Err(error_text(e)),
                _ => {}
            }
        }
        let rxs = self.submit(vec![(WaitKind::Other, Call::Lookup(keys))]);
        match self.collect(rxs).await.pop() {
            Some(OpResult::Located(found, complete)) => Ok((found, complete)),
            Some(OpResult::Error(e)) => Err(error_text(e)),
            other => Err(format!("unexpected outcome {other:?}")),
        }
    }

    /// A lookup answered from the homes' lookup tables
    /// (`Node::lookup_tables`), read in place through this process's
    /// mappings of them; `None` where this daemon keeps no table (then it
    /// reads none either). The answer is ready when this returns.
    fn lookup_tables(self: &Arc<Self>, keys: &[BlockKey]) -> Option<oneshot::Receiver<OpResult>> {
        let dp = self.peers.dataplane();
        if !dp.maps_peer_tables() {
            return None; // (tcp, RDMA: nothing to read in place)
        }
        let mut mapped: HashMap<NodeId, Option<Arc<kvmesh_ucx::RemoteWords>>> = HashMap::new();
        let mut read = |h: NodeId, k: &BlockKey| -> Option<(TableHeader, Option<TableEntry>)> {
            let words = mapped.entry(h).or_insert_with(|| dp.peer_table(h)).as_ref()?;
            words
                .with(|w| {
                    let r = TableReader::new(w)?;
                    let h = r.header()?;
                    let entry = match r.get(k.ns, k.key) {
                        Probe::Found(v) => Some(TableEntry::from_words(v)?),
                        Probe::Absent => None,
                        Probe::Unknown => return None,
                    };
                    // The entry belongs to that header only if the header
                    // did not change meanwhile (a view change rewrites the
                    // header before it clears the entries).
                    if r.header()? != h {
                        return None;
                    }
                    let header =
                        TableHeader { node: h.node, incarnation: h.incarnation, epoch: h.epoch, ready: h.ready };
                    Some((header, entry))
                })
                .flatten()
        };
        let mut g = self.inner.lock();
        g.table.as_ref()?;
        let now = self.now_us();
        let op = g.next_op;
        g.next_op += 1;
        let (tx, rx) = oneshot::channel();
        g.waiters.insert(
            op,
            Waiter { kind: WaitKind::Other, tx, started: Instant::now(), read_started: None, read_done: None },
        );
        let mut queue = VecDeque::new();
        let actions = g.node.lookup_tables(now, op, keys.to_vec(), &mut read);
        apply_table(&mut g);
        for a in actions {
            self.execute(&mut g, a, &mut queue);
        }
        while let Some(ev) = queue.pop_front() {
            self.feed_locked(&mut g, ev);
        }
        self.dispatch_reads(&mut g);
        // (An op the core did not end at once would leave its waiter for
        // the message path's answer: never, `lookup_tables` ends it.)
        g.waiters.remove(&op);
        Some(rx)
    }

    /// Publishes written slots (checksummed) as the keys' next versions.
    pub async fn publish(self: &Arc<Self>, items: &[(SlotRef, u64, Key, u64)]) -> Vec<Result<u64, String>> {
        let ops = items
            .iter()
            .map(|&(slot, fingerprint, k, checksum)| {
                let key = block_key(fingerprint, k);
                (WaitKind::Other, Call::Put(key, to_core(slot), checksum))
            })
            .collect();
        let rxs = self.submit(ops);
        self.collect(rxs)
            .await
            .into_iter()
            .map(|r| match r {
                OpResult::Stored(v) => Ok(v),
                OpResult::Error(e) => Err(error_text(e)),
                other => Err(format!("unexpected outcome {other:?}")),
            })
            .collect()
    }

    /// Invalidates keys cluster-wide; retries keys that were busy (another
    /// change in progress) until `deadline`. Returns (done, failed, first
    /// error).
    pub async fn invalidate(self: &Arc<Self>, keys: Vec<BlockKey>, deadline: Instant) -> (u64, u64, String) {
        let mut pending = keys;
        let mut done = 0u64;
        let mut first_error = String::new();
        // Paced: a window of keys in flight at a time. The same throughput
        // as one burst (the work is the same), but each change waits behind
        // a window's worth of work, not behind the whole call's.
        let chunk = self.cfg.invalidate_window.min(self.cfg.ops_max / 2).max(1);
        loop {
            let mut retry = Vec::new();
            for part in pending.chunks(chunk) {
                let ops = part.iter().map(|&key| (WaitKind::Other, Call::Invalidate(key))).collect();
                let rxs = self.submit(ops);
                for (key, r) in part.iter().zip(self.collect(rxs).await) {
                    match r {
                        OpResult::Invalidated => done += 1,
                        OpResult::Error(e) => {
                            if first_error.is_empty() {
                                first_error = error_text(e);
                            }
                            retry.push(*key);
                        }
                        other => {
                            first_error = format!("unexpected outcome {other:?}");
                            retry.push(*key);
                        }
                    }
                }
            }
            if retry.is_empty() {
                return (done, 0, String::new());
            }
            if Instant::now() + Duration::from_millis(20) >= deadline {
                return (done, retry.len() as u64, first_error);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            pending = retry;
        }
    }

    /// Every key of a namespace known to any daemon of the cluster. Fails
    /// when a member cannot be asked (its keys would be missed), and on a
    /// daemon that is not a serving member: its view may not name the
    /// others (just restarted, or cut off from the membership service), and
    /// an empty list would be reported as a namespace invalidated while
    /// copies stay Valid elsewhere (found by `kvmesh-nemesis`).
    pub async fn namespace_keys(self: &Arc<Self>, fingerprint: u64) -> Result<Vec<BlockKey>, String> {
        let (epoch, members): (u64, Vec<NodeId>) = {
            let g = self.inner.lock();
            if !g.node.serving_at(self.now_us()) {
                return Err(error_text(ErrorKind::NotMember));
            }
            let v = g.node.view();
            (v.epoch, v.members.iter().map(|m| m.id).filter(|&id| id != self.id).collect())
        };
        let mut keys: HashSet<BlockKey> = self.local_keys(fingerprint).into_iter().collect();
        for id in members {
            if self.peers.conn_info(id).await.is_none() {
                self.peers.connect_to(id).await;
            }
            let Some((_, _, mut client)) = self.peers.conn_info(id).await else {
                return Err(format!("member node {id} is not connected: its keys cannot be listed"));
            };
            let r = client
                .list_keys(pb::ListKeysRequest { namespace_fingerprint: fingerprint })
                .await
                .map_err(|s| format!("node {id}: list keys: {}", s.message()))?;
            for b in r.into_inner().keys {
                if b.namespace_fingerprint == fingerprint {
                    keys.insert(block_key(fingerprint, Key::from_parts(b.key_hi, b.key_lo)));
                }
            }
        }
        // A view that changed meanwhile may have members not asked.
        {
            let g = self.inner.lock();
            if g.node.view().epoch != epoch || !g.node.serving_at(self.now_us()) {
                return Err("the cluster's membership changed while its keys were listed; retry".into());
            }
        }
        let mut v: Vec<BlockKey> = keys.into_iter().collect();
        v.sort();
        Ok(v)
    }

    /// Keys of a namespace this daemon knows: directory entries it keeps as
    /// home (still held somewhere or changing) and its Valid copies.
    pub fn local_keys(&self, fingerprint: u64) -> Vec<BlockKey> {
        let g = self.inner.lock();
        let mut out: Vec<BlockKey> = g
            .node
            .directory()
            .filter(|(k, d)| k.ns == fingerprint && (!d.holders.is_empty() || d.changing))
            .map(|(k, _)| k)
            .chain(g.node.copies().filter(|(k, _, _)| k.ns == fingerprint).map(|(k, _, _)| k))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Drops this daemon's copies of keys (engine `Remove`): per key whether
    /// a copy was dropped. A copy pinned or granted stays.
    pub fn evict(self: &Arc<Self>, fingerprint: u64, keys: &[Key]) -> Vec<bool> {
        let mut out = Vec::with_capacity(keys.len());
        {
            let mut g = self.inner.lock();
            for &k in keys {
                let key = block_key(fingerprint, k);
                let can = g.node.can_evict(&key);
                if can {
                    self.feed_locked(&mut g, Event::Evict { key, slot: None });
                }
                out.push(can);
            }
            if self.cfg.flush_when_idle {
                self.flush_locked(&mut g);
            }
        }
        self.kick_timer();
        out
    }

    /// Reserves slots for an engine's put (see `Store::allocate_detached`);
    /// blocks evicted to make room are dropped from the protocol too.
    pub fn allocate(
        self: &Arc<Self>,
        session: SessionId,
        ns: u32,
        keys: &[Key],
        lease_ms: u64,
        overwrite: bool,
    ) -> Result<(Vec<crate::store::AllocOutcome>, Instant), crate::Error> {
        let mut g = self.inner.lock();
        let (res, evicted) = {
            let mut st = self.store.lock();
            // A draining daemon takes no new puts (as alone: `Store::allocate`).
            // (Blocks the core keeps for readers stay: see `allocate_detached`.)
            let keep = core_holds(&g.node);
            let how = Detached { exists_check: !overwrite, keep: &keep };
            let res = st
                .check_not_draining()
                .and_then(|()| st.allocate_detached(session, ns, keys, lease_ms, how, Instant::now()));
            (res, st.take_evicted())
        };
        let any = !evicted.is_empty();
        for (fp, k, r) in evicted {
            self.feed_locked(&mut g, Event::Evict { key: block_key(fp, k), slot: Some(to_core(r)) });
        }
        if any && self.cfg.flush_when_idle {
            self.flush_locked(&mut g);
        }
        self.kick_timer_locked(&g);
        drop(g);
        res
    }

    /// Every configured peer: its stream and its place in the view.
    pub fn links(&self) -> Vec<LinkInfo> {
        let view = self.inner.lock().node.view().clone();
        let now = self.now_us();
        let mut out: Vec<LinkInfo> = self
            .link_stats
            .iter()
            .map(|(&id, l)| {
                let pong = l.last_pong_us.load(Ordering::Relaxed);
                LinkInfo {
                    id,
                    up: l.up.load(Ordering::Relaxed),
                    last_pong_ago: (pong > 0).then(|| Duration::from_micros(now.saturating_sub(pong))),
                    queue_drops: l.queue_drops.load(Ordering::Relaxed),
                    view_incarnation: view.member(id).map(|m| m.incarnation),
                }
            })
            .collect();
        out.sort_by_key(|l| l.id);
        out
    }

    /// Leaves the cluster for good (a drain, before the process exits):
    /// the core stops serving first (`Event::Leave`: operations fail,
    /// copies are dropped and their homes told), then the membership is
    /// asked to remove this daemon now (static: a `Leave` frame to the
    /// coordinator; etcd: the lease is revoked), so no peer waits out a
    /// lease for it. Waits up to `wait` for every peer of the view to have
    /// handled what was sent (a ping after it, answered) and for etcd.
    pub async fn leave(self: &Arc<Self>, wait: Duration) -> LeaveReport {
        let deadline = tokio::time::Instant::now() + wait;
        let bug = planted_bug() == Some(kvmesh_coherence::Bug::LeaveBeforeStop);
        let mut report = LeaveReport::default();
        let peers: Vec<(NodeId, u64)> = {
            let mut g = self.inner.lock();
            if bug {
                tracing::warn!("PLANTED BUG leave-before-stop: asking the membership first");
            } else {
                report.copies_dropped = g.node.copy_count();
                self.feed_locked(&mut g, Event::Leave);
                self.flush_locked(&mut g);
            }
            let actions = g.membership.leave(self.id, self.incarnation, self.now_us());
            self.run_membership(&mut g, actions);
            g.node.view().members.iter().filter(|m| m.id != self.id).map(|m| (m.id, m.incarnation)).collect()
        };
        self.kick_timer();
        if bug {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut g = self.inner.lock();
            report.copies_dropped = g.node.copy_count();
            self.feed_locked(&mut g, Event::Leave);
            self.flush_locked(&mut g);
        }
        report.peers = peers.len();
        // A ping behind what went on each path to the peer: its stream,
        // and its data-plane endpoint where batches went that way.
        let mut waits = Vec::new();
        for (p, incarnation) in peers {
            let mut rxs = Vec::new();
            for ucx in [false, true] {
                let seq = self.next_barrier.fetch_add(1, Ordering::Relaxed);
                let (tx, rx) = oneshot::channel();
                self.barriers.lock().insert((p, seq), tx);
                if !ucx {
                    self.send_frame(p, pb::Frame { body: Some(pb::frame::Body::Ping(seq)), ..Default::default() });
                } else if !(self.control_ucx && self.peers.dataplane().send_ping(p, incarnation, self.id, seq)) {
                    // Not sent (no endpoint to that incarnation, or the
                    // peer takes no such messages): nothing went that way.
                    self.barriers.lock().remove(&(p, seq));
                    continue;
                }
                rxs.push(rx);
            }
            waits.push(rxs);
        }
        for rxs in waits {
            let mut confirmed = true;
            for rx in rxs {
                confirmed &= matches!(tokio::time::timeout_at(deadline, rx).await, Ok(Ok(())));
            }
            if confirmed {
                report.peers_confirmed += 1;
            }
        }
        self.barriers.lock().clear();
        if let Some(st) = &self.etcd_status {
            let notified = st.left_notify.notified();
            let left = st.left.load(Ordering::SeqCst) || tokio::time::timeout_at(deadline, notified).await.is_ok();
            report.etcd_left = Some(left || st.left.load(Ordering::SeqCst));
        }
        report
    }

    /// Whether the coherence state can be locked within `wait` (the
    /// watchdog's probe: a deadlocked or wedged driver cannot).
    pub fn responsive(&self, wait: Duration) -> bool {
        self.inner.try_lock_for(wait).is_some()
    }

    /// What `kvmesh stats` shows about coherence.
    pub fn stats(&self) -> kvmesh_proto::engine::v1::CoherenceStats {
        let etcd = self.etcd_status.as_ref();
        let control = self.peers.dataplane().control_counters();
        let staging = self.peers.staging();
        let g = self.inner.lock();
        let m = g.node.metrics();
        let h = &m.inval_to_ack_us;
        kvmesh_proto::engine::v1::CoherenceStats {
            serving: g.node.serving_at(self.now_us()),
            epoch: g.node.view().epoch,
            members: g.node.view().members.len() as u32,
            batches_sent: m.batches_sent,
            msgs_sent: m.msgs_sent,
            invalidates_sent: m.invalidates_sent,
            acks_sent: m.acks_sent,
            ack_batches_sent: m.ack_batches_sent,
            stale_epoch_drops: m.stale_epoch_drops,
            validation_failures: m.validation_failures,
            late_transfers: m.late_transfers,
            grants_outstanding: m.grants_outstanding,
            changes_completed: m.changes_completed,
            inval_to_ack_count: h.count,
            inval_to_ack_p50_us: h.quantile_upper_bound(0.5),
            inval_to_ack_p99_us: h.quantile_upper_bound(0.99),
            inval_to_ack_max_us: h.max,
            peer_queue_drops: self.counters.queue_drops.load(Ordering::Relaxed),
            decode_errors: self.counters.decode_errors.load(Ordering::Relaxed),
            batches_received: self.counters.batches_received.load(Ordering::Relaxed),
            ops_in_flight: g.node.ops_in_flight() as u32,
            ignored_acks: m.ignored_acks,
            directory_ready: g.node.directory_ready(),
            inval_to_ack_buckets: h.buckets.clone(),
            locate_grants: m.locate_grants,
            membership_recovering: g.membership.recovering(),
            incarnations_held_back: g.membership.incarnations_held_back(),
            unsolicited_keepalive_acks: m.unsolicited_keepalive_acks,
            membership_foreign_drops: self.counters.membership_foreign_drops.load(Ordering::Relaxed),
            epoch_persist_failures: self.counters.epoch_persist_failures.load(Ordering::Relaxed),
            etcd_connected: etcd.is_some_and(|s| s.connected.load(Ordering::Relaxed)),
            etcd_errors: etcd.map_or(0, |s| s.errors.load(Ordering::Relaxed)),
            etcd_keepalives_dropped: etcd.map_or(0, |s| s.keepalives_dropped.load(Ordering::Relaxed)),
            copies: g.node.copy_count() as u64,
            directory_entries: g.node.directory_len() as u64,
            peer_refusals: m.peer_refusals + self.peers.refusals.load(Ordering::Relaxed) + control.sends_refused,
            versions_exhausted: m.versions_exhausted,
            peer_auth_refusals: self.peers.auth_refusals(),
            lease_lapses: m.lease_lapses,
            copies_dropped_lapsed: m.copies_dropped_lapsed,
            lookups: m.lookups,
            lookups_incomplete: m.lookups_incomplete,
            lookup_questions_answered: m.lookup_questions_answered,
            lookups_one_sided: m.lookups_one_sided,
            lookup_table_fallbacks: m.lookup_table_fallbacks,
            lookup_table_entries: g.table.as_ref().map_or(0, |t| t.placed() as u64),
            lookup_table_overflowed: g.table.as_ref().map_or(0, |t| t.overflowed() as u64),
            control_am_sent: control.sent,
            control_am_direct: control.direct,
            control_am_received: control.received,
            control_am_drops: control.drops,
            staged_reads: staging.map_or(0, |s| s.staged_reads.load(Ordering::Relaxed)),
            staged_sends: staging.map_or(0, |s| s.staged_sends.load(Ordering::Relaxed)),
            staging_exhausted: staging.map_or(0, |s| s.exhausted.load(Ordering::Relaxed)),
            pending_registrations: m.pending_registrations,
            early_registrations: m.early_registrations,
            push_invites: self.push_counters.invites.load(Ordering::Relaxed),
            pushes_used: self.push_counters.used.load(Ordering::Relaxed),
            pushes_unused: self.push_counters.unused.load(Ordering::Relaxed),
            pushes_sent: self.push_counters.sent.load(Ordering::Relaxed),
            pushes_landed_first: self.push_counters.landed_inline.load(Ordering::Relaxed),
            timer_kicks: self.counters.timer_kicks.load(Ordering::Relaxed),
        }
    }

    /// Deadline of an engine's `Invalidate`.
    pub fn invalidate_deadline(&self) -> Instant {
        Instant::now() + Duration::from_millis(self.cfg.invalidate_timeout_ms)
    }
}

/// The epoch a previous incarnation of this coordinator persisted (0 when
/// there is no file: a first start).
fn read_epoch(path: &Path) -> anyhow::Result<u64> {
    match std::fs::read_to_string(path) {
        Ok(s) => s.trim().parse::<u64>().map_err(|e| {
            anyhow::anyhow!(
                "{}: expected the last published membership epoch (an integer), found {s:?}: {e}",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(anyhow::anyhow!("cannot read the membership epoch file {}: {e}", path.display())),
    }
}

/// Durably replaces the epoch file (write a temporary file, fsync, rename,
/// fsync the directory).
fn write_epoch(path: &Path, epoch: u64) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    writeln!(f, "{epoch}")?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// This daemon's lookup table: UCX-allocated memory (so peers on shared
/// memory map it) of 256 bytes per local slot — room for twice as many keys
/// homed here as the pools hold, at half load — at least 512 KiB, at most
/// what peers accept. `None` (lookups then ask the homes) where it cannot
/// be made.
fn make_table(peers: &Peers, local_slots: usize) -> Option<TableWriter<RegionWords>> {
    use kvmesh_common::table::{groups_for, table_words};
    if peers.config().transports == "tcp" {
        // Nothing maps it over tcp: lookups of keys homed here ask.
        tracing::info!("no lookup table on tcp (peers would not read it)");
        return None;
    }
    let entries = local_slots.saturating_mul(2).max(4096);
    let bytes = table_words(groups_for(entries)).saturating_mul(8).min(crate::peers::PEER_TABLE_BYTES_MAX as usize);
    let made = peers.dataplane().allocate_table(bytes).and_then(|mr| {
        let words = RegionWords::new(mr).ok_or("lookup table memory not UCX-allocated")?;
        TableWriter::new(words).map_err(|e| e.to_string())
    });
    match made {
        Ok(t) => {
            tracing::info!(bytes, groups = t.groups(), "lookup table: peers on shared memory read it in place");
            Some(t)
        }
        Err(e) => {
            tracing::warn!("no lookup table ({e}): lookups of keys homed here ask this daemon");
            None
        }
    }
}

/// Writes what the core's last step changed in its lookup table into this
/// daemon's table, and its header when that changed: on a reset or a new
/// header, a "not ready" header before the entries change and the new one
/// after them, so no reader believes entries under a header they were not
/// written for (readers also re-read the header after an entry).
/// Called after every step, before its actions are carried out.
fn apply_table(g: &mut Inner) {
    let Some(t) = g.table.as_mut() else { return };
    let changes = g.node.take_table_changes();
    if let Some(d) = g.table_delay
        && !changes.entries.is_empty()
    {
        std::thread::sleep(d);
    }
    let h = g.node.table_header();
    let h = TableWords { node: h.node, incarnation: h.incarnation, epoch: h.epoch, ready: h.ready };
    if changes.reset || g.table_header != Some(h) {
        // Not ready while the entries are rewritten.
        let not_ready = TableWords { ready: false, ..h };
        if g.table_header != Some(not_ready) {
            t.set_header(not_ready);
            g.table_header = Some(not_ready);
        }
    }
    if changes.reset {
        t.clear();
    }
    for (k, e) in changes.entries {
        match e {
            Some(e) => t.set(k.ns, k.key, e.to_words()),
            None => t.remove(k.ns, k.key),
        }
    }
    if g.table_header != Some(h) {
        t.set_header(h);
        g.table_header = Some(h);
    }
}

/// A protocol bug planted for tests (`KVMESH_TEST_BUG`), to prove the
/// cluster test's checks can fail. Never set in production.
fn planted_bug() -> Option<kvmesh_coherence::Bug> {
    let name = std::env::var("KVMESH_TEST_BUG").ok()?;
    match kvmesh_coherence::Bug::parse(&name) {
        Some(b) => {
            tracing::warn!("TEST HOOK ACTIVE: coherence bug {name:?} planted; this daemon may serve stale blocks");
            Some(b)
        }
        None => {
            tracing::error!(
                "KVMESH_TEST_BUG={name:?} names no bug (known: {:?}); ignored",
                kvmesh_coherence::Bug::NAMES
            );
            None
        }
    }
}

fn error_text(e: ErrorKind) -> String {
    match e {
        ErrorKind::Busy => "busy: another write or invalidation of the key is in progress, or the cluster is \
                            rebuilding its directory after a membership change; retry"
            .into(),
        ErrorKind::Timeout => "timed out waiting for the key's home daemon".into(),
        ErrorKind::NotMember => "this daemon is not a serving cluster member (no membership lease)".into(),
        ErrorKind::Overloaded => "too many coherence operations in flight (coherence.ops_max)".into(),
    }
}

fn pb_view(v: &View) -> pb::View {
    pb::View {
        epoch: v.epoch,
        members: v
            .members
            .iter()
            .map(|m| pb::Member { id: m.id, incarnation: m.incarnation, capacity: m.capacity })
            .collect(),
    }
}

impl Cluster {
    /// A view may only list this node and its configured peers, each once,
    /// under an epoch that leaves room for versions.
    /// The error says whether no honest coordinator could have sent it.
    fn check_view(&self, v: &View) -> Result<(), (String, bool)> {
        if v.epoch > kvmesh_coherence::EPOCH_MAX {
            return Err((format!("epoch {} is above the most a view may have", v.epoch), true));
        }
        let mut seen = std::collections::HashSet::new();
        for m in &v.members {
            if !seen.insert(m.id) {
                return Err((format!("member {} listed twice", m.id), true));
            }
            if m.id != self.id && !self.links.contains_key(&m.id) {
                return Err((
                    format!(
                        "member {} is neither this node nor one of its [[peers]] (every daemon must list the same \
                         nodes)",
                        m.id
                    ),
                    false,
                ));
            }
        }
        Ok(())
    }
}

fn from_pb_view(v: &pb::View) -> View {
    View {
        epoch: v.epoch,
        members: v
            .members
            .iter()
            .map(|m| Member { id: m.id, incarnation: m.incarnation, capacity: m.capacity.max(1) })
            .collect(),
    }
}

/// What a slot copy holds, as the core compares it with a grant. An
/// unreadable header or trailer becomes an image that matches nothing.
/// Slots named in one send-order message: each item encodes in at most 38
/// bytes, so 1,024 stay well under the data plane's message limit.
const SEND_ORDER_ITEMS: usize = 1024;
const _: () = assert!(SEND_ORDER_ITEMS * 38 + 64 <= crate::dataplane::SEND_ORDER_BYTES_MAX);

/// A wave of reads handed to the data plane (or not): what
/// [`Cluster::finish_wave`] needs to report them.
struct Wave {
    /// Reads refused before posting (by index in the wave), with why.
    refused: Vec<(usize, TransferError)>,
    /// The reads posted, if any.
    posted: Option<Posted>,
}

/// Reads the data plane is moving.
struct Posted {
    /// One outcome per posted read, as each ends.
    rx: tokio::sync::mpsc::UnboundedReceiver<(usize, TransferOutcome)>,
    /// Index in the wave of each posted read.
    index: Vec<usize>,
    /// Per posted read: slot stride, payload capacity, where it lands.
    geometry: Vec<(u64, u64, Option<Dest>)>,
    mode: Mode,
    /// When it was handed to the data plane.
    t_post: Instant,
    /// The holder's incarnation the reads went to.
    inc: u64,
}

/// The posted reads of a small wave, reporting their outcomes on the
/// data-plane thread (see [`INLINE_DONE_READS_MAX`]): each copy that
/// arrived is checked where it landed (as [`Cluster::finish_wave`] does)
/// and fed to the core at once.
struct InlineReads {
    /// Weak: the data plane (owned by the cluster) holds this.
    cluster: std::sync::Weak<Cluster>,
    /// Entered while feeding the core (it spawns tasks).
    runtime: tokio::runtime::Handle,
    from: NodeId,
    /// The holder's incarnation the reads went to.
    inc: u64,
    /// The wave's reads.
    reads: Vec<Read>,
    /// Per posted read: its index in `reads`.
    index: Vec<usize>,
    /// Per posted read: slot stride, payload capacity, where it lands
    /// (always our pool: waves with staged pools are not inline).
    geometry: Vec<(u64, u64, Option<Dest>)>,
    /// Per posted read: reported to the core.
    reported: Vec<bool>,
    mode: Mode,
    t_post: Instant,
    moved: u64,
    validating: Duration,
    failed: bool,
}

impl InlineReads {
    fn ended(&mut self, k: usize, outcome: TransferOutcome) {
        if self.reported.get(k) != Some(&false) {
            return;
        }
        self.reported[k] = true;
        let Some(c) = self.cluster.upgrade() else { return };
        let _entered = self.runtime.enter();
        let i = self.index[k];
        let result = match outcome {
            TransferOutcome::Done => {
                let (stride, cap, dest) = &mut self.geometry[k];
                let (stride, cap) = (*stride, *cap);
                self.moved += stride;
                let d = to_store(self.reads[i].dest);
                let tv = Instant::now();
                let r = match dest.take() {
                    Some(Dest::Pool(mapping)) => {
                        landed_in_pool(&mapping, d.slot, stride, cap, self.reads[i].expect.key.ns)
                    }
                    _ => Err(TransferError::NoSpace),
                };
                self.validating += tv.elapsed();
                r
            }
            TransferOutcome::TimedOut => Err(TransferError::Timeout),
            TransferOutcome::Failed(e) => {
                tracing::debug!(peer = self.from, "transfer failed: {e}");
                self.failed = true;
                Err(TransferError::PeerGone)
            }
        };
        // Never wait for the core here: while a runtime thread holds it
        // (posting a batch, a flush), UCX would make no progress. Busy:
        // a task tells it.
        if let Some((r, result)) = c.try_read_ended(self.reads[i], result) {
            let c = Arc::clone(&c);
            self.runtime.spawn(async move { c.read_ended(r, result) });
        }
        if self.reported.iter().all(|&r| r) {
            let move_us = self.t_post.elapsed().as_micros() as u64;
            tracing::trace!(from = self.from, reads = self.index.len(), move_us, "slots read (inline)");
            c.read_batch_done(self.t_post, self.validating, self.moved);
            if self.failed && self.mode != Mode::Recv {
                let (from, inc) = (self.from, self.inc);
                self.runtime.spawn(async move { c.peers.reset_if(from, inc).await });
            }
        }
    }
}

impl Drop for InlineReads {
    /// Reads never reported (the data plane stopped, or never took the
    /// batch) failed; told to the core from a task, since this may run
    /// under the core lock.
    fn drop(&mut self) {
        let left: Vec<Read> =
            self.reported.iter().zip(&self.index).filter(|(r, _)| !**r).map(|(_, &i)| self.reads[i]).collect();
        if left.is_empty() {
            return;
        }
        self.reported.iter_mut().for_each(|r| *r = true);
        let Some(c) = self.cluster.upgrade() else { return };
        let (t_post, validating, moved) = (self.t_post, self.validating, self.moved);
        self.runtime.spawn(async move {
            for r in left {
                c.read_ended(r, Err(TransferError::PeerGone));
            }
            c.read_batch_done(t_post, validating, moved);
        });
    }
}

/// Where a read lands.
enum Dest {
    /// Straight into our pool's (host) slot.
    Pool(Arc<kvmesh_ffi_os::SharedMapping>),
    /// Into a staging slot, then copied into the pool's slot (a pool UCX
    /// cannot reach: GPU memory).
    Staged { slot: crate::staging::StagingSlot, memory: crate::memory::PoolMemory },
}

/// The store slots the core holds pinned or granted: clustered eviction
/// passes over them (`Detached::keep`).
fn core_holds(node: &Node) -> impl Fn(SlotRef) -> bool + '_ {
    |r| node.slot_held(to_core(r))
}

/// A fetch slot for `key` in namespace `ns`, reserved under the store
/// lock `st` ([`Cluster::alloc_fetch_slot`]); what that evicted goes to
/// `queue`.
fn fetch_slot_in(st: &mut Store, node: &Node, ns: u32, key: BlockKey, queue: &mut VecDeque<Event>) -> Option<CoreSlot> {
    let keep = core_holds(node);
    let how = Detached { exists_check: false, keep: &keep };
    let r =
        st.allocate_detached(FETCH_SESSION, ns, &[Key(key.key)], 0, how, Instant::now()).ok().and_then(
            |(v, _)| match v.first() {
                Some(crate::store::AllocOutcome::Allocated { slot, .. }) => Some(*slot),
                _ => None,
            },
        );
    for (fp, k, r) in st.take_evicted() {
        queue.push_back(Event::Evict { key: block_key(fp, k), slot: Some(to_core(r)) });
    }
    let r = r?;
    st.begin_commit(FETCH_SESSION, &[r]).ok()?.pop().flatten()?;
    Some(to_core(r))
}

/// What arrived in our pool's slot `slot` (`stride` bytes): its image,
/// or `NoSpace` where the mapping cannot be read there.
fn landed_in_pool(
    mapping: &Arc<kvmesh_ffi_os::SharedMapping>,
    slot: u32,
    stride: u64,
    cap: u64,
    fingerprint: u64,
) -> Result<SlotImage, TransferError> {
    match mapping.read(slot as u64 * stride, stride) {
        Ok(bytes) => Ok(slot_image(&bytes, cap, fingerprint, false)),
        Err(_) => Err(TransferError::NoSpace),
    }
}

/// What a slot's bytes say (header, trailer, payload checksum: xxh3-64, or
/// `kvsum64` for a GPU pool's slot).
fn slot_image(bytes: &[u8], cap: u64, fingerprint: u64, gpu: bool) -> SlotImage {
    let none = CoreMeta { key: BlockKey { ns: 0, key: 0 }, version: 0, generation: 0, checksum: 0 };
    let core = |m: &LayoutMeta| {
        if m.state != SlotState::Valid || m.namespace != fingerprint || m.payload_len > cap {
            none
        } else {
            CoreMeta {
                key: block_key(m.namespace, m.key),
                version: m.version,
                generation: m.generation,
                checksum: m.checksum,
            }
        }
    };
    let t = trailer_offset(cap) as usize;
    let (Ok(h), Ok(tr)) =
        (LayoutMeta::decode_header(&bytes[..HEADER_BYTES]), LayoutMeta::decode_trailer(&bytes[t..t + TRAILER_BYTES]))
    else {
        return SlotImage { header: none, trailer: none, payload_checksum: 1 };
    };
    let len = h.payload_len.min(cap) as usize;
    let payload = &bytes[HEADER_BYTES..HEADER_BYTES + len];
    let payload_checksum =
        if gpu { kvmesh_kernels::checksum::kvsum64(payload) } else { kvmesh_common::checksum(payload) };
    let mut header = core(&h);
    let trailer = core(&tr);
    if h.payload_len != tr.payload_len {
        header = none;
    }
    SlotImage { header, trailer, payload_checksum }
}
