//! Helpers for integration tests: a real `kvmeshd` process on a private
//! socket, killed when the handle drops.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let p = std::env::temp_dir().join(format!("kvmesh-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // `KVMESH_KEEP_TEST_DIRS=1`: keep configs and daemon logs (to read
        // what a failing run left).
        if std::env::var_os("KVMESH_KEEP_TEST_DIRS").is_some() {
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: TempDir,
}

impl Daemon {
    /// Starts kvmeshd with `pools_toml` (one or more `[[pools]]` tables)
    /// and optional extra config.
    pub fn start(tag: &str, extra: &str) -> Daemon {
        Daemon::start_with(tag, extra, &[])
    }

    /// Starts kvmeshd with extra config and environment variables.
    pub fn start_with(tag: &str, extra: &str, env: &[(&str, &str)]) -> Daemon {
        let dir = TempDir::new(tag);
        let socket = dir.0.join("kvmeshd.sock");
        // No metrics endpoint unless the test asks (tests run many daemons).
        let metrics = if extra.contains("[metrics]") { "" } else { "[metrics]\nlisten = \"\"\n" };
        let cfg = format!("[server]\nsocket = {:?}\n{extra}\n{metrics}", socket.display().to_string());
        let cfg_path = dir.0.join("kvmeshd.toml");
        std::fs::write(&cfg_path, cfg).unwrap();
        let child = spawn(&dir, env, false);
        let mut d = Daemon { child, socket, dir };
        d.wait_ready();
        d
    }

    /// Starts the daemon again on the same config, socket and log (after a
    /// kill).
    pub fn restart(&mut self, env: &[(&str, &str)]) {
        self.respawn(env);
        self.wait_ready();
    }

    /// [`Daemon::restart`] without waiting for it to serve
    /// ([`Daemon::wait_ready`] does).
    pub fn respawn(&mut self, env: &[(&str, &str)]) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn(&self.dir, env, true);
    }

    /// Waits until the daemon serves its engine socket.
    pub fn wait_ready(&mut self) {
        let log = self.dir.0.join("kvmeshd.log");
        wait_serving(&mut self.child, &self.socket, &log);
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("kvmeshd.log")).unwrap_or_default()
    }

    pub async fn client(&self) -> kvmesh_client::Client {
        kvmesh_client::Client::connect(&self.socket).await.expect("connect to kvmeshd")
    }
}

/// Runs kvmeshd on `dir/kvmeshd.toml`, logging to `dir/kvmeshd.log`.
fn spawn(dir: &TempDir, env: &[(&str, &str)], append_log: bool) -> Child {
    let log_path = dir.0.join("kvmeshd.log");
    let log = if append_log {
        std::fs::OpenOptions::new().append(true).open(&log_path).unwrap()
    } else {
        std::fs::File::create(&log_path).unwrap()
    };
    Command::new(env!("CARGO_BIN_EXE_kvmeshd"))
        .arg("--config")
        .arg(dir.0.join("kvmeshd.toml"))
        .env("KVMESH_LOG", "info")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn kvmeshd")
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until the daemon `child` answers an fd handshake on `socket`:
/// its accept loop runs, so everything done before it (the peer port
/// bound, the start logged) is done. (A bare connect succeeds as soon as
/// the socket listens, before that.) Panics with the log at `log` if it
/// exits or does not come up.
pub fn wait_serving(child: &mut Child, socket: &Path, log: &Path) {
    use std::io::{Read, Write};
    let read_log = || std::fs::read_to_string(log).unwrap_or_default();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("kvmeshd exited ({status}) while starting; log:\n{}", read_log());
        }
        if let Ok(mut s) = std::os::unix::net::UnixStream::connect(socket) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut b = [0u8; 1];
            if s.write_all(kvmesh_common::handshake::FD_HANDSHAKE_MAGIC).is_ok() && s.read(&mut b).unwrap_or(0) > 0 {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("kvmeshd did not come up; log:\n{}", read_log());
}

pub fn pool(name: &str, bytes: &str, slot: &str) -> String {
    format!("[[pools]]\nname = {name:?}\nbytes = {bytes:?}\nslot_payload_bytes = {slot:?}\nmlock = false\n")
}

/// Deterministic block content for (key, version): every byte is checkable.
pub fn block_bytes(key: kvmesh_client::Key, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = key.0 as u64 ^ (key.0 >> 64) as u64 ^ 0x9e37_79b9_7f4a_7c15;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn run_cli(socket: &Path, args: &[&str]) -> (i32, String, String) {
    let out =
        Command::new(env!("CARGO_BIN_EXE_kvmesh")).arg("--socket").arg(socket).args(args).output().expect("run kvmesh");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `kvmeshd --config PATH --check-config`.
pub fn check_config(path: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvmeshd")).arg("--config").arg(path).arg("--check-config").output().unwrap()
}

/// Fails the test if `promtool check metrics` rejects `text`; says SKIPPED
/// where promtool is missing (scripts/setup.sh installs it).
pub fn promtool_check_metrics(text: &str) {
    use std::io::Write;
    match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(mut p) => {
            p.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
            let out = p.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "promtool check metrics: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Err(e) => eprintln!("SKIPPED promtool check: promtool not found ({e}); install the Debian package prometheus"),
    }
}

/// A TCP port that was free a moment ago on loopback. Taken below the
/// kernel's ephemeral range (32768-60999 by default), where UCX's tcp
/// transport and outgoing connections of the many daemons of a parallel
/// test run take their ports: a port handed out there could be taken
/// before the daemon binds it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU64, Ordering};
    // A per-process starting point, then a walk that visits every port of
    // the range once (7,919 is prime and does not divide 12,000), so one
    // test process never hands out the same port twice.
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let seed = *SEED.get_or_init(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        (t ^ ((std::process::id() as u64) << 17)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40
    });
    for _ in 0..12_000 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20_000 + (seed + n * 7_919) % 12_000;
        if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return port as u16;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Config of one member of a cluster of daemons on loopback (peer TLS off).
pub fn peer_config(id: u32, ports: &[u16], transports: &str, pools: &str) -> String {
    peer_config_tls(id, ports, transports, pools, "{ mode = \"off\" }")
}

/// [`peer_config`] with `peer.tls` set to the inline table `tls`.
pub fn peer_config_tls(id: u32, ports: &[u16], transports: &str, pools: &str, tls: &str) -> String {
    let mut s = format!(
        "[node]\nid = {id}\n[peer]\nlisten = \"127.0.0.1:{}\"\ntransports = \"{transports}\"\n\
         transfer_timeout_ms = 10000\ngrant_lease_ms = 30000\ntls = {tls}\n{pools}",
        ports[id as usize - 1]
    );
    for (i, p) in ports.iter().enumerate() {
        if i as u32 + 1 != id {
            s.push_str(&format!("[[peers]]\nid = {}\naddr = \"127.0.0.1:{p}\"\n", i + 1));
        }
    }
    s
}

impl Daemon {
    /// Waits until the daemon reports `n` connected peers and serves as a
    /// member of a view of `n + 1` daemons.
    pub async fn wait_peers(&self, n: u32) {
        let c = self.client().await;
        let t0 = Instant::now();
        loop {
            let s = c.stats().await.unwrap();
            let member = s.coherence.as_ref().is_some_and(|c| c.serving && c.members > n && c.directory_ready);
            if s.peers_connected >= n && member {
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "peers never connected; log:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// One mutable key of namespace "ns" (4 KiB blocks) whose every byte is a
/// fill byte: what the membership tests write and read.
pub mod fill {
    use super::Daemon;
    use kvmesh_client::{Allocation, Client, CommitOutcome, Key};
    use std::time::{Duration, Instant};

    pub const BLOCK: usize = 4096;

    /// Overwrites `key` with `fill` through `d`; false if refused or failed.
    pub async fn put(d: &Daemon, key: Key, fill: u8) -> bool {
        let Ok(c) = Client::connect(&d.socket).await else { return false };
        let Ok(ns) = c.register_namespace("ns", BLOCK as u64, "t").await else { return false };
        let Ok(a) = c.allocate_overwrite(&ns, &[key]).await else { return false };
        let Some(Allocation::Allocated(mut w)) = a.into_iter().next() else { return false };
        w.copy_from_slice(&[fill; BLOCK]);
        matches!(c.commit(vec![w]).await.as_deref(), Ok([CommitOutcome::Committed { .. }]))
    }

    /// Retries `put` (a daemon that is not serving refuses) until stored;
    /// fails the test after `deadline`. Returns how long it took.
    pub async fn put_until_stored(d: &Daemon, key: Key, fill: u8, deadline: Duration) -> Duration {
        let t0 = Instant::now();
        let mut attempts = 1;
        while !put(d, key, fill).await {
            assert!(t0.elapsed() < deadline, "put {:?} never stored; log:\n{}", fill as char, d.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
            attempts += 1;
        }
        eprintln!("put {:?} stored after {attempts} attempts, {:?}", fill as char, t0.elapsed());
        t0.elapsed()
    }

    /// The fill byte `d` serves for `key`, or None (a miss, or no answer).
    /// A block that is not one fill byte throughout fails the test.
    pub async fn get(d: &Daemon, key: Key) -> Option<u8> {
        let c = Client::connect(&d.socket).await.ok()?;
        let ns = c.register_namespace("ns", BLOCK as u64, "t").await.ok()?;
        let b = c.pin(&ns, &[key]).await.ok()?.into_iter().next().flatten()?;
        let first = b[0];
        assert!(b.iter().all(|&x| x == first), "torn or wrong block served");
        Some(first)
    }
}
