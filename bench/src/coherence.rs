//! `kvmesh-bench coherence`: a cluster of daemons (real processes, UCX
//! over shared memory, the protocol on gRPC streams) all holding the same
//! keys; one engine call invalidates every key of the namespace; the bench
//! reports how the acknowledgements travelled (messages, entries per
//! message, invalidate -> ack latency at the homes) and checks that no
//! daemon serves an invalidated block afterwards.
//!
//! Baseline, measured in the same run on a second cluster: the same
//! workload with batching off (`batch_entries_max = 1`, every entry its own
//! message).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvmesh_client::{Client, Key, Namespace, Stats};

use crate::DaemonProc;

const BLOCK: u64 = 4096;

fn content(key: Key) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK as usize];
    crate::fill_block(key, &mut v);
    v
}

/// What one cluster measured.
struct Phase {
    invalidated: u64,
    invalidate_ms: f64,
    invalidates_sent: u64,
    acks: u64,
    ack_messages: u64,
    p50_us: u64,
    p99_us: u64,
    max_us: u64,
    samples: u64,
    wrong_reads: u64,
    reads_before: u64,
}

fn coherence(s: &Stats) -> anyhow::Result<kvmesh_client::CoherenceStats> {
    s.coherence.clone().context("daemon runs without coherence")
}

fn quantile(buckets: &[u64], q: f64) -> u64 {
    kvmesh_coherence::quantile_of_buckets(buckets, q)
}

pub(crate) async fn wait_ready(clients: &[Client], n: u32) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        let mut ok = true;
        for c in clients {
            let s = coherence(&c.stats().await?)?;
            ok &= s.serving && s.members == n && s.directory_ready;
        }
        if ok {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("the cluster did not form a view of {n} serving daemons");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn start_cluster(tag: &str, nodes: u32, keys: usize, extra: &str) -> anyhow::Result<Vec<(DaemonProc, PathBuf)>> {
    // Room for every key plus slack, 4 KiB slots.
    let pool_mib = ((keys as u64 * (BLOCK + 128) * 3 / 2) >> 20).max(16);
    crate::start_sm_cluster(
        &format!("coh-{tag}"),
        nodes,
        &format!(
            "[[pools]]\nname = \"p4k\"\nbytes = \"{pool_mib}MiB\"\nslot_payload_bytes = \"4KiB\"\nmlock = false\n\
             [coherence]\n{extra}"
        ),
    )
}

async fn phase(tag: &str, nodes: u32, keys: usize, extra: &str) -> anyhow::Result<Phase> {
    let daemons = start_cluster(tag, nodes, keys, extra)?;
    let mut clients = Vec::new();
    for (_, sock) in &daemons {
        clients.push(Client::connect(sock).await?);
    }
    wait_ready(&clients, nodes).await?;
    let mut nss: Vec<Namespace> = Vec::new();
    for c in &clients {
        nss.push(c.register_namespace("coherence-bench", BLOCK, "bench").await?);
    }
    let all: Vec<Key> = (0..keys as u128).map(|i| Key((0xc0ffee << 64) | i)).collect();
    // Written on daemon 1 ...
    for chunk in all.chunks(1024) {
        let data: Vec<Vec<u8>> = chunk.iter().map(|&k| content(k)).collect();
        let items: Vec<(Key, &[u8])> = chunk.iter().copied().zip(data.iter().map(|d| &d[..])).collect();
        let s = clients[0].put(&nss[0], &items).await?;
        if s.stored as usize != chunk.len() {
            bail!("put on daemon 1: {s:?}");
        }
    }
    // ... and read on every other one, so all of them hold every key.
    let mut wrong_reads = 0u64;
    let mut reads_before = 0u64;
    for (c, ns) in clients.iter().zip(&nss).skip(1) {
        for chunk in all.chunks(512) {
            // A miss here is not a wrong read (e.g. a view change made a
            // home busy for a moment): retry a few times before giving up.
            let mut want: Vec<Key> = chunk.to_vec();
            for attempt in 0..5 {
                let got = c.pin(ns, &want).await?;
                let mut missed = Vec::new();
                for (b, k) in got.iter().zip(&want) {
                    match b {
                        Some(b) => {
                            reads_before += 1;
                            if b[..] != content(*k)[..] {
                                wrong_reads += 1;
                            }
                        }
                        None => missed.push(*k),
                    }
                }
                drop(got);
                want = missed;
                if want.is_empty() {
                    break;
                }
                if attempt == 4 {
                    bail!("{} keys (first {}) not fetched after 5 attempts", want.len(), want[0]);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        c.flush_releases().await;
    }
    if let Ok(secs) = std::env::var("KVMESH_BENCH_PAUSE_S") {
        // For attaching a profiler to the daemons around the invalidation.
        let pids: Vec<u32> = daemons.iter().map(|(d, _)| d.pid()).collect();
        eprintln!("daemon pids {pids:?}; invalidating in {secs} s");
        tokio::time::sleep(Duration::from_secs(secs.parse().unwrap_or(2))).await;
    }
    let before: Vec<Stats> = futures_stats(&clients).await?;
    // One engine call invalidates the namespace on every daemon.
    let t = Instant::now();
    let inv = clients[0].invalidate_namespace(&nss[0]).await?;
    let invalidate_ms = t.elapsed().as_secs_f64() * 1e3;
    if inv.failed > 0 {
        bail!("invalidation incomplete: {inv:?}");
    }
    // Let the last acks of retransmissions land in the counters.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after: Vec<Stats> = futures_stats(&clients).await?;
    // No daemon may serve any of the keys now.
    for (c, ns) in clients.iter().zip(&nss) {
        for chunk in all.chunks(512) {
            let got = c.pin(ns, chunk).await?;
            wrong_reads += got.iter().filter(|b| b.is_some()).count() as u64;
        }
    }
    let mut acks = 0;
    let mut ack_messages = 0;
    let mut invalidates_sent = 0;
    let mut buckets = vec![0u64; kvmesh_coherence::HISTOGRAM_BUCKETS];
    let mut max_us = 0;
    for (b, a) in before.iter().zip(&after) {
        let (b, a) = (coherence(b)?, coherence(a)?);
        acks += a.acks_sent - b.acks_sent;
        ack_messages += a.ack_batches_sent - b.ack_batches_sent;
        invalidates_sent += a.invalidates_sent - b.invalidates_sent;
        for (i, (x, y)) in a.inval_to_ack_buckets.iter().zip(&b.inval_to_ack_buckets).enumerate() {
            buckets[i] += x - y;
        }
        max_us = max_us.max(a.inval_to_ack_max_us);
    }
    let samples = buckets.iter().sum();
    Ok(Phase {
        invalidated: inv.invalidated,
        invalidate_ms,
        invalidates_sent,
        acks,
        ack_messages,
        p50_us: quantile(&buckets, 0.5),
        p99_us: quantile(&buckets, 0.99),
        max_us,
        samples,
        wrong_reads,
        reads_before,
    })
}

async fn futures_stats(clients: &[Client]) -> anyhow::Result<Vec<Stats>> {
    let mut v = Vec::new();
    for c in clients {
        v.push(c.stats().await?);
    }
    Ok(v)
}

pub(crate) fn run(json: bool, nodes: u32, keys: usize, window: usize, baseline: bool) -> anyhow::Result<()> {
    if nodes < 2 {
        bail!("--daemons must be at least 2");
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let w = format!("invalidate_window = {window}\n");
    let main = rt.block_on(phase("batched", nodes, keys, &w))?;
    let base = if baseline {
        Some(rt.block_on(phase(
            "unbatched",
            nodes,
            keys,
            &format!("{w}batch_entries_max = 1\nflush_delay_us = 1\n"),
        ))?)
    } else {
        None
    };
    let factor = |p: &Phase| if p.ack_messages == 0 { 0.0 } else { p.acks as f64 / p.ack_messages as f64 };
    let r2 = |x: f64| (x * 100.0).round() / 100.0;
    for (name, p) in [("batched", Some(&main)), ("unbatched (baseline)", base.as_ref())] {
        let Some(p) = p else { continue };
        eprintln!(
            "{name:>21}: {} keys x {nodes} daemons  invalidate call {:.1} ms  invalidates {}  acks {} in {} messages \
             (x{:.1})  inval->ack p50 <= {} us p99 <= {} us max {} us ({} samples)  wrong reads {} (of {} checked \
             before, {} after)",
            p.invalidated,
            p.invalidate_ms,
            p.invalidates_sent,
            p.acks,
            p.ack_messages,
            factor(p),
            p.p50_us,
            p.p99_us,
            p.max_us,
            p.samples,
            p.wrong_reads,
            p.reads_before,
            keys as u64 * nodes as u64
        );
    }
    let mut out = serde_json::json!({
        "bench": "coherence",
        "daemons": nodes,
        "keys": keys,
        "invalidate_window": window,
        "wrong_reads": main.wrong_reads,
        "invalidations": main.invalidated,
        "invalidate_messages": main.invalidates_sent,
        "ack_messages": main.ack_messages,
        "acks": main.acks,
        "batching_factor": r2(factor(&main)),
        "inval_to_ack_p50_us": main.p50_us,
        "inval_to_ack_p99_us": main.p99_us,
        "inval_to_ack_max_us": main.max_us,
        "invalidate_call_ms": r2(main.invalidate_ms),
    });
    if let Some(b) = &base {
        out["baseline_unbatched"] = serde_json::json!({
            "wrong_reads": b.wrong_reads,
            "ack_messages": b.ack_messages,
            "batching_factor": r2(factor(b)),
            "inval_to_ack_p50_us": b.p50_us,
            "inval_to_ack_p99_us": b.p99_us,
            "invalidate_call_ms": r2(b.invalidate_ms),
        });
        out["invalidate_call_ratio_vs_unbatched"] = serde_json::json!(r2(main.invalidate_ms / b.invalidate_ms));
    }
    if !json {
        println!("quantiles are bucket upper bounds (~6%); the baseline runs on a second cluster, batching off");
    }
    println!("{out}");
    Ok(())
}
