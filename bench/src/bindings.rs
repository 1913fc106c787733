//! `kvmesh-bench bindings`: the C ABI and the Python package against the
//! Rust client, in the same run on the same daemon and blocks.
//!
//! For each block size, 64 blocks are put once; then, in interleaved rounds
//! (Rust, C, Python, Rust, ...), each language runs `iters` iterations of:
//! a copy-get of the 64 blocks into its own buffer, a pin + read (pin the
//! 64, copy each out of the pool, unpin); then 500 one-key lookups. Each
//! side is a process of its own (the Rust one is this binary's hidden
//! `bindings-rust-side`), connected to the same daemon. A round
//! reports medians; the result is the median of the rounds. Ratios are
//! throughputs relative to Rust (1.0 = as fast); `call_overhead_us` is the
//! one-key lookup latency minus Rust's.
//!
//! The C side is `bench/c/bindings_bench.c` compiled here with `cc -O2`
//! against `libkvmesh.so` next to this binary; the Python side is
//! `python/bench.py` run by the given interpreter with the `kvmesh` package
//! installed (`PROFILE=release scripts/python-test.sh --install-only`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};
use kvmesh_client::{Client, Key};

const BLOCKS: usize = 64;
/// One-key lookups per round (back to back, after the copies).
const LOOKUPS: usize = 500;

#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    copy_s: f64,
    pin_read_s: f64,
    lookup_us: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn keys() -> Vec<Key> {
    let tokens: Vec<u32> = (0..(BLOCKS * 16) as u32).collect();
    Key::prefix_keys(&tokens, 16)
}

/// The Rust side, in its own process like the C and Python sides (the
/// hidden `bindings-rust-side` subcommand): prints one JSON line.
pub(crate) fn rust_side(socket: &Path, name: &str, iters: usize) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let client = rt.block_on(Client::connect(socket))?;
    let s = rust_round(&rt, &client, name, iters)?;
    println!("{}", serde_json::json!({"copy_s": s.copy_s, "pin_read_s": s.pin_read_s, "lookup_us": s.lookup_us}));
    Ok(())
}

fn rust_round(rt: &tokio::runtime::Runtime, client: &Client, name: &str, iters: usize) -> anyhow::Result<Sample> {
    rt.block_on(async {
        let ns = client.namespace(name).await?;
        let bs = ns.block_bytes as usize;
        let keys = keys();
        let mut dst = vec![0u8; BLOCKS * bs];
        let (mut copy, mut pin, mut look) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..iters {
            let t0 = Instant::now();
            let hits = client.get_into(&ns, &keys, &mut dst).await?;
            copy.push(t0.elapsed().as_secs_f64());
            if !hits.iter().all(|&h| h) {
                bail!("copy-get missed");
            }
            let t0 = Instant::now();
            let blocks: Vec<_> = client.pin(&ns, &keys).await?.into_iter().flatten().collect();
            if blocks.len() != BLOCKS {
                bail!("pin missed");
            }
            for (i, b) in blocks.iter().enumerate() {
                dst[i * bs..(i + 1) * bs].copy_from_slice(b);
            }
            client.unpin(blocks).await?;
            pin.push(t0.elapsed().as_secs_f64());
        }
        for _ in 0..LOOKUPS {
            let t0 = Instant::now();
            client.lookup(&ns, &keys[..1]).await?;
            look.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        std::hint::black_box(&dst);
        Ok(Sample { copy_s: median(copy), pin_read_s: median(pin), lookup_us: median(look) })
    })
}

fn parse_sample(out: &[u8], who: &str) -> anyhow::Result<Sample> {
    let text = String::from_utf8_lossy(out);
    let line = text.lines().last().with_context(|| format!("{who}: no output"))?;
    let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{who}: bad output {line:?}"))?;
    let f = |k: &str| v[k].as_f64().with_context(|| format!("{who}: no {k} in {line}"));
    Ok(Sample { copy_s: f("copy_s")?, pin_read_s: f("pin_read_s")?, lookup_us: f("lookup_us")? })
}

fn run_child(mut cmd: Command, who: &str) -> anyhow::Result<Sample> {
    let out = cmd.output().with_context(|| format!("run the {who} side"))?;
    if !out.status.success() {
        bail!("{who} side failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    parse_sample(&out.stdout, who)
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("bench/ is in the repository").to_path_buf()
}

fn build_c(dir: &Path) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let lib_dir = exe.parent().context("binary directory")?.to_path_buf();
    if !lib_dir.join("libkvmesh.so").exists() {
        bail!(
            "no libkvmesh.so next to {} (build it: cargo build --release -p kvmesh-capi), or pass --no-c",
            exe.display()
        );
    }
    let bin = dir.join("bindings_bench");
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Werror"])
        .arg("-I")
        .arg(repo().join("ffi/capi/include"))
        .arg(repo().join("bench/c/bindings_bench.c"))
        .arg("-o")
        .arg(&bin)
        .arg(format!("-L{}", lib_dir.display()))
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-lkvmesh")
        .status()
        .context("run cc")?;
    if !status.success() {
        bail!("cc failed on bench/c/bindings_bench.c");
    }
    Ok(bin)
}

/// Runs the comparison; prints a table on stderr and the JSON line on stdout.
pub(crate) fn run(
    json: bool,
    block_kib: &[u64],
    iters: usize,
    rounds: usize,
    python: Option<PathBuf>,
    with_c: bool,
) -> anyhow::Result<()> {
    if block_kib.is_empty() || iters == 0 || rounds == 0 {
        bail!("need at least one block size, iteration and round");
    }
    let max_kib = *block_kib.iter().max().expect("non-empty");
    let slots = BLOCKS * block_kib.len() + 8;
    let pools = format!(
        "[[pools]]\nname = \"host0\"\nbytes = \"{}MiB\"\nslot_payload_bytes = \"{max_kib}KiB\"\nmlock = false\n",
        (slots as u64 * (max_kib + 4)).div_ceil(1024) + 1
    );
    let (_daemon, socket) = crate::start_daemon_tagged("bindings", &pools)?;
    let tmp = std::env::temp_dir().join(format!("kvmesh-bench-bindings-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let c_bin = if with_c { Some(build_c(&tmp)?) } else { None };
    let python = match python {
        Some(p) if p.as_os_str() == "none" => None,
        Some(p) => Some(p),
        None => Some(repo().join("target/pyvenv/bin/python")),
    };
    if let Some(py) = &python {
        let ok = Command::new(py).args(["-c", "import kvmesh"]).status().map(|s| s.success()).unwrap_or(false);
        if !ok {
            bail!(
                "{} cannot import kvmesh (install it: PROFILE=release scripts/python-test.sh --install-only), or pass --python none",
                py.display()
            );
        }
    }

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let client = rt.block_on(Client::connect(&socket))?;
    let mut rows = Vec::new();
    for &kib in block_kib {
        let bs = (kib * 1024) as usize;
        let name = format!("bindings-{kib}k");
        rt.block_on(async {
            let ns = client.register_namespace(&name, bs as u64, "bench").await?;
            let data: Vec<Vec<u8>> = keys()
                .into_iter()
                .map(|k| {
                    let mut v = vec![0u8; bs];
                    crate::fill_block(k, &mut v);
                    v
                })
                .collect();
            let blocks: Vec<(Key, &[u8])> = keys().into_iter().zip(data.iter().map(|d| &d[..])).collect();
            let s = client.put(&ns, &blocks).await?;
            if s.stored as usize != BLOCKS {
                bail!("stored {} of {BLOCKS} blocks: {s:?}", s.stored);
            }
            anyhow::Ok(())
        })?;
        let mut per: Vec<(&str, Vec<Sample>)> = vec![("rust", Vec::new())];
        if c_bin.is_some() {
            per.push(("c", Vec::new()));
        }
        if python.is_some() {
            per.push(("python", Vec::new()));
        }
        for _ in 0..rounds {
            for (lang, samples) in per.iter_mut() {
                let s = match *lang {
                    "rust" => {
                        let mut cmd = Command::new(std::env::current_exe()?);
                        cmd.arg("bindings-rust-side").arg(&socket).arg(&name).arg(iters.to_string());
                        run_child(cmd, "Rust")?
                    }
                    "c" => {
                        let mut cmd = Command::new(c_bin.as_ref().expect("built"));
                        cmd.arg(&socket)
                            .arg(&name)
                            .arg(BLOCKS.to_string())
                            .arg(iters.to_string())
                            .arg(LOOKUPS.to_string());
                        run_child(cmd, "C")?
                    }
                    _ => {
                        let mut cmd = Command::new(python.as_ref().expect("given"));
                        cmd.arg(repo().join("python/bench.py"))
                            .arg(&socket)
                            .arg(&name)
                            .arg(BLOCKS.to_string())
                            .arg(iters.to_string())
                            .arg(LOOKUPS.to_string());
                        run_child(cmd, "Python")?
                    }
                };
                samples.push(s);
            }
        }
        let summary: Vec<(&str, Sample)> = per
            .iter()
            .map(|(lang, s)| {
                (
                    *lang,
                    Sample {
                        copy_s: median(s.iter().map(|x| x.copy_s).collect()),
                        pin_read_s: median(s.iter().map(|x| x.pin_read_s).collect()),
                        lookup_us: median(s.iter().map(|x| x.lookup_us).collect()),
                    },
                )
            })
            .collect();
        let rust = summary[0].1;
        let gbps = |s: f64| (BLOCKS * bs) as f64 / s / 1e9;
        eprintln!(
            "{kib} KiB x {BLOCKS}: rust copy {:.2} GB/s, pin+read {:.2} GB/s, lookup {:.1} us",
            gbps(rust.copy_s),
            gbps(rust.pin_read_s),
            rust.lookup_us
        );
        for (lang, s) in &summary[1..] {
            let row = serde_json::json!({
                "lang": lang,
                "block_bytes": bs,
                "copy_ratio_vs_rust": rust.copy_s / s.copy_s,
                "pin_read_ratio_vs_rust": rust.pin_read_s / s.pin_read_s,
                "call_overhead_us": s.lookup_us - rust.lookup_us,
                "copy_gbps": gbps(s.copy_s),
                "pin_read_gbps": gbps(s.pin_read_s),
                "lookup_us": s.lookup_us,
                "rust_copy_gbps": gbps(rust.copy_s),
                "rust_pin_read_gbps": gbps(rust.pin_read_s),
                "rust_lookup_us": rust.lookup_us,
            });
            eprintln!(
                "  {lang:>6}: copy {:.2} GB/s ({:.2}x rust), pin+read {:.2} GB/s ({:.2}x rust), lookup {:.1} us (+{:.1} us)",
                gbps(s.copy_s),
                rust.copy_s / s.copy_s,
                gbps(s.pin_read_s),
                rust.pin_read_s / s.pin_read_s,
                s.lookup_us,
                s.lookup_us - rust.lookup_us
            );
            rows.push(row);
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    let out =
        serde_json::json!({"bench": "bindings", "blocks": BLOCKS, "iters": iters, "rounds": rounds, "rows": rows});
    if json {
        println!("{out}");
    } else {
        eprintln!("{out}");
    }
    Ok(())
}
