//! The data plane: one thread that owns the UCX worker (UCX workers are
//! single-threaded; the wrapper makes `Worker` `!Send`), endpoints and remote
//! keys of every peer, and the in-flight one-sided reads.
//!
//! The async side sends commands over a bounded crossbeam channel and wakes
//! the thread through an eventfd; results come back on oneshot channels.
//! The thread sleeps in `poll` on the worker's event fd and the eventfd, so
//! it costs nothing when idle and still progresses the reads that peers
//! make from this daemon's pool (on tcp and on shared memory with a pool the
//! process allocated itself, UCX emulates gets with active messages that the
//! target must progress).
//!
//! Limits: at most `inflight_requests_max` reads and `inflight_bytes_max`
//! bytes in flight (later batches wait in a queue); every batch has a
//! deadline. A read that times out is cancelled; if UCX cannot guarantee it
//! stopped writing (shared memory has no peer-failure mode in UCX 1.13), the
//! result says so and the caller quarantines the destination slot.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError, bounded};
use kvmesh_ffi_os::{EventFd, SharedMapping};
use kvmesh_ucx::{Context, Endpoint, MemoryRegion, RemoteKey, Request, Transports, Worker};
use tokio::sync::oneshot;

/// One read: `len` bytes at `remote_offset` of the peer's pool
/// `remote_pool` into our pool `local_pool` at `local_offset`.
#[derive(Clone, Copy, Debug)]
pub struct TransferItem {
    /// Peer pool index.
    pub remote_pool: u32,
    /// Offset in the peer's pool.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
    /// Local pool index.
    pub local_pool: u32,
    /// Offset in the local pool.
    pub local_offset: u64,
    /// Tag of a tag-matched transfer (send/receive modes).
    pub tag: u64,
}

/// How a batch moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One-sided reads from the peer's pool (remote fields used).
    Get,
    /// Tag-matched receives into our pool (the peer sends).
    Recv,
    /// Tag-matched sends from our pool to the peer (it receives).
    Send,
}

/// How one read ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferOutcome {
    /// The bytes are in the local slot (still to be validated).
    Done,
    /// It failed; UCX no longer touches the destination.
    Failed(String),
    /// It passed the deadline and UCX may still write the destination:
    /// never reuse that slot.
    TimedOut,
}

/// A peer pool as announced in its handshake.
#[derive(Clone, Debug)]
pub struct RemotePool {
    /// Pool index.
    pub index: u32,
    /// Base address in the peer's address space.
    pub base: u64,
    /// Packed remote key.
    pub rkey: Vec<u8>,
}

/// What the data plane needs to reach a peer.
#[derive(Clone, Debug)]
pub struct PeerAddr {
    /// Node id.
    pub id: u32,
    /// Incarnation of that node.
    pub incarnation: u64,
    /// UCX worker address.
    pub worker_address: Vec<u8>,
    /// Its pools.
    pub pools: Vec<RemotePool>,
}

enum Cmd {
    Connect { peer: PeerAddr, reply: oneshot::Sender<Result<String, String>> },
    Transfer(Pending),
    Cancel { id: u64 },
    Shutdown,
}

/// Limits of the data plane.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most reads in flight.
    pub inflight_requests_max: usize,
    /// Most bytes in flight.
    pub inflight_bytes_max: u64,
}

/// Our pools as peers must see them.
#[derive(Clone, Debug)]
pub struct LocalPool {
    /// Pool index.
    pub index: u32,
    /// Base address.
    pub base: u64,
    /// Packed remote key.
    pub rkey: Vec<u8>,
}

/// Handle of the data-plane thread.
pub struct DataPlane {
    next_id: std::sync::atomic::AtomicU64,
    tx: Sender<Cmd>,
    wake: Arc<EventFd>,
    worker_address: Vec<u8>,
    pools: Vec<LocalPool>,
    transports: Transports,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Queue depth of the command channel.
const COMMANDS_MAX: usize = 4096;

impl DataPlane {
    /// Starts the thread: creates the UCX context limited to `transports`,
    /// registers the pools and creates the worker.
    pub fn start(transports: Transports, pools: &[Arc<SharedMapping>], limits: Limits) -> Result<DataPlane, String> {
        let ctx = Context::new(&transports).map_err(|e| format!("UCX context ({}): {e}", transports.tls()))?;
        let mut regions = Vec::new();
        for (i, p) in pools.iter().enumerate() {
            regions.push(Arc::new(
                MemoryRegion::register(&ctx, Arc::clone(p)).map_err(|e| format!("register pool {i}: {e}"))?,
            ));
        }
        DataPlane::start_with(ctx, regions, transports, limits)
    }

    /// Starts the thread on pools already known to UCX (registered, or
    /// allocated by it), one region per pool in pool order.
    pub fn start_with(
        ctx: Arc<Context>,
        regions: Vec<Arc<MemoryRegion>>,
        transports: Transports,
        limits: Limits,
    ) -> Result<DataPlane, String> {
        let mut local = Vec::new();
        for (i, mr) in regions.iter().enumerate() {
            local.push(LocalPool {
                index: i as u32,
                base: mr.base(),
                rkey: mr.pack_rkey().map_err(|e| e.to_string())?,
            });
        }
        let wake = Arc::new(EventFd::new().map_err(|e| format!("eventfd: {e}"))?);
        let (tx, rx) = bounded::<Cmd>(COMMANDS_MAX);
        let (init_tx, init_rx) = std::sync::mpsc::channel();
        let thread_wake = Arc::clone(&wake);
        let peer_failure = !matches!(transports, Transports::SharedMemory);
        let thread = std::thread::Builder::new()
            .name("kvmesh-dataplane".into())
            .spawn(move || {
                let worker = match Worker::new(&ctx) {
                    Ok(w) => w,
                    Err(e) => {
                        let _ = init_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                match worker.address() {
                    Ok(a) => {
                        let _ = init_tx.send(Ok(a));
                    }
                    Err(e) => {
                        let _ = init_tx.send(Err(e.to_string()));
                        return;
                    }
                }
                run(&worker, &regions, rx, &thread_wake, limits, peer_failure);
            })
            .map_err(|e| format!("spawn data plane thread: {e}"))?;
        let worker_address = init_rx.recv().map_err(|_| "data plane thread died".to_string())??;
        Ok(DataPlane {
            next_id: std::sync::atomic::AtomicU64::new(1),
            tx,
            wake,
            worker_address,
            pools: local,
            transports,
            thread: Some(thread),
        })
    }

    /// Our worker address.
    pub fn worker_address(&self) -> &[u8] {
        &self.worker_address
    }

    /// Our pools' registrations.
    pub fn pools(&self) -> &[LocalPool] {
        &self.pools
    }

    /// The transports UCX may use.
    pub fn transports(&self) -> &Transports {
        &self.transports
    }

    fn send(&self, cmd: Cmd) -> Result<(), String> {
        match self.tx.try_send(cmd) {
            Ok(()) => {
                self.wake.notify();
                Ok(())
            }
            Err(TrySendError::Full(_)) => Err("data plane queue full".into()),
            Err(TrySendError::Disconnected(_)) => Err("data plane stopped".into()),
        }
    }

    /// Connects (or reconnects) to a peer; returns UCX's description of the
    /// chosen transports.
    pub async fn connect(&self, peer: PeerAddr) -> Result<String, String> {
        let (reply, rx) = oneshot::channel();
        self.send(Cmd::Connect { peer, reply })?;
        rx.await.map_err(|_| "data plane stopped".to_string())?
    }

    /// Reads `items` from `peer`; one `(index, outcome)` per item arrives
    /// on the returned channel as each read ends, all by `deadline`.
    pub fn transfer_stream(
        &self,
        mode: Mode,
        peer: u32,
        incarnation: u64,
        items: Vec<TransferItem>,
        deadline: Instant,
    ) -> (u64, tokio::sync::mpsc::UnboundedReceiver<(usize, TransferOutcome)>) {
        let n = items.len();
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (reply, rx) = tokio::sync::mpsc::unbounded_channel();
        let fallback = reply.clone();
        if let Err(e) = self.send(Cmd::Transfer(Pending { id, mode, peer, incarnation, items, deadline, reply })) {
            for i in 0..n {
                let _ = fallback.send((i, TransferOutcome::Failed(e.clone())));
            }
        }
        (id, rx)
    }

    /// Cancels what is still in flight of batch `id` (its outcomes follow).
    pub fn cancel(&self, id: u64) {
        let _ = self.send(Cmd::Cancel { id });
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        let _ = self.tx.try_send(Cmd::Shutdown);
        self.wake.notify();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where a batch's outcomes go, one `(item index, outcome)` as each read ends.
type Completions = tokio::sync::mpsc::UnboundedSender<(usize, TransferOutcome)>;

struct PeerConn<'w> {
    // Field order matters: remote keys are dropped before the endpoint.
    rkeys: HashMap<u32, (RemoteKey<'w>, u64)>,
    ep: Endpoint<'w>,
    incarnation: u64,
}

struct InFlight<'w> {
    id: u64,
    peer: u32,
    reqs: Vec<Option<Request<'w>>>,
    outcomes: Vec<Option<TransferOutcome>>,
    bytes: u64,
    deadline: Instant,
    reply: Completions,
}

impl InFlight<'_> {
    fn settle(&mut self, i: usize, o: TransferOutcome) {
        let _ = self.reply.send((i, o.clone()));
        self.outcomes[i] = Some(o);
    }
}

struct Pending {
    id: u64,
    mode: Mode,
    peer: u32,
    incarnation: u64,
    items: Vec<TransferItem>,
    deadline: Instant,
    reply: Completions,
}

fn run(
    worker: &Worker,
    regions: &[Arc<MemoryRegion>],
    rx: Receiver<Cmd>,
    wake: &EventFd,
    limits: Limits,
    peer_failure: bool,
) {
    let mut peers: HashMap<u32, PeerConn<'_>> = HashMap::new();
    let mut inflight: Vec<InFlight<'_>> = Vec::new();
    let mut queue: VecDeque<Pending> = VecDeque::new();
    let mut zombies: Vec<Request<'_>> = Vec::new();
    let (mut reqs_in_flight, mut bytes_in_flight) = (0usize, 0u64);
    let efd = match worker.event_fd() {
        Ok(fd) => fd,
        Err(e) => {
            tracing::error!("data plane: no UCX event fd ({e}); stopping");
            return;
        }
    };
    loop {
        // Commands.
        loop {
            match rx.try_recv() {
                Ok(Cmd::Shutdown) => return,
                Ok(Cmd::Connect { peer, reply }) => {
                    peers.remove(&peer.id);
                    let r = connect(worker, &peer, peer_failure).map(|conn| {
                        let d = conn.ep.describe();
                        peers.insert(peer.id, conn);
                        d
                    });
                    let _ = reply.send(r);
                }
                Ok(Cmd::Transfer(p)) => queue.push_back(p),
                Ok(Cmd::Cancel { id }) => {
                    for f in inflight.iter_mut().filter(|f| f.id == id) {
                        for r in f.reqs.iter_mut().flatten() {
                            r.cancel();
                        }
                    }
                    for p in queue.iter().filter(|p| p.id == id) {
                        for i in 0..p.items.len() {
                            let _ = p.reply.send((i, TransferOutcome::Failed("cancelled".into())));
                        }
                    }
                    queue.retain(|p| p.id != id);
                }
                Err(_) => break,
            }
        }
        // Start queued batches while under the limits (a batch larger than
        // the limits runs alone).
        while let Some(p) = queue.front() {
            let bytes: u64 = p.items.iter().map(|i| i.len).sum();
            let fits = (reqs_in_flight + p.items.len() <= limits.inflight_requests_max
                && bytes_in_flight + bytes <= limits.inflight_bytes_max)
                || reqs_in_flight == 0;
            if !fits {
                break;
            }
            let p = queue.pop_front().expect("front exists");
            let f = start(worker, &peers, regions, p, bytes);
            reqs_in_flight += f.reqs.iter().filter(|r| r.is_some()).count();
            bytes_in_flight += f.bytes;
            inflight.push(f);
        }
        while worker.progress() > 0 {}
        // Completions and deadlines.
        let now = Instant::now();
        let mut failed_peers = Vec::new();
        for f in inflight.iter_mut() {
            for (i, slot) in f.reqs.iter_mut().enumerate() {
                if let Some(r) = slot
                    && let Some(res) = r.poll()
                {
                    let o = match res {
                        Ok(()) => TransferOutcome::Done,
                        Err(e) => TransferOutcome::Failed(e.to_string()),
                    };
                    let _ = f.reply.send((i, o.clone()));
                    f.outcomes[i] = Some(o);
                    *slot = None;
                    reqs_in_flight -= 1;
                }
            }
            if now >= f.deadline && f.reqs.iter().any(|r| r.is_some()) {
                for r in f.reqs.iter_mut().flatten() {
                    r.cancel();
                }
                failed_peers.push(f.peer);
            }
        }
        // A peer that let a deadline pass is dropped (a forced close fails
        // its requests where UCX supports it); the peer manager reconnects.
        for id in failed_peers {
            if peer_failure {
                peers.remove(&id);
                while worker.progress() > 0 {}
            }
            for f in inflight.iter_mut().filter(|f| f.peer == id) {
                for i in 0..f.reqs.len() {
                    if let Some(mut r) = f.reqs[i].take() {
                        reqs_in_flight -= 1;
                        let o = match r.poll() {
                            Some(_) => TransferOutcome::Failed("peer timed out; connection closed".into()),
                            None => {
                                zombies.push(r);
                                TransferOutcome::TimedOut
                            }
                        };
                        f.settle(i, o);
                    }
                }
            }
        }
        inflight.retain_mut(|f| {
            if f.outcomes.iter().all(|o| o.is_some()) {
                bytes_in_flight -= f.bytes;
                false
            } else {
                true
            }
        });
        zombies.retain_mut(|r| r.poll().is_none());
        // While reads are in flight, keep progressing: emulated gets move a
        // fragment per round trip, and sleeping between fragments would
        // cost a wakeup each. Sleep only when idle.
        if !rx.is_empty() || (!queue.is_empty() && reqs_in_flight == 0) || reqs_in_flight > 0 {
            continue;
        }
        match worker.arm() {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::warn!("data plane: arm failed: {e}");
            }
        }
        let timeout_ms: u16 = if inflight.is_empty() && zombies.is_empty() { 100 } else { 1 };
        // (reached only with nothing in flight; zombies are polled each ms)
        let _ = kvmesh_ffi_os::with_raw_fd(efd, |fd| kvmesh_ffi_os::poll_readable(&[fd, wake.fd()], timeout_ms));
        wake.drain();
    }
}

fn connect<'w>(worker: &'w Worker, peer: &PeerAddr, peer_failure: bool) -> Result<PeerConn<'w>, String> {
    let ep = worker.connect(&peer.worker_address, peer_failure).map_err(|e| e.to_string())?;
    let mut rkeys = HashMap::new();
    for p in &peer.pools {
        let rk = ep.unpack_rkey(&p.rkey).map_err(|e| format!("pool {}: {e}", p.index))?;
        rkeys.insert(p.index, (rk, p.base));
    }
    Ok(PeerConn { rkeys, ep, incarnation: peer.incarnation })
}

fn start<'w>(
    worker: &'w Worker,
    peers: &HashMap<u32, PeerConn<'w>>,
    regions: &[Arc<MemoryRegion>],
    p: Pending,
    bytes: u64,
) -> InFlight<'w> {
    let n = p.items.len();
    let mut f = InFlight {
        id: p.id,
        peer: p.peer,
        reqs: (0..n).map(|_| None).collect(),
        outcomes: vec![None; n],
        bytes,
        deadline: p.deadline,
        reply: p.reply,
    };
    if p.mode == Mode::Recv {
        for (i, it) in p.items.iter().enumerate() {
            let Some(dst) = regions.get(it.local_pool as usize) else {
                f.settle(i, TransferOutcome::Failed(format!("no local pool {}", it.local_pool)));
                continue;
            };
            match worker.tag_recv(dst, it.local_offset as usize, it.len as usize, it.tag) {
                Ok(r) => f.reqs[i] = Some(r),
                Err(e) => f.settle(i, TransferOutcome::Failed(e.to_string())),
            }
        }
        return f;
    }
    let Some(conn) = peers.get(&p.peer).filter(|c| c.incarnation == p.incarnation) else {
        for i in 0..n {
            f.settle(
                i,
                TransferOutcome::Failed(format!("peer {} (incarnation {}) not connected", p.peer, p.incarnation)),
            );
        }
        return f;
    };
    if p.mode == Mode::Send {
        for (i, it) in p.items.iter().enumerate() {
            let Some(src) = regions.get(it.local_pool as usize) else {
                f.settle(i, TransferOutcome::Failed(format!("no local pool {}", it.local_pool)));
                continue;
            };
            match conn.ep.tag_send(src, it.local_offset as usize, it.len as usize, it.tag) {
                Ok(r) => f.reqs[i] = Some(r),
                Err(e) => f.settle(i, TransferOutcome::Failed(e.to_string())),
            }
        }
        return f;
    }
    for (i, it) in p.items.iter().enumerate() {
        let Some((rkey, base)) = conn.rkeys.get(&it.remote_pool) else {
            f.settle(i, TransferOutcome::Failed(format!("peer has no pool {}", it.remote_pool)));
            continue;
        };
        let Some(dst) = regions.get(it.local_pool as usize) else {
            f.settle(i, TransferOutcome::Failed(format!("no local pool {}", it.local_pool)));
            continue;
        };
        match conn.ep.get(dst, it.local_offset as usize, it.len as usize, base + it.remote_offset, rkey) {
            Ok(r) => f.reqs[i] = Some(r),
            Err(e) => f.settle(i, TransferOutcome::Failed(e.to_string())),
        }
    }
    f
}

/// How long to wait for a peer's handshake or query answer.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(2);
