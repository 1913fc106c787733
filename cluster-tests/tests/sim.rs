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
fn same_seed_same_run() {
    let cfg = SimConfig { steps: 1500, ..SimConfig::default() };
    let a = run_seed(11, &cfg).unwrap();
    let b = run_seed(11, &cfg).unwrap();
    assert_eq!((a.events, a.hits, a.stored, a.invalidated), (b.events, b.hits, b.stored, b.invalidated));
    assert!(a.hits > 0 && a.stored > 0 && a.invalidated > 0, "the run must exercise the protocol: {a:?}");
}

#[test]
fn every_planted_bug_is_caught() {
    for name in Bug::NAMES {
        let cfg = SimConfig { steps: 2000, bug: Bug::parse(name), ..SimConfig::default() };
        let caught = (1..=200).find_map(|seed| run_seed(seed, &cfg).err());
        let v = caught.unwrap_or_else(|| panic!("bug {name} survived 200 seeds"));
        eprintln!("{name}: seed={} {} {}", v.seed, v.invariant, v.detail);
    }
}
