//! A bounded fuzz smoke on stable: every target runs its seeds, its
//! committed corpus (`fuzz/corpus/<target>/`, grown by cargo-fuzz runs) and
//! a seeded set of mutations of them. A crash or a broken invariant fails
//! the test and prints the input (hex) to add as a regression. The real
//! coverage-guided runs are `fuzz/run.sh` (docs/SECURITY.md).
//!
//! `KVMESH_FUZZ_SMOKE_ITERS` (default 3,000 per target) and
//! `KVMESH_FUZZ_SEED` change the mutation run.

use std::path::Path;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn corpus(name: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus").join(name);
    let mut out = kvmesh_fuzz_targets::seeds(name);
    if let Ok(rd) = std::fs::read_dir(&dir) {
        let mut files: Vec<_> = rd.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        files.sort();
        out.extend(files.iter().filter_map(|p| std::fs::read(p).ok()));
    }
    out
}

fn mutate(rng: &mut SmallRng, input: &[u8], pool: &[Vec<u8>]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        match rng.random_range(0..6) {
            0 if !v.is_empty() => {
                let i = rng.random_range(0..v.len());
                v[i] ^= 1 << rng.random_range(0..8);
            }
            1 if !v.is_empty() => {
                let i = rng.random_range(0..v.len());
                v[i] = [0, 1, 0x7f, 0x80, 0xff][rng.random_range(0..5)];
            }
            2 => {
                let cut = rng.random_range(0..=v.len());
                v.truncate(cut);
            }
            3 => {
                let i = rng.random_range(0..=v.len());
                let n = rng.random_range(1..16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                v.splice(i..i, bytes);
            }
            4 if !pool.is_empty() => {
                // Splice in a piece of another input.
                let o = &pool[rng.random_range(0..pool.len())];
                if !o.is_empty() {
                    let a = rng.random_range(0..o.len());
                    let b = rng.random_range(a..=o.len());
                    let i = rng.random_range(0..=v.len());
                    v.splice(i..i, o[a..b].iter().copied());
                }
            }
            _ if v.len() >= 8 => {
                // An integer field set to an edge value.
                let i = rng.random_range(0..=v.len() - 8);
                let x: u64 = [0, 1, u64::from(u32::MAX), u64::MAX, 1 << 32, u64::MAX >> 1][rng.random_range(0..6)];
                v[i..i + 8].copy_from_slice(&x.to_le_bytes());
            }
            _ => {}
        }
    }
    v
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn every_target_survives_its_corpus_and_mutations() {
    let iters: usize = std::env::var("KVMESH_FUZZ_SMOKE_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(3_000);
    let seed: u64 = std::env::var("KVMESH_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x6b76_6d65_7368);
    let quiet = std::panic::take_hook();
    for (name, run) in kvmesh_fuzz_targets::TARGETS {
        let inputs = corpus(name);
        assert!(!inputs.is_empty(), "{name}: no seeds");
        let mut rng = SmallRng::seed_from_u64(seed ^ name.len() as u64);
        let t0 = std::time::Instant::now();
        let mut n = 0;
        let cases = inputs.iter().cloned().chain(
            (0..iters).map(|_| mutate(&mut rng, &inputs[n % inputs.len()].clone(), &inputs)).collect::<Vec<_>>(),
        );
        for input in cases {
            n += 1;
            std::panic::set_hook(Box::new(|_| {}));
            let r = std::panic::catch_unwind(|| run(&input));
            let _ = std::panic::take_hook();
            if let Err(p) = r {
                std::panic::set_hook(quiet);
                let msg = p.downcast_ref::<String>().cloned().or(p.downcast_ref::<&str>().map(|s| s.to_string()));
                panic!("{name}: input {n} failed: {msg:?}\ninput (hex): {}", hex(&input));
            }
        }
        eprintln!("{name}: {n} inputs ({} from seeds and corpus) in {:?}", inputs.len(), t0.elapsed());
    }
    std::panic::set_hook(quiet);
}

/// Writes the seeds as corpus files (`KVMESH_FUZZ_WRITE_SEEDS=1`): what a
/// first cargo-fuzz run starts from.
#[test]
fn write_seeds_when_asked() {
    if std::env::var_os("KVMESH_FUZZ_WRITE_SEEDS").is_none() {
        return;
    }
    for (name, _) in kvmesh_fuzz_targets::TARGETS {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, s) in kvmesh_fuzz_targets::seeds(name).iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), s).unwrap();
        }
    }
}
