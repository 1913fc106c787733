//! Membership: who is in the cluster, as the coherence core needs it — a
//! view (epoch, members with incarnations) and acknowledgements of this
//! node's keepalives (its lease runs from the send time of the last
//! acknowledged one).
//!
//! [`Membership`] is the interface the driver (`cluster.rs`) talks to,
//! sans-IO like the core: it is handed keepalives and time, and answers with
//! [`MembershipAction`]s the driver carries out (forward a keepalive over a
//! peer stream, acknowledge one, publish a view). The static implementation
//! ([`static_membership`]) is a coordinator on one configured daemon and
//! forwarding on the others; etcd leases will implement the same trait.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvmesh_coherence::{Member, NodeId, View};

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
    /// A new view: feed it to the local core and send it to the other
    /// members.
    Publish(View),
}

/// A membership service as the driver sees it.
pub trait Membership: Send {
    /// This node's keepalive.
    fn keepalive(&mut self, ka: KeepAlive, now: Instant) -> Vec<MembershipAction>;
    /// A keepalive another daemon sent to this one.
    fn peer_keepalive(&mut self, ka: KeepAlive, now: Instant) -> Vec<MembershipAction>;
    /// Time passed (failure detection).
    fn tick(&mut self, now: Instant) -> Vec<MembershipAction>;
    /// The daemon that answers keepalives.
    fn coordinator(&self) -> NodeId;
}

/// Static membership: `coordinator` answers keepalives; a member silent for
/// `removal` is removed from the view.
pub fn static_membership(me: NodeId, coordinator: NodeId, removal: Duration) -> Box<dyn Membership> {
    if me == coordinator {
        Box::new(Coordinator { me, epoch: 0, members: BTreeMap::new(), removal })
    } else {
        Box::new(Forwarder { coordinator })
    }
}

/// A daemon that is not the coordinator: forwards its keepalives.
struct Forwarder {
    coordinator: NodeId,
}

impl Membership for Forwarder {
    fn keepalive(&mut self, ka: KeepAlive, _now: Instant) -> Vec<MembershipAction> {
        vec![MembershipAction::Forward { to: self.coordinator, ka }]
    }

    fn peer_keepalive(&mut self, ka: KeepAlive, _now: Instant) -> Vec<MembershipAction> {
        tracing::warn!(peer = ka.node, "keepalive received, but this daemon is not the coordinator");
        Vec::new()
    }

    fn tick(&mut self, _now: Instant) -> Vec<MembershipAction> {
        Vec::new()
    }

    fn coordinator(&self) -> NodeId {
        self.coordinator
    }
}

/// The coordinator: grants leases, detects silent members, publishes views.
struct Coordinator {
    me: NodeId,
    epoch: u64,
    /// Members: incarnation, capacity, last keepalive (local clock).
    members: BTreeMap<NodeId, (u64, u32, Instant)>,
    removal: Duration,
}

impl Coordinator {
    /// Records a keepalive; true when the view changed (new epoch).
    fn record(&mut self, ka: &KeepAlive, now: Instant) -> bool {
        let capacity = ka.capacity.max(1);
        let mut changed = self.members.get(&ka.node).is_none_or(|m| m.0 != ka.incarnation || m.1 != capacity);
        if ka.epoch_seen > self.epoch {
            // Restarted coordinator: continue above what members saw.
            self.epoch = ka.epoch_seen;
            changed = true;
        }
        self.members.insert(ka.node, (ka.incarnation, capacity, now));
        if changed {
            self.epoch += 1;
        }
        changed
    }

    fn view(&self) -> View {
        View {
            epoch: self.epoch,
            members: self
                .members
                .iter()
                .map(|(&id, &(incarnation, capacity, _))| Member { id, incarnation, capacity })
                .collect(),
        }
    }
}

impl Membership for Coordinator {
    fn keepalive(&mut self, ka: KeepAlive, now: Instant) -> Vec<MembershipAction> {
        let mut out = Vec::new();
        if self.record(&ka, now) {
            out.push(MembershipAction::Publish(self.view()));
        }
        out.push(MembershipAction::AckLocal { sent_at_us: ka.sent_at_us });
        out
    }

    fn peer_keepalive(&mut self, ka: KeepAlive, now: Instant) -> Vec<MembershipAction> {
        let mut out = Vec::new();
        if self.record(&ka, now) {
            out.push(MembershipAction::Publish(self.view()));
        }
        out.push(MembershipAction::Ack { to: ka.node, sent_at_us: ka.sent_at_us, view: self.view() });
        out
    }

    fn tick(&mut self, now: Instant) -> Vec<MembershipAction> {
        let before = self.members.len();
        let (removal, me) = (self.removal, self.me);
        self.members.retain(|&id, m| {
            let keep = id == me || now.duration_since(m.2) <= removal;
            if !keep {
                tracing::warn!(node = id, "membership: node silent past its lease, removed from the view");
            }
            keep
        });
        if self.members.len() != before {
            self.epoch += 1;
            return vec![MembershipAction::Publish(self.view())];
        }
        Vec::new()
    }

    fn coordinator(&self) -> NodeId {
        self.me
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ka(node: NodeId, incarnation: u64, sent_at_us: u64, epoch_seen: u64) -> KeepAlive {
        KeepAlive { node, incarnation, sent_at_us, epoch_seen, capacity: 1 }
    }

    fn published(actions: &[MembershipAction]) -> Option<View> {
        actions.iter().find_map(|a| match a {
            MembershipAction::Publish(v) => Some(v.clone()),
            _ => None,
        })
    }

    #[test]
    fn coordinator_admits_acks_removes_and_continues_epochs() {
        let t0 = Instant::now();
        let removal = Duration::from_millis(100);
        let mut m = static_membership(1, 1, removal);
        // Its own keepalive: a view of itself, acknowledged locally.
        let a = m.keepalive(ka(1, 10, 5, 0), t0);
        let v = published(&a).expect("first view");
        assert_eq!((v.epoch, v.members.len()), (1, 1));
        assert!(a.contains(&MembershipAction::AckLocal { sent_at_us: 5 }));
        // A peer joins: new epoch, acked with the view, echoing its send time.
        let a = m.peer_keepalive(ka(2, 20, 7, 0), t0);
        let v = published(&a).expect("view with node 2");
        assert_eq!((v.epoch, v.members.len()), (2, 2));
        assert!(a.iter().any(|x| matches!(x, MembershipAction::Ack { to: 2, sent_at_us: 7, .. })));
        // A repeated keepalive changes nothing.
        assert!(published(&m.peer_keepalive(ka(2, 20, 9, 2), t0)).is_none());
        // A restart (new incarnation) is a new view at once.
        let v = published(&m.peer_keepalive(ka(2, 21, 11, 2), t0)).expect("new incarnation");
        assert_eq!(v.epoch, 3);
        assert_eq!(v.member(2).map(|x| x.incarnation), Some(21));
        // Silent past the removal time: removed (the coordinator never is).
        assert!(m.tick(t0 + removal / 2).is_empty());
        let v = published(&m.tick(t0 + removal * 2)).expect("node 2 removed");
        assert_eq!((v.epoch, v.members.iter().map(|x| x.id).collect::<Vec<_>>()), (4, vec![1]));
        // A member that saw a higher epoch (coordinator restarted): continue above it.
        let v = published(&m.peer_keepalive(ka(3, 30, 1, 57), t0)).expect("view above 57");
        assert_eq!(v.epoch, 58);
    }

    #[test]
    fn members_forward_to_the_coordinator() {
        let mut m = static_membership(2, 1, Duration::from_millis(100));
        let k = ka(2, 20, 7, 3);
        assert_eq!(m.keepalive(k, Instant::now()), vec![MembershipAction::Forward { to: 1, ka: k }]);
        assert!(m.peer_keepalive(ka(3, 1, 1, 1), Instant::now()).is_empty());
        assert_eq!(m.coordinator(), 1);
    }
}
