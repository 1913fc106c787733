//! A safe wrapper over the system UCX (ucp API).
//!
//! Three steps, as in cudarc: `kvmesh-ucx-sys` has the raw bindings; this
//! crate turns each call into a `Result` and each handle into a type that
//! frees itself on drop, in the right order:
//! - [`Context`] (shared, `Send + Sync`) owns the UCX context;
//! - [`MemoryRegion`] (shared) is memory registered with it — here a
//!   [`SharedMapping`] pool, kept alive by the region;
//! - [`Worker`] is single-threaded in UCX, so it is `!Send` and `!Sync`: the
//!   compiler keeps it on the thread that created it;
//! - [`Endpoint`] borrows its worker, [`RemoteKey`] borrows its endpoint, and
//!   [`Request`] borrows its worker, so none can outlive what it needs.
//!
//! A one-sided get writes into registered memory until its request
//! completes; the request keeps that memory mapped (it holds the region).
//! Which bytes of the region a get may overwrite is the caller's protocol:
//! the daemon only reads into slots it has reserved.

use std::ffi::{CStr, CString, c_void};
use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::Arc;

use kvmesh_ffi_os::SharedMapping;
use kvmesh_ucx_sys as sys;

/// A UCX status other than OK.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {message} ({code})")]
pub struct UcxError {
    /// The failing call.
    pub call: &'static str,
    /// UCX status code.
    pub code: i8,
    /// UCX's description.
    pub message: String,
}

impl UcxError {
    /// Whether the operation ended because it was cancelled (by us), as
    /// opposed to failing (a broken connection, say).
    pub fn is_cancelled(&self) -> bool {
        self.code == sys::ucs_status_t::UCS_ERR_CANCELED.0
    }
}

/// The error a status pointer carries (`ucs_ptr_is_err(p)`).
fn ptr_error(call: &'static str, p: sys::ucs_status_ptr_t) -> UcxError {
    let s = sys::ucs_ptr_status(p);
    UcxError { call, code: s.0, message: status_string(s) }
}

fn status_string(s: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated
    // string for every status value.
    unsafe { CStr::from_ptr(sys::ucs_status_string(s)) }.to_string_lossy().into_owned()
}

/// Largest worker address taken from a peer (UCX's are a few hundred
/// bytes).
pub const WORKER_ADDRESS_MAX: usize = 64 << 10;
/// Largest packed remote key taken from a peer.
pub const RKEY_MAX: usize = 16 << 10;
/// Zero bytes after a peer's buffer handed to a UCX parser that takes no
/// length: a packed key's memory-domain entries have one-byte sizes, so
/// 64 domains of 255 bytes end within it.
const PEER_BUFFER_PAD: usize = 32 << 10;

/// A copy of peer bytes for a length-less UCX parser: non-empty, at most
/// `max`, followed by [`PEER_BUFFER_PAD`] zero bytes.
fn padded(call: &'static str, b: &[u8], max: usize) -> Result<Vec<u8>, UcxError> {
    if b.is_empty() || b.len() > max {
        return Err(UcxError {
            call,
            code: sys::ucs_status_t::UCS_ERR_INVALID_PARAM.0,
            message: format!("peer buffer of {} bytes (expected 1 to {max})", b.len()),
        });
    }
    let mut v = Vec::with_capacity(b.len() + PEER_BUFFER_PAD);
    v.extend_from_slice(b);
    v.resize(b.len() + PEER_BUFFER_PAD, 0);
    Ok(v)
}

fn check(call: &'static str, s: sys::ucs_status_t) -> Result<(), UcxError> {
    if s == sys::ucs_status_t::UCS_OK { Ok(()) } else { Err(UcxError { call, code: s.0, message: status_string(s) }) }
}

/// Request parameters with nothing set: no callback (the caller polls),
/// contiguous bytes.
fn empty_param() -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: 0,
        flags: 0,
        request: ptr::null_mut(),
        cb: Default::default(),
        datatype: 0,
        user_data: ptr::null_mut(),
        reply_buffer: ptr::null_mut(),
        memory_type: 0,
        recv_info: Default::default(),
        memh: ptr::null_mut(),
    }
}

/// UCX settings kvmesh changes from UCX's defaults, as `UCX_*` variables:
/// larger tcp segments (UCX: 8K send, 64K receive) mean fewer system calls
/// per block; on loopback they took a raw tag-send loop from ~1.9 to
/// ~3.4 GB/s and the daemon's batches of 256 KiB blocks up by ~30%
/// (docs/DATAPLANE.md). UCX reads transport settings only from the
/// environment (`ucp_config_modify` does not reach them in 1.13).
pub const TUNED_ENV: [(&str, &str); 2] = [("UCX_TCP_RX_SEG_SIZE", "512k"), ("UCX_TCP_TX_SEG_SIZE", "64k")];

/// Tag sends up to 4 MiB go eagerly on tcp (UCX's rendezvous threshold,
/// far lower by default): a holder that pushes a block with its grant
/// (daemon: `peer.push_with_grants`) streams it at once instead of
/// waiting for the getter's thread to answer a rendezvous request. Set
/// (where not set by hand) only for a process whose transports are tcp
/// alone: over RDMA the rendezvous is a zero-copy read. UCX takes it only
/// from the environment (`ucp_config_modify` of `RNDV_THRESH` changed
/// nothing measurable in 1.13).
pub const TCP_EAGER_ENV: (&str, &str) = ("UCX_RNDV_THRESH", "4m");

/// Sets [`TUNED_ENV`] (and, with `tcp_only`, [`TCP_EAGER_ENV`]) where the
/// environment does not already say otherwise, if this process has a single thread (changing the
/// environment while another thread may read it is undefined behaviour):
/// call it in `main` before anything starts a thread, and only where tcp
/// may be used (UCX warns of variables no transport reads). Returns what
/// it set, or why it did not.
pub fn tune_environment(tcp_only: bool) -> Result<Vec<&'static str>, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| format!("/proc/self/status: {e}"))?;
    let threads = status.lines().find_map(|l| l.strip_prefix("Threads:")).map(|v| v.trim().to_string());
    if threads.as_deref() != Some("1") {
        return Err(format!("{} threads already run; UCX settings left as they are", threads.unwrap_or_default()));
    }
    // Both or neither: UCX needs the receive segment at least as large as
    // the send segment, so a value set by hand is never paired with ours.
    let mut wanted: Vec<(&'static str, &'static str)> = Vec::new();
    if !TUNED_ENV.iter().any(|(k, _)| std::env::var_os(k).is_some()) {
        wanted.extend(TUNED_ENV);
    }
    if tcp_only && std::env::var_os(TCP_EAGER_ENV.0).is_none() {
        wanted.push(TCP_EAGER_ENV);
    }
    let mut set = Vec::new();
    for (k, v) in wanted {
        // Only this thread could start another (the count was checked above).
        // SAFETY: the process has one thread: nothing reads the environment concurrently.
        unsafe { std::env::set_var(k, v) };
        set.push(k);
    }
    Ok(set)
}

/// Which transports UCX may use (its `TLS` setting).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transports {
    /// Shared memory on one host: `posix,sysv,cma,self`.
    SharedMemory,
    /// TCP (separate hosts, or loopback): `tcp,self`... UCX needs `self`
    /// only for loopback to its own worker.
    Tcp,
    /// Whatever UCX finds (RDMA on a cluster).
    All,
    /// An explicit `UCX_TLS` list.
    Custom(String),
}

impl Transports {
    /// The `TLS` value for UCX.
    pub fn tls(&self) -> &str {
        match self {
            Transports::SharedMemory => "posix,sysv,cma,self",
            Transports::Tcp => "tcp,self",
            Transports::All => "all",
            Transports::Custom(s) => s,
        }
    }
}

/// A UCX context with RMA and wakeup features.
pub struct Context {
    h: sys::ucp_context_h,
}

// SAFETY: the context is created with `mt_workers_shared`, which makes UCX
// serialise the context-level calls this crate exposes (worker creation,
// memory mapping, rkey packing) across threads.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Creates a context limited to `transports`.
    pub fn new(transports: &Transports) -> Result<Arc<Context>, UcxError> {
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: NULL env prefix and file name select the defaults; config
        // is an out-pointer UCX fills in.
        check("ucp_config_read", unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) })?;
        let tls = CString::new(transports.tls()).map_err(|_| UcxError {
            call: "ucp_config_modify",
            code: 0,
            message: "transport list contains NUL".into(),
        })?;
        // SAFETY: config came from ucp_config_read; both strings are valid
        // NUL-terminated C strings for the duration of the call.
        let modified = unsafe { sys::ucp_config_modify(config, c"TLS".as_ptr(), tls.as_ptr()) };
        if let Err(e) = check("ucp_config_modify(TLS)", modified) {
            // SAFETY: config is released exactly once.
            unsafe { sys::ucp_config_release(config) };
            return Err(e);
        }
        // A multi-threaded worker's lock ([`Worker::new_shared`]): a mutex,
        // not UCX's default spinlock. A thread spinning for a lock whose
        // holder the scheduler took off the core (threads outnumber
        // cores) waited milliseconds: a 2-core VM's cluster-wide lookup
        // P99 went from ~0.5 to 0.7–3.3 ms with the spinlock, 0.45–0.49
        // with the mutex (docs/DATAPLANE.md). `UCX_USE_MT_MUTEX` set by
        // hand wins (ucp_config_read has read it).
        if std::env::var_os("UCX_USE_MT_MUTEX").is_none() {
            // SAFETY: as for TLS above: a live config, two static C strings.
            let modified = unsafe { sys::ucp_config_modify(config, c"USE_MT_MUTEX".as_ptr(), c"y".as_ptr()) };
            if let Err(e) = check("ucp_config_modify(USE_MT_MUTEX)", modified) {
                // SAFETY: config is released exactly once.
                unsafe { sys::ucp_config_release(config) };
                return Err(e);
            }
        }
        let params = sys::ucp_params_t {
            field_mask: (sys::ucp_params_field::UCP_PARAM_FIELD_FEATURES
                | sys::ucp_params_field::UCP_PARAM_FIELD_MT_WORKERS_SHARED)
                .0 as u64,
            features: (sys::ucp_feature::UCP_FEATURE_RMA
                | sys::ucp_feature::UCP_FEATURE_TAG
                | sys::ucp_feature::UCP_FEATURE_AM
                | sys::ucp_feature::UCP_FEATURE_WAKEUP)
                .0 as u64,
            mt_workers_shared: 1,
            ..Default::default()
        };
        let mut h: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: params and config are valid for the call; h is an
        // out-pointer. ucp_init is a static inline around this call.
        let s = unsafe { sys::ucp_init_version(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, config, &mut h) };
        // SAFETY: config is released exactly once, after its last use.
        unsafe { sys::ucp_config_release(config) };
        check("ucp_init", s)?;
        Ok(Arc::new(Context { h }))
    }
}

impl Context {
    /// Whether this UCX build moves CUDA device memory (a build `--with-cuda`;
    /// Debian's has no CUDA transport): `ucp_context_query`'s memory types.
    pub fn cuda_memory(&self) -> Result<bool, UcxError> {
        let mut attr = sys::ucp_context_attr_t {
            field_mask: sys::ucp_context_attr_field_UCP_ATTR_FIELD_MEMORY_TYPES as u64,
            ..Default::default()
        };
        // SAFETY: the context is alive (self); attr is a valid out-struct
        // whose field mask asks only for the memory types.
        check("ucp_context_query", unsafe { sys::ucp_context_query(self.h, &mut attr) })?;
        Ok(attr.memory_types & (1u64 << sys::ucs_memory_type_UCS_MEMORY_TYPE_CUDA) != 0)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and memory region holds an Arc<Context>, so
        // none is alive when the last Arc drops.
        unsafe { sys::ucp_cleanup(self.h) };
    }
}

/// Memory registered with a context (a pool).
pub struct MemoryRegion {
    ctx: Arc<Context>,
    memh: sys::ucp_mem_h,
    base: usize,
    len: usize,
    /// Our pool when we registered it; `None` when UCX allocated the memory
    /// (it is then unmapped by `ucp_mem_unmap`).
    _backing: Option<Arc<SharedMapping>>,
    sysv_id: Option<i32>,
}

// SAFETY: a memory handle is a context-level object (see Context's Send).
unsafe impl Send for MemoryRegion {}
// SAFETY: as above; the region only reads its own fields after creation.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers a whole shared mapping (a pool) with `ctx`.
    pub fn register(ctx: &Arc<Context>, mapping: Arc<SharedMapping>) -> Result<MemoryRegion, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                .0 as u64,
            address: mapping.base_addr() as *mut c_void,
            length: mapping.len() as usize,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: address/length describe a live mapping that this region
        // keeps alive (it holds the Arc) until after ucp_mem_unmap.
        check("ucp_mem_map", unsafe { sys::ucp_mem_map(ctx.h, &params, &mut memh) })?;
        Ok(MemoryRegion {
            ctx: Arc::clone(ctx),
            memh,
            base: mapping.base_addr(),
            len: mapping.len() as usize,
            _backing: Some(mapping),
            sysv_id: None,
        })
    }

    /// Lets UCX allocate `len` bytes (the memory its shared-memory
    /// transports can expose for true one-sided access). When UCX placed it
    /// in a SysV segment, its id is reported ([`MemoryRegion::sysv_id`]) so
    /// other processes can attach the same memory.
    pub fn allocate(ctx: &Arc<Context>, len: usize) -> Result<MemoryRegion, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_FLAGS)
                .0 as u64,
            address: ptr::null_mut(),
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: with ALLOCATE and a NULL address UCX chooses and owns the
        // memory; memh is an out-pointer.
        check("ucp_mem_map(ALLOCATE)", unsafe { sys::ucp_mem_map(ctx.h, &params, &mut memh) })?;
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: (sys::ucp_mem_attr_field::UCP_MEM_ATTR_FIELD_ADDRESS
                | sys::ucp_mem_attr_field::UCP_MEM_ATTR_FIELD_LENGTH)
                .0 as u64,
            ..Default::default()
        };
        // SAFETY: memh is the handle just created; attr is an out-pointer.
        if let Err(e) = check("ucp_mem_query", unsafe { sys::ucp_mem_query(memh, &mut attr) }) {
            // SAFETY: unmapped once, on the context that mapped it.
            unsafe { sys::ucp_mem_unmap(ctx.h, memh) };
            return Err(e);
        }
        let base = attr.address as usize;
        // Prefault UCX's mapping (peers' one-sided reads and our receives go
        // through it) now, not on the data path — with huge pages where the
        // kernel allows, so advised before the first fault.
        let prefault = match std::ptr::NonNull::new(attr.address.cast::<u8>()) {
            Some(p) => {
                // SAFETY: base..base+length is the live read-write allocation
                // UCX just made for us (unmapped only by Drop, or below).
                unsafe { kvmesh_ffi_os::shm::advise_huge_and_prefault(p, attr.length) }.map_err(|e| e.to_string())
            }
            None => Err("UCX allocated at address 0".to_string()),
        };
        if let Err(message) = prefault {
            // SAFETY: unmapped once, on the context that mapped it.
            unsafe { sys::ucp_mem_unmap(ctx.h, memh) };
            return Err(UcxError { call: "prefault", code: sys::ucs_status_t::UCS_ERR_NO_MEMORY.0, message });
        }
        Ok(MemoryRegion {
            ctx: Arc::clone(ctx),
            memh,
            base,
            len: attr.length,
            _backing: None,
            sysv_id: sysv_id_of(base),
        })
    }

    /// Checks that `offset..offset+len` lies inside the region.
    fn check_range(&self, call: &'static str, offset: usize, len: usize) -> Result<(), UcxError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(UcxError {
                call,
                code: 0,
                message: format!("{offset}+{len} lies outside the {}-byte region", self.len),
            });
        }
        Ok(())
    }

    /// The SysV shared memory id of UCX-allocated memory, if it is one.
    pub fn sysv_id(&self) -> Option<i32> {
        self.sysv_id
    }

    /// Address of the first byte, as remote peers must name it.
    pub fn base(&self) -> u64 {
        self.base as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The remote key peers need to read this region, packed.
    pub fn pack_rkey(&self) -> Result<Vec<u8>, UcxError> {
        let mut buf: *mut c_void = ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: memh belongs to ctx; buf/size are out-pointers.
        check("ucp_rkey_pack", unsafe { sys::ucp_rkey_pack(self.ctx.h, self.memh, &mut buf, &mut size) })?;
        // SAFETY: UCX returned `size` readable bytes at `buf`.
        let v = unsafe { std::slice::from_raw_parts(buf as *const u8, size) }.to_vec();
        // SAFETY: buf came from ucp_rkey_pack and is released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(v)
    }
}

/// A region UCX allocated, seen as 64-bit words that are only ever
/// accessed atomically (here, and by peers that map it): a lookup table
/// this process writes while peers read it.
pub struct RegionWords(Arc<MemoryRegion>);

impl RegionWords {
    /// The words of `region`; `None` unless UCX allocated it (memory this
    /// process registered may be accessed non-atomically elsewhere) and it
    /// is 8-byte aligned.
    pub fn new(region: Arc<MemoryRegion>) -> Option<RegionWords> {
        (region._backing.is_none() && region.base.is_multiple_of(8)).then_some(RegionWords(region))
    }

    /// The region.
    pub fn region(&self) -> &Arc<MemoryRegion> {
        &self.0
    }
}

impl std::ops::Deref for RegionWords {
    type Target = [std::sync::atomic::AtomicU64];
    fn deref(&self) -> &[std::sync::atomic::AtomicU64] {
        let r = &self.0;
        // UCX allocated `len` bytes at `base` for this region; nothing else in
        // this process touches UCX-allocated table memory, and peers only read
        // it, so every access is an atomic word access.
        // SAFETY: mapped until the region drops (we hold its Arc past this
        // borrow), `base` 8-aligned (checked in `new`), accessed atomically.
        unsafe { std::slice::from_raw_parts(r.base as *const std::sync::atomic::AtomicU64, r.len / 8) }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: memh was mapped on ctx, which this region keeps alive.
        // Requests using the region hold an Arc to it, so none is in flight.
        unsafe { sys::ucp_mem_unmap(self.ctx.h, self.memh) };
    }
}

/// The SysV segment id of the mapping starting at `base`, read from
/// `/proc/self/maps` (a SysV mapping is named `/SYSV<key>` and its inode
/// column is the shmid).
fn sysv_id_of(base: usize) -> Option<i32> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    for line in maps.lines() {
        let mut cols = line.split_whitespace();
        let range = cols.next()?;
        let start = usize::from_str_radix(range.split('-').next()?, 16).ok()?;
        if start != base {
            continue;
        }
        let inode = cols.nth(3)?; // perms, offset, dev, inode
        let path = cols.next().unwrap_or("");
        if path.starts_with("/SYSV") {
            return inode.parse().ok();
        }
        return None;
    }
    None
}

/// Whether `len` bytes from `addr` are mapped readable in this process by
/// one mapping of one object: a single mapping, or mappings that follow
/// each other and map the same file (device, inode, path) at following
/// offsets — never a neighbouring mapping of something else, which could
/// go away while the range is read. From `/proc/self/maps`; `false` when
/// it cannot be read (the range is then not used).
fn mapped_readable(addr: usize, len: usize) -> bool {
    let Some(end) = addr.checked_add(len) else { return false };
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return false };
    let mut covered = addr;
    // (device, inode, path, file offset where the next mapping must start)
    let mut object: Option<(String, String, String, u64)> = None;
    for line in maps.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() < 5 {
            continue;
        }
        let Some((lo, hi)) = cols[0].split_once('-') else { continue };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) else { continue };
        if !(lo <= covered && covered < hi) {
            continue;
        }
        let Ok(offset) = u64::from_str_radix(cols[2], 16) else { return false };
        let (dev, inode, path) = (cols[3].to_string(), cols[4].to_string(), cols.get(5).unwrap_or(&"").to_string());
        // (Anonymous memory cannot be told apart: one mapping only.)
        if let Some((d, i, p, next)) = &object
            && (inode == "0" || (d, i, p) != (&dev, &inode, &path) || *next != offset)
        {
            return false;
        }
        if !cols[1].starts_with('r') {
            return false;
        }
        let next = offset + (hi - lo) as u64;
        object = Some((dev, inode, path, next));
        covered = hi;
        if covered >= end {
            return true;
        }
    }
    false
}

/// A UCX worker: progress engine and endpoint factory. Single-threaded.
pub struct Worker {
    ctx: Arc<Context>,
    h: sys::ucp_worker_h,
    /// Where the active-message handlers put what arrives (boxed: the
    /// handlers hold its address; freed after the worker is destroyed).
    inbox: Box<AmInbox>,
    /// One per accepted id (boxed: UCX holds their addresses, which must
    /// not move when the vector grows; freed after the worker is
    /// destroyed).
    #[allow(clippy::vec_box)]
    handlers: std::cell::RefCell<Vec<Box<AmHandler>>>,
    /// Created in UCX's multi-threaded mode ([`Worker::new_shared`]): its
    /// endpoints hand out [`AmSender`]s.
    shared: bool,
    /// Unique in the process (a worker's address may be reused after it
    /// is destroyed): what [`Worker::adopt`] compares.
    id: u64,
    /// The shared handles of its endpoints, nulled before the worker is
    /// destroyed (an endpoint leaked rather than dropped never nulls its
    /// own).
    shared_eps: std::cell::RefCell<Vec<std::sync::Weak<SharedEp>>>,
    _not_send: PhantomData<*const ()>,
}

/// Active messages received and not yet taken (with their ids), and the
/// inbox's limit.
///
/// Locked, not a `RefCell`: UCX runs the handler inside the call that
/// delivers a message, which for an endpoint to the worker's own address
/// (the `self` transport) is the send itself, on whichever thread sent
/// it ([`AmSender`]).
struct AmInbox {
    msgs: std::sync::Mutex<std::collections::VecDeque<(u16, Vec<u8>)>>,
    /// Messages refused (too long, rendezvous, inbox full).
    dropped: std::sync::atomic::AtomicU64,
    max_msgs: std::sync::atomic::AtomicUsize,
}

impl AmInbox {
    fn msgs(&self) -> std::sync::MutexGuard<'_, std::collections::VecDeque<(u16, Vec<u8>)>> {
        self.msgs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What UCX passes the handler of one id.
struct AmHandler {
    /// The worker's inbox (lives as long as the worker).
    inbox: *const AmInbox,
    id: u16,
    max_len: usize,
}

/// The active-message handler: copies an eager message into the inbox.
/// Called by UCX from `ucp_worker_progress` on the worker's thread, with
/// `arg` = one of the worker's boxed handlers (those boxes and the inbox
/// live until after `ucp_worker_destroy`; outside progress the inbox is
/// only borrowed briefly).
// SAFETY: unsafe to call: only UCX calls it, with the argument registered
// in `Worker::accept_am` and the pointers of one received message.
unsafe extern "C" fn am_recv(
    arg: *mut c_void,
    _header: *const c_void,
    _header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is a live boxed handler registered by `accept_am`.
    let handler = unsafe { &*(arg as *const AmHandler) };
    // SAFETY: the handler's inbox is the worker's boxed inbox, alive while
    // the worker (and so this registration) is.
    let inbox = unsafe { &*handler.inbox };
    // SAFETY: UCX passes a valid parameter struct for the callback's span.
    let attr = unsafe { (*param).recv_attr };
    let rndv = attr & sys::ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0;
    let mut msgs = inbox.msgs();
    let full = msgs.len() >= inbox.max_msgs.load(std::sync::atomic::Ordering::Relaxed);
    if rndv || length > handler.max_len || full {
        // Returning OK drops the message (a rendezvous descriptor too).
        inbox.dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return sys::ucs_status_t::UCS_OK;
    }
    let bytes = if length == 0 {
        Vec::new()
    } else {
        // SAFETY: without the rendezvous flag, `data` points to `length`
        // received bytes valid until the callback returns.
        unsafe { std::slice::from_raw_parts(data as *const u8, length) }.to_vec()
    };
    msgs.push_back((handler.id, bytes));
    sys::ucs_status_t::UCS_OK
}

impl Worker {
    /// Creates a single-threaded worker.
    pub fn new(ctx: &Arc<Context>) -> Result<Worker, UcxError> {
        Worker::create(ctx, false)
    }

    /// Creates a worker in UCX's multi-threaded mode: still driven by one
    /// thread (progress, requests, receives: `Worker` stays `!Send`), but
    /// its endpoints' [`AmSender`]s send active messages from any thread.
    /// Fails where UCX was built without thread support (it would hand
    /// back a single-threaded worker).
    pub fn new_shared(ctx: &Arc<Context>) -> Result<Worker, UcxError> {
        let w = Worker::create(ctx, true)?;
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: sys::ucp_worker_attr_field::UCP_WORKER_ATTR_FIELD_THREAD_MODE.0 as u64,
            ..Default::default()
        };
        // SAFETY: the worker is alive; attr is an out-struct whose mask asks
        // for the thread mode only.
        check("ucp_worker_query", unsafe { sys::ucp_worker_query(w.h, &mut attr) })?;
        if attr.thread_mode != sys::ucs_thread_mode_t_UCS_THREAD_MODE_MULTI {
            return Err(UcxError {
                call: "ucp_worker_create",
                code: sys::ucs_status_t::UCS_ERR_UNSUPPORTED.0,
                message: "UCX gave no multi-threaded worker (built without --enable-mt?)".into(),
            });
        }
        Ok(w)
    }

    fn create(ctx: &Arc<Context>, shared: bool) -> Result<Worker, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_THREAD_MODE.0 as u64,
            thread_mode: if shared {
                sys::ucs_thread_mode_t_UCS_THREAD_MODE_MULTI
            } else {
                sys::ucs_thread_mode_t_UCS_THREAD_MODE_SINGLE
            },
            ..Default::default()
        };
        let mut h: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: params is valid; h is an out-pointer.
        check("ucp_worker_create", unsafe { sys::ucp_worker_create(ctx.h, &params, &mut h) })?;
        let inbox =
            Box::new(AmInbox { msgs: Default::default(), dropped: Default::default(), max_msgs: Default::default() });
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Worker {
            ctx: Arc::clone(ctx),
            h,
            inbox,
            handlers: Default::default(),
            shared,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            shared_eps: Default::default(),
            _not_send: PhantomData,
        })
    }

    /// Takes over a send another thread started on one of this worker's
    /// endpoints ([`AmSender::send`]): the request is then polled, and
    /// completes, here. A send of another worker is handed back.
    pub fn adopt(&self, mut p: PendingSend) -> Result<Request<'_>, PendingSend> {
        if p.worker != self.id {
            return Err(p);
        }
        let buf = p.buf.take();
        // Never an error: `AmSender::send` returns errors itself.
        Ok(Request {
            ptr: p.ptr,
            done: None,
            call: "ucp_am_send_nbx",
            worker: self,
            _region: None,
            _buf: buf,
            tag_recv: false,
            received: None,
        })
    }

    /// Accepts active messages with `id` of at most `max_len` bytes sent
    /// eagerly (see [`Endpoint::am_send`]); at most `max_msgs` (of every
    /// id, the last value set) wait to be taken. Others are dropped and
    /// counted ([`Worker::am_dropped`]).
    pub fn accept_am(&self, id: u16, max_len: usize, max_msgs: usize) -> Result<(), UcxError> {
        self.inbox.max_msgs.store(max_msgs, std::sync::atomic::Ordering::Relaxed);
        let handler = Box::new(AmHandler { inbox: &*self.inbox, id, max_len });
        let param = sys::ucp_am_handler_param_t {
            field_mask: (sys::ucp_am_handler_param_field_UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::ucp_am_handler_param_field_UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::ucp_am_handler_param_field_UCP_AM_HANDLER_PARAM_FIELD_ARG
                | sys::ucp_am_handler_param_field_UCP_AM_HANDLER_PARAM_FIELD_FLAGS) as u64,
            id: id as u32,
            flags: sys::ucp_am_cb_flags_UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(am_recv),
            arg: &*handler as *const AmHandler as *mut c_void,
        };
        // The handler box (kept below) and the inbox are dropped after the
        // worker is destroyed.
        // SAFETY: the argument (the boxed handler) outlives the registration; `am_recv` matches ucp_am_recv_callback_t.
        check("ucp_worker_set_am_recv_handler", unsafe { sys::ucp_worker_set_am_recv_handler(self.h, &param) })?;
        self.handlers.borrow_mut().push(handler);
        Ok(())
    }

    /// Whether active messages wait to be taken.
    pub fn am_pending(&self) -> bool {
        !self.inbox.msgs().is_empty()
    }

    /// Takes the active messages received so far, oldest first, with
    /// their ids.
    pub fn take_am(&self) -> Vec<(u16, Vec<u8>)> {
        self.inbox.msgs().drain(..).collect()
    }

    /// Active messages dropped so far (too long, not eager, inbox full).
    pub fn am_dropped(&self) -> u64 {
        self.inbox.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The worker's address, for peers to connect to.
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: out-pointers; the worker is alive.
        check("ucp_worker_get_address", unsafe { sys::ucp_worker_get_address(self.h, &mut addr, &mut len) })?;
        // SAFETY: UCX returned `len` readable bytes at `addr`.
        let v = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: released once, with the worker that produced it.
        unsafe { sys::ucp_worker_release_address(self.h, addr) };
        Ok(v)
    }

    /// Makes progress on outstanding operations; returns how many events
    /// were processed.
    pub fn progress(&self) -> u32 {
        // SAFETY: the worker is alive and used on its own thread (!Send).
        unsafe { sys::ucp_worker_progress(self.h) }
    }

    /// File descriptor that becomes readable when the worker has events
    /// (after [`Worker::arm`] returned true).
    pub fn event_fd(&self) -> Result<RawFd, UcxError> {
        let mut fd: i32 = -1;
        // SAFETY: out-pointer; the worker was created with WAKEUP.
        check("ucp_worker_get_efd", unsafe { sys::ucp_worker_get_efd(self.h, &mut fd) })?;
        Ok(fd)
    }

    /// Arms the event fd. `Ok(false)` means events are pending: progress
    /// again before sleeping.
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: the worker is alive.
        let s = unsafe { sys::ucp_worker_arm(self.h) };
        if s == sys::ucs_status_t::UCS_ERR_BUSY {
            return Ok(false);
        }
        check("ucp_worker_arm", s)?;
        Ok(true)
    }

    /// Posts a receive of exactly-tagged `tag` (up to `len` bytes) into
    /// `dst` at `offset`.
    pub fn tag_recv(
        &self,
        dst: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        tag: u64,
    ) -> Result<Request<'_>, UcxError> {
        dst.check_range("ucp_tag_recv_nbx", offset, len)?;
        // Always a request (never completed in place), so the received
        // length can be read from it.
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t::UCP_OP_ATTR_FLAG_NO_IMM_CMPL.0,
            ..empty_param()
        };
        let dst_ptr = (dst.base + offset) as *mut c_void;
        // SAFETY: dst_ptr..+len lies in a registered region the Request keeps alive until
        // completion (a dropped request is cancelled and waited for).
        let p = unsafe { sys::ucp_tag_recv_nbx(self.h, dst_ptr, len, tag, u64::MAX, &param) };
        let mut r = Request::from_status_ptr("ucp_tag_recv_nbx", p, self, Some(Arc::clone(dst)))?;
        r.tag_recv = true;
        Ok(r)
    }

    /// Connects to a peer worker by its address. With `peer_failure`,
    /// requests to a dead peer fail instead of hanging — UCX 1.13 supports
    /// that on tcp and RDMA transports but not on shared memory (posix,
    /// sysv), where connecting that way is refused.
    pub fn connect(&self, remote: &[u8], peer_failure: bool) -> Result<Endpoint<'_>, UcxError> {
        let remote = padded("ucp_ep_create", remote, WORKER_ADDRESS_MAX)?;
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE)
                .0 as u64,
            address: remote.as_ptr() as *const sys::ucp_address_t,
            err_mode: if peer_failure {
                sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_NONE
            },
            ..Default::default()
        };
        let mut h: sys::ucp_ep_h = ptr::null_mut();
        // `remote` is a peer's claim of its worker address, which UCX
        // parses without a length; a short or truncated one is read inside
        // the padding (zero lengths end UCX's walk); one crafted to declare
        // longer fields is parsed as UCX parses any peer's (peers are
        // authenticated first, docs/SECURITY.md).
        // SAFETY: `remote` (bounded, zero-padded by `padded`) outlives the
        // call, which only reads it; `h` is an out-pointer.
        check("ucp_ep_create", unsafe { sys::ucp_ep_create(self.h, &params, &mut h) })?;
        let shared = self.shared.then(|| {
            let ep = Arc::new(SharedEp { h: std::sync::RwLock::new(EpHandle(h)), worker: self.id });
            let mut eps = self.shared_eps.borrow_mut();
            eps.retain(|w| w.strong_count() > 0);
            eps.push(Arc::downgrade(&ep));
            ep
        });
        Ok(Endpoint { worker: self, h, peer_failure, shared })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        for ep in self.shared_eps.get_mut().drain(..).filter_map(|w| w.upgrade()) {
            ep.close();
        }
        // SAFETY: endpoints and requests borrow the worker, so none is alive.
        unsafe { sys::ucp_worker_destroy(self.h) };
        let _ = &self.ctx;
    }
}

/// A connection to one peer worker.
pub struct Endpoint<'w> {
    worker: &'w Worker,
    h: sys::ucp_ep_h,
    peer_failure: bool,
    /// The handle [`AmSender`]s use (a multi-threaded worker's endpoints
    /// only); nulled under its write lock before the endpoint closes.
    shared: Option<Arc<SharedEp>>,
}

/// A `ucp_ep_h` that [`AmSender`]s of other threads read.
struct EpHandle(sys::ucp_ep_h);

struct SharedEp {
    /// Null once the endpoint began closing (or its worker, being
    /// destroyed).
    h: std::sync::RwLock<EpHandle>,
    /// Its worker's [`Worker::id`].
    worker: u64,
}

impl SharedEp {
    fn close(&self) {
        self.h.write().unwrap_or_else(|e| e.into_inner()).0 = ptr::null_mut();
    }
}

// The endpoint handle belongs to a worker in UCX's multi-threaded mode,
// whose calls UCX serialises with the worker's lock; `Endpoint::drop`
// (before closing it) and `Worker::drop` (before destroying the worker, for
// endpoints leaked instead of dropped) null it under the write lock.
// SAFETY: the handle is used only under the read lock while not null, so no
// thread uses a closed endpoint.
unsafe impl Send for SharedEp {}
// SAFETY: as for Send: every use of the handle is under the lock above.
unsafe impl Sync for SharedEp {}

/// Sends active messages on one endpoint of a multi-threaded worker from
/// any thread ([`Endpoint::am_sender`]): the message leaves at once, no
/// wake-up of the worker's thread. Once the endpoint closes, sends fail
/// with `UCS_ERR_NOT_CONNECTED`.
#[derive(Clone)]
pub struct AmSender {
    ep: Arc<SharedEp>,
}

/// What [`AmSender::send`] did.
#[must_use]
pub enum AmSent {
    /// UCX took the bytes at once: nothing to wait for.
    Done,
    /// In flight: hand it to the worker's thread ([`Worker::adopt`]),
    /// whose progress completes it.
    InFlight(PendingSend),
}

/// A send started by [`AmSender::send`] and not finished. Dropped without
/// [`Worker::adopt`], its request and bytes are leaked (UCX may still read
/// the bytes, and the request is freed only on the worker's thread).
#[must_use = "a send UCX has not finished: hand it to its worker (Worker::adopt)"]
pub struct PendingSend {
    ptr: *mut c_void,
    buf: Option<Box<[u8]>>,
    /// Its worker's [`Worker::id`].
    worker: u64,
}

// SAFETY: the pointers are only carried to the worker's own thread, which
// alone polls and frees the request ([`Worker::adopt`]); on any other
// thread the value is only moved or leaked.
unsafe impl Send for PendingSend {}

impl Drop for PendingSend {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            // Not adopted: UCX may still read the bytes; never freed.
            std::mem::forget(b);
        }
    }
}

/// Starts an eager active-message send of `data` (no header) as `id` on
/// `ep`: UCX's status pointer, and the bytes, which must stay alive (heap
/// memory: moving the box does not move them) until a returned request
/// completes.
///
/// # Safety
/// `ep` is an open endpoint, and its worker may be called on this thread
/// (its own thread, or any thread for a multi-threaded worker).
// SAFETY: an `unsafe fn` — every caller shows `ep` open and its worker
// callable on that thread (the `# Safety` contract above); the body's own
// unsafe blocks state what they rely on.
unsafe fn am_send_eager(ep: sys::ucp_ep_h, id: u16, data: Vec<u8>) -> (sys::ucs_status_ptr_t, Box<[u8]>) {
    let param = sys::ucp_request_param_t {
        op_attr_mask: sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS.0,
        flags: sys::ucp_send_am_flags_UCP_AM_SEND_FLAG_EAGER,
        ..empty_param()
    };
    let buf = data.into_boxed_slice();
    // (`buf` is returned to the caller, who keeps it until completion.)
    // SAFETY: the caller vouches for `ep`; `buf` holds the bytes UCX
    // reads until completion; `param` lives for the call.
    let p = unsafe {
        sys::ucp_am_send_nbx(ep, id as u32, ptr::null(), 0, buf.as_ptr() as *const c_void, buf.len(), &param)
    };
    (p, buf)
}

impl AmSender {
    /// Sends `data` as active message `id`, eagerly (as
    /// [`Endpoint::am_send`]), from the calling thread.
    pub fn send(&self, id: u16, data: Vec<u8>) -> Result<AmSent, UcxError> {
        let h = self.ep.h.read().unwrap_or_else(|e| e.into_inner());
        if h.0.is_null() {
            return Err(UcxError {
                call: "ucp_am_send_nbx",
                code: sys::ucs_status_t::UCS_ERR_NOT_CONNECTED.0,
                message: "endpoint closed".into(),
            });
        }
        // (buf is freed below only when UCX returned no request.)
        // SAFETY: the endpoint is open (not null, read lock held across the
        // call) on a multi-threaded worker, which serialises the call.
        let (p, buf) = unsafe { am_send_eager(h.0, id, data) };
        drop(h);
        if p.is_null() {
            return Ok(AmSent::Done);
        }
        if sys::ucs_ptr_is_err(p) {
            return Err(ptr_error("ucp_am_send_nbx", p));
        }
        Ok(AmSent::InFlight(PendingSend { ptr: p, buf: Some(buf), worker: self.ep.worker }))
    }
}

impl<'w> Endpoint<'w> {
    /// Unpacks a peer's packed remote key for use on this endpoint. Drop
    /// remote keys before their endpoint (declare them first in a struct
    /// that holds both).
    pub fn unpack_rkey(&self, packed: &[u8]) -> Result<RemoteKey<'w>, UcxError> {
        let packed = padded("ucp_ep_rkey_unpack", packed, RKEY_MAX)?;
        let mut h: sys::ucp_rkey_h = ptr::null_mut();
        // The call takes no length: `padded` bounds the peer's key and
        // appends more zero bytes than a packed key's fields (one-byte
        // sizes per memory domain) can reach past its end.
        // SAFETY: `packed` outlives the call, which only reads it within
        // the padding; `h` is an out-pointer.
        check("ucp_ep_rkey_unpack", unsafe {
            sys::ucp_ep_rkey_unpack(self.h, packed.as_ptr() as *const c_void, &mut h)
        })?;
        Ok(RemoteKey { h, _ep: PhantomData, words: None })
    }

    /// Starts a one-sided read of `len` bytes at `remote_addr` (covered by
    /// `rkey`) into `dst` at `offset`.
    pub fn get(
        &self,
        dst: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey<'_>,
    ) -> Result<Request<'w>, UcxError> {
        dst.check_range("ucp_get_nbx", offset, len)?;
        let param = empty_param();
        let dst_ptr = (dst.base + offset) as *mut c_void;
        // SAFETY: dst_ptr..+len lies in a registered region the Request keeps alive until
        // completion; rkey belongs to this endpoint; no callback, so UCX returns a request.
        let p = unsafe { sys::ucp_get_nbx(self.h, dst_ptr, len, remote_addr, rkey.h, &param) };
        Request::from_status_ptr("ucp_get_nbx", p, self.worker, Some(Arc::clone(dst)))
    }

    /// Starts sending `len` bytes of `src` at `offset` to the peer with
    /// `tag` (tag-matched; UCX uses rendezvous for large messages).
    pub fn tag_send(
        &self,
        src: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        tag: u64,
    ) -> Result<Request<'w>, UcxError> {
        src.check_range("ucp_tag_send_nbx", offset, len)?;
        let param = empty_param();
        let src_ptr = (src.base + offset) as *const c_void;
        // SAFETY: src_ptr..+len lies in a registered region the Request keeps alive until
        // completion; no callback, so UCX returns a request to poll.
        let p = unsafe { sys::ucp_tag_send_nbx(self.h, src_ptr, len, tag, &param) };
        Request::from_status_ptr("ucp_tag_send_nbx", p, self.worker, Some(Arc::clone(src)))
    }

    /// Sends `data` as active message `id`, eagerly (no rendezvous: the
    /// receiver's handler gets the bytes in its callback).
    pub fn am_send(&self, id: u16, data: Vec<u8>) -> Result<Request<'w>, UcxError> {
        // (The endpoint borrows the !Send worker: used on its thread.)
        // SAFETY: the endpoint is open (closed only in Drop), on its worker's
        // thread; buf is owned by the returned Request until it completes.
        let (p, buf) = unsafe { am_send_eager(self.h, id, data) };
        let mut r = Request::from_status_ptr("ucp_am_send_nbx", p, self.worker, None)?;
        r._buf = Some(buf);
        Ok(r)
    }

    /// A handle that sends active messages on this endpoint from any
    /// thread; `None` unless the worker is multi-threaded
    /// ([`Worker::new_shared`]).
    pub fn am_sender(&self) -> Option<AmSender> {
        self.shared.as_ref().map(|ep| AmSender { ep: Arc::clone(ep) })
    }

    /// What UCX chose for this endpoint (transports, lanes), as text.
    pub fn describe(&self) -> String {
        let mut buf: *mut libc::c_char = ptr::null_mut();
        let mut size: libc::size_t = 0;
        // SAFETY: open_memstream returns a FILE* writing into a malloc'ed
        // buffer that we read and free after fclose.
        let f = unsafe { libc::open_memstream(&mut buf, &mut size) };
        if f.is_null() {
            return String::from("(ucp_ep_print_info unavailable)");
        }
        // SAFETY: f is a valid FILE*; the bindings' FILE is the same C type.
        unsafe { sys::ucp_ep_print_info(self.h, f as *mut sys::FILE) };
        // SAFETY: f is closed once; afterwards buf/size are final.
        unsafe { libc::fclose(f) };
        // SAFETY: buf holds `size` bytes written by UCX (NUL-terminated).
        let s = unsafe { std::slice::from_raw_parts(buf as *const u8, size) };
        let text = String::from_utf8_lossy(s).into_owned();
        // SAFETY: buf was malloc'ed by open_memstream and is freed once.
        unsafe { libc::free(buf as *mut c_void) };
        text
    }
}

impl Drop for Endpoint<'_> {
    fn drop(&mut self) {
        if let Some(shared) = &self.shared {
            // No sender of another thread is inside a call on it from here on.
            shared.close();
        }
        // A forced close needs peer failure handling on both sides; without
        // it, close by flushing (bounded below).
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS.0,
            flags: if self.peer_failure { sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE } else { 0 },
            ..empty_param()
        };
        // SAFETY: the endpoint is closed exactly once; a forced close fails
        // its outstanding requests instead of waiting for the peer.
        let p = unsafe { sys::ucp_ep_close_nbx(self.h, &param) };
        if let Ok(mut r) = Request::from_status_ptr("ucp_ep_close_nbx", p, self.worker, None) {
            for _ in 0..1_000_000 {
                if r.poll().is_some() {
                    break;
                }
                self.worker.progress();
            }
        }
    }
}

/// A peer's remote key, unpacked on one endpoint of worker `'w`.
pub struct RemoteKey<'w> {
    h: sys::ucp_rkey_h,
    _ep: PhantomData<&'w Worker>,
    /// Words of the peer's memory handed out through this key's mapping
    /// ([`RemoteKey::map_words`]): closed, and waited for, before the key
    /// (and so the mapping) goes.
    words: Option<Arc<RemoteWords>>,
}

/// Words of a peer's memory mapped in this process (shared memory), read
/// from any thread while the remote key that mapped them lives: each read
/// ([`RemoteWords::with`]) is counted, and the key's drop closes the words
/// and waits for reads in progress before it unmaps them.
pub struct RemoteWords {
    ptr: *const std::sync::atomic::AtomicU64,
    len: usize,
    users: std::sync::atomic::AtomicUsize,
    closed: std::sync::atomic::AtomicBool,
}

// SAFETY: the words are only read through `with`, which checks that the
// mapping is alive (`closed` and `users` are atomics), from any thread.
unsafe impl Send for RemoteWords {}
// SAFETY: as above: shared reads of atomics only.
unsafe impl Sync for RemoteWords {}

impl RemoteWords {
    /// Runs `f` on the words while they are mapped; `None` once the key
    /// that mapped them is gone (or going). Keep `f` short: the key's drop
    /// waits for it.
    pub fn with<R>(&self, f: impl FnOnce(&[std::sync::atomic::AtomicU64]) -> R) -> Option<R> {
        use std::sync::atomic::Ordering::SeqCst;
        struct Leave<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, SeqCst);
            }
        }
        self.users.fetch_add(1, SeqCst);
        let _leave = Leave(&self.users);
        if self.closed.load(SeqCst) {
            return None;
        }
        // The key's drop sets `closed`, then waits for `users` to reach 0
        // before destroying the key; `map_words` checked the words lie in one
        // mapping here and are 8-aligned; a peer writes them only atomically.
        // SAFETY: `closed` was false after `users` counted this read, so the
        // words stay mapped until `_leave` drops; accessed atomically.
        let words = unsafe { std::slice::from_raw_parts(self.ptr, self.len) };
        Some(f(words))
    }

    /// Words mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (`map_words` maps at least one word).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl RemoteKey<'_> {
    /// Where the peer's byte at `remote_addr` is mapped in this process,
    /// when a shared-memory transport reaches the peer's memory through a
    /// mapping of its own (UCX attaches the segment when the key is
    /// unpacked; `ucp_rkey_ptr`); `None` for memory reached another way
    /// (cma, tcp, RDMA). The mapping lives as long as this key.
    pub fn local_address(&self, remote_addr: u64) -> Option<usize> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `h` is a live key (destroyed only in Drop); the call
        // only writes the address it finds into `p`.
        let s = unsafe { sys::ucp_rkey_ptr(self.h, remote_addr, &mut p) };
        (s == sys::ucs_status_t::UCS_OK && !p.is_null()).then_some(p as usize)
    }

    /// Whether the peer's claimed extent (`bytes` at `remote_addr`) is all
    /// mapped readable in this process, where UCX reads it through a local
    /// mapping (shared memory: `ucp_rkey_ptr` only adds an offset, and a
    /// read past the segment would fault the reading thread); `None` where
    /// this process does not map it (the transport reads the peer's
    /// memory through the peer, which checks its own registration).
    pub fn maps_extent(&self, remote_addr: u64, bytes: u64) -> Option<bool> {
        let first = self.local_address(remote_addr)?;
        if bytes == 0 {
            return Some(true);
        }
        let contiguous = remote_addr
            .checked_add(bytes - 1)
            .and_then(|end| self.local_address(end))
            .and_then(|last| last.checked_sub(first))
            .is_some_and(|d| d as u64 == bytes - 1);
        Some(contiguous && usize::try_from(bytes).is_ok_and(|n| mapped_readable(first, n)))
    }

    /// The peer's `bytes` at `remote_addr` as words other threads may read
    /// while this key lives ([`RemoteWords`]); `None` where this process
    /// does not map them (not shared memory), they are not 8-aligned, not
    /// all mapped readable here (the length is the peer's claim: UCX's
    /// `ucp_rkey_ptr` on shared memory only adds an offset, so the extent
    /// is checked against this process's mappings), or this key already
    /// mapped words.
    pub fn map_words(&mut self, remote_addr: u64, bytes: u64) -> Option<Arc<RemoteWords>> {
        if self.words.is_some() || bytes < 8 || !bytes.is_multiple_of(8) {
            return None;
        }
        let first = self.local_address(remote_addr)?;
        if !first.is_multiple_of(8) || self.maps_extent(remote_addr, bytes) != Some(true) {
            return None;
        }
        let w = Arc::new(RemoteWords {
            ptr: first as *const std::sync::atomic::AtomicU64,
            len: (bytes / 8) as usize,
            users: std::sync::atomic::AtomicUsize::new(0),
            closed: std::sync::atomic::AtomicBool::new(false),
        });
        self.words = Some(Arc::clone(&w));
        Some(w)
    }
}

/// Longest a remote key's drop waits for reads of its words to end before
/// it leaks the key (and its mapping) instead of unmapping it under them.
const WORDS_DRAIN_MAX: std::time::Duration = std::time::Duration::from_secs(1);

impl Drop for RemoteKey<'_> {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::SeqCst;
        if let Some(w) = &self.words {
            w.closed.store(true, SeqCst);
            let t0 = std::time::Instant::now();
            while w.users.load(SeqCst) != 0 {
                if t0.elapsed() > WORDS_DRAIN_MAX {
                    // A reader stuck inside `with`: keep the mapping (a leak,
                    // never an unmap under a reader).
                    return;
                }
                std::thread::yield_now();
            }
        }
        // SAFETY: destroyed once, while its worker is alive (it borrows it);
        // nobody reads words of its mapping any more (closed and drained).
        unsafe { sys::ucp_rkey_destroy(self.h) };
    }
}

/// An operation in flight (or already complete).
pub struct Request<'w> {
    ptr: *mut c_void,
    done: Option<Result<(), UcxError>>,
    call: &'static str,
    worker: &'w Worker,
    _region: Option<Arc<MemoryRegion>>,
    /// The bytes an active message sends, kept until it completes.
    _buf: Option<Box<[u8]>>,
    /// A tag receive: completion is read with its received length.
    tag_recv: bool,
    received: Option<usize>,
}

impl<'w> Request<'w> {
    fn from_status_ptr(
        call: &'static str,
        p: sys::ucs_status_ptr_t,
        worker: &'w Worker,
        region: Option<Arc<MemoryRegion>>,
    ) -> Result<Request<'w>, UcxError> {
        if p.is_null() {
            return Ok(Request {
                ptr: ptr::null_mut(),
                done: Some(Ok(())),
                call,
                worker,
                _region: region,
                _buf: None,
                tag_recv: false,
                received: None,
            });
        }
        if sys::ucs_ptr_is_err(p) {
            return Err(ptr_error(call, p));
        }
        Ok(Request { ptr: p, done: None, call, worker, _region: region, _buf: None, tag_recv: false, received: None })
    }

    /// `None` while in flight, then the outcome (repeatable).
    pub fn poll(&mut self) -> Option<Result<(), UcxError>> {
        if self.done.is_none() {
            let mut info = sys::ucp_tag_recv_info { sender_tag: 0, length: 0 };
            let s = if self.tag_recv {
                // SAFETY: ptr is a live tag-receive request not yet freed;
                // info is an out-pointer.
                unsafe { sys::ucp_tag_recv_request_test(self.ptr, &mut info) }
            } else {
                // SAFETY: ptr is a live request returned by UCX and not yet freed.
                unsafe { sys::ucp_request_check_status(self.ptr) }
            };
            if s == sys::ucs_status_t::UCS_INPROGRESS {
                return None;
            }
            if self.tag_recv && s == sys::ucs_status_t::UCS_OK {
                self.received = Some(info.length);
            }
            // SAFETY: the request completed; it is freed exactly once.
            unsafe { sys::ucp_request_free(self.ptr) };
            self.ptr = ptr::null_mut();
            self.done = Some(check(self.call, s));
        }
        self.done.clone()
    }

    /// Bytes a completed tag receive got (a sender may send fewer than the
    /// receive allowed); `None` for other requests or before completion.
    pub fn received(&self) -> Option<usize> {
        self.received
    }

    /// Asks UCX to cancel the operation (it then completes with an error).
    pub fn cancel(&mut self) {
        if self.done.is_none() {
            // SAFETY: ptr is a live request of this worker.
            unsafe { sys::ucp_request_cancel(self.worker.h, self.ptr) };
        }
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        if self.done.is_some() {
            return;
        }
        // Never leave UCX writing into memory we may reuse: cancel and wait.
        self.cancel();
        for _ in 0..10_000_000 {
            if self.poll().is_some() {
                return;
            }
            self.worker.progress();
        }
        // Still running: leak the region Arc and the buffer so the memory
        // stays valid.
        if let Some(r) = self._region.take() {
            std::mem::forget(r);
        }
        if let Some(b) = self._buf.take() {
            std::mem::forget(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(bytes: u64) -> Arc<SharedMapping> {
        Arc::new(SharedMapping::create("ucx-test", bytes, false).unwrap())
    }

    /// Two workers in one process, shared memory: a real one-sided get.
    #[test]
    fn get_between_two_workers_over_shared_memory() {
        for t in [Transports::SharedMemory, Transports::Tcp] {
            let ctx = Context::new(&t).unwrap();
            let (a, b) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
            let src = pool(1 << 20);
            src.copy_in(4096, b"kvmesh block bytes").unwrap();
            let dst = pool(1 << 20);
            let src_mr = Arc::new(MemoryRegion::register(&ctx, Arc::clone(&src)).unwrap());
            let dst_mr = Arc::new(MemoryRegion::register(&ctx, Arc::clone(&dst)).unwrap());
            let ep = a.connect(&b.address().unwrap(), t == Transports::Tcp).unwrap();
            eprintln!("{t:?}: {}", ep.describe());
            let rkey = ep.unpack_rkey(&src_mr.pack_rkey().unwrap()).unwrap();
            let mut req = ep.get(&dst_mr, 100, 18, src_mr.base() + 4096, &rkey).unwrap();
            let mut spins = 0;
            let res = loop {
                if let Some(r) = req.poll() {
                    break r;
                }
                a.progress();
                b.progress();
                spins += 1;
                assert!(spins < 10_000_000, "get never completed over {t:?}");
            };
            res.unwrap();
            let mut out = [0u8; 18];
            dst.copy_out(100, &mut out).unwrap();
            assert_eq!(&out, b"kvmesh block bytes", "{t:?}");
            assert!(ep.describe().len() > 10);
            // Out-of-range destination is refused before UCX sees it.
            assert!(ep.get(&dst_mr, (1 << 20) - 4, 18, src_mr.base(), &rkey).is_err());
            drop(rkey);
            drop(ep);
        }
    }

    /// A UCX-allocated region written as words is read, through a peer
    /// endpoint's remote key, from another thread (shared memory); once
    /// the key drops, the words refuse reads. Over tcp there is no mapping.
    #[test]
    fn region_words_are_read_through_a_remote_keys_mapping() {
        use std::sync::atomic::Ordering::Relaxed;
        for t in [Transports::SharedMemory, Transports::Tcp] {
            let ctx = Context::new(&t).unwrap();
            let (a, b) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
            let mr = Arc::new(MemoryRegion::allocate(&ctx, 1 << 16).unwrap());
            let words = RegionWords::new(Arc::clone(&mr)).expect("UCX allocated it");
            assert_eq!(words.len(), (1 << 16) / 8);
            words[3].store(0xfeed, Relaxed);
            assert!(RegionWords::new(Arc::new(MemoryRegion::register(&ctx, pool(1 << 16)).unwrap())).is_none());
            let ep = a.connect(&b.address().unwrap(), t == Transports::Tcp).unwrap();
            let mut rkey = ep.unpack_rkey(&mr.pack_rkey().unwrap()).unwrap();
            let Some(remote) = rkey.map_words(mr.base(), mr.len() as u64) else {
                assert_eq!(t, Transports::Tcp, "shared memory maps the region");
                continue;
            };
            assert_ne!(t, Transports::Tcp);
            assert!(rkey.map_words(mr.base(), 8).is_none(), "one mapping per key");
            // A length past what is mapped (a peer's wrong claim) is refused.
            let mut other = ep.unpack_rkey(&mr.pack_rkey().unwrap()).unwrap();
            assert!(other.map_words(mr.base(), 1 << 40).is_none(), "a claimed extent beyond the mapping");
            assert!(other.map_words(mr.base(), (1 << 16) + 4096).is_none(), "one page past the mapping");
            assert!(other.map_words(mr.base(), 1 << 16).is_some());
            drop(other);
            assert_eq!(remote.len(), (1 << 16) / 8);
            let seen = std::thread::scope(|sc| sc.spawn(|| remote.with(|w| w[3].load(Relaxed))).join().unwrap());
            assert_eq!(seen, Some(0xfeed));
            words[3].store(0xbeef, Relaxed);
            assert_eq!(remote.with(|w| w[3].load(Relaxed)), Some(0xbeef), "the same memory");
            drop(rkey);
            assert_eq!(remote.with(|w| w[3].load(Relaxed)), None, "closed with its key");
            drop(ep);
        }
    }

    /// Sends `msgs` as `id` from a thread of its own; what UCX did not
    /// finish is adopted by `w` (the sender's worker).
    fn send_from_another_thread<'w>(w: &'w Worker, sender: &AmSender, id: u16, msgs: &[Vec<u8>]) -> Vec<Request<'w>> {
        let pending: Vec<PendingSend> = std::thread::scope(|s| {
            s.spawn(|| {
                msgs.iter()
                    .filter_map(|m| match sender.send(id, m.clone()).unwrap() {
                        AmSent::Done => None,
                        AmSent::InFlight(p) => Some(p),
                    })
                    .collect()
            })
            .join()
            .unwrap()
        });
        pending.into_iter().map(|p| w.adopt(p).ok().expect("its own worker adopts a send")).collect()
    }

    /// A multi-threaded worker's endpoint sends active messages from
    /// another thread; a send UCX did not finish is completed where the
    /// worker runs; once the endpoint closes, senders are refused, not
    /// handed a closed endpoint. A single-threaded worker gives no sender.
    #[test]
    fn am_sender_sends_from_another_thread_until_the_endpoint_closes() {
        for t in [Transports::SharedMemory, Transports::Tcp] {
            let ctx = Context::new(&t).unwrap();
            let (a, b) = (Worker::new_shared(&ctx).unwrap(), Worker::new(&ctx).unwrap());
            b.accept_am(9, 1 << 16, 1024).unwrap();
            let ep = a.connect(&b.address().unwrap(), t == Transports::Tcp).unwrap();
            assert!(b.connect(&a.address().unwrap(), t == Transports::Tcp).unwrap().am_sender().is_none());
            let sender = ep.am_sender().expect("a shared worker's endpoint has a sender");
            let msgs: Vec<Vec<u8>> =
                (0..64u32).map(|i| (0..(i * 97) % 4000).map(|j| (i + j) as u8).collect()).collect();
            let mut reqs = send_from_another_thread(&a, &sender, 9, &msgs);
            let mut got = Vec::new();
            let mut spins = 0u64;
            while got.len() < msgs.len() || reqs.iter_mut().any(|r| r.poll().is_none()) {
                a.progress();
                b.progress();
                got.extend(b.take_am());
                spins += 1;
                assert!(spins < 10_000_000, "{t:?}: {} of {} messages arrived", got.len(), msgs.len());
            }
            for r in &mut reqs {
                r.poll().unwrap().unwrap();
            }
            let want: Vec<(u16, Vec<u8>)> = msgs.iter().map(|m| (9, m.clone())).collect();
            assert_eq!(got, want, "{t:?}: messages lost or out of order");
            // Another worker's send is refused.
            let other = Worker::new_shared(&ctx).unwrap();
            let ep2 = other.connect(&b.address().unwrap(), t == Transports::Tcp).unwrap();
            let s2 = ep2.am_sender().unwrap();
            if let AmSent::InFlight(p) = s2.send(9, vec![1; 8]).unwrap() {
                let p = a.adopt(p).err().expect("a send of another worker adopted");
                let mut r = other.adopt(p).ok().expect("its own worker adopts it");
                let mut spins = 0u64;
                while r.poll().is_none() {
                    other.progress();
                    b.progress();
                    spins += 1;
                    assert!(spins < 10_000_000, "{t:?}: the adopted send never completed");
                }
            }
            drop(ep);
            let e = sender.send(9, b"late".to_vec()).err().expect("a send on a closed endpoint");
            assert_eq!(e.code, sys::ucs_status_t::UCS_ERR_NOT_CONNECTED.0, "{t:?}: {e}");
            drop(ep2);
        }
    }

    /// A message to the worker's own address is delivered inside the send
    /// (UCX's `self` transport), on the sending thread: the inbox takes it
    /// there. An endpoint leaked instead of dropped is closed to its
    /// senders when its worker goes.
    #[test]
    fn am_sender_to_its_own_worker_and_past_a_leaked_endpoint() {
        for t in [Transports::SharedMemory, Transports::Tcp] {
            let ctx = Context::new(&t).unwrap();
            let a = Worker::new_shared(&ctx).unwrap();
            a.accept_am(3, 1 << 12, 1024).unwrap();
            let ep = a.connect(&a.address().unwrap(), t == Transports::Tcp).unwrap();
            let sender = ep.am_sender().unwrap();
            let msgs: Vec<Vec<u8>> = (0..16u8).map(|i| vec![i; 100]).collect();
            let mut reqs = send_from_another_thread(&a, &sender, 3, &msgs);
            let mut got = Vec::new();
            let mut spins = 0u64;
            while got.len() < 16 || reqs.iter_mut().any(|r| r.poll().is_none()) {
                a.progress();
                got.extend(a.take_am());
                spins += 1;
                assert!(spins < 10_000_000, "{t:?}: {} of 16 messages to itself arrived", got.len());
            }
            let want: Vec<(u16, Vec<u8>)> = msgs.iter().map(|m| (3, m.clone())).collect();
            assert_eq!(got, want, "{t:?}");
            drop(reqs);
            std::mem::forget(ep);
            drop(a);
            let e = sender.send(3, b"after the worker".to_vec()).err().expect("a send past its worker");
            assert_eq!(e.code, sys::ucs_status_t::UCS_ERR_NOT_CONNECTED.0, "{t:?}: {e}");
        }
    }

    /// Tag send/receive between two workers (rendezvous for large sizes).
    #[test]
    fn tag_send_recv_moves_bytes() {
        for t in [Transports::SharedMemory, Transports::Tcp] {
            let ctx = Context::new(&t).unwrap();
            let (a, b) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
            let src = pool(4 << 20);
            let dst = pool(4 << 20);
            let pattern: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
            src.copy_in(8192, &pattern).unwrap();
            let src_mr = Arc::new(MemoryRegion::register(&ctx, Arc::clone(&src)).unwrap());
            let dst_mr = Arc::new(MemoryRegion::register(&ctx, Arc::clone(&dst)).unwrap());
            let mut recv = b.tag_recv(&dst_mr, 4096, 1 << 20, 42).unwrap();
            let ep = a.connect(&b.address().unwrap(), t == Transports::Tcp).unwrap();
            let mut send = ep.tag_send(&src_mr, 8192, 1 << 20, 42).unwrap();
            let mut spins = 0u64;
            while recv.poll().is_none() || send.poll().is_none() {
                a.progress();
                b.progress();
                spins += 1;
                assert!(spins < 100_000_000, "tag transfer never completed over {t:?}");
            }
            recv.poll().unwrap().unwrap();
            send.poll().unwrap().unwrap();
            let mut out = vec![0u8; 1 << 20];
            dst.copy_out(4096, &mut out).unwrap();
            assert_eq!(out, pattern, "{t:?}");
            // A receive nobody sends to can be cancelled.
            let mut orphan = b.tag_recv(&dst_mr, 0, 4096, 7).unwrap();
            orphan.cancel();
            let mut spins = 0;
            while orphan.poll().is_none() {
                b.progress();
                spins += 1;
                assert!(spins < 1_000_000);
            }
            assert!(orphan.poll().unwrap().is_err());
            drop(ep);
        }
    }

    /// Active messages arrive in the receiver's inbox in order, with their
    /// ids; ones over their id's limit are dropped and counted. A tag
    /// receive reports how many bytes the sender sent (zero for an empty
    /// message).
    #[test]
    fn active_messages_and_received_lengths() {
        for t in [Transports::SharedMemory, Transports::Tcp] {
            let ctx = Context::new(&t).unwrap();
            let (a, b) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
            b.accept_am(7, 4096, 16).unwrap();
            b.accept_am(8, 100, 16).unwrap();
            let ep = a.connect(&b.address().unwrap(), t == Transports::Tcp).unwrap();
            let mut sends: Vec<_> = vec![
                ep.am_send(7, b"first".to_vec()).unwrap(),
                ep.am_send(8, b"other id".to_vec()).unwrap(),
                ep.am_send(8, vec![3u8; 200]).unwrap(),
                ep.am_send(7, vec![1u8; 3000]).unwrap(),
                ep.am_send(7, vec![2u8; 5000]).unwrap(),
            ];
            let mut got = Vec::new();
            let mut spins = 0u64;
            while got.len() < 3 || b.am_dropped() < 2 || sends.iter_mut().any(|r| r.poll().is_none()) {
                a.progress();
                b.progress();
                got.extend(b.take_am());
                spins += 1;
                assert!(spins < 10_000_000, "active messages never arrived over {t:?}");
            }
            assert_eq!(got.len(), 3, "{t:?}");
            assert_eq!(got[0], (7, b"first".to_vec()));
            assert_eq!(got[1], (8, b"other id".to_vec()));
            assert_eq!(got[2], (7, vec![1u8; 3000]));
            assert_eq!(b.am_dropped(), 2, "the 5000-byte and the 200-byte messages are over their limits");

            let src = Arc::new(MemoryRegion::register(&ctx, pool(1 << 20)).unwrap());
            let dst = Arc::new(MemoryRegion::register(&ctx, pool(1 << 20)).unwrap());
            let mut full = b.tag_recv(&dst, 0, 65536, 1).unwrap();
            let mut empty = b.tag_recv(&dst, 65536, 65536, 2).unwrap();
            assert_eq!(full.received(), None);
            let mut s1 = ep.tag_send(&src, 0, 65536, 1).unwrap();
            let mut s2 = ep.tag_send(&src, 0, 0, 2).unwrap();
            let mut spins = 0u64;
            while [&mut full, &mut empty, &mut s1, &mut s2].into_iter().any(|r| r.poll().is_none()) {
                a.progress();
                b.progress();
                spins += 1;
                assert!(spins < 10_000_000, "tag messages never arrived over {t:?}");
            }
            full.poll().unwrap().unwrap();
            empty.poll().unwrap().unwrap();
            assert_eq!(full.received(), Some(65536), "{t:?}");
            assert_eq!(empty.received(), Some(0), "{t:?}");
            drop(ep);
        }
    }

    /// UCX's own pool allocation is advised huge before it is prefaulted,
    /// so where the kernel allows shmem huge pages the pool gets them.
    #[test]
    fn allocated_pools_get_huge_pages_where_the_kernel_allows_them() {
        if !kvmesh_ffi_os::shm::shmem_huge_pages_allowed_here() {
            eprintln!(
                "SKIPPED allocated_pools_get_huge_pages_where_the_kernel_allows_them: shared-memory huge pages \
                 are off here (shmem_enabled = {})",
                kvmesh_ffi_os::shm::shmem_huge_mode()
            );
            return;
        }
        let ctx = Context::new(&Transports::SharedMemory).unwrap();
        let mr = MemoryRegion::allocate(&ctx, 32 << 20).unwrap();
        let huge = kvmesh_ffi_os::shm::huge_mapped_bytes(mr.base() as usize);
        assert!(huge >= 2 << 20, "UCX-allocated pool: {huge} bytes in huge pages (SysV id {:?})", mr.sysv_id());
    }

    #[test]
    fn unknown_transport_is_an_error_not_a_crash() {
        let e = Context::new(&Transports::Custom("no-such-transport".into()))
            .err()
            .expect("UCX accepted a bogus transport");
        assert_eq!(e.call, "ucp_init");
        assert!(!e.message.is_empty());
    }
}
