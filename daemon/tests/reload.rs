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

    // A broken file: an error, nothing changed, the daemon keeps serving.
    std::fs::write(&cfg_path, "this is not toml [").unwrap();
    hup(&d);
    wait_log(&d, "nothing changed", 2);
    assert_eq!(d.client().await.hello().batch_keys_max, 100);
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
