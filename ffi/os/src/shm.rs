//! Shared memory mappings of block pools.
//!
//! A pool is one memfd, mapped `MAP_SHARED` by the daemon and by each engine
//! that connects. Two kinds of aliasing matter:
//! - inside one process, Rust references into the mapping must follow the
//!   borrow rules. [`SharedMapping`] enforces them at run time with a claim
//!   table: any number of [`ReadRegion`]s may overlap each other, a
//!   [`WriteRegion`] overlaps nothing. A conflicting claim is an error, never
//!   an aliased `&mut`.
//! - across processes, who may write which bytes when is the kvmesh pin
//!   protocol: the daemon never hands out a slot for writing while anyone
//!   holds a pin on it, and never reuses a pinned or allocated slot (see
//!   docs/ARCHITECTURE.md). The `// SAFETY:` comments below rely on it.

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};
use parking_lot::Mutex;

/// Errors of shared-memory operations.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A system call failed.
    #[error("{call} failed: {errno}")]
    Sys {
        /// The call.
        call: &'static str,
        /// Its errno.
        errno: nix::errno::Errno,
    },
    /// A mapping of size zero was asked for.
    #[error("cannot map 0 bytes")]
    Empty,
    /// A region lies (partly) outside the mapping.
    #[error("region {offset}+{len} lies outside the {size}-byte mapping")]
    OutOfBounds {
        /// Start of the region.
        offset: u64,
        /// Length of the region.
        len: u64,
        /// Size of the mapping.
        size: u64,
    },
    /// A region overlaps a region already claimed in a conflicting mode.
    #[error("region {offset}+{len} is already claimed ({mode}) in this process")]
    Conflict {
        /// Start of the region.
        offset: u64,
        /// Length of the region.
        len: u64,
        /// Mode of the existing claim.
        mode: &'static str,
    },
}

fn sys(call: &'static str) -> impl FnOnce(nix::errno::Errno) -> ShmError {
    move |errno| ShmError::Sys { call, errno }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Read,
    Write,
}

/// Claimed ranges, keyed by (start, end) with a count for identical read
/// claims.
#[derive(Default)]
struct Claims {
    ranges: BTreeMap<(u64, u64), (Mode, u32)>,
    longest: u64,
}

impl Claims {
    fn claim(&mut self, start: u64, end: u64, mode: Mode) -> Result<(), ShmError> {
        // Any overlapping range starts before `end` and after `start - longest`.
        let lo = start.saturating_sub(self.longest);
        for (&(s, e), &(m, _)) in self.ranges.range((lo, 0)..(end, 0)) {
            if s < end && start < e && (mode == Mode::Write || m == Mode::Write) {
                return Err(ShmError::Conflict {
                    offset: start,
                    len: end - start,
                    mode: if m == Mode::Write { "write" } else { "read" },
                });
            }
        }
        self.ranges.entry((start, end)).or_insert((mode, 0)).1 += 1;
        self.longest = self.longest.max(end - start);
        Ok(())
    }

    fn release(&mut self, start: u64, end: u64) {
        if let Some(entry) = self.ranges.get_mut(&(start, end)) {
            entry.1 -= 1;
            if entry.1 == 0 {
                self.ranges.remove(&(start, end));
            }
        }
    }
}

/// A `MAP_SHARED` read-write mapping of a whole memfd.
pub struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    mlocked: bool,
    claims: Mutex<Claims>,
}

/// What the mapping maps.
enum Backing {
    /// A memfd (mapped with mmap).
    Memfd(OwnedFd),
    /// A SysV shared memory segment (attached with shmat), by id.
    SysV(i32),
}

// The mapping is plain memory valid for the life of the value; every
// reference into it is handed out through the claim table (behind a mutex).
// SAFETY: claims are exclusive, so moving the handle between threads cannot
// create aliased mutable references.
unsafe impl Send for SharedMapping {}
// SAFETY: as for Send: all access goes through `&self` methods that lock the
// claim table or copy through raw pointers to claimed ranges.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Creates a memfd of `bytes` bytes and maps it, prefaulted. When
    /// `lock` is set, tries to `mlock` it; failure to lock is reported by
    /// [`SharedMapping::mlocked`], not an error.
    pub fn create(name: &str, bytes: u64, lock: bool) -> Result<Self, ShmError> {
        let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC).map_err(sys("memfd_create"))?;
        nix::unistd::ftruncate(&fd, bytes as i64).map_err(sys("ftruncate"))?;
        let mut m = Self::map(fd, bytes)?;
        if lock {
            // SAFETY: ptr/len describe exactly the mapping this value owns.
            m.mlocked = unsafe { nix::sys::mman::mlock(m.ptr.cast(), m.len) }.is_ok();
        }
        Ok(m)
    }

    /// Maps an existing memfd (received from the daemon) of `bytes` bytes,
    /// read-write and prefaulted (with huge pages where the kernel allows:
    /// [`advise_huge_and_prefault`]).
    pub fn map(fd: OwnedFd, bytes: u64) -> Result<Self, ShmError> {
        let len = NonZeroUsize::new(bytes as usize).ok_or(ShmError::Empty)?;
        // Fresh mapping at a kernel-chosen address; the fd lives in `self`.
        // Not MAP_POPULATE: pages faulted before MADV_HUGEPAGE stay small.
        let prot = ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
        // SAFETY: it overlaps no Rust object and is unmapped only in Drop.
        let mapped = unsafe { mmap(None, len, prot, MapFlags::MAP_SHARED, &fd, 0) };
        let ptr = mapped.map_err(sys("mmap"))?;
        let m = SharedMapping {
            ptr: ptr.cast(),
            len: len.get(),
            backing: Backing::Memfd(fd),
            mlocked: false,
            claims: Mutex::new(Claims::default()),
        };
        // SAFETY: ptr/len are the read-write mapping `m` owns (unmapped
        // only when `m` drops, here on error too).
        unsafe { advise_huge_and_prefault(m.ptr, m.len) }?;
        Ok(m)
    }

    /// Attaches the SysV shared memory segment `shmid` (at least `bytes`
    /// long), read-write, and touches every page so later accesses do not
    /// fault. Linux allows attaching a segment already marked for removal,
    /// which is how UCX leaves the pools it allocates.
    pub fn attach_sysv(shmid: i32, bytes: u64) -> Result<Self, ShmError> {
        let len = NonZeroUsize::new(bytes as usize).ok_or(ShmError::Empty)?;
        // SAFETY: an all-zero shmid_ds is a valid value for the kernel to fill.
        let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
        // SAFETY: IPC_STAT only writes into `ds`.
        if unsafe { libc::shmctl(shmid, libc::IPC_STAT, &mut ds) } != 0 {
            return Err(ShmError::Sys { call: "shmctl(IPC_STAT)", errno: nix::errno::Errno::last() });
        }
        if (ds.shm_segsz as u64) < bytes {
            return Err(ShmError::OutOfBounds { offset: 0, len: bytes, size: ds.shm_segsz as u64 });
        }
        // SAFETY: attaching at an address of the kernel's choosing cannot
        // overlap any Rust object; the segment stays attached until Drop.
        let p = unsafe { libc::shmat(shmid, std::ptr::null(), 0) };
        if p as isize == -1 {
            return Err(ShmError::Sys { call: "shmat", errno: nix::errno::Errno::last() });
        }
        let ptr = NonNull::new(p as *mut u8).ok_or(ShmError::Empty)?;
        let m = SharedMapping {
            ptr,
            len: len.get(),
            backing: Backing::SysV(shmid),
            mlocked: false,
            claims: Mutex::new(Claims::default()),
        };
        // SAFETY: ptr/len lie inside the segment just attached read-write
        // (detached only when `m` drops, here on error too).
        unsafe { advise_huge_and_prefault(m.ptr, m.len) }?;
        Ok(m)
    }

    /// The SysV segment id, when the mapping is one.
    pub fn sysv_id(&self) -> Option<i32> {
        match self.backing {
            Backing::SysV(id) => Some(id),
            Backing::Memfd(_) => None,
        }
    }

    /// The memfd (to send to engines).
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.backing {
            Backing::Memfd(fd) => Some(fd.as_fd()),
            Backing::SysV(_) => None,
        }
    }

    /// Size of the mapping in bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Always false: mappings are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Keeps this mapping out of processes forked from this one
    /// (`MADV_DONTFORK`): a child has nothing at these addresses, so a
    /// read or write through a pointer it inherited faults (SIGSEGV)
    /// instead of reaching the pool. An engine's mapping needs this: the
    /// daemon watches the engine's process for blocks it may still write
    /// (fences) and ends its pins when it exits, so a child that kept the
    /// mapping could write into a slot the daemon already gave to another
    /// block, or read one after it was reused.
    pub fn keep_from_children(&self) -> Result<(), ShmError> {
        use nix::sys::mman::{MmapAdvise, madvise};
        // (MADV_DONTFORK changes only whether fork copies the mapping.)
        // SAFETY: ptr/len are exactly the live mapping this value owns.
        unsafe { madvise(self.ptr.cast(), self.len, MmapAdvise::MADV_DONTFORK) }.map_err(sys("madvise(MADV_DONTFORK)"))
    }

    /// Whether `mlock` succeeded at creation.
    pub fn mlocked(&self) -> bool {
        self.mlocked
    }

    /// Address of the first byte (for registering the memory with a NIC).
    pub fn base_addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Bytes of this mapping the kernel maps with huge pages now (what
    /// operators check after setting `shmem_enabled`). Reads
    /// `/proc/self/smaps`, which walks every page table of the process:
    /// milliseconds for large pools, so never on a hot path or under a lock.
    pub fn huge_page_bytes(&self) -> u64 {
        huge_mapped_bytes(self.base_addr())
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), ShmError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(ShmError::OutOfBounds { offset, len, size: self.len as u64 }),
        }
    }

    /// Claims `offset..offset+len` for reading.
    pub fn read(self: &Arc<Self>, offset: u64, len: u64) -> Result<ReadRegion, ShmError> {
        self.check(offset, len)?;
        self.claims.lock().claim(offset, offset + len, Mode::Read)?;
        Ok(ReadRegion { map: Arc::clone(self), offset, len })
    }

    /// Claims `offset..offset+len` for writing, exclusively in this process.
    pub fn write(self: &Arc<Self>, offset: u64, len: u64) -> Result<WriteRegion, ShmError> {
        self.check(offset, len)?;
        self.claims.lock().claim(offset, offset + len, Mode::Write)?;
        Ok(WriteRegion { map: Arc::clone(self), offset, len })
    }

    /// Copies `src` into the mapping at `offset` (claims it for the copy).
    pub fn copy_in(self: &Arc<Self>, offset: u64, src: &[u8]) -> Result<(), ShmError> {
        let mut w = self.write(offset, src.len() as u64)?;
        w.copy_from_slice(src);
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the mapping.
    pub fn copy_out(self: &Arc<Self>, offset: u64, dst: &mut [u8]) -> Result<(), ShmError> {
        let r = self.read(offset, dst.len() as u64)?;
        dst.copy_from_slice(&r);
        Ok(())
    }
}

/// The kernel's setting for shared-memory huge pages (the selected word of
/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled`: `never`, `advise`,
/// `always`, ...), or `unknown`.
pub fn shmem_huge_mode() -> String {
    let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").unwrap_or_default();
    let active = mode.split_whitespace().find(|w| w.starts_with('['));
    active.map(|w| w.trim_matches(['[', ']']).to_string()).unwrap_or_else(|| "unknown".into())
}

/// Whether [`advise_huge_and_prefault`] can get huge pages for shared
/// memory on this machine.
pub fn shmem_huge_pages_allowed_here() -> bool {
    matches!(shmem_huge_mode().as_str(), "advise" | "always" | "within_size" | "force")
}

/// Bytes of the mapping that starts at `addr` in this process which the
/// kernel maps with huge pages (`ShmemPmdMapped` plus `FilePmdMapped` and
/// `AnonHugePages` of its entry in `/proc/self/smaps`); 0 when there is no
/// such mapping or smaps cannot be read.
pub fn huge_mapped_bytes(addr: usize) -> u64 {
    std::fs::read_to_string("/proc/self/smaps").map_or(0, |smaps| huge_bytes_in_smaps(&smaps, addr))
}

/// [`huge_mapped_bytes`] of the entry starting at `addr` in `smaps` text.
fn huge_bytes_in_smaps(smaps: &str, addr: usize) -> u64 {
    let mut inside = false;
    let mut kib = 0u64;
    for line in smaps.lines() {
        // An entry starts with its range: "7f1e00000000-7f1e01000000 rw-s ...".
        let range = line.split_whitespace().next().and_then(|r| r.split_once('-'));
        if let Some((start, end)) = range
            && let (Ok(start), Ok(_)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16))
        {
            if inside {
                break;
            }
            inside = start == addr;
            continue;
        }
        if inside
            && let Some((name, value)) = line.split_once(':')
            && matches!(name, "ShmemPmdMapped" | "FilePmdMapped" | "AnonHugePages")
        {
            kib += value.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0);
        }
    }
    kib * 1024
}

/// Asks for transparent huge pages on `len` bytes at `ptr`, then faults
/// every page in, contents kept. The order matters: the kernel picks a
/// page's size when the page is first faulted, so pages faulted before
/// `MADV_HUGEPAGE` (by `MAP_POPULATE`, or by touching them) stay 4 KiB for
/// good. Shared memory gets huge pages only when the operator sets
/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` to `advise` (or
/// `always`); otherwise the advice changes nothing. Fewer TLB misses make
/// block copies markedly faster (docs/BENCHMARKS.md, "Huge pages").
///
/// Prefaulting is `MADV_POPULATE_WRITE` (Linux 5.14+), which reports a
/// failure (memory the kernel cannot give) as an error here instead of a
/// SIGBUS on the data path later; on older kernels one byte of every page
/// is read instead.
///
/// # Safety
/// `ptr..ptr + len` must lie inside one live read-write mapping of this
/// process.
// SAFETY: an `unsafe fn` — every caller shows the range inside one live
// read-write mapping of this process (the `# Safety` contract above); the
// body's own unsafe blocks state what they rely on.
pub unsafe fn advise_huge_and_prefault(ptr: NonNull<u8>, len: usize) -> Result<(), ShmError> {
    use nix::sys::mman::{MmapAdvise, madvise};
    // SAFETY: the caller's range; MADV_HUGEPAGE changes neither contents
    // nor validity of the mapping.
    let _ = unsafe { madvise(ptr.cast(), len, MmapAdvise::MADV_HUGEPAGE) };
    // SAFETY: the caller's read-write range; MADV_POPULATE_WRITE faults
    // the pages in writable without writing them.
    match unsafe { madvise(ptr.cast(), len, MmapAdvise::MADV_POPULATE_WRITE) } {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::EINVAL) => {
            // A kernel without MADV_POPULATE_WRITE: read one byte per page
            // (reads keep the contents).
            let mut acc = 0u8;
            for off in (0..len).step_by(4096) {
                // SAFETY: off < len, inside the caller's mapping.
                acc ^= unsafe { std::ptr::read_volatile(ptr.as_ptr().add(off)) };
            }
            std::hint::black_box(acc);
            Ok(())
        }
        Err(errno) => Err(ShmError::Sys { call: "madvise(MADV_POPULATE_WRITE)", errno }),
    }
}

/// Fills in the page-table entries of `addr..addr + len` (widened to whole
/// pages) for pages that are already backed, without touching them from
/// user space: `MADV_POPULATE_READ` (Linux 5.14+). Meant for a peer's pool
/// that a shared-memory transport mapped here, whose pages would otherwise
/// each take a fault on their first read. `Ok(false)`: the kernel lacks
/// the advice (nothing done).
///
/// Safe whatever is mapped there by the time it runs (the mapping may go
/// away meanwhile): the advice changes no contents and no mapping, and a
/// range that is not mapped is an error, not a fault.
pub fn populate_read(addr: usize, len: usize) -> Result<bool, ShmError> {
    use nix::sys::mman::{MmapAdvise, madvise};
    const PAGE: usize = 4096;
    let start = addr & !(PAGE - 1);
    let end = addr.checked_add(len).and_then(|e| e.checked_add(PAGE - 1)).map(|e| e & !(PAGE - 1));
    let (Some(end), Some(ptr)) = (end, NonNull::new(start as *mut std::ffi::c_void)) else {
        return Err(ShmError::OutOfBounds { offset: addr as u64, len: len as u64, size: usize::MAX as u64 });
    };
    if end <= start {
        return Ok(true);
    }
    // (MADV_POPULATE_READ never unmaps or writes; a range with no mapping
    // fails with ENOMEM; no Rust object's validity depends on page tables.)
    // SAFETY: the advice only faults page-table entries in, read-only.
    let advised = unsafe { madvise(ptr, end - start, MmapAdvise::MADV_POPULATE_READ) };
    match advised {
        Ok(()) => Ok(true),
        Err(nix::errno::Errno::EINVAL) => Ok(false),
        Err(errno) => Err(ShmError::Sys { call: "madvise(MADV_POPULATE_READ)", errno }),
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        match self.backing {
            Backing::Memfd(_) => {
                // SAFETY: no region outlives the mapping (each holds an Arc
                // to it), so nothing references these bytes any more.
                let _ = unsafe { munmap(self.ptr.cast(), self.len) };
            }
            Backing::SysV(_) => {
                // SAFETY: as above; the address came from shmat.
                let _ = unsafe { libc::shmdt(self.ptr.as_ptr() as *const libc::c_void) };
            }
        }
    }
}

/// A claimed, readable range of a mapping; derefs to its bytes.
pub struct ReadRegion {
    map: Arc<SharedMapping>,
    offset: u64,
    len: u64,
}

impl Deref for ReadRegion {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // (Other processes do not write a pinned range: the pin protocol.)
        // SAFETY: bounds-checked and claimed for reading: no `&mut` to it exists here.
        unsafe { std::slice::from_raw_parts(self.map.ptr.as_ptr().add(self.offset as usize), self.len as usize) }
    }
}

impl Drop for ReadRegion {
    fn drop(&mut self) {
        self.map.claims.lock().release(self.offset, self.offset + self.len);
    }
}

/// A claimed range of a mapping, exclusive in this process; derefs mutably.
pub struct WriteRegion {
    map: Arc<SharedMapping>,
    offset: u64,
    len: u64,
}

impl WriteRegion {
    /// Offset of the region in the mapping.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl Deref for WriteRegion {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the range was bounds-checked and claimed exclusively; the
        // only references to it derive from `self`.
        unsafe { std::slice::from_raw_parts(self.map.ptr.as_ptr().add(self.offset as usize), self.len as usize) }
    }
}

impl DerefMut for WriteRegion {
    fn deref_mut(&mut self) -> &mut [u8] {
        // (Other processes do not touch a range allocated to this writer.)
        // SAFETY: claimed exclusively and `&mut self`: the only live reference to it.
        unsafe { std::slice::from_raw_parts_mut(self.map.ptr.as_ptr().add(self.offset as usize), self.len as usize) }
    }
}

impl Drop for WriteRegion {
    fn drop(&mut self) {
        self.map.claims.lock().release(self.offset, self.offset + self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_memfd_share_bytes() {
        let a = Arc::new(SharedMapping::create("kvmesh-test", 1 << 20, false).unwrap());
        // Written before the second mapping prefaults: kept.
        a.copy_in(100, b"early").unwrap();
        let fd = a.fd().unwrap().try_clone_to_owned().unwrap();
        let b = Arc::new(SharedMapping::map(fd, 1 << 20).unwrap());
        a.copy_in(4096, b"hello").unwrap();
        let mut out = [0u8; 5];
        b.copy_out(4096, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        b.copy_out(100, &mut out).unwrap();
        assert_eq!(&out, b"early");
    }

    /// Forks; the child reads the first byte of `m` and exits 0, unless
    /// that faults. Returns the child's wait status.
    fn child_reads(m: &SharedMapping) -> i32 {
        // SAFETY: the child only reads one byte and calls `_exit`, both
        // async-signal-safe, so forking a multi-threaded test is sound.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: in the child: the address was mapped in the parent;
            // without the mapping the read faults, which is what is tested.
            let b = unsafe { std::ptr::read_volatile(m.ptr.as_ptr()) };
            // SAFETY: `_exit` ends the child without running the parent's
            // destructors or atexit handlers.
            unsafe { libc::_exit(i32::from(b != 7) * 2) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child; `status` is an out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        status
    }

    #[test]
    fn a_mapping_kept_from_children_is_not_in_a_forked_child() {
        for sysv in [false, true] {
            let m = if sysv {
                // SAFETY: creating a private segment has no preconditions.
                let id = unsafe { libc::shmget(libc::IPC_PRIVATE, 1 << 20, libc::IPC_CREAT | 0o600) };
                assert!(id >= 0, "shmget: {}", std::io::Error::last_os_error());
                let m = SharedMapping::attach_sysv(id, 1 << 20);
                // SAFETY: IPC_RMID on our own segment; a null buffer is allowed.
                unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
                Arc::new(m.unwrap())
            } else {
                Arc::new(SharedMapping::create("kvmesh-fork-test", 1 << 20, false).unwrap())
            };
            m.copy_in(0, &[7]).unwrap();
            // Before: the child reads the parent's byte (what the advice prevents).
            let st = child_reads(&m);
            assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "sysv {sysv}: child status {st:#x}");
            m.keep_from_children().unwrap();
            let st = child_reads(&m);
            assert!(
                libc::WIFSIGNALED(st) && libc::WTERMSIG(st) == libc::SIGSEGV,
                "sysv {sysv}: the child should fault, status {st:#x}"
            );
            // The parent still has it.
            let mut b = [0u8; 1];
            m.copy_out(0, &mut b).unwrap();
            assert_eq!(b, [7]);
        }
    }

    /// Whether this machine allows shmem huge pages; says so loudly when not.
    fn shmem_huge_pages_allowed(test: &str) -> bool {
        let allowed = shmem_huge_pages_allowed_here();
        if !allowed {
            eprintln!(
                "SKIPPED {test}: shared-memory huge pages are off here (shmem_enabled = {}); \
                 echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled to run it",
                shmem_huge_mode()
            );
        }
        allowed
    }

    /// Pages are advised huge before their first fault, so where the kernel
    /// allows shmem huge pages a pool and an engine's mapping of it get
    /// them (pages faulted first, as MAP_POPULATE did, stay 4 KiB).
    #[test]
    fn pools_get_huge_pages_where_the_kernel_allows_them() {
        if !shmem_huge_pages_allowed("pools_get_huge_pages_where_the_kernel_allows_them") {
            return;
        }
        let a = SharedMapping::create("kvmesh-thp-test", 32 << 20, false).unwrap();
        assert!(a.huge_page_bytes() >= 2 << 20, "pool mapping: {} bytes in huge pages", a.huge_page_bytes());
        let fd = a.fd().unwrap().try_clone_to_owned().unwrap();
        let b = SharedMapping::map(fd, 32 << 20).unwrap();
        assert!(b.huge_page_bytes() >= 2 << 20, "second mapping: {} bytes in huge pages", b.huge_page_bytes());
        // SAFETY: creating a private segment has no preconditions.
        let id = unsafe { libc::shmget(libc::IPC_PRIVATE, 32 << 20, libc::IPC_CREAT | 0o600) };
        assert!(id >= 0, "shmget: {}", std::io::Error::last_os_error());
        let s = SharedMapping::attach_sysv(id, 32 << 20);
        // SAFETY: IPC_RMID on our own segment; a null buffer is allowed.
        unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
        let s = s.unwrap();
        assert!(s.huge_page_bytes() >= 2 << 20, "SysV segment: {} bytes in huge pages", s.huge_page_bytes());
    }

    /// The huge-page figures of exactly the entry asked for are summed
    /// (runs everywhere: the kernel-backed tests above skip without shmem
    /// huge pages).
    #[test]
    fn huge_bytes_are_read_from_the_entry_of_the_mapping() {
        let smaps = "\
7f0000000000-7f0000800000 rw-s 00000000 00:01 11 /memfd:kvmesh-a (deleted)
Size:               8192 kB
AnonHugePages:         0 kB
ShmemPmdMapped:     6144 kB
FilePmdMapped:         0 kB
7f0000800000-7f0001000000 rw-p 00000000 00:00 0
Size:               8192 kB
AnonHugePages:      2048 kB
ShmemPmdMapped:        0 kB
VmFlags: rd wr mr mw me ac hg
";
        assert_eq!(huge_bytes_in_smaps(smaps, 0x7f00_0000_0000), 6144 * 1024);
        assert_eq!(huge_bytes_in_smaps(smaps, 0x7f00_0080_0000), 2048 * 1024);
        assert_eq!(huge_bytes_in_smaps(smaps, 0x7f00_0040_0000), 0, "not the start of an entry");
        assert_eq!(huge_mapped_bytes(0), 0);
    }

    #[test]
    fn sysv_segment_attaches_twice_and_shares_bytes() {
        // SAFETY: creating a private segment has no preconditions.
        let id = unsafe { libc::shmget(libc::IPC_PRIVATE, 1 << 20, libc::IPC_CREAT | 0o600) };
        assert!(id >= 0, "shmget: {}", std::io::Error::last_os_error());
        let a = Arc::new(SharedMapping::attach_sysv(id, 1 << 20).unwrap());
        // Marked for removal, as UCX leaves its pools: still attachable on Linux.
        // SAFETY: IPC_RMID on our own segment; a null buffer is allowed.
        unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
        let b = Arc::new(SharedMapping::attach_sysv(id, 1 << 20).unwrap());
        assert_eq!(a.sysv_id(), Some(id));
        assert!(a.fd().is_none());
        a.copy_in(777, b"sysv").unwrap();
        let mut out = [0u8; 4];
        b.copy_out(777, &mut out).unwrap();
        assert_eq!(&out, b"sysv");
        assert!(matches!(SharedMapping::attach_sysv(id, 2 << 20), Err(ShmError::OutOfBounds { .. })));
    }

    #[test]
    fn claims_forbid_aliasing() {
        let m = Arc::new(SharedMapping::create("kvmesh-test", 8192, false).unwrap());
        let r1 = m.read(0, 100).unwrap();
        let r2 = m.read(50, 100).unwrap();
        assert!(matches!(m.write(99, 10), Err(ShmError::Conflict { .. })));
        drop(r1);
        assert!(matches!(m.write(99, 10), Err(ShmError::Conflict { .. })));
        drop(r2);
        let w = m.write(99, 10).unwrap();
        assert!(m.read(108, 4).is_err());
        assert!(m.read(109, 4).is_ok());
        assert!(m.write(0, 99).is_ok());
        drop(w);
        assert!(m.write(0, 8192).is_ok());
        assert!(matches!(m.read(8000, 193), Err(ShmError::OutOfBounds { .. })));
        assert!(matches!(m.read(u64::MAX, 2), Err(ShmError::OutOfBounds { .. })));
    }
}
