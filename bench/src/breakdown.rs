//! `kvmesh-bench breakdown`: where the time of a remote get goes, hop by
//! hop, from the getter daemon's own histograms (`/metrics`, scraped before
//! and after each measurement; means from the deltas of sums and counts, so
//! the stages add up) beside the engine's view of the `Pin` call (client
//! side, hdrhistogram). Two daemons on loopback; every round fetches blocks
//! the getter does not hold (they are removed, untimed, after each round).

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use hdrhistogram::Histogram;
use kvmesh_client::{Client, Key};

/// Sum of the samples of `name` whose labels contain `selector` ("" for
/// all).
fn sample_sum(text: &str, name: &str, selector: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(r) => r.split_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            labels.contains(selector).then(|| value.trim().parse::<f64>().ok()).flatten()
        })
        .sum()
}

fn scrape(port: u16) -> anyhow::Result<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).context("connect to /metrics")?;
    write!(s, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
    let mut r = String::new();
    s.read_to_string(&mut r)?;
    let (_, body) = r.split_once("\r\n\r\n").context("no HTTP body")?;
    Ok(body.to_string())
}

/// Mean of a histogram between two scrapes (seconds), and its count.
fn mean(a: &str, b: &str, hist: &str, selector: &str) -> (f64, f64) {
    let sum = sample_sum(b, &format!("{hist}_sum"), selector) - sample_sum(a, &format!("{hist}_sum"), selector);
    let n = sample_sum(b, &format!("{hist}_count"), selector) - sample_sum(a, &format!("{hist}_count"), selector);
    (if n > 0.0 { sum / n } else { f64::NAN }, n)
}

struct Row {
    transport: String,
    block: u64,
    batch: usize,
    calls: usize,
    client_p50: u64,
    client_p99: u64,
    client_mean: f64,
    /// Per call, daemon side: the Pin RPC handler.
    rpc: f64,
    /// Per key, in the coherence driver.
    driver: f64,
    locate: f64,
    read: f64,
    register: f64,
    /// Per batch of reads to the holder.
    post: f64,
    moving: f64,
    validate: f64,
    batches: f64,
}

pub(crate) fn run(
    json: bool,
    transports: &[String],
    block_kib: &[u64],
    calls: usize,
    batch: usize,
    blocking: bool,
) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for t in transports {
        for &kib in block_kib {
            for b in [1usize, batch] {
                let n = if b == 1 { calls } else { (calls / 4).max(100) };
                rows.push(measure(t, kib << 10, b, n, blocking)?);
            }
        }
    }
    let us = |s: f64| if s.is_nan() { f64::NAN } else { s * 1e6 };
    if !json {
        eprintln!(
            "{:<4} {:>6} {:>5} {:>6} | {:>8} {:>8} {:>8} | {:>8} {:>8} {:>8} {:>8} {:>8} | {:>8} {:>8} {:>8}",
            "tp",
            "block",
            "batch",
            "calls",
            "cli p50",
            "cli p99",
            "cli mean",
            "rpc",
            "driver",
            "locate",
            "read",
            "register",
            "post",
            "move",
            "validate"
        );
    }
    let mut out = Vec::new();
    for r in &rows {
        if !json {
            eprintln!(
                "{:<4} {:>5}K {:>5} {:>6} | {:>8} {:>8} {:>8.0} | {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>8.0} | {:>8.0} {:>8.0} {:>8.0}",
                r.transport,
                r.block >> 10,
                r.batch,
                r.calls,
                r.client_p50,
                r.client_p99,
                r.client_mean,
                us(r.rpc),
                us(r.driver),
                us(r.locate),
                us(r.read),
                us(r.register),
                us(r.post),
                us(r.moving),
                us(r.validate)
            );
        }
        out.push(serde_json::json!({
            "transport": r.transport, "block_bytes": r.block, "batch": r.batch, "calls": r.calls,
            "client_p50_us": r.client_p50, "client_p99_us": r.client_p99, "client_mean_us": r.client_mean,
            "rpc_mean_us": us(r.rpc), "driver_mean_us_per_key": us(r.driver),
            "locate_mean_us": us(r.locate), "read_mean_us": us(r.read), "register_mean_us": us(r.register),
            "post_mean_us_per_batch": us(r.post), "move_mean_us_per_batch": us(r.moving),
            "validate_mean_us_per_batch": us(r.validate),
            "read_batches": r.batches,
        }));
    }
    if !json {
        eprintln!(
            "us; cli = the engine's Pin call (client side, {} samples per row at least); rpc = the daemon's Pin handler; \
             driver/locate/read/register = per key in the coherence driver (means); post/move = per batch of reads (move includes validate: hashing the copies)",
            rows.iter().map(|r| r.calls).min().unwrap_or(0)
        );
    }
    println!(
        "{}",
        serde_json::json!({"bench": "breakdown", "shmem_huge_pages": kvmesh_ffi_os::shm::shmem_huge_mode(), "rows": out})
    );
    Ok(())
}

/// The next `batch` keys of a round robin over `keys`.
fn next_batch(keys: &[Key], next: &mut usize, batch: usize) -> Vec<Key> {
    (0..batch)
        .map(|_| {
            *next += 1;
            keys[*next % keys.len()]
        })
        .collect()
}

/// Records one timed pin (`dt`); fails where it missed a block.
fn record_pin<B>(
    hist: &mut Histogram<u64>,
    total: &mut Duration,
    dt: Duration,
    got: &[Option<B>],
    transport: &str,
) -> anyhow::Result<()> {
    if got.iter().any(|g| g.is_none()) {
        bail!("a remote get over {transport} missed");
    }
    *total += dt;
    hist.record(dt.as_micros().max(1) as u64)?;
    Ok(())
}

fn measure(transport: &str, size: u64, batch: usize, calls: usize, blocking: bool) -> anyhow::Result<Row> {
    let mport = crate::transfer::free_port()?;
    let pools = format!(
        "[[pools]]\nname = \"p\"\nbytes = \"{}MiB\"\nslot_payload_bytes = \"{}KiB\"\nmlock = false\n",
        ((size * 512) >> 20).max(64),
        size >> 10
    );
    let tag = format!("bd-{transport}-{}-{batch}", size >> 10);
    let metrics = format!("[metrics]\nlisten = \"127.0.0.1:{mport}\"\n");
    let (_a, sock_a, _b, sock_b) = crate::transfer::start_pair(&tag, transport, &pools, &metrics)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let ca = Client::connect(&sock_a).await?;
        let cb = Client::connect(&sock_b).await?;
        crate::transfer::wait_pair(&ca, &cb, transport).await?;
        let na = ca.register_namespace("bd", size, "bench").await?;
        let nb = cb.register_namespace("bd", size, "bench").await?;
        let slots = ca.hello().pools[na.pool as usize].slots as usize;
        let keys: Vec<Key> = (0..slots as u128).map(|i| Key(0xbd00_0000 + i)).collect();
        let block = vec![0x5au8; size as usize];
        for chunk in keys.chunks(64) {
            let items: Vec<(Key, &[u8])> = chunk.iter().map(|&k| (k, &block[..])).collect();
            if ca.put(&na, &items).await?.stored as usize != chunk.len() {
                bail!("put on A over {transport} failed");
            }
        }
        // Warm-up (connections, handshakes), untimed.
        for i in 0..20 {
            let ks = [keys[i % keys.len()]];
            drop(cb.pin(&nb, &ks).await?);
            cb.flush_releases().await;
            cb.remove(&nb, &ks).await?;
        }
        let before = tokio::task::spawn_blocking(move || scrape(mport)).await??;
        let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
        let mut total = Duration::ZERO;
        let mut next = 0usize;
        if blocking {
            // The same loop through the blocking client, on a thread
            // outside this runtime (as a C or Python engine calls).
            let (sock, keys, transport) = (sock_b.clone(), keys.clone(), transport.to_string());
            (hist, total) = std::thread::spawn(move || -> anyhow::Result<(Histogram<u64>, Duration)> {
                let b = kvmesh_client::blocking::Client::connect(Some(std::path::Path::new(&sock)))?;
                let nb = b.call(b.inner().namespace("bd"))?;
                let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
                let mut total = Duration::ZERO;
                for _ in 0..calls {
                    let ks = next_batch(&keys, &mut next, batch);
                    let t = Instant::now();
                    let got = b.call(b.inner().pin(&nb, &ks))?;
                    record_pin(&mut hist, &mut total, t.elapsed(), &got, &transport)?;
                    drop(got);
                    b.block_on(b.inner().flush_releases())?;
                    b.call(b.inner().remove(&nb, &ks))?;
                }
                Ok((hist, total))
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the blocking client's thread panicked"))??;
        }
        for _ in 0..if blocking { 0 } else { calls } {
            let ks = next_batch(&keys, &mut next, batch);
            let t = Instant::now();
            let got = cb.pin(&nb, &ks).await?;
            record_pin(&mut hist, &mut total, t.elapsed(), &got, transport)?;
            drop(got);
            cb.flush_releases().await;
            cb.remove(&nb, &ks).await?;
        }
        let after = tokio::task::spawn_blocking(move || scrape(mport)).await??;
        let (rpc, _) = mean(&before, &after, "kvmesh_engine_call_seconds", "method=\"pin\"");
        let (driver, _) = mean(&before, &after, "kvmesh_get_seconds", "result=\"fetched\"");
        let (locate, _) = mean(&before, &after, "kvmesh_get_stage_seconds", "stage=\"locate\"");
        let (read, _) = mean(&before, &after, "kvmesh_get_stage_seconds", "stage=\"read\"");
        let (register, _) = mean(&before, &after, "kvmesh_get_stage_seconds", "stage=\"register\"");
        let (post, _) = mean(&before, &after, "kvmesh_transfer_post_seconds", "");
        let (moving, batches) = mean(&before, &after, "kvmesh_transfer_batch_seconds", "");
        let (validate, _) = mean(&before, &after, "kvmesh_transfer_validate_seconds", "");
        Ok(Row {
            transport: transport.to_string(),
            block: size,
            batch,
            calls,
            client_p50: hist.value_at_quantile(0.5),
            client_p99: hist.value_at_quantile(0.99),
            client_mean: total.as_secs_f64() * 1e6 / calls as f64,
            rpc,
            driver,
            locate,
            read,
            register,
            post,
            moving,
            validate,
            batches,
        })
    })
}
