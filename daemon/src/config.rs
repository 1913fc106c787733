//! The daemon's TOML configuration: one file, every field with a default,
//! unknown fields rejected, and every error naming the field at fault.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};

/// The default configuration, embedded in the binary (`kvmeshd` with no
/// arguments runs on it; `kvmeshd --print-default-config` prints it).
pub const DEFAULT_CONFIG: &str = include_str!("../kvmeshd.default.toml");

/// Whole configuration file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Engine socket.
    #[serde(default)]
    pub server: ServerConfig,
    /// Limits on requests, sessions and leases.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// Eviction watermarks.
    #[serde(default)]
    pub eviction: EvictionConfig,
    /// Memory pools (at least one).
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
    /// This daemon in the cluster.
    #[serde(default)]
    pub node: NodeConfig,
    /// Peer channel and data plane.
    #[serde(default)]
    pub peer: PeerConfig,
    /// Static list of peer daemons.
    #[serde(default)]
    pub peers: Vec<PeerEntry>,
    /// Coherence protocol and membership (clustered daemons).
    #[serde(default)]
    pub coherence: CoherenceConfig,
    /// Who is in the cluster: the static list with a coordinator, or etcd.
    #[serde(default)]
    pub membership: MembershipConfig,
    /// The Prometheus endpoint.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// Logging.
    #[serde(default)]
    pub log: LogConfig,
    /// KV events for routers (`WatchEvents`).
    #[serde(default)]
    pub events: EventsConfig,
}

/// `[events]`: the `WatchEvents` streams.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsConfig {
    /// Events kept for consumers that are behind (one ring for all
    /// watchers); a consumer further behind is cut off. 16 to 2^22.
    pub buffer_events: u32,
    /// A consumer that does not take the next batch for this long is cut
    /// off. 100 ms to 1 hour.
    pub stall_ms: u64,
    /// Watch streams open at once (more are refused). 1 to 4096.
    pub watchers_max: u32,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig { buffer_events: 65_536, stall_ms: 10_000, watchers_max: 64 }
    }
}

/// `[log]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// A `RUST_LOG`-style filter (`info`, `kvmeshd::cluster=debug,info`);
    /// the `KVMESH_LOG` environment variable overrides it. Reloadable.
    pub filter: String,
    /// `text` or `json` (one JSON object per line).
    pub format: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { filter: "info".into(), format: "text".into() }
    }
}

impl Config {
    /// What changed from `self` to `new` that a reload (SIGHUP) cannot
    /// apply: the names of the sections or fields, empty when all changes
    /// are reloadable (`log.filter`, `limits.*` but `reaper_interval_ms`,
    /// `eviction.*`).
    pub fn unreloadable_changes(&self, new: &Config) -> Vec<&'static str> {
        let mut out = Vec::new();
        let differ = |a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| format!("{a:?}") != format!("{b:?}");
        if differ(&self.server, &new.server) {
            out.push("server");
        }
        if differ(&self.pools, &new.pools) {
            out.push("pools");
        }
        if differ(&self.node, &new.node) {
            out.push("node");
        }
        if differ(&self.peer, &new.peer) {
            out.push("peer");
        }
        if differ(&self.peers, &new.peers) {
            out.push("peers");
        }
        if differ(&self.coherence, &new.coherence) {
            out.push("coherence");
        }
        if differ(&self.membership, &new.membership) {
            out.push("membership");
        }
        if differ(&self.metrics, &new.metrics) {
            out.push("metrics");
        }
        if self.log.format != new.log.format {
            out.push("log.format");
        }
        if differ(&self.events, &new.events) {
            out.push("events");
        }
        if self.limits.reaper_interval_ms != new.limits.reaper_interval_ms {
            out.push("limits.reaper_interval_ms");
        }
        out
    }
}

/// `[metrics]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// `host:port` serving `GET /metrics` (Prometheus); `""` turns it off.
    pub listen: String,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig { listen: "127.0.0.1:9433".into() }
    }
}

impl MetricsConfig {
    /// The address to serve on, or None when off.
    pub fn addr(&self) -> Result<Option<std::net::SocketAddr>, String> {
        if self.listen.is_empty() {
            return Ok(None);
        }
        self.listen.parse().map(Some).map_err(|e| {
            format!("metrics.listen: {:?} is not an address:port ({e}); \"\" turns the endpoint off", self.listen)
        })
    }
}

/// `[membership]`: where views and membership leases come from.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MembershipConfig {
    /// `static`: the configured peers, with a coordinator daemon
    /// (`coherence.coordinator`); `etcd`: every daemon registers under an
    /// etcd lease and views come from etcd (no single coordinator).
    pub kind: String,
    /// etcd endpoints (`host:port` or `http://host:port`).
    pub endpoints: Vec<String>,
    /// Prefix of kvmesh's keys in etcd (one cluster per prefix).
    pub key_prefix: String,
    /// TTL of this daemon's etcd lease, seconds: a daemon that stops
    /// refreshing it leaves the view this long after its last refresh.
    /// Must exceed `coherence.membership_lease_ms` plus twice the margin.
    pub lease_ttl_s: u64,
    /// Deadline of connecting to etcd and of each etcd request.
    pub dial_timeout_ms: u64,
    /// TLS to etcd (`https://` endpoints); unset: plaintext.
    pub tls: Option<EtcdTlsConfig>,
}

/// `[membership.tls]`: TLS to etcd, with a client certificate when etcd
/// requires one (`--client-cert-auth`).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct EtcdTlsConfig {
    /// PEM file of the CA that signed etcd's server certificate.
    pub ca: Option<PathBuf>,
    /// PEM file of this daemon's client certificate (with `key`).
    pub cert: Option<PathBuf>,
    /// PEM file of its private key.
    pub key: Option<PathBuf>,
    /// Name etcd's certificate must carry; default: the endpoint's host.
    pub domain: Option<String>,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            kind: "static".into(),
            endpoints: Vec::new(),
            key_prefix: "/kvmesh".into(),
            lease_ttl_s: 5,
            dial_timeout_ms: 2_000,
            tls: None,
        }
    }
}

/// `[node]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Node id, unique in the cluster.
    pub id: u32,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig { id: 1 }
    }
}

/// `[peer]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeerConfig {
    /// Address of the peer gRPC service (`host:port`); none: no peer service.
    pub listen: Option<String>,
    /// UCX transports: `sm` (shared memory, one host), `tcp`, `all`.
    pub transports: String,
    /// How blocks move: `get` (one-sided reads), `send` (the holder sends
    /// with tag-matched rendezvous), `auto` (send on tcp, get otherwise).
    pub transfer: String,
    /// Who allocates the pools of a clustered daemon: `memfd` (the daemon),
    /// `ucx` (UCX, so its shared-memory transports read them one-sided;
    /// engines attach the SysV segment), `auto` (ucx with `sm`).
    pub pool_alloc: String,
    /// Deadline of one remote fetch (query, transfer, validation).
    pub transfer_timeout_ms: u64,
    /// Lease of a read grant given to a peer.
    pub grant_lease_ms: u64,
    /// Most one-sided reads in flight.
    pub inflight_requests_max: u32,
    /// Most bytes in flight.
    #[serde(deserialize_with = "de_bytes")]
    pub inflight_bytes_max: u64,
    /// How long the data-plane thread keeps polling UCX, with reads in
    /// flight, after the last progress before it sleeps on the worker's
    /// event fd (µs; 0: never polls while waiting). Longer is lower
    /// latency where the thread has a core of its own, and takes that
    /// core from the transfer's other threads where it has not.
    pub poll_idle_us: u64,
    /// Host staging slots through which blocks of GPU pools move between
    /// daemons (each the size of the largest GPU slot; docs/GPU.md): at
    /// most this many such blocks in flight, sent or received, at once.
    pub staging_slots: u32,
    /// How coherence batches travel between daemons: `ucx` (as UCX active
    /// messages on the data plane's endpoints; peer TLS must be off),
    /// `auto` (so with `transports = "sm"` and peer TLS off, else on the
    /// gRPC streams), `grpc` (always the streams).
    pub control: String,
    /// On tcp (`transfer` send), a getter posts the receive for a block
    /// with its locate or grant request and invites the home or holder to
    /// send the slot as soon as it grants it, instead of after the grant's
    /// answer and a send order (one round trip less per remote get;
    /// docs/DATAPLANE.md). With peers whose handshake takes it; the frame
    /// that carries the invitation (or answer) and its batch travels whole,
    /// as one UCX active message where batches do and the peer takes
    /// frames that way, else on the gRPC stream.
    pub push_with_grants: bool,
    /// Mutual TLS between daemons.
    pub tls: PeerTlsConfig,
}

/// `[peer.tls]`: mutual TLS on the peer service. A clustered daemon must
/// say which: `mode = "required"` (with `ca`, `cert`, `key`) or
/// `mode = "off"` (any process that reaches the peer port is trusted as a
/// daemon; logged as a warning at start).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct PeerTlsConfig {
    /// `required` or `off`; no default for a clustered daemon.
    pub mode: Option<String>,
    /// PEM file of the CA that signs every daemon's certificate.
    pub ca: Option<PathBuf>,
    /// PEM file of this daemon's certificate: its subject alternative
    /// names must include `node-<node.id>.kvmesh`.
    pub cert: Option<PathBuf>,
    /// PEM file of this daemon's private key.
    pub key: Option<PathBuf>,
}

impl PeerTlsConfig {
    /// Whether TLS is on (`mode = "required"`).
    pub fn required(&self) -> bool {
        self.mode.as_deref() == Some("required")
    }
}

impl Default for PeerConfig {
    fn default() -> Self {
        PeerConfig {
            listen: None,
            transports: "sm".into(),
            transfer: "auto".into(),
            pool_alloc: "auto".into(),
            transfer_timeout_ms: 2_000,
            grant_lease_ms: 5_000,
            inflight_requests_max: 4096,
            inflight_bytes_max: 1 << 30,
            poll_idle_us: crate::dataplane::POLL_IDLE_DEFAULT_US,
            staging_slots: 64,
            control: "auto".into(),
            push_with_grants: true,
            tls: PeerTlsConfig::default(),
        }
    }
}

/// `[coherence]`: the coherence protocol between clustered daemons and
/// the static membership that feeds it.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoherenceConfig {
    /// Node that runs the membership coordinator (grants membership
    /// leases, publishes views); default: the lowest node id of this node
    /// and its peers. Every daemon of a cluster must name the same one.
    pub coordinator: Option<u32>,
    /// This node's weight in placing keys' homes.
    pub capacity: u32,
    /// Most entries in one batch to a peer.
    pub batch_entries_max: usize,
    /// Most copies in one announce message after a membership change
    /// (more travel in several, each in a batch of its own).
    pub announce_entries_max: usize,
    /// Longest an entry waits for company before its batch leaves.
    pub flush_delay_us: u64,
    /// A remote get asks the key's home to register this daemon (pending)
    /// when it answers the locate, so the fetched copy is served as soon
    /// as it validates: one round trip less per remote get. Homes serve
    /// readers of both kinds; a peer from before this setting (its
    /// handshake says so) is sent plain locates, so a rolling upgrade
    /// needs no change here.
    pub register_at_locate: bool,
    /// Keep a lookup table (what this daemon, as home, would answer a
    /// lookup with) in memory peers on shared memory read in place, and
    /// answer lookups from peers' tables where this process maps them: a
    /// lookup then asks no home and wakes none (docs/COHERENCE.md,
    /// "Lookups read one-sided"). Its size follows the pools: 256 bytes per
    /// local slot (at least 512 KiB), 2 GiB at most; none on tcp (nothing
    /// would read it).
    pub lookup_tables: bool,
    /// Also send what a burst of input produced (received batches, the
    /// keys of one engine call) as soon as the input runs dry, instead of
    /// waiting out `flush_delay_us` (a timer of millisecond resolution).
    pub flush_when_idle: bool,
    /// Deadline of one protocol operation (get, publish, invalidation of
    /// one key).
    pub op_timeout_ms: u64,
    /// Interval of retransmissions.
    pub retransmit_ms: u64,
    /// Membership lease: a daemon serves nothing once this long passed
    /// since the send time of its last acknowledged keepalive.
    pub membership_lease_ms: u64,
    /// Interval of keepalives to the coordinator.
    pub keepalive_ms: u64,
    /// Bound on clock rate error between daemons, parts per million.
    pub drift_ppm: u64,
    /// Extra margin on every lease.
    pub drift_margin_ms: u64,
    /// Most protocol operations in flight on this daemon.
    pub ops_max: usize,
    /// Frames queued for one peer before new ones are dropped (the
    /// protocol retransmits what matters).
    pub peer_queue_frames: usize,
    /// Interval of pings on each peer stream; a stream silent for three
    /// intervals is reconnected.
    pub heartbeat_ms: u64,
    /// Deadline of an engine's `Invalidate` call.
    pub invalidate_timeout_ms: u64,
    /// Keys of one `Invalidate` call in flight at a time (pacing: a large
    /// invalidation does not queue every change behind all the others).
    pub invalidate_window: usize,
    /// Directory where the membership coordinator persists the epoch of
    /// every view it publishes (a restarted coordinator continues above
    /// it). Default: the directory of the engine socket.
    pub state_dir: Option<PathBuf>,
}

impl Default for CoherenceConfig {
    fn default() -> Self {
        CoherenceConfig {
            coordinator: None,
            capacity: 1,
            batch_entries_max: 512,
            announce_entries_max: 65_536,
            flush_delay_us: 200,
            register_at_locate: true,
            lookup_tables: true,
            flush_when_idle: true,
            op_timeout_ms: 2_000,
            retransmit_ms: 50,
            membership_lease_ms: 1_500,
            keepalive_ms: 100,
            drift_ppm: 200,
            drift_margin_ms: 20,
            ops_max: 200_000,
            peer_queue_frames: 4096,
            heartbeat_ms: 250,
            invalidate_timeout_ms: 15_000,
            invalidate_window: 512,
            state_dir: None,
        }
    }
}

/// `[[peers]]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PeerEntry {
    /// The peer's node id.
    pub id: u32,
    /// Its peer service address (`host:port`).
    pub addr: String,
}

/// `[server]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Path of the engine socket. Default: `$XDG_RUNTIME_DIR/kvmesh/kvmeshd.sock`,
    /// else `/tmp/kvmesh-<uid>/kvmeshd.sock`.
    pub socket: Option<PathBuf>,
    /// Threads of the async runtime (engine RPCs, timers). 0: one per core,
    /// at most 4.
    #[serde(default)]
    pub worker_threads: u32,
    /// Drain (SIGTERM, `kvmesh drain`): how long engines' pins and
    /// allocations may take to end before the daemon leaves anyway.
    #[serde(default = "default_drain_timeout_ms")]
    pub drain_timeout_ms: u64,
    /// Other uids whose engines may use this daemon (the daemon's own uid
    /// always may). Empty: the socket is mode 0600 and a client of another
    /// uid is refused. Non-empty: the socket is mode 0666 in a directory
    /// the operator makes reachable, and every connection's uid
    /// (SO_PEERCRED) is checked. Needs `socket` set.
    #[serde(default)]
    pub allow_uids: Vec<u32>,
    /// After answering a fast-path call at once (a local one), the
    /// connection's thread polls for the engine's next call this long
    /// before it sleeps in `read`: back-to-back calls then find it awake
    /// (no wake-up of a halted CPU). 0: never polls. At most 1,000 µs.
    #[serde(default = "default_fast_path_poll_us")]
    pub fast_path_poll_us: u64,
}

fn default_drain_timeout_ms() -> u64 {
    20_000
}

fn default_fast_path_poll_us() -> u64 {
    20
}

/// Longest `server.fast_path_poll_us`.
pub const FAST_PATH_POLL_US_MAX: u64 = 1_000;

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            socket: None,
            worker_threads: 0,
            drain_timeout_ms: default_drain_timeout_ms(),
            fast_path_poll_us: default_fast_path_poll_us(),
            allow_uids: Vec::new(),
        }
    }
}

/// Longest drain deadline accepted (config or `kvmesh drain`).
pub const DRAIN_TIMEOUT_MS_MAX: u64 = 600_000;

/// `[limits]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Most keys in one request.
    pub batch_keys_max: u32,
    /// Most concurrent engine connections.
    pub sessions_max: u32,
    /// Most pins one session holds at once (a block pinned twice counts twice).
    pub pins_per_session_max: u32,
    /// Most uncommitted allocations one session holds at once.
    pub allocations_per_session_max: u32,
    /// Most namespaces.
    pub namespaces_max: u32,
    /// Lease of a pin or allocation when the client asks for none.
    pub lease_ms_default: u64,
    /// Longest lease a client can get.
    pub lease_ms_max: u64,
    /// How often expired leases are reclaimed.
    pub reaper_interval_ms: u64,
    /// Longest an allocation's slots stay fenced after it ended without its
    /// writer saying it stopped writing (its lease passed while the engine
    /// was still connected, or its connection closed while the engine's
    /// process lives): the engine may still be writing them, so they are
    /// not reused until it commits or aborts them, or its process exits, or
    /// this much time passed (then they are reused anyway, counted as
    /// `fences_forced`). 0: no fence (freed at once, as before 2026-12-07).
    pub fence_ms_max: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            batch_keys_max: 4096,
            sessions_max: 512,
            pins_per_session_max: 1 << 20,
            allocations_per_session_max: 1 << 16,
            namespaces_max: 1024,
            lease_ms_default: 30_000,
            lease_ms_max: 600_000,
            reaper_interval_ms: 50,
            fence_ms_max: 600_000,
        }
    }
}

/// `[eviction]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvictionConfig {
    /// When the used fraction of a pool exceeds this, evict...
    pub high_watermark: f64,
    /// ...down to this fraction.
    pub low_watermark: f64,
}

impl Default for EvictionConfig {
    fn default() -> Self {
        EvictionConfig { high_watermark: 0.98, low_watermark: 0.95 }
    }
}

/// `[[pools]]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Name in stats and logs.
    pub name: String,
    /// `"host"`, or `"cuda:N"`: a GPU pool on device N (a CUDA driver and
    /// that device needed, checked at load; single-node daemons only for
    /// now — docs/GPU.md).
    #[serde(default = "default_device")]
    pub device: String,
    /// Size of the pool in bytes (integer, or a string such as `"256MiB"`).
    #[serde(deserialize_with = "de_bytes")]
    pub bytes: u64,
    /// Largest block one slot holds (integer or `"1MiB"`).
    #[serde(deserialize_with = "de_bytes")]
    pub slot_payload_bytes: u64,
    /// Lock the pool in RAM (`mlock`); failure is logged, not fatal.
    #[serde(default = "yes")]
    pub mlock: bool,
}

fn default_device() -> String {
    "host".into()
}

fn yes() -> bool {
    true
}

/// Parses `1048576`, `"1048576"`, `"1MiB"`, `"4 KiB"`, `"2GiB"`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size (expected e.g. 268435456 or \"256MiB\")"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        u => {
            return Err(format!("unknown size unit {u:?} in {s:?} (use B, KiB, MiB, GiB or TiB)"));
        }
    };
    n.checked_mul(mult).ok_or_else(|| format!("size {s:?} overflows 64 bits"))
}

fn de_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        N(u64),
        S(String),
    }
    match Raw::deserialize(d)? {
        Raw::N(n) => Ok(n),
        Raw::S(s) => parse_bytes(&s).map_err(serde::de::Error::custom),
    }
}

/// Most slots in one pool (slot indices are u32 on the wire; this keeps the
/// per-slot bookkeeping bounded too).
pub const POOL_SLOTS_MAX: u64 = 1 << 24;

/// Longest deadline of one operation (`*_timeout_ms` but the drain's): 10 minutes.
pub const TIMEOUT_MS_MAX: u64 = 600_000;

/// Largest `limits.batch_keys_max`; also the bound on a release (unpin,
/// abort, commit) whatever the limit now: those free what a session took
/// under the limit it was told when it connected, which a reload may
/// have lowered since.
pub const BATCH_KEYS_MAX_MAX: u32 = 65_536;

/// Longest engine socket path, in bytes: a Unix socket's path holds at
/// most 107, and the daemon binds it first at `<path>.bind.d/s` (9 more)
/// before it moves it into place.
pub const SOCKET_PATH_MAX: usize = 107 - ".bind.d/s".len();

/// Refuses an engine socket path too long to bind, naming the field.
pub fn check_socket_path(p: &std::path::Path) -> Result<(), String> {
    let n = p.as_os_str().len();
    if n > SOCKET_PATH_MAX {
        return Err(format!(
            "server.socket: {} is {n} bytes, at most {SOCKET_PATH_MAX} (a Unix socket path holds 107 bytes, and the \
             daemon binds it first at <path>.bind.d/s): choose a shorter path",
            p.display()
        ));
    }
    Ok(())
}

/// Longest `peer.poll_idle_us`: 100 ms (beyond it the thread would poll
/// through whole transfers, as it did before the bound).
pub const POLL_IDLE_US_MAX: u64 = 100_000;

/// Longest lease or interval a daemon adds to its clocks: one day.
pub const LEASE_MS_MAX: u64 = 86_400_000;

/// Most pins the engine sessions together may hold on one slot
/// (`limits.sessions_max` × `limits.pins_per_session_max`): 2^31, which
/// leaves the other 2^31 of a slot's 32-bit pin count to the internal
/// sessions (peers' grants, the daemon's fetches; each at most
/// `store::INTERNAL_PINS_MAX` = 2^21, so 1,024 of them at their limit).
pub const ENGINE_PINS_PER_SLOT_MAX: u64 = 1 << 31;

/// `section.name` above `max` is a one-line error naming the field.
fn check_max(section: &str, name: &str, v: u64, max: u64) -> Result<(), String> {
    if v > max {
        return Err(format!("{section}.{name}: {v} exceeds {max}"));
    }
    Ok(())
}

/// Each `(name, value, max)` of `section` must be in `1..=max`: the first
/// field at 0 is an error ("must be greater than 0"), then the first above
/// its bound ("exceeds"), each one line naming the field. One table per
/// section keeps a field's lower and upper bound side by side.
fn check_fields(section: &str, fields: &[(&str, u64, u64)]) -> Result<(), String> {
    if let Some((name, ..)) = fields.iter().find(|&&(_, v, _)| v == 0) {
        return Err(format!("{section}.{name}: must be greater than 0"));
    }
    for &(name, v, max) in fields {
        check_max(section, name, v, max)?;
    }
    Ok(())
}

/// The upper bound of a field whose limit is a cross-field rule of its own
/// (with its own message) further down.
const BOUNDED_BELOW: u64 = u64::MAX;

/// Most host memory the staging slots of GPU pools may take.
pub const STAGING_BYTES_MAX: u64 = 16 << 30;

impl Config {
    /// The configuration as TOML (every field, defaults filled in).
    pub fn to_toml(&self) -> Result<String, String> {
        toml::to_string(self).map_err(|e| e.to_string())
    }

    /// Parses and validates a configuration text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config, String> {
        let cfg: Config = toml::from_str(text).map_err(|e| format!("{origin}: {e}"))?;
        cfg.validate().map_err(|e| format!("{origin}: {e}"))?;
        Ok(cfg)
    }

    /// The embedded default configuration.
    pub fn default_config() -> Config {
        Config::parse(DEFAULT_CONFIG, "embedded default config").expect("embedded default config is valid")
    }

    fn validate(&self) -> Result<(), String> {
        self.metrics.addr()?;
        if self.log.format != "text" && self.log.format != "json" {
            return Err(format!("log.format: {:?} is neither \"text\" nor \"json\"", self.log.format));
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.filter) {
            return Err(format!("log.filter: {:?} is not a log filter ({e})", self.log.filter));
        }
        if self.pools.is_empty() {
            return Err("pools: at least one [[pools]] entry is required".into());
        }
        if self.pools.len() > kvmesh_common::handshake::POOLS_MAX {
            return Err(format!(
                "pools: {} pools configured, at most {} are supported",
                self.pools.len(),
                kvmesh_common::handshake::POOLS_MAX
            ));
        }
        for (i, p) in self.pools.iter().enumerate() {
            let f = |field: &str| format!("pools[{i}] ({}).{field}", p.name);
            if p.name.is_empty() || p.name.len() > 64 {
                return Err(format!("pools[{i}].name: must be 1 to 64 characters"));
            }
            if self.pools[..i].iter().any(|q| q.name == p.name) {
                return Err(format!("{}: duplicate pool name", f("name")));
            }
            // A namespace goes to the pool with the smallest slots that fit
            // on its device: of two pools alike, the second would hold
            // memory and never a block.
            if let Some(q) =
                self.pools[..i].iter().find(|q| q.device == p.device && q.slot_payload_bytes == p.slot_payload_bytes)
            {
                return Err(format!(
                    "{}: pool {} on {} has slots of {} bytes already; a second pool like it would never be used \
                     (give the first one both pools' bytes)",
                    f("slot_payload_bytes"),
                    q.name,
                    p.device,
                    p.slot_payload_bytes
                ));
            }
            if p.device != "host" {
                let Some(ordinal) = kvmesh_kernels::cuda::parse_device(&p.device) else {
                    return Err(format!("{}: {:?} is neither \"host\" nor \"cuda:N\"", f("device"), p.device));
                };
                // One line that says why it cannot be: no driver, or no
                // such device. (A clustered daemon moves GPU blocks through
                // host staging slots: `peer.staging_slots`.)
                let why = match kvmesh_kernels::cuda::device_count() {
                    Err(e) => Some(e.to_string()),
                    Ok(n) if ordinal >= n => Some(format!("no CUDA device {ordinal} (this machine has {n})")),
                    Ok(_) => None,
                };
                if let Some(why) = why {
                    return Err(format!("{} = {:?}: {why}", f("device"), p.device));
                }
            }
            if p.slot_payload_bytes < 64 || p.slot_payload_bytes > (1 << 30) {
                return Err(format!(
                    "{}: {} is out of range (64 B to 1 GiB)",
                    f("slot_payload_bytes"),
                    p.slot_payload_bytes
                ));
            }
            let stride = kvmesh_common::slot::slot_stride(p.slot_payload_bytes);
            let slots = p.bytes / stride;
            if slots == 0 {
                return Err(format!(
                    "{}: {} bytes cannot hold one slot of {} bytes (payload {} + header and trailer)",
                    f("bytes"),
                    p.bytes,
                    stride,
                    p.slot_payload_bytes
                ));
            }
            if slots > POOL_SLOTS_MAX {
                return Err(format!(
                    "{}: {} slots exceed the maximum of {} (use larger slots or a smaller pool)",
                    f("bytes"),
                    slots,
                    POOL_SLOTS_MAX
                ));
            }
        }
        match self.peer.transports.as_str() {
            "sm" | "tcp" | "all" => {}
            t => return Err(format!("peer.transports: {t:?} is not one of \"sm\", \"tcp\", \"all\"")),
        }
        match self.peer.pool_alloc.as_str() {
            "auto" | "memfd" | "ucx" => {}
            t => return Err(format!("peer.pool_alloc: {t:?} is not one of \"auto\", \"memfd\", \"ucx\"")),
        }
        match self.peer.transfer.as_str() {
            "auto" | "get" | "send" => {}
            t => return Err(format!("peer.transfer: {t:?} is not one of \"auto\", \"get\", \"send\"")),
        }
        match self.peer.control.as_str() {
            "auto" | "grpc" => {}
            "ucx" if self.peer.tls.required() => {
                return Err("peer.control: \"ucx\" sends coherence messages without authentication; \
                            not with peer.tls.mode = \"required\" (use \"auto\" or \"grpc\")"
                    .into());
            }
            "ucx" => {}
            t => return Err(format!("peer.control: {t:?} is not one of \"auto\", \"ucx\", \"grpc\"")),
        }
        if let Some(l) = &self.peer.listen
            && l.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(format!("peer.listen: {l:?} is not host:port (e.g. \"127.0.0.1:7300\")"));
        }
        // Upper bounds (TIGER_STYLE: a limit on everything): durations a
        // daemon adds to clocks (an absurd one wraps the core's µs
        // arithmetic or panics `Instant + Duration`) and counts it sizes
        // queues and maps by.
        check_fields(
            "peer",
            &[
                ("transfer_timeout_ms", self.peer.transfer_timeout_ms, TIMEOUT_MS_MAX),
                ("grant_lease_ms", self.peer.grant_lease_ms, LEASE_MS_MAX),
                ("inflight_requests_max", self.peer.inflight_requests_max as u64, 1 << 20),
                ("inflight_bytes_max", self.peer.inflight_bytes_max, 1 << 40),
                ("staging_slots", self.peer.staging_slots as u64, 1 << 16),
            ],
        )?;
        // (0 is a value here: never poll while waiting.)
        check_max("peer", "poll_idle_us", self.peer.poll_idle_us, POLL_IDLE_US_MAX)?;
        if self.peer.staging_slots < 2 {
            return Err("peer.staging_slots: at least 2 (half serve reads, half sends)".into());
        }
        // The staging memory of GPU pools (allocated only when a clustered
        // daemon has one): bounded.
        let gpu_stride = self
            .pools
            .iter()
            .filter(|p| p.device != "host")
            .map(|p| kvmesh_common::slot::slot_stride(p.slot_payload_bytes))
            .max();
        if let Some(stride) = gpu_stride
            && (self.peer.listen.is_some() || !self.peers.is_empty())
            && u64::from(self.peer.staging_slots).saturating_mul(stride) > STAGING_BYTES_MAX
        {
            return Err(format!(
                "peer.staging_slots: {} slots of the largest GPU slot ({stride} bytes) exceed {} GiB of host staging memory",
                self.peer.staging_slots,
                STAGING_BYTES_MAX >> 30
            ));
        }
        let c = &self.coherence;
        // What peers' decoders take (kvmesh_coherence::DECODE_ENTRIES_MAX,
        // ANNOUNCE_ENTRIES_MAX): a batch above it would be refused (40 bytes
        // an announced entry: a part stays far below the 64 MiB frame).
        const _: () = assert!(kvmesh_coherence::DECODE_ENTRIES_MAX == 65_536);
        const _: () = assert!(kvmesh_coherence::ANNOUNCE_ENTRIES_MAX == 262_144);
        check_fields(
            "coherence",
            &[
                ("capacity", c.capacity as u64, 1 << 20),
                ("batch_entries_max", c.batch_entries_max as u64, 65_536),
                ("announce_entries_max", c.announce_entries_max as u64, 262_144),
                ("flush_delay_us", c.flush_delay_us, 1_000_000),
                ("op_timeout_ms", c.op_timeout_ms, TIMEOUT_MS_MAX),
                ("retransmit_ms", c.retransmit_ms, 60_000),
                ("membership_lease_ms", c.membership_lease_ms, LEASE_MS_MAX),
                ("keepalive_ms", c.keepalive_ms, LEASE_MS_MAX),
                ("ops_max", c.ops_max as u64, BOUNDED_BELOW),
                ("peer_queue_frames", c.peer_queue_frames as u64, 1 << 20),
                ("heartbeat_ms", c.heartbeat_ms, 60_000),
                ("invalidate_timeout_ms", c.invalidate_timeout_ms, LEASE_MS_MAX),
                ("invalidate_window", c.invalidate_window as u64, 1 << 20),
            ],
        )?;
        // (0 is taken: no margin beyond the drift_ppm bound.)
        check_max("coherence", "drift_margin_ms", c.drift_margin_ms, LEASE_MS_MAX)?;
        if c.ops_max as u64 > kvmesh_coherence::GRANTS_PER_READER_MAX / 2 {
            return Err(format!(
                "coherence.ops_max: {} exceeds {} (a peer grants a reader at most twice that many reads)",
                c.ops_max,
                kvmesh_coherence::GRANTS_PER_READER_MAX / 2
            ));
        }
        if c.drift_ppm > 10_000 {
            return Err(format!("coherence.drift_ppm: {} exceeds 10000", c.drift_ppm));
        }
        let m = &self.membership;
        match m.kind.as_str() {
            "static" if m.tls.is_some() => {
                return Err("membership.tls: only for kind = \"etcd\" (static membership has no etcd)".into());
            }
            "static" => {}
            "etcd" => {
                if m.endpoints.is_empty() {
                    return Err("membership.endpoints: kind = \"etcd\" needs at least one endpoint".into());
                }
                if m.key_prefix.is_empty() || !m.key_prefix.starts_with('/') {
                    return Err(format!(
                        "membership.key_prefix: expected a path such as \"/kvmesh\", found {:?}",
                        m.key_prefix
                    ));
                }
                // (before the cross check below, which multiplies it)
                check_max("membership", "lease_ttl_s", m.lease_ttl_s, 3600)?;
                check_max("membership", "dial_timeout_ms", m.dial_timeout_ms, TIMEOUT_MS_MAX)?;
                if m.lease_ttl_s * 1000 <= c.membership_lease_ms + 2 * c.drift_margin_ms {
                    return Err(format!(
                        "membership.lease_ttl_s ({} s) must exceed coherence.membership_lease_ms ({} ms) plus twice \
                         coherence.drift_margin_ms ({} ms): a daemon must stop serving before etcd drops it",
                        m.lease_ttl_s, c.membership_lease_ms, c.drift_margin_ms
                    ));
                }
                if m.dial_timeout_ms == 0 {
                    return Err("membership.dial_timeout_ms: must be greater than 0".into());
                }
                if let Some(t) = &m.tls {
                    if let Some(e) = m.endpoints.iter().find(|e| e.starts_with("http://")) {
                        return Err(format!("membership.endpoints: {e:?} is plaintext but [membership.tls] is set"));
                    }
                    if t.ca.is_none() {
                        return Err("membership.tls.ca: needed to check etcd's certificate".into());
                    }
                    if t.cert.is_some() != t.key.is_some() {
                        return Err("membership.tls: cert and key go together (a client certificate)".into());
                    }
                }
            }
            other => {
                return Err(format!("membership.kind: expected \"static\" or \"etcd\", found {other:?}"));
            }
        }
        if c.keepalive_ms * 3 > c.membership_lease_ms {
            return Err(format!(
                "coherence.keepalive_ms ({}) must be at most a third of coherence.membership_lease_ms ({})",
                c.keepalive_ms, c.membership_lease_ms
            ));
        }
        if c.drift_margin_ms * 4 >= c.membership_lease_ms {
            return Err(format!(
                "coherence.drift_margin_ms ({}) must be under a quarter of coherence.membership_lease_ms ({})",
                c.drift_margin_ms, c.membership_lease_ms
            ));
        }
        let clustered = self.peer.listen.is_some() || !self.peers.is_empty();
        if clustered && self.peer.grant_lease_ms + 2 * c.drift_margin_ms >= self.limits.lease_ms_max {
            return Err(format!(
                "limits.lease_ms_max ({}) must exceed peer.grant_lease_ms ({}) plus twice coherence.drift_margin_ms \
                 ({}): a granted slot is held by a pin of that lease",
                self.limits.lease_ms_max, self.peer.grant_lease_ms, c.drift_margin_ms
            ));
        }
        if let Some(co) = c.coordinator
            && co != self.node.id
            && !self.peers.iter().any(|p| p.id == co)
        {
            return Err(format!("coherence.coordinator: node {co} is neither this node nor one of [[peers]]"));
        }
        if self.peer.grant_lease_ms <= self.peer.transfer_timeout_ms {
            return Err(format!(
                "peer.grant_lease_ms ({}) must exceed peer.transfer_timeout_ms ({}): a grant must outlive the read",
                self.peer.grant_lease_ms, self.peer.transfer_timeout_ms
            ));
        }
        for (i, p) in self.peers.iter().enumerate() {
            if p.id == self.node.id {
                return Err(format!("peers[{i}].id: {} is this node's own id (node.id)", p.id));
            }
            if self.peers[..i].iter().any(|q| q.id == p.id) {
                return Err(format!("peers[{i}].id: duplicate peer id {}", p.id));
            }
            if p.addr.parse::<std::net::SocketAddr>().is_err() {
                return Err(format!("peers[{i}].addr: {:?} is not host:port", p.addr));
            }
        }
        if self.peers.len() > 256 {
            return Err(format!("peers: {} peers configured, at most 256", self.peers.len()));
        }
        let t = &self.peer.tls;
        match t.mode.as_deref() {
            None if clustered => {
                return Err("peer.tls.mode: a clustered daemon must set it: \"required\" (with ca, cert and key: \
                            `kvmesh certs` makes them) or \"off\" (any process that reaches the peer port is \
                            trusted as a daemon)"
                    .into());
            }
            None | Some("off") => {}
            Some("required") => {
                for (name, v) in [("ca", &t.ca), ("cert", &t.cert), ("key", &t.key)] {
                    if v.is_none() {
                        return Err(format!("peer.tls.{name}: mode = \"required\" needs a PEM file path"));
                    }
                }
            }
            Some(other) => return Err(format!("peer.tls.mode: expected \"required\" or \"off\", found {other:?}")),
        }
        if self.server.fast_path_poll_us > FAST_PATH_POLL_US_MAX {
            return Err(format!(
                "server.fast_path_poll_us: {} exceeds {FAST_PATH_POLL_US_MAX}",
                self.server.fast_path_poll_us
            ));
        }
        if self.server.drain_timeout_ms > DRAIN_TIMEOUT_MS_MAX {
            return Err(format!(
                "server.drain_timeout_ms: {} exceeds {DRAIN_TIMEOUT_MS_MAX} (10 minutes)",
                self.server.drain_timeout_ms
            ));
        }
        if let Some(s) = &self.server.socket {
            check_socket_path(s)?;
        }
        if !self.server.allow_uids.is_empty() && self.server.socket.is_none() {
            return Err("server.allow_uids: needs server.socket, in a directory the allowed users can reach (the \
                        default directory is private to this uid)"
                .into());
        }
        if self.server.allow_uids.len() > 1024 {
            return Err(format!("server.allow_uids: {} uids, at most 1024", self.server.allow_uids.len()));
        }
        if self.server.worker_threads > 64 {
            return Err(format!("server.worker_threads: {} exceeds 64", self.server.worker_threads));
        }
        let l = &self.limits;
        check_fields(
            "limits",
            &[
                ("batch_keys_max", l.batch_keys_max as u64, BATCH_KEYS_MAX_MAX as u64),
                ("sessions_max", l.sessions_max as u64, 1 << 16),
                ("pins_per_session_max", l.pins_per_session_max as u64, BOUNDED_BELOW),
                ("allocations_per_session_max", l.allocations_per_session_max as u64, 1 << 24),
                ("namespaces_max", l.namespaces_max as u64, 1 << 16),
                ("lease_ms_default", l.lease_ms_default, BOUNDED_BELOW),
                ("lease_ms_max", l.lease_ms_max, LEASE_MS_MAX),
                ("reaper_interval_ms", l.reaper_interval_ms, 60_000),
            ],
        )?;
        // 0 is taken: no fences.
        check_max("limits", "fence_ms_max", l.fence_ms_max, LEASE_MS_MAX)?;
        // A slot counts its pins in 32 bits: every engine session pinning
        // one block as often as it may must leave room for the internal
        // sessions' pins, or the count wraps (release builds) and a pinned
        // slot looks free.
        let engine_pins = u64::from(l.sessions_max) * u64::from(l.pins_per_session_max);
        if engine_pins > ENGINE_PINS_PER_SLOT_MAX {
            return Err(format!(
                "limits.pins_per_session_max ({}) times limits.sessions_max ({}) is {engine_pins}: at most \
                 {ENGINE_PINS_PER_SLOT_MAX} (a slot counts its pins in 32 bits)",
                l.pins_per_session_max, l.sessions_max
            ));
        }
        if l.lease_ms_default > l.lease_ms_max {
            return Err(format!(
                "limits.lease_ms_default: {} exceeds limits.lease_ms_max ({})",
                l.lease_ms_default, l.lease_ms_max
            ));
        }
        let e = &self.eviction;
        if !(e.low_watermark > 0.0 && e.low_watermark <= e.high_watermark && e.high_watermark <= 1.0) {
            return Err(format!(
                "eviction: need 0 < low_watermark ({}) <= high_watermark ({}) <= 1",
                e.low_watermark, e.high_watermark
            ));
        }
        let ev = &self.events;
        if !(16..=1 << 22).contains(&ev.buffer_events) {
            return Err(format!("events.buffer_events: {} is out of range (16 to 4194304)", ev.buffer_events));
        }
        if !(100..=3_600_000).contains(&ev.stall_ms) {
            return Err(format!("events.stall_ms: {} is out of range (100 to 3600000)", ev.stall_ms));
        }
        if !(1..=4096).contains(&ev.watchers_max) {
            return Err(format!("events.watchers_max: {} is out of range (1 to 4096)", ev.watchers_max));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_parses() {
        let c = Config::default_config();
        assert_eq!(c.pools.len(), 1);
        assert_eq!(c.pools[0].device, "host");
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_bytes("4 KiB").unwrap(), 4096);
        assert_eq!(parse_bytes("123").unwrap(), 123);
        assert!(parse_bytes("12MB").unwrap_err().contains("unknown size unit"));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("99999999999TiB").unwrap_err().contains("overflows"));
    }

    /// Each bad config gives an error that names the field.
    #[test]
    fn errors_name_the_field() {
        let pool = "[[pools]]\nname = \"p\"\nbytes = \"1MiB\"\nslot_payload_bytes = 4096\n";
        let cases = [
            ("", "at least one [[pools]]"),
            ("[[pools]]\nname = \"p\"\nbytes = \"1MiB\"\n", "slot_payload_bytes"),
            ("[[pools]]\nname = \"p\"\nbytes = \"1XB\"\nslot_payload_bytes = 4096\n", "unknown size unit"),
            ("[[pools]]\nname = \"p\"\nbytes = 100\nslot_payload_bytes = 4096\n", "pools[0] (p).bytes"),
            (
                "[[pools]]\nname = \"p\"\ndevice = \"gpu0\"\nbytes = \"1MiB\"\nslot_payload_bytes = 4096\n",
                "pools[0] (p).device: \"gpu0\" is neither",
            ),
            ("[[pools]]\nname = \"p\"\nbytes = \"1MiB\"\nslot_payload_bytes = 4096\nbogus = 1\n", "bogus"),
            (&format!("{pool}{pool}"), "duplicate pool name"),
            (
                &format!("{pool}[[pools]]\nname = \"q\"\nbytes = \"2MiB\"\nslot_payload_bytes = 4096\n"),
                "pools[1] (q).slot_payload_bytes: pool p on host has slots of 4096 bytes already",
            ),
            (&format!("[limits]\nbatch_keys_max = 0\n{pool}"), "limits.batch_keys_max"),
            (&format!("[limits]\nlease_ms_default = 10\nlease_ms_max = 5\n{pool}"), "limits.lease_ms_default"),
            (&format!("[eviction]\nhigh_watermark = 0.5\nlow_watermark = 0.9\n{pool}"), "low_watermark"),
            (&format!("[events]\nbuffer_events = 8\n{pool}"), "events.buffer_events"),
            (&format!("[events]\nstall_ms = 5\n{pool}"), "events.stall_ms"),
            (&format!("[server]\nsockett = \"/x\"\n{pool}"), "sockett"),
            (&format!("[server]\nsocket = \"/{}\"\n{pool}", "s".repeat(98)), "server.socket: /sss"),
            (&format!("[peer]\ntransports = \"rdma\"\n{pool}"), "peer.transports"),
            (&format!("[peer]\ntransfer = \"push\"\n{pool}"), "peer.transfer"),
            (&format!("[peer]\npool_alloc = \"huge\"\n{pool}"), "peer.pool_alloc"),
            (&format!("[peer]\ncontrol = \"carrier-pigeon\"\n{pool}"), "peer.control"),
            (
                &format!(
                    "[peer]\ncontrol = \"ucx\"\ntls = {{ mode = \"required\", ca = \"/c\", cert = \"/c\", key = \"/k\" }}\n{pool}"
                ),
                "peer.control",
            ),
            (&format!("[peer]\nlisten = \"localhost\"\n{pool}"), "peer.listen"),
            (&format!("[peer]\ngrant_lease_ms = 100\ntransfer_timeout_ms = 200\n{pool}"), "peer.grant_lease_ms"),
            (&format!("[[peers]]\nid = 1\naddr = \"127.0.0.1:1\"\n{pool}"), "this node's own id"),
            (&format!("[[peers]]\nid = 2\naddr = \"nowhere\"\n{pool}"), "peers[0].addr"),
            (&format!("[peer]\nlisten = \"127.0.0.1:1\"\n{pool}"), "peer.tls.mode: a clustered daemon must set it"),
            (&format!("[peer.tls]\nmode = \"maybe\"\n{pool}"), "peer.tls.mode: expected"),
            (
                &format!(
                    "[membership]\nkind = \"etcd\"\nendpoints = [\"127.0.0.1:2379\"]\n[membership.tls]\n\
                     ca = \"/c\"\ncert = \"/d\"\n{pool}"
                ),
                "cert and key go together",
            ),
            (&format!("[peer.tls]\nmode = \"required\"\nca = \"/c\"\ncert = \"/d\"\n{pool}"), "peer.tls.key"),
            (
                &format!(
                    "[[peers]]\nid = 2\naddr = \"127.0.0.1:1\"\n[[peers]]\nid = 2\naddr = \"127.0.0.1:2\"\n{pool}"
                ),
                "duplicate peer id",
            ),
            (&format!("[coherence]\nbatch_entries_max = 0\n{pool}"), "coherence.batch_entries_max"),
            (&format!("[coherence]\nkeepalive_ms = 600\n{pool}"), "coherence.keepalive_ms"),
            (&format!("[coherence]\ndrift_margin_ms = 500\n{pool}"), "coherence.drift_margin_ms"),
            (&format!("[coherence]\ncoordinator = 9\n{pool}"), "coherence.coordinator"),
            (&format!("[coherence]\nflush_delay = 9\n{pool}"), "flush_delay"),
            (
                &format!(
                    "[limits]\nlease_ms_max = 5000\nlease_ms_default = 100\n[peer]\nlisten = \"127.0.0.1:1\"\n\
                     tls = {{ mode = \"off\" }}\n{pool}"
                ),
                "limits.lease_ms_max",
            ),
        ];
        for (text, want) in cases {
            let e = Config::parse(text, "test.toml").unwrap_err();
            assert!(e.contains(want), "config {text:?}: error {e:?} does not mention {want:?}");
            assert!(e.starts_with("test.toml: "), "{e}");
        }
        Config::parse(pool, "ok.toml").unwrap();
        // Pools of different slot sizes on one device are what several pools are for.
        Config::parse(
            &format!("{pool}[[pools]]\nname = \"q\"\nbytes = \"2MiB\"\nslot_payload_bytes = 65536\n"),
            "ok.toml",
        )
        .unwrap();
    }

    /// Every duration and count has an upper bound: an absurd value (up to
    /// u64::MAX, which used to be taken and wrapped clock arithmetic or
    /// slot pin counts later) is one line naming the field; the bound itself
    /// is taken.
    #[test]
    fn absurd_durations_and_counts_are_refused_naming_the_field() {
        let pool = "[[pools]]\nname = \"p\"\nbytes = \"1MiB\"\nslot_payload_bytes = 4096\n";
        // (section, field, largest value taken); the clustered sections get
        // a peer listener so their cross-field checks apply too.
        let cases: &[(&str, &str, u64)] = &[
            // (the grant must outlive it: see `companion` below)
            ("peer", "transfer_timeout_ms", TIMEOUT_MS_MAX),
            ("peer", "inflight_requests_max", 1 << 20),
            ("peer", "inflight_bytes_max", 1 << 40),
            ("peer", "poll_idle_us", POLL_IDLE_US_MAX),
            ("peer", "staging_slots", 1 << 16),
            ("server", "fast_path_poll_us", FAST_PATH_POLL_US_MAX),
            ("coherence", "capacity", 1 << 20),
            ("coherence", "flush_delay_us", 1_000_000),
            ("coherence", "op_timeout_ms", TIMEOUT_MS_MAX),
            ("coherence", "retransmit_ms", 60_000),
            ("coherence", "peer_queue_frames", 1 << 20),
            ("coherence", "heartbeat_ms", 60_000),
            ("coherence", "invalidate_timeout_ms", LEASE_MS_MAX),
            ("coherence", "invalidate_window", 1 << 20),
            ("limits", "sessions_max", 1 << 16),
            ("limits", "allocations_per_session_max", 1 << 24),
            ("limits", "namespaces_max", 1 << 16),
            ("limits", "reaper_interval_ms", 60_000),
            ("membership", "dial_timeout_ms", TIMEOUT_MS_MAX),
            // (refused before its cross check multiplies it by 1000)
            ("membership", "lease_ttl_s", 3600),
        ];
        let peer = |extra: &str| format!("[peer]\nlisten = \"127.0.0.1:1\"\ntls = {{ mode = \"off\" }}\n{extra}");
        // What a field's cross-field rules need beside it at its bound.
        let companion = |field: &str| match field {
            "transfer_timeout_ms" => "grant_lease_ms = 700000\n[limits]\nlease_ms_max = 800000\n",
            // (2^16 sessions of the default 2^20 pins would wrap a slot's
            // pin count: refused by its own rule, tested below)
            "sessions_max" => "pins_per_session_max = 1\n",
            "dial_timeout_ms" | "lease_ttl_s" => "kind = \"etcd\"\nendpoints = [\"127.0.0.1:1\"]\n",
            _ => "",
        };
        let config = |section: &str, field: &str, v: u64| {
            let line = format!("{field} = {v}\n{}", companion(field));
            if section == "peer" {
                format!("{}{pool}", peer(&line))
            } else {
                format!("{}[{section}]\n{line}{pool}", peer(""))
            }
        };
        for &(section, field, max) in cases {
            for bad in [max + 1, u64::MAX >> 1, u64::MAX] {
                let text = config(section, field, bad);
                // A value that does not fit a u32 field is refused by the
                // parser, whose message quotes the line (the field's name).
                let e = Config::parse(&text, "t.toml").unwrap_err();
                assert!(e.contains(field), "{section}.{field} = {bad}: error {e:?} does not name the field");
            }
            Config::parse(&config(section, field, max), "t.toml")
                .unwrap_or_else(|e| panic!("{section}.{field} = {max} (its bound) refused: {e}"));
        }
        // A bound whose 0 means something: never poll while waiting.
        let c = Config::parse(&config("peer", "poll_idle_us", 0), "t.toml").expect("peer.poll_idle_us = 0 is taken");
        assert_eq!(c.peer.poll_idle_us, 0);
        let c =
            Config::parse(&config("limits", "fence_ms_max", 0), "t.toml").expect("limits.fence_ms_max = 0 is taken");
        assert_eq!(c.limits.fence_ms_max, 0);
        // Leases and intervals: the bound is a day; their cross-field rules
        // (a grant outlives a read, keepalives a third of the lease) must
        // not overflow on the way to refusing.
        for (section, field) in [
            ("peer", "grant_lease_ms"),
            ("coherence", "membership_lease_ms"),
            ("coherence", "keepalive_ms"),
            ("coherence", "drift_margin_ms"),
            ("limits", "lease_ms_max"),
            ("limits", "fence_ms_max"),
        ] {
            for bad in [LEASE_MS_MAX + 1, u64::MAX] {
                let e = Config::parse(&config(section, field, bad), "t.toml").unwrap_err();
                assert!(e.contains(&format!("{section}.{field}")), "{section}.{field} = {bad}: {e:?}");
            }
        }
    }

    /// Engine sessions together may not be allowed pins enough to wrap a
    /// slot's 32-bit pin count (release builds wrap silently: a pinned
    /// slot would look free and be evicted under its reader).
    #[test]
    fn session_pin_limits_cannot_wrap_a_slot_pin_count() {
        let pool = "[[pools]]\nname = \"p\"\nbytes = \"1MiB\"\nslot_payload_bytes = 4096\n";
        let limits = |sessions: u64, pins: u64| {
            format!("[limits]\nsessions_max = {sessions}\npins_per_session_max = {pins}\n{pool}")
        };
        // 4,096 sessions of 2^20 pins each: 2^32, which a u32 count wraps to 0.
        let e = Config::parse(&limits(4096, 1 << 20), "t.toml").unwrap_err();
        assert!(e.contains("limits.pins_per_session_max") && e.contains("32 bits"), "{e}");
        let e = Config::parse(&limits(1, u64::from(u32::MAX)), "t.toml").unwrap_err();
        assert!(e.contains("limits.pins_per_session_max"), "{e}");
        Config::parse(&limits(2048, 1 << 20), "t.toml").unwrap();
        Config::parse(&limits(1, 1 << 31), "t.toml").unwrap();
    }

    /// A GPU pool on a machine without a CUDA driver is one line naming the
    /// field and saying there is no driver (CI and this machine have none;
    /// with a driver the line says what else is missing).
    #[test]
    fn gpu_pool_without_a_driver_is_one_line_naming_the_field() {
        let text = "[[pools]]\nname = \"g\"\ndevice = \"cuda:0\"\nbytes = \"1MiB\"\nslot_payload_bytes = 4096\n";
        if kvmesh_kernels::cuda::driver().is_err() {
            let e = Config::parse(text, "gpu.toml").unwrap_err();
            assert!(!e.contains('\n'), "{e}");
            assert!(e.starts_with("gpu.toml: pools[0] (g).device = \"cuda:0\": no CUDA driver on this machine"), "{e}");
        } else {
            eprintln!("a CUDA driver is present: {:?}", Config::parse(text, "gpu.toml").map(|_| ()));
        }
        // A device that no machine has (or no driver): refused either way.
        let e = Config::parse(&text.replace("cuda:0", "cuda:999"), "gpu.toml").unwrap_err();
        assert!(e.starts_with("gpu.toml: pools[0] (g).device = \"cuda:999\": "), "{e}");
        // Clustered with a GPU pool: staged through host slots, bounded.
        let clustered = format!("[peer]\nlisten = \"127.0.0.1:1\"\ntls = {{ mode = \"off\" }}\n{text}");
        let big = clustered.replace("4096", "1073741824").replace("1MiB", "2GiB");
        let e = Config::parse(&big, "gpu.toml").unwrap_err();
        if kvmesh_kernels::cuda::driver().is_err() {
            assert!(e.contains("pools[0] (g).device = \"cuda:0\": no CUDA driver"), "{e}");
        } else {
            assert!(e.contains("peer.staging_slots: 64 slots of the largest GPU slot"), "{e}");
            assert!(Config::parse(&clustered, "gpu.toml").is_ok());
        }
    }
}
