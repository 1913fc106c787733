//! SIGHUP reloads what can change safely (log filter, limits, eviction)
//! and refuses the rest, naming it, with nothing changed.

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, pool};

fn hup(d: &Daemon) {
    let ok = std::process::Command::new("kill").args(["-HUP", &d.child.id().to_string()]).status().unwrap().success();
    assert!(ok);
}

fn wait_log(d: &Daemon, needle: &str, count: usize) {
    let t0 = Instant::now();
    while d.log().matches(needle).count() < count {
        assert!(t0.elapsed() < Duration::from_secs(10), "no {needle:?} (x{count}) in the log:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_limits_and_log_filter_and_refuses_the_rest() {
    let d = Daemon::start("reload", &pool("p", "4MiB", "4KiB"));
    let cfg_path = d.dir.0.join("kvmeshd.toml");
    let original = std::fs::read_to_string(&cfg_path).unwrap();
    assert_eq!(d.client().await.hello().batch_keys_max, 4096);

    // Reloadable: limits and the log filter.
    std::fs::write(&cfg_path, format!("{original}[limits]\nbatch_keys_max = 100\n[log]\nfilter = \"debug\"\n"))
        .unwrap();
    hup(&d);
    wait_log(&d, "config reloaded", 1);
    assert_eq!(d.client().await.hello().batch_keys_max, 100, "new limits apply to new connections");
    let c = d.client().await;
    let ns = c.register_namespace("reload", 4096, "x").await.unwrap();
    let keys: Vec<kvmesh_client::Key> = (0..101u128).map(kvmesh_client::Key).collect();
    // (the client checks its Hello's limit; the daemon enforces its own)
    assert!(c.lookup(&ns, &keys).await.is_err(), "a batch above the new limit is refused");

    // Not reloadable: a pool's size. Refused, naming it; limits stay.
    let changed = original.replace("bytes = \"4MiB\"", "bytes = \"8MiB\"");
    assert_ne!(changed, original);
    std::fs::write(&cfg_path, format!("{changed}[limits]\nbatch_keys_max = 200\n")).unwrap();
    hup(&d);
    wait_log(&d, "config reload refused: pools changed", 1);
    assert_eq!(d.client().await.hello().batch_keys_max, 100, "nothing changed");

    // Not reloadable either: the socket (from the file here). Before, the
    // live one silently replaced it and the reload was taken.
    let moved = original.replace("kvmeshd.sock", "kvmeshd-moved.sock");
    assert_ne!(moved, original);
    std::fs::write(&cfg_path, format!("{moved}[limits]\nbatch_keys_max = 300\n")).unwrap();
    hup(&d);
    wait_log(&d, "config reload refused: server changed", 1);
    assert_eq!(d.client().await.hello().batch_keys_max, 100, "nothing changed");

    // A broken file: an error, nothing changed, the daemon keeps serving.
    std::fs::write(&cfg_path, "this is not toml [").unwrap();
    hup(&d);
    wait_log(&d, "nothing changed", 2);
    assert_eq!(d.client().await.hello().batch_keys_max, 100);
}

/// A reload that lowers `limits.batch_keys_max` refuses new large batches
/// but not the release of what engines already hold in larger ones: the
/// unpin of 200 pins and the commit (and abort) of 200 allocations made
/// under the old limit go through. Before, they were refused by the new
/// limit: pins held to their lease, allocations lapsed and fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_batch_limit_still_releases_what_was_taken_before() {
    use kvmesh_client::{Allocation, Key};
    let d = Daemon::start("reloadbatch", &pool("p", "8MiB", "4KiB"));
    let cfg_path = d.dir.0.join("kvmeshd.toml");
    let original = std::fs::read_to_string(&cfg_path).unwrap();
    let c = d.client().await;
    let ns = c.register_namespace("rb", 4096, "").await.unwrap();
    let keys: Vec<Key> = (0..200u128).map(Key).collect();
    let block = vec![7u8; 4096];
    let items: Vec<(Key, &[u8])> = keys.iter().map(|&k| (k, &block[..])).collect();
    c.put(&ns, &items).await.unwrap();
    let pinned: Vec<_> = c.pin(&ns, &keys).await.unwrap().into_iter().flatten().collect();
    assert_eq!(pinned.len(), 200);
    let fresh: Vec<Key> = (1000..1200u128).map(Key).collect();
    let mut writes: Vec<_> = c
        .allocate(&ns, &fresh)
        .await
        .unwrap()
        .into_iter()
        .map(|a| match a {
            Allocation::Allocated(w) => w,
            o => panic!("{o:?}"),
        })
        .collect();
    let rest = writes.split_off(100);
    let more: Vec<Key> = (2000..2200u128).map(Key).collect();
    let to_abort: Vec<_> = c.allocate(&ns, &more).await.unwrap();

    std::fs::write(&cfg_path, format!("{original}[limits]\nbatch_keys_max = 50\n")).unwrap();
    hup(&d);
    wait_log(&d, "config reloaded", 1);

    assert_eq!(c.unpin(pinned).await.unwrap(), 200, "the unpin of pins taken under the old limit");
    let mut all = writes;
    all.extend(rest);
    for w in all.iter_mut() {
        w.copy_from_slice(&block);
    }
    let outcomes = c.commit(all).await.expect("the commit of allocations made under the old limit");
    assert_eq!(outcomes.len(), 200);
    drop(to_abort);
    c.flush_releases().await;
    let s = c.stats().await.unwrap();
    assert_eq!((s.pins_outstanding, s.allocations_outstanding), (0, 0), "{s:?}");
    assert_eq!(s.pools[0].fenced, 0);
    // New batches above the new limit are refused.
    assert!(c.lookup(&ns, &keys).await.is_err());
}

/// kvmeshd on `cfg` with its log filter from the file (no `KVMESH_LOG`),
/// once its socket answers; and its log file.
fn spawn_own_log(
    dir: &common::TempDir,
    cfg: &std::path::Path,
    socket: &std::path::Path,
) -> (std::process::Child, std::path::PathBuf) {
    let log_path = dir.0.join("kvmeshd.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvmeshd"))
        .arg("--config")
        .arg(cfg)
        .env_remove("KVMESH_LOG")
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    common::wait_serving(&mut child, socket, &log_path);
    (child, log_path)
}

/// `[log] filter` is reloaded too (when `KVMESH_LOG` does not override it).
#[test]
fn sighup_reloads_the_log_filter() {
    let dir = common::TempDir::new("reload-log");
    let socket = dir.0.join("kvmeshd.sock");
    let cfg_path = dir.0.join("kvmeshd.toml");
    let base = format!(
        "[server]\nsocket = {:?}\n[metrics]\nlisten = \"\"\n{}",
        socket.display().to_string(),
        pool("p", "4MiB", "4KiB")
    );
    std::fs::write(&cfg_path, format!("{base}[log]\nfilter = \"warn\"\n")).unwrap();
    let (mut child, log_path) = spawn_own_log(&dir, &cfg_path, &socket);
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(!log().contains("INFO"), "warn filter: {}", log());
    std::fs::write(&cfg_path, format!("{base}[log]\nfilter = \"info\"\nformat = \"text\"\n")).unwrap();
    std::process::Command::new("kill").args(["-HUP", &child.id().to_string()]).status().unwrap();
    let t0 = Instant::now();
    while !log().contains("config reloaded") {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(log().contains("INFO"), "the info filter took effect: {}", log());
    let _ = child.kill();
    let _ = child.wait();
}

/// `[log] format = "json"`: one JSON object per line.
#[test]
fn json_log_format() {
    let dir = common::TempDir::new("log-json");
    let socket = dir.0.join("kvmeshd.sock");
    let cfg_path = dir.0.join("kvmeshd.toml");
    std::fs::write(
        &cfg_path,
        format!(
            "[server]\nsocket = {:?}\n[metrics]\nlisten = \"\"\n[log]\nformat = \"json\"\n{}",
            socket.display().to_string(),
            pool("p", "4MiB", "4KiB")
        ),
    )
    .unwrap();
    let (mut child, log_path) = spawn_own_log(&dir, &cfg_path, &socket);
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&log_path).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert!(!lines.is_empty());
    for l in lines {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{l}");
    }
    let out = common::check_config(&cfg_path);
    assert!(out.status.success());
    std::fs::write(&cfg_path, format!("[log]\nformat = \"xml\"\n{}", pool("p", "4MiB", "4KiB"))).unwrap();
    let out = common::check_config(&cfg_path);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("log.format"));
}
