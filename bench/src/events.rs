//! `kvmesh-bench events`: KV events under a put load. One daemon, or a
//! cluster of `--daemons` (each its own share of the load and its own
//! watcher, as a router watching every daemon); putters paced at `--rate`
//! blocks per second in all (batches of `--batch`) for `--seconds`. Reports, per round, the put
//! rate reached with the watcher and without it (interleaved rounds, the
//! baseline of the same run), the delay from the issue of a put to its
//! STORED event at the watcher — an upper bound of the delay after the
//! commit, which the client cannot observe; the put call's own P99 is
//! printed beside it — (HDR, with the sample count), and gaps in the
//! sequence numbers (must be 0). JSON last line:
//! `{"bench":"events","rows":[{"watcher":true|false,"target_rate":..,"put_rate":..,"events":..,"gaps":..,"p50_ms":..,"p99_ms":..,"max_ms":..,"samples":..}],"ratio_put_rate":..}`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use hdrhistogram::Histogram;
use kvmesh_client::{Client, Key, KvEventKind, Namespace};
use parking_lot::Mutex;

const BLOCK: usize = 4096;

struct Round {
    watcher: bool,
    put_rate: f64,
    events: u64,
    gaps: u64,
    delay: Histogram<u64>,
    put_calls: Histogram<u64>,
}

/// One round: puts at `rate` for `seconds` (shared evenly by the daemons,
/// each putter paced on its own), with or without a watcher on every daemon.
async fn round(
    cs: &[(Client, Namespace)],
    first_key: u128,
    rate: u64,
    seconds: f64,
    batch: usize,
    watch: bool,
) -> anyhow::Result<(Round, u128)> {
    // When the put of each key was issued: an event's delay is measured
    // from there (an upper bound of the delay after the commit, which the
    // client cannot see; the put call's own latency is reported beside it).
    let started: Arc<Mutex<HashMap<u128, Instant>>> = Arc::new(Mutex::new(HashMap::new()));
    let stored_seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut watchers = Vec::new();
    if watch {
        for (c, ns) in cs {
            let mut stream = c.watch_events(ns, false).await?;
            let started = Arc::clone(&started);
            let stored_seen = Arc::clone(&stored_seen);
            let mut stop = stop_rx.clone();
            watchers.push(tokio::spawn(async move {
                let mut delay = Histogram::<u64>::new(3).expect("histogram");
                let (mut events, mut gaps, mut last, mut stored) = (0u64, 0u64, None::<u64>, 0u64);
                loop {
                    let b = tokio::select! {
                        _ = stop.changed() => break,
                        m = stream.message() => match m {
                            Ok(Some(b)) => b,
                            Ok(None) => return Err("the event stream ended".to_string()),
                            Err(st) => return Err(format!("the event stream failed: {st}")),
                        },
                    };
                    let now = Instant::now();
                    for e in b.events {
                        if let Some(l) = last
                            && e.seq != l + 1
                        {
                            gaps += e.seq.saturating_sub(l + 1).max(1);
                        }
                        last = Some(e.seq);
                        events += 1;
                        if KvEventKind::try_from(e.kind) == Ok(KvEventKind::Stored) {
                            stored += 1;
                            stored_seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let k = e.key.map(|k| Key::from_parts(k.hi, k.lo).0).unwrap_or(0);
                            if let Some(&t) = started.lock().get(&k) {
                                delay.record(now.saturating_duration_since(t).as_micros() as u64).ok();
                            }
                        }
                    }
                }
                Ok((delay, events, gaps, stored))
            }));
        }
    }
    let n = cs.len() as u128;
    let total = (rate as f64 * seconds) as u128 / n * n;
    let per = total / n;
    let t0 = Instant::now();
    let mut putters = Vec::new();
    for (d, (c, ns)) in cs.iter().enumerate() {
        let (c, ns, started) = (c.clone(), ns.clone(), Arc::clone(&started));
        let from = first_key + d as u128 * per;
        let rate_d = rate as f64 / n as f64;
        putters.push(tokio::spawn(async move {
            let data = vec![7u8; BLOCK];
            let mut calls = Histogram::<u64>::new(3)?;
            let mut next = from;
            while next < from + per {
                // Pace: the batch starting at key `next` is due at this time.
                let due = t0 + Duration::from_secs_f64((next - from) as f64 / rate_d);
                tokio::time::sleep_until(due.into()).await;
                let m = (batch as u128).min(from + per - next);
                let keys: Vec<Key> = (next..next + m).map(Key).collect();
                let items: Vec<(Key, &[u8])> = keys.iter().map(|&k| (k, &data[..])).collect();
                let at = Instant::now();
                {
                    let mut s = started.lock();
                    for k in &keys {
                        s.insert(k.0, at);
                    }
                }
                let s = c.put(&ns, &items).await?;
                calls.record(at.elapsed().as_micros() as u64).ok();
                if s.stored as u128 != m {
                    bail!("put on daemon {} stored {} of {m}: {s:?}", d + 1, s.stored);
                }
                next += m;
            }
            anyhow::Ok(calls)
        }));
    }
    let mut put_calls = Histogram::<u64>::new(3)?;
    for p in putters {
        put_calls.add(p.await??)?;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let put_rate = total as f64 / elapsed;
    let (delay, events, gaps) = if watch {
        // Every put's STORED event must arrive (the slowest included: they
        // are the P99), within 10 s.
        let t = Instant::now();
        while stored_seen.load(std::sync::atomic::Ordering::Relaxed) < total as u64
            && !watchers.iter().any(|h| h.is_finished())
        {
            if t.elapsed() > Duration::from_secs(10) {
                bail!(
                    "only {} of {total} STORED events arrived within 10 s",
                    stored_seen.load(std::sync::atomic::Ordering::Relaxed)
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = stop_tx.send(true);
        let (mut delay, mut events, mut gaps, mut stored) = (Histogram::<u64>::new(3)?, 0, 0, 0);
        for h in watchers {
            let (d, e, g, s) = h.await?.map_err(anyhow::Error::msg)?;
            delay.add(d)?;
            events += e;
            gaps += g;
            stored += s;
        }
        if stored != total as u64 {
            bail!("{stored} STORED events for {total} puts");
        }
        (delay, events, gaps)
    } else {
        (Histogram::<u64>::new(3)?, 0, 0)
    };
    Ok((Round { watcher: watch, put_rate, events, gaps, delay, put_calls }, first_key + total))
}

pub(crate) async fn events(rate: u64, seconds: f64, batch: usize, rounds: usize, daemons: u32) -> anyhow::Result<()> {
    if rate == 0 || batch == 0 || seconds.is_nan() || seconds <= 0.0 || daemons == 0 {
        bail!("--rate, --batch, --seconds and --daemons must be positive");
    }
    let blocks = (rate as f64 * seconds) as u64 * rounds as u64 * 2 / daemons as u64;
    let pool = (blocks + 1024) * (BLOCK as u64 + 128);
    let pools = format!("[[pools]]\nname = \"p\"\nbytes = {pool}\nslot_payload_bytes = {BLOCK}\nmlock = false\n");
    let procs = if daemons == 1 {
        vec![crate::start_daemon_tagged("events", &pools)?]
    } else {
        crate::start_sm_cluster("events", daemons, &pools)?
    };
    let mut cs = Vec::new();
    for (_, socket) in &procs {
        let c = Client::connect(socket).await?;
        cs.push(c);
    }
    if daemons > 1 {
        crate::coherence::wait_ready(&cs, daemons).await?;
    }
    let mut with_ns = Vec::new();
    for c in cs {
        let ns = c.register_namespace("events-bench", BLOCK as u64, "bench").await?;
        with_ns.push((c, ns));
    }
    let cs = with_ns;
    let mut rows = Vec::new();
    let mut key = 1u128;
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        // Interleaved: which goes first alternates.
        for watch in if r % 2 == 0 { [true, false] } else { [false, true] } {
            let (res, next) = round(&cs, key, rate, seconds, batch, watch).await?;
            key = next;
            let q = |p: f64| res.delay.value_at_quantile(p) as f64 / 1e3;
            let put_p99 = res.put_calls.value_at_quantile(0.99) as f64 / 1e3;
            println!(
                "round {r} watcher={:<5} put_rate={:>9.0}/s events={:>8} gaps={} put-to-event p50={:.3} ms p99={:.3} ms \
                 max={:.3} ms (samples {}); put call p99 {put_p99:.3} ms (samples {})",
                res.watcher,
                res.put_rate,
                res.events,
                res.gaps,
                q(0.5),
                q(0.99),
                res.delay.max() as f64 / 1e3,
                res.delay.len(),
                res.put_calls.len()
            );
            if res.watcher {
                with.push(res.put_rate);
                if res.gaps != 0 {
                    bail!("the watcher saw {} gaps", res.gaps);
                }
            } else {
                without.push(res.put_rate);
            }
            rows.push(serde_json::json!({
                "watcher": res.watcher, "target_rate": rate, "put_rate": res.put_rate, "events": res.events,
                "gaps": res.gaps, "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": res.delay.max() as f64 / 1e3,
                "samples": res.delay.len(), "put_call_p99_ms": put_p99, "put_calls": res.put_calls.len(),
            }));
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let ratio = median(with) / median(without);
    println!("{}", serde_json::json!({"bench": "events", "daemons": daemons, "rows": rows, "ratio_put_rate": ratio}));
    Ok(())
}
