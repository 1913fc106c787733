//! Graceful drain (SIGTERM, `kvmesh drain`): new pins and allocations are
//! refused with a clear error, pins already given may end (up to the
//! deadline), a second SIGTERM stops at once, and a drained daemon leaves
//! its cluster so that no peer waits out its lease — compared here with a
//! SIGKILL of the same daemon in the same setup.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{Daemon, fill, free_port, peer_config, pool, run_cli};
use kvmesh_client::{ErrorKind, Key};

const KEY: Key = Key(0xd7a1_0000_0000_0000_0000_0000_0000_0001);

fn signal(d: &Daemon, sig: &str) {
    let ok = Command::new("kill").arg(sig).arg(d.child.id().to_string()).status().expect("run kill").success();
    assert!(ok, "kill {sig} {}", d.child.id());
}

/// Waits for the daemon process to end; its exit status, or None after
/// `limit`. (Async: the client's unpins run on this runtime meanwhile.)
async fn wait_exit(d: &mut Daemon, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(s) = d.child.try_wait().expect("try_wait") {
            return Some(s);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

async fn wait_draining(d: &Daemon) {
    let c = d.client().await;
    let t0 = Instant::now();
    while !c.stats().await.unwrap().draining {
        assert!(t0.elapsed() < Duration::from_secs(10), "never draining; log:\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_drain_refuses_new_work_waits_for_pins_then_exits() {
    let mut d = Daemon::start("drain-pins", &pool("p", "4MiB", "4KiB"));
    let c = d.client().await;
    let ns = c.register_namespace("ns", 4096, "t").await.unwrap();
    let data = vec![7u8; 4096];
    c.put(&ns, &[(KEY, &data)]).await.unwrap();
    let held = c.pin(&ns, &[KEY]).await.unwrap().pop().flatten().expect("hit");
    let k2 = Key(KEY.0 + 1);
    let Some(kvmesh_client::Allocation::Allocated(mut w)) = c.allocate(&ns, &[k2]).await.unwrap().pop() else {
        panic!("allocation")
    };
    w.copy_from_slice(&[9u8; 4096]);

    signal(&d, "-TERM");
    wait_draining(&d).await;
    // A put begun before the drain may finish.
    assert_eq!((c.stats().await.unwrap().allocations_outstanding), 1);
    let done = c.commit(vec![w]).await.unwrap();
    assert!(matches!(done.as_slice(), [kvmesh_client::CommitOutcome::Committed { .. }]), "{done:?}");
    // A new connection still works for reads of state, but new pins and
    // allocations are refused, saying why.
    let c2 = d.client().await;
    let e = c2.pin(&ns, &[KEY]).await.expect_err("a pin while draining");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("draining"), "{e}");
    let e = c2.allocate(&ns, &[Key(KEY.0 + 2)]).await.expect_err("an allocation while draining");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    let s = c2.stats().await.unwrap();
    assert_eq!(s.pins_outstanding, 1);
    // The pin still reads its bytes, and the daemon waits for it.
    assert!(held.iter().all(|&b| b == 7));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(d.child.try_wait().unwrap().is_none(), "exited with a pin outstanding; log:\n{}", d.log());
    drop(held);
    drop(c2);
    let status =
        wait_exit(&mut d, Duration::from_secs(10)).await.unwrap_or_else(|| panic!("no exit; log:\n{}", d.log()));
    assert!(status.success(), "{status:?}; log:\n{}", d.log());
    let log = d.log();
    assert!(log.contains("SIGTERM: draining") && log.contains("drained in"), "{log}");
    assert!(!d.socket.exists(), "socket left behind");
}

#[tokio::test]
async fn a_second_sigterm_stops_at_once() {
    let mut d = Daemon::start("drain-twice", &pool("p", "4MiB", "4KiB"));
    let c = d.client().await;
    let ns = c.register_namespace("ns", 4096, "t").await.unwrap();
    c.put(&ns, &[(KEY, &[1u8; 4096])]).await.unwrap();
    let _held = c.pin(&ns, &[KEY]).await.unwrap().pop().flatten().expect("hit");
    signal(&d, "-TERM");
    wait_draining(&d).await;
    let t0 = Instant::now();
    signal(&d, "-TERM");
    let status =
        wait_exit(&mut d, Duration::from_secs(8)).await.unwrap_or_else(|| panic!("no exit; log:\n{}", d.log()));
    assert!(status.success(), "{status:?}");
    assert!(t0.elapsed() < Duration::from_secs(8));
    assert!(d.log().contains("SIGTERM during the drain: stopping at once"), "{}", d.log());
}

/// A drain `kvmesh drain --no-wait` started goes on through the first
/// SIGTERM (a `systemctl stop` or restart right after it) and stops at
/// once at the second. Before, the first cut it short.
#[tokio::test]
async fn a_drain_started_by_kvmesh_drain_goes_on_through_one_sigterm() {
    let mut d = Daemon::start("drain-cli-term", &pool("p", "4MiB", "4KiB"));
    let c = d.client().await;
    let ns = c.register_namespace("ns", 4096, "t").await.unwrap();
    c.put(&ns, &[(KEY, &[3u8; 4096])]).await.unwrap();
    let held = c.pin(&ns, &[KEY]).await.unwrap().pop().flatten().expect("hit");
    let socket = d.socket.clone();
    let (code, out, err) =
        tokio::task::spawn_blocking(move || run_cli(&socket, &["drain", "--no-wait"])).await.unwrap();
    assert_eq!(code, 0, "{out}{err}");
    wait_draining(&d).await;
    signal(&d, "-TERM");
    // Still draining (waiting for the pin), not stopped.
    let t0 = Instant::now();
    while !d.log().contains("started by `kvmesh drain`: draining on") {
        assert!(t0.elapsed() < Duration::from_secs(5), "{}", d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(d.child.try_wait().unwrap().is_none(), "stopped at the first SIGTERM; log:\n{}", d.log());
    // The pin ends: the drain completes on its own.
    drop(held);
    c.flush_releases().await;
    let status = wait_exit(&mut d, Duration::from_secs(8)).await.unwrap_or_else(|| panic!("no exit; {}", d.log()));
    assert!(status.success(), "{status:?}");
    assert!(d.log().contains("drained in"), "{}", d.log());
    assert!(!d.log().contains("stopping at once"), "{}", d.log());
}

#[tokio::test]
async fn kvmesh_drain_with_a_deadline_ends_a_held_pin_and_waits_for_the_exit() {
    let mut d = Daemon::start("drain-cli", &pool("p", "4MiB", "4KiB"));
    let c = d.client().await;
    let ns = c.register_namespace("ns", 4096, "t").await.unwrap();
    c.put(&ns, &[(KEY, &[2u8; 4096])]).await.unwrap();
    let _held = c.pin(&ns, &[KEY]).await.unwrap().pop().flatten().expect("hit");
    // Bad input is refused without draining.
    let (code, _, err) = run_cli(&d.socket, &["drain", "--deadline-ms", "999999999"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("exceeds"), "{err}");
    assert!(!c.stats().await.unwrap().draining);
    let t0 = Instant::now();
    let socket = d.socket.clone();
    let out = tokio::task::spawn_blocking(move || run_cli(&socket, &["drain", "--deadline-ms", "400", "--json"]))
        .await
        .unwrap();
    let (code, stdout, stderr) = out;
    assert_eq!(code, 0, "{stdout}{stderr}; log:\n{}", d.log());
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["pins_outstanding"], 1);
    assert_eq!(v["deadline_ms"], 400);
    assert_eq!(v["exited"], true);
    assert!(t0.elapsed() >= Duration::from_millis(400), "the pin's deadline was not waited for");
    let status = wait_exit(&mut d, Duration::from_secs(5)).await.expect("exited");
    assert!(status.success());
    assert!(d.log().contains("drain deadline passed"), "{}", d.log());
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Departure {
    Drain,
    Kill,
}

/// What the other daemons paid for a departure.
#[derive(Debug)]
struct Cost {
    /// Node 1's overwrite of a key the departed daemon held: time to store.
    overwrite: Duration,
    /// Node 2 reading 24 blocks held by node 1 (one pin call, started with
    /// the overwrite): misses, and how long the call took.
    misses: usize,
    read: Duration,
}

/// Three daemons; node 3 holds a copy of KEY (it read it), node 1 holds 24
/// more blocks (some homed at node 3). Node 3 departs (drain or SIGKILL);
/// then node 1 overwrites KEY (it must not complete while a serving holder
/// is unacked) while node 2 reads the 24 blocks.
async fn overwrite_after_departure(how: Departure) -> Cost {
    let ports = [free_port(), free_port(), free_port()];
    let pools = pool("p", "8MiB", "64KiB");
    let coherence = "[coherence]\nmembership_lease_ms = 4000\nop_timeout_ms = 1000\n";
    let mut nodes: Vec<Daemon> = (1..=3)
        .map(|id| Daemon::start(&format!("depart-{how:?}-{id}"), &(peer_config(id, &ports, "tcp", &pools) + coherence)))
        .collect();
    for n in &nodes {
        n.wait_peers(2).await;
    }
    fill::put_until_stored(&nodes[0], KEY, b'A', Duration::from_secs(20)).await;
    assert_eq!(fill::get(&nodes[2], KEY).await, Some(b'A'), "node 3 reads (and holds) A");
    let others: Vec<Key> = (1..=24u128).map(|i| Key(KEY.0 + 0x100 + i)).collect();
    for &k in &others {
        fill::put_until_stored(&nodes[0], k, b'o', Duration::from_secs(20)).await;
    }
    let mut n3 = nodes.pop().unwrap();
    match how {
        Departure::Drain => {
            signal(&n3, "-TERM");
            let s = wait_exit(&mut n3, Duration::from_secs(10)).await.unwrap_or_else(|| panic!("log:\n{}", n3.log()));
            assert!(s.success());
            let log = n3.log();
            assert!(log.contains("left the cluster") && log.contains("peers_confirmed=2"), "{log}");
        }
        Departure::Kill => {
            n3.child.kill().unwrap();
            n3.child.wait().unwrap();
        }
    }
    let reader = nodes[1].client().await;
    let ns = reader.register_namespace("ns", fill::BLOCK as u64, "t").await.unwrap();
    let read = async {
        let t0 = Instant::now();
        let got = reader.pin(&ns, &others).await.unwrap();
        for b in got.iter().flatten() {
            assert!(b.iter().all(|&x| x == b'o'), "wrong bytes served");
        }
        (got.iter().filter(|b| b.is_none()).count(), t0.elapsed())
    };
    let (took, (misses, read)) =
        tokio::join!(fill::put_until_stored(&nodes[0], KEY, b'B', Duration::from_secs(30)), read);
    assert_eq!(fill::get(&nodes[0], KEY).await, Some(b'B'));
    let c = nodes[1].client().await;
    let t0 = Instant::now();
    while !c.stats().await.unwrap().coherence.is_some_and(|k| k.members == 2 && k.directory_ready) {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(fill::get(&nodes[1], KEY).await, Some(b'B'));
    Cost { overwrite: took, misses, read }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_daemon_leaves_at_once_a_killed_one_is_waited_out() {
    let drained = overwrite_after_departure(Departure::Drain).await;
    let killed = overwrite_after_departure(Departure::Kill).await;
    eprintln!("after the departure: drained {drained:?}; SIGKILLed {killed:?}");
    // The membership lease is 4 s: a killed holder is removed (and the
    // overwrite completes) only after it; a drained one told the home and
    // the coordinator before it exited.
    assert!(killed.overwrite >= Duration::from_millis(2_500), "killed: {killed:?}");
    assert!(drained.overwrite < Duration::from_millis(1_500), "drained: {drained:?} (killed: {killed:?})");
    // Reads of blocks homed at the departed daemon miss (after waiting out
    // the operation deadline) until it is removed; after a drain the new
    // homes answer at once.
    assert!(drained.misses < killed.misses, "drained: {drained:?}, killed: {killed:?}");
    assert!(drained.read < killed.read, "drained: {drained:?}, killed: {killed:?}");
}

/// A clustered daemon refuses new puts while it drains, as a daemon alone
/// does (a put begun then would keep the drain waiting, and its block would
/// be lost when the daemon leaves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_clustered_daemon_refuses_new_puts() {
    let ports = [free_port(), free_port()];
    let pools = pool("p", "4MiB", "64KiB");
    let mut nodes: Vec<Daemon> = (1..=2)
        .map(|id| Daemon::start(&format!("drain-clustered-{id}"), &peer_config(id, &ports, "tcp", &pools)))
        .collect();
    for n in &nodes {
        n.wait_peers(1).await;
    }
    fill::put_until_stored(&nodes[0], KEY, b'A', Duration::from_secs(20)).await;
    let c = nodes[0].client().await;
    let ns = c.register_namespace("ns", fill::BLOCK as u64, "t").await.unwrap();
    // A pin keeps the drain waiting.
    let held = c.pin(&ns, &[KEY]).await.unwrap().pop().flatten().expect("hit");
    signal(&nodes[0], "-TERM");
    wait_draining(&nodes[0]).await;
    let c2 = nodes[0].client().await;
    let e = c2.allocate(&ns, &[Key(KEY.0 + 7)]).await.expect_err("a clustered allocation while draining");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("draining"), "{e}");
    assert_eq!(c2.stats().await.unwrap().allocations_outstanding, 0);
    drop(held);
    drop((c, c2));
    let mut n1 = nodes.remove(0);
    let status = wait_exit(&mut n1, Duration::from_secs(10)).await.unwrap_or_else(|| panic!("log:\n{}", n1.log()));
    assert!(status.success(), "{status:?}");
}
