//! The simulator as a test: seeds pass on the real protocol, and every
//! planted bug is caught. (CI also runs 1,000 seeds of the release build
//! through `kvmesh-sim`, see scripts/test.sh.)

use kvmesh_cluster_tests::sim::{SimConfig, run_seed};
use kvmesh_coherence::Bug;

#[test]
fn seeds_pass() {
    let cfg = SimConfig { steps: 2000, ..SimConfig::default() };
    for seed in 1..=60 {
        if let Err(v) = run_seed(seed, &cfg) {
            panic!("seed={} {}: {}\n{}", v.seed, v.invariant, v.detail, v.trace.join("\n"));
        }
    }
}

#[test]
fn seeds_pass_with_etcd_membership() {
    let cfg = SimConfig { steps: 2000, etcd: true, ..SimConfig::default() };
    for seed in 1..=60 {
        if let Err(v) = run_seed(seed, &cfg) {
            panic!("seed={} {}: {}\n{}", v.seed, v.invariant, v.detail, v.trace.join("\n"));
        }
    }
}

#[test]
fn same_seed_same_run() {
    let cfg = SimConfig { steps: 1500, ..SimConfig::default() };
    let a = run_seed(11, &cfg).unwrap();
    let b = run_seed(11, &cfg).unwrap();
    assert_eq!((a.events, a.hits, a.stored, a.invalidated), (b.events, b.hits, b.stored, b.invalidated));
    assert!(a.hits > 0 && a.stored > 0 && a.invalidated > 0, "the run must exercise the protocol: {a:?}");
}

/// A scale run: thousands of cached keys on 3 nodes under faults, every
/// core's incremental structures (timers, counts, the bounded directory)
/// recomputed by a full scan and compared every 200 events. (CI also runs
/// 100,000 keys in the release build, see scripts/test.sh.)
#[test]
fn scale_seeds_pass_and_agree_with_a_full_scan() {
    for etcd in [false, true] {
        let cfg =
            SimConfig { nodes: 3, steps: 1500, background: 4_000, check_every: 200, etcd, ..SimConfig::default() };
        for seed in 1..=2 {
            match run_seed(seed, &cfg) {
                Ok(s) => assert!(s.prefilled >= 4_000, "the prefill must reach scale: {s:?}"),
                Err(v) => panic!("seed={} {}: {}\n{}", v.seed, v.invariant, v.detail, v.trace.join("\n")),
            }
        }
    }
}

/// Each planted bug, and the invariants it breaks: the run must name one of
/// them (a bug caught by accident, under another name, is a checker that
/// does not check what it claims). Skipping the ack wait breaks S1 (two
/// Valid versions), S3 (a change completed while a holder serves) and REG
/// (a Valid copy its home no longer lists: an invalidation completed and
/// its entry was dropped).
const PLANTED: [(&str, &str); 13] = [
    ("skip-ack-wait", "S1/S3/REG"),
    ("ack-without-invalidate", "S3/REG"),
    ("skip-validation", "DATA"),
    ("reuse-granted-slot", "S4"),
    ("coordinator-no-wait", "M1"),
    ("etcd-short-ttl", "M1"),
    ("leave-before-stop", "M1"),
    ("lookup-counts-pending-put", "LOOKUP"),
    ("take-late-registration", "REG/S1/S3"),
    ("early-valid-across-epochs", "REG/S1/S3"),
    ("capacity-per-keepalive", "CAP"),
    ("incarnation-per-keepalive", "INC"),
    ("table-misses-dropped-copy", "TABLE"),
];

#[test]
fn every_planted_bug_is_caught_by_the_invariant_it_breaks() {
    assert_eq!(PLANTED.len(), Bug::NAMES.len(), "every planted bug has its invariant here");
    for (name, invariant) in PLANTED {
        let bug = Bug::parse(name);
        let mut cfg = SimConfig { steps: 2000, bug, etcd: bug == Some(Bug::EtcdShortTtl), ..SimConfig::default() };
        let mut seeds = 1..=200;
        if bug == Some(Bug::TakeLateRegistration) {
            // About one seed in 300 of 20,000 events meets a late
            // registration that matters (`scripts/test.sh` searches 300);
            // here a range known to hold one (1, since half the lookups
            // read the homes' tables; 62 before), so the test stays short.
            cfg.steps = 20_000;
            seeds = 1..=5;
        }
        if bug == Some(Bug::EarlyValidAcrossEpochs) {
            // A read still in flight when the view changes, then an
            // overwrite in the new epoch before the read ends: about one
            // seed in 170 of 4,000 events (`scripts/test.sh` searches
            // 1,000); here a range known to hold one (3, since a node gets
            // one new incarnation per removal time; 148 before, since half
            // the lookups read the homes' tables; 165 before that).
            cfg.steps = 4_000;
            seeds = 1..=3;
        }
        let caught = seeds.into_iter().find_map(|seed| run_seed(seed, &cfg).err());
        let v = caught.unwrap_or_else(|| panic!("bug {name} survived its seeds"));
        eprintln!("{name}: seed={} {} {}", v.seed, v.invariant, v.detail);
        assert!(
            invariant.split('/').any(|i| i == v.invariant),
            "bug {name} caught by {} ({}), not by {invariant}",
            v.invariant,
            v.detail
        );
    }
}
