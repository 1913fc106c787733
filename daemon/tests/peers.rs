//! Two real kvmeshd processes on loopback, moving blocks with real UCX (no
//! mock) over shared memory and over tcp.

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, block_bytes, free_port, peer_config, pool, run_cli};
use kvmesh_client::{Client, Key, Namespace};
use rand::{Rng, SeedableRng};

fn pools() -> String {
    format!("{}{}", pool("p16k", "32MiB", "16KiB"), pool("p64k", "96MiB", "64KiB"))
}

fn pair(tag: &str, transports: &str, env_a: &[(&str, &str)]) -> (Daemon, Daemon) {
    pair_with(tag, transports, env_a, "")
}

/// Two daemons, both configs ending with `extra`.
fn pair_with(tag: &str, transports: &str, env_a: &[(&str, &str)], extra: &str) -> (Daemon, Daemon) {
    let ports = [free_port(), free_port()];
    let a = Daemon::start_with(&format!("{tag}-a"), &(peer_config(1, &ports, transports, &pools()) + extra), env_a);
    let b = Daemon::start(&format!("{tag}-b"), &(peer_config(2, &ports, transports, &pools()) + extra));
    (a, b)
}

/// Clients of `a` and `b`, once each sees the other.
async fn clients(a: &Daemon, b: &Daemon) -> (Client, Client) {
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    (a.client().await, b.client().await)
}

async fn namespaces(c: &Client) -> (Namespace, Namespace) {
    (c.register_namespace("small", 16384, "l").await.unwrap(), c.register_namespace("big", 65536, "l").await.unwrap())
}

async fn put_all(c: &Client, ns: &Namespace, keys: &[Key]) {
    for chunk in keys.chunks(128) {
        let data: Vec<Vec<u8>> = chunk.iter().map(|&k| block_bytes(k, ns.block_bytes as usize)).collect();
        let items: Vec<(Key, &[u8])> = chunk.iter().copied().zip(data.iter().map(|d| &d[..])).collect();
        let s = c.put(ns, &items).await.unwrap();
        assert_eq!(s.stored as usize, chunk.len(), "{s:?}");
    }
}

/// Pins `keys` (fetched from the other daemon) and checks every byte.
async fn pin_verified(c: &Client, ns: &Namespace, keys: &[Key]) {
    let pinned = c.pin(ns, keys).await.unwrap();
    for (blk, k) in pinned.iter().zip(keys) {
        let blk = blk.as_ref().unwrap_or_else(|| panic!("{k} not fetched"));
        assert_eq!(&blk[..], &block_bytes(*k, ns.block_bytes as usize)[..], "bytes of {k}");
    }
}

/// `kvmesh stats --json`'s coherence figures of daemon `d`.
fn stats_coherence(d: &Daemon) -> serde_json::Value {
    let (rc, stdout, err) = run_cli(&d.socket, &["stats", "--json"]);
    assert_eq!(rc, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    v["coherence"].clone()
}

async fn remote_round_trip(transports: &str) {
    let (a, b) = pair(&format!("rt-{transports}"), transports, &[]);
    let (ca, cb) = clients(&a, &b).await;
    let (sa, ba) = namespaces(&ca).await;
    let (sb, bb) = namespaces(&cb).await;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    // 1,000 random blocks of mixed sizes, put on A.
    let small: Vec<Key> = (0..600).map(|_| Key(rng.random())).collect();
    let big: Vec<Key> = (0..400).map(|_| Key(rng.random())).collect();
    put_all(&ca, &sa, &small).await;
    put_all(&ca, &ba, &big).await;
    // Read them all through B, concurrently from three clients.
    let mut tasks = Vec::new();
    for (i, part) in [(sb.clone(), small.clone()), (bb.clone(), big.clone())].into_iter().enumerate() {
        for third in 0..3usize {
            let c = b.client().await;
            let (ns, keys) = (part.0.clone(), part.1.clone());
            tasks.push(tokio::spawn(async move {
                let mine: Vec<Key> = keys.iter().copied().skip(third).step_by(3).collect();
                for chunk in mine.chunks(50) {
                    let pinned = c.pin(&ns, chunk).await.unwrap();
                    for (blk, k) in pinned.iter().zip(chunk) {
                        let blk = blk.as_ref().unwrap_or_else(|| panic!("{k} not fetched (part {i})"));
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
    let sb_stats = cb.stats().await.unwrap();
    assert_eq!(sb_stats.remote_fetched, 1000, "{sb_stats:?}");
    assert_eq!(sb_stats.remote_validation_failures, 0);
    assert_eq!(sb_stats.lookups, 0, "probing for misses before a fetch is not an engine lookup");
    // Second read: local hits, no new fetch.
    let again = cb.pin(&sb, &small[..10]).await.unwrap();
    assert!(again.iter().all(|b| b.is_some()));
    assert_eq!(cb.stats().await.unwrap().remote_fetched, 1000);
    // A gave grants and got them all back.
    let t0 = Instant::now();
    loop {
        let s = ca.stats().await.unwrap();
        assert!(s.grants_given >= 1000);
        if s.pins_outstanding == 0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "grants never released: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The CLI on B serves a key put on A (fetched on demand).
    let k = Key(rng.random());
    put_all(&ca, &sa, &[k]).await;
    let out = b.dir.0.join("cli-out");
    let (rc, _, err) = run_cli(&b.socket, &["get", "--namespace", "small", &k.to_string(), out.to_str().unwrap()]);
    assert_eq!(rc, 0, "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), block_bytes(k, 16384));
    // `kvmesh stats --json` shows the coherence figures.
    let (rc, stdout, err) = run_cli(&b.socket, &["stats", "--json"]);
    assert_eq!(rc, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let c = &v["coherence"];
    assert_eq!(c["serving"], true, "{v}");
    assert_eq!(c["members"], 2, "{v}");
    assert!(c["batching_factor"].as_f64().unwrap() >= 1.0, "{v}");
    assert!(c["batches_sent"].as_u64().unwrap() > 0, "{v}");
    for field in
        ["inval_to_ack_p50_us", "inval_to_ack_p99_us", "stale_epoch_drops", "validation_failures", "grants_outstanding"]
    {
        assert!(c[field].is_u64(), "{field} missing: {v}");
    }
    assert_eq!(c["validation_failures"], 0, "{v}");
    // Every copy B fetched was served on its locate-time registration
    // (one epoch, no change of the keys meanwhile): none waited for a
    // registration round trip after its read.
    assert_eq!(c["early_registrations"].as_u64(), Some(sb_stats.remote_fetched + 1), "{v}");
    // tcp: the holder pushed slots with its grants (`peer.push_with_grants`,
    // on by default), B's reads used them — every byte checked above.
    // Not on shared memory (one-sided reads: nothing to push).
    let (invited, used) = (c["push_invites"].as_u64().unwrap(), c["pushes_used"].as_u64().unwrap());
    let sa_coh = stats_coherence(&a);
    let sent = sa_coh["pushes_sent"].as_u64().unwrap();
    if transports == "tcp" {
        assert!(used >= 500, "most of 1,000 fetches read a pushed slot: {v}");
        assert!(invited >= used && sent >= used, "invited {invited}, used {used}, A sent {sent}");
    } else {
        assert_eq!((invited, used, sent), (0, 0, 0), "{v}");
    }
    // Overwrite on B from the CLI: A then serves the new bytes, never the old.
    let newer = b.dir.0.join("newer");
    std::fs::write(&newer, vec![0xabu8; 16384]).unwrap();
    let (rc, _, err) = run_cli(
        &b.socket,
        &[
            "put",
            "--overwrite",
            "--namespace",
            "small",
            "--block-size",
            "16384",
            &k.to_string(),
            newer.to_str().unwrap(),
        ],
    );
    assert_eq!(rc, 0, "{err}");
    let got = ca.pin(&sa, &[k]).await.unwrap();
    assert_eq!(&got[0].as_ref().expect("A serves the new version")[..], &[0xabu8; 16384][..]);
    drop(got);
    ca.flush_releases().await;
    // `kvmesh invalidate` on A: returns once no daemon serves the key.
    let (rc, stdout, err) = run_cli(&a.socket, &["invalidate", "--namespace", "small", &k.to_string()]);
    assert_eq!(rc, 0, "{err}");
    assert!(stdout.contains("invalidated 1 keys"), "{stdout}");
    for (c, ns) in [(&ca, &sa), (&cb, &sb)] {
        assert!(c.pin(ns, &[k]).await.unwrap()[0].is_none(), "an invalidated key was served");
    }
    let (rc, _, _) = run_cli(&b.socket, &["get", "--namespace", "small", &k.to_string(), out.to_str().unwrap()]);
    assert_eq!(rc, 3, "CLI get of an invalidated key must miss");
    // The whole namespace: every key put on A is gone everywhere.
    let (rc, stdout, err) = run_cli(&b.socket, &["invalidate", "--namespace", "small"]);
    assert_eq!(rc, 0, "{err}");
    assert!(stdout.contains("invalidated 600 keys"), "{stdout}");
    assert!(cb.pin(&sb, &small[..50]).await.unwrap().iter().all(|b| b.is_none()));
    assert!(ca.pin(&sa, &small[..50]).await.unwrap().iter().all(|b| b.is_none()));
    // Bad input: unknown namespace, bad key.
    let (rc, _, err) = run_cli(&b.socket, &["invalidate", "--namespace", "nope"]);
    assert_eq!(rc, 1);
    assert!(err.contains("not registered"), "{err}");
    let (rc, _, err) = run_cli(&b.socket, &["invalidate", "--namespace", "small", "xyz"]);
    assert_eq!(rc, 1, "{err}");
}

/// `coherence.register_at_locate` off on A, on (the default) on B: each
/// daemon fetches what the other put, both kinds of reader meet both
/// kinds of home; only B serves copies on their locate-time registration,
/// and an overwrite reaches the copies of both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_with_and_without_locate_time_registration_share_a_cluster() {
    let ports = [free_port(), free_port()];
    let off = "[coherence]\nregister_at_locate = false\n";
    let a = Daemon::start("mixreg-a", &(peer_config(1, &ports, "sm", &pools()) + off));
    let b = Daemon::start("mixreg-b", &(peer_config(2, &ports, "sm", &pools()) + "[coherence]\n"));
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let (sa, _) = namespaces(&ca).await;
    let (sb, _) = namespaces(&cb).await;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
    let on_a: Vec<Key> = (0..64).map(|_| Key(rng.random())).collect();
    let on_b: Vec<Key> = (0..64).map(|_| Key(rng.random())).collect();
    put_all(&ca, &sa, &on_a).await;
    put_all(&cb, &sb, &on_b).await;
    for (c, ns, keys) in [(&cb, &sb, &on_a), (&ca, &sa, &on_b)] {
        pin_verified(c, ns, keys).await;
    }
    let (sa_stats, sb_stats) = (ca.stats().await.unwrap(), cb.stats().await.unwrap());
    assert_eq!((sa_stats.remote_fetched, sb_stats.remote_fetched), (64, 64));
    let (ka, kb) = (sa_stats.coherence.unwrap(), sb_stats.coherence.unwrap());
    assert_eq!(ka.early_registrations, 0, "A registers after the read: {ka:?}");
    assert_eq!(kb.early_registrations, 64, "B is served on its locate-time registration: {kb:?}");
    // Homes of both kinds registered B at locate time (A is home of some
    // of the keys, B of the others).
    assert_eq!(ka.pending_registrations + kb.pending_registrations, 64, "{ka:?} {kb:?}");
    ca.flush_releases().await;
    cb.flush_releases().await;
    // Overwrites of keys each side fetched: both serve the new bytes.
    let newer = vec![0x5au8; 16384];
    for (c, ns, k) in [(&ca, &sa, on_a[0]), (&cb, &sb, on_b[0])] {
        let s = c.put_overwrite(ns, &[(k, &newer[..])]).await.unwrap();
        assert_eq!(s.stored, 1, "{s:?}");
    }
    for (c, ns) in [(&ca, &sa), (&cb, &sb)] {
        for k in [on_a[0], on_b[0]] {
            let got = c.pin(ns, &[k]).await.unwrap();
            assert_eq!(&got[0].as_ref().expect("the new version is served")[..], &newer[..], "{k}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_round_trip_over_shared_memory() {
    remote_round_trip("sm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_round_trip_over_tcp() {
    remote_round_trip("tcp").await;
}

async fn reused_slot_is_caught(transports: &str) {
    // A's test hook makes every granted slot look reused before B reads it.
    let (a, b) = pair(&format!("reuse-{transports}"), transports, &[("KVMESH_TEST_HOOK", "corrupt-granted-slots")]);
    let (ca, cb) = clients(&a, &b).await;
    let (sa, _) = namespaces(&ca).await;
    let (sb, _) = namespaces(&cb).await;
    let keys: Vec<Key> = (0..20u128).map(Key).collect();
    put_all(&ca, &sa, &keys).await;
    let got = cb.pin(&sb, &keys).await.unwrap();
    assert!(got.iter().all(|g| g.is_none()), "a block from a reused slot reached the client");
    let s = cb.stats().await.unwrap();
    assert_eq!(s.remote_validation_failures, 20, "{s:?}");
    assert_eq!(s.remote_fetched, 0);
    assert_eq!(s.pools[0].valid, 0, "nothing was committed");
    assert_eq!(s.allocations_outstanding, 0, "rejected slots were freed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_slot_is_caught_by_validation_sm() {
    reused_slot_is_caught("sm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_slot_is_caught_by_validation_tcp() {
    reused_slot_is_caught("tcp").await;
}

/// Kills A while B fetches from it (retried when the kill overlapped no
/// fetch: the workload ended first, or nothing was cut short).
async fn killed_peer(transports: &str) {
    for attempt in 1..=3 {
        if killed_peer_once(transports).await {
            return;
        }
        eprintln!("{transports}: attempt {attempt}: the kill overlapped no fetch; again");
    }
    panic!("{transports}: in 3 attempts A was never killed while B's fetches were in flight");
}

/// One try of [`killed_peer`]: false if the kill did not land while
/// fetches were in flight.
async fn killed_peer_once(transports: &str) -> bool {
    // B coordinates membership, so it keeps its lease when A dies (a dead
    // coordinator stops every daemon from serving: see docs/COHERENCE.md).
    let (mut a, b) = pair_with(&format!("kill-{transports}"), transports, &[], "[coherence]\ncoordinator = 2\n");
    let (ca, cb) = clients(&a, &b).await;
    let (_, ba) = namespaces(&ca).await;
    let (_, bb) = namespaces(&cb).await;
    let keys: Vec<Key> = (0..1000u128).map(|i| Key(i + 77)).collect();
    put_all(&ca, &ba, &keys).await;
    // Several clients fetch batches while A is killed.
    let mut tasks = Vec::new();
    for part in 0..4usize {
        let c = b.client().await;
        let ns = bb.clone();
        let mine: Vec<Key> = keys.iter().copied().skip(part).step_by(4).collect();
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let mut outcome = (0usize, 0usize, 0usize);
            for chunk in mine.chunks(64) {
                match c.pin(&ns, chunk).await {
                    Ok(v) => {
                        for (b, k) in v.iter().zip(chunk) {
                            match b {
                                Some(b) => {
                                    assert_eq!(&b[..], &block_bytes(*k, 65536)[..]);
                                    outcome.0 += 1;
                                }
                                None => outcome.1 += 1,
                            }
                        }
                    }
                    Err(_) => outcome.2 += chunk.len(),
                }
            }
            assert_eq!(outcome.0 + outcome.1 + outcome.2, mine.len(), "every key got an outcome");
            (outcome, t0.elapsed())
        }));
    }
    // Kill A once some blocks moved and B has gets in flight.
    let t0 = Instant::now();
    let at_kill = loop {
        let s = cb.stats().await.unwrap();
        let busy = s.coherence.as_ref().is_some_and(|c| c.ops_in_flight > 0);
        if busy && s.remote_fetched >= 64 && s.remote_fetched < keys.len() as u64 {
            break s;
        }
        if s.remote_fetched >= keys.len() as u64 || tasks.iter().all(|t| t.is_finished()) {
            for t in tasks {
                let _ = t.await;
            }
            return false;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no fetch from A started: {s:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    a.child.kill().unwrap(); // SIGKILL
    a.child.wait().unwrap();
    let mut fetched = 0;
    for t in tasks {
        let ((hits, misses, errors), took) = t.await.unwrap();
        // Every call ended: data, a miss or an explicit error, within the
        // transfer deadline (2 s) per batch plus slack.
        assert!(took < Duration::from_secs(30), "calls hung for {took:?}");
        eprintln!("{transports}: hits {hits} misses {misses} errors {errors} in {took:?}");
        fetched += hits;
    }
    eprintln!(
        "{transports}: at the kill {} fetched, {} gets in flight",
        at_kill.remote_fetched,
        at_kill.coherence.as_ref().map_or(0, |c| c.ops_in_flight)
    );
    if fetched == keys.len() {
        return false; // the kill cut nothing short
    }
    // The survivor still serves once A left the view.
    let t0 = Instant::now();
    loop {
        let s = cb.stats().await.unwrap();
        let c = s.coherence.clone().unwrap();
        if c.serving && c.members == 1 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "A never left the view: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let local = Key(5);
    put_all(&cb, &bb, &[local]).await;
    assert!(cb.pin(&bb, &[local]).await.unwrap()[0].is_some());
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_gives_explicit_outcomes_sm() {
    killed_peer("sm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_gives_explicit_outcomes_tcp() {
    killed_peer("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_peer_never_slows_a_miss() {
    // B's peer accepts TCP connections but never answers (a hung host): a
    // handshake with it can only time out.
    let blackhole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ports = [blackhole.local_addr().unwrap().port(), free_port()];
    // B coordinates membership: it serves (a view of itself) while the
    // blackhole never joins.
    let b = Daemon::start("lonely-b", &(peer_config(2, &ports, "tcp", &pools()) + "[coherence]\ncoordinator = 2\n"));
    let cb = b.client().await;
    let t0 = Instant::now();
    while !cb.stats().await.unwrap().coherence.is_some_and(|c| c.serving && c.members == 1) {
        assert!(t0.elapsed() < Duration::from_secs(10), "B never served; log:\n{}", b.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (sb, _) = namespaces(&cb).await;
    for _ in 0..5 {
        let t0 = Instant::now();
        let got = cb.pin(&sb, &[Key(1), Key(2)]).await.unwrap();
        assert!(got.iter().all(|g| g.is_none()));
        assert!(t0.elapsed() < Duration::from_millis(500), "a miss waited {:?} on an unreachable peer", t0.elapsed());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let s = cb.stats().await.unwrap();
    assert_eq!(s.peers_connected, 0);
    assert_eq!(s.remote_fetched, 0);
    assert!(s.remote_misses >= 10, "every miss asked the cluster: {s:?}");
    // B still serves its own blocks.
    let k = Key(3);
    let data = block_bytes(k, 16384);
    assert_eq!(cb.put(&sb, &[(k, &data[..])]).await.unwrap().stored, 1);
    assert_eq!(&cb.pin(&sb, &[k]).await.unwrap()[0].as_ref().unwrap()[..], &data[..]);
    drop(blackhole);
}

/// The coherence stream refuses what it must and survives garbage: a
/// stream without a hello, a hello from a node not in the peer list, and
/// undecodable batches (counted, the stream and the daemon keep working).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coherence_stream_refuses_bad_input() {
    use kvmesh_proto::peer::v1 as pb;
    let (a, b) = pair("badstream", "sm", &[]);
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let addr = {
        // A's peer address is in B's config.
        let cfg = std::fs::read_to_string(b.dir.0.join("kvmeshd.toml")).unwrap();
        let line = cfg.lines().find(|l| l.starts_with("addr = ")).unwrap().to_string();
        line.trim_start_matches("addr = ").trim_matches('"').to_string()
    };
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let client = pb::peer_client::PeerClient::new(channel);
    let frame = |body| pb::Frame { body: Some(body), ..Default::default() };
    let open = |frames: Vec<pb::Frame>| {
        let mut c = client.clone();
        async move { c.exchange(tokio_stream::iter(frames)).await }
    };
    // No hello first.
    let err = open(vec![frame(pb::frame::Body::Ping(1))]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    // A node A does not know.
    let hello = |id| frame(pb::frame::Body::Hello(pb::StreamHello { node_id: id, incarnation: 1 }));
    let err = open(vec![hello(99)]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    // Garbage batches from a known node id: counted, nothing else happens.
    let before = a.client().await.stats().await.unwrap().coherence.unwrap().decode_errors;
    let frames = vec![
        hello(2),
        frame(pb::frame::Body::Batch(vec![])),
        frame(pb::frame::Body::Batch(vec![7; 100])),
        frame(pb::frame::Body::Batch(vec![1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 255, 255, 255, 255])),
        frame(pb::frame::Body::Ping(5)),
    ];
    let mut replies = open(frames).await.unwrap().into_inner();
    let pong = replies.message().await.unwrap().unwrap();
    assert_eq!(pong.body, Some(pb::frame::Body::Pong(5)));
    let ca = a.client().await;
    let t0 = Instant::now();
    loop {
        let k = ca.stats().await.unwrap().coherence.unwrap();
        if k.decode_errors >= before + 3 {
            assert!(k.serving, "{k:?}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "decode errors not counted: {k:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Membership frames: views and keepalive acks count only from the
    // coordinator (node 1, A). From node 2 to A: dropped and counted, the
    // epoch does not jump.
    let k0 = ca.stats().await.unwrap().coherence.unwrap();
    let bogus_view = pb::View { epoch: 1_000_000, members: vec![pb::Member { id: 2, incarnation: 1, capacity: 1 }] };
    let frames = vec![
        hello(2),
        frame(pb::frame::Body::View(bogus_view.clone())),
        frame(pb::frame::Body::KeepaliveAck(pb::KeepAliveAck { sent_at_us: 1, view: Some(bogus_view) })),
        frame(pb::frame::Body::Ping(6)),
    ];
    let mut replies = open(frames).await.unwrap().into_inner();
    assert_eq!(replies.message().await.unwrap().unwrap().body, Some(pb::frame::Body::Pong(6)));
    let t0 = Instant::now();
    loop {
        let k = ca.stats().await.unwrap().coherence.unwrap();
        if k.membership_foreign_drops >= k0.membership_foreign_drops + 2 {
            assert!(k.epoch < 1_000_000 && k.serving, "{k:?}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "foreign membership frames not counted: {k:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // From the coordinator's id to B: an ack echoing a send time B never
    // used grants nothing and is counted.
    let cb0 = b.client().await.stats().await.unwrap().coherence.unwrap();
    let b_addr = {
        let cfg = std::fs::read_to_string(a.dir.0.join("kvmeshd.toml")).unwrap();
        let line = cfg.lines().find(|l| l.starts_with("addr = ")).unwrap().to_string();
        line.trim_start_matches("addr = ").trim_matches('"').to_string()
    };
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{b_addr}")).unwrap().connect().await.unwrap();
    let mut to_b = pb::peer_client::PeerClient::new(channel);
    let frames = vec![
        hello(1),
        frame(pb::frame::Body::KeepaliveAck(pb::KeepAliveAck { sent_at_us: 987_654_321_987, view: None })),
        frame(pb::frame::Body::Ping(7)),
    ];
    let mut replies = to_b.exchange(tokio_stream::iter(frames)).await.unwrap().into_inner();
    assert_eq!(replies.message().await.unwrap().unwrap().body, Some(pb::frame::Body::Pong(7)));
    let cbc = b.client().await;
    let t0 = Instant::now();
    loop {
        let k = cbc.stats().await.unwrap().coherence.unwrap();
        if k.unsolicited_keepalive_acks > cb0.unsolicited_keepalive_acks {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "unsolicited ack not counted: {k:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The cluster still works.
    let (sa, _) = namespaces(&ca).await;
    let cb = b.client().await;
    let (sb, _) = namespaces(&cb).await;
    put_all(&ca, &sa, &[Key(11)]).await;
    assert_eq!(&cb.pin(&sb, &[Key(11)]).await.unwrap()[0].as_ref().unwrap()[..], &block_bytes(Key(11), 16384)[..]);
}

/// The coherence state of a daemon is bounded by what the cluster caches:
/// after 600 blocks are put on A, read on B, then half invalidated and half
/// removed on both, neither daemon keeps a copy or a directory entry (the
/// homes drop entries with no holders; before issue 18 every key ever put
/// kept one for the whole epoch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directories_shrink_back_when_blocks_go() {
    let (a, b) = pair("dir-shrink", "sm", &[]);
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let (sa, _) = namespaces(&ca).await;
    let (sb, _) = namespaces(&cb).await;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(18);
    let keys: Vec<Key> = (0..600).map(|_| Key(rng.random())).collect();
    put_all(&ca, &sa, &keys).await;
    for chunk in keys.chunks(100) {
        let got = cb.pin(&sb, chunk).await.unwrap();
        assert!(got.iter().all(|g| g.is_some()), "every block readable on B");
    }
    cb.flush_releases().await;
    let stats = |c: Client| async move { c.stats().await.unwrap().coherence.expect("clustered") };
    let (x, y) = (stats(a.client().await).await, stats(b.client().await).await);
    assert_eq!((x.copies, y.copies), (600, 600), "both hold every block");
    assert_eq!(x.directory_entries + y.directory_entries, 600, "one entry per key, at its home");
    let (inv, rem) = keys.split_at(300);
    let s = ca.invalidate(&sa, inv).await.unwrap();
    assert_eq!((s.invalidated, s.failed), (300, 0), "{s:?}");
    assert!(ca.remove(&sa, rem).await.unwrap().iter().all(|&r| r));
    assert!(cb.remove(&sb, rem).await.unwrap().iter().all(|&r| r));
    // Removals reach the homes in the next batches.
    let t0 = Instant::now();
    loop {
        let (x, y) = (stats(a.client().await).await, stats(b.client().await).await);
        if (x.copies, y.copies, x.directory_entries, y.directory_entries) == (0, 0, 0, 0) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "coherence state left behind: A {} copies {} entries, B {} copies {} entries",
            x.copies,
            x.directory_entries,
            y.copies,
            y.directory_entries
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And the keys can be put again (versions still grow: the put is
    // accepted and readable from the other daemon).
    put_all(&cb, &sb, &keys[..10]).await;
    for k in &keys[..10] {
        let got = ca.pin(&sa, &[*k]).await.unwrap();
        assert_eq!(got[0].as_deref(), Some(&block_bytes(*k, 16384)[..]));
    }
}

/// After a view change every daemon announces its copies to their homes in
/// parts of `coherence.announce_entries_max` (here 16): B restarts, so A
/// must announce the ~150 of its 300 copies that B is home of in ~10 parts
/// before B serves as their home; then every block reads back through B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_are_announced_in_parts_after_a_restart() {
    let (a, mut b) = pair_with("announce-parts", "sm", &[], "[coherence]\nannounce_entries_max = 16\n");
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let ca = a.client().await;
    let (sa, _) = namespaces(&ca).await;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(16);
    let keys: Vec<Key> = (0..300).map(|_| Key(rng.random())).collect();
    put_all(&ca, &sa, &keys).await;
    let before = ca.stats().await.unwrap().coherence.expect("clustered");
    b.restart(&[]);
    b.wait_peers(1).await;
    a.wait_peers(1).await;
    let after = ca.stats().await.unwrap().coherence.expect("clustered");
    assert!(after.epoch > before.epoch, "B's restart made a new view");
    // A sent at least 150/16 announce batches to B (half the keys are
    // homed at B, give or take) on top of what it sent before.
    assert!(after.batches_sent - before.batches_sent >= 5, "{} batches", after.batches_sent - before.batches_sent);
    let b_stats = b.client().await.stats().await.unwrap().coherence.expect("clustered");
    assert!(b_stats.directory_entries > 100, "B is home of the keys A announced: {}", b_stats.directory_entries);
    let cb = b.client().await;
    let (sb, _) = namespaces(&cb).await;
    for chunk in keys.chunks(50) {
        let got = cb.pin(&sb, chunk).await.unwrap();
        for (g, k) in got.iter().zip(chunk) {
            assert_eq!(g.as_deref(), Some(&block_bytes(*k, 16384)[..]), "block {k} through B after the restart");
        }
    }
}

/// A hostile process that reaches the peer ports of a cluster without TLS
/// (so it can claim any node id) speaks the protocol with values no honest
/// daemon sends: a view from "the coordinator" with an epoch at the end of
/// the epoch space and one naming unknown nodes, a keepalive reporting the
/// last epoch, announces of versions of this and later epochs, parts beyond
/// their count. Before the peer values were checked, these panicked or
/// wedged the daemons (the view ended B's version space, the keepalive
/// overflowed A's epoch). Now each is refused and counted, and the cluster
/// keeps serving correct data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_peer_cannot_crash_or_mislead_the_cluster() {
    use kvmesh_coherence::{Batch, BlockKey, Msg};
    use kvmesh_proto::peer::v1 as pb;
    let (a, b) = pair("hostile", "sm", &[]);
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let port_of = |d: &Daemon| {
        let cfg = std::fs::read_to_string(d.dir.0.join("kvmeshd.toml")).unwrap();
        let line = cfg.lines().find(|l| l.starts_with("listen = ") && l.contains("127.0.0.1")).unwrap().to_string();
        line.trim_start_matches("listen = ").trim_matches('"').to_string()
    };
    let open = |addr: String, frames: Vec<pb::Frame>| async move {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
        pb::peer_client::PeerClient::new(ch).exchange(tokio_stream::iter(frames)).await
    };
    let frame = |body| pb::Frame { body: Some(body), ..Default::default() };
    let hello = |id| frame(pb::frame::Body::Hello(pb::StreamHello { node_id: id, incarnation: 1 }));
    let (ca, cb) = (a.client().await, b.client().await);
    let (sa, sb) = (ca.stats().await.unwrap(), cb.stats().await.unwrap());
    let epoch = sa.coherence.as_ref().unwrap().epoch;
    let refusals = |s: &kvmesh_proto::engine::v1::StatsResponse| s.coherence.as_ref().unwrap().peer_refusals;
    let (ra, rb) = (refusals(&sa), refusals(&sb));
    let decode_errors = |s: &kvmesh_proto::engine::v1::StatsResponse| s.coherence.as_ref().unwrap().decode_errors;
    let da = decode_errors(&sa);

    // To B, as node 1 (the coordinator): views B must refuse.
    let members = |ids: &[u32]| ids.iter().map(|&id| pb::Member { id, incarnation: 1, capacity: 1 }).collect();
    let frames = vec![
        hello(1),
        frame(pb::frame::Body::View(pb::View { epoch: u64::MAX, members: members(&[1, 2]) })),
        frame(pb::frame::Body::View(pb::View { epoch: epoch + 1, members: members(&[1, 2, 99]) })),
        frame(pb::frame::Body::View(pb::View { epoch: epoch + 1, members: members(&[1, 2, 2]) })),
        frame(pb::frame::Body::Ping(1)),
    ];
    let mut r = open(port_of(&b), frames).await.unwrap().into_inner();
    assert_eq!(r.message().await.unwrap().unwrap().body, Some(pb::frame::Body::Pong(1)));
    // To A (the coordinator), as node 2 with B's incarnation: a keepalive
    // reporting the last epoch, announces of impossible versions.
    let inc_b = sa.peers.iter().find(|p| p.id == 2).map(|p| p.view_incarnation).unwrap();
    let keys: Vec<BlockKey> = (0..64u128).map(|k| BlockKey { ns: 7, key: k }).collect();
    let announce = |round, version: u64| Msg::Announce {
        round,
        part: 0,
        parts: 1,
        entries: keys.iter().map(|&k| (k, version, 1)).collect(),
    };
    let batch = Batch {
        epoch,
        incarnation: inc_b,
        msgs: vec![announce(1_000, (epoch << 32) | 0xffff_ffff), announce(1_001, (epoch + 5) << 32)],
    };
    // A part beyond its count does not even decode (the batch is dropped).
    let bad_part = Batch {
        epoch,
        incarnation: inc_b,
        msgs: vec![Msg::Announce { round: 1_002, part: 3, parts: 2, entries: vec![] }],
    };
    let frames = vec![
        hello(2),
        frame(pb::frame::Body::Keepalive(pb::KeepAlive {
            sent_at_us: 1,
            incarnation: inc_b,
            epoch_seen: u64::MAX,
            capacity: 1,
        })),
        frame(pb::frame::Body::Batch(batch.encode())),
        frame(pb::frame::Body::Batch(bad_part.encode())),
        frame(pb::frame::Body::Ping(2)),
    ];
    let mut r = open(port_of(&a), frames).await.unwrap().into_inner();
    assert_eq!(r.message().await.unwrap().unwrap().body, Some(pb::frame::Body::Pong(2)));

    // Refused and counted on both; both daemons alive, in the same epoch.
    let t0 = Instant::now();
    loop {
        let (sa, sb) = (ca.stats().await.unwrap(), cb.stats().await.unwrap());
        // B: the two impossible views (the one naming node 99 is refused
        // as a configuration mismatch: logged, not counted). A: the copies
        // of the 2 x 64 announced that it homes (about half), and the bad
        // part as a decode error.
        if refusals(&sb) >= rb + 2 && refusals(&sa) > ra + 16 && decode_errors(&sa) > da {
            break;
        }
        let brief = |s: &kvmesh_proto::engine::v1::StatsResponse| {
            let c = s.coherence.as_ref().unwrap();
            (c.epoch, c.members, c.serving, c.peer_refusals, c.decode_errors)
        };
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "refusals not counted: A (epoch, members, serving, refusals, decode errors) {:?} B {:?}",
            brief(&sa),
            brief(&sb)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The cluster still serves correct data both ways (puts need versions
    // of the current epoch at every home).
    for (i, (w, r)) in [(&a, &b), (&b, &a)].into_iter().enumerate() {
        for k in 0..16u128 {
            let key = Key(0xbad0_0000_0000_0000_0000_0000_0000_0000 | (i as u128) << 64 | k);
            let fill = b'a' + k as u8;
            common::fill::put_until_stored(w, key, fill, Duration::from_secs(10)).await;
            assert_eq!(common::fill::get(r, key).await, Some(fill), "{key:?}");
        }
    }
    let (sa, sb) = (ca.stats().await.unwrap(), cb.stats().await.unwrap());
    let (ka, kb) = (sa.coherence.unwrap(), sb.coherence.unwrap());
    assert!(b.log().contains("view refused: member 99 is neither this node nor one of its [[peers]]"), "{}", b.log());
    assert_eq!(ka.epoch, kb.epoch, "one view");
    assert!(ka.epoch < 1 << 20, "the epoch did not jump: {}", ka.epoch);
    assert!(ka.serving && kb.serving);
}

/// A member that names another capacity in every keepalive (a buggy or
/// hostile process speaking as node 2 without TLS; an honest daemon's
/// capacity changes only with a restart) does not make the coordinator
/// publish a view per keepalive — each view clears and rebuilds every
/// directory. With the old rule, planted (`KVMESH_TEST_BUG=capacity-per-keepalive`
/// on the coordinator), the same keepalives move the epoch by dozens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_changing_its_capacity_in_every_keepalive_publishes_no_views() {
    for planted in [true, false] {
        let env: &[(&str, &str)] = if planted { &[("KVMESH_TEST_BUG", "capacity-per-keepalive")] } else { &[] };
        let (a, b) = pair(if planted { "capflap-bug" } else { "capflap" }, "sm", env);
        let (ca, epoch, inc_b) = view_of_pair(&a, &b).await;
        send_as_node_2(&a, inc_b, (0..40u32).map(|i| (inc_b, 2 + i % 2)), epoch).await;
        let after = epoch_after(&ca, epoch, planted).await;
        if planted {
            assert!(after >= epoch + 20, "the planted rule must publish views: epoch {epoch} -> {after}");
            continue;
        }
        assert_eq!(after, epoch, "keepalives naming other capacities published views");
        // Both still serve, in one view, and move blocks.
        let key = Key(0xcaf0_0000_0000_0000_0000_0000_0000_0001);
        common::fill::put_until_stored(&a, key, b'c', Duration::from_secs(10)).await;
        assert_eq!(common::fill::get(&b, key).await, Some(b'c'));
        let kb = b.client().await.stats().await.unwrap().coherence.unwrap();
        assert_eq!(kb.epoch, epoch, "B is in the same view");
    }
}

/// A member that names a new incarnation in every keepalive (a buggy or
/// hostile process speaking as node 2 without TLS; the same as a daemon
/// in a crash loop) gets at most one admitted per removal time, so it does
/// not make the coordinator publish a view per keepalive — each view
/// clears and rebuilds every directory. With the old rule, planted
/// (`KVMESH_TEST_BUG=incarnation-per-keepalive` on the coordinator), the
/// same keepalives move the epoch by dozens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_naming_a_new_incarnation_in_every_keepalive_publishes_one_view() {
    for planted in [true, false] {
        let env: &[(&str, &str)] = if planted { &[("KVMESH_TEST_BUG", "incarnation-per-keepalive")] } else { &[] };
        let (a, b) = pair(if planted { "incflap-bug" } else { "incflap" }, "sm", env);
        let (ca, epoch, inc_b) = view_of_pair(&a, &b).await;
        send_as_node_2(&a, inc_b, (1..=40u64).map(|i| (inc_b + i, 1)), epoch).await;
        let after = epoch_after(&ca, epoch, planted).await;
        if planted {
            assert!(after >= epoch + 20, "the planted rule must publish views: epoch {epoch} -> {after}");
            continue;
        }
        // The first may be admitted (B's own was admitted over the removal
        // time ago), the other 39 or all 40 are held back.
        assert!(after <= epoch + 1, "new incarnations in every keepalive published views: epoch {epoch} -> {after}");
        let held = ca.stats().await.unwrap().coherence.unwrap().incarnations_held_back;
        assert!(held >= 39, "{held} keepalives held back");
        // B (its own incarnation, once the forged one fell silent for the
        // removal time) serves again, and the pair moves blocks.
        let key = Key(0xcaf0_0000_0000_0000_0000_0000_0000_0002);
        common::fill::put_until_stored(&a, key, b'i', Duration::from_secs(15)).await;
        let t0 = Instant::now();
        while common::fill::get(&b, key).await != Some(b'i') {
            assert!(t0.elapsed() < Duration::from_secs(10), "B never served A's block again");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let kb = b.client().await.stats().await.unwrap().coherence.unwrap();
        assert!(kb.serving && kb.epoch <= epoch + 2, "{kb:?}");
    }
}

/// Once both see each other: A's client, the epoch, and B's incarnation in
/// A's view.
async fn view_of_pair(a: &Daemon, b: &Daemon) -> (Client, u64, u64) {
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let ca = a.client().await;
    let sa = ca.stats().await.unwrap();
    let epoch = sa.coherence.as_ref().unwrap().epoch;
    let inc_b = sa.peers.iter().find(|p| p.id == 2).map(|p| p.view_incarnation).unwrap();
    (ca, epoch, inc_b)
}

/// Sends A, on a coherence stream speaking as node 2 (incarnation
/// `hello_inc`), keepalives of the (incarnation, capacity) pairs given,
/// and returns once A has handled them all.
async fn send_as_node_2(a: &Daemon, hello_inc: u64, kas: impl Iterator<Item = (u64, u32)>, epoch: u64) {
    use kvmesh_proto::peer::v1 as pb;
    let cfg = std::fs::read_to_string(a.dir.0.join("kvmeshd.toml")).unwrap();
    let listen = cfg.lines().find(|l| l.starts_with("listen = ") && l.contains("127.0.0.1")).unwrap();
    let addr = listen.trim_start_matches("listen = ").trim_matches('"');
    let frame = |body| pb::Frame { body: Some(body), ..Default::default() };
    let mut frames = vec![frame(pb::frame::Body::Hello(pb::StreamHello { node_id: 2, incarnation: hello_inc }))];
    for (incarnation, capacity) in kas {
        // (An old send time: the acknowledgements extend no lease of B's.)
        frames.push(frame(pb::frame::Body::Keepalive(pb::KeepAlive {
            sent_at_us: 1,
            incarnation,
            epoch_seen: epoch,
            capacity,
        })));
    }
    frames.push(frame(pb::frame::Body::Ping(7)));
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let mut r = pb::peer_client::PeerClient::new(ch).exchange(tokio_stream::iter(frames)).await.unwrap().into_inner();
    // The pong comes after every keepalive before it was handled.
    loop {
        match r.message().await.unwrap().map(|f| f.body) {
            Some(Some(pb::frame::Body::Pong(7))) => break,
            Some(_) => continue,
            None => panic!("stream ended before the pong"),
        }
    }
}

/// A's epoch once the views the keepalives caused had time to show: 20
/// above `epoch` or 5 s with the planted rule, 0.5 s without.
async fn epoch_after(ca: &Client, epoch: u64, planted: bool) -> u64 {
    // (Views are applied by the driver: give them time to show.)
    let t0 = Instant::now();
    loop {
        let e = ca.stats().await.unwrap().coherence.unwrap().epoch;
        if (planted && e >= epoch + 20) || t0.elapsed() > Duration::from_millis(if planted { 5000 } else { 500 }) {
            return e;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A peer from before locate-time registration (its handshake says so:
/// `KVMESH_TEST_HOOK=predate-locate-registration`) is sent plain locates:
/// it registers nobody at locate time (it could not decode such a locate),
/// and gets of keys it homes register after their read; keys homed at the
/// reader itself still go the short way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_from_before_locate_time_registration_gets_plain_locates() {
    // A pretends to predate it; B fetches what A put.
    let (a, b) = pair("oldreg", "sm", &[("KVMESH_TEST_HOOK", "predate-locate-registration")]);
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let (sa, _) = namespaces(&ca).await;
    let (sb, _) = namespaces(&cb).await;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(13);
    let keys: Vec<Key> = (0..64).map(|_| Key(rng.random())).collect();
    put_all(&ca, &sa, &keys).await;
    pin_verified(&cb, &sb, &keys).await;
    let ka = ca.stats().await.unwrap().coherence.unwrap();
    let kb = cb.stats().await.unwrap().coherence.unwrap();
    assert_eq!(ka.decode_errors, 0, "{ka:?}");
    assert_eq!(ka.pending_registrations, 0, "A was sent plain locates: {ka:?}");
    // B's own directory registered B at locate time for the keys B homes.
    assert_eq!(kb.early_registrations, kb.pending_registrations, "{kb:?}");
    assert!(kb.early_registrations > 0 && kb.early_registrations < 64, "keys homed on both sides: {kb:?}");
}

/// SysV segments mapped into process `pid`: (segment id, bytes mapped,
/// bytes resident in its page tables), one per mapping, from
/// `/proc/<pid>/smaps` (a SysV mapping's inode column is its segment id).
fn sysv_mappings(pid: u32) -> Vec<(u64, u64, u64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut out = Vec::new();
    let mut current: Option<(u64, u64)> = None;
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let is_header = fields.first().is_some_and(|f| f.contains('-') && !f.ends_with(':'));
        if is_header {
            current = (fields.len() >= 6 && fields[5].starts_with("/SYSV")).then(|| (fields[4].parse().unwrap(), 0));
        } else if let Some((id, size)) = current.as_mut() {
            let kb = || fields.get(1).and_then(|v| v.parse::<u64>().ok()).unwrap() * 1024;
            match fields.first() {
                Some(&"Size:") => *size = kb(),
                Some(&"Rss:") => out.push((*id, *size, kb())),
                _ => {}
            }
        }
    }
    out
}

/// On shared memory, UCX maps the holder's pools into the reader; their
/// pages are faulted in once, when the endpoint is made, not one by one on
/// the data-plane thread as reads first touch them (a 256 KiB block read
/// for the first time cost ~180 µs more than a re-read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_pools_are_prefaulted_where_shared_memory_maps_them() {
    let (a, b) = pair("prefault", "sm", &[]);
    let (ca, cb) = clients(&a, &b).await;
    let (sa, _) = namespaces(&ca).await;
    let (sb, _) = namespaces(&cb).await;
    // One read of one 16 KiB block: the endpoint is surely made; by itself
    // it touches four pages of A's 128 MiB.
    put_all(&ca, &sa, &[Key(1)]).await;
    pin_verified(&cb, &sb, &[Key(1)]).await;
    // A's pools: the segments A maps twice (UCX's view and its own); the
    // others in A are B's pools and UCX's own small segments.
    let in_a = sysv_mappings(a.child.id());
    let mut own: Vec<u64> =
        in_a.iter().map(|m| m.0).filter(|id| in_a.iter().filter(|m| m.0 == *id).count() >= 2).collect();
    own.sort_unstable();
    own.dedup();
    assert_eq!(own.len(), 2, "A's two pools are UCX-allocated SysV segments: {in_a:?}");
    let t0 = Instant::now();
    loop {
        let in_b: Vec<_> = sysv_mappings(b.child.id()).into_iter().filter(|m| own.contains(&m.0)).collect();
        assert_eq!(in_b.len(), 2, "UCX maps A's two pools into B: {:?}", sysv_mappings(b.child.id()));
        if in_b.iter().all(|&(_, size, rss)| rss * 100 >= size * 95) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "A's pools not faulted in in B: {in_b:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// tcp, `peer.push_with_grants` on A (the default) and off on B: A's gets
/// read slots B pushed with its grants; B's gets take the send-order path
/// (B invites nothing, though it answers A's invitations); A's misses
/// come to nothing and give their reserved slots back. Every byte checked.
/// Coherence batches on the peer streams (tcp's default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_slots_are_read_and_unused_ones_freed_tcp() {
    pushed_slots_are_read_and_unused_ones_freed("grpc").await;
}

/// The same with coherence batches as UCX active messages
/// (`peer.control = "ucx"`): the frames that carry invitations and answers
/// travel that way too (before, pushes were off there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_slots_are_read_and_unused_ones_freed_tcp_active_messages() {
    pushed_slots_are_read_and_unused_ones_freed("ucx").await;
}

/// A pushed block can land before the core starts its read (the core
/// handled the grant after the bytes came: on one endpoint with active
/// messages, or from a stream behind a busy core). Its read is then
/// checked and reported within the input that started it (push.rs,
/// `read_pushed`), not by a task. The getter's test hook handles push
/// answers 100 ms late, so the blocks here land first: the bytes are
/// checked, and a block the holder corrupted (its test hook) is refused on
/// that path as on every other.
async fn pushes_that_landed_first(corrupt: bool) {
    let ports = [free_port(), free_port()];
    let tag = if corrupt { "landed-corrupt" } else { "landed" };
    let holder: &[(&str, &str)] = if corrupt { &[("KVMESH_TEST_HOOK", "corrupt-granted-slots")] } else { &[] };
    let a = Daemon::start_with(&format!("{tag}-a"), &peer_config(1, &ports, "tcp", &pools()), holder);
    let b = Daemon::start_with(
        &format!("{tag}-b"),
        &peer_config(2, &ports, "tcp", &pools()),
        &[("KVMESH_TEST_HOOK", "delay-push-answers-ms:100")],
    );
    let (ca, cb) = clients(&a, &b).await;
    let (sa, _) = namespaces(&ca).await;
    let (sb, _) = namespaces(&cb).await;
    let keys: Vec<Key> = (0..8u128).map(|i| Key(0x1a4d_0000 + i)).collect();
    put_all(&ca, &sa, &keys).await;
    // One at a time: each get's answer starts one read.
    for &k in &keys {
        if corrupt {
            let got = cb.pin(&sb, &[k]).await.unwrap();
            assert!(got[0].is_none(), "a corrupted pushed block reached the client ({k})");
        } else {
            pin_verified(&cb, &sb, &[k]).await;
        }
    }
    let kb = stats_coherence(&b);
    let n = |f: &str| kb[f].as_u64().unwrap();
    assert_eq!(n("pushes_used"), 8, "every read used its pushed slot: {kb}");
    // 100 ms is far more than a 16 KiB send on loopback takes; a block
    // later than that (a loaded machine) meets its read as before.
    assert!(n("pushes_landed_first") >= 6, "pushed blocks had landed before their reads started: {kb}");
    let s = cb.stats().await.unwrap();
    if corrupt {
        assert_eq!(s.remote_validation_failures, 8, "{s:?}");
        assert_eq!(s.remote_fetched, 0, "{s:?}");
        assert_eq!(s.pools[0].valid, 0, "nothing was committed: {s:?}");
        assert_eq!(s.allocations_outstanding, 0, "rejected slots were freed: {s:?}");
    } else {
        assert_eq!(s.remote_validation_failures, 0, "{s:?}");
        assert_eq!(s.remote_fetched, 8, "{s:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_block_that_landed_first_is_read_in_the_same_input_tcp() {
    pushes_that_landed_first(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_pushed_block_that_landed_first_is_refused_tcp() {
    pushes_that_landed_first(true).await;
}

async fn pushed_slots_are_read_and_unused_ones_freed(control: &str) {
    let ports = [free_port(), free_port()];
    // `peer_config_tls` writes its last argument as `peer.tls`'s value: the
    // lines after it land in `[peer]` too.
    let off = "{ mode = \"off\" }";
    let a_peer = format!("{off}\ncontrol = \"{control}\"");
    let a = Daemon::start(&format!("push-a-{control}"), &common::peer_config_tls(1, &ports, "tcp", &pools(), &a_peer));
    let b_peer = format!("{a_peer}\npush_with_grants = false");
    let b = Daemon::start(&format!("push-b-{control}"), &common::peer_config_tls(2, &ports, "tcp", &pools(), &b_peer));
    let (ca, cb) = clients(&a, &b).await;
    let (sa, _) = namespaces(&ca).await;
    let (sb, _) = namespaces(&cb).await;
    let on_a: Vec<Key> = (0..40u128).map(|i| Key(1000 + i)).collect();
    let on_b: Vec<Key> = (0..40u128).map(|i| Key(2000 + i)).collect();
    put_all(&ca, &sa, &on_a).await;
    put_all(&cb, &sb, &on_b).await;
    for chunk in on_b.chunks(8) {
        pin_verified(&ca, &sa, chunk).await;
    }
    for chunk in on_a.chunks(8) {
        pin_verified(&cb, &sb, chunk).await;
    }
    // Keys nobody holds: misses (those homed at B invited a push B declines).
    let absent: Vec<Key> = (0..40u128).map(|i| Key(3000 + i)).collect();
    assert!(ca.pin(&sa, &absent).await.unwrap().iter().all(|b| b.is_none()));
    let (ka, kb) = (stats_coherence(&a), stats_coherence(&b));
    let n = |c: &serde_json::Value, f: &str| c[f].as_u64().unwrap();
    assert!(n(&ka, "pushes_used") >= 20, "most of A's 40 fetches read pushed slots: {ka}");
    assert!(n(&ka, "pushes_unused") >= 1, "misses homed at B were declined: {ka}");
    assert_eq!(n(&kb, "push_invites"), 0, "B has pushes off: {kb}");
    assert!(n(&kb, "pushes_sent") >= n(&ka, "pushes_used"), "B sent what A used: {kb}");
    assert_eq!(n(&ka, "pushes_sent"), 0, "B never invited: {ka}");
    // Every invitation accounted for, and every reserved slot given back
    // (a declined receive is cancelled; its slot freed).
    let t0 = Instant::now();
    loop {
        let ka = stats_coherence(&a);
        let s = ca.stats().await.unwrap();
        if n(&ka, "push_invites") == n(&ka, "pushes_used") + n(&ka, "pushes_unused") && s.allocations_outstanding == 0 {
            assert_eq!(s.remote_fetched, 40, "{s:?}");
            assert_eq!(s.remote_validation_failures, 0, "{s:?}");
            let valid: u32 = s.pools.iter().map(|p| p.valid).sum();
            assert_eq!(valid, 80, "A holds its 40 blocks and the 40 it fetched, nothing else: {s:?}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "reserved slots not freed: {ka} {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cb.stats().await.unwrap().remote_fetched, 40);
}

/// tcp: a peer from before push invitations (test hook: its handshake does
/// not offer them, and it would ignore them) is never invited — its blocks
/// come over the send-order path — while its own gets still invite the
/// other daemon, which pushes. Every byte checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_from_before_push_invitations_is_not_invited_tcp() {
    let (a, b) = pair("oldpush", "tcp", &[("KVMESH_TEST_HOOK", "predate-push-invites")]);
    let (ca, cb) = clients(&a, &b).await;
    let (sa, _) = namespaces(&ca).await;
    let (sb, _) = namespaces(&cb).await;
    let on_a: Vec<Key> = (0..32u128).map(|i| Key(5000 + i)).collect();
    let on_b: Vec<Key> = (0..32u128).map(|i| Key(6000 + i)).collect();
    put_all(&ca, &sa, &on_a).await;
    put_all(&cb, &sb, &on_b).await;
    for chunk in on_a.chunks(8) {
        pin_verified(&cb, &sb, chunk).await;
    }
    for chunk in on_b.chunks(8) {
        pin_verified(&ca, &sa, chunk).await;
    }
    let (ka, kb) = (stats_coherence(&a), stats_coherence(&b));
    let n = |c: &serde_json::Value, f: &str| c[f].as_u64().unwrap();
    assert_eq!(n(&kb, "push_invites"), 0, "B never invites A: {kb}");
    assert_eq!(n(&ka, "pushes_sent"), 0, "{ka}");
    assert!(n(&ka, "pushes_used") >= 16, "A's own gets were pushed by B: {ka}");
    assert_eq!(cb.stats().await.unwrap().remote_fetched, 32);
    assert_eq!(ca.stats().await.unwrap().remote_fetched, 32);
}

/// A block the holder granted in a batch not sent yet is not evicted by an
/// allocation meanwhile: the store passes over what the coherence core
/// keeps for readers. Before, the store freed the granted slot (its pin
/// was taken only when the batch left); the core kept the copy with no
/// slot behind it (a phantom it went on announcing), and the reader was
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_granted_in_an_unsent_batch_is_not_evicted() {
    let ports = [free_port(), free_port()];
    // A: one small pool, eviction only when full, and batches that wait
    // 600 ms for company (none leaves when A's input runs dry).
    let a_extra = "[eviction]\nhigh_watermark = 1.0\nlow_watermark = 1.0\n\
                   [coherence]\nflush_when_idle = false\nflush_delay_us = 600000\n";
    let a = Daemon::start("granted-a", &(peer_config(1, &ports, "sm", &pool("p16k", "512KiB", "16KiB")) + a_extra));
    let b = Daemon::start("granted-b", &peer_config(2, &ports, "sm", &pools()));
    let (ca, cb) = clients(&a, &b).await;
    let sa = ca.register_namespace("small", 16384, "l").await.unwrap();
    let sb = cb.register_namespace("small", 16384, "l").await.unwrap();
    let slots = ca.stats().await.unwrap().pools[0].slots as u128;
    assert!(slots >= 4, "{slots}");
    // Key 0 first (the first block eviction would take), then the rest of the pool.
    put_all(&ca, &sa, &[Key(0)]).await;
    put_all(&ca, &sa, &(1..slots).map(Key).collect::<Vec<_>>()).await;
    let s = ca.stats().await.unwrap();
    assert_eq!((s.pools[0].valid, s.pools[0].free), (slots as u32, 0), "{:?}", s.pools[0]);
    let grants = |s: kvmesh_client::Stats| s.coherence.unwrap().grants_outstanding;
    let before = grants(ca.stats().await.unwrap());
    // (The store counts a grant when its batch leaves and pins it.)
    let pinned_grants = ca.stats().await.unwrap().grants_given;

    // B's get of key 0: A grants it; the grant waits in A's unsent batch.
    let getter = tokio::spawn(async move { cb.pin(&sb, &[Key(0)]).await.map(|v| (v, sb)) });
    let t = Instant::now();
    while grants(ca.stats().await.unwrap()) == before {
        assert!(t.elapsed() < Duration::from_secs(5), "A never granted key 0");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // An engine put on A now, whose allocation evicts one block of the
    // full pool, while the grant's batch has not left (checked after the
    // allocation: else its pin, not the fix, kept the block).
    let mut w = match ca.allocate(&sa, &[Key(1000)]).await.unwrap().pop() {
        Some(kvmesh_client::Allocation::Allocated(w)) => w,
        other => panic!("{other:?}"),
    };
    assert_eq!(ca.stats().await.unwrap().grants_given, pinned_grants, "the grant left before the allocation: no check");
    w.write(&block_bytes(Key(1000), sa.block_bytes as usize)).unwrap();
    let c = ca.commit(vec![w]).await.unwrap();
    assert!(matches!(c[0], kvmesh_client::CommitOutcome::Committed { .. }), "{c:?}");
    let (got, sb) = getter.await.unwrap().unwrap();
    let blk = got[0].as_ref().expect("the granted block reached B");
    assert_eq!(&blk[..], &block_bytes(Key(0), sb.block_bytes as usize)[..]);
    // A still has key 0 (another block went), and serves it.
    let pinned = ca.pin(&sa, &[Key(0)]).await.unwrap();
    assert_eq!(&pinned[0].as_ref().expect("A's own key 0")[..], &block_bytes(Key(0), sa.block_bytes as usize)[..]);
    let evicted = ca.stats().await.unwrap().evictions;
    assert_eq!(evicted, 1, "one block made room");
}
