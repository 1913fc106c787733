//! etcd membership with real processes: a real etcd on loopback (temporary
//! data directory), three `kvmeshd` registered under etcd leases. Through a
//! SIGKILL + restart of a daemon, etcd stopped for longer than a lease and
//! started again, and one daemon cut off from etcd (a TCP proxy the test
//! breaks) until its lease expires: no daemon ever serves a version older
//! than one whose put returned, and every daemon serves again afterwards,
//! by itself.
//!
//! Needs the `etcd` binary (Debian `etcd-server`, installed by
//! `scripts/setup.sh`); without it the test says so and skips.

mod common;

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Daemon, TempDir, fill, free_port, peer_config, pool};
use kvmesh_client::Key;

const KEY: Key = Key(0xe7cd_0000_0000_0000_0000_0000_0000_0002);
const TTL_S: u64 = 2;

struct Etcd {
    child: Option<Child>,
    port: u16,
    peer_port: u16,
    dir: TempDir,
    /// TLS files (server cert, key, client CA) when clients must use TLS.
    tls: Option<(std::path::PathBuf, std::path::PathBuf, std::path::PathBuf)>,
}

impl Etcd {
    fn start() -> Option<Etcd> {
        if Command::new("etcd").arg("--version").stdout(Stdio::null()).status().is_err() {
            eprintln!("SKIPPED: no etcd binary (Debian package etcd-server; scripts/setup.sh installs it)");
            return None;
        }
        let mut e =
            Etcd { child: None, port: free_port(), peer_port: free_port(), dir: TempDir::new("etcd"), tls: None };
        e.spawn();
        Some(e)
    }

    /// An etcd that serves clients over TLS only and requires a client
    /// certificate of `ca` (its own certificate is `cert`, `key`).
    fn start_tls(cert: std::path::PathBuf, key: std::path::PathBuf, ca: std::path::PathBuf) -> Option<Etcd> {
        if Command::new("etcd").arg("--version").stdout(Stdio::null()).status().is_err() {
            eprintln!("SKIPPED: no etcd binary (Debian package etcd-server; scripts/setup.sh installs it)");
            return None;
        }
        let mut e = Etcd {
            child: None,
            port: free_port(),
            peer_port: free_port(),
            dir: TempDir::new("etcd-tls"),
            tls: Some((cert, key, ca)),
        };
        e.spawn();
        Some(e)
    }

    fn spawn(&mut self) {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.0.join("etcd.log")).unwrap();
        let mut cmd = Command::new("etcd");
        if let Some((cert, key, ca)) = &self.tls {
            cmd.arg("--cert-file").arg(cert).arg("--key-file").arg(key).arg("--trusted-ca-file").arg(ca);
            cmd.arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", "t", "--data-dir"])
            .arg(self.dir.0.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(t0.elapsed() < Duration::from_secs(20), "etcd did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A TCP proxy in front of etcd for one daemon; `cut` breaks every
/// connection and refuses new ones (a partition from etcd only).
struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
    epoch: tokio::sync::watch::Sender<u64>,
    /// Connections open when it changes stop carrying bytes but stay open.
    freeze: tokio::sync::watch::Sender<u64>,
}

impl Proxy {
    async fn start(upstream: u16) -> Proxy {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let (epoch, rx) = tokio::sync::watch::channel(0u64);
        let (freeze, frx) = tokio::sync::watch::channel(0u64);
        let c = Arc::clone(&cut);
        tokio::spawn(async move {
            loop {
                let Ok((mut down, _)) = l.accept().await else { return };
                if c.load(Ordering::SeqCst) {
                    continue; // dropped: refused
                }
                let (mut rx, mut frx) = (rx.clone(), frx.clone());
                tokio::spawn(async move {
                    let Ok(mut up) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else { return };
                    rx.borrow_and_update();
                    frx.borrow_and_update();
                    let frozen = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => false,
                        _ = rx.changed() => false, // cut: both ends dropped
                        _ = frx.changed() => true,
                    };
                    if frozen {
                        // Open, silent: until cut.
                        let _ = rx.changed().await;
                    }
                    drop((down, up));
                });
            }
        });
        Proxy { port, cut, epoch, freeze }
    }

    /// The connections open now stall: no byte passes either way, and
    /// neither end sees them close (a host gone, packets dropped). New
    /// connections pass.
    fn freeze(&self) {
        self.freeze.send_modify(|e| *e += 1);
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.epoch.send_modify(|e| *e += 1);
    }

    fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

fn config(id: u32, ports: &[u16], etcd_port: u16) -> String {
    peer_config(id, ports, "sm", &pool("p", "8MiB", "64KiB"))
        + &format!(
            "[membership]\nkind = \"etcd\"\nendpoints = [\"127.0.0.1:{etcd_port}\"]\nkey_prefix = \"/kvmesh-test\"\n\
             lease_ttl_s = {TTL_S}\ndial_timeout_ms = 500\n"
        )
}

async fn put(d: &Daemon, f: u8) -> bool {
    fill::put(d, KEY, f).await
}

async fn put_until_stored(d: &Daemon, f: u8) {
    fill::put_until_stored(d, KEY, f, Duration::from_secs(20)).await;
}

async fn get(d: &Daemon) -> Option<u8> {
    fill::get(d, KEY).await
}

async fn coherence(d: &Daemon) -> kvmesh_proto::engine::v1::CoherenceStats {
    d.client().await.stats().await.unwrap().coherence.unwrap()
}

async fn wait_until<F: Fn(&kvmesh_proto::engine::v1::CoherenceStats) -> bool>(d: &Daemon, what: &str, f: F) {
    let t0 = Instant::now();
    loop {
        let k = coherence(d).await;
        if f(&k) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{what}: {k:?}\nlog:\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_all_serving(nodes: &[Daemon], members: u32, what: &str) {
    for n in nodes {
        wait_until(n, what, |k| k.serving && k.members == members && k.directory_ready && k.etcd_connected).await;
    }
}

/// Reads KEY on every daemon: a read of a version older than `latest`
/// (the fill of the last acknowledged put) fails the test; a miss is
/// allowed. Returns what each served.
async fn no_stale(nodes: &[Daemon], older: &[u8], what: &str) -> Vec<Option<u8>> {
    let mut out = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let got = get(n).await;
        assert!(
            !got.is_some_and(|b| older.contains(&b)),
            "{what}: daemon {} served {:?}, an older version than the last acknowledged put",
            i + 1,
            got.map(|b| b as char)
        );
        out.push(got);
    }
    out
}

async fn eventually_all_serve(nodes: &[Daemon], fill: u8, older: &[u8], what: &str) {
    let t0 = Instant::now();
    loop {
        let got = no_stale(nodes, older, what).await;
        if got.iter().all(|b| *b == Some(fill)) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "{what}: never served {:?} everywhere: {got:?}", fill as char);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_membership_survives_restarts_outages_and_partitions() {
    let Some(mut etcd) = Etcd::start() else { return };
    let proxy = Proxy::start(etcd.port).await;
    let ports = [free_port(), free_port(), free_port()];
    let mut nodes: Vec<Daemon> = (1..=3u32)
        .map(|id| {
            // Daemon 3 reaches etcd through the proxy.
            let port = if id == 3 { proxy.port } else { etcd.port };
            Daemon::start(&format!("etcd-{id}"), &config(id, &ports, port))
        })
        .collect();
    wait_all_serving(&nodes, 3, "start").await;
    let e0 = coherence(&nodes[0]).await.epoch;

    // A, everywhere.
    put_until_stored(&nodes[1], b'A').await;
    eventually_all_serve(&nodes, b'A', &[], "after A").await;

    // SIGKILL + restart of daemon 1: it comes back in a later epoch.
    nodes[0].child.kill().unwrap();
    nodes[0].child.wait().unwrap();
    nodes[0].restart(&[]);
    wait_all_serving(&nodes, 3, "after the restart of daemon 1").await;
    assert!(coherence(&nodes[1]).await.epoch > e0, "epochs only grow");
    put_until_stored(&nodes[0], b'B').await;
    no_stale(&nodes, b"A", "right after B").await;
    eventually_all_serve(&nodes, b'B', b"A", "after B").await;

    // etcd stopped for longer than a lease: every daemon stops serving
    // (misses and refusals, never an older version), then recovers by
    // itself when etcd is back.
    etcd.stop();
    for n in &nodes {
        wait_until(n, "etcd down: stop serving", |k| !k.serving).await;
    }
    tokio::time::sleep(Duration::from_secs(TTL_S + 1)).await;
    let got = no_stale(&nodes, b"A", "etcd down").await;
    eprintln!("etcd down: {got:?}");
    assert!(!put(&nodes[2], b'X').await, "a put must be refused while no daemon holds a lease");
    etcd.spawn();
    wait_all_serving(&nodes, 3, "etcd back").await;
    put_until_stored(&nodes[2], b'C').await;
    eventually_all_serve(&nodes, b'C', b"AB", "after C").await;

    // Daemon 3 cut off from etcd until its lease expires: it stops
    // serving, the others go on without it, and it never serves the
    // version they replaced meanwhile.
    let before = coherence(&nodes[2]).await.etcd_errors;
    proxy.cut();
    wait_until(&nodes[2], "cut from etcd: stop serving", |k| !k.serving).await;
    for n in &nodes[..2] {
        wait_until(n, "daemon 3's lease expired", |k| k.serving && k.members == 2).await;
    }
    put_until_stored(&nodes[0], b'D').await;
    let got = no_stale(&nodes, b"ABC", "daemon 3 partitioned from etcd").await;
    eprintln!("daemon 3 partitioned from etcd: {got:?}");
    assert!(coherence(&nodes[2]).await.etcd_errors > before, "the lost session is counted");
    // Daemon 3 restarted while it still cannot reach etcd: it is no member
    // and its view names no other daemon. A whole-namespace invalidation
    // on it must be refused — not answered "0 keys, 0 failed" while D
    // stays Valid on the others (found by kvmesh-nemesis).
    nodes[2].restart(&[]);
    let c = nodes[2].client().await;
    let ns = c.register_namespace("ns", fill::BLOCK as u64, "t").await.unwrap();
    match c.invalidate_namespace(&ns).await {
        Err(e) => assert!(e.to_string().contains("not a serving cluster member"), "{e}"),
        Ok(s) => panic!("a daemon outside the cluster reported the namespace invalidated: {s:?}"),
    }
    assert_eq!(get(&nodes[0]).await, Some(b'D'), "D is still Valid on daemon 1");
    proxy.heal();
    wait_all_serving(&nodes, 3, "partition healed").await;
    eventually_all_serve(&nodes, b'D', b"ABC", "after D").await;
}

/// A drained daemon revokes its etcd lease on the way out: the others see a
/// view without it at once (not after the lease TTL), an overwrite of a key
/// it held completes without waiting for it, and it rejoins when started
/// again.
/// A connection to etcd that stalls without closing (its bytes stop, no
/// end sees it close) is given up once a keepalive has waited the lease
/// TTL: the daemon connects again and serves. Before, it waited for TCP to
/// give up (many minutes), out of the cluster all that time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_etcd_connection_is_replaced() {
    let Some(etcd) = Etcd::start() else { return };
    let proxy = Proxy::start(etcd.port).await;
    let ports = [free_port(), free_port()];
    let nodes: Vec<Daemon> = (1..=2u32)
        .map(|id| {
            let port = if id == 2 { proxy.port } else { etcd.port };
            Daemon::start(&format!("etcd-stall-{id}"), &config(id, &ports, port))
        })
        .collect();
    wait_all_serving(&nodes, 2, "start").await;
    let errors = coherence(&nodes[1]).await.etcd_errors;
    proxy.freeze();
    // It stops serving (no keepalive answered) and etcd drops it.
    wait_until(&nodes[1], "the stalled daemon stops serving", |k| !k.serving).await;
    // Then, within a few TTLs, it is back on a new connection.
    let t0 = Instant::now();
    wait_until(&nodes[1], "the stalled daemon serves again", |k| {
        k.serving && k.members == 2 && k.etcd_connected && k.etcd_errors > errors
    })
    .await;
    eprintln!("served again {:?} after it stopped", t0.elapsed());
    assert!(nodes[1].log().contains("the connection stalled"), "{}", nodes[1].log());
    put_until_stored(&nodes[0], b'S').await;
    eventually_all_serve(&nodes, b'S', &[], "after the stall").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_daemon_revokes_its_lease_and_the_view_moves_on_at_once() {
    let Some(etcd) = Etcd::start() else { return };
    let ports = [free_port(), free_port(), free_port()];
    let mut nodes: Vec<Daemon> =
        (1..=3u32).map(|id| Daemon::start(&format!("etcd-drain-{id}"), &config(id, &ports, etcd.port))).collect();
    wait_all_serving(&nodes, 3, "start").await;
    put_until_stored(&nodes[0], b'A').await;
    eventually_all_serve(&nodes, b'A', &[], "after A").await;
    let n3 = &mut nodes[2];
    let ok = Command::new("kill").arg("-TERM").arg(n3.child.id().to_string()).status().unwrap().success();
    assert!(ok);
    let t0 = Instant::now();
    while n3.child.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no exit; log:\n{}", n3.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let exited = t0.elapsed();
    assert!(n3.log().contains("lease revoked"), "{}", n3.log());
    assert!(exited < Duration::from_secs(TTL_S), "a drain without pins took {exited:?}");
    // Within a fraction of the TTL the others serve in a view of two.
    let t1 = Instant::now();
    for n in &nodes[..2] {
        wait_until(n, "view without the drained daemon", |k| k.serving && k.members == 2 && k.directory_ready).await;
    }
    let view_after = t1.elapsed();
    fill::put_until_stored(&nodes[0], KEY, b'B', Duration::from_secs(20)).await;
    let stored_after = t1.elapsed();
    eprintln!("drained daemon exited in {exited:?}; view of 2 after {view_after:?}; B stored after {stored_after:?}");
    assert!(stored_after < Duration::from_millis(TTL_S * 1000 / 2), "waited for the lease: {stored_after:?}");
    nodes[2].restart(&[]);
    wait_all_serving(&nodes, 3, "drained daemon restarted").await;
    eventually_all_serve(&nodes, b'B', b"A", "after B").await;
}

/// etcd over TLS with client certificates: daemons with `[membership.tls]`
/// (CA and their client certificate) form a cluster and move a block; a
/// daemon without a client certificate never connects (etcd refuses it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_with_client_certificates() {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let certs = TempDir::new("etcd-certs");
    let write = |name: &str, text: String| {
        use std::os::unix::fs::PermissionsExt;
        let p = certs.0.join(name);
        std::fs::write(&p, text).unwrap();
        // (Private keys readable by their owner only, as the daemon asks.)
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_pem = write("ca.pem", ca_params.self_signed(&ca_key).unwrap().pem());
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>, tag: &str| {
        let k = KeyPair::generate().unwrap();
        let c = CertificateParams::new(names).unwrap().signed_by(&k, &issuer).unwrap();
        (write(&format!("{tag}.pem"), c.pem()), write(&format!("{tag}.key"), k.serialize_pem()))
    };
    let (server_pem, server_key) = leaf(vec!["127.0.0.1".into(), "localhost".into()], "etcd");
    let (client_pem, client_key) = leaf(vec!["kvmesh-client".into()], "client");
    let Some(etcd) = Etcd::start_tls(server_pem, server_key, ca_pem.clone()) else { return };
    let tls = |with_cert: bool| {
        let mut s = format!("[membership.tls]\nca = {:?}\n", ca_pem.display().to_string());
        if with_cert {
            s += &format!(
                "cert = {:?}\nkey = {:?}\n",
                client_pem.display().to_string(),
                client_key.display().to_string()
            );
        }
        s
    };
    let ports = [free_port(), free_port(), free_port()];
    let a = Daemon::start("etcd-tls-a", &(config(1, &ports, etcd.port) + &tls(true)));
    let b = Daemon::start("etcd-tls-b", &(config(2, &ports, etcd.port) + &tls(true)));
    let nodes = [a, b];
    wait_all_serving(&nodes, 2, "two daemons over etcd TLS").await;
    put_until_stored(&nodes[0], b'T').await;
    assert_eq!(get(&nodes[1]).await, Some(b'T'));
    // No client certificate: etcd refuses the TLS session; the daemon
    // never joins (and says why).
    let c = Daemon::start("etcd-tls-c", &(config(3, &ports, etcd.port) + &tls(false)));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let k = coherence(&c).await;
    assert!(!k.etcd_connected && !k.serving, "{k:?}");
    for n in &nodes {
        assert_eq!(coherence(n).await.members, 2, "the daemon without a certificate is not a member");
    }
    // It said why: an etcd session that failed (and is retried).
    let log = c.log();
    assert!(log.contains("etcd membership: ") && log.contains("stops serving when its lease ends, retrying"), "{log}");
}
