//! Hand-written protocol scenarios on a tiny harness: a network that holds
//! batches until the test delivers them, a perfect clock, pools of slots
//! modelled as a map. Each test states one rule of the protocol.

use std::collections::{BTreeMap, VecDeque};

use kvmesh_coherence::{
    Action, Batch, BlockKey, Config, Event, Member, Msg, Node, NodeId, Outcome, SlotImage, SlotMeta, SlotRef,
    TableHeader, View,
};

struct Net {
    nodes: Vec<Node>,
    now: u64,
    wire: VecDeque<(NodeId, NodeId, Batch)>,
    done: BTreeMap<(NodeId, u64), Outcome>,
    reads: Vec<(NodeId, u64, NodeId, SlotRef, SlotMeta)>,
    mem: BTreeMap<(NodeId, SlotRef), SlotMeta>,
    next_slot: u32,
    freed: Vec<(NodeId, SlotRef)>,
    /// Keepalives sent: node, send time.
    keepalives: Vec<(NodeId, u64)>,
    /// Read deadlines of the reads started, in order.
    read_deadlines: Vec<u64>,
    /// Lookups ended: (node, op) -> per key (node, version).
    lookups: BTreeMap<(NodeId, u64), Found>,
}

/// What a lookup answered: per key, (node, version) or nothing.
type Found = Vec<Option<(NodeId, u64)>>;

fn key(k: u128) -> BlockKey {
    BlockKey { ns: 1, key: k }
}

impl Net {
    fn new(n: usize, cfg: Config) -> Net {
        let mut net = Net {
            nodes: (0..n as NodeId).map(|i| Node::new(i, 1, cfg.clone())).collect(),
            now: 1_000,
            wire: VecDeque::new(),
            done: BTreeMap::new(),
            reads: Vec::new(),
            mem: BTreeMap::new(),
            next_slot: 0,
            freed: Vec::new(),
            keepalives: Vec::new(),
            read_deadlines: Vec::new(),
            lookups: BTreeMap::new(),
        };
        let view =
            View { epoch: 1, members: (0..n as NodeId).map(|id| Member { id, incarnation: 1, capacity: 1 }).collect() };
        for i in 0..n as NodeId {
            net.drive(i, Event::View(view.clone()));
            net.drive(i, Event::Tick);
            let sent_at = net.last_keepalive(i).expect("a keepalive on the first tick");
            net.drive(i, Event::KeepAliveAck { sent_at });
        }
        net.settle();
        net
    }

    fn drive(&mut self, n: NodeId, ev: Event) {
        let acts = self.nodes[n as usize].handle(self.now, ev);
        for a in acts {
            match a {
                Action::Send { to, batch } => self.wire.push_back((n, to, batch)),
                Action::ClientDone { op, outcome } => {
                    self.done.insert((n, op), outcome);
                }
                Action::StartRead { op, from, remote, expect, deadline } => {
                    self.reads.push((n, op, from, remote, expect));
                    self.read_deadlines.push(deadline);
                }
                Action::CommitSlot { slot, meta } => {
                    self.mem.insert((n, slot), meta);
                }
                Action::FreeSlot { slot } => {
                    self.mem.remove(&(n, slot));
                    self.freed.push((n, slot));
                }
                Action::KeepAlive { sent_at } => self.keepalives.push((n, sent_at)),
                Action::LookupDone { op, found, complete } => {
                    assert!(complete, "every home answers on this network");
                    self.lookups.insert((n, op), found);
                }
            }
        }
    }

    /// Advances time past every flush window and delivers everything.
    fn settle(&mut self) {
        for _ in 0..100 {
            self.now += 1_000;
            for i in 0..self.nodes.len() as NodeId {
                self.drive(i, Event::Tick);
            }
            if self.wire.is_empty() {
                return;
            }
            while let Some((from, to, batch)) = self.wire.pop_front() {
                self.drive(to, Event::Receive { from, batch });
            }
        }
    }

    /// Delivers everything, flushing for 20 rounds, with `rewrite` applied
    /// to every message on the wire first (a peer that lies).
    fn deliver_rewriting(&mut self, mut rewrite: impl FnMut(&mut Msg)) {
        for _ in 0..20 {
            self.flush();
            while let Some((from, to, mut batch)) = self.wire.pop_front() {
                batch.msgs.iter_mut().for_each(&mut rewrite);
                self.drive(to, Event::Receive { from, batch });
            }
        }
    }

    /// Flushes queues without delivering.
    fn flush(&mut self) {
        self.now += 1_000;
        for i in 0..self.nodes.len() as NodeId {
            self.drive(i, Event::Tick);
        }
    }

    fn slot(&mut self) -> SlotRef {
        self.next_slot += 1;
        SlotRef { slot: self.next_slot, generation: 1 }
    }

    fn put(&mut self, n: NodeId, op: u64, k: BlockKey, checksum: u64) {
        let slot = self.slot();
        self.drive(n, Event::ClientPut { op, key: k, slot, checksum });
    }

    /// Completes pending reads with the holder's true slot content.
    fn serve_reads(&mut self, corrupt: bool) {
        for (reader, op, holder, remote, _expect) in std::mem::take(&mut self.reads) {
            let meta = self.mem.get(&(holder, remote)).copied();
            let dest = self.slot();
            let result = match meta {
                Some(m) => {
                    let mut img = SlotImage { header: m, trailer: m, payload_checksum: m.checksum };
                    if corrupt {
                        img.trailer.generation += 1;
                    }
                    self.mem.insert((reader, dest), m);
                    Ok(img)
                }
                None => Err(kvmesh_coherence::TransferError::PeerGone),
            };
            self.drive(reader, Event::TransferDone { op, dest: Some(dest), result });
        }
    }

    fn last_keepalive(&self, n: NodeId) -> Option<u64> {
        self.keepalives.iter().rev().find(|k| k.0 == n).map(|k| k.1)
    }

    fn outcome(&self, n: NodeId, op: u64) -> Option<Outcome> {
        self.done.get(&(n, op)).copied()
    }
}

#[test]
fn put_then_remote_get_reads_under_a_grant_and_registers() {
    let mut net = Net::new(3, Config::default());
    net.put(0, 1, key(7), 0xabc);
    net.settle();
    let Some(Outcome::Stored { version }) = net.outcome(0, 1) else { panic!("{:?}", net.outcome(0, 1)) };
    net.drive(2, Event::ClientGet { op: 2, key: key(7) });
    net.settle();
    assert_eq!(net.reads.len(), 1, "one one-sided read from the holder");
    assert_eq!(net.reads[0].2, 0);
    net.serve_reads(false);
    net.settle();
    let Some(Outcome::Hit { version: v, .. }) = net.outcome(2, 2) else { panic!("{:?}", net.outcome(2, 2)) };
    assert_eq!(v, version);
    // Node 2 is now a registered holder: a local hit needs no message.
    net.drive(2, Event::ClientGet { op: 3, key: key(7) });
    assert!(matches!(net.outcome(2, 3), Some(Outcome::Hit { .. })));
    assert_eq!(net.nodes[0].metrics().grants_outstanding, 0, "grant released after the read");
}

/// The pool's eviction names the slot it freed: a copy that moved to
/// another slot meanwhile (a newer version committed in the same step)
/// stays. And a slot a reader holds a grant on stays held after its copy
/// is dropped, until the grant ends: the pool must not free it.
#[test]
fn an_eviction_of_another_slot_keeps_the_copy_and_a_granted_slot_stays_held() {
    let mut net = Net::new(3, Config::default());
    net.put(0, 1, key(7), 0xabc);
    net.settle();
    assert!(matches!(net.outcome(0, 1), Some(Outcome::Stored { .. })), "{:?}", net.outcome(0, 1));
    let (_, s1) = net.nodes[0].copy_of(&key(7)).expect("copy");
    let other = SlotRef { slot: s1.slot, generation: s1.generation + 1 };
    net.drive(0, Event::Evict { key: key(7), slot: Some(other) });
    assert_eq!(net.nodes[0].copy_of(&key(7)).map(|c| c.1), Some(s1), "a copy not in the freed slot was dropped");
    assert!(!net.nodes[0].slot_held(s1), "nothing holds it yet");
    // Node 2 is granted a read of it, held (its read not served).
    net.drive(2, Event::ClientGet { op: 2, key: key(7) });
    net.settle();
    assert_eq!(net.reads.len(), 1);
    assert!(net.nodes[0].slot_held(s1), "granted");
    // The copy goes (an engine's Remove refuses a granted copy, so an
    // invalidation by another writer: node 1 puts a new version).
    net.put(1, 3, key(7), 0xdef);
    net.settle();
    assert!(net.nodes[0].copy_of(&key(7)).is_none_or(|c| c.1 != s1), "node 0's old copy dropped");
    assert!(net.nodes[0].slot_held(s1), "the grant still holds the dropped copy's slot");
    net.drive(0, Event::Evict { key: key(7), slot: Some(s1) });
    net.serve_reads(false);
    net.settle();
    for _ in 0..100 {
        net.flush();
    }
    net.settle();
    assert!(!net.nodes[0].slot_held(s1), "released with the grant");
}

#[test]
fn a_torn_transfer_is_a_miss_never_a_hit() {
    let mut net = Net::new(2, Config::default());
    net.put(0, 1, key(1), 5);
    net.settle();
    net.drive(1, Event::ClientGet { op: 2, key: key(1) });
    net.settle();
    net.serve_reads(true);
    net.settle();
    assert_eq!(net.outcome(1, 2), Some(Outcome::Miss));
    assert_eq!(net.nodes[1].metrics().validation_failures, 1);
    assert_eq!(net.nodes[1].copies().count(), 0);
}

#[test]
fn overwrite_waits_for_every_ack() {
    let mut net = Net::new(3, Config::default());
    net.put(0, 1, key(9), 1);
    net.settle();
    net.drive(1, Event::ClientGet { op: 2, key: key(9) });
    net.settle();
    net.serve_reads(false);
    net.settle();
    assert!(matches!(net.outcome(1, 2), Some(Outcome::Hit { .. })));
    // Node 2 overwrites; hold node 1's ack on the wire.
    net.put(2, 3, key(9), 2);
    for _ in 0..10 {
        net.flush();
        let held: Vec<_> = net.wire.drain(..).collect();
        for (from, to, batch) in held {
            let is_ack_from_1 = from == 1 && batch.msgs.iter().any(|m| matches!(m, Msg::InvalidateAck { .. }));
            if is_ack_from_1 {
                net.wire.push_back((from, to, batch));
                break;
            }
            net.drive(to, Event::Receive { from, batch });
        }
        if !net.wire.is_empty() {
            break;
        }
    }
    assert_eq!(net.wire.len(), 1, "node 1's ack is held");
    assert_eq!(net.outcome(2, 3), None, "the overwrite must not complete without node 1's ack");
    assert!(net.nodes[1].copies().next().is_none(), "node 1 stopped serving before acking");
    net.settle();
    assert!(matches!(net.outcome(2, 3), Some(Outcome::Stored { .. })));
}

#[test]
fn duplicate_and_stale_acks_do_not_count() {
    let mut net = Net::new(3, Config::default());
    net.put(0, 1, key(4), 1);
    net.settle();
    net.drive(1, Event::ClientGet { op: 2, key: key(4) });
    net.settle();
    net.serve_reads(false);
    net.settle();
    let home = net.nodes[0].view().home_of(&key(4)).unwrap();
    // Forge acks for a change that does not exist, from a holder.
    let batch = Batch {
        epoch: 1,
        incarnation: 1,
        msgs: vec![
            Msg::InvalidateAck { key: key(4), version: 1, change: 999 },
            Msg::InvalidateAck { key: key(4), version: 1, change: 999 },
        ],
    };
    let before = net.nodes[home as usize].metrics().ignored_acks;
    let sender = if home == 1 { 2 } else { 1 };
    net.drive(home, Event::Receive { from: sender, batch });
    assert_eq!(net.nodes[home as usize].metrics().ignored_acks, before + 2);
    // The holders are still registered: an overwrite still invalidates them.
    let d = net.nodes[home as usize].directory().find(|(k, _)| *k == key(4)).unwrap().1;
    assert_eq!(d.holders.len(), 2);
}

#[test]
fn batches_of_another_epoch_are_dropped_and_counted() {
    let mut net = Net::new(2, Config::default());
    let stale = Batch { epoch: 0, incarnation: 1, msgs: vec![Msg::LocateReq { op: 1, key: key(1), copy: 0 }] };
    net.drive(0, Event::Receive { from: 1, batch: stale });
    assert_eq!(net.nodes[0].metrics().stale_epoch_drops, 1);
    let wrong_inc = Batch { epoch: 1, incarnation: 7, msgs: vec![Msg::LocateReq { op: 1, key: key(1), copy: 0 }] };
    net.drive(0, Event::Receive { from: 1, batch: wrong_inc });
    assert_eq!(net.nodes[0].metrics().stale_epoch_drops, 2);
    assert!(net.wire.is_empty(), "nothing answered");
}

#[test]
fn invalidations_to_one_peer_travel_in_one_batch() {
    let cfg = Config { ack_flush_delay_us_max: 500, ..Config::default() };
    let mut net = Net::new(2, cfg);
    // Node 1 fetches 50 blocks put by node 0.
    for i in 0..50u64 {
        net.put(0, 100 + i, key(i as u128), i);
    }
    net.settle();
    for i in 0..50u64 {
        net.drive(1, Event::ClientGet { op: 200 + i, key: key(i as u128) });
    }
    net.settle();
    net.serve_reads(false);
    net.settle();
    assert_eq!(net.nodes[1].copies().count(), 50);
    let batches_before = net.nodes[1].metrics().ack_batches_sent;
    for i in 0..50u64 {
        net.drive(0, Event::ClientInvalidate { op: 300 + i, key: key(i as u128) });
    }
    net.settle();
    for i in 0..50u64 {
        assert_eq!(net.outcome(0, 300 + i), Some(Outcome::Invalidated));
    }
    assert_eq!(net.nodes[1].copies().count(), 0);
    let ack_batches = net.nodes[1].metrics().ack_batches_sent - batches_before;
    assert!(ack_batches <= 2, "50 acks should leave in one or two batches, took {ack_batches}");
}

#[test]
fn invalidated_key_cannot_be_registered_by_a_late_reader() {
    let mut net = Net::new(3, Config::default());
    net.put(0, 1, key(3), 1);
    net.settle();
    net.drive(1, Event::ClientGet { op: 2, key: key(3) });
    net.settle();
    // The read is in flight while the key is invalidated.
    assert_eq!(net.reads.len(), 1, "the get's read is in flight");
    net.drive(2, Event::ClientInvalidate { op: 3, key: key(3) });
    net.settle();
    assert_eq!(net.outcome(2, 3), Some(Outcome::Invalidated));
    net.serve_reads(false);
    net.settle();
    // The get ended, and not with the invalidated block.
    let got = net.outcome(1, 2);
    assert!(got.is_some(), "the get never ended");
    assert!(!matches!(got, Some(Outcome::Hit { .. })), "stale block served: {got:?}");
}

#[test]
fn a_keepalive_ack_this_node_never_asked_for_grants_no_lease() {
    let mut net = Net::new(2, Config::default());
    let lease = Config::default().membership_lease_us;
    // Far past the lease; node 1 has sent keepalives, but an ack echoing a
    // time it never sent (forged, or meant for a previous life) is dropped.
    net.now += 2 * lease;
    let forged = net.now;
    net.drive(1, Event::KeepAliveAck { sent_at: forged });
    assert_eq!(net.nodes[1].metrics().unsolicited_keepalive_acks, 1);
    assert!(!net.nodes[1].serving(), "no lease from an unsolicited ack");
    // Its own next keepalive, acknowledged, does grant one.
    net.drive(1, Event::Tick);
    let sent_at = net.last_keepalive(1).expect("keepalive");
    net.drive(1, Event::KeepAliveAck { sent_at });
    assert!(net.nodes[1].serving());
    assert_eq!(net.nodes[1].metrics().unsolicited_keepalive_acks, 1);
}

#[test]
fn copies_held_under_a_lapsed_lease_are_never_announced_into_a_new_view() {
    let mut net = Net::new(2, Config::default());
    net.put(1, 1, key(3), 9);
    net.settle();
    assert!(matches!(net.outcome(1, 1), Some(Outcome::Stored { .. })));
    assert_eq!(net.nodes[1].copies().count(), 1);
    // Node 1 stalls (no tick) past its lease; the first thing it then
    // handles is a new view (from a coordinator that moved on).
    net.now += 2 * Config::default().membership_lease_us;
    let view = View { epoch: 2, members: (0..2).map(|id| Member { id, incarnation: 1, capacity: 1 }).collect() };
    net.drive(1, Event::View(view));
    assert_eq!(net.nodes[1].copies().count(), 0, "a lapsed lease drops the copies before the view is adopted");
    let announced: Vec<_> = net
        .wire
        .iter()
        .filter(|(from, _, _)| *from == 1)
        .flat_map(|(_, _, b)| b.msgs.iter())
        .filter_map(|m| match m {
            Msg::Announce { entries, .. } => Some(entries.len()),
            _ => None,
        })
        .collect();
    assert!(announced.iter().all(|&n| n == 0), "announced entries {announced:?}");
}

#[test]
fn a_home_whose_lease_lapsed_assigns_no_version() {
    // Found by the simulator: a home that had lost its membership lease
    // (and whose keys another home may already serve in a later view) still
    // completed a publish, and the writer reported "stored" for a version
    // the cluster then never served.
    let mut net = Net::new(2, Config::default());
    let k = (0..1000).map(key).find(|k| net.nodes[0].view().home_of(k) == Some(0)).expect("a key homed on node 0");
    net.now += 2 * Config::default().membership_lease_us;
    // Node 1 keeps its lease (its keepalive acknowledged); node 0's lapsed.
    net.drive(1, Event::Tick);
    let sent_at = net.last_keepalive(1).expect("keepalive");
    net.drive(1, Event::KeepAliveAck { sent_at });
    assert!(net.nodes[1].serving() && !net.nodes[0].serving_at(net.now));
    net.put(1, 1, k, 7);
    net.settle();
    assert!(
        !matches!(net.outcome(1, 1), Some(Outcome::Stored { .. })),
        "a home without a lease assigned a version: {:?}",
        net.outcome(1, 1)
    );
    assert_eq!(net.nodes[0].metrics().changes_completed, 0);
}

/// The directory holds keys cached somewhere (or changing), not every key
/// ever put in the epoch: after puts, invalidations and evictions of many
/// keys it is empty again, and a key put again still gets a newer version.
#[test]
fn directory_holds_only_cached_keys_after_churn() {
    let mut net = Net::new(3, Config::default());
    let mut versions = BTreeMap::new();
    for i in 0..600u128 {
        net.put((i % 2) as NodeId, 10 + i as u64, key(i), i as u64);
    }
    net.settle();
    for i in 0..600u128 {
        let Some(Outcome::Stored { version }) = net.outcome((i % 2) as NodeId, 10 + i as u64) else {
            panic!("put {i}: {:?}", net.outcome((i % 2) as NodeId, 10 + i as u64))
        };
        versions.insert(i, version);
    }
    let entries: usize = net.nodes.iter().map(|n| n.directory_len()).sum();
    assert_eq!(entries, 600, "one entry per cached key");
    // Half invalidated (through node 2, which holds nothing), half evicted.
    for i in 0..300u128 {
        net.drive(2, Event::ClientInvalidate { op: 1_000 + i as u64, key: key(i) });
    }
    for i in 300..600u128 {
        net.drive((i % 2) as NodeId, Event::Evict { key: key(i), slot: None });
    }
    net.settle();
    for i in 0..300u64 {
        assert_eq!(net.outcome(2, 1_000 + i), Some(Outcome::Invalidated));
    }
    for n in &net.nodes {
        assert_eq!(n.copy_count(), 0);
        assert_eq!(n.directory_len(), 0, "node {}: entries of keys nobody holds", n.id());
        n.check_incremental().unwrap();
    }
    // Versions still grow per key (the bucket floors remember them).
    for i in [0u128, 299, 300, 599] {
        net.put(1, 5_000 + i as u64, key(i), 1);
        net.settle();
        let Some(Outcome::Stored { version }) = net.outcome(1, 5_000 + i as u64) else { panic!() };
        assert!(version > versions[&i], "key {i}: v{version:#x} not above v{:#x}", versions[&i]);
    }
}

/// A publish request retransmitted after the home completed it is answered
/// with the version it was given, not published again.
#[test]
fn a_duplicate_publish_request_gets_its_first_version() {
    let mut net = Net::new(2, Config::default());
    // A key homed on node 1, put by node 0.
    let k = (0..).map(key).find(|k| net.nodes[0].view().home_of(k) == Some(1)).expect("a key homed on 1");
    net.put(0, 1, k, 42);
    net.flush();
    let (from, to, batch) = net.wire.pop_front().expect("the publish request");
    assert!(matches!(batch.msgs[..], [Msg::PublishReq { .. }]), "{batch:?}");
    net.drive(to, Event::Receive { from, batch: batch.clone() });
    net.settle();
    let Some(Outcome::Stored { version }) = net.outcome(0, 1) else { panic!("{:?}", net.outcome(0, 1)) };
    let changes = net.nodes[1].metrics().changes_completed;
    net.drive(to, Event::Receive { from, batch });
    net.flush();
    let answer = net.wire.pop_front().expect("an answer to the duplicate");
    assert!(
        matches!(answer.2.msgs[..], [Msg::PublishResp { result: kvmesh_coherence::PublishResult::Stored(v), .. }] if v == version),
        "{answer:?}"
    );
    assert_eq!(net.nodes[1].metrics().changes_completed, changes, "no second change for a duplicate");
    net.settle();
    assert_eq!(net.nodes[0].copy_of(&k).map(|c| c.0), Some(version));
}

/// Announces travel in parts of `announce_entries_max` entries, each in a
/// batch of its own; a home counts a holder announced only with every part
/// of one round: with a part lost it stays busy, and the retransmitted round
/// completes it.
#[test]
fn a_large_announce_travels_in_parts_and_needs_them_all() {
    let cfg = Config { announce_entries_max: 4, ..Config::default() };
    let mut net = Net::new(2, cfg);
    // Node 0 holds 10 keys whose home is node 1.
    let keys: Vec<BlockKey> = (0..).map(key).filter(|k| net.nodes[0].view().home_of(k) == Some(1)).take(10).collect();
    for (i, &k) in keys.iter().enumerate() {
        net.put(0, 100 + i as u64, k, i as u64);
    }
    net.settle();
    assert_eq!(net.nodes[0].copy_count(), 10);
    // A new view: node 0 announces its 10 copies to node 1 in 3 parts.
    let view = View { epoch: 2, members: (0..2).map(|id| Member { id, incarnation: 1, capacity: 1 }).collect() };
    net.drive(0, Event::View(view.clone()));
    net.drive(1, Event::View(view));
    let parts: Vec<(u32, usize)> = net
        .wire
        .iter()
        .filter(|(from, to, _)| (*from, *to) == (0, 1))
        .flat_map(|(_, _, b)| b.msgs.iter())
        .filter_map(|m| match m {
            Msg::Announce { part, parts, entries, .. } => {
                assert_eq!(*parts, 3);
                Some((*part, entries.len()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(parts, vec![(0, 4), (1, 4), (2, 2)]);
    assert!(
        net.wire.iter().filter(|(from, to, _)| (*from, *to) == (0, 1)).all(|(_, _, b)| b.msgs.len() == 1),
        "each part in a batch of its own"
    );
    // Lose the middle part.
    let mut kept = std::collections::VecDeque::new();
    while let Some((from, to, b)) = net.wire.pop_front() {
        let middle = matches!(b.msgs[..], [Msg::Announce { part: 1, .. }]) && (from, to) == (0, 1);
        if !middle {
            kept.push_back((from, to, b));
        }
    }
    net.wire = kept;
    while let Some((from, to, batch)) = net.wire.pop_front() {
        net.drive(to, Event::Receive { from, batch });
    }
    assert!(!net.nodes[1].directory_ready(), "a home missing a part stays busy");
    // The retransmission (a new round) completes it.
    net.now += Config::default().retransmit_us;
    net.settle();
    assert!(net.nodes[1].directory_ready());
    for &k in &keys {
        assert!(net.nodes[1].directory().any(|(dk, d)| dk == k && d.holders == vec![0]), "{k:?} registered");
    }
}

#[test]
fn a_node_that_leaves_tells_the_homes_and_serves_nothing_more() {
    let mut net = Net::new(3, Config::default());
    // Find a key homed away from node 2, put it on node 0, read it on 2.
    let k = (0..64u128).map(key).find(|k| net.nodes[0].view().home_of(k) != Some(2)).unwrap();
    let home = net.nodes[0].view().home_of(&k).unwrap();
    net.put(0, 1, k, 3);
    net.settle();
    net.drive(2, Event::ClientGet { op: 2, key: k });
    net.settle();
    net.serve_reads(false);
    net.settle();
    assert!(matches!(net.outcome(2, 2), Some(Outcome::Hit { .. })));
    let holders = |net: &Net| net.nodes[home as usize].directory().find(|(x, _)| *x == k).unwrap().1.holders;
    assert!(holders(&net).contains(&2));
    // Node 2 leaves: its copy is gone and the home unregisters it, without
    // waiting for any view change.
    net.drive(2, Event::Leave);
    assert!(net.nodes[2].has_left() && !net.nodes[2].serving());
    assert_eq!(net.nodes[2].copies().count(), 0);
    net.settle();
    assert!(!holders(&net).contains(&2), "the home still lists the node that left: {:?}", holders(&net));
    // So an overwrite from node 0 completes without node 2.
    net.put(0, 3, k, 4);
    net.settle();
    assert!(matches!(net.outcome(0, 3), Some(Outcome::Stored { .. })), "{:?}", net.outcome(0, 3));
    // After leaving: calls are refused, no keepalive is sent, an ack of an
    // earlier keepalive does not make it serve again.
    // (The ack echoes its latest keepalive, still inside the lease.)
    let sent = net.last_keepalive(2).unwrap();
    net.drive(2, Event::KeepAliveAck { sent_at: sent });
    net.drive(2, Event::ClientGet { op: 4, key: k });
    assert_eq!(net.outcome(2, 4), Some(Outcome::Error(kvmesh_coherence::ErrorKind::NotMember)));
    assert!(!net.nodes[2].serving());
    let before = net.keepalives.iter().filter(|x| x.0 == 2).count();
    net.now += 10_000_000;
    net.drive(2, Event::Tick);
    assert_eq!(net.keepalives.iter().filter(|x| x.0 == 2).count(), before, "no keepalive after leaving");
    // Nor does it ask for a tick at once after every step: its keepalive
    // time passed and is never advanced again.
    let next = net.nodes[2].next_timeout();
    assert!(next.is_none_or(|t| t > net.now), "a node that left wants a tick now ({next:?} at {})", net.now);
}

#[test]
fn impossible_peer_values_are_refused_and_never_crash_a_home() {
    let mut net = Net::new(2, Config::default());
    let homed: Vec<BlockKey> = (0..).map(key).filter(|k| net.nodes[0].view().home_of(k) == Some(0)).take(3).collect();
    let (last_of_epoch, later_epoch) = (homed[0], homed[1]);
    let before = net.nodes[0].metrics().peer_refusals;
    // Node 1 announces a copy at the last version of epoch 1 (copies
    // announced into an epoch were made in earlier ones; taken, it would
    // leave the key no version), one of an epoch no view has reached, and
    // parts that belong to no round.
    let forged = Batch {
        epoch: 1,
        incarnation: 1,
        msgs: vec![
            Msg::Announce { round: 1, part: 0, parts: 1, entries: vec![(last_of_epoch, (1 << 32) | 0xffff_ffff, 1)] },
            Msg::Announce { round: 2, part: 0, parts: 1, entries: vec![(later_epoch, 7 << 32, 1)] },
            Msg::Announce { round: 3, part: 5, parts: 2, entries: vec![] },
            Msg::Announce { round: 4, part: 0, parts: u32::MAX, entries: vec![] },
        ],
    };
    net.drive(0, Event::Receive { from: 1, batch: forged });
    assert_eq!(net.nodes[0].metrics().peer_refusals, before + 4, "two versions and two bad parts refused");
    for k in [last_of_epoch, later_epoch] {
        assert!(!net.nodes[0].directory().any(|(dk, _)| dk == k), "a version of this or a later epoch is not taken");
    }
    // Puts of those keys get versions of this epoch (before the fix, the
    // first panicked the home: its next version left the epoch).
    for (op, k) in [(1, last_of_epoch), (2, later_epoch), (3, homed[2])] {
        net.put(0, op, k, 9);
        net.settle();
        let Some(Outcome::Stored { version }) = net.outcome(0, op) else { panic!("{:?}", net.outcome(0, op)) };
        assert_eq!(version >> 32, 1, "version {version:#x} of epoch 1");
    }
    assert_eq!(net.nodes[0].metrics().versions_exhausted, 0);
    net.nodes[0].check_incremental().unwrap();
}

#[test]
fn a_home_answer_from_another_epoch_or_node_is_refused() {
    let mut net = Net::new(3, Config::default());
    let k = (0..).map(key).find(|k| net.nodes[0].view().home_of(k) == Some(1)).unwrap();
    net.put(0, 1, k, 9);
    // The home's answer carries a version of a later epoch: refused, the
    // put fails (Busy), nothing is committed, the home is told.
    net.deliver_rewriting(|m| {
        if let Msg::PublishResp { result: kvmesh_coherence::PublishResult::Stored(v), .. } = m {
            *v = 5 << 32;
        }
    });
    assert!(matches!(net.outcome(0, 1), Some(Outcome::Error(_))), "{:?}", net.outcome(0, 1));
    assert_eq!(net.nodes[0].copy_count(), 0);
    assert_eq!(net.nodes[0].metrics().peer_refusals, 1);
    // A locate answer naming a holder outside the view is a miss.
    net.put(0, 2, k, 9);
    net.settle();
    net.drive(2, Event::ClientGet { op: 3, key: k });
    net.deliver_rewriting(|m| {
        if let Msg::LocateResp { result: kvmesh_coherence::LocateResult::Found { holder, .. }, .. } = m {
            *holder = 77;
        }
    });
    assert_eq!(net.outcome(2, 3), Some(Outcome::Miss));
    assert_eq!(net.nodes[2].metrics().peer_refusals, 1);
}

#[test]
fn a_grant_lease_from_a_peer_is_trusted_no_longer_than_our_own() {
    let cfg = Config::default();
    let mut net = Net::new(2, cfg.clone());
    net.put(0, 1, key(3), 4);
    net.settle();
    net.drive(1, Event::ClientGet { op: 2, key: key(3) });
    // Deliver everything, stretching the lease of every grant to the most
    // a u64 holds (overflowed `lease * 2 * drift` before).
    net.deliver_rewriting(|m| {
        if let Msg::GrantResp { result: kvmesh_coherence::GrantResult::Granted { lease_us, .. }, .. } = m {
            *lease_us = u64::MAX;
        }
    });
    assert_eq!(net.read_deadlines.len(), 1, "the read started");
    assert!(
        net.read_deadlines[0] <= net.now + cfg.grant_lease_us,
        "deadline {} now {}",
        net.read_deadlines[0],
        net.now
    );
}

#[test]
fn a_grant_is_released_only_by_its_reader() {
    let mut net = Net::new(3, Config::default());
    net.put(0, 1, key(5), 4);
    net.settle();
    net.drive(1, Event::ClientGet { op: 2, key: key(5) });
    net.settle();
    assert_eq!(net.reads.len(), 1, "node 1 reads under a grant");
    let (_, _, holder, remote, _) = net.reads[0];
    assert_eq!(net.nodes[holder as usize].metrics().grants_outstanding, 1);
    // Node 2 releases node 1's grant (the first grant: id 1): ignored.
    let forged = Batch { epoch: 1, incarnation: 1, msgs: vec![Msg::GrantRelease { slot: remote, grant: 1 }] };
    net.drive(holder, Event::Receive { from: 2, batch: forged });
    assert_eq!(net.nodes[holder as usize].metrics().grants_outstanding, 1, "another node released the grant");
    net.nodes[holder as usize].check_incremental().unwrap();
    // The reader's own release (after its read) ends it.
    net.serve_reads(false);
    net.settle();
    assert!(matches!(net.outcome(1, 2), Some(Outcome::Hit { .. })));
    assert_eq!(net.nodes[holder as usize].metrics().grants_outstanding, 0);
    net.nodes[holder as usize].check_incremental().unwrap();
}

#[test]
fn a_lookup_reports_where_blocks_are_without_moving_them() {
    let mut net = Net::new(3, Config::default());
    // Keys homed at each node, put on node 0; key 9 nowhere.
    let ks: Vec<BlockKey> =
        (0..3).map(|h| (100..).map(key).find(|k| net.nodes[0].view().home_of(k) == Some(h)).unwrap()).collect();
    for (i, &k) in ks.iter().enumerate() {
        net.put(0, 10 + i as u64, k, 7);
    }
    net.settle();
    let copies_before: Vec<usize> = net.nodes.iter().map(|n| n.copy_count()).collect();
    let ask = vec![ks[0], ks[1], ks[2], key(9), ks[1]];
    net.drive(2, Event::ClientLookup { op: 50, keys: ask.clone() });
    net.settle();
    let found = net.lookups.get(&(2, 50)).expect("the lookup ended").clone();
    let nodes: Vec<Option<NodeId>> = found.iter().map(|f| f.map(|(n, _)| n)).collect();
    assert_eq!(nodes, vec![Some(0), Some(0), Some(0), None, Some(0)]);
    for (f, k) in found.iter().zip(&ask) {
        if let Some((_, v)) = f {
            assert_eq!(Some(*v), net.nodes[0].copy_of(k).map(|c| c.0), "the current version");
        }
    }
    assert!(net.reads.is_empty(), "nothing read");
    assert_eq!(net.nodes.iter().map(|n| n.copy_count()).collect::<Vec<_>>(), copies_before, "nothing copied");
    // Node 0 answers its own copies itself, with no question on the wire.
    net.drive(0, Event::ClientLookup { op: 51, keys: ks.clone() });
    assert!(net.wire.is_empty(), "answered locally");
    assert_eq!(
        net.lookups[&(0, 51)],
        ks.iter().map(|k| Some((0, net.nodes[0].copy_of(k).unwrap().0))).collect::<Vec<_>>()
    );
    // Invalidated: no longer reported.
    net.drive(1, Event::ClientInvalidate { op: 52, key: ks[1] });
    net.settle();
    net.drive(2, Event::ClientLookup { op: 53, keys: ask });
    net.settle();
    let nodes: Vec<Option<NodeId>> = net.lookups[&(2, 53)].iter().map(|f| f.map(|(n, _)| n)).collect();
    assert_eq!(nodes, vec![Some(0), None, Some(0), None, None]);
}

impl Net {
    /// A lookup of node `n` answered from the homes' tables, read at this
    /// moment; `header` rewrites what each table's header says.
    fn lookup_tables(
        &mut self,
        n: NodeId,
        op: u64,
        keys: Vec<BlockKey>,
        header: impl Fn(TableHeader) -> TableHeader,
    ) -> (Vec<Option<(NodeId, u64)>>, bool) {
        let (before, rest) = self.nodes.split_at_mut(n as usize);
        let (asker, after) = rest.split_first_mut().expect("node n exists");
        let mut read = |h: NodeId, k: &BlockKey| {
            let home = if h < n { &before[h as usize] } else { &after[(h - n - 1) as usize] };
            Some((header(home.table_header()), home.table_entry(k)))
        };
        let acts = asker.lookup_tables(self.now, op, keys, &mut read);
        assert!(!acts.iter().any(|a| matches!(a, Action::Send { .. })), "nothing sent");
        let mut out = None;
        for a in acts {
            if let Action::LookupDone { op: o, found, complete } = a {
                assert_eq!(o, op);
                out = Some((found, complete));
            }
        }
        out.expect("the lookup ended at once")
    }
}

/// A lookup that reads the homes' tables one-sided reports what asking
/// the homes reports, sends nothing, moves nothing; a table whose header
/// is not of the home the asker's view names (another epoch, another
/// incarnation) is not believed: those keys are unanswered, not absent.
#[test]
fn a_lookup_from_the_homes_tables_answers_as_the_homes_do() {
    let mut net = Net::new(3, Config::default());
    let ks: Vec<BlockKey> =
        (0..3).map(|h| (100..).map(key).find(|k| net.nodes[0].view().home_of(k) == Some(h)).unwrap()).collect();
    for (i, &k) in ks.iter().enumerate() {
        net.put(0, 10 + i as u64, k, 7);
    }
    // Node 1 also holds ks[2] (homed at 2): a registered source beside node 0.
    net.drive(1, Event::ClientGet { op: 20, key: ks[2] });
    net.settle();
    net.serve_reads(false);
    net.settle();
    assert!(net.nodes[1].copy_of(&ks[2]).is_some(), "node 1 fetched ks[2]");
    let ask = vec![ks[0], ks[1], ks[2], key(9), ks[1]];
    net.drive(2, Event::ClientLookup { op: 50, keys: ask.clone() });
    net.settle();
    let copies_before: Vec<usize> = net.nodes.iter().map(|n| n.copy_count()).collect();
    let (found, complete) = net.lookup_tables(2, 51, ask.clone(), |h| h);
    assert!(complete);
    assert_eq!(found, net.lookups[&(2, 50)], "as the homes answered");
    assert_eq!(found.iter().filter(|f| f.is_some()).count(), 4);
    assert_eq!(net.nodes.iter().map(|n| n.copy_count()).collect::<Vec<_>>(), copies_before, "nothing copied");
    assert!(net.reads.is_empty(), "nothing read");
    // A node that holds the key itself reports its own copy.
    let (found, _) = net.lookup_tables(1, 52, vec![ks[2]], |h| h);
    assert_eq!(found[0].map(|f| f.0), Some(1));
    // Another epoch, another incarnation, a directory not rebuilt: not believed.
    for bad in [
        (|h: TableHeader| TableHeader { epoch: h.epoch + 1, ..h }) as fn(TableHeader) -> TableHeader,
        |h| TableHeader { incarnation: h.incarnation + 1, ..h },
        |h| TableHeader { ready: false, ..h },
        |h| TableHeader { node: h.node + 1, ..h },
    ] {
        let (found, complete) = net.lookup_tables(2, 53, vec![ks[0], ks[1]], bad);
        assert!(!complete, "a table of another view is not an answer");
        assert_eq!(found, vec![None, None]);
    }
    // Keys homed at the asker answer from its own directory, whatever
    // the others' tables say.
    let (found, complete) = net.lookup_tables(2, 54, vec![ks[2]], |h| TableHeader { epoch: 0, ..h });
    assert!(complete);
    assert!(found[0].is_some());
    // Invalidated: no longer reported.
    net.drive(1, Event::ClientInvalidate { op: 55, key: ks[1] });
    net.settle();
    let (found, _) = net.lookup_tables(2, 56, ask, |h| h);
    let nodes: Vec<Option<NodeId>> = found.iter().map(|f| f.map(|(n, _)| n)).collect();
    assert_eq!(nodes[..2], [Some(0), None]);
    assert!(nodes[2].is_some(), "ks[2] is still held");
    assert_eq!(nodes[3..], [None, None]);
}

/// Found by the simulator (LOOKUP, seed 401): a part of an announce
/// delivered again after the holder counted as announced registered its
/// entries again, bringing back a version an invalidation had retired
/// (and a late fetch registration of it would have been accepted).
#[test]
fn a_late_duplicate_announce_does_not_bring_back_a_retired_version() {
    let mut net = Net::new(2, Config::default());
    let k = (0..).map(key).find(|k| net.nodes[0].view().home_of(k) == Some(1)).unwrap();
    net.put(0, 1, k, 5);
    net.settle();
    let view = View { epoch: 2, members: (0..2).map(|id| Member { id, incarnation: 1, capacity: 1 }).collect() };
    net.drive(0, Event::View(view.clone()));
    net.drive(1, Event::View(view));
    net.flush();
    let dup: Vec<(NodeId, NodeId, Batch)> = net
        .wire
        .iter()
        .filter(|(f, t, b)| (*f, *t) == (0, 1) && b.msgs.iter().any(|m| matches!(m, Msg::Announce { .. })))
        .cloned()
        .collect();
    assert!(!dup.is_empty(), "node 0 announced its copy to node 1");
    net.settle();
    assert!(net.nodes[1].directory_ready());
    // The copy is invalidated: the entry goes.
    net.drive(1, Event::ClientInvalidate { op: 2, key: k });
    net.settle();
    assert_eq!(net.outcome(1, 2), Some(Outcome::Invalidated));
    assert!(net.nodes[1].directory().all(|(dk, _)| dk != k));
    // The old announce arrives again.
    for (from, to, batch) in dup {
        net.drive(to, Event::Receive { from, batch });
    }
    net.settle();
    assert!(net.nodes[1].directory().all(|(dk, _)| dk != k), "a retired version came back into the directory");
    net.drive(1, Event::ClientLookup { op: 3, keys: vec![k] });
    assert_eq!(net.lookups[&(1, 3)], vec![None]);
}

/// Found by the simulator (S4, 6 nodes, seed 277): a home answered a locate
/// with itself as the holder, then (a duplicate of the locate) with a grant
/// of its own copy; the reader trusted that grant from when it sent its
/// grant request, later than the holder's lease started. A grant from the
/// home is trusted from the locate.
#[test]
fn a_grant_from_the_home_is_trusted_from_the_locate_not_later() {
    let cfg = Config::default();
    let mut net = Net::new(3, cfg.clone());
    let k = (0..).map(key).find(|k| net.nodes[0].view().home_of(k) == Some(1)).unwrap();
    net.put(1, 1, k, 5);
    net.settle();
    let (version, slot) = net.nodes[1].copy_of(&k).expect("node 1 holds its put");
    let meta = net.mem[&(1, slot)];
    let asked = net.now;
    net.drive(2, Event::ClientGet { op: 2, key: k });
    net.wire.clear(); // the locate is lost on the way
    net.now += 30_000;
    // What a home may send for one locate delivered twice: itself as the
    // holder, then a grant of its copy (started when it handled the
    // duplicate, no later than now).
    let epoch = net.nodes[2].view().epoch;
    let batch = Batch {
        epoch,
        incarnation: 1,
        msgs: vec![
            Msg::LocateResp {
                op: 2,
                key: k,
                result: kvmesh_coherence::LocateResult::Found { version, holder: 1 },
                reg: None,
            },
            Msg::GrantResp {
                op: 2,
                result: kvmesh_coherence::GrantResult::Granted { slot, meta, lease_us: cfg.grant_lease_us, grant: 9 },
                reg: None,
            },
        ],
    };
    net.drive(2, Event::Receive { from: 1, batch });
    let deadline = *net.read_deadlines.last().expect("the read started");
    assert!(
        deadline <= asked + cfg.grant_lease_us,
        "read trusted until {deadline}, past the lease of a grant asked for at {asked} ({} us)",
        cfg.grant_lease_us
    );
}

/// A registration that arrives late (held on a stream that broke and came
/// back) must not replace the registration of the copy the reader holds
/// now: the home would then let the reader's "I gave that one up" remove
/// it, forget a Valid copy, and complete the next overwrite without it.
/// (Found by `kvmesh-nemesis`: a daemon served an old version for seconds
/// after a newer put was acknowledged, right after a flapping link.)
#[test]
fn a_late_registration_never_unregisters_the_copy_held_now() {
    // The registration after the read (without locate-time registration,
    // and after a view change with it).
    let mut net = Net::new(3, Config { register_at_locate: false, ..Config::default() });
    // A key homed at node 1; node 0 writes it, node 2 reads it.
    let view = View { epoch: 1, members: (0..3).map(|id| Member { id, incarnation: 1, capacity: 1 }).collect() };
    let k = (1..10_000u128).map(key).find(|k| view.home_of(k) == Some(1)).expect("a key homed at node 1");
    net.put(0, 1, k, 0x5eed);
    net.settle();
    let Some(Outcome::Stored { version: v1 }) = net.outcome(0, 1) else { panic!("{:?}", net.outcome(0, 1)) };

    // First get by node 2: its registration at the home is held back (the
    // first one kept, every resend lost) until the get gives up.
    net.drive(2, Event::ClientGet { op: 2, key: k });
    net.settle();
    net.serve_reads(false);
    let registers = |b: &Batch| b.msgs.iter().any(|m| matches!(m, Msg::AddHolderReq { .. }));
    let mut held: Option<Batch> = None;
    for _ in 0..1_000 {
        if net.outcome(2, 2).is_some() {
            break;
        }
        net.flush();
        // Membership keeps every node serving meanwhile.
        for n in 0..3 {
            if let Some(sent_at) = net.last_keepalive(n) {
                net.drive(n, Event::KeepAliveAck { sent_at });
            }
        }
        for (from, to, batch) in std::mem::take(&mut net.wire) {
            if from == 2 && to == 1 && registers(&batch) {
                held.get_or_insert(batch);
                continue;
            }
            net.drive(to, Event::Receive { from, batch });
        }
    }
    let held = held.expect("the registration was sent");
    assert!(!matches!(net.outcome(2, 2), Some(Outcome::Hit { .. }) | None), "{:?}", net.outcome(2, 2));
    net.settle();

    // Second get: read and registered; node 2 holds v1 now.
    net.drive(2, Event::ClientGet { op: 3, key: k });
    net.settle();
    net.serve_reads(false);
    net.settle();
    assert!(
        matches!(net.outcome(2, 3), Some(Outcome::Hit { version, .. }) if version == v1),
        "{:?}",
        net.outcome(2, 3)
    );

    // The held registration of the first get arrives now.
    net.drive(1, Event::Receive { from: 2, batch: held });
    net.settle();
    let holders = net.nodes[1].directory().find(|(d, _)| *d == k).map(|(_, d)| d.holders).unwrap_or_default();
    assert!(holders.contains(&2), "the home forgot node 2's copy: holders {holders:?}");

    // An overwrite must invalidate node 2's copy before it completes.
    net.put(0, 4, k, 0x5eee);
    net.settle();
    assert!(matches!(net.outcome(0, 4), Some(Outcome::Stored { .. })), "{:?}", net.outcome(0, 4));
    net.drive(2, Event::ClientGet { op: 5, key: k });
    net.settle();
    assert!(
        !matches!(net.outcome(2, 5), Some(Outcome::Hit { version, .. }) if version == v1),
        "node 2 served the overwritten version: {:?}",
        net.outcome(2, 5)
    );
}

/// A get that gives up while its one-sided read is in flight releases the
/// holder's grant when the read ends, not when the grant lease runs out
/// (until then the holder's slot stays pinned: under a burst of timeouts,
/// pool memory held for nothing). Not before the read ends either: the
/// holder must not reuse a slot under a read.
#[test]
fn a_get_that_gives_up_mid_read_releases_the_grant_when_the_read_ends() {
    let cfg = Config { op_timeout_us: 200_000, grant_lease_us: 5_000_000, ..Config::default() };
    let mut net = Net::new(3, cfg);
    net.put(0, 1, key(7), 0xabc);
    net.settle();
    assert!(matches!(net.outcome(0, 1), Some(Outcome::Stored { .. })), "{:?}", net.outcome(0, 1));
    net.drive(2, Event::ClientGet { op: 2, key: key(7) });
    net.settle();
    assert_eq!(net.reads.len(), 1, "the read is under way");
    let holder = net.reads[0].2;
    assert_eq!(net.nodes[holder as usize].metrics().grants_outstanding, 1);
    // The read hangs past the get's deadline (membership keeps every node
    // serving meanwhile).
    for _ in 0..300 {
        net.flush();
        for n in 0..3 {
            if let Some(sent_at) = net.last_keepalive(n) {
                net.drive(n, Event::KeepAliveAck { sent_at });
            }
        }
        net.wire.clear(); // nothing the nodes say matters here
    }
    assert_eq!(net.outcome(2, 2), Some(Outcome::Miss), "the get gave up");
    assert_eq!(net.nodes[holder as usize].metrics().grants_outstanding, 1, "the read is still in flight");
    // The read ends: the grant goes back at once.
    net.serve_reads(false);
    net.settle();
    assert_eq!(
        net.nodes[holder as usize].metrics().grants_outstanding,
        0,
        "the holder's grant outlived the read (released only by its 5 s lease)"
    );
}

/// A key homed at node 1 (of three).
fn key_homed_at_1() -> BlockKey {
    let view = View { epoch: 1, members: (0..3).map(|id| Member { id, incarnation: 1, capacity: 1 }).collect() };
    (1..10_000u128).map(key).find(|k| view.home_of(k) == Some(1)).expect("a key homed at node 1")
}

/// Three nodes: node 0 put a key homed at node 1 (its version returned),
/// and node 2's get of it (op 2) is reading from node 0 now.
fn reading_on_2(cfg: Config) -> (Net, BlockKey, u64) {
    let mut net = Net::new(3, cfg);
    let k = key_homed_at_1();
    net.put(0, 1, k, 0x5eed);
    net.settle();
    let Some(Outcome::Stored { version }) = net.outcome(0, 1) else { panic!("{:?}", net.outcome(0, 1)) };
    net.drive(2, Event::ClientGet { op: 2, key: k });
    net.settle();
    assert_eq!(net.reads.len(), 1, "node 2 reads from node 0");
    (net, k, version)
}

/// With locate-time registration the home registers the reader (pending)
/// when it names the holder, so the fetched copy is Valid the moment it
/// validates — no round trip to the home after the read — and the home
/// names it as a source only once the reader confirmed it.
#[test]
fn a_fetched_copy_is_valid_when_it_validates_and_a_source_once_confirmed() {
    let (mut net, k, version) = reading_on_2(Config::default());
    let holders = net.nodes[1].directory_entry(&k).expect("entry").holders;
    assert!(holders.contains(&2), "node 2 registered (pending) at locate: {holders:?}");
    assert_eq!(net.nodes[1].metrics().pending_registrations, 1);
    net.serve_reads(false);
    // No message delivered since the read ended.
    assert!(
        matches!(net.outcome(2, 2), Some(Outcome::Hit { version: v, .. }) if v == version),
        "{:?}",
        net.outcome(2, 2)
    );
    assert_eq!(net.nodes[2].metrics().early_registrations, 1);
    // Confirmed, node 2 is a source: node 0 drops its copy, and a get on
    // node 1 (the home) reads from node 2.
    net.settle();
    net.drive(0, Event::Evict { key: k, slot: None });
    net.settle();
    net.drive(1, Event::ClientGet { op: 3, key: k });
    net.settle();
    assert_eq!(net.reads.len(), 1, "{:?}", net.outcome(1, 3));
    assert_eq!(net.reads[0].2, 2, "read from the confirmed copy on node 2");
}

/// A pending holder is invalidated like any other: an overwrite that
/// starts while its read is in flight waits for its ack, and the copy it
/// was fetching never becomes Valid.
#[test]
fn an_overwrite_waits_for_a_pending_holder_and_dooms_its_read() {
    let (mut net, k, _) = reading_on_2(Config::default());
    // Overwrite by node 0; nothing reaches node 2 for a while.
    net.put(0, 3, k, 0x5eee);
    let mut held = Vec::new();
    for _ in 0..20 {
        net.flush();
        for (from, to, batch) in std::mem::take(&mut net.wire) {
            if to == 2 {
                held.push((from, to, batch));
            } else {
                net.drive(to, Event::Receive { from, batch });
            }
        }
    }
    assert!(
        held.iter().flat_map(|h| h.2.msgs.iter()).any(|m| matches!(m, Msg::Invalidate { .. })),
        "the pending holder is invalidated"
    );
    net.wire.extend(held);
    assert_eq!(net.outcome(0, 3), None, "the overwrite completed without the pending holder's ack");
    net.settle();
    assert!(matches!(net.outcome(0, 3), Some(Outcome::Stored { .. })), "{:?}", net.outcome(0, 3));
    // The read of the old version ends now: a miss, no copy.
    net.serve_reads(false);
    net.settle();
    assert_eq!(net.outcome(2, 2), Some(Outcome::Miss));
    assert!(net.nodes[2].copy_of(&k).is_none());
}

/// A view change while a locate-registered read is in flight: the
/// registration went with the old directory (the new home rebuilt its own
/// from announces that could not include a copy still being fetched), so
/// an overwrite in the new epoch completes without the reader, and the
/// reader must register its copy again — refused now — instead of serving
/// it. Planted bug `EarlyValidAcrossEpochs` serves the overwritten version.
#[test]
fn after_a_view_change_a_fetched_copy_registers_again() {
    for bug in [None, Some(kvmesh_coherence::Bug::EarlyValidAcrossEpochs)] {
        let (mut net, k, v1) = reading_on_2(Config { bug, ..Config::default() });
        let view = View { epoch: 2, members: (0..3).map(|id| Member { id, incarnation: 1, capacity: 1 }).collect() };
        for n in 0..3 {
            net.drive(n, Event::View(view.clone()));
        }
        net.settle();
        assert!(net.nodes[1].directory_ready());
        for n in 0..3 {
            let sent_at = net.last_keepalive(n).expect("keepalives");
            net.drive(n, Event::KeepAliveAck { sent_at });
        }
        net.put(0, 3, k, 0x5eee);
        net.settle();
        assert!(matches!(net.outcome(0, 3), Some(Outcome::Stored { .. })), "{:?}", net.outcome(0, 3));
        net.serve_reads(false);
        net.settle();
        let stale = matches!(net.outcome(2, 2), Some(Outcome::Hit { version, .. }) if version == v1);
        match bug {
            None => assert!(!stale, "node 2 served v{v1:#x} after the overwrite completed"),
            Some(_) => assert!(stale, "the planted bug should serve the overwritten version: {:?}", net.outcome(2, 2)),
        }
    }
}

/// Keeps every node's membership lease (acks each one's last keepalive).
fn keep_leases(net: &mut Net) {
    for n in 0..net.nodes.len() as NodeId {
        net.drive(n, Event::Tick);
        if let Some(sent_at) = net.last_keepalive(n) {
            net.drive(n, Event::KeepAliveAck { sent_at });
        }
    }
}

/// A reader whose lease lapsed dropped its copies without telling the home
/// (its registration stays, confirmed); back in service in the same epoch,
/// its next get of the key registers again, replacing the stale entry —
/// not refused until the key changes (found in review: the first version
/// answered busy to every such get).
#[test]
fn a_stale_registration_does_not_keep_its_reader_from_the_key() {
    let (mut net, k, _) = reading_on_2(Config::default());
    net.serve_reads(false);
    net.settle();
    assert!(matches!(net.outcome(2, 2), Some(Outcome::Hit { .. })), "{:?}", net.outcome(2, 2));
    // Node 2's keepalives go unanswered past its lease: it drops its copy,
    // and tells nobody (nodes 0 and 1 keep theirs).
    for _ in 0..60 {
        net.now += 5_000;
        for n in 0..3 {
            net.drive(n, Event::Tick);
        }
        for n in 0..2 {
            let sent_at = net.last_keepalive(n).expect("keepalives");
            net.drive(n, Event::KeepAliveAck { sent_at });
        }
    }
    assert!(!net.nodes[2].serving() && net.nodes[2].copy_of(&k).is_none(), "node 2's lease lapsed");
    keep_leases(&mut net);
    assert!(net.nodes[2].serving() && net.nodes[2].copy_of(&k).is_none());
    net.wire.clear();
    net.drive(2, Event::ClientGet { op: 3, key: k });
    net.settle();
    net.serve_reads(false);
    net.settle();
    assert!(matches!(net.outcome(2, 3), Some(Outcome::Hit { .. })), "{:?}", net.outcome(2, 3));
}

/// A get that gives up before its locate is answered: the home registered
/// it anyway, and the late answer (which echoes the registration) makes
/// the reader take it back, so the directory returns to the real holders
/// and goes when they do (found in review: the registration stayed until
/// the key changed).
#[test]
fn a_late_locate_answer_is_taken_back() {
    let cfg = Config { op_timeout_us: 20_000, ..Config::default() };
    let mut net = Net::new(3, cfg);
    let k = key_homed_at_1();
    net.put(0, 1, k, 0x5eed);
    net.settle();
    net.drive(2, Event::ClientGet { op: 2, key: k });
    let mut held = Vec::new();
    for _ in 0..40 {
        net.flush();
        keep_leases(&mut net);
        for (from, to, batch) in std::mem::take(&mut net.wire) {
            if to == 2 && from == 1 {
                held.push((from, to, batch));
            } else {
                net.drive(to, Event::Receive { from, batch });
            }
        }
    }
    assert_eq!(net.outcome(2, 2), Some(Outcome::Miss), "the get gave up");
    assert_eq!(net.nodes[1].directory_entry(&k).expect("entry").holders, vec![0, 2], "registered (pending)");
    net.wire.extend(held);
    net.settle();
    assert_eq!(net.nodes[1].directory_entry(&k).expect("entry").holders, vec![0], "taken back");
    net.drive(0, Event::Evict { key: k, slot: None });
    net.settle();
    assert!(net.nodes[1].directory_entry(&k).is_none(), "the entry goes with the last holder");
}

/// A confirmation only confirms: one overtaken by the reader's
/// `RemoveHolder` (it evicted the copy meanwhile) does not register the
/// dropped copy again as a source (found in review).
#[test]
fn a_confirmation_overtaken_by_its_remove_registers_nothing() {
    let (mut net, k, _) = reading_on_2(Config::default());
    net.serve_reads(false);
    assert!(matches!(net.outcome(2, 2), Some(Outcome::Hit { .. })), "{:?}", net.outcome(2, 2));
    net.flush();
    let confirm: Vec<_> = net.wire.drain(..).filter(|(from, to, _)| (*from, *to) == (2, 1)).collect();
    assert!(
        confirm.iter().flat_map(|c| c.2.msgs.iter()).any(|m| matches!(m, Msg::AddHolderReq { .. })),
        "the confirmation is on its way"
    );
    net.drive(2, Event::Unpin { slot: net.nodes[2].copy_of(&k).expect("copy").1 });
    net.drive(2, Event::Evict { key: k, slot: None });
    net.flush();
    let remove: Vec<_> = net.wire.drain(..).filter(|(from, to, _)| (*from, *to) == (2, 1)).collect();
    for (from, to, batch) in remove.into_iter().chain(confirm) {
        net.drive(to, Event::Receive { from, batch });
    }
    assert_eq!(net.nodes[1].directory_entry(&k).expect("entry").holders, vec![0], "node 2 gave its copy up");
}

/// A lookup-table entry survives its three-word form, and words no entry
/// makes are refused.
#[test]
fn table_entries_round_trip_through_words() {
    use kvmesh_coherence::TableEntry;
    for e in [
        TableEntry { version: 1 << 32 | 5, home_copy: true, sources: [0; 3], len: 0 },
        TableEntry { version: u64::MAX, home_copy: false, sources: [7, u32::MAX, 3], len: 3 },
        TableEntry { version: 9, home_copy: true, sources: [4, 0, 0], len: 1 },
    ] {
        assert_eq!(TableEntry::from_words(e.to_words()), Some(e));
    }
    assert_eq!(TableEntry::from_words([1, 4 << 8, 0]), None, "four sources");
    assert_eq!(TableEntry::from_words([1, 2, 0]), None, "an unknown flag");
}

/// A node that left keeps no directory: its table's header says not
/// ready, so askers still in its view get no answer from it (not an
/// "absent" for keys held elsewhere), and the lookup is incomplete.
#[test]
fn the_table_of_a_node_that_left_answers_nothing() {
    let mut net = Net::new(3, Config::default());
    let k = (100..).map(key).find(|k| net.nodes[0].view().home_of(k) == Some(1)).unwrap();
    net.put(2, 10, k, 7);
    net.settle();
    let (found, complete) = net.lookup_tables(0, 11, vec![k], |h| h);
    assert!(complete);
    assert_eq!(found[0].map(|f| f.0), Some(2));
    assert!(net.nodes[1].table_header().ready);
    net.drive(1, Event::Leave);
    assert!(!net.nodes[1].table_header().ready, "a node that left says not ready");
    assert_eq!(net.nodes[1].table_entry(&k), None);
    let (found, complete) = net.lookup_tables(0, 12, vec![k], |h| h);
    assert!(!complete, "unanswered, not absent");
    assert_eq!(found, vec![None]);
}
