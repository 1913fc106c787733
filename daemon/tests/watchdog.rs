//! The systemd watchdog: a real daemon started as systemd would
//! (`NOTIFY_SOCKET`, `WATCHDOG_USEC`) pings while it works and stops pinging
//! when its store is wedged (a test hook holds the lock forever).

mod common;

use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use common::{Daemon, TempDir, pool};

/// Messages received on `sock` until `until`.
fn drain(sock: &UnixDatagram, until: Instant) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = [0u8; 512];
    while Instant::now() < until {
        sock.set_read_timeout(Some((until - Instant::now()).max(Duration::from_millis(1)))).unwrap();
        match sock.recv(&mut buf) {
            Ok(n) => out.push(String::from_utf8_lossy(&buf[..n]).into_owned()),
            Err(_) => break,
        }
    }
    out
}

fn notify_socket(dir: &TempDir) -> (UnixDatagram, String) {
    let path = dir.0.join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    (sock, path.display().to_string())
}

#[test]
fn pings_while_working_and_not_when_wedged() {
    let dir = TempDir::new("watchdog");
    let (sock, path) = notify_socket(&dir);
    // Enough runtime threads that the tasks blocked on the wedged store lock
    // (the lease reaper) leave the runtime running: then only the liveness
    // probe can tell, and a plain timer would go on pinging.
    let d = Daemon::start_with(
        "watchdog",
        &format!("worker_threads = 4\n{}", pool("p", "4MiB", "4KiB")),
        &[("NOTIFY_SOCKET", &path), ("WATCHDOG_USEC", "200000"), ("KVMESH_TEST_HOOK", "wedge-store-after-ms:1500")],
    );
    // The windows count from when the daemon serves (READY and the wedge's
    // clock start then; a slow start must not eat into them).
    let t0 = Instant::now();
    // Working: READY, then a ping every 100 ms.
    let first = drain(&sock, t0 + Duration::from_millis(1000));
    assert!(first.iter().any(|m| m == "READY=1"), "{first:?}");
    let pings = first.iter().filter(|m| m.as_str() == "WATCHDOG=1").count();
    assert!(pings >= 5, "{pings} pings in the first second: {first:?}");
    // Wedged at 1.5 s: at most a ping already in flight, then silence.
    let _ = drain(&sock, t0 + Duration::from_millis(2300));
    let after = drain(&sock, t0 + Duration::from_millis(3300));
    assert!(!after.iter().any(|m| m == "WATCHDOG=1"), "pinged while wedged: {after:?}\n{}", d.log());
    assert!(d.log().contains("TEST HOOK: store wedged"), "{}", d.log());
    assert!(d.log().contains("watchdog: not pinging systemd"), "the probe saw the wedge: {}", d.log());
}

#[test]
fn no_watchdog_without_watchdog_usec_and_none_for_another_pid() {
    let dir = TempDir::new("watchdog-off");
    let (sock, path) = notify_socket(&dir);
    let t0 = Instant::now();
    let _d = Daemon::start_with(
        "watchdog-off",
        &pool("p", "4MiB", "4KiB"),
        &[("NOTIFY_SOCKET", &path), ("WATCHDOG_USEC", "200000"), ("WATCHDOG_PID", "1")],
    );
    let msgs = drain(&sock, t0 + Duration::from_millis(1200));
    assert!(msgs.iter().any(|m| m == "READY=1"), "{msgs:?}");
    assert!(!msgs.iter().any(|m| m == "WATCHDOG=1"), "WATCHDOG_PID names another process: {msgs:?}");
}

/// A panic in a background task (which tokio would otherwise contain,
/// leaving the daemon running with whatever that task half-changed) aborts
/// the whole process with the panic in the log: systemd restarts it.
#[test]
fn a_panic_in_any_task_aborts_the_daemon() {
    use std::os::unix::process::ExitStatusExt;
    let mut d = Daemon::start_with("panic-abort", &pool("p", "1MiB", "4KiB"), &[("KVMESH_TEST_HOOK", "panic-in-task")]);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = d.child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the daemon survived its panic; log:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.signal(), Some(libc_sigabrt()), "{status:?}; log:\n{}", d.log());
    let log = d.log();
    assert!(log.contains("a background task panicked") && log.contains("aborting"), "{log}");
}

fn libc_sigabrt() -> i32 {
    6 // SIGABRT on Linux
}
