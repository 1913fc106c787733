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

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp, WatchOptions,
};
use kvmesh_coherence::membership::{KeepAlive, Membership, MembershipAction};
use kvmesh_coherence::{Member, NodeId, Time, View};
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
}

/// The driver-side half: hands keepalives to the etcd task.
pub struct EtcdMembership {
    tx: mpsc::Sender<u64>,
    status: Arc<EtcdStatus>,
}

/// The membership the driver talks to, the receiving end for [`run`], and
/// the shared status.
pub fn channel() -> (EtcdMembership, mpsc::Receiver<u64>, Arc<EtcdStatus>) {
    let (tx, rx) = mpsc::channel(PENDING_MAX);
    let status = Arc::new(EtcdStatus::default());
    (EtcdMembership { tx, status: Arc::clone(&status) }, rx, status)
}

impl Membership for EtcdMembership {
    fn keepalive(&mut self, ka: KeepAlive, _now: Time) -> Vec<MembershipAction> {
        if self.tx.try_send(ka.sent_at_us).is_err() {
            self.status.keepalives_dropped.fetch_add(1, Ordering::Relaxed);
        }
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
pub async fn run(s: EtcdSettings, mut kas: mpsc::Receiver<u64>, sink: Arc<dyn Sink>, status: Arc<EtcdStatus>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match session(&s, &mut kas, &*sink, &status).await {
            Ok(()) => return,
            Err(e) => {
                status.connected.store(false, Ordering::Relaxed);
                status.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    endpoints = ?s.endpoints,
                    "etcd membership: {e}; this daemon stops serving when its lease ends, retrying in {backoff:?}"
                );
            }
        }
        // Keepalives sent meanwhile will never be answered.
        while kas.try_recv().is_ok() {}
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Members as registered: id -> (incarnation, capacity, registration).
type Members = BTreeMap<NodeId, (u64, u32, i64)>;

/// The members and the view as this daemon's watch has seen them.
#[derive(Default)]
struct State {
    /// id -> (incarnation, capacity, registration).
    members: Members,
    /// The view key: its mod revision, epoch, members with registrations.
    view: Option<(i64, u64, Members)>,
    /// Highest epoch handed to the driver.
    delivered: u64,
}

impl State {
    fn apply(&mut self, s: &EtcdSettings, kv: &KeyValue, deleted: bool) {
        let key = String::from_utf8_lossy(kv.key());
        let Some(rest) = key.strip_prefix(&s.prefix) else { return };
        if rest == "/view" {
            self.view = if deleted {
                None
            } else {
                match parse_view(&String::from_utf8_lossy(kv.value())) {
                    Some((epoch, m)) => Some((kv.mod_revision(), epoch, m)),
                    None => {
                        tracing::error!(key = %key, "etcd membership: undecodable view; ignored");
                        self.view.take()
                    }
                }
            };
        } else if let Some(id) = rest.strip_prefix("/members/").and_then(|x| x.parse::<NodeId>().ok()) {
            if deleted {
                self.members.remove(&id);
            } else {
                let v = String::from_utf8_lossy(kv.value()).into_owned();
                let mut it = v.split_whitespace();
                match (it.next().and_then(|x| x.parse().ok()), it.next().and_then(|x| x.parse().ok())) {
                    (Some(inc), Some(cap)) => {
                        self.members.insert(id, (inc, cap, kv.mod_revision()));
                    }
                    _ => tracing::error!(key = %key, "etcd membership: undecodable member; ignored"),
                }
            }
        }
    }

    /// Hands a newer view to the driver.
    fn deliver(&mut self, sink: &dyn Sink) {
        if let Some((_, epoch, m)) = &self.view
            && *epoch > self.delivered
        {
            self.delivered = *epoch;
            sink.view(View {
                epoch: *epoch,
                members: m
                    .iter()
                    .map(|(&id, &(incarnation, capacity, _))| Member { id, incarnation, capacity })
                    .collect(),
            });
        }
    }

    /// Whether the current view lists this registration.
    fn admits(&self, me: NodeId, incarnation: u64, reg: i64) -> bool {
        self.view.as_ref().is_some_and(|(_, _, m)| m.get(&me).is_some_and(|&(i, _, r)| i == incarnation && r == reg))
    }

    /// Proposes the next view when the members differ from the view's.
    async fn propose(&self, s: &EtcdSettings, c: &mut Client) -> Result<(), etcd_client::Error> {
        let (rev, epoch) = match &self.view {
            Some((_, _, m)) if *m == self.members => return Ok(()),
            Some((rev, epoch, _)) => (*rev, *epoch),
            None => (0, 0),
        };
        let key = format!("{}/view", s.prefix);
        let txn = Txn::new().when([Compare::mod_revision(key.clone(), CompareOp::Equal, rev)]).and_then([TxnOp::put(
            key,
            format_view(epoch + 1, &self.members),
            None,
        )]);
        let r = c.txn(txn).await?;
        if r.succeeded() {
            tracing::info!(epoch = epoch + 1, members = ?self.members.keys().collect::<Vec<_>>(), "etcd membership: proposed a new view");
        }
        Ok(())
    }
}

fn format_view(epoch: u64, m: &Members) -> String {
    let members: Vec<String> = m.iter().map(|(id, (inc, cap, reg))| format!("{id}:{inc}:{cap}:{reg}")).collect();
    format!("{epoch} {}", members.join(","))
}

fn parse_view(s: &str) -> Option<(u64, Members)> {
    let mut it = s.splitn(2, ' ');
    let epoch = it.next()?.parse().ok()?;
    let mut m = BTreeMap::new();
    for e in it.next().unwrap_or("").split(',').filter(|e| !e.is_empty()) {
        let f: Vec<&str> = e.split(':').collect();
        if f.len() != 4 {
            return None;
        }
        m.insert(f[0].parse().ok()?, (f[1].parse().ok()?, f[2].parse().ok()?, f[3].parse().ok()?));
    }
    Some((epoch, m))
}

/// One session: a lease, the registration under it, a watch on the
/// prefix. `Ok` only when the driver went away.
async fn session(
    s: &EtcdSettings,
    kas: &mut mpsc::Receiver<u64>,
    sink: &dyn Sink,
    status: &EtcdStatus,
) -> Result<(), String> {
    let e = |what: &str| {
        let what = what.to_string();
        move |err: etcd_client::Error| format!("{what}: {err}")
    };
    let opts = ConnectOptions::new().with_connect_timeout(s.dial_timeout).with_timeout(s.dial_timeout);
    let mut c = tokio::time::timeout(s.dial_timeout, Client::connect(&s.endpoints, Some(opts)))
        .await
        .map_err(|_| "connect: timed out".to_string())?
        .map_err(e("connect"))?;
    let lease = c.lease_grant(s.ttl_s as i64, None).await.map_err(e("lease grant"))?.id();
    let member_key = format!("{}/members/{}", s.prefix, s.me);
    let value = format!("{} {} {}", s.incarnation, s.capacity, s.addr);
    let put = c.put(member_key, value, Some(PutOptions::new().with_lease(lease))).await.map_err(e("register"))?;
    let reg = put.header().map(|h| h.revision()).ok_or("register: no revision in the answer")?;
    let (mut keeper, mut answers) = c.lease_keep_alive(lease).await.map_err(e("lease keepalive"))?;
    // The first request is sent by `lease_keep_alive` itself.
    let mut pending: VecDeque<Option<u64>> = VecDeque::from([None]);
    let prefix = format!("{}/", s.prefix);
    let got = c.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await.map_err(e("read members"))?;
    let rev = got.header().map(|h| h.revision()).ok_or("read members: no revision in the answer")?;
    let mut st = State::default();
    for kv in got.kvs() {
        st.apply(s, kv, false);
    }
    let mut watch = c
        .watch(prefix, Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1)))
        .await
        .map_err(e("watch"))?;
    status.connected.store(true, Ordering::Relaxed);
    tracing::info!(lease, registration = reg, "etcd membership: registered");
    st.deliver(sink);
    st.propose(s, &mut c).await.map_err(e("propose view"))?;
    loop {
        tokio::select! {
            sent = kas.recv() => {
                let Some(sent) = sent else { return Ok(()) };
                if pending.len() >= PENDING_MAX {
                    status.keepalives_dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                keeper.keep_alive().await.map_err(e("lease keepalive"))?;
                pending.push_back(Some(sent));
            }
            a = answers.message() => {
                let a = a.map_err(e("lease keepalive"))?.ok_or("lease keepalive stream ended")?;
                let sent = pending.pop_front().flatten();
                if a.ttl() <= 0 {
                    return Err(format!("lease {lease} expired in etcd"));
                }
                if let Some(sent) = sent && st.admits(s.me, s.incarnation, reg) {
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
                        st.apply(s, kv, ev.event_type() == EventType::Delete);
                    }
                }
                if !st.members.get(&s.me).is_some_and(|&(i, _, r)| i == s.incarnation && r == reg) {
                    return Err("this daemon's registration is gone (lease expired)".into());
                }
                st.deliver(sink);
                st.propose(s, &mut c).await.map_err(e("propose view"))?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_round_trip_and_bad_ones_are_refused() {
        let m = BTreeMap::from([(1, (10, 1, 100)), (3, (30, 2, 105))]);
        let s = format_view(7, &m);
        assert_eq!(parse_view(&s), Some((7, m)));
        assert_eq!(parse_view("8 "), Some((8, BTreeMap::new())));
        for bad in ["", "x 1:1:1:1", "1 1:1:1", "1 a:1:1:1", "1 1:1:1:1:1"] {
            assert_eq!(parse_view(bad), None, "{bad:?}");
        }
    }
}
