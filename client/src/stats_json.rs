//! Statistics as JSON text, one shape for the CLI and the bindings.

/// The daemon's statistics as one JSON object (what `kvmesh stats --json`
/// prints, the C ABI's `kvmesh_stats_json` and Python's `Client.stats()`
/// return): every counter by its proto field name, plus batching factors.
pub fn stats_json(s: &crate::Stats) -> String {
    let pools: Vec<serde_json::Value> = s.pools.iter().map(pool_json).collect();
    serde_json::json!({
        "pools": pools,
        "namespaces": s.namespaces,
        "sessions": s.sessions,
        "pins_outstanding": s.pins_outstanding,
        "allocations_outstanding": s.allocations_outstanding,
        "lookups": s.lookups,
        "hits": s.hits,
        "misses": s.misses,
        "pins": s.pins,
        "commits": s.commits,
        "aborts": s.aborts,
        "evictions": s.evictions,
        "removes": s.removes,
        "lease_expirations": s.lease_expirations,
        "session_releases": s.session_releases,
        "resource_exhausted": s.resource_exhausted,
        "uptime_ms": s.uptime_ms,
        "remote_fetched": s.remote_fetched,
        "remote_misses": s.remote_misses,
        "draining": s.draining,
        "remote_validation_failures": s.remote_validation_failures,
        "transfer_failures": s.transfer_failures,
        "transfer_timeouts": s.transfer_timeouts,
        "slots_quarantined": s.slots_quarantined,
        "slots_fenced": s.slots_fenced,
        "fences_forced": s.fences_forced,
        "grants_given": s.grants_given,
        "event_watchers": s.event_watchers,
        "event_watchers_cut_off": s.event_watchers_cut_off,
        "peers_connected": s.peers_connected,
        "coherence": s.coherence.as_ref().map(|c| {
            let batching = if c.batches_sent == 0 { 0.0 } else { c.msgs_sent as f64 / c.batches_sent as f64 };
            let ack_batching = if c.ack_batches_sent == 0 { 0.0 } else { c.acks_sent as f64 / c.ack_batches_sent as f64 };
            let mut v = serde_json::json!({
                "serving": c.serving, "epoch": c.epoch, "members": c.members,
                "batches_sent": c.batches_sent, "msgs_sent": c.msgs_sent, "batching_factor": batching,
                "invalidates_sent": c.invalidates_sent, "acks_sent": c.acks_sent,
                "ack_batches_sent": c.ack_batches_sent, "ack_batching_factor": ack_batching,
                "stale_epoch_drops": c.stale_epoch_drops, "validation_failures": c.validation_failures,
                "late_transfers": c.late_transfers, "grants_outstanding": c.grants_outstanding,
                "changes_completed": c.changes_completed, "ignored_acks": c.ignored_acks,
                "inval_to_ack_count": c.inval_to_ack_count, "inval_to_ack_p50_us": c.inval_to_ack_p50_us,
                "inval_to_ack_p99_us": c.inval_to_ack_p99_us, "inval_to_ack_max_us": c.inval_to_ack_max_us,
                "peer_queue_drops": c.peer_queue_drops, "decode_errors": c.decode_errors,
                "batches_received": c.batches_received, "ops_in_flight": c.ops_in_flight,
                "directory_ready": c.directory_ready, "locate_grants": c.locate_grants,
                "membership_recovering": c.membership_recovering,
                "unsolicited_keepalive_acks": c.unsolicited_keepalive_acks,
                "membership_foreign_drops": c.membership_foreign_drops,
                "epoch_persist_failures": c.epoch_persist_failures,
                "etcd_connected": c.etcd_connected, "etcd_errors": c.etcd_errors,
                "etcd_keepalives_dropped": c.etcd_keepalives_dropped,
                "copies": c.copies, "directory_entries": c.directory_entries,
                "peer_refusals": c.peer_refusals, "versions_exhausted": c.versions_exhausted,
                "peer_auth_refusals": c.peer_auth_refusals, "lease_lapses": c.lease_lapses,
                "copies_dropped_lapsed": c.copies_dropped_lapsed, "lookups": c.lookups,
                "lookups_incomplete": c.lookups_incomplete,
                "lookup_questions_answered": c.lookup_questions_answered,
                "control_am_sent": c.control_am_sent, "control_am_direct": c.control_am_direct,
                "control_am_received": c.control_am_received,
                "control_am_drops": c.control_am_drops, "staged_reads": c.staged_reads,
                "staged_sends": c.staged_sends, "staging_exhausted": c.staging_exhausted,
                "pending_registrations": c.pending_registrations,
                "early_registrations": c.early_registrations,
            });
            // (Past what one `json!` expands within the recursion limit.)
            v["lookups_one_sided"] = c.lookups_one_sided.into();
            v["lookup_table_entries"] = c.lookup_table_entries.into();
            v["lookup_table_overflowed"] = c.lookup_table_overflowed.into();
            v["lookup_table_fallbacks"] = c.lookup_table_fallbacks.into();
            v["push_invites"] = c.push_invites.into();
            v["pushes_used"] = c.pushes_used.into();
            v["pushes_unused"] = c.pushes_unused.into();
            v["pushes_sent"] = c.pushes_sent.into();
            v["pushes_landed_first"] = c.pushes_landed_first.into();
            v["timer_kicks"] = c.timer_kicks.into();
            v["incarnations_held_back"] = c.incarnations_held_back.into();
            v
        }),
    })
    .to_string()
}

/// One pool's figures as a JSON object, every field by its proto name (the
/// `pools` entries of [`stats_json`], and `kvmesh pools --json`).
pub fn pool_json(p: &kvmesh_proto::engine::v1::PoolStats) -> serde_json::Value {
    serde_json::json!({
        "name": p.name, "device": p.device, "bytes": p.bytes, "slot_payload_bytes": p.slot_payload_bytes,
        "slots": p.slots, "free": p.free, "valid": p.valid, "pending": p.pending, "pinned": p.pinned,
        "zombie": p.zombie, "mlocked": p.mlocked, "quarantined": p.quarantined,
        "fenced": p.fenced, "huge_page_bytes": p.huge_page_bytes,
    })
}

#[cfg(test)]
mod tests {
    /// The field names of proto message `name` (comments skipped).
    fn proto_fields(name: &str) -> Vec<&'static str> {
        let proto = include_str!("../../proto/kvmesh/engine/v1/engine.proto");
        let start = proto.find(&format!("message {name} {{")).expect("the message");
        let body = &proto[start..start + proto[start..].find("\n}").expect("its end")];
        body.lines()
            .map(str::trim)
            .filter(|l| !l.starts_with("//") && l.ends_with(';') && l.contains(" = "))
            .filter_map(|l| l.split(" = ").next()?.split_whitespace().last())
            .collect()
    }

    /// Every field of `CoherenceStats` is in the JSON under its proto name
    /// (the histogram buckets aside), so a new counter cannot be left out.
    #[test]
    fn every_coherence_counter_is_in_the_json() {
        let fields: Vec<&str> =
            proto_fields("CoherenceStats").into_iter().filter(|f| *f != "inval_to_ack_buckets").collect();
        assert!(fields.len() > 40, "{fields:?}");
        let s = crate::Stats { coherence: Some(Default::default()), ..Default::default() };
        let v: serde_json::Value = serde_json::from_str(&super::stats_json(&s)).unwrap();
        let c = v["coherence"].as_object().unwrap();
        for f in &fields {
            assert!(c.contains_key(*f), "coherence.{f} is missing from the stats JSON");
        }
    }

    /// The same for every field of `PoolStats`.
    #[test]
    fn every_pool_field_is_in_the_json() {
        let fields = proto_fields("PoolStats");
        assert!(fields.len() >= 13, "{fields:?}");
        let s = crate::Stats { pools: vec![Default::default()], ..Default::default() };
        let v: serde_json::Value = serde_json::from_str(&super::stats_json(&s)).unwrap();
        let p = v["pools"][0].as_object().unwrap();
        for f in &fields {
            assert!(p.contains_key(*f), "pools[].{f} is missing from the stats JSON");
        }
    }
}
