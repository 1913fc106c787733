//! `kvmesh-bench peers`: remote gets side by side with the systems an
//! engine would otherwise fetch KV from, in one run: kvmesh over tcp and
//! over shared memory (two daemons on loopback, the getter pins blocks the
//! other holds), Redis (`redis-server` from Debian: GET, MGET of the batch)
//! and Mooncake Store over TCP (a master and two store clients driven by
//! `bench/mooncake/driver.py` in its own virtualenv: the reader's
//! `get_into` / `batch_get_into` of blocks held in the other client's
//! segment).
//!
//! Every system holds the same amount of data per block size (larger than
//! the last-level cache, so reads are cold), and every byte of every read
//! is checked against what was stored, outside the timed call. Rounds are
//! interleaved (each round runs every row on every system), so a slow
//! moment of this shared machine hits all of them; latencies of all rounds
//! go into one histogram per row, printed with their sample count.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use hdrhistogram::Histogram;

use crate::placement::{Split, pin};
use kvmesh_client::{Client, Key, Namespace};

/// What one system did on one row, over all rounds.
struct Acc {
    hist: Histogram<u64>,
    secs: f64,
    bytes: u64,
    wrong: u64,
}

impl Acc {
    fn new() -> anyhow::Result<Acc> {
        Ok(Acc { hist: Histogram::new_with_bounds(1, 600_000_000, 3)?, secs: 0.0, bytes: 0, wrong: 0 })
    }
    fn record(&mut self, dt: Duration, bytes: u64) -> anyhow::Result<()> {
        self.hist.record(dt.as_micros().max(1) as u64)?;
        self.secs += dt.as_secs_f64();
        self.bytes += bytes;
        Ok(())
    }
}

/// Bytes of block `i` (8-byte words derived from the index, so a block
/// read in place of another is caught).
fn fill(i: u64, buf: &mut [u8]) {
    for (w, chunk) in buf.chunks_mut(8).enumerate() {
        let v = (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (w as u64).wrapping_mul(0xff51_afd7_ed55_8ccd)).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// Bytes of `got` that differ from block `i`.
fn wrong_bytes(i: u64, got: &[u8], expect_len: usize, scratch: &mut Vec<u8>) -> u64 {
    if got.len() != expect_len {
        return expect_len.max(got.len()) as u64;
    }
    scratch.resize(expect_len, 0);
    fill(i, scratch);
    if got == &scratch[..] { 0 } else { got.iter().zip(scratch.iter()).filter(|(a, b)| a != b).count() as u64 }
}

/// The next `batch` block indices of `n`, cycling (so reads stay cold).
fn next_indices(next: &mut u64, n: u64, batch: usize) -> Vec<u64> {
    (0..batch)
        .map(|_| {
            *next = (*next + 1) % n;
            *next
        })
        .collect()
}

/// Bytes each system holds per block size.
const DATA_BYTES: u64 = 320 << 20;

/// Untimed calls per system and row before the rounds.
const WARM_UP_CALLS: usize = 20;

/// Two kvmesh daemons on loopback: A holds the blocks, the engine of B
/// pins them (each pin a remote get; the copies are removed, untimed,
/// after each call so the next one fetches again).
struct KvPair {
    _a: crate::DaemonProc,
    _b: crate::DaemonProc,
    cb: Client,
    nb: Namespace,
    keys: u64,
    next: u64,
}

impl KvPair {
    async fn start(transport: &str, size: u64, batch: usize, split: Option<&Split>) -> anyhow::Result<KvPair> {
        let pool_bytes = DATA_BYTES.max(size * batch as u64 * 4) + (16 << 20);
        let pools = format!(
            "[[pools]]\nname = \"p\"\nbytes = \"{}MiB\"\nslot_payload_bytes = \"{}KiB\"\nmlock = false\n",
            pool_bytes >> 20,
            size >> 10
        );
        let tag = format!("peers-{transport}-{}", size >> 10);
        let (a, sock_a, b, sock_b) = crate::transfer::start_pair(&tag, transport, &pools, "")?;
        if let Some(sp) = split {
            pin(a.pid(), &sp.server, "holding daemon")?;
            pin(b.pid(), &sp.client, "getter daemon")?;
        }
        let ca = Client::connect(&sock_a).await?;
        let cb = Client::connect(&sock_b).await?;
        crate::transfer::wait_pair(&ca, &cb, transport).await?;
        if let Some(sp) = split {
            // Again, for threads made while the peers connected.
            pin(a.pid(), &sp.server, "holding daemon")?;
            pin(b.pid(), &sp.client, "getter daemon")?;
        }
        let na = ca.register_namespace("peers", size, "bench").await?;
        let nb = cb.register_namespace("peers", size, "bench").await?;
        let keys = (DATA_BYTES / size).max(batch as u64 * 2);
        let per_put = ((64 << 20) / size).max(1);
        let mut blocks: Vec<Vec<u8>> = Vec::new();
        let mut i = 0u64;
        while i < keys {
            let n = per_put.min(keys - i);
            blocks.clear();
            for j in i..i + n {
                let mut b = vec![0u8; size as usize];
                fill(j, &mut b);
                blocks.push(b);
            }
            let items: Vec<(Key, &[u8])> = (i..i + n).zip(&blocks).map(|(j, b)| (Key(j as u128), &b[..])).collect();
            let stored = ca.put(&na, &items).await?.stored as u64;
            if stored != n {
                bail!("kvmesh-{transport}: stored {stored} of {n} blocks of {size} B on the holder");
            }
            i += n;
        }
        Ok(KvPair { _a: a, _b: b, cb, nb, keys, next: 0 })
    }

    async fn run(&mut self, size: u64, batch: usize, samples: usize, acc: &mut Acc) -> anyhow::Result<()> {
        let mut scratch = Vec::new();
        for _ in 0..samples {
            let idx = next_indices(&mut self.next, self.keys, batch);
            let ks: Vec<Key> = idx.iter().map(|&i| Key(i as u128)).collect();
            let t = Instant::now();
            let got = self.cb.pin(&self.nb, &ks).await?;
            let dt = t.elapsed();
            for (&i, g) in idx.iter().zip(&got) {
                match g {
                    Some(b) => acc.wrong += wrong_bytes(i, b, size as usize, &mut scratch),
                    None => bail!("kvmesh: a remote get missed (key {i})"),
                }
            }
            acc.record(dt, size * batch as u64)?;
            drop(got);
            self.cb.flush_releases().await;
            self.cb.remove(&self.nb, &ks).await?;
        }
        Ok(())
    }
}

/// `redis-server` on a free loopback port, killed on drop.
struct Redis {
    child: Child,
    conn: redis::aio::MultiplexedConnection,
    /// Block sizes already stored, and how many keys each.
    filled: Vec<(u64, u64)>,
    next: u64,
}

impl Redis {
    async fn start(split: Option<&Split>) -> anyhow::Result<Redis> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .context("start redis-server (Debian package redis-server; or leave redis out of --systems)")?;
        if let Some(sp) = split {
            pin(child.id(), &sp.server, "redis-server")?;
        }
        let t0 = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if t0.elapsed() > Duration::from_secs(10) {
                bail!("redis-server did not come up on port {port}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let conn =
            redis::Client::open(format!("redis://127.0.0.1:{port}/"))?.get_multiplexed_async_connection().await?;
        Ok(Redis { child, conn, filled: Vec::new(), next: 0 })
    }

    async fn keys_for(&mut self, size: u64, batch: usize) -> anyhow::Result<u64> {
        if let Some(&(_, n)) = self.filled.iter().find(|(s, _)| *s == size) {
            return Ok(n);
        }
        let n = (DATA_BYTES / size).max(batch as u64 * 2);
        let mut buf = vec![0u8; size as usize];
        for i in 0..n {
            fill(i, &mut buf);
            let _: () = redis::cmd("SET").arg(format!("b{size}:{i}")).arg(&buf[..]).query_async(&mut self.conn).await?;
        }
        self.filled.push((size, n));
        Ok(n)
    }

    async fn run(&mut self, size: u64, batch: usize, samples: usize, acc: &mut Acc) -> anyhow::Result<()> {
        let n = self.keys_for(size, batch).await?;
        let mut scratch = Vec::new();
        for _ in 0..samples {
            let idx = next_indices(&mut self.next, n, batch);
            let names: Vec<String> = idx.iter().map(|i| format!("b{size}:{i}")).collect();
            let t = Instant::now();
            let got: Vec<Option<Vec<u8>>> = if batch == 1 {
                vec![redis::cmd("GET").arg(&names[0]).query_async(&mut self.conn).await?]
            } else {
                redis::cmd("MGET").arg(&names).query_async(&mut self.conn).await?
            };
            let dt = t.elapsed();
            for (&i, g) in idx.iter().zip(&got) {
                match g {
                    Some(b) => acc.wrong += wrong_bytes(i, b, size as usize, &mut scratch),
                    None => bail!("redis: key b{size}:{i} missing"),
                }
            }
            acc.record(dt, size * batch as u64)?;
        }
        Ok(())
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The Mooncake Store driver (`bench/mooncake/driver.py`), one command per
/// line on its stdin, one JSON line per answer.
struct Mooncake {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    version: String,
}

impl Mooncake {
    fn start(repo: &Path, split: Option<&Split>) -> anyhow::Result<Mooncake> {
        let dir = repo.join("bench/mooncake");
        let venv = std::env::var_os("KVMESH_MOONCAKE_VENV").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/kvmesh/mooncake-venv")
        });
        let python = venv.join("bin/python");
        if !python.exists() {
            eprintln!("peers: installing Mooncake Store into {} (bench/mooncake/setup.sh)", venv.display());
            let ok = Command::new("bash").arg(dir.join("setup.sh")).env("KVMESH_MOONCAKE_VENV", &venv).status()?;
            if !ok.success() {
                bail!("bench/mooncake/setup.sh failed (pip install mooncake-transfer-engine-non-cuda)");
            }
        }
        let mut cmd = Command::new(&python);
        if let Some(sp) = split {
            // The driver is the reader; it starts its master and holding
            // client under `taskset` on these CPUs.
            cmd.env("KVMESH_PEERS_SERVER_CPUS", &sp.server);
        }
        let mut child = cmd
            .arg(dir.join("driver.py"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("start {}", python.display()))?;
        if let Some(sp) = split {
            pin(child.id(), &sp.client, "Mooncake reader")?;
        }
        let stdin = child.stdin.take().context("driver stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("driver stdout")?);
        let mut m = Mooncake { child, stdin, stdout, version: String::new() };
        let first = m.line()?;
        if first.get("ready").and_then(|v| v.as_bool()) != Some(true) {
            bail!("Mooncake driver did not start: {first}");
        }
        m.version = first.get("version").and_then(|v| v.as_str()).unwrap_or("?").to_string();
        Ok(m)
    }

    fn line(&mut self) -> anyhow::Result<serde_json::Value> {
        let mut s = String::new();
        if self.stdout.read_line(&mut s)? == 0 {
            bail!("Mooncake driver exited");
        }
        let v: serde_json::Value = serde_json::from_str(s.trim()).with_context(|| format!("driver said {s:?}"))?;
        if let Some(e) = v.get("error") {
            bail!("Mooncake driver: {e}");
        }
        Ok(v)
    }

    fn run(&mut self, size: u64, batch: usize, samples: usize, acc: &mut Acc) -> anyhow::Result<()> {
        writeln!(self.stdin, "run {size} {batch} {samples}")?;
        self.stdin.flush()?;
        let v = self.line()?;
        let lat = v.get("lat_us").and_then(|l| l.as_array()).context("driver answer without lat_us")?;
        if lat.len() != samples {
            bail!("Mooncake driver timed {} calls, asked {samples}", lat.len());
        }
        for l in lat {
            let us = l.as_f64().context("latency not a number")?;
            acc.record(Duration::from_secs_f64(us / 1e6), size * batch as u64)?;
        }
        acc.wrong += v.get("wrong").and_then(|w| w.as_u64()).context("driver answer without wrong")?;
        let errors = v.get("errors").and_then(|w| w.as_u64()).unwrap_or(0);
        if errors > 0 {
            bail!("Mooncake: {errors} reads did not return the whole block");
        }
        Ok(())
    }
}

impl Drop for Mooncake {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

enum System {
    Kvmesh { transport: String, pairs: Vec<((u64, usize), KvPair)>, split: Option<Split> },
    Redis(Box<Redis>),
    Mooncake(Box<Mooncake>),
}

impl System {
    fn name(&self) -> String {
        match self {
            System::Kvmesh { transport, .. } => format!("kvmesh-{transport}"),
            System::Redis(_) => "redis".into(),
            System::Mooncake(_) => "mooncake-tcp".into(),
        }
    }

    async fn run(&mut self, size: u64, batch: usize, samples: usize, acc: &mut Acc) -> anyhow::Result<()> {
        match self {
            System::Kvmesh { transport, pairs, split } => {
                // One daemon pair per block size (pools are cut per size).
                let i = match pairs.iter().position(|((s, _), _)| *s == size) {
                    Some(i) => i,
                    None => {
                        pairs.push(((size, batch), KvPair::start(transport, size, batch, split.as_ref()).await?));
                        pairs.len() - 1
                    }
                };
                pairs[i].1.run(size, batch, samples, acc).await
            }
            System::Redis(r) => r.run(size, batch, samples, acc).await,
            System::Mooncake(m) => m.run(size, batch, samples, acc),
        }
    }
}

pub(crate) struct Opts {
    pub json: bool,
    pub systems: Vec<String>,
    pub block_kib: Vec<u64>,
    pub batches: Vec<usize>,
    pub samples: usize,
    pub rounds: usize,
    pub split: Option<Split>,
}

pub(crate) fn run(o: Opts) -> anyhow::Result<()> {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    if let Some(sp) = &o.split {
        // This process is every system's engine (or client) and the clock.
        pin(std::process::id(), &sp.client, "this bench")?;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let rounds = o.rounds.max(1);
    let per_round = o.samples.div_ceil(rounds).max(1);
    let rows: Vec<(u64, usize)> =
        o.block_kib.iter().flat_map(|&k| o.batches.iter().map(move |&b| (k << 10, b))).collect();
    rt.block_on(async {
        let mut systems = Vec::new();
        let mut mooncake_version = None;
        for s in &o.systems {
            systems.push(match s.as_str() {
                "kvmesh-tcp" | "kvmesh-sm" => {
                    System::Kvmesh {
                        transport: s.trim_start_matches("kvmesh-").to_string(),
                        pairs: Vec::new(),
                        split: o.split.clone(),
                    }
                }
                "redis" => System::Redis(Box::new(Redis::start(o.split.as_ref()).await?)),
                "mooncake-tcp" => {
                    let m = Mooncake::start(&repo, o.split.as_ref())?;
                    mooncake_version = Some(m.version.clone());
                    System::Mooncake(Box::new(m))
                }
                other => bail!("unknown system {other:?} (kvmesh-tcp, kvmesh-sm, redis, mooncake-tcp)"),
            });
        }
        let mut accs: Vec<Vec<Acc>> = Vec::new();
        for _ in &systems {
            accs.push(rows.iter().map(|_| Acc::new()).collect::<anyhow::Result<_>>()?);
        }
        // Untimed first pass: fills every system for every block size, and
        // warms connections.
        for (si, sys) in systems.iter_mut().enumerate() {
            for &(size, batch) in &rows {
                let mut scratch = Acc::new()?;
                sys.run(size, batch, WARM_UP_CALLS, &mut scratch)
                    .await
                    .with_context(|| format!("{} warm-up", sys.name()))?;
                accs[si][0].wrong += scratch.wrong;
            }
        }
        for round in 0..rounds {
            if !o.json {
                eprintln!("peers: round {} of {rounds}", round + 1);
            }
            for (ri, &(size, batch)) in rows.iter().enumerate() {
                for (si, sys) in systems.iter_mut().enumerate() {
                    sys.run(size, batch, per_round, &mut accs[si][ri])
                        .await
                        .with_context(|| format!("{} {size} B x{batch}", sys.name()))?;
                }
            }
        }
        let mut out = Vec::new();
        if !o.json {
            eprintln!(
                "{:<13} {:>7} {:>5} {:>7} {:>8} {:>9} {:>9} {:>6}",
                "system", "block", "batch", "GB/s", "p50 us", "p99 us", "samples", "wrong"
            );
        }
        for (ri, &(size, batch)) in rows.iter().enumerate() {
            for (si, sys) in systems.iter().enumerate() {
                let a = &accs[si][ri];
                let gbps = a.bytes as f64 / a.secs.max(1e-9) / 1e9;
                let (p50, p99, n) = (a.hist.value_at_quantile(0.5), a.hist.value_at_quantile(0.99), a.hist.len());
                if !o.json {
                    eprintln!(
                        "{:<13} {:>6}K {:>5} {:>7.2} {:>8} {:>9} {:>9} {:>6}",
                        sys.name(),
                        size >> 10,
                        batch,
                        gbps,
                        p50,
                        p99,
                        n,
                        a.wrong
                    );
                }
                out.push(serde_json::json!({
                    "system": sys.name(), "block_bytes": size, "batch": batch, "gbps": gbps,
                    "p50_us": p50, "p99_us": p99, "samples": n, "wrong_bytes": a.wrong,
                }));
            }
        }
        let wrong: u64 = accs.iter().flatten().map(|a| a.wrong).sum();
        println!(
            "{}",
            serde_json::json!({"bench": "peers", "rounds": rounds, "split_cpus": o.split.as_ref().map(|sp| format!("{}:{}", sp.server, sp.client)), "mooncake_version": mooncake_version, "shmem_huge_pages": kvmesh_ffi_os::shm::shmem_huge_mode(), "rows": out})
        );
        if wrong > 0 {
            bail!("{wrong} wrong bytes read (see the rows)");
        }
        Ok(())
    })
}
