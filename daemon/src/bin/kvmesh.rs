//! `kvmesh`: admin and debug CLI for a running kvmeshd.
//!
//! Exit codes: 0 success, 1 error (one line on stderr), 2 usage error,
//! 3 miss (`get` of a key that is not cached).
#![forbid(unsafe_code)]
#![recursion_limit = "256"]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvmesh_client::{Client, ClientError, Key};

/// Admin CLI for kvmeshd.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// Daemon socket (default: the daemon's default path).
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print daemon statistics.
    Stats {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Pools: slots by state and occupancy.
    Pools {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Registered namespaces with the blocks this daemon holds of each.
    Namespaces {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Keys of a namespace cached on this daemon.
    Keys {
        /// Namespace.
        #[arg(long)]
        namespace: String,
        /// At most this many keys.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Print JSON instead of one key per line.
        #[arg(long)]
        json: bool,
    },
    /// KV events of a namespace on this daemon, as they happen (stored,
    /// removed, evicted, invalidated): one line each, or JSON lines. Ctrl-C
    /// stops it.
    Events {
        /// Namespace.
        #[arg(long)]
        namespace: String,
        /// First list the blocks held now (snapshot events).
        #[arg(long)]
        snapshot: bool,
        /// Stop after this many events (0: never).
        #[arg(long, default_value_t = 0)]
        count: u64,
        /// One JSON object per event.
        #[arg(long)]
        json: bool,
    },
    /// A live view, refreshed every interval: operations per second, hit
    /// ratio, pool occupancy, and P99s of pin, commit and fetched gets over
    /// the interval (read from the daemon's /metrics; "-" when it is off or
    /// nothing was observed). Ctrl-C stops it.
    Top {
        /// Seconds between refreshes.
        #[arg(long, default_value_t = 1.0)]
        interval_s: f64,
        /// Stop after this many refreshes (0: until interrupted).
        #[arg(long, default_value_t = 0)]
        count: u32,
        /// One JSON object per refresh instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Peer daemons: handshake, coherence stream, last heartbeat answer,
    /// frames dropped, membership in the current view.
    Peers {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The running configuration (TOML; reloaded fields as reloaded).
    Config {
        /// Print JSON ({"source":..,"toml":..}) instead of the TOML.
        #[arg(long)]
        json: bool,
    },
    /// Drain the daemon: refuse new pins and allocations, let those given
    /// end (up to the deadline), leave the cluster, exit. Waits until the
    /// daemon has exited unless --no-wait.
    Drain {
        /// How long pins may take to end, ms (0: the daemon's
        /// server.drain_timeout_ms).
        #[arg(long, default_value_t = 0)]
        deadline_ms: u64,
        /// Return once the drain started.
        #[arg(long)]
        no_wait: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Store one block from a file (exactly one block long).
    Put {
        /// Write a new version even if the key is cached (mutable keys).
        #[arg(long)]
        overwrite: bool,
        /// Namespace (registered with --block-size if it does not exist).
        #[arg(long)]
        namespace: String,
        /// Block size in bytes.
        #[arg(long)]
        block_size: u64,
        /// Key: 32 hex digits.
        key: String,
        /// File holding the block.
        file: PathBuf,
    },
    /// Write one cached block to a file (exit 3 on a miss).
    Get {
        /// Namespace.
        #[arg(long)]
        namespace: String,
        /// Key: 32 hex digits.
        key: String,
        /// Output file.
        outfile: PathBuf,
    },
    /// Where blocks are cached: on a clustered daemon, cluster-wide (each
    /// key's home is asked; nothing is pinned or moved): the prefix of the
    /// keys that are all present, and for each key the node holding it.
    Lookup {
        /// Namespace.
        #[arg(long)]
        namespace: String,
        /// This daemon's own copies only (no question to the cluster).
        #[arg(long)]
        local: bool,
        /// Print JSON ({"prefix_len":..,"blocks":[{"key":..,"node":..}]}).
        #[arg(long)]
        json: bool,
        /// Keys, in prefix order (32 hex digits each).
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Make sure no daemon of the cluster serves the current version of
    /// these keys, or of every key of the namespace when none are given.
    /// Returns when none does (exit 1 if some could not be invalidated).
    Invalidate {
        /// Namespace.
        #[arg(long)]
        namespace: String,
        /// Keys (32 hex digits each); none: the whole namespace.
        keys: Vec<String>,
    },
    /// Make a cluster CA (or reuse the one in --dir) and a certificate and
    /// key per node for `[peer.tls]`: ca.pem, ca.key, node-<id>.pem,
    /// node-<id>.key (keys mode 0600). No daemon needed.
    Certs {
        /// Directory to write to (created if missing).
        #[arg(long)]
        dir: std::path::PathBuf,
        /// Node ids, comma-separated (e.g. 1,2,3).
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<u32>,
        /// Validity in days.
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
}

enum Failure {
    Error(String),
    Miss(String),
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        Failure::Error(e.to_string())
    }
}

fn parse_key(s: &str) -> Result<Key, Failure> {
    s.parse::<Key>().map_err(|e| Failure::Error(e.to_string()))
}

async fn connect(socket: Option<PathBuf>) -> Result<Client, Failure> {
    let path = socket.unwrap_or_else(kvmesh_client::default_socket_path);
    Ok(Client::connect(&path).await?)
}

async fn run(args: Args) -> Result<(), Failure> {
    match args.cmd {
        Cmd::Stats { json } => {
            let client = connect(args.socket).await?;
            let s = client.stats().await?;
            if json {
                println!("{}", kvmesh_client::stats_json(&s));
            } else {
                print_stats(&s);
            }
        }
        Cmd::Pools { json } => {
            let client = connect(args.socket).await?;
            let s = client.stats().await?;
            if json {
                let v: Vec<serde_json::Value> = s.pools.iter().map(kvmesh_client::pool_json).collect();
                println!("{}", serde_json::Value::Array(v));
            } else {
                println!(
                    "{:<12} {:<8} {:>10} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>6}",
                    "POOL",
                    "DEVICE",
                    "BYTES",
                    "SLOT",
                    "SLOTS",
                    "FREE",
                    "VALID",
                    "PENDING",
                    "PINNED",
                    "ZOMBIE",
                    "QUARANT",
                    "FENCED",
                    "USED"
                );
                for p in &s.pools {
                    let used = if p.slots == 0 { 0.0 } else { 100.0 * (p.slots - p.free) as f64 / p.slots as f64 };
                    println!(
                        "{:<12} {:<8} {:>10} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>5.1}%",
                        p.name,
                        p.device,
                        p.bytes,
                        p.slot_payload_bytes,
                        p.slots,
                        p.free,
                        p.valid,
                        p.pending,
                        p.pinned,
                        p.zombie,
                        p.quarantined,
                        p.fenced,
                        used
                    );
                }
            }
        }
        Cmd::Namespaces { json } => {
            let client = connect(args.socket).await?;
            let list = client.list_namespaces().await?;
            if json {
                let v: Vec<serde_json::Value> = list
                    .iter()
                    .map(|(n, blocks)| {
                        serde_json::json!({"id": n.id, "name": n.name, "block_bytes": n.block_bytes,
                            "layout": n.layout, "pool": n.pool, "fingerprint": format!("{:016x}", n.fingerprint),
                            "blocks": blocks})
                    })
                    .collect();
                println!("{}", serde_json::Value::Array(v));
            } else {
                println!("{:>4} {:<32} {:>10} {:>10} {:>5}  LAYOUT", "ID", "NAME", "BLOCK", "BLOCKS", "POOL");
                for (n, blocks) in &list {
                    println!(
                        "{:>4} {:<32} {:>10} {:>10} {:>5}  {}",
                        n.id, n.name, n.block_bytes, blocks, n.pool, n.layout
                    );
                }
            }
        }
        Cmd::Keys { namespace, limit, json } => {
            let client = connect(args.socket).await?;
            let ns = client.namespace(&namespace).await?;
            let (keys, total) = client.list_keys(&ns, limit).await?;
            if json {
                let ks: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
                println!("{}", serde_json::json!({"namespace": namespace, "total": total, "keys": ks}));
            } else {
                for k in &keys {
                    println!("{k}");
                }
                if (keys.len() as u64) < total {
                    eprintln!("({} of {total} keys; --limit raises it)", keys.len());
                }
            }
        }
        Cmd::Events { namespace, snapshot, count, json } => {
            let client = connect(args.socket).await?;
            let ns = client.namespace(&namespace).await?;
            let mut stream = client.watch_events(&ns, snapshot).await?;
            let mut seen = 0u64;
            while let Some(batch) = stream.message().await.map_err(|e| Failure::Error(e.message().to_string()))? {
                for e in &batch.events {
                    let kind = kvmesh_client::event_kind_name(e.kind);
                    let key = e.key.map(|k| kvmesh_client::Key::from_parts(k.hi, k.lo).to_string()).unwrap_or_default();
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({"node": batch.node_id, "namespace": namespace, "kind": kind,
                                "seq": e.seq, "key": key, "version": e.version})
                        );
                    } else {
                        println!("{:>10} {kind:<11} {key} v{}", e.seq, e.version);
                    }
                    seen += 1;
                    if count > 0 && seen >= count {
                        return Ok(());
                    }
                }
            }
            return Err(Failure::Error("the event stream ended".into()));
        }
        Cmd::Top { interval_s, count, json } => {
            if !(0.05..=86_400.0).contains(&interval_s) {
                return Err(Failure::Error(format!(
                    "--interval-s must be from 0.05 to 86400 seconds, got {interval_s}"
                )));
            }
            let client = connect(args.socket).await?;
            // Latency percentiles come from the daemon's /metrics histograms
            // (the address from its running config; none when it is off).
            let metrics = metrics_addr(&client).await;
            let mut prev = client.stats().await?;
            let mut prev_text = match metrics {
                Some(a) => scrape(a).await,
                None => None,
            };
            let mut t_prev = std::time::Instant::now();
            let mut n = 0u32;
            loop {
                tokio::time::sleep(std::time::Duration::from_secs_f64(interval_s)).await;
                let s = client.stats().await?;
                let text = match metrics {
                    Some(a) => scrape(a).await,
                    None => None,
                };
                let dt = t_prev.elapsed().as_secs_f64();
                t_prev = std::time::Instant::now();
                let p99 = |metric: &str, sel: &str| match (&prev_text, &text) {
                    (Some(a), Some(b)) => p99_between(a, b, metric, sel),
                    _ => None,
                };
                let lat = Latencies {
                    pin: p99("kvmesh_engine_call_seconds_bucket", "method=\"pin\""),
                    commit: p99("kvmesh_engine_call_seconds_bucket", "method=\"commit\""),
                    fetched: p99("kvmesh_get_seconds_bucket", "result=\"fetched\""),
                };
                print_top(&prev, &s, dt, json, n == 0, &lat);
                prev = s;
                prev_text = text;
                n += 1;
                if count > 0 && n >= count {
                    break;
                }
            }
        }
        Cmd::Peers { json } => {
            let client = connect(args.socket).await?;
            let s = client.stats().await?;
            let epoch = s.coherence.as_ref().map(|c| c.epoch);
            if json {
                let peers: Vec<_> = s
                    .peers
                    .iter()
                    .map(|p| {
                        serde_json::json!({
                            "id": p.id, "addr": p.addr, "handshake": p.handshake, "incarnation": p.incarnation,
                            "stream_up": p.stream_up,
                            "last_pong_ms_ago": (p.last_pong_ms_ago > 0).then_some(p.last_pong_ms_ago),
                            "queue_drops": p.queue_drops, "in_view": p.in_view,
                            "view_incarnation": p.in_view.then_some(p.view_incarnation), "transports": p.transports,
                        })
                    })
                    .collect();
                println!("{}", serde_json::json!({"epoch": epoch, "peers": peers}));
            } else if s.peers.is_empty() {
                println!("no peers configured (a single-node daemon)");
            } else {
                println!(
                    "{:>4} {:<22} {:<9} {:>20} {:<7} {:>10} {:>7} {:<8} TRANSPORTS",
                    "ID", "ADDR", "HANDSHAKE", "INCARNATION", "STREAM", "LAST-PONG", "DROPS", "IN-VIEW"
                );
                for p in &s.peers {
                    let pong = if p.last_pong_ms_ago == 0 {
                        "never".to_string()
                    } else {
                        format!("{} ms", p.last_pong_ms_ago)
                    };
                    println!(
                        "{:>4} {:<22} {:<9} {:>20} {:<7} {:>10} {:>7} {:<8} {}",
                        p.id,
                        p.addr,
                        if p.handshake { "yes" } else { "no" },
                        if p.handshake { p.incarnation.to_string() } else { "-".into() },
                        if p.stream_up { "up" } else { "down" },
                        pong,
                        p.queue_drops,
                        if p.in_view { "yes" } else { "no" },
                        p.transports
                    );
                }
                if let Some(e) = epoch {
                    println!("view epoch {e}");
                }
            }
        }
        Cmd::Certs { dir, nodes, days } => {
            let written = kvmeshd::tls::make_certs(&dir, &nodes, days).map_err(Failure::Error)?;
            for p in written {
                println!("{}", p.display());
            }
        }
        Cmd::Config { json } => {
            let client = connect(args.socket).await?;
            let (toml, source) = client.config().await?;
            if json {
                println!("{}", serde_json::json!({"source": source, "toml": toml}));
            } else {
                println!("# running configuration of kvmeshd (from {source})");
                print!("{toml}");
            }
        }
        Cmd::Drain { deadline_ms, no_wait, json } => {
            let path = args.socket.clone().unwrap_or_else(kvmesh_client::default_socket_path);
            let client = connect(args.socket).await?;
            let r = client.drain(deadline_ms).await?;
            drop(client);
            let t0 = std::time::Instant::now();
            let mut exited = None;
            if !no_wait {
                // The daemon is gone when its socket refuses connections
                // and it let go of the socket's lock file — the last thing
                // it does (a refused connection alone comes while it still
                // stops its servers and peers, up to seconds, holding the
                // socket path and its ports).
                let limit = std::time::Duration::from_millis(r.deadline_ms) + std::time::Duration::from_secs(15);
                let lock = std::path::PathBuf::from(format!("{}.lock", path.display()));
                while t0.elapsed() < limit {
                    if tokio::net::UnixStream::connect(&path).await.is_err() && lock_released(&lock) {
                        exited = Some(t0.elapsed());
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "already_draining": r.already_draining, "pins_outstanding": r.pins_outstanding,
                        "allocations_outstanding": r.allocations_outstanding, "deadline_ms": r.deadline_ms,
                        "waited": !no_wait, "exited": exited.is_some(),
                        "exited_after_ms": exited.map(|d| d.as_millis() as u64),
                    })
                );
            } else {
                println!(
                    "{}: {} pins and {} allocations outstanding, deadline {} ms",
                    if r.already_draining { "already draining" } else { "draining" },
                    r.pins_outstanding,
                    r.allocations_outstanding,
                    r.deadline_ms
                );
                if let Some(d) = exited {
                    println!("daemon exited after {:.1} s", d.as_secs_f64());
                }
            }
            if !no_wait && exited.is_none() {
                return Err(Failure::Error(format!(
                    "the daemon still runs {:.0} s after the drain began",
                    t0.elapsed().as_secs_f64()
                )));
            }
        }
        Cmd::Put { overwrite, namespace, block_size, key, file } => {
            let key = parse_key(&key)?;
            if block_size == 0 {
                return Err(Failure::Error("--block-size must be greater than 0".into()));
            }
            let meta =
                std::fs::metadata(&file).map_err(|e| Failure::Error(format!("cannot read {}: {e}", file.display())))?;
            if meta.len() != block_size {
                return Err(Failure::Error(format!(
                    "{} is {} bytes, expected exactly one block of {block_size}",
                    file.display(),
                    meta.len()
                )));
            }
            let data =
                std::fs::read(&file).map_err(|e| Failure::Error(format!("cannot read {}: {e}", file.display())))?;
            let client = connect(args.socket).await?;
            let ns = match client.namespace(&namespace).await {
                Ok(ns) if ns.block_bytes != block_size => {
                    return Err(Failure::Error(format!(
                        "block size {block_size} does not match namespace {namespace} ({})",
                        ns.block_bytes
                    )));
                }
                Ok(ns) => ns,
                Err(e) if e.code() == tonic::Code::NotFound => {
                    client.register_namespace(&namespace, block_size, "").await?
                }
                Err(e) => return Err(e.into()),
            };
            let s = if overwrite {
                client.put_overwrite(&ns, &[(key, &data)]).await?
            } else {
                client.put(&ns, &[(key, &data)]).await?
            };
            if s.stored == 1 {
                println!("stored {key} ({block_size} bytes) in {namespace}");
            } else if s.existed == 1 {
                println!("{key} is already cached in {namespace}");
            } else if s.in_progress == 1 {
                return Err(Failure::Error(format!("another put of {key} is in progress")));
            } else if s.refused == 1 {
                return Err(Failure::Error(format!(
                    "the cluster refused the put of {key} (another write or invalidation of it in progress, \
                     or this daemon is not a serving member); retry"
                )));
            } else {
                return Err(Failure::Error(format!("put of {key} was lost (allocation expired)")));
            }
        }
        Cmd::Get { namespace, key, outfile } => {
            let key = parse_key(&key)?;
            let client = connect(args.socket).await?;
            let ns = client.namespace(&namespace).await?;
            let mut buf = vec![0u8; ns.block_bytes as usize];
            let hit = client.get_into(&ns, &[key], &mut buf).await?;
            if !hit[0] {
                return Err(Failure::Miss(format!("{key} is not cached in {namespace}")));
            }
            std::fs::write(&outfile, &buf)
                .map_err(|e| Failure::Error(format!("cannot write {}: {e}", outfile.display())))?;
            println!("wrote {key} ({} bytes) to {}", buf.len(), outfile.display());
        }
        Cmd::Lookup { namespace, local, json, keys } => {
            let keys = keys.iter().map(|k| parse_key(k)).collect::<Result<Vec<_>, _>>()?;
            let client = connect(args.socket).await?;
            let ns = client.namespace(&namespace).await?;
            let r = if local { client.lookup_local(&ns, &keys).await? } else { client.lookup(&ns, &keys).await? };
            if json {
                let blocks: Vec<_> = keys
                    .iter()
                    .zip(&r.nodes)
                    .map(|(k, n)| serde_json::json!({"key": k.to_string(), "node": n}))
                    .collect();
                let v = serde_json::json!({
                    "prefix_len": r.prefix_len,
                    "cluster_wide": r.cluster_wide,
                    "complete": r.complete,
                    "blocks": blocks,
                });
                println!("{v}");
            } else {
                let scope = match (r.cluster_wide, r.complete) {
                    (false, _) => "this daemon only",
                    (true, true) => "cluster-wide",
                    (true, false) => "cluster-wide, INCOMPLETE: some homes did not answer",
                };
                println!("prefix {} of {} keys ({scope})", r.prefix_len, keys.len());
                for (k, (&p, n)) in keys.iter().zip(r.present.iter().zip(&r.nodes)) {
                    match (p, n) {
                        (true, Some(n)) => println!("{k}  node {n}"),
                        (true, None) => println!("{k}  present"),
                        _ => println!("{k}  -"),
                    }
                }
            }
        }
        Cmd::Invalidate { namespace, keys } => {
            let keys = keys.iter().map(|k| parse_key(k)).collect::<Result<Vec<_>, _>>()?;
            let client = connect(args.socket).await?;
            let ns = client.namespace(&namespace).await?;
            let s = if keys.is_empty() {
                client.invalidate_namespace(&ns).await?
            } else {
                client.invalidate(&ns, &keys).await?
            };
            if s.failed > 0 {
                return Err(Failure::Error(format!(
                    "{} keys of {namespace} invalidated, {} NOT (they may still be served): {}",
                    s.invalidated, s.failed, s.first_error
                )));
            }
            println!("invalidated {} keys of {namespace}: no daemon serves their old versions", s.invalidated);
        }
    }
    Ok(())
}

/// P99s of one `top` interval (upper bucket bounds, seconds); None when
/// nothing was observed or the metrics endpoint is off.
struct Latencies {
    pin: Option<f64>,
    commit: Option<f64>,
    fetched: Option<f64>,
}

/// The metrics address from the daemon's running config (`metrics.listen`;
/// an unspecified IP is reached on loopback).
async fn metrics_addr(client: &Client) -> Option<std::net::SocketAddr> {
    let (text, _) = client.config().await.ok()?;
    let table: toml::Table = text.parse().ok()?;
    let listen = table.get("metrics")?.get("listen")?.as_str()?;
    let mut addr: std::net::SocketAddr = listen.parse().ok()?;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    Some(addr)
}

/// GET /metrics (HTTP/1.1, the body only); None on any failure.
async fn scrape(addr: std::net::SocketAddr) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8(buf).ok()?;
        let (head, body) = text.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.1 200").then(|| body.to_string())
    };
    tokio::time::timeout(std::time::Duration::from_secs(2), io).await.ok().flatten()
}

/// Cumulative bucket counts of `metric` summed over the series whose labels
/// contain `selector`: (upper bound, count), in increasing bounds.
fn buckets(text: &str, metric: &str, selector: &str) -> Vec<(f64, u64)> {
    let mut out: std::collections::BTreeMap<u64, (f64, u64)> = Default::default();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(metric) else { continue };
        let Some((labels, value)) = rest.strip_prefix('{').and_then(|r| r.split_once("} ")) else { continue };
        if !labels.contains(selector) {
            continue;
        }
        let Some(le) = labels.split(',').find_map(|l| l.strip_prefix("le=\"")).and_then(|l| l.strip_suffix('"')) else {
            continue;
        };
        let bound = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
        let (Ok(v), false) = (value.trim().parse::<f64>(), bound.is_nan()) else { continue };
        let e = out.entry(bound.to_bits()).or_insert((bound, 0));
        e.1 += v as u64;
    }
    let mut v: Vec<(f64, u64)> = out.into_values().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// The P99 of what was observed between two scrapes: the upper bound of
/// the first bucket holding 99% of the new observations.
fn p99_between(before: &str, after: &str, metric: &str, selector: &str) -> Option<f64> {
    let a = buckets(before, metric, selector);
    let b = buckets(after, metric, selector);
    let delta: Vec<(f64, u64)> =
        b.iter().map(|&(le, n)| (le, n.saturating_sub(a.iter().find(|x| x.0 == le).map_or(0, |x| x.1)))).collect();
    let total = delta.last()?.1;
    if total == 0 {
        return None;
    }
    let target = (total as f64 * 0.99).ceil() as u64;
    delta.iter().find(|x| x.1 >= target).map(|x| x.0)
}

/// One refresh of `kvmesh top`: rates from two snapshots `dt` seconds apart.
fn print_top(a: &kvmesh_client::Stats, b: &kvmesh_client::Stats, dt: f64, json: bool, header: bool, lat: &Latencies) {
    let rate = |x: u64, y: u64| y.saturating_sub(x) as f64 / dt;
    let (hits, misses) = (b.hits.saturating_sub(a.hits), b.misses.saturating_sub(a.misses));
    let hit_ratio = if hits + misses == 0 { 0.0 } else { hits as f64 / (hits + misses) as f64 };
    let (slots, free, pinned): (u64, u64, u64) =
        b.pools.iter().fold((0, 0, 0), |(s, f, p), x| (s + x.slots as u64, f + x.free as u64, p + x.pinned as u64));
    let used = if slots == 0 { 0.0 } else { 100.0 * (slots - free) as f64 / slots as f64 };
    let v = serde_json::json!({
        "lookups_per_s": rate(a.lookups, b.lookups), "pins_per_s": rate(a.pins, b.pins),
        "commits_per_s": rate(a.commits, b.commits), "evictions_per_s": rate(a.evictions, b.evictions),
        "remote_fetched_per_s": rate(a.remote_fetched, b.remote_fetched), "hit_ratio": hit_ratio,
        "pins_outstanding": b.pins_outstanding, "sessions": b.sessions, "pool_used_pct": used,
        "pinned_slots": pinned, "resource_exhausted_per_s": rate(a.resource_exhausted, b.resource_exhausted),
        "pin_p99_s": lat.pin, "commit_p99_s": lat.commit, "fetched_get_p99_s": lat.fetched,
    });
    if json {
        println!("{v}");
        return;
    }
    if header {
        println!(
            "{:>9} {:>9} {:>9} {:>6} {:>9} {:>9} {:>7} {:>8} {:>7} {:>8} {:>9} {:>9} {:>9}",
            "LOOKUP/s",
            "PIN/s",
            "COMMIT/s",
            "HIT%",
            "EVICT/s",
            "REMOTE/s",
            "PINNED",
            "SESSIONS",
            "USED%",
            "REFUSED/s",
            "PIN-P99",
            "COMMIT-P99",
            "FETCH-P99"
        );
    }
    let ms = |v: Option<f64>| match v {
        Some(s) if s.is_finite() => format!("<={:.2}ms", s * 1e3),
        Some(_) => ">max".to_string(),
        None => "-".to_string(),
    };
    println!(
        "{:>9.0} {:>9.0} {:>9.0} {:>5.1}% {:>9.0} {:>9.0} {:>7} {:>8} {:>6.1}% {:>8.0} {:>9} {:>9} {:>9}",
        rate(a.lookups, b.lookups),
        rate(a.pins, b.pins),
        rate(a.commits, b.commits),
        100.0 * hit_ratio,
        rate(a.evictions, b.evictions),
        rate(a.remote_fetched, b.remote_fetched),
        b.pins_outstanding,
        b.sessions,
        used,
        rate(a.resource_exhausted, b.resource_exhausted),
        ms(lat.pin),
        ms(lat.commit),
        ms(lat.fetched)
    );
}

fn print_stats(s: &kvmesh_client::Stats) {
    for p in &s.pools {
        println!(
            "pool {} ({}): {} slots of {} B, {} free, {} valid, {} pending, {} pinned, {} zombie, {} quarantined, {} fenced{}",
            p.name,
            p.device,
            p.slots,
            p.slot_payload_bytes,
            p.free,
            p.valid,
            p.pending,
            p.pinned,
            p.zombie,
            p.quarantined,
            p.fenced,
            if p.mlocked { ", mlocked" } else { "" }
        );
    }
    println!(
        "namespaces {}  sessions {}  uptime {} s{}",
        s.namespaces,
        s.sessions,
        s.uptime_ms / 1000,
        if s.draining { "  DRAINING (new pins and allocations refused)" } else { "" }
    );
    println!("pins outstanding {}  allocations outstanding {}", s.pins_outstanding, s.allocations_outstanding);
    println!(
        "lookups {}  hits {}  misses {}  pins {}  commits {}  aborts {}",
        s.lookups, s.hits, s.misses, s.pins, s.commits, s.aborts
    );
    println!(
        "evictions {}  removes {}  lease expirations {}  session releases {}  resource exhausted {}",
        s.evictions, s.removes, s.lease_expirations, s.session_releases, s.resource_exhausted
    );
    println!(
        "peers connected {}  remote fetched {}  remote misses {}  validation failures {}  transfer failures {}  \
         timeouts {}  quarantined slots {}  fenced slots {} ({} forced)  grants given {}",
        s.peers_connected,
        s.remote_fetched,
        s.remote_misses,
        s.remote_validation_failures,
        s.transfer_failures,
        s.transfer_timeouts,
        s.slots_quarantined,
        s.slots_fenced,
        s.fences_forced,
        s.grants_given
    );
    if let Some(c) = &s.coherence {
        let batching = if c.batches_sent == 0 { 0.0 } else { c.msgs_sent as f64 / c.batches_sent as f64 };
        println!(
            "coherence: {} epoch {} members {}  batches {} (x{batching:.1} entries)  invalidates {}  acks {} in {} \
             batches  inval->ack p50 <= {} us p99 <= {} us  stale-epoch drops {}  validation failures {}  grants \
             outstanding {}  queue drops {}",
            if c.serving { "serving" } else { "NOT serving" },
            c.epoch,
            c.members,
            c.batches_sent,
            c.invalidates_sent,
            c.acks_sent,
            c.ack_batches_sent,
            c.inval_to_ack_p50_us,
            c.inval_to_ack_p99_us,
            c.stale_epoch_drops,
            c.validation_failures,
            c.grants_outstanding,
            c.peer_queue_drops
        );
        if c.peer_refusals + c.peer_auth_refusals + c.versions_exhausted > 0 {
            println!(
                "peer refusals: {} impossible values, {} calls from an unauthenticated or unknown node, {} changes \
                 without a version",
                c.peer_refusals, c.peer_auth_refusals, c.versions_exhausted
            );
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvmesh: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Miss(m)) => {
            eprintln!("kvmesh: miss: {m}");
            ExitCode::from(3)
        }
        Err(Failure::Error(m)) => {
            eprintln!("kvmesh: {m}");
            ExitCode::FAILURE
        }
    }
}

/// Whether no process holds the daemon's socket lock `path` (or it is
/// gone). Taken and let go at once when free.
fn lock_released(path: &std::path::Path) -> bool {
    match std::fs::File::open(path) {
        Ok(f) => f.try_lock_shared().is_ok(),
        Err(_) => true,
    }
}
