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

fn print_stats(s: &kvmesh_client::Stats) {
    for p in &s.pools {
        println!(
            "pool {} ({}): {} slots of {} B, {} free, {} valid, {} pending, {} pinned, {} zombie{}",
            p.name,
            p.device,
            p.slots,
            p.slot_payload_bytes,
            p.free,
            p.valid,
            p.pending,
            p.pinned,
            p.zombie,
            if p.mlocked { ", mlocked" } else { "" }
        );
    }
    println!("namespaces {}  sessions {}  uptime {} s", s.namespaces, s.sessions, s.uptime_ms / 1000);
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
         timeouts {}  quarantined slots {}  grants given {}",
        s.peers_connected,
        s.remote_fetched,
        s.remote_misses,
        s.remote_validation_failures,
        s.transfer_failures,
        s.transfer_timeouts,
        s.slots_quarantined,
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
