//! Fuzz targets: every parser and state machine that takes untrusted input,
//! as plain functions of bytes. `fuzz/` (cargo-fuzz, nightly) runs them
//! under libFuzzer with coverage; `tests/smoke.rs` replays the committed
//! corpora and a bounded, seeded set of mutations of them on stable, in the
//! test suite. Each target panics only on a bug: a crash, or a broken
//! invariant it checks.
//!
//! | target | input | checks |
//! |---|---|---|
//! | `batch_decode` | a peer's coherence batch | no panic; what decodes re-encodes to the same bytes |
//! | `core_batches` | a script: honest puts/gets/ticks and a hostile member's batches | no panic; honest nodes' `check_incremental`; S1 among honest copies of keys with an honest home |
//! | `peer_messages` | peer gRPC messages (handshake, frame, send order), and a peer's lookup table as this process reads it | no panic; a handshake answer `check_pools` accepts has only in-range pools, a table description `check_table` accepts is whole aligned words within the bound; a table of any words reads without panic, and an entry it yields names at most `TABLE_SOURCES_MAX` sources |
//! | `engine_messages` | a script of engine API requests on one session | no panic; the store's invariants after every call |
//! | `config` | a config file | no panic; what parses validates again after a round trip through TOML |
//! | `trace` | a request trace | no panic; accepted requests obey the trace rules |

#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};

use kvmesh_coherence::{
    Action, Batch, BlockKey, Config as CoreConfig, Event, Member, Msg, Node, NodeId, SlotImage, SlotMeta, SlotRef,
    TransferError, View,
};
use prost::Message;

#[allow(dead_code, unreachable_pub, missing_docs)]
#[path = "../../../bench/src/replay/trace.rs"]
mod trace_file;

/// A fuzz target: bytes in, a panic only on a bug.
pub type Target = fn(&[u8]);

/// The targets by name (what `fuzz/libfuzzer/fuzz_targets/*.rs` and the
/// smoke test run).
pub const TARGETS: [(&str, Target); 6] = [
    ("batch_decode", batch_decode),
    ("core_batches", core_batches),
    ("peer_messages", peer_messages),
    ("engine_messages", engine_messages),
    ("config", config),
    ("trace", trace),
];

/// A peer's coherence batch.
pub fn batch_decode(data: &[u8]) {
    if let Ok(b) = Batch::decode(data) {
        let again = b.encode();
        assert_eq!(again, data, "a decoded batch re-encodes to other bytes");
    }
}

/// Reads a script from fuzz bytes.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
}

const HOSTILE: NodeId = 2;

struct World {
    nodes: Vec<Node>,
    now: u64,
    wire: VecDeque<(NodeId, NodeId, Batch)>,
    reads: Vec<(NodeId, u64, NodeId, SlotRef)>,
    mem: HashMap<(NodeId, SlotRef), SlotMeta>,
    next_slot: u32,
}

impl World {
    fn drive(&mut self, n: NodeId, ev: Event) {
        let acts = self.nodes[n as usize].handle(self.now, ev);
        for a in acts {
            match a {
                Action::Send { to, batch } if to != HOSTILE => self.wire.push_back((n, to, batch)),
                Action::Send { .. }
                | Action::ClientDone { .. }
                | Action::LookupDone { .. }
                | Action::KeepAlive { .. } => {}
                Action::StartRead { op, from, remote, .. } => self.reads.push((n, op, from, remote)),
                Action::CommitSlot { slot, meta } => {
                    self.mem.insert((n, slot), meta);
                }
                Action::FreeSlot { slot } => {
                    self.mem.remove(&(n, slot));
                }
            }
        }
    }

    fn slot(&mut self) -> SlotRef {
        self.next_slot = self.next_slot.wrapping_add(1) & 0x00ff_ffff;
        SlotRef { slot: self.next_slot, generation: 1 }
    }

    /// S1 among the honest nodes, for keys whose home is honest (a hostile
    /// home can tell two writers anything).
    fn check(&self) {
        for n in &self.nodes {
            if let Err(e) = n.check_incremental() {
                panic!("node {}: {e}", n.id());
            }
        }
        let view = self.nodes[0].view();
        for (k, v, _) in self.nodes[0].copies() {
            if view.home_of(&k) == Some(HOSTILE) || !self.nodes[0].serving() || !self.nodes[1].serving() {
                continue;
            }
            if let Some((v1, _)) = self.nodes[1].copy_of(&k) {
                assert_eq!(v, v1, "S1: {k:?} valid at two versions on honest nodes");
            }
        }
    }
}

/// Two honest nodes and a hostile member (node 2) whose batches are the
/// fuzz input's: interleaved client calls, deliveries, reads and ticks.
pub fn core_batches(data: &[u8]) {
    run_core(data);
}

fn run_core(data: &[u8]) -> World {
    let mut s = Script(data);
    let cfg = CoreConfig::default();
    let view = View { epoch: 1, members: (0..3).map(|id| Member { id, incarnation: 1, capacity: 1 }).collect() };
    let mut w = World {
        nodes: (0..2).map(|i| Node::new(i, 1, cfg.clone())).collect(),
        now: 1_000,
        wire: VecDeque::new(),
        reads: Vec::new(),
        mem: HashMap::new(),
        next_slot: 0,
    };
    for i in 0..2 {
        w.drive(i, Event::View(view.clone()));
        w.drive(i, Event::Tick);
        // Leases granted (as the coordinator would).
        let now = w.now;
        w.drive(i, Event::KeepAliveAck { sent_at: now });
        // The hostile member announces (nothing), as every member must
        // before homes are ready.
        let hello = Batch {
            epoch: 1,
            incarnation: 1,
            msgs: vec![Msg::Announce { round: 1, part: 0, parts: 1, entries: vec![] }],
        };
        w.drive(i, Event::Receive { from: HOSTILE, batch: hello });
    }
    // The honest members' announces and acks.
    for _ in 0..8 {
        w.now += 1_000;
        w.drive(0, Event::Tick);
        w.drive(1, Event::Tick);
        while let Some((from, to, batch)) = w.wire.pop_front() {
            w.drive(to, Event::Receive { from, batch });
        }
    }
    assert!(w.nodes.iter().all(|n| n.directory_ready()), "honest homes ready before the script");
    let mut op = 0u64;
    let mut steps = 0;
    while let Some(b) = s.byte() {
        steps += 1;
        if steps > 2_000 {
            break;
        }
        let node = (b >> 4) as NodeId & 1;
        let key = |x: u8| BlockKey { ns: 1, key: u128::from(x % 16) };
        match b % 8 {
            0 => {
                op += 1;
                let (k, slot) = (key(s.byte().unwrap_or(0)), w.slot());
                w.drive(node, Event::ClientPut { op, key: k, slot, checksum: u64::from(b) });
            }
            1 => {
                op += 1;
                w.drive(node, Event::ClientGet { op, key: key(s.byte().unwrap_or(0)) });
            }
            2 => {
                op += 1;
                w.drive(node, Event::ClientInvalidate { op, key: key(s.byte().unwrap_or(0)) });
            }
            3 => {
                // Deliver some honest traffic.
                for _ in 0..=(s.byte().unwrap_or(0) % 8) {
                    let Some((from, to, batch)) = w.wire.pop_front() else { break };
                    w.drive(to, Event::Receive { from, batch });
                }
            }
            4 => {
                // A hostile batch: its own bytes, usually stamped with the
                // current epoch and incarnation so it is not simply dropped.
                let flags = s.byte().unwrap_or(0);
                let len = usize::from(s.byte().unwrap_or(0)) * 4;
                let raw = s.bytes(len);
                if let Ok(mut batch) = Batch::decode(raw) {
                    if flags & 1 == 0 {
                        batch.epoch = w.nodes[node as usize].view().epoch;
                        batch.incarnation = 1;
                    }
                    w.drive(node, Event::Receive { from: HOSTILE, batch });
                }
            }
            5 => {
                // Finish pending reads: honest holders' true slots; a
                // hostile holder's are whatever the input says.
                for (reader, op, holder, remote) in std::mem::take(&mut w.reads) {
                    let dest = w.slot();
                    let meta = if holder == HOSTILE {
                        let m = s.bytes(8);
                        let x = m.iter().fold(0u64, |a, &b| a << 8 | u64::from(b));
                        Some(SlotMeta {
                            key: BlockKey { ns: 1, key: u128::from(x as u8 % 16) },
                            version: x >> 8,
                            generation: remote.generation,
                            checksum: x & 0xff,
                        })
                    } else {
                        w.mem.get(&(holder, remote)).copied()
                    };
                    let result = match meta {
                        Some(m) => {
                            w.mem.insert((reader, dest), m);
                            Ok(SlotImage { header: m, trailer: m, payload_checksum: m.checksum })
                        }
                        None => Err(TransferError::PeerGone),
                    };
                    w.drive(reader, Event::TransferDone { op, dest: Some(dest), result });
                }
            }
            6 => {
                w.now += u64::from(s.byte().unwrap_or(0)) * 500;
                w.drive(0, Event::Tick);
                w.drive(1, Event::Tick);
                // Keep honest leases alive (the coordinator is honest).
                let now = w.now;
                w.drive(node, Event::KeepAliveAck { sent_at: now });
            }
            _ => {
                let k = key(s.byte().unwrap_or(0));
                if let Some((_, slot)) = w.nodes[node as usize].copy_of(&k) {
                    w.drive(node, Event::Unpin { slot });
                    w.drive(node, Event::Evict { key: k, slot: None });
                }
            }
        }
        w.check();
    }
    w
}

/// Peer gRPC messages as they arrive from the network.
pub fn peer_messages(data: &[u8]) {
    use kvmesh_proto::peer::v1 as pb;
    let Some((&kind, body)) = data.split_first() else { return };
    match kind % 5 {
        0 => {
            let _ = pb::HandshakeRequest::decode(body);
        }
        1 => {
            if let Ok(r) = pb::HandshakeResponse::decode(body)
                && kvmeshd::peers::check_pools(&r).is_ok()
            {
                // What the data plane relies on: whole slots, payload inside
                // a slot, an address range that does not wrap, distinct pools.
                let mut seen = std::collections::HashSet::new();
                for p in &r.pools {
                    assert!(p.bytes.checked_rem(p.slot_stride_bytes) == Some(0), "partial slot accepted");
                    assert!(p.slot_payload_bytes <= p.slot_stride_bytes && seen.insert(p.index));
                    assert!(p.base_address.checked_add(p.bytes).is_some());
                }
                if let Some(t) = &r.lookup_table
                    && kvmeshd::peers::check_table(t).is_ok()
                {
                    assert!(t.bytes.is_multiple_of(8) && t.bytes <= kvmeshd::peers::PEER_TABLE_BYTES_MAX);
                    assert!(t.base_address.is_multiple_of(8) && t.base_address.checked_add(t.bytes).is_some());
                }
            }
        }
        4 => {
            // A hostile peer's lookup table: whatever its words say.
            let words: Vec<std::sync::atomic::AtomicU64> = body
                .chunks(8)
                .map(|c| {
                    let mut w = [0u8; 8];
                    w[..c.len()].copy_from_slice(c);
                    std::sync::atomic::AtomicU64::new(u64::from_le_bytes(w))
                })
                .collect();
            if let Some(r) = kvmesh_common::table::TableReader::new(&words) {
                let _ = r.header();
                for i in 0..8u64 {
                    let w = |j: usize| words.get(j).map_or(0, |w| w.load(std::sync::atomic::Ordering::Relaxed));
                    for (ns, key) in [(w(10), u128::from(w(11))), (i, u128::from(i) << 64 | 7)] {
                        if let kvmesh_common::table::Probe::Found(v) = r.get(ns, key)
                            && let Some(e) = kvmesh_coherence::TableEntry::from_words(v)
                        {
                            assert!(usize::from(e.len) <= kvmesh_coherence::TABLE_SOURCES_MAX);
                        }
                    }
                }
            }
        }
        2 => {
            if let Ok(pb::Frame { body: Some(pb::frame::Body::Batch(b)), .. }) = pb::Frame::decode(body) {
                batch_decode(&b);
            }
        }
        _ => {
            let _ = pb::SendRequest::decode(body);
        }
    }
}

/// A script of engine API calls on one session of a real store: each is a
/// method byte, a length byte and that many bytes of the request message
/// (protobuf).
pub fn engine_messages(data: &[u8]) {
    run_engine(data);
}

fn run_engine(data: &[u8]) -> kvmeshd::store::StoreStats {
    use kvmesh_proto::engine::v1 as pb;
    use kvmesh_proto::engine::v1::engine_server::Engine;
    use std::sync::Arc;
    use tonic::Request;
    let cfg = kvmeshd::Config::parse(
        "[[pools]]\nname = \"p\"\nbytes = \"256KiB\"\nslot_payload_bytes = 4096\n[limits]\nbatch_keys_max = 64\n",
        "fuzz",
    )
    .expect("fuzz config");
    let store = Arc::new(parking_lot::Mutex::new(kvmeshd::store::Store::new(cfg).expect("store")));
    let (drain, _drain_rx) = tokio::sync::watch::channel(None);
    let svc = kvmeshd::service::EngineService::new(Arc::clone(&store), None, None, drain, "fuzz".into());
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let mut s = Script(data);
    let mut calls = 0;
    while let (Some(m), Some(len)) = (s.byte(), s.byte()) {
        calls += 1;
        if calls > 64 {
            break;
        }
        let body = s.bytes(usize::from(len)).to_vec();
        fn req<T>(t: T) -> Request<T> {
            let mut r = Request::new(t);
            r.extensions_mut().insert(kvmeshd::service::ConnInfo { session: 1, hold: None });
            r
        }
        macro_rules! call {
            ($method:ident, $ty:ty) => {
                if let Ok(msg) = <$ty>::decode(&body[..]) {
                    let _ = rt.block_on(svc.$method(req(msg)));
                }
            };
        }
        match m % 14 {
            0 => call!(hello, pb::HelloRequest),
            1 => call!(register_namespace, pb::RegisterNamespaceRequest),
            2 => call!(get_namespace, pb::GetNamespaceRequest),
            3 => call!(lookup, pb::LookupRequest),
            4 => call!(pin, pb::PinRequest),
            5 => call!(unpin, pb::UnpinRequest),
            6 => call!(allocate, pb::AllocateRequest),
            7 => call!(commit, pb::CommitRequest),
            8 => call!(abort, pb::AbortRequest),
            9 => call!(remove, pb::RemoveRequest),
            10 => call!(invalidate, pb::InvalidateRequest),
            11 => call!(list_namespaces, pb::ListNamespacesRequest),
            12 => call!(list_keys, pb::ListKeysRequest),
            _ => call!(stats, pb::StatsRequest),
        }
        if let Err(e) = store.lock().check_invariants() {
            panic!("store invariant after call {calls}: {e}");
        }
    }
    let stats = store.lock().stats();
    // The session ends: everything it held is released.
    store.lock().release_session(1);
    if let Err(e) = store.lock().check_invariants() {
        panic!("store invariant after the session ended: {e}");
    }
    stats
}

/// A config file.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(c) = kvmeshd::Config::parse(text, "fuzz.toml") {
        let again = toml::to_string(&c).expect("a parsed config serializes");
        if let Err(e) = kvmeshd::Config::parse(&again, "fuzz-again.toml") {
            panic!("a valid config no longer parses after a round trip: {e}\n{again}");
        }
    }
}

/// A request trace.
pub fn trace(data: &[u8]) {
    let Some((&bt, body)) = data.split_first() else { return };
    let block_tokens = u64::from(bt % 64);
    if let Ok(t) = trace_file::read_from(body, "fuzz", block_tokens, bt & 0x80 != 0) {
        let mut last = 0;
        for r in &t.requests {
            assert!(r.timestamp >= last, "timestamps go back");
            last = r.timestamp;
            assert_eq!(r.hash_ids.len() as u64, r.input_length.div_ceil(block_tokens));
        }
    }
}

/// Seed inputs of target `name`: valid inputs of each kind, from which
/// fuzzing starts (the committed corpora grew from them).
pub fn seeds(name: &str) -> Vec<Vec<u8>> {
    use kvmesh_proto::engine::v1 as epb;
    use kvmesh_proto::peer::v1 as pb;
    let k = |x: u128| BlockKey { ns: 1, key: x };
    let meta = SlotMeta { key: k(3), version: (1 << 32) | 2, generation: 5, checksum: 77 };
    let slot = SlotRef { slot: 9, generation: 5 };
    let msgs = vec![
        Msg::PublishReq { op: 1, key: k(1), checksum: 2, copy: 3 },
        Msg::Invalidate { key: k(2), version: (1 << 32) | 1, change: 4 },
        Msg::InvalidateAck { key: k(2), version: (1 << 32) | 1, change: 4 },
        Msg::LocateReq { op: 5, key: k(3), copy: 0 },
        Msg::LocateReq { op: 5, key: k(3), copy: 9 },
        Msg::LocateResp {
            op: 5,
            key: k(3),
            result: kvmesh_coherence::LocateResult::Found { version: meta.version, holder: 2 },
            reg: Some(kvmesh_coherence::Registration { key: k(3), version: meta.version, copy: 9 }),
        },
        Msg::GrantReq { op: 5, key: k(3), version: meta.version },
        Msg::GrantResp {
            op: 5,
            result: kvmesh_coherence::GrantResult::Granted { slot, meta, lease_us: 50_000, grant: 8 },
            reg: None,
        },
        Msg::GrantResp {
            op: 5,
            result: kvmesh_coherence::GrantResult::Granted { slot, meta, lease_us: 50_000, grant: 8 },
            reg: Some(kvmesh_coherence::Registration { key: k(3), version: meta.version, copy: 9 }),
        },
        Msg::GrantRelease { slot, grant: 8 },
        Msg::AddHolderReq { op: 5, key: k(3), version: meta.version, copy: 6 },
        Msg::RemoveHolder { key: k(3), version: meta.version, copy: 6 },
        Msg::Announce { round: 1, part: 0, parts: 1, entries: vec![(k(4), 7, 1)] },
        Msg::AnnounceAck,
    ];
    let batches: Vec<Vec<u8>> = msgs
        .iter()
        .map(|m| Batch { epoch: 1, incarnation: 1, msgs: vec![m.clone()] }.encode())
        .chain([Batch { epoch: 1, incarnation: 1, msgs: msgs.clone() }.encode()])
        .collect();
    let framed = |tag: u8, body: Vec<u8>| [vec![tag], body].concat();
    match name {
        "batch_decode" => batches,
        "core_batches" => {
            // Puts, deliveries, a get and reads; then the same with hostile
            // batches of each kind in between.
            // (b % 8: 0 put, 1 get, 2 invalidate, 3 deliver, 5 reads, 6
            // tick; bit 4 picks the node.)
            let settle = [3, 7, 3, 7, 6, 10, 3, 7, 5, 3, 7, 3, 7, 6, 10, 3, 7];
            let honest = [
                &[0x00, 1, 0x10, 2, 0x00, 3][..],
                &settle,
                &[0x11, 1, 0x01, 2],
                &settle,
                &settle,
                &[0x10, 1],
                &settle,
                &[0x02, 3],
                &settle,
                &[0x01, 1, 0x11, 3],
                &settle,
            ]
            .concat();
            let mut out = vec![honest.clone()];
            for b in &batches {
                let mut v = honest.clone();
                let len = b.len().div_ceil(4);
                v.extend([4, 0, len as u8]);
                v.extend(b);
                v.resize(v.len() + len * 4 - b.len(), 0);
                v.extend([3, 7, 5, 6, 10]);
                out.push(v);
            }
            out
        }
        "peer_messages" => vec![
            framed(0, pb::HandshakeRequest { node_id: 2, incarnation: 9, worker_address: vec![1; 40] }.encode_to_vec()),
            framed(
                1,
                pb::HandshakeResponse {
                    node_id: 1,
                    incarnation: 3,
                    worker_address: vec![1; 40],
                    pools: vec![pb::PoolDesc {
                        index: 0,
                        base_address: 1 << 40,
                        bytes: 1 << 20,
                        slot_stride_bytes: 4096 + 128,
                        slot_payload_bytes: 4096,
                        rkey: vec![2; 30],
                        staged: false,
                    }],
                    transports: "sm".into(),
                    accepts_control: true,
                    takes_locate_registration: true,
                    lookup_table: Some(pb::TableDesc { base_address: 1 << 41, bytes: 1 << 19, rkey: vec![3; 30] }),
                    takes_push_invites: true,
                    takes_control_frames: true,
                }
                .encode_to_vec(),
            ),
            framed(
                2,
                pb::Frame {
                    body: Some(pb::frame::Body::Batch(batches[0].clone())),
                    push_invites: vec![pb::PushInvite { op: 1, tag: 7, len: 4224 }],
                    push_answers: vec![pb::PushAnswer { op: 2, pushed: true }],
                }
                .encode_to_vec(),
            ),
            framed(
                3,
                pb::SendRequest {
                    node_id: 2,
                    incarnation: 1,
                    holder_incarnation: 2,
                    items: vec![pb::SendItem { pool: 0, slot: 1, generation: 1, tag: 7 }],
                }
                .encode_to_vec(),
            ),
            framed(4, {
                // A lookup table as an honest home writes it.
                let words: Vec<std::sync::atomic::AtomicU64> =
                    (0..kvmesh_common::table::table_words(2)).map(|_| std::sync::atomic::AtomicU64::new(0)).collect();
                let mut w = kvmesh_common::table::TableWriter::new(words).expect("two groups");
                w.set_header(kvmesh_common::table::Header { node: 1, incarnation: 3, epoch: 2, ready: true });
                for k in 0..12u64 {
                    let e = kvmesh_coherence::TableEntry {
                        version: 2 << 32 | k,
                        home_copy: k % 2 == 0,
                        sources: [2, 3, 0],
                        len: 2,
                    };
                    w.set(k, u128::from(k) << 64 | 7, e.to_words());
                }
                w.words().iter().flat_map(|x| x.load(std::sync::atomic::Ordering::Relaxed).to_le_bytes()).collect()
            }),
        ],
        "engine_messages" => {
            let key = |lo| epb::Key { hi: 0, lo };
            let call = |m: u8, body: Vec<u8>| [vec![m, body.len() as u8], body].concat();
            let slot0 = epb::SlotRef { pool: 0, slot: 0, generation: 1 };
            vec![
                [
                    call(0, epb::HelloRequest {}.encode_to_vec()),
                    call(
                        1,
                        epb::RegisterNamespaceRequest {
                            name: "n".into(),
                            block_bytes: 4096,
                            layout: "l".into(),
                            device: String::new(),
                        }
                        .encode_to_vec(),
                    ),
                    call(
                        6,
                        epb::AllocateRequest {
                            namespace_id: 0,
                            keys: vec![key(1), key(2)],
                            lease_ms: 0,
                            overwrite: false,
                        }
                        .encode_to_vec(),
                    ),
                    call(7, epb::CommitRequest { slots: vec![slot0] }.encode_to_vec()),
                    call(
                        3,
                        epb::LookupRequest { namespace_id: 0, keys: vec![key(1), key(2)], local_only: false }
                            .encode_to_vec(),
                    ),
                    call(
                        4,
                        epb::PinRequest {
                            namespace_id: 0,
                            keys: vec![key(1)],
                            lease_ms: 0,
                            stop_at_first_miss: false,
                            release: vec![],
                        }
                        .encode_to_vec(),
                    ),
                    call(5, epb::UnpinRequest { slots: vec![slot0] }.encode_to_vec()),
                    call(9, epb::RemoveRequest { namespace_id: 0, keys: vec![key(1)] }.encode_to_vec()),
                    call(13, epb::StatsRequest {}.encode_to_vec()),
                ]
                .concat(),
            ]
        }
        "config" => vec![
            kvmeshd::config::DEFAULT_CONFIG.as_bytes().to_vec(),
            b"[node]\nid = 1\n[peer]\nlisten = \"127.0.0.1:7000\"\ntls = { mode = \"off\" }\n\
              [[peers]]\nid = 2\naddr = \"127.0.0.1:7001\"\n[[pools]]\nname = \"p\"\nbytes = \"64MiB\"\n\
              slot_payload_bytes = 65536\n"
                .to_vec(),
        ],
        "trace" => vec![
            [
                &[16u8][..],
                b"{\"timestamp\": 0, \"input_length\": 40, \"output_length\": 3, \"hash_ids\": [1, 2, 3]}\n\
                  {\"timestamp\": 5, \"input_length\": 17, \"output_length\": 1, \"hash_ids\": [1, 4]}\n",
            ]
            .concat(),
        ],
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds reach the states worth fuzzing from: honest puts complete
    /// at both homes, remote reads happen, and hostile batches are taken
    /// (not dropped as stale).
    #[test]
    fn core_seeds_exercise_the_protocol() {
        let seeds = seeds("core_batches");
        let w = run_core(&seeds[0]);
        let changes: u64 = w.nodes.iter().map(|n| n.metrics().changes_completed).sum();
        let copies: usize = w.nodes.iter().map(|n| n.copy_count()).sum();
        eprintln!("changes {changes}, copies {copies}");
        assert!(changes >= 4, "puts, an overwrite and an invalidation completed: {changes}");
        // k1 and k2 fetched to the other node, k1 overwritten, k3 gone.
        assert!(copies >= 3, "remote gets registered copies: {copies}");
        let mut taken = 0;
        for s in &seeds[1..] {
            let w = run_core(s);
            taken += w.nodes.iter().map(|n| n.metrics().stale_epoch_drops).sum::<u64>();
        }
        assert_eq!(taken, 0, "hostile seed batches carry the current epoch");
    }

    /// The engine seed registers a namespace, commits a block, finds and
    /// pins it.
    #[test]
    fn engine_seed_reaches_commit_and_pin() {
        let s = run_engine(&seeds("engine_messages")[0]);
        let c = &s.counters;
        eprintln!("{c:?}");
        assert_eq!(s.namespaces, 1);
        assert!(c.commits >= 1 && c.hits >= 1 && c.pins >= 1, "{c:?}");
    }
}
