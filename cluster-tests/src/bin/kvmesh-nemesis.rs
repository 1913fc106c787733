//! `kvmesh-nemesis`: real daemons under real faults, with a checker over
//! the whole history (issue 17).
//!
//! N `kvmeshd` (default 5), each in a network namespace of its own, and
//! etcd in another, joined by a bridge in a hub namespace (addresses
//! 10.213.0.0/24, only inside the namespaces this program creates and
//! removes). UCX over tcp between the daemons, etcd membership. Engines
//! (tasks of this process, on the daemons' Unix sockets): per daemon a
//! writer overwriting its share of mutable keys with content derived from
//! (key, sequence), and readers pinning random batches and checking every
//! byte. A seeded nemesis: one daemon cut off (its link down: from the
//! others and from etcd), a split (a minority or a majority of the daemons,
//! with or without etcd, apart from the rest), a daemon paused (SIGSTOP),
//! killed (SIGKILL) and
//! restarted, drained (SIGTERM) and restarted, etcd paused. The checker:
//! wrong bytes, stale reads (a read that started after a put of a later
//! sequence was acknowledged returned an older one: a lost acknowledged
//! put), availability (reads that got data) during faults and quiet
//! periods; the first offending operations with the nemesis events around
//! them. Last line: JSON. Exit 0 clean, 1 violations, 77 cannot run here
//! (not root, no `ip` or `etcd`).
//!
//!     kvmesh-nemesis --kvmeshd target/release/kvmeshd --minutes 10 --seed 1
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use kvmesh_client::{Allocation, Client, CommitOutcome, Key, Namespace};
use kvmesh_cluster_tests::blocks::{BLOCK, check, content};
use kvmesh_cluster_tests::sim::Rng;
use parking_lot::Mutex;

const SUBNET: &str = "10.213.0";

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
    /// Readers per daemon.
    #[arg(long, default_value_t = 2)]
    readers: usize,
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

#[derive(Default)]
struct Tally {
    reads: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    wrong: AtomicU64,
    stale: AtomicU64,
    writes: AtomicU64,
    write_failures: AtomicU64,
}

/// One offending operation, with when it started and ended (ms since the
/// start of the run).
struct Offence {
    what: String,
    start_ms: u64,
    end_ms: u64,
}

struct Shared {
    t0: Instant,
    keys: Vec<Key>,
    /// Highest sequence of each key whose commit was acknowledged.
    acked: HashMap<Key, AtomicU64>,
    stop: AtomicBool,
    tally: Tally,
    offences: Mutex<Vec<Offence>>,
    /// A fault is in effect (reads counted per period).
    faulty: AtomicBool,
    reads_fault: AtomicU64,
    hits_fault: AtomicU64,
    reads_quiet: AtomicU64,
    hits_quiet: AtomicU64,
    /// Nemesis events: (ms since start, text).
    events: Mutex<Vec<(u64, String)>>,
    /// Pin call latencies (µs) of reads that answered, per minute of the run.
    latency_us: Mutex<Vec<Vec<u32>>>,
}

impl Shared {
    fn ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }
    fn offend(&self, counter: &AtomicU64, what: String, start_ms: u64) {
        counter.fetch_add(1, Ordering::Relaxed);
        let mut o = self.offences.lock();
        if o.len() < 20 {
            o.push(Offence { what, start_ms, end_ms: self.ms() });
        }
    }
    fn event(&self, what: String) {
        let ms = self.ms();
        eprintln!("nemesis {:>8.3} s: {what}", ms as f64 / 1e3);
        self.events.lock().push((ms, what));
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

async fn reader(socket: PathBuf, sh: Arc<Shared>, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut conn: Option<(Client, Namespace)> = None;
    while !sh.stop.load(Ordering::Relaxed) {
        let Some((c, ns)) = connected(&mut conn, &socket).await else { continue };
        let keys: Vec<Key> = (0..8).map(|_| sh.keys[rng.below(sh.keys.len() as u64) as usize]).collect();
        // What had been acknowledged before this read started.
        let floors: Vec<u64> = keys.iter().map(|k| sh.acked[k].load(Ordering::SeqCst)).collect();
        let start = sh.ms();
        let faulty = sh.faulty.load(Ordering::Relaxed);
        let t = Instant::now();
        let res = tokio::time::timeout(Duration::from_secs(5), c.pin(ns, &keys)).await;
        if matches!(res, Ok(Ok(_))) {
            let us = t.elapsed().as_micros().min(u32::MAX as u128) as u32;
            let minute = (start / 60_000) as usize;
            let mut l = sh.latency_us.lock();
            if l.len() <= minute {
                l.resize_with(minute + 1, Vec::new);
            }
            l[minute].push(us);
        }
        let (reads, hits) = if faulty { (&sh.reads_fault, &sh.hits_fault) } else { (&sh.reads_quiet, &sh.hits_quiet) };
        match res {
            Ok(Ok(blocks)) => {
                for ((b, k), floor) in blocks.iter().zip(&keys).zip(&floors) {
                    sh.tally.reads.fetch_add(1, Ordering::Relaxed);
                    reads.fetch_add(1, Ordering::Relaxed);
                    let Some(b) = b else {
                        sh.tally.misses.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    sh.tally.hits.fetch_add(1, Ordering::Relaxed);
                    hits.fetch_add(1, Ordering::Relaxed);
                    match check(*k, &b[..]) {
                        Err(e) => {
                            sh.offend(&sh.tally.wrong, format!("wrong bytes from {}: {e}", socket.display()), start)
                        }
                        Ok(seq) if seq < *floor => sh.offend(
                            &sh.tally.stale,
                            format!(
                                "stale read from {}: {k} sequence {seq}, {floor} was acknowledged before",
                                socket.display()
                            ),
                            start,
                        ),
                        Ok(_) => {}
                    }
                }
            }
            _ => {
                sh.tally.errors.fetch_add(1, Ordering::Relaxed);
                reads.fetch_add(keys.len() as u64, Ordering::Relaxed);
                conn = None;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

async fn writer(socket: PathBuf, sh: Arc<Shared>, keys: Vec<Key>, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut seqs: HashMap<Key, u64> = keys.iter().map(|k| (*k, 0)).collect();
    let mut conn: Option<(Client, Namespace)> = None;
    while !sh.stop.load(Ordering::Relaxed) {
        let Some((c, ns)) = connected(&mut conn, &socket).await else { continue };
        let key = keys[rng.below(keys.len() as u64) as usize];
        // A sequence is never reused, even when its put failed (it may
        // still have been stored).
        let seq = seqs[&key] + 1;
        seqs.insert(key, seq);
        let put = async {
            let a = c.allocate_overwrite(ns, &[key]).await.ok()?;
            let Some(Allocation::Allocated(mut w)) = a.into_iter().next() else { return Some(false) };
            w.copy_from_slice(&content(key, seq));
            let o = c.commit(vec![w]).await.ok()?;
            Some(matches!(o[0], CommitOutcome::Committed { .. }))
        };
        match tokio::time::timeout(Duration::from_secs(5), put).await {
            Ok(Some(true)) => {
                sh.tally.writes.fetch_add(1, Ordering::Relaxed);
                sh.acked[&key].fetch_max(seq, Ordering::SeqCst);
            }
            Ok(Some(false)) => {
                sh.tally.write_failures.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                sh.tally.write_failures.fetch_add(1, Ordering::Relaxed);
                conn = None;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.range(0, 4))).await;
    }
}

struct Cluster {
    net: Net,
    dir: PathBuf,
    kvmeshd: PathBuf,
    etcd: Proc,
    daemons: Vec<Proc>,
    sockets: Vec<PathBuf>,
    env: Vec<(String, String)>,
}

impl Cluster {
    fn config(&self, id: u32) -> String {
        let mut s = format!(
            "[server]\nsocket = {:?}\n[metrics]\nlisten = \"\"\n[node]\nid = {id}\n\
             [peer]\nlisten = \"{}:7100\"\ntransports = \"tcp\"\ntransfer_timeout_ms = 2000\ntls = {{ mode = \"off\" }}\n\
             [[pools]]\nname = \"p\"\nbytes = \"32MiB\"\nslot_payload_bytes = \"4KiB\"\nmlock = false\n\
             [membership]\nkind = \"etcd\"\nendpoints = [\"{}:2379\"]\nkey_prefix = \"/kvmesh-nemesis\"\n\
             lease_ttl_s = 2\ndial_timeout_ms = 500\n",
            self.sockets[id as usize - 1].display().to_string(),
            Net::addr(id),
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
    let tag = format!("{:x}", std::process::id() % 0xfff);
    let dir = std::env::temp_dir().join(format!("kvmesh-nemesis-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let kvmeshd = std::fs::canonicalize(&a.kvmeshd).map_err(|e| e.to_string())?;
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
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    for id in 1..=a.daemons {
        cl.start_daemon(id)?;
    }
    wait_serving(&sockets, a.daemons, Duration::from_secs(60)).await?;
    let rss_start: Vec<f64> = cl.daemons.iter().filter_map(|p| p.pid()).filter_map(rss_mib).collect();
    eprintln!("nemesis: cluster up; workload and faults for {} minutes", a.minutes);

    let mut rng = Rng::new(a.seed);
    let keys: Vec<Key> = (0..a.keys).map(|_| Key(((rng.next_u64() as u128) << 64) | rng.next_u64() as u128)).collect();
    let sh = Arc::new(Shared {
        t0: Instant::now(),
        acked: keys.iter().map(|k| (*k, AtomicU64::new(0))).collect(),
        keys: keys.clone(),
        stop: AtomicBool::new(false),
        tally: Tally::default(),
        offences: Mutex::new(Vec::new()),
        faulty: AtomicBool::new(false),
        reads_fault: AtomicU64::new(0),
        hits_fault: AtomicU64::new(0),
        reads_quiet: AtomicU64::new(0),
        hits_quiet: AtomicU64::new(0),
        events: Mutex::new(Vec::new()),
        latency_us: Mutex::new(Vec::new()),
    });
    let mut tasks = Vec::new();
    let n = a.daemons as usize;
    for (i, s) in sockets.iter().enumerate() {
        let mine: Vec<Key> = keys.iter().copied().skip(i).step_by(n).collect();
        tasks.push(tokio::spawn(writer(s.clone(), Arc::clone(&sh), mine, a.seed * 1000 + i as u64)));
        for r in 0..a.readers {
            tasks.push(tokio::spawn(reader(s.clone(), Arc::clone(&sh), a.seed * 1000 + 100 + (i * 10 + r) as u64)));
        }
    }

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
    let mut faults: HashMap<&'static str, u64> = HashMap::new();
    let mut rss_min2: Option<Vec<f64>> = None;
    while Instant::now() < end && !interrupted.load(Ordering::SeqCst) {
        let gap = rng.range(500, (a.fault_every_s * 2000.0) as u64);
        tokio::time::sleep(Duration::from_millis(gap)).await;
        if rss_min2.is_none() && sh.t0.elapsed() > Duration::from_secs(120) {
            rss_min2 = Some(cl.daemons.iter().filter_map(|p| p.pid()).filter_map(rss_mib).collect());
        }
        let id = rng.range(1, a.daemons as u64) as u32;
        let hold = Duration::from_millis(rng.range(50, 3000));
        sh.faulty.store(true, Ordering::Relaxed);
        match rng.below(10) {
            0..=1 => {
                sh.event(format!("partition: daemon {id} cut off for {hold:?}"));
                cl.net.link(id, false)?;
                tokio::time::sleep(hold).await;
                cl.net.link(id, true)?;
                sh.event(format!("partition of daemon {id} healed"));
                *faults.entry("partitions").or_default() += 1;
            }
            2 => {
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
                *faults.entry("splits").or_default() += 1;
            }
            3..=4 => {
                sh.event(format!("pause: daemon {id} SIGSTOP for {hold:?}"));
                cl.daemons[id as usize - 1].signal("STOP");
                tokio::time::sleep(hold).await;
                cl.daemons[id as usize - 1].signal("CONT");
                sh.event(format!("daemon {id} SIGCONT"));
                *faults.entry("pauses").or_default() += 1;
            }
            5..=6 => {
                sh.event(format!("kill: daemon {id} SIGKILL, restart after {hold:?}"));
                cl.daemons[id as usize - 1].kill();
                tokio::time::sleep(hold).await;
                cl.start_daemon(id)?;
                sh.event(format!("daemon {id} restarted"));
                *faults.entry("kills").or_default() += 1;
                *faults.entry("restarts").or_default() += 1;
            }
            7 => {
                sh.event(format!("drain: daemon {id} SIGTERM"));
                cl.daemons[id as usize - 1].signal("TERM");
                if !cl.daemons[id as usize - 1].wait_exit(Duration::from_secs(15)) {
                    sh.event(format!("daemon {id} did not exit within 15 s of SIGTERM: killed"));
                    cl.daemons[id as usize - 1].kill();
                }
                cl.start_daemon(id)?;
                sh.event(format!("daemon {id} restarted after its drain"));
                *faults.entry("drains").or_default() += 1;
                *faults.entry("restarts").or_default() += 1;
            }
            _ => {
                sh.event(format!("pause: etcd SIGSTOP for {hold:?}"));
                cl.etcd.signal("STOP");
                tokio::time::sleep(hold).await;
                cl.etcd.signal("CONT");
                sh.event("etcd SIGCONT".to_string());
                *faults.entry("etcd_pauses").or_default() += 1;
            }
        }
        sh.faulty.store(false, Ordering::Relaxed);
    }
    // Heal: every daemon up and serving, then check every key everywhere.
    sh.event("healing: every link up, every process running".to_string());
    for id in 0..=a.daemons {
        cl.net.side(id, false)?;
        cl.net.link(id, true)?;
        if id > 0 {
            cl.daemons[id as usize - 1].signal("CONT");
        }
    }
    cl.etcd.signal("CONT");
    let healed = wait_serving(&sockets, a.daemons, Duration::from_secs(60)).await;
    sh.stop.store(true, Ordering::SeqCst);
    for t in tasks {
        let _ = t.await;
    }
    let rss_end: Vec<f64> = cl.daemons.iter().filter_map(|p| p.pid()).filter_map(rss_mib).collect();
    // Final reads: every key on every daemon, none older than acknowledged.
    let mut final_reads = 0u64;
    for s in &sockets {
        let Some((c, ns)) = connect(s).await else { continue };
        for chunk in keys.chunks(64) {
            let floors: Vec<u64> = chunk.iter().map(|k| sh.acked[k].load(Ordering::SeqCst)).collect();
            let start = sh.ms();
            if let Ok(Ok(blocks)) = tokio::time::timeout(Duration::from_secs(10), c.pin(&ns, chunk)).await {
                for ((b, k), floor) in blocks.iter().zip(chunk).zip(&floors) {
                    final_reads += 1;
                    if let Some(b) = b {
                        match check(*k, &b[..]) {
                            Err(e) => sh.offend(&sh.tally.wrong, format!("final read: {e}"), start),
                            Ok(seq) if seq < *floor => sh.offend(
                                &sh.tally.stale,
                                format!("final read from {}: {k} sequence {seq} < acknowledged {floor}", s.display()),
                                start,
                            ),
                            Ok(_) => {}
                        }
                    }
                }
            }
        }
    }
    let t = &sh.tally;
    let (wrong, stale) = (t.wrong.load(Ordering::Relaxed), t.stale.load(Ordering::Relaxed));
    let offences = sh.offences.lock();
    let events = sh.events.lock();
    for o in offences.iter().take(5) {
        eprintln!("OFFENCE {} (started {} ms, ended {} ms); nemesis around it:", o.what, o.start_ms, o.end_ms);
        for (ms, e) in events.iter().filter(|(ms, _)| *ms + 5000 >= o.start_ms && *ms <= o.end_ms + 1000) {
            eprintln!("    {:>8} ms  {e}", ms);
        }
    }
    let ratio = |h: &AtomicU64, r: &AtomicU64| {
        let r = r.load(Ordering::Relaxed);
        if r == 0 { serde_json::Value::Null } else { serde_json::json!(h.load(Ordering::Relaxed) as f64 / r as f64) }
    };
    let fault_count: u64 = faults.values().sum();
    let p99_by_minute: Vec<f64> = sh
        .latency_us
        .lock()
        .iter_mut()
        .map(|v| {
            if v.is_empty() {
                return 0.0;
            }
            v.sort_unstable();
            v[(v.len() * 99 / 100).min(v.len() - 1)] as f64 / 1000.0
        })
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "bench": "nemesis", "minutes": a.minutes, "seed": a.seed, "daemons": a.daemons,
            "reads_verified": t.hits.load(Ordering::Relaxed), "reads": t.reads.load(Ordering::Relaxed),
            "misses": t.misses.load(Ordering::Relaxed), "read_errors": t.errors.load(Ordering::Relaxed),
            "puts_acknowledged": t.writes.load(Ordering::Relaxed), "put_failures": t.write_failures.load(Ordering::Relaxed),
            "final_reads": final_reads,
            "wrong_bytes": wrong, "stale_reads": stale, "lost_puts": stale,
            "faults": faults, "faults_total": fault_count,
            "availability": {"during_faults": ratio(&sh.hits_fault, &sh.reads_fault), "quiet": ratio(&sh.hits_quiet, &sh.reads_quiet)},
            "healed": healed.is_ok(), "planted_bug": a.plant_bug,
            "rss_mib_start": rss_start, "rss_mib_minute2": rss_min2, "rss_mib_end": rss_end,
            "read_p99_ms_by_minute": p99_by_minute,
        })
    );
    if let Err(e) = &healed {
        eprintln!("nemesis: the cluster did not heal: {e}");
    }
    let clean = wrong == 0 && stale == 0 && healed.is_ok();
    drop(cl); // processes and namespaces
    if clean {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("nemesis: logs of the daemons and etcd kept in {}", dir.display());
    }
    Ok(clean)
}
