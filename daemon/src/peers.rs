//! Peers: the daemon-to-daemon control channel (gRPC over TCP) and remote
//! fetches over the data plane.
//!
//! A remote fetch, for the keys an engine asked for and this node misses:
//! 1. ask every connected peer which of them it holds (`Query`, batched per
//!    peer); a holder pins each found slot for the grant lease and answers
//!    with pool, slot, generation, version and checksum;
//! 2. reserve local slots (as an uncommitted put of the daemon's own fetch
//!    session);
//! 3. read each holder slot — header, payload and trailer — straight into
//!    the local slot with one-sided UCX gets (data plane);
//! 4. validate what arrived against the grant: header and trailer equal,
//!    both naming the granted key, version and generation, payload hashing
//!    to the checksum. Only then commit it locally (the header is rewritten
//!    with the local generation). A mismatch is a miss and a counted
//!    validation failure, never data handed out;
//! 5. release the grants.
//!
//! Membership is the static peer list of the config; the full directory and
//! coherence protocol (`kvmesh-coherence`) take over later.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvmesh_common::Key;
use kvmesh_common::slot::{SlotMeta as LayoutMeta, SlotState, validate_slot};
use kvmesh_proto::peer::v1 as pb;
use parking_lot::Mutex;
use pb::peer_client::PeerClient;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use crate::config::{PeerConfig, PeerEntry};
use crate::dataplane::{CONTROL_TIMEOUT, DataPlane, Mode, PeerAddr, RemotePool, TransferItem, TransferOutcome};
use crate::store::{AllocOutcome, FETCH_SESSION, Namespace, PEER_SESSION_BASE, SlotRef, Store};

/// Counters of remote traffic.
#[derive(Default)]
pub struct PeerCounters {
    /// Keys asked of peers and found nowhere.
    pub remote_misses: AtomicU64,
    /// Transferred slots that failed validation.
    pub validation_failures: AtomicU64,
    /// Transfers that failed.
    pub transfer_failures: AtomicU64,
    /// Transfers past their deadline.
    pub transfer_timeouts: AtomicU64,
}

struct Connected {
    client: PeerClient<Channel>,
    incarnation: u64,
    pools: Vec<pb::PoolDesc>,
}

struct PeerState {
    entry: PeerEntry,
    conn: tokio::sync::Mutex<Option<Connected>>,
    /// Earliest time to try connecting again after a failure.
    retry_at: Mutex<Instant>,
}

/// Test-only fault injection, from the environment (`KVMESH_TEST_HOOK`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestHook {
    /// After granting a slot, bump its header generation as if the slot had
    /// been evicted and reused before the peer's read.
    CorruptGrantedSlots,
}

/// The peer side of a daemon.
pub struct Peers {
    node_id: u32,
    incarnation: u64,
    cfg: PeerConfig,
    dp: Arc<DataPlane>,
    store: Arc<Mutex<Store>>,
    peers: Vec<Arc<PeerState>>,
    /// Remote traffic counters.
    pub counters: PeerCounters,
    hook: Option<TestHook>,
    next_tag: AtomicU64,
}

impl Peers {
    /// Peers of this node.
    pub fn new(
        node_id: u32,
        incarnation: u64,
        cfg: PeerConfig,
        entries: Vec<PeerEntry>,
        dp: Arc<DataPlane>,
        store: Arc<Mutex<Store>>,
    ) -> Peers {
        let hook = match std::env::var("KVMESH_TEST_HOOK").as_deref() {
            Ok("corrupt-granted-slots") => {
                tracing::warn!("TEST HOOK ACTIVE: granted slots are corrupted before peers read them");
                Some(TestHook::CorruptGrantedSlots)
            }
            _ => None,
        };
        let peers = entries
            .into_iter()
            .map(|entry| {
                Arc::new(PeerState { entry, conn: tokio::sync::Mutex::new(None), retry_at: Mutex::new(Instant::now()) })
            })
            .collect();
        Peers {
            node_id,
            incarnation,
            cfg,
            dp,
            store,
            peers,
            counters: PeerCounters::default(),
            hook,
            next_tag: AtomicU64::new(1),
        }
    }

    /// How this node moves blocks it fetches.
    fn mode(&self) -> Mode {
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
                *p.conn.lock().await = Some(c);
                true
            }
            Err(e) => {
                tracing::debug!(peer = p.entry.id, addr = %p.entry.addr, "peer not reachable: {e}");
                *p.retry_at.lock() = Instant::now() + Duration::from_millis(500);
                false
            }
        }
    }

    async fn handshake(&self, e: &PeerEntry) -> Result<Connected, String> {
        let ep = Endpoint::from_shared(format!("http://{}", e.addr))
            .map_err(|err| err.to_string())?
            .connect_timeout(CONTROL_TIMEOUT)
            .timeout(CONTROL_TIMEOUT);
        let channel = ep.connect().await.map_err(|err| format!("connect: {err}"))?;
        let mut client = PeerClient::new(channel).max_decoding_message_size(16 << 20);
        let req = pb::HandshakeRequest {
            node_id: self.node_id,
            incarnation: self.incarnation,
            worker_address: self.dp.worker_address().to_vec(),
        };
        let resp = client.handshake(req).await.map_err(|s| format!("handshake: {}", s.message()))?.into_inner();
        if resp.node_id != e.id {
            return Err(format!("peer at {} says it is node {}, config says {}", e.addr, resp.node_id, e.id));
        }
        if resp.transports != self.cfg.transports {
            return Err(format!("peer uses transports {:?}, this node {:?}", resp.transports, self.cfg.transports));
        }
        let addr = PeerAddr {
            id: e.id,
            incarnation: resp.incarnation,
            worker_address: resp.worker_address.clone(),
            pools: resp
                .pools
                .iter()
                .map(|p| RemotePool { index: p.index, base: p.base_address, rkey: p.rkey.clone() })
                .collect(),
        };
        let desc = self.dp.connect(addr).await?;
        tracing::info!(
            peer = e.id,
            addr = %e.addr,
            incarnation = resp.incarnation,
            "peer connected; UCX endpoint:\n{}",
            desc.lines().filter(|l| l.contains("lane") || l.contains("get") || l.contains("rma")).collect::<Vec<_>>().join("\n")
        );
        Ok(Connected { client, incarnation: resp.incarnation, pools: resp.pools })
    }

    async fn drop_conn(&self, p: &PeerState) {
        *p.conn.lock().await = None;
        *p.retry_at.lock() = Instant::now();
    }

    /// Fetches `keys` of `ns` from peers into the local pool. Returns how
    /// many blocks were fetched, validated and committed.
    pub async fn fetch(&self, ns: &Namespace, keys: &[Key]) -> usize {
        if keys.is_empty() || self.peers.is_empty() {
            return 0;
        }
        let t_start = Instant::now();
        let deadline = t_start + Duration::from_millis(self.cfg.transfer_timeout_ms);
        let Some((stride, payload_cap)) = self.store.lock().pool_geometry(ns.pool) else { return 0 };
        // 1. Ask every peer (concurrently).
        let asks = self.peers.iter().map(|p| self.query(p, ns, keys, stride, payload_cap));
        let answers = futures_join_all(asks).await;
        // Choose one holder per key; release the other grants.
        let mut chosen: Vec<Option<(usize, pb::Grant)>> = vec![None; keys.len()];
        let mut extra: HashMap<usize, Vec<pb::SlotRef>> = HashMap::new();
        for (pi, ans) in answers.into_iter().enumerate() {
            let Some(grants) = ans else { continue };
            for (ki, g) in grants.into_iter().enumerate() {
                if !g.found {
                    continue;
                }
                if chosen[ki].is_none() {
                    chosen[ki] = Some((pi, g));
                } else {
                    extra.entry(pi).or_default().push(slot_ref(&g));
                }
            }
        }
        let t_queried = Instant::now();
        let missing = chosen.iter().filter(|c| c.is_none()).count();
        self.counters.remote_misses.fetch_add(missing as u64, Ordering::Relaxed);
        // 2. Reserve local slots.
        let want: Vec<(usize, Key)> =
            chosen.iter().enumerate().filter(|(_, c)| c.is_some()).map(|(i, _)| (i, keys[i])).collect();
        let want_keys: Vec<Key> = want.iter().map(|(_, k)| *k).collect();
        let allocs =
            match self.store.lock().allocate(FETCH_SESSION, ns.id, &want_keys, self.cfg.grant_lease_ms, Instant::now())
            {
                Ok((a, _)) => a,
                Err(e) => {
                    tracing::debug!("remote fetch: no local slots: {e}");
                    vec![AllocOutcome::InProgress; want.len()]
                }
            };
        // 3. Transfers, grouped per holder.
        struct Job {
            peer: usize,
            key: Key,
            grant: pb::Grant,
            local: SlotRef,
            local_offset: u64,
        }
        let mut jobs: Vec<Job> = Vec::new();
        for ((ki, key), a) in want.iter().zip(allocs) {
            let (pi, g) = chosen[*ki].expect("wanted keys were chosen");
            match a {
                AllocOutcome::Allocated { slot, payload_offset } => jobs.push(Job {
                    peer: pi,
                    key: *key,
                    grant: g,
                    local: slot,
                    local_offset: payload_offset - kvmesh_common::slot::HEADER_BYTES as u64,
                }),
                // Someone put it meanwhile: no transfer needed.
                _ => extra.entry(pi).or_default().push(slot_ref(&g)),
            }
        }
        let mut by_peer: HashMap<usize, Vec<usize>> = HashMap::new();
        for (j, job) in jobs.iter().enumerate() {
            by_peer.entry(job.peer).or_default().push(j);
        }
        let mut incs: HashMap<usize, (u64, PeerClient<Channel>)> = HashMap::new();
        for &pi in by_peer.keys() {
            if let Some(c) = self.peers[pi].conn.lock().await.as_ref() {
                incs.insert(pi, (c.incarnation, c.client.clone()));
            }
        }
        let mode = self.mode();
        // 4. Each read is validated as soon as it lands, while the others
        // are still moving; only a validated copy is committed.
        enum Verdict {
            Ok,
            Bad,
            Stuck,
            PeerDown,
        }
        let mappings: Vec<_> = self.store.lock().pools().iter().map(|p| Arc::clone(&p.mapping)).collect();
        let jobs_ref = &jobs;
        let mappings_ref = &mappings;
        let transfers = by_peer.iter().map(|(&pi, js)| {
            let items: Vec<TransferItem> = js
                .iter()
                .map(|&j| TransferItem {
                    remote_pool: jobs_ref[j].grant.pool,
                    remote_offset: jobs_ref[j].grant.slot as u64 * stride,
                    len: stride,
                    local_pool: jobs_ref[j].local.pool,
                    local_offset: jobs_ref[j].local_offset,
                    tag: self.next_tag.fetch_add(1, Ordering::Relaxed),
                })
                .collect();
            let (inc, client) = match incs.get(&pi) {
                Some((i, c)) => (*i, Some(c.clone())),
                None => (0, None),
            };
            let id = self.peers[pi].entry.id;
            // In send mode the receives are posted first; the holder is then
            // asked to send (below, concurrently with consuming completions).
            let send_items: Vec<pb::SendItem> = items
                .iter()
                .zip(js.iter())
                .map(|(it, &j)| pb::SendItem {
                    pool: jobs_ref[j].grant.pool,
                    slot: jobs_ref[j].grant.slot,
                    generation: jobs_ref[j].grant.generation,
                    tag: it.tag,
                })
                .collect();
            let (batch, mut rx) = self.dp.transfer_stream(mode, id, inc, items, deadline);
            let ask_holder = async move {
                if mode != Mode::Recv {
                    return;
                }
                let req = pb::SendRequest {
                    node_id: self.node_id,
                    incarnation: self.incarnation,
                    holder_incarnation: inc,
                    items: send_items,
                };
                let sent = match client {
                    Some(mut c) => match c.send(req).await {
                        Ok(r) => r.into_inner().sent.iter().all(|&b| b),
                        Err(s) => {
                            tracing::debug!(peer = id, "send request failed: {}", s.message());
                            false
                        }
                    },
                    None => false,
                };
                if !sent {
                    // Nothing (more) will arrive: stop the receives.
                    self.dp.cancel(batch);
                }
            };
            let consume = async move {
                let mut verdicts: Vec<(usize, Verdict)> = Vec::with_capacity(js.len());
                while verdicts.len() < js.len() {
                    let Some((i, outcome)) = rx.recv().await else { break };
                    let j = js[i];
                    let job = &jobs_ref[j];
                    let v = match outcome {
                        TransferOutcome::Done => {
                            let expected = LayoutMeta {
                                state: SlotState::Valid,
                                namespace: ns.fingerprint,
                                key: job.key,
                                version: job.grant.version,
                                generation: job.grant.generation,
                                payload_len: job.grant.payload_bytes,
                                checksum: job.grant.checksum,
                            };
                            let valid = mappings_ref[job.local.pool as usize]
                                .read(job.local_offset, stride)
                                .map_err(|e| e.to_string())
                                .and_then(|bytes| {
                                    validate_slot(&bytes, payload_cap, &expected).map(|_| ()).map_err(|e| e.to_string())
                                });
                            match valid {
                                Ok(()) if Instant::now() <= deadline => Verdict::Ok,
                                Ok(()) => {
                                    self.counters.transfer_timeouts.fetch_add(1, Ordering::Relaxed);
                                    Verdict::Bad
                                }
                                Err(e) => {
                                    self.counters.validation_failures.fetch_add(1, Ordering::Relaxed);
                                    tracing::warn!(peer = id, key = %job.key, "remote block rejected: {e}");
                                    Verdict::Bad
                                }
                            }
                        }
                        TransferOutcome::Failed(e) => {
                            self.counters.transfer_failures.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(peer = id, "transfer failed: {e}");
                            Verdict::PeerDown
                        }
                        TransferOutcome::TimedOut => {
                            self.counters.transfer_timeouts.fetch_add(1, Ordering::Relaxed);
                            Verdict::Stuck
                        }
                    };
                    verdicts.push((j, v));
                }
                if verdicts.len() < js.len() {
                    // The data plane vanished: nothing will write these.
                    let seen: Vec<usize> = verdicts.iter().map(|(j, _)| *j).collect();
                    for &j in js.iter().filter(|j| !seen.contains(j)) {
                        verdicts.push((j, Verdict::PeerDown));
                    }
                }
                verdicts
            };
            async move { tokio::join!(ask_holder, consume).1 }
        });
        let all = futures_join_all(transfers).await;
        let t_moved = Instant::now();
        let mut ok: Vec<(SlotRef, u64, u64)> = Vec::new();
        let mut bad: Vec<SlotRef> = Vec::new();
        let mut stuck: Vec<SlotRef> = Vec::new();
        let mut dead_peers: Vec<usize> = Vec::new();
        for (j, v) in all.into_iter().flatten() {
            let job = &jobs[j];
            match v {
                Verdict::Ok => ok.push((job.local, job.grant.version, job.grant.checksum)),
                Verdict::Bad => bad.push(job.local),
                Verdict::PeerDown => {
                    bad.push(job.local);
                    dead_peers.push(job.peer);
                }
                Verdict::Stuck => {
                    stuck.push(job.local);
                    dead_peers.push(job.peer);
                }
            }
            extra.entry(job.peer).or_default().push(slot_ref(&job.grant));
        }
        {
            let mut st = self.store.lock();
            let refs: Vec<SlotRef> = ok.iter().map(|(r, _, _)| *r).collect();
            if let Ok(jobs) = st.begin_commit(FETCH_SESSION, &refs) {
                let done: Vec<(SlotRef, u64, u64)> =
                    ok.iter().zip(jobs).filter(|(_, j)| j.is_some()).map(|(x, _)| *x).collect();
                st.finish_fetch(&done);
            }
            let _ = st.abort(FETCH_SESSION, &bad);
            for r in stuck {
                st.quarantine(FETCH_SESSION, r);
            }
        }
        tracing::debug!(
            keys = keys.len(),
            fetched = ok.len(),
            query_us = (t_queried - t_start).as_micros() as u64,
            transfer_and_validate_us = (t_moved - t_queried).as_micros() as u64,
            commit_us = t_moved.elapsed().as_micros() as u64,
            "remote fetch"
        );
        dead_peers.sort_unstable();
        dead_peers.dedup();
        for pi in dead_peers {
            self.drop_conn(&self.peers[pi]).await;
        }
        // 5. Release grants (in the background; they expire anyway).
        for (pi, slots) in extra {
            let p = Arc::clone(&self.peers[pi]);
            let node_id = self.node_id;
            tokio::spawn(async move {
                let client = p.conn.lock().await.as_ref().map(|c| c.client.clone());
                if let Some(mut c) = client {
                    let _ = c.release(pb::ReleaseRequest { node_id, slots }).await;
                }
            });
        }
        ok.len()
    }

    /// Asks one peer; `None` when it cannot serve this namespace or is down.
    async fn query(
        &self,
        p: &PeerState,
        ns: &Namespace,
        keys: &[Key],
        stride: u64,
        payload_cap: u64,
    ) -> Option<Vec<pb::Grant>> {
        // Only peers already connected are asked: connecting (and waiting
        // out an unreachable peer) is the background task's job, never an
        // engine call's.
        let (mut client, inc, compatible) = {
            let g = p.conn.lock().await;
            let c = g.as_ref()?;
            // Slots are copied whole: the holder's pool must have our layout.
            let compatible = |pool: u32| {
                c.pools
                    .iter()
                    .any(|d| d.index == pool && d.slot_stride_bytes == stride && d.slot_payload_bytes == payload_cap)
            };
            let pools: Vec<u32> = c.pools.iter().map(|d| d.index).collect();
            (c.client.clone(), c.incarnation, pools.into_iter().filter(|&i| compatible(i)).collect::<Vec<_>>())
        };
        let req = pb::QueryRequest {
            node_id: self.node_id,
            holder_incarnation: inc,
            lease_ms: self.cfg.grant_lease_ms,
            blocks: keys
                .iter()
                .map(|k| pb::BlockRef { namespace_fingerprint: ns.fingerprint, key_hi: k.hi(), key_lo: k.lo() })
                .collect(),
        };
        match client.query(req).await {
            Ok(r) => {
                let mut grants = r.into_inner().grants;
                if grants.len() != keys.len() {
                    return None;
                }
                let mut incompatible = Vec::new();
                for g in grants.iter_mut() {
                    if g.found && !compatible.contains(&g.pool) {
                        incompatible.push(slot_ref(g));
                        g.found = false;
                    }
                }
                if !incompatible.is_empty() {
                    let _ = client.release(pb::ReleaseRequest { node_id: self.node_id, slots: incompatible }).await;
                }
                Some(grants)
            }
            Err(s) => {
                tracing::debug!(peer = p.entry.id, "query failed: {}", s.message());
                self.drop_conn(p).await;
                None
            }
        }
    }
}

fn slot_ref(g: &pb::Grant) -> pb::SlotRef {
    pb::SlotRef { pool: g.pool, slot: g.slot, generation: g.generation }
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

/// The peer gRPC service (holder side).
pub struct PeerService {
    /// Shared peer state.
    pub peers: Arc<Peers>,
}

#[tonic::async_trait]
impl pb::peer_server::Peer for PeerService {
    async fn handshake(&self, req: Request<pb::HandshakeRequest>) -> Result<Response<pb::HandshakeResponse>, Status> {
        let r = req.into_inner();
        let p = &self.peers;
        if !p.peers.iter().any(|s| s.entry.id == r.node_id) {
            return Err(Status::permission_denied(format!("node {} is not in this daemon's peer list", r.node_id)));
        }
        let st = p.store.lock();
        let pools = st
            .pools()
            .iter()
            .zip(p.dp.pools())
            .map(|(sp, dp)| pb::PoolDesc {
                index: sp.index,
                base_address: dp.base,
                bytes: sp.mapping.len(),
                slot_stride_bytes: sp.stride,
                slot_payload_bytes: sp.slot_payload_bytes,
                rkey: dp.rkey.clone(),
            })
            .collect();
        tracing::info!(peer = r.node_id, incarnation = r.incarnation, "handshake from peer");
        Ok(Response::new(pb::HandshakeResponse {
            node_id: p.node_id,
            incarnation: p.incarnation,
            worker_address: p.dp.worker_address().to_vec(),
            pools,
            transports: p.cfg.transports.clone(),
        }))
    }

    async fn query(&self, req: Request<pb::QueryRequest>) -> Result<Response<pb::QueryResponse>, Status> {
        let r = req.into_inner();
        let p = &self.peers;
        if r.holder_incarnation != p.incarnation {
            return Err(Status::failed_precondition(format!(
                "this daemon restarted (incarnation {}, you shook hands with {}); handshake again",
                p.incarnation, r.holder_incarnation
            )));
        }
        if r.blocks.len() > 65536 {
            return Err(Status::invalid_argument(format!("query of {} blocks exceeds 65536", r.blocks.len())));
        }
        let blocks: Vec<(u64, Key)> =
            r.blocks.iter().map(|b| (b.namespace_fingerprint, Key::from_parts(b.key_hi, b.key_lo))).collect();
        let lease = r.lease_ms.min(p.cfg.grant_lease_ms);
        let now = Instant::now();
        let mut st = p.store.lock();
        let (out, deadline) = st.grant(r.node_id, &blocks, lease, now).map_err(Status::from)?;
        let grants = out
            .iter()
            .map(|o| match o {
                Some(g) => pb::Grant {
                    found: true,
                    pool: g.slot.pool,
                    slot: g.slot.slot,
                    generation: g.slot.generation,
                    version: g.version,
                    checksum: g.checksum,
                    payload_bytes: g.payload_bytes,
                },
                None => pb::Grant::default(),
            })
            .collect();
        if p.hook == Some(TestHook::CorruptGrantedSlots) {
            for g in out.iter().flatten() {
                st.test_corrupt_header(g.slot);
            }
        }
        Ok(Response::new(pb::QueryResponse { grants, lease_deadline_unix_ms: crate::store::unix_ms(deadline, now) }))
    }

    async fn send(&self, req: Request<pb::SendRequest>) -> Result<Response<pb::SendResponse>, Status> {
        let r = req.into_inner();
        let p = &self.peers;
        if r.holder_incarnation != p.incarnation {
            return Err(Status::failed_precondition("this daemon restarted; handshake again"));
        }
        if r.items.len() > 65536 {
            return Err(Status::invalid_argument(format!("send of {} blocks exceeds 65536", r.items.len())));
        }
        // We send on our own endpoint to the asker: make sure we have one to
        // its current incarnation (it may have just started or restarted).
        let Some(ps) = p.peers.iter().find(|s| s.entry.id == r.node_id) else {
            return Err(Status::permission_denied(format!("node {} is not in this daemon's peer list", r.node_id)));
        };
        let stale = ps.conn.lock().await.as_ref().is_some_and(|c| c.incarnation != r.incarnation);
        if stale {
            p.drop_conn(ps).await;
        }
        *ps.retry_at.lock() = Instant::now();
        if !p.ensure(ps).await {
            return Err(Status::unavailable(format!("cannot reach node {} to send to it", r.node_id)));
        }
        // Only slots granted to this peer (pinned under its session) go out.
        let session = PEER_SESSION_BASE + r.node_id as u64;
        let mut items = Vec::with_capacity(r.items.len());
        let mut granted = Vec::with_capacity(r.items.len());
        {
            let st = p.store.lock();
            for it in &r.items {
                let sref = SlotRef { pool: it.pool, slot: it.slot, generation: it.generation };
                let ok = st.holds_pin(session, sref);
                granted.push(ok);
                if let (true, Some((stride, _))) = (ok, st.pool_geometry(it.pool)) {
                    items.push(TransferItem {
                        remote_pool: 0,
                        remote_offset: 0,
                        len: stride,
                        local_pool: it.pool,
                        local_offset: it.slot as u64 * stride,
                        tag: it.tag,
                    });
                }
            }
        }
        let deadline = Instant::now() + Duration::from_millis(p.cfg.transfer_timeout_ms);
        let n = items.len();
        let (_, mut rx) = p.dp.transfer_stream(Mode::Send, r.node_id, r.incarnation, items, deadline);
        let mut ok_sends = vec![false; n];
        for _ in 0..n {
            match rx.recv().await {
                Some((i, TransferOutcome::Done)) => ok_sends[i] = true,
                Some(_) => {}
                None => break,
            }
        }
        let mut it = ok_sends.into_iter();
        let sent = granted.iter().map(|&g| g && it.next().unwrap_or(false)).collect();
        Ok(Response::new(pb::SendResponse { sent }))
    }

    async fn release(&self, req: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        let r = req.into_inner();
        let refs: Vec<SlotRef> =
            r.slots.iter().map(|s| SlotRef { pool: s.pool, slot: s.slot, generation: s.generation }).collect();
        let mut st = self.peers.store.lock();
        let mut released = 0;
        for chunk in refs.chunks(st.config().limits.batch_keys_max as usize) {
            released += st.unpin(PEER_SESSION_BASE + r.node_id as u64, chunk).map_err(Status::from)?.0;
        }
        Ok(Response::new(pb::ReleaseResponse { released }))
    }
}
