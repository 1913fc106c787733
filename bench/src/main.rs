//! kvmesh benchmarks. Every figure is reported next to a baseline measured
//! in the same run on the same machine (see docs/BENCHMARKS.md).
//!
//! `kvmesh-bench local [--json]` starts a kvmeshd (a child process running
//! this binary's hidden `daemon` subcommand) with one pool per block size,
//! each larger than the L3 cache, and measures pin + in-place read, copy-get
//! into a caller buffer, and put through the mapping, against a cold
//! single-thread `memcpy` of the same bytes in the same order.
#![forbid(unsafe_code)]

mod bindings;
mod breakdown;
mod coherence;
mod events;
mod lookup;
mod peers;
mod placement;
mod replay;
mod scale;
mod transfer;

use std::hint::black_box;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use hdrhistogram::Histogram;
use kvmesh_client::{Allocation, Client, Key, Namespace};

#[derive(Parser)]
#[command(about = "kvmesh benchmarks")]
struct Args {
    /// How the daemons the bench starts carry coherence batches between
    /// them (`peer.control`): `auto` (UCX active messages on sm, the peer
    /// streams on tcp), `ucx`, or `grpc`, to compare them.
    #[arg(long, global = true, default_value = "auto", value_parser = ["auto", "ucx", "grpc"])]
    peer_control: String,
    /// `coherence.register_at_locate` of the daemons `transfer`,
    /// `breakdown` and `peers` start (false: a fetched copy is served only
    /// once the home answered its registration, one round trip later), to
    /// compare them.
    #[arg(long, global = true, default_value_t = true, action = clap::ArgAction::Set)]
    register_at_locate: bool,
    /// `peer.poll_idle_us` of the daemons the bench starts (how long a
    /// data-plane thread with reads in flight polls after its last
    /// progress; unset: the daemon's default), to compare values.
    #[arg(long, global = true)]
    poll_idle_us: Option<u64>,
    /// `peer.push_with_grants` of the daemons the bench starts (tcp: the
    /// getter posts its receive with the locate and the holder sends the
    /// slot with its grant; unset: the daemon's default, on), to compare.
    #[arg(long, global = true, action = clap::ArgAction::Set)]
    push_with_grants: Option<bool>,
    #[command(subcommand)]
    cmd: Cmd,
}

/// `--peer-control`, for the configs of the daemons the bench starts.
static PEER_CONTROL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// `--register-at-locate`.
static REGISTER_AT_LOCATE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// `--poll-idle-us`.
static POLL_IDLE_US: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// `--push-with-grants`.
static PUSH_WITH_GRANTS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// `extra` (the tail of a daemon config) with `coherence.register_at_locate`
/// as `--register-at-locate` asks.
pub(crate) fn with_register_at_locate(extra: &str) -> String {
    const TABLE: &str = "[coherence]\n";
    let line = format!("register_at_locate = {}\n", REGISTER_AT_LOCATE.get().copied().unwrap_or(true));
    match extra.find(TABLE).map(|i| i + TABLE.len()) {
        Some(at) => format!("{}{line}{}", &extra[..at], &extra[at..]),
        None => format!("{extra}\n{TABLE}{line}"),
    }
}

/// The `[peer]` lines that set `peer.control` as `--peer-control` asks
/// (and `peer.poll_idle_us`, `peer.push_with_grants` when given).
pub(crate) fn peer_control_line() -> String {
    let mut s = format!("control = \"{}\"\n", PEER_CONTROL.get().map_or("auto", |s| s.as_str()));
    if let Some(us) = POLL_IDLE_US.get() {
        s.push_str(&format!("poll_idle_us = {us}\n"));
    }
    if let Some(on) = PUSH_WITH_GRANTS.get() {
        s.push_str(&format!("push_with_grants = {on}\n"));
    }
    s
}

/// Arrival process of `load`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum ArrivalKind {
    /// Poisson arrivals at --rate.
    Poisson,
    /// Gamma-distributed gaps (--burst-shape, --burst-scale-ms).
    Bursts,
    /// A staircase of Poisson rates (--stairs, --stair-secs).
    Stairs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Local pool access through the client library vs a cold memcpy.
    Local {
        /// Print only the final JSON line on stdout (tables go to stderr).
        #[arg(long)]
        json: bool,
        /// Size of each pool (one per block size), in MiB. At least 256.
        #[arg(long, default_value_t = 512)]
        pool_mib: u64,
        /// Block sizes in KiB.
        #[arg(long, value_delimiter = ',', default_value = "64,256,1024,4096")]
        block_kib: Vec<u64>,
        /// Blocks per batch.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Bytes to move per measurement, in MiB (several passes over the pool).
        #[arg(long, default_value_t = 2048)]
        bytes_mib: u64,
        /// Fewest pin batches per repetition of the pin + read measurement
        /// (the P99 needs samples).
        #[arg(long, default_value_t = 200)]
        pin_batches_min: usize,
    },
    /// KV events under a paced put load: put rate with and without a
    /// watcher (interleaved rounds), delay from put to event, gaps.
    Events {
        /// Blocks put per second.
        #[arg(long, default_value_t = 50_000)]
        rate: u64,
        /// Seconds per round.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Blocks per put call.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Rounds (each: one with a watcher, one without).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Daemons (more than 1: a cluster over shared memory, the load
        /// shared evenly, one watcher per daemon).
        #[arg(long, default_value_t = 1)]
        daemons: u32,
    },
    /// Cluster-wide lookup of a batch of keys spread over a filled cluster
    /// vs a local-only lookup of the same keys (interleaved): P50/P99 and
    /// their ratios; every answer checked, nothing fetched.
    Lookup {
        /// Print only the final JSON line on stdout.
        #[arg(long)]
        json: bool,
        /// Daemons in the cluster.
        #[arg(long, default_value_t = 4)]
        daemons: u32,
        /// Blocks each daemon holds (4 KiB each) before measuring.
        #[arg(long, default_value_t = 100_000)]
        fill: usize,
        /// Keys per lookup.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Timed lookups of each kind, over all rounds.
        #[arg(long, default_value_t = 3000)]
        samples: usize,
        /// Rounds (reported one by one).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// `coherence.lookup_tables` of the daemons (false: every lookup
        /// asks the homes, as before the tables), to compare them.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        lookup_tables: bool,
    },
    /// Latency of single engine calls (lookup, pin, unpin) by batch size.
    Rpc {
        /// Calls per measurement.
        #[arg(long, default_value_t = 2000)]
        calls: usize,
    },
    /// Remote gets between two daemons (sm and tcp) vs a raw UCX loop and a
    /// cold memcpy.
    Transfer {
        /// Print only the final JSON line on stdout.
        #[arg(long)]
        json: bool,
        /// Pool size per block size, MiB (at least 256).
        #[arg(long, default_value_t = 320)]
        pool_mib: u64,
        /// Block sizes in KiB.
        #[arg(long, value_delimiter = ',', default_value = "64,256,1024,4096")]
        block_kib: Vec<u64>,
        /// Transports to measure.
        #[arg(long, value_delimiter = ',', default_value = "sm,tcp")]
        transports: Vec<String>,
        /// Bytes per measurement, MiB.
        #[arg(long, default_value_t = 256)]
        bytes_mib: u64,
        /// Skip ucx_perftest.
        #[arg(long)]
        no_perftest: bool,
        /// `SERVER:CLIENT` CPU lists (taskset syntax): the raw loop's
        /// target and the holding daemon on SERVER; this process (the raw
        /// loop's reader, the engine) and the getter daemon on CLIENT, as
        /// on two nodes (see `peers --split-cpus`).
        #[arg(long)]
        split_cpus: Option<String>,
        /// How long the raw loop's two sides poll UCX after it last made
        /// progress before they sleep on the worker's event fd. The default
        /// (a second) never sleeps mid-transfer: the strongest loop, as
        /// before this option; 100 is the daemon's `peer.poll_idle_us`
        /// default, for the same policy on both sides.
        #[arg(long, default_value_t = 1_000_000)]
        raw_poll_idle_us: u64,
    },
    /// Remote gets side by side, interleaved rounds in one run: kvmesh over
    /// tcp and shared memory, Redis (GET/MGET), Mooncake Store over TCP
    /// (installed into a virtualenv by bench/mooncake/setup.sh when missing).
    Peers {
        /// Print only the final JSON line on stdout.
        #[arg(long)]
        json: bool,
        /// Systems to measure.
        #[arg(long, value_delimiter = ',', default_value = "kvmesh-tcp,kvmesh-sm,redis,mooncake-tcp")]
        systems: Vec<String>,
        /// Block sizes in KiB.
        #[arg(long, value_delimiter = ',', default_value = "256,1024")]
        block_kib: Vec<u64>,
        /// Blocks per call (1: GET / get_into / a pin of one key).
        #[arg(long, value_delimiter = ',', default_value = "1,32")]
        batches: Vec<usize>,
        /// Timed calls per system and row, over all rounds.
        #[arg(long, default_value_t = 1000)]
        samples: usize,
        /// Interleaved rounds.
        #[arg(long, default_value_t = 4)]
        rounds: usize,
        /// `SERVER:CLIENT` CPU lists (taskset syntax, e.g. `1:0`): every
        /// system's serving side (the holding daemon, redis-server,
        /// Mooncake's master and holding client) runs on SERVER, its
        /// reading side (this process, which is the engine, the redis
        /// client and the one timing; the getter daemon; Mooncake's reader)
        /// on CLIENT, as on two nodes. Unset: the scheduler places them.
        #[arg(long)]
        split_cpus: Option<String>,
    },
    /// Where the time of a remote get goes, hop by hop: the getter daemon's
    /// stage histograms (/metrics) beside the engine's Pin call.
    Breakdown {
        /// Print only the final JSON line on stdout.
        #[arg(long)]
        json: bool,
        /// Transports to measure.
        #[arg(long, value_delimiter = ',', default_value = "tcp,sm")]
        transports: Vec<String>,
        /// Block sizes in KiB.
        #[arg(long, value_delimiter = ',', default_value = "256,1024")]
        block_kib: Vec<u64>,
        /// Pin calls of one block (batches: a quarter as many, at least 100).
        #[arg(long, default_value_t = 1000)]
        calls: usize,
        /// Keys per batch in the batched rows.
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// The engine's pins through the blocking client (the C ABI's and
        /// Python's path), on a thread of its own, instead of the async one.
        #[arg(long)]
        blocking_client: bool,
    },
    /// Daemons all holding the same keys; one call invalidates them all:
    /// ack batching, invalidate -> ack latency, wrong reads (baseline: the
    /// same run with batching off).
    Coherence {
        /// Print only the final JSON line on stdout.
        #[arg(long)]
        json: bool,
        /// Daemons in the cluster.
        #[arg(long, default_value_t = 4)]
        daemons: u32,
        /// Keys held on every daemon and invalidated.
        #[arg(long, default_value_t = 10_000)]
        keys: usize,
        /// Keys of the invalidation in flight at a time (the daemons'
        /// `coherence.invalidate_window`).
        #[arg(long, default_value_t = 512)]
        invalidate_window: usize,
        /// Skip the unbatched baseline cluster.
        #[arg(long)]
        no_baseline: bool,
    },
    /// Two daemons filled level by level to N cached blocks each: pin
    /// (local and remote), put and invalidation latency, idle CPU and
    /// memory per block at every level (the smallest level is the
    /// baseline).
    Scale {
        /// Print only the final JSON line on stdout.
        #[arg(long)]
        json: bool,
        /// Cached blocks per daemon at each level (increasing).
        #[arg(long, value_delimiter = ',', default_value = "10000,100000,1000000")]
        blocks: Vec<usize>,
        /// Samples per latency measurement.
        #[arg(long, default_value_t = 1000)]
        samples: usize,
        /// Seconds of idle CPU measurement per level.
        #[arg(long, default_value_t = 10)]
        idle_s: u64,
        /// Block size, KiB (1 fits 4 million blocks per daemon in ~10 GiB).
        #[arg(long, default_value_t = 4)]
        block_kib: usize,
    },
    /// The C ABI and the Python package vs the Rust client in the same run:
    /// copy-get and pin + read of 64 blocks, one-key lookup latency. Needs
    /// `cargo build --release -p kvmesh-capi` and the Python package
    /// installed (`PROFILE=release scripts/python-test.sh --install-only`).
    Bindings {
        /// Print only the final JSON line on stdout.
        #[arg(long)]
        json: bool,
        /// Block sizes in KiB.
        #[arg(long, value_delimiter = ',', default_value = "256,1024")]
        block_kib: Vec<u64>,
        /// Iterations per round and language.
        #[arg(long, default_value_t = 50)]
        iters: usize,
        /// Interleaved rounds (the result is their median).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Python interpreter with `kvmesh` installed ("none": skip Python);
        /// default target/pyvenv/bin/python.
        #[arg(long)]
        python: Option<PathBuf>,
        /// Skip the C side.
        #[arg(long)]
        no_c: bool,
    },
    /// Replays a request trace (Mooncake FAST'25 JSONL) open-loop against
    /// a real cluster, with offline references, CSV and plots
    /// (docs/REPLAY.md).
    Replay {
        /// The trace file (one JSON object per line).
        trace: PathBuf,
        /// Skip malformed lines (counted and reported) instead of failing.
        #[arg(long)]
        skip_bad_lines: bool,
        #[command(flatten)]
        opts: replay::run::ReplayOpts,
    },
    /// Generates a seeded synthetic trace (written with --write, replayed
    /// with --replay, or both).
    Load {
        /// Seed: the same seed gives the same trace.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Arrival process.
        #[arg(long, value_enum, default_value = "poisson")]
        arrival: ArrivalKind,
        /// Poisson rate, requests/s.
        #[arg(long, default_value_t = 20.0)]
        rate: f64,
        /// Bursts: shape of the Gamma-distributed gaps.
        #[arg(long, default_value_t = 2.0)]
        burst_shape: f64,
        /// Bursts: scale of the gaps, ms.
        #[arg(long, default_value_t = 100.0)]
        burst_scale_ms: f64,
        /// Staircase rates, requests/s ("50,100,200,400/s").
        #[arg(long, value_delimiter = ',', default_value = "50,100,200,400")]
        stairs: Vec<String>,
        /// Seconds per stair.
        #[arg(long, default_value_t = 30.0)]
        stair_secs: f64,
        /// Stop after this many requests.
        #[arg(long)]
        requests: Option<usize>,
        /// Seconds of arrivals (poisson, bursts).
        #[arg(long, default_value_t = 60.0)]
        duration_s: f64,
        /// Zipf exponent of the new prompt tokens per request.
        #[arg(long, default_value_t = 1.2)]
        zipf_alpha: f64,
        /// Fewest new prompt tokens per request.
        #[arg(long, default_value_t = 10)]
        min_tokens: u64,
        /// Most new prompt tokens per request.
        #[arg(long, default_value_t = 4096)]
        max_tokens: u64,
        /// Shared system prompts (0: none).
        #[arg(long, default_value_t = 8)]
        system_prompts: usize,
        /// Tokens of each system prompt.
        #[arg(long, default_value_t = 1024)]
        system_prompt_tokens: u64,
        /// Probability that a request is the next turn of an open session.
        #[arg(long, default_value_t = 0.5)]
        followup_prob: f64,
        /// Most turns of a session.
        #[arg(long, default_value_t = 8)]
        max_turns: u32,
        /// Fewest output tokens.
        #[arg(long, default_value_t = 16)]
        output_min: u64,
        /// Most output tokens.
        #[arg(long, default_value_t = 512)]
        output_max: u64,
        /// Write the trace to this file.
        #[arg(long)]
        write: Option<PathBuf>,
        /// Replay it against a cluster.
        #[arg(long)]
        replay: bool,
        #[command(flatten)]
        opts: replay::run::ReplayOpts,
    },
    /// The Rust side of `bindings` (one process per round).
    #[command(hide = true)]
    BindingsRustSide { socket: PathBuf, namespace: String, iters: usize },
    /// A raw UCX target for the transfer baseline (prints its address, then
    /// progresses until stdin closes).
    #[command(hide = true)]
    UcxTarget {
        #[arg(long)]
        transport: String,
        #[arg(long)]
        bytes: u64,
        #[arg(long)]
        poll_idle_us: u64,
    },
    /// Runs a daemon in this process (used by `local`).
    #[command(hide = true)]
    Daemon {
        #[arg(long)]
        config: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _ = PEER_CONTROL.set(args.peer_control.clone());
    let _ = REGISTER_AT_LOCATE.set(args.register_at_locate);
    if let Some(us) = args.poll_idle_us {
        let _ = POLL_IDLE_US.set(us);
    }
    if let Some(on) = args.push_with_grants {
        let _ = PUSH_WITH_GRANTS.set(on);
    }
    // As the daemon does, before any thread starts, where tcp may be used:
    // the raw UCX loops and the daemons (children inherit it) run with the
    // same UCX settings.
    let tcp = match &args.cmd {
        Cmd::Transfer { transports, .. } | Cmd::Breakdown { transports, .. } => transports.iter().any(|t| t != "sm"),
        Cmd::Peers { systems, .. } => systems.iter().any(|s| s == "kvmesh-tcp"),
        Cmd::Daemon { config } => std::fs::read_to_string(config)
            .ok()
            .and_then(|t| kvmeshd::Config::parse(&t, "").ok())
            .is_some_and(|c| c.peer.transports != "sm"),
        _ => false,
    };
    // tcp alone (the eager threshold too) unless some daemon or loop here
    // may use RDMA.
    let tcp_only = match &args.cmd {
        Cmd::Transfer { transports, .. } | Cmd::Breakdown { transports, .. } => !transports.iter().any(|t| t == "all"),
        Cmd::Daemon { config } => std::fs::read_to_string(config)
            .ok()
            .and_then(|t| kvmeshd::Config::parse(&t, "").ok())
            .is_some_and(|c| c.peer.transports == "tcp"),
        _ => true,
    };
    if tcp && let Err(e) = kvmesh_ucx::tune_environment(tcp_only) {
        eprintln!("kvmesh-bench: {e}");
    }
    match args.cmd {
        Cmd::Daemon { config } => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_env("KVMESH_LOG")
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
                )
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .init();
            let text = std::fs::read_to_string(&config)?;
            let cfg = kvmeshd::Config::parse(&text, &config.display().to_string()).map_err(anyhow::Error::msg)?;
            let rt = if std::env::var("KVMESH_BENCH_DAEMON_CT").is_ok() {
                tokio::runtime::Builder::new_current_thread().enable_all().build()?
            } else {
                tokio::runtime::Builder::new_multi_thread().enable_all().build()?
            };
            rt.block_on(kvmeshd::server::run(cfg, std::future::pending(), true))
        }
        Cmd::Transfer {
            json,
            pool_mib,
            block_kib,
            transports,
            bytes_mib,
            no_perftest,
            split_cpus,
            raw_poll_idle_us,
        } => {
            let split = split_cpus.as_deref().map(placement::Split::parse).transpose()?;
            let raw_poll_idle = Duration::from_micros(raw_poll_idle_us);
            let opts = transfer::Placed { split: split.as_ref(), raw_poll_idle };
            transfer::run(json, pool_mib, &block_kib, &transports, bytes_mib, !no_perftest, opts)
        }
        Cmd::Peers { json, systems, block_kib, batches, samples, rounds, split_cpus } => {
            let split = split_cpus.as_deref().map(placement::Split::parse).transpose()?;
            peers::run(peers::Opts { json, systems, block_kib, batches, samples, rounds, split })
        }
        Cmd::Breakdown { json, transports, block_kib, calls, batch, blocking_client } => {
            breakdown::run(json, &transports, &block_kib, calls, batch, blocking_client)
        }
        Cmd::Coherence { json, daemons, keys, invalidate_window, no_baseline } => {
            coherence::run(json, daemons, keys, invalidate_window, !no_baseline)
        }
        Cmd::Bindings { json, block_kib, iters, rounds, python, no_c } => {
            bindings::run(json, &block_kib, iters, rounds, python, !no_c)
        }
        Cmd::Replay { trace, skip_bad_lines, opts } => {
            let t = replay::trace::read(&trace, opts.block_tokens, skip_bad_lines)?;
            if t.skipped > 0 {
                eprintln!("replay: skipped {} bad lines; first: {}", t.skipped, t.first_skip.unwrap_or_default());
            }
            let summary = replay::run::run(t.requests, &opts, t.skipped)?;
            println!("{summary}");
            Ok(())
        }
        Cmd::Load {
            seed,
            arrival,
            rate,
            burst_shape,
            burst_scale_ms,
            stairs,
            stair_secs,
            requests,
            duration_s,
            zipf_alpha,
            min_tokens,
            max_tokens,
            system_prompts,
            system_prompt_tokens,
            followup_prob,
            max_turns,
            output_min,
            output_max,
            write,
            replay,
            opts,
        } => {
            use replay::synth::{Arrival, SynthConfig};
            let arrival = match arrival {
                ArrivalKind::Poisson => Arrival::Poisson { rate },
                ArrivalKind::Bursts => Arrival::Bursts { shape: burst_shape, scale_ms: burst_scale_ms },
                ArrivalKind::Stairs => Arrival::Stairs {
                    rates: stairs
                        .iter()
                        .map(|s| {
                            s.trim()
                                .trim_end_matches("/s")
                                .parse::<f64>()
                                .map_err(|e| anyhow::anyhow!("--stairs {s:?}: {e}"))
                        })
                        .collect::<anyhow::Result<_>>()?,
                    stair_secs,
                },
            };
            let cfg = SynthConfig {
                seed,
                arrival,
                requests,
                duration_s,
                block_tokens: opts.block_tokens,
                zipf_alpha,
                min_tokens,
                max_tokens,
                system_prompts,
                system_prompt_tokens,
                followup_prob,
                max_turns,
                output_min,
                output_max,
            };
            let trace = replay::synth::generate(&cfg)?;
            if let Some(path) = &write {
                replay::trace::write(path, &trace)?;
                eprintln!("load: wrote {} requests to {}", trace.len(), path.display());
            }
            if replay {
                let summary = replay::run::run(trace, &opts, 0)?;
                println!("{summary}");
            } else if write.is_none() {
                anyhow::bail!("nothing to do: give --write PATH, --replay, or both");
            }
            Ok(())
        }
        Cmd::BindingsRustSide { socket, namespace, iters } => bindings::rust_side(&socket, &namespace, iters),
        Cmd::Scale { json, blocks, samples, idle_s, block_kib } => {
            scale::run(json, &blocks, samples, idle_s, block_kib)
        }
        Cmd::UcxTarget { transport, bytes, poll_idle_us } => {
            transfer::ucx_target(&transport, bytes, Duration::from_micros(poll_idle_us))
        }
        Cmd::Rpc { calls } => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(rpc(calls))
        }
        Cmd::Lookup { json, daemons, fill, batch, samples, rounds, lookup_tables } => {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            rt.block_on(lookup::lookup(json, daemons, fill, batch, samples, rounds, lookup_tables))
        }
        Cmd::Events { rate, seconds, batch, rounds, daemons } => {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            rt.block_on(events::events(rate, seconds, batch, rounds, daemons))
        }
        Cmd::Local { json, pool_mib, block_kib, batch, bytes_mib, pin_batches_min } => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(local(json, pool_mib, &block_kib, batch, bytes_mib, pin_batches_min))
        }
    }
}

pub(crate) struct DaemonProc {
    child: Child,
    dir: PathBuf,
}

impl DaemonProc {
    /// Process id of the daemon.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for DaemonProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start_daemon(pools: &str) -> anyhow::Result<(DaemonProc, PathBuf)> {
    start_daemon_tagged("local", pools)
}

/// Starts a daemon (this binary's `daemon` subcommand) with `extra` config.
pub(crate) fn start_daemon_tagged(tag: &str, extra: &str) -> anyhow::Result<(DaemonProc, PathBuf)> {
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-{}-{tag}", std::process::id()));
    let pools = extra;
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("kvmeshd.sock");
    let metrics = if pools.contains("[metrics]") { "" } else { "[metrics]\nlisten = \"\"\n" };
    // `KVMESH_BENCH_FAST_PATH_POLL_US`: the daemon's `server.fast_path_poll_us`
    // (for comparisons; its default otherwise).
    let poll = match std::env::var("KVMESH_BENCH_FAST_PATH_POLL_US") {
        Ok(us) => {
            format!("fast_path_poll_us = {}\n", us.trim().parse::<u64>().context("KVMESH_BENCH_FAST_PATH_POLL_US")?)
        }
        Err(_) => String::new(),
    };
    let cfg = format!(
        "[server]\nsocket = {:?}\n{poll}{metrics}[limits]\nbatch_keys_max = 4096\n[eviction]\nhigh_watermark = 1.0\nlow_watermark = 1.0\n{pools}",
        socket.display().to_string()
    );
    let cfg_path = dir.join("kvmeshd.toml");
    std::fs::write(&cfg_path, cfg)?;
    let mut cmd = Command::new(std::env::current_exe()?);
    if !extra.contains("transports = \"tcp\"") && !extra.contains("transports = \"all\"") {
        // No tcp here: without UCX's tcp settings (it warns of unused ones).
        for (k, _) in kvmesh_ucx::TUNED_ENV {
            cmd.env_remove(k);
        }
    }
    if !extra.contains("transports = \"tcp\"") {
        cmd.env_remove(kvmesh_ucx::TCP_EAGER_ENV.0);
    }
    let child = cmd
        .args(["daemon", "--config"])
        .arg(&cfg_path)
        .env("KVMESH_LOG", std::env::var("KVMESH_BENCH_DAEMON_LOG").unwrap_or_else(|_| "warn".into()))
        .stdout(Stdio::null())
        .spawn()
        .context("start daemon")?;
    let d = DaemonProc { child, dir };
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("daemon did not start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((d, socket))
}

/// Starts `nodes` daemons forming one cluster: static membership, peers on
/// loopback, UCX over shared memory; `node_extra` (pools, coherence
/// settings) goes into every node's config. Daemon `i` is tagged `tag-i`.
pub(crate) fn start_sm_cluster(tag: &str, nodes: u32, node_extra: &str) -> anyhow::Result<Vec<(DaemonProc, PathBuf)>> {
    let ports: Vec<u16> = (0..nodes)
        .map(|_| Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()))
        .collect::<anyhow::Result<_>>()?;
    let mut out = Vec::new();
    for id in 1..=nodes {
        let mut cfg = format!(
            "[node]\nid = {id}\n[peer]\nlisten = \"127.0.0.1:{}\"\ntransports = \"sm\"\ntls = {{ mode = \"off\" }}\n{}{node_extra}\n",
            ports[id as usize - 1],
            peer_control_line()
        );
        for (i, p) in ports.iter().enumerate() {
            if i as u32 + 1 != id {
                cfg.push_str(&format!("[[peers]]\nid = {}\naddr = \"127.0.0.1:{p}\"\n", i + 1));
            }
        }
        out.push(start_daemon_tagged(&format!("{tag}-{id}"), &cfg)?);
    }
    Ok(out)
}

/// A block's content: a deterministic function of its key (xorshift
/// seeded by it), so every byte read back can be checked.
pub(crate) fn fill_block(key: kvmesh_client::Key, out: &mut [u8]) {
    let mut x = key.lo() ^ key.hi() ^ 0x9e37_79b9_7f4a_7c15;
    for c in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
}

/// Touches every byte (8 at a time) so an in-place read really reads.
fn fold(bytes: &[u8]) -> u64 {
    let mut acc = 0u64;
    for c in bytes.chunks_exact(64) {
        let mut x = 0u64;
        for w in c.chunks_exact(8) {
            x ^= u64::from_le_bytes(w.try_into().expect("8 bytes"));
        }
        acc = acc.wrapping_add(x);
    }
    acc
}

struct Row {
    block_bytes: u64,
    blocks: usize,
    copy_gbps: f64,
    memcpy_gbps: f64,
    pin_read_gbps: f64,
    pin_p50_us: f64,
    pin_p99_us: f64,
    pin_max_us: f64,
    puts_per_s: f64,
    put_gbps: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

async fn bench_size(
    client: &Client,
    ns: &Namespace,
    blocks: usize,
    batch: usize,
    bytes_target: u64,
    pin_batches_min: usize,
) -> anyhow::Result<Row> {
    let bs = ns.block_bytes as usize;
    let keys: Vec<Key> = (0..blocks as u128).map(|i| Key((ns.block_bytes as u128) << 64 | i)).collect();

    // Source data for puts, and the memcpy baseline's source: memory of the
    // same kind as the pool (a memfd mapping: shmem, same page size), laid
    // out like the pool (same stride, payloads at the same offsets), every
    // page written first, so both copies see the same alignment, TLB and
    // cache behaviour.
    let stride = client.hello().pools[ns.pool as usize].slot_stride_bytes as usize;
    let base = client.hello().pools[ns.pool as usize].payload_offset_bytes as usize;
    let src_map =
        std::sync::Arc::new(kvmesh_ffi_os::SharedMapping::create("bench-src", (blocks * stride) as u64, false)?);
    {
        let mut all = src_map.write(0, src_map.len())?;
        for (i, chunk) in all.chunks_mut(4096).enumerate() {
            chunk.fill((i % 251) as u8);
        }
    }
    let src_region = src_map.read(0, src_map.len())?;
    let src_buf: &[u8] = &src_region;
    let src_at = |i: usize| base + i * stride;

    // (c) put through the mapping: allocate, write in place, commit.
    let t0 = Instant::now();
    for (bi, chunk) in keys.chunks(batch).enumerate() {
        let allocs = client.allocate(ns, chunk).await?;
        let mut writes = Vec::with_capacity(chunk.len());
        for (j, a) in allocs.into_iter().enumerate() {
            match a {
                Allocation::Allocated(mut w) => {
                    let i = bi * batch + j;
                    w.copy_from_slice(&src_buf[src_at(i)..src_at(i) + bs]);
                    writes.push(w);
                }
                other => bail!("fresh key not allocated: {other:?}"),
            }
        }
        client.commit(writes).await?;
    }
    let put_s = t0.elapsed().as_secs_f64();
    let puts_per_s = blocks as f64 / put_s;
    let put_gbps = (blocks * bs) as f64 / put_s / 1e9;

    let rounds = ((bytes_target / (batch * bs) as u64).max(4)) as usize;
    let batches: Vec<&[Key]> = keys.chunks(batch).filter(|c| c.len() == batch).collect();
    // Destination: one batch, page aligned (as engines' KV buffers are).
    let mut dst_buf = vec![1u8; batch * bs + 4096];
    let d0 = align_offset(&dst_buf, 4096);
    let dst = &mut dst_buf[d0..d0 + batch * bs];

    let (mut copy, mut memcpy, mut pin_read) = (Vec::new(), Vec::new(), Vec::new());
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for _rep in 0..3 {
        // Baseline: cold single-thread memcpy, same bytes, same order, same destination.
        let t = Instant::now();
        for r in 0..rounds {
            let b = r % batches.len();
            for j in 0..batch {
                let i = b * batch + j;
                dst[j * bs..(j + 1) * bs].copy_from_slice(&src_buf[src_at(i)..src_at(i) + bs]);
            }
            black_box(&dst);
        }
        memcpy.push((rounds * batch * bs) as f64 / t.elapsed().as_secs_f64() / 1e9);

        // (b) copy-get into the caller buffer.
        let t = Instant::now();
        for r in 0..rounds {
            let hits = client.get_into(ns, batches[r % batches.len()], dst).await?;
            if hits.iter().any(|h| !h) {
                bail!("copy-get missed a block that was put");
            }
            black_box(&dst);
        }
        copy.push((rounds * batch * bs) as f64 / t.elapsed().as_secs_f64() / 1e9);

        // (a) pin a batch, read it in place, unpin. At least `pin_batches_min` per
        // repetition so the P99 of the pin latency rests on enough samples.
        let rounds_a = rounds.max(pin_batches_min);
        let t = Instant::now();
        let mut acc = 0u64;
        for r in 0..rounds_a {
            let tp = Instant::now();
            let pinned = client.pin(ns, batches[r % batches.len()]).await?;
            hist.record(tp.elapsed().as_micros().max(1) as u64)?;
            let mut held = Vec::with_capacity(batch);
            for p in pinned {
                let p = p.context("pin missed a block that was put")?;
                acc = acc.wrapping_add(fold(&p));
                held.push(p);
            }
            client.unpin(held).await?;
        }
        black_box(acc);
        pin_read.push((rounds_a * batch * bs) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    // Content check: the bytes read back are the bytes put.
    let check = client.pin(ns, &keys[..batch.min(keys.len())]).await?;
    for (i, p) in check.iter().enumerate() {
        let p = p.as_ref().context("block vanished")?;
        if p[..] != src_buf[src_at(i)..src_at(i) + bs] {
            bail!("block {i} differs from what was put");
        }
        p.verify().map_err(|e| anyhow::anyhow!("block {i} does not verify: {e}"))?;
    }
    drop(check);
    Ok(Row {
        block_bytes: ns.block_bytes,
        blocks,
        copy_gbps: median(copy),
        memcpy_gbps: median(memcpy),
        pin_read_gbps: median(pin_read),
        pin_p50_us: hist.value_at_quantile(0.5) as f64,
        pin_p99_us: hist.value_at_quantile(0.99) as f64,
        pin_max_us: hist.max() as f64,
        puts_per_s,
        put_gbps,
    })
}

async fn local(
    json: bool,
    pool_mib: u64,
    block_kib: &[u64],
    batch: usize,
    bytes_mib: u64,
    pin_batches_min: usize,
) -> anyhow::Result<()> {
    if pool_mib < 256 {
        eprintln!("warning: pools under 256 MiB fit in caches on many machines; numbers will flatter");
    }
    let mut pools = String::new();
    for kib in block_kib {
        pools.push_str(&format!(
            "[[pools]]\nname = \"p{kib}k\"\nbytes = \"{pool_mib}MiB\"\nslot_payload_bytes = \"{kib}KiB\"\n"
        ));
    }
    let (_daemon, socket) = start_daemon(&pools)?;
    let client = Client::connect(&socket).await?;
    let mut rows = Vec::new();
    for (i, kib) in block_kib.iter().enumerate() {
        let bs = kib * 1024;
        let ns = client.register_namespace(&format!("bench-{kib}k"), bs, "bench").await?;
        let slots = client.hello().pools[i].slots as usize;
        if slots < batch {
            bail!("pool of {pool_mib} MiB holds {slots} blocks of {kib} KiB, fewer than one batch of {batch}");
        }
        let blocks = slots - slots % batch;
        let row = bench_size(&client, &ns, blocks, batch, bytes_mib << 20, pin_batches_min).await?;
        eprintln!(
            "{:>5} KiB x{:<5} copy {:6.2} GB/s  memcpy {:6.2} GB/s  ratio {:.2}  pin+read {:6.2} GB/s  \
             pin64 p50 {:>5} us p99 {:>5} us max {:>6} us  puts {:>8.0}/s ({:.2} GB/s)",
            kib,
            row.blocks,
            row.copy_gbps,
            row.memcpy_gbps,
            row.copy_gbps / row.memcpy_gbps,
            row.pin_read_gbps,
            row.pin_p50_us,
            row.pin_p99_us,
            row.pin_max_us,
            row.puts_per_s,
            row.put_gbps
        );
        rows.push(row);
    }
    let rows_json: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "block_bytes": r.block_bytes,
                "blocks": r.blocks,
                "copy_gbps": round(r.copy_gbps),
                "memcpy_gbps": round(r.memcpy_gbps),
                "copy_ratio": round(r.copy_gbps / r.memcpy_gbps),
                "pin_read_gbps": round(r.pin_read_gbps),
                "pin_batch_p50_us": r.pin_p50_us,
                "pin_batch_p99_us": r.pin_p99_us,
                "pin_batch_max_us": r.pin_max_us,
                "puts_per_s": r.puts_per_s.round(),
                "put_gbps": round(r.put_gbps),
            })
        })
        .collect();
    let out = serde_json::json!({ "bench": "local", "batch": batch, "pool_mib": pool_mib, "shmem_huge_pages": kvmesh_ffi_os::shm::shmem_huge_mode(), "rows": rows_json });
    if !json {
        println!("batch {batch}, pools of {pool_mib} MiB; copy_ratio = copy-get / cold memcpy of the same bytes");
    }
    println!("{out}");
    Ok(())
}

/// Offset of the first `align`-aligned byte of `buf`.
fn align_offset(buf: &[u8], align: usize) -> usize {
    buf.as_ptr().align_offset(align)
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The calls `rpc` times, in the order of its histograms.
const CALLS: [&str; 5] = ["lookup", "pin", "unpin", "allocate", "commit"];

/// `n` keys never used before, from the counter `next`.
fn fresh_keys(next: &mut u128, n: usize) -> Vec<Key> {
    let keys = (*next..*next + n as u128).map(Key).collect();
    *next += n as u128;
    keys
}

/// The writable blocks of an allocation of new keys (every key must get one).
fn allocated(a: Vec<kvmesh_client::Allocation>) -> anyhow::Result<Vec<kvmesh_client::WritableBlock>> {
    a.into_iter()
        .map(|x| match x {
            kvmesh_client::Allocation::Allocated(w) => Ok(w),
            other => Err(anyhow::anyhow!("allocation of a new key: {other:?}")),
        })
        .collect()
}

/// Fails unless every block of a commit was committed.
fn committed(c: &[kvmesh_client::CommitOutcome]) -> anyhow::Result<()> {
    match c.iter().find(|o| !matches!(o, kvmesh_client::CommitOutcome::Committed { .. })) {
        Some(o) => Err(anyhow::anyhow!("a commit did not commit: {o:?}")),
        None => Ok(()),
    }
}

async fn rpc(calls: usize) -> anyhow::Result<()> {
    let (_daemon, socket) =
        start_daemon("[[pools]]\nname = \"p\"\nbytes = \"64MiB\"\nslot_payload_bytes = \"16KiB\"\n")?;
    // The same calls over gRPC and over the fast path, interleaved in
    // rounds so both see the same moments of this machine.
    let grpc = Client::connect_with(&socket, false).await?;
    let fast = Client::connect_with(&socket, true).await?;
    if !fast.fast_path() {
        bail!("the daemon did not offer the fast path");
    }
    let ns = grpc.register_namespace("rpc", 16384, "").await?;
    let keys: Vec<Key> = (0..1024u128).map(Key).collect();
    let data = vec![5u8; 16384];
    for chunk in keys.chunks(256) {
        let items: Vec<(Key, &[u8])> = chunk.iter().map(|&k| (k, &data[..])).collect();
        grpc.put(&ns, &items).await?;
    }
    // The blocking client (what the C ABI and Python call through), on a
    // thread of its own outside this runtime, over the fast path.
    let blocking = {
        let socket = socket.clone();
        std::thread::spawn(move || kvmesh_client::blocking::Client::connect(Some(&socket)))
            .join()
            .map_err(|_| anyhow::anyhow!("the blocking client's thread panicked"))??
    };
    let rounds = 10;
    let mut rows = Vec::new();
    // New keys for the puts: one range per client, never reused.
    let mut fresh: u128 = 1 << 40;
    let mut fresh_blocking: u128 = 1 << 60;
    for n in [1usize, 64, 512] {
        // [path][lookup, pin, unpin, allocate, commit]: gRPC, fast path,
        // blocking client
        let mut h: Vec<Vec<Histogram<u64>>> = (0..3)
            .map(|_| (0..CALLS.len()).map(|_| Histogram::<u64>::new(3)).collect::<Result<_, _>>())
            .collect::<Result<_, _>>()?;
        for round in 0..rounds {
            for (path, client) in [&grpc, &fast].into_iter().enumerate() {
                for i in round * calls / rounds..(round + 1) * calls / rounds {
                    let ks = &keys[(i * n) % 512..(i * n) % 512 + n];
                    let t = Instant::now();
                    client.lookup(&ns, ks).await?;
                    h[path][0].record(t.elapsed().as_nanos() as u64)?;
                    let t = Instant::now();
                    let p = client.pin(&ns, ks).await?;
                    h[path][1].record(t.elapsed().as_nanos() as u64)?;
                    if p.iter().any(|b| b.is_none()) {
                        bail!("a local pin missed");
                    }
                    let t = Instant::now();
                    client.unpin(p.into_iter().flatten().collect()).await?;
                    h[path][2].record(t.elapsed().as_nanos() as u64)?;
                    // A put of n new keys: allocate, then commit (the
                    // daemon checksums the n blocks); the pool fills during
                    // the one-key rows, and from then on allocations evict.
                    let new = fresh_keys(&mut fresh, n);
                    let t = Instant::now();
                    let a = client.allocate(&ns, &new).await?;
                    h[path][3].record(t.elapsed().as_nanos() as u64)?;
                    let w = allocated(a)?;
                    let t = Instant::now();
                    let c = client.commit(w).await?;
                    h[path][4].record(t.elapsed().as_nanos() as u64)?;
                    committed(&c)?;
                }
            }
            let (b, ns, keys) = (blocking.clone(), ns.clone(), keys.clone());
            let (from, to) = (round * calls / rounds, (round + 1) * calls / rounds);
            let mut bfresh = fresh_blocking;
            fresh_blocking += (to - from) as u128 * n as u128;
            let hb = std::thread::spawn(move || -> anyhow::Result<Vec<Histogram<u64>>> {
                let mut hb: Vec<Histogram<u64>> =
                    (0..CALLS.len()).map(|_| Histogram::<u64>::new(3)).collect::<Result<_, _>>()?;
                for i in from..to {
                    let ks = &keys[(i * n) % 512..(i * n) % 512 + n];
                    let t = Instant::now();
                    b.call(b.inner().lookup(&ns, ks))?;
                    hb[0].record(t.elapsed().as_nanos() as u64)?;
                    let t = Instant::now();
                    let p = b.call(b.inner().pin(&ns, ks))?;
                    hb[1].record(t.elapsed().as_nanos() as u64)?;
                    if p.iter().any(|b| b.is_none()) {
                        bail!("a local pin missed");
                    }
                    let t = Instant::now();
                    b.call(b.inner().unpin(p.into_iter().flatten().collect()))?;
                    hb[2].record(t.elapsed().as_nanos() as u64)?;
                    let new = fresh_keys(&mut bfresh, n);
                    let t = Instant::now();
                    let a = b.call(b.inner().allocate(&ns, &new))?;
                    hb[3].record(t.elapsed().as_nanos() as u64)?;
                    let w = allocated(a)?;
                    let t = Instant::now();
                    let c = b.call(b.inner().commit(w))?;
                    hb[4].record(t.elapsed().as_nanos() as u64)?;
                    committed(&c)?;
                }
                Ok(hb)
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the blocking client's thread panicked"))??;
            for (m, x) in hb.iter().enumerate() {
                h[2][m].add(x)?;
            }
        }
        for (m, name) in CALLS.iter().enumerate() {
            let us = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1e3;
            let (g, f, bl) = (&h[0][m], &h[1][m], &h[2][m]);
            println!(
                "{name:>6} x{n:<4} grpc p50 {:>7.1} p99 {:>7.1} us | fast p50 {:>7.1} p99 {:>7.1} us | blocking p50 {:>7.1} p99 {:>7.1} us | p99 fast/grpc {:.2} | {} samples each",
                us(g, 0.5),
                us(g, 0.99),
                us(f, 0.5),
                us(f, 0.99),
                us(bl, 0.5),
                us(bl, 0.99),
                us(f, 0.99) / us(g, 0.99),
                f.len()
            );
            rows.push(serde_json::json!({
                "call": name, "keys": n, "samples": f.len(),
                "grpc_p50_us": us(g, 0.5), "grpc_p99_us": us(g, 0.99),
                "fast_p50_us": us(f, 0.5), "fast_p99_us": us(f, 0.99),
                "blocking_p50_us": us(bl, 0.5), "blocking_p99_us": us(bl, 0.99),
            }));
        }
    }
    // Its runtime may not be dropped inside this one.
    std::thread::spawn(move || drop(blocking)).join().map_err(|_| anyhow::anyhow!("dropping the blocking client"))?;
    println!("{}", serde_json::json!({"bench": "rpc", "rows": rows}));
    Ok(())
}
