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
    let (code, _, err) = run_cli(&d.socket, &["top", "--interval-s", "0", "--count", "1"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--interval-s"), "{err}");
}
