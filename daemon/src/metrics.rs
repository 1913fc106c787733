//! The Prometheus endpoint: `GET /metrics` on `[metrics] listen`, in the
//! OpenMetrics text format (which Prometheus scrapes natively).
//!
//! Two sources: the daemon's statistics (the same snapshot as the engine
//! `Stats` call and `kvmesh stats --json`), turned into counters and gauges
//! at every scrape, and histograms kept here (engine call latency per
//! method). Names follow Prometheus conventions: prefix `kvmesh_`, counters
//! end in `_total`, units in the name (`_seconds`, `_bytes`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use http_body_util::Full;
use hyper::body::Bytes;
use kvmesh_proto::engine::v1 as pb;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of an engine call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: &'static str,
    result: &'static str,
}

/// The thread that wrote a fast-path answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastAnswer {
    /// The connection's own thread: the call did not wait.
    Connection = 0,
    /// The data-plane thread, where the call's last step ended
    /// (daemon/src/inline.rs).
    DataPlane = 1,
    /// A runtime worker; or the connection's thread, the wait over by its
    /// re-poll.
    Other = 2,
}

/// `thread` label of each [`FastAnswer`], in its order.
const FAST_ANSWER_THREADS: [&str; 3] = ["connection", "data_plane", "other"];

/// Labels of a fast-path answer: the thread that wrote it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AnswerLabels {
    thread: &'static str,
}

fn call_histogram() -> Histogram {
    // 10 µs .. ~21 s (22 buckets doubling from 10 µs).
    Histogram::new(exponential_buckets(0.00001, 2.0, 22))
}

/// The result label of a clustered get.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GetLabels {
    /// `local_hit`, `fetched` (read from a peer and validated), `miss`,
    /// `error`.
    pub result: &'static str,
}

/// The stage label of a fetched get.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// `locate` (into the driver to the read asked: locate at the home,
    /// grant), `read` (read asked to its end: posting, moving, validating),
    /// `register` (read ended to the answer: registration at the home).
    pub stage: &'static str,
}

fn get_histogram() -> Histogram {
    // 5 µs .. ~21 s.
    Histogram::new(exponential_buckets(0.000005, 2.0, 23))
}

/// What the coherence driver records about remote work.
#[derive(Debug)]
pub struct RemoteMetrics {
    /// Per key of a clustered get: from entering the driver to its answer.
    pub get_seconds: Family<GetLabels, Histogram, fn() -> Histogram>,
    /// Fetched gets, per stage.
    pub get_stage_seconds: Family<StageLabels, Histogram, fn() -> Histogram>,
    /// A batch of reads: from the core asking for its first read to the
    /// batch posted to the data plane (task wake-up, handshake check,
    /// slot geometry).
    pub transfer_post_seconds: Histogram,
    /// A batch of reads: time spent hashing the copies that arrived (the
    /// validation before the core sees them), inside the batch's time.
    pub transfer_validate_seconds: Histogram,
    /// Bytes one batch of reads from one holder moved (successful reads).
    pub transfer_batch_bytes: Histogram,
    /// Time of one batch of reads from one holder, posted to last outcome.
    pub transfer_batch_seconds: Histogram,
    /// Bytes read from peers.
    pub bytes_read: prometheus_client::metrics::counter::Counter,
    /// The families' series, looked up once (a get records without a
    /// family lookup): by `GET_RESULTS` and `GET_STAGES` index.
    by_result: Vec<Histogram>,
    by_stage: Vec<Histogram>,
}

const GET_RESULTS: [&str; 4] = ["local_hit", "fetched", "miss", "error"];
const GET_STAGES: [&str; 3] = ["locate", "read", "register"];

impl RemoteMetrics {
    /// Records a clustered get (`result` one of `GET_RESULTS`).
    pub fn observe_get(&self, result: &'static str, secs: f64) {
        match GET_RESULTS.iter().position(|r| *r == result) {
            Some(i) => self.by_result[i].observe(secs),
            None => self.get_seconds.get_or_create(&GetLabels { result }).observe(secs),
        }
    }

    /// Records one stage of a fetched get (one of `GET_STAGES`).
    pub fn observe_stage(&self, stage: &'static str, secs: f64) {
        match GET_STAGES.iter().position(|s| *s == stage) {
            Some(i) => self.by_stage[i].observe(secs),
            None => self.get_stage_seconds.get_or_create(&StageLabels { stage }).observe(secs),
        }
    }
}

impl Default for RemoteMetrics {
    fn default() -> Self {
        let m = RemoteMetrics {
            get_seconds: Family::new_with_constructor(get_histogram),
            get_stage_seconds: Family::new_with_constructor(get_histogram),
            transfer_post_seconds: get_histogram(),
            transfer_validate_seconds: get_histogram(),
            // 4 KiB .. 4 GiB.
            transfer_batch_bytes: Histogram::new(exponential_buckets(4096.0, 4.0, 11)),
            transfer_batch_seconds: Histogram::new(exponential_buckets(0.00001, 2.0, 22)),
            bytes_read: Default::default(),
            by_result: Vec::new(),
            by_stage: Vec::new(),
        };
        // Every known label value exists from the start (zero series), so
        // dashboards and alerts see the families before the first event.
        let mut m = m;
        m.by_result = GET_RESULTS.map(|result| m.get_seconds.get_or_create(&GetLabels { result }).clone()).to_vec();
        m.by_stage = GET_STAGES.map(|stage| m.get_stage_seconds.get_or_create(&StageLabels { stage }).clone()).to_vec();
        m
    }
}

/// A histogram with fixed buckets recorded with relaxed atomics: no lock
/// per observation (prometheus-client's `Histogram` takes a mutex), for
/// paths that observe once per block.
#[derive(Debug)]
pub struct AtomicHistogram {
    bounds: Vec<f64>,
    /// One count per bound, plus the overflow (+Inf) bucket.
    counts: Vec<std::sync::atomic::AtomicU64>,
    /// Sum of observations, in micro-units.
    sum_micros: std::sync::atomic::AtomicU64,
}

impl AtomicHistogram {
    /// Buckets with these upper bounds (increasing).
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> AtomicHistogram {
        let bounds: Vec<f64> = bounds.into_iter().collect();
        let counts = (0..=bounds.len()).map(|_| std::sync::atomic::AtomicU64::new(0)).collect();
        AtomicHistogram { bounds, counts, sum_micros: std::sync::atomic::AtomicU64::new(0) }
    }

    /// Records one value.
    pub fn observe(&self, v: f64) {
        use std::sync::atomic::Ordering::Relaxed;
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_micros.fetch_add((v.max(0.0) * 1e6) as u64, Relaxed);
    }
}

impl EncodeMetric for AtomicHistogram {
    fn encode(&self, mut encoder: prometheus_client::encoding::MetricEncoder) -> Result<(), std::fmt::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let counts: Vec<u64> = self.counts.iter().map(|c| c.load(Relaxed)).collect();
        let buckets: Vec<(f64, u64)> =
            self.bounds.iter().copied().chain([f64::INFINITY]).zip(counts.iter().copied()).collect();
        let sum = self.sum_micros.load(Relaxed) as f64 / 1e6;
        encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, counts.iter().sum(), &buckets, None)
    }

    fn metric_type(&self) -> prometheus_client::metrics::MetricType {
        prometheus_client::metrics::MetricType::Histogram
    }
}

/// An [`AtomicHistogram`] shared with its recorder, registered per scrape.
#[derive(Debug)]
struct Shared(Arc<AtomicHistogram>);

impl EncodeMetric for Shared {
    fn encode(&self, encoder: prometheus_client::encoding::MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }
    fn metric_type(&self) -> prometheus_client::metrics::MetricType {
        self.0.metric_type()
    }
}

/// Histograms the daemon records as it works.
#[derive(Debug)]
pub struct Metrics {
    engine_calls: Family<CallLabels, Histogram, fn() -> Histogram>,
    fast_answers: Family<AnswerLabels, Counter>,
    /// Its three series, made once (no family lookup per answer):
    /// connection, data_plane, other.
    fast_answered: [Counter; 3],
    lease_left: Option<Arc<AtomicHistogram>>,
    remote: Option<Arc<RemoteMetrics>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let fast_answers: Family<AnswerLabels, Counter> = Family::default();
        let fast_answered =
            FAST_ANSWER_THREADS.map(|thread| fast_answers.get_or_create(&AnswerLabels { thread }).clone());
        Metrics {
            engine_calls: Family::new_with_constructor(call_histogram),
            fast_answers,
            fast_answered,
            lease_left: None,
            remote: None,
        }
    }
}

impl Metrics {
    /// Also renders the coherence driver's remote histograms.
    pub fn with_remote(mut self, r: Arc<RemoteMetrics>) -> Metrics {
        self.remote = Some(r);
        self
    }

    /// Also renders the store's lease-left-at-unpin histogram.
    pub fn with_lease_left(mut self, h: Arc<AtomicHistogram>) -> Metrics {
        self.lease_left = Some(h);
        self
    }

    /// Records one engine call.
    pub fn observe_call(&self, method: &'static str, ok: bool, started: Instant) {
        let labels = CallLabels { method, result: if ok { "ok" } else { "error" } };
        self.engine_calls.get_or_create(&labels).observe(started.elapsed().as_secs_f64());
    }

    /// Counts one fast-path answer by the thread that wrote it.
    pub fn count_fast_answer(&self, thread: FastAnswer) {
        self.fast_answered[thread as usize].inc();
    }
}

/// The statistics snapshot of one scrape.
#[derive(Debug)]
struct Snapshot(pb::StatsResponse);

fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(v);
    c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge<N: prometheus_client::encoding::EncodeGaugeValue + Clone + std::fmt::Debug + Send + Sync + 'static>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: N,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v);
    g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)
}

impl prometheus_client::collector::Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        let e = &mut enc;
        gauge(e, "uptime_seconds", "Seconds since the daemon started.", s.uptime_ms as f64 / 1e3)?;
        gauge(e, "namespaces", "Registered namespaces.", s.namespaces)?;
        gauge(e, "sessions", "Engine connections.", s.sessions)?;
        gauge(e, "pins_outstanding", "Pins held by engines.", s.pins_outstanding)?;
        gauge(e, "allocations_outstanding", "Uncommitted allocations.", s.allocations_outstanding)?;
        gauge(e, "peers_connected", "Peer daemons connected.", s.peers_connected)?;
        gauge(e, "draining", "1 while a drain refuses new pins and allocations.", s.draining as u64)?;
        gauge(e, "event_watchers", "WatchEvents streams open.", s.event_watchers)?;
        for (name, help, v) in [
            ("lookups", "Keys looked up.", s.lookups),
            ("hits", "Keys found (lookups and pins).", s.hits),
            ("misses", "Keys not found.", s.misses),
            ("pins", "Blocks pinned.", s.pins),
            ("commits", "Blocks committed.", s.commits),
            ("aborts", "Allocations aborted (explicitly, by lease or by disconnect).", s.aborts),
            ("evictions", "Blocks evicted.", s.evictions),
            ("removes", "Blocks removed or invalidated.", s.removes),
            ("lease_expirations", "Pins or allocations reclaimed at their lease end.", s.lease_expirations),
            ("session_releases", "Pins and allocations released by closed connections.", s.session_releases),
            ("resource_exhausted", "Requests refused for lack of slots or a limit.", s.resource_exhausted),
            ("remote_fetched", "Blocks fetched from peers and validated.", s.remote_fetched),
            ("remote_misses", "Remote fetches that found nothing.", s.remote_misses),
            ("remote_validation_failures", "Remote copies that failed validation.", s.remote_validation_failures),
            ("transfer_failures", "Data-plane transfers that failed.", s.transfer_failures),
            ("transfer_timeouts", "Data-plane transfers that timed out.", s.transfer_timeouts),
            ("slots_quarantined", "Slots quarantined after a failed transfer.", s.slots_quarantined),
            (
                "slots_fenced",
                "Slots fenced: an allocation ended while its engine could still write it.",
                s.slots_fenced,
            ),
            (
                "fences_forced",
                "Fenced slots reused after limits.fence_ms_max while their engine could still write.",
                s.fences_forced,
            ),
            ("grants_given", "Read grants given to peers.", s.grants_given),
            (
                "event_watchers_cut_off",
                "Event watchers cut off: too far behind the event ring, or not reading.",
                s.event_watchers_cut_off,
            ),
        ] {
            counter(e, name, help, v)?;
        }
        // Per pool.
        for (name, help, get) in [
            ("pool_bytes", "Bytes of the pool.", (|p: &pb::PoolStats| p.bytes) as fn(&pb::PoolStats) -> u64),
            ("pool_slot_payload_bytes", "Payload bytes of a slot.", |p| p.slot_payload_bytes),
            ("pool_slots", "Slots of the pool.", |p| p.slots as u64),
            ("pool_free_slots", "Free slots.", |p| p.free as u64),
            ("pool_valid_slots", "Slots holding a valid block.", |p| p.valid as u64),
            ("pool_pending_slots", "Slots being written.", |p| p.pending as u64),
            ("pool_pinned_slots", "Slots pinned by engines or peers.", |p| p.pinned as u64),
            ("pool_zombie_slots", "Removed slots still pinned.", |p| p.zombie as u64),
            ("pool_quarantined_slots", "Slots reserved until restart after a timed-out transfer.", |p| {
                p.quarantined as u64
            }),
            ("pool_fenced_slots", "Slots fenced: an engine whose allocation ended may still write them.", |p| {
                p.fenced as u64
            }),
            ("pool_huge_page_bytes", "Bytes of the pool mapped with huge pages when it was made.", |p| {
                p.huge_page_bytes
            }),
        ] {
            let g = ConstGauge::new(0u64);
            let mut me = e.encode_descriptor(name, help, None, g.metric_type())?;
            for p in &s.pools {
                let labels = [("pool", p.name.as_str()), ("device", p.device.as_str())];
                ConstGauge::new(get(p)).encode(me.encode_family(&labels)?)?;
            }
        }
        // Per peer (bounded by the configured [[peers]]).
        if !s.peers.is_empty() {
            for (name, help, get) in [
                (
                    "peer_up",
                    "1 when the coherence stream to the peer is up.",
                    (|p: &pb::PeerInfo| p.stream_up as u64) as fn(&pb::PeerInfo) -> u64,
                ),
                ("peer_handshake", "1 when the data-plane handshake with the peer is done.", |p| p.handshake as u64),
                ("peer_in_view", "1 when the peer is a member of the current view.", |p| p.in_view as u64),
            ] {
                let g = ConstGauge::new(0u64);
                let mut me = e.encode_descriptor(name, help, None, g.metric_type())?;
                for p in &s.peers {
                    let id = p.id.to_string();
                    ConstGauge::new(get(p)).encode(me.encode_family(&[("peer", id.as_str())])?)?;
                }
            }
            let c = ConstCounter::new(0u64);
            let mut me = e.encode_descriptor(
                "peer_queue_drops",
                "Frames to the peer dropped (queue full or stream down).",
                None,
                c.metric_type(),
            )?;
            for p in &s.peers {
                let id = p.id.to_string();
                ConstCounter::new(p.queue_drops).encode(me.encode_family(&[("peer", id.as_str())])?)?;
            }
            let g = ConstGauge::new(0.0f64);
            let mut me = e.encode_descriptor(
                "peer_last_pong_age_seconds",
                "Seconds since the peer last answered a heartbeat (absent: never).",
                None,
                g.metric_type(),
            )?;
            for p in s.peers.iter().filter(|p| p.last_pong_ms_ago > 0) {
                let id = p.id.to_string();
                ConstGauge::new(p.last_pong_ms_ago as f64 / 1e3).encode(me.encode_family(&[("peer", id.as_str())])?)?;
            }
        }
        if let Some(c) = &s.coherence {
            gauge(e, "coherence_serving", "1 when the daemon serves (member of the current view).", c.serving as u64)?;
            gauge(e, "coherence_epoch", "Membership epoch.", c.epoch)?;
            gauge(e, "coherence_members", "Members of the current view.", c.members)?;
            gauge(e, "coherence_ops_in_flight", "Puts, gets and invalidations in flight.", c.ops_in_flight)?;
            gauge(e, "coherence_grants_outstanding", "Read grants not yet returned.", c.grants_outstanding)?;
            gauge(e, "coherence_copies", "Copies this daemon holds.", c.copies)?;
            gauge(e, "coherence_directory_entries", "Directory entries this daemon homes.", c.directory_entries)?;
            gauge(
                e,
                "coherence_directory_ready",
                "1 when the directory is rebuilt after a view change.",
                c.directory_ready as u64,
            )?;
            gauge(e, "etcd_connected", "1 when connected to etcd (etcd membership).", c.etcd_connected as u64)?;
            let us = |v: u64| v as f64 / 1e6;
            gauge(
                e,
                "coherence_inval_to_ack_p50_seconds",
                "Invalidation sent to its ack, P50 (upper bucket bound).",
                us(c.inval_to_ack_p50_us),
            )?;
            gauge(
                e,
                "coherence_inval_to_ack_p99_seconds",
                "Invalidation sent to its ack, P99 (upper bucket bound).",
                us(c.inval_to_ack_p99_us),
            )?;
            gauge(
                e,
                "coherence_inval_to_ack_max_seconds",
                "Invalidation sent to its ack, max.",
                us(c.inval_to_ack_max_us),
            )?;
            counter(e, "coherence_inval_to_ack", "Invalidation acks timed.", c.inval_to_ack_count)?;
            for (name, help, v) in [
                ("coherence_batches_sent", "Protocol batches sent to peers.", c.batches_sent),
                ("coherence_messages_sent", "Protocol messages sent to peers.", c.msgs_sent),
                ("coherence_batches_received", "Protocol batches received.", c.batches_received),
                ("coherence_invalidates_sent", "Invalidations sent.", c.invalidates_sent),
                ("coherence_acks_sent", "Acknowledgements sent.", c.acks_sent),
                ("coherence_stale_epoch_drops", "Messages of an old epoch dropped.", c.stale_epoch_drops),
                ("coherence_validation_failures", "Copies that failed validation.", c.validation_failures),
                ("coherence_late_transfers", "Transfers that finished after their deadline.", c.late_transfers),
                ("coherence_changes_completed", "Overwrites and invalidations completed.", c.changes_completed),
                ("coherence_peer_queue_drops", "Messages dropped on full peer queues.", c.peer_queue_drops),
                (
                    "membership_incarnations_held_back",
                    "Keepalives of a node's new incarnation the coordinator ignored: its last was admitted less than \
                     the removal time ago.",
                    c.incarnations_held_back,
                ),
                ("coherence_decode_errors", "Peer messages that failed to decode.", c.decode_errors),
                (
                    "coherence_peer_refusals",
                    "Peer values refused as impossible for an honest daemon (versions, epochs, views, slots, pools).",
                    c.peer_refusals,
                ),
                (
                    "coherence_versions_exhausted",
                    "Changes refused: the epoch had no version left.",
                    c.versions_exhausted,
                ),
                (
                    "coherence_lease_lapses",
                    "Times the membership lease lapsed while copies were held (all dropped).",
                    c.lease_lapses,
                ),
                (
                    "coherence_copies_dropped_lapsed",
                    "Copies dropped because the lease lapsed.",
                    c.copies_dropped_lapsed,
                ),
                ("coherence_lookups", "Cluster-wide lookups started here.", c.lookups),
                (
                    "coherence_lookups_incomplete",
                    "Cluster-wide lookups that ended before every home answered (keys of the others reported absent).",
                    c.lookups_incomplete,
                ),
                (
                    "coherence_lookup_questions_answered",
                    "Lookup questions this daemon answered as a home.",
                    c.lookup_questions_answered,
                ),
                (
                    "coherence_lookups_one_sided",
                    "Cluster-wide lookups answered from the homes' lookup tables, read one-sided.",
                    c.lookups_one_sided,
                ),
                (
                    "coherence_lookup_table_fallbacks",
                    "Lookups that tried the homes' tables and had to ask the homes.",
                    c.lookup_table_fallbacks,
                ),
                (
                    "coherence_lookup_table_overflowed",
                    "Keys homed here that found their lookup-table group full (peers ask about them).",
                    c.lookup_table_overflowed,
                ),
                (
                    "coherence_control_am_sent",
                    "Coherence messages (batches, barrier pings and pongs) sent as UCX active messages.",
                    c.control_am_sent,
                ),
                (
                    "coherence_control_am_direct",
                    "Of the coherence messages sent as UCX active messages, those sent by the thread that produced them while the data-plane thread slept (no wake-up).",
                    c.control_am_direct,
                ),
                (
                    "coherence_control_am_received",
                    "Coherence messages received as UCX active messages.",
                    c.control_am_received,
                ),
                (
                    "coherence_control_am_drops",
                    "Coherence messages over UCX dropped (endpoint gone, send failed or stuck, malformed); the protocol retransmits.",
                    c.control_am_drops,
                ),
                (
                    "coherence_staged_reads",
                    "Blocks fetched through a host staging slot (pools UCX cannot reach: GPU pools without CUDA support in UCX).",
                    c.staged_reads,
                ),
                ("coherence_staged_sends", "Blocks sent to peers from a host staging slot.", c.staged_sends),
                (
                    "coherence_push_invites",
                    "Receives posted with a locate or grant request, inviting the peer to push the slot with its grant (tcp, peer.push_with_grants).",
                    c.push_invites,
                ),
                ("coherence_pushes_used", "Slots a peer pushed with its grant that a read used.", c.pushes_used),
                (
                    "coherence_pushes_unused",
                    "Push invitations that came to nothing (no grant, declined, or the get went another way); their slots are freed.",
                    c.pushes_unused,
                ),
                (
                    "coherence_pushes_sent",
                    "Slots this daemon sent with its grant on a getter's invitation.",
                    c.pushes_sent,
                ),
                (
                    "coherence_pushes_landed_first",
                    "Pushed slots that had landed before the core started their read, checked and reported in the input that started it (no task).",
                    c.pushes_landed_first,
                ),
                (
                    "coherence_timer_kicks",
                    "Times an input woke the coherence timer task because the core's next timeout moved earlier (other inputs leave it asleep).",
                    c.timer_kicks,
                ),
                (
                    "coherence_staging_exhausted",
                    "Staged reads or sends refused because every staging slot was busy (misses; see peer.staging_slots).",
                    c.staging_exhausted,
                ),
                (
                    "coherence_pending_registrations",
                    "Readers this daemon (as home) registered as pending holders when it answered their locate.",
                    c.pending_registrations,
                ),
                (
                    "coherence_early_registrations",
                    "Fetched copies served as soon as they validated, on their locate-time registration (one round trip saved each).",
                    c.early_registrations,
                ),
                (
                    "coherence_peer_auth_refusals",
                    "Peer calls refused for who made them (not a configured peer, or a TLS certificate for another node).",
                    c.peer_auth_refusals,
                ),
                ("etcd_errors", "etcd calls that failed.", c.etcd_errors),
            ] {
                counter(e, name, help, v)?;
            }
        }
        Ok(())
    }
}

/// Renders one scrape.
pub fn render(stats: pb::StatsResponse, metrics: &Metrics) -> String {
    let mut reg = Registry::with_prefix("kvmesh");
    reg.register("engine_call_seconds", "Engine gRPC call latency by method and result", metrics.engine_calls.clone());
    reg.register(
        "fast_answers",
        "Fast-path answers by the thread that wrote them (connection: at once; data_plane: where the call's last step ended; other)",
        metrics.fast_answers.clone(),
    );
    if let Some(h) = &metrics.lease_left {
        reg.register(
            "lease_remaining_at_unpin_seconds",
            "Lease left when an engine released a pin",
            Shared(Arc::clone(h)),
        );
    }
    if let Some(r) = &metrics.remote {
        reg.register(
            "get_seconds",
            "Clustered gets, per key: from the driver to the answer, by result (local_hit, fetched, miss, error)",
            r.get_seconds.clone(),
        );
        reg.register(
            "get_stage_seconds",
            "Fetched gets by stage: locate (home, grant), read (post, move, validate), register (at the home)",
            r.get_stage_seconds.clone(),
        );
        reg.register(
            "transfer_post_seconds",
            "A batch of reads: from the first read asked to the batch posted to the data plane",
            r.transfer_post_seconds.clone(),
        );
        reg.register(
            "transfer_validate_seconds",
            "A batch of reads: time spent checksumming the copies that arrived (within the batch time)",
            r.transfer_validate_seconds.clone(),
        );
        reg.register(
            "transfer_batch_bytes",
            "Bytes one batch of reads from one peer moved",
            r.transfer_batch_bytes.clone(),
        );
        reg.register(
            "transfer_batch_seconds",
            "One batch of reads from one peer, posted to its last outcome",
            r.transfer_batch_seconds.clone(),
        );
        reg.register("remote_read_bytes", "Bytes read from peers", r.bytes_read.clone());
    }
    reg.register_collector(Box::new(Snapshot(stats)));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &reg).expect("writing to a String cannot fail");
    out
}

/// The Prometheus text format (0.0.4) of an OpenMetrics text: a counter
/// family `x` is named `x_total` there (its samples already are), and
/// there are no `# EOF` or `# UNIT` lines. Served to clients that do not
/// ask for OpenMetrics (curl, promtool); Prometheus asks for OpenMetrics.
pub fn to_prometheus_text(om: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        om.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{p}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(&l),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Serves `/metrics` on `listener` until `stop` changes. `snapshot` builds
/// the statistics of one scrape.
pub async fn serve<F, Fut>(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    snapshot: F,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = pb::StatsResponse> + Send,
{
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("metrics endpoint: accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let (metrics, snapshot) = (Arc::clone(&metrics), snapshot.clone());
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let (metrics, snapshot) = (Arc::clone(&metrics), snapshot.clone());
                async move {
                    let resp = match (req.method(), req.uri().path()) {
                        (&hyper::Method::GET, "/metrics") => {
                            let om = render(snapshot().await, &metrics);
                            let wants_om = req
                                .headers()
                                .get(hyper::header::ACCEPT)
                                .and_then(|v| v.to_str().ok())
                                .is_some_and(|v| v.contains("application/openmetrics-text"));
                            let (body, ctype) = if wants_om {
                                (om, "application/openmetrics-text; version=1.0.0; charset=utf-8")
                            } else {
                                (to_prometheus_text(&om), "text/plain; version=0.0.4; charset=utf-8")
                            };
                            hyper::Response::builder()
                                .header(hyper::header::CONTENT_TYPE, ctype)
                                .body(Full::new(Bytes::from(body)))
                        }
                        (&hyper::Method::GET, "/") => hyper::Response::builder()
                            .header(hyper::header::CONTENT_TYPE, "text/plain; charset=utf-8")
                            .body(Full::new(Bytes::from_static(b"kvmeshd: metrics at /metrics\n"))),
                        _ => hyper::Response::builder()
                            .status(hyper::StatusCode::NOT_FOUND)
                            .body(Full::new(Bytes::from_static(b"not found: try /metrics\n"))),
                    };
                    Ok::<_, Infallible>(resp.expect("valid response"))
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await {
                tracing::debug!("metrics connection: {e}");
            }
        });
    }
}

/// The engine method of a gRPC path, as a static label.
fn method_label(path: &str) -> &'static str {
    match path.rsplit('/').next().unwrap_or("") {
        "Hello" => "hello",
        "RegisterNamespace" => "register_namespace",
        "GetNamespace" => "get_namespace",
        "Lookup" => "lookup",
        "Pin" => "pin",
        "Unpin" => "unpin",
        "Allocate" => "allocate",
        "Commit" => "commit",
        "Abort" => "abort",
        "Remove" => "remove",
        "Invalidate" => "invalidate",
        "Stats" => "stats",
        "ListNamespaces" => "list_namespaces",
        "ListKeys" => "list_keys",
        _ => "other",
    }
}

/// A tower layer timing every engine call (method from the path, result
/// from the `grpc-status` of the response headers: tonic puts a failure's
/// status there, a success's in the trailers).
#[derive(Clone)]
pub struct TimedLayer(pub Arc<Metrics>);

impl<S> tower::Layer<S> for TimedLayer {
    type Service = Timed<S>;
    fn layer(&self, inner: S) -> Timed<S> {
        Timed { inner, metrics: Arc::clone(&self.0) }
    }
}

/// See [`TimedLayer`].
#[derive(Clone)]
pub struct Timed<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, B, RB> tonic::codegen::Service<tonic::codegen::http::Request<B>> for Timed<S>
where
    S: tonic::codegen::Service<tonic::codegen::http::Request<B>, Response = tonic::codegen::http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        let method = method_label(req.uri().path());
        let started = Instant::now();
        let fut = self.inner.call(req);
        let metrics = Arc::clone(&self.metrics);
        Box::pin(async move {
            let r = fut.await;
            let ok = match &r {
                Ok(resp) => resp.headers().get("grpc-status").is_none_or(|v| v.as_bytes() == b"0"),
                Err(_) => false,
            };
            metrics.observe_call(method, ok, started);
            r
        })
    }
}
