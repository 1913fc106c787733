//! The admin CLI's views of a working daemon: `pools`, `namespaces`, `top`.

mod common;

use common::{Daemon, pool, run_cli};
use kvmesh_client::Key;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_namespaces_and_top_describe_a_working_daemon() {
    let d = Daemon::start("cli-admin", &pool("p", "8MiB", "64KiB"));
    let c = d.client().await;
    let a = c.register_namespace("alpha", 4096, "layout-a").await.unwrap();
    c.register_namespace("beta", 8192, "layout-b").await.unwrap();
    let keys: Vec<Key> = (1..=5u128).map(Key).collect();
    let data = vec![7u8; 4096];
    let items: Vec<(Key, &[u8])> = keys.iter().map(|&k| (k, &data[..])).collect();
    assert_eq!(c.put(&a, &items).await.unwrap().stored, 5);
    let _pinned = c.pin(&a, &keys[..2]).await.unwrap();

    let (code, out, err) = run_cli(&d.socket, &["pools", "--json"]);
    assert_eq!(code, 0, "{err}");
    let pools: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(pools[0]["name"], "p");
    assert_eq!(pools[0]["valid"], 5);
    assert_eq!(pools[0]["pinned"], 2);
    let (code, out, _) = run_cli(&d.socket, &["pools"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("POOL") && out.lines().nth(1).unwrap().starts_with("p "), "{out}");

    let (code, out, err) = run_cli(&d.socket, &["namespaces", "--json"]);
    assert_eq!(code, 0, "{err}");
    let ns: serde_json::Value = serde_json::from_str(&out).unwrap();
    let by_name = |n: &str| ns.as_array().unwrap().iter().find(|x| x["name"] == n).cloned().unwrap();
    assert_eq!(by_name("alpha")["blocks"], 5);
    assert_eq!(by_name("alpha")["layout"], "layout-a");
    assert_eq!(by_name("beta")["blocks"], 0);
    assert_eq!(by_name("beta")["block_bytes"], 8192);
    let (_, out, _) = run_cli(&d.socket, &["namespaces"]);
    assert!(out.contains("alpha") && out.contains("beta"), "{out}");

    // keys
    let (code, out, err) = run_cli(&d.socket, &["keys", "--namespace", "alpha", "--json"]);
    assert_eq!(code, 0, "{err}");
    let k: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(k["total"], 5);
    let mut listed: Vec<String> =
        k["keys"].as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect();
    listed.sort();
    let mut want: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    want.sort();
    assert_eq!(listed, want);
    let (code, out, err) = run_cli(&d.socket, &["keys", "--namespace", "alpha", "--limit", "2"]);
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), 2, "{out}");
    assert!(err.contains("2 of 5 keys"), "{err}");
    let (code, _, err) = run_cli(&d.socket, &["keys", "--namespace", "nope"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("nope"), "{err}");

    // top: two refreshes while lookups run.
    let c2 = c.clone();
    let a2 = a.clone();
    let load = tokio::spawn(async move {
        for _ in 0..200 {
            c2.lookup(&a2, &keys).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    });
    let socket = d.socket.clone();
    let (code, out, err) = tokio::task::spawn_blocking(move || {
        run_cli(&socket, &["top", "--interval-s", "0.3", "--count", "2", "--json"])
    })
    .await
    .unwrap();
    load.await.unwrap();
    assert_eq!(code, 0, "{err}");
    let rows: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(rows.iter().any(|r| r["lookups_per_s"].as_f64().unwrap() > 10.0), "{out}");
    assert_eq!(rows[1]["pins_outstanding"], 2);
    // This daemon serves no /metrics: no percentiles, said so.
    assert!(rows.iter().all(|r| r["pin_p99_s"].is_null()), "{out}");
    for bad in ["0", "1e20", "NaN"] {
        let (code, _, err) = run_cli(&d.socket, &["top", "--interval-s", bad, "--count", "1"]);
        assert_eq!(code, 1, "{bad}: {err}");
        assert!(err.contains("--interval-s"), "{bad}: {err}");
    }
}

/// `kvmesh config` prints the running configuration, which the daemon
/// accepts again as its config file (a true round trip, defaults filled in).
#[tokio::test]
async fn config_prints_a_running_config_the_daemon_accepts_again() {
    let d = Daemon::start("cli-config", &(pool("p", "8MiB", "64KiB") + "[limits]\nsessions_max = 77\n"));
    let (code, out, err) = run_cli(&d.socket, &["config"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("# running configuration of kvmeshd (from "), "{out}");
    assert!(out.contains("sessions_max = 77") && out.contains("drain_timeout_ms = 20000"), "{out}");
    let file = d.dir.0.join("printed.toml");
    std::fs::write(&file, &out).unwrap();
    let check = common::check_config(&file);
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    let (code, out, _) = run_cli(&d.socket, &["config", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["source"].as_str().unwrap().ends_with("kvmeshd.toml"), "{v}");
    assert!(v["toml"].as_str().unwrap().contains("[[pools]]"));
}

/// `kvmesh peers` of a two-daemon cluster: the other daemon with its
/// handshake, stream, heartbeat and place in the view; then down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_shows_the_other_daemon_up_then_down() {
    use common::{free_port, peer_config};
    let ports = [free_port(), free_port()];
    let pools = pool("p", "8MiB", "64KiB");
    let extra = "[coherence]\nmembership_lease_ms = 1000\n";
    let a = Daemon::start("cli-peers-1", &(peer_config(1, &ports, "tcp", &pools) + extra));
    let mut b = Daemon::start("cli-peers-2", &(peer_config(2, &ports, "tcp", &pools) + extra));
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    // A heartbeat answer needs a heartbeat period.
    let t0 = std::time::Instant::now();
    let v = loop {
        let (code, out, err) = run_cli(&a.socket, &["peers", "--json"]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        if !v["peers"][0]["last_pong_ms_ago"].is_null() {
            break v;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "{v}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let p = &v["peers"][0];
    assert_eq!(p["id"], 2);
    assert_eq!(p["addr"], format!("127.0.0.1:{}", ports[1]));
    assert_eq!(
        (p["handshake"].as_bool(), p["stream_up"].as_bool(), p["in_view"].as_bool()),
        (Some(true), Some(true), Some(true))
    );
    assert_eq!(p["incarnation"], p["view_incarnation"]);
    assert_eq!(p["transports"], "tcp");
    let (code, out, _) = run_cli(&a.socket, &["peers"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("  ID ADDR") && out.contains(" up ") && out.contains("view epoch"), "{out}");
    b.child.kill().unwrap();
    b.child.wait().unwrap();
    let t0 = std::time::Instant::now();
    loop {
        let (_, out, _) = run_cli(&a.socket, &["peers", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let p = &v["peers"][0];
        if p["stream_up"] == false && p["in_view"] == false {
            break;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(15), "{v}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// `kvmesh top` reads the P99s of the interval from the daemon's /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_pin_p99_from_the_metrics_endpoint() {
    let port = common::free_port();
    let d = Daemon::start(
        "cli-top-p99",
        &(pool("p", "8MiB", "64KiB") + &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n")),
    );
    let c = d.client().await;
    let ns = c.register_namespace("t", 4096, "x").await.unwrap();
    let keys: Vec<Key> = (1..=4u128).map(Key).collect();
    let data = vec![1u8; 4096];
    let items: Vec<(Key, &[u8])> = keys.iter().map(|&k| (k, &data[..])).collect();
    c.put(&ns, &items).await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (c2, ns2, stop2) = (c.clone(), ns.clone(), stop.clone());
    let load = tokio::spawn(async move {
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            drop(c2.pin(&ns2, &keys).await.unwrap());
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    });
    let socket = d.socket.clone();
    let (code, out, err) = tokio::task::spawn_blocking(move || {
        run_cli(&socket, &["top", "--interval-s", "0.3", "--count", "2", "--json"])
    })
    .await
    .unwrap();
    let socket = d.socket.clone();
    let (code2, table, _) =
        tokio::task::spawn_blocking(move || run_cli(&socket, &["top", "--interval-s", "0.3", "--count", "1"]))
            .await
            .unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.unwrap();
    assert_eq!((code, code2), (0, 0), "{err}");
    let rows: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    for r in &rows {
        let p99 = r["pin_p99_s"].as_f64().unwrap_or_else(|| panic!("no pin P99 while pins run: {out}"));
        assert!(p99 > 0.0 && p99 < 5.0, "{out}");
    }
    assert!(table.contains("PIN-P99") && table.lines().nth(1).unwrap().contains("ms"), "{table}");
}
