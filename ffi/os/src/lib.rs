//! The OS-level `unsafe` of kvmesh, wrapped in safe types: memfd-backed
//! shared mappings for block pools (created by the daemon, mapped again by
//! engines), passing their fds over a Unix socket (SCM_RIGHTS), and small
//! socket helpers. Nothing outside `ffi/` and `kernels/` contains `unsafe`.

pub mod fdpass;
pub mod shm;

pub use shm::{ReadRegion, SharedMapping, ShmError, WriteRegion};

/// Real user id of this process.
pub fn current_uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

/// The default engine socket: `$XDG_RUNTIME_DIR/kvmesh/kvmeshd.sock` when
/// `XDG_RUNTIME_DIR` is set, else `/tmp/kvmesh-<uid>/kvmeshd.sock`. The
/// daemon and the client library both use this rule.
pub fn default_socket_path() -> std::path::PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => std::path::PathBuf::from(dir).join("kvmesh").join("kvmeshd.sock"),
        None => std::path::PathBuf::from(format!("/tmp/kvmesh-{}", current_uid())).join("kvmeshd.sock"),
    }
}

/// An eventfd used to wake a thread that sleeps in [`poll_readable`].
pub struct EventFd(std::os::fd::OwnedFd);

impl EventFd {
    /// A non-blocking eventfd.
    pub fn new() -> std::io::Result<EventFd> {
        let fd = nix::sys::eventfd::EventFd::from_flags(
            nix::sys::eventfd::EfdFlags::EFD_CLOEXEC | nix::sys::eventfd::EfdFlags::EFD_NONBLOCK,
        )?;
        Ok(EventFd(std::os::fd::OwnedFd::from(fd)))
    }
    /// Wakes the sleeper.
    pub fn notify(&self) {
        let _ = nix::unistd::write(&self.0, &1u64.to_ne_bytes());
    }
    /// Clears pending notifications.
    pub fn drain(&self) {
        let mut b = [0u8; 8];
        let _ = nix::unistd::read(&self.0, &mut b);
    }
    /// The descriptor.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.0)
    }
}

/// Waits until one of `fds` is readable or `timeout_ms` passes; returns
/// which are readable.
pub fn poll_readable(fds: &[std::os::fd::BorrowedFd<'_>], timeout_ms: u16) -> std::io::Result<Vec<bool>> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut pfds: Vec<PollFd<'_>> = fds.iter().map(|f| PollFd::new(*f, PollFlags::POLLIN)).collect();
    match poll(&mut pfds, PollTimeout::from(timeout_ms)) {
        Ok(_) => {}
        Err(nix::errno::Errno::EINTR) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(pfds.iter().map(|p| p.revents().is_some_and(|r| !r.is_empty())).collect())
}

/// A process, held by a pidfd (Linux 5.3 and later): unlike its pid, the
/// handle never names another process once this one has exited.
pub struct Process(std::os::fd::OwnedFd);

/// `SO_PEERPIDFD` (Linux 6.5; the same number on every architecture but
/// mips, sparc, alpha and parisc, which kvmesh does not build for).
const SO_PEERPIDFD: libc::c_int = 77;

impl Process {
    /// The process at the other end of a connected Unix socket: the one
    /// that connected (`SO_PEERPIDFD`, Linux 6.5 and later); on older
    /// kernels a pidfd of its SO_PEERCRED pid — which names another
    /// process if the one that connected exited and its pid was reused
    /// before this call (call it as the connection is accepted).
    pub fn of_peer(sock: std::os::fd::BorrowedFd<'_>) -> std::io::Result<Process> {
        use std::os::fd::AsRawFd;
        let mut fd: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        let (fd_out, len_out) = ((&raw mut fd).cast::<libc::c_void>(), &raw mut len);
        // SAFETY: getsockopt(2) writes at most `len` (4) bytes at `fd_out` (a c_int on our stack) and the
        // length at `len_out`; `sock` is an open descriptor borrowed for the call.
        let rc = unsafe { libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, SO_PEERPIDFD, fd_out, len_out) };
        if rc == 0 && fd >= 0 {
            // SAFETY: the kernel just handed us this new descriptor: open,
            // and owned by nothing else in this process.
            return Ok(Process(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) }));
        }
        let cred = nix::sys::socket::getsockopt(&sock, nix::sys::socket::sockopt::PeerCredentials)?;
        Process::open(cred.pid())
    }

    /// A handle on process `pid` (see [`Process::of_peer`] for a peer).
    pub fn open(pid: i32) -> std::io::Result<Process> {
        if pid <= 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        }
        // SAFETY: pidfd_open(2) takes a pid and flags (no pointers) and
        // returns a new descriptor or -1; it touches no memory of ours.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::c_long::from(pid), 0 as libc::c_long) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let raw = std::os::fd::RawFd::try_from(fd).map_err(|_| std::io::Error::other("pidfd out of range"))?;
        // SAFETY: `raw` is the descriptor the kernel just returned to us:
        // open, and owned by nothing else in this process.
        Ok(Process(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) }))
    }

    /// The process has exited (its pidfd polls readable). An error of the
    /// poll says "not known to have exited".
    pub fn exited(&self) -> bool {
        use std::os::fd::AsFd;
        poll_readable(&[self.0.as_fd()], 0).is_ok_and(|r| r[0])
    }
}

/// Borrows a raw descriptor owned elsewhere (e.g. a UCX worker's event fd)
/// for polling.
pub fn with_raw_fd<R>(fd: std::os::fd::RawFd, f: impl FnOnce(std::os::fd::BorrowedFd<'_>) -> R) -> R {
    // SAFETY: the caller passes a descriptor that stays open for the call
    // (the UCX worker owning it outlives the poll).
    f(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
}

#[cfg(test)]
mod process_tests {
    use super::Process;

    /// A child's handle says "running" until the child exits (reaped or
    /// not), and a pid that names nothing is refused.
    #[test]
    fn a_process_handle_tells_when_its_process_exited() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let p = Process::open(child.id() as i32).expect("pidfd_open");
        assert!(!p.exited(), "the child runs");
        child.kill().expect("kill the child");
        let t0 = std::time::Instant::now();
        while !p.exited() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(10), "the child's exit was never seen");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        child.wait().expect("reap");
        assert!(p.exited(), "still exited once reaped");
        assert!(Process::open(0).is_err());
        assert!(Process::open(-1).is_err());
        let me = Process::open(std::process::id() as i32).expect("own pidfd");
        assert!(!me.exited(), "this process runs");
    }

    /// The peer of a socket pair is this process (SO_PEERPIDFD, or the
    /// SO_PEERCRED fallback).
    #[test]
    fn the_peer_of_a_unix_socket_is_the_process_that_connected() {
        use std::os::fd::AsFd;
        let (a, _b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        let p = Process::of_peer(a.as_fd()).expect("a pidfd of the peer");
        assert!(!p.exited(), "the peer (this process) runs");
        // A socket that is not connected names no process.
        let l = std::os::unix::net::UnixDatagram::unbound().expect("socket");
        assert!(Process::of_peer(l.as_fd()).is_err());
    }
}
