//! Peers: the daemon-to-daemon control channel (gRPC over TCP).
//!
//! This module keeps the handshake with every configured peer (node id,
//! incarnation, UCX worker address, pools with their remote keys — the
//! data plane connects an endpoint from it) and serves the peer service:
//! `Handshake`, `Send` (tag-matched sends of slots granted to the asker,
//! for transports without one-sided reads; daemons now send those orders
//! as UCX active messages, served by [`Peers::serve_send_orders`], and the
//! RPC stays for tools), and hands `Exchange` (the
//! coherence stream) and `ListKeys` to [`crate::cluster`], which runs the
//! protocol: which blocks exist, who may read which slot, and when.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvmesh_proto::peer::v1 as pb;
use parking_lot::Mutex;
use pb::peer_client::PeerClient;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use crate::config::{PeerConfig, PeerEntry};
use crate::dataplane::{
    CONTROL_TIMEOUT, DataPlane, Mode, PeerAddr, RemotePool, SendOrder, TransferItem, TransferOutcome,
};
use crate::staging::{StageJob, Staging, is_staged};
use crate::store::{PEER_SESSION_BASE, SlotRef, Store};
use crate::tls::PeerTls;

struct Connected {
    client: PeerClient<Channel>,
    incarnation: u64,
    /// Shared, not copied, with every read batch (descriptors carry remote
    /// keys: up to 256 pools of 16 KiB each).
    pools: Arc<[pb::PoolDesc]>,
    takes_locate_registration: bool,
    takes_push_invites: bool,
}

struct PeerState {
    entry: PeerEntry,
    conn: tokio::sync::Mutex<Option<Connected>>,
    /// Earliest time to try connecting again after a failure.
    retry_at: Mutex<Instant>,
    /// When a send order last made us shake hands again (at most once a
    /// second: an order's incarnation is the sender's claim).
    renewed_at: Mutex<Option<Instant>>,
    /// Its handshake said it takes locate-time registrations (false until
    /// a handshake says so, and after the connection is dropped).
    takes_locate_registration: std::sync::atomic::AtomicBool,
    /// Its handshake said it takes push invitations (`Frame.push_invites`).
    takes_push_invites: std::sync::atomic::AtomicBool,
    /// Why attempts to reach it failed since it was last reached (each
    /// new reason is logged as a warning, repeats at debug; a few kept).
    failing: Mutex<Vec<String>>,
}

/// Test-only fault injection, from the environment (`KVMESH_TEST_HOOK`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestHook {
    /// After granting a slot, bump its header generation as if the slot had
    /// been evicted and reused before the peer's read.
    CorruptGrantedSlots,
    /// Move host pools' blocks as GPU pools' move without a CUDA-capable
    /// UCX (through staging slots, sent on send orders): the staged data
    /// path, tested without a GPU.
    StageHostPools,
    /// Answer handshakes as a daemon from before locate-time registration
    /// would (`takes_locate_registration` false): peers send it plain
    /// locates.
    PredateLocateRegistration,
    /// Answer handshakes as a daemon from before push invitations would
    /// (`takes_push_invites` and `takes_control_frames` false), and ignore
    /// any invitation received, as such a daemon's decoder would: peers
    /// invite it to push nothing.
    PredatePushInvites,
    /// Reads reported on the data-plane thread always find the core busy
    /// (`Cluster::try_read_ended`): the fallback through a task, which a
    /// quiet test otherwise rarely takes.
    InlineReportsFindCoreBusy,
}

/// The peer side of a daemon.
pub struct Peers {
    node_id: u32,
    incarnation: u64,
    cfg: PeerConfig,
    dp: Arc<DataPlane>,
    store: Arc<Mutex<Store>>,
    peers: Vec<Arc<PeerState>>,
    /// Staging slots, when a pool is staged (docs/GPU.md).
    staging: Option<Arc<Staging>>,
    next_tag: AtomicU64,
    tls: Option<Arc<PeerTls>>,
    /// Calls refused because the caller is not a configured peer.
    unknown_refusals: AtomicU64,
    /// Peer values refused outside the core (a granted slot outside the
    /// holder's advertised pool, a send order naming no such slot...).
    pub refusals: AtomicU64,
}

impl Peers {
    /// Peers of this node.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        node_id: u32,
        incarnation: u64,
        cfg: PeerConfig,
        entries: Vec<PeerEntry>,
        dp: Arc<DataPlane>,
        store: Arc<Mutex<Store>>,
        tls: Option<Arc<PeerTls>>,
        staging: Option<Arc<Staging>>,
    ) -> Peers {
        match test_hook() {
            Some(TestHook::CorruptGrantedSlots) => {
                tracing::warn!("TEST HOOK ACTIVE: granted slots are corrupted before peers read them")
            }
            Some(TestHook::StageHostPools) => {
                tracing::warn!("TEST HOOK ACTIVE: host pools move through staging slots, as GPU pools do")
            }
            Some(TestHook::PredateLocateRegistration) => {
                tracing::warn!("TEST HOOK ACTIVE: handshakes say this daemon takes no locate-time registration")
            }
            Some(TestHook::PredatePushInvites) => {
                tracing::warn!("TEST HOOK ACTIVE: handshakes say this daemon takes no push invitations")
            }
            Some(TestHook::InlineReportsFindCoreBusy) => {
                tracing::warn!("TEST HOOK ACTIVE: reads reported on the data-plane thread always find the core busy")
            }
            None => {}
        }
        let peers = entries
            .into_iter()
            .map(|entry| {
                Arc::new(PeerState {
                    entry,
                    conn: tokio::sync::Mutex::new(None),
                    retry_at: Mutex::new(Instant::now()),
                    renewed_at: Mutex::new(None),
                    takes_locate_registration: std::sync::atomic::AtomicBool::new(false),
                    takes_push_invites: std::sync::atomic::AtomicBool::new(false),
                    failing: Mutex::new(Vec::new()),
                })
            })
            .collect();
        Peers {
            node_id,
            incarnation,
            cfg,
            dp,
            store,
            peers,
            staging,
            next_tag: AtomicU64::new(tag_start()),
            tls,
            unknown_refusals: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
        }
    }

    /// TLS material (`None`: `peer.tls.mode = "off"`).
    pub fn tls(&self) -> Option<&PeerTls> {
        self.tls.as_deref()
    }

    /// The endpoint of peer `id` at `addr`, over TLS when it is on (the
    /// server must then prove it is node `id`).
    pub fn endpoint(&self, id: u32, addr: &str) -> Result<Endpoint, String> {
        let ep = Endpoint::from_shared(format!("{}://{addr}", crate::tls::scheme(self.tls())))
            .map_err(|err| err.to_string())?;
        match self.tls() {
            Some(t) => ep.tls_config(t.client_config(id)).map_err(|e| format!("TLS: {e}")),
            None => Ok(ep),
        }
    }

    /// Calls and streams refused for who made them: not a configured
    /// peer, or a TLS certificate that does not name the node claimed.
    pub fn auth_refusals(&self) -> u64 {
        self.unknown_refusals.load(Ordering::Relaxed) + self.tls().map_or(0, |t| t.refusals.load(Ordering::Relaxed))
    }

    /// Refuses a caller claiming to be node `id` that is not a configured
    /// peer, or whose certificate names another node.
    pub fn authenticate(
        &self,
        certs: Option<&[rustls_pki_types::CertificateDer<'static>]>,
        id: u32,
    ) -> Result<(), Status> {
        if !self.peers.iter().any(|s| s.entry.id == id) {
            self.unknown_refusals.fetch_add(1, Ordering::Relaxed);
            return Err(Status::permission_denied(format!("node {id} is not in this daemon's peer list")));
        }
        crate::tls::check_certs(self.tls(), certs, id)
    }

    /// How this node moves blocks it fetches.
    pub fn mode(&self) -> Mode {
        match (self.cfg.transfer.as_str(), self.cfg.transports.as_str()) {
            ("send", _) | ("auto", "tcp") => Mode::Recv,
            _ => Mode::Get,
        }
    }

    /// Whether any peer is configured.
    pub fn any(&self) -> bool {
        !self.peers.is_empty()
    }

    /// Peers with a live handshake.
    pub async fn connected(&self) -> u32 {
        let mut n = 0;
        for p in &self.peers {
            if p.conn.lock().await.is_some() {
                n += 1;
            }
        }
        n
    }

    /// Every configured peer: id, address, and the incarnation of its
    /// handshake (None without one).
    pub async fn handshakes(&self) -> Vec<(u32, String, Option<u64>)> {
        let mut out = Vec::new();
        for p in &self.peers {
            let inc = p.conn.lock().await.as_ref().map(|c| c.incarnation);
            out.push((p.entry.id, p.entry.addr.clone(), inc));
        }
        out
    }

    /// Connects to every configured peer that is not connected yet.
    pub async fn connect_all(&self) {
        let futs = self.peers.iter().map(|p| self.ensure(p));
        futures_join_all(futs).await;
    }

    async fn ensure(&self, p: &PeerState) -> bool {
        if p.conn.lock().await.is_some() {
            return true;
        }
        // Claim this attempt (no concurrent handshakes with one peer), and
        // never hold the connection lock while a handshake may hang.
        {
            let mut retry = p.retry_at.lock();
            if Instant::now() < *retry {
                return false;
            }
            *retry = Instant::now() + CONTROL_TIMEOUT + Duration::from_millis(500);
        }
        match self.handshake(&p.entry).await {
            Ok(c) => {
                p.takes_locate_registration.store(c.takes_locate_registration, Ordering::Relaxed);
                p.takes_push_invites.store(c.takes_push_invites, Ordering::Relaxed);
                *p.conn.lock().await = Some(c);
                if !std::mem::take(&mut *p.failing.lock()).is_empty() {
                    tracing::info!(peer = p.entry.id, addr = %p.entry.addr, "peer reached");
                }
                true
            }
            Err(e) => {
                // A peer restarting is unreachable for a while: the first
                // failure (and each new reason: a refused certificate, a
                // peer naming another node id) is a warning, repeats are not.
                let mut failing = p.failing.lock();
                if !failing.contains(&e) {
                    tracing::warn!(peer = p.entry.id, addr = %p.entry.addr, "peer not reachable: {e}");
                    if failing.len() >= 8 {
                        failing.remove(0);
                    }
                    failing.push(e);
                } else {
                    tracing::debug!(peer = p.entry.id, addr = %p.entry.addr, "peer not reachable: {e}");
                }
                drop(failing);
                *p.retry_at.lock() = Instant::now() + Duration::from_millis(500);
                false
            }
        }
    }

    async fn handshake(&self, e: &PeerEntry) -> Result<Connected, String> {
        let ep = self.endpoint(e.id, &e.addr)?.connect_timeout(CONTROL_TIMEOUT).timeout(CONTROL_TIMEOUT);
        let channel = ep.connect().await.map_err(|err| format!("connect: {}", error_chain(&err)))?;
        let mut client = PeerClient::new(channel).max_decoding_message_size(16 << 20);
        let req = pb::HandshakeRequest {
            node_id: self.node_id,
            incarnation: self.incarnation,
            worker_address: self.dp.worker_address().to_vec(),
        };
        let resp = client
            .handshake(req)
            .await
            .map_err(|s| format!("handshake: {}", sources(s.message().to_string(), std::error::Error::source(&s))))?
            .into_inner();
        if resp.node_id != e.id {
            return Err(format!("peer at {} says it is node {}, config says {}", e.addr, resp.node_id, e.id));
        }
        if resp.transports != self.cfg.transports {
            return Err(format!("peer uses transports {:?}, this node {:?}", resp.transports, self.cfg.transports));
        }
        if let Err(why) = check_pools(&resp) {
            self.refusals.fetch_add(1, Ordering::Relaxed);
            return Err(format!("peer at {} refused: {why}", e.addr));
        }
        let addr = PeerAddr {
            id: e.id,
            incarnation: resp.incarnation,
            worker_address: resp.worker_address.clone(),
            // Staged pools have no remote key: never read one-sided.
            pools: resp
                .pools
                .iter()
                .filter(|p| !p.staged)
                .map(|p| RemotePool { index: p.index, base: p.base_address, bytes: p.bytes, rkey: p.rkey.clone() })
                .collect(),
            control: resp.accepts_control,
            frames: resp.takes_control_frames,
            table: resp.lookup_table.as_ref().and_then(|t| match check_table(t) {
                Ok(()) => Some(RemotePool { index: 0, base: t.base_address, bytes: t.bytes, rkey: t.rkey.clone() }),
                Err(why) => {
                    self.refusals.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(peer = e.id, "peer's lookup table refused ({why}): its lookups ask it");
                    None
                }
            }),
        };
        let desc = self.dp.connect(addr).await?;
        tracing::info!(
            peer = e.id,
            addr = %e.addr,
            incarnation = resp.incarnation,
            "peer connected; UCX endpoint:\n{}",
            desc.lines().filter(|l| l.contains("lane") || l.contains("get") || l.contains("rma")).collect::<Vec<_>>().join("\n")
        );
        Ok(Connected {
            client,
            incarnation: resp.incarnation,
            pools: resp.pools.into(),
            takes_locate_registration: resp.takes_locate_registration,
            takes_push_invites: resp.takes_push_invites,
        })
    }

    /// Whether peer `id`'s handshake said it takes locate-time
    /// registrations (locates to it are sent plain otherwise).
    pub fn takes_locate_registration(&self, id: u32) -> bool {
        self.peers
            .iter()
            .find(|p| p.entry.id == id)
            .is_some_and(|p| p.takes_locate_registration.load(Ordering::Relaxed))
    }

    /// Whether peer `id`'s handshake said it takes push invitations
    /// (`Frame.push_invites`; tcp, `peer.push_with_grants`).
    pub fn takes_push_invites(&self, id: u32) -> bool {
        self.peers.iter().find(|p| p.entry.id == id).is_some_and(|p| p.takes_push_invites.load(Ordering::Relaxed))
    }

    /// The handshake state of peer `id`: its incarnation, pools and a
    /// client of its peer service. `None` while not connected.
    pub async fn conn_info(&self, id: u32) -> Option<(u64, Arc<[pb::PoolDesc]>, PeerClient<Channel>)> {
        let p = self.peers.iter().find(|p| p.entry.id == id)?;
        let g = p.conn.lock().await;
        g.as_ref().map(|c| (c.incarnation, Arc::clone(&c.pools), c.client.clone()))
    }

    /// As [`Peers::conn_info`] without waiting: the incarnation and pools
    /// of peer `id` when connected and its handshake state is not being
    /// changed at this moment (`None` then: ask [`Peers::conn_info`]).
    pub fn try_conn_info(&self, id: u32) -> Option<(u64, Arc<[pb::PoolDesc]>)> {
        let p = self.peers.iter().find(|p| p.entry.id == id)?;
        let g = p.conn.try_lock().ok()?;
        g.as_ref().map(|c| (c.incarnation, Arc::clone(&c.pools)))
    }

    /// Shakes hands with `id` now if not connected (and no attempt is in
    /// progress or failed just before); true when connected.
    /// Waits (up to the control timeout) for an attempt already in flight.
    pub async fn connect_to(&self, id: u32) -> bool {
        let Some(p) = self.peers.iter().find(|p| p.entry.id == id) else { return false };
        let until = Instant::now() + CONTROL_TIMEOUT;
        loop {
            if self.ensure(p).await {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Forgets the handshake with `id` only if it is with incarnation
    /// `inc` (so concurrent callers do not drop a fresh one).
    pub async fn reset_if(&self, id: u32, inc: u64) {
        if let Some(p) = self.peers.iter().find(|p| p.entry.id == id) {
            let mut g = p.conn.lock().await;
            if g.as_ref().is_some_and(|c| c.incarnation == inc) {
                *g = None;
                p.takes_locate_registration.store(false, Ordering::Relaxed);
                p.takes_push_invites.store(false, Ordering::Relaxed);
                *p.retry_at.lock() = Instant::now();
            }
        }
    }

    /// The configured peers.
    pub fn entries(&self) -> impl Iterator<Item = &PeerEntry> {
        self.peers.iter().map(|p| &p.entry)
    }

    /// This node's id.
    pub fn node_id(&self) -> u32 {
        self.node_id
    }

    /// This node's incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Peer settings.
    pub fn config(&self) -> &PeerConfig {
        &self.cfg
    }

    /// The data plane.
    pub fn dataplane(&self) -> &Arc<DataPlane> {
        &self.dp
    }

    /// The fault injection active in this process, if any.
    pub fn hook(&self) -> Option<TestHook> {
        test_hook()
    }

    /// The staging slots (when a pool is staged).
    pub fn staging(&self) -> Option<&Arc<Staging>> {
        self.staging.as_ref()
    }

    /// Serves getters' send orders (tcp): the data-plane thread checks each
    /// against the grants and sends at once; an order from a getter it has
    /// no endpoint to yet is handed to a task that shakes hands first.
    pub fn serve_send_orders(self: &Arc<Self>) {
        let store = Arc::clone(&self.store);
        let staging = self.staging.clone();
        let incarnation = self.incarnation;
        let ids: Vec<u32> = self.peers.iter().map(|p| p.entry.id).collect();
        let check = move |bytes: &[u8]| -> Option<SendOrder> {
            let r = match <pb::SendRequest as prost::Message>::decode(bytes) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("peer: undecodable send order dropped: {e}");
                    return None;
                }
            };
            if !ids.contains(&r.node_id) {
                tracing::warn!(node = r.node_id, "peer: send order from a node not in the peer list dropped");
                return None;
            }
            if r.items.len() > SEND_ORDER_ITEMS_MAX {
                tracing::warn!(
                    node = r.node_id,
                    items = r.items.len(),
                    "peer: send order over {SEND_ORDER_ITEMS_MAX} slots dropped"
                );
                return None;
            }
            // An order for an earlier incarnation of this daemon: its
            // grants died with it; refuse every slot.
            let stale = r.holder_incarnation != incarnation;
            Some(order_of(&store.lock(), &r, stale, staging.as_ref()))
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let (staging_tx, mut staging_rx) = tokio::sync::mpsc::unbounded_channel::<SendOrder>();
        let send_timeout = Duration::from_millis(self.cfg.transfer_timeout_ms);
        self.dp.serve_orders(Box::new(check), tx, staging_tx, send_timeout);
        // Orders with slots of staged pools: copied into staging slots on
        // a blocking thread (device copies), then sent. At most
        // STAGED_ORDERS_MAX at once (each may wait for send slots until
        // half the transfer deadline); beyond, an order's staged slots are
        // refused at once (counted as staging exhaustion) and the rest of
        // it sent, without a task of its own.
        let weak = Arc::downgrade(self);
        let staged_slots = Arc::new(tokio::sync::Semaphore::new(STAGED_ORDERS_MAX));
        tokio::spawn(async move {
            while let Some(o) = staging_rx.recv().await {
                let Some(p) = weak.upgrade() else { break };
                let Ok(permit) = Arc::clone(&staged_slots).try_acquire_owned() else {
                    let o = refuse_staged(o, p.staging.as_ref());
                    tracing::debug!(node = o.node, "staged send order over {STAGED_ORDERS_MAX} at once: slots refused");
                    let deadline = Instant::now() + send_timeout;
                    // (Its outcomes go nowhere: the getter's receives end
                    // by the refusals, or at its deadline.)
                    let _ = p.dp.transfer_staged(
                        Mode::Send,
                        o.node,
                        o.incarnation,
                        o.items,
                        Vec::new(),
                        o.staged,
                        deadline,
                    );
                    continue;
                };
                tokio::spawn(async move {
                    let o = p.staged(o).await;
                    if let Err(e) = p.send_connecting(o, false).await {
                        tracing::debug!("staged send order not served: {e}");
                    }
                    drop(permit);
                });
            }
        });
        // Weak: the data plane (owned by Peers) holds the senders.
        let weak = Arc::downgrade(self);
        // At most UNCONNECTED_ORDERS_MAX such orders are served at once;
        // more are dropped (their getters' receives fail: a miss).
        let slots = Arc::new(tokio::sync::Semaphore::new(UNCONNECTED_ORDERS_MAX));
        tokio::spawn(async move {
            while let Some(o) = rx.recv().await {
                let Some(p) = weak.upgrade() else { break };
                let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
                    tracing::debug!(node = o.node, "send order dropped: too many orders waiting for a handshake");
                    continue;
                };
                tokio::spawn(async move {
                    if let Err(e) = p.send_connecting(o, true).await {
                        tracing::debug!("send order not served: {e}");
                    }
                    drop(permit);
                });
            }
        });
        // An endpoint the data plane dropped: shake hands again (the
        // background task does, within a second), so a new one is made.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        self.dp.report_dropped(tx);
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some((id, inc)) = rx.recv().await {
                let Some(p) = weak.upgrade() else { break };
                tracing::info!(
                    peer = id,
                    incarnation = inc,
                    "data plane dropped its endpoint to the peer; reconnecting"
                );
                p.reset_if(id, inc).await;
            }
        });
    }

    /// `o` with its staged slots copied into send staging slots (on a
    /// blocking thread: device copies).
    async fn staged(&self, mut o: SendOrder) -> SendOrder {
        let Some(staging) = self.staging.clone().filter(|_| !o.jobs.is_empty()) else { return o };
        let (node, incarnation) = (o.node, o.incarnation);
        // Wait for send slots a while (earlier sends free them): the
        // getter's read waits for us anyway, until about the same deadline.
        let deadline = Instant::now() + Duration::from_millis(self.cfg.transfer_timeout_ms / 2);
        let slots = staging.take_send_wait(o.jobs.len(), deadline).await;
        match tokio::task::spawn_blocking(move || {
            crate::staging::stage(&mut o, &staging, slots);
            o
        })
        .await
        {
            Ok(o) => o,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down: nothing to send.
            Err(_) => SendOrder { node, incarnation, items: Vec::new(), staged: Vec::new(), jobs: Vec::new() },
        }
    }

    /// Sends an order's slots, shaking hands with the getter first if we
    /// have no endpoint to its incarnation (`unconnected`: the data plane
    /// said so, whatever the handshake record says); per item, whether it
    /// was sent (refused items never are).
    async fn send_connecting(&self, o: SendOrder, unconnected: bool) -> Result<Vec<bool>, String> {
        let Some(ps) = self.peers.iter().find(|s| s.entry.id == o.node) else {
            return Err(format!("node {} is not in this daemon's peer list", o.node));
        };
        let handshake = ps.conn.lock().await.as_ref().map(|c| c.incarnation);
        match handshake {
            // A handshake with another incarnation of the getter, or the
            // data plane has no endpoint to this one: shake hands again —
            // at most once a second per peer (the order's incarnation is
            // only a claim: orders naming a wrong one must not keep
            // tearing down a good handshake). Later orders wait for the
            // handshake in flight and go out if it matches.
            Some(inc) if inc != o.incarnation || unconnected => {
                let renew = {
                    let mut at = ps.renewed_at.lock();
                    let due = at.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
                    if due {
                        *at = Some(Instant::now());
                    }
                    due
                };
                if renew {
                    self.reset_if(o.node, inc).await;
                }
            }
            _ => {}
        }
        // One handshake at a time per peer (waits for one in flight); the
        // data plane keeps an endpoint it already has to that incarnation.
        if !self.connect_to(o.node).await {
            return Err(format!("cannot reach node {} to send to it", o.node));
        }
        let granted: Vec<bool> = o.items.iter().map(|i| i.len > 0).collect();
        let deadline = Instant::now() + Duration::from_millis(self.cfg.transfer_timeout_ms);
        let n = o.items.len();
        let (_, mut rx) =
            self.dp.transfer_staged(Mode::Send, o.node, o.incarnation, o.items, Vec::new(), o.staged, deadline);
        let mut sent = vec![false; n];
        for _ in 0..n {
            match rx.recv().await {
                Some((i, TransferOutcome::Done)) => sent[i] = granted[i],
                Some(_) => {}
                None => break,
            }
        }
        Ok(sent)
    }

    /// A fresh tag for a tag-matched transfer.
    pub fn next_tag(&self) -> u64 {
        self.next_tag.fetch_add(1, Ordering::Relaxed)
    }
}

/// Where this daemon's receive tags start: 64 random bits (UCX matches a
/// tagged message to a posted receive worker-wide, from any endpoint, so a
/// process that reaches the worker could otherwise aim messages at the
/// receives a counter from 1 names; it must now guess). Consecutive after
/// it (wrapping): unique among the receives in flight. A forged message
/// that still hit one would fail validation (a miss, never wrong bytes).
fn tag_start() -> u64 {
    getrandom::u64().unwrap_or_else(|e| {
        tracing::warn!("no OS randomness for UCX tags ({e}); using std's per-process hash keys");
        std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), std::process::id())
    })
}

/// Most send orders from getters without an endpoint yet served at once.
const UNCONNECTED_ORDERS_MAX: usize = 64;

/// Most send orders with slots of staged pools served at once.
const STAGED_ORDERS_MAX: usize = 64;

/// `o` with every slot still to stage refused (`len` 0, sent as a
/// refusal), counted as staging exhaustion; its other items unchanged.
fn refuse_staged(mut o: SendOrder, staging: Option<&Arc<Staging>>) -> SendOrder {
    match staging {
        Some(st) => {
            st.exhausted.fetch_add(o.jobs.len() as u64, Ordering::Relaxed);
            crate::staging::stage(&mut o, st, Vec::new());
        }
        // (No staging: no order has jobs; none are sent regardless.)
        None => {
            for j in std::mem::take(&mut o.jobs) {
                o.items[j.item].len = 0;
            }
        }
    }
    o
}

/// Most pools a peer may advertise (a pool index has 8 bits in a slot
/// reference).
pub const PEER_POOLS_MAX: usize = 256;

/// What a peer's handshake answer must be before anything of it is used:
/// pools with distinct indices below [`PEER_POOLS_MAX`], whole slots, an
/// address range that does not wrap, bounded UCX buffers.
pub fn check_pools(r: &pb::HandshakeResponse) -> Result<(), String> {
    if r.worker_address.is_empty() || r.worker_address.len() > kvmesh_ucx::WORKER_ADDRESS_MAX {
        return Err(format!("worker address of {} bytes", r.worker_address.len()));
    }
    if r.pools.len() > PEER_POOLS_MAX {
        return Err(format!("{} pools (at most {PEER_POOLS_MAX})", r.pools.len()));
    }
    let mut seen = std::collections::HashSet::new();
    for p in &r.pools {
        if p.index as usize >= PEER_POOLS_MAX || !seen.insert(p.index) {
            return Err(format!("pool index {} out of range or repeated", p.index));
        }
        if p.slot_stride_bytes == 0 || p.bytes % p.slot_stride_bytes != 0 || p.slot_payload_bytes > p.slot_stride_bytes
        {
            return Err(format!(
                "pool {}: {} bytes in slots of {} ({} payload)",
                p.index, p.bytes, p.slot_stride_bytes, p.slot_payload_bytes
            ));
        }
        if p.base_address.checked_add(p.bytes).is_none() {
            return Err(format!("pool {}: {} bytes at {:#x} wrap the address space", p.index, p.bytes, p.base_address));
        }
        if (p.rkey.is_empty() && !p.staged) || p.rkey.len() > kvmesh_ucx::RKEY_MAX {
            return Err(format!("pool {}: remote key of {} bytes", p.index, p.rkey.len()));
        }
    }
    Ok(())
}

/// Largest lookup table taken from a peer (a bound on what this process
/// maps of it; 2^24 keys at 128 bytes each).
pub const PEER_TABLE_BYTES_MAX: u64 = 2 << 30;

/// A peer's lookup-table description, checked before anything maps it.
pub fn check_table(t: &pb::TableDesc) -> Result<(), String> {
    if t.bytes < 8 || !t.bytes.is_multiple_of(8) || t.bytes > PEER_TABLE_BYTES_MAX {
        return Err(format!("{} bytes (whole words, at most {PEER_TABLE_BYTES_MAX})", t.bytes));
    }
    if !t.base_address.is_multiple_of(8) || t.base_address.checked_add(t.bytes).is_none() {
        return Err(format!("{} bytes at {:#x}", t.bytes, t.base_address));
    }
    if t.rkey.is_empty() || t.rkey.len() > kvmesh_ucx::RKEY_MAX {
        return Err(format!("remote key of {} bytes", t.rkey.len()));
    }
    Ok(())
}

/// Runs futures concurrently on the current task and collects their outputs
/// in order (a small `join_all`).
async fn futures_join_all<F: std::future::Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let handles: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut outs: Vec<Option<F::Output>> = (0..handles.len()).map(|_| None).collect();
    let mut handles: Vec<Option<_>> = handles.into_iter().map(Some).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, h) in handles.iter_mut().enumerate() {
            if let Some(f) = h {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        outs[i] = Some(v);
                        *h = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    outs.into_iter().map(|o| o.expect("every future finished")).collect()
}

/// What a holder sends for a getter's order: only slots granted to that
/// getter (pinned under its session) go out; the others (and all of them
/// when `refuse_all`) as empty messages with the getter's tag, so its
/// receives end at once as refusals. A slot of a staged pool goes out
/// from a staging slot: its copy is a job of the order for
/// [`crate::staging::stage`], run off the data-plane thread and outside the
/// store lock (the grant's pin keeps the slot as granted).
fn order_of(st: &Store, r: &pb::SendRequest, refuse_all: bool, staging: Option<&Arc<Staging>>) -> SendOrder {
    let session = PEER_SESSION_BASE + r.node_id as u64;
    // A slot named twice in one order is sent once (a getter reads each
    // granted slot into one place): repeats are refused, so one message
    // cannot multiply the bytes a holder sends.
    let mut seen = rustc_hash::FxHashSet::default();
    seen.reserve(r.items.len());
    let mut jobs = Vec::new();
    let items = r
        .items
        .iter()
        .enumerate()
        .map(|(i, it)| {
            let sref = SlotRef { pool: it.pool, slot: it.slot, generation: it.generation };
            let first = seen.insert((it.pool, it.slot));
            let geometry = st.pool_geometry(it.pool).filter(|_| first && !refuse_all && st.holds_pin(session, sref));
            let (local_pool, local_offset, len) = match geometry {
                Some((stride, _)) => (it.pool, it.slot as u64 * stride, stride),
                None => (0, 0, 0),
            };
            if len > 0 && staging.is_some() {
                let memory = &st.pools()[it.pool as usize].memory;
                if is_staged(memory) {
                    jobs.push(StageJob { item: i, memory: memory.clone(), offset: local_offset, len });
                }
            }
            TransferItem { remote_pool: 0, remote_offset: 0, len, local_pool, local_offset, tag: it.tag }
        })
        .collect();
    SendOrder { node: r.node_id, incarnation: r.incarnation, items, staged: Vec::new(), jobs }
}

/// The N of a test hook `KVMESH_TEST_HOOK=<name>:N` (a duration in ms)
/// when this process has that one.
pub fn test_hook_ms(name: &str) -> Option<u64> {
    std::env::var("KVMESH_TEST_HOOK").ok()?.strip_prefix(name)?.strip_prefix(':')?.parse().ok()
}

/// The test hook of this process (`KVMESH_TEST_HOOK`), read once.
pub fn test_hook() -> Option<TestHook> {
    static HOOK: std::sync::OnceLock<Option<TestHook>> = std::sync::OnceLock::new();
    *HOOK.get_or_init(|| match std::env::var("KVMESH_TEST_HOOK").as_deref() {
        Ok("corrupt-granted-slots") => Some(TestHook::CorruptGrantedSlots),
        Ok("stage-host-pools") => Some(TestHook::StageHostPools),
        Ok("predate-locate-registration") => Some(TestHook::PredateLocateRegistration),
        Ok("predate-push-invites") => Some(TestHook::PredatePushInvites),
        Ok("inline-reports-find-core-busy") => Some(TestHook::InlineReportsFindCoreBusy),
        _ => None,
    })
}

/// Most slots one send-order message may name (getters send at most
/// 1,024; a 64 KiB message could otherwise name ~30,000 tiny items).
pub(crate) const SEND_ORDER_ITEMS_MAX: usize = 4096;

/// Most keys one `ListKeys` answer carries (about 32 MiB on the wire).
pub const LIST_KEYS_MAX: usize = 1 << 20;

/// The peer gRPC service.
pub struct PeerService {
    /// Shared peer state.
    pub peers: Arc<Peers>,
    /// The coherence driver.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
}

#[tonic::async_trait]
impl pb::peer_server::Peer for PeerService {
    async fn handshake(&self, req: Request<pb::HandshakeRequest>) -> Result<Response<pb::HandshakeResponse>, Status> {
        let certs = req.peer_certs();
        let r = req.into_inner();
        let p = &self.peers;
        // The pools' remote keys go only to an authenticated peer.
        p.authenticate(certs.as_deref().map(Vec::as_slice), r.node_id)?;
        let st = p.store.lock();
        let pools = st
            .pools()
            .iter()
            .map(|sp| {
                // A staged pool is sent from staging slots: no remote key
                // (a GPU pool has no registration at all).
                let dp = p.dp.pools().iter().find(|d| d.index == sp.index);
                let staged = is_staged(&sp.memory) || dp.is_none();
                pb::PoolDesc {
                    index: sp.index,
                    base_address: dp.map_or(0, |d| d.base),
                    bytes: sp.memory.len(),
                    slot_stride_bytes: sp.stride,
                    slot_payload_bytes: sp.slot_payload_bytes,
                    rkey: if staged { Vec::new() } else { dp.map(|d| d.rkey.clone()).unwrap_or_default() },
                    staged,
                }
            })
            .collect();
        tracing::info!(peer = r.node_id, incarnation = r.incarnation, "handshake from peer");
        Ok(Response::new(pb::HandshakeResponse {
            node_id: p.node_id,
            incarnation: p.incarnation,
            worker_address: p.dp.worker_address().to_vec(),
            pools,
            transports: p.cfg.transports.clone(),
            accepts_control: p.tls.is_none(),
            takes_locate_registration: test_hook() != Some(TestHook::PredateLocateRegistration),
            takes_push_invites: test_hook() != Some(TestHook::PredatePushInvites),
            takes_control_frames: p.tls.is_none() && test_hook() != Some(TestHook::PredatePushInvites),
            lookup_table: p.dp.table().map(|t| pb::TableDesc {
                base_address: t.base,
                bytes: t.bytes,
                rkey: t.rkey.clone(),
            }),
        }))
    }

    async fn send(&self, req: Request<pb::SendRequest>) -> Result<Response<pb::SendResponse>, Status> {
        let certs = req.peer_certs();
        let r = req.into_inner();
        let p = &self.peers;
        p.authenticate(certs.as_deref().map(Vec::as_slice), r.node_id)?;
        if r.holder_incarnation != p.incarnation {
            return Err(Status::failed_precondition("this daemon restarted; handshake again"));
        }
        if r.items.len() > 65536 {
            return Err(Status::invalid_argument(format!("send of {} blocks exceeds 65536", r.items.len())));
        }
        let order = order_of(&p.store.lock(), &r, false, p.staging.as_ref());
        let order = p.staged(order).await;
        let sent = p.send_connecting(order, false).await.map_err(Status::unavailable)?;
        Ok(Response::new(pb::SendResponse { sent }))
    }

    type ExchangeStream = crate::cluster::FrameStream;

    async fn exchange(
        &self,
        req: Request<tonic::Streaming<pb::Frame>>,
    ) -> Result<Response<Self::ExchangeStream>, Status> {
        let cluster = self.cluster.clone().ok_or_else(|| Status::unavailable("coherence is not running"))?;
        let certs = req.peer_certs();
        let peers = Arc::clone(&self.peers);
        let auth = move |id: u32| peers.authenticate(certs.as_deref().map(Vec::as_slice), id);
        Ok(Response::new(cluster.serve_stream(req.into_inner(), auth).await?))
    }

    type WatchEventsStream = crate::service::EventsStream;

    async fn watch_events(
        &self,
        req: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        let certs = req.peer_certs();
        let r = req.into_inner();
        self.peers.authenticate(certs.as_deref().map(Vec::as_slice), r.node_id)?;
        let ns = self.peers.store.lock().namespace_by_name(&r.namespace)?.id;
        Ok(Response::new(crate::service::watch_events(&self.peers.store, ns, r.snapshot)?))
    }

    async fn list_keys(&self, req: Request<pb::ListKeysRequest>) -> Result<Response<pb::ListKeysResponse>, Status> {
        // No node id in the request: with TLS, the certificate must name
        // one of the configured peers.
        if let Some(t) = self.peers.tls() {
            let certs = req.peer_certs();
            let leaf = certs.as_deref().and_then(|c| c.first());
            if !self.peers.peers.iter().any(|p| leaf.is_some_and(|l| crate::tls::cert_names_node(l, p.entry.id))) {
                t.refusals.fetch_add(1, Ordering::Relaxed);
                return Err(Status::permission_denied("the TLS client certificate names no configured peer"));
            }
        }
        let cluster = self.cluster.as_ref().ok_or_else(|| Status::unavailable("coherence is not running"))?;
        let keys = cluster.local_keys(req.into_inner().namespace_fingerprint);
        if keys.len() > LIST_KEYS_MAX {
            return Err(Status::resource_exhausted(format!(
                "{} keys in the namespace here, more than one listing carries ({LIST_KEYS_MAX}); invalidate by key",
                keys.len()
            )));
        }
        let keys = keys
            .into_iter()
            .map(|k| pb::BlockRef { namespace_fingerprint: k.ns, key_hi: (k.key >> 64) as u64, key_lo: k.key as u64 })
            .collect();
        Ok(Response::new(pb::ListKeysResponse { keys }))
    }
}

/// An error with its sources ("transport error: ...: certificate not
/// trusted"): tonic's transport error alone says only "transport error".
fn error_chain(e: &dyn std::error::Error) -> String {
    sources(e.to_string(), e.source())
}

/// `s`, then each error of the chain from `src`.
fn sources(mut s: String, mut src: Option<&dyn std::error::Error>) -> String {
    while let Some(c) = src {
        // (Some errors repeat their source in their own text.)
        let t = c.to_string();
        if !s.ends_with(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::AllocOutcome;
    use kvmesh_common::Key;

    /// Receive tags start at random, not at 1 (two starts alike: odds 2^-64).
    #[test]
    fn receive_tags_start_at_random() {
        let (a, b) = (tag_start(), tag_start());
        assert_ne!(a, b, "two daemons' tags start alike");
        assert!(a > 1 << 32 || b > 1 << 32, "tags start low: {a}, {b}");
    }

    /// An order over the staged-order limit: its slots still to stage go
    /// as refusals at once (counted as staging exhaustion, no copy made),
    /// its other items as they were.
    #[test]
    fn a_staged_order_over_the_limit_refuses_its_staged_slots_only() {
        let st = Staging::new(4, 4096, 9, false).unwrap();
        let pool =
            crate::memory::PoolMemory::Host(Arc::new(kvmesh_ffi_os::SharedMapping::create("p", 16384, false).unwrap()));
        let item = |off| TransferItem {
            remote_pool: 0,
            remote_offset: 0,
            len: 4096,
            local_pool: 0,
            local_offset: off,
            tag: off,
        };
        let order = || SendOrder {
            node: 2,
            incarnation: 1,
            items: vec![item(0), item(4096), item(8192)],
            staged: Vec::new(),
            jobs: vec![
                StageJob { item: 0, memory: pool.clone(), offset: 0, len: 4096 },
                StageJob { item: 2, memory: pool.clone(), offset: 8192, len: 4096 },
            ],
        };
        for staging in [Some(&st), None] {
            let o = refuse_staged(order(), staging);
            assert!(o.jobs.is_empty() && o.staged.is_empty(), "{o:?}");
            let lens: Vec<u64> = o.items.iter().map(|i| i.len).collect();
            assert_eq!(lens, [0, 4096, 0], "staged items refused, the host one kept");
            assert_eq!(o.items[1].local_offset, 4096);
        }
        assert_eq!(st.exhausted.load(Ordering::Relaxed), 2, "two staged sends refused");
        assert_eq!(st.staged_sends.load(Ordering::Relaxed), 0, "nothing copied");
        assert_eq!(st.free_slots(), 4, "no staging slot taken");
    }

    /// A send order sends only slots pinned for the asking node's grants,
    /// each once however often the order names it.
    #[test]
    fn a_send_order_sends_each_granted_slot_once() {
        let cfg = crate::Config::parse(
            "[[pools]]\nname = \"t\"\nbytes = \"1MiB\"\nslot_payload_bytes = 4096\nmlock = false\n",
            "t",
        )
        .unwrap();
        let mut st = Store::new(cfg).unwrap();
        let now = Instant::now();
        st.open_session(1).unwrap();
        let ns = st.register_namespace("n", 4096, "").unwrap().id;
        let (out, _) = st.allocate(1, ns, &[Key(5)], 0, now).unwrap();
        let AllocOutcome::Allocated { slot, .. } = out[0] else { panic!("{:?}", out[0]) };
        let jobs = st.begin_commit(1, &[slot]).unwrap();
        let j = jobs[0].clone().unwrap();
        st.finish_commit(&[(slot, j.memory.checksum(j.offset, j.len).unwrap())]);
        // Node 2 holds a grant on it (the driver pins it under node 2's
        // peer session).
        st.pin_slots(PEER_SESSION_BASE + 2, &[slot], 10_000, now).unwrap();
        let item = pb::SendItem { pool: slot.pool, slot: slot.slot, generation: slot.generation, tag: 1 };
        let order = |node: u32| pb::SendRequest {
            node_id: node,
            incarnation: 1,
            holder_incarnation: 0,
            items: vec![item, pb::SendItem { tag: 2, ..item }, pb::SendItem { tag: 3, ..item }],
        };
        let lens: Vec<u64> = order_of(&st, &order(2), false, None).items.iter().map(|i| i.len).collect();
        assert!(lens[0] > 0 && lens[1..] == [0, 0], "sent once: {lens:?}");
        // Not pinned for node 3, and everything refused for a stale order.
        assert!(order_of(&st, &order(3), false, None).items.iter().all(|i| i.len == 0));
        assert!(order_of(&st, &order(2), true, None).items.iter().all(|i| i.len == 0));
    }
}
