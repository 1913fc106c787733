//! `kvmesh-bench lookup`: a cluster-wide lookup of a batch of keys on a
//! cluster of daemons (real processes, the protocol on gRPC streams),
//! against a local-only lookup of the same keys on the same daemon, in
//! interleaved rounds (the baseline: the engine RPC and the daemon's own
//! index, without the question to the homes). The caches are filled
//! first; every answer is checked (each key reported on the daemon that
//! holds it, nothing moved).

use std::time::Instant;

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kvmesh_client::{Client, Key, Namespace};

const BLOCK: u64 = 4096;

fn key(daemon: usize, i: usize) -> Key {
    Key(((0x100c_0000 + daemon as u128) << 64) | i as u128)
}

pub(crate) async fn lookup(
    json: bool,
    daemons: u32,
    fill: usize,
    batch: usize,
    samples: usize,
    rounds: usize,
    lookup_tables: bool,
) -> anyhow::Result<()> {
    if daemons < 2 || batch == 0 || fill < batch || rounds == 0 || samples < rounds {
        bail!("need --daemons >= 2, --fill >= --batch > 0, --samples >= --rounds > 0");
    }
    let n = daemons as usize;
    let pool_mib = ((fill as u64 * (BLOCK + 128) * 3 / 2) >> 20).max(16);
    let procs = crate::start_sm_cluster(
        "lookup",
        daemons,
        &format!(
            "[[pools]]\nname = \"p4k\"\nbytes = \"{pool_mib}MiB\"\nslot_payload_bytes = \"4KiB\"\nmlock = false\n\
             [coherence]\nlookup_tables = {lookup_tables}\n"
        ),
    )?;
    let mut clients = Vec::new();
    for (_, sock) in &procs {
        clients.push(Client::connect(sock).await?);
    }
    crate::coherence::wait_ready(&clients, daemons).await?;
    let mut nss: Vec<Namespace> = Vec::new();
    for c in &clients {
        nss.push(c.register_namespace("lookup-bench", BLOCK, "bench").await?);
    }
    // Fill: every daemon puts `fill` blocks of its own.
    let t0 = Instant::now();
    for (d, (c, ns)) in clients.iter().zip(&nss).enumerate() {
        for from in (0..fill).step_by(1024) {
            let keys: Vec<Key> = (from..(from + 1024).min(fill)).map(|i| key(d, i)).collect();
            let data: Vec<Vec<u8>> = keys
                .iter()
                .map(|&k| {
                    let mut v = vec![0u8; BLOCK as usize];
                    crate::fill_block(k, &mut v);
                    v
                })
                .collect();
            let items: Vec<(Key, &[u8])> = keys.iter().copied().zip(data.iter().map(|v| &v[..])).collect();
            let s = c.put(ns, &items).await?;
            if s.stored as usize != keys.len() {
                bail!("fill of daemon {}: {s:?}", d + 1);
            }
        }
    }
    eprintln!("filled {fill} blocks on each of {n} daemons in {:.1} s", t0.elapsed().as_secs_f64());
    let (asker, ns) = (&clients[0], &nss[0]);
    let before = asker.stats().await?;
    // A batch: keys spread over every daemon (the i-th key on daemon i % n),
    // a different batch every call.
    let batch_at = |s: usize| -> Vec<(Key, u32)> {
        (0..batch)
            .map(|j| {
                let d = j % n;
                let i = (s.wrapping_mul(7919) + j * 31) % fill;
                (key(d, i), d as u32 + 1)
            })
            .collect()
    };
    let (mut hc, mut hl) = (Histogram::<u64>::new(3)?, Histogram::<u64>::new(3)?);
    let per_round = samples / rounds;
    let mut rows = Vec::new();
    let mut s = 0usize;
    for r in 0..rounds {
        let (mut rc, mut rl) = (Histogram::<u64>::new(3)?, Histogram::<u64>::new(3)?);
        for _ in 0..per_round {
            s += 1;
            let want = batch_at(s);
            let keys: Vec<Key> = want.iter().map(|w| w.0).collect();
            // Interleaved: which goes first alternates.
            for cluster in if s.is_multiple_of(2) { [true, false] } else { [false, true] } {
                let t = Instant::now();
                let res = if cluster { asker.lookup(ns, &keys).await? } else { asker.lookup_local(ns, &keys).await? };
                let us = t.elapsed().as_nanos() as u64 / 1000;
                for (k, ((_, home), got)) in keys.iter().zip(want.iter().zip(&res.nodes)) {
                    let expect = if cluster || *home == 1 { Some(*home) } else { None };
                    if *got != expect {
                        bail!("lookup (cluster={cluster}) reported {k} at {got:?}; it is on daemon {home}");
                    }
                }
                if cluster && !(res.cluster_wide && res.complete) {
                    bail!("a cluster-wide lookup came back incomplete: {res:?}");
                }
                let (h, rh) = if cluster { (&mut hc, &mut rc) } else { (&mut hl, &mut rl) };
                h.record(us.max(1))?;
                rh.record(us.max(1))?;
            }
        }
        let q = |h: &Histogram<u64>, p: f64| h.value_at_quantile(p) as f64;
        eprintln!(
            "round {r}: cluster-wide p50 {:.0} us p99 {:.0} us | local-only p50 {:.0} us p99 {:.0} us ({} samples each)",
            q(&rc, 0.5),
            q(&rc, 0.99),
            q(&rl, 0.5),
            q(&rl, 0.99),
            rc.len()
        );
        rows.push(serde_json::json!({
            "round": r, "cluster_p50_us": q(&rc, 0.5), "cluster_p99_us": q(&rc, 0.99),
            "local_p50_us": q(&rl, 0.5), "local_p99_us": q(&rl, 0.99), "samples": rc.len(),
        }));
    }
    let after = asker.stats().await?;
    let moved = (after.remote_fetched - before.remote_fetched, after.remote_misses - before.remote_misses);
    if moved != (0, 0) {
        bail!("lookups moved data: {moved:?} (fetched, remote misses)");
    }
    let co = after.coherence.context("clustered")?;
    let q = |h: &Histogram<u64>, p: f64| h.value_at_quantile(p) as f64;
    let ratio_p99 = q(&hc, 0.99) / q(&hl, 0.99);
    let ratio_p50 = q(&hc, 0.5) / q(&hl, 0.5);
    if !json {
        println!(
            "{n} daemons, {fill} blocks each, {batch} keys per lookup ({:.0}% on other daemons): cluster-wide p50 {:.0} us \
             p99 {:.0} us; local-only p50 {:.0} us p99 {:.0} us; p99 ratio {ratio_p99:.2} (p50 {ratio_p50:.2}), {} samples each; \
             {} lookups counted by the asker ({} from the homes' tables, {} of those fell back to asking), 0 fetches; \
             its coherence messages over UCX: {} sent, {} of them without waking its data-plane thread",
            100.0 * (n - 1) as f64 / n as f64,
            q(&hc, 0.5),
            q(&hc, 0.99),
            q(&hl, 0.5),
            q(&hl, 0.99),
            hc.len(),
            co.lookups,
            co.lookups_one_sided,
            co.lookup_table_fallbacks,
            co.control_am_sent,
            co.control_am_direct
        );
    }
    println!(
        "{}",
        serde_json::json!({
            "bench": "lookup", "daemons": n, "fill": fill, "batch": batch, "samples": hc.len(), "rows": rows,
            "cluster_p50_us": q(&hc, 0.5), "cluster_p99_us": q(&hc, 0.99),
            "local_p50_us": q(&hl, 0.5), "local_p99_us": q(&hl, 0.99),
            "ratio_p99": ratio_p99, "ratio_p50": ratio_p50,
            "asker_control_am_sent": co.control_am_sent, "asker_control_am_direct": co.control_am_direct,
            "lookup_tables": lookup_tables, "asker_lookups_one_sided": co.lookups_one_sided,
            "asker_lookup_table_fallbacks": co.lookup_table_fallbacks,
        })
    );
    drop(procs);
    Ok(())
}
