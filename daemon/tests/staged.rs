//! The staged data path: how blocks of pools UCX cannot reach (GPU pools
//! without a CUDA-capable UCX, docs/GPU.md) move between daemons — the
//! holder copies a granted slot into a host staging slot and sends it on
//! the getter's order; the getter receives into a staging slot, validates
//! it there and copies it into its pool. There is no GPU here, so host
//! pools stand in (`KVMESH_TEST_HOOK=stage-host-pools` makes both daemons
//! stage them); everything but the device copies is the code GPU pools
//! run. Real daemons, real UCX (shared memory and tcp).

mod common;

use common::{Daemon, block_bytes, free_port, peer_config_tls, pool};
use kvmesh_client::{Client, Key, Namespace};

const HOOK: &[(&str, &str)] = &[("KVMESH_TEST_HOOK", "stage-host-pools")];

fn staged_pair(tag: &str, transports: &str, peer_extra: &str) -> (Daemon, Daemon) {
    let ports = [free_port(), free_port()];
    let pools = format!("{}{}", pool("p16k", "32MiB", "16KiB"), pool("p64k", "64MiB", "64KiB"));
    // Staged reads go in waves (96 through one read slot below): on a
    // loaded machine gets get 10 s, not 2, before they give up.
    let tls = format!("{{ mode = \"off\" }}\n{peer_extra}\n[coherence]\nop_timeout_ms = 10000");
    let a = Daemon::start_with(&format!("{tag}-a"), &peer_config_tls(1, &ports, transports, &pools, &tls), HOOK);
    let b = Daemon::start_with(&format!("{tag}-b"), &peer_config_tls(2, &ports, transports, &pools, &tls), HOOK);
    (a, b)
}

async fn put_all(c: &Client, ns: &Namespace, keys: &[Key]) {
    for chunk in keys.chunks(64) {
        let data: Vec<Vec<u8>> = chunk.iter().map(|&k| block_bytes(k, ns.block_bytes as usize)).collect();
        let items: Vec<(Key, &[u8])> = chunk.iter().copied().zip(data.iter().map(|d| &d[..])).collect();
        let s = c.put(ns, &items).await.unwrap();
        assert_eq!(s.stored as usize, chunk.len(), "{s:?}");
    }
}

/// Every block put on A is served by B with its bytes, every one moved
/// through staging slots on both sides, none failing validation.
async fn staged_round_trip(transports: &str) {
    let (a, b) = staged_pair(&format!("staged-{transports}"), transports, "");
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    for d in [&a, &b] {
        assert!(d.log().contains("TEST HOOK ACTIVE: host pools move through staging slots"), "{}", d.log());
        assert!(d.log().contains("staged pools: blocks move between daemons through host staging slots"));
    }
    let (ca, cb) = (a.client().await, b.client().await);
    let mut expected = 0;
    let mut tasks = Vec::new();
    for (name, bytes, n) in [("small", 16384u64, 300u128), ("big", 65536, 100)] {
        let na = ca.register_namespace(name, bytes, "l").await.unwrap();
        let nb = cb.register_namespace(name, bytes, "l").await.unwrap();
        let keys: Vec<Key> = (0..n).map(|i| Key(i * 7919 + bytes as u128)).collect();
        put_all(&ca, &na, &keys).await;
        expected += keys.len() as u64;
        // Read through B from two clients at once, 50 keys a call.
        for half in 0..2usize {
            let c = b.client().await;
            let (ns, keys) = (nb.clone(), keys.clone());
            tasks.push(tokio::spawn(async move {
                let mine: Vec<Key> = keys.iter().copied().skip(half).step_by(2).collect();
                for chunk in mine.chunks(50) {
                    let pinned = c.pin(&ns, chunk).await.unwrap();
                    for (blk, k) in pinned.iter().zip(chunk) {
                        let blk = blk.as_ref().unwrap_or_else(|| panic!("{k} not fetched"));
                        assert_eq!(&blk[..], &block_bytes(*k, ns.block_bytes as usize)[..], "bytes of {k}");
                        blk.verify().unwrap();
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let sb = cb.stats().await.unwrap();
    let kb = sb.coherence.clone().unwrap();
    assert_eq!(sb.remote_fetched, expected, "{sb:?}");
    assert_eq!(sb.remote_validation_failures, 0, "{sb:?}");
    assert_eq!(kb.staged_reads, expected, "every fetched block came through a staging slot: {kb:?}");
    assert_eq!(kb.staging_exhausted, 0, "{kb:?}");
    let ka = ca.stats().await.unwrap().coherence.unwrap();
    assert_eq!(ka.staged_sends, expected, "A sent every block from a staging slot: {ka:?}");
    assert_eq!(ka.staging_exhausted, 0, "{ka:?}");
    // And the staging slots all came back: a second round of fresh keys
    // (more than the 64 staging slots in all) moves as well.
    let na = ca.register_namespace("small", 16384, "l").await.unwrap();
    let nb = cb.register_namespace("small", 16384, "l").await.unwrap();
    let more: Vec<Key> = (0..200u128).map(|i| Key(1 << 100 | i)).collect();
    put_all(&ca, &na, &more).await;
    for chunk in more.chunks(40) {
        let pinned = cb.pin(&nb, chunk).await.unwrap();
        for (blk, k) in pinned.iter().zip(chunk) {
            assert_eq!(&blk.as_ref().expect("fetched")[..], &block_bytes(*k, 16384)[..]);
        }
    }
    let kb = cb.stats().await.unwrap().coherence.unwrap();
    assert_eq!(kb.staged_reads, expected + 200, "{kb:?}");
    assert_eq!(kb.staging_exhausted, 0, "no staging slot leaked: {kb:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_blocks_move_over_shared_memory() {
    staged_round_trip("sm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_blocks_move_over_tcp() {
    staged_round_trip("tcp").await;
}

/// Two staging slots (one for reads, one for sends) and calls of 32 keys
/// from three clients at once: reads go in waves through the one read
/// slot, every key arrives with its bytes, and the slots keep coming back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_reads_than_staging_slots_go_in_waves() {
    let (a, b) = staged_pair("staged-waves", "tcp", "staging_slots = 2");
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let na = ca.register_namespace("small", 16384, "l").await.unwrap();
    cb.register_namespace("small", 16384, "l").await.unwrap();
    let keys: Vec<Key> = (0..96u128).map(|i| Key(i + 5)).collect();
    put_all(&ca, &na, &keys).await;
    let mut tasks = Vec::new();
    for part in keys.chunks(32) {
        let c = b.client().await;
        let part = part.to_vec();
        tasks.push(tokio::spawn(async move {
            let ns = c.register_namespace("small", 16384, "l").await.unwrap();
            let pinned = c.pin(&ns, &part).await.unwrap();
            for (blk, k) in pinned.iter().zip(&part) {
                let blk = blk.as_ref().unwrap_or_else(|| panic!("{k} not fetched"));
                assert_eq!(&blk[..], &block_bytes(*k, 16384)[..], "bytes of {k}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let kb = cb.stats().await.unwrap().coherence.unwrap();
    let ka = ca.stats().await.unwrap().coherence.unwrap();
    assert_eq!(kb.staged_reads, 96, "{kb:?}");
    assert_eq!(ka.staged_sends, 96, "{ka:?}");
    assert_eq!(kb.staging_exhausted, 0, "a getter waits for its read slot: {kb:?}");
    assert_eq!(cb.stats().await.unwrap().remote_validation_failures, 0);
}

/// A bad staging size is one line naming the field.
#[test]
fn staging_slots_below_two_are_refused() {
    let ports = [free_port(), free_port()];
    let text = peer_config_tls(1, &ports, "tcp", &pool("p", "1MiB", "4KiB"), "{ mode = \"off\" }\nstaging_slots = 1");
    let dir = common::TempDir::new("staged-config");
    let path = dir.0.join("kvmeshd.toml");
    std::fs::write(&path, text).unwrap();
    let out = common::check_config(&path);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("peer.staging_slots: at least 2"), "{err}");
}
