//! `kvmesh-bench scale`: does a daemon holding many blocks answer as fast
//! as an empty one? Two clustered daemons (real processes, UCX over shared
//! memory, the protocol on gRPC) are filled, level by level, to N cached
//! blocks each; at every level the bench measures, through the client
//! library:
//!
//! - pin of a batch of 32 blocks the daemon holds (local), p50/p99;
//! - pin of a batch of 32 blocks only the other daemon holds (remote:
//!   locate at the home, grant, one-sided UCX read, validation,
//!   registration), p50/p99;
//! - put of 32 new blocks (allocate, copy into the pool, commit, publish
//!   at the homes), p50/p99;
//! - invalidation of 1,000 keys held by both daemons (median of 3);
//! - each daemon's idle CPU over `--idle-s` seconds, its resident memory,
//!   and its anonymous memory per cached block (index, directory and
//!   coherence state; the pool is shared memory and not counted).
//!
//! The baseline is the same bench at the smallest level, in the same run:
//! the ratios of the largest level to it are printed. Every pinned block's
//! bytes are checked after its timing (a wrong byte fails the bench).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kvmesh_client::{Client, Key, Namespace};

use crate::{DaemonProc, start_daemon_tagged};

const BLOCK: usize = 4096;
const BATCH: usize = 32;
/// Keys per fill call.
const FILL_CHUNK: usize = 1024;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Key `i` of daemon `d`'s fill (`tag` 0), of its put samples (1), of the
/// blocks it invalidates (2): spread over the key space, as the chained
/// prefix hashes of engines are.
fn key(d: usize, tag: u64, i: usize) -> Key {
    let seed = ((d as u64) << 62) ^ (tag << 56) ^ i as u64;
    let hi = splitmix(seed);
    Key(((hi as u128) << 64) | splitmix(hi ^ seed) as u128)
}

/// A block's bytes: its key, repeated.
fn content(k: Key) -> Vec<u8> {
    k.0.to_le_bytes().iter().copied().cycle().take(BLOCK).collect()
}

fn check(k: Key, got: &[u8]) -> anyhow::Result<()> {
    let want = k.0.to_le_bytes();
    if got.len() != BLOCK || got.chunks_exact(16).any(|c| c != want) {
        bail!("block {k} read back wrong bytes");
    }
    Ok(())
}

/// CPU seconds (user + system) a process used so far.
fn cpu_s(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start after ')'.
    let rest = stat.rsplit_once(')').context("malformed /proc stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    Ok(ticks / 100.0) // USER_HZ is 100 on Linux
}

/// (VmRSS, RssAnon) in KiB.
fn mem_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status.lines().find(|l| l.starts_with(name)).with_context(|| format!("no {name}"))?;
        Ok(line.split_whitespace().nth(1).context("value")?.parse()?)
    };
    Ok((field("VmRSS:")?, field("RssAnon:")?))
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

async fn valid_blocks(c: &Client) -> anyhow::Result<u64> {
    Ok(c.stats().await?.pools.iter().map(|p| p.valid as u64).sum())
}

async fn fill(c: &Client, ns: &Namespace, d: usize, from: usize, to: usize) -> anyhow::Result<()> {
    let mut i = from;
    while i < to {
        let n = FILL_CHUNK.min(to - i);
        let keys: Vec<Key> = (i..i + n).map(|j| key(d, 0, j)).collect();
        let data: Vec<Vec<u8>> = keys.iter().map(|&k| content(k)).collect();
        let items: Vec<(Key, &[u8])> = keys.iter().copied().zip(data.iter().map(|v| &v[..])).collect();
        let s = c.put(ns, &items).await?;
        if s.stored as usize + s.existed as usize != n {
            bail!("fill of daemon {d}: {s:?}");
        }
        i += n;
    }
    Ok(())
}

/// One level's figures.
struct Level {
    blocks: u64,
    pin_local: Histogram<u64>,
    pin_remote: Histogram<u64>,
    put: Histogram<u64>,
    invalidate_1k_ms: f64,
    idle_cpu_pct: f64,
    rss_mib: f64,
    bytes_per_block: f64,
}

fn wait_ready_blocking(clients: &[Client], rt: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        let mut ok = true;
        for c in clients {
            let s = rt.block_on(c.stats())?;
            let co = s.coherence.context("daemon runs without coherence")?;
            ok &= co.serving && co.members == clients.len() as u32 && co.directory_ready;
        }
        if ok {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("the cluster did not form");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn start_cluster(pool_mib: u64) -> anyhow::Result<Vec<(DaemonProc, PathBuf)>> {
    let ports: Vec<u16> = (0..2)
        .map(|_| Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()))
        .collect::<anyhow::Result<_>>()?;
    let mut out = Vec::new();
    for id in 1..=2usize {
        let other = 3 - id;
        let cfg = format!(
            "[node]\nid = {id}\n[peer]\nlisten = \"127.0.0.1:{}\"\ntransports = \"sm\"\n\
             [[pools]]\nname = \"p4k\"\nbytes = \"{pool_mib}MiB\"\nslot_payload_bytes = \"4KiB\"\nmlock = false\n\
             [[peers]]\nid = {other}\naddr = \"127.0.0.1:{}\"\n",
            ports[id - 1],
            ports[other - 1]
        );
        out.push(start_daemon_tagged(&format!("scale-{id}"), &cfg)?);
    }
    Ok(out)
}

pub(crate) fn run(json: bool, levels: &[usize], samples: usize, idle_s: u64) -> anyhow::Result<()> {
    if levels.is_empty() || levels.windows(2).any(|w| w[0] >= w[1]) {
        bail!("--blocks must be increasing");
    }
    if samples == 0 {
        bail!("--samples must be at least 1");
    }
    let top = *levels.last().expect("non-empty");
    // Room on each daemon for its fill, the remote blocks it fetches and
    // the blocks it puts at every level, with slack; no eviction.
    let per_level = 2 * BATCH + 3 * 1000;
    let slots = top + levels.len() * per_level + 10_000;
    let stride = kvmesh_common::slot::slot_stride(BLOCK as u64);
    let pool_mib = (slots as u64 * stride).div_ceil(1 << 20);
    eprintln!("scale: 2 daemons, {slots} slots of 4 KiB each ({pool_mib} MiB per pool)");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let daemons = start_cluster(pool_mib)?;
    let pids: Vec<u32> = daemons.iter().map(|(d, _)| d.pid()).collect();
    let clients: Vec<Client> =
        daemons.iter().map(|(_, s)| rt.block_on(Client::connect(s))).collect::<Result<_, _>>()?;
    wait_ready_blocking(&clients, &rt)?;
    let nss: Vec<Namespace> = clients
        .iter()
        .map(|c| rt.block_on(c.register_namespace("scale-bench", BLOCK as u64, "bench")))
        .collect::<Result<_, _>>()?;
    // Anonymous memory of the formed, empty cluster: the base the
    // per-block overhead is measured from.
    let mut base: Vec<(u64, u64)> =
        pids.iter().map(|&p| mem_kib(p).map(|m| (m.1, 0))).collect::<anyhow::Result<_>>()?;
    let mut filled = 0usize;
    let mut inval_next = 0usize;
    let mut put_next = 0usize;
    let mut rows = Vec::new();
    for &level in levels {
        let t = Instant::now();
        rt.block_on(async {
            let (a, b) = tokio::join!(
                fill(&clients[0], &nss[0], 0, filled, level),
                fill(&clients[1], &nss[1], 1, filled, level)
            );
            a.and(b)
        })?;
        eprintln!("filled to {level} blocks each in {:.1} s", t.elapsed().as_secs_f64());
        filled = level;
        rows.push(rt.block_on(measure(
            &clients,
            &nss,
            &pids,
            &mut base,
            samples,
            idle_s,
            &mut inval_next,
            &mut put_next,
            filled,
        ))?);
        let l = rows.last().expect("pushed");
        eprintln!(
            "level {:>8} blocks: pin local p50 {} us p99 {} us | pin remote p50 {} us p99 {} us | put p50 {} us p99 {} us \
             | invalidate 1k {:.1} ms | idle cpu {:.2}% | rss {:.0} MiB | {:.0} B/block",
            l.blocks,
            l.pin_local.value_at_quantile(0.5),
            l.pin_local.value_at_quantile(0.99),
            l.pin_remote.value_at_quantile(0.5),
            l.pin_remote.value_at_quantile(0.99),
            l.put.value_at_quantile(0.5),
            l.put.value_at_quantile(0.99),
            l.invalidate_1k_ms,
            l.idle_cpu_pct,
            l.rss_mib,
            l.bytes_per_block
        );
    }
    let r2 = |x: f64| (x * 100.0).round() / 100.0;
    let out_rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|l| {
            serde_json::json!({
                "blocks": l.blocks,
                "pin_local_p50_us": l.pin_local.value_at_quantile(0.5),
                "pin_local_p99_us": l.pin_local.value_at_quantile(0.99),
                "pin_remote_p50_us": l.pin_remote.value_at_quantile(0.5),
                "pin_remote_p99_us": l.pin_remote.value_at_quantile(0.99),
                "put_p50_us": l.put.value_at_quantile(0.5),
                "put_p99_us": l.put.value_at_quantile(0.99),
                "invalidate_1k_ms": r2(l.invalidate_1k_ms),
                "idle_cpu_pct": r2(l.idle_cpu_pct),
                "rss_mib": r2(l.rss_mib),
                "bytes_per_block_overhead": l.bytes_per_block.round(),
            })
        })
        .collect();
    let (first, last) = (&rows[0], rows.last().expect("non-empty"));
    let ratio = |f: fn(&Level) -> f64| r2(f(last) / f(first).max(1.0));
    let ratios = serde_json::json!({
        "pin_local_p50": ratio(|l| l.pin_local.value_at_quantile(0.5) as f64),
        "pin_local_p99": ratio(|l| l.pin_local.value_at_quantile(0.99) as f64),
        "pin_remote_p50": ratio(|l| l.pin_remote.value_at_quantile(0.5) as f64),
        "pin_remote_p99": ratio(|l| l.pin_remote.value_at_quantile(0.99) as f64),
        "put_p50": ratio(|l| l.put.value_at_quantile(0.5) as f64),
        "put_p99": ratio(|l| l.put.value_at_quantile(0.99) as f64),
        "invalidate_1k": ratio(|l| l.invalidate_1k_ms),
    });
    if !json {
        eprintln!("ratios of the largest level to the smallest (baseline, same run): {ratios}");
    }
    println!(
        "{}",
        serde_json::json!({"bench": "scale", "samples": samples, "rows": out_rows, "ratio_largest_to_smallest": ratios})
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    clients: &[Client],
    nss: &[Namespace],
    pids: &[u32],
    base: &mut [(u64, u64)],
    samples: usize,
    idle_s: u64,
    inval_next: &mut usize,
    put_next: &mut usize,
    filled: usize,
) -> anyhow::Result<Level> {
    let (c, ns) = (&clients[0], &nss[0]);
    // Local pins: 32 consecutive keys at a pseudo-random place of the fill.
    let mut pin_local = hist();
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ filled as u64;
    for _ in 0..samples {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let start = (x as usize) % (filled - BATCH + 1);
        let keys: Vec<Key> = (start..start + BATCH).map(|i| key(0, 0, i)).collect();
        let t = Instant::now();
        let got = c.pin(ns, &keys).await?;
        pin_local.record(t.elapsed().as_micros() as u64)?;
        for (b, &k) in got.iter().zip(&keys) {
            check(k, b.as_ref().with_context(|| format!("local block {k} missing"))?)?;
        }
    }
    // Remote pins: keys only daemon 2 holds; after each sample daemon 1
    // drops its new copies again (untimed), so the fill stays remote.
    let mut pin_remote = hist();
    for _ in 0..samples {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let start = (x as usize) % (filled - BATCH + 1);
        let keys: Vec<Key> = (start..start + BATCH).map(|i| key(1, 0, i)).collect();
        let t = Instant::now();
        let got = c.pin(ns, &keys).await?;
        pin_remote.record(t.elapsed().as_micros() as u64)?;
        for (b, &k) in got.iter().zip(&keys) {
            check(k, b.as_ref().with_context(|| format!("remote block {k} missing"))?)?;
        }
        drop(got);
        c.flush_releases().await;
        let removed = c.remove(ns, &keys).await?;
        if removed.iter().any(|r| !r) {
            bail!("daemon 1 kept a fetched copy after remove");
        }
    }
    // Puts of 32 new blocks.
    let mut put = hist();
    for _ in 0..samples {
        let keys: Vec<Key> = (*put_next..*put_next + BATCH).map(|i| key(0, 1, i)).collect();
        *put_next += BATCH;
        let data: Vec<Vec<u8>> = keys.iter().map(|&k| content(k)).collect();
        let items: Vec<(Key, &[u8])> = keys.iter().copied().zip(data.iter().map(|v| &v[..])).collect();
        let t = Instant::now();
        let s = c.put(ns, &items).await?;
        put.record(t.elapsed().as_micros() as u64)?;
        if s.stored as usize != BATCH {
            bail!("put of 32 new blocks: {s:?}");
        }
        // Untimed: drop them again, so every level holds its fill only.
        if c.remove(ns, &keys).await?.iter().any(|r| !r) {
            bail!("daemon 1 kept a put block after remove");
        }
    }
    // Invalidations of 1,000 keys held on both daemons: put on daemon 2,
    // fetched by daemon 1 (untimed), invalidated through daemon 1.
    let mut inv = Vec::new();
    for _ in 0..3 {
        let keys: Vec<Key> = (*inval_next..*inval_next + 1000).map(|i| key(1, 2, i)).collect();
        *inval_next += 1000;
        let data: Vec<Vec<u8>> = keys.iter().map(|&k| content(k)).collect();
        let items: Vec<(Key, &[u8])> = keys.iter().copied().zip(data.iter().map(|v| &v[..])).collect();
        let s = clients[1].put(&nss[1], &items).await?;
        if s.stored != 1000 {
            bail!("put of 1000 keys to invalidate: {s:?}");
        }
        for chunk in keys.chunks(500) {
            let got = c.pin(ns, chunk).await?;
            if got.iter().any(|b| b.is_none()) {
                bail!("a key to invalidate was not fetched");
            }
        }
        c.flush_releases().await;
        let t = Instant::now();
        let s = c.invalidate(ns, &keys).await?;
        inv.push(t.elapsed().as_secs_f64() * 1e3);
        if s.failed > 0 || s.invalidated < 1000 {
            bail!("invalidation of 1000 keys: {s:?}");
        }
        // Nobody may serve an invalidated key any more.
        for (cl, n) in clients.iter().zip(nss) {
            for chunk in keys.chunks(500) {
                if cl.pin(n, chunk).await?.iter().any(|b| b.is_some()) {
                    bail!("an invalidated block was served");
                }
            }
        }
    }
    inv.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    c.flush_releases().await;
    // Idle: nothing asked of the daemons (their clients stay connected).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before: Vec<f64> = pids.iter().map(|&p| cpu_s(p)).collect::<anyhow::Result<_>>()?;
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(idle_s)).await;
    let wall = t.elapsed().as_secs_f64();
    let mut idle_cpu_pct = 0f64;
    for (&p, b) in pids.iter().zip(&before) {
        idle_cpu_pct = idle_cpu_pct.max((cpu_s(p)? - b) / wall * 100.0);
    }
    let mut rss_mib = 0f64;
    let mut bytes_per_block = 0f64;
    for ((&p, b), cl) in pids.iter().zip(base.iter_mut()).zip(clients) {
        let (rss, anon) = mem_kib(p)?;
        rss_mib = rss_mib.max(rss as f64 / 1024.0);
        // Marginal: what the blocks added since the previous level cost
        // (the first level's figure also carries one-time allocations).
        let blocks = valid_blocks(cl).await?;
        let grown = blocks.saturating_sub(b.1).max(1);
        bytes_per_block = bytes_per_block.max(anon.saturating_sub(b.0) as f64 * 1024.0 / grown as f64);
        *b = (anon, blocks);
    }
    Ok(Level {
        blocks: valid_blocks(c).await?,
        pin_local,
        pin_remote,
        put,
        invalidate_1k_ms: inv[inv.len() / 2],
        idle_cpu_pct,
        rss_mib,
        bytes_per_block,
    })
}
