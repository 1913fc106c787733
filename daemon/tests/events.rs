//! KV events (`WatchEvents`) on a real kvmeshd: what is stored, removed and
//! evicted arrives in order with per-namespace sequence numbers and no
//! gaps; a snapshot continues exactly where the live events start; a
//! watcher that falls behind is cut off with RESOURCE_EXHAUSTED while the
//! daemon keeps serving; the number of watchers is bounded; the CLI prints
//! them.

mod common;

use std::time::Duration;

use common::{Daemon, block_bytes, free_port, peer_config, pool, run_cli};
use kvmesh_client::{Client, Key, KvEvent, KvEventBatch, KvEventKind, Namespace};

/// The next `n` events of a stream (panics after 10 s without one).
async fn next_events(s: &mut tonic::Streaming<KvEventBatch>, n: usize) -> Vec<KvEvent> {
    let mut out = Vec::new();
    while out.len() < n {
        let b = tokio::time::timeout(Duration::from_secs(10), s.message())
            .await
            .expect("an event within 10 s")
            .expect("stream ok")
            .expect("stream open");
        assert!(!b.snapshot, "live batch");
        out.extend(b.events);
    }
    out
}

/// Reads a stream to its end: the status it ended with (panics if it ends
/// without one, or does not move for 20 s).
async fn end_status(s: &mut tonic::Streaming<KvEventBatch>) -> tonic::Status {
    loop {
        match tokio::time::timeout(Duration::from_secs(20), s.message()).await.expect("stream moves") {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("stream ended without a status"),
            Err(st) => return st,
        }
    }
}

fn kind(e: &KvEvent) -> KvEventKind {
    KvEventKind::try_from(e.kind).unwrap()
}

fn key(e: &KvEvent) -> Key {
    let k = e.key.unwrap();
    Key::from_parts(k.hi, k.lo)
}

async fn put(c: &Client, ns: &Namespace, keys: &[Key]) {
    let blocks: Vec<Vec<u8>> = keys.iter().map(|&k| block_bytes(k, 4096)).collect();
    let items: Vec<(Key, &[u8])> = keys.iter().copied().zip(blocks.iter().map(|b| &b[..])).collect();
    let s = c.put(ns, &items).await.unwrap();
    assert_eq!(s.stored as usize, keys.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_removed_evicted_in_order_and_snapshots_continue_without_gaps() {
    // 8 slots: the ninth block evicts.
    let d = Daemon::start("events", &pool("p", &format!("{}", 8 * (4096 + 128)), "4KiB"));
    let c = d.client().await;
    let ns = c.register_namespace("ev", 4096, "t").await.unwrap();
    let other = c.register_namespace("other", 4096, "t").await.unwrap();
    let mut w = c.watch_events(&ns, false).await.unwrap();

    let keys: Vec<Key> = (1..=3).map(Key).collect();
    put(&c, &ns, &keys).await;
    put(&c, &other, &[Key(99)]).await; // another namespace: not in this stream
    assert_eq!(c.remove(&ns, &keys[..1]).await.unwrap(), vec![true]);
    let ev = next_events(&mut w, 4).await;
    let got: Vec<(KvEventKind, Key, u64)> = ev.iter().map(|e| (kind(e), key(e), e.seq)).collect();
    assert_eq!(
        got,
        vec![
            (KvEventKind::Stored, Key(1), 1),
            (KvEventKind::Stored, Key(2), 2),
            (KvEventKind::Stored, Key(3), 3),
            (KvEventKind::Removed, Key(1), 4),
        ]
    );
    assert!(ev.iter().all(|e| e.version >= 1));

    // A snapshot: the two blocks held, at seq 4; the live events go on at 5.
    let mut s = c.watch_events(&ns, true).await.unwrap();
    let b = s.message().await.unwrap().unwrap();
    assert!(b.snapshot && b.snapshot_done);
    assert_eq!(b.snapshot_seq, 4);
    assert_eq!(b.node_id, 1);
    let mut held: Vec<Key> = b.events.iter().map(key).collect();
    held.sort();
    assert_eq!(held, vec![Key(2), Key(3)]);
    assert!(b.events.iter().all(|e| kind(e) == KvEventKind::Snapshot && e.seq == 4));

    // Fill the pool past its 8 slots: evictions, numbered on without gaps.
    for k in 10..20 {
        put(&c, &ns, &[Key(k)]).await;
    }
    for stream in [&mut w, &mut s] {
        let mut ev = next_events(stream, 10).await;
        while ev.iter().filter(|e| kind(e) == KvEventKind::Stored).count() < 10 {
            ev.extend(next_events(stream, 1).await);
        }
        for (i, e) in ev.iter().enumerate() {
            assert_eq!(e.seq, 5 + i as u64, "no gaps: {ev:?}");
        }
        assert!(ev.iter().any(|e| kind(e) == KvEventKind::Evicted), "{ev:?}");
        assert_eq!(ev.iter().filter(|e| kind(e) == KvEventKind::Stored).count(), 10);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_falls_behind_is_cut_off_and_the_daemon_keeps_serving() {
    let cfg =
        format!("[events]\nbuffer_events = 16\nstall_ms = 60000\nwatchers_max = 2\n{}", pool("p", "2MiB", "4KiB"));
    let d = Daemon::start("events-slow", &cfg);
    let c = d.client().await;
    let ns = c.register_namespace("ev", 4096, "t").await.unwrap();
    let mut slow = c.watch_events(&ns, false).await.unwrap();
    let _second = c.watch_events(&ns, false).await.unwrap();
    // watchers_max = 2: a third is refused.
    let e = c.watch_events(&ns, false).await.expect_err("third watcher refused");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
    assert!(e.to_string().contains("events.watchers_max"), "{e}");

    // Nobody reads: thousands of events (stores and evictions) overflow the
    // 16-event ring once the stream's flow-control window is full. Puts go
    // on at full speed meanwhile.
    let other = Client::connect(&d.socket).await.unwrap();
    for round in 0..40u128 {
        let keys: Vec<Key> = (0..256).map(|i| Key(round * 1000 + i + 1)).collect();
        put(&other, &ns, &keys).await;
    }
    let hit = other.lookup(&ns, &[Key(39_001)]).await.unwrap();
    assert_eq!(hit.prefix_len, 1, "the daemon still serves");

    // The slow watcher gets what was in flight, then the cut-off.
    let status = end_status(&mut slow).await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("events passed it"), "{status:?}");
    let st = other.stats().await.unwrap();
    // The slow watcher; the second one, which reads nothing either, may be cut off too.
    assert!(st.event_watchers_cut_off >= 1, "counted: {}", st.event_watchers_cut_off);
}

/// A watcher that stops reading is cut off after `events.stall_ms` with
/// RESOURCE_EXHAUSTED (not a silent end), after the batches already sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_watcher_ends_with_resource_exhausted() {
    let cfg = format!("[events]\nstall_ms = 200\n{}", pool("p", "2MiB", "4KiB"));
    let d = Daemon::start("events-stall", &cfg);
    let c = d.client().await;
    let ns = c.register_namespace("ev", 4096, "t").await.unwrap();
    let mut w = c.watch_events(&ns, false).await.unwrap();
    let other = Client::connect(&d.socket).await.unwrap();
    // Put until the stream's flow-control window is full and the watcher's
    // task has waited 200 ms on it (the daemon counts the cut-off).
    let mut round = 0u128;
    while other.stats().await.unwrap().event_watchers_cut_off == 0 {
        assert!(round < 400, "no cut-off after {round} rounds of puts");
        let keys: Vec<Key> = (0..256).map(|i| Key(round * 1000 + i + 1)).collect();
        put(&other, &ns, &keys).await;
        round += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = end_status(&mut w).await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("cut off"), "{status:?}");
    assert_eq!(other.stats().await.unwrap().event_watchers_cut_off, 1, "counted once");
}

/// Clustered: a fetched copy is a STORED event where it lands, and an
/// invalidation is an INVALIDATED event on every daemon that held it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_copies_and_invalidations_are_events_on_each_daemon() {
    let ports = [free_port(), free_port()];
    let p = pool("p", "8MiB", "4KiB");
    let a = Daemon::start("events-a", &peer_config(1, &ports, "tcp", &p));
    let b = Daemon::start("events-b", &peer_config(2, &ports, "tcp", &p));
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let (na, nb) =
        (ca.register_namespace("ev", 4096, "t").await.unwrap(), cb.register_namespace("ev", 4096, "t").await.unwrap());
    let mut wa = ca.watch_events(&na, false).await.unwrap();
    let mut wb = cb.watch_events(&nb, false).await.unwrap();
    put(&ca, &na, &[Key(5)]).await;
    let ev = next_events(&mut wa, 1).await;
    assert_eq!((kind(&ev[0]), key(&ev[0]), ev[0].seq), (KvEventKind::Stored, Key(5), 1));
    // B reads it: the copy fetched from A is stored on B.
    let got = cb.pin(&nb, &[Key(5)]).await.unwrap();
    assert!(got[0].is_some(), "fetched from A");
    drop(got);
    let ev = next_events(&mut wb, 1).await;
    assert_eq!((kind(&ev[0]), key(&ev[0]), ev[0].seq), (KvEventKind::Stored, Key(5), 1));
    assert!(ev[0].version >= 1);
    // Invalidated from A: both copies go, each daemon says so.
    let s = ca.invalidate(&na, &[Key(5)]).await.unwrap();
    assert_eq!((s.invalidated, s.failed), (1, 0), "{s:?}");
    for (w, who) in [(&mut wa, "a"), (&mut wb, "b")] {
        let ev = next_events(w, 1).await;
        assert_eq!((kind(&ev[0]), key(&ev[0]), ev[0].seq), (KvEventKind::Invalidated, Key(5), 2), "daemon {who}");
    }
}

#[test]
fn the_cli_prints_events() {
    let d = Daemon::start("events-cli", &pool("p", "1MiB", "4KiB"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = d.client().await;
        let ns = c.register_namespace("cli", 4096, "t").await.unwrap();
        put(&c, &ns, &[Key(7)]).await;
    });
    let (code, out, err) =
        run_cli(&d.socket, &["events", "--namespace", "cli", "--snapshot", "--count", "1", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["kind"], "snapshot");
    assert_eq!(v["key"], Key(7).to_string());
    assert_eq!(v["seq"], 1);
}

/// Routers on other hosts watch over the peer port, authenticated like a
/// peer: a configured peer's id is served, another id refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_on_the_peer_port_for_authenticated_callers() {
    use kvmesh_proto::peer::v1 as pp;
    let ports = [free_port(), free_port()];
    let p = pool("p", "8MiB", "4KiB");
    let a = Daemon::start("pevents-a", &peer_config(1, &ports, "tcp", &p));
    let b = Daemon::start("pevents-b", &peer_config(2, &ports, "tcp", &p));
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let cb = b.client().await;
    let nb = cb.register_namespace("pev", 4096, "t").await.unwrap();
    put(&cb, &nb, &[Key(1)]).await;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", ports[1]))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut router = pp::peer_client::PeerClient::new(ch);
    let ask = |node_id: u32, namespace: &str| pp::WatchEventsRequest {
        node_id,
        namespace: namespace.to_string(),
        snapshot: true,
    };
    // Not a configured peer: refused.
    let err = router.watch_events(ask(99, "pev")).await.expect_err("node 99 refused");
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
    // An unknown namespace: NOT_FOUND.
    let err = router.watch_events(ask(1, "nope")).await.expect_err("unknown namespace refused");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    // Node 1's identity (no TLS here; with TLS its certificate): the
    // snapshot, then the live events, as on the engine socket.
    let mut s = router.watch_events(ask(1, "pev")).await.unwrap().into_inner();
    let snap = s.message().await.unwrap().unwrap();
    assert!(snap.snapshot && snap.snapshot_done && snap.node_id == 2, "{snap:?}");
    assert_eq!(snap.events.iter().map(key).collect::<Vec<_>>(), vec![Key(1)]);
    put(&cb, &nb, &[Key(2)]).await;
    let ev = next_events(&mut s, 1).await;
    assert_eq!((kind(&ev[0]), key(&ev[0]), ev[0].seq), (KvEventKind::Stored, Key(2), snap.snapshot_seq + 1));
}
