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
//! The baseline runs in the same process at the same time: a second pair
//! of daemons holding only the smallest level's blocks. Every latency
//! sample on the large cluster is taken next to one on the baseline (the
//! order alternating), so both see the same machine; the ratios reported
//! are large / baseline at each level. Every pinned block's bytes are
//! checked after its timing (a wrong byte fails the bench).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kvmesh_client::{Client, Key, Namespace};

use crate::DaemonProc;

/// Block size of this run (`--block-kib`), set once in `run`.
static BLOCK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

fn block() -> usize {
    *BLOCK.get().expect("set in run")
}
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
    k.0.to_le_bytes().repeat(block() / 16)
}

fn check(k: Key, got: &[u8]) -> anyhow::Result<()> {
    let want = k.0.to_le_bytes();
    if got.len() != block() || got.chunks_exact(16).any(|c| c != want) {
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

/// The measured operations, in the order they are measured.
#[derive(Clone, Copy)]
enum What {
    PinLocal,
    PinRemote,
    Put,
    Invalidate,
}

/// Latency histograms of one cluster at one level.
struct Lat {
    pin_local: Histogram<u64>,
    pin_remote: Histogram<u64>,
    put: Histogram<u64>,
    invalidate_ms: Vec<f64>,
}

impl Lat {
    fn new() -> Lat {
        Lat { pin_local: hist(), pin_remote: hist(), put: hist(), invalidate_ms: Vec::new() }
    }
    fn invalidate_1k_ms(&self) -> f64 {
        let mut v = self.invalidate_ms.clone();
        v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
        v[v.len() / 2]
    }
}

/// One level's figures (the large cluster, and its baseline alongside).
struct Level {
    blocks: u64,
    big: Lat,
    base: Lat,
    idle_cpu_pct: f64,
    rss_mib: f64,
    bytes_per_block: f64,
    marginal: f64,
}

/// Two clustered daemons and what the bench has put on them.
struct Cluster {
    _daemons: Vec<(DaemonProc, PathBuf)>,
    clients: Vec<Client>,
    nss: Vec<Namespace>,
    pids: Vec<u32>,
    filled: usize,
    inval_next: usize,
    put_next: usize,
    rng: u64,
}

impl Cluster {
    fn start(tag: &str, slots: usize, rt: &tokio::runtime::Runtime) -> anyhow::Result<Cluster> {
        let stride = kvmesh_common::slot::slot_stride(block() as u64);
        let pool_mib = (slots as u64 * stride).div_ceil(1 << 20).max(16);
        let daemons = start_cluster(tag, pool_mib)?;
        let pids: Vec<u32> = daemons.iter().map(|(d, _)| d.pid()).collect();
        // Large pools take a while to set up: retry the handshake.
        let mut clients = Vec::new();
        for (_, sock) in &daemons {
            let t0 = Instant::now();
            loop {
                match rt.block_on(Client::connect(sock)) {
                    Ok(c) => break clients.push(c),
                    Err(e) if t0.elapsed() < Duration::from_secs(180) => {
                        eprintln!("waiting for the daemon at {}: {e}", sock.display());
                        std::thread::sleep(Duration::from_secs(1));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        wait_ready_blocking(&clients, rt)?;
        let nss: Vec<Namespace> = clients
            .iter()
            .map(|c| rt.block_on(c.register_namespace("scale-bench", block() as u64, "bench")))
            .collect::<Result<_, _>>()?;
        Ok(Cluster {
            _daemons: daemons,
            clients,
            nss,
            pids,
            filled: 0,
            inval_next: 0,
            put_next: 0,
            rng: 0x9e37_79b9_7f4a_7c15 ^ slots as u64,
        })
    }

    /// Anonymous memory (KiB, the larger of the two daemons) and pool slots
    /// of a daemon before anything is cached.
    async fn empty_memory(&self) -> anyhow::Result<(u64, u64)> {
        let mut anon = 0;
        for &p in &self.pids {
            anon = anon.max(mem_kib(p)?.1);
        }
        let slots = self.clients[0].stats().await?.pools.iter().map(|p| p.slots as u64).sum();
        Ok((anon, slots))
    }

    async fn fill_to(&mut self, level: usize) -> anyhow::Result<()> {
        let (a, b) = tokio::join!(
            fill(&self.clients[0], &self.nss[0], 0, self.filled, level),
            fill(&self.clients[1], &self.nss[1], 1, self.filled, level)
        );
        a.and(b)?;
        self.filled = level;
        Ok(())
    }

    /// 32 consecutive fill keys of daemon `d` at a pseudo-random place.
    fn batch_of(&mut self, d: usize) -> Vec<Key> {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let start = (self.rng as usize) % (self.filled - BATCH + 1);
        (start..start + BATCH).map(|i| key(d, 0, i)).collect()
    }

    /// Pins `keys` through daemon 1 and checks every block's bytes
    /// (untimed); returns the pin's microseconds.
    async fn timed_pin(&self, keys: &[Key], what: &str) -> anyhow::Result<u64> {
        let (c, ns) = (&self.clients[0], &self.nss[0]);
        let t = Instant::now();
        let got = c.pin(ns, keys).await?;
        let us = t.elapsed().as_micros() as u64;
        for (b, &k) in got.iter().zip(keys) {
            check(k, b.as_ref().with_context(|| format!("{what} block {k} missing"))?)?;
        }
        Ok(us)
    }

    /// Pins 32 blocks daemon 1 holds; returns the pin's microseconds.
    async fn pin_local(&mut self) -> anyhow::Result<u64> {
        let keys = self.batch_of(0);
        self.timed_pin(&keys, "local").await
    }

    /// Pins 32 blocks only daemon 2 holds through daemon 1, which drops
    /// its new copies again afterwards (untimed) so the fill stays remote.
    async fn pin_remote(&mut self) -> anyhow::Result<u64> {
        let keys = self.batch_of(1);
        let us = self.timed_pin(&keys, "remote").await?;
        let (c, ns) = (&self.clients[0], &self.nss[0]);
        c.flush_releases().await;
        if c.remove(ns, &keys).await?.iter().any(|r| !r) {
            bail!("daemon 1 kept a fetched copy after remove");
        }
        Ok(us)
    }

    /// Puts 32 new blocks on daemon 1 (removed again afterwards, untimed).
    async fn put(&mut self) -> anyhow::Result<u64> {
        let keys: Vec<Key> = (self.put_next..self.put_next + BATCH).map(|i| key(0, 1, i)).collect();
        self.put_next += BATCH;
        let (c, ns) = (&self.clients[0], &self.nss[0]);
        let data: Vec<Vec<u8>> = keys.iter().map(|&k| content(k)).collect();
        let items: Vec<(Key, &[u8])> = keys.iter().copied().zip(data.iter().map(|v| &v[..])).collect();
        let t = Instant::now();
        let s = c.put(ns, &items).await?;
        let us = t.elapsed().as_micros() as u64;
        if s.stored as usize != BATCH {
            bail!("put of 32 new blocks: {s:?}");
        }
        if c.remove(ns, &keys).await?.iter().any(|r| !r) {
            bail!("daemon 1 kept a put block after remove");
        }
        Ok(us)
    }

    /// Invalidates 1,000 keys held on both daemons (put on daemon 2 and
    /// fetched by daemon 1 first, untimed); returns milliseconds.
    async fn invalidate_1k(&mut self) -> anyhow::Result<f64> {
        let keys: Vec<Key> = (self.inval_next..self.inval_next + 1000).map(|i| key(1, 2, i)).collect();
        self.inval_next += 1000;
        let data: Vec<Vec<u8>> = keys.iter().map(|&k| content(k)).collect();
        let items: Vec<(Key, &[u8])> = keys.iter().copied().zip(data.iter().map(|v| &v[..])).collect();
        let s = self.clients[1].put(&self.nss[1], &items).await?;
        if s.stored != 1000 {
            bail!("put of 1000 keys to invalidate: {s:?}");
        }
        let (c, ns) = (&self.clients[0], &self.nss[0]);
        for chunk in keys.chunks(500) {
            if c.pin(ns, chunk).await?.iter().any(|b| b.is_none()) {
                bail!("a key to invalidate was not fetched");
            }
        }
        c.flush_releases().await;
        let t = Instant::now();
        let s = c.invalidate(ns, &keys).await?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if s.failed > 0 || s.invalidated < 1000 {
            bail!("invalidation of 1000 keys: {s:?}");
        }
        // Nobody may serve an invalidated key any more.
        for (cl, n) in self.clients.iter().zip(&self.nss) {
            for chunk in keys.chunks(500) {
                if cl.pin(n, chunk).await?.iter().any(|b| b.is_some()) {
                    bail!("an invalidated block was served");
                }
            }
            cl.flush_releases().await;
        }
        Ok(ms)
    }
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
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("the cluster did not form");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn start_cluster(tag: &str, pool_mib: u64) -> anyhow::Result<Vec<(DaemonProc, PathBuf)>> {
    crate::start_sm_cluster(
        tag,
        2,
        &format!(
            "[[pools]]\nname = \"blocks\"\nbytes = \"{pool_mib}MiB\"\nslot_payload_bytes = \"{}KiB\"\nmlock = false\n",
            block() / 1024
        ),
    )
}

pub(crate) fn run(json: bool, levels: &[usize], samples: usize, idle_s: u64, block_kib: usize) -> anyhow::Result<()> {
    if !(1..=1024).contains(&block_kib) {
        bail!("--block-kib must be 1..=1024");
    }
    BLOCK.set(block_kib * 1024).map_err(|_| anyhow::anyhow!("block size set twice"))?;
    if levels.is_empty() || levels.windows(2).any(|w| w[0] >= w[1]) || levels[0] < BATCH {
        bail!("--blocks must be increasing, the first at least {BATCH}");
    }
    if samples == 0 {
        bail!("--samples must be at least 1");
    }
    let top = *levels.last().expect("non-empty");
    // Room on each daemon for its fill and what the measurements put, with
    // slack; no eviction.
    let slack = 4 * 1000 + 4 * BATCH + 10_000;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut base = Cluster::start("scale-base", levels[0] + slack, &rt)?;
    let base_empty = rt.block_on(base.empty_memory())?;
    rt.block_on(base.fill_to(levels[0]))?;
    let mut big = Cluster::start("scale", top + slack, &rt)?;
    let big_empty = rt.block_on(big.empty_memory())?;
    // What a daemon spends per slot of its pool before it caches anything
    // (slot table, free list, the index sized for every slot): the two
    // clusters differ only in their pools' slot counts.
    let fixed_per_slot = (big_empty.0 as f64 - base_empty.0 as f64) * 1024.0 / (big_empty.1 - base_empty.1) as f64;
    eprintln!("fixed memory per pool slot (anonymous, before any block): {fixed_per_slot:.0} B");
    eprintln!(
        "scale: 2 daemons filled level by level to {levels:?} blocks of {block_kib} KiB each, next to 2 holding {}",
        levels[0]
    );
    // Anonymous memory of the formed, empty cluster: the base the
    // per-block overhead is measured from.
    let mut mem_base: Vec<(u64, u64, u64)> =
        big.pids.iter().map(|&p| mem_kib(p).map(|m| (m.1, m.1, 0))).collect::<anyhow::Result<_>>()?;
    let mut rows = Vec::new();
    for &level in levels {
        let t = Instant::now();
        rt.block_on(big.fill_to(level))?;
        eprintln!("filled to {level} blocks each in {:.1} s", t.elapsed().as_secs_f64());
        let l = rt.block_on(measure(&mut big, &mut base, &mut mem_base, samples, idle_s))?;
        let r = |a: &Histogram<u64>, b: &Histogram<u64>, q: f64| {
            a.value_at_quantile(q) as f64 / b.value_at_quantile(q).max(1) as f64
        };
        eprintln!(
            "level {:>8} blocks: pin local p50 {} us p99 {} us (x{:.2} x{:.2}) | pin remote p50 {} us p99 {} us (x{:.2} \
             x{:.2}) | put p50 {} us p99 {} us (x{:.2} x{:.2}) | invalidate 1k {:.1} ms (x{:.2}) | idle cpu {:.2}% | \
             rss {:.0} MiB | {:.0} B/block ({:.0} marginal)",
            l.blocks,
            l.big.pin_local.value_at_quantile(0.5),
            l.big.pin_local.value_at_quantile(0.99),
            r(&l.big.pin_local, &l.base.pin_local, 0.5),
            r(&l.big.pin_local, &l.base.pin_local, 0.99),
            l.big.pin_remote.value_at_quantile(0.5),
            l.big.pin_remote.value_at_quantile(0.99),
            r(&l.big.pin_remote, &l.base.pin_remote, 0.5),
            r(&l.big.pin_remote, &l.base.pin_remote, 0.99),
            l.big.put.value_at_quantile(0.5),
            l.big.put.value_at_quantile(0.99),
            r(&l.big.put, &l.base.put, 0.5),
            r(&l.big.put, &l.base.put, 0.99),
            l.big.invalidate_1k_ms(),
            l.big.invalidate_1k_ms() / l.base.invalidate_1k_ms(),
            l.idle_cpu_pct,
            l.rss_mib,
            l.bytes_per_block,
            l.marginal
        );
        rows.push(l);
    }
    let r2 = |x: f64| (x * 100.0).round() / 100.0;
    let ratio = |a: &Histogram<u64>, b: &Histogram<u64>, q: f64| {
        r2(a.value_at_quantile(q) as f64 / b.value_at_quantile(q).max(1) as f64)
    };
    let out_rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|l| {
            serde_json::json!({
                "blocks": l.blocks,
                "pin_local_p50_us": l.big.pin_local.value_at_quantile(0.5),
                "pin_local_p99_us": l.big.pin_local.value_at_quantile(0.99),
                "pin_remote_p50_us": l.big.pin_remote.value_at_quantile(0.5),
                "pin_remote_p99_us": l.big.pin_remote.value_at_quantile(0.99),
                "put_p50_us": l.big.put.value_at_quantile(0.5),
                "put_p99_us": l.big.put.value_at_quantile(0.99),
                "invalidate_1k_ms": r2(l.big.invalidate_1k_ms()),
                "idle_cpu_pct": r2(l.idle_cpu_pct),
                "rss_mib": r2(l.rss_mib),
                "bytes_per_block_overhead": l.bytes_per_block.round(),
                "bytes_per_block_marginal": l.marginal.round(),
                "vs_baseline": {
                    "baseline_blocks": levels[0],
                    "pin_local_p50": ratio(&l.big.pin_local, &l.base.pin_local, 0.5),
                    "pin_local_p99": ratio(&l.big.pin_local, &l.base.pin_local, 0.99),
                    "pin_remote_p50": ratio(&l.big.pin_remote, &l.base.pin_remote, 0.5),
                    "pin_remote_p99": ratio(&l.big.pin_remote, &l.base.pin_remote, 0.99),
                    "put_p50": ratio(&l.big.put, &l.base.put, 0.5),
                    "put_p99": ratio(&l.big.put, &l.base.put, 0.99),
                    "invalidate_1k": r2(l.big.invalidate_1k_ms() / l.base.invalidate_1k_ms()),
                },
            })
        })
        .collect();
    if !json {
        eprintln!("ratios: the large cluster over the baseline pair measured alongside, same samples");
    }
    println!(
        "{}",
        serde_json::json!({
            "bench": "scale",
            "samples": samples,
            "fixed_bytes_per_slot": fixed_per_slot.round(),
            "rows": out_rows,
        })
    );
    Ok(())
}

/// Measures one level: latency samples alternating between the large
/// cluster and the baseline, then the large cluster's idle CPU and memory.
async fn measure(
    big: &mut Cluster,
    base: &mut Cluster,
    mem_base: &mut [(u64, u64, u64)],
    samples: usize,
    idle_s: u64,
) -> anyhow::Result<Level> {
    let (mut big_lat, mut base_lat) = (Lat::new(), Lat::new());
    for (what, n) in
        [(What::PinLocal, samples), (What::PinRemote, samples), (What::Put, samples), (What::Invalidate, 3)]
    {
        for i in 0..n {
            // Alternate which cluster goes first.
            for big_turn in [i % 2 == 0, i % 2 != 0] {
                let (cl, lat) = if big_turn { (&mut *big, &mut big_lat) } else { (&mut *base, &mut base_lat) };
                match what {
                    What::PinLocal => lat.pin_local.record(cl.pin_local().await?)?,
                    What::PinRemote => lat.pin_remote.record(cl.pin_remote().await?)?,
                    What::Put => lat.put.record(cl.put().await?)?,
                    What::Invalidate => lat.invalidate_ms.push(cl.invalidate_1k().await?),
                }
            }
        }
    }
    // Idle: nothing asked of the daemons (their clients stay connected).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before: Vec<f64> = big.pids.iter().map(|&p| cpu_s(p)).collect::<anyhow::Result<_>>()?;
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(idle_s)).await;
    let wall = t.elapsed().as_secs_f64();
    let mut idle_cpu_pct = 0f64;
    for (&p, b) in big.pids.iter().zip(&before) {
        idle_cpu_pct = idle_cpu_pct.max((cpu_s(p)? - b) / wall * 100.0);
    }
    let mut rss_mib = 0f64;
    let mut bytes_per_block = 0f64;
    let mut marginal = 0f64;
    for ((&p, mb), cl) in big.pids.iter().zip(mem_base.iter_mut()).zip(&big.clients) {
        let (rss, anon) = mem_kib(p)?;
        rss_mib = rss_mib.max(rss as f64 / 1024.0);
        // Average: everything the daemon's anonymous memory grew by since
        // it was empty, per block it holds (maps sized up front are paid
        // as their pages are touched, so early levels carry more).
        // Marginal: per block added since the previous level.
        let blocks = valid_blocks(cl).await?;
        bytes_per_block = bytes_per_block.max(anon.saturating_sub(mb.0) as f64 * 1024.0 / blocks.max(1) as f64);
        let grown = blocks.saturating_sub(mb.2).max(1);
        marginal = marginal.max(anon.saturating_sub(mb.1) as f64 * 1024.0 / grown as f64);
        *mb = (mb.0, anon, blocks);
    }
    Ok(Level {
        blocks: valid_blocks(&big.clients[0]).await?,
        big: big_lat,
        base: base_lat,
        idle_cpu_pct,
        rss_mib,
        bytes_per_block,
        marginal,
    })
}
