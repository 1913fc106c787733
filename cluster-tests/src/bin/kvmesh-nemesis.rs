//! `kvmesh-nemesis`: real daemons under real faults, with a checker over
//! the whole history (issue 17).
//!
//! N `kvmeshd` (default 5), each in a network namespace of its own, and
//! etcd in another, joined by a bridge in a hub namespace (addresses
//! 10.213.0.0/24, only inside the namespaces this program creates and
//! removes). UCX over tcp between the daemons, etcd membership. Engines
//! (tasks of this process, on the daemons' Unix sockets): per daemon a
//! writer overwriting its share of mutable keys with content derived from
//! (key, sequence) and putting immutable prefix blocks when absent, readers
//! pinning random batches and checking every byte, and now and then an
//! invalidation of the whole namespace. Every operation is recorded with
//! its start and end ([`kvmesh_cluster_tests::history`]). A seeded
//! nemesis: one daemon cut off (its link down), a split (a minority or a
//! majority of the daemons, with or without etcd), a flapping link, a
//! daemon paused (SIGSTOP), killed (SIGKILL) and restarted, drained
//! (SIGTERM) and restarted, etcd paused, a daemon's pool filled past its
//! size (evictions). After the run, every daemon is healed and every key
//! read everywhere; then the checker judges the whole history: wrong
//! bytes, stale reads, lost acknowledged puts, availability per kind of
//! fault; the first offending operations are printed with the nemesis
//! events around them. Last line: JSON. Exit 0 clean, 1 violations, 77
//! cannot run here (not root, no `ip` or `etcd`).
//!
//!     kvmesh-nemesis --kvmeshd target/release/kvmeshd --minutes 10 --seed 1
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use kvmesh_client::{Allocation, Client, CommitOutcome, Key, Namespace};
use kvmesh_cluster_tests::blocks::{BLOCK, check, content};
use kvmesh_cluster_tests::history::{self, Answer, Fault, History, Invalidation, Outcome, Put, Read, Us};
use kvmesh_cluster_tests::sim::Rng;
use parking_lot::Mutex;

const SUBNET: &str = "10.213.0";
/// Blocks a pool-pressure fault puts: a third more than a daemon's pool
/// (32 MiB of 4 KiB slots) holds.
const PRESSURE_BLOCKS: usize = 11_000;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// The daemon binary.
    #[arg(long, default_value = "target/release/kvmeshd")]
    kvmeshd: PathBuf,
    /// Daemons.
    #[arg(long, default_value_t = 5)]
    daemons: u32,
    /// Minutes of workload under faults (fractions allowed).
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Seed of the fault schedule and the workload.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Mutable keys (each overwritten again and again).
    #[arg(long, default_value_t = 256)]
    keys: usize,
    /// Immutable prefix keys (put if absent, always the same content).
    #[arg(long, default_value_t = 128)]
    prefix_keys: usize,
    /// No namespace invalidations in the workload.
    #[arg(long)]
    no_invalidations: bool,
    /// Kinds of fault to inject (comma-separated; default all): cut-off,
    /// split, flapping, pause, kill, drain, etcd-pause, pressure.
    #[arg(long, value_delimiter = ',', default_values_t = FAULT_KINDS.map(String::from))]
    faults: Vec<String>,
    /// Mutual TLS between the daemons (`peer.tls.mode = "required"`; the
    /// certificates are made with the `kvmesh` CLI beside `--kvmeshd`).
    #[arg(long)]
    tls: bool,
    /// How the daemons carry coherence batches (`peer.control`): `auto`
    /// (the gRPC streams on tcp), `ucx` (UCX active messages; not with
    /// `--tls`), `grpc`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "ucx", "grpc"])]
    peer_control: String,
    /// Readers per daemon.
    #[arg(long, default_value_t = 2)]
    readers: usize,
    /// Each reader starts a read of 8 keys every this many ms (or as soon
    /// as the last one ended, when it took longer); 0: back to back.
    #[arg(long, default_value_t = 5.0)]
    read_every_ms: f64,
    /// Mean seconds between faults.
    #[arg(long, default_value_t = 4.0)]
    fault_every_s: f64,
    /// Plant a coherence bug in every daemon (`KVMESH_TEST_BUG`, e.g.
    /// `ack-without-invalidate`): the checker must then find stale reads.
    #[arg(long)]
    plant_bug: Option<String>,
}

/// Runs a command; its failure is an error with its output.
fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!("{}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

/// The namespaces, links and processes of a run; all removed on drop.
struct Net {
    tag: String,
    nodes: u32,
}

impl Net {
    fn hub(&self) -> String {
        format!("kvn{}h", self.tag)
    }
    fn ns(&self, i: u32) -> String {
        format!("kvn{}n{i}", self.tag)
    }
    /// Node 0 is etcd; daemons 1..=N.
    fn addr(i: u32) -> String {
        format!("{SUBNET}.{}", 10 + i)
    }
    fn hub_link(i: u32) -> String {
        format!("kvnb{i}")
    }

    /// The hub and nodes + 1 namespaces (node 0: etcd); whatever was made
    /// is removed again when this fails (the `Net` drops).
    fn create(tag: &str, nodes: u32) -> Result<Net, String> {
        let net = Net { tag: tag.to_string(), nodes };
        net.setup()?;
        Ok(net)
    }

    fn setup(&self) -> Result<(), String> {
        let net = self;
        let hub = net.hub();
        sh(&["ip", "netns", "add", &hub])?;
        // Two bridges: every link is on br0; a split moves some to br1
        // (each side still reaches its own members, not the other side).
        for br in ["br0", "br1"] {
            sh(&["ip", "-n", &hub, "link", "add", br, "type", "bridge"])?;
            sh(&["ip", "-n", &hub, "link", "set", br, "up"])?;
        }
        for i in 0..=self.nodes {
            let ns = net.ns(i);
            sh(&["ip", "netns", "add", &ns])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            let (a, b) = (format!("kvna{i}"), Net::hub_link(i));
            sh(&["ip", "link", "add", &a, "netns", &ns, "type", "veth", "peer", "name", &b, "netns", &hub])?;
            sh(&["ip", "-n", &ns, "addr", "add", &format!("{}/24", Net::addr(i)), "dev", &a])?;
            sh(&["ip", "-n", &ns, "link", "set", &a, "up"])?;
            sh(&["ip", "-n", &hub, "link", "set", &b, "master", "br0"])?;
            sh(&["ip", "-n", &hub, "link", "set", &b, "up"])?;
        }
        Ok(())
    }

    /// Cuts node `i` off from everyone (its link on the bridge down), or
    /// joins it again.
    fn link(&self, i: u32, up: bool) -> Result<(), String> {
        sh(&["ip", "-n", &self.hub(), "link", "set", &Net::hub_link(i), if up { "up" } else { "down" }])
    }

    /// Puts node `i` (0: etcd) on the other side of a split, or back.
    fn side(&self, i: u32, other: bool) -> Result<(), String> {
        sh(&["ip", "-n", &self.hub(), "link", "set", &Net::hub_link(i), "master", if other { "br1" } else { "br0" }])
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..=self.nodes {
            let _ = sh(&["ip", "netns", "del", &self.ns(i)]);
        }
        let _ = sh(&["ip", "netns", "del", &self.hub()]);
    }
}

/// A process in a namespace, killed on drop.
struct Proc {
    child: Option<Child>,
}

impl Proc {
    fn spawn(ns: &str, argv: &[String], log: &Path, env: &[(String, String)]) -> Result<Proc, String> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(log).map_err(|e| e.to_string())?;
        use std::os::unix::process::CommandExt;
        // A process group of its own: Ctrl-C at the terminal reaches the
        // nemesis only (which heals, checks and removes), not the daemons.
        let child = Command::new("ip")
            .process_group(0)
            .args(["netns", "exec", ns])
            .args(argv)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn {argv:?} in {ns}: {e}"))?;
        Ok(Proc { child: Some(child) })
    }
    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }
    fn signal(&self, sig: &str) {
        if let Some(p) = self.pid() {
            let _ = sh(&["kill", &format!("-{sig}"), &p.to_string()]);
        }
    }
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = sh(&["kill", "-CONT", &c.id().to_string()]);
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    /// Waits up to `d` for the process to exit by itself.
    fn wait_exit(&mut self, d: Duration) -> bool {
        let t0 = Instant::now();
        while t0.elapsed() < d {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(_)) = c.try_wait()
            {
                self.child = None;
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn rss_mib(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// What the tasks of a run share.
struct Shared {
    t0: Instant,
    /// The mutable keys, then the immutable prefix keys.
    keys: Vec<Key>,
    /// How many of `keys` are mutable.
    mutable: usize,
    stop: AtomicBool,
    /// Nemesis events: (µs since start, text).
    events: Mutex<Vec<(Us, String)>>,
}

impl Shared {
    /// Microseconds since the start of the run.
    fn us(&self) -> Us {
        self.t0.elapsed().as_micros().min(Us::MAX as u128) as Us
    }
    fn event(&self, what: String) {
        let us = self.us();
        eprintln!("nemesis {:>8.3} s: {what}", us as f64 / 1e6);
        self.events.lock().push((us, what));
    }
}

async fn connect(socket: &Path) -> Option<(Client, Namespace)> {
    let c = tokio::time::timeout(Duration::from_secs(2), Client::connect(socket)).await.ok()?.ok()?;
    let ns = tokio::time::timeout(Duration::from_secs(2), c.register_namespace("nemesis", BLOCK as u64, "t"))
        .await
        .ok()?
        .ok()?;
    Some((c, ns))
}

/// The connection, made again when it was dropped (`None`, after a short
/// pause, while the daemon does not answer).
async fn connected<'a>(conn: &'a mut Option<(Client, Namespace)>, socket: &Path) -> Option<&'a (Client, Namespace)> {
    if conn.is_none() {
        *conn = connect(socket).await;
        if conn.is_none() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    conn.as_ref()
}

/// What a reader saw: every key of every read, and why the wrong ones
/// were wrong (by index into the reads).
#[derive(Default)]
struct Seen {
    reads: Vec<Read>,
    wrong: Vec<(usize, String)>,
}

impl Seen {
    /// Pins `idx` (indices into the run's keys) on `node` and records what
    /// came back; `false` when the call failed.
    async fn read(&mut self, sh: &Shared, node: u16, c: &Client, ns: &Namespace, idx: &[u32]) -> bool {
        let keys: Vec<Key> = idx.iter().map(|&i| sh.keys[i as usize]).collect();
        let start = sh.us();
        let res = tokio::time::timeout(Duration::from_secs(5), c.pin(ns, &keys)).await;
        let end = sh.us();
        match res {
            Ok(Ok(blocks)) => {
                for ((b, k), &i) in blocks.iter().zip(&keys).zip(idx) {
                    let outcome = match b {
                        None => Outcome::Miss,
                        Some(b) => match check(*k, &b[..]) {
                            Ok(seq) if seq < u64::from(u32::MAX - 2) => Outcome::Hit(seq as u32),
                            Ok(seq) => {
                                self.wrong.push((self.reads.len(), format!("{k}: sequence {seq} out of range")));
                                Outcome::Wrong
                            }
                            Err(e) => {
                                self.wrong.push((self.reads.len(), e));
                                Outcome::Wrong
                            }
                        },
                    };
                    self.reads.push(Read::new(node, i, start, end, outcome));
                }
                true
            }
            _ => {
                for &i in idx {
                    self.reads.push(Read::new(node, i, start, end, Outcome::Error));
                }
                false
            }
        }
    }
}

async fn reader(node: u16, socket: PathBuf, sh: Arc<Shared>, seed: u64, every: Duration) -> Seen {
    let mut rng = Rng::new(seed);
    let mut conn: Option<(Client, Namespace)> = None;
    let mut seen = Seen::default();
    // Paced: a daemon that refuses at once must not flood the history with
    // fast misses (availability is a share of reads).
    let mut tick = tokio::time::interval(every.max(Duration::from_micros(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !sh.stop.load(Ordering::Relaxed) {
        if !every.is_zero() {
            tick.tick().await;
        }
        let idx: Vec<u32> = (0..8).map(|_| rng.below(sh.keys.len() as u64) as u32).collect();
        let start = sh.us();
        let Some((c, ns)) = connected(&mut conn, &socket).await else {
            // The daemon does not answer (killed, paused): these reads
            // fail too, or availability would count only the others.
            let end = sh.us();
            seen.reads.extend(idx.iter().map(|&i| Read::new(node, i, start, end, Outcome::Error)));
            continue;
        };
        if !seen.read(&sh, node, c, ns, &idx).await {
            conn = None;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    seen
}

/// Overwrites `mine` (indices of mutable keys) with ever higher sequences,
/// and now and then puts an immutable prefix block if it is absent.
async fn writer(node: u16, socket: PathBuf, sh: Arc<Shared>, mine: Vec<u32>, seed: u64) -> Vec<Put> {
    let mut rng = Rng::new(seed);
    let mut seqs: HashMap<u32, u32> = mine.iter().map(|k| (*k, 0)).collect();
    let mut conn: Option<(Client, Namespace)> = None;
    let mut puts = Vec::new();
    let prefix = sh.keys.len() - sh.mutable;
    while !sh.stop.load(Ordering::Relaxed) {
        let Some((c, ns)) = connected(&mut conn, &socket).await else { continue };
        // A fifth of the puts: an immutable block (sequence 0), put only if
        // absent.
        let (i, seq, overwrite) = if prefix > 0 && rng.chance(0.2) {
            ((sh.mutable + rng.below(prefix as u64) as usize) as u32, 0, false)
        } else {
            let i = mine[rng.below(mine.len() as u64) as usize];
            // A sequence is never reused, even when its put failed (it may
            // still have been stored).
            let seq = seqs[&i] + 1;
            seqs.insert(i, seq);
            (i, seq, true)
        };
        let key = sh.keys[i as usize];
        let start = sh.us();
        let mut wrote = false;
        let put = async {
            let a = if overwrite { c.allocate_overwrite(ns, &[key]).await } else { c.allocate(ns, &[key]).await };
            let Some(Allocation::Allocated(mut w)) = a.ok()?.into_iter().next() else { return Some(false) };
            w.copy_from_slice(&content(key, u64::from(seq)));
            wrote = true;
            let o = c.commit(vec![w]).await.ok()?;
            Some(matches!(o[0], CommitOutcome::Committed { .. }))
        };
        let res = tokio::time::timeout(Duration::from_secs(5), put).await;
        let end = sh.us();
        // Only bytes this writer wrote can ever be read: a put that never
        // got its slot is not one.
        if wrote {
            let answer = match res {
                Ok(Some(true)) => Answer::Acked(end),
                // The commit answered, not Committed: Lost or Refused.
                Ok(Some(false)) => Answer::Refused(end),
                _ => Answer::Unknown,
            };
            puts.push(Put { node, key: i, seq, start, answer });
        }
        if !matches!(res, Ok(Some(_))) {
            conn = None;
        }
        tokio::time::sleep(Duration::from_millis(rng.range(0, 4))).await;
    }
    puts
}

/// Kinds of fault, by the draw in `0..20` that picks them.
fn fault_kind(roll: u64) -> &'static str {
    match roll {
        0..=3 => "cut-off",
        4..=5 => "split",
        6..=7 => "flapping",
        8..=10 => "pause",
        11..=13 => "kill",
        14..=15 => "drain",
        16..=17 => "etcd-pause",
        _ => "pressure",
    }
}

/// Every kind of fault.
const FAULT_KINDS: [&str; 8] = ["cut-off", "split", "flapping", "pause", "kill", "drain", "etcd-pause", "pressure"];

/// Invalidates the whole namespace on a random daemon every 5–20 s.
async fn invalidator(sockets: Vec<PathBuf>, sh: Arc<Shared>, seed: u64) -> Vec<Invalidation> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    loop {
        let wait = Instant::now() + Duration::from_millis(rng.range(5_000, 20_000));
        while Instant::now() < wait {
            if sh.stop.load(Ordering::Relaxed) {
                return out;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let node = rng.range(1, sockets.len() as u64) as u16;
        let Some((c, ns)) = connect(&sockets[node as usize - 1]).await else { continue };
        let start = sh.us();
        let res = tokio::time::timeout(Duration::from_secs(10), c.invalidate_namespace(&ns)).await;
        let end = sh.us();
        let acked = match &res {
            Ok(Ok(s)) if s.failed == 0 => Some(end),
            _ => None,
        };
        sh.event(match &res {
            Ok(Ok(s)) => format!(
                "namespace invalidated on daemon {node}: {} keys, {} failed{}",
                s.invalidated,
                s.failed,
                if s.failed > 0 { format!(" ({})", s.first_error) } else { String::new() }
            ),
            Ok(Err(e)) => format!("namespace invalidation on daemon {node} refused: {e}"),
            Err(_) => format!("namespace invalidation on daemon {node} timed out"),
        });
        out.push(Invalidation { node, start, acked });
    }
}

/// Fills daemon `socket`'s pool past its size with blocks of another
/// namespace (fresh keys each time): its copies are evicted. Returns the
/// evictions the daemon counted meanwhile.
async fn pressure(socket: &Path, blocks: usize, rng: &mut Rng) -> Result<u64, String> {
    let c = tokio::time::timeout(Duration::from_secs(2), Client::connect(socket))
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let before = c.stats().await.map_err(|e| e.to_string())?.evictions;
    let ns = c.register_namespace("filler", BLOCK as u64, "t").await.map_err(|e| e.to_string())?;
    let zeros = vec![0u8; BLOCK];
    for _ in 0..blocks.div_ceil(256) {
        let keys: Vec<Key> = (0..256).map(|_| Key(((rng.next_u64() as u128) << 64) | rng.next_u64() as u128)).collect();
        let batch: Vec<(Key, &[u8])> = keys.iter().map(|k| (*k, &zeros[..])).collect();
        tokio::time::timeout(Duration::from_secs(10), c.put(&ns, &batch))
            .await
            .map_err(|_| "put timed out".to_string())?
            .map_err(|e| e.to_string())?;
    }
    let after = c.stats().await.map_err(|e| e.to_string())?.evictions;
    Ok(after.saturating_sub(before))
}

struct Cluster {
    net: Net,
    dir: PathBuf,
    kvmeshd: PathBuf,
    etcd: Proc,
    daemons: Vec<Proc>,
    sockets: Vec<PathBuf>,
    env: Vec<(String, String)>,
    /// Directory of the cluster CA and node certificates (mutual TLS
    /// between the daemons), or none.
    certs: Option<PathBuf>,
    /// `peer.control` of every daemon.
    peer_control: String,
}

impl Cluster {
    fn config(&self, id: u32) -> String {
        let mut s = format!(
            "[server]\nsocket = {:?}\n[metrics]\nlisten = \"\"\n[node]\nid = {id}\n\
             [peer]\nlisten = \"{}:7100\"\ntransports = \"tcp\"\ntransfer_timeout_ms = 2000\ncontrol = \"{}\"\ntls = {}\n\
             [[pools]]\nname = \"p\"\nbytes = \"32MiB\"\nslot_payload_bytes = \"4KiB\"\nmlock = false\n\
             [membership]\nkind = \"etcd\"\nendpoints = [\"{}:2379\"]\nkey_prefix = \"/kvmesh-nemesis\"\n\
             lease_ttl_s = 2\ndial_timeout_ms = 500\n",
            self.sockets[id as usize - 1].display().to_string(),
            Net::addr(id),
            self.peer_control,
            match &self.certs {
                Some(d) => format!(
                    "{{ mode = \"required\", ca = {:?}, cert = {:?}, key = {:?} }}",
                    d.join("ca.pem").display().to_string(),
                    d.join(format!("node-{id}.pem")).display().to_string(),
                    d.join(format!("node-{id}.key")).display().to_string()
                ),
                None => "{ mode = \"off\" }".to_string(),
            },
            Net::addr(0)
        );
        for p in 1..=self.net.nodes {
            if p != id {
                s.push_str(&format!("[[peers]]\nid = {p}\naddr = \"{}:7100\"\n", Net::addr(p)));
            }
        }
        s
    }

    fn start_daemon(&mut self, id: u32) -> Result<(), String> {
        let cfg = self.dir.join(format!("kvmeshd-{id}.toml"));
        std::fs::write(&cfg, self.config(id)).map_err(|e| e.to_string())?;
        let argv = vec![self.kvmeshd.display().to_string(), "--config".into(), cfg.display().to_string()];
        let p = Proc::spawn(&self.net.ns(id), &argv, &self.dir.join(format!("kvmeshd-{id}.log")), &self.env)?;
        self.daemons[id as usize - 1] = p;
        Ok(())
    }
}

async fn wait_serving(sockets: &[PathBuf], members: u32, limit: Duration) -> Result<(), String> {
    let t0 = Instant::now();
    'outer: loop {
        if t0.elapsed() > limit {
            return Err(format!("no view of {members} serving daemons within {limit:?}"));
        }
        for s in sockets {
            let ok = match connect(s).await {
                Some((c, _)) => c
                    .stats()
                    .await
                    .ok()
                    .and_then(|st| st.coherence)
                    .is_some_and(|k| k.serving && k.members == members && k.directory_ready),
                None => false,
            };
            if !ok {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue 'outer;
            }
        }
        return Ok(());
    }
}

fn main() -> std::process::ExitCode {
    let a = Args::parse();
    if effective_uid() != 0 {
        eprintln!("kvmesh-nemesis: SKIPPED: network namespaces need root");
        println!("{}", serde_json::json!({"bench": "nemesis", "skipped": "not root"}));
        return std::process::ExitCode::from(77);
    }
    for bin in ["ip", "etcd"] {
        if Command::new(bin).arg("--version").output().is_err() && Command::new(bin).arg("-V").output().is_err() {
            eprintln!("kvmesh-nemesis: SKIPPED: no `{bin}` (Debian packages iproute2, etcd-server)");
            println!("{}", serde_json::json!({"bench": "nemesis", "skipped": format!("no {bin}")}));
            return std::process::ExitCode::from(77);
        }
    }
    if !a.kvmeshd.exists() {
        eprintln!("kvmesh-nemesis: no daemon binary at {}", a.kvmeshd.display());
        return std::process::ExitCode::from(2);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    match rt.block_on(run(a)) {
        Ok(clean) => {
            if clean {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("kvmesh-nemesis: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

/// The effective uid, read from /proc (no libc call in this crate).
fn effective_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(2)?.parse().ok()))
        .unwrap_or(u32::MAX)
}

async fn run(a: Args) -> Result<bool, String> {
    if a.daemons < 2 || a.daemons > 16 {
        return Err("--daemons: 2 to 16".into());
    }
    if !(a.minutes > 0.0 && a.minutes <= 60.0) {
        return Err("--minutes: more than 0, at most 60 (the history counts microseconds in 32 bits)".into());
    }
    if let Some(f) = a.faults.iter().find(|f| !FAULT_KINDS.contains(&f.as_str())) {
        return Err(format!("--faults: no fault {f:?} (known: {})", FAULT_KINDS.join(", ")));
    }
    if a.faults.is_empty() {
        return Err("--faults: name at least one".into());
    }
    if !(0.25..=3600.0).contains(&a.fault_every_s) {
        return Err("--fault-every-s: 0.25 to 3600".into());
    }
    if !(0.0..=10_000.0).contains(&a.read_every_ms) {
        return Err("--read-every-ms: 0 to 10000".into());
    }
    if a.keys < a.daemons as usize || a.keys + a.prefix_keys > 1 << 20 {
        return Err("--keys: at least one per daemon; --keys + --prefix-keys at most 1,048,576".into());
    }
    let tag = format!("{:x}", std::process::id() % 0xfff);
    let dir = std::env::temp_dir().join(format!("kvmesh-nemesis-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let kvmeshd = std::fs::canonicalize(&a.kvmeshd).map_err(|e| e.to_string())?;
    // Mutual TLS: a CA and a certificate per node, made by the `kvmesh`
    // CLI that sits beside the daemon binary.
    let certs = if a.tls {
        let cli = kvmeshd.with_file_name("kvmesh");
        let d = dir.join("certs");
        let nodes: Vec<String> = (1..=a.daemons).map(|i| i.to_string()).collect();
        let out = Command::new(&cli)
            .args(["certs", "--dir", &d.display().to_string(), "--nodes", &nodes.join(","), "--days", "2"])
            .output()
            .map_err(|e| format!("--tls: {}: {e}", cli.display()))?;
        if !out.status.success() {
            return Err(format!("--tls: kvmesh certs: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        Some(d)
    } else {
        None
    };
    let net = Net::create(&tag, a.daemons)?;
    eprintln!("nemesis: {} daemons in network namespaces kvn{tag}n1.., etcd in kvn{tag}n0, seed {}", a.daemons, a.seed);
    let etcd_argv: Vec<String> = [
        "etcd",
        "--name",
        "e",
        "--data-dir",
        &dir.join("etcd").display().to_string(),
        "--listen-client-urls",
        &format!("http://{}:2379", Net::addr(0)),
        "--advertise-client-urls",
        &format!("http://{}:2379", Net::addr(0)),
        "--listen-peer-urls",
        &format!("http://{}:2380", Net::addr(0)),
        "--initial-advertise-peer-urls",
        &format!("http://{}:2380", Net::addr(0)),
        "--initial-cluster",
        &format!("e=http://{}:2380", Net::addr(0)),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let etcd = Proc::spawn(&net.ns(0), &etcd_argv, &dir.join("etcd.log"), &[])?;
    let sockets: Vec<PathBuf> = (1..=a.daemons).map(|i| dir.join(format!("kvmeshd-{i}.sock"))).collect();
    let mut cl = Cluster {
        net,
        dir: dir.clone(),
        kvmeshd,
        etcd,
        daemons: (0..a.daemons).map(|_| Proc { child: None }).collect(),
        sockets: sockets.clone(),
        env: a.plant_bug.iter().map(|b| ("KVMESH_TEST_BUG".to_string(), b.clone())).collect(),
        certs,
        peer_control: a.peer_control.clone(),
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    for id in 1..=a.daemons {
        cl.start_daemon(id)?;
    }
    wait_serving(&sockets, a.daemons, Duration::from_secs(60)).await?;
    let rss_start: Vec<f64> = cl.daemons.iter().filter_map(|p| p.pid()).filter_map(rss_mib).collect();
    eprintln!("nemesis: cluster up; workload and faults for {} minutes", a.minutes);

    let mut rng = Rng::new(a.seed);
    let keys: Vec<Key> =
        (0..a.keys + a.prefix_keys).map(|_| Key(((rng.next_u64() as u128) << 64) | rng.next_u64() as u128)).collect();
    let sh = Arc::new(Shared {
        t0: Instant::now(),
        keys: keys.clone(),
        mutable: a.keys,
        stop: AtomicBool::new(false),
        events: Mutex::new(Vec::new()),
    });
    let mut readers = Vec::new();
    let mut writers = Vec::new();
    let n = a.daemons as usize;
    for (i, s) in sockets.iter().enumerate() {
        let node = i as u16 + 1;
        let mine: Vec<u32> = (0..a.keys as u32).skip(i).step_by(n).collect();
        writers.push(tokio::spawn(writer(node, s.clone(), Arc::clone(&sh), mine, a.seed * 1000 + i as u64)));
        for r in 0..a.readers {
            readers.push(tokio::spawn(reader(
                node,
                s.clone(),
                Arc::clone(&sh),
                a.seed * 1000 + 100 + (i * 10 + r) as u64,
                Duration::from_secs_f64(a.read_every_ms / 1e3),
            )));
        }
    }
    let invalidations =
        (!a.no_invalidations).then(|| tokio::spawn(invalidator(sockets.clone(), Arc::clone(&sh), a.seed * 1000 + 999)));

    // The nemesis. Ctrl-C ends it early (the cluster is healed, checked and
    // removed as at the end).
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let i = Arc::clone(&interrupted);
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                i.store(true, Ordering::SeqCst);
            }
        });
    }
    let end = Instant::now() + Duration::from_secs_f64(a.minutes * 60.0);
    let mut counts: HashMap<&'static str, u64> = HashMap::new();
    let mut faults: Vec<Fault> = Vec::new();
    let mut evictions = 0u64;
    let mut rss_min2: Option<Vec<f64>> = None;
    while Instant::now() < end && !interrupted.load(Ordering::SeqCst) {
        let gap = rng.range(500, (a.fault_every_s * 2000.0) as u64);
        tokio::time::sleep(Duration::from_millis(gap)).await;
        if rss_min2.is_none() && sh.t0.elapsed() > Duration::from_secs(120) {
            rss_min2 = Some(cl.daemons.iter().filter_map(|p| p.pid()).filter_map(rss_mib).collect());
        }
        let id = rng.range(1, a.daemons as u64) as u32;
        let hold = Duration::from_millis(rng.range(50, 3000));
        // Pauses and kills: from 50 ms to three leases (2 s each).
        let long_hold = Duration::from_millis(rng.range(50, 6000));
        let start = sh.us();
        // Draw a kind among those allowed (`--faults`).
        let roll = loop {
            let r = rng.below(20);
            if a.faults.iter().any(|f| f == fault_kind(r)) {
                break r;
            }
        };
        let kind = fault_kind(roll);
        match kind {
            "cut-off" => {
                sh.event(format!("partition: daemon {id} cut off for {hold:?}"));
                cl.net.link(id, false)?;
                tokio::time::sleep(hold).await;
                cl.net.link(id, true)?;
                sh.event(format!("partition of daemon {id} healed"));
                *counts.entry("partitions").or_default() += 1;
            }
            "split" => {
                // A split: a group of daemons (a minority or a majority),
                // with or without etcd, on the other side.
                let size = rng.range(1, a.daemons as u64 - 1);
                let mut group: Vec<u32> = (1..=a.daemons).collect();
                for i in (1..group.len()).rev() {
                    group.swap(i, rng.below(i as u64 + 1) as usize);
                }
                group.truncate(size as usize);
                group.sort_unstable();
                let with_etcd = rng.chance(0.5);
                sh.event(format!(
                    "split: daemons {group:?}{} apart from the rest for {hold:?}",
                    if with_etcd { " and etcd" } else { "" }
                ));
                for &i in &group {
                    cl.net.side(i, true)?;
                }
                if with_etcd {
                    cl.net.side(0, true)?;
                }
                tokio::time::sleep(hold).await;
                for i in group.iter().copied().chain(with_etcd.then_some(0)) {
                    cl.net.side(i, false)?;
                }
                sh.event("split healed".to_string());
                *counts.entry("partitions").or_default() += 1;
            }
            "flapping" => {
                // A flapping link: down and up again 3 to 12 times, each
                // state 20–300 ms.
                let flips = rng.range(3, 12);
                sh.event(format!("flapping: daemon {id}'s link down and up {flips} times"));
                for _ in 0..flips {
                    cl.net.link(id, false)?;
                    tokio::time::sleep(Duration::from_millis(rng.range(20, 300))).await;
                    cl.net.link(id, true)?;
                    tokio::time::sleep(Duration::from_millis(rng.range(20, 300))).await;
                }
                sh.event(format!("daemon {id}'s link steady again"));
                *counts.entry("partitions").or_default() += 1;
            }
            "pause" => {
                sh.event(format!("pause: daemon {id} SIGSTOP for {long_hold:?}"));
                cl.daemons[id as usize - 1].signal("STOP");
                tokio::time::sleep(long_hold).await;
                cl.daemons[id as usize - 1].signal("CONT");
                sh.event(format!("daemon {id} SIGCONT"));
                *counts.entry("pauses").or_default() += 1;
            }
            "kill" => {
                sh.event(format!("kill: daemon {id} SIGKILL, restart after {long_hold:?}"));
                cl.daemons[id as usize - 1].kill();
                tokio::time::sleep(long_hold).await;
                cl.start_daemon(id)?;
                sh.event(format!("daemon {id} restarted"));
                *counts.entry("kills").or_default() += 1;
                *counts.entry("restarts").or_default() += 1;
            }
            "drain" => {
                sh.event(format!("drain: daemon {id} SIGTERM"));
                cl.daemons[id as usize - 1].signal("TERM");
                if !cl.daemons[id as usize - 1].wait_exit(Duration::from_secs(15)) {
                    sh.event(format!("daemon {id} did not exit within 15 s of SIGTERM: killed"));
                    cl.daemons[id as usize - 1].kill();
                }
                cl.start_daemon(id)?;
                sh.event(format!("daemon {id} restarted after its drain"));
                *counts.entry("drains").or_default() += 1;
                *counts.entry("restarts").or_default() += 1;
            }
            "etcd-pause" => {
                sh.event(format!("pause: etcd SIGSTOP for {long_hold:?}"));
                cl.etcd.signal("STOP");
                tokio::time::sleep(long_hold).await;
                cl.etcd.signal("CONT");
                sh.event("etcd SIGCONT".to_string());
                *counts.entry("etcd_pauses").or_default() += 1;
            }
            _ => {
                // Pool pressure: a third more blocks than the pool holds.
                sh.event(format!(
                    "pressure: daemon {id}'s pool filled with {PRESSURE_BLOCKS} blocks of another namespace"
                ));
                match pressure(&sockets[id as usize - 1], PRESSURE_BLOCKS, &mut Rng::new(rng.next_u64())).await {
                    Ok(e) => {
                        evictions += e;
                        sh.event(format!("pressure on daemon {id} over: {e} evictions"));
                    }
                    Err(e) => sh.event(format!("pressure on daemon {id} cut short: {e}")),
                }
                *counts.entry("pressure").or_default() += 1;
            }
        }
        faults.push(Fault { kind: kind.to_string(), start, end: sh.us() });
    }
    // Heal: every daemon up and serving, then check every key everywhere.
    sh.event("healing: every link up, every process running".to_string());
    let heal_start = sh.us();
    for id in 0..=a.daemons {
        cl.net.side(id, false)?;
        cl.net.link(id, true)?;
        if id > 0 {
            cl.daemons[id as usize - 1].signal("CONT");
        }
    }
    cl.etcd.signal("CONT");
    let healed = wait_serving(&sockets, a.daemons, Duration::from_secs(60)).await;
    faults.push(Fault { kind: "healing".into(), start: heal_start, end: sh.us() });
    sh.stop.store(true, Ordering::SeqCst);
    let mut history = History { key_names: keys.iter().map(|k| k.to_string()).collect(), ..History::default() };
    for t in writers {
        history.puts.extend(t.await.map_err(|e| e.to_string())?);
    }
    let mut seen = Seen::default();
    for t in readers {
        let s = t.await.map_err(|e| e.to_string())?;
        let base = seen.reads.len();
        seen.wrong.extend(s.wrong.into_iter().map(|(i, w)| (base + i, w)));
        seen.reads.extend(s.reads);
    }
    if let Some(t) = invalidations {
        history.invalidations = t.await.map_err(|e| e.to_string())?;
    }
    let rss_end: Vec<f64> = cl.daemons.iter().filter_map(|p| p.pid()).filter_map(rss_mib).collect();
    // Final reads: every key on every daemon (the checker judges them with
    // the rest).
    let final_from = seen.reads.len();
    let all: Vec<u32> = (0..keys.len() as u32).collect();
    for (i, s) in sockets.iter().enumerate() {
        let Some((c, ns)) = connect(s).await else { continue };
        for chunk in all.chunks(64) {
            seen.read(&sh, i as u16 + 1, &c, &ns, chunk).await;
        }
    }
    let final_reads = seen.reads.len() - final_from;
    // Read (pin) latency P99 per minute of the run, of calls that answered
    // (every key of a call has the call's start and end).
    let mut by_minute: Vec<Vec<u32>> = Vec::new();
    for r in seen.reads[..final_from].iter().filter(|r| r.outcome() != Outcome::Error) {
        let m = (r.start / 60_000_000) as usize;
        if by_minute.len() <= m {
            by_minute.resize_with(m + 1, Vec::new);
        }
        by_minute[m].push(r.end - r.start);
    }
    let p99_by_minute: Vec<f64> = by_minute
        .iter_mut()
        .map(|v| {
            if v.is_empty() {
                return 0.0;
            }
            v.sort_unstable();
            v[(v.len() * 99 / 100).min(v.len() - 1)] as f64 / 1000.0
        })
        .collect();
    history.reads = seen.reads;
    history.wrong = seen.wrong.into_iter().collect();
    history.faults = faults;
    let rep = history::check(&history);

    let events = sh.events.lock();
    for o in rep.offences.iter().take(5) {
        eprintln!(
            "OFFENCE {} (started {:.6} s, ended {:.6} s); nemesis around it:",
            o.what,
            o.start as f64 / 1e6,
            o.end as f64 / 1e6
        );
        for (us, e) in events.iter().filter(|(us, _)| *us + 5_000_000 >= o.start && *us <= o.end + 1_000_000) {
            eprintln!("    {:>10.3} s  {e}", *us as f64 / 1e6);
        }
    }
    let fault_count: u64 = counts.iter().filter(|(k, _)| **k != "restarts").map(|(_, v)| v).sum();
    let availability: serde_json::Map<String, serde_json::Value> = rep
        .availability
        .iter()
        .map(|(k, s)| (k.clone(), serde_json::json!({"share": s.share(), "reads": s.reads})))
        .collect();
    let acked = history.puts.iter().filter(|p| p.acked().is_some()).count();
    let refused = history.puts.iter().filter(|p| matches!(p.answer, Answer::Refused(_))).count();
    println!(
        "{}",
        serde_json::json!({
            "bench": "nemesis", "minutes": a.minutes, "seed": a.seed, "daemons": a.daemons,
            "reads_verified": rep.hits, "reads": rep.reads, "misses": rep.misses, "read_errors": rep.errors,
            "puts_acknowledged": acked, "puts_refused": refused, "puts_unanswered": history.puts.len() - acked - refused,
            "invalidations": history.invalidations.len(),
            "invalidations_acknowledged": history.invalidations.iter().filter(|i| i.acked.is_some()).count(),
            "final_reads": final_reads,
            "wrong_bytes": rep.wrong_bytes, "stale_reads": rep.stale_reads, "lost_puts": rep.lost_puts,
            "faults": counts, "faults_total": fault_count, "pressure_evictions": evictions,
            "availability": availability,
            "healed": healed.is_ok(), "planted_bug": a.plant_bug,
            "rss_mib_start": rss_start, "rss_mib_minute2": rss_min2, "rss_mib_end": rss_end,
            "read_p99_ms_by_minute": p99_by_minute,
        })
    );
    if let Err(e) = &healed {
        eprintln!("nemesis: the cluster did not heal: {e}");
    }
    // A run that verified no read, or injected no fault, showed nothing:
    // it must not pass as clean (a run too short, a cluster that served
    // nothing).
    let exercised = rep.hits > 0 && fault_count > 0;
    if !exercised {
        eprintln!(
            "nemesis: the run verified {} reads and injected {fault_count} faults: nothing was shown (fails)",
            rep.hits
        );
    }
    let clean = rep.clean() && healed.is_ok() && exercised;
    if !rep.clean() {
        // What happened to the first offending keys, for the diagnosis.
        let mut text = String::new();
        let mut keys_told: Vec<u32> = Vec::new();
        for o in &rep.offences {
            if keys_told.contains(&o.key) || keys_told.len() == 3 {
                continue;
            }
            keys_told.push(o.key);
            text.push_str(&format!("== key {} (first offence: {})\n", history.key_names[o.key as usize], o.what));
            text.push_str(&history::story(&history, o.key, o.start.saturating_sub(15_000_000), o.end + 3_000_000));
        }
        let path = dir.join("offending-keys.txt");
        match std::fs::write(&path, text) {
            Ok(()) => eprintln!("nemesis: the history of the offending keys is in {}", path.display()),
            Err(e) => eprintln!("nemesis: {}: {e}", path.display()),
        }
    }
    drop(cl); // processes and namespaces
    if clean {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("nemesis: logs of the daemons and etcd kept in {}", dir.display());
    }
    Ok(clean)
}
