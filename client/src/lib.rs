//! Client library for inference engines.
//!
//! A [`Client`] connects to the local `kvmeshd` over its Unix socket,
//! receives the pools' memfds once and maps them. Blocks are then read in
//! place: [`Client::pin`] returns [`PinnedBlock`] guards that deref to the
//! block's bytes inside the daemon's pool (no copy) and unpin when dropped.
//! Puts are written in place too: [`Client::allocate`] hands out
//! [`WritableBlock`]s to fill, [`Client::commit`] makes them visible.
//! Engines that want the bytes in their own buffer use [`Client::get_into`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvmesh_client::ClientError> {
//! use kvmesh_client::{Client, Key};
//! let client = Client::connect_default().await?;
//! let ns = client.register_namespace("llama3-8b/bf16/tp1", 4096, "demo-layout").await?;
//! let key = Key(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
//! client.put(&ns, &[(key, &[7u8; 4096][..])]).await?;
//! let blocks = client.pin(&ns, &[key]).await?;
//! let block = blocks[0].as_ref().expect("cached");
//! assert_eq!(block[0], 7); // reads the daemon's pool in place
//! # Ok(()) }
//! ```
//!
//! **Leases.** Every pin carries a lease (30 s by default). Read a pinned
//! block within its lease ([`PinnedBlock::lease_remaining`]); after it the
//! daemon may reuse the slot. Dropping the client, or the process dying,
//! releases all its pins and uncommitted allocations at once.
#![forbid(unsafe_code)]
#![recursion_limit = "256"]

use std::ops::{Deref, DerefMut};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvmesh_common::handshake::FD_HANDSHAKE_MAGIC;
use kvmesh_common::handshake::PoolKind;
use kvmesh_common::slot::{
    HEADER_BYTES, SlotMeta, SlotState, TRAILER_BYTES, trailer_offset, validate_meta, validate_slot,
};
pub use kvmesh_common::{Key, ValidationError};
use kvmesh_ffi_os::{ReadRegion, SharedMapping, ShmError, WriteRegion};
pub use kvmesh_kernels::cuda::GpuError;
use kvmesh_kernels::cuda::{DeviceRange, Gpu, GpuPool};
use kvmesh_proto::engine::v1 as pb;
/// Coherence figures of a clustered daemon (`Stats::coherence`).
pub use kvmesh_proto::engine::v1::CoherenceStats;
pub use kvmesh_proto::engine::v1::StatsResponse as Stats;
pub use kvmesh_proto::engine::v1::{KvEvent, KvEventBatch, KvEventKind};

/// The name of a KV event kind as tools print it: "stored", "removed",
/// "evicted", "invalidated", "snapshot" (or "kind-N" for a number this
/// library does not know).
pub fn event_kind_name(kind: i32) -> String {
    KvEventKind::try_from(kind)
        .map(|k| k.as_str_name().trim_start_matches("KV_EVENT_KIND_").to_lowercase())
        .unwrap_or_else(|_| format!("kind-{kind}"))
}
use pb::engine_client::EngineClient;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::{Channel, Endpoint};

pub use kvmesh_ffi_os::default_socket_path;

pub mod blocking;
mod fast;
mod stats_json;
pub use stats_json::{pool_json, stats_json};

/// Errors of the client library.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon's socket could not be reached.
    #[error("cannot connect to kvmeshd at {path}: {source}")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The fd handshake failed or disagreed with the daemon's `Hello`.
    #[error("handshake with kvmeshd at {path} failed: {reason}")]
    Handshake {
        /// Socket path.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The daemon answered with an error status.
    #[error("{}", .0.message())]
    Rpc(#[from] tonic::Status),
    /// The request is invalid before it is sent.
    #[error("{0}")]
    InvalidArgument(String),
    /// The daemon answered something the client cannot use.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Mapping or claiming pool memory failed.
    #[error("pool memory: {0}")]
    Shm(#[from] ShmError),
    /// A lease (of a pin or an allocation) passed before the operation
    /// finished; nothing read under it can be trusted. Retry.
    #[error("lease expired: {0}")]
    LeaseExpired(String),
    /// GPU memory could not be used: no CUDA driver or device in this
    /// process, a failed import of a GPU pool, a failed device copy.
    #[error("GPU: {0}")]
    Gpu(#[from] GpuError),
}

impl ClientError {
    /// The gRPC code of the error (`Unavailable` for connection problems).
    pub fn code(&self) -> tonic::Code {
        match self {
            ClientError::Rpc(s) => s.code(),
            ClientError::Connect { .. } | ClientError::Handshake { .. } => tonic::Code::Unavailable,
            ClientError::InvalidArgument(_) => tonic::Code::InvalidArgument,
            ClientError::Protocol(_) | ClientError::Shm(_) => tonic::Code::Internal,
            ClientError::LeaseExpired(_) => tonic::Code::DeadlineExceeded,
            ClientError::Gpu(_) => tonic::Code::FailedPrecondition,
        }
    }
}

/// What kind of failure a [`ClientError`] is, for callers that map errors
/// to codes or exception classes (the C ABI, the Python package).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A bad argument, or one the daemon rejects (wrong block size for a
    /// registered namespace, a batch too large).
    InvalidArgument,
    /// An unknown namespace.
    NotFound,
    /// The pool is full of pinned or pending blocks, or a session limit
    /// was reached.
    ResourceExhausted,
    /// A lease ended before the operation finished.
    LeaseExpired,
    /// The daemon or the cluster refused (write in progress, not serving,
    /// timeout).
    Refused,
    /// The daemon cannot be reached or the connection broke.
    Unavailable,
    /// A bug or an unexpected answer.
    Internal,
    /// GPU memory cannot be used here (no CUDA driver, device or NVRTC),
    /// or a device operation failed.
    NoDevice,
}

impl ClientError {
    /// The kind of this error.
    pub fn kind(&self) -> ErrorKind {
        use tonic::Code;
        match self {
            ClientError::Connect { .. } | ClientError::Handshake { .. } => ErrorKind::Unavailable,
            ClientError::InvalidArgument(_) => ErrorKind::InvalidArgument,
            ClientError::LeaseExpired(_) => ErrorKind::LeaseExpired,
            ClientError::Protocol(_) | ClientError::Shm(_) => ErrorKind::Internal,
            ClientError::Gpu(_) => ErrorKind::NoDevice,
            ClientError::Rpc(s) => match s.code() {
                Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => ErrorKind::InvalidArgument,
                Code::NotFound => ErrorKind::NotFound,
                Code::ResourceExhausted => ErrorKind::ResourceExhausted,
                Code::Aborted | Code::AlreadyExists | Code::PermissionDenied | Code::DeadlineExceeded => {
                    ErrorKind::Refused
                }
                Code::Unavailable | Code::Cancelled | Code::Unknown | Code::Unauthenticated => ErrorKind::Unavailable,
                _ => ErrorKind::Internal,
            },
        }
    }
}

type Result<T> = std::result::Result<T, ClientError>;

/// A registered namespace (see [`Client::register_namespace`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Namespace {
    /// Handle used in requests.
    pub id: u32,
    /// Name.
    pub name: String,
    /// Size of every block.
    pub block_bytes: u64,
    /// Layout fingerprint string.
    pub layout: String,
    /// Pool that holds its blocks.
    pub pool: u32,
    /// Fingerprint written into slot headers.
    pub fingerprint: u64,
}

impl From<pb::NamespaceInfo> for Namespace {
    fn from(n: pb::NamespaceInfo) -> Self {
        Namespace {
            id: n.id,
            name: n.name,
            block_bytes: n.block_bytes,
            layout: n.layout,
            pool: n.pool,
            fingerprint: n.fingerprint,
        }
    }
}

/// A slot reference as the daemon names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotRef {
    /// Pool index.
    pub pool: u32,
    /// Slot index.
    pub slot: u32,
    /// Slot generation.
    pub generation: u64,
}

impl From<SlotRef> for pb::SlotRef {
    fn from(r: SlotRef) -> Self {
        pb::SlotRef { pool: r.pool, slot: r.slot, generation: r.generation }
    }
}

enum Release {
    /// Unpins are waiting in `Releases::unpins`.
    Wake,
    Abort(SlotRef),
    Flush(oneshot::Sender<()>),
}

/// How long dropped pins wait for the next `pin` call to carry their
/// release before the background task sends an `Unpin` of its own.
const UNPIN_PIGGYBACK_WAIT: Duration = Duration::from_millis(1);

/// Releases queued by dropped guards. Unpins ride on the next `Pin` request
/// when one comes soon, else the background task sends them.
struct Releases {
    unpins: std::sync::Mutex<Vec<pb::SlotRef>>,
    tx: mpsc::UnboundedSender<Release>,
    /// What must live as long as any guard (the blocking client's runtime:
    /// it runs the connection, whose end would end the session and every
    /// pin with it while a guard still reads its slot). Guards hold this
    /// struct; the release task holds it only weakly (no cycle).
    keep: std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
}

impl Releases {
    fn unpin(&self, r: SlotRef) {
        let mut q = self.unpins.lock().unwrap_or_else(|e| e.into_inner());
        q.push(r.into());
        if q.len() == 1 {
            let _ = self.tx.send(Release::Wake);
        }
    }
    fn abort(&self, r: SlotRef) {
        let _ = self.tx.send(Release::Abort(r));
    }
    fn take_unpins(&self) -> Vec<pb::SlotRef> {
        std::mem::take(&mut *self.unpins.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Slots taken from their guards (or from the release queue) and not yet
/// sent to the daemon. Dropped — the call that was to send them was
/// cancelled, or failed before them — they go back to the release queue.
/// A slot is taken out (`send`) right before the request naming it starts,
/// and never put back after: a request that may have been sent is not
/// repeated (a second unpin would release another guard's pin of the same
/// slot).
struct Unsent<'a> {
    releases: &'a Releases,
    /// Unpins.
    slots: Vec<pb::SlotRef>,
}

impl Unsent<'_> {
    /// The first `n` slots, to be sent now.
    fn send(&mut self, n: usize) -> Vec<pb::SlotRef> {
        let n = n.min(self.slots.len());
        self.slots.drain(..n).collect()
    }
}

impl Drop for Unsent<'_> {
    fn drop(&mut self) {
        if self.slots.is_empty() {
            return;
        }
        let mut q = self.releases.unpins.lock().unwrap_or_else(|e| e.into_inner());
        let was_empty = q.is_empty();
        q.append(&mut self.slots);
        if was_empty {
            let _ = self.releases.tx.send(Release::Wake);
        }
    }
}

/// A GPU pool of the daemon, imported into this process.
struct ImportedGpu {
    gpu: Arc<Gpu>,
    pool: GpuPool,
}

/// How this process reaches a pool.
#[derive(Clone)]
enum PoolMem {
    Host(Arc<SharedMapping>),
    Cuda(Arc<ImportedGpu>),
    /// A GPU pool this process could not import (no driver here, say):
    /// namespaces in it fail with this error; the other pools work.
    Unavailable(GpuError),
}

struct PoolMap {
    mem: PoolMem,
    info: pb::PoolInfo,
}

/// A block in GPU memory, as this process sees it: `len` bytes at device
/// address `ptr` of CUDA device `device`, valid while the guard it came
/// from lives (and within its lease).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBlock {
    /// CUDA device ordinal.
    pub device: u32,
    /// Device address in this process.
    pub ptr: u64,
    /// Bytes of the block.
    pub len: u64,
}

/// Where a guard's bytes are.
enum Bytes<R> {
    Host(R),
    Device(Arc<ImportedGpu>, DeviceRange),
}

impl<R: Deref<Target = [u8]>> Bytes<R> {
    fn len(&self) -> usize {
        match self {
            Bytes::Host(r) => r.len(),
            Bytes::Device(_, r) => r.len(),
        }
    }
}

impl<R> Bytes<R> {
    fn device(&self) -> Option<DeviceBlock> {
        match self {
            Bytes::Host(_) => None,
            Bytes::Device(g, r) => {
                Some(DeviceBlock { device: g.gpu.ordinal() as u32, ptr: r.ptr(), len: r.len() as u64 })
            }
        }
    }
}

struct Inner {
    rpc: EngineClient<Channel>,
    /// The fast path for lookup, pin and unpin, when the daemon offers it.
    fast: Option<Arc<fast::Fast>>,
    pools: Vec<PoolMap>,
    hello: pb::HelloResponse,
    releases: Arc<Releases>,
    path: PathBuf,
}

/// A connection to the local kvmeshd. Cheap to clone; all clones share the
/// connection (one session: pins die with it).
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

/// Presence of keys in the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LookupResult {
    /// One entry per key.
    pub present: Vec<bool>,
    /// Number of leading keys that are all present.
    pub prefix_len: u32,
    /// One entry per key: the node (`[node] id`) holding it where present
    /// (`None` where absent, or from a daemon too old to say).
    pub nodes: Vec<Option<u32>>,
    /// The answer covers the cluster (a clustered daemon asked the keys'
    /// homes); false: the daemon's own copies only. A key reported present
    /// was Valid on its node during the call (unless that node had just
    /// dropped it); a later pin may still miss.
    pub cluster_wide: bool,
    /// Every home asked answered (cluster-wide answers only).
    pub complete: bool,
}

/// Options of a pin.
#[derive(Clone, Copy, Debug, Default)]
pub struct PinOptions {
    /// Lease in milliseconds; 0 is the daemon's default.
    pub lease_ms: u64,
    /// Stop at the first miss (prefix fetch).
    pub stop_at_first_miss: bool,
}

/// A pinned block, read in place. In a host pool it derefs to the block's
/// bytes; in a GPU pool the bytes are on the device: [`PinnedBlock::device`]
/// gives their address ([`PinnedBlock::copy_to`] copies them to host
/// memory), and dereferencing panics. Unpins when dropped.
pub struct PinnedBlock {
    bytes: Bytes<ReadRegion>,
    key: Key,
    slot: SlotRef,
    version: u64,
    checksum: u64,
    fingerprint: u64,
    lease_deadline_unix_ms: u64,
    pool: PoolMem,
    stride: u64,
    payload_capacity: u64,
    release: Option<Arc<Releases>>,
}

impl PinnedBlock {
    /// The block's key.
    pub fn key(&self) -> Key {
        self.key
    }
    /// The block's version.
    pub fn version(&self) -> u64 {
        self.version
    }
    /// The payload checksum recorded at commit: xxh3-64 in a host pool,
    /// `kvsum64` in a GPU pool.
    pub fn checksum(&self) -> u64 {
        self.checksum
    }
    /// The pinned slot.
    pub fn slot(&self) -> SlotRef {
        self.slot
    }
    /// Bytes of the block.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }
    /// Whether the block is empty (never: blocks have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the block is when it is in a GPU pool (`None`: host memory,
    /// read it through `Deref`).
    pub fn device(&self) -> Option<DeviceBlock> {
        self.bytes.device()
    }
    /// Copies the block into `dst` (exactly [`PinnedBlock::len`] bytes),
    /// from host or device memory.
    pub fn copy_to(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() != self.len() {
            return Err(ClientError::InvalidArgument(format!(
                "destination is {} bytes, block {}",
                dst.len(),
                self.len()
            )));
        }
        match &self.bytes {
            Bytes::Host(r) => dst.copy_from_slice(r),
            Bytes::Device(g, r) => g.gpu.copy_to_host(dst, *r)?,
        }
        Ok(())
    }
    /// Time left on the pin's lease (zero once it has passed).
    pub fn lease_remaining(&self) -> Duration {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(u64::MAX);
        Duration::from_millis(self.lease_deadline_unix_ms.saturating_sub(now))
    }
    /// Re-reads the whole slot (header, payload, trailer) and checks that it
    /// still holds this block with a matching checksum. In a GPU pool the
    /// payload is checksummed on the device (`kvsum64`); only header and
    /// trailer are copied to the host.
    pub fn verify(&self) -> std::result::Result<(), ValidationError> {
        let base = self.slot.slot as u64 * self.stride;
        let expected = SlotMeta {
            state: SlotState::Valid,
            namespace: self.fingerprint,
            key: self.key,
            version: self.version,
            generation: self.slot.generation,
            payload_len: self.len() as u64,
            checksum: self.checksum,
        };
        match &self.pool {
            PoolMem::Host(map) => {
                let whole = map.read(base, self.stride).map_err(|e| ValidationError::Unreadable(e.to_string()))?;
                validate_slot(&whole, self.payload_capacity, &expected).map(|_| ())
            }
            PoolMem::Cuda(g) => {
                let unreadable = |e: GpuError| ValidationError::Unreadable(e.to_string());
                let range = g.pool.range();
                let (mut h, mut t) = ([0u8; HEADER_BYTES], [0u8; TRAILER_BYTES]);
                g.gpu
                    .copy_to_host(&mut h, range.sub(base as usize, HEADER_BYTES).map_err(unreadable)?)
                    .map_err(unreadable)?;
                let at = (base + trailer_offset(self.payload_capacity)) as usize;
                g.gpu.copy_to_host(&mut t, range.sub(at, TRAILER_BYTES).map_err(unreadable)?).map_err(unreadable)?;
                let meta = validate_meta(&h, &t, self.payload_capacity, &expected)?;
                let payload = range.sub(base as usize + HEADER_BYTES, meta.payload_len as usize).map_err(unreadable)?;
                let found = g.gpu.kvsum64(payload).map_err(unreadable)?;
                if found != meta.checksum {
                    return Err(ValidationError::Checksum { expected: meta.checksum, found });
                }
                Ok(())
            }
            PoolMem::Unavailable(e) => Err(ValidationError::Unreadable(e.to_string())),
        }
    }
}

impl Deref for PinnedBlock {
    type Target = [u8];
    /// The block's bytes in a host pool. **Panics** for a block in a GPU
    /// pool (its bytes are not host memory): check [`PinnedBlock::device`].
    fn deref(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Host(r) => r,
            Bytes::Device(g, _) => {
                panic!("block is in GPU memory (cuda:{}): use PinnedBlock::device() or copy_to()", g.gpu.ordinal())
            }
        }
    }
}

impl Drop for PinnedBlock {
    fn drop(&mut self) {
        if let Some(r) = self.release.take() {
            r.unpin(self.slot);
        }
    }
}

/// A slot allocated for a put: write the block into it (in a host pool it
/// derefs mutably to the slot's payload; in a GPU pool use
/// [`WritableBlock::device`] or [`WritableBlock::write`]), then
/// [`Client::commit`] it. Dropped without commit, the allocation is
/// aborted.
pub struct WritableBlock {
    bytes: Bytes<WriteRegion>,
    key: Key,
    slot: SlotRef,
    release: Option<Arc<Releases>>,
}

impl WritableBlock {
    /// The key being put.
    pub fn key(&self) -> Key {
        self.key
    }
    /// The allocated slot.
    pub fn slot(&self) -> SlotRef {
        self.slot
    }
    /// Bytes of the block.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }
    /// Whether the block is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where to write the block when the slot is in a GPU pool (`None`:
    /// host memory, write it through `DerefMut`).
    pub fn device(&self) -> Option<DeviceBlock> {
        self.bytes.device()
    }
    /// Writes the whole block from host memory (`src` is exactly
    /// [`WritableBlock::len`] bytes), into host or device memory.
    pub fn write(&mut self, src: &[u8]) -> Result<()> {
        if src.len() != self.len() {
            return Err(ClientError::InvalidArgument(format!("block is {} bytes, slot {}", src.len(), self.len())));
        }
        match &mut self.bytes {
            Bytes::Host(r) => r.copy_from_slice(src),
            Bytes::Device(g, r) => g.gpu.copy_to_device(*r, src)?,
        }
        Ok(())
    }
}

impl Deref for WritableBlock {
    type Target = [u8];
    /// The slot's payload in a host pool. **Panics** for a GPU pool.
    fn deref(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Host(r) => r,
            Bytes::Device(g, _) => {
                panic!("slot is in GPU memory (cuda:{}): use WritableBlock::device()", g.gpu.ordinal())
            }
        }
    }
}

impl DerefMut for WritableBlock {
    /// The slot's payload in a host pool. **Panics** for a GPU pool.
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.bytes {
            Bytes::Host(r) => r,
            Bytes::Device(g, _) => {
                panic!("slot is in GPU memory (cuda:{}): use WritableBlock::device()", g.gpu.ordinal())
            }
        }
    }
}

impl Drop for WritableBlock {
    fn drop(&mut self) {
        if let Some(r) = self.release.take() {
            r.abort(self.slot);
        }
    }
}

/// Outcome of an allocation for one key.
pub enum Allocation {
    /// Write the block here, then commit.
    Allocated(WritableBlock),
    /// The key is already cached.
    Exists,
    /// Another put of the key is in progress.
    InProgress,
}

/// Outcome of a commit for one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommitOutcome {
    /// Stored; the checksum the daemon computed and the version the block is
    /// visible at.
    Committed {
        /// xxh3-64 of the payload.
        checksum: u64,
        /// Version assigned (by the key's home daemon in a cluster).
        version: u64,
    },
    /// The allocation had expired or was unknown: not stored.
    Lost,
    /// The cluster refused to publish it (another write or invalidation of
    /// the key in progress, daemon not a serving member, timeout): not
    /// stored. The reason, for logs.
    Refused(String),
}

/// Summary of [`Client::invalidate`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InvalidateSummary {
    /// Keys no daemon serves the old version of any more.
    pub invalidated: u64,
    /// Keys whose invalidation did not complete before the deadline.
    pub failed: u64,
    /// The first failure.
    pub first_error: String,
}

/// Summary of [`Client::put`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PutSummary {
    /// Blocks written and committed.
    pub stored: u32,
    /// Keys already cached (nothing written).
    pub existed: u32,
    /// Keys being put by someone else (nothing written).
    pub in_progress: u32,
    /// Allocations lost before commit (lease expired).
    pub lost: u32,
    /// Blocks the cluster refused to publish (see `CommitOutcome::Refused`).
    pub refused: u32,
    /// Why the first refused block was refused.
    pub first_refusal: Option<String>,
}

/// How a pool reaches the client: a memfd to map, a SysV segment id to
/// attach, or a CUDA allocation's fd to import on a device.
enum PoolHandle {
    Memfd(std::os::fd::OwnedFd),
    SysV(i32),
    Cuda(std::os::fd::OwnedFd, u32),
}

fn handshake(path: &Path) -> std::result::Result<(u64, Vec<(pb::PoolInfo, PoolHandle)>), String> {
    use std::io::Write;
    let mut s = std::os::unix::net::UnixStream::connect(path).map_err(|e| format!("connect: {e}"))?;
    const WAIT: Duration = Duration::from_secs(10);
    s.set_read_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    s.write_all(FD_HANDSHAKE_MAGIC).map_err(|e| format!("send: {e}"))?;
    let mut buf = [0u8; 1024];
    let (n, fds) = kvmesh_ffi_os::fdpass::recv_fds(s.as_fd(), &mut buf, kvmesh_common::handshake::POOLS_MAX).map_err(
        |e| match e.kind() {
            // (What a read timeout reads as.)
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                format!("the daemon sent no pool table within {} s (overloaded or wedged?)", WAIT.as_secs())
            }
            _ => format!("receive pool fds: {e}"),
        },
    )?;
    let (instance, table) = kvmesh_common::handshake::decode(&buf[..n], fds.len())?;
    let mut fds = fds.into_iter();
    Ok((
        instance,
        table
            .into_iter()
            .map(|t| {
                let h = match t.kind {
                    PoolKind::SysV(id) => PoolHandle::SysV(id),
                    PoolKind::Memfd => PoolHandle::Memfd(fds.next().expect("decode checked the fd count")),
                    PoolKind::Cuda(d) => PoolHandle::Cuda(fds.next().expect("decode checked the fd count"), d),
                };
                (pb::PoolInfo { index: t.pool, bytes: t.bytes, ..Default::default() }, h)
            })
            .collect(),
    ))
}

/// Imports a GPU pool of the daemon on `device` (CUDA IPC through the
/// allocation's fd: this process then reads and writes the same memory).
/// The device is found by its UUID (the daemon's ordinal `device` is used
/// only when the daemon sent none): ordinals differ between processes with
/// different `CUDA_VISIBLE_DEVICES`.
/// `m`, kept out of processes forked from this one
/// ([`SharedMapping::keep_from_children`]).
fn kept_from_children(m: SharedMapping) -> std::result::Result<SharedMapping, ShmError> {
    m.keep_from_children()?;
    Ok(m)
}

fn import_gpu_pool(
    fd: &std::os::fd::OwnedFd,
    device: u32,
    uuid: &[u8],
    bytes: u64,
) -> std::result::Result<ImportedGpu, GpuError> {
    let ordinal = match <[u8; 16]>::try_from(uuid) {
        Ok(u) => kvmesh_kernels::cuda::ordinal_of(&u)?.ok_or_else(|| {
            GpuError::Invalid(format!(
                "the pool's GPU (uuid {}) is not visible in this process (CUDA_VISIBLE_DEVICES?)",
                u.iter().map(|b| format!("{b:02x}")).collect::<String>()
            ))
        })?,
        Err(_) => device as usize,
    };
    let gpu = kvmesh_kernels::raw::gpu(ordinal)?;
    let pool = gpu.import_pool(fd, bytes as usize)?;
    // Cross-card reuse: every other GPU of this process that can reach the
    // pool's GPU peer-to-peer may read it in place too.
    for d in (0..kvmesh_kernels::cuda::device_count()?).filter(|&d| d != ordinal) {
        if kvmesh_kernels::cuda::can_access(d, ordinal).unwrap_or(false)
            && let Err(e) = pool.grant(d)
        {
            tracing::warn!(device = d, "no peer access to the GPU pool on device {ordinal}: {e}");
        }
    }
    Ok(ImportedGpu { gpu, pool })
}

impl Client {
    /// Connects to the daemon at the default socket path.
    pub async fn connect_default() -> Result<Client> {
        Client::connect(default_socket_path()).await
    }

    /// Connects to the daemon at `path`, receives and maps its pools.
    /// Lookups, pins and unpins use the fast path when the daemon offers it
    /// (unless `KVMESH_FAST_PATH=off`), and so do allocations, commits and
    /// aborts where its `Hello` says `fast_path_writes`.
    pub async fn connect(path: impl AsRef<Path>) -> Result<Client> {
        Client::connect_with(path, !fast::disabled()).await
    }

    /// As [`Client::connect`]; `fast_path = false` sends every call over
    /// gRPC (for comparisons, or a daemon that should see one connection).
    pub async fn connect_with(path: impl AsRef<Path>, fast_path: bool) -> Result<Client> {
        Client::connect_mode(path, fast_path.then_some(fast::Mode::Tasks)).await
    }

    /// As [`Client::connect_with`], with the fast path's way of waiting for
    /// answers (`None`: no fast path).
    pub(crate) async fn connect_mode(path: impl AsRef<Path>, fast_mode: Option<fast::Mode>) -> Result<Client> {
        let path = path.as_ref().to_path_buf();
        if !path.exists() {
            return Err(ClientError::Connect {
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no socket (is kvmeshd running? it creates the socket once it is ready to answer)",
                ),
            });
        }
        let hs_path = path.clone();
        let (instance, fds) = tokio::task::spawn_blocking(move || handshake(&hs_path))
            .await
            .map_err(|e| ClientError::Protocol(format!("handshake task: {e}")))?
            .map_err(|reason| ClientError::Handshake { path: path.clone(), reason })?;

        // One connection per client: a reconnect would reach a daemon whose
        // pools this client has not mapped, so it is refused.
        let connects = Arc::new(AtomicU32::new(0));
        let conn_path = path.clone();
        let channel = Endpoint::from_static("http://kvmeshd.local")
            .connect_timeout(Duration::from_secs(10))
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let p = conn_path.clone();
                let n = connects.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n > 0 {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::ConnectionAborted,
                            "connection to kvmeshd was lost; create a new client",
                        ));
                    }
                    let s = tokio::net::UnixStream::connect(p).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                }
            }))
            .await
            .map_err(|e| ClientError::Connect { path: path.clone(), source: std::io::Error::other(e) })?;
        let mut rpc =
            EngineClient::new(channel).max_decoding_message_size(16 << 20).max_encoding_message_size(16 << 20);
        let hello = rpc.hello(pb::HelloRequest {}).await?.into_inner();
        let bad = |reason: String| ClientError::Handshake { path: path.clone(), reason };
        if hello.instance_id != instance {
            return Err(bad("the daemon restarted during the handshake; retry".into()));
        }
        if hello.layout_version != kvmesh_common::LAYOUT_VERSION {
            return Err(bad(format!(
                "daemon speaks slot layout {}, this client {}",
                hello.layout_version,
                kvmesh_common::LAYOUT_VERSION
            )));
        }
        let mut pools = Vec::new();
        for (info, fd) in fds {
            let Some(full) = hello.pools.iter().find(|p| p.index == info.index) else {
                return Err(bad(format!("fd for pool {} that Hello does not describe", info.index)));
            };
            if full.bytes != info.bytes || full.index as usize != pools.len() {
                return Err(bad(format!("pool {} described inconsistently", info.index)));
            }
            let mem = match fd {
                // Kept out of forked children: the daemon watches this
                // process (fences, pins), not its children.
                PoolHandle::Memfd(fd) => {
                    PoolMem::Host(Arc::new(kept_from_children(SharedMapping::map(fd, info.bytes)?)?))
                }
                PoolHandle::SysV(id) => {
                    PoolMem::Host(Arc::new(kept_from_children(SharedMapping::attach_sysv(id, info.bytes)?)?))
                }
                PoolHandle::Cuda(fd, device) => match import_gpu_pool(&fd, device, &full.device_uuid, info.bytes) {
                    Ok(g) => PoolMem::Cuda(Arc::new(g)),
                    Err(e) => {
                        tracing::warn!(pool = %full.name, device, "GPU pool not usable in this process: {e}");
                        PoolMem::Unavailable(e)
                    }
                },
            };
            pools.push(PoolMap { mem, info: full.clone() });
        }
        let fast = match fast_mode {
            Some(mode) => fast::Fast::open(&path, hello.instance_id, mode).await.map(Arc::new),
            None => None,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let releases =
            Arc::new(Releases { unpins: std::sync::Mutex::new(Vec::new()), tx, keep: std::sync::OnceLock::new() });
        tokio::spawn(release_loop(
            Calls { rpc: rpc.clone(), fast: fast.clone(), writes: hello.fast_path_writes },
            rx,
            Arc::downgrade(&releases),
            hello.batch_keys_max.max(1) as usize,
        ));
        Ok(Client { inner: Arc::new(Inner { rpc, fast, pools, hello, releases, path }) })
    }

    /// Refuses guards this client did not make: their slots name another
    /// session (or, after a daemon restart, someone else's slot of the same
    /// number and generation), which this session would release or commit
    /// in their owner's stead. The guards go back untouched (their own
    /// client releases them when they drop).
    fn check_own<'a>(&self, releases: impl Iterator<Item = &'a Option<Arc<Releases>>>) -> Result<()> {
        for r in releases {
            if !r.as_ref().is_some_and(|r| Arc::ptr_eq(r, &self.inner.releases)) {
                return Err(ClientError::InvalidArgument(
                    "a block pinned or allocated through another client (release it through that one)".into(),
                ));
            }
        }
        Ok(())
    }

    /// Keeps `it` alive as long as this client or any guard made through it
    /// (the blocking client's runtime). Set once; later calls do nothing.
    pub(crate) fn keep_with_guards(&self, it: Arc<dyn std::any::Any + Send + Sync>) {
        let _ = self.inner.releases.keep.set(it);
    }

    /// Whether lookups, pins and unpins use the fast path (a framed Unix
    /// socket beside gRPC) rather than gRPC (allocations, commits and aborts
    /// too where `hello().fast_path_writes`).
    pub fn fast_path(&self) -> bool {
        self.inner.fast.is_some()
    }

    /// How many fast-path answers were read by the very thread that waited
    /// for them: `Some` only for the client of a [`blocking::Client`], whose
    /// calling threads read their own answers (see `fast.rs`). For tests
    /// and benches.
    #[doc(hidden)]
    pub fn fast_answers_read_by_caller(&self) -> Option<u64> {
        self.inner.fast.as_ref().and_then(|f| f.answers_read_by_their_caller())
    }

    fn calls(&self) -> Calls {
        Calls { rpc: self.rpc(), fast: self.inner.fast.clone(), writes: self.inner.hello.fast_path_writes }
    }

    fn rpc(&self) -> EngineClient<Channel> {
        self.inner.rpc.clone()
    }

    /// The daemon's self-description (pools, limits, session id).
    pub fn hello(&self) -> &pb::HelloResponse {
        &self.inner.hello
    }

    /// The socket this client is connected to.
    pub fn socket_path(&self) -> &Path {
        &self.inner.path
    }

    /// Registers a namespace (or returns the existing identical one).
    pub async fn register_namespace(&self, name: &str, block_bytes: u64, layout: &str) -> Result<Namespace> {
        self.register_namespace_on(name, block_bytes, layout, "").await
    }

    /// Registers a namespace whose blocks live on `device`: `""`/`"host"`
    /// (host pools) or `"cuda:N"` (the daemon's GPU pools on device N;
    /// pinned blocks are then device memory: [`PinnedBlock::device`]).
    pub async fn register_namespace_on(
        &self,
        name: &str,
        block_bytes: u64,
        layout: &str,
        device: &str,
    ) -> Result<Namespace> {
        let r = pb::RegisterNamespaceRequest {
            name: name.into(),
            block_bytes,
            layout: layout.into(),
            device: device.into(),
        };
        Ok(self.rpc().register_namespace(r).await?.into_inner().into())
    }

    /// Finds a registered namespace by name.
    pub async fn namespace(&self, name: &str) -> Result<Namespace> {
        Ok(self.rpc().get_namespace(pb::GetNamespaceRequest { name: name.into() }).await?.into_inner().into())
    }

    fn check_batch(&self, n: usize) -> Result<()> {
        if n > self.inner.hello.batch_keys_max as usize {
            return Err(ClientError::InvalidArgument(format!(
                "batch of {n} keys exceeds the daemon's batch_keys_max ({})",
                self.inner.hello.batch_keys_max
            )));
        }
        Ok(())
    }

    /// Per-key presence and the longest cached prefix. Pins nothing.
    pub async fn lookup(&self, ns: &Namespace, keys: &[Key]) -> Result<LookupResult> {
        self.lookup_with(ns, keys, false).await
    }

    /// [`Client::lookup`] answered from the daemon's own copies only: on a
    /// clustered daemon, no question to the keys' homes (a hint).
    pub async fn lookup_local(&self, ns: &Namespace, keys: &[Key]) -> Result<LookupResult> {
        self.lookup_with(ns, keys, true).await
    }

    async fn lookup_with(&self, ns: &Namespace, keys: &[Key], local_only: bool) -> Result<LookupResult> {
        self.check_batch(keys.len())?;
        let r = pb::LookupRequest { namespace_id: ns.id, keys: pb_keys(keys), local_only };
        let resp = self.calls().lookup(r).await?;
        let nodes_ok = resp.node.len() == keys.len() || resp.node.is_empty();
        if resp.present.len() != keys.len() || !nodes_ok {
            return Err(ClientError::Protocol(format!(
                "lookup answered {} of {} keys ({} locations)",
                resp.present.len(),
                keys.len(),
                resp.node.len()
            )));
        }
        let nodes =
            resp.present.iter().enumerate().map(|(i, &p)| if p { resp.node.get(i).copied() } else { None }).collect();
        Ok(LookupResult {
            present: resp.present,
            prefix_len: resp.prefix_len,
            nodes,
            cluster_wide: resp.cluster_wide,
            complete: resp.complete,
        })
    }

    /// Pins the cached keys with the daemon's default lease.
    pub async fn pin(&self, ns: &Namespace, keys: &[Key]) -> Result<Vec<Option<PinnedBlock>>> {
        self.pin_with(ns, keys, PinOptions::default()).await
    }

    /// Pins the cached keys. One entry per key (`None` on a miss); with
    /// `stop_at_first_miss`, entries end at the first miss.
    pub async fn pin_with(&self, ns: &Namespace, keys: &[Key], opts: PinOptions) -> Result<Vec<Option<PinnedBlock>>> {
        self.check_batch(keys.len())?;
        // (Queued again if this call ends before they are sent.)
        let mut carried = Unsent { releases: &self.inner.releases, slots: self.inner.releases.take_unpins() };
        let max = self.inner.hello.batch_keys_max as usize;
        if carried.slots.len() > max {
            // More than one request can carry: send the excess on its own.
            let rest = carried.slots.split_off(max);
            self.calls().unpin(pb::UnpinRequest { slots: rest }).await?;
        }
        let r = pb::PinRequest {
            namespace_id: ns.id,
            keys: pb_keys(keys),
            lease_ms: opts.lease_ms,
            stop_at_first_miss: opts.stop_at_first_miss,
            release: carried.send(max),
        };
        let resp = self.calls().pin(r).await?;
        // Every slot the daemon pinned is released on an error: a hit
        // after the one that failed gets no guard, so it is unpinned here.
        let mut err = None;
        if resp.blocks.len() > keys.len() {
            err = Some(ClientError::Protocol("pin answered more blocks than keys".into()));
        }
        let pool = self.inner.pools.get(ns.pool as usize);
        if pool.is_none() {
            err.get_or_insert_with(|| ClientError::Protocol(format!("namespace in unknown pool {}", ns.pool)));
        }
        let mut out = Vec::with_capacity(resp.blocks.len());
        for (i, b) in resp.blocks.into_iter().enumerate() {
            if !b.hit {
                out.push(None);
                continue;
            }
            let Some(s) = b.slot else {
                err.get_or_insert_with(|| ClientError::Protocol("hit without slot".into()));
                continue;
            };
            let slot = SlotRef { pool: s.pool, slot: s.slot, generation: s.generation };
            if s.pool != ns.pool {
                // A `Namespace` of another client or daemon instance: its
                // pool is not the one the daemon answered from.
                err.get_or_insert_with(|| {
                    ClientError::InvalidArgument(format!(
                        "namespace {:?} says pool {}, the daemon answered a slot of pool {} (a Namespace from \
                         another client or an earlier daemon?)",
                        ns.name, ns.pool, s.pool
                    ))
                });
            }
            let (Some(pool), Some(&key), None) = (pool, keys.get(i), &err) else {
                self.inner.releases.unpin(slot);
                continue;
            };
            let release = Some(Arc::clone(&self.inner.releases));
            let bytes = match pool.bytes_at(b.payload_offset, b.payload_bytes, |m, o, l| m.read(o, l)) {
                Ok(r) => r,
                Err(e) => {
                    self.inner.releases.unpin(slot);
                    err = Some(e);
                    continue;
                }
            };
            out.push(Some(PinnedBlock {
                bytes,
                key,
                slot,
                version: b.version,
                checksum: b.checksum,
                fingerprint: ns.fingerprint,
                lease_deadline_unix_ms: resp.lease_deadline_unix_ms,
                pool: pool.mem.clone(),
                stride: pool.info.slot_stride_bytes,
                payload_capacity: pool.info.slot_payload_bytes,
                release,
            }));
        }
        match err {
            // (The guards built drop with `out`: their slots are unpinned.)
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Unpins now and waits for the daemon's answer (dropping the guards
    /// unpins too, in the background).
    pub async fn unpin(&self, blocks: Vec<PinnedBlock>) -> Result<u32> {
        self.check_own(blocks.iter().map(|b| &b.release))?;
        // Batches not sent when this call ends (cancelled, or a batch
        // failed) are unpinned in the background.
        let mut left = Unsent { releases: &self.inner.releases, slots: Vec::with_capacity(blocks.len()) };
        for mut b in blocks {
            b.release = None;
            left.slots.push(b.slot.into());
        }
        let mut released = 0;
        while !left.slots.is_empty() {
            let chunk = left.send(self.inner.hello.batch_keys_max.max(1) as usize);
            released += self.calls().unpin(pb::UnpinRequest { slots: chunk }).await?.released;
        }
        Ok(released)
    }

    /// Waits until every unpin or abort queued by dropped guards so far has
    /// reached the daemon.
    pub async fn flush_releases(&self) {
        let (tx, rx) = oneshot::channel();
        if self.inner.releases.tx.send(Release::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Copies cached blocks into `dst` (`keys.len()` blocks back to back,
    /// each `ns.block_bytes` long). Returns per-key hit flags; the bytes of
    /// a miss are left untouched.
    pub async fn get_into(&self, ns: &Namespace, keys: &[Key], dst: &mut [u8]) -> Result<Vec<bool>> {
        let bs = ns.block_bytes as usize;
        if dst.len() != keys.len() * bs {
            return Err(ClientError::InvalidArgument(format!(
                "destination is {} bytes, expected {} ({} blocks of {bs})",
                dst.len(),
                keys.len() * bs,
                keys.len()
            )));
        }
        let blocks = self.pin(ns, keys).await?;
        let mut hits = vec![false; keys.len()];
        let mut held = Vec::with_capacity(blocks.len());
        for (i, b) in blocks.into_iter().enumerate() {
            if let Some(b) = b {
                b.copy_to(&mut dst[i * bs..(i + 1) * bs])?;
                hits[i] = true;
                held.push(b);
            }
        }
        // A copy that outlived its lease may have raced a reuse of the slot.
        if held.iter().any(|b| b.lease_remaining().is_zero()) {
            return Err(ClientError::LeaseExpired("copy finished after the pin lease expired; retry".into()));
        }
        // Unpins ride on the next pin (or leave within a millisecond).
        drop(held);
        Ok(hits)
    }

    /// Put, phase one: reserves a slot per absent key.
    pub async fn allocate(&self, ns: &Namespace, keys: &[Key]) -> Result<Vec<Allocation>> {
        self.allocate_with_lease(ns, keys, 0).await
    }

    /// As [`Client::allocate`] with an explicit lease (0: daemon default).
    pub async fn allocate_with_lease(&self, ns: &Namespace, keys: &[Key], lease_ms: u64) -> Result<Vec<Allocation>> {
        self.allocate_inner(ns, keys, lease_ms, false).await
    }

    /// Put of a new version of mutable keys, phase one: reserves a slot per
    /// key even when the key is cached. The commit publishes the new
    /// version; when it returns, no daemon of the cluster serves an older
    /// one. (On a daemon without peers the cached version is removed when
    /// the slot is allocated: readers miss until the commit.)
    pub async fn allocate_overwrite(&self, ns: &Namespace, keys: &[Key]) -> Result<Vec<Allocation>> {
        self.allocate_inner(ns, keys, 0, true).await
    }

    async fn allocate_inner(
        &self,
        ns: &Namespace,
        keys: &[Key],
        lease_ms: u64,
        overwrite: bool,
    ) -> Result<Vec<Allocation>> {
        self.check_batch(keys.len())?;
        // A block the slot cannot hold would be written past its payload
        // (a `Namespace` edited, or of another daemon instance).
        if let Some(p) = self.inner.pools.get(ns.pool as usize)
            && ns.block_bytes > p.info.slot_payload_bytes
        {
            return Err(ClientError::InvalidArgument(format!(
                "namespace {:?}: blocks of {} bytes do not fit pool {}'s slots of {}",
                ns.name, ns.block_bytes, ns.pool, p.info.slot_payload_bytes
            )));
        }
        let r = pb::AllocateRequest { namespace_id: ns.id, keys: pb_keys(keys), lease_ms, overwrite };
        let resp = self.calls().allocate(r).await?;
        // Every slot the daemon allocated is aborted on an error: an
        // allocation after the one that failed gets no guard, so it is
        // aborted here (left, it would read in progress for every engine
        // and be fenced once its lease passed).
        let mut err = None;
        if resp.allocations.len() != keys.len() {
            err = Some(ClientError::Protocol("allocate answered a different number of keys".into()));
        }
        let pool = self.inner.pools.get(ns.pool as usize);
        if pool.is_none() {
            err.get_or_insert_with(|| ClientError::Protocol(format!("namespace in unknown pool {}", ns.pool)));
        }
        let mut out = Vec::with_capacity(keys.len());
        for (i, a) in resp.allocations.into_iter().enumerate() {
            out.push(match pb::AllocateStatus::try_from(a.status) {
                Ok(pb::AllocateStatus::Allocated) => {
                    let Some(s) = a.slot else {
                        err.get_or_insert_with(|| ClientError::Protocol("allocation without slot".into()));
                        continue;
                    };
                    let slot = SlotRef { pool: s.pool, slot: s.slot, generation: s.generation };
                    if s.pool != ns.pool {
                        err.get_or_insert_with(|| {
                            ClientError::InvalidArgument(format!(
                                "namespace {:?} says pool {}, the daemon allocated in pool {} (a Namespace from \
                                 another client or an earlier daemon?)",
                                ns.name, ns.pool, s.pool
                            ))
                        });
                    }
                    let (Some(pool), Some(&key), None) = (pool, keys.get(i), &err) else {
                        self.inner.releases.abort(slot);
                        continue;
                    };
                    let bytes = match pool.bytes_at(a.payload_offset, ns.block_bytes, |m, o, l| m.write(o, l)) {
                        Ok(r) => r,
                        Err(e) => {
                            self.inner.releases.abort(slot);
                            err = Some(e);
                            continue;
                        }
                    };
                    Allocation::Allocated(WritableBlock {
                        bytes,
                        key,
                        slot,
                        release: Some(Arc::clone(&self.inner.releases)),
                    })
                }
                Ok(pb::AllocateStatus::Exists) => Allocation::Exists,
                Ok(pb::AllocateStatus::InProgress) => Allocation::InProgress,
                _ => {
                    err.get_or_insert_with(|| ClientError::Protocol(format!("unknown allocation status {}", a.status)));
                    continue;
                }
            });
        }
        match err {
            // (The guards built drop with `out`: their slots are aborted.)
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Put, phase two: the daemon checksums the written blocks and makes
    /// them visible.
    pub async fn commit(&self, blocks: Vec<WritableBlock>) -> Result<Vec<CommitOutcome>> {
        self.check_batch(blocks.len())?;
        self.check_own(blocks.iter().map(|b| &b.release))?;
        let mut refs = Vec::with_capacity(blocks.len());
        let mut slots = Vec::with_capacity(blocks.len());
        for mut b in blocks {
            b.release = None;
            refs.push(b.slot.into());
            slots.push(b.slot);
            // dropping `b` here releases the write claim before the commit
        }
        // A commit that fails is aborted in the background (an abort of a
        // slot the daemon committed, or aborted, meanwhile does nothing);
        // one cancelled once started still reaches the daemon (see
        // `Calls`).
        let resp = match self.calls().commit(pb::CommitRequest { slots: refs }).await {
            Ok(r) => r,
            Err(e) => {
                for s in slots {
                    self.inner.releases.abort(s);
                }
                return Err(e);
            }
        };
        Ok(resp
            .status
            .iter()
            .enumerate()
            .map(|(i, &s)| match pb::CommitStatus::try_from(s) {
                Ok(pb::CommitStatus::Committed) => CommitOutcome::Committed {
                    checksum: resp.checksums.get(i).copied().unwrap_or(0),
                    version: resp.versions.get(i).copied().unwrap_or(0),
                },
                Ok(pb::CommitStatus::Refused) => {
                    CommitOutcome::Refused(resp.errors.get(i).cloned().unwrap_or_else(|| "refused".into()))
                }
                _ => CommitOutcome::Lost,
            })
            .collect())
    }

    /// Makes sure no daemon of the cluster serves the current version of
    /// `keys`: when this returns with `failed == 0`, none does (on a daemon
    /// without peers: the keys are removed).
    pub async fn invalidate(&self, ns: &Namespace, keys: &[Key]) -> Result<InvalidateSummary> {
        self.check_batch(keys.len())?;
        let r = pb::InvalidateRequest { namespace_id: ns.id, keys: pb_keys(keys), whole_namespace: false };
        let a = self.rpc().invalidate(r).await?.into_inner();
        Ok(InvalidateSummary { invalidated: a.invalidated, failed: a.failed, first_error: a.first_error })
    }

    /// As [`Client::invalidate`] for every key of the namespace that any
    /// daemon of the cluster knows.
    pub async fn invalidate_namespace(&self, ns: &Namespace) -> Result<InvalidateSummary> {
        let r = pb::InvalidateRequest { namespace_id: ns.id, keys: Vec::new(), whole_namespace: true };
        let a = self.rpc().invalidate(r).await?.into_inner();
        Ok(InvalidateSummary { invalidated: a.invalidated, failed: a.failed, first_error: a.first_error })
    }

    /// Frees allocated, uncommitted slots.
    pub async fn abort(&self, blocks: Vec<WritableBlock>) -> Result<u32> {
        self.check_batch(blocks.len())?;
        self.check_own(blocks.iter().map(|b| &b.release))?;
        let mut refs = Vec::with_capacity(blocks.len());
        let mut slots = Vec::with_capacity(blocks.len());
        for mut b in blocks {
            b.release = None;
            refs.push(b.slot.into());
            slots.push(b.slot);
        }
        match self.calls().abort(pb::AbortRequest { slots: refs }).await {
            Ok(r) => Ok(r.aborted),
            Err(e) => {
                // Again in the background (a repeated abort does nothing).
                for s in slots {
                    self.inner.releases.abort(s);
                }
                Err(e)
            }
        }
    }

    /// Stores whole blocks: allocate, copy into the pool, commit. Keys
    /// already cached are left as they are (see [`Client::put_overwrite`]).
    pub async fn put(&self, ns: &Namespace, blocks: &[(Key, &[u8])]) -> Result<PutSummary> {
        self.put_inner(ns, blocks, false).await
    }

    /// Stores a new version of each block, cached or not (mutable keys).
    pub async fn put_overwrite(&self, ns: &Namespace, blocks: &[(Key, &[u8])]) -> Result<PutSummary> {
        self.put_inner(ns, blocks, true).await
    }

    async fn put_inner(&self, ns: &Namespace, blocks: &[(Key, &[u8])], overwrite: bool) -> Result<PutSummary> {
        for (k, b) in blocks {
            if b.len() as u64 != ns.block_bytes {
                return Err(ClientError::InvalidArgument(format!(
                    "block {k} is {} bytes, namespace {} has blocks of {}",
                    b.len(),
                    ns.name,
                    ns.block_bytes
                )));
            }
        }
        let keys: Vec<Key> = blocks.iter().map(|(k, _)| *k).collect();
        let allocs = self.allocate_inner(ns, &keys, 0, overwrite).await?;
        let mut sum = PutSummary::default();
        let mut writes = Vec::new();
        for (a, (_, bytes)) in allocs.into_iter().zip(blocks) {
            match a {
                Allocation::Allocated(mut w) => {
                    w.write(bytes)?;
                    writes.push(w);
                }
                Allocation::Exists => sum.existed += 1,
                Allocation::InProgress => sum.in_progress += 1,
            }
        }
        if !writes.is_empty() {
            for o in self.commit(writes).await? {
                match o {
                    CommitOutcome::Committed { .. } => sum.stored += 1,
                    CommitOutcome::Lost => sum.lost += 1,
                    CommitOutcome::Refused(why) => {
                        sum.refused += 1;
                        sum.first_refusal.get_or_insert(why);
                    }
                }
            }
        }
        Ok(sum)
    }

    /// Removes keys; per-key whether it was cached.
    pub async fn remove(&self, ns: &Namespace, keys: &[Key]) -> Result<Vec<bool>> {
        self.check_batch(keys.len())?;
        let r = pb::RemoveRequest { namespace_id: ns.id, keys: pb_keys(keys) };
        Ok(self.rpc().remove(r).await?.into_inner().removed)
    }

    /// Every registered namespace with the blocks this daemon holds of it.
    pub async fn list_namespaces(&self) -> Result<Vec<(Namespace, u64)>> {
        let r = self.rpc().list_namespaces(pb::ListNamespacesRequest {}).await?.into_inner();
        r.namespaces
            .into_iter()
            .map(|s| {
                let info = s.info.ok_or_else(|| ClientError::Protocol("namespace summary without info".into()))?;
                Ok((info.into(), s.blocks))
            })
            .collect()
    }

    /// Up to `limit` keys of `ns` cached on this daemon and their total.
    pub async fn list_keys(&self, ns: &Namespace, limit: u32) -> Result<(Vec<Key>, u64)> {
        let r = self.rpc().list_keys(pb::ListKeysRequest { namespace_id: ns.id, limit }).await?.into_inner();
        Ok((r.keys.iter().map(|k| Key::from_parts(k.hi, k.lo)).collect(), r.total))
    }

    /// KV events of namespace `ns` on this daemon (blocks stored, removed,
    /// evicted, invalidated), in batches, until the stream ends. With
    /// `snapshot`, the blocks held now come first (SNAPSHOT events, the
    /// batches marked `snapshot`), then the live events continuing from
    /// `snapshot_seq`. `seq` numbers each namespace's events from 1 without
    /// gaps: a gap, or the stream ending with RESOURCE_EXHAUSTED (too slow),
    /// means watching again with `snapshot`.
    pub async fn watch_events(&self, ns: &Namespace, snapshot: bool) -> Result<tonic::Streaming<KvEventBatch>> {
        let r = pb::WatchEventsRequest { namespace_id: ns.id, snapshot };
        Ok(self.rpc().watch_events(r).await?.into_inner())
    }

    /// Starts a graceful drain of the daemon (see the `Drain` RPC): it
    /// refuses new pins and allocations, waits up to `deadline_ms` (0: its
    /// configured `server.drain_timeout_ms`) for those given to end, leaves
    /// the cluster and exits. Answers at once.
    pub async fn drain(&self, deadline_ms: u64) -> Result<pb::DrainResponse> {
        Ok(self.rpc().drain(pb::DrainRequest { deadline_ms }).await?.into_inner())
    }

    /// The daemon's running configuration as TOML, and where it came from.
    pub async fn config(&self) -> Result<(String, String)> {
        let r = self.rpc().get_config(pb::GetConfigRequest {}).await?.into_inner();
        Ok((r.toml, r.source))
    }

    /// Daemon statistics.
    pub async fn stats(&self) -> Result<Stats> {
        Ok(self.rpc().stats(pb::StatsRequest {}).await?.into_inner())
    }
}

fn pb_keys(keys: &[Key]) -> Vec<pb::Key> {
    keys.iter().map(|k| pb::Key { hi: k.hi(), lo: k.lo() }).collect()
}

/// The calls that go over the fast path when there is one (pins taken on
/// it must be released on it: it is their session; so must allocations be
/// committed or aborted on the connection that made them).
#[derive(Clone)]
struct Calls {
    rpc: EngineClient<Channel>,
    fast: Option<Arc<fast::Fast>>,
    /// The daemon takes allocate, commit and abort on the fast path too
    /// (`Hello.fast_path_writes`); an older one only over gRPC.
    writes: bool,
}

impl Calls {
    async fn lookup(&mut self, r: pb::LookupRequest) -> Result<pb::LookupResponse> {
        match &self.fast {
            Some(f) => f.call(kvmesh_common::handshake::fast::LOOKUP, &r).await,
            None => Ok(self.rpc.lookup(r).await?.into_inner()),
        }
    }
    async fn pin(&mut self, mut r: pb::PinRequest) -> Result<pb::PinResponse> {
        match &self.fast {
            Some(f) => f.call(kvmesh_common::handshake::fast::PIN, &r).await,
            None => {
                // The releases it would carry go in an unpin of their own,
                // sent whatever becomes of this call (a dropped tonic call
                // may never be sent).
                let release = std::mem::take(&mut r.release);
                if !release.is_empty() {
                    let mut rpc = self.rpc.clone();
                    tokio::spawn(async move {
                        if let Err(e) = rpc.unpin(pb::UnpinRequest { slots: release }).await {
                            tracing::debug!("unpin failed (the daemon releases pins of closed connections): {e}");
                        }
                    });
                }
                Ok(self.rpc.pin(r).await?.into_inner())
            }
        }
    }
    async fn unpin(&mut self, r: pb::UnpinRequest) -> Result<pb::UnpinResponse> {
        match &self.fast {
            Some(f) => f.call(kvmesh_common::handshake::fast::UNPIN, &r).await,
            None => {
                let mut rpc = self.rpc.clone();
                detached(async move { rpc.unpin(r).await }).await
            }
        }
    }
    /// The fast path where it takes writes.
    fn writes(&self) -> Option<&fast::Fast> {
        self.fast.as_deref().filter(|_| self.writes)
    }
    async fn allocate(&mut self, r: pb::AllocateRequest) -> Result<pb::AllocateResponse> {
        match self.writes() {
            Some(f) => f.call(kvmesh_common::handshake::fast::ALLOCATE, &r).await,
            None => Ok(self.rpc.allocate(r).await?.into_inner()),
        }
    }
    async fn commit(&mut self, r: pb::CommitRequest) -> Result<pb::CommitResponse> {
        match self.writes() {
            Some(f) => f.call(kvmesh_common::handshake::fast::COMMIT, &r).await,
            None => {
                let mut rpc = self.rpc.clone();
                detached(async move { rpc.commit(r).await }).await
            }
        }
    }
    async fn abort(&mut self, r: pb::AbortRequest) -> Result<pb::AbortResponse> {
        match self.writes() {
            Some(f) => f.call(kvmesh_common::handshake::fast::ABORT, &r).await,
            None => {
                let mut rpc = self.rpc.clone();
                detached(async move { rpc.abort(r).await }).await
            }
        }
    }
}

/// Runs a gRPC call that releases slots in a task of its own: once
/// started, it reaches the daemon even if its caller is cancelled (a
/// tonic call dropped before its request went out is never sent, and the
/// guards it consumed would be released only by their lease). Fast-path
/// calls need none of this: their request is written or queued when they
/// are first polled.
async fn detached<T: Send + 'static>(
    call: impl std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>> + Send + 'static,
) -> Result<T> {
    match tokio::spawn(call).await {
        Ok(r) => Ok(r?.into_inner()),
        Err(e) => Err(ClientError::Protocol(format!("call task ended: {e}"))),
    }
}

async fn release_loop(
    mut calls: Calls,
    mut rx: mpsc::UnboundedReceiver<Release>,
    releases: std::sync::Weak<Releases>,
    batch_max: usize,
) {
    while let Some(first) = rx.recv().await {
        let mut aborts = Vec::new();
        let mut flushes = Vec::new();
        let mut wake = false;
        let mut next = Some(first);
        while let Some(r) = next {
            match r {
                Release::Wake => wake = true,
                Release::Abort(s) => aborts.push(pb::SlotRef::from(s)),
                Release::Flush(tx) => flushes.push(tx),
            }
            if aborts.len() >= batch_max || !flushes.is_empty() {
                break;
            }
            next = rx.try_recv().ok();
        }
        if wake && flushes.is_empty() {
            // Give the next pin a chance to carry these unpins.
            tokio::time::sleep(UNPIN_PIGGYBACK_WAIT).await;
        }
        let unpins = releases.upgrade().map(|r| r.take_unpins()).unwrap_or_default();
        for chunk in unpins.chunks(batch_max) {
            if let Err(e) = calls.unpin(pb::UnpinRequest { slots: chunk.to_vec() }).await {
                tracing::debug!("background unpin failed (the daemon releases pins of closed connections): {e}");
            }
        }
        for chunk in aborts.chunks(batch_max) {
            if let Err(e) = calls.abort(pb::AbortRequest { slots: chunk.to_vec() }).await {
                tracing::debug!("background abort failed: {e}");
            }
        }
        for f in flushes {
            let _ = f.send(());
        }
    }
}

impl PoolMap {
    /// The bytes of a slot's payload: a claimed region of a host mapping
    /// (`claim` reads or writes), or a range of an imported GPU pool.
    fn bytes_at<R>(
        &self,
        offset: u64,
        len: u64,
        claim: impl FnOnce(&Arc<SharedMapping>, u64, u64) -> std::result::Result<R, ShmError>,
    ) -> Result<Bytes<R>> {
        match &self.mem {
            PoolMem::Host(m) => Ok(Bytes::Host(claim(m, offset, len)?)),
            PoolMem::Cuda(g) => {
                let r = g.pool.range().sub(offset as usize, len as usize)?;
                Ok(Bytes::Device(Arc::clone(g), r))
            }
            PoolMem::Unavailable(e) => Err(ClientError::Gpu(e.clone())),
        }
    }
}

impl std::fmt::Debug for PinnedBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBlock")
            .field("key", &self.key)
            .field("slot", &self.slot)
            .field("version", &self.version)
            .field("len", &self.len())
            .field("device", &self.device())
            .finish()
    }
}

impl std::fmt::Debug for WritableBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WritableBlock").field("key", &self.key).field("slot", &self.slot).finish()
    }
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Allocation::Allocated(w) => w.fmt(f),
            Allocation::Exists => f.write_str("Exists"),
            Allocation::InProgress => f.write_str("InProgress"),
        }
    }
}
