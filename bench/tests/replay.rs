//! `kvmesh-bench load` and `replay` end to end: generated traces replayed
//! against real daemons (2, started by the command), bad traces refused.

use std::path::{Path, PathBuf};
use std::process::Command;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvmesh-bench"))
}

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("kvmesh-replay-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    let _ = std::fs::remove_file(&p);
    p
}

fn load(seed: u64, path: &Path) {
    let out = bench()
        .args(["load", "--requests", "200", "--rate", "100", "--max-tokens", "2048", "--seed", &seed.to_string()])
        .arg("--write")
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn summary(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "replay failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().expect("a JSON line")).expect("JSON summary")
}

#[test]
fn the_same_seed_gives_the_same_trace() {
    let (a, b, c) = (tmp("a.jsonl"), tmp("b.jsonl"), tmp("c.jsonl"));
    load(7, &a);
    load(7, &b);
    load(8, &c);
    let (ta, tb, tc) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), std::fs::read(&c).unwrap());
    assert_eq!(ta, tb);
    assert_ne!(ta, tc);
    assert_eq!(ta.iter().filter(|&&b| b == b'\n').count(), 200);
    for p in [a, b, c] {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn replay_with_ample_capacity_hits_exactly_the_ideal_and_reads_no_wrong_byte() {
    let trace = tmp("ample.jsonl");
    load(3, &trace);
    let out_dir = tmp("ample-out");
    // One request at a time: each one's puts are done before the next
    // starts, so the cluster can find everything the ideal cache holds.
    let out = bench()
        .args(["replay", "--daemons", "2", "--pool-mib", "64", "--policy", "round-robin", "--max-inflight", "1"])
        .args(["--speed", "4", "--json", "--out"])
        .arg(&out_dir)
        .arg(&trace)
        .output()
        .unwrap();
    let s = summary(&out);
    assert_eq!(s["requests"], 200);
    assert_eq!(s["wrong_bytes"], 0, "{s}");
    assert_eq!(s["above_ideal"], 0, "{s}");
    assert!(s["ideal_hit_ratio"].as_f64().unwrap() > 0.2, "the trace reuses prefixes: {s}");
    assert_eq!(s["hit_ratio"], s["ideal_hit_ratio"], "{s}");
    assert!(s["remote_hits"].as_u64().unwrap() > 0, "round-robin reuses blocks across daemons: {s}");
    assert_eq!(s["errors"], serde_json::json!({}), "{s}");
    for op in ["lookup", "pin_read", "put", "request"] {
        assert!(s["ops"][op]["count"].as_u64().unwrap() > 0, "{op}: {s}");
    }
    for f in ["latency_cdf", "hit_ratio", "throughput", "p99_vs_load"] {
        for ext in ["svg", "png"] {
            let p = out_dir.join(format!("{f}.{ext}"));
            let len = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
            assert!(len > 1000, "{} is missing or empty ({len} bytes)", p.display());
        }
    }
    let csv = std::fs::read_to_string(out_dir.join("timeseries.csv")).unwrap();
    // A header and a row per second of the run (one when the 200 requests
    // took under a second of wall time).
    assert!(csv.starts_with("second,offered,started,finished,late") && csv.lines().count() >= 2, "{csv}");
    let rows: u64 = csv.lines().skip(1).map(|l| l.split(',').nth(3).unwrap().parse::<u64>().unwrap()).sum();
    assert_eq!(rows, 200, "every request finished in some second: {csv}");
    let _ = std::fs::remove_dir_all(out_dir);
    let _ = std::fs::remove_file(trace);
}

#[test]
fn kv_aware_routing_serves_more_blocks_locally_than_round_robin_in_one_run() {
    let trace = tmp("kv-aware.jsonl");
    load(11, &trace);
    let out_dir = tmp("kv-aware-out");
    let out = bench()
        .args(["replay", "--daemons", "3", "--pool-mib", "64", "--policy", "kv-aware,round-robin"])
        .args(["--max-inflight", "1", "--speed", "4", "--json", "--out"])
        .arg(&out_dir)
        .arg(&trace)
        .output()
        .unwrap();
    let s = summary(&out);
    let (kv, rr) = (&s["runs"]["KvAware"], &s["runs"]["RoundRobin"]);
    for r in [kv, rr] {
        assert_eq!(r["wrong_bytes"], 0, "{s}");
        assert_eq!(r["requests"], 200, "{s}");
    }
    assert!(kv["router"]["events"].as_u64().unwrap() > 0, "the router consumed events: {s}");
    let share = |p: &str| s["policies"][p]["local_hit_share"].as_f64().unwrap();
    assert!(
        share("KvAware") > share("RoundRobin") && share("KvAware") > 0.0,
        "kv-aware local share {} vs round-robin {}: {s}",
        share("KvAware"),
        share("RoundRobin")
    );
    assert!(
        out_dir.join("KvAware").join("timeseries.csv").exists()
            && out_dir.join("RoundRobin").join("timeseries.csv").exists()
    );
    let _ = std::fs::remove_dir_all(out_dir);
    let _ = std::fs::remove_file(trace);
}

#[test]
fn malformed_and_truncated_traces_are_refused_with_the_line() {
    let good = "{\"timestamp\":0,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1,2]}\n";
    for (name, text, line, why) in [
        ("truncated", format!("{good}{good}{{\"timestamp\":3,\"input_le"), ":3:", "not a trace record"),
        (
            "wrong-count",
            format!("{good}{{\"timestamp\":3,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1]}}\n"),
            ":2:",
            "expected 2",
        ),
        ("garbage", format!("{good}hello\n"), ":2:", "not a trace record"),
    ] {
        let p = tmp(name);
        std::fs::write(&p, text).unwrap();
        let out = bench().args(["replay", "--daemons", "1", "--json"]).arg(&p).output().unwrap();
        assert!(!out.status.success(), "{name} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(line) && err.contains(why), "{name}: {err}");
        let _ = std::fs::remove_file(p);
    }
    // An empty trace is refused too.
    let p = tmp("empty");
    std::fs::write(&p, "\n").unwrap();
    let out = bench().args(["replay", "--json"]).arg(&p).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("no requests"));
    let _ = std::fs::remove_file(p);
}

#[test]
fn a_redis_baseline_replays_the_same_trace_in_the_same_run() {
    let trace = tmp("redis.jsonl");
    load(5, &trace);
    let out_dir = tmp("redis-out");
    let out = bench()
        .args(["replay", "--daemons", "1", "--pool-mib", "64", "--speed", "4", "--baseline", "redis", "--json"])
        .arg("--out")
        .arg(&out_dir)
        .arg(&trace)
        .output()
        .unwrap();
    let s = summary(&out);
    let b = &s["baseline"];
    assert_eq!(s["wrong_bytes"], 0, "{s}");
    assert_eq!(b["wrong_bytes"], 0, "{s}");
    assert_eq!(b["errors"], serde_json::json!({}), "{s}");
    // A remote store with ample memory finds what the ideal cache finds,
    // less what concurrent requests had not put yet.
    let (ideal, got) = (s["ideal_hit_ratio"].as_f64().unwrap(), b["hit_ratio"].as_f64().unwrap());
    assert!(got <= ideal && got > ideal * 0.9, "redis hit ratio {got}, ideal {ideal}");
    // Timed only where an MGET went out: not for the first request (an
    // empty store) nor any whose prefix was absent.
    let timed = b["ops"]["pin_read"]["count"].as_u64().unwrap();
    assert!(timed > 0 && timed < 200, "{timed} of 200 Redis reads timed: {s}");
    let svg = std::fs::read_to_string(out_dir.join("cdf_pin_read.svg")).unwrap();
    assert!(svg.contains("redis pin_read") && svg.contains("kvmesh pin_read"), "both on one chart");
    let _ = std::fs::remove_dir_all(out_dir);
    let _ = std::fs::remove_file(trace);
}
