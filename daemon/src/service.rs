//! The engine gRPC service: decodes batched requests, runs them against the
//! store under its lock, and encodes the answers. Each request is tied to the
//! session of the connection it arrived on (see `server`), so pins and
//! allocations die with the connection.

use std::sync::Arc;
use std::time::Instant;

use kvmesh_common::Key;
use kvmesh_proto::engine::v1 as pb;
use parking_lot::Mutex;
use tonic::{Request, Response, Status};

use crate::cluster::{Cluster, block_key};
use crate::error::Error;
use crate::store::{AllocOutcome, SessionId, SlotRef, Store};

/// Connection identity attached to every request by the server.
#[derive(Clone)]
pub struct ConnInfo {
    /// The session (connection) id.
    pub session: SessionId,
    /// What keeps the session open (gRPC: the connection's guard, whose
    /// drop releases the session's pins and allocations). A call holds it
    /// while it runs ([`held_session`]), so a connection that closes while
    /// a call of it is queued or running releases its session after that
    /// call — never before, when the call would open the session again and
    /// leave it behind. `None` on the fast path, whose calls hold their
    /// connection's guard themselves.
    pub hold: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for ConnInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnInfo").field("session", &self.session).finish_non_exhaustive()
    }
}

/// The session of a request's connection, and what keeps it open: keep
/// the second for as long as the call uses the session.
fn held_session<T>(req: &Request<T>) -> Result<(SessionId, Option<Arc<dyn std::any::Any + Send + Sync>>), Status> {
    req.extensions()
        .get::<ConnInfo>()
        .map(|c| (c.session, c.hold.clone()))
        .ok_or_else(|| Status::internal("request without connection info"))
}

/// Commits whose payload is larger than this are checksummed on a blocking
/// thread, so no tokio worker is held for long.
const INLINE_CHECKSUM_BYTES_MAX: u64 = 256 << 10;

/// A commit's outcome per slot: its checksum and version, or `None` for a
/// slot that was no allocation of the session.
type CommitResults = Vec<Option<(u64, Result<u64, String>)>>;

/// Finishes a commit on a daemon without peers: the checksummed slots become
/// visible, each with the version the store gives it.
fn finish_local(store: &Mutex<Store>, sums: Vec<Option<(SlotRef, u64)>>) -> CommitResults {
    let done: Vec<_> = sums.iter().flatten().copied().collect();
    let versions = {
        let mut st = store.lock();
        st.finish_commit(&done);
        done.iter().map(|(r, _)| st.version_of(*r)).collect::<Vec<_>>()
    };
    let mut vs = versions.into_iter();
    sums.into_iter().map(|s| s.map(|(_, c)| (c, Ok(vs.next().expect("one version per commit"))))).collect()
}

/// The engine service.
#[derive(Clone)]
pub struct EngineService {
    store: Arc<Mutex<Store>>,
    peers: Option<Arc<crate::peers::Peers>>,
    cluster: Option<Arc<Cluster>>,
    started: Instant,
    /// Set (to the deadline, ms) when a drain is asked for over the API;
    /// the server watches it.
    drain: tokio::sync::watch::Sender<Option<u64>>,
    /// Where the configuration came from (`GetConfig`).
    config_source: String,
}

impl EngineService {
    /// A service over `store`; on a clustered daemon, gets, puts,
    /// invalidations and removals go through the coherence driver.
    pub fn new(
        store: Arc<Mutex<Store>>,
        peers: Option<Arc<crate::peers::Peers>>,
        cluster: Option<Arc<Cluster>>,
        drain: tokio::sync::watch::Sender<Option<u64>>,
        config_source: String,
    ) -> Self {
        EngineService { store, peers, cluster, started: Instant::now(), drain, config_source }
    }
}

fn keys(ks: &[pb::Key]) -> Vec<Key> {
    ks.iter().map(|k| Key::from_parts(k.hi, k.lo)).collect()
}

fn refs(rs: &[pb::SlotRef]) -> Vec<SlotRef> {
    rs.iter().map(|r| SlotRef { pool: r.pool, slot: r.slot, generation: r.generation }).collect()
}

fn pb_ref(r: SlotRef) -> pb::SlotRef {
    pb::SlotRef { pool: r.pool, slot: r.slot, generation: r.generation }
}

fn ns_info(ns: crate::store::Namespace) -> pb::NamespaceInfo {
    pb::NamespaceInfo {
        id: ns.id,
        name: ns.name,
        block_bytes: ns.block_bytes,
        layout: ns.layout,
        pool: ns.pool,
        fingerprint: ns.fingerprint,
    }
}

impl EngineService {
    /// Refuses requests of a connection that exceeded `limits.sessions_max`.
    fn admitted(&self, session: SessionId) -> Result<(), Status> {
        let mut st = self.store.lock();
        st.open_session(session).map_err(Status::from)
    }
}

#[tonic::async_trait]
impl pb::engine_server::Engine for EngineService {
    async fn hello(&self, req: Request<pb::HelloRequest>) -> Result<Response<pb::HelloResponse>, Status> {
        let (session, _hold) = held_session(&req)?;
        self.admitted(session)?;
        let st = self.store.lock();
        let l = &st.config().limits;
        Ok(Response::new(pb::HelloResponse {
            daemon_version: env!("CARGO_PKG_VERSION").into(),
            layout_version: kvmesh_common::LAYOUT_VERSION,
            pools: st
                .pools()
                .iter()
                .map(|p| pb::PoolInfo {
                    index: p.index,
                    name: p.name.clone(),
                    device: p.device.clone(),
                    bytes: p.memory.len(),
                    slot_stride_bytes: p.stride,
                    slot_payload_bytes: p.slot_payload_bytes,
                    slots: p.slot_count(),
                    payload_offset_bytes: kvmesh_common::slot::HEADER_BYTES as u32,
                    device_uuid: p.memory.device_uuid(),
                })
                .collect(),
            batch_keys_max: l.batch_keys_max,
            lease_ms_default: l.lease_ms_default,
            lease_ms_max: l.lease_ms_max,
            session_id: session,
            instance_id: st.instance_id,
            fast_path_writes: true,
        }))
    }

    async fn register_namespace(
        &self,
        req: Request<pb::RegisterNamespaceRequest>,
    ) -> Result<Response<pb::NamespaceInfo>, Status> {
        let (session, _hold) = held_session(&req)?;
        self.admitted(session)?;
        let r = req.into_inner();
        let ns = self.store.lock().register_namespace_on(&r.name, r.block_bytes, &r.layout, &r.device)?;
        Ok(Response::new(ns_info(ns)))
    }

    async fn get_namespace(
        &self,
        req: Request<pb::GetNamespaceRequest>,
    ) -> Result<Response<pb::NamespaceInfo>, Status> {
        let (session, _hold) = held_session(&req)?;
        self.admitted(session)?;
        let ns = self.store.lock().namespace_by_name(&req.into_inner().name)?;
        Ok(Response::new(ns_info(ns)))
    }

    async fn lookup(&self, req: Request<pb::LookupRequest>) -> Result<Response<pb::LookupResponse>, Status> {
        let (session, _hold) = held_session(&req)?;
        self.admitted(session)?;
        let r = req.into_inner();
        let ks = keys(&r.keys);
        let (cluster, fingerprint) = {
            let mut st = self.store.lock();
            let me = st.config().node.id;
            match &self.cluster {
                Some(c) if !r.local_only => {
                    st.check_batch(ks.len())?;
                    (c, st.namespace_info(r.namespace_id)?.fingerprint)
                }
                // A single daemon's index, or a clustered daemon's own
                // copies (a hint: nothing asked of the cluster).
                _ => {
                    let (present, prefix_len) = st.lookup(r.namespace_id, &ks)?;
                    let node = present.iter().map(|&p| if p { me } else { 0 }).collect();
                    return Ok(Response::new(pb::LookupResponse {
                        present,
                        prefix_len,
                        node,
                        cluster_wide: false,
                        complete: true,
                    }));
                }
            }
        };
        let (found, complete) = cluster.lookup(fingerprint, &ks).await.map_err(Status::unavailable)?;
        let present: Vec<bool> = found.iter().map(|f| f.is_some()).collect();
        let prefix_len = present.iter().take_while(|&&p| p).count() as u32;
        let node = found.iter().map(|f| f.unwrap_or(0)).collect();
        {
            // This daemon's hit counters count what it holds, not what the
            // cluster does (`kvmesh_hits_total`, the hit ratio of `top`).
            let mut st = self.store.lock();
            let me = st.config().node.id;
            let here: Vec<bool> = found.iter().map(|f| *f == Some(me)).collect();
            st.count_lookup(&here);
        }
        Ok(Response::new(pb::LookupResponse { present, prefix_len, node, cluster_wide: true, complete }))
    }

    async fn pin(&self, req: Request<pb::PinRequest>) -> Result<Response<pb::PinResponse>, Status> {
        let (session, _hold) = held_session(&req)?;
        let r = req.into_inner();
        let ks = keys(&r.keys);
        let now = Instant::now();
        let (out, deadline) = match &self.cluster {
            None => {
                let mut st = self.store.lock();
                if !r.release.is_empty() {
                    st.unpin(session, &refs(&r.release))?;
                }
                st.open_session(session)?;
                st.pin(session, r.namespace_id, &ks, r.lease_ms, r.stop_at_first_miss, now)?
            }
            Some(cluster) => {
                let fingerprint = {
                    let mut st = self.store.lock();
                    if !r.release.is_empty() {
                        st.unpin(session, &refs(&r.release))?;
                    }
                    st.open_session(session)?;
                    let ns = st.namespace_info(r.namespace_id)?;
                    st.check_pin_request(session, ks.len())?;
                    ns.fingerprint
                };
                let mut out = cluster.get(session, fingerprint, &ks, r.lease_ms).await;
                let mut st = self.store.lock();
                if r.stop_at_first_miss
                    && let Some(first) = out.iter().position(|o| o.is_none())
                {
                    let extra: Vec<SlotRef> = out[first..].iter().flatten().map(|p| p.slot).collect();
                    out.truncate(first + 1);
                    st.unpin(session, &extra)?;
                }
                let hits = out.iter().flatten().count() as u64;
                st.counters.hits += hits;
                st.counters.misses += out.len() as u64 - hits;
                (out, now + st.lease(r.lease_ms))
            }
        };
        let prefix_len = out.iter().take_while(|o| o.is_some()).count() as u32;
        let blocks = out
            .into_iter()
            .map(|o| match o {
                Some(p) => pb::PinnedBlock {
                    hit: true,
                    slot: Some(pb_ref(p.slot)),
                    payload_offset: p.payload_offset,
                    payload_bytes: p.payload_bytes,
                    version: p.version,
                    checksum: p.checksum,
                },
                None => pb::PinnedBlock::default(),
            })
            .collect();
        Ok(Response::new(pb::PinResponse {
            blocks,
            prefix_len,
            lease_deadline_unix_ms: crate::store::unix_ms(deadline, now),
        }))
    }

    async fn unpin(&self, req: Request<pb::UnpinRequest>) -> Result<Response<pb::UnpinResponse>, Status> {
        let (session, _hold) = held_session(&req)?;
        let r = req.into_inner();
        let (released, unknown) = self.store.lock().unpin(session, &refs(&r.slots))?;
        Ok(Response::new(pb::UnpinResponse { released, unknown }))
    }

    async fn allocate(&self, req: Request<pb::AllocateRequest>) -> Result<Response<pb::AllocateResponse>, Status> {
        let (session, _hold) = held_session(&req)?;
        self.admitted(session)?;
        let r = req.into_inner();
        let now = Instant::now();
        let (out, deadline) = match &self.cluster {
            None => {
                let keys = keys(&r.keys);
                let mut store = self.store.lock();
                if r.overwrite {
                    // Without peers an overwrite retires the cached version
                    // now: until the commit, readers miss (never read old
                    // and new mixed). What would refuse the allocation is
                    // checked first, so such a refusal leaves the cached
                    // versions as they were (only a pool with no slot to
                    // take after the old ones are freed still refuses it
                    // after: their slots were pinned).
                    store.check_allocate(session, r.namespace_id, keys.len())?;
                    store.remove(r.namespace_id, &keys)?;
                }
                store.allocate(session, r.namespace_id, &keys, r.lease_ms, now)?
            }
            Some(c) => c.allocate(session, r.namespace_id, &keys(&r.keys), r.lease_ms, r.overwrite)?,
        };
        let allocations = out
            .into_iter()
            .map(|o| match o {
                AllocOutcome::Allocated { slot, payload_offset } => pb::Allocation {
                    status: pb::AllocateStatus::Allocated as i32,
                    slot: Some(pb_ref(slot)),
                    payload_offset,
                },
                AllocOutcome::Exists => {
                    pb::Allocation { status: pb::AllocateStatus::Exists as i32, ..Default::default() }
                }
                AllocOutcome::InProgress => {
                    pb::Allocation { status: pb::AllocateStatus::InProgress as i32, ..Default::default() }
                }
            })
            .collect();
        Ok(Response::new(pb::AllocateResponse {
            allocations,
            lease_deadline_unix_ms: crate::store::unix_ms(deadline, now),
        }))
    }

    async fn commit(&self, req: Request<pb::CommitRequest>) -> Result<Response<pb::CommitResponse>, Status> {
        let (session, _hold) = held_session(&req)?;
        let r = req.into_inner();
        let jobs = self.store.lock().begin_commit(session, &refs(&r.slots))?;
        let total: u64 = jobs.iter().flatten().map(|j| j.len).sum();
        let gpu = jobs.iter().flatten().any(|j| j.memory.is_gpu());
        let sums = move || {
            jobs.into_iter()
                .map(|j| {
                    j.map(|j| {
                        // A GPU that fails here is fatal (the panic hook
                        // aborts): no block is made visible unchecked.
                        (j.slot, j.memory.checksum(j.offset, j.len).expect("commit checksum of a pool region"))
                    })
                })
                .collect::<Vec<_>>()
        };
        let sums = if self.cluster.is_none() && !gpu && total <= INLINE_CHECKSUM_BYTES_MAX {
            // A small commit without peers ends here, with no await between
            // taking the slots and finishing them: a client that goes
            // mid-call cannot strand them (and no task wakes a worker).
            finish_local(&self.store, sums())
        } else {
            // The slots now belong to this commit, not to the session:
            // finish it in a task of its own so a client that disconnects
            // mid-call cannot strand them in the committing state.
            let store = Arc::clone(&self.store);
            let cluster = self.cluster.clone();
            let task = tokio::spawn(async move {
                // GPU checksums wait for the device: never on a runtime thread.
                let sums = if gpu || total > INLINE_CHECKSUM_BYTES_MAX {
                    tokio::task::spawn_blocking(sums).await.expect("checksum task panicked")
                } else {
                    sums()
                };
                let Some(cluster) = cluster else {
                    return finish_local(&store, sums);
                };
                // Clustered: the key's home assigns the version once no other
                // daemon serves the previous one.
                let done: Vec<_> = sums.iter().flatten().copied().collect();
                let items: Vec<(SlotRef, u64, Key, u64)> = {
                    let st = store.lock();
                    done.iter()
                        .map(|&(r, c)| {
                            let (fp, key) = st.slot_block(r);
                            (r, fp, key, c)
                        })
                        .collect()
                };
                let mut results = cluster.publish(&items).await.into_iter();
                sums.into_iter()
                    .map(|s| s.map(|(_, c)| (c, results.next().expect("one result per publish"))))
                    .collect::<Vec<_>>()
            });
            task.await.map_err(|e| Error::Internal(format!("commit task failed: {e}")))?
        };
        let mut out = pb::CommitResponse::default();
        for s in sums {
            let (status, checksum, version, error) = match s {
                None => (pb::CommitStatus::UnknownAllocation, 0, 0, String::new()),
                Some((c, Ok(v))) => (pb::CommitStatus::Committed, c, v, String::new()),
                Some((c, Err(e))) => (pb::CommitStatus::Refused, c, 0, e),
            };
            out.status.push(status as i32);
            out.checksums.push(checksum);
            out.versions.push(version);
            out.errors.push(error);
        }
        Ok(Response::new(out))
    }

    async fn abort(&self, req: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let (session, _hold) = held_session(&req)?;
        let r = req.into_inner();
        let (aborted, unknown) = self.store.lock().abort(session, &refs(&r.slots))?;
        Ok(Response::new(pb::AbortResponse { aborted, unknown }))
    }

    async fn remove(&self, req: Request<pb::RemoveRequest>) -> Result<Response<pb::RemoveResponse>, Status> {
        let (session, _hold) = held_session(&req)?;
        self.admitted(session)?;
        let r = req.into_inner();
        let removed = match &self.cluster {
            None => self.store.lock().remove(r.namespace_id, &keys(&r.keys))?,
            Some(c) => {
                let fp = {
                    let st = self.store.lock();
                    st.check_batch(r.keys.len())?;
                    st.namespace_info(r.namespace_id)?.fingerprint
                };
                c.evict(fp, &keys(&r.keys))
            }
        };
        Ok(Response::new(pb::RemoveResponse { removed }))
    }

    async fn invalidate(
        &self,
        req: Request<pb::InvalidateRequest>,
    ) -> Result<Response<pb::InvalidateResponse>, Status> {
        let (session, _hold) = held_session(&req)?;
        self.admitted(session)?;
        let r = req.into_inner();
        let (fp, ks) = {
            let st = self.store.lock();
            let ns = st.namespace_info(r.namespace_id)?;
            if r.whole_namespace && !r.keys.is_empty() {
                return Err(Status::invalid_argument("give keys or whole_namespace, not both"));
            }
            st.check_batch(r.keys.len())?;
            (ns.fingerprint, keys(&r.keys))
        };
        let Some(cluster) = &self.cluster else {
            // One daemon: removing the keys is invalidating them.
            let mut st = self.store.lock();
            let ks = if r.whole_namespace { st.keys_of(r.namespace_id)? } else { ks };
            let n = ks.len() as u64;
            for chunk in ks.chunks(st.config().limits.batch_keys_max as usize) {
                st.remove(r.namespace_id, chunk)?;
            }
            return Ok(Response::new(pb::InvalidateResponse { invalidated: n, failed: 0, first_error: String::new() }));
        };
        let deadline = cluster.invalidate_deadline();
        let targets = if r.whole_namespace {
            cluster.namespace_keys(fp).await.map_err(Status::unavailable)?
        } else {
            ks.iter().map(|&k| block_key(fp, k)).collect()
        };
        let (invalidated, failed, first_error) = cluster.invalidate(targets, deadline).await;
        Ok(Response::new(pb::InvalidateResponse { invalidated, failed, first_error }))
    }

    type WatchEventsStream = EventsStream;

    async fn watch_events(
        &self,
        req: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        held_session(&req)?;
        let r = req.into_inner();
        Ok(Response::new(watch_events(&self.store, r.namespace_id, r.snapshot)?))
    }

    async fn list_namespaces(
        &self,
        req: Request<pb::ListNamespacesRequest>,
    ) -> Result<Response<pb::ListNamespacesResponse>, Status> {
        held_session(&req)?;
        let list = self.store.lock().namespace_summaries();
        Ok(Response::new(pb::ListNamespacesResponse {
            namespaces: list
                .into_iter()
                .map(|(n, blocks)| pb::NamespaceSummary { info: Some(ns_info(n)), blocks })
                .collect(),
        }))
    }

    async fn list_keys(&self, req: Request<pb::ListKeysRequest>) -> Result<Response<pb::ListKeysResponse>, Status> {
        held_session(&req)?;
        let r = req.into_inner();
        let (keys, total) = self.store.lock().list_keys(r.namespace_id, r.limit as usize)?;
        Ok(Response::new(pb::ListKeysResponse {
            keys: keys.into_iter().map(|k| pb::Key { hi: k.hi(), lo: k.lo() }).collect(),
            total,
        }))
    }

    async fn stats(&self, req: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        held_session(&req)?;
        Ok(Response::new(self.snapshot().await))
    }

    async fn get_config(&self, req: Request<pb::GetConfigRequest>) -> Result<Response<pb::GetConfigResponse>, Status> {
        held_session(&req)?;
        let cfg = self.store.lock().config().clone();
        let toml = cfg.to_toml().map_err(|e| Status::internal(format!("cannot render the config: {e}")))?;
        Ok(Response::new(pb::GetConfigResponse { toml, source: self.config_source.clone() }))
    }

    async fn drain(&self, req: Request<pb::DrainRequest>) -> Result<Response<pb::DrainResponse>, Status> {
        held_session(&req)?;
        let r = req.into_inner();
        if r.deadline_ms > crate::config::DRAIN_TIMEOUT_MS_MAX {
            return Err(Status::invalid_argument(format!(
                "deadline_ms {} exceeds {} (10 minutes)",
                r.deadline_ms,
                crate::config::DRAIN_TIMEOUT_MS_MAX
            )));
        }
        let (already, (pins, allocs), configured) = {
            let mut st = self.store.lock();
            let configured = st.config().server.drain_timeout_ms;
            (st.set_draining(), st.engine_outstanding(), configured)
        };
        let deadline_ms = if r.deadline_ms == 0 { configured } else { r.deadline_ms };
        if !already {
            tracing::info!(deadline_ms, pins, allocations = allocs, "drain asked for over the engine API");
            self.drain.send_replace(Some(deadline_ms));
        }
        Ok(Response::new(pb::DrainResponse {
            already_draining: already,
            pins_outstanding: pins,
            allocations_outstanding: allocs,
            deadline_ms: if already { self.drain.borrow().unwrap_or(configured) } else { deadline_ms },
        }))
    }
}

impl EngineService {
    /// The daemon's statistics (the `Stats` call, `/metrics`).
    pub async fn snapshot(&self) -> pb::StatsResponse {
        let (s, event_watchers) = {
            let st = self.store.lock();
            (st.stats(), st.event_watchers() as u32)
        };
        let c = s.counters;
        let peers_connected = match &self.peers {
            Some(p) => p.connected().await,
            None => 0,
        };
        let coherence = self.cluster.as_ref().map(|c| c.stats());
        let mut peers = Vec::new();
        if let Some(p) = &self.peers {
            let links = self.cluster.as_ref().map(|c| c.links()).unwrap_or_default();
            let transports = p.config().transports.clone();
            for (id, addr, inc) in p.handshakes().await {
                let l = links.iter().find(|l| l.id == id);
                peers.push(pb::PeerInfo {
                    id,
                    addr,
                    handshake: inc.is_some(),
                    incarnation: inc.unwrap_or(0),
                    stream_up: l.is_some_and(|l| l.up),
                    last_pong_ms_ago: l.and_then(|l| l.last_pong_ago).map_or(0, |d| d.as_millis().max(1) as u64),
                    queue_drops: l.map_or(0, |l| l.queue_drops),
                    in_view: l.is_some_and(|l| l.view_incarnation.is_some()),
                    view_incarnation: l.and_then(|l| l.view_incarnation).unwrap_or(0),
                    transports: transports.clone(),
                });
            }
        }
        let (remote_misses, transfer_failures, transfer_timeouts) = match &self.cluster {
            Some(c) => {
                use std::sync::atomic::Ordering::Relaxed;
                let k = &c.counters;
                (k.remote_misses.load(Relaxed), k.transfer_failures.load(Relaxed), k.transfer_timeouts.load(Relaxed))
            }
            None => (0, 0, 0),
        };
        pb::StatsResponse {
            pools: s
                .pools
                .into_iter()
                .map(|p| pb::PoolStats {
                    name: p.name,
                    device: p.device,
                    bytes: p.bytes,
                    slot_payload_bytes: p.slot_payload_bytes,
                    slots: p.slots,
                    free: p.free,
                    valid: p.valid,
                    pending: p.pending,
                    pinned: p.pinned,
                    zombie: p.zombie,
                    mlocked: p.mlocked,
                    quarantined: p.quarantined,
                    huge_page_bytes: p.huge_page_bytes,
                    fenced: p.fenced,
                })
                .collect(),
            namespaces: s.namespaces,
            sessions: s.sessions,
            pins_outstanding: s.pins_outstanding,
            allocations_outstanding: s.allocations_outstanding,
            lookups: c.lookups,
            hits: c.hits,
            misses: c.misses,
            pins: c.pins,
            commits: c.commits,
            aborts: c.aborts,
            evictions: c.evictions,
            removes: c.removes,
            lease_expirations: c.lease_expirations,
            session_releases: c.session_releases,
            resource_exhausted: c.resource_exhausted,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            remote_fetched: c.remote_fetched,
            remote_validation_failures: coherence.as_ref().map_or(0, |c| c.validation_failures),
            transfer_failures,
            transfer_timeouts,
            slots_quarantined: c.quarantined,
            slots_fenced: c.fenced,
            fences_forced: c.fences_forced,
            grants_given: c.grants_given,
            peers_connected,
            remote_misses,
            coherence,
            draining: self.store.lock().draining(),
            peers,
            event_watchers,
            event_watchers_cut_off: c.events_cut_off,
        }
    }
}

/// Most events in one batch of a watch stream.
const EVENT_BATCH_MAX: usize = 4096;

struct EventStream {
    ns: u32,
    node: u32,
    instance: u64,
    stall: std::time::Duration,
    tx: tokio::sync::mpsc::Sender<pb::KvEventBatch>,
    /// The status the stream ends with, delivered after the batches
    /// already handed over (see [`EventsOut`]).
    last: Option<tokio::sync::oneshot::Sender<Status>>,
    /// Weak: a watch stream does not keep the store alive.
    store: std::sync::Weak<Mutex<Store>>,
}

/// The stream `WatchEvents` answers with.
pub(crate) type EventsStream =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::KvEventBatch, Status>> + Send + 'static>>;

/// A stream of KV events of namespace `ns` (its id here), with a snapshot
/// first when asked: what `WatchEvents` answers, on the engine socket and on
/// the peer port (`peers.rs`).
pub(crate) fn watch_events(store: &Arc<Mutex<Store>>, ns: u32, snapshot: bool) -> Result<EventsStream, Status> {
    let (rx, seq, held, node, instance, stall) = {
        let mut st = store.lock();
        let ev = st.config().events.clone();
        let watchers = st.event_watchers();
        if watchers >= ev.watchers_max as usize {
            st.counters.resource_exhausted += 1;
            return Err(Status::resource_exhausted(format!("{watchers} event watchers already (events.watchers_max)")));
        }
        let (rx, seq, held) = st.watch_events(ns, snapshot)?;
        (rx, seq, held, st.config().node.id, st.instance_id, std::time::Duration::from_millis(ev.stall_ms))
    };
    let (tx, out) = tokio::sync::mpsc::channel(1);
    let (last_tx, last_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(stream_events(
        EventStream { ns, node, instance, stall, tx, last: Some(last_tx), store: Arc::downgrade(store) },
        rx,
        seq,
        snapshot.then_some(held),
    ));
    Ok(Box::pin(EventsOut { rx: out, last: Some(last_rx) }))
}

/// Why a send did not go through.
enum Sent {
    Ok,
    /// The client went away.
    Gone,
    /// The client took nothing for `stall`.
    Stalled,
}

impl EventStream {
    fn batch(&self, events: Vec<pb::KvEvent>, snapshot: Option<(u64, bool)>) -> pb::KvEventBatch {
        pb::KvEventBatch {
            node_id: self.node,
            instance_id: self.instance,
            namespace_id: self.ns,
            events,
            snapshot: snapshot.is_some(),
            snapshot_seq: snapshot.map_or(0, |s| s.0),
            snapshot_done: snapshot.is_some_and(|s| s.1),
        }
    }

    /// Hands one batch to the client's stream.
    async fn send(&self, b: pb::KvEventBatch) -> Sent {
        match tokio::time::timeout(self.stall, self.tx.send(b)).await {
            Ok(Ok(())) => Sent::Ok,
            Ok(Err(_)) => Sent::Gone,
            Err(_) => Sent::Stalled,
        }
    }

    /// Ends the stream with `status` after what was already handed over.
    fn end(mut self, status: Status) {
        if let Some(l) = self.last.take() {
            let _ = l.send(status);
        }
    }

    /// Cuts this watcher off (counted once), ending with RESOURCE_EXHAUSTED.
    fn cut_off(self, why: String) {
        tracing::warn!(namespace = self.ns, "event watcher cut off: {why}");
        if let Some(st) = self.store.upgrade() {
            st.lock().counters.events_cut_off += 1;
        }
        self.end(Status::resource_exhausted(format!(
            "event watcher cut off: {why}; watch again with snapshot to resynchronise"
        )));
    }

    /// Sends, and ends the stream if the send did not go through. False
    /// when the stream is over.
    async fn deliver(self, b: pb::KvEventBatch) -> Option<Self> {
        match self.send(b).await {
            Sent::Ok => Some(self),
            Sent::Gone => None,
            Sent::Stalled => {
                let why = format!("it took no batch for {:?} (events.stall_ms)", self.stall);
                self.cut_off(why);
                None
            }
        }
    }
}

/// The response stream of a watch: the batches the task hands over, then
/// the status it ended with (if it set one), then the end.
struct EventsOut {
    rx: tokio::sync::mpsc::Receiver<pb::KvEventBatch>,
    last: Option<tokio::sync::oneshot::Receiver<Status>>,
}

impl tokio_stream::Stream for EventsOut {
    type Item = Result<pb::KvEventBatch, Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::future::Future;
        use std::task::Poll;
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(b)) => return Poll::Ready(Some(Ok(b))),
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => {}
        }
        let Some(last) = self.last.as_mut() else { return Poll::Ready(None) };
        match std::pin::Pin::new(last).poll(cx) {
            Poll::Ready(r) => {
                self.last = None;
                Poll::Ready(r.ok().map(Err))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

fn pb_event(e: &crate::store::KvEvent) -> pb::KvEvent {
    use crate::store::KvEventKind as K;
    let kind = match e.kind {
        K::Stored => pb::KvEventKind::Stored,
        K::Removed => pb::KvEventKind::Removed,
        K::Evicted => pb::KvEventKind::Evicted,
        K::Invalidated => pb::KvEventKind::Invalidated,
    };
    pb::KvEvent {
        kind: kind as i32,
        seq: e.seq,
        key: Some(pb::Key { hi: e.key.hi(), lo: e.key.lo() }),
        version: e.version,
    }
}

/// One watch stream: the snapshot (if asked), then live events of the
/// namespace in batches of what is ready, until the client goes (the
/// stream just ends), stalls or falls behind the ring (cut off:
/// RESOURCE_EXHAUSTED), or the daemon stops (UNAVAILABLE).
async fn stream_events(
    s: EventStream,
    mut rx: tokio::sync::broadcast::Receiver<crate::store::KvEvent>,
    seq: u64,
    held: Option<Vec<(Key, u64)>>,
) {
    use tokio::sync::broadcast::error::{RecvError, TryRecvError};
    let mut s = s;
    if let Some(held) = held {
        let kind = pb::KvEventKind::Snapshot as i32;
        let n = held.len().div_ceil(EVENT_BATCH_MAX).max(1);
        for i in 0..n {
            let chunk = &held[(i * EVENT_BATCH_MAX).min(held.len())..((i + 1) * EVENT_BATCH_MAX).min(held.len())];
            let events = chunk
                .iter()
                .map(|(k, v)| pb::KvEvent { kind, seq, key: Some(pb::Key { hi: k.hi(), lo: k.lo() }), version: *v })
                .collect();
            let b = s.batch(events, Some((seq, i + 1 == n)));
            match s.deliver(b).await {
                Some(next) => s = next,
                None => return,
            }
        }
    }
    loop {
        let first = tokio::select! {
            _ = s.tx.closed() => return,
            r = rx.recv() => r,
        };
        let mut events = Vec::new();
        let mut lost = match first {
            Ok(e) => {
                if e.ns == s.ns && e.seq > seq {
                    events.push(pb_event(&e));
                }
                None
            }
            Err(RecvError::Lagged(n)) => Some(n),
            Err(RecvError::Closed) => {
                s.end(Status::unavailable("the daemon is stopping"));
                return;
            }
        };
        while lost.is_none() && events.len() < EVENT_BATCH_MAX {
            match rx.try_recv() {
                Ok(e) => {
                    if e.ns == s.ns && e.seq > seq {
                        events.push(pb_event(&e));
                    }
                }
                Err(TryRecvError::Empty) | Err(TryRecvError::Closed) => break,
                Err(TryRecvError::Lagged(n)) => lost = Some(n),
            }
        }
        if let Some(n) = lost {
            // Free the ring slot and the watcher place at once.
            drop(rx);
            s.cut_off(format!("{n} events passed it (events.buffer_events)"));
            return;
        }
        if !events.is_empty() {
            let b = s.batch(events, None);
            match s.deliver(b).await {
                Some(next) => s = next,
                None => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use pb::engine_server::Engine;

    /// Stands in for the server's connection guard: releases the session
    /// when the last holder drops it.
    struct Guard(SessionId, Arc<Mutex<Store>>);

    impl Drop for Guard {
        fn drop(&mut self) {
            self.1.lock().release_session(self.0);
        }
    }

    fn req<T>(m: T, session: SessionId, guard: &Arc<Guard>) -> Request<T> {
        let mut r = Request::new(m);
        let hold: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(guard) as _;
        r.extensions_mut().insert(ConnInfo { session, hold: Some(hold) });
        r
    }

    /// A connection that closes while its call is queued (its guard is then
    /// held by the call's request alone) releases its session after the
    /// call, not before: the call does not open it again and leave it (and
    /// its allocation) behind.
    #[tokio::test]
    async fn a_call_of_a_closed_connection_leaves_no_session_behind() {
        let text = "[[pools]]\nname = \"t\"\nbytes = \"1MiB\"\nslot_payload_bytes = 4096\nmlock = false\n";
        let store = Arc::new(Mutex::new(Store::new(Config::parse(text, "test").unwrap()).unwrap()));
        let (drain, _) = tokio::sync::watch::channel(None);
        let svc = EngineService::new(Arc::clone(&store), None, None, drain, "test".into());
        let guard = Arc::new(Guard(1, Arc::clone(&store)));
        let ns = svc
            .register_namespace(req(
                pb::RegisterNamespaceRequest { name: "n".into(), block_bytes: 4096, ..Default::default() },
                1,
                &guard,
            ))
            .await
            .unwrap()
            .into_inner()
            .id;
        let call = req(
            pb::AllocateRequest { namespace_id: ns, keys: vec![pb::Key { hi: 0, lo: 7 }], ..Default::default() },
            1,
            &guard,
        );
        drop(guard); // the connection closed; the queued call holds the rest
        let out = svc.allocate(call).await.unwrap().into_inner();
        assert_eq!(out.allocations.len(), 1);
        let st = store.lock().stats();
        assert_eq!((st.sessions, st.allocations_outstanding), (0, 0), "a session outlived its connection");
    }
}
