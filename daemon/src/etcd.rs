//! etcd membership: every daemon registers under an etcd lease, and views
//! (with their epochs) live in etcd, so no daemon is a single point of
//! unavailability and epochs survive the restart of any daemon.
//!
//! Keys under `membership.key_prefix` (P):
//! - `P/members/<id>` = `"<incarnation> <capacity> <peer address>"`, put
//!   under this daemon's lease: it disappears when the lease expires (the
//!   daemon stopped refreshing it for `lease_ttl_s`). Its mod revision is
//!   the daemon's *registration*.
//! - `P/view` = `"<epoch> <id>:<incarnation>:<capacity>:<registration>,..."`,
//!   never leased. Any daemon whose watch shows a member set different
//!   from the view's proposes the next view (epoch + 1) with a transaction
//!   that succeeds only if `P/view` is unchanged since it read it, so views
//!   form one sequence and epochs only grow, whatever restarts.
//!
//! Why it is safe (M1): a view leaves a daemon out only when its member key
//! is gone, i.e. etcd expired its lease, `lease_ttl_s` after its last
//! refresh. The daemon's protocol lease runs from the send time of a
//! keepalive etcd answered, for `coherence.membership_lease_ms`, which the
//! configuration requires to be shorter than the TTL by twice the drift
//! margin: it has stopped serving before any view leaves it out. A daemon
//! acknowledges its core's keepalives only while the current view lists
//! its current registration: after its key expired (an etcd outage, a
//! partition from etcd), it serves again only once a view that re-admits it
//! exists, never in the view it was dropped from.
//!
//! The driver-side half ([`EtcdMembership`]) implements the sans-IO
//! `Membership` trait: keepalives go to the task ([`run`]) through a
//! bounded channel; acknowledgements and views come back through a
//! [`Sink`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp, WatchOptions,
};
use kvmesh_coherence::membership::{EtcdMember, KeepAlive, Membership, MembershipAction, etcd_member_value};
use kvmesh_coherence::{NodeId, Time, View};
use tokio::sync::mpsc;

/// Keepalives waiting for etcd's answer, at most.
const PENDING_MAX: usize = 64;

/// What the task needs to know.
#[derive(Clone, Debug)]
pub struct EtcdSettings {
    /// etcd endpoints.
    pub endpoints: Vec<String>,
    /// Key prefix.
    pub prefix: String,
    /// Lease TTL, seconds.
    pub ttl_s: u64,
    /// Connect and request deadline.
    pub dial_timeout: Duration,
    /// This daemon.
    pub me: NodeId,
    /// Its incarnation.
    pub incarnation: u64,
    /// Its capacity.
    pub capacity: u32,
    /// Its peer address (informational).
    pub addr: String,
    /// TLS to etcd, loaded at start (`None`: plaintext).
    pub tls: Option<etcd_client::TlsOptions>,
}

/// Loads `[membership.tls]`: the CA, the client certificate if any, the
/// name etcd's certificate must carry.
pub fn load_tls(t: &crate::config::EtcdTlsConfig) -> Result<etcd_client::TlsOptions, String> {
    let read = |name: &str, p: &std::path::Path| {
        std::fs::read(p).map_err(|e| format!("membership.tls.{name}: {}: {e}", p.display()))
    };
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    // PEM checked here, at start (and by `--check-config`): etcd's client
    // would only fail at the first dial, as a connection error.
    let certs = |name: &str, pem: &[u8]| match CertificateDer::pem_slice_iter(pem).next() {
        Some(Ok(_)) => Ok(()),
        _ => Err(format!("membership.tls.{name}: no PEM certificate in the file")),
    };
    let ca_path = t.ca.as_deref().ok_or("membership.tls.ca: not set")?;
    let ca = read("ca", ca_path)?;
    certs("ca", &ca)?;
    let mut o = etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(ca));
    if let (Some(c), Some(k)) = (&t.cert, &t.key) {
        let (cert, key) = (read("cert", c)?, crate::tls::read_private_key("membership.tls.key", k)?);
        certs("cert", &cert)?;
        if PrivateKeyDer::from_pem_slice(&key).is_err() {
            return Err("membership.tls.key: no PEM private key in the file".into());
        }
        o = o.identity(etcd_client::Identity::from_pem(cert, key));
    }
    if let Some(d) = &t.domain {
        o = o.domain_name(d.clone());
    }
    Ok(o)
}

/// Where the task delivers what etcd says.
pub trait Sink: Send + Sync + 'static {
    /// A view read from etcd.
    fn view(&self, view: View);
    /// etcd refreshed this daemon's lease for the keepalive sent at
    /// `sent_at` (and the current view lists this registration).
    fn ack(&self, sent_at: u64);
}

/// Health of the etcd session, for stats.
#[derive(Default)]
pub struct EtcdStatus {
    /// A session (lease, registration, watch) is up.
    pub connected: AtomicBool,
    /// Sessions that ended in an error (etcd unreachable, lease lost).
    pub errors: AtomicU64,
    /// Keepalives dropped because the task was behind.
    pub keepalives_dropped: AtomicU64,
    /// This daemon left (a drain): the task revoked its lease (or gave up
    /// trying) and ended; it never registers again.
    pub left: AtomicBool,
    /// Signalled when `left` is set.
    pub left_notify: tokio::sync::Notify,
}

/// What the driver asks of the etcd task.
#[derive(Debug)]
pub enum Cmd {
    /// Refresh the lease for the core's keepalive sent at this time.
    KeepAlive(u64),
    /// The core left the cluster: revoke the lease (the member key goes at
    /// once, so the next view leaves this daemon out without waiting out
    /// the TTL) and end for good.
    Leave,
}

/// The driver-side half: hands keepalives to the etcd task.
pub struct EtcdMembership {
    tx: mpsc::Sender<Cmd>,
    status: Arc<EtcdStatus>,
}

/// The membership the driver talks to, the receiving end for [`run`], and
/// the shared status.
pub fn channel() -> (EtcdMembership, mpsc::Receiver<Cmd>, Arc<EtcdStatus>) {
    let (tx, rx) = mpsc::channel(PENDING_MAX);
    let status = Arc::new(EtcdStatus::default());
    (EtcdMembership { tx, status: Arc::clone(&status) }, rx, status)
}

impl Membership for EtcdMembership {
    fn keepalive(&mut self, ka: KeepAlive, _now: Time) -> Vec<MembershipAction> {
        if self.tx.try_send(Cmd::KeepAlive(ka.sent_at_us)).is_err() {
            self.status.keepalives_dropped.fetch_add(1, Ordering::Relaxed);
        }
        Vec::new()
    }

    fn leave(&mut self, _node: NodeId, _incarnation: u64, _now: Time) -> Vec<MembershipAction> {
        let tx = self.tx.clone();
        // The channel may be full of keepalives: wait for room.
        tokio::spawn(async move {
            let _ = tx.send(Cmd::Leave).await;
        });
        Vec::new()
    }

    fn peer_keepalive(&mut self, _ka: KeepAlive, _now: Time) -> Vec<MembershipAction> {
        Vec::new()
    }

    fn tick(&mut self, _now: Time) -> Vec<MembershipAction> {
        Vec::new()
    }

    /// No daemon speaks for membership: acks and views from peers are
    /// dropped.
    fn coordinator(&self) -> NodeId {
        NodeId::MAX
    }
}

/// Runs sessions with etcd until the driver goes away, reconnecting with
/// backoff after every failure.
pub async fn run(s: EtcdSettings, mut kas: mpsc::Receiver<Cmd>, sink: Arc<dyn Sink>, status: Arc<EtcdStatus>) {
    let mut backoff = BACKOFF_MIN;
    let mut st = EtcdMember::new(s.me, s.incarnation);
    let leave = |status: &EtcdStatus| {
        status.connected.store(false, Ordering::Relaxed);
        status.left.store(true, Ordering::SeqCst);
        status.left_notify.notify_waiters();
    };
    loop {
        let r = session(&s, &mut st, &mut kas, &*sink, &status).await;
        st.end_session();
        match r {
            Ok(left) => {
                if left {
                    leave(&status);
                }
                return;
            }
            Err(e) => {
                // A session that was up starts the backoff over: one error
                // after an outage long past waits 100 ms, not the 2 s an
                // outage's retries reached (longer than the protocol lease,
                // so every copy would be dropped).
                let was_up = status.connected.swap(false, Ordering::Relaxed);
                backoff = next_backoff(backoff, was_up);
                status.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    endpoints = ?s.endpoints,
                    "etcd membership: {e}; this daemon stops serving when its lease ends, retrying in {backoff:?}"
                );
            }
        }
        // Keepalives sent meanwhile will never be answered; a leave ends
        // the task (no session: nothing to revoke), also one that comes
        // while it waits (it must not register again after a drain).
        let left = tokio::time::timeout(backoff, async {
            while let Some(cmd) = kas.recv().await {
                if matches!(cmd, Cmd::Leave) {
                    return true;
                }
            }
            false
        })
        .await;
        match left {
            Ok(true) => {
                leave(&status);
                return;
            }
            // The driver went away.
            Ok(false) => return,
            Err(_) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// The first wait before reconnecting to etcd.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// The longest wait before reconnecting to etcd.
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// The wait before the next session after one ended in an error: from
/// the start again when that session was up (registered), else the
/// current one (doubled after the wait).
fn next_backoff(current: Duration, was_up: bool) -> Duration {
    if was_up { BACKOFF_MIN } else { current }
}

/// Feeds one key of the prefix to the state machine.
fn apply(st: &mut EtcdMember, s: &EtcdSettings, kv: &KeyValue, deleted: bool) {
    let key = String::from_utf8_lossy(kv.key());
    let Some(rest) = key.strip_prefix(&s.prefix) else { return };
    if !st.apply(rest, &String::from_utf8_lossy(kv.value()), kv.mod_revision(), deleted) {
        tracing::error!(key = %key, "etcd membership: undecodable value; ignored");
    }
}

/// Proposes the next view when the registered members differ from the
/// view's (a transaction that loses to another daemon's changes nothing).
async fn propose(st: &EtcdMember, s: &EtcdSettings, c: &mut Client) -> Result<(), etcd_client::Error> {
    let Some((rev, epoch, value)) = st.proposal() else { return Ok(()) };
    let key = format!("{}/view", s.prefix);
    let txn = Txn::new()
        .when([Compare::mod_revision(key.clone(), CompareOp::Equal, rev)])
        .and_then([TxnOp::put(key, value, None)]);
    if c.txn(txn).await?.succeeded() {
        tracing::info!(epoch, "etcd membership: proposed a new view");
    }
    Ok(())
}

fn deliver(st: &mut EtcdMember, sink: &dyn Sink) {
    if let Some(v) = st.take_view() {
        sink.view(v);
    }
}

/// One session: a lease, the registration under it, a watch on the
/// prefix. `Ok(true)` after a leave (the lease revoked), `Ok(false)` when
/// the driver went away.
async fn session(
    s: &EtcdSettings,
    st: &mut EtcdMember,
    kas: &mut mpsc::Receiver<Cmd>,
    sink: &dyn Sink,
    status: &EtcdStatus,
) -> Result<bool, String> {
    let e = |what: &str| {
        let what = what.to_string();
        move |err: etcd_client::Error| format!("{what}: {err}")
    };
    let mut opts = ConnectOptions::new().with_connect_timeout(s.dial_timeout).with_timeout(s.dial_timeout);
    let endpoints: Vec<String> = match &s.tls {
        Some(t) => {
            opts = opts.with_tls(t.clone());
            // TLS needs https:// endpoints.
            s.endpoints.iter().map(|e| if e.contains("://") { e.clone() } else { format!("https://{e}") }).collect()
        }
        None => s.endpoints.clone(),
    };
    let mut c = tokio::time::timeout(s.dial_timeout, Client::connect(&endpoints, Some(opts)))
        .await
        .map_err(|_| "connect: timed out".to_string())?
        .map_err(e("connect"))?;
    let lease = c.lease_grant(s.ttl_s as i64, None).await.map_err(e("lease grant"))?.id();
    let member_key = format!("{}/members/{}", s.prefix, s.me);
    let value = etcd_member_value(s.incarnation, s.capacity, &s.addr);
    let put = c.put(member_key, value, Some(PutOptions::new().with_lease(lease))).await.map_err(e("register"))?;
    let reg = put.header().map(|h| h.revision()).ok_or("register: no revision in the answer")?;
    let (mut keeper, mut answers) = c.lease_keep_alive(lease).await.map_err(e("lease keepalive"))?;
    // Keepalives sent and not answered yet, in order (etcd answers them in
    // order on the stream): the core's send time, and when it went out.
    // The first request and its answer are `lease_keep_alive`'s own (it
    // reads that answer itself, etcd-client 0.18 `LeaseClient::keep_alive`),
    // so nothing is pending at first. (An entry for that first request
    // credited every later answer to the keepalive sent one interval
    // before the one it answered: safe, but each lease then ran from an
    // interval too early.)
    let mut pending: VecDeque<(u64, Instant)> = VecDeque::new();
    // A keepalive unanswered this long means a connection that stalled
    // without closing (a host gone, packets dropped): etcd has expired the
    // lease by then anyway, and without this the session would wait for
    // TCP to give up (many minutes) before reconnecting.
    let stall = Duration::from_secs(s.ttl_s.max(1));
    let prefix = format!("{}/", s.prefix);
    let got = c.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await.map_err(e("read members"))?;
    let rev = got.header().map(|h| h.revision()).ok_or("read members: no revision in the answer")?;
    st.start_session(reg);
    for kv in got.kvs() {
        apply(st, s, kv, false);
    }
    let mut watch = c
        .watch(prefix, Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1)))
        .await
        .map_err(e("watch"))?;
    status.connected.store(true, Ordering::Relaxed);
    tracing::info!(lease, registration = reg, "etcd membership: registered");
    deliver(st, sink);
    propose(st, s, &mut c).await.map_err(e("propose view"))?;
    loop {
        tokio::select! {
            cmd = kas.recv() => {
                let sent = match cmd {
                    None => return Ok(false),
                    Some(Cmd::KeepAlive(sent)) => sent,
                    Some(Cmd::Leave) => {
                        match tokio::time::timeout(s.dial_timeout, c.lease_revoke(lease)).await {
                            Ok(Ok(_)) => tracing::info!(lease, "etcd membership: left (lease revoked, member key deleted)"),
                            Ok(Err(err)) => tracing::warn!(lease, "etcd membership: revoke failed ({err}); the member key goes when the lease expires"),
                            Err(_) => tracing::warn!(lease, "etcd membership: revoke timed out; the member key goes when the lease expires"),
                        }
                        return Ok(true);
                    }
                };
                if let Some((_, at)) = pending.front() && at.elapsed() > stall {
                    return Err(format!(
                        "etcd answered no keepalive for {:?} (the lease TTL): the connection stalled",
                        at.elapsed()
                    ));
                }
                if pending.len() >= PENDING_MAX {
                    status.keepalives_dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                keeper.keep_alive().await.map_err(e("lease keepalive"))?;
                pending.push_back((sent, Instant::now()));
            }
            a = answers.message() => {
                let a = a.map_err(e("lease keepalive"))?.ok_or("lease keepalive stream ended")?;
                let sent = pending.pop_front().map(|p| p.0);
                if a.ttl() <= 0 {
                    return Err(format!("lease {lease} expired in etcd"));
                }
                if let Some(sent) = sent && st.admits() {
                    sink.ack(sent);
                }
            }
            w = watch.message() => {
                let w = w.map_err(e("watch"))?.ok_or("watch stream ended")?;
                if w.canceled() {
                    return Err(format!("watch canceled: {}", w.cancel_reason()));
                }
                for ev in w.events() {
                    if let Some(kv) = ev.kv() {
                        apply(st, s, kv, ev.event_type() == EventType::Delete);
                    }
                }
                if st.registration_lost() {
                    return Err("this daemon's registration is gone (lease expired)".into());
                }
                deliver(st, sink);
                propose(st, s, &mut c).await.map_err(e("propose view"))?;
            }
        }
    }
}
