//! Slots pushed with their grant (tcp, `peer.push_with_grants`).
//!
//! Over tcp a holder sends a block with a tag-matched send that the getter
//! receives into its reserved slot. Without this module the getter posts
//! that receive only once the grant's answer is back, then sends a send
//! order (a UCX active message) and waits for the holder's data-plane
//! thread to wake and send: a round trip and a wake-up after the grant.
//!
//! Here the getter reserves the slot and posts the receive when it sends
//! the locate (to the home) or the grant request (to a holder), and names
//! its tag in the same frame (`Frame.push_invites`). The peer, when its
//! answer to that request grants the getter a slot (already pinned for the
//! getter's session, as for any grant), posts the send at once and says so
//! beside the answer (`Frame.push_answers`, ahead of the batch in the same
//! frame); when it does not grant, it says it sent nothing and the getter
//! cancels the receive. The bytes travel while the answer does.
//!
//! Nothing changes in what is guaranteed: the peer sends only slots it
//! granted to that getter in the very answer; the getter uses a pushed slot
//! only for a read the core asked for, from that peer, for that request,
//! and the core validates what landed against the grant (header, trailer,
//! payload checksum) as for any read. A reservation is made only where it
//! evicts nothing (a locate may find nothing), at most `PUSHES_MAX` at once.
//! A receive whose peer said it pushed (or has not answered yet) is never
//! cancelled early — a send whose receive is gone would hold the peer's
//! endpoint until its deadline — but waited for until its own deadline.
//!
//! A frame with invitations or answers travels whole: as one UCX active
//! message (`KIND_FRAME`) where coherence batches take active messages and
//! the peer's handshake says `takes_control_frames`, else on the peer's
//! stream — never split, so answers and the batch they go with arrive
//! together.

use super::*;

/// Slots to push: to whom (that incarnation), what.
pub(super) type PushSends = Option<(NodeId, u64, Vec<TransferItem>)>;

/// Receives posted for pushes at most at once (per daemon).
pub(crate) const PUSHES_MAX: usize = 1024;
/// Invitations from peers held at most at once (they are answered in the
/// flush that follows the batch they came with).
const INVITES_MAX: usize = 4096;

/// A frame that came as an active message: its batch (none where it
/// carries answers alone), push answers and invitations.
pub(super) struct PushFrame {
    pub(super) batch: Option<Batch>,
    pub(super) answers: Vec<pb::PushAnswer>,
    pub(super) invites: Vec<pb::PushInvite>,
}

/// Decodes a frame that came as an active message. Only frames with a
/// batch or push answers travel that way; any other body is refused.
pub(super) fn decode_push_frame(bytes: &[u8]) -> Result<PushFrame, String> {
    use prost::Message as _;
    let f = pb::Frame::decode(bytes).map_err(|e| e.to_string())?;
    let batch = match f.body {
        Some(pb::frame::Body::Batch(b)) => Some(Batch::decode(&b).map_err(|e| e.to_string())?),
        None if !f.push_answers.is_empty() => None,
        None => return Err("a frame with neither batch nor push answers".into()),
        Some(_) => return Err("a frame body other than a batch".into()),
    };
    Ok(PushFrame { batch, answers: f.push_answers, invites: f.push_invites })
}

/// Where a push receive's outcome goes: to its channel (`Posted.rx`)
/// until a read uses the slot, then to that read, checked and reported on
/// the data-plane thread as it lands (no task to wake).
enum Landing {
    Waiting(tokio::sync::mpsc::UnboundedSender<(usize, TransferOutcome)>),
    Read(InlineReads),
}

/// The receive's outcome handler on the data-plane thread. Dropped
/// without an outcome (the queue did not take the receive, or the thread
/// stopped), it reports a failure.
struct LandingSink {
    landing: Arc<Mutex<Landing>>,
    ended: bool,
}

impl LandingSink {
    fn deliver(&mut self, k: usize, outcome: TransferOutcome) {
        self.ended = true;
        // A read's report never waits for the core (`try_read_ended`):
        // this lock is never held by a thread waiting for the core.
        match &mut *self.landing.lock() {
            Landing::Waiting(tx) => {
                let _ = tx.send((k, outcome));
            }
            Landing::Read(r) => r.ended(k, outcome),
        }
    }
}

impl Drop for LandingSink {
    fn drop(&mut self) {
        if !self.ended {
            self.deliver(0, TransferOutcome::Failed("data plane stopped".into()));
        }
    }
}

/// A receive posted for a slot a peer was invited to push.
pub(super) struct Push {
    /// The reserved local slot.
    pub(super) dest: CoreSlot,
    /// Its data-plane batch (one receive).
    id: u64,
    posted: Posted,
    landing: Arc<Mutex<Landing>>,
    /// Receive deadline.
    until: Instant,
    /// What the peer answered: `Some(true)` it sent the slot.
    answer: Option<bool>,
}

/// Push state of the driver (under the core lock).
#[derive(Default)]
pub(super) struct PushState {
    /// Getter side: receives posted, by the request's op and peer.
    posted: HashMap<OpId, Vec<(NodeId, Push)>>,
    count: usize,
    /// Holder side: invitations of the batches being handled, by (getter,
    /// op): the getter's tag.
    invites: HashMap<(NodeId, OpId), (u64, u64)>,
}

impl PushState {
    /// Takes receive `i` of `op` out (the op's entry goes with its last).
    fn take(&mut self, op: OpId, i: usize) -> Push {
        let v = self.posted.get_mut(&op).expect("a receive of this op");
        let (_, p) = v.swap_remove(i);
        if v.is_empty() {
            self.posted.remove(&op);
        }
        self.count -= 1;
        p
    }
}

/// Counters (stats: `push_invites`, `pushes_used`, `pushes_unused`,
/// `pushes_sent`, `pushes_landed_first`).
#[derive(Default)]
pub struct PushCounters {
    /// Receives posted with an invitation.
    pub invites: AtomicU64,
    /// Pushed slots a read used.
    pub used: AtomicU64,
    /// Invitations that came to nothing.
    pub unused: AtomicU64,
    /// Slots this daemon sent on an invitation.
    pub sent: AtomicU64,
    /// Pushed slots used by a read that had landed before the core started
    /// it, checked and reported within the input that started it.
    pub landed_inline: AtomicU64,
}

impl Cluster {
    /// Getter: for each locate or grant request of `batch` (for `to`),
    /// reserves a slot, posts its receive and returns the invitations to
    /// send with the batch. None where pushes are off, the peer does not
    /// take them, or a slot would cost an eviction.
    pub(super) fn invite_pushes(
        &self,
        g: &mut Inner,
        to: NodeId,
        batch: &Batch,
        queue: &mut VecDeque<Event>,
    ) -> Vec<pb::PushInvite> {
        if !self.push_invites || !self.peers.takes_push_invites(to) {
            return Vec::new();
        }
        let Some(inc) = g.node.view().member(to).map(|m| m.incarnation) else { return Vec::new() };
        if self.peers.try_conn_info(to).is_none_or(|(i, _)| i != inc) {
            return Vec::new();
        }
        let mut invites = Vec::new();
        let until = Instant::now() + Duration::from_millis(self.peers.config().transfer_timeout_ms);
        for m in &batch.msgs {
            let (op, key) = match *m {
                Msg::LocateReq { op, key, .. } | Msg::GrantReq { op, key, .. } => (op, key),
                _ => continue,
            };
            // One receive per request and peer (a retransmitted request
            // is not invited again), and only for a get still waited for
            // (one whose end was handled already gets no `ClientDone` to
            // free its receive).
            if g.push.count >= PUSHES_MAX
                || !g.waiters.contains_key(&op)
                || g.push.posted.get(&op).is_some_and(|v| v.iter().any(|(n, _)| *n == to))
            {
                continue;
            }
            let Some((dest, stride, cap, mapping)) = self.reserve_push_slot(&g.node, key, queue) else { continue };
            let d = to_store(dest);
            let tag = self.peers.next_tag();
            let item = TransferItem {
                remote_pool: 0,
                remote_offset: 0,
                len: stride,
                local_pool: d.pool,
                local_offset: d.slot as u64 * stride,
                tag,
            };
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let landing = Arc::new(Mutex::new(Landing::Waiting(tx)));
            let mut sink = LandingSink { landing: Arc::clone(&landing), ended: false };
            let done: crate::dataplane::InlineDone = Box::new(move |k, o| sink.deliver(k, o));
            let posted = Posted {
                rx,
                index: vec![0],
                geometry: vec![(stride, cap, Some(Dest::Pool(mapping)))],
                mode: Mode::Recv,
                t_post: Instant::now(),
                inc,
            };
            let Ok(id) = self.peers.dataplane().post_passive(Mode::Recv, to, inc, vec![item], until, done) else {
                // Not taken (the data plane's queue is full): no receive,
                // so no invitation (the peer would send into a tag nobody
                // receives); the sink, dropped, reported the failure, so
                // the slot is freed like any unused one.
                self.discard_push(Push { dest, id: 0, posted, landing, until, answer: None });
                continue;
            };
            g.push.posted.entry(op).or_default().push((to, Push { dest, id, posted, landing, until, answer: None }));
            g.push.count += 1;
            self.push_counters.invites.fetch_add(1, Ordering::Relaxed);
            invites.push(pb::PushInvite { op, tag, len: stride });
        }
        invites
    }

    /// A fetch slot for `key` if one is free without evicting anything, in
    /// a host pool UCX receives into: slot, stride, payload capacity, mapping.
    fn reserve_push_slot(
        &self,
        node: &Node,
        key: BlockKey,
        queue: &mut VecDeque<Event>,
    ) -> Option<(CoreSlot, u64, u64, Arc<kvmesh_ffi_os::SharedMapping>)> {
        // One lock from the check to the reservation: nothing allocates
        // in between.
        let mut st = self.store.lock();
        if !st.reserves_without_eviction(key.ns) {
            return None;
        }
        let ns = st.namespace_by_fingerprint(key.ns)?;
        let p = st.pools().get(ns.pool as usize)?;
        let mapping = p.memory.host().filter(|_| !is_staged(&p.memory))?.clone();
        let (stride, cap) = (p.stride, p.slot_payload_bytes);
        let slot = fetch_slot_in(&mut st, node, ns.id, key, queue)?;
        Some((slot, stride, cap, mapping))
    }

    /// Getter: the peer's answers to our invitations (handled before the
    /// batch they came with). A declined one's receive is cancelled: the
    /// peer sends nothing for it.
    pub(super) fn on_push_answers(&self, g: &mut Inner, from: NodeId, answers: &[pb::PushAnswer]) {
        for a in answers {
            let Some(v) = g.push.posted.get_mut(&a.op) else { continue };
            let Some(i) = v.iter().position(|(n, p)| *n == from && p.answer.is_none()) else { continue };
            if a.pushed {
                v[i].1.answer = Some(true);
                continue;
            }
            let mut p = g.push.take(a.op, i);
            p.answer = Some(false);
            self.discard_push(p);
        }
    }

    /// Getter: the core asks to read `remote` from `from` for `op`: the
    /// receive the peer pushed into, if it said it did and the slot is
    /// one a read may land in ours (the layout `post_wave` checks); else
    /// the read takes the send-order path (a push not used is discarded).
    pub(super) fn take_pushed(&self, g: &mut Inner, op: OpId, from: NodeId, remote: CoreSlot) -> Option<Push> {
        let i = g.push.posted.get(&op)?.iter().position(|(n, p)| *n == from && p.answer == Some(true))?;
        let p = g.push.take(op, i);
        let (stride, cap, _) = p.posted.geometry[0];
        let r = to_store(remote);
        let fits = self.peers.try_conn_info(from).is_some_and(|(_, pools)| {
            pools.iter().any(|rp| {
                rp.index == r.pool
                    && rp.slot_stride_bytes == stride
                    && rp.slot_payload_bytes == cap
                    && u64::from(r.slot) < rp.bytes / stride
            })
        });
        if !fits {
            self.discard_push(p);
            return None;
        }
        self.push_counters.used.fetch_add(1, Ordering::Relaxed);
        Some(p)
    }

    /// Getter: reads `read` (whose slot is `p.dest`) from what the peer
    /// pushed: reported to the core as any read (validated against the
    /// grant). A read deadline before the receive's cancels it then.
    ///
    /// A block that landed before the core started its read (its bytes
    /// came with, or ahead of, the answer the core is handling) is checked
    /// here, under the core lock, and reported within the same input
    /// (`queue`) — up to [`LANDED_INLINE_BYTES_MAX`] of slots per input;
    /// past it a task reports it as before. A receive that already ended
    /// otherwise (failed, timed out) is reported here too (not counted as
    /// landed first).
    pub(super) fn read_pushed(
        self: &Arc<Self>,
        g: &mut Inner,
        from: NodeId,
        read: Read,
        p: Push,
        queue: &mut VecDeque<Event>,
    ) {
        let Push { landing, mut posted, until, id: p_id, .. } = p;
        // Posted before the core asked for the read: no post time (one
        // observation per batch, as for every batch of reads).
        self.remote_metrics.transfer_post_seconds.observe(0.0);
        let stride = posted.geometry.first().map_or(u64::MAX, |(stride, _, _)| *stride);
        if g.landed_inline_bytes.saturating_add(stride) <= LANDED_INLINE_BYTES_MAX
            && let Ok((k, outcome)) = posted.rx.try_recv()
        {
            // (Taken from the channel: whatever it says is reported here.)
            let (mut moved, mut validating) = (0, Duration::ZERO);
            let result = match outcome {
                TransferOutcome::Done => {
                    g.landed_inline_bytes += stride;
                    let (stride, cap, dest) = &mut posted.geometry[k];
                    moved = *stride;
                    let d = to_store(read.dest);
                    let tv = Instant::now();
                    let r = match dest.take() {
                        Some(Dest::Pool(mapping)) => {
                            landed_in_pool(&mapping, d.slot, *stride, *cap, read.expect.key.ns)
                        }
                        _ => Err(TransferError::NoSpace),
                    };
                    validating = tv.elapsed();
                    self.push_counters.landed_inline.fetch_add(1, Ordering::Relaxed);
                    r
                }
                TransferOutcome::TimedOut => Err(TransferError::Timeout),
                TransferOutcome::Failed(e) => {
                    tracing::debug!(peer = from, "pushed slot: receive failed: {e}");
                    Err(TransferError::PeerGone)
                }
            };
            tracing::trace!(from, "slot read (landed before its read)");
            self.read_batch_done(posted.t_post, validating, moved);
            // (The last read in flight needs no flush of its own here, as
            // `read_ended` gives it: the inputs that start pushed reads,
            // a peer's batch on a stream or as active messages, flush
            // when their burst is handled; elsewhere the flush timer does.)
            let (ev, _last) = self.read_outcome(g, read, result);
            queue.push_back(ev);
            return;
        }
        let deadline = self.instant_of(read.deadline);
        if deadline < until {
            let (dp, id) = (Arc::clone(self.peers.dataplane()), p_id);
            tokio::spawn(async move {
                tokio::time::sleep_until(deadline.into()).await;
                dp.cancel(id);
            });
        }
        // Not landed yet (the usual case: the answer was sent first): the
        // data-plane thread checks and reports it as it lands.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let mut l = landing.lock();
            if matches!(*l, Landing::Waiting(_)) && posted.rx.is_empty() {
                *l = Landing::Read(InlineReads {
                    cluster: Arc::downgrade(self),
                    runtime,
                    from,
                    reads: vec![read],
                    index: vec![0],
                    geometry: std::mem::take(&mut posted.geometry),
                    reported: vec![false],
                    mode: Mode::Recv,
                    t_post: posted.t_post,
                    inc: posted.inc,
                    moved: 0,
                    validating: Duration::ZERO,
                    failed: false,
                });
                return;
            }
        }
        let wave = Wave { refused: Vec::new(), posted: Some(posted) };
        let me = Arc::clone(self);
        tokio::spawn(async move { me.read_batch_task(from, vec![read], Some(wave)).await });
    }

    /// Getter: the get `op` ended; receives still posted for it are
    /// waited for (a peer that pushed, or may still answer that it did,
    /// must not find the receive gone) and their slots freed.
    pub(super) fn end_pushes(&self, g: &mut Inner, op: OpId) {
        let Some(v) = g.push.posted.remove(&op) else { return };
        g.push.count -= v.len();
        for (_, p) in v {
            self.discard_push(p);
        }
    }

    /// Frees the slot of a push no read uses, once its receive ended
    /// (cancelled first where the peer declined); quarantined if UCX may
    /// still write it.
    fn discard_push(&self, p: Push) {
        self.push_counters.unused.fetch_add(1, Ordering::Relaxed);
        let dp = Arc::clone(self.peers.dataplane());
        if p.answer == Some(false) {
            dp.cancel(p.id);
        }
        let store = Arc::clone(&self.store);
        let Push { dest, posted: Posted { mut rx, .. }, .. } = p;
        tokio::spawn(async move {
            let outcome = rx.recv().await.map(|(_, o)| o);
            let mut st = store.lock();
            match outcome {
                Some(TransferOutcome::TimedOut) => st.quarantine_core(to_store(dest)),
                _ => st.free_core(to_store(dest)),
            }
        });
    }

    /// Holder: keeps the invitations `from` sent with `batch` (only for the
    /// locates and grant requests in it) until the answers go out.
    pub(super) fn take_invites(&self, g: &mut Inner, from: NodeId, invites: &[pb::PushInvite], batch: &Batch) {
        if invites.is_empty() || self.peers.hook() == Some(TestHook::PredatePushInvites) {
            return;
        }
        let asked: HashSet<OpId> = batch
            .msgs
            .iter()
            .filter_map(|m| match *m {
                Msg::LocateReq { op, .. } | Msg::GrantReq { op, .. } => Some(op),
                _ => None,
            })
            .collect();
        // Over the bound (or where answers leave only on the core's own
        // flush timer, so none could be declined in time): declined now.
        let mut declined = Vec::new();
        for i in invites {
            if !asked.contains(&i.op) {
                continue;
            }
            if g.push.invites.len() < INVITES_MAX && self.cfg.flush_when_idle {
                g.push.invites.insert((from, i.op), (i.tag, i.len));
            } else {
                declined.push(pb::PushAnswer { op: i.op, pushed: false });
            }
        }
        if !declined.is_empty() {
            let inc = g.node.view().member(from).map(|m| m.incarnation);
            self.send_batch(from, inc, pb::Frame { body: None, push_invites: Vec::new(), push_answers: declined });
        }
    }

    /// Getter: receives of gets that ended without a `ClientDone` reaching
    /// them (none should; a bound all the same), past their deadline.
    pub(super) fn sweep_pushes(&self, g: &mut Inner, now: Instant) {
        if g.push.posted.is_empty() {
            return;
        }
        let dead: Vec<OpId> = g
            .push
            .posted
            .iter()
            .filter(|(op, v)| !g.waiters.contains_key(op) && v.iter().all(|(_, p)| p.until <= now))
            .map(|(op, _)| *op)
            .collect();
        for op in dead {
            self.end_pushes(g, op);
        }
    }

    /// Holder: answers the invitations that the answers in `batch` (to
    /// `to`, grants already pinned for it) settle; the granted slots to
    /// send with the invitations' tags ([`Cluster::send_pushes`], once the
    /// batch is on its way).
    pub(super) fn answer_invites(&self, g: &mut Inner, to: NodeId, batch: &Batch) -> (Vec<pb::PushAnswer>, PushSends) {
        if g.push.invites.is_empty() {
            return (Vec::new(), None);
        }
        // Sends promised in the answers are queued after the answer leaves:
        // only where the data plane's queue has room for them now (a full
        // queue would refuse them, and the getter would wait in vain).
        let inc = g
            .node
            .view()
            .member(to)
            .map(|m| m.incarnation)
            .filter(|inc| self.peers.try_conn_info(to).is_some_and(|(i, _)| i == *inc))
            .filter(|_| self.peers.dataplane().has_room(64));
        let mut answers = Vec::new();
        let mut items = Vec::new();
        {
            let st = self.store.lock();
            for m in &batch.msgs {
                let (op, granted) = match m {
                    Msg::GrantResp { op, result: GrantResult::Granted { slot, .. }, .. } => (*op, Some(*slot)),
                    Msg::GrantResp { op, .. } | Msg::LocateResp { op, .. } => (*op, None),
                    _ => continue,
                };
                let Some((tag, len)) = g.push.invites.remove(&(to, op)) else { continue };
                let r = granted.filter(|_| inc.is_some()).map(to_store);
                let geometry = r.and_then(|r| {
                    let p = st.pools().get(r.pool as usize).filter(|p| !is_staged(&p.memory) && p.stride == len)?;
                    Some((r, p.stride))
                });
                if let Some((r, stride)) = geometry {
                    items.push(TransferItem {
                        remote_pool: 0,
                        remote_offset: 0,
                        len: stride,
                        local_pool: r.pool,
                        local_offset: r.slot as u64 * stride,
                        tag,
                    });
                }
                answers.push(pb::PushAnswer { op, pushed: geometry.is_some() });
            }
        }
        let sends = inc.filter(|_| !items.is_empty()).map(|inc| (to, inc, items));
        (answers, sends)
    }

    /// Holder: sends what [`Cluster::answer_invites`] granted.
    pub(super) fn send_pushes(&self, sends: PushSends) {
        let Some((to, inc, items)) = sends else { return };
        self.push_counters.sent.fetch_add(items.len() as u64, Ordering::Relaxed);
        let until = Instant::now() + Duration::from_millis(self.peers.config().transfer_timeout_ms);
        let dp = Arc::clone(self.peers.dataplane());
        // Nothing to do with the outcomes (the getter validates what lands).
        let post = move || {
            let _ = dp.post_passive(Mode::Send, to, inc, items, until, Box::new(|_, _| {}));
        };
        // Test-only (`KVMESH_TEST_HOOK=delay-push-sends-ms:N`, read once):
        // the pushed bytes land well after the answer, as they would behind
        // a slow link (the read the core starts meets a receive not landed
        // yet).
        static DELAY_MS: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
        let delay = *DELAY_MS.get_or_init(|| {
            let ms = crate::peers::test_hook_ms("delay-push-sends-ms");
            if let Some(ms) = ms {
                tracing::warn!("TEST HOOK ACTIVE: pushed slots are sent {ms} ms after their answer");
            }
            ms
        });
        match delay {
            Some(ms) => {
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(ms));
                    post()
                });
            }
            None => post(),
        }
    }

    /// Holder: invitations whose request got no answer in the flush that
    /// followed it are declined (their getters cancel the receives).
    pub(super) fn decline_leftover_invites(&self, g: &mut Inner) {
        if g.push.invites.is_empty() {
            return;
        }
        let mut by_peer: HashMap<NodeId, Vec<pb::PushAnswer>> = HashMap::new();
        for ((to, op), _) in g.push.invites.drain() {
            by_peer.entry(to).or_default().push(pb::PushAnswer { op, pushed: false });
        }
        for (to, push_answers) in by_peer {
            let inc = g.node.view().member(to).map(|m| m.incarnation);
            self.send_batch(to, inc, pb::Frame { body: None, push_invites: Vec::new(), push_answers });
        }
    }
}
