//! The open-loop replay of a trace against a real cluster.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kvmesh_client::{Client, Key, Namespace};
use parking_lot::Mutex;

use super::model;
use super::plot::{self, Chart, Scale, Series};
use super::trace::Request;
use crate::DaemonProc;

/// Which daemon ("engine on that node") serves a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Policy {
    /// Request i goes to daemon i mod N.
    RoundRobin,
    /// A seeded random daemon.
    Random,
    /// The daemon chosen by a hash of the first block id (requests sharing a
    /// first block meet on one node).
    PrefixAffinity,
    /// A router fed by every daemon's KV events: the daemon holding the
    /// longest prefix of the request's blocks (ties: fewest requests in
    /// flight).
    KvAware,
}

/// Options shared by `replay` and `load --replay`.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct ReplayOpts {
    /// Daemons to start (UCX over shared memory); ignored with --sockets.
    #[arg(long, default_value_t = 2)]
    pub(crate) daemons: u32,
    /// Use running daemons instead (their engine sockets, comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub(crate) sockets: Vec<PathBuf>,
    /// Pool of each started daemon, MiB.
    #[arg(long, default_value_t = 256)]
    pub(crate) pool_mib: u64,
    /// Tokens per block of the trace's hash_ids.
    #[arg(long, default_value_t = 512)]
    pub(crate) block_tokens: u64,
    /// KV bytes per token: block_bytes = bytes_per_token * block_tokens.
    #[arg(long, default_value_t = 32)]
    pub(crate) bytes_per_token: u64,
    /// Namespace (the model name).
    #[arg(long, default_value = "replay-model")]
    pub(crate) model: String,
    /// Arrival times are divided by this.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) speed: f64,
    /// Requests in flight at most; an arrival beyond waits (and may be late).
    #[arg(long, default_value_t = 64)]
    pub(crate) max_inflight: usize,
    /// A request that starts more than this after its arrival is late.
    #[arg(long, default_value_t = 10)]
    pub(crate) late_ms: u64,
    /// Daemon choice per request; several (comma-separated) replay the
    /// trace once per policy, each on a fresh cluster, in one run.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "prefix-affinity")]
    pub(crate) policy: Vec<Policy>,
    /// Pins are held for this many µs per missing token (a simulated
    /// prefill) before the missing blocks are put.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) prefill_us_per_token: f64,
    /// Stop after this many requests of the trace (0: all).
    #[arg(long, default_value_t = 0)]
    pub(crate) limit: usize,
    /// Output directory (CSV time series, plots).
    #[arg(long, default_value = "replay-out")]
    pub(crate) out: PathBuf,
    /// Seed of the `random` policy.
    #[arg(long, default_value_t = 1)]
    pub(crate) policy_seed: u64,
    /// Print only the final JSON line on stdout.
    #[arg(long)]
    pub(crate) json: bool,
    /// Replay the same trace, same run, against a baseline store too.
    #[arg(long, value_enum, default_value = "none")]
    pub(crate) baseline: Baseline,
}

/// A store the same trace is replayed against, for comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Baseline {
    /// No baseline.
    None,
    /// `redis-server` on a loopback port, used as a remote block store
    /// (pipelined EXISTS, MGET of the found prefix, pipelined SET),
    /// `maxmemory` = the cluster's pool capacity, allkeys-lru.
    Redis,
}

/// Where a replayed request goes.
#[derive(Clone)]
enum Backend {
    Kvmesh(Client, Namespace),
    Redis(redis::aio::MultiplexedConnection),
}

fn redis_kind(e: &redis::RedisError) -> String {
    format!("{:?}", e.kind())
}

/// Operations with a latency histogram: the three calls, a request from
/// its start, and `e2e` from its scheduled arrival (queueing included).
const OPS: [&str; 5] = ["lookup", "pin_read", "put", "request", "e2e"];

/// Longest latency recorded as it is, in µs (a day); longer ones (a
/// cluster that fell that far behind an open-loop trace) count as a day.
const LATENCY_US_MAX: u64 = 86_400_000_000;

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, LATENCY_US_MAX, 3).expect("valid bounds")
}

/// Counters of one second of the run (by completion time).
#[derive(Clone, Debug, Default)]
struct Second {
    started: u64,
    finished: u64,
    late: u64,
    offered: u64,
    blocks: u64,
    local_hits: u64,
    remote_hits: u64,
    missed: u64,
    ideal_hits: u64,
    lru_hits: u64,
    bytes_read: u64,
    bytes_written: u64,
    errors: u64,
    request_us: Option<Histogram<u64>>,
    e2e_us: Option<Histogram<u64>>,
}

#[derive(Default)]
struct Totals {
    local_hits: AtomicU64,
    remote_hits: AtomicU64,
    missed: AtomicU64,
    wrong_bytes: AtomicU64,
    above_ideal: AtomicU64,
    put_stored: AtomicU64,
    put_existed: AtomicU64,
    put_failed: AtomicU64,
    finished: AtomicU64,
}

struct Shared {
    hists: Mutex<Vec<Histogram<u64>>>,
    seconds: Mutex<Vec<Second>>,
    errors: Mutex<std::collections::BTreeMap<String, u64>>,
    first_refusal: Mutex<Option<String>>,
    totals: Totals,
    t0: Instant,
}

impl Shared {
    fn second(&self, at: Instant, f: impl FnOnce(&mut Second)) {
        let s = at.saturating_duration_since(self.t0).as_secs() as usize;
        let mut v = self.seconds.lock();
        if v.len() <= s {
            v.resize_with(s + 1, Second::default);
        }
        f(&mut v[s]);
    }
    fn error(&self, what: &str, kind: Option<String>) {
        let k = match kind {
            Some(k) => format!("{what}:{k}"),
            None => what.to_string(),
        };
        *self.errors.lock().entry(k).or_default() += 1;
        self.second(Instant::now(), |s| s.errors += 1);
    }
}

/// The key of a trace block id (the id fixes its whole prefix).
pub(crate) fn key_of(id: u64) -> Key {
    Key::chain(None, &[id as u32, (id >> 32) as u32])
}

/// Bytes of `got` that differ from the block of `key` (`len` bytes): a
/// block shorter or longer than that counts every byte missing or extra.
fn wrong_bytes(key: Key, got: &[u8], len: usize, scratch: &mut Vec<u8>) -> u64 {
    scratch.resize(len, 0);
    crate::fill_block(key, scratch);
    if scratch[..] == got[..] {
        return 0;
    }
    let differ = scratch.iter().zip(got).filter(|(a, b)| a != b).count();
    (differ + len.abs_diff(got.len())) as u64
}

fn pick(policy: Policy, i: usize, r: &Request, n: usize, seed: u64) -> usize {
    let h = |x: u64| {
        let k = Key::chain(None, &[x as u32, (x >> 32) as u32, seed as u32]);
        (k.lo() % n as u64) as usize
    };
    match policy {
        Policy::RoundRobin => i % n,
        Policy::Random => h(i as u64),
        Policy::PrefixAffinity => r.hash_ids.first().map_or(i % n, |&id| h(id)),
        // Chosen when the request starts (`Router::pick`).
        Policy::KvAware => 0,
    }
}

struct Plan {
    keys: Vec<Key>,
    daemon: usize,
    input_tokens: u64,
    ideal: u32,
    lru: u32,
}

#[allow(clippy::too_many_arguments)]
async fn one_request(
    sh: Arc<Shared>,
    backend: Backend,
    plan: Arc<Plan>,
    block_bytes: usize,
    prefill_us_per_token: f64,
    block_tokens: u64,
    due: Instant,
) {
    let t_req = Instant::now();
    let n = plan.keys.len();
    // Redis keys: the 16 key bytes (not needed for kvmesh).
    let key_bytes: Vec<[u8; 16]> = match backend {
        Backend::Redis(_) => plan.keys.iter().map(|k| k.0.to_be_bytes()).collect(),
        Backend::Kvmesh(..) => Vec::new(),
    };
    let t = Instant::now();
    let local = match &backend {
        // This daemon's own copies: the local part of the prefix (a
        // cluster-wide lookup would count blocks held elsewhere).
        Backend::Kvmesh(client, ns) => match client.lookup_local(ns, &plan.keys).await {
            Ok(l) => l.prefix_len as usize,
            Err(e) => {
                sh.error("lookup", Some(format!("{:?}", e.kind())));
                0
            }
        },
        Backend::Redis(conn) => {
            let mut pipe = redis::pipe();
            for k in &key_bytes {
                pipe.cmd("EXISTS").arg(&k[..]);
            }
            match pipe.query_async::<Vec<bool>>(&mut conn.clone()).await {
                Ok(v) => v.iter().take_while(|&&x| x).count(),
                Err(e) => {
                    sh.error("lookup", Some(redis_kind(&e)));
                    0
                }
            }
        }
    };
    sh.hists.lock()[0].saturating_record(t.elapsed().as_micros() as u64);
    let t = Instant::now();
    let mut scratch = Vec::with_capacity(block_bytes);
    let mut wrong = 0;
    // Held (kvmesh: pinned) while the prefill runs.
    let mut pinned = Vec::new();
    let hits = match &backend {
        Backend::Kvmesh(client, ns) => {
            let opts = kvmesh_client::PinOptions { lease_ms: 0, stop_at_first_miss: true };
            pinned = match client.pin_with(ns, &plan.keys, opts).await {
                Ok(p) => p.into_iter().map_while(|b| b).collect::<Vec<_>>(),
                Err(e) => {
                    sh.error("pin", Some(format!("{:?}", e.kind())));
                    Vec::new()
                }
            };
            for b in &pinned {
                wrong += wrong_bytes(b.key(), b, block_bytes, &mut scratch);
            }
            pinned.len()
        }
        Backend::Redis(conn) => {
            if local == 0 {
                0
            } else {
                let keys: Vec<&[u8]> = key_bytes[..local].iter().map(|k| &k[..]).collect();
                match redis::cmd("MGET").arg(&keys).query_async::<Vec<Option<Vec<u8>>>>(&mut conn.clone()).await {
                    Ok(v) => {
                        let got: Vec<Vec<u8>> = v.into_iter().map_while(|b| b).collect();
                        for (b, k) in got.iter().zip(&plan.keys) {
                            wrong += wrong_bytes(*k, b, block_bytes, &mut scratch);
                        }
                        got.len()
                    }
                    Err(e) => {
                        sh.error("mget", Some(redis_kind(&e)));
                        0
                    }
                }
            }
        }
    };
    // (A Redis request whose prefix is absent sends no MGET: nothing to
    // time, where kvmesh's pin still asks the cluster.)
    if !matches!(backend, Backend::Redis(_)) || local > 0 {
        sh.hists.lock()[1].saturating_record(t.elapsed().as_micros() as u64);
    }
    let (local_hits, remote_hits) = match backend {
        Backend::Kvmesh(..) => (local.min(hits), hits - local.min(hits)),
        // Every block of a remote store is a remote hit.
        Backend::Redis(_) => (0, hits),
    };
    if hits as u32 > plan.ideal {
        sh.totals.above_ideal.fetch_add(1, Ordering::Relaxed);
    }
    if wrong > 0 {
        sh.totals.wrong_bytes.fetch_add(wrong, Ordering::Relaxed);
    }
    // Prefill of the missing tokens, holding the pins.
    let missing_tokens = plan.input_tokens.saturating_sub(hits as u64 * block_tokens);
    let prefill = Duration::from_secs_f64(missing_tokens as f64 * prefill_us_per_token / 1e6);
    if !prefill.is_zero() {
        tokio::time::sleep(prefill).await;
    }
    let mut written = 0u64;
    if hits < n {
        let t = Instant::now();
        let data: Vec<Vec<u8>> = plan.keys[hits..]
            .iter()
            .map(|&k| {
                let mut v = vec![0u8; block_bytes];
                crate::fill_block(k, &mut v);
                v
            })
            .collect();
        match &backend {
            Backend::Kvmesh(client, ns) => {
                let items: Vec<(Key, &[u8])> =
                    plan.keys[hits..].iter().copied().zip(data.iter().map(|d| &d[..])).collect();
                match client.put(ns, &items).await {
                    Ok(s) => {
                        written = s.stored as u64;
                        sh.totals.put_stored.fetch_add(s.stored as u64, Ordering::Relaxed);
                        sh.totals.put_existed.fetch_add((s.existed + s.in_progress) as u64, Ordering::Relaxed);
                        let failed = (s.lost + s.refused) as u64;
                        sh.totals.put_failed.fetch_add(failed, Ordering::Relaxed);
                        if s.lost > 0 {
                            sh.error("put:lost", None);
                        }
                        if let Some(why) = s.first_refusal {
                            sh.error("put:refused", None);
                            sh.first_refusal.lock().get_or_insert(why);
                        }
                    }
                    Err(e) => sh.error("put", Some(format!("{:?}", e.kind()))),
                }
            }
            Backend::Redis(conn) => {
                let mut pipe = redis::pipe();
                for (k, d) in key_bytes[hits..].iter().zip(&data) {
                    pipe.cmd("SET").arg(&k[..]).arg(&d[..]).ignore();
                }
                match pipe.query_async::<()>(&mut conn.clone()).await {
                    Ok(()) => {
                        written = data.len() as u64;
                        sh.totals.put_stored.fetch_add(written, Ordering::Relaxed);
                    }
                    Err(e) => sh.error("set", Some(redis_kind(&e))),
                }
            }
        }
        sh.hists.lock()[2].saturating_record(t.elapsed().as_micros() as u64);
    }
    drop(pinned);
    let done = Instant::now();
    let req_us = done.duration_since(t_req).as_micros() as u64;
    let e2e_us = done.saturating_duration_since(due).as_micros() as u64;
    {
        let mut h = sh.hists.lock();
        h[3].saturating_record(req_us);
        h[4].saturating_record(e2e_us);
    }
    sh.totals.local_hits.fetch_add(local_hits as u64, Ordering::Relaxed);
    sh.totals.remote_hits.fetch_add(remote_hits as u64, Ordering::Relaxed);
    sh.totals.missed.fetch_add((n - hits) as u64, Ordering::Relaxed);
    sh.totals.finished.fetch_add(1, Ordering::Relaxed);
    sh.second(done, |s| {
        s.finished += 1;
        s.blocks += n as u64;
        s.local_hits += local_hits as u64;
        s.remote_hits += remote_hits as u64;
        s.missed += (n - hits) as u64;
        s.ideal_hits += plan.ideal as u64;
        s.lru_hits += plan.lru as u64;
        s.bytes_read += (hits * block_bytes) as u64;
        s.bytes_written += written * block_bytes as u64;
        s.request_us.get_or_insert_with(hist).saturating_record(req_us);
        s.e2e_us.get_or_insert_with(hist).saturating_record(e2e_us);
    });
}

fn ops_json(hists: &[Histogram<u64>]) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (name, h) in OPS.iter().zip(hists) {
        m.insert(
            name.to_string(),
            serde_json::json!({
                "count": h.len(),
                "p50_us": h.value_at_quantile(0.5), "p90_us": h.value_at_quantile(0.9),
                "p99_us": h.value_at_quantile(0.99), "p999_us": h.value_at_quantile(0.999), "max_us": h.max(),
            }),
        );
    }
    serde_json::Value::Object(m)
}

/// Replays `requests` once per policy of `o.policy` (each on a fresh
/// cluster); prints tables on stderr; returns the JSON summary (with
/// several policies, one summary per policy and their local hit shares).
pub(crate) fn run(requests: Vec<Request>, o: &ReplayOpts, skipped_lines: usize) -> anyhow::Result<serde_json::Value> {
    let mut policies: Vec<Policy> = Vec::new();
    for &p in &o.policy {
        if !policies.contains(&p) {
            policies.push(p);
        }
    }
    match policies.as_slice() {
        [] => bail!("--policy: give at least one"),
        [p] => return run_policy(requests, o, *p, &o.out, skipped_lines),
        _ if !o.sockets.is_empty() => {
            bail!("several policies need fresh clusters: give one --policy with --sockets")
        }
        _ => {}
    }
    let mut runs = serde_json::Map::new();
    let mut shares = serde_json::Map::new();
    for &p in &policies {
        let name = format!("{p:?}");
        let out = o.out.join(&name);
        let j = run_policy(requests.clone(), o, p, &out, skipped_lines)?;
        let share = |k: &str| j[k].as_f64().or_else(|| j[k].as_u64().map(|v| v as f64)).unwrap_or(0.0);
        let blocks = share("blocks");
        let local = if blocks > 0.0 { share("local_hits") / blocks } else { 0.0 };
        shares.insert(name.clone(), serde_json::json!({"local_hit_share": local, "hit_ratio": j["hit_ratio"]}));
        runs.insert(name, j);
    }
    eprintln!("replay: local hit share by policy (blocks served from the daemon the request was sent to):");
    for (name, s) in &shares {
        eprintln!(
            "  {name:>16}: local {:.3}  all hits {:.3}",
            s["local_hit_share"].as_f64().unwrap_or(0.0),
            s["hit_ratio"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(serde_json::json!({"bench": "replay", "policies": shares, "runs": runs}))
}

fn run_policy(
    requests: Vec<Request>,
    o: &ReplayOpts,
    policy: Policy,
    out: &Path,
    skipped_lines: usize,
) -> anyhow::Result<serde_json::Value> {
    if !(o.speed > 0.0 && o.speed.is_finite()) {
        bail!("--speed must be a positive number, got {}", o.speed);
    }
    if o.max_inflight == 0 {
        bail!("--max-inflight must be at least 1");
    }
    if o.block_tokens == 0 || o.bytes_per_token == 0 {
        bail!("--block-tokens and --bytes-per-token must be at least 1");
    }
    let mut requests = requests;
    if o.limit > 0 {
        requests.truncate(o.limit);
    }
    let block_bytes = o.bytes_per_token * o.block_tokens;
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;

    // The cluster under test.
    let (_daemons, sockets): (Vec<DaemonProc>, Vec<PathBuf>) = if o.sockets.is_empty() {
        if o.daemons == 0 {
            bail!("--daemons must be at least 1");
        }
        let pools = format!(
            "[[pools]]\nname = \"replay\"\nbytes = \"{}MiB\"\nslot_payload_bytes = {block_bytes}\nmlock = false\n",
            o.pool_mib
        );
        crate::start_sm_cluster("replay", o.daemons, &pools)?.into_iter().unzip()
    } else {
        (Vec::new(), o.sockets.clone())
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let (clients, nss, slots) = rt.block_on(async {
        let mut clients = Vec::new();
        for s in &sockets {
            clients.push(Client::connect(s).await.with_context(|| format!("connect to {}", s.display()))?);
        }
        if o.sockets.is_empty() && clients.len() > 1 {
            crate::coherence::wait_ready(&clients, clients.len() as u32).await?;
        }
        let mut nss = Vec::new();
        let mut slots = 0u64;
        for c in &clients {
            nss.push(c.register_namespace(&o.model, block_bytes, "replay").await?);
            let st = c.stats().await?;
            slots +=
                st.pools.iter().filter(|p| p.slot_payload_bytes >= block_bytes).map(|p| p.slots as u64).sum::<u64>();
        }
        anyhow::Ok((clients, nss, slots))
    })?;

    // Offline references.
    let ideal = model::ideal(&requests);
    let lru = model::lru(&requests, slots as usize);
    let n_daemons = clients.len();
    let plans: Vec<Arc<Plan>> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            Arc::new(Plan {
                keys: r.hash_ids.iter().map(|&id| key_of(id)).collect(),
                daemon: pick(policy, i, r, n_daemons, o.policy_seed),
                input_tokens: r.input_length,
                ideal: ideal[i],
                lru: lru[i],
            })
        })
        .collect();
    let total_blocks: u64 = requests.iter().map(|r| r.hash_ids.len() as u64).sum();
    let ideal_hits: u64 = ideal.iter().map(|&h| h as u64).sum();
    let lru_hits: u64 = lru.iter().map(|&h| h as u64).sum();

    let span_ms = requests.last().map_or(0, |r| r.timestamp) as f64 / o.speed;
    eprintln!(
        "replay: {} requests, {} blocks of {} B, {} daemons, policy {:?}, speed {} ({:.1} s of arrivals)",
        requests.len(),
        total_blocks,
        block_bytes,
        n_daemons,
        policy,
        o.speed,
        span_ms / 1e3
    );
    let backends: Vec<Backend> = clients.iter().zip(&nss).map(|(c, n)| Backend::Kvmesh(c.clone(), n.clone())).collect();
    let router = match policy {
        Policy::KvAware => Some(rt.block_on(super::router::Router::start(&clients, &nss))?),
        _ => None,
    };
    let run = drive(&rt, &requests, &plans, o, &backends, block_bytes, "kvmesh", router.as_ref());
    let router_json = router.map(|r| {
        r.stop();
        let (events, resyncs) = (r.events.load(Ordering::Relaxed), r.resyncs.load(Ordering::Relaxed));
        eprintln!("kv-aware router: {events} events applied, {resyncs} resynchronisations");
        serde_json::json!({"events": events, "resyncs": resyncs})
    });
    drop(backends);
    drop(clients);
    let refs = Refs { requests: requests.len(), blocks: total_blocks, ideal_hits, lru_hits, block_bytes };
    let baseline = match o.baseline {
        Baseline::None => None,
        Baseline::Redis => {
            let capacity = slots * (block_bytes + 128);
            let redis = RedisServer::start(capacity)?;
            let conn = rt.block_on(async {
                let c = redis::Client::open(format!("redis://127.0.0.1:{}/", redis.port))?;
                anyhow::Ok(c.get_multiplexed_async_connection().await?)
            })?;
            eprintln!("replay: the same trace against redis-server (maxmemory {capacity} B, allkeys-lru)");
            let d = drive(&rt, &requests, &plans, o, &[Backend::Redis(conn)], block_bytes, "redis", None);
            let j = result_json(&d, &refs);
            print_result("redis", &d, &refs);
            Some((d, j))
        }
    };
    print_result("kvmesh", &run, &refs);
    let hists = run.sh.hists.lock().clone();
    let seconds = run.sh.seconds.lock().clone();
    // Outputs: CSV, plots, summary.
    let csv = out.join("timeseries.csv");
    {
        use std::io::Write;
        let mut w = std::io::BufWriter::new(std::fs::File::create(&csv)?);
        writeln!(
            w,
            "second,offered,started,finished,late,blocks,local_hits,remote_hits,missed,ideal_hits,lru_hits,bytes_read,bytes_written,errors,request_p50_us,request_p99_us"
        )?;
        for (i, s) in seconds.iter().enumerate() {
            // A second in which no request finished has no latency: empty
            // cells, not 0 (which would read as fast).
            let (p50, p99) =
                s.request_us.as_ref().filter(|h| !h.is_empty()).map_or((String::new(), String::new()), |h| {
                    (h.value_at_quantile(0.5).to_string(), h.value_at_quantile(0.99).to_string())
                });
            writeln!(
                w,
                "{i},{},{},{},{},{},{},{},{},{},{},{},{},{},{p50},{p99}",
                s.offered,
                s.started,
                s.finished,
                s.late,
                s.blocks,
                s.local_hits,
                s.remote_hits,
                s.missed,
                s.ideal_hits,
                s.lru_hits,
                s.bytes_read,
                s.bytes_written,
                s.errors
            )?;
        }
        w.flush()?;
    }
    let base_hists = baseline.as_ref().map(|(d, _)| d.sh.hists.lock().clone());
    // A chart that cannot be drawn (no font for the PNGs) costs the charts,
    // not the run: the CSV and the summary are written whatever happens.
    let (plots, plot_error) = match write_plots(out, &hists, base_hists.as_deref(), &seconds) {
        Ok(p) => (p, None),
        Err(e) => {
            eprintln!("replay: plots not written: {e:#} (the CSV and the summary are complete)");
            (Vec::new(), Some(format!("{e:#}")))
        }
    };
    let mut summary = serde_json::json!({
        "bench": "replay",
        "requests": requests.len(),
        "skipped_lines": skipped_lines,
        "daemons": n_daemons,
        "policy": format!("{:?}", policy),
        "router": router_json,
        "speed": o.speed,
        "block_bytes": block_bytes,
        "blocks": total_blocks,
        "ideal_hit_ratio": refs.ratio(ideal_hits),
        "lru_hit_ratio": refs.ratio(lru_hits),
        "out": {"csv": csv, "plots": plots, "plot_error": plot_error},
        "baseline": baseline.map(|(_, j)| j),
    });
    if let (Some(m), serde_json::Value::Object(r)) = (summary.as_object_mut(), result_json(&run, &refs)) {
        m.extend(r);
    }
    Ok(summary)
}

/// The trace-wide references a result is read against.
struct Refs {
    requests: usize,
    blocks: u64,
    ideal_hits: u64,
    lru_hits: u64,
    block_bytes: u64,
}

impl Refs {
    fn ratio(&self, h: u64) -> f64 {
        if self.blocks == 0 { 0.0 } else { h as f64 / self.blocks as f64 }
    }
}

/// One open-loop pass of the trace against one kind of backend.
struct Driven {
    sh: Arc<Shared>,
    delay: Histogram<u64>,
    late: u64,
    elapsed: f64,
}

/// Replays `requests` open-loop against `backends` (request i goes to
/// `backends[plan.daemon % len]`, or where `router` picks).
#[allow(clippy::too_many_arguments)]
fn drive(
    rt: &tokio::runtime::Runtime,
    requests: &[Request],
    plans: &[Arc<Plan>],
    o: &ReplayOpts,
    backends: &[Backend],
    block_bytes: u64,
    label: &str,
    router: Option<&Arc<super::router::Router>>,
) -> Driven {
    let t0 = Instant::now() + Duration::from_millis(50);
    let sh = Arc::new(Shared {
        hists: Mutex::new(OPS.iter().map(|_| hist()).collect()),
        seconds: Mutex::new(Vec::new()),
        errors: Mutex::new(Default::default()),
        first_refusal: Mutex::new(None),
        totals: Totals::default(),
        t0,
    });
    let mut delay = hist();
    let mut late = 0u64;
    let tty = std::io::stderr().is_terminal() && !o.json;
    let bar = if tty {
        let b = indicatif::ProgressBar::new(requests.len() as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        Some(b)
    } else {
        None
    };
    rt.block_on(async {
        let sem = Arc::new(tokio::sync::Semaphore::new(o.max_inflight));
        let mut tasks = tokio::task::JoinSet::new();
        let mut last_report = Instant::now();
        for (i, (r, plan)) in requests.iter().zip(plans).enumerate() {
            let due = t0 + Duration::from_secs_f64(r.timestamp as f64 / o.speed / 1e3);
            tokio::time::sleep_until(due.into()).await;
            sh.second(due, |s| s.offered += 1);
            let permit = Arc::clone(&sem).acquire_owned().await.expect("semaphore open");
            let start = Instant::now();
            let d = start.saturating_duration_since(due);
            delay.saturating_record(d.as_micros() as u64);
            let is_late = d > Duration::from_millis(o.late_ms);
            if is_late {
                late += 1;
            }
            sh.second(start, |s| {
                s.started += 1;
                s.late += is_late as u64;
            });
            let daemon = match router {
                Some(r) => r.pick(&plan.keys) % backends.len(),
                None => plan.daemon % backends.len(),
            };
            let router = router.cloned();
            if let Some(r) = &router {
                r.begin(daemon);
            }
            let (sh2, backend, plan) = (Arc::clone(&sh), backends[daemon].clone(), Arc::clone(plan));
            let (pf, bt) = (o.prefill_us_per_token, o.block_tokens);
            tasks.spawn(async move {
                one_request(sh2, backend, plan, block_bytes as usize, pf, bt, due).await;
                if let Some(r) = router {
                    r.end(daemon);
                }
                drop(permit);
            });
            while tasks.try_join_next().is_some() {}
            if let Some(b) = &bar {
                b.set_position(i as u64 + 1);
                b.set_message(format!("{label}: late {late}"));
            } else if last_report.elapsed() >= Duration::from_secs(5) {
                last_report = Instant::now();
                eprintln!(
                    "replay ({label}): {:>6.1} s  started {}  finished {}  late {late}",
                    t0.elapsed().as_secs_f64(),
                    i + 1,
                    sh.totals.finished.load(Ordering::Relaxed)
                );
            }
        }
        while tasks.join_next().await.is_some() {}
    });
    if let Some(b) = bar {
        b.finish();
    }
    Driven { sh, delay, late, elapsed: t0.elapsed().as_secs_f64() }
}

/// The result fields of one pass (for the summary and the baseline).
fn result_json(d: &Driven, refs: &Refs) -> serde_json::Value {
    let t = &d.sh.totals;
    let local_hits = t.local_hits.load(Ordering::Relaxed);
    let remote_hits = t.remote_hits.load(Ordering::Relaxed);
    let hits = local_hits + remote_hits;
    let ideal = refs.ideal_hits;
    serde_json::json!({
        "elapsed_s": d.elapsed,
        "hit_ratio": refs.ratio(hits),
        "hit_ratio_of_ideal": if ideal == 0 { 0.0 } else { hits as f64 / ideal as f64 },
        "local_hits": local_hits,
        "remote_hits": remote_hits,
        "missed_blocks": t.missed.load(Ordering::Relaxed),
        "above_ideal": t.above_ideal.load(Ordering::Relaxed),
        "wrong_bytes": t.wrong_bytes.load(Ordering::Relaxed),
        "bytes_read": hits * refs.block_bytes,
        "bytes_written": t.put_stored.load(Ordering::Relaxed) * refs.block_bytes,
        "put_existed": t.put_existed.load(Ordering::Relaxed),
        "put_failed": t.put_failed.load(Ordering::Relaxed),
        "first_put_refusal": d.sh.first_refusal.lock().clone(),
        "late": d.late,
        "late_ratio": if refs.requests == 0 { 0.0 } else { d.late as f64 / refs.requests as f64 },
        "start_delay_us": {"p50": d.delay.value_at_quantile(0.5), "p99": d.delay.value_at_quantile(0.99), "max": d.delay.max()},
        "errors": d.sh.errors.lock().clone(),
        "ops": ops_json(&d.sh.hists.lock()),
    })
}

fn print_result(label: &str, d: &Driven, refs: &Refs) {
    let t = &d.sh.totals;
    let (l, r) = (t.local_hits.load(Ordering::Relaxed), t.remote_hits.load(Ordering::Relaxed));
    eprintln!(
        "{label}: {} requests in {:.1} s, hit ratio {:.3} (ideal {:.3}, LRU {:.3}), local {l} remote {r}, late {}, wrong bytes {}",
        refs.requests,
        d.elapsed,
        refs.ratio(l + r),
        refs.ratio(refs.ideal_hits),
        refs.ratio(refs.lru_hits),
        d.late,
        t.wrong_bytes.load(Ordering::Relaxed)
    );
    for (name, h) in OPS.iter().zip(d.sh.hists.lock().iter()) {
        eprintln!(
            "  {name:>9}: p50 {} us  p90 {}  p99 {}  p99.9 {}  max {}  ({} samples)",
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.9),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max(),
            h.len()
        );
    }
}

/// `redis-server` on a free loopback port, killed on drop.
struct RedisServer {
    child: std::process::Child,
    port: u16,
}

impl RedisServer {
    fn start(maxmemory: u64) -> anyhow::Result<RedisServer> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = std::process::Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", "", "--appendonly", "no"])
            .args(["--maxmemory", &maxmemory.to_string(), "--maxmemory-policy", "allkeys-lru"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("start redis-server (Debian package redis-server; or --baseline none)")?;
        let server = RedisServer { child, port };
        let t0 = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if t0.elapsed() > Duration::from_secs(10) {
                bail!("redis-server did not come up on port {port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write_plots(
    out: &Path,
    hists: &[Histogram<u64>],
    baseline: Option<&[Histogram<u64>]>,
    seconds: &[Second],
) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    // Latency CDFs (the baseline's beside kvmesh's).
    let series: Vec<Series> = OPS
        .iter()
        .zip(hists)
        .filter(|(_, h)| !h.is_empty())
        .map(|(name, h)| Series { label: format!("kvmesh {name}"), points: plot::cdf_from_histogram(h) })
        .collect();
    // With a baseline: one chart per operation, kvmesh against it.
    if let Some(b) = baseline {
        for ((name, k), r) in OPS.iter().zip(hists).zip(b) {
            let title = format!("Latency CDF of {name}: kvmesh and Redis, same trace");
            files.extend(plot::line_chart(
                &out.join(format!("cdf_{name}")),
                &Chart {
                    title: &title,
                    x_label: "latency (µs, log scale)",
                    y_label: "requests at or below (%)",
                    x_scale: Scale::Log,
                    y_range: Some((0.0, 100.0)),
                    series: &[
                        Series { label: format!("kvmesh {name}"), points: plot::cdf_from_histogram(k) },
                        Series { label: format!("redis {name}"), points: plot::cdf_from_histogram(r) },
                    ],
                },
            )?);
        }
    }
    files.extend(plot::line_chart(
        &out.join("latency_cdf"),
        &Chart {
            title: "Latency CDF per operation",
            x_label: "latency (µs, log scale)",
            y_label: "requests at or below (%)",
            x_scale: Scale::Log,
            y_range: Some((0.0, 100.0)),
            series: &series,
        },
    )?);
    // Hit ratio over time (cumulative), against the references.
    let (mut b, mut h, mut i, mut l) = (0u64, 0u64, 0u64, 0u64);
    let (mut kv, mut id, mut lr) = (Vec::new(), Vec::new(), Vec::new());
    for (s, sec) in seconds.iter().enumerate() {
        b += sec.blocks;
        h += sec.local_hits + sec.remote_hits;
        i += sec.ideal_hits;
        l += sec.lru_hits;
        if b > 0 {
            let x = s as f64 + 1.0;
            kv.push((x, 100.0 * h as f64 / b as f64));
            id.push((x, 100.0 * i as f64 / b as f64));
            lr.push((x, 100.0 * l as f64 / b as f64));
        }
    }
    files.extend(plot::line_chart(
        &out.join("hit_ratio"),
        &Chart {
            title: "Block hit ratio over time (cumulative)",
            x_label: "time since start (s)",
            y_label: "hit ratio (% of blocks)",
            x_scale: Scale::Linear,
            y_range: Some((0.0, 100.0)),
            series: &[
                Series { label: "kvmesh".into(), points: kv },
                Series { label: "ideal (infinite cache)".into(), points: id },
                Series { label: "LRU (cluster capacity)".into(), points: lr },
            ],
        },
    )?);
    // Throughput and P99 against offered load: seconds grouped into bins of
    // offered load (a staircase's stairs), completions averaged and the
    // request histograms of a bin merged.
    let max_offered = seconds.iter().map(|s| s.offered).max().unwrap_or(0);
    let bin = (max_offered / 20).max(1);
    type Bin = (u64, u64, Histogram<u64>, Histogram<u64>);
    let mut bins: std::collections::BTreeMap<u64, Bin> = Default::default();
    for sec in seconds.iter().filter(|s| s.offered > 0) {
        let e = bins.entry((sec.offered + bin / 2) / bin).or_insert_with(|| (0, 0, hist(), hist()));
        e.0 += 1;
        e.1 += sec.finished;
        if let Some(h) = &sec.request_us {
            let _ = e.2.add(h);
        }
        if let Some(h) = &sec.e2e_us {
            let _ = e.3.add(h);
        }
    }
    let mut thr = Vec::new();
    let mut ideal_line = Vec::new();
    let mut p99 = Vec::new();
    let mut p99_e2e = Vec::new();
    for (&b, (n, finished, h, e2e)) in &bins {
        let x = (b * bin) as f64;
        thr.push((x, *finished as f64 / *n as f64));
        ideal_line.push((x, x));
        if !h.is_empty() {
            p99.push((x, h.value_at_quantile(0.99) as f64 / 1e3));
        }
        if !e2e.is_empty() {
            p99_e2e.push((x, e2e.value_at_quantile(0.99) as f64 / 1e3));
        }
    }
    files.extend(plot::line_chart(
        &out.join("throughput"),
        &Chart {
            title: "Completed requests against offered load",
            x_label: "offered load (requests/s)",
            y_label: "completed (requests/s)",
            x_scale: Scale::Linear,
            y_range: None,
            series: &[
                Series { label: "completed (mean of the seconds at that load)".into(), points: thr },
                Series { label: "offered (y = x)".into(), points: ideal_line },
            ],
        },
    )?);
    files.extend(plot::line_chart(
        &out.join("p99_vs_load"),
        &Chart {
            title: "Request P99 latency against offered load",
            x_label: "offered load (requests/s)",
            y_label: "request P99 (ms)",
            x_scale: Scale::Linear,
            y_range: None,
            series: &[
                Series { label: "from arrival (queueing included)".into(), points: p99_e2e },
                Series { label: "from start".into(), points: p99 },
            ],
        },
    )?);
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block of the wrong length is wrong by every byte missing or extra,
    /// not only by the bytes it has.
    #[test]
    fn a_short_or_long_block_counts_its_missing_or_extra_bytes() {
        let key = key_of(7);
        let mut good = vec![0u8; 4096];
        crate::fill_block(key, &mut good);
        let mut scratch = Vec::new();
        assert_eq!(wrong_bytes(key, &good, 4096, &mut scratch), 0);
        assert_eq!(wrong_bytes(key, &good[..100], 4096, &mut scratch), 3996);
        assert_eq!(wrong_bytes(key, &[], 4096, &mut scratch), 4096);
        let mut long = good.clone();
        long.extend_from_slice(&[1, 2, 3]);
        assert_eq!(wrong_bytes(key, &long, 4096, &mut scratch), 3);
        good[5] ^= 1;
        assert_eq!(wrong_bytes(key, &good, 4096, &mut scratch), 1);
    }
}
