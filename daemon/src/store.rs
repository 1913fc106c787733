//! The block store: pools of slots, the (namespace, key) index, S3-FIFO
//! eviction, and the pins and allocations of every engine session.
//!
//! **Invariants** (checked by tests, kept in release builds where cheap):
//! - a slot is reused (generation bumped) only when it is Free, and it
//!   becomes Free only with no pins and no pending allocation on it;
//! - a pinned slot is never evicted; a removed pinned slot (zombie) leaves
//!   the index at once and is freed by its last unpin;
//! - every pin and every pending allocation belongs to exactly one session
//!   and has a lease deadline; closing the session or passing the deadline
//!   releases it;
//! - the index maps a key to a Pending slot (an uncommitted put) or a Valid
//!   slot, never to a Free or zombie one.
//!
//! All state sits behind one mutex; every operation is O(batch) except
//! eviction, which is O(slots visited) and bounded by the queue lengths.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvmesh_common::slot::{HEADER_BYTES, SlotMeta, SlotState, slot_stride, trailer_offset};
use kvmesh_common::{Key, namespace_fingerprint};
use kvmesh_ffi_os::SharedMapping;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use crate::config::Config;
use crate::error::Error;
use crate::memory::{CudaMemory, PoolMemory};

/// Identifies an engine connection.
pub type SessionId = u64;

/// Which slots eviction must pass over as if pinned (see
/// [`Store::allocate_detached`]).
pub type Keep<'a> = &'a dyn Fn(SlotRef) -> bool;

/// How a clustered allocation ([`Store::allocate_detached`]) treats what
/// is cached.
#[derive(Clone, Copy)]
pub struct Detached<'a> {
    /// A key whose Valid copy is here answers `Exists`.
    pub exists_check: bool,
    /// Blocks eviction passes over as if pinned.
    pub keep: Keep<'a>,
}

/// Session of the daemon's own fetches from peers.
pub const FETCH_SESSION: SessionId = u64::MAX - 1;
/// Sessions of read grants to peers: this plus the peer's node id.
pub const PEER_SESSION_BASE: SessionId = 1 << 62;

/// Most pins one internal session (a peer's grants) holds: twice what the
/// coherence core lets one reader hold in grants.
pub const INTERNAL_PINS_MAX: u64 = 2 * kvmesh_coherence::GRANTS_PER_READER_MAX;

/// One use of one slot: (pool, slot, generation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotRef {
    /// Pool index.
    pub pool: u32,
    /// Slot index within the pool.
    pub slot: u32,
    /// Generation of the slot at the time of the reference.
    pub generation: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    /// Allocated to `session` for a put, not yet committed.
    Pending {
        session: SessionId,
    },
    /// Commit in progress (checksumming): owned by the commit task.
    Committing,
    Valid,
    /// Removed or evicted while pinned: out of the index, freed on last unpin.
    Zombie,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Queue {
    None,
    Small,
    Main,
}

#[derive(Debug)]
struct Slot {
    state: State,
    generation: u64,
    pins: u32,
    ns: u32,
    key: Key,
    version: u64,
    checksum: u64,
    payload_len: u64,
    freq: u8,
    queue: Queue,
}

/// A pool of fixed-size slots in one piece of memory (host or GPU).
pub struct Pool {
    /// Index in the daemon's pool list.
    pub index: u32,
    /// Name from the config.
    pub name: String,
    /// Device from the config.
    pub device: String,
    /// The memory.
    pub memory: PoolMemory,
    /// Largest payload of a slot.
    pub slot_payload_bytes: u64,
    /// Distance between slots.
    pub stride: u64,
    slots: Vec<Slot>,
    free: Vec<u32>,
    small: VecDeque<(u32, u64)>,
    main: VecDeque<(u32, u64)>,
    small_live: usize,
    main_live: usize,
    ghost: VecDeque<u64>,
    ghost_set: HashSet<u64>,
    valid: u32,
    pending: u32,
    pinned: u32,
    zombie: u32,
    /// Of `pending`: slots quarantined (a timed-out transfer may still
    /// write them), reserved until restart.
    quarantined: u32,
    /// Of `pending`: slots fenced (an engine whose allocation ended may
    /// still write them; see [`Store::fence`]).
    fenced: u32,
    /// Bytes mapped with huge pages when the pool was made.
    huge_page_bytes: u64,
}

impl Pool {
    fn slot_offset(&self, slot: u32) -> u64 {
        slot as u64 * self.stride
    }
    /// Offset of a slot's payload in the mapping.
    pub fn payload_offset(&self, slot: u32) -> u64 {
        self.slot_offset(slot) + HEADER_BYTES as u64
    }
    /// Number of slots.
    pub fn slot_count(&self) -> u32 {
        self.slots.len() as u32
    }
    fn used(&self) -> u32 {
        self.slot_count() - self.free.len() as u32
    }

    fn write_meta(&self, slot: u32, meta: &SlotMeta) {
        let off = self.slot_offset(slot);
        // The daemon is the only writer of headers and trailers, and it writes
        // them under the store lock, so these claims never conflict.
        // On a GPU pool these are two 64-byte copies to the device (a few
        // microseconds each, under the store lock); a failing device is
        // fatal (the panic hook aborts: no half-written slot is served).
        self.memory.copy_in(off, &meta.encode_header()).expect("header write within pool");
        self.memory
            .copy_in(off + trailer_offset(self.slot_payload_bytes), &meta.encode_trailer())
            .expect("trailer write within pool");
    }

    fn meta_of(&self, slot: u32, state: SlotState, fingerprint: u64) -> SlotMeta {
        let s = &self.slots[slot as usize];
        SlotMeta {
            state,
            namespace: fingerprint,
            key: s.key,
            version: s.version,
            generation: s.generation,
            payload_len: s.payload_len,
            checksum: s.checksum,
        }
    }

    /// Appends to eviction queue `which`. Entries of slots freed or
    /// removed since stay in a queue until eviction passes them; a queue
    /// that reaches its capacity drops them first, and grows only when at
    /// least half of it is live (so a pool below its watermark, where
    /// nothing is evicted, does not grow its queues with every put).
    fn enqueue(&mut self, which: Queue, entry: (u32, u64)) {
        let q = match which {
            Queue::Small => &mut self.small,
            Queue::Main => &mut self.main,
            Queue::None => return,
        };
        if q.len() >= q.capacity() {
            let slots = &self.slots;
            q.retain(|&(s, g)| {
                let x = &slots[s as usize];
                x.generation == g && x.queue == which && x.state == State::Valid
            });
            if q.len() > q.capacity() / 2 {
                q.reserve(q.capacity().max(16));
            }
        }
        q.push_back(entry);
    }

    fn ghost_add(&mut self, h: u64) {
        if self.ghost_set.insert(h) {
            self.ghost.push_back(h);
            while self.ghost.len() > self.slots.len() {
                if let Some(old) = self.ghost.pop_front() {
                    self.ghost_set.remove(&old);
                }
            }
        }
    }
}

/// A registered namespace.
#[derive(Clone, Debug)]
pub struct Namespace {
    /// Handle used by requests.
    pub id: u32,
    /// Name.
    pub name: String,
    /// Size of every block in bytes.
    pub block_bytes: u64,
    /// Layout fingerprint string.
    pub layout: String,
    /// Pool holding its blocks.
    pub pool: u32,
    /// Fingerprint written into slot headers.
    pub fingerprint: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum LeaseKind {
    Pin,
    Alloc,
}

#[derive(Default)]
struct Session {
    /// Pins: slot -> (count, lease id).
    pins: HashMap<SlotRef, (u32, u64)>,
    /// Pins held, a slot pinned again counted again (the sum of the
    /// counts): what `limits.pins_per_session_max` bounds, so no slot's
    /// pin count can overflow.
    pin_total: u64,
    /// Pending allocations: slot -> lease id.
    allocs: HashMap<SlotRef, u64>,
    /// Allocations whose lease passed while the session was open: fenced
    /// until the session commits or aborts them, or closes.
    fenced: HashSet<SlotRef>,
}

/// Tells whether the process that wrote through a session can still write
/// (its mapping of the pools lives as long as it does).
pub trait WriterProbe: Send + Sync {
    /// The process has exited: nothing of it writes any more.
    fn gone(&self) -> bool;
}

/// A slot kept from reuse because the engine that allocated it may still
/// be writing it.
struct Fence {
    since: Instant,
    /// Whose allocation it was, while that session is open.
    session: Option<SessionId>,
    /// Once the session closed: the engine's process, while it lives (its
    /// key in `Store::fence_writers`).
    writer: Option<usize>,
}

/// The key of a process in `Store::fence_writers` (its probe's address:
/// unique while the map holds the probe).
fn writer_key(w: &Arc<dyn WriterProbe>) -> usize {
    Arc::as_ptr(w).cast::<()>() as usize
}

/// One lease covers the pins (or allocations) of one request. `live`
/// counts the session records that still point at it; the lease is dropped
/// when it reaches zero or when the deadline passes, whichever is first.
struct Lease {
    deadline: Instant,
    session: SessionId,
    kind: LeaseKind,
    live: u32,
    refs: Vec<SlotRef>,
}

/// Counters exported by `Stats`.
#[derive(Default, Clone, Debug)]
pub struct Counters {
    /// Lookup calls.
    pub lookups: u64,
    /// Keys found by lookup or pin.
    pub hits: u64,
    /// Keys not found by lookup or pin.
    pub misses: u64,
    /// Pins granted.
    pub pins: u64,
    /// Blocks committed.
    pub commits: u64,
    /// Allocations aborted (explicitly, by lease expiry or by disconnect).
    pub aborts: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Blocks removed by request.
    pub removes: u64,
    /// Pins or allocations reclaimed because their lease passed.
    pub lease_expirations: u64,
    /// Pins and allocations released because their session closed.
    pub session_releases: u64,
    /// Requests refused with RESOURCE_EXHAUSTED.
    pub resource_exhausted: u64,
    /// Blocks fetched from peers and made Valid here.
    pub remote_fetched: u64,
    /// Slots held forever because a timed-out transfer may still write them.
    pub quarantined: u64,
    /// Slots fenced: their allocation ended (lease passed, or connection
    /// closed with its process alive) while its engine may still write.
    pub fenced: u64,
    /// Fences lifted because `limits.fence_ms_max` passed while the engine
    /// could still write (the slot is reused anyway).
    pub fences_forced: u64,
    /// Read grants given to peers.
    pub grants_given: u64,
    /// Event watchers cut off (behind the ring, or not reading).
    pub events_cut_off: u64,
}

/// Result of a pin of one key.
#[derive(Clone, Copy, Debug)]
pub struct PinOutcome {
    /// The pinned slot.
    pub slot: SlotRef,
    /// Payload offset in the pool mapping.
    pub payload_offset: u64,
    /// Payload length.
    pub payload_bytes: u64,
    /// Block version.
    pub version: u64,
    /// Payload checksum.
    pub checksum: u64,
}

/// Result of an allocation of one key.
#[derive(Clone, Copy, Debug)]
pub enum AllocOutcome {
    /// Write the block at `payload_offset`, then commit `slot`.
    Allocated {
        /// The reserved slot.
        slot: SlotRef,
        /// Where to write.
        payload_offset: u64,
    },
    /// Already cached.
    Exists,
    /// Another put of this key is in progress.
    InProgress,
}

/// A slot handed to a commit task: checksum `len` bytes at `offset`.
#[derive(Clone)]
pub struct CommitJob {
    /// The slot.
    pub slot: SlotRef,
    /// Pool memory to read.
    pub memory: PoolMemory,
    /// Payload offset.
    pub offset: u64,
    /// Payload length.
    pub len: u64,
}

/// Per-pool figures for `Stats`.
#[derive(Clone, Debug)]
pub struct PoolStats {
    /// Pool name.
    pub name: String,
    /// Device.
    pub device: String,
    /// Mapping size.
    pub bytes: u64,
    /// Slot payload size.
    pub slot_payload_bytes: u64,
    /// Slots.
    pub slots: u32,
    /// Free slots.
    pub free: u32,
    /// Valid slots.
    pub valid: u32,
    /// Pending or committing slots, quarantined ones not counted.
    pub pending: u32,
    /// Valid slots with a pin.
    pub pinned: u32,
    /// Removed-while-pinned slots.
    pub zombie: u32,
    /// Whether the pool is mlocked.
    pub mlocked: bool,
    /// Slots reserved for good after a timed-out transfer.
    pub quarantined: u32,
    /// Slots fenced: an engine whose allocation ended may still write them.
    pub fenced: u32,
    /// Bytes mapped with huge pages when the pool was made.
    pub huge_page_bytes: u64,
}

/// Whole-store figures for `Stats`.
#[derive(Clone, Debug)]
pub struct StoreStats {
    /// Per pool.
    pub pools: Vec<PoolStats>,
    /// Registered namespaces.
    pub namespaces: u32,
    /// Open sessions.
    pub sessions: u32,
    /// Pins held (counting repeats).
    pub pins_outstanding: u64,
    /// Uncommitted allocations.
    pub allocations_outstanding: u64,
    /// Counters.
    pub counters: Counters,
}

/// The store. Wrap it in a mutex; every method is short.
pub struct Store {
    pools: Vec<Pool>,
    namespaces: Vec<Namespace>,
    ns_by_name: HashMap<String, u32>,
    ns_by_fingerprint: HashMap<u64, u32>,
    index: HashMap<IndexKey, (u32, u32)>,
    sessions: HashMap<SessionId, Session>,
    /// Fenced slots (see [`Store::fence`]).
    fences: HashMap<SlotRef, Fence>,
    /// The same, oldest first (`limits.fence_ms_max` lifts from the front).
    fence_order: BTreeSet<(Instant, SlotRef)>,
    /// Fences held for a process whose connection closed, by process: each
    /// is asked whether it exited once per reaper pass, however many slots
    /// it left.
    fence_writers: HashMap<usize, (Arc<dyn WriterProbe>, HashSet<SlotRef>)>,
    leases: HashMap<u64, Lease>,
    deadlines: BTreeSet<(Instant, u64)>,
    lease_seq: u64,
    pins_outstanding: u64,
    allocs_outstanding: u64,
    cfg: Config,
    /// A drain is under way: new engine pins and allocations are refused.
    draining: bool,
    /// Random per start; ties the fd handshake to the RPCs of this daemon.
    pub instance_id: u64,
    /// Counters for `Stats`.
    pub counters: Counters,
    /// Clustered: the coherence core decides which copies are Valid (see
    /// `set_coherent`).
    coherent: bool,
    /// Clustered: indexed blocks evicted since the last `take_evicted`
    /// (namespace fingerprint, key, the slot freed), for the coherence core.
    evicted: Vec<(u64, Key, SlotRef)>,
    /// Lease left when a pin is released (`/metrics`): how close engines
    /// cut their leases.
    lease_left_at_unpin: Arc<crate::metrics::AtomicHistogram>,
    /// KV events for `WatchEvents` (one ring for every watcher, bounded:
    /// a watcher that falls behind it is cut off; sending never blocks).
    events: tokio::sync::broadcast::Sender<KvEvent>,
    /// Per namespace: the sequence number of its last event.
    event_seq: Vec<u64>,
}

/// A new watch: the receiver, the namespace's last sequence number, and
/// the snapshot (key, version) when asked.
pub type EventWatch = (tokio::sync::broadcast::Receiver<KvEvent>, u64, Vec<(Key, u64)>);

/// What happened to a block (`WatchEvents`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEventKind {
    /// Readable here (a put, or a fetched copy).
    Stored,
    /// Removed by an engine.
    Removed,
    /// Evicted for space.
    Evicted,
    /// Dropped by the coherence protocol.
    Invalidated,
}

/// One KV event of this daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvEvent {
    /// Namespace id.
    pub ns: u32,
    /// What happened.
    pub kind: KvEventKind,
    /// Per-namespace sequence number, from 1.
    pub seq: u64,
    /// The block.
    pub key: Key,
    /// Its version.
    pub version: u64,
}

/// Key of the index: namespace and block key, packed to 20 bytes (28 per
/// entry with its slot) instead of 32 (48).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(C, packed(4))]
struct IndexKey {
    ns: u32,
    key: u128,
}

impl IndexKey {
    fn new(ns: u32, key: Key) -> IndexKey {
        IndexKey { ns, key: key.0 }
    }
}

fn ghost_hash(ns: u32, key: Key) -> u64 {
    let mut b = [0u8; 20];
    b[..4].copy_from_slice(&ns.to_le_bytes());
    b[4..].copy_from_slice(&key.0.to_le_bytes());
    kvmesh_common::checksum(&b)
}

/// Wall-clock unix milliseconds of a monotonic deadline.
pub fn unix_ms(deadline: Instant, now: Instant) -> u64 {
    let wall = SystemTime::now() + deadline.saturating_duration_since(now);
    wall.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Store {
    /// The histogram of lease left at unpin (shared: `/metrics` renders it).
    pub fn lease_left_at_unpin(&self) -> Arc<crate::metrics::AtomicHistogram> {
        Arc::clone(&self.lease_left_at_unpin)
    }

    /// Applies reloaded limits and eviction watermarks (`SIGHUP`).
    pub fn reload_limits(&mut self, limits: crate::config::LimitsConfig, eviction: crate::config::EvictionConfig) {
        self.cfg.limits = limits;
        self.cfg.eviction = eviction;
        if self.cfg.limits.fence_ms_max == 0 && !self.fences.is_empty() {
            // Fences turned off by the operator: lifted now, not counted as
            // forced (nor alerted on).
            let all: Vec<SlotRef> = self.fences.keys().copied().collect();
            tracing::info!(slots = all.len(), "limits.fence_ms_max = 0: fenced slots freed");
            for r in all {
                self.unfence(r, false);
            }
        }
    }

    /// Records the reloaded log settings (so the running config reads true).
    pub fn reload_log(&mut self, log: crate::config::LogConfig) {
        self.cfg.log = log;
    }

    /// Up to `limit` keys of namespace `ns` cached here, and how many there
    /// are in all (a walk of the index: for admin tools).
    pub fn list_keys(&self, ns: u32, limit: usize) -> Result<(Vec<Key>, u64), Error> {
        self.namespace(ns)?;
        let limit = limit.min(self.cfg.limits.batch_keys_max as usize);
        let mut out = Vec::new();
        let mut total = 0u64;
        for k in self.index.keys() {
            let (kns, key) = (k.ns, k.key);
            if kns == ns {
                total += 1;
                if out.len() < limit {
                    out.push(Key(key));
                }
            }
        }
        Ok((out, total))
    }

    /// Every namespace with the number of blocks indexed for it (a walk of
    /// the index: for admin tools, not the hot path).
    pub fn namespace_summaries(&self) -> Vec<(Namespace, u64)> {
        let mut counts = vec![0u64; self.namespaces.len()];
        for k in self.index.keys() {
            let ns = k.ns;
            if let Some(c) = counts.get_mut(ns as usize) {
                *c += 1;
            }
        }
        self.namespaces.iter().cloned().zip(counts).collect()
    }

    /// Creates the pools of `cfg` (allocating and prefaulting their memory).
    pub fn new(cfg: Config) -> Result<Store, Error> {
        Store::with_mappings(cfg, Vec::new())
    }

    /// Bytes the mapping of pool `i` of `cfg` needs (whole slots).
    pub fn pool_bytes(cfg: &Config, i: usize) -> u64 {
        let p = &cfg.pools[i];
        let stride = slot_stride(p.slot_payload_bytes);
        (p.bytes / stride) * stride
    }

    /// Creates the store on mappings made elsewhere (e.g. pools UCX
    /// allocated); pools without one get a fresh memfd.
    pub fn with_mappings(cfg: Config, premade: Vec<Option<Arc<SharedMapping>>>) -> Result<Store, Error> {
        let cfg_events = cfg.events.buffer_events;
        let mut pools = Vec::new();
        for (i, p) in cfg.pools.iter().enumerate() {
            let stride = slot_stride(p.slot_payload_bytes);
            let n = (p.bytes / stride) as u32;
            let memory = match (premade.get(i).cloned().flatten(), kvmesh_kernels::cuda::parse_device(&p.device)) {
                (Some(m), _) => PoolMemory::Host(m),
                (None, Some(ordinal)) => {
                    let bytes = stride * n as u64;
                    let gpu = kvmesh_kernels::raw::gpu(ordinal)
                        .map_err(|e| Error::Internal(format!("pool {} on {}: {e}", p.name, p.device)))?;
                    let pool = gpu.alloc_pool(bytes as usize).map_err(|e| {
                        Error::Internal(format!("pool {}: cannot allocate {bytes} bytes on {}: {e}", p.name, p.device))
                    })?;
                    gpu.warm_up()
                        .map_err(|e| Error::Internal(format!("pool {} on {}: kernels: {e}", p.name, p.device)))?;
                    tracing::info!(pool = %p.name, device = %p.device, gpudirect_rdma = pool.rdma_capable(),
                        "GPU pool allocated (virtual-memory API, POSIX fd shareable)");
                    let uuid = kvmesh_kernels::cuda::device_uuid(ordinal)
                        .map_err(|e| Error::Internal(format!("pool {} on {}: {e}", p.name, p.device)))?;
                    PoolMemory::Cuda(Arc::new(CudaMemory { gpu, pool, bytes, uuid }))
                }
                (None, None) => {
                    let m = SharedMapping::create(&format!("kvmesh-{}", p.name), stride * n as u64, p.mlock).map_err(
                        |e| Error::Internal(format!("pool {}: cannot allocate {} bytes: {e}", p.name, p.bytes)),
                    )?;
                    if p.mlock && !m.mlocked() {
                        tracing::warn!(pool = %p.name, "mlock failed (raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK); pool may be swapped");
                    }
                    PoolMemory::Host(Arc::new(m))
                }
            };
            let slots = (0..n)
                .map(|_| Slot {
                    state: State::Free,
                    generation: 0,
                    pins: 0,
                    ns: 0,
                    key: Key(0),
                    version: 0,
                    checksum: 0,
                    payload_len: 0,
                    freq: 0,
                    queue: Queue::None,
                })
                .collect();
            // Read once: /proc/self/smaps walks every page table of the
            // process (milliseconds for large pools), never under the lock.
            let huge_page_bytes = memory.huge_page_bytes();
            tracing::info!(pool = %p.name, slots = n, slot_payload_bytes = p.slot_payload_bytes,
                bytes = stride * n as u64, mlocked = memory.mlocked(), huge_page_bytes,
                shmem_huge_pages = %kvmesh_ffi_os::shm::shmem_huge_mode(), "pool ready");
            pools.push(Pool {
                index: i as u32,
                name: p.name.clone(),
                device: p.device.clone(),
                memory,
                slot_payload_bytes: p.slot_payload_bytes,
                stride,
                slots,
                free: (0..n).rev().collect(),
                // Sized for every slot up front: a queue that grows copies
                // itself under the store's lock (milliseconds at a million
                // entries); the memory is touched only as entries arrive.
                small: VecDeque::with_capacity(n as usize),
                main: VecDeque::with_capacity(n as usize),
                small_live: 0,
                main_live: 0,
                ghost: VecDeque::with_capacity(n as usize),
                ghost_set: HashSet::with_capacity_and_hasher(n as usize, Default::default()),
                valid: 0,
                pending: 0,
                pinned: 0,
                zombie: 0,
                quarantined: 0,
                fenced: 0,
                huge_page_bytes,
            });
        }
        // The index never holds more keys than there are slots: sized once,
        // it never rehashes (a rehash of a million keys would stall every
        // engine call for tens of milliseconds under the lock).
        let slots_total: usize = pools.iter().map(|p| p.slots.len()).sum();
        Ok(Store {
            pools,
            namespaces: Vec::new(),
            ns_by_name: HashMap::default(),
            ns_by_fingerprint: HashMap::default(),
            index: HashMap::with_capacity_and_hasher(slots_total, Default::default()),
            lease_left_at_unpin: Arc::new(crate::metrics::AtomicHistogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.01, 2.0, 17),
            )),
            sessions: HashMap::default(),
            fences: HashMap::default(),
            fence_order: BTreeSet::new(),
            fence_writers: HashMap::default(),
            leases: HashMap::default(),
            deadlines: BTreeSet::new(),
            lease_seq: 0,
            pins_outstanding: 0,
            draining: false,
            allocs_outstanding: 0,
            cfg,
            // Start time in milliseconds (high 44 bits: later starts have
            // larger ids, which the membership relies on to ignore a
            // delayed keepalive of a previous process) and 20 bits of a
            // hash of the exact time and pid (two daemons started in one
            // millisecond still differ).
            instance_id: {
                let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
                let mut b = d.as_nanos().to_le_bytes().to_vec();
                b.extend_from_slice(&std::process::id().to_le_bytes());
                ((d.as_millis() as u64) << 20) | (kvmesh_common::checksum(&b) & 0xf_ffff)
            },
            counters: Counters::default(),
            coherent: false,
            evicted: Vec::new(),
            events: tokio::sync::broadcast::channel(cfg_events as usize).0,
            event_seq: Vec::new(),
        })
    }

    /// Switches to clustered operation: puts and fetches allocate slots
    /// outside the index (a new version is written beside the current
    /// one), the coherence core makes them Valid (`commit_core`) and frees
    /// them (`free_core`), and evictions are logged for the core
    /// (`take_evicted`). A Valid slot may then be out of the index while the
    /// core still holds it for readers.
    pub fn set_coherent(&mut self) {
        self.coherent = true;
    }

    /// A new watcher of KV events: its receiver, and the sequence number of
    /// namespace `ns`'s last event — with, when `snapshot`, the blocks of
    /// `ns` held now (key, version) — taken together under the store lock,
    /// so the live events that follow continue exactly from there.
    pub fn watch_events(&self, ns: u32, snapshot: bool) -> Result<EventWatch, Error> {
        self.namespace(ns)?;
        let rx = self.events.subscribe();
        let seq = self.event_seq.get(ns as usize).copied().unwrap_or(0);
        let held = if snapshot {
            self.index
                .iter()
                .filter(|(k, _)| k.ns == ns)
                .filter_map(|(k, &(p, s))| {
                    let slot = &self.pools[p as usize].slots[s as usize];
                    (slot.state == State::Valid).then_some((Key(k.key), slot.version))
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok((rx, seq, held))
    }

    /// Ends every watch stream (the daemon is stopping): their receivers
    /// see the ring closed; new events go to a fresh ring.
    pub fn close_events(&mut self) {
        self.events = tokio::sync::broadcast::channel(self.cfg.events.buffer_events as usize).0;
    }

    /// Watchers of KV events now.
    pub fn event_watchers(&self) -> usize {
        self.events.receiver_count()
    }

    fn emit(&mut self, ns: u32, kind: KvEventKind, key: Key, version: u64) {
        let i = ns as usize;
        if self.event_seq.len() <= i {
            self.event_seq.resize(i + 1, 0);
        }
        self.event_seq[i] += 1;
        let seq = self.event_seq[i];
        // No receiver is not an error: events of a namespace nobody watches
        // still number themselves (a later snapshot continues from there).
        let _ = self.events.send(KvEvent { ns, kind, seq, key, version });
    }

    /// Blocks evicted since the last call (clustered mode): namespace
    /// fingerprint, key, and the slot freed.
    pub fn take_evicted(&mut self) -> Vec<(u64, Key, SlotRef)> {
        std::mem::take(&mut self.evicted)
    }

    /// Removes the index entry of (ns, key) if it names this slot.
    fn unindex(&mut self, ns: u32, key: Key, p: u32, s: u32) -> bool {
        if self.index.get(&IndexKey::new(ns, key)) == Some(&(p, s)) {
            self.index.remove(&IndexKey::new(ns, key));
            true
        } else {
            false
        }
    }

    /// Reserves slots for a clustered put or fetch: never indexed until the
    /// coherence core commits them, so a key may get a slot while its
    /// current version is Valid (an overwrite). With `how.exists_check`, a
    /// key whose Valid copy is here answers `Exists` instead. A key twice in
    /// the batch answers `InProgress` the second time.
    ///
    /// `how.keep(slot)`: slots the coherence core still holds for readers
    /// (a grant not yet pinned here: its store pin is taken when the
    /// grant's batch leaves; a copy dropped since, still granted) are
    /// passed over by eviction as if pinned, so the store never frees a
    /// slot the core still counts granted (a copy the core would keep
    /// announcing with no slot behind it, or a grant refused at the last
    /// moment).
    pub fn allocate_detached(
        &mut self,
        session: SessionId,
        ns: u32,
        keys: &[Key],
        lease_ms: u64,
        how: Detached<'_>,
        now: Instant,
    ) -> Result<(Vec<AllocOutcome>, Instant), Error> {
        self.allocate_inner(session, ns, keys, lease_ms, Some(how), now)
    }

    /// Makes a slot of a clustered put or fetch Valid at `version` (the
    /// coherence core's `CommitSlot`, or a fetched copy it accepted):
    /// writes header and trailer with this slot's own generation and points
    /// the index at it. Returns false (and changes nothing) when the slot is
    /// not in the committing state at that generation.
    pub fn commit_core(&mut self, r: SlotRef, version: u64, checksum: u64, fetched: bool) -> bool {
        let Some(slot) = self.pools.get(r.pool as usize).and_then(|p| p.slots.get(r.slot as usize)) else {
            return false;
        };
        if slot.state != State::Committing || slot.generation != r.generation {
            return false;
        }
        let (ns, key) = (slot.ns, slot.key);
        self.finish_commit_versioned(&[(r, Some(version), checksum)]);
        if fetched {
            self.counters.remote_fetched += 1;
        }
        // The previous version's slot (if still held for its readers) leaves
        // the index; the core frees it when they are done.
        self.index.insert(IndexKey::new(ns, key), (r.pool, r.slot));
        self.emit(ns, KvEventKind::Stored, key, version);
        true
    }

    /// The coherence core no longer needs this slot (`FreeSlot`): a slot
    /// being published or fetched is freed; a Valid one leaves the index
    /// and is freed now, or by its last pin. Stale references do nothing.
    pub fn free_core(&mut self, r: SlotRef) {
        let Some(slot) = self.pools.get(r.pool as usize).and_then(|p| p.slots.get(r.slot as usize)) else {
            return;
        };
        if slot.generation != r.generation {
            return;
        }
        let (ns, key, state) = (slot.ns, slot.key, slot.state);
        match state {
            State::Committing => self.drop_pending(r),
            State::Valid => {
                let version = slot.version;
                if self.unindex(ns, key, r.pool, r.slot) {
                    self.emit(ns, KvEventKind::Invalidated, key, version);
                }
                self.retire_valid(r.pool, r.slot);
            }
            State::Free | State::Zombie | State::Pending { .. } => {}
        }
    }

    /// Pins exactly these slot uses (Valid, same generation) for `session`:
    /// the coherence core chose them. `None` for a slot that is not (any
    /// more) that Valid block.
    pub fn pin_slots(
        &mut self,
        session: SessionId,
        refs: &[SlotRef],
        lease_ms: u64,
        now: Instant,
    ) -> Result<(Vec<Option<PinOutcome>>, Instant), Error> {
        self.check_batch(refs.len())?;
        if session < PEER_SESSION_BASE {
            self.check_pins_room(session, refs.len())?;
        } else {
            // A peer's grants: the core bounds them per reader, but a member
            // that asks for one block again and again without releasing
            // keeps renewing one record; bounded here too, so no slot's pin
            // count can wrap whatever a peer sends.
            let held = self.sessions.get(&session).map_or(0, |s| s.pin_total);
            if held + refs.len() as u64 > INTERNAL_PINS_MAX {
                self.counters.resource_exhausted += 1;
                return Err(Error::ResourceExhausted(format!(
                    "internal session {session:#x} holds {held} pins (at most {INTERNAL_PINS_MAX})"
                )));
            }
        }
        if session < PEER_SESSION_BASE && !self.sessions.contains_key(&session) {
            // The engine's connection closed while its call was in flight:
            // nothing to pin for (and no session to resurrect).
            return Ok((vec![None; refs.len()], now));
        }
        let deadline = now + self.lease(lease_ms);
        let lease = self.new_lease(deadline, session, LeaseKind::Pin);
        let mut sess = self.sessions.remove(&session).unwrap_or_default();
        let mut moved_from = Vec::new();
        let mut out = Vec::with_capacity(refs.len());
        for r in refs {
            let ok = self
                .pools
                .get(r.pool as usize)
                .and_then(|p| p.slots.get(r.slot as usize))
                .is_some_and(|s| s.state == State::Valid && s.generation == r.generation);
            if !ok {
                out.push(None);
                continue;
            }
            out.push(self.pin_one(&mut sess, r.pool, r.slot, lease, &mut moved_from));
        }
        self.sessions.insert(session, sess);
        for old in moved_from {
            self.lease_unref(old);
        }
        self.lease_drop_if_empty(lease);
        Ok((out, deadline))
    }

    /// Pins one Valid slot for the session being built in `sess` under
    /// `lease`; `None` (a miss) for a slot pinned `u32::MAX` times.
    fn pin_one(
        &mut self,
        sess: &mut Session,
        p: u32,
        s: u32,
        lease: u64,
        moved_from: &mut Vec<u64>,
    ) -> Option<PinOutcome> {
        let pool = &mut self.pools[p as usize];
        if pool.slots[s as usize].pins == u32::MAX {
            // Unreachable within the configured limits (engine pins are
            // bounded by sessions_max × pins_per_session_max ≤ 2^31,
            // peers' by INTERNAL_PINS_MAX each) unless a reload lowered
            // sessions_max below the sessions open: a miss rather than a
            // count that wraps (a pinned slot read as unpinned, and reused
            // under its readers).
            self.counters.resource_exhausted += 1;
            return None;
        }
        self.counters.pins += 1;
        let payload_offset = pool.payload_offset(s);
        let slot = &mut pool.slots[s as usize];
        let r = SlotRef { pool: p, slot: s, generation: slot.generation };
        if slot.pins == 0 {
            pool.pinned += 1;
        }
        slot.pins += 1;
        slot.freq = (slot.freq + 1).min(3);
        let out = PinOutcome {
            slot: r,
            payload_offset,
            payload_bytes: slot.payload_len,
            version: slot.version,
            checksum: slot.checksum,
        };
        self.pins_outstanding += 1;
        sess.pin_total += 1;
        let rec = sess.pins.entry(r).or_insert((0, 0));
        rec.0 += 1;
        // The record follows the lease that ends last: a re-pin with a
        // shorter lease never cuts short the pin an earlier call was
        // promised (its guard may still read the slot in place).
        let later = |old: u64| {
            self.leases.get(&old).is_none_or(|o| self.leases.get(&lease).is_some_and(|n| n.deadline >= o.deadline))
        };
        if rec.1 != lease && (rec.1 == 0 || later(rec.1)) {
            if rec.1 != 0 {
                moved_from.push(rec.1);
            }
            rec.1 = lease;
            let l = self.leases.get_mut(&lease).expect("fresh lease");
            l.live += 1;
            l.refs.push(r);
        }
        Some(out)
    }

    /// The pools.
    pub fn pools(&self) -> &[Pool] {
        &self.pools
    }

    /// The configuration the store runs on.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Registers a namespace in host pools, or returns the matching existing
    /// one.
    pub fn register_namespace(&mut self, name: &str, block_bytes: u64, layout: &str) -> Result<Namespace, Error> {
        self.register_namespace_on(name, block_bytes, layout, "")
    }

    /// Registers a namespace in the pools of `device` (`""` or `"host"`:
    /// host pools; `"cuda:N"`: GPU pools of device N), or returns the
    /// matching existing one (a namespace lives on one device).
    pub fn register_namespace_on(
        &mut self,
        name: &str,
        block_bytes: u64,
        layout: &str,
        device: &str,
    ) -> Result<Namespace, Error> {
        let device = if device.is_empty() { "host" } else { device };
        if name.is_empty() || name.len() > 256 {
            return Err(Error::InvalidArgument(format!("namespace name must be 1 to 256 bytes, got {}", name.len())));
        }
        if layout.len() > 4096 {
            return Err(Error::InvalidArgument(format!("layout is {} bytes, at most 4096", layout.len())));
        }
        if let Some(&id) = self.ns_by_name.get(name) {
            let ns = &self.namespaces[id as usize];
            if ns.block_bytes != block_bytes {
                return Err(Error::FailedPrecondition(format!(
                    "block size {block_bytes} does not match namespace {name} ({})",
                    ns.block_bytes
                )));
            }
            if ns.layout != layout {
                return Err(Error::FailedPrecondition(format!(
                    "layout {layout:?} does not match namespace {name} ({:?})",
                    ns.layout
                )));
            }
            let on = &self.pools[ns.pool as usize].device;
            if on != device {
                return Err(Error::FailedPrecondition(format!(
                    "device {device:?} does not match namespace {name} ({on:?})"
                )));
            }
            return Ok(ns.clone());
        }
        if block_bytes == 0 {
            return Err(Error::InvalidArgument("block size must be greater than 0".into()));
        }
        if self.namespaces.len() >= self.cfg.limits.namespaces_max as usize {
            self.counters.resource_exhausted += 1;
            return Err(Error::ResourceExhausted(format!(
                "namespace limit reached ({} namespaces, limits.namespaces_max)",
                self.namespaces.len()
            )));
        }
        if !self.pools.iter().any(|p| p.device == device) {
            let have: Vec<&str> = self.pools.iter().map(|p| p.device.as_str()).collect();
            return Err(Error::InvalidArgument(format!("no pool on device {device:?} (pools are on {have:?})")));
        }
        let pool = self
            .pools
            .iter()
            .filter(|p| p.device == device && p.slot_payload_bytes >= block_bytes)
            .min_by_key(|p| p.slot_payload_bytes)
            .ok_or_else(|| {
                let largest =
                    self.pools.iter().filter(|p| p.device == device).map(|p| p.slot_payload_bytes).max().unwrap_or(0);
                Error::InvalidArgument(format!(
                    "block size {block_bytes} exceeds the largest slot of any pool on {device} ({largest} bytes)"
                ))
            })?;
        let ns = Namespace {
            id: self.namespaces.len() as u32,
            name: name.to_string(),
            block_bytes,
            layout: layout.to_string(),
            pool: pool.index,
            fingerprint: namespace_fingerprint(name, block_bytes, layout),
        };
        tracing::info!(namespace = name, block_bytes, pool = %pool.name, "namespace registered");
        self.ns_by_name.insert(ns.name.clone(), ns.id);
        self.ns_by_fingerprint.insert(ns.fingerprint, ns.id);
        self.namespaces.push(ns.clone());
        Ok(ns)
    }

    /// Finds a namespace by its fingerprint (how peers name it).
    pub fn namespace_by_fingerprint(&self, fp: u64) -> Option<Namespace> {
        self.ns_by_fingerprint.get(&fp).map(|&id| self.namespaces[id as usize].clone())
    }

    /// Whether a slot for the namespace `fingerprint` can be reserved now
    /// without evicting anything (a free slot, and its pool stays at or
    /// under the high watermark): for reservations that may come to
    /// nothing (a slot a peer may push, reserved before the locate's
    /// answer says whether anyone holds the key).
    pub fn reserves_without_eviction(&self, fingerprint: u64) -> bool {
        let Some(&id) = self.ns_by_fingerprint.get(&fingerprint) else { return false };
        let Some(p) = self.pools.get(self.namespaces[id as usize].pool as usize) else { return false };
        !p.free.is_empty() && f64::from(p.used() + 1) <= self.cfg.eviction.high_watermark * f64::from(p.slot_count())
    }

    /// A registered namespace by id.
    pub fn namespace_info(&self, id: u32) -> Result<Namespace, Error> {
        self.namespace(id).cloned()
    }

    /// The block (namespace fingerprint, key) a slot was allocated for.
    pub fn slot_block(&self, r: SlotRef) -> (u64, Key) {
        let slot = &self.pools[r.pool as usize].slots[r.slot as usize];
        (self.namespaces.get(slot.ns as usize).map_or(0, |n| n.fingerprint), slot.key)
    }

    /// Version of a committed slot.
    pub fn version_of(&self, r: SlotRef) -> u64 {
        self.pools[r.pool as usize].slots[r.slot as usize].version
    }

    /// Every key of a namespace cached here.
    pub fn keys_of(&self, ns: u32) -> Result<Vec<Key>, Error> {
        self.namespace(ns)?;
        let mut v: Vec<Key> = self.index.keys().filter(|k| { k.ns } == ns).map(|k| Key(k.key)).collect();
        v.sort();
        Ok(v)
    }

    /// Starts a drain: from now on engine pins and allocations are refused
    /// (what was given may finish). True if it was already draining.
    pub fn set_draining(&mut self) -> bool {
        std::mem::replace(&mut self.draining, true)
    }

    /// Whether a drain is under way.
    pub fn draining(&self) -> bool {
        self.draining
    }

    /// Refuses new work while draining.
    pub fn check_not_draining(&self) -> Result<(), Error> {
        if self.draining {
            return Err(Error::Unavailable(
                "kvmeshd is draining (shutting down): no new pins or allocations; connect to the daemon that replaces it".into(),
            ));
        }
        Ok(())
    }

    /// Pins and allocations engines still hold (peers' grant pins and the
    /// daemon's own fetches left out): what a drain waits for. O(sessions).
    pub fn engine_outstanding(&self) -> (u64, u64) {
        self.sessions
            .iter()
            .filter(|(id, _)| **id < PEER_SESSION_BASE)
            .fold((0, 0), |(p, a), (_, s)| (p + s.pins.len() as u64, a + s.allocs.len() as u64))
    }

    /// Refuses a pin request that would exceed the session's pin limit.
    pub fn check_pin_request(&mut self, session: SessionId, n: usize) -> Result<(), Error> {
        self.check_not_draining()?;
        self.check_batch(n)?;
        self.check_pins_room(session, n)
    }

    /// Refuses `n` more pins for a session at `limits.pins_per_session_max`.
    fn check_pins_room(&mut self, session: SessionId, n: usize) -> Result<(), Error> {
        let held = self.sessions.get(&session).map_or(0, |s| s.pin_total);
        if held + n as u64 > u64::from(self.cfg.limits.pins_per_session_max) {
            self.counters.resource_exhausted += 1;
            return Err(Error::ResourceExhausted(format!(
                "session holds {held} pins; {n} more would exceed limits.pins_per_session_max ({})",
                self.cfg.limits.pins_per_session_max
            )));
        }
        Ok(())
    }

    /// Clustered: keeps a slot being fetched reserved forever (a timed-out
    /// transfer may still write it); stale references do nothing.
    pub fn quarantine_core(&mut self, r: SlotRef) {
        let Some(slot) = self.pools.get_mut(r.pool as usize).and_then(|p| p.slots.get_mut(r.slot as usize)) else {
            return;
        };
        if slot.state != State::Committing || slot.generation != r.generation {
            return;
        }
        // A new generation: no reference to it is valid any more.
        slot.generation += 1;
        let (ns, key) = (slot.ns, slot.key);
        self.unindex(ns, key, r.pool, r.slot);
        self.allocs_outstanding -= 1;
        self.counters.quarantined += 1;
        self.pools[r.pool as usize].quarantined += 1;
        tracing::warn!(?r, "slot quarantined: a timed-out transfer may still write it");
    }

    /// Test hook: makes a slot look reused (header and trailer of the next
    /// generation), as if it had been evicted and refilled.
    pub fn test_corrupt_header(&mut self, r: SlotRef) {
        let ns = self.pools[r.pool as usize].slots[r.slot as usize].ns;
        let fp = self.namespaces.get(ns as usize).map_or(0, |n| n.fingerprint);
        let pool = &self.pools[r.pool as usize];
        let mut meta = pool.meta_of(r.slot, SlotState::Valid, fp);
        meta.generation += 1;
        pool.write_meta(r.slot, &meta);
    }

    /// Whether `session` holds a pin on exactly this slot use.
    pub fn holds_pin(&self, session: SessionId, r: SlotRef) -> bool {
        self.sessions.get(&session).is_some_and(|s| s.pins.contains_key(&r))
    }

    /// Geometry of a pool: (stride, payload capacity).
    pub fn pool_geometry(&self, pool: u32) -> Option<(u64, u64)> {
        self.pools.get(pool as usize).map(|p| (p.stride, p.slot_payload_bytes))
    }

    /// Finds a namespace by name.
    pub fn namespace_by_name(&self, name: &str) -> Result<Namespace, Error> {
        self.ns_by_name
            .get(name)
            .map(|&id| self.namespaces[id as usize].clone())
            .ok_or_else(|| Error::NotFound(format!("namespace {name:?} is not registered")))
    }

    fn namespace(&self, id: u32) -> Result<&Namespace, Error> {
        self.namespaces.get(id as usize).ok_or_else(|| Error::NotFound(format!("namespace id {id} is not registered")))
    }

    /// Refuses a batch above `limits.batch_keys_max`.
    pub fn check_batch(&self, n: usize) -> Result<(), Error> {
        if n > self.cfg.limits.batch_keys_max as usize {
            return Err(Error::InvalidArgument(format!(
                "batch of {n} keys exceeds limits.batch_keys_max ({})",
                self.cfg.limits.batch_keys_max
            )));
        }
        Ok(())
    }

    /// The bound on a release (unpin, abort, commit): not the live
    /// `batch_keys_max` — a reload may have lowered it below the batches
    /// engines took their pins and allocations in (and split their
    /// releases by) — but its largest value; what a session releases is
    /// bounded by what it holds anyway.
    fn check_release_batch(&self, n: usize) -> Result<(), Error> {
        if n > crate::config::BATCH_KEYS_MAX_MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "release of {n} slots exceeds {}",
                crate::config::BATCH_KEYS_MAX_MAX
            )));
        }
        Ok(())
    }

    /// The lease a request of `lease_ms` gets (0: the default; clamped).
    pub fn lease(&self, lease_ms: u64) -> Duration {
        let l = &self.cfg.limits;
        Duration::from_millis(if lease_ms == 0 { l.lease_ms_default } else { lease_ms.min(l.lease_ms_max) })
    }

    fn valid_slot(&self, ns: u32, key: Key) -> Option<(u32, u32)> {
        let &(p, s) = self.index.get(&IndexKey::new(ns, key))?;
        (self.pools[p as usize].slots[s as usize].state == State::Valid).then_some((p, s))
    }

    /// Per-key presence and the longest present prefix.
    pub fn lookup(&mut self, ns: u32, keys: &[Key]) -> Result<(Vec<bool>, u32), Error> {
        self.namespace(ns)?;
        self.check_batch(keys.len())?;
        let present: Vec<bool> = keys.iter().map(|&k| self.valid_slot(ns, k).is_some()).collect();
        let prefix = present.iter().take_while(|&&p| p).count() as u32;
        self.count_lookup(&present);
        Ok((present, prefix))
    }

    /// Counts a lookup's answer (`lookups`, `hits`, `misses`).
    pub fn count_lookup(&mut self, present: &[bool]) {
        self.counters.lookups += 1;
        let hits = present.iter().filter(|&&p| p).count() as u64;
        self.counters.hits += hits;
        self.counters.misses += present.len() as u64 - hits;
    }

    fn new_lease(&mut self, deadline: Instant, session: SessionId, kind: LeaseKind) -> u64 {
        self.lease_seq += 1;
        let id = self.lease_seq;
        self.leases.insert(id, Lease { deadline, session, kind, live: 0, refs: Vec::new() });
        self.deadlines.insert((deadline, id));
        id
    }

    /// Drops one record's hold on a lease; forgets the lease at zero.
    fn lease_unref(&mut self, id: u64) {
        let lease = self.leases.get_mut(&id).expect("record points at a known lease");
        lease.live -= 1;
        if lease.live == 0 {
            let l = self.leases.remove(&id).expect("lease present");
            self.deadlines.remove(&(l.deadline, id));
        }
    }

    /// Forgets a lease that ended up covering nothing.
    fn lease_drop_if_empty(&mut self, id: u64) {
        if self.leases.get(&id).is_some_and(|l| l.live == 0) {
            let l = self.leases.remove(&id).expect("lease present");
            self.deadlines.remove(&(l.deadline, id));
        }
    }

    /// Pins the present keys for `session`. Returns one entry per key (or up
    /// to the first miss), and the lease deadline.
    pub fn pin(
        &mut self,
        session: SessionId,
        ns: u32,
        keys: &[Key],
        lease_ms: u64,
        stop_at_first_miss: bool,
        now: Instant,
    ) -> Result<(Vec<Option<PinOutcome>>, Instant), Error> {
        self.check_not_draining()?;
        self.namespace(ns)?;
        self.check_batch(keys.len())?;
        self.check_pins_room(session, keys.len())?;
        let deadline = now + self.lease(lease_ms);
        let lease = self.new_lease(deadline, session, LeaseKind::Pin);
        let mut sess = self.sessions.remove(&session).unwrap_or_default();
        let mut moved_from = Vec::new();
        let mut out = Vec::with_capacity(keys.len());
        for &key in keys {
            let Some((p, s)) = self.valid_slot(ns, key) else {
                self.counters.misses += 1;
                out.push(None);
                if stop_at_first_miss {
                    break;
                }
                continue;
            };
            self.counters.hits += 1;
            out.push(self.pin_one(&mut sess, p, s, lease, &mut moved_from));
        }
        self.sessions.insert(session, sess);
        for old in moved_from {
            self.lease_unref(old);
        }
        self.lease_drop_if_empty(lease);
        Ok((out, deadline))
    }

    /// Drops one pin reference of a slot; frees a zombie on its last pin.
    fn drop_pin(&mut self, r: SlotRef) {
        let pool = &mut self.pools[r.pool as usize];
        let slot = &mut pool.slots[r.slot as usize];
        assert!(slot.pins > 0 && slot.generation == r.generation, "pin accounting broken for {r:?}");
        slot.pins -= 1;
        self.pins_outstanding -= 1;
        if slot.pins == 0 {
            match slot.state {
                State::Valid => pool.pinned -= 1,
                State::Zombie => {
                    pool.zombie -= 1;
                    self.free_slot(r.pool, r.slot);
                }
                s => panic!("pinned slot {r:?} in state {s:?}"),
            }
        }
    }

    /// Releases all pins of `session` on each slot; returns (released, unknown).
    pub fn unpin(&mut self, session: SessionId, refs: &[SlotRef]) -> Result<(u32, u32), Error> {
        self.check_release_batch(refs.len())?;
        let (mut released, mut unknown) = (0, 0);
        let now = Instant::now();
        for r in refs {
            let Some(sess) = self.sessions.get_mut(&session) else {
                unknown += 1;
                continue;
            };
            let Some((count, lease)) = sess.pins.get_mut(r) else {
                unknown += 1;
                continue;
            };
            *count -= 1;
            sess.pin_total -= 1;
            if let Some(l) = self.leases.get(lease) {
                self.lease_left_at_unpin.observe(l.deadline.saturating_duration_since(now).as_secs_f64());
            }
            if *count == 0 {
                let lease = *lease;
                sess.pins.remove(r);
                self.lease_unref(lease);
            }
            self.drop_pin(*r);
            released += 1;
        }
        Ok((released, unknown))
    }

    fn queues_evict_one(&mut self, p: u32, keep: Keep<'_>) -> bool {
        let pool = &mut self.pools[p as usize];
        let live = pool.small_live + pool.main_live;
        // Each live entry is visited at most 4 times (freq <= 3) plus once
        // when pinned; a bound keeps a fully pinned pool from spinning.
        let mut budget = 5 * live + pool.small.len() + pool.main.len() + 1;
        // Pinned entries met in a row (since the last unpinned one): past
        // the main queue's length, the main queue is all pinned and the
        // small queue is read whatever its size; past every live entry,
        // everything is pinned.
        let mut pinned_seen = 0usize;
        while budget > 0 {
            budget -= 1;
            let small_target = (live / 10).max(1);
            let main_pinned = pinned_seen >= pool.main_live && pool.small_live > 0;
            let from_small = pool.small_live > small_target || pool.main_live == 0 || main_pinned;
            let entry = if from_small { pool.small.pop_front() } else { pool.main.pop_front() };
            let Some((s, gen_)) = entry else {
                if pool.small.is_empty() && pool.main.is_empty() {
                    return false;
                }
                continue;
            };
            let expect = if from_small { Queue::Small } else { Queue::Main };
            let slot = &mut pool.slots[s as usize];
            if slot.generation != gen_ || slot.queue != expect || slot.state != State::Valid {
                continue; // stale entry of a freed or removed slot
            }
            if slot.pins > 0 || keep(SlotRef { pool: p, slot: s, generation: gen_ }) {
                pinned_seen += 1;
                if pinned_seen > live {
                    // every live slot is pinned
                    if from_small {
                        pool.enqueue(Queue::Small, (s, gen_))
                    } else {
                        pool.enqueue(Queue::Main, (s, gen_))
                    }
                    return false;
                }
                if from_small {
                    pool.small_live -= 1;
                    pool.main_live += 1;
                    slot.queue = Queue::Main;
                }
                pool.enqueue(Queue::Main, (s, gen_));
                continue;
            }
            pinned_seen = 0;
            if from_small {
                pool.small_live -= 1;
                if slot.freq > 1 {
                    slot.freq = 0;
                    slot.queue = Queue::Main;
                    pool.main_live += 1;
                    pool.enqueue(Queue::Main, (s, gen_));
                    continue;
                }
            } else {
                if slot.freq > 0 {
                    slot.freq -= 1;
                    pool.enqueue(Queue::Main, (s, gen_));
                    continue;
                }
                pool.main_live -= 1;
            }
            // Evict.
            slot.queue = Queue::None;
            let (ns, key, version) = (slot.ns, slot.key, slot.version);
            if from_small {
                pool.ghost_add(ghost_hash(ns, key));
            }
            pool.valid -= 1;
            let removed = self.unindex(ns, key, p, s);
            assert!(removed || self.coherent, "index out of sync with evicted slot");
            if removed {
                self.emit(ns, KvEventKind::Evicted, key, version);
            }
            if removed && self.coherent {
                let fp = self.namespaces[ns as usize].fingerprint;
                self.evicted.push((fp, key, SlotRef { pool: p, slot: s, generation: gen_ }));
            }
            self.counters.evictions += 1;
            self.free_slot(p, s);
            return true;
        }
        false
    }

    /// Marks a slot Free and returns it to the free list.
    fn free_slot(&mut self, p: u32, s: u32) {
        let pool = &mut self.pools[p as usize];
        let slot = &mut pool.slots[s as usize];
        assert_eq!(slot.pins, 0, "freeing a pinned slot");
        slot.state = State::Free;
        slot.queue = Queue::None;
        let meta = pool.meta_of(s, SlotState::Free, 0);
        pool.write_meta(s, &meta);
        pool.free.push(s);
    }

    fn take_free_slot(&mut self, p: u32, keep: Keep<'_>) -> Option<u32> {
        if self.pools[p as usize].free.is_empty() && !self.queues_evict_one(p, keep) {
            return None;
        }
        self.pools[p as usize].free.pop()
    }

    /// Evicts down to the low watermark if a pool is above the high one.
    fn apply_watermarks(&mut self, p: u32, keep: Keep<'_>) {
        let (n, used) = {
            let pool = &self.pools[p as usize];
            (pool.slot_count() as f64, pool.used() as f64)
        };
        if used > self.cfg.eviction.high_watermark * n {
            let target = (self.cfg.eviction.low_watermark * n).floor() as u32;
            while self.pools[p as usize].used() > target {
                if !self.queues_evict_one(p, keep) {
                    break;
                }
            }
        }
    }

    /// Reserves slots for the absent keys (all or nothing for the batch).
    pub fn allocate(
        &mut self,
        session: SessionId,
        ns: u32,
        keys: &[Key],
        lease_ms: u64,
        now: Instant,
    ) -> Result<(Vec<AllocOutcome>, Instant), Error> {
        self.check_not_draining()?;
        self.allocate_inner(session, ns, keys, lease_ms, None, now)
    }

    /// What refuses an allocation of `n` keys in `ns` by `session` before
    /// any slot is looked for: draining, an unknown namespace, the batch
    /// limit, the session's allowance. An overwrite checks it before it
    /// retires the cached versions, so that those checks never refuse it
    /// after the old versions are gone.
    pub fn check_allocate(&mut self, session: SessionId, ns: u32, n: usize) -> Result<(), Error> {
        self.check_not_draining()?;
        self.namespace(ns)?;
        self.check_allowance(session, n)
    }

    fn check_allowance(&mut self, session: SessionId, n: usize) -> Result<(), Error> {
        self.check_batch(n)?;
        // Fenced ones count: an engine that lets its allocations lapse may
        // not fence more of the pool than it may allocate.
        let held = self.sessions.get(&session).map_or(0, |s| s.allocs.len() + s.fenced.len());
        if held + n > self.cfg.limits.allocations_per_session_max as usize {
            self.counters.resource_exhausted += 1;
            return Err(Error::ResourceExhausted(format!(
                "session holds {held} uncommitted allocations (those past their lease not yet committed or \
                 aborted included); {n} more would exceed limits.allocations_per_session_max ({})",
                self.cfg.limits.allocations_per_session_max
            )));
        }
        Ok(())
    }

    /// `detached`: `None` for an indexed allocation; `Some` for one outside
    /// the index (see `allocate_detached`).
    fn allocate_inner(
        &mut self,
        session: SessionId,
        ns: u32,
        keys: &[Key],
        lease_ms: u64,
        detached: Option<Detached<'_>>,
        now: Instant,
    ) -> Result<(Vec<AllocOutcome>, Instant), Error> {
        let keep: Keep<'_> = match detached {
            Some(d) => d.keep,
            None => &|_| false,
        };
        let nsd = self.namespace(ns)?.clone();
        self.check_allowance(session, keys.len())?;
        let deadline = now + self.lease(lease_ms);
        let p = nsd.pool;
        let mut out = Vec::with_capacity(keys.len());
        let mut taken: Vec<(Key, u32)> = Vec::new();
        let mut seen = HashSet::default();
        for &key in keys {
            if !seen.insert(key) {
                out.push(AllocOutcome::InProgress);
                continue;
            }
            match detached {
                None => {
                    if let Some(&(ip, is)) = self.index.get(&IndexKey::new(ns, key)) {
                        let st = self.pools[ip as usize].slots[is as usize].state;
                        out.push(if st == State::Valid { AllocOutcome::Exists } else { AllocOutcome::InProgress });
                        continue;
                    }
                }
                Some(Detached { exists_check: true, .. }) if self.valid_slot(ns, key).is_some() => {
                    out.push(AllocOutcome::Exists);
                    continue;
                }
                Some(_) => {}
            }
            let Some(s) = self.take_free_slot(p, keep) else {
                // Roll back this batch: nothing was visible yet.
                for (k, s) in taken {
                    self.unindex(ns, k, p, s);
                    let pool = &mut self.pools[p as usize];
                    pool.pending -= 1;
                    self.free_slot(p, s);
                }
                self.counters.resource_exhausted += 1;
                let pool = &self.pools[p as usize];
                return Err(Error::ResourceExhausted(format!(
                    "pool {}: no slot to allocate: all {} slots are pinned, being written or held for \
                     peers' reads ({} pinned, {} pending, {} removed but still pinned)",
                    pool.name,
                    pool.slot_count(),
                    pool.pinned,
                    pool.pending,
                    pool.zombie
                )));
            };
            let pool = &mut self.pools[p as usize];
            let slot = &mut pool.slots[s as usize];
            slot.generation += 1;
            slot.state = State::Pending { session };
            slot.ns = ns;
            slot.key = key;
            slot.version = 1;
            slot.checksum = 0;
            slot.payload_len = nsd.block_bytes;
            slot.freq = 0;
            let generation = slot.generation;
            pool.pending += 1;
            let meta = pool.meta_of(s, SlotState::Pending, nsd.fingerprint);
            pool.write_meta(s, &meta);
            if detached.is_none() {
                self.index.insert(IndexKey::new(ns, key), (p, s));
            }
            taken.push((key, s));
            out.push(AllocOutcome::Allocated {
                slot: SlotRef { pool: p, slot: s, generation },
                payload_offset: self.pools[p as usize].payload_offset(s),
            });
        }
        let lease = self.new_lease(deadline, session, LeaseKind::Alloc);
        for o in &out {
            if let AllocOutcome::Allocated { slot, .. } = o {
                self.sessions.entry(session).or_default().allocs.insert(*slot, lease);
                let l = self.leases.get_mut(&lease).expect("fresh lease");
                l.live += 1;
                l.refs.push(*slot);
                self.allocs_outstanding += 1;
            }
        }
        self.lease_drop_if_empty(lease);
        self.apply_watermarks(p, keep);
        Ok((out, deadline))
    }

    fn drop_pending(&mut self, r: SlotRef) {
        let pool = &mut self.pools[r.pool as usize];
        let slot = &pool.slots[r.slot as usize];
        let (ns, key) = (slot.ns, slot.key);
        pool.pending -= 1;
        self.allocs_outstanding -= 1;
        let removed = self.unindex(ns, key, r.pool, r.slot);
        assert!(removed || self.coherent, "index out of sync with pending slot {r:?}");
        self.counters.aborts += 1;
        self.free_slot(r.pool, r.slot);
    }

    /// Ends an allocation whose engine may still be writing its slot (its
    /// lease passed, or its connection closed while its process lives):
    /// the key leaves the index as on an abort, but the slot is kept from
    /// reuse — a late write would otherwise land in another block, after
    /// that block's commit, and be served as it — until the engine says it
    /// stopped (commits or aborts it: see [`Store::begin_commit`],
    /// [`Store::abort`]), its process exits, or `limits.fence_ms_max`
    /// passes ([`Store::expire`]). With `fence_ms_max = 0`, freed at once
    /// (`false`).
    fn fence(
        &mut self,
        r: SlotRef,
        now: Instant,
        session: Option<SessionId>,
        writer: Option<Arc<dyn WriterProbe>>,
    ) -> bool {
        if self.cfg.limits.fence_ms_max == 0 {
            self.drop_pending(r);
            return false;
        }
        let pool = &mut self.pools[r.pool as usize];
        let slot = &pool.slots[r.slot as usize];
        assert!(matches!(slot.state, State::Pending { .. }), "fencing a slot that is not pending: {r:?}");
        let (ns, key) = (slot.ns, slot.key);
        pool.fenced += 1;
        self.allocs_outstanding -= 1;
        let removed = self.unindex(ns, key, r.pool, r.slot);
        assert!(removed || self.coherent, "index out of sync with pending slot {r:?}");
        self.counters.aborts += 1;
        self.counters.fenced += 1;
        self.fences.insert(r, Fence { since: now, session, writer: None });
        self.fence_order.insert((now, r));
        if let Some(w) = writer {
            self.fence_for_writer(r, w);
        }
        true
    }

    /// Hands a fence over to the engine's process (its session closed).
    fn fence_for_writer(&mut self, r: SlotRef, w: Arc<dyn WriterProbe>) {
        let Some(f) = self.fences.get_mut(&r) else {
            return;
        };
        let key = writer_key(&w);
        f.session = None;
        f.writer = Some(key);
        self.fence_writers.entry(key).or_insert_with(|| (w, HashSet::default())).1.insert(r);
    }

    /// Lifts a fence: the slot is free again (`forced`: by the bound).
    fn unfence(&mut self, r: SlotRef, forced: bool) {
        let Some(f) = self.fences.remove(&r) else {
            return;
        };
        self.fence_order.remove(&(f.since, r));
        if let Some(sess) = f.session.and_then(|s| self.sessions.get_mut(&s)) {
            sess.fenced.remove(&r);
        }
        if let Some(k) = f.writer
            && let Some((_, slots)) = self.fence_writers.get_mut(&k)
        {
            slots.remove(&r);
            if slots.is_empty() {
                self.fence_writers.remove(&k);
            }
        }
        if forced {
            self.counters.fences_forced += 1;
        }
        let pool = &mut self.pools[r.pool as usize];
        pool.pending -= 1;
        pool.fenced -= 1;
        self.free_slot(r.pool, r.slot);
    }

    /// `session` names a slot of its own allocation whose lease passed (in
    /// a commit or an abort): the engine has stopped writing it, so its
    /// fence lifts.
    fn lift_own_fence(&mut self, session: SessionId, r: SlotRef) {
        if self.sessions.get(&session).is_some_and(|s| s.fenced.contains(&r)) {
            self.unfence(r, false);
        }
    }

    /// Slots fenced now.
    #[cfg(test)]
    fn fenced_slots(&self) -> usize {
        self.fences.len()
    }

    /// Frees uncommitted allocations of `session`; returns (aborted, unknown).
    pub fn abort(&mut self, session: SessionId, refs: &[SlotRef]) -> Result<(u32, u32), Error> {
        self.check_release_batch(refs.len())?;
        let (mut aborted, mut unknown) = (0, 0);
        for r in refs {
            match self.sessions.get_mut(&session).and_then(|s| s.allocs.remove(r)) {
                Some(lease) => {
                    self.lease_unref(lease);
                    self.drop_pending(*r);
                    aborted += 1;
                }
                None => {
                    // (Its lease passed: already aborted.)
                    self.lift_own_fence(session, *r);
                    unknown += 1;
                }
            }
        }
        Ok((aborted, unknown))
    }

    /// Commit, step one: takes the allocations out of the session (so lease
    /// expiry and disconnect no longer touch them) and returns what to
    /// checksum. `None` for references the session does not hold.
    pub fn begin_commit(&mut self, session: SessionId, refs: &[SlotRef]) -> Result<Vec<Option<CommitJob>>, Error> {
        self.check_release_batch(refs.len())?;
        let mut out = Vec::with_capacity(refs.len());
        for r in refs {
            match self.sessions.get_mut(&session).and_then(|s| s.allocs.remove(r)) {
                Some(lease) => {
                    self.lease_unref(lease);
                    let pool = &mut self.pools[r.pool as usize];
                    let offset = pool.payload_offset(r.slot);
                    let slot = &mut pool.slots[r.slot as usize];
                    assert_eq!(slot.state, State::Pending { session }, "allocation not pending");
                    slot.state = State::Committing;
                    out.push(Some(CommitJob { slot: *r, memory: pool.memory.clone(), offset, len: slot.payload_len }));
                }
                None => {
                    // (Its lease passed: the commit fails.)
                    self.lift_own_fence(session, *r);
                    out.push(None);
                }
            }
        }
        Ok(out)
    }

    /// Commit, step two: records the checksums, writes header and trailer,
    /// and makes the blocks visible.
    pub fn finish_commit(&mut self, done: &[(SlotRef, u64)]) {
        let with_version: Vec<(SlotRef, Option<u64>, u64)> = done.iter().map(|&(r, c)| (r, None, c)).collect();
        self.finish_commit_versioned(&with_version);
    }

    fn finish_commit_versioned(&mut self, done: &[(SlotRef, Option<u64>, u64)]) {
        for &(r, version, checksum) in done {
            let ns_of = self.pools[r.pool as usize].slots[r.slot as usize].ns;
            let fingerprint = self.namespaces[ns_of as usize].fingerprint;
            let pool = &mut self.pools[r.pool as usize];
            let slot = &mut pool.slots[r.slot as usize];
            assert!(
                slot.state == State::Committing && slot.generation == r.generation,
                "commit of {r:?} lost its slot"
            );
            slot.checksum = checksum;
            if let Some(v) = version {
                slot.version = v;
            }
            slot.state = State::Valid;
            let h = ghost_hash(slot.ns, slot.key);
            let gen_ = slot.generation;
            pool.pending -= 1;
            pool.valid += 1;
            if pool.ghost_set.remove(&h) {
                pool.slots[r.slot as usize].queue = Queue::Main;
                pool.enqueue(Queue::Main, (r.slot, gen_));
                pool.main_live += 1;
            } else {
                pool.slots[r.slot as usize].queue = Queue::Small;
                pool.enqueue(Queue::Small, (r.slot, gen_));
                pool.small_live += 1;
            }
            let meta = pool.meta_of(r.slot, SlotState::Valid, fingerprint);
            pool.write_meta(r.slot, &meta);
            self.allocs_outstanding -= 1;
            self.counters.commits += 1;
            let (key, version) = (meta.key, meta.version);
            // Clustered, a slot becomes readable when the core indexes it
            // (`commit_core`, which emits); alone, at commit.
            if !self.coherent {
                self.emit(ns_of, KvEventKind::Stored, key, version);
            }
        }
    }

    /// Removes keys. A pinned block leaves the index now and its slot is freed
    /// by the last unpin.
    pub fn remove(&mut self, ns: u32, keys: &[Key]) -> Result<Vec<bool>, Error> {
        self.namespace(ns)?;
        self.check_batch(keys.len())?;
        let mut out = Vec::with_capacity(keys.len());
        for &key in keys {
            let Some((p, s)) = self.valid_slot(ns, key) else {
                out.push(false);
                continue;
            };
            self.index.remove(&IndexKey::new(ns, key));
            let version = self.pools[p as usize].slots[s as usize].version;
            self.emit(ns, KvEventKind::Removed, key, version);
            self.retire_valid(p, s);
            self.counters.removes += 1;
            out.push(true);
        }
        Ok(out)
    }

    /// A Valid slot (already out of the index) leaves the eviction queues:
    /// freed now, or a zombie freed by its last pin.
    fn retire_valid(&mut self, p: u32, s: u32) {
        let pool = &mut self.pools[p as usize];
        let slot = &mut pool.slots[s as usize];
        match slot.queue {
            Queue::Small => pool.small_live -= 1,
            Queue::Main => pool.main_live -= 1,
            Queue::None => {}
        }
        slot.queue = Queue::None;
        pool.valid -= 1;
        if slot.pins > 0 {
            slot.state = State::Zombie;
            pool.pinned -= 1;
            pool.zombie += 1;
        } else {
            self.free_slot(p, s);
        }
    }

    /// Releases everything `session` holds (its connection closed), as
    /// [`Store::release_session_of`] with no process to watch.
    pub fn release_session(&mut self, session: SessionId) -> (u64, u64) {
        self.release_session_of(session, None, Instant::now())
    }

    /// Releases everything `session` holds (its connection closed). Where
    /// `writer` (the engine's process) still lives, its unfinished
    /// allocations — and those whose lease passed — stay fenced until it
    /// exits (or `limits.fence_ms_max`); otherwise they are freed now.
    pub fn release_session_of(
        &mut self,
        session: SessionId,
        writer: Option<Arc<dyn WriterProbe>>,
        now: Instant,
    ) -> (u64, u64) {
        let Some(sess) = self.sessions.remove(&session) else {
            return (0, 0);
        };
        let writer = writer.filter(|w| !w.gone());
        let (mut pins, mut allocs) = (0u64, 0u64);
        for (r, (count, lease)) in sess.pins {
            self.lease_unref(lease);
            for _ in 0..count {
                self.drop_pin(r);
                pins += 1;
            }
        }
        for (r, lease) in sess.allocs {
            self.lease_unref(lease);
            match &writer {
                Some(w) => {
                    self.fence(r, now, None, Some(Arc::clone(w)));
                }
                None => self.drop_pending(r),
            }
            allocs += 1;
        }
        for r in sess.fenced {
            match &writer {
                Some(w) => self.fence_for_writer(r, Arc::clone(w)),
                None => self.unfence(r, false),
            }
        }
        self.counters.session_releases += pins + allocs;
        (pins, allocs)
    }

    /// Reclaims pins and allocations whose lease has passed.
    pub fn expire(&mut self, now: Instant) -> u64 {
        let mut n = 0;
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            let lease = self.leases.remove(&id).expect("deadline of a known lease");
            let Some(mut sess) = self.sessions.remove(&lease.session) else {
                continue;
            };
            for r in lease.refs {
                match lease.kind {
                    LeaseKind::Pin => {
                        if let Some(&(count, l)) = sess.pins.get(&r)
                            && l == id
                        {
                            sess.pins.remove(&r);
                            sess.pin_total -= u64::from(count);
                            for _ in 0..count {
                                self.drop_pin(r);
                            }
                            n += 1;
                        }
                    }
                    LeaseKind::Alloc => {
                        if sess.allocs.get(&r) == Some(&id) {
                            sess.allocs.remove(&r);
                            // The engine may still be writing (it is late,
                            // not necessarily gone): fenced, not freed.
                            if self.fence(r, now, Some(lease.session), None) {
                                sess.fenced.insert(r);
                            }
                            n += 1;
                        }
                    }
                }
            }
            self.sessions.insert(lease.session, sess);
        }
        self.counters.lease_expirations += n;
        self.lift_fences(now);
        n
    }

    /// Lifts the fences of engine processes that exited (each process asked
    /// once: O(processes)), then those older than `limits.fence_ms_max`
    /// (forced; O(lifted), oldest first), with one warning per pass.
    fn lift_fences(&mut self, now: Instant) {
        if self.fences.is_empty() {
            return;
        }
        let exited: Vec<usize> = self.fence_writers.iter().filter(|(_, (w, _))| w.gone()).map(|(k, _)| *k).collect();
        for k in exited {
            if let Some((_, slots)) = self.fence_writers.remove(&k) {
                for r in slots {
                    if let Some(f) = self.fences.get_mut(&r) {
                        f.writer = None;
                    }
                    self.unfence(r, false);
                }
            }
        }
        let max = Duration::from_millis(self.cfg.limits.fence_ms_max);
        let mut forced = 0u64;
        while let Some(&(since, r)) = self.fence_order.first() {
            if now.saturating_duration_since(since) < max {
                break;
            }
            self.unfence(r, true);
            forced += 1;
        }
        if forced > 0 {
            tracing::warn!(
                slots = forced,
                fence_ms_max = self.cfg.limits.fence_ms_max,
                "fenced slots reused after limits.fence_ms_max: the engines that allocated them neither finished \
                 nor exited (a late write of theirs would land in another block)"
            );
        }
    }

    /// Registers a session (a new engine connection), if under the limit.
    pub fn open_session(&mut self, session: SessionId) -> Result<(), Error> {
        if self.sessions.contains_key(&session) {
            return Ok(());
        }
        // Engine connections only: peers' grant sessions and the daemon's
        // own fetches are not what the limit is about. (Counted only when a
        // connection opens: O(sessions).)
        let engines = self.sessions.keys().filter(|&&id| id < PEER_SESSION_BASE).count();
        if session < PEER_SESSION_BASE && engines >= self.cfg.limits.sessions_max as usize {
            self.counters.resource_exhausted += 1;
            return Err(Error::ResourceExhausted(format!("{engines} sessions open, limits.sessions_max reached")));
        }
        self.sessions.entry(session).or_default();
        Ok(())
    }

    /// Figures for `Stats`.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            pools: self
                .pools
                .iter()
                .map(|p| PoolStats {
                    name: p.name.clone(),
                    device: p.device.clone(),
                    bytes: p.memory.len(),
                    slot_payload_bytes: p.slot_payload_bytes,
                    slots: p.slot_count(),
                    free: p.free.len() as u32,
                    valid: p.valid,
                    pending: p.pending.saturating_sub(p.quarantined + p.fenced),
                    pinned: p.pinned,
                    zombie: p.zombie,
                    mlocked: p.memory.mlocked(),
                    quarantined: p.quarantined,
                    fenced: p.fenced,
                    huge_page_bytes: p.huge_page_bytes,
                })
                .collect(),
            namespaces: self.namespaces.len() as u32,
            sessions: self.sessions.len() as u32,
            pins_outstanding: self.pins_outstanding,
            allocations_outstanding: self.allocs_outstanding,
            counters: self.counters.clone(),
        }
    }

    /// Checks the store's internal accounting against a full recount.
    /// Used by tests; cheap enough to call after every step of a test.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut pins_total = 0u64;
        for p in &self.pools {
            let (mut valid, mut pending, mut pinned, mut zombie, mut small, mut main) = (0, 0, 0, 0, 0, 0);
            for (i, s) in p.slots.iter().enumerate() {
                pins_total += s.pins as u64;
                match s.state {
                    State::Free => {
                        if s.pins != 0 {
                            return Err(format!("pool {} slot {i}: free with {} pins", p.name, s.pins));
                        }
                    }
                    State::Pending { .. } | State::Committing => pending += 1,
                    State::Valid => {
                        valid += 1;
                        if s.pins > 0 {
                            pinned += 1;
                        }
                        // Clustered, the core may keep a replaced version
                        // (out of the index) for its readers.
                        if !self.coherent && self.index.get(&IndexKey::new(s.ns, s.key)) != Some(&(p.index, i as u32)) {
                            return Err(format!("pool {} slot {i}: valid but not indexed", p.name));
                        }
                    }
                    State::Zombie => {
                        zombie += 1;
                        if s.pins == 0 {
                            return Err(format!("pool {} slot {i}: zombie without pins", p.name));
                        }
                    }
                }
                match s.queue {
                    Queue::Small => small += 1,
                    Queue::Main => main += 1,
                    Queue::None => {}
                }
            }
            let free = p.free.len() as u32;
            if (valid, pending, pinned, zombie) != (p.valid, p.pending, p.pinned, p.zombie)
                || valid + pending + zombie + free != p.slot_count()
                || small != p.small_live
                || main != p.main_live
            {
                return Err(format!(
                    "pool {}: counts drifted: recount valid {valid} pending {pending} pinned {pinned} zombie {zombie} \
                     small {small} main {main}, kept {} {} {} {} {} {}, free {free} of {}",
                    p.name,
                    p.valid,
                    p.pending,
                    p.pinned,
                    p.zombie,
                    p.small_live,
                    p.main_live,
                    p.slot_count()
                ));
            }
        }
        if pins_total != self.pins_outstanding {
            return Err(format!("pins: slots hold {pins_total}, counter says {}", self.pins_outstanding));
        }
        let session_pins: u64 = self.sessions.values().flat_map(|s| s.pins.values()).map(|(c, _)| *c as u64).sum();
        if session_pins != pins_total {
            return Err(format!("pins: sessions hold {session_pins}, slots hold {pins_total}"));
        }
        if let Some((sid, s)) =
            self.sessions.iter().find(|(_, s)| s.pin_total != s.pins.values().map(|(c, _)| u64::from(*c)).sum::<u64>())
        {
            return Err(format!("session {sid}: pin total {} is not the sum of its pin counts", s.pin_total));
        }
        let session_allocs: usize = self.sessions.values().map(|s| s.allocs.len()).sum();
        let records = self.sessions.values().map(|s| s.allocs.len() + s.pins.len()).sum::<usize>();
        let live: usize = self.leases.values().map(|l| l.live as usize).sum();
        if records != live || self.leases.len() != self.deadlines.len() || self.leases.values().any(|l| l.live == 0) {
            return Err(format!(
                "leases: {live} live references in {} leases ({} deadlines), sessions hold {records} records",
                self.leases.len(),
                self.deadlines.len()
            ));
        }
        for (sid, sess) in &self.sessions {
            let ids = sess.pins.values().map(|(_, l)| *l).chain(sess.allocs.values().copied());
            for id in ids {
                match self.leases.get(&id) {
                    Some(l) if l.session == *sid => {}
                    _ => {
                        return Err(format!("session {sid}: record points at a missing or foreign lease {id}"));
                    }
                }
            }
        }
        if (session_allocs as u64) > self.allocs_outstanding {
            return Err("allocations: sessions hold more than the counter".into());
        }
        for p in &self.pools {
            let n = self.fences.keys().filter(|r| r.pool == p.index).count();
            if n != p.fenced as usize {
                return Err(format!("pool {}: counts {} fenced, {n} recorded", p.name, p.fenced));
            }
        }
        if self.fence_order.len() != self.fences.len() {
            return Err(format!("fences: {} recorded, {} in order", self.fences.len(), self.fence_order.len()));
        }
        for (r, f) in &self.fences {
            let slot = &self.pools[r.pool as usize].slots[r.slot as usize];
            if !matches!(slot.state, State::Pending { .. }) || slot.generation != r.generation {
                return Err(format!("fence of {r:?}: slot not pending in that generation"));
            }
            if !self.fence_order.contains(&(f.since, *r)) {
                return Err(format!("fence of {r:?}: not in the order"));
            }
            match (f.session, f.writer) {
                (Some(sid), None) => {
                    if !self.sessions.get(&sid).is_some_and(|s| s.fenced.contains(r)) {
                        return Err(format!("fence of {r:?}: session {sid} does not record it"));
                    }
                }
                (None, Some(k)) => {
                    if !self.fence_writers.get(&k).is_some_and(|(_, slots)| slots.contains(r)) {
                        return Err(format!("fence of {r:?}: its process does not record it"));
                    }
                }
                _ => return Err(format!("fence of {r:?}: held for a session xor a process")),
            }
        }
        let by_writers: usize = self.fence_writers.values().map(|(_, slots)| slots.len()).sum();
        if by_writers != self.fences.values().filter(|f| f.writer.is_some()).count() {
            return Err("fences: processes record other slots than the fences held for them".into());
        }
        for (sid, sess) in &self.sessions {
            if let Some(r) = sess.fenced.iter().find(|r| self.fences.get(r).is_none_or(|f| f.session != Some(*sid))) {
                return Err(format!("session {sid}: fenced {r:?} not fenced for it"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A clustered allocation that keeps nothing from eviction.
    fn detached(exists_check: bool) -> Detached<'static> {
        Detached { exists_check, keep: &|_| false }
    }

    fn store(slots: u64, extra: &str) -> Store {
        let stride = slot_stride(4096);
        let text = format!(
            "{extra}\n[[pools]]\nname = \"t\"\nbytes = {}\nslot_payload_bytes = 4096\nmlock = false\n",
            slots * stride
        );
        Store::new(Config::parse(&text, "test").unwrap()).unwrap()
    }

    /// A seeded xorshift: `rnd(n)` is in `0..n`.
    fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
        move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        }
    }

    fn put(st: &mut Store, session: SessionId, ns: u32, key: Key, now: Instant) -> Option<SlotRef> {
        let (out, _) = st.allocate(session, ns, &[key], 0, now).ok()?;
        let AllocOutcome::Allocated { slot, payload_offset } = out[0] else {
            return None;
        };
        let data = vec![(key.0 & 0xff) as u8; 4096];
        st.pools[0].memory.copy_in(payload_offset, &data).unwrap();
        let jobs = st.begin_commit(session, &[slot]).unwrap();
        let j = jobs[0].clone().unwrap();
        let sum = j.memory.checksum(j.offset, j.len).unwrap();
        st.finish_commit(&[(slot, sum)]);
        Some(slot)
    }

    /// Puts and removes below the watermark (nothing is evicted) leave
    /// stale queue entries behind; the queues drop them instead of growing.
    #[test]
    fn eviction_queues_stay_bounded_without_evictions() {
        let mut st = store(64, "");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let now = Instant::now();
        let cap = (st.pools[0].small.capacity(), st.pools[0].main.capacity());
        for i in 0..20_000u128 {
            put(&mut st, 1, ns, Key(i % 8), now).unwrap();
            st.remove(ns, &[Key(i % 8)]).unwrap();
            if i % 3 == 0 {
                // Some stay (and some are read, so they move to main).
                put(&mut st, 1, ns, Key(100 + i % 16), now);
                let _ = st.pin(2, ns, &[Key(100 + i % 16)], 0, false, now).unwrap();
                st.release_session(2);
            }
        }
        st.check_invariants().unwrap();
        let p = &st.pools[0];
        assert!(p.small.len() <= cap.0 && p.main.len() <= cap.1.max(p.main.len()), "queues grew: {}", p.small.len());
        assert_eq!((p.small.capacity(), p.main.capacity()), cap, "a queue regrew");
        assert_eq!(st.counters.evictions, 0, "the test is about a pool that does not evict");
    }

    /// Allocates `key` for `session` with a lease of `lease_ms`; `None`
    /// when no slot is left.
    fn alloc(st: &mut Store, session: SessionId, ns: u32, key: Key, lease_ms: u64, now: Instant) -> Option<SlotRef> {
        st.open_session(session).unwrap();
        match st.allocate(session, ns, &[key], lease_ms, now) {
            Ok((out, _)) => match out[0] {
                AllocOutcome::Allocated { slot, .. } => Some(slot),
                ref o => panic!("{o:?}"),
            },
            Err(Error::ResourceExhausted(_)) => None,
            Err(e) => panic!("{e:?}"),
        }
    }

    /// An engine late past its allocation's lease may still be writing the
    /// slot: it is not handed to anyone else (a late write would land in
    /// their block after its commit) until the engine commits or aborts it
    /// — then it is free. The key itself is free for another put at once.
    #[test]
    fn an_allocation_past_its_lease_is_fenced_until_its_engine_commits_or_aborts() {
        let mut st = store(4, "");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let t0 = Instant::now();
        let a = alloc(&mut st, 1, ns, Key(1), 10, t0).unwrap();
        let b = alloc(&mut st, 1, ns, Key(2), 10, t0).unwrap();
        assert_eq!(st.expire(t0 + Duration::from_millis(20)), 2);
        st.check_invariants().unwrap();
        assert_eq!((st.fenced_slots(), st.counters.fenced), (2, 2));
        let p = &st.stats().pools[0];
        assert_eq!((p.fenced, p.pending, p.free), (2, 0, 2), "{p:?}");
        // Another engine gets the two free slots, not the fenced ones; the
        // keys themselves are free again.
        let t1 = t0 + Duration::from_millis(30);
        let c = alloc(&mut st, 2, ns, Key(1), 0, t1).unwrap();
        let d = alloc(&mut st, 2, ns, Key(3), 0, t1).unwrap();
        assert!(alloc(&mut st, 2, ns, Key(4), 0, t1).is_none(), "a fenced slot was handed out");
        for r in [c, d] {
            assert!(r.slot != a.slot && r.slot != b.slot, "{r:?} reuses a fenced slot");
        }
        st.check_invariants().unwrap();
        // The late engine commits one (refused: its lease passed) and
        // aborts the other: it stopped writing both.
        assert!(st.begin_commit(1, &[a]).unwrap()[0].is_none());
        assert_eq!(st.fenced_slots(), 1);
        assert_eq!(st.abort(1, &[b]).unwrap(), (0, 1));
        assert_eq!(st.fenced_slots(), 0);
        st.check_invariants().unwrap();
        assert!(alloc(&mut st, 2, ns, Key(4), 0, t1).is_some());
        assert!(alloc(&mut st, 2, ns, Key(5), 0, t1).is_some());
        assert_eq!(st.counters.fences_forced, 0);
        st.check_invariants().unwrap();
    }

    /// A probe the test flips.
    struct Probe(std::sync::atomic::AtomicBool);

    impl WriterProbe for Probe {
        fn gone(&self) -> bool {
            self.0.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// A connection that closes while its process lives leaves its
    /// unfinished allocations (and those past their lease) fenced until
    /// the process exits; one whose process is gone frees them at once.
    #[test]
    fn a_closed_session_whose_process_lives_keeps_its_slots_fenced_until_it_exits() {
        let mut st = store(4, "");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let t0 = Instant::now();
        alloc(&mut st, 1, ns, Key(1), 10, t0).unwrap();
        alloc(&mut st, 1, ns, Key(2), 60_000, t0).unwrap();
        alloc(&mut st, 1, ns, Key(3), 60_000, t0).unwrap();
        st.expire(t0 + Duration::from_millis(20));
        assert_eq!(st.fenced_slots(), 1);
        let probe = Arc::new(Probe(std::sync::atomic::AtomicBool::new(false)));
        assert_eq!(st.release_session_of(1, Some(probe.clone() as Arc<dyn WriterProbe>), t0), (0, 2));
        st.check_invariants().unwrap();
        assert_eq!(st.fenced_slots(), 3, "the process lives: all three may still be written");
        assert_eq!(st.stats().allocations_outstanding, 0);
        st.expire(t0 + Duration::from_secs(1));
        assert_eq!(st.fenced_slots(), 3);
        assert_eq!(st.stats().pools[0].free, 1);
        probe.0.store(true, std::sync::atomic::Ordering::Relaxed);
        st.expire(t0 + Duration::from_secs(1));
        assert_eq!(st.fenced_slots(), 0, "the process exited: nothing of it writes");
        assert_eq!(st.stats().pools[0].free, 4);
        assert_eq!(st.counters.fences_forced, 0);
        st.check_invariants().unwrap();
        // Gone before its connection closed (a crash): freed at once.
        alloc(&mut st, 3, ns, Key(1), 60_000, t0).unwrap();
        assert_eq!(st.release_session_of(3, Some(probe as Arc<dyn WriterProbe>), t0), (0, 1));
        assert_eq!((st.fenced_slots(), st.stats().pools[0].free), (0, 4));
        // No process known (another pid namespace): freed at once, as before.
        alloc(&mut st, 4, ns, Key(1), 60_000, t0).unwrap();
        assert_eq!(st.release_session(4), (0, 1));
        assert_eq!((st.fenced_slots(), st.stats().pools[0].free), (0, 4));
        st.check_invariants().unwrap();
    }

    /// A fence lasts at most `limits.fence_ms_max` (then the slot is reused,
    /// counted); 0 turns fences off.
    #[test]
    fn fences_end_at_fence_ms_max_and_zero_turns_them_off() {
        let mut st = store(4, "[limits]\nfence_ms_max = 100\n");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let t0 = Instant::now();
        let a = alloc(&mut st, 1, ns, Key(1), 10, t0).unwrap();
        st.expire(t0 + Duration::from_millis(20));
        assert_eq!(st.fenced_slots(), 1);
        st.expire(t0 + Duration::from_millis(110));
        assert_eq!(st.fenced_slots(), 1, "fenced for 90 ms of 100");
        st.expire(t0 + Duration::from_millis(121));
        assert_eq!((st.fenced_slots(), st.counters.fences_forced), (0, 1));
        assert_eq!(st.stats().pools[0].free, 4);
        st.check_invariants().unwrap();
        // The session's record of it went too: its late commit is refused
        // as before and touches nothing.
        assert!(st.sessions[&1].fenced.is_empty());
        assert!(st.begin_commit(1, &[a]).unwrap()[0].is_none());
        assert_eq!((st.fenced_slots(), st.stats().pools[0].free), (0, 4));
        st.check_invariants().unwrap();
        // Turned off by a reload: lifted at once, not counted as forced.
        let b = alloc(&mut st, 1, ns, Key(2), 10, t0).unwrap();
        st.expire(t0 + Duration::from_millis(20));
        assert_eq!(st.fenced_slots(), 1);
        let mut limits = st.cfg.limits.clone();
        limits.fence_ms_max = 0;
        let eviction = st.cfg.eviction.clone();
        st.reload_limits(limits, eviction);
        assert_eq!((st.fenced_slots(), st.counters.fences_forced, st.stats().pools[0].free), (0, 1, 4));
        assert!(st.abort(1, &[b]).is_ok());
        st.check_invariants().unwrap();

        let mut st = store(4, "[limits]\nfence_ms_max = 0\n");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        alloc(&mut st, 1, ns, Key(1), 10, t0).unwrap();
        st.expire(t0 + Duration::from_millis(20));
        assert_eq!((st.fenced_slots(), st.stats().pools[0].free, st.counters.fenced), (0, 4, 0));
        st.check_invariants().unwrap();
    }

    /// A peer that asks for the same block again and again without ever
    /// releasing is refused at a bound, never wraps the slot's pin count.
    #[test]
    fn a_peer_repinning_one_block_hits_a_bound() {
        let mut st = store(4, "");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let now = Instant::now();
        let slot = put(&mut st, 9, ns, Key(1), now).unwrap();
        let peer = PEER_SESSION_BASE + 3;
        let refs = vec![slot; 4096];
        let rounds = INTERNAL_PINS_MAX / 4096;
        for _ in 0..rounds {
            let (out, _) = st.pin_slots(peer, &refs, 5_000, now).unwrap();
            assert!(out.iter().all(Option::is_some));
        }
        let e = st.pin_slots(peer, &refs[..1], 5_000, now).unwrap_err();
        assert!(matches!(&e, Error::ResourceExhausted(m) if m.contains("internal session")), "{e:?}");
        assert_eq!(u64::from(st.pools[0].slots[slot.slot as usize].pins), INTERNAL_PINS_MAX);
        st.release_session(peer);
        assert_eq!(st.pools[0].slots[slot.slot as usize].pins, 0);
        st.check_invariants().unwrap();
    }

    /// `sessions_max` bounds engine connections: the sessions of peers'
    /// grants and of the daemon's own fetches do not take their places.
    #[test]
    fn internal_sessions_do_not_count_against_sessions_max() {
        let mut st = store(4, "[limits]\nsessions_max = 2");
        st.open_session(PEER_SESSION_BASE + 1).unwrap();
        st.open_session(FETCH_SESSION).unwrap();
        st.open_session(1).unwrap();
        st.open_session(2).unwrap();
        let e = st.open_session(3).unwrap_err();
        assert!(matches!(&e, Error::ResourceExhausted(m) if m.starts_with("2 sessions open")), "{e:?}");
        st.open_session(PEER_SESSION_BASE + 2).unwrap();
    }

    /// Pinning one slot again and again counts against the session's pin
    /// limit (each pin is a count on the slot: unbounded, it could wrap).
    #[test]
    fn repeated_pins_of_one_slot_count_against_the_limit() {
        let mut st = store(4, "[limits]\npins_per_session_max = 5");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let now = Instant::now();
        let slot = put(&mut st, 9, ns, Key(1), now).unwrap();
        for _ in 0..5 {
            st.check_pin_request(1, 1).unwrap();
            st.pin(1, ns, &[Key(1)], 0, false, now).unwrap();
        }
        let e = st.check_pin_request(1, 1).unwrap_err();
        assert!(matches!(&e, Error::ResourceExhausted(m) if m.contains("pins_per_session_max")), "{e:?}");
        assert_eq!(st.pools[0].slots[slot.slot as usize].pins, 5);
        st.unpin(1, &[slot, slot]).unwrap();
        st.check_pin_request(1, 2).unwrap();
        st.check_invariants().unwrap();
    }

    /// A re-pin with a shorter lease does not cut short the first pin's
    /// lease: the slot stays pinned (not evictable) until the longer one.
    #[test]
    fn a_shorter_repin_keeps_the_longer_lease() {
        let mut st = store(4, "");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let t0 = Instant::now();
        let slot = put(&mut st, 9, ns, Key(1), t0).unwrap();
        let (_, long) = st.pin(1, ns, &[Key(1)], 60_000, false, t0).unwrap();
        let (_, short) = st.pin(1, ns, &[Key(1)], 1_000, false, t0).unwrap();
        assert!(short < long);
        st.expire(short + Duration::from_millis(1));
        assert_eq!(st.pools[0].slots[slot.slot as usize].pins, 2, "the short lease released the long one's pin");
        st.check_invariants().unwrap();
        st.expire(long + Duration::from_millis(1));
        assert_eq!(st.pools[0].slots[slot.slot as usize].pins, 0);
        st.check_invariants().unwrap();
        // The other way round, the record follows the longer lease.
        let (_, short) = st.pin(1, ns, &[Key(1)], 1_000, false, t0).unwrap();
        let (_, long) = st.pin(1, ns, &[Key(1)], 60_000, false, t0).unwrap();
        st.expire(short + Duration::from_millis(1));
        assert_eq!(st.pools[0].slots[slot.slot as usize].pins, 2);
        st.expire(long + Duration::from_millis(1));
        assert_eq!(st.pools[0].slots[slot.slot as usize].pins, 0);
        st.check_invariants().unwrap();
    }

    /// A namespace lives on one device: one with no pool is refused, and a
    /// name registered on the host cannot be taken again for a GPU.
    #[test]
    fn namespaces_are_placed_on_their_device_only() {
        let mut st = store(4, "");
        let e = st.register_namespace_on("g", 4096, "", "cuda:0").unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("no pool on device \"cuda:0\"")), "{e:?}");
        st.register_namespace_on("h", 4096, "", "host").unwrap();
        assert_eq!(st.register_namespace("h", 4096, "").unwrap().pool, 0, "\"\" is the host");
        let e = st.register_namespace_on("h", 4096, "", "cuda:0").unwrap_err();
        assert!(matches!(&e, Error::FailedPrecondition(m) if m.contains("does not match namespace h")), "{e:?}");
    }

    /// Random operations from several sessions; after every step the
    /// accounting recounts exactly, pinned slots keep their generation and
    /// contents, and every Valid slot's header verifies in pool memory.
    #[test]
    fn random_ops_keep_invariants() {
        const FENCE_MS: u64 = 300;
        let mut st = store(
            64,
            &format!("[limits]\nfence_ms_max = {FENCE_MS}\n[eviction]\nhigh_watermark = 0.9\nlow_watermark = 0.8"),
        );
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let mut rnd = xorshift(0x1234_5678_9abc_def0);
        let t0 = Instant::now();
        let mut pins: HashMap<(SessionId, SlotRef), (Key, u32)> = HashMap::new();
        // Allocations the engine may still write (not committed nor
        // aborted), with the time until which that is guaranteed safe: their
        // slot is theirs, whether their lease passed (fenced) or not.
        let mut pending: Vec<(SessionId, SlotRef, Instant)> = Vec::new();
        // Allocations left by a closed session whose process lives (its
        // probe), until it exits.
        let mut lingering: Vec<(Arc<Probe>, SlotRef, Instant)> = Vec::new();
        for step in 0..20_000u64 {
            let now = t0 + Duration::from_millis(step);
            if step % 7 == 0 {
                st.expire(now);
                // Exited processes' slots are free after a pass.
                lingering.retain(|(w, ..)| !w.gone());
            }
            let session = 1 + rnd(3);
            let key = Key(rnd(200) as u128);
            match rnd(10) {
                0..=2 => {
                    put(&mut st, session, ns, key, now);
                }
                3 | 4 => {
                    if let Ok((out, _)) = st.pin(session, ns, &[key], 0, false, now)
                        && let Some(p) = out[0]
                    {
                        pins.entry((session, p.slot)).or_insert((key, 0)).1 += 1;
                    }
                }
                5 | 6 => {
                    let mine: Vec<_> = pins.keys().filter(|(s, _)| *s == session).copied().collect();
                    if let Some(&(s, r)) = mine.get(rnd(mine.len().max(1) as u64) as usize) {
                        st.unpin(s, &[r]).unwrap();
                        let e = pins.get_mut(&(s, r)).unwrap();
                        e.1 -= 1;
                        if e.1 == 0 {
                            pins.remove(&(s, r));
                        }
                    }
                }
                7 => {
                    st.remove(ns, &[key]).unwrap();
                }
                8 => {
                    // Some leases pass before the engine is done.
                    let lease_ms = if rnd(2) == 0 { 5 } else { 30_000 };
                    if let Ok((out, _)) = st.allocate(session, ns, &[key], lease_ms, now)
                        && let AllocOutcome::Allocated { slot, .. } = out[0]
                    {
                        pending.push((session, slot, now + Duration::from_millis(lease_ms + FENCE_MS)));
                    }
                }
                _ => {
                    if rnd(50) == 0 {
                        // Closed: its process lives on (for a while), has
                        // exited, or is not known.
                        let mine: Vec<_> =
                            pending.iter().filter(|(s, ..)| *s == session).map(|&(_, r, t)| (r, t)).collect();
                        match rnd(3) {
                            0 => {
                                let w = Arc::new(Probe(std::sync::atomic::AtomicBool::new(false)));
                                st.release_session_of(session, Some(w.clone() as Arc<dyn WriterProbe>), now);
                                // (Fenced from now on, or since its lease passed.)
                                let fenced_until = now + Duration::from_millis(FENCE_MS);
                                lingering.extend(mine.into_iter().map(|(r, t)| (w.clone(), r, t.min(fenced_until))));
                            }
                            1 => {
                                let w = Arc::new(Probe(std::sync::atomic::AtomicBool::new(true)));
                                st.release_session_of(session, Some(w as Arc<dyn WriterProbe>), now);
                            }
                            _ => {
                                st.release_session(session);
                            }
                        }
                        pins.retain(|(s, _), _| *s != session);
                        pending.retain(|(s, ..)| *s != session);
                    } else if rnd(20) == 0 && !lingering.is_empty() {
                        // A lingering process exits.
                        let i = rnd(lingering.len() as u64) as usize;
                        lingering[i].0.0.store(true, std::sync::atomic::Ordering::Relaxed);
                    } else if let Some((s, r, _)) = pending.pop() {
                        // Done writing: commit (refused if its lease passed)
                        // or abort.
                        if rnd(2) == 0 {
                            st.abort(s, &[r]).unwrap();
                        } else if let Some(j) = {
                            // Its bytes first, as an engine writes them.
                            let k = st.pools[0].slots[r.slot as usize].key;
                            let off = st.pools[0].payload_offset(r.slot);
                            st.pools[0].memory.copy_in(off, &[(k.0 & 0xff) as u8; 4096]).unwrap();
                            st.begin_commit(s, &[r]).unwrap()[0].clone()
                        } {
                            let sum = j.memory.checksum(j.offset, j.len).unwrap();
                            st.finish_commit(&[(r, sum)]);
                        }
                    }
                }
            }
            st.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
            for (r, until) in pending.iter().map(|&(_, r, t)| (r, t)).chain(lingering.iter().map(|(_, r, t)| (*r, *t)))
            {
                if now < until {
                    let slot = &st.pools[0].slots[r.slot as usize];
                    assert!(
                        slot.generation == r.generation && matches!(slot.state, State::Pending { .. }),
                        "step {step}: {r:?}, which its engine may still write, was reused ({:?})",
                        slot.state
                    );
                }
            }
            for ((_, r), (key, _)) in &pins {
                let slot = &st.pools[0].slots[r.slot as usize];
                assert_eq!(slot.generation, r.generation, "step {step}: pinned slot reused");
                assert!(
                    matches!(slot.state, State::Valid | State::Zombie),
                    "step {step}: pinned slot {:?}",
                    slot.state
                );
                assert_eq!(slot.key, *key);
                let mut b = [0u8; 1];
                st.pools[0].memory.copy_out(st.pools[0].payload_offset(r.slot), &mut b).unwrap();
                assert_eq!(b[0], (key.0 & 0xff) as u8, "step {step}: pinned bytes changed");
            }
        }
        assert!(st.counters.evictions > 100, "the test must exercise eviction: {}", st.counters.evictions);
        assert!(
            st.counters.fenced > 50 && st.counters.fences_forced > 0,
            "the test must exercise fences: {} fenced, {} forced",
            st.counters.fenced,
            st.counters.fences_forced
        );
        // Every valid slot's header and trailer verify against pool memory.
        let p = &st.pools[0];
        for (i, s) in p.slots.iter().enumerate() {
            if s.state == State::Valid {
                let whole = p.memory.host().unwrap().read(p.slot_offset(i as u32), p.stride).unwrap();
                let want = p.meta_of(i as u32, SlotState::Valid, st.namespaces[0].fingerprint);
                kvmesh_common::slot::validate_slot(&whole, 4096, &want).unwrap();
            }
        }
    }

    /// A quarantined slot (a timed-out fetch UCX may still write) is shown
    /// as quarantined, not as a slot being written for ever.
    #[test]
    fn quarantined_slots_are_counted_apart_from_pending_ones() {
        let mut st = store(8, "");
        st.set_coherent();
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let now = Instant::now();
        let (out, _) = st.allocate_detached(FETCH_SESSION, ns, &[Key(1), Key(2)], 0, detached(false), now).unwrap();
        let slots: Vec<SlotRef> = out
            .iter()
            .map(|o| match o {
                AllocOutcome::Allocated { slot, .. } => *slot,
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(st.begin_commit(FETCH_SESSION, &slots).unwrap().iter().all(Option::is_some));
        st.quarantine_core(slots[0]);
        st.quarantine_core(slots[0]); // stale now: nothing more
        st.check_invariants().unwrap();
        let p = &st.stats().pools[0];
        assert_eq!((p.pending, p.quarantined, p.free), (1, 1, 6), "{p:?}");
        st.free_core(slots[1]);
        let p = &st.stats().pools[0];
        assert_eq!((p.pending, p.quarantined, p.free), (0, 1, 7), "{p:?}");
        assert_eq!(st.counters.quarantined, 1);
    }

    /// Clustered mode, driven the way the coherence driver drives it: puts
    /// and fetches outside the index, commits and frees chosen by a model
    /// of the core, engine and grant pins on exact slots, evictions fed
    /// back. After every step the accounting recounts, pinned and
    /// core-owned slots are never reused, and the index names only Valid
    /// slots the model holds.
    #[test]
    fn clustered_random_ops_keep_invariants() {
        let mut st = store(48, "[eviction]\nhigh_watermark = 0.9\nlow_watermark = 0.8");
        st.set_coherent();
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let fp = st.namespaces[0].fingerprint;
        let mut rnd = xorshift(0x0bad_cafe_1234_5678);
        let t0 = Instant::now();
        // The model core: slots it owns (being written/fetched) and Valid
        // copies it references, by key.
        let mut owned: Vec<(SlotRef, Key)> = Vec::new();
        let mut copies: HashMap<Key, SlotRef> = HashMap::new();
        let mut pins: HashMap<(SessionId, SlotRef), (Key, u32)> = HashMap::new();
        let mut version = 0u64;
        let (mut commits, mut fetches, mut quarantined) = (0, 0, 0);
        for step in 0..20_000u64 {
            let now = t0 + Duration::from_millis(step);
            let session = 1 + rnd(3);
            st.open_session(session).unwrap();
            let key = Key(rnd(120) as u128);
            match rnd(12) {
                0..=2 => {
                    // A put or a fetch: a slot outside the index, owned by the core.
                    let (who, exists_check) = if rnd(2) == 0 { (session, rnd(2) == 0) } else { (FETCH_SESSION, false) };
                    if let Ok((out, _)) = st.allocate_detached(who, ns, &[key], 0, detached(exists_check), now)
                        && let AllocOutcome::Allocated { slot, payload_offset } = out[0]
                    {
                        st.pools[0].memory.copy_in(payload_offset, &[(key.0 & 0xff) as u8; 4096]).unwrap();
                        assert!(st.begin_commit(who, &[slot]).unwrap()[0].is_some());
                        owned.push((slot, key));
                    }
                }
                3 | 4 => {
                    // The core makes an owned slot Valid (publish answered, or
                    // a fetch registered) and drops the previous copy.
                    if !owned.is_empty() {
                        let (slot, key) = owned.swap_remove(rnd(owned.len() as u64) as usize);
                        version += 1;
                        let fetched = rnd(2) == 0;
                        assert!(st.commit_core(slot, version, 7, fetched), "step {step}: owned slot lost");
                        commits += 1;
                        fetches += fetched as u64;
                        if let Some(old) = copies.insert(key, slot) {
                            st.free_core(old);
                        }
                    }
                }
                5 => {
                    // The core gives an owned slot up (refused publish, bad
                    // read), or quarantines it (timed-out read).
                    if !owned.is_empty() {
                        let (slot, _) = owned.swap_remove(rnd(owned.len() as u64) as usize);
                        // (Quarantined slots are gone for good: only a few.)
                        if quarantined < 8 && rnd(4) == 0 {
                            st.quarantine_core(slot);
                            quarantined += 1;
                        } else {
                            st.free_core(slot);
                        }
                    }
                }
                6 | 7 => {
                    // A hit or a grant: the exact slot of a copy is pinned.
                    if let Some(&slot) = copies.get(&key) {
                        let who = if rnd(3) == 0 { PEER_SESSION_BASE + 2 } else { session };
                        let (out, _) = st.pin_slots(who, &[slot], 0, now).unwrap();
                        let p = out[0].expect("a copy the core references is Valid in the store");
                        assert_eq!(p.slot, slot);
                        pins.entry((who, slot)).or_insert((key, 0)).1 += 1;
                    }
                }
                8 | 9 => {
                    let all: Vec<_> = pins.keys().copied().collect();
                    if let Some(&(s, r)) = all.get(rnd(all.len().max(1) as u64) as usize) {
                        assert_eq!(st.unpin(s, &[r]).unwrap(), (1, 0));
                        let e = pins.get_mut(&(s, r)).unwrap();
                        e.1 -= 1;
                        if e.1 == 0 {
                            pins.remove(&(s, r));
                        }
                    }
                }
                10 => {
                    // The core drops a copy (invalidation, eviction request).
                    if let Some(slot) = copies.remove(&key) {
                        st.free_core(slot);
                    }
                }
                _ => {
                    if rnd(40) == 0 {
                        st.release_session(session);
                        pins.retain(|(s, _), _| *s != session);
                    }
                }
            }
            // Evictions are reported; the core drops those copies (their
            // slots are already gone: the free is a stale no-op).
            for (f, k, _) in st.take_evicted() {
                assert_eq!(f, fp);
                let slot = copies.remove(&k).expect("only copies the core references are indexed");
                assert!(!pins.keys().any(|(_, r)| *r == slot), "step {step}: a pinned slot was evicted");
                st.free_core(slot);
            }
            st.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
            for (slot, key) in &owned {
                let s = &st.pools[0].slots[slot.slot as usize];
                assert!(
                    s.generation == slot.generation && s.state == State::Committing,
                    "step {step}: owned slot reused"
                );
                assert_eq!(s.key, *key);
            }
            for ((_, r), (key, _)) in &pins {
                let slot = &st.pools[0].slots[r.slot as usize];
                assert_eq!(slot.generation, r.generation, "step {step}: pinned slot reused");
                assert!(matches!(slot.state, State::Valid | State::Zombie), "step {step}: {:?}", slot.state);
                let mut b = [0u8; 1];
                st.pools[0].memory.copy_out(st.pools[0].payload_offset(r.slot), &mut b).unwrap();
                assert_eq!(b[0], (key.0 & 0xff) as u8, "step {step}: pinned bytes changed");
            }
            for (&IndexKey { ns: n, key: k }, &(p, s)) in &st.index {
                let k = Key(k);
                let slot = &st.pools[p as usize].slots[s as usize];
                assert_eq!(slot.state, State::Valid, "step {step}: index names a {:?} slot", slot.state);
                assert_eq!(copies.get(&k).map(|r| (r.pool, r.slot)), Some((p, s)), "step {step}: index vs core");
                assert_eq!(n, ns);
            }
        }
        assert!(commits > 1000 && fetches > 300 && quarantined == 8, "{commits} {fetches} {quarantined}");
        assert_eq!(st.counters.quarantined, 8);
        assert!(st.counters.evictions > 50, "the test must exercise eviction: {}", st.counters.evictions);
    }

    #[test]
    fn s3fifo_keeps_reused_blocks_over_one_hit_scans() {
        let mut st = store(100, "[eviction]\nhigh_watermark = 1.0\nlow_watermark = 1.0");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let now = Instant::now();
        let hot: Vec<Key> = (0..20u128).map(|i| Key(1_000_000 + i)).collect();
        for &k in &hot {
            put(&mut st, 1, ns, k, now);
        }
        // Touch the hot set twice so it graduates to the main queue.
        for _ in 0..2 {
            let (out, _) = st.pin(1, ns, &hot, 0, false, now).unwrap();
            let refs: Vec<_> = out.iter().flatten().map(|p| p.slot).collect();
            st.unpin(1, &refs).unwrap();
        }
        // A scan of 1,000 one-hit blocks.
        for i in 0..1000u128 {
            put(&mut st, 1, ns, Key(i), now);
        }
        let (present, _) = st.lookup(ns, &hot).unwrap();
        let kept = present.iter().filter(|&&p| p).count();
        assert!(kept >= 18, "S3-FIFO should keep the reused set through a scan, kept {kept}/20");
        st.check_invariants().unwrap();
    }

    /// An allocation evicts whenever some cached block is unpinned, in
    /// whichever queue it waits: here most of the pool is pinned (the main
    /// queue entirely, at times), with unpinned blocks left in the small
    /// queue or hot ones in main. Before, a pass over a main queue of
    /// pinned blocks gave up while the small queue held evictable ones.
    #[test]
    fn an_allocation_evicts_while_any_block_is_unpinned() {
        let mut rnd = xorshift(0x5eed);
        let now = Instant::now();
        for round in 0..200u128 {
            let mut st = store(100, "[eviction]\nhigh_watermark = 1.0\nlow_watermark = 1.0");
            let ns = st.register_namespace("n", 4096, "").unwrap().id;
            let mut next = 0u128;
            let put_next = |st: &mut Store, next: &mut u128| {
                put(st, 1, ns, Key(*next), now).expect("room while nothing is pinned");
                *next += 1;
            };
            for _ in 0..100 {
                put_next(&mut st, &mut next);
            }
            // Reuse some (to the main queue), put more (evicting), repeat.
            for _ in 0..1 + rnd(3) {
                let reused: Vec<Key> = (0..next).map(Key).filter(|_| rnd(4) != 0).collect();
                for _ in 0..1 + rnd(3) {
                    let (out, _) = st.pin(1, ns, &reused, 0, false, now).unwrap();
                    let refs: Vec<_> = out.iter().flatten().map(|p| p.slot).collect();
                    st.unpin(1, &refs).unwrap();
                }
                for _ in 0..rnd(12) {
                    put_next(&mut st, &mut next);
                }
            }
            // Another engine pins all cached blocks but a few.
            let cached: Vec<Key> = (0..next).map(Key).filter(|&k| st.lookup(ns, &[k]).unwrap().0[0]).collect();
            let spare = 1 + rnd(8) as usize;
            let pinned = &cached[..cached.len().saturating_sub(spare)];
            st.pin(2, ns, pinned, 0, false, now).unwrap();
            let got = st.allocate(3, ns, &[Key(1 << 64 | round)], 0, now);
            assert!(
                got.is_ok(),
                "round {round}: {} of {} cached blocks unpinned, yet: {:?}",
                cached.len() - pinned.len(),
                cached.len(),
                got.err()
            );
            st.check_invariants().unwrap();
        }
    }

    /// Clustered eviction passes over the blocks the coherence core keeps
    /// for readers (a grant whose store pin is not taken yet) as if they
    /// were pinned, and frees another block instead; with everything kept
    /// or pinned, an allocation is refused rather than freeing a kept slot.
    #[test]
    fn clustered_eviction_passes_over_blocks_the_core_keeps() {
        let mut st = store(4, "[eviction]\nhigh_watermark = 1.0\nlow_watermark = 1.0");
        st.set_coherent();
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let fp = st.namespace(ns).unwrap().fingerprint;
        let now = Instant::now();
        for (i, k) in (0..4u128).map(Key).enumerate() {
            let (out, _) = st.allocate_detached(1, ns, &[k], 0, detached(false), now).unwrap();
            let AllocOutcome::Allocated { slot, .. } = out[0] else { panic!("{out:?}") };
            assert!(st.begin_commit(1, &[slot]).unwrap()[0].is_some());
            assert!(st.commit_core(slot, i as u64 + 1, 7, false));
        }
        // Key 0 is the oldest: the first victim, unless the core keeps it.
        let slot0 = st.index[&IndexKey::new(ns, Key(0))];
        let keep0: Keep<'_> = &|r| (r.pool, r.slot) == slot0;
        st.allocate_detached(1, ns, &[Key(10)], 0, Detached { exists_check: false, keep: keep0 }, now).unwrap();
        let evicted: Vec<_> = st.take_evicted().into_iter().map(|(f, k, _)| (f, k)).collect();
        assert_eq!(evicted, vec![(fp, Key(1))], "the kept block was evicted");
        assert!(st.valid_slot(ns, Key(0)).is_some());
        // Everything kept: no slot, and nothing freed.
        let all: Keep<'_> = &|_| true;
        let got = st.allocate_detached(1, ns, &[Key(11)], 0, Detached { exists_check: false, keep: all }, now);
        assert!(matches!(got, Err(Error::ResourceExhausted(_))), "{got:?}");
        assert!(st.take_evicted().is_empty());
        assert!(st.valid_slot(ns, Key(0)).is_some() && st.valid_slot(ns, Key(2)).is_some());
        st.check_invariants().unwrap();
    }

    /// A slot's pin count never wraps: a pin of a slot pinned u32::MAX
    /// times is a miss.
    #[test]
    fn a_slot_pinned_u32_max_times_refuses_another_pin() {
        let mut st = store(4, "");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let now = Instant::now();
        let slot = put(&mut st, 1, ns, Key(1), now).unwrap();
        let (out, _) = st.pin(2, ns, &[Key(1)], 0, false, now).unwrap();
        assert!(out[0].is_some());
        // (As if u32::MAX - 1 other pins were held.)
        st.pools[0].slots[slot.slot as usize].pins = u32::MAX;
        let (out, _) = st.pin(2, ns, &[Key(1)], 0, false, now).unwrap();
        assert!(out[0].is_none(), "a pin past u32::MAX must miss");
        assert_eq!(st.pools[0].slots[slot.slot as usize].pins, u32::MAX);
        st.pools[0].slots[slot.slot as usize].pins = 1;
        st.release_session(2);
        st.check_invariants().unwrap();
    }

    #[test]
    fn all_pinned_pool_refuses_allocation_with_reason() {
        let mut st = store(4, "[eviction]\nhigh_watermark = 1.0\nlow_watermark = 1.0");
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let now = Instant::now();
        let keys: Vec<Key> = (0..4u128).map(Key).collect();
        for &k in &keys {
            put(&mut st, 1, ns, k, now).unwrap();
        }
        st.pin(1, ns, &keys, 0, false, now).unwrap();
        let e = st.allocate(1, ns, &[Key(9)], 0, now).unwrap_err();
        assert!(matches!(e, Error::ResourceExhausted(_)), "{e}");
        assert!(e.to_string().contains("4 pinned"), "{e}");
        st.check_invariants().unwrap();
        // Releasing the session makes room again.
        st.release_session(1);
        assert!(put(&mut st, 2, ns, Key(9), now).is_some());
        st.check_invariants().unwrap();
    }
}
