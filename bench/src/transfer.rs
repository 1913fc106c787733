//! `kvmesh-bench transfer`: remote gets between two daemons, against two
//! ceilings measured in the same run on the same pool sizes:
//! - a raw UCX loop: this binary's own minimal get loop through `ffi/ucx`
//!   (no daemon logic) against a second process (`ucx-target`) that
//!   registers a memfd pool like the daemon's and progresses its worker;
//! - a cold single-thread memcpy between two memfd pools.
//!
//! `ucx_perftest` (ucp_get, am_bw) is recorded for reference; it reuses one
//! cache-hot buffer per side, so it is not a ceiling to quote.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use hdrhistogram::Histogram;
use kvmesh_client::{Client, Key};
use kvmesh_ffi_os::SharedMapping;
use kvmesh_ucx::{Context, MemoryRegion, Transports, Worker};

fn transports_of(name: &str) -> anyhow::Result<Transports> {
    Ok(match name {
        "sm" => Transports::SharedMemory,
        "tcp" => Transports::Tcp,
        "all" => Transports::All,
        t => bail!("unknown transport {t:?} (sm, tcp, all)"),
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> anyhow::Result<Vec<u8>> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).context("hex")).collect()
}

/// Progresses `worker` until `done()`, with the daemon's data-plane policy
/// (`peer.poll_idle_us`): it polls while UCX made progress within
/// `poll_idle`, then sleeps on the worker's event fd (1 ms at most) and
/// leaves the CPU to whoever must run for the transfer to go on — on tcp,
/// the kernel's own work and the other side. With `poll_idle` longer than
/// any transfer (the default, a second) it never sleeps mid-transfer: the
/// loop as it was before the option.
fn progress_until(
    worker: &Worker,
    poll_idle: Duration,
    mut done: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let efd = worker.event_fd()?;
    let mut active_at = Instant::now();
    loop {
        if worker.progress() > 0 {
            active_at = Instant::now();
        }
        if done()? {
            return Ok(());
        }
        if active_at.elapsed() < poll_idle || !worker.arm()? {
            continue;
        }
        kvmesh_ffi_os::with_raw_fd(efd, |fd| kvmesh_ffi_os::poll_readable(&[fd], 1))?;
    }
}

/// The raw-UCX target: a registered memfd pool and a progressing worker.
pub(crate) fn ucx_target(transport: &str, bytes: u64, poll_idle: Duration) -> anyhow::Result<()> {
    let t = transports_of(transport)?;
    let ctx = Context::new(&t)?;
    let mr = if transport == "sm" {
        Arc::new(MemoryRegion::allocate(&ctx, bytes as usize)?)
    } else {
        let pool = Arc::new(SharedMapping::create("ucx-target", bytes, false)?);
        {
            let mut w = pool.write(0, bytes)?;
            for (i, c) in w.chunks_mut(4096).enumerate() {
                c.fill(i as u8);
            }
        }
        Arc::new(MemoryRegion::register(&ctx, Arc::clone(&pool))?)
    };
    let worker = Worker::new(&ctx)?;
    println!("{} {} {}", hex(&worker.address()?), mr.base(), hex(&mr.pack_rkey()?));
    std::io::stdout().flush()?;
    // Busy-poll: the fastest a target can serve emulated gets, so the raw
    // loop is a ceiling, not a straw man. Check stdin now and then; the
    // parent's lines are `connect <addr hex>` and `send <size> <count>`
    // (tag sends of `count` blocks for the tag-mode loop).
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines() {
            let Ok(l) = l else { break };
            if lines_tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut ep = None;
    let mut next = 0u64;
    loop {
        worker.progress();
        // Idle: nothing of ours in flight; UCX is progressed every 200 µs
        // (connection set-up) and a command is taken as it comes.
        let line = match lines.recv_timeout(Duration::from_micros(200)) {
            Ok(l) => l,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(()), // parent closed stdin
        };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["connect", addr] => ep = Some(worker.connect(&unhex(addr)?, transport != "sm")?),
            ["send", size, count] => {
                let (size, count): (u64, u64) = (size.parse()?, count.parse()?);
                let e = ep.as_ref().context("send before connect")?;
                let per = (bytes / size).max(1);
                let mut reqs = Vec::new();
                for tag in 0..count {
                    let off = (next % per) * size;
                    next += 1;
                    reqs.push(e.tag_send(&mr, off as usize, size as usize, tag)?);
                }
                progress_until(&worker, poll_idle, || Ok(reqs.iter_mut().all(|r| r.poll().is_some())))?;
            }
            _ => {}
        }
    }
}

/// Raw UCX gets of `block` bytes, `batch` in flight, rotating over the pools.
fn raw_ucx(
    transport: &str,
    tag_mode: bool,
    pool_bytes: u64,
    sizes: &[u64],
    batches: &[usize],
    bytes_target: u64,
    opts: &Placed<'_>,
) -> anyhow::Result<Vec<f64>> {
    let (split, poll_idle) = (opts.split, opts.raw_poll_idle);
    let t = transports_of(transport)?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["ucx-target", "--transport", transport, "--bytes", &pool_bytes.to_string()])
        .args(["--poll-idle-us", &poll_idle.as_micros().to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    if let Some(sp) = split {
        crate::placement::pin(child.id(), &sp.server, "ucx-target")?;
    }
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
    let parts: Vec<&str> = line.split_whitespace().collect();
    if parts.len() != 3 {
        bail!("ucx-target said {line:?}");
    }
    let (addr, base, rkey) = (unhex(parts[0])?, parts[1].parse::<u64>()?, unhex(parts[2])?);
    let ctx = Context::new(&t)?;
    let mr = if transport == "sm" {
        Arc::new(MemoryRegion::allocate(&ctx, pool_bytes as usize)?)
    } else {
        let local = Arc::new(SharedMapping::create("ucx-init", pool_bytes, false)?);
        local.write(0, pool_bytes)?.fill(1);
        Arc::new(MemoryRegion::register(&ctx, local)?)
    };
    let worker = Worker::new(&ctx)?;
    let ep = worker.connect(&addr, transport != "sm")?;
    let rk = ep.unpack_rkey(&rkey)?;
    let mut target_in = child.stdin.take().context("stdin")?;
    if tag_mode {
        writeln!(target_in, "connect {}", hex(&worker.address()?))?;
    }
    let mut out = Vec::new();
    for &size in sizes {
        let slots = (pool_bytes / size) as usize;
        for &batch in batches {
            let rounds = (bytes_target / (size * batch as u64)).clamp(8, 2000) as usize;
            let mut next = 0usize;
            let t0 = Instant::now();
            for _ in 0..rounds {
                let mut reqs = Vec::with_capacity(batch);
                for tag in 0..batch {
                    let off = (next % slots) as u64 * size;
                    next += 1;
                    if tag_mode {
                        reqs.push(worker.tag_recv(&mr, off as usize, size as usize, tag as u64)?);
                    } else {
                        reqs.push(ep.get(&mr, off as usize, size as usize, base + off, &rk)?);
                    }
                }
                if tag_mode {
                    writeln!(target_in, "send {size} {batch}")?;
                }
                progress_until(&worker, poll_idle, || {
                    let mut all = true;
                    for r in reqs.iter_mut() {
                        match r.poll() {
                            None => all = false,
                            Some(Err(e)) => bail!("raw get failed: {e}"),
                            Some(Ok(())) => {}
                        }
                    }
                    Ok(all)
                })?;
            }
            out.push((rounds * batch) as f64 * size as f64 / t0.elapsed().as_secs_f64() / 1e9);
        }
    }
    drop(rk);
    drop(ep);
    drop(target_in);
    let _ = child.wait();
    Ok(out)
}

/// Cold single-thread memcpy between two memfd pools of `pool_bytes`.
fn memcpy_gbps(pool_bytes: u64, size: u64, bytes_target: u64) -> anyhow::Result<f64> {
    let src = Arc::new(SharedMapping::create("memcpy-src", pool_bytes, false)?);
    let dst = Arc::new(SharedMapping::create("memcpy-dst", pool_bytes, false)?);
    src.write(0, pool_bytes)?.fill(3);
    dst.write(0, pool_bytes)?.fill(4);
    let s = src.read(0, pool_bytes)?;
    let mut d = dst.write(0, pool_bytes)?;
    let slots = (pool_bytes / size) as usize;
    let n = (bytes_target / size).max(64) as usize;
    let t0 = Instant::now();
    for i in 0..n {
        let a = (i % slots) * size as usize;
        let b = ((i * 7 + 3) % slots) * size as usize;
        d[b..b + size as usize].copy_from_slice(&s[a..a + size as usize]);
    }
    std::hint::black_box(&d[..]);
    Ok(n as f64 * size as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

fn perftest(transport: &str, test: &str, size: u64) -> Option<f64> {
    let tls = transports_of(transport).ok()?.tls().to_string();
    let port = std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port().to_string();
    let mut server = Command::new("ucx_perftest")
        .args(["-p", &port])
        .env("UCX_TLS", &tls)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("timeout")
        .args(["20", "ucx_perftest", "127.0.0.1", "-p", &port, "-t", test, "-s", &size.to_string(), "-n", "2000"])
        .env("UCX_TLS", &tls)
        .output()
        .ok();
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out?.stdout).into_owned();
    // Final line: "Final: ... bandwidth (MB/s): average overall ..."
    let fin = text.lines().find(|l| l.trim_start().starts_with("Final:"))?;
    let nums: Vec<f64> = fin.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    // columns: iterations, latency typical/avg/overall, bandwidth avg/overall, msgrate avg/overall
    nums.get(5).map(|mbps| mbps * 1.048576 / 1000.0) // MB/s (2^20) -> GB/s
}

struct Row {
    transport: String,
    block: u64,
    batch: usize,
    gbps: f64,
    raw: f64,
    memcpy: f64,
    p50: u64,
    p99: u64,
    /// Timed calls behind p50/p99 (with fewer than 100, p99 is the maximum).
    samples: u64,
    perf_get: Option<f64>,
    perf_am: Option<f64>,
}

/// Where `transfer` runs its processes, and how its raw loop polls.
pub(crate) struct Placed<'a> {
    /// `--split-cpus`.
    pub(crate) split: Option<&'a crate::placement::Split>,
    /// `--raw-poll-idle-us`.
    pub(crate) raw_poll_idle: Duration,
}

pub(crate) fn run(
    json: bool,
    pool_mib: u64,
    block_kib: &[u64],
    transports: &[String],
    bytes_mib: u64,
    with_perftest: bool,
    opts: Placed<'_>,
) -> anyhow::Result<()> {
    let (split, raw_poll_idle) = (opts.split, opts.raw_poll_idle);
    if let Some(sp) = split {
        // This process reads: the raw loop's initiator and the engine.
        crate::placement::pin(std::process::id(), &sp.client, "this bench")?;
    }
    let pool_bytes = pool_mib << 20;
    let bytes_target = bytes_mib << 20;
    let sizes: Vec<u64> = block_kib.iter().map(|k| k << 10).collect();
    let batches = [1usize, 32];
    let mut rows = Vec::new();
    let memcpy: Vec<f64> = sizes.iter().map(|&s| memcpy_gbps(pool_bytes, s, bytes_target)).collect::<Result<_, _>>()?;
    for t in transports {
        // The raw loop uses the operation the daemon uses on this transport:
        // one-sided get on shared memory, tag rendezvous on tcp.
        let raw = raw_ucx(t, t == "tcp", pool_bytes, &sizes, &batches, bytes_target, &opts)?;
        let daemon = daemon_gets(t, pool_mib, &sizes, &batches, bytes_target, split)?;
        for (si, &size) in sizes.iter().enumerate() {
            let (pg, pa) = if with_perftest {
                (perftest(t, "ucp_get", size), perftest(t, "ucp_am_bw", size))
            } else {
                (None, None)
            };
            for (bi, &batch) in batches.iter().enumerate() {
                let (gbps, p50, p99, samples) = daemon[si * batches.len() + bi];
                let row = Row {
                    transport: t.clone(),
                    block: size,
                    batch,
                    gbps,
                    raw: raw[si * batches.len() + bi],
                    memcpy: memcpy[si],
                    p50,
                    p99,
                    samples,
                    perf_get: pg,
                    perf_am: pa,
                };
                eprintln!(
                    "{:>3} {:>5} KiB x{:<2} daemon {:6.2} GB/s  raw UCX {:6.2}  memcpy {:6.2}  ratio_raw {:.2}  \
                     ratio_memcpy {:.2}  batch p50 {:>6} us p99 {:>6} us ({} samples)  perftest get {:?} am {:?}",
                    row.transport,
                    size >> 10,
                    batch,
                    row.gbps,
                    row.raw,
                    row.memcpy,
                    row.gbps / row.raw,
                    row.gbps / row.memcpy,
                    row.p50,
                    row.p99,
                    row.samples,
                    row.perf_get.map(|x| (x * 100.0).round() / 100.0),
                    row.perf_am.map(|x| (x * 100.0).round() / 100.0),
                );
                rows.push(row);
            }
        }
    }
    let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
    let rows_json: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "transport": r.transport, "block_bytes": r.block, "batch": r.batch,
                "gbps": r3(r.gbps), "raw_ucx_gbps": r3(r.raw), "memcpy_gbps": r3(r.memcpy),
                "ratio_raw": r3(r.gbps / r.raw), "ratio_memcpy": r3(r.gbps / r.memcpy),
                "batch_p50_us": r.p50, "batch_p99_us": r.p99, "samples": r.samples,
                "perftest_get_gbps": r.perf_get.map(r3), "perftest_am_bw_gbps": r.perf_am.map(r3),
            })
        })
        .collect();
    if !json {
        println!("remote get = engine pin on B of blocks held by A (query, one-sided reads, validation, commit)");
    }
    println!(
        "{}",
        serde_json::json!({ "bench": "transfer", "pool_mib": pool_mib, "split_cpus": split.map(|sp| format!("{}:{}", sp.server, sp.client)), "raw_poll_idle_us": raw_poll_idle.as_micros() as u64, "shmem_huge_pages": kvmesh_ffi_os::shm::shmem_huge_mode(), "rows": rows_json })
    );
    Ok(())
}

/// Remote gets through two daemons: returns (GB/s, p50 us, p99 us,
/// samples) per
/// Waits until two daemons serve as one cluster of two (30 s at most).
/// A loopback TCP port that was free a moment ago.
pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Two daemons (nodes 1 and 2) peered over `transport` on loopback, each
/// with `pools`; `b_extra` is added to B's config. Returns A and B with
/// their sockets.
pub(crate) fn start_pair(
    tag: &str,
    transport: &str,
    pools: &str,
    b_extra: &str,
) -> anyhow::Result<(crate::DaemonProc, std::path::PathBuf, crate::DaemonProc, std::path::PathBuf)> {
    let (pa, pb) = (free_port()?, free_port()?);
    let cfg = |id: u32, me: u16, other: u16, extra: &str| {
        format!(
            "[node]\nid = {id}\n[peer]\nlisten = \"127.0.0.1:{me}\"\ntransports = \"{transport}\"\ntransfer_timeout_ms = 10000\n\
             tls = {{ mode = \"off\" }}\n{}\
             grant_lease_ms = 20000\n[[peers]]\nid = {}\naddr = \"127.0.0.1:{other}\"\n{pools}{extra}",
            crate::peer_control_line(),
            3 - id
        )
    };
    let (a, sock_a) =
        crate::start_daemon_tagged(&format!("{tag}-a"), &cfg(1, pa, pb, &crate::with_register_at_locate("")))?;
    let (b, sock_b) =
        crate::start_daemon_tagged(&format!("{tag}-b"), &cfg(2, pb, pa, &crate::with_register_at_locate(b_extra)))?;
    Ok((a, sock_a, b, sock_b))
}

pub(crate) async fn wait_pair(ca: &Client, cb: &Client, transport: &str) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        let mut ready = true;
        for c in [ca, cb] {
            let s = c.stats().await?;
            ready &=
                s.peers_connected == 1 && s.coherence.is_some_and(|c| c.serving && c.members == 2 && c.directory_ready);
        }
        if ready {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("daemons did not form a cluster over {transport}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// (size, batch).
fn daemon_gets(
    transport: &str,
    pool_mib: u64,
    sizes: &[u64],
    batches: &[usize],
    bytes_target: u64,
    split: Option<&crate::placement::Split>,
) -> anyhow::Result<Vec<(f64, u64, u64, u64)>> {
    let mut pools = String::new();
    for s in sizes {
        pools.push_str(&format!(
            "[[pools]]\nname = \"p{}k\"\nbytes = \"{pool_mib}MiB\"\nslot_payload_bytes = \"{}KiB\"\nmlock = false\n",
            s >> 10,
            s >> 10
        ));
    }
    let (a, sock_a, b, sock_b) = start_pair(transport, transport, &pools, "")?;
    let pin_pair = || -> anyhow::Result<()> {
        if let Some(sp) = split {
            crate::placement::pin(a.pid(), &sp.server, "holding daemon")?;
            crate::placement::pin(b.pid(), &sp.client, "getter daemon")?;
        }
        Ok(())
    };
    pin_pair()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let ca = Client::connect(&sock_a).await?;
        let cb = Client::connect(&sock_b).await?;
        wait_pair(&ca, &cb, transport).await?;
        // Again, for threads made while the peers connected.
        pin_pair()?;
        let mut out = Vec::new();
        for &size in sizes {
            let name = format!("xfer-{}", size >> 10);
            let na = ca.register_namespace(&name, size, "bench").await?;
            let nb = cb.register_namespace(&name, size, "bench").await?;
            let slots = ca.hello().pools[na.pool as usize].slots as usize;
            let keys: Vec<Key> = (0..slots as u128).map(|i| Key(((size as u128) << 64) | i)).collect();
            let block = vec![0x5au8; size as usize];
            for chunk in keys.chunks(64) {
                let items: Vec<(Key, &[u8])> = chunk.iter().map(|&k| (k, &block[..])).collect();
                let s = ca.put(&na, &items).await?;
                if s.stored as usize != chunk.len() {
                    bail!("put on A over {transport}: {s:?}");
                }
            }
            for &batch in batches {
                let rounds = (bytes_target / (size * batch as u64)).clamp(8, 2000) as usize;
                let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
                let mut next = 0usize;
                let mut total = Duration::ZERO;
                let mut moved = 0u64;
                for _ in 0..rounds {
                    let ks: Vec<Key> = (0..batch)
                        .map(|_| {
                            let k = keys[next % keys.len()];
                            next += 1;
                            k
                        })
                        .collect();
                    let t = Instant::now();
                    let got = cb.pin(&nb, &ks).await?;
                    let dt = t.elapsed();
                    let hits = got.iter().filter(|g| g.is_some()).count();
                    if hits != ks.len() {
                        bail!("remote get over {transport} returned {hits} of {} blocks", ks.len());
                    }
                    total += dt;
                    moved += hits as u64 * size;
                    hist.record(dt.as_micros().max(1) as u64)?;
                    drop(got);
                    cb.flush_releases().await;
                    // Untimed: forget the copies so the next round fetches again.
                    cb.remove(&nb, &ks).await?;
                }
                out.push((
                    moved as f64 / total.as_secs_f64() / 1e9,
                    hist.value_at_quantile(0.5),
                    hist.value_at_quantile(0.99),
                    hist.len(),
                ));
            }
        }
        Ok(out)
    })
}
