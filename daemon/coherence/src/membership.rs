//! Membership: who is in the cluster, as the coherence core needs it — a
//! view (epoch, members with incarnations) and acknowledgements of a node's
//! keepalives (its lease runs from the send time of the last acknowledged
//! one).
//!
//! [`Membership`] is the interface a driver (the daemon's `cluster.rs`, or
//! the simulator) talks to, sans-IO like the core: it is handed keepalives
//! and time (microseconds on the local clock), and answers with
//! [`MembershipAction`]s the driver carries out (forward a keepalive,
//! acknowledge one, persist an epoch, publish a view). The static
//! implementation ([`static_membership`]) is a coordinator on one configured
//! daemon and forwarding on the others. The daemon and the simulator run
//! this same code, so the simulator checks the membership as implemented.
//!
//! Why a restarted coordinator is safe (invariant M1): it cannot know which
//! leases its previous incarnation granted, so it grants none and publishes
//! no view until `removal` (lease + twice the drift margin) has passed on
//! its clock since it started: by then every lease granted before the crash
//! has run out on its holder's clock, and every holder has dropped its
//! copies. Meanwhile it listens to keepalives (which report the highest
//! epoch each member saw); its first view continues above the highest of
//! those and above the epoch it persisted before every publish
//! ([`MembershipAction::Persist`]), so epochs never go backwards.

use std::collections::BTreeMap;

use crate::{Member, NodeId, Time, View};

/// A keepalive: the sender, its incarnation, its send time (on its own
/// clock, echoed in the acknowledgement), the highest epoch it has seen and
/// its capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeepAlive {
    /// Sender.
    pub node: NodeId,
    /// Its incarnation.
    pub incarnation: u64,
    /// Its clock when sent (microseconds).
    pub sent_at_us: u64,
    /// Highest epoch it saw (a restarted coordinator continues above it).
    pub epoch_seen: u64,
    /// Weight in placing keys' homes.
    pub capacity: u32,
}

/// What the driver must do for the membership service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipAction {
    /// Deliver this node's keepalive to `to` (the coordinator).
    Forward {
        /// Destination.
        to: NodeId,
        /// The keepalive.
        ka: KeepAlive,
    },
    /// Tell `to` that its keepalive sent at `sent_at_us` is acknowledged,
    /// with the current view.
    Ack {
        /// Destination.
        to: NodeId,
        /// Echoed send time.
        sent_at_us: u64,
        /// Current view.
        view: View,
    },
    /// This node's own keepalive is acknowledged (feed the core
    /// `KeepAliveAck`).
    AckLocal {
        /// Echoed send time.
        sent_at_us: u64,
    },
    /// Store this epoch durably before carrying out the actions after it
    /// (it always precedes the `Publish` of that epoch): a restarted
    /// coordinator starts above it.
    Persist(u64),
    /// A new view: feed it to the local core and send it to the other
    /// members.
    Publish(View),
    /// Tell the coordinator `to` that `node` (this daemon, incarnation
    /// `incarnation`) left the cluster and serves nothing any more.
    ForwardLeave {
        /// Destination.
        to: NodeId,
        /// The daemon that left.
        node: NodeId,
        /// Its incarnation.
        incarnation: u64,
    },
}

/// A membership service as a driver sees it. Times are microseconds on the
/// local clock.
pub trait Membership: Send {
    /// This node's keepalive.
    fn keepalive(&mut self, ka: KeepAlive, now: Time) -> Vec<MembershipAction>;
    /// A keepalive another daemon sent to this one.
    fn peer_keepalive(&mut self, ka: KeepAlive, now: Time) -> Vec<MembershipAction>;
    /// Time passed (failure detection, end of the restart wait).
    fn tick(&mut self, now: Time) -> Vec<MembershipAction>;
    /// The daemon that answers keepalives.
    fn coordinator(&self) -> NodeId;
    /// Whether this service still withholds leases and views after a
    /// (re)start.
    fn recovering(&self) -> bool {
        false
    }
    /// Keepalives of a new incarnation ignored because the node's last one
    /// was admitted less than the removal time ago (a crash loop, or a
    /// member naming a new incarnation in every keepalive).
    fn incarnations_held_back(&self) -> u64 {
        0
    }
    /// This daemon left the cluster: call only once its core has handled
    /// `Event::Leave` (it serves nothing any more), so that a view without
    /// it never finds it serving (M1). Asks for its removal now instead of
    /// after the removal time. The coordinator itself cannot leave: it
    /// answers nothing here, and its members stop serving when their
    /// leases lapse, as after a crash.
    fn leave(&mut self, _node: NodeId, _incarnation: u64, _now: Time) -> Vec<MembershipAction> {
        Vec::new()
    }
    /// Another daemon says it left (the coordinator removes it at once).
    fn peer_leave(&mut self, _node: NodeId, _incarnation: u64, _now: Time) -> Vec<MembershipAction> {
        Vec::new()
    }
}

/// Settings of the static membership.
#[derive(Clone, Copy, Debug)]
pub struct StaticConfig {
    /// This node.
    pub me: NodeId,
    /// The node that answers keepalives.
    pub coordinator: NodeId,
    /// A member silent this long is removed; also how long a (re)started
    /// coordinator waits before its first lease and view (lease + twice the
    /// drift margin).
    pub removal_us: u64,
    /// Highest epoch a previous incarnation persisted (0 if none).
    pub epoch_floor: u64,
    /// Planted bug: a restarted coordinator serves at once (no wait).
    pub skip_restart_wait: bool,
    /// Planted bug: the coordinator takes a member's capacity from every
    /// keepalive, not from the first of its incarnation.
    pub take_capacity_changes: bool,
    /// Planted bug: the coordinator admits every new incarnation of a node
    /// at once, however soon after the last.
    pub admit_every_incarnation: bool,
}

/// Static membership: `coordinator` answers keepalives; a member silent for
/// `removal_us` is removed from the view. `now` is the local clock at start.
pub fn static_membership(cfg: StaticConfig, now: Time) -> Box<dyn Membership> {
    if cfg.me == cfg.coordinator {
        Box::new(Coordinator::new(cfg, now))
    } else {
        Box::new(Forwarder { coordinator: cfg.coordinator })
    }
}

/// A daemon that is not the coordinator: forwards its keepalives.
struct Forwarder {
    coordinator: NodeId,
}

impl Membership for Forwarder {
    fn keepalive(&mut self, ka: KeepAlive, _now: Time) -> Vec<MembershipAction> {
        vec![MembershipAction::Forward { to: self.coordinator, ka }]
    }

    fn peer_keepalive(&mut self, _ka: KeepAlive, _now: Time) -> Vec<MembershipAction> {
        Vec::new()
    }

    fn tick(&mut self, _now: Time) -> Vec<MembershipAction> {
        Vec::new()
    }

    fn coordinator(&self) -> NodeId {
        self.coordinator
    }

    fn leave(&mut self, node: NodeId, incarnation: u64, _now: Time) -> Vec<MembershipAction> {
        vec![MembershipAction::ForwardLeave { to: self.coordinator, node, incarnation }]
    }
}

/// The coordinator: grants leases, detects silent members, publishes views.
pub struct Coordinator {
    me: NodeId,
    epoch: u64,
    /// Members heard from: incarnation, capacity, last keepalive (local
    /// clock).
    members: BTreeMap<NodeId, (u64, u32, Time)>,
    removal_us: u64,
    /// No lease and no view before this time (local clock).
    recover_until: Option<Time>,
    /// Daemons that left: incarnation and when (local clock). Their
    /// keepalives still in flight must not bring them back; kept for the
    /// removal time (one entry per node at most).
    departed: BTreeMap<NodeId, (u64, Time)>,
    /// The incarnation of each node admitted last, and when (local clock),
    /// kept for the removal time: another incarnation of the node is
    /// admitted only once that time has passed since.
    admitted: BTreeMap<NodeId, (u64, Time)>,
    /// Keepalives ignored by that rule.
    held_back: u64,
    /// Planted bug (`StaticConfig::take_capacity_changes`).
    take_capacity_changes: bool,
    /// Planted bug (`StaticConfig::admit_every_incarnation`).
    admit_every_incarnation: bool,
}

impl Coordinator {
    /// A coordinator starting at `now`, above `cfg.epoch_floor`.
    pub fn new(cfg: StaticConfig, now: Time) -> Coordinator {
        Coordinator {
            me: cfg.me,
            epoch: cfg.epoch_floor,
            members: BTreeMap::new(),
            removal_us: cfg.removal_us,
            recover_until: (!cfg.skip_restart_wait).then_some(now + cfg.removal_us),
            departed: BTreeMap::new(),
            admitted: BTreeMap::new(),
            held_back: 0,
            take_capacity_changes: cfg.take_capacity_changes,
            admit_every_incarnation: cfg.admit_every_incarnation,
        }
    }

    /// The current view.
    pub fn view(&self) -> View {
        View {
            epoch: self.epoch,
            members: self
                .members
                .iter()
                .map(|(&id, &(incarnation, capacity, _))| Member { id, incarnation, capacity })
                .collect(),
        }
    }

    /// Ends the restart wait when it is over; true when it just ended.
    fn end_wait(&mut self, now: Time) -> bool {
        match self.recover_until {
            Some(t) if now >= t => {
                self.recover_until = None;
                // Only members heard within the removal time.
                let removal = self.removal_us;
                self.members.retain(|_, m| now.saturating_sub(m.2) <= removal);
                // Listed from now on: each member's incarnation counts as
                // admitted now (the first view), not when first heard.
                self.admitted = self.members.iter().map(|(&id, m)| (id, (m.0, now))).collect();
                true
            }
            _ => false,
        }
    }

    fn publish(&mut self, out: &mut Vec<MembershipAction>) {
        if self.epoch >= crate::EPOCH_MAX {
            // Unreachable for an honest cluster (4 billion views); never
            // wrap: the view stays as it is.
            return;
        }
        self.epoch += 1;
        out.push(MembershipAction::Persist(self.epoch));
        out.push(MembershipAction::Publish(self.view()));
    }

    /// Records a keepalive; true when the view changed, `None` when it is
    /// ignored: a keepalive from an older incarnation of a live member (a
    /// process that is gone, its keepalive delayed) must not bring it back.
    /// Incarnations grow with each start of a daemon; an older one is
    /// admitted again only once the newer has been silent for the removal
    /// time (a daemon whose clock stepped back still rejoins).
    ///
    /// A node gets at most one new incarnation admitted per removal time,
    /// whether it replaces a live one, follows a leave, or comes back
    /// after silence: each admission is a view, and every view clears and
    /// rebuilds every directory in the cluster, so a member naming a new
    /// incarnation in every keepalive (buggy or hostile), or leaving and
    /// rejoining in a loop, must not make this coordinator publish a view
    /// per keepalive. An honest daemon restarted within the removal time
    /// of its last admission waits out the rest of it; until then the
    /// view still lists the old incarnation, which serves nothing (as
    /// after a crash not yet detected, which takes as long).
    fn record(&mut self, ka: &KeepAlive, now: Time) -> Option<bool> {
        if let Some(&(inc, at)) = self.departed.get(&ka.node)
            && ka.incarnation <= inc
            && now.saturating_sub(at) <= self.removal_us
        {
            return None;
        }
        if let Some(m) = self.members.get(&ka.node)
            && ka.incarnation < m.0
            && now.saturating_sub(m.2) <= self.removal_us
        {
            return None;
        }
        if let Some(&(inc, at)) = self.admitted.get(&ka.node)
            && inc != ka.incarnation
            && now.saturating_sub(at) < self.removal_us
            && !self.admit_every_incarnation
        {
            self.held_back += 1;
            return None;
        }
        if self.admitted.get(&ka.node).is_none_or(|a| a.0 != ka.incarnation) {
            self.admitted.insert(ka.node, (ka.incarnation, now));
        }
        // A member's capacity is that of the first keepalive of its
        // incarnation: it changes only with a restart (`coherence.capacity`
        // is not reloadable), and a member naming another one in every
        // keepalive (buggy or hostile) must not make this coordinator
        // publish a view per keepalive — every view clears and rebuilds
        // every directory in the cluster.
        let capacity = match self.members.get(&ka.node) {
            Some(m) if m.0 == ka.incarnation && !self.take_capacity_changes => m.1,
            _ => ka.capacity.max(1),
        };
        let mut changed = self.members.get(&ka.node).is_none_or(|m| m.0 != ka.incarnation || m.1 != capacity);
        if ka.epoch_seen > self.epoch && ka.epoch_seen <= EPOCH_SEEN_MAX {
            // A member saw a later epoch than this coordinator knows (it
            // restarted without its persisted epoch): continue above it.
            // Only up to half the epoch space: an honest cluster never gets
            // there, and a lie cannot use up the epochs (no further view).
            self.epoch = ka.epoch_seen;
            changed = true;
        }
        self.members.insert(ka.node, (ka.incarnation, capacity, now));
        Some(changed)
    }

    fn on_keepalive(&mut self, ka: KeepAlive, now: Time, local: bool) -> Vec<MembershipAction> {
        let mut out = Vec::new();
        let ended = self.end_wait(now);
        let Some(changed) = self.record(&ka, now) else {
            if ended {
                self.publish(&mut out);
            }
            return out;
        };
        if self.recover_until.is_some() {
            // Still waiting out the previous incarnation's leases: listen only.
            return out;
        }
        if changed || ended {
            self.publish(&mut out);
        }
        if local {
            out.push(MembershipAction::AckLocal { sent_at_us: ka.sent_at_us });
        } else {
            out.push(MembershipAction::Ack { to: ka.node, sent_at_us: ka.sent_at_us, view: self.view() });
        }
        out
    }
}

impl Membership for Coordinator {
    fn keepalive(&mut self, ka: KeepAlive, now: Time) -> Vec<MembershipAction> {
        self.on_keepalive(ka, now, true)
    }

    fn peer_keepalive(&mut self, ka: KeepAlive, now: Time) -> Vec<MembershipAction> {
        self.on_keepalive(ka, now, false)
    }

    fn tick(&mut self, now: Time) -> Vec<MembershipAction> {
        let mut out = Vec::new();
        if self.end_wait(now) {
            self.publish(&mut out);
            return out;
        }
        if self.recover_until.is_some() {
            return out;
        }
        let before = self.members.len();
        let (removal, me) = (self.removal_us, self.me);
        self.members.retain(|&id, m| id == me || now.saturating_sub(m.2) <= removal);
        self.departed.retain(|_, d| now.saturating_sub(d.1) <= removal);
        self.admitted.retain(|_, a| now.saturating_sub(a.1) < removal);
        if self.members.len() != before {
            self.publish(&mut out);
        }
        out
    }

    fn coordinator(&self) -> NodeId {
        self.me
    }

    fn peer_leave(&mut self, node: NodeId, incarnation: u64, now: Time) -> Vec<MembershipAction> {
        let mut out = Vec::new();
        if node == self.me {
            return out;
        }
        // Only the incarnation that left: a newer one is a restarted
        // daemon that serves (or will) and stays.
        let d = self.departed.entry(node).or_insert((incarnation, now));
        if incarnation >= d.0 {
            *d = (incarnation, now);
        }
        if self.members.get(&node).is_some_and(|m| m.0 == incarnation) {
            self.members.remove(&node);
            if self.recover_until.is_none() {
                self.publish(&mut out);
            }
        }
        out
    }

    fn recovering(&self) -> bool {
        self.recover_until.is_some()
    }

    fn incarnations_held_back(&self) -> u64 {
        self.held_back
    }
}

/// Members registered in etcd: id -> (incarnation, capacity, registration
/// = mod revision of the member key).
pub type EtcdMembers = BTreeMap<NodeId, (u64, u32, i64)>;

/// The etcd membership of one daemon as a state machine (the IO — leases,
/// keepalives, watch, transactions — is the driver's: the daemon's
/// `etcd.rs`, or the simulator's etcd model). Keys are relative to the
/// cluster's prefix: `/members/<id>` (value [`etcd_member_value`], under
/// the daemon's lease; its mod revision is the daemon's registration) and
/// `/view` (value [`format_etcd_view`], replaced only by a transaction that
/// compares its mod revision: views form one sequence and epochs only
/// grow). See `docs/COHERENCE.md`.
#[derive(Clone, Debug)]
pub struct EtcdMember {
    me: NodeId,
    incarnation: u64,
    /// This session's registration.
    reg: Option<i64>,
    members: EtcdMembers,
    /// The view key: mod revision, epoch, members.
    view: Option<(i64, u64, EtcdMembers)>,
    /// Highest epoch handed to the core.
    delivered: u64,
}

/// The core's view of an etcd view's members.
pub fn etcd_view(epoch: u64, m: &EtcdMembers) -> View {
    View {
        epoch,
        members: m.iter().map(|(&id, &(incarnation, capacity, _))| Member { id, incarnation, capacity }).collect(),
    }
}

/// The member key's value.
pub fn etcd_member_value(incarnation: u64, capacity: u32, addr: &str) -> String {
    format!("{incarnation} {capacity} {addr}")
}

/// The view key's value.
pub fn format_etcd_view(epoch: u64, m: &EtcdMembers) -> String {
    let members: Vec<String> = m.iter().map(|(id, (inc, cap, reg))| format!("{id}:{inc}:{cap}:{reg}")).collect();
    format!("{epoch} {}", members.join(","))
}

/// Highest epoch a member's report moves a coordinator to (half of
/// [`crate::EPOCH_MAX`]; a report above it is ignored, the keepalive kept).
pub const EPOCH_SEEN_MAX: u64 = crate::EPOCH_MAX / 2;

/// Parses the view key's value.
pub fn parse_etcd_view(s: &str) -> Option<(u64, EtcdMembers)> {
    let mut it = s.splitn(2, ' ');
    let epoch = it.next()?.parse().ok().filter(|&e| e <= crate::EPOCH_MAX)?;
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

impl EtcdMember {
    /// A daemon with no session yet.
    pub fn new(me: NodeId, incarnation: u64) -> EtcdMember {
        EtcdMember { me, incarnation, reg: None, members: BTreeMap::new(), view: None, delivered: 0 }
    }

    /// A new session: registered at revision `reg`; the prefix is read
    /// again (feed every key of the snapshot to [`Self::apply`]).
    pub fn start_session(&mut self, reg: i64) {
        self.reg = Some(reg);
        self.members.clear();
        self.view = None;
    }

    /// The session ended: nothing is acknowledged until the next one.
    pub fn end_session(&mut self) {
        self.reg = None;
    }

    /// A key under the prefix was put (or deleted) at `mod_rev`. Returns
    /// false for an undecodable value (ignored).
    pub fn apply(&mut self, key: &str, value: &str, mod_rev: i64, deleted: bool) -> bool {
        if key == "/view" {
            if deleted {
                self.view = None;
                return true;
            }
            match parse_etcd_view(value) {
                Some((epoch, m)) => {
                    self.view = Some((mod_rev, epoch, m));
                    true
                }
                None => false,
            }
        } else if let Some(id) = key.strip_prefix("/members/").and_then(|x| x.parse::<NodeId>().ok()) {
            if deleted {
                self.members.remove(&id);
                return true;
            }
            let mut it = value.split_whitespace();
            match (it.next().and_then(|x| x.parse().ok()), it.next().and_then(|x| x.parse().ok())) {
                (Some(inc), Some(cap)) => {
                    self.members.insert(id, (inc, cap, mod_rev));
                    true
                }
                _ => false,
            }
        } else {
            true
        }
    }

    /// Whether this session's registration is gone (its lease expired, or
    /// another process registered this id): the session must end.
    pub fn registration_lost(&self) -> bool {
        let Some(reg) = self.reg else { return false };
        self.members.get(&self.me).is_none_or(|&(i, _, r)| i != self.incarnation || r != reg)
    }

    /// A view newer than any handed to the core, to hand to it now.
    pub fn take_view(&mut self) -> Option<View> {
        let (_, epoch, m) = self.view.as_ref()?;
        if *epoch <= self.delivered {
            return None;
        }
        self.delivered = *epoch;
        Some(etcd_view(*epoch, m))
    }

    /// When the registered members differ from the view's: the next view,
    /// to put on `/view` if its mod revision is still the first value (0:
    /// absent).
    pub fn proposal(&self) -> Option<(i64, u64, String)> {
        let (rev, epoch) = match &self.view {
            Some((_, _, m)) if *m == self.members => return None,
            Some((rev, epoch, _)) => (*rev, *epoch),
            None => (0, 0),
        };
        let next = epoch.checked_add(1).filter(|&e| e <= crate::EPOCH_MAX)?;
        Some((rev, next, format_etcd_view(next, &self.members)))
    }

    /// Whether etcd's answer to a lease keepalive may become the core's
    /// keepalive acknowledgement: only while the current view lists this
    /// session's registration (a daemon dropped from a view never serves in
    /// it again).
    pub fn admits(&self) -> bool {
        let Some(reg) = self.reg else { return false };
        self.view
            .as_ref()
            .is_some_and(|(_, _, m)| m.get(&self.me).is_some_and(|&(i, _, r)| i == self.incarnation && r == reg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REMOVAL: u64 = 100_000;

    fn ka(node: NodeId, incarnation: u64, sent_at_us: u64, epoch_seen: u64) -> KeepAlive {
        KeepAlive { node, incarnation, sent_at_us, epoch_seen, capacity: 1 }
    }

    fn published(actions: &[MembershipAction]) -> Option<View> {
        actions.iter().find_map(|a| match a {
            MembershipAction::Publish(v) => Some(v.clone()),
            _ => None,
        })
    }

    fn acks(actions: &[MembershipAction]) -> usize {
        actions.iter().filter(|a| matches!(a, MembershipAction::Ack { .. } | MembershipAction::AckLocal { .. })).count()
    }

    fn cfg(floor: u64) -> StaticConfig {
        StaticConfig {
            me: 1,
            coordinator: 1,
            removal_us: REMOVAL,
            epoch_floor: floor,
            skip_restart_wait: false,
            take_capacity_changes: false,
            admit_every_incarnation: false,
        }
    }

    /// A member's capacity is fixed for its incarnation: keepalives naming
    /// other capacities publish no view and change none; a restart (a new
    /// incarnation) brings its new capacity.
    #[test]
    fn a_member_cannot_change_its_capacity_without_a_restart() {
        for bug in [false, true] {
            let mut m =
                static_membership(StaticConfig { skip_restart_wait: true, take_capacity_changes: bug, ..cfg(0) }, 0);
            m.keepalive(ka(1, 10, 0, 0), 0);
            let v =
                published(&m.peer_keepalive(KeepAlive { capacity: 3, ..ka(2, 20, 1, 1) }, 1)).expect("node 2 joins");
            assert_eq!(v.member(2).map(|x| x.capacity), Some(3));
            let mut views = 0;
            for t in 2..102u64 {
                let a = m.peer_keepalive(KeepAlive { capacity: 1 + (t % 5) as u32, ..ka(2, 20, t, v.epoch) }, t);
                assert_eq!(acks(&a), 1, "each keepalive still acknowledged");
                views += published(&a).is_some_and(|w| w.member(2).map(|x| x.capacity) != Some(3)) as u32;
            }
            if bug {
                assert!(views >= 50, "the planted bug publishes a view per change: {views}");
                continue;
            }
            assert_eq!(views, 0, "100 keepalives with other capacities published views");
            let t = 1 + REMOVAL;
            let v =
                published(&m.peer_keepalive(KeepAlive { capacity: 7, ..ka(2, 21, t, v.epoch) }, t)).expect("restart");
            assert_eq!(v.member(2).map(|x| (x.incarnation, x.capacity)), Some((21, 7)));
        }
    }

    /// A node gets at most one new incarnation admitted per removal time:
    /// a member naming a new incarnation in every keepalive, or leaving
    /// and rejoining as a new one in a loop, publishes no view per
    /// keepalive (each view rebuilds every directory in the cluster).
    #[test]
    fn a_node_gets_one_new_incarnation_per_removal_time() {
        for bug in [false, true] {
            let mut m =
                static_membership(StaticConfig { skip_restart_wait: true, admit_every_incarnation: bug, ..cfg(0) }, 0);
            m.keepalive(ka(1, 10, 0, 0), 0);
            let v = published(&m.peer_keepalive(ka(2, 20, 1, 1), 1)).expect("node 2 joins");
            let (mut views, mut inc) = (0, 20);
            for t in 2..102u64 {
                inc += 1;
                views += published(&m.peer_keepalive(ka(2, inc, t, v.epoch), t)).is_some() as u32;
                if t % 2 == 0 {
                    views += published(&m.peer_leave(2, inc, t)).is_some() as u32;
                }
            }
            if bug {
                assert!(views >= 100, "the planted rule publishes a view per incarnation: {views}");
                continue;
            }
            assert_eq!(views, 0, "new incarnations within the removal time published views");
            assert_eq!(m.incarnations_held_back(), 100);
            // Once the removal time has passed since incarnation 20 was
            // admitted: the next new one is, once.
            let t = 1 + REMOVAL;
            let v = published(&m.peer_keepalive(ka(2, 200, t, v.epoch), t)).expect("restart");
            assert_eq!(v.member(2).map(|x| x.incarnation), Some(200));
            assert!(m.peer_keepalive(ka(2, 201, t + 1, v.epoch), t + 1).is_empty());
            // Its own incarnation is still acknowledged.
            assert_eq!(acks(&m.peer_keepalive(ka(2, 200, t + 2, v.epoch), t + 2)), 1);
        }
    }

    #[test]
    fn coordinator_waits_out_old_leases_then_admits_acks_removes() {
        let t0 = 1_000;
        let mut m = static_membership(cfg(0), t0);
        assert!(m.recovering());
        // During the wait: keepalives are heard, never acknowledged, no view.
        let a = m.keepalive(ka(1, 10, t0, 0), t0);
        assert!(a.is_empty(), "{a:?}");
        let a = m.peer_keepalive(ka(2, 20, 7, 41), t0 + REMOVAL / 2);
        assert!(a.is_empty(), "{a:?}");
        assert!(m.tick(t0 + REMOVAL - 1).is_empty());
        // Wait over: one view of both, above the epoch node 2 reported,
        // persisted before it is published.
        let a = m.tick(t0 + REMOVAL);
        assert_eq!(a[0], MembershipAction::Persist(42));
        let v = published(&a).expect("first view");
        assert_eq!((v.epoch, v.members.len()), (42, 2));
        assert!(!m.recovering());
        let t = t0 + REMOVAL;
        // Now keepalives are acknowledged, echoing the send time.
        let a = m.peer_keepalive(ka(2, 20, 9, 42), t);
        assert!(published(&a).is_none());
        assert!(a.contains(&MembershipAction::Ack { to: 2, sent_at_us: 9, view: v.clone() }));
        assert_eq!(m.keepalive(ka(1, 10, t, 42), t), vec![MembershipAction::AckLocal { sent_at_us: t }]);
        // A restart of a member (new incarnation) within the removal time
        // of its incarnation's admission (the first view, here) waits;
        // after it, it is a new view at once.
        assert!(m.peer_keepalive(ka(2, 21, 10, 42), t + REMOVAL - 1).is_empty());
        assert_eq!(m.incarnations_held_back(), 1);
        let t = t + REMOVAL;
        let v = published(&m.peer_keepalive(ka(2, 21, 11, 42), t)).expect("new incarnation");
        assert_eq!(v.epoch, 43);
        assert_eq!(v.member(2).map(|x| x.incarnation), Some(21));
        // Silent past the removal time: removed (the coordinator never is).
        assert!(m.tick(t + REMOVAL / 2).is_empty());
        let v = published(&m.tick(t + REMOVAL * 2)).expect("node 2 removed");
        assert_eq!((v.epoch, v.members.iter().map(|x| x.id).collect::<Vec<_>>()), (44, vec![1]));
        // A member that saw a higher epoch: continue above it.
        let v = published(&m.peer_keepalive(ka(3, 30, 1, 57), t + REMOVAL * 2)).expect("view above 57");
        assert_eq!(v.epoch, 58);
    }

    #[test]
    fn a_delayed_keepalive_of_a_dead_incarnation_is_ignored() {
        let mut m = static_membership(StaticConfig { skip_restart_wait: true, ..cfg(0) }, 0);
        m.keepalive(ka(1, 10, 0, 0), 0);
        m.peer_keepalive(ka(2, 20, 1, 1), 1);
        let t = 1 + REMOVAL;
        let v = published(&m.peer_keepalive(ka(2, 21, 2, 2), t)).expect("restart of node 2");
        assert_eq!(v.member(2).map(|x| x.incarnation), Some(21));
        // The old process's keepalive, delayed: no view, no ack.
        assert!(m.peer_keepalive(ka(2, 20, 3, 2), t + 1).is_empty());
        // Once incarnation 21 has been silent past the removal time, a
        // lower one (a clock stepped back) is admitted.
        let v = published(&m.peer_keepalive(ka(2, 19, 4, 3), t + 1 + REMOVAL + 1)).expect("rejoin");
        assert_eq!(v.member(2).map(|x| x.incarnation), Some(19));
    }

    #[test]
    fn a_member_that_left_is_removed_at_once_and_its_late_keepalives_ignored() {
        let mut m = static_membership(StaticConfig { skip_restart_wait: true, ..cfg(0) }, 0);
        m.keepalive(ka(1, 10, 0, 0), 0);
        let v = published(&m.peer_keepalive(ka(2, 20, 1, 1), 1)).expect("node 2 joins");
        assert_eq!(v.members.len(), 2);
        // A leave of another incarnation changes nothing.
        assert!(published(&m.peer_leave(2, 19, 2)).is_none());
        // Its own leave: a view without it now, not after the removal time.
        let v = published(&m.peer_leave(2, 20, 3)).expect("node 2 removed");
        assert_eq!((v.epoch, v.members.iter().map(|x| x.id).collect::<Vec<_>>()), (v.epoch, vec![1]));
        // A keepalive it sent before leaving, delayed: ignored.
        assert!(m.peer_keepalive(ka(2, 20, 2, v.epoch), 4).is_empty());
        // The restarted daemon (a new incarnation) joins again at once,
        // unless its last incarnation was admitted less than the removal
        // time ago (as here): then once that time is over.
        assert!(m.peer_keepalive(ka(2, 21, 5, v.epoch), 5).is_empty());
        let v = published(&m.peer_keepalive(ka(2, 21, 6, v.epoch), 1 + REMOVAL)).expect("restart joins");
        assert_eq!(v.member(2).map(|x| x.incarnation), Some(21));
        // The coordinator cannot leave its own view; a forwarder forwards.
        assert!(m.leave(1, 10, 6).is_empty());
        let mut f = static_membership(StaticConfig { me: 2, ..cfg(0) }, 0);
        assert_eq!(f.leave(2, 21, 7), vec![MembershipAction::ForwardLeave { to: 1, node: 2, incarnation: 21 }]);
    }

    #[test]
    fn restarted_coordinator_starts_above_its_persisted_epoch() {
        let mut m = static_membership(cfg(77), 0);
        assert!(m.keepalive(ka(1, 10, 0, 0), 0).is_empty());
        let v = published(&m.tick(REMOVAL)).expect("view");
        assert_eq!(v.epoch, 78);
    }

    #[test]
    fn members_heard_only_before_the_wait_are_not_in_the_first_view() {
        let mut m = static_membership(cfg(0), 0);
        m.peer_keepalive(ka(2, 20, 1, 3), 0);
        m.keepalive(ka(1, 10, REMOVAL / 2, 0), REMOVAL / 2);
        // Node 2 fell silent at t=0: when the wait ends it has been silent too long.
        let v = published(&m.tick(REMOVAL + 1)).expect("view");
        assert_eq!(v.members.iter().map(|x| x.id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(v.epoch, 4, "still above what node 2 reported");
    }

    #[test]
    fn planted_bug_serves_at_once() {
        let mut m = static_membership(StaticConfig { skip_restart_wait: true, ..cfg(0) }, 0);
        let a = m.keepalive(ka(1, 10, 0, 0), 0);
        assert_eq!(published(&a).map(|v| v.epoch), Some(1));
        assert_eq!(acks(&a), 1);
    }

    #[test]
    fn etcd_views_round_trip_and_bad_ones_are_refused() {
        let m = BTreeMap::from([(1, (10, 1, 100)), (3, (30, 2, 105))]);
        let s = format_etcd_view(7, &m);
        assert_eq!(parse_etcd_view(&s), Some((7, m)));
        assert_eq!(parse_etcd_view("8 "), Some((8, BTreeMap::new())));
        for bad in ["", "x 1:1:1:1", "1 1:1:1", "1 a:1:1:1", "1 1:1:1:1:1"] {
            assert_eq!(parse_etcd_view(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn etcd_member_acks_only_under_a_view_listing_its_registration() {
        let mut m = EtcdMember::new(2, 20);
        assert!(!m.admits(), "no session");
        m.start_session(50);
        m.apply("/members/2", &etcd_member_value(20, 1, "a"), 50, false);
        m.apply("/members/1", &etcd_member_value(10, 1, "b"), 40, false);
        // An older view that listed an earlier registration of node 2.
        m.apply("/view", "4 1:10:1:40,2:20:1:31", 45, false);
        assert_eq!(m.take_view().map(|v| v.epoch), Some(4));
        assert_eq!(m.take_view(), None, "delivered once");
        assert!(!m.admits(), "the view lists registration 31, not 50");
        let (rev, epoch, value) = m.proposal().expect("members differ from the view");
        assert_eq!((rev, epoch), (45, 5));
        m.apply("/view", &value, 51, false);
        assert!(m.proposal().is_none());
        assert!(m.admits());
        assert!(!m.registration_lost());
        m.apply("/members/2", "", 60, true);
        assert!(m.registration_lost(), "lease expired");
    }

    #[test]
    fn members_forward_to_the_coordinator() {
        let mut m = static_membership(StaticConfig { me: 2, ..cfg(0) }, 0);
        let k = ka(2, 20, 7, 3);
        assert_eq!(m.keepalive(k, 0), vec![MembershipAction::Forward { to: 1, ka: k }]);
        assert!(m.peer_keepalive(ka(3, 1, 1, 1), 0).is_empty());
        assert_eq!(m.coordinator(), 1);
        assert!(!m.recovering());
    }
}
