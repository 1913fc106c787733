//! Mutual TLS between daemons: who a peer is.
//!
//! Every daemon has a certificate signed by the cluster's CA whose subject
//! alternative names include `node-<id>.kvmesh` ([`node_name`]). A daemon
//! that connects checks the server names the node id its config lists at
//! that address (rustls, through tonic); a daemon that serves requires a
//! client certificate from the same CA and checks, on every call that
//! names a node id (handshake, coherence stream hello, the `Send` RPC),
//! that the certificate names that id ([`check_peer`]); `ListKeys` needs a
//! certificate naming some configured peer. So a process without a
//! certificate of the CA gets no connection, and one with the certificate
//! of node 5 cannot speak as node 2 (PERMISSION_DENIED, counted in
//! `coherence_peer_auth_refusals`). Send orders over UCX active messages
//! carry no identity of their own (docs/SECURITY.md says what bounds them).
//! The CA must be kvmesh's own: any certificate it signs for a
//! `node-<id>.kvmesh` name is that node.
//!
//! [`make_certs`] is `kvmesh certs`: a CA and node certificates for tests
//! and small clusters.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use tonic::{Request, Status};

use crate::config::PeerTlsConfig;

/// The DNS name a daemon's certificate carries for node `id`.
pub fn node_name(id: u32) -> String {
    format!("node-{id}.kvmesh")
}

/// Whether DER certificate `der` is valid for node `id`'s name (the chain
/// to the CA is rustls's job, done before any call arrives).
pub fn cert_names_node(der: &[u8], id: u32) -> bool {
    let der = CertificateDer::from(der);
    let Ok(cert) = webpki::EndEntityCert::try_from(&der) else { return false };
    let Ok(name) = ServerName::try_from(node_name(id)) else { return false };
    cert.verify_is_valid_for_subject_name(&name).is_ok()
}

/// This daemon's TLS material, loaded once at start.
pub struct PeerTls {
    ca: Certificate,
    identity: Identity,
    /// Calls refused because the certificate did not name the node.
    pub refusals: AtomicU64,
}

/// Reads the private key `field` at `p`, refused when any user may read or
/// write it (mode bits for others: anyone on the host could then act as
/// this node), with a warning when its group may.
pub fn read_private_key(field: &str, p: &std::path::Path) -> Result<Vec<u8>, String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(p).map_err(|e| format!("{field}: {}: {e}", p.display()))?.permissions().mode();
    if mode & 0o007 != 0 {
        return Err(format!(
            "{field}: {} is open to other users (mode {:o}): anyone on this host could act as this node; \
             chmod 600 it",
            p.display(),
            mode & 0o777
        ));
    }
    if mode & 0o070 != 0 {
        tracing::warn!(
            "{field}: {} is readable by its group (mode {:o}); 600 keeps it to this user",
            p.display(),
            mode & 0o777
        );
    }
    std::fs::read(p).map_err(|e| format!("{field}: {}: {e}", p.display()))
}

impl PeerTls {
    /// Loads `cfg` for node `id`: `None` when TLS is off. Checks that the
    /// certificate names this node (a daemon started with another node's
    /// certificate would be refused by every peer).
    pub fn load(cfg: &PeerTlsConfig, id: u32) -> Result<Option<PeerTls>, String> {
        if !cfg.required() {
            return Ok(None);
        }
        let read = |name: &str, p: &Option<PathBuf>| -> Result<Vec<u8>, String> {
            let p = p.as_ref().ok_or_else(|| format!("peer.tls.{name}: not set"))?;
            std::fs::read(p).map_err(|e| format!("peer.tls.{name}: {}: {e}", p.display()))
        };
        let key_path = cfg.key.as_ref().ok_or("peer.tls.key: not set")?;
        let (ca, cert, key) =
            (read("ca", &cfg.ca)?, read("cert", &cfg.cert)?, read_private_key("peer.tls.key", key_path)?);
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("peer.tls.cert: not PEM certificates: {e}"))?;
        let Some(leaf) = certs.first() else { return Err("peer.tls.cert: no certificate in the file".into()) };
        if !cert_names_node(leaf, id) {
            return Err(format!(
                "peer.tls.cert: the certificate does not name this node ({}): peers would refuse it",
                node_name(id)
            ));
        }
        if CertificateDer::pem_slice_iter(&ca).next().is_none() {
            return Err("peer.tls.ca: no PEM certificate in the file".into());
        }
        if rustls_pki_types::PrivateKeyDer::from_pem_slice(&key).is_err() {
            return Err("peer.tls.key: no PEM private key in the file".into());
        }
        Ok(Some(PeerTls {
            ca: Certificate::from_pem(ca),
            identity: Identity::from_pem(cert, key),
            refusals: AtomicU64::new(0),
        }))
    }

    /// The peer service's side: this daemon's certificate, and a client
    /// certificate of the CA required of every caller.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
            .timeout(crate::dataplane::CONTROL_TIMEOUT)
    }

    /// The side that connects to node `peer`: the server must be that node.
    pub fn client_config(&self, peer: u32) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .identity(self.identity.clone())
            .domain_name(node_name(peer))
    }
}

/// The URL scheme of a peer address.
pub fn scheme(tls: Option<&PeerTls>) -> &'static str {
    if tls.is_some() { "https" } else { "http" }
}

/// Refuses a call that claims to come from node `id` unless its TLS
/// client certificate names that node (nothing to check with TLS off).
pub fn check_peer<T>(tls: Option<&PeerTls>, req: &Request<T>, id: u32) -> Result<(), Status> {
    check_certs(tls, req.peer_certs().as_deref().map(Vec::as_slice), id)
}

/// [`check_peer`] on certificates taken from a request earlier (a stream
/// names its node in its first frame).
pub fn check_certs(tls: Option<&PeerTls>, certs: Option<&[CertificateDer<'static>]>, id: u32) -> Result<(), Status> {
    let Some(t) = tls else { return Ok(()) };
    let ok = certs.is_some_and(|c| c.first().is_some_and(|leaf| cert_names_node(leaf, id)));
    if ok {
        return Ok(());
    }
    t.refusals.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(claimed = id, "peer: a call claiming node {id} refused: its TLS certificate does not name it");
    Err(Status::permission_denied(format!("the TLS client certificate does not name node {id} ({})", node_name(id))))
}

/// Makes a CA (or reuses the one in `dir`) and a certificate and key for
/// each of `nodes`, valid for `days`: `ca.pem`, `ca.key`, `node-<id>.pem`,
/// `node-<id>.key`. Keys are written with mode 0600. Returns the files
/// written.
pub fn make_certs(dir: &Path, nodes: &[u32], days: u32) -> Result<Vec<PathBuf>, String> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let err = |e: rcgen::Error| e.to_string();
    if days == 0 || days > 36_500 {
        return Err(format!("--days {days}: expected 1 to 36500"));
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let now = time::OffsetDateTime::now_utc();
    let mut written = Vec::new();
    let ca_params = || {
        let mut p = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        p.distinguished_name.push(DnType::CommonName, "kvmesh cluster CA");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        p.not_before = now - time::Duration::hours(1);
        p.not_after = now + time::Duration::days(i64::from(days));
        Ok::<_, String>(p)
    };
    let (ca_pem, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
    if ca_pem.exists() != ca_key.exists() {
        // Never replace a CA silently: certificates of a new one would not
        // be trusted by the daemons that have the old ca.pem.
        return Err(format!(
            "{} holds {} without {}: put the CA's key back (or remove both to make a new CA)",
            dir.display(),
            if ca_pem.exists() { "ca.pem" } else { "ca.key" },
            if ca_pem.exists() { "ca.key" } else { "ca.pem" }
        ));
    }
    let ca_key_pair = if ca_pem.exists() && ca_key.exists() {
        // Reuse the CA: node certificates chain to it through its name
        // and key, which are all an issuer needs.
        let pem = std::fs::read_to_string(&ca_key).map_err(|e| format!("{}: {e}", ca_key.display()))?;
        KeyPair::from_pem(&pem).map_err(|e| format!("{}: {e}", ca_key.display()))?
    } else {
        let k = KeyPair::generate().map_err(err)?;
        let cert = ca_params()?.self_signed(&k).map_err(err)?;
        write(&ca_pem, cert.pem().as_bytes(), false)?;
        write(&ca_key, k.serialize_pem().as_bytes(), true)?;
        written.extend([ca_pem.clone(), ca_key]);
        k
    };
    let issuer = Issuer::new(ca_params()?, ca_key_pair);
    // Every certificate is checked against ca.pem as the daemons will check
    // it (a reused ca.key that is not that CA's key would only show as
    // refused handshakes) before anything is written. (The CA's own
    // validity period is not checked, here or by the daemons: rustls takes
    // ca.pem as a trust anchor, whose dates it does not read.)
    let ca_der = {
        let pem = std::fs::read(&ca_pem).map_err(|e| format!("{}: {e}", ca_pem.display()))?;
        CertificateDer::from_pem_slice(&pem).map_err(|e| format!("{}: {e}", ca_pem.display()))?
    };
    let anchor = webpki::anchor_from_trusted_cert(&ca_der).map_err(|e| format!("{}: {e}", ca_pem.display()))?;
    let unix = rustls_pki_types::UnixTime::since_unix_epoch(std::time::Duration::from_secs(
        now.unix_timestamp().max(0) as u64,
    ));
    let mut made = Vec::new();
    for &id in nodes {
        let mut p = CertificateParams::new(vec![node_name(id)]).map_err(err)?;
        p.distinguished_name.push(DnType::CommonName, node_name(id));
        p.not_before = now - time::Duration::hours(1);
        p.not_after = now + time::Duration::days(i64::from(days));
        let k = KeyPair::generate().map_err(err)?;
        let cert = p.signed_by(&k, &issuer).map_err(err)?;
        let leaf = webpki::EndEntityCert::try_from(cert.der()).map_err(|e| format!("node {id}: {e}"))?;
        leaf.verify_for_usage(
            CA_ALGS,
            std::slice::from_ref(&anchor),
            &[],
            unix,
            webpki::KeyUsage::server_auth(),
            None,
            None,
        )
        .map_err(|e| {
            format!(
                "{}: a certificate signed with ca.key does not verify against ca.pem ({e:?}): ca.key is not \
                 that CA's key, or ca.pem was not made by `kvmesh certs`; put the CA's own key back (or remove \
                 both to make a new CA)",
                dir.display()
            )
        })?;
        made.push((id, cert.pem(), k.serialize_pem()));
    }
    for (id, cert, key) in made {
        let (c, kf) = (dir.join(format!("node-{id}.pem")), dir.join(format!("node-{id}.key")));
        write(&c, cert.as_bytes(), false)?;
        write(&kf, key.as_bytes(), true)?;
        written.extend([c, kf]);
    }
    Ok(written)
}

/// Signature algorithms a CA made by `make_certs` (rcgen's default, ECDSA
/// P-256) or another common one may sign with.
static CA_ALGS: &[&dyn rustls_pki_types::SignatureVerificationAlgorithm] = &[
    webpki::ring::ECDSA_P256_SHA256,
    webpki::ring::ECDSA_P384_SHA384,
    webpki::ring::ED25519,
    webpki::ring::RSA_PKCS1_2048_8192_SHA256,
];

fn write(p: &Path, data: &[u8], secret: bool) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::fs::PermissionsExt;
    let mode = if secret { 0o600 } else { 0o644 };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(p)
        .map_err(|e| format!("{}: {e}", p.display()))?;
    // An existing file keeps its mode on open: set it (before the bytes).
    f.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(|e| format!("{}: {e}", p.display()))?;
    f.write_all(data).map_err(|e| format!("{}: {e}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_certificates_name_their_node_only() {
        let dir = std::env::temp_dir().join(format!("kvmesh-tls-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        make_certs(&dir, &[1, 2], 1).unwrap();
        // A second call reuses the CA.
        let w = make_certs(&dir, &[3], 1).unwrap();
        assert!(!w.iter().any(|p| p.ends_with("ca.pem")), "CA reused: {w:?}");
        for id in [1u32, 3] {
            let pem = std::fs::read(dir.join(format!("node-{id}.pem"))).unwrap();
            let der = CertificateDer::from_pem_slice(&pem).unwrap();
            assert!(cert_names_node(&der, id));
            assert!(!cert_names_node(&der, id + 1));
            let cfg = PeerTlsConfig {
                mode: Some("required".into()),
                ca: Some(dir.join("ca.pem")),
                cert: Some(dir.join(format!("node-{id}.pem"))),
                key: Some(dir.join(format!("node-{id}.key"))),
            };
            assert!(PeerTls::load(&cfg, id).unwrap().is_some());
            let e = PeerTls::load(&cfg, 9).err().expect("another node's certificate");
            assert!(e.contains("node-9.kvmesh"), "{e}");
        }
        let mode = std::fs::metadata(dir.join("node-1.key")).unwrap().permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
        // A key that is not the CA's: refused, and nothing written.
        let other = dir.join("other");
        make_certs(&other, &[1], 1).unwrap();
        let kept_ca_key = std::fs::read(dir.join("ca.key")).unwrap();
        std::fs::copy(other.join("ca.key"), dir.join("ca.key")).unwrap();
        let e = make_certs(&dir, &[5], 1).unwrap_err();
        assert!(e.contains("does not verify against ca.pem"), "{e}");
        assert!(!dir.join("node-5.pem").exists());
        std::fs::write(dir.join("ca.key"), kept_ca_key).unwrap();
        make_certs(&dir, &[5], 1).unwrap();
        // A CA certificate without its key is never replaced.
        std::fs::remove_file(dir.join("ca.key")).unwrap();
        let e = make_certs(&dir, &[4], 1).unwrap_err();
        assert!(e.contains("ca.pem without ca.key"), "{e}");
        assert!(make_certs(&dir, &[4], 0).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
