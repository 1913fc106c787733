//! The C ABI of the kvmesh client library (`libkvmesh.so`, `libkvmesh.a`,
//! header `include/kvmesh.h`, generated from this file by cbindgen).
//!
//! **Conventions.** Every fallible function returns an `int32_t`: `0`
//! (`KVMESH_OK`) on success, a small positive outcome where one is
//! documented (`KVMESH_EXISTS`, `KVMESH_IN_PROGRESS`), or a negative
//! `KVMESH_E_*` code grouped by kind. After a negative return,
//! `kvmesh_last_error()` gives the message of the calling thread's last
//! failure. No Rust panic crosses the boundary: each entry point runs under
//! `catch_unwind`, and a caught panic is `KVMESH_E_INTERNAL`.
//!
//! **Ownership.** Handles come from `_open`-style calls and go back through
//! the matching call (`kvmesh_close`, `kvmesh_unpin`, `kvmesh_commit` or
//! `kvmesh_abort`), exactly once; NULL is accepted and ignored there
//! (except by `kvmesh_commit`, which answers NULL with
//! `KVMESH_E_INVALID`: nothing was committed). The
//! library copies what it needs from caller memory during a call and never
//! keeps a caller's pointer after the call returns.
//!
//! **Threads.** A `kvmesh_client_t` may be shared by any number of threads:
//! every call on it is thread-safe (calls block only their caller). A batch
//! (`kvmesh_batch_t`) or allocation (`kvmesh_alloc_t`) handle belongs to one
//! thread at a time: a call that finds another thread inside a call on the
//! same handle fails with `KVMESH_E_INVALID` instead of racing. Handles may
//! outlive the client they came from (the connection stays open until the
//! last one is released).
//!
//! **Zero copy.** `kvmesh_batch_block` returns a pointer *into the daemon's
//! pool*, valid until the batch is unpinned and at most until its lease
//! ends (`kvmesh_batch_lease_remaining_ms`); `kvmesh_alloc_block` returns a
//! writable pointer into the slot, valid until commit or abort.
#![deny(unsafe_op_in_unsafe_fn)]
#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::{Arc, Mutex, TryLockError};

use kvmesh_client::blocking;
use kvmesh_client::{
    Allocation, ClientError, CommitOutcome, ErrorKind, Key, Namespace, PinOptions, PinnedBlock, WritableBlock,
};

use kvmesh_kernels::cuda::GpuError;
use kvmesh_kernels::layout::PagedKv;
use kvmesh_kernels::raw::{Direction, Memory};

/// Version of this C ABI. Raised on any incompatible change to a function
/// signature, a struct layout or the meaning of a code; compare it with
/// `kvmesh_abi_version()` at run time to catch a header/library mismatch.
pub const KVMESH_ABI_VERSION: u32 = 1;

/// Success.
pub const KVMESH_OK: i32 = 0;
/// Outcome (not an error): the key is already cached; nothing allocated.
pub const KVMESH_EXISTS: i32 = 1;
/// Outcome (not an error): another put of the key is in progress.
pub const KVMESH_IN_PROGRESS: i32 = 2;
/// Usage: a NULL pointer, a wrong size, a bad index, a handle used by two
/// threads at once, an argument the daemon rejects.
pub const KVMESH_E_INVALID: i32 = -1;
/// Not found: an unknown namespace, or a miss (the block is not cached).
pub const KVMESH_E_NOT_FOUND: i32 = -2;
/// Resource exhausted: the pool is full of pinned blocks, a session limit
/// was reached.
pub const KVMESH_E_EXHAUSTED: i32 = -3;
/// A lease (of a pin or an allocation) ended: the pointers it covered must
/// not be used; retry.
pub const KVMESH_E_LEASE_EXPIRED: i32 = -4;
/// The daemon or the cluster refused the operation (another write of the
/// key in progress, not a serving member, a timeout).
pub const KVMESH_E_REFUSED: i32 = -5;
/// The daemon cannot be reached or the connection broke (open a new client).
pub const KVMESH_E_TRANSPORT: i32 = -6;
/// A bug or an unexpected answer (including a caught panic).
pub const KVMESH_E_INTERNAL: i32 = -7;
/// The event stream was cancelled (`kvmesh_events_cancel`); only close it.
pub const KVMESH_E_CANCELLED: i32 = -9;

/// `kvmesh_pin` flag: stop at the first miss (a prefix fetch).
pub const KVMESH_PIN_STOP_AT_FIRST_MISS: u32 = 1;
/// `kvmesh_lookup_where` flag: the daemon's own copies only (on a
/// clustered daemon, no question to the keys' homes).
pub const KVMESH_LOOKUP_LOCAL_ONLY: u32 = 1;
/// `kvmesh_lookup_where` info bit: the answer covers the cluster.
pub const KVMESH_LOOKUP_CLUSTER_WIDE: u32 = 1;
/// `kvmesh_lookup_where` info bit: every home asked answered.
pub const KVMESH_LOOKUP_COMPLETE: u32 = 2;
/// `kvmesh_lookup_where`: the node of a key cached nowhere.
pub const KVMESH_NODE_NONE: u32 = u32::MAX;
/// `kvmesh_allocate` / `kvmesh_put` flag: write a new version even when the
/// key is cached (mutable keys); the commit returns once no daemon of the
/// cluster serves an older version.
pub const KVMESH_OVERWRITE: u32 = 1;

/// A block key: the 128-bit chained prefix hash, as two halves.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvmesh_key_t {
    /// High 64 bits.
    pub hi: u64,
    /// Low 64 bits.
    pub lo: u64,
}

impl From<kvmesh_key_t> for Key {
    fn from(k: kvmesh_key_t) -> Key {
        Key::from_parts(k.hi, k.lo)
    }
}

impl From<Key> for kvmesh_key_t {
    fn from(k: Key) -> kvmesh_key_t {
        kvmesh_key_t { hi: k.hi(), lo: k.lo() }
    }
}

/// A namespace as the daemon registered it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvmesh_namespace_t {
    /// Handle passed to the calls below (valid for the client that
    /// registered or looked it up).
    pub id: u32,
    /// Pool holding its blocks.
    pub pool: u32,
    /// Size of every block in bytes.
    pub block_bytes: u64,
    /// Fingerprint of (name, block size, layout).
    pub fingerprint: u64,
}

/// What `kvmesh_put` did, per kind of outcome.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvmesh_put_summary_t {
    /// Blocks written and committed.
    pub stored: u32,
    /// Keys already cached (nothing written).
    pub existed: u32,
    /// Keys being put by someone else (nothing written).
    pub in_progress: u32,
    /// Allocations whose lease ended before commit (not stored).
    pub lost: u32,
    /// Blocks the cluster refused to publish (not stored).
    pub refused: u32,
}

/// What `kvmesh_invalidate` did.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvmesh_invalidate_summary_t {
    /// Keys no daemon serves the old version of any more.
    pub invalidated: u64,
    /// Keys whose invalidation did not complete before the deadline (the
    /// message of the first is in `kvmesh_last_error`).
    pub failed: u64,
}

/// A connection to the local kvmeshd (opaque).
pub struct kvmesh_client_t {
    client: blocking::Client,
    /// Shared, so a call borrows one without copying its strings.
    namespaces: Mutex<Vec<Arc<Namespace>>>,
}

/// A KV event stream (opaque): `kvmesh_watch_events`, `kvmesh_events_next`,
/// `kvmesh_events_cancel`, `kvmesh_events_close`.
pub struct kvmesh_events_t {
    client: blocking::Client,
    state: Mutex<EventsState>,
    /// Set by `kvmesh_events_cancel` (any thread), read by every `next`.
    cancelled: std::sync::atomic::AtomicBool,
    /// Wakes a `next` waiting when the cancel comes (a permit is kept for a
    /// `next` that has not started waiting yet).
    cancel: tokio::sync::Notify,
}

struct EventsState {
    stream: Option<tonic::Streaming<kvmesh_client::KvEventBatch>>,
    /// Events of the last batch not handed out yet.
    pending: std::collections::VecDeque<kvmesh_event_t>,
    node: u32,
}

/// What happened to a block (`kvmesh_event_t.kind`): it became readable
/// here (a put, or a copy fetched from a peer).
pub const KVMESH_EVENT_STORED: u32 = 1;
/// Removed by an engine on a daemon without peers.
pub const KVMESH_EVENT_REMOVED: u32 = 2;
/// Evicted for space.
pub const KVMESH_EVENT_EVICTED: u32 = 3;
/// Dropped by the coherence protocol (clustered).
pub const KVMESH_EVENT_INVALIDATED: u32 = 4;
/// Held when the watch started (a snapshot).
pub const KVMESH_EVENT_SNAPSHOT: u32 = 5;

// The kinds are the wire enum's numbers (copied through unchanged).
const _: () = {
    use kvmesh_client::KvEventKind as K;
    assert!(KVMESH_EVENT_STORED == K::Stored as u32 && KVMESH_EVENT_REMOVED == K::Removed as u32);
    assert!(KVMESH_EVENT_EVICTED == K::Evicted as u32 && KVMESH_EVENT_INVALIDATED == K::Invalidated as u32);
    assert!(KVMESH_EVENT_SNAPSHOT == K::Snapshot as u32);
};

/// One KV event.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvmesh_event_t {
    /// `KVMESH_EVENT_*`.
    pub kind: u32,
    /// Per (daemon, namespace) sequence number, from 1, without gaps
    /// (snapshot events carry the number the live events continue from).
    pub seq: u64,
    /// The block.
    pub key: kvmesh_key_t,
    /// Its version.
    pub version: u64,
}

/// A pinned batch of blocks (opaque).
pub struct kvmesh_batch_t {
    client: blocking::Client,
    blocks: Mutex<Vec<Option<PinnedBlock>>>,
}

/// The slots of a put in progress (opaque).
pub struct kvmesh_alloc_t {
    client: blocking::Client,
    slots: Mutex<Vec<Allocation>>,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// An error on its way to C: a code and a message.
struct Fail(i32, String);

impl Fail {
    fn invalid(msg: impl Into<String>) -> Fail {
        Fail(KVMESH_E_INVALID, msg.into())
    }
}

impl From<ClientError> for Fail {
    fn from(e: ClientError) -> Fail {
        let code = match e.kind() {
            ErrorKind::InvalidArgument => KVMESH_E_INVALID,
            ErrorKind::NotFound => KVMESH_E_NOT_FOUND,
            ErrorKind::ResourceExhausted => KVMESH_E_EXHAUSTED,
            ErrorKind::LeaseExpired => KVMESH_E_LEASE_EXPIRED,
            ErrorKind::Refused => KVMESH_E_REFUSED,
            ErrorKind::Unavailable => KVMESH_E_TRANSPORT,
            ErrorKind::Internal => KVMESH_E_INTERNAL,
            ErrorKind::NoDevice => KVMESH_E_NO_DEVICE,
        };
        Fail(code, e.to_string())
    }
}

/// Runs one entry point: catches panics, records the message of a failure.
fn guard(name: &str, f: impl FnOnce() -> Result<i32, Fail>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(code)) => code,
        Ok(Err(Fail(code, msg))) => {
            set_last_error(&format!("{name}: {msg}"));
            code
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("{name}: internal error (panic): {what}"));
            KVMESH_E_INTERNAL
        }
    }
}

fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> Result<std::sync::MutexGuard<'a, T>, Fail> {
    match m.try_lock() {
        Ok(g) => Ok(g),
        Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        Err(TryLockError::WouldBlock) => {
            Err(Fail::invalid(format!("{what} is in use by another thread (one thread at a time per {what})")))
        }
    }
}

/// Borrows a handle or fails on NULL.
fn handle<'a, T>(p: *const T, what: &str) -> Result<&'a T, Fail> {
    // Handles are only read through shared references here.
    // SAFETY: `p` is NULL or a live handle of this library (the contract).
    unsafe { p.as_ref() }.ok_or_else(|| Fail::invalid(format!("{what} is NULL")))
}

/// Reads a NUL-terminated string argument.
fn string_arg<'a>(p: *const c_char, what: &str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and the caller passes a NUL-terminated string valid
    // for the duration of the call (documented for every string argument).
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|_| Fail::invalid(format!("{what} is not UTF-8")))
}

/// Copies the key array argument.
fn keys_arg(keys: *const kvmesh_key_t, n: usize) -> Result<Vec<Key>, Fail> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if keys.is_null() {
        return Err(Fail::invalid(format!("keys is NULL with n = {n}")));
    }
    if n > isize::MAX as usize / std::mem::size_of::<kvmesh_key_t>() {
        return Err(Fail::invalid(format!("n = {n} keys is too large")));
    }
    // SAFETY: non-null; the caller passes `n` initialized keys valid for the
    // call (documented); the size was checked against isize::MAX above.
    let s = unsafe { std::slice::from_raw_parts(keys, n) };
    Ok(s.iter().map(|&k| k.into()).collect())
}

/// An optional output array of `n` elements: `None` for NULL.
fn out_slice<'a, T>(p: *mut T, n: usize) -> Result<Option<&'a mut [T]>, Fail> {
    if p.is_null() {
        return Ok(None);
    }
    if n > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(Fail::invalid(format!("output array of {n} elements is too large")));
    }
    // SAFETY: non-null; the caller passes room for `n` elements, writable
    // for the call and not aliased by other arguments (documented).
    Ok(Some(unsafe { std::slice::from_raw_parts_mut(p, n) }))
}

/// Writes an output scalar (NULL: fails).
fn put_out<T>(p: *mut T, v: T, what: &str) -> Result<(), Fail> {
    if p.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and the caller passes a pointer writable for one `T`
    // (documented for every output argument).
    unsafe { p.write(v) };
    Ok(())
}

/// Writes an optional output scalar (NULL: nothing).
fn out_opt<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: as in `out`: a non-null output argument is writable.
        unsafe { p.write(v) };
    }
}

impl kvmesh_client_t {
    fn namespace(&self, id: u32) -> Result<Arc<Namespace>, Fail> {
        let known = self.namespaces.lock().unwrap_or_else(|e| e.into_inner());
        known.iter().find(|n| n.id == id).cloned().ok_or_else(|| {
            Fail(
                KVMESH_E_NOT_FOUND,
                format!("namespace id {id} is unknown to this client (kvmesh_register_namespace or kvmesh_get_namespace it first)"),
            )
        })
    }
    fn remember(&self, ns: &Namespace) -> kvmesh_namespace_t {
        let mut known = self.namespaces.lock().unwrap_or_else(|e| e.into_inner());
        if !known.iter().any(|n| n.id == ns.id) {
            known.push(Arc::new(ns.clone()));
        }
        kvmesh_namespace_t { id: ns.id, pool: ns.pool, block_bytes: ns.block_bytes, fingerprint: ns.fingerprint }
    }
}

/// The ABI version of the loaded library (`KVMESH_ABI_VERSION` it was built
/// with).
#[unsafe(no_mangle)]
pub extern "C" fn kvmesh_abi_version() -> u32 {
    KVMESH_ABI_VERSION
}

/// The library version, a static NUL-terminated string ("0.1.0").
#[unsafe(no_mangle)]
pub extern "C" fn kvmesh_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The message of the calling thread's last failure ("" if none). Valid
/// until the next call on this thread that sets it — a failing call, or a
/// `kvmesh_commit` / `kvmesh_put` that succeeded with entries refused (it
/// then says why); copy it to keep it.
#[unsafe(no_mangle)]
pub extern "C" fn kvmesh_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The name of a code ("KVMESH_E_NOT_FOUND", ...), a static string;
/// "KVMESH_UNKNOWN_CODE" for a code this library does not define.
#[unsafe(no_mangle)]
pub extern "C" fn kvmesh_code_name(code: i32) -> *const c_char {
    let s: &'static str = match code {
        KVMESH_OK => "KVMESH_OK\0",
        KVMESH_EXISTS => "KVMESH_EXISTS\0",
        KVMESH_IN_PROGRESS => "KVMESH_IN_PROGRESS\0",
        KVMESH_E_INVALID => "KVMESH_E_INVALID\0",
        KVMESH_E_NOT_FOUND => "KVMESH_E_NOT_FOUND\0",
        KVMESH_E_EXHAUSTED => "KVMESH_E_EXHAUSTED\0",
        KVMESH_E_LEASE_EXPIRED => "KVMESH_E_LEASE_EXPIRED\0",
        KVMESH_E_REFUSED => "KVMESH_E_REFUSED\0",
        KVMESH_E_TRANSPORT => "KVMESH_E_TRANSPORT\0",
        KVMESH_E_INTERNAL => "KVMESH_E_INTERNAL\0",
        KVMESH_E_NO_DEVICE => "KVMESH_E_NO_DEVICE\0",
        KVMESH_E_CANCELLED => "KVMESH_E_CANCELLED\0",
        _ => "KVMESH_UNKNOWN_CODE\0",
    };
    s.as_ptr().cast()
}

/// No CUDA driver, device or NVRTC here for a call on device memory (the
/// same call on host memory, `KVMESH_DEVICE_HOST`, works everywhere).
pub const KVMESH_E_NO_DEVICE: i32 = -8;

/// Memory argument of the kernels: host memory of this process (the CPU
/// reference runs). N >= 0 means device memory of CUDA device N.
pub const KVMESH_DEVICE_HOST: i32 = -1;

/// Engine layouts (`kvmesh_kv_shape_t.layout`); see docs/GPU.md for each
/// tensor's shape and the packing of a block in a slot.
/// Per layer `[2, num_blocks, block_tokens, kv_heads, head_dim]` (vLLM).
pub const KVMESH_LAYOUT_NHD: u32 = 0;
/// Per layer `[2, num_blocks, kv_heads, block_tokens, head_dim]`.
pub const KVMESH_LAYOUT_HND: u32 = 1;
/// Per layer `[num_blocks, 2, block_tokens, kv_heads, head_dim]`.
pub const KVMESH_LAYOUT_FLASHINFER: u32 = 2;
/// Per layer `[num_blocks, block_tokens, latent_dim]` (`head_dim` is the
/// latent dimension, `kv_heads` ignored).
pub const KVMESH_LAYOUT_MLA: u32 = 3;
/// One tensor for all layers: `[num_blocks, num_layers, 2, block_tokens,
/// kv_heads, head_dim]`.
pub const KVMESH_LAYOUT_CROSS_LAYER: u32 = 4;
/// Element types (`kvmesh_kv_shape_t.dtype`): bytes are moved, never
/// converted. IEEE half.
pub const KVMESH_DTYPE_F16: u32 = 0;
/// bfloat16.
pub const KVMESH_DTYPE_BF16: u32 = 1;
/// fp8 (e4m3 or e5m2).
pub const KVMESH_DTYPE_FP8: u32 = 2;

/// The shape of an engine's paged KV cache.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvmesh_kv_shape_t {
    /// `KVMESH_LAYOUT_*`.
    pub layout: u32,
    /// `KVMESH_DTYPE_*`.
    pub dtype: u32,
    /// Layers.
    pub num_layers: u64,
    /// Pages (blocks) in each tensor.
    pub num_blocks: u64,
    /// Tokens per block.
    pub block_tokens: u64,
    /// KV heads (ignored for MLA).
    pub kv_heads: u64,
    /// Head dimension, or the latent dimension for MLA.
    pub head_dim: u64,
}

fn shape_arg(shape: *const kvmesh_kv_shape_t) -> Result<PagedKv, Fail> {
    let s = handle(shape, "shape")?;
    let dims = [s.num_layers, s.num_blocks, s.block_tokens, s.kv_heads, s.head_dim];
    PagedKv::from_codes(s.layout, s.dtype, dims).map_err(|e| Fail::invalid(format!("shape: {e}")))
}

/// Copies an array argument of `n` pointers or integers.
fn array_arg<T: Copy>(p: *const T, n: usize, what: &str) -> Result<Vec<T>, Fail> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL with {n} elements")));
    }
    if n > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(Fail::invalid(format!("{what}: {n} elements is too large")));
    }
    // SAFETY: non-null; the caller passes `n` initialised elements readable
    // for the call (documented for every array argument); size checked.
    Ok(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
}

impl From<GpuError> for Fail {
    fn from(e: GpuError) -> Fail {
        let code = match e {
            GpuError::NoDriver(_) | GpuError::NoDevice { .. } | GpuError::Nvrtc(_) | GpuError::Unsupported { .. } => {
                KVMESH_E_NO_DEVICE
            }
            GpuError::Layout(_) | GpuError::Invalid(_) => KVMESH_E_INVALID,
            GpuError::Driver { .. } => KVMESH_E_INTERNAL,
        };
        Fail(code, e.to_string())
    }
}

fn device_arg(device: i32) -> Result<Memory, Fail> {
    Memory::from_code(device)
        .ok_or_else(|| Fail::invalid(format!("device = {device}: KVMESH_DEVICE_HOST (-1) or a CUDA device ordinal")))
}

/// Sizes of a shape: the bytes of one block packed in a slot, the number of
/// engine tensors (layers, or 1 for cross-layer) and the bytes of each.
/// Any output may be NULL.
///
/// # Safety
/// `shape` is readable; non-NULL outputs are writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_kv_sizes(
    shape: *const kvmesh_kv_shape_t,
    block_bytes: *mut u64,
    tensor_count: *mut u64,
    tensor_bytes: *mut u64,
) -> i32 {
    guard("kvmesh_kv_sizes", || {
        let s = shape_arg(shape)?;
        let block = s.block_bytes().map_err(|e| Fail::invalid(e.to_string()))?;
        let (n, bytes) = s.tensors().map_err(|e| Fail::invalid(e.to_string()))?;
        out_opt(block_bytes, block as u64);
        out_opt(tensor_count, n as u64);
        out_opt(tensor_bytes, bytes as u64);
        Ok(KVMESH_OK)
    })
}

#[allow(clippy::too_many_arguments)]
fn kv_move(
    name: &str,
    dir: Direction,
    shape: *const kvmesh_kv_shape_t,
    device: i32,
    tensors: *const *const std::ffi::c_void,
    n_tensors: usize,
    pages: *const u64,
    slots: *const *const std::ffi::c_void,
    n: usize,
    slot_bytes: u64,
) -> i32 {
    guard(name, || {
        let s = shape_arg(shape)?;
        let mem = device_arg(device)?;
        let t: Vec<u64> = array_arg(tensors, n_tensors, "tensors")?.into_iter().map(|p| p as u64).collect();
        let pg = array_arg(pages, n, "pages")?;
        let sl: Vec<u64> = array_arg(slots, n, "slots")?.into_iter().map(|p| p as u64).collect();
        let slot_bytes = usize::try_from(slot_bytes).map_err(|_| Fail::invalid("slot_bytes is too large"))?;
        // The caller vouches (documented on kvmesh_kv_gather and
        // kvmesh_kv_scatter) for the memory behind every pointer, of the kind
        // `device` names and the sizes the shape and `slot_bytes` give,
        // writable where written, not overlapping, for the call.
        // SAFETY: every pointer is the caller's, as documented.
        unsafe { kvmesh_kernels::raw::move_pages(&s, mem, dir, &t, &pg, &sl, slot_bytes) }?;
        Ok(KVMESH_OK)
    })
}

/// Gathers pages of an engine's paged KV cache into slots: for each `i <
/// n`, page `pages[i]` of the tensors is packed into `slots[i]` (see
/// docs/GPU.md for the packing, the same for every layout). `device` is
/// `KVMESH_DEVICE_HOST` (host pointers: runs on the CPU) or a CUDA device
/// ordinal (device pointers of that device: the kernel runs, and the call
/// returns when it finished). Checked before a byte moves: the shape,
/// `n_tensors` (the layers, or 1 for cross-layer), every page < num_blocks,
/// `slot_bytes` >= the block bytes (`kvmesh_kv_sizes`).
///
/// # Safety
/// `shape` is readable; `tensors` holds `n_tensors` pointers to tensors of
/// `kvmesh_kv_sizes`' tensor bytes each; `pages` and `slots` hold `n`
/// elements, each slot `slot_bytes` of writable memory not overlapping the
/// tensors or another slot; all of the memory kind `device` names, and not
/// written by anyone else during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_kv_gather(
    shape: *const kvmesh_kv_shape_t,
    device: i32,
    tensors: *const *const std::ffi::c_void,
    n_tensors: usize,
    pages: *const u64,
    slots: *const *mut std::ffi::c_void,
    n: usize,
    slot_bytes: u64,
) -> i32 {
    kv_move(
        "kvmesh_kv_gather",
        Direction::Gather,
        shape,
        device,
        tensors,
        n_tensors,
        pages,
        slots.cast(),
        n,
        slot_bytes,
    )
}

/// Scatters slots back into pages (the inverse of `kvmesh_kv_gather`): for
/// each `i < n`, `slots[i]` is unpacked into page `pages[i]` of the
/// tensors; nothing else of them is written. Same checks and `device` as
/// the gather.
///
/// # Safety
/// As for `kvmesh_kv_gather`, with the tensors written and the slots read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_kv_scatter(
    shape: *const kvmesh_kv_shape_t,
    device: i32,
    tensors: *const *mut std::ffi::c_void,
    n_tensors: usize,
    pages: *const u64,
    slots: *const *const std::ffi::c_void,
    n: usize,
    slot_bytes: u64,
) -> i32 {
    kv_move(
        "kvmesh_kv_scatter",
        Direction::Scatter,
        shape,
        device,
        tensors.cast(),
        n_tensors,
        pages,
        slots,
        n,
        slot_bytes,
    )
}

/// `kvsum64` (the checksum of blocks in GPU pools, docs/GPU.md) of `len`
/// bytes at `ptr`, into `*out`. `device` as for the gather; on a device the
/// address must be 8-byte aligned.
///
/// # Safety
/// `ptr` points to `len` readable bytes of the memory kind `device` names;
/// `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_kvsum64(device: i32, ptr: *const std::ffi::c_void, len: u64, out: *mut u64) -> i32 {
    guard("kvmesh_kvsum64", || {
        let mem = device_arg(device)?;
        let len = usize::try_from(len).map_err(|_| Fail::invalid("len is too large"))?;
        // SAFETY: the caller vouches for `len` readable bytes at `ptr` of
        // that memory kind (documented); NULL with a length is refused inside.
        let sum = unsafe { kvmesh_kernels::raw::kvsum64(mem, ptr as u64, len) }?;
        put_out(out, sum, "out")?;
        Ok(KVMESH_OK)
    })
}

/// Connects to the local kvmeshd at `socket_path` (NULL: the default path,
/// `$XDG_RUNTIME_DIR/kvmesh/kvmeshd.sock`, else `/tmp/kvmesh-<uid>/kvmeshd.sock`)
/// and maps its pools. On success `*out` is a client to release with
/// `kvmesh_close`.
///
/// # Safety
/// `socket_path` is NULL or a NUL-terminated string; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_open(socket_path: *const c_char, out: *mut *mut kvmesh_client_t) -> i32 {
    guard("kvmesh_open", || {
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        let path = if socket_path.is_null() { None } else { Some(string_arg(socket_path, "socket_path")?) };
        let client = blocking::Client::connect(path.map(Path::new))?;
        let h = Box::new(kvmesh_client_t { client, namespaces: Mutex::new(Vec::new()) });
        out_opt(out, Box::into_raw(h));
        Ok(KVMESH_OK)
    })
}

/// Releases a client (NULL: nothing). Batches and allocations made through
/// it stay usable until released themselves; the connection closes with the
/// last of them, and the daemon then drops every pin and unfinished put of
/// the connection.
///
/// # Safety
/// `client` is NULL or a client from `kvmesh_open` not yet closed; no other
/// thread is using it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_close(client: *mut kvmesh_client_t) {
    guard("kvmesh_close", || {
        if !client.is_null() {
            // SAFETY: `client` came from Box::into_raw in kvmesh_open and is
            // released exactly once (the caller's contract).
            drop(unsafe { Box::from_raw(client) });
        }
        Ok(KVMESH_OK)
    });
}

/// Registers a namespace (or finds the identical existing one): `name` (1 to
/// 256 bytes), `block_bytes` per block, and a `layout` string that
/// fingerprints the KV layout (model, dtype, tensor-parallel shape...).
/// A name registered with another block size or layout: `KVMESH_E_INVALID`.
///
/// # Safety
/// `client` is a live client; `name` and `layout` are NUL-terminated
/// strings; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_register_namespace(
    client: *const kvmesh_client_t,
    name: *const c_char,
    block_bytes: u64,
    layout: *const c_char,
    out: *mut kvmesh_namespace_t,
) -> i32 {
    guard("kvmesh_register_namespace", || {
        let c = handle(client, "client")?;
        let name = string_arg(name, "name")?;
        let layout = string_arg(layout, "layout")?;
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        let ns = c.client.call(c.client.inner().register_namespace(name, block_bytes, layout))?;
        put_out(out, c.remember(&ns), "out")?;
        Ok(KVMESH_OK)
    })
}

/// As `kvmesh_register_namespace`, with the blocks on `device`: `"host"`
/// (or NULL, or "") for host pools, `"cuda:N"` for the daemon's GPU pools on
/// device N. Blocks of a GPU namespace are read with
/// `kvmesh_batch_block_device` and written with `kvmesh_alloc_block_device`
/// (or copied with `kvmesh_get_into` / `kvmesh_put`). A name registered on
/// another device: `KVMESH_E_INVALID`; no pool on that device:
/// `KVMESH_E_INVALID`; a GPU pool this process cannot import (no driver):
/// `KVMESH_E_NO_DEVICE` when its blocks are used.
///
/// # Safety
/// As `kvmesh_register_namespace`; `device` is NULL or a NUL-terminated
/// string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_register_namespace_on(
    client: *const kvmesh_client_t,
    name: *const c_char,
    block_bytes: u64,
    layout: *const c_char,
    device: *const c_char,
    out: *mut kvmesh_namespace_t,
) -> i32 {
    guard("kvmesh_register_namespace_on", || {
        let c = handle(client, "client")?;
        let name = string_arg(name, "name")?;
        let layout = string_arg(layout, "layout")?;
        let device = if device.is_null() { "" } else { string_arg(device, "device")? };
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        let ns = c.client.call(c.client.inner().register_namespace_on(name, block_bytes, layout, device))?;
        put_out(out, c.remember(&ns), "out")?;
        Ok(KVMESH_OK)
    })
}

/// Starts watching the KV events of namespace `ns` on this daemon (see
/// docs/OPERATING.md, "KV events"); with `snapshot` non-zero, the blocks
/// held now come first (`KVMESH_EVENT_SNAPSHOT`). `*out` is released with
/// `kvmesh_events_close`. Too many watchers: `KVMESH_E_EXHAUSTED`.
///
/// # Safety
/// `client` is a live client; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_watch_events(
    client: *const kvmesh_client_t,
    ns: u32,
    snapshot: u32,
    out: *mut *mut kvmesh_events_t,
) -> i32 {
    guard("kvmesh_watch_events", || {
        let c = handle(client, "client")?;
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        let n = c.namespace(ns)?;
        let stream = c.client.call(c.client.inner().watch_events(&n, snapshot != 0))?;
        let e = Box::new(kvmesh_events_t {
            client: c.client.clone(),
            state: Mutex::new(EventsState { stream: Some(stream), pending: Default::default(), node: 0 }),
            cancelled: Default::default(),
            cancel: tokio::sync::Notify::new(),
        });
        put_out(out, Box::into_raw(e), "out")?;
        Ok(KVMESH_OK)
    })
}

/// Takes up to `cap` events into `events`: `*n` of them (0 when
/// `timeout_ms` passed first; `timeout_ms` 0 waits for ever), and the
/// sending daemon's node id in `*node_id` (may be NULL). Events of one
/// batch beyond `cap` are kept for the next call. The watcher cut off (too
/// far behind, or not reading): `KVMESH_E_EXHAUSTED` — watch again with a
/// snapshot; the stream ended (daemon stopping): `KVMESH_E_TRANSPORT`;
/// cancelled (`kvmesh_events_cancel`, before or during the call; events
/// not taken yet are dropped): `KVMESH_E_CANCELLED`, and so every later
/// call. One thread at a time per stream; another thread stops a waiting
/// call with `kvmesh_events_cancel` (`kvmesh_events_close` must not race
/// it: close after the reader returned).
///
/// # Safety
/// `ev` is a live stream; `events` has room for `cap` events; `n` is
/// writable; `node_id` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_events_next(
    ev: *mut kvmesh_events_t,
    timeout_ms: u64,
    events: *mut kvmesh_event_t,
    cap: usize,
    n: *mut usize,
    node_id: *mut u32,
) -> i32 {
    guard("kvmesh_events_next", || {
        let e = handle(ev.cast_const(), "events")?;
        let out = out_slice(events, cap)?.ok_or_else(|| Fail::invalid("events is NULL"))?;
        if n.is_null() || cap == 0 {
            return Err(Fail::invalid("n is NULL or cap is 0"));
        }
        // The daemon sees a cancelled watcher leave now, not at close.
        let cancelled = |st: &mut EventsState| {
            st.stream = None;
            st.pending.clear();
            Fail(KVMESH_E_CANCELLED, "the event stream was cancelled".into())
        };
        let mut st = lock(&e.state, "event stream")?;
        if e.cancelled.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(cancelled(&mut st));
        }
        if st.pending.is_empty() {
            let Some(stream) = st.stream.as_mut() else {
                return Err(Fail(KVMESH_E_TRANSPORT, "the event stream has ended".into()));
            };
            let got = e.client.block_on(async {
                let message = async {
                    if timeout_ms == 0 {
                        Some(stream.message().await)
                    } else {
                        tokio::time::timeout(std::time::Duration::from_millis(timeout_ms), stream.message()).await.ok()
                    }
                };
                tokio::select! {
                    biased;
                    () = e.cancel.notified() => None,
                    got = message => Some(got),
                }
            })?;
            let Some(got) = got else {
                return Err(cancelled(&mut st));
            };
            match got {
                None => {
                    put_out(n, 0, "n")?;
                    return Ok(KVMESH_OK);
                }
                Some(Ok(Some(b))) => {
                    st.node = b.node_id;
                    for x in &b.events {
                        let key = x.key.map(|k| Key::from_parts(k.hi, k.lo)).unwrap_or(Key(0));
                        st.pending.push_back(kvmesh_event_t {
                            kind: x.kind as u32,
                            seq: x.seq,
                            key: key.into(),
                            version: x.version,
                        });
                    }
                }
                Some(Ok(None)) => {
                    st.stream = None;
                    return Err(Fail(KVMESH_E_TRANSPORT, "the event stream ended".into()));
                }
                Some(Err(status)) => {
                    st.stream = None;
                    return Err(ClientError::Rpc(status).into());
                }
            }
        }
        let k = st.pending.len().min(cap);
        for (slot, x) in out.iter_mut().zip(st.pending.drain(..k)) {
            *slot = x;
        }
        put_out(n, k, "n")?;
        out_opt(node_id, st.node);
        Ok(KVMESH_OK)
    })
}

/// Cancels an event stream from any thread: a `kvmesh_events_next` waiting
/// on it returns `KVMESH_E_CANCELLED` at once, and so does every later one
/// (the daemon sees the watcher leave then). The stream still has to be
/// closed, after its reader returned. Idempotent; NULL: nothing.
///
/// # Safety
/// `ev` is NULL or a live stream from `kvmesh_watch_events` (not closed).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_events_cancel(ev: *const kvmesh_events_t) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if let Ok(e) = handle(ev, "events") {
            e.cancelled.store(true, std::sync::atomic::Ordering::SeqCst);
            e.cancel.notify_one();
        }
    }));
}

/// Ends an event stream and releases it (NULL: nothing).
///
/// # Safety
/// `ev` is NULL or a stream from `kvmesh_watch_events`, not used after.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_events_close(ev: *mut kvmesh_events_t) {
    if ev.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ev` came from `Box::into_raw` in `kvmesh_watch_events`
        // and is released exactly once, here (the contract).
        drop(unsafe { Box::from_raw(ev) });
    }));
}

/// A block in GPU memory: `len` bytes at device address `ptr` (in this
/// process) of CUDA device `device`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvmesh_device_block_t {
    /// CUDA device ordinal.
    pub device: i32,
    /// Device address (a `CUdeviceptr`).
    pub ptr: u64,
    /// Bytes of the block.
    pub len: u64,
}

/// Finds a registered namespace by name (`KVMESH_E_NOT_FOUND` if none).
///
/// # Safety
/// `client` is a live client; `name` is a NUL-terminated string; `out` is
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_get_namespace(
    client: *const kvmesh_client_t,
    name: *const c_char,
    out: *mut kvmesh_namespace_t,
) -> i32 {
    guard("kvmesh_get_namespace", || {
        let c = handle(client, "client")?;
        let name = string_arg(name, "name")?;
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        let ns = c.client.call(c.client.inner().namespace(name))?;
        put_out(out, c.remember(&ns), "out")?;
        Ok(KVMESH_OK)
    })
}

/// Which of `n` keys are cached: `*prefix_len` is the number of leading keys
/// all cached; `present` (NULL, or room for `n` bytes) gets 1/0 per key.
/// Pins nothing.
///
/// # Safety
/// `client` is a live client; `keys` holds `n` keys; `prefix_len` is
/// writable; `present` is NULL or writable for `n` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_lookup(
    client: *const kvmesh_client_t,
    ns: u32,
    keys: *const kvmesh_key_t,
    n: usize,
    prefix_len: *mut u32,
    present: *mut u8,
) -> i32 {
    guard("kvmesh_lookup", || {
        let c = handle(client, "client")?;
        let ns = c.namespace(ns)?;
        let keys = keys_arg(keys, n)?;
        if prefix_len.is_null() {
            return Err(Fail::invalid("prefix_len is NULL"));
        }
        let present = out_slice(present, n)?;
        let r = c.client.call(c.client.inner().lookup(&ns, &keys))?;
        if let Some(p) = present {
            for (d, &s) in p.iter_mut().zip(&r.present) {
                *d = s as u8;
            }
        }
        put_out(prefix_len, r.prefix_len, "prefix_len")?;
        Ok(KVMESH_OK)
    })
}

/// Where `n` keys are cached. On a clustered daemon the answer covers the
/// cluster (each key's home is asked; nothing is pinned, granted or moved)
/// unless `flags` has `KVMESH_LOOKUP_LOCAL_ONLY`. `*prefix_len`: leading
/// keys all cached; `nodes` (NULL, or room for `n`): per key the node id
/// (`[node] id`) holding it, or `KVMESH_NODE_NONE`; `info` (NULL or
/// writable): `KVMESH_LOOKUP_CLUSTER_WIDE` | `KVMESH_LOOKUP_COMPLETE`. A
/// key reported at a node was Valid there during the call (unless that
/// node had just dropped it); a later pin may miss.
///
/// # Safety
/// `client` is a live client; `keys` holds `n` keys; `prefix_len` is
/// writable; `nodes` is NULL or writable for `n` values; `info` is NULL
/// or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_lookup_where(
    client: *const kvmesh_client_t,
    ns: u32,
    keys: *const kvmesh_key_t,
    n: usize,
    flags: u32,
    prefix_len: *mut u32,
    nodes: *mut u32,
    info: *mut u32,
) -> i32 {
    guard("kvmesh_lookup_where", || {
        let c = handle(client, "client")?;
        let ns = c.namespace(ns)?;
        let keys = keys_arg(keys, n)?;
        if prefix_len.is_null() {
            return Err(Fail::invalid("prefix_len is NULL"));
        }
        if flags & !KVMESH_LOOKUP_LOCAL_ONLY != 0 {
            return Err(Fail::invalid(format!("flags {flags:#x}: only KVMESH_LOOKUP_LOCAL_ONLY is known")));
        }
        let nodes = out_slice(nodes, n)?;
        let inner = c.client.inner();
        let r = if flags & KVMESH_LOOKUP_LOCAL_ONLY != 0 {
            c.client.call(inner.lookup_local(&ns, &keys))?
        } else {
            c.client.call(inner.lookup(&ns, &keys))?
        };
        if let Some(out) = nodes {
            for (d, s) in out.iter_mut().zip(&r.nodes) {
                *d = s.unwrap_or(KVMESH_NODE_NONE);
            }
        }
        if !info.is_null() {
            let bits =
                (r.cluster_wide as u32 * KVMESH_LOOKUP_CLUSTER_WIDE) | (r.complete as u32 * KVMESH_LOOKUP_COMPLETE);
            put_out(info, bits, "info")?;
        }
        put_out(prefix_len, r.prefix_len, "prefix_len")?;
        Ok(KVMESH_OK)
    })
}

/// Pins the cached keys among `n` for reading in place. `lease_ms` 0 asks
/// the daemon's default lease; `flags` may hold
/// `KVMESH_PIN_STOP_AT_FIRST_MISS`. On success `*out` is a batch: read its
/// blocks with `kvmesh_batch_block`, release it with `kvmesh_unpin`.
///
/// # Safety
/// `client` is a live client; `keys` holds `n` keys; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_pin(
    client: *const kvmesh_client_t,
    ns: u32,
    keys: *const kvmesh_key_t,
    n: usize,
    lease_ms: u64,
    flags: u32,
    out: *mut *mut kvmesh_batch_t,
) -> i32 {
    guard("kvmesh_pin", || {
        let c = handle(client, "client")?;
        let ns = c.namespace(ns)?;
        let keys = keys_arg(keys, n)?;
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        if flags & !KVMESH_PIN_STOP_AT_FIRST_MISS != 0 {
            return Err(Fail::invalid(format!("unknown pin flags {flags:#x}")));
        }
        let opts = PinOptions { lease_ms, stop_at_first_miss: flags & KVMESH_PIN_STOP_AT_FIRST_MISS != 0 };
        let mut blocks = c.client.call(c.client.inner().pin_with(&ns, &keys, opts))?;
        blocks.resize_with(n, || None);
        let b = Box::new(kvmesh_batch_t { client: c.client.clone(), blocks: Mutex::new(blocks) });
        out_opt(out, Box::into_raw(b));
        Ok(KVMESH_OK)
    })
}

/// Number of entries of a batch (the `n` it was pinned with).
///
/// # Safety
/// `batch` is NULL (returns 0) or a live batch.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_batch_len(batch: *const kvmesh_batch_t) -> usize {
    let mut len = 0;
    guard("kvmesh_batch_len", || {
        let b = handle(batch, "batch")?;
        len = lock(&b.blocks, "batch")?.len();
        Ok(KVMESH_OK)
    });
    len
}

/// Number of hits (pinned blocks) of a batch.
///
/// # Safety
/// `batch` is NULL (returns 0) or a live batch.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_batch_hits(batch: *const kvmesh_batch_t) -> usize {
    let mut hits = 0;
    guard("kvmesh_batch_hits", || {
        let b = handle(batch, "batch")?;
        hits = lock(&b.blocks, "batch")?.iter().filter(|x| x.is_some()).count();
        Ok(KVMESH_OK)
    });
    hits
}

/// The bytes of entry `i` of a batch, in place in the daemon's pool:
/// `*data` and `*len` are set on success. A miss: `KVMESH_E_NOT_FOUND`. A
/// lease that has ended: `KVMESH_E_LEASE_EXPIRED` (unpin and pin again).
/// The pointer is valid until `kvmesh_unpin` and only within the lease.
///
/// # Safety
/// `batch` is a live batch; `data` and `len` are writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_batch_block(
    batch: *const kvmesh_batch_t,
    i: usize,
    data: *mut *const u8,
    len: *mut usize,
) -> i32 {
    guard("kvmesh_batch_block", || {
        let b = handle(batch, "batch")?;
        if data.is_null() || len.is_null() {
            return Err(Fail::invalid("data or len is NULL"));
        }
        let blocks = lock(&b.blocks, "batch")?;
        let block = batch_entry(&blocks, i)?;
        if let Some(d) = block.device() {
            return Err(Fail::invalid(format!(
                "entry {i} is in GPU memory (cuda:{}): use kvmesh_batch_block_device",
                d.device
            )));
        }
        put_out(data, block.as_ptr(), "data")?;
        put_out(len, block.len(), "len")?;
        Ok(KVMESH_OK)
    })
}

/// Entry `i` of a batch whose namespace is on a GPU: `*out` is the block's
/// device address in this process (zero copy: the daemon's GPU pool,
/// imported), valid until `kvmesh_unpin` and only within the lease. A miss:
/// `KVMESH_E_NOT_FOUND`; a host block: `KVMESH_E_INVALID` (use
/// `kvmesh_batch_block`).
///
/// # Safety
/// `batch` is a live batch; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_batch_block_device(
    batch: *const kvmesh_batch_t,
    i: usize,
    out: *mut kvmesh_device_block_t,
) -> i32 {
    guard("kvmesh_batch_block_device", || {
        let b = handle(batch, "batch")?;
        let blocks = lock(&b.blocks, "batch")?;
        let block = batch_entry(&blocks, i)?;
        let d = block
            .device()
            .ok_or_else(|| Fail::invalid(format!("entry {i} is in host memory: use kvmesh_batch_block")))?;
        put_out(out, kvmesh_device_block_t { device: d.device as i32, ptr: d.ptr, len: d.len }, "out")?;
        Ok(KVMESH_OK)
    })
}

/// Entry `i` of a batch: a pinned block within its lease, or why not.
fn batch_entry(blocks: &[Option<PinnedBlock>], i: usize) -> Result<&PinnedBlock, Fail> {
    let entry = blocks.get(i).ok_or_else(|| Fail::invalid(format!("index {i} out of a batch of {}", blocks.len())))?;
    let block = entry.as_ref().ok_or_else(|| Fail(KVMESH_E_NOT_FOUND, format!("entry {i} is a miss")))?;
    if block.lease_remaining().is_zero() {
        return Err(Fail(KVMESH_E_LEASE_EXPIRED, format!("the lease of entry {i} has ended")));
    }
    Ok(block)
}

/// Re-reads the whole slot of entry `i` (header, payload, trailer) and
/// checks that it still holds this block with a matching checksum:
/// `KVMESH_OK`, or `KVMESH_E_INTERNAL` with the mismatch in the message.
///
/// # Safety
/// `batch` is a live batch.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_batch_verify(batch: *const kvmesh_batch_t, i: usize) -> i32 {
    guard("kvmesh_batch_verify", || {
        let b = handle(batch, "batch")?;
        let blocks = lock(&b.blocks, "batch")?;
        let block = batch_entry(&blocks, i)?;
        block.verify().map_err(|e| Fail(KVMESH_E_INTERNAL, format!("entry {i} failed validation: {e}")))?;
        Ok(KVMESH_OK)
    })
}

/// Milliseconds left on the batch's lease (the shortest of its pins; 0 when
/// it has ended or the batch holds no pin).
///
/// # Safety
/// `batch` is NULL (returns 0) or a live batch.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_batch_lease_remaining_ms(batch: *const kvmesh_batch_t) -> u64 {
    let mut ms = 0;
    guard("kvmesh_batch_lease_remaining_ms", || {
        let b = handle(batch, "batch")?;
        let blocks = lock(&b.blocks, "batch")?;
        ms = blocks.iter().flatten().map(|b| b.lease_remaining().as_millis() as u64).min().unwrap_or(0);
        Ok(KVMESH_OK)
    });
    ms
}

/// Unpins a batch and releases the handle (NULL: nothing). The handle is
/// released even when the unpin request fails (then the daemon frees the
/// pins at the lease end or when the connection closes).
///
/// # Safety
/// `batch` is NULL or a live batch, not used by another thread, and not
/// used again after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_unpin(batch: *mut kvmesh_batch_t) -> i32 {
    guard("kvmesh_unpin", || {
        if batch.is_null() {
            return Ok(KVMESH_OK);
        }
        // SAFETY: `batch` came from Box::into_raw in kvmesh_pin and is
        // released exactly once (the caller's contract).
        let b = unsafe { Box::from_raw(batch) };
        let blocks: Vec<PinnedBlock> =
            b.blocks.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().flatten().collect();
        if blocks.is_empty() {
            return Ok(KVMESH_OK);
        }
        b.client.call(b.client.inner().unpin(blocks))?;
        Ok(KVMESH_OK)
    })
}

/// Copies cached blocks into `dst` (`n` blocks back to back, `dst_len` must
/// be `n * block_bytes`). `hits` (NULL, or room for `n` bytes) gets 1/0 per
/// key; `*hit_count` (may be NULL) the number of hits. The bytes of a miss
/// are left untouched.
///
/// # Safety
/// `client` is a live client; `keys` holds `n` keys; `dst` is writable for
/// `dst_len` bytes and does not overlap the pool; `hits` is NULL or
/// writable for `n` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_get_into(
    client: *const kvmesh_client_t,
    ns: u32,
    keys: *const kvmesh_key_t,
    n: usize,
    dst: *mut u8,
    dst_len: usize,
    hits: *mut u8,
    hit_count: *mut u32,
) -> i32 {
    guard("kvmesh_get_into", || {
        let c = handle(client, "client")?;
        let ns = c.namespace(ns)?;
        let keys = keys_arg(keys, n)?;
        let want = (n as u64).checked_mul(ns.block_bytes);
        if want != Some(dst_len as u64) {
            return Err(Fail::invalid(format!(
                "dst_len is {dst_len} bytes, expected {n} blocks of {} bytes",
                ns.block_bytes
            )));
        }
        if dst.is_null() && dst_len > 0 {
            return Err(Fail::invalid("dst is NULL"));
        }
        let hits_out = out_slice(hits, n)?;
        let dst = out_slice(dst, dst_len)?.unwrap_or_default();
        let r = c.client.call(c.client.inner().get_into(&ns, &keys, dst))?;
        if let Some(h) = hits_out {
            for (d, &s) in h.iter_mut().zip(&r) {
                *d = s as u8;
            }
        }
        out_opt(hit_count, r.iter().filter(|&&h| h).count() as u32);
        Ok(KVMESH_OK)
    })
}

/// Put, phase one: reserves a slot for each of `n` keys that is absent
/// (with `KVMESH_OVERWRITE` in `flags`: for every key). On success `*out`
/// is an allocation: write each block through `kvmesh_alloc_block`, then
/// `kvmesh_commit` (or `kvmesh_abort`).
///
/// # Safety
/// `client` is a live client; `keys` holds `n` keys; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_allocate(
    client: *const kvmesh_client_t,
    ns: u32,
    keys: *const kvmesh_key_t,
    n: usize,
    flags: u32,
    out: *mut *mut kvmesh_alloc_t,
) -> i32 {
    guard("kvmesh_allocate", || {
        let c = handle(client, "client")?;
        let ns = c.namespace(ns)?;
        let keys = keys_arg(keys, n)?;
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        if flags & !KVMESH_OVERWRITE != 0 {
            return Err(Fail::invalid(format!("unknown allocate flags {flags:#x}")));
        }
        let inner = c.client.inner();
        let allocs = if flags & KVMESH_OVERWRITE != 0 {
            c.client.call(inner.allocate_overwrite(&ns, &keys))?
        } else {
            c.client.call(inner.allocate(&ns, &keys))?
        };
        let a = Box::new(kvmesh_alloc_t { client: c.client.clone(), slots: Mutex::new(allocs) });
        out_opt(out, Box::into_raw(a));
        Ok(KVMESH_OK)
    })
}

/// Number of entries of an allocation (the `n` it was made with).
///
/// # Safety
/// `alloc` is NULL (returns 0) or a live allocation.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_alloc_len(alloc: *const kvmesh_alloc_t) -> usize {
    let mut len = 0;
    guard("kvmesh_alloc_len", || {
        len = lock(&handle(alloc, "alloc")?.slots, "alloc")?.len();
        Ok(KVMESH_OK)
    });
    len
}

/// Entry `i` of an allocation: `KVMESH_OK` with `*data`/`*len` set to the
/// writable slot in the pool (write exactly `*len` bytes, the block size),
/// or the outcome `KVMESH_EXISTS` / `KVMESH_IN_PROGRESS` (nothing to
/// write). The pointer is valid until `kvmesh_commit` or `kvmesh_abort`.
///
/// # Safety
/// `alloc` is a live allocation; `data` and `len` are writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_alloc_block(
    alloc: *const kvmesh_alloc_t,
    i: usize,
    data: *mut *mut u8,
    len: *mut usize,
) -> i32 {
    guard("kvmesh_alloc_block", || {
        let a = handle(alloc, "alloc")?;
        if data.is_null() || len.is_null() {
            return Err(Fail::invalid("data or len is NULL"));
        }
        let mut slots = lock(&a.slots, "alloc")?;
        let n = slots.len();
        match slots.get_mut(i).ok_or_else(|| Fail::invalid(format!("index {i} out of an allocation of {n}")))? {
            Allocation::Allocated(w) if w.device().is_some() => {
                Err(Fail::invalid(format!("entry {i} is in GPU memory: use kvmesh_alloc_block_device")))
            }
            Allocation::Allocated(w) => {
                put_out(data, w.as_mut_ptr(), "data")?;
                put_out(len, w.len(), "len")?;
                Ok(KVMESH_OK)
            }
            Allocation::Exists => Ok(KVMESH_EXISTS),
            Allocation::InProgress => Ok(KVMESH_IN_PROGRESS),
        }
    })
}

/// Entry `i` of an allocation in a GPU namespace: `KVMESH_OK` with `*out`
/// the slot's device address (write exactly `len` bytes there, e.g. with
/// `kvmesh_kv_gather` on that device), or `KVMESH_EXISTS` /
/// `KVMESH_IN_PROGRESS`. Valid until `kvmesh_commit` or `kvmesh_abort`;
/// the commit checksums the block on the GPU. A host slot:
/// `KVMESH_E_INVALID` (use `kvmesh_alloc_block`).
///
/// # Safety
/// `alloc` is a live allocation; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_alloc_block_device(
    alloc: *const kvmesh_alloc_t,
    i: usize,
    out: *mut kvmesh_device_block_t,
) -> i32 {
    guard("kvmesh_alloc_block_device", || {
        let a = handle(alloc, "alloc")?;
        let slots = lock(&a.slots, "alloc")?;
        let n = slots.len();
        match slots.get(i).ok_or_else(|| Fail::invalid(format!("index {i} out of an allocation of {n}")))? {
            Allocation::Allocated(w) => {
                let d = w
                    .device()
                    .ok_or_else(|| Fail::invalid(format!("entry {i} is in host memory: use kvmesh_alloc_block")))?;
                put_out(out, kvmesh_device_block_t { device: d.device as i32, ptr: d.ptr, len: d.len }, "out")?;
                Ok(KVMESH_OK)
            }
            Allocation::Exists => Ok(KVMESH_EXISTS),
            Allocation::InProgress => Ok(KVMESH_IN_PROGRESS),
        }
    })
}

/// Put, phase two: the daemon checksums the written blocks and makes them
/// visible; the handle is released whatever the outcome. `outcomes` (NULL,
/// or room for `kvmesh_alloc_len` entries) gets per entry `KVMESH_OK`
/// (stored), `KVMESH_EXISTS`, `KVMESH_IN_PROGRESS`,
/// `KVMESH_E_LEASE_EXPIRED` (allocation lost: not stored) or
/// `KVMESH_E_REFUSED` (the cluster refused it: not stored); `*stored` (may
/// be NULL) the number stored.
///
/// # Safety
/// `alloc` is NULL or a live allocation, not used by another thread and not
/// used again after this call; `outcomes` is NULL or writable for
/// `kvmesh_alloc_len(alloc)` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_commit(alloc: *mut kvmesh_alloc_t, outcomes: *mut i32, stored: *mut u32) -> i32 {
    guard("kvmesh_commit", || {
        if alloc.is_null() {
            return Err(Fail::invalid("alloc is NULL"));
        }
        // SAFETY: `alloc` came from Box::into_raw in kvmesh_allocate and is
        // released exactly once (the caller's contract).
        let a = unsafe { Box::from_raw(alloc) };
        let slots = a.slots.into_inner().unwrap_or_else(|e| e.into_inner());
        let out_codes = out_slice(outcomes, slots.len())?;
        let mut codes = Vec::with_capacity(slots.len());
        let mut writes = Vec::new();
        for s in slots {
            codes.push(match s {
                Allocation::Allocated(w) => {
                    writes.push(w);
                    KVMESH_OK
                }
                Allocation::Exists => KVMESH_EXISTS,
                Allocation::InProgress => KVMESH_IN_PROGRESS,
            });
        }
        let results = if writes.is_empty() { Vec::new() } else { a.client.call(a.client.inner().commit(writes))? };
        let mut results = results.into_iter();
        let mut n_stored = 0u32;
        let mut first_refusal = None;
        for c in codes.iter_mut().filter(|c| **c == KVMESH_OK) {
            *c = match results.next() {
                Some(CommitOutcome::Committed { .. }) => {
                    n_stored += 1;
                    KVMESH_OK
                }
                Some(CommitOutcome::Refused(why)) => {
                    first_refusal.get_or_insert(why);
                    KVMESH_E_REFUSED
                }
                Some(CommitOutcome::Lost) | None => KVMESH_E_LEASE_EXPIRED,
            };
        }
        if let Some(o) = out_codes {
            o.copy_from_slice(&codes);
        }
        out_opt(stored, n_stored);
        if let Some(why) = first_refusal {
            // Not a failure of the call; the reason, for logs.
            set_last_error(&format!("kvmesh_commit: refused: {why}"));
        }
        Ok(KVMESH_OK)
    })
}

/// Frees the slots of an allocation without storing anything and releases
/// the handle (NULL: nothing).
///
/// # Safety
/// `alloc` is NULL or a live allocation, not used by another thread and not
/// used again after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_abort(alloc: *mut kvmesh_alloc_t) -> i32 {
    guard("kvmesh_abort", || {
        if alloc.is_null() {
            return Ok(KVMESH_OK);
        }
        // SAFETY: `alloc` came from Box::into_raw in kvmesh_allocate and is
        // released exactly once (the caller's contract).
        let a = unsafe { Box::from_raw(alloc) };
        let writes: Vec<WritableBlock> = a
            .slots
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .into_iter()
            .filter_map(|s| match s {
                Allocation::Allocated(w) => Some(w),
                _ => None,
            })
            .collect();
        if !writes.is_empty() {
            a.client.call(a.client.inner().abort(writes))?;
        }
        Ok(KVMESH_OK)
    })
}

/// Stores `n` whole blocks given back to back in `data` (`data_len` must be
/// `n * block_bytes`): allocate, copy into the pool, commit. Keys already
/// cached are left as they are, unless `flags` holds `KVMESH_OVERWRITE`.
/// `summary` (may be NULL) counts the outcomes; the call succeeds even when
/// some blocks were not stored (see the summary).
///
/// # Safety
/// `client` is a live client; `keys` holds `n` keys; `data` is readable for
/// `data_len` bytes; `summary` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_put(
    client: *const kvmesh_client_t,
    ns: u32,
    keys: *const kvmesh_key_t,
    n: usize,
    data: *const u8,
    data_len: usize,
    flags: u32,
    summary: *mut kvmesh_put_summary_t,
) -> i32 {
    guard("kvmesh_put", || {
        let c = handle(client, "client")?;
        let ns = c.namespace(ns)?;
        let keys = keys_arg(keys, n)?;
        if flags & !KVMESH_OVERWRITE != 0 {
            return Err(Fail::invalid(format!("unknown put flags {flags:#x}")));
        }
        if (n as u64).checked_mul(ns.block_bytes) != Some(data_len as u64) {
            return Err(Fail::invalid(format!(
                "data_len is {data_len} bytes, expected {n} blocks of {} bytes",
                ns.block_bytes
            )));
        }
        if data.is_null() && data_len > 0 {
            return Err(Fail::invalid("data is NULL"));
        }
        let bytes: &[u8] = if data_len == 0 {
            &[]
        } else {
            // SAFETY: non-null; the caller passes `data_len` readable bytes
            // valid for the call (documented); isize bound: a C object.
            unsafe { std::slice::from_raw_parts(data, data_len) }
        };
        let bs = ns.block_bytes as usize;
        let blocks: Vec<(Key, &[u8])> =
            keys.iter().enumerate().map(|(i, &k)| (k, &bytes[i * bs..(i + 1) * bs])).collect();
        let inner = c.client.inner();
        let s = if flags & KVMESH_OVERWRITE != 0 {
            c.client.call(inner.put_overwrite(&ns, &blocks))?
        } else {
            c.client.call(inner.put(&ns, &blocks))?
        };
        if let Some(why) = &s.first_refusal {
            set_last_error(&format!("kvmesh_put: refused: {why}"));
        }
        out_opt(
            summary,
            kvmesh_put_summary_t {
                stored: s.stored,
                existed: s.existed,
                in_progress: s.in_progress,
                lost: s.lost,
                refused: s.refused,
            },
        );
        Ok(KVMESH_OK)
    })
}

/// Removes keys from this daemon's cache. `removed` (NULL, or room for `n`
/// bytes) gets 1 per key that was cached; `*count` (may be NULL) their
/// number.
///
/// # Safety
/// `client` is a live client; `keys` holds `n` keys; `removed` is NULL or
/// writable for `n` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_remove(
    client: *const kvmesh_client_t,
    ns: u32,
    keys: *const kvmesh_key_t,
    n: usize,
    removed: *mut u8,
    count: *mut u32,
) -> i32 {
    guard("kvmesh_remove", || {
        let c = handle(client, "client")?;
        let ns = c.namespace(ns)?;
        let keys = keys_arg(keys, n)?;
        let removed = out_slice(removed, n)?;
        let r = c.client.call(c.client.inner().remove(&ns, &keys))?;
        if let Some(o) = removed {
            for (d, &s) in o.iter_mut().zip(&r) {
                *d = s as u8;
            }
        }
        out_opt(count, r.iter().filter(|&&x| x).count() as u32);
        Ok(KVMESH_OK)
    })
}

fn invalidate_done(s: kvmesh_client::InvalidateSummary, summary: *mut kvmesh_invalidate_summary_t) -> i32 {
    out_opt(summary, kvmesh_invalidate_summary_t { invalidated: s.invalidated, failed: s.failed });
    if s.failed > 0 {
        set_last_error(&format!("invalidation of {} keys did not complete: {}", s.failed, s.first_error));
        return KVMESH_E_REFUSED;
    }
    KVMESH_OK
}

/// Makes sure no daemon of the cluster serves the current version of the
/// `n` keys (on a daemon without peers: removes them). `KVMESH_E_REFUSED`
/// when some did not complete before the deadline (`summary->failed`).
///
/// # Safety
/// `client` is a live client; `keys` holds `n` keys; `summary` is NULL or
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_invalidate(
    client: *const kvmesh_client_t,
    ns: u32,
    keys: *const kvmesh_key_t,
    n: usize,
    summary: *mut kvmesh_invalidate_summary_t,
) -> i32 {
    guard("kvmesh_invalidate", || {
        let c = handle(client, "client")?;
        let ns = c.namespace(ns)?;
        let keys = keys_arg(keys, n)?;
        let s = c.client.call(c.client.inner().invalidate(&ns, &keys))?;
        match invalidate_done(s, summary) {
            KVMESH_OK => Ok(KVMESH_OK),
            code => Err(Fail(code, kvmesh_last_error_string())),
        }
    })
}

/// As `kvmesh_invalidate` for every key of the namespace any daemon of the
/// cluster knows.
///
/// # Safety
/// `client` is a live client; `summary` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_invalidate_namespace(
    client: *const kvmesh_client_t,
    ns: u32,
    summary: *mut kvmesh_invalidate_summary_t,
) -> i32 {
    guard("kvmesh_invalidate_namespace", || {
        let c = handle(client, "client")?;
        let ns = c.namespace(ns)?;
        let s = c.client.call(c.client.inner().invalidate_namespace(&ns))?;
        match invalidate_done(s, summary) {
            KVMESH_OK => Ok(KVMESH_OK),
            code => Err(Fail(code, kvmesh_last_error_string())),
        }
    })
}

fn kvmesh_last_error_string() -> String {
    LAST_ERROR.with(|e| e.borrow().to_string_lossy().into_owned())
}

/// The daemon's statistics as one JSON object (NUL-terminated) in `buf` of
/// `cap` bytes. `*needed` (may be NULL) gets the size including the NUL;
/// when `cap` is too small nothing is written and the call fails with
/// `KVMESH_E_INVALID` (call again with `*needed` bytes).
///
/// # Safety
/// `client` is a live client; `buf` is NULL (with `cap` 0) or writable for
/// `cap` bytes; `needed` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_stats_json(
    client: *const kvmesh_client_t,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard("kvmesh_stats_json", || {
        let c = handle(client, "client")?;
        let s = c.client.call(c.client.inner().stats())?;
        let json = kvmesh_client::stats_json(&s);
        out_opt(needed, json.len() + 1);
        if cap < json.len() + 1 || buf.is_null() {
            return Err(Fail::invalid(format!("buffer of {cap} bytes is too small, {} needed", json.len() + 1)));
        }
        let dst = out_slice(buf.cast::<u8>(), cap)?.unwrap_or_default();
        dst[..json.len()].copy_from_slice(json.as_bytes());
        dst[json.len()] = 0;
        Ok(KVMESH_OK)
    })
}

/// Parses 32 hex digits into a key.
///
/// # Safety
/// `hex` is a NUL-terminated string; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_key_parse(hex: *const c_char, out: *mut kvmesh_key_t) -> i32 {
    guard("kvmesh_key_parse", || {
        let s = string_arg(hex, "hex")?;
        let k: Key = s.parse().map_err(|e: kvmesh_common::KeyParseError| Fail::invalid(e.to_string()))?;
        put_out(out, k.into(), "out")?;
        Ok(KVMESH_OK)
    })
}

/// The key of a block of `n` token ids following the block whose key is
/// `*parent` (NULL for the first block of a sequence): xxh3-128 with seed
/// 0x6b766d657368 ("kvmesh") over the parent key's 16 bytes (big-endian:
/// `hi` then `lo`; absent for the first block) followed by each token id as
/// 4 little-endian bytes. The same in every process and language.
///
/// # Safety
/// `parent` is NULL or readable; `tokens` holds `n` token ids; `out` is
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_key_chain(
    parent: *const kvmesh_key_t,
    tokens: *const u32,
    n: usize,
    out: *mut kvmesh_key_t,
) -> i32 {
    guard("kvmesh_key_chain", || {
        // SAFETY: `parent` is NULL or points to a readable key (documented).
        let parent = unsafe { parent.as_ref() }.map(|&k| Key::from(k));
        let toks = tokens_arg(tokens, n)?;
        put_out(out, Key::chain(parent, toks).into(), "out")?;
        Ok(KVMESH_OK)
    })
}

fn tokens_arg<'a>(tokens: *const u32, n: usize) -> Result<&'a [u32], Fail> {
    if n == 0 {
        return Ok(&[]);
    }
    if tokens.is_null() {
        return Err(Fail::invalid(format!("tokens is NULL with n = {n}")));
    }
    if n > isize::MAX as usize / 4 {
        return Err(Fail::invalid(format!("n = {n} tokens is too large")));
    }
    // SAFETY: non-null; the caller passes `n` readable token ids valid for
    // the call (documented); the size was checked against isize::MAX.
    Ok(unsafe { std::slice::from_raw_parts(tokens, n) })
}

/// The keys of the full blocks of a token sequence (`block_tokens` tokens
/// per block, chained as `kvmesh_key_chain`; a trailing partial block has
/// no key). Writes at most `cap` keys to `out`; `*n_keys` gets the number of
/// full blocks (more than `cap`: `KVMESH_E_INVALID`, nothing written).
///
/// # Safety
/// `tokens` holds `n_tokens` ids; `out` is writable for `cap` keys (may be
/// NULL with `cap` 0); `n_keys` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmesh_prefix_keys(
    tokens: *const u32,
    n_tokens: usize,
    block_tokens: usize,
    out: *mut kvmesh_key_t,
    cap: usize,
    n_keys: *mut usize,
) -> i32 {
    guard("kvmesh_prefix_keys", || {
        if block_tokens == 0 {
            return Err(Fail::invalid("block_tokens is 0"));
        }
        let toks = tokens_arg(tokens, n_tokens)?;
        let keys = Key::prefix_keys(toks, block_tokens);
        self::put_out(n_keys, keys.len(), "n_keys")?;
        if keys.len() > cap {
            return Err(Fail::invalid(format!("{} keys do not fit in cap = {cap}", keys.len())));
        }
        if let Some(o) = out_slice(out, keys.len())? {
            for (d, k) in o.iter_mut().zip(keys) {
                *d = k.into();
            }
        } else if !keys.is_empty() {
            return Err(Fail::invalid("out is NULL"));
        }
        Ok(KVMESH_OK)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        kvmesh_last_error_string()
    }

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {})); // keep the test output clean
        let code = guard("kvmesh_test", || panic!("boom {}", 42));
        std::panic::set_hook(prev);
        assert_eq!(code, KVMESH_E_INTERNAL);
        assert!(last_error().contains("kvmesh_test: internal error (panic): boom 42"), "{}", last_error());
    }

    #[test]
    fn failures_set_the_message_of_the_calling_thread_only() {
        assert_eq!(guard("a", || Err(Fail::invalid("first"))), KVMESH_E_INVALID);
        std::thread::spawn(|| {
            assert_eq!(guard("b", || Err(Fail(KVMESH_E_NOT_FOUND, "other thread".into()))), KVMESH_E_NOT_FOUND);
            assert_eq!(last_error(), "b: other thread");
        })
        .join()
        .unwrap();
        assert_eq!(last_error(), "a: first");
    }

    #[test]
    fn null_arguments_are_usage_errors() {
        let mut ns = kvmesh_namespace_t::default();
        // SAFETY: NULL handles and outputs are part of the contract (refused).
        unsafe {
            assert_eq!(kvmesh_get_namespace(std::ptr::null(), c"x".as_ptr(), &mut ns), KVMESH_E_INVALID);
            assert_eq!(kvmesh_open(std::ptr::null(), std::ptr::null_mut()), KVMESH_E_INVALID);
            assert_eq!(kvmesh_batch_len(std::ptr::null()), 0);
            assert_eq!(kvmesh_unpin(std::ptr::null_mut()), KVMESH_OK);
        }
        assert!(last_error().contains("NULL"), "{}", last_error());
    }

    #[test]
    fn every_code_has_a_name() {
        for code in -9..=2 {
            // SAFETY: kvmesh_code_name returns a static NUL-terminated string.
            let name = unsafe { CStr::from_ptr(kvmesh_code_name(code)) }.to_str().unwrap();
            assert!(name.starts_with("KVMESH_") && name != "KVMESH_UNKNOWN_CODE", "{code}: {name}");
        }
        // SAFETY: as above.
        assert_eq!(unsafe { CStr::from_ptr(kvmesh_code_name(99)) }.to_str().unwrap(), "KVMESH_UNKNOWN_CODE");
    }
}
