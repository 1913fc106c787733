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
