//! The Prometheus endpoint of a real daemon, scraped over HTTP while it
//! works; the text passes `promtool check metrics` where promtool exists.

mod common;

use std::io::{Read, Write};

use common::{Daemon, free_port, pool};
use kvmesh_client::Key;

fn get(port: u16, path: &str, accept: &str) -> (u16, String, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to the metrics port");
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: {accept}\r\nConnection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head.to_string(), body.to_string())
}

/// The value of the first sample line starting with `prefix`.
fn sample(text: &str, prefix: &str) -> f64 {
    let line = text.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix} in:\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_while_the_daemon_works_and_pass_promtool() {
    let port = free_port();
    let d =
        Daemon::start("metrics", &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n{}", pool("p", "16MiB", "64KiB")));
    let c = d.client().await;
    let ns = c.register_namespace("metrics-test", 4096, "x").await.unwrap();
    let keys: Vec<Key> = (1..=10u128).map(Key).collect();
    let blocks: Vec<Vec<u8>> = keys.iter().map(|k| vec![k.0 as u8; 4096]).collect();
    let items: Vec<(Key, &[u8])> = keys.iter().copied().zip(blocks.iter().map(|b| &b[..])).collect();
    assert_eq!(c.put(&ns, &items).await.unwrap().stored, 10);
    let pinned = c.pin(&ns, &keys[..4]).await.unwrap();
    assert!(c.namespace("no-such-namespace").await.is_err());

    // What Prometheus asks for: OpenMetrics.
    let om_accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
    let (status, head, om) = tokio::task::spawn_blocking(move || get(port, "/metrics", om_accept)).await.unwrap();
    assert_eq!(status, 200, "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: application/openmetrics-text"), "{head}");
    assert!(om.trim_end().ends_with("# EOF"), "{om}");
    assert!(om.contains("# TYPE kvmesh_commits counter"), "{om}");
    // What curl and promtool get: the Prometheus text format.
    let (status, head, text) = tokio::task::spawn_blocking(move || get(port, "/metrics", "*/*")).await.unwrap();
    assert_eq!(status, 200, "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4"), "{head}");
    assert!(text.contains("# TYPE kvmesh_commits_total counter") && !text.contains("# EOF"), "{text}");
    assert_eq!(sample(&text, "kvmesh_commits_total"), 10.0);
    assert_eq!(sample(&text, "kvmesh_pins_outstanding"), 4.0);
    assert_eq!(sample(&text, "kvmesh_pool_pinned_slots{pool=\"p\""), 4.0);
    assert!(sample(&text, "kvmesh_pool_slots{pool=\"p\"") > 200.0);
    assert!(text.contains("# TYPE kvmesh_engine_call_seconds histogram"), "{text}");
    assert!(sample(&text, "kvmesh_engine_call_seconds_count{method=\"pin\",result=\"ok\"}") >= 1.0);
    assert!(sample(&text, "kvmesh_engine_call_seconds_count{method=\"get_namespace\",result=\"error\"}") >= 1.0);
    drop(pinned);
    c.flush_releases().await;
    let (_, _, text) = tokio::task::spawn_blocking(move || get(port, "/metrics", "*/*")).await.unwrap();
    assert_eq!(sample(&text, "kvmesh_lease_remaining_at_unpin_seconds_count"), 4.0, "{text}");
    // The last bucket is +Inf (PromQL's histogram_quantile needs it).
    assert_eq!(sample(&text, "kvmesh_lease_remaining_at_unpin_seconds_bucket{le=\"+Inf\"}"), 4.0, "{text}");
    // Released within a second of a 30 s lease: the 16.4-32.8 s bucket.
    assert_eq!(sample(&text, "kvmesh_lease_remaining_at_unpin_seconds_bucket{le=\"10.24\"}"), 0.0, "{text}");

    let (status, _, _) = tokio::task::spawn_blocking(move || get(port, "/nope", "*/*")).await.unwrap();
    assert_eq!(status, 404);

    common::promtool_check_metrics(&text);
}

#[test]
fn a_metrics_port_in_use_is_a_startup_error_naming_the_field() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let dir = common::TempDir::new("metrics-busy");
    let cfg = dir.0.join("kvmeshd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nsocket = {:?}\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n{}",
            dir.0.join("s.sock").display().to_string(),
            pool("p", "4MiB", "4KiB")
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvmeshd")).arg("--config").arg(&cfg).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("metrics.listen") && err.contains(&port.to_string()), "{err}");
    std::fs::write(&cfg, "[metrics]\nlisten = \"not-an-address\"\n".to_string() + &pool("p", "4MiB", "4KiB")).unwrap();
    let out = common::check_config(&cfg);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("metrics.listen"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    for args in [["check", "rules", "alerts.yml"], ["test", "rules", "alerts.test.yml"]] {
        match std::process::Command::new("promtool").args(args).current_dir(&deploy).output() {
            Ok(out) => assert!(
                out.status.success(),
                "promtool {args:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => {
                eprintln!("SKIPPED promtool {args:?}: promtool not found ({e}); install the Debian package prometheus");
                return;
            }
        }
    }
}

/// Every `kvmesh_*` metric the dashboard and the alert rules use is one the
/// daemon serves (a renamed metric breaks this test, not a dashboard).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_alerts_use_only_served_metrics() {
    let port = free_port();
    let d = Daemon::start(
        "metrics-names",
        &format!(
            "[metrics]\nlisten = \"127.0.0.1:{port}\"\n[node]\nid = 1\n[peer]\nlisten = \"127.0.0.1:{}\"\ntls = {{ mode = \"off\" }}\n{}\
             [[peers]]\nid = 2\naddr = \"127.0.0.1:{}\"\n",
            free_port(),
            pool("p", "4MiB", "4KiB"),
            free_port()
        ),
    );
    let c = d.client().await;
    let ns = c.register_namespace("names", 4096, "x").await.unwrap();
    c.lookup_local(&ns, &[Key(1)]).await.unwrap();
    let (_, _, text) = tokio::task::spawn_blocking(move || get(port, "/metrics", "*/*")).await.unwrap();
    let served: std::collections::HashSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
        .collect();
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let used = std::fs::read_to_string(deploy.join("grafana-dashboard.json")).unwrap()
        + &std::fs::read_to_string(deploy.join("alerts.yml")).unwrap();
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(deploy.join("grafana-dashboard.json")).unwrap()).unwrap();
    assert!(dashboard["panels"].as_array().unwrap().len() >= 8);
    let mut names: Vec<&str> = Vec::new();
    let mut rest = used.as_str();
    while let Some(i) = rest.find("kvmesh_") {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        names.push(&tail[..end]);
        rest = &tail[end..];
    }
    assert!(names.len() > 10, "{names:?}");
    assert!(served.contains("kvmesh_coherence_inval_to_ack_p99_seconds"), "{text}");
    // The clustered daemon's text passes promtool too.
    common::promtool_check_metrics(&text);
    for n in names {
        assert!(served.contains(n), "{n} is used by deploy/ but not served:\n{text}");
    }
    drop(d);
}

/// The shipped unit passes `systemd-analyze verify` (with ExecStart pointed
/// at the binary just built).
#[test]
fn the_systemd_unit_verifies() {
    let unit =
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kvmeshd.service"))
            .unwrap();
    assert!(unit.contains("Type=notify") && unit.contains("WatchdogSec=") && unit.contains("ExecReload="));
    let dir = common::TempDir::new("unit");
    let path = dir.0.join("kvmeshd.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/kvmeshd", env!("CARGO_BIN_EXE_kvmeshd"))).unwrap();
    match std::process::Command::new("systemd-analyze").arg("verify").arg(&path).output() {
        Ok(out) => assert!(
            out.status.success() && out.stderr.is_empty(),
            "systemd-analyze verify: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => eprintln!("SKIPPED systemd-analyze verify: not found ({e}); install the Debian package systemd"),
    }
}

/// Fetching from a peer shows in the getter's histograms: gets by result,
/// transfer batch bytes and time, bytes read; and the per-peer gauges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_fetch_shows_in_the_get_and_transfer_histograms() {
    use common::peer_config;
    let ports = [free_port(), free_port()];
    let mport = free_port();
    let pools = pool("p", "8MiB", "64KiB");
    let a = Daemon::start("metrics-remote-1", &peer_config(1, &ports, "tcp", &pools));
    let b = Daemon::start(
        "metrics-remote-2",
        &(peer_config(2, &ports, "tcp", &pools) + &format!("[metrics]\nlisten = \"127.0.0.1:{mport}\"\n")),
    );
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let ns_a = ca.register_namespace("m", 65536, "x").await.unwrap();
    let ns_b = cb.register_namespace("m", 65536, "x").await.unwrap();
    let keys: Vec<Key> = (1..=3u128).map(|i| Key(0xabc0 + i)).collect();
    let data = vec![5u8; 65536];
    let items: Vec<(Key, &[u8])> = keys.iter().map(|&k| (k, &data[..])).collect();
    assert_eq!(ca.put(&ns_a, &items).await.unwrap().stored, 3);
    // Three fetched from daemon 1, then the same three local, one miss.
    let mut ask = keys.clone();
    ask.push(Key(0xdead));
    let got = cb.pin(&ns_b, &ask).await.unwrap();
    assert_eq!(got.iter().filter(|b| b.is_some()).count(), 3);
    drop(got);
    let got = cb.pin(&ns_b, &keys).await.unwrap();
    assert!(got.iter().all(|b| b.as_ref().is_some_and(|b| b.iter().all(|&x| x == 5))));
    let (_, _, text) = tokio::task::spawn_blocking(move || get(mport, "/metrics", "*/*")).await.unwrap();
    assert_eq!(sample(&text, "kvmesh_get_seconds_count{result=\"fetched\"}"), 3.0, "{text}");
    assert_eq!(sample(&text, "kvmesh_get_seconds_count{result=\"local_hit\"}"), 3.0);
    assert_eq!(sample(&text, "kvmesh_get_seconds_count{result=\"miss\"}"), 1.0);
    for stage in ["locate", "read", "register"] {
        assert_eq!(sample(&text, &format!("kvmesh_get_stage_seconds_count{{stage=\"{stage}\"}}")), 3.0, "{text}");
    }
    let batches = sample(&text, "kvmesh_transfer_batch_bytes_count");
    assert_eq!(sample(&text, "kvmesh_transfer_post_seconds_count"), batches);
    assert_eq!(sample(&text, "kvmesh_transfer_validate_seconds_count"), batches);
    assert!((1.0..=3.0).contains(&batches), "{text}");
    // Whole slots move (header + payload + trailer): at least the payload.
    assert!(sample(&text, "kvmesh_remote_read_bytes_total") >= 3.0 * 65536.0, "{text}");
    assert_eq!(sample(&text, "kvmesh_transfer_batch_bytes_sum"), sample(&text, "kvmesh_remote_read_bytes_total"));
    assert_eq!(sample(&text, "kvmesh_peer_up{peer=\"1\"}"), 1.0);
    assert_eq!(sample(&text, "kvmesh_peer_in_view{peer=\"1\"}"), 1.0);
    common::promtool_check_metrics(&text);
}

/// A remote fetch over shared memory ends on the data-plane thread (the
/// read validated there): the engine's fast-path answer is written from
/// there too, not from a runtime worker woken for it (daemon/src/inline.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_that_ends_on_the_data_plane_is_answered_from_there() {
    let (data_plane, _, _) = lone_fetches_answered("metrics-inline", "sm", &[], &[]).await;
    // A read whose report found the core busy goes through a task (rare
    // here, never all of them).
    assert!(data_plane >= 4.0, "{data_plane} of 8 answered on the data plane");
}

/// Over tcp the holder pushes the slot with its grant: the read the core
/// starts when the grant arrives (on a runtime thread, from the peer
/// stream) is checked and reported on the data-plane thread where the
/// bytes land, and the engine's answer is written from there too (before,
/// a task per pushed read: every answer from the runtime).
///
/// Whether a pushed block lands before or after the core starts its read
/// is a race (a block that landed first takes the task path); the holder's
/// test hook sends its pushes 100 ms after the answer so that every read
/// here meets a receive not landed yet (without the hook a slow debug
/// build on a loaded machine answered 2 of 8 from the data plane).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_fetch_is_answered_from_the_data_plane_tcp() {
    let holder = [("KVMESH_TEST_HOOK", "delay-push-sends-ms:100")];
    let (data_plane, _, text) = lone_fetches_answered("metrics-push", "tcp", &holder, &[]).await;
    assert_eq!(sample(&text, "kvmesh_coherence_pushes_used_total"), 8.0, "{text}");
    assert!(data_plane >= 4.0, "{data_plane} of 8 answered on the data plane");
}

/// When the read's report finds the core busy (forced by a test hook) it
/// goes through a task: the fetch still ends with the right bytes, and its
/// answer is written from the runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_whose_report_finds_the_core_busy_ends_through_a_task() {
    let hook = [("KVMESH_TEST_HOOK", "inline-reports-find-core-busy")];
    let (data_plane, other, _) = lone_fetches_answered("metrics-busy", "sm", &[], &hook).await;
    assert_eq!(data_plane, 0.0);
    assert!(other >= 4.0, "{other} of 8 answered through a task");
}

/// Remote gets do not wake the coherence driver's timer task at every
/// hop: an input wakes it only when the core's next timeout moved earlier
/// than the task set out to wake at (`kvmesh_coherence_timer_kicks_total`).
/// Before, every locate, grant, read report and engine call woke it (a
/// runtime worker unparked on the thread handling it, on the path of
/// the get): 4 or more wake-ups per fetch between the two daemons. A
/// fetch's timers (its deadline; at the holder, the grant's lease) fall
/// after the keepalive the task has armed (at most `keepalive_ms` away),
/// so what is left is a kick where an input brings a timeout nearer than
/// that, whatever the rate of gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lone_fetches_do_not_wake_the_timer_task_at_every_hop() {
    use common::peer_config;
    const FETCHES: u64 = 200;
    let ports = [free_port(), free_port()];
    let pools = pool("p", "32MiB", "64KiB");
    let a = Daemon::start("timer-kicks-1", &peer_config(1, &ports, "sm", &pools));
    let b = Daemon::start("timer-kicks-2", &peer_config(2, &ports, "sm", &pools));
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let ns_a = ca.register_namespace("t", 65536, "x").await.unwrap();
    let ns_b = cb.register_namespace("t", 65536, "x").await.unwrap();
    let keys: Vec<Key> = (1..=FETCHES as u128).map(|i| Key(0x71c0_0000 + i)).collect();
    for chunk in keys.chunks(50) {
        let items: Vec<(Key, Vec<u8>)> = chunk.iter().map(|&k| (k, vec![k.0 as u8; 65536])).collect();
        let refs: Vec<(Key, &[u8])> = items.iter().map(|(k, d)| (*k, &d[..])).collect();
        assert_eq!(ca.put(&ns_a, &refs).await.unwrap().stored as usize, chunk.len());
    }
    let kicks = |s: kvmesh_client::Stats| s.coherence.unwrap().timer_kicks;
    let before = kicks(ca.stats().await.unwrap()) + kicks(cb.stats().await.unwrap());
    let t0 = std::time::Instant::now();
    for &k in &keys {
        let got = cb.pin(&ns_b, &[k]).await.unwrap();
        let blk = got[0].as_ref().unwrap_or_else(|| panic!("{k} not fetched"));
        assert!(blk.iter().all(|&x| x == k.0 as u8), "bytes of {k}");
    }
    let secs = t0.elapsed().as_secs_f64().ceil() as u64;
    let sb = cb.stats().await.unwrap();
    assert_eq!(sb.remote_fetched, FETCHES, "every get was a fetch");
    assert_eq!(sb.remote_validation_failures, 0);
    let during = kicks(sb) + kicks(ca.stats().await.unwrap()) - before;
    // Woken per hop this is >= 4 per fetch (800 here); the bound leaves a
    // kick per fetch in four and 40 a second of run time for timers due.
    let bound = FETCHES / 4 + 40 * secs;
    assert!(during <= bound, "{during} timer-task wake-ups for {FETCHES} fetches in {secs} s (at most {bound})");
}

/// Daemon 1 (started with `holder_env`) puts 8 blocks of 64 KiB, daemon 2
/// (started with `env`) fetches them over `transports` one pin at a time,
/// every byte checked, then pins them again (local hits); returns how many
/// of daemon 2's fast-path answers were written on its data-plane thread
/// and elsewhere (`kvmesh_fast_answers_total`), and its metrics text.
async fn lone_fetches_answered(
    tag: &str,
    transports: &str,
    holder_env: &[(&str, &str)],
    env: &[(&str, &str)],
) -> (f64, f64, String) {
    use common::peer_config;
    let ports = [free_port(), free_port()];
    let mport = free_port();
    let pools = pool("p", "8MiB", "64KiB");
    let a = Daemon::start_with(&format!("{tag}-1"), &peer_config(1, &ports, transports, &pools), holder_env);
    let b = Daemon::start_with(
        &format!("{tag}-2"),
        &(peer_config(2, &ports, transports, &pools) + &format!("[metrics]\nlisten = \"127.0.0.1:{mport}\"\n")),
        env,
    );
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    let (ca, cb) = (a.client().await, b.client().await);
    assert!(cb.fast_path(), "the test needs the fast path");
    let ns_a = ca.register_namespace("m", 65536, "x").await.unwrap();
    let ns_b = cb.register_namespace("m", 65536, "x").await.unwrap();
    let keys: Vec<Key> = (1..=8u128).map(|i| Key(0xfa50 + i)).collect();
    for (i, &k) in keys.iter().enumerate() {
        let data = vec![i as u8; 65536];
        assert_eq!(ca.put(&ns_a, &[(k, &data[..])]).await.unwrap().stored, 1);
    }
    // One at a time: each pin's last step is its own read's end.
    for (i, &k) in keys.iter().enumerate() {
        let got = cb.pin(&ns_b, &[k]).await.unwrap();
        let blk = got[0].as_ref().unwrap_or_else(|| panic!("{k} not fetched"));
        assert!(blk.iter().all(|&x| x == i as u8), "bytes of {k}");
        blk.verify().unwrap();
    }
    // And local hits, answered at once.
    assert!(cb.pin(&ns_b, &keys).await.unwrap().iter().all(|b| b.is_some()));
    let (_, _, text) = tokio::task::spawn_blocking(move || get(mport, "/metrics", "*/*")).await.unwrap();
    assert_eq!(sample(&text, "kvmesh_get_seconds_count{result=\"fetched\"}"), 8.0, "{text}");
    let on = |t: &str| sample(&text, &format!("kvmesh_fast_answers_total{{thread=\"{t}\"}}"));
    // The local pin (and the unpins) are answered at once. A fetch is
    // answered where it ended — mostly later, but it can end within the
    // connection thread's first poll of it (that thread preempted between
    // sending the locate and polling for the answer: seen with the CPUs
    // loaded), so at most 8 are answered elsewhere.
    assert!(on("connection") >= 1.0, "{text}");
    assert!(on("data_plane") + on("other") <= 8.0, "{text}");
    assert_eq!(cb.stats().await.unwrap().remote_validation_failures, 0);
    common::promtool_check_metrics(&text);
    (on("data_plane"), on("other"), text)
}
