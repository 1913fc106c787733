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

/// Borrows a raw descriptor owned elsewhere (e.g. a UCX worker's event fd)
/// for polling.
pub fn with_raw_fd<R>(fd: std::os::fd::RawFd, f: impl FnOnce(std::os::fd::BorrowedFd<'_>) -> R) -> R {
    // SAFETY: the caller passes a descriptor that stays open for the call
    // (the UCX worker owning it outlives the poll).
    f(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
}
