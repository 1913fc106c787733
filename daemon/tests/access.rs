//! Who may use a daemon's engine socket: its own uid, and the uids in
//! `server.allow_uids`. A client of another uid is refused with a message
//! that says why; the socket never exists with looser permissions than
//! configured.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

use common::{Daemon, pool};

/// `kvmesh stats` against `socket` as `uid`: (exit code, stderr), or None
/// when the CLI cannot run as that uid here (not root, or the binary is
/// out of that uid's reach).
fn stats_as(uid: u32, socket: &std::path::Path) -> Option<(i32, String)> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .arg("--socket")
        .arg(socket)
        .arg("stats")
        .uid(uid)
        .gid(65534)
        .output();
    match out {
        Ok(o) => Some((o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stderr).into_owned())),
        Err(e) => {
            eprintln!("SKIPPED part of the uid test: cannot run the CLI as uid {uid}: {e}");
            None
        }
    }
}

#[test]
fn the_socket_is_private_and_other_uids_are_refused_unless_allowed() {
    // Without allow_uids: mode 0600 from the start (the daemon's own uid
    // only; the kernel refuses the others before the daemon sees them).
    let d = Daemon::start("access-private", &pool("p", "1MiB", "4KiB"));
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
    assert!(
        !std::fs::read_dir(d.dir.0.as_path()).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains("bind")),
        "the private bind directory was removed"
    );
    if kvmesh_ffi_os::current_uid() != 0 {
        eprintln!("SKIPPED the other-uid half of this test: it needs root to run a client as another uid");
        return;
    }
    std::fs::set_permissions(d.dir.0.as_path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    if let Some((code, err)) = stats_as(65534, &d.socket) {
        assert_ne!(code, 0, "uid 65534 used a private daemon");
        assert!(err.to_lowercase().contains("permission denied"), "{err}");
    }
    drop(d);

    // allow_uids = [65534]: the socket is 0666 and the uid is checked per
    // connection: 65534 is served, 65533 is refused with the reason.
    let d = Daemon::start("access-allow", &format!("allow_uids = [65534]\n{}", pool("p", "1MiB", "4KiB")));
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o666, "socket mode {mode:o}");
    std::fs::set_permissions(d.dir.0.as_path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    if let Some((code, err)) = stats_as(65534, &d.socket) {
        assert_eq!(code, 0, "allowed uid refused: {err}");
    }
    if let Some((code, err)) = stats_as(65533, &d.socket) {
        assert_ne!(code, 0, "uid 65533 served");
        assert!(err.contains("uid 65533") && err.contains("server.allow_uids"), "{err}");
        assert!(d.log().contains("engine connection refused: uid 65533"), "{}", d.log());
    }
}
