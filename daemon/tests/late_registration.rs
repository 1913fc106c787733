//! A registration that arrives late, with real processes (the bug
//! `kvmesh-nemesis` found after a flapping link; `docs/RELIABILITY.md`).
//!
//! Daemon 3 fetches a key homed at daemon 1; the batch that registers its
//! copy at the home is held back (`KVMESH_TEST_HOOK=hold-first-registration-
//! ms:N`: sent N ms late, behind everything sent after it, as a stream that
//! broke with the batch on it and came back), so that get gives up. The
//! next get fetches and registers again. Then the held batch arrives. The
//! home must not let it replace the registration of the copy daemon 3
//! holds now: if it did, daemon 3's "I gave that copy up" would unregister
//! it, and the next overwrite would complete without invalidating it —
//! daemon 3 would go on serving the overwritten bytes.
//!
//! The same run with the fix planted out (`KVMESH_TEST_BUG=take-late-
//! registration`) must serve the stale block: the test reaches the race,
//! so the first test can fail.

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, fill, free_port, peer_config, pool};
use kvmesh_client::{Client, Key};
use kvmesh_coherence::{BlockKey, Member, View};

const HOLD_MS: u64 = 1_500;

/// A key of namespace "ns" whose home, among daemons 1..=3 of equal
/// capacity, is daemon 1.
fn key_homed_at_1(fingerprint: u64) -> Key {
    let view = View { epoch: 1, members: (1..=3).map(|id| Member { id, incarnation: 1, capacity: 1 }).collect() };
    (0xabc0_0000u128..)
        .map(Key)
        .find(|k| view.home_of(&BlockKey { ns: fingerprint, key: k.0 }) == Some(1))
        .expect("a key homed at daemon 1")
}

async fn wait_log(d: &Daemon, needle: &str, within: Duration) {
    let t0 = Instant::now();
    while !d.log().contains(needle) {
        assert!(t0.elapsed() < within, "never logged {needle:?}; log:\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The fill byte daemon 3 serves after the overwrite (`b'A'` is the
/// overwritten block, `b'B'` the new one).
async fn run(bug: Option<&str>) -> Option<u8> {
    let ports = [free_port(), free_port(), free_port()];
    let pools = pool("p4k", "16MiB", "4KiB");
    // Gets give up after 500 ms: well inside the hold. Registration after
    // the read (with `register_at_locate` a get does not wait for it; the
    // home's refusal of an older copy is the same code either way).
    let config = |id: u32| {
        format!(
            "{}[coherence]\nop_timeout_ms = 500\nregister_at_locate = false\n",
            peer_config(id, &ports, "tcp", &pools)
        )
    };
    let tag = if bug.is_some() { "late-reg-bug" } else { "late-reg" };
    let hook = format!("hold-first-registration-ms:{HOLD_MS}");
    let nodes: Vec<Daemon> = (1..=3)
        .map(|id| {
            let mut env: Vec<(&str, &str)> = bug.iter().map(|b| ("KVMESH_TEST_BUG", *b)).collect();
            if id == 3 {
                env.push(("KVMESH_TEST_HOOK", &hook));
            }
            Daemon::start_with(&format!("{tag}-{id}"), &config(id), &env)
        })
        .collect();
    for n in &nodes {
        n.wait_peers(2).await;
    }
    let ns = Client::connect(&nodes[0].socket)
        .await
        .unwrap()
        .register_namespace("ns", fill::BLOCK as u64, "t")
        .await
        .unwrap();
    let key = key_homed_at_1(ns.fingerprint);

    // Daemon 2 writes the key; daemon 3's first fetch of it cannot register.
    fill::put_until_stored(&nodes[1], key, b'A', Duration::from_secs(10)).await;
    let first = fill::get(&nodes[2], key).await;
    wait_log(&nodes[2], "TEST HOOK: holding a registration batch", Duration::from_secs(5)).await;
    assert_eq!(first, None, "the first fetch cannot have registered its copy");
    assert!(!nodes[2].log().contains("sending the held registration batch"), "the hold ended too early");

    // The second fetch registers: daemon 3 holds the block now.
    assert_eq!(fill::get(&nodes[2], key).await, Some(b'A'), "second fetch; log:\n{}", nodes[2].log());
    assert!(!nodes[2].log().contains("sending the held registration batch"), "the hold ended too early");

    // The held registration reaches the home; its answer, and daemon 3's
    // "I hold no such copy", follow within milliseconds.
    wait_log(&nodes[2], "TEST HOOK: sending the held registration batch", Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    // An overwrite must invalidate daemon 3's copy before it is stored.
    fill::put_until_stored(&nodes[1], key, b'B', Duration::from_secs(10)).await;
    let after = fill::get(&nodes[2], key).await;
    eprintln!("daemon 3 serves {:?} after the overwrite", after.map(|b| b as char));
    after
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_registration_never_unregisters_the_copy_a_daemon_holds() {
    let served = run(None).await;
    assert_eq!(served, Some(b'B'), "daemon 3 must serve the new block (Some(b'A'): the overwritten one)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_take_late_registration_bug_serves_the_overwritten_block() {
    let served = run(Some("take-late-registration")).await;
    assert_eq!(served, Some(b'A'), "without the fix daemon 3 must serve the overwritten block (the race was reached)");
}
