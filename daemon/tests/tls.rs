//! Mutual TLS between daemons, with real certificates and real daemons: a
//! TLS cluster moves blocks; a caller without a certificate, with one from
//! another CA, or with the certificate of another node is refused.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Daemon, fill, free_port, peer_config_tls, pool};
use kvmesh_client::Key;
use kvmesh_proto::peer::v1 as pb;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

const KEY: Key = Key(0x7157_0000_0000_0000_0000_0000_0000_0001);

fn tls_inline(dir: &Path, id: u32) -> String {
    format!(
        "{{ mode = \"required\", ca = {:?}, cert = {:?}, key = {:?} }}",
        dir.join("ca.pem").display().to_string(),
        dir.join(format!("node-{id}.pem")).display().to_string(),
        dir.join(format!("node-{id}.key")).display().to_string()
    )
}

fn read(p: std::path::PathBuf) -> Vec<u8> {
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A client of `addr` speaking as `id` with the certificate files of
/// `cert_dir`, trusting the CA of `ca_dir`; `None` identity: no client
/// certificate.
async fn peer_client(
    addr: &str,
    ca_dir: &Path,
    cert_dir: Option<&Path>,
    id: u32,
    server: u32,
) -> Result<pb::peer_client::PeerClient<tonic::transport::Channel>, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(ca_dir.join("ca.pem"))))
        .domain_name(format!("node-{server}.kvmesh"));
    if let Some(d) = cert_dir {
        tls = tls.identity(Identity::from_pem(
            read(d.join(format!("node-{id}.pem"))),
            read(d.join(format!("node-{id}.key"))),
        ));
    }
    let ch = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(pb::peer_client::PeerClient::new(ch))
}

async fn handshake(
    c: &mut pb::peer_client::PeerClient<tonic::transport::Channel>,
    id: u32,
) -> Result<(), tonic::Status> {
    c.handshake(pb::HandshakeRequest { node_id: id, incarnation: 1, worker_address: vec![1; 16] }).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_moves_blocks_and_refuses_callers_that_are_not_its_nodes() {
    let base = std::env::temp_dir().join(format!("kvmesh-tls-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (certs, other_ca) = (base.join("cluster"), base.join("other"));
    kvmeshd::tls::make_certs(&certs, &[1, 2, 5], 1).unwrap();
    kvmeshd::tls::make_certs(&other_ca, &[1, 2], 1).unwrap();

    let ports = [free_port(), free_port()];
    let pools = pool("p", "4MiB", "4KiB");
    let a = Daemon::start("tls-a", &peer_config_tls(1, &ports, "sm", &pools, &tls_inline(&certs, 1)));
    let b = Daemon::start("tls-b", &peer_config_tls(2, &ports, "sm", &pools, &tls_inline(&certs, 2)));
    a.wait_peers(1).await;
    b.wait_peers(1).await;
    assert!(a.log().contains("peer TLS required"), "{}", a.log());

    // The cluster works over TLS: a block put on A is read on B, then
    // overwritten on B and read on A (invalidation crossed too).
    fill::put_until_stored(&a, KEY, b'x', Duration::from_secs(10)).await;
    assert_eq!(fill::get(&b, KEY).await, Some(b'x'));
    fill::put_until_stored(&b, KEY, b'y', Duration::from_secs(10)).await;
    assert_eq!(fill::get(&a, KEY).await, Some(b'y'));

    let addr = format!("127.0.0.1:{}", ports[0]);
    // Plain gRPC without TLS: no answer from the peer service.
    let plain = async {
        let ch = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        handshake(&mut pb::peer_client::PeerClient::new(ch), 2).await.map_err(|s| s.to_string())
    };
    assert!(plain.await.is_err(), "a plaintext handshake was answered");
    // TLS without a client certificate, and with one of another CA: the
    // TLS handshake fails (no RPC is ever served).
    for (what, cert_dir) in [("no client certificate", None), ("another CA", Some(other_ca.as_path()))] {
        let r = match peer_client(&addr, &certs, cert_dir, 2, 1).await {
            Ok(mut c) => handshake(&mut c, 2).await.map_err(|s| s.to_string()),
            Err(e) => Err(e),
        };
        assert!(r.is_err(), "{what}: handshake answered");
    }
    // A daemon that is not node 1 is refused by the client side too: our
    // client expects node-2's name from A's port.
    let answered = match peer_client(&addr, &certs, Some(&certs), 2, 2).await {
        Ok(mut c) => handshake(&mut c, 2).await.is_ok(),
        Err(_) => false,
    };
    assert!(!answered, "A's port answered as node 2");
    // A valid certificate of the CA, for node 5, claiming to be node 2:
    // PERMISSION_DENIED on the handshake (no remote keys) and on the
    // coherence stream, counted.
    let before = a.client().await.stats().await.unwrap().coherence.unwrap().peer_auth_refusals;
    let mut c = peer_client(&addr, &certs, Some(&certs), 5, 1).await.expect("node 5 holds a certificate of the CA");
    let err = handshake(&mut c, 2).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("node-2.kvmesh"), "{err:?}");
    let hello = pb::Frame {
        body: Some(pb::frame::Body::Hello(pb::StreamHello { node_id: 2, incarnation: 1 })),
        ..Default::default()
    };
    let err = c.exchange(tokio_stream::iter(vec![hello])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    let send = pb::SendRequest { node_id: 2, ..Default::default() };
    let err = c.send(send).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    let after = a.client().await.stats().await.unwrap().coherence.unwrap().peer_auth_refusals;
    assert_eq!(after, before + 3, "auth refusals {before} -> {after}");
    // Node 2's own certificate is accepted (the check is not refusing all).
    let mut c2 = peer_client(&addr, &certs, Some(&certs), 2, 1).await.unwrap();
    handshake(&mut c2, 2).await.expect("node 2's certificate names node 2");

    // The cluster still serves correct data.
    fill::put_until_stored(&a, KEY, b'z', Duration::from_secs(10)).await;
    assert_eq!(fill::get(&b, KEY).await, Some(b'z'));
    let _ = std::fs::remove_dir_all(&base);
}

/// `--check-config` loads the TLS files as start-up does (it used to
/// check only the config's text, so a missing key or another node's
/// certificate passed it and failed the start): each bad file is refused
/// with exit 2 and a line naming its field; the right files pass.
#[test]
fn check_config_loads_the_tls_files_as_start_up_does() {
    let base = std::env::temp_dir().join(format!("kvmesh-tls-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    kvmeshd::tls::make_certs(&base, &[1, 2], 1).unwrap();
    let garbage = base.join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    {
        // (Private as a key must be, so that what refuses it as one is its
        // content.)
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&garbage, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let (ca, garbage) = (base.join("ca.pem").display().to_string(), garbage.display().to_string());
    let ports = [free_port(), free_port()];
    let pools = pool("p", "4MiB", "4KiB");
    let check = |name: &str, text: String| {
        let path = base.join(format!("{name}.toml"));
        std::fs::write(&path, text).unwrap();
        let out = common::check_config(&path);
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let etcd = |tls: &str| {
        format!("[membership]\nkind = \"etcd\"\nendpoints = [\"https://127.0.0.1:1\"]\n[membership.tls]\n{tls}")
    };
    let client = |cert: &str, key: &str| format!("ca = {ca:?}\ncert = {cert:?}\nkey = {key:?}\n");
    let node2 = (base.join("node-2.pem").display().to_string(), base.join("node-2.key").display().to_string());
    let good = peer_config_tls(1, &ports, "sm", &pools, &tls_inline(&base, 1));
    // Node 1's key, readable by every user.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::copy(base.join("node-1.key"), base.join("open.key")).unwrap();
        std::fs::set_permissions(base.join("open.key"), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let (code, err) = check("good", good.clone() + &etcd(&client(&node2.0, &node2.1)));
    assert_eq!(code, Some(0), "the right files refused: {err}");
    let cases = [
        // Node 2's certificate in node 1's config.
        (
            peer_config_tls(1, &ports, "sm", &pools, &tls_inline(&base, 2)),
            "peer.tls.cert: the certificate does not name",
        ),
        (good.replace("node-1.key", "missing.key"), "peer.tls.key: "),
        (good.replace("node-1.key", "open.key"), "is open to other users (mode 644)"),
        (
            good.clone() + &etcd(&client(&node2.0, &base.join("open.key").display().to_string())),
            "is open to other users",
        ),
        (good.replace("ca.pem", "garbage.pem"), "peer.tls.ca: no PEM certificate"),
        (good.clone() + &etcd(&format!("ca = {garbage:?}\n")), "membership.tls.ca: no PEM certificate"),
        (good.clone() + &etcd(&client(&node2.0, &garbage)), "membership.tls.key: no PEM private key"),
        (good.clone() + &etcd(&client(&garbage, &node2.1)), "membership.tls.cert: no PEM certificate"),
        (good.clone() + &etcd("ca = \"/nonexistent/ca.pem\"\n"), "membership.tls.ca: /nonexistent/ca.pem: "),
    ];
    for (i, (text, want)) in cases.into_iter().enumerate() {
        let (code, err) = check(&format!("bad-{i}"), text);
        assert_eq!(code, Some(2), "case {i} ({want}) passed --check-config: {err}");
        assert!(err.starts_with("kvmeshd: ") && err.contains(want) && err.lines().count() == 1, "case {i}: {err:?}");
    }
    let _ = std::fs::remove_dir_all(&base);
}
