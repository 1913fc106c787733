//! `kvmesh-gpu-check`: the device check of issue 15, run on a machine with
//! an NVIDIA GPU by `scripts/gpu-check.sh` (prebuilt here; the GPU machine
//! has no Rust toolchain).
//!
//! Checks, each against a CPU reference or the bytes written: a GPU pool
//! (virtual-memory API) written, checksummed on the GPU and read back; the
//! pool lent to a second process (fd over a Unix socket) that maps it on
//! the same GPU — and on a second GPU with peer access when there is one —
//! and reads it in place and writes into it; every gather/scatter kernel on
//! random shapes of every layout and dtype; the GPU checksum on random
//! lengths; and a bandwidth row: gather, scatter and pool-to-pool copies as
//! a ratio of a plain device-to-device `cuMemcpy` of the same bytes.
//!
//! Prints one line per check and a JSON last line. Exit 0: all passed; 1:
//! a check failed; 77: no CUDA driver or device here (skipped, with why).

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, ExitCode};
use std::time::Instant;

use kvmesh_kernels::checksum::kvsum64;
use kvmesh_kernels::cuda::{DeviceRange, Gpu, GpuError, can_access, device_count};
use kvmesh_kernels::layout::{DType, Layout, PagedKv};
use serde_json::{Value, json};

/// xorshift64*: reproducible random data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.next() >> 24) as u8).collect()
    }
}

struct Report {
    checks: Vec<Value>,
    rows: Vec<Value>,
    failed: usize,
}

impl Report {
    fn check(&mut self, name: &str, r: Result<String, String>) {
        match r {
            Ok(detail) => {
                println!("ok   {name}: {detail}");
                self.checks.push(json!({"check": name, "ok": true, "detail": detail}));
            }
            Err(why) => {
                println!("FAIL {name}: {why}");
                self.failed += 1;
                self.checks.push(json!({"check": name, "ok": false, "detail": why}));
            }
        }
    }
}

fn e(err: GpuError) -> String {
    err.to_string()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        return match child(args.get(2).map(String::as_str).unwrap_or("")) {
            Ok(()) => ExitCode::SUCCESS,
            Err(why) => {
                eprintln!("child: {why}");
                ExitCode::FAILURE
            }
        };
    }
    let ordinal: usize = std::env::var("KVMESH_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    let started = Instant::now();
    let gpu = match Gpu::open(ordinal) {
        Ok(g) => g,
        Err(err) => {
            println!("SKIP: {err}");
            println!("{}", json!({"bench": "gpu-check", "skipped": err.to_string()}));
            return ExitCode::from(77);
        }
    };
    let (name, cc) = gpu.describe().unwrap_or_else(|err| (format!("? ({err})"), (0, 0)));
    println!("device {ordinal}: {name}, compute capability {}.{}", cc.0, cc.1);
    let mut rep = Report { checks: Vec::new(), rows: Vec::new(), failed: 0 };
    let t = Instant::now();
    rep.check("nvrtc", gpu.warm_up().map(|()| format!("kernels compiled in {:?}", t.elapsed())).map_err(e));
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id()));
    let r = checksum(&gpu, &mut rng);
    rep.check("checksum", r);
    let r = pool(&gpu, &mut rng);
    rep.check("pool", r);
    let devices = device_count().unwrap_or(1);
    let r = lending(&gpu, ordinal, &mut rng);
    rep.check("lend-same-gpu", r);
    let peer = (0..devices).find(|&d| d != ordinal);
    match peer {
        Some(p) if can_access(p, ordinal).unwrap_or(false) => {
            let r = lending(&gpu, p, &mut rng);
            rep.check("lend-peer-gpu", r);
        }
        Some(p) => println!("skip lend-peer-gpu: device {p} cannot access device {ordinal} (no peer access)"),
        None => println!("skip lend-peer-gpu: one GPU on this machine"),
    }
    let r = kernels(&gpu, &mut rng);
    rep.check("kernels", r);
    match bandwidth(&gpu, &mut rng) {
        Ok(rows) => {
            for r in &rows {
                println!("bw   {r}");
            }
            let low: Vec<&Value> = rows
                .iter()
                .filter(|r| r["block_bytes"].as_u64().unwrap_or(0) >= 256 << 10)
                .filter(|r| r["target"].as_f64().is_some_and(|t| r["ratio"].as_f64().unwrap_or(0.0) < t))
                .collect();
            let r = if low.is_empty() {
                Ok("every row with a target met it".to_string())
            } else {
                Err(format!("{} rows below their target: {low:?}", low.len()))
            };
            rep.rows = rows;
            rep.check("bandwidth-targets", r);
        }
        Err(why) => rep.check("bandwidth", Err(why)),
    }
    let ok = rep.failed == 0;
    println!(
        "{}",
        json!({
            "bench": "gpu-check",
            "device": name,
            "compute_capability": format!("{}.{}", cc.0, cc.1),
            "devices": devices,
            "ok": ok,
            "failed": rep.failed,
            "seconds": started.elapsed().as_secs_f64(),
            "checks": rep.checks,
            "rows": rep.rows,
        })
    );
    if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

/// The GPU checksum equals the CPU one on random lengths (and offsets on
/// 8 bytes), including lengths that are not whole words.
fn checksum(gpu: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let buf = gpu.alloc(8 << 20).map_err(e)?;
    let mut lens = vec![0usize, 1, 7, 8, 9, 63, 64, 4095, 4096, 65_539, 1 << 20, (4 << 20) + 5];
    lens.extend((0..20).map(|_| rng.below(2 << 20)));
    for len in &lens {
        let off = 8 * rng.below(64);
        let data = rng.bytes(*len);
        let r = buf.range().sub(off, *len).map_err(e)?;
        gpu.copy_to_device(r, &data).map_err(e)?;
        let g = gpu.kvsum64(r).map_err(e)?;
        let c = kvsum64(&data);
        if g != c {
            return Err(format!("len {len} at +{off}: GPU {g:#018x}, CPU {c:#018x}"));
        }
    }
    // A flipped byte changes the GPU sum too.
    let data = rng.bytes(1 << 16);
    let r = buf.range().sub(0, data.len()).map_err(e)?;
    gpu.copy_to_device(r, &data).map_err(e)?;
    let before = gpu.kvsum64(r).map_err(e)?;
    gpu.copy_to_device(r.sub(777, 1).map_err(e)?, &[data[777] ^ 0x10]).map_err(e)?;
    if gpu.kvsum64(r).map_err(e)? == before {
        return Err("a flipped byte left the GPU sum unchanged".into());
    }
    Ok(format!("{} lengths equal to the CPU reference; a flip is caught", lens.len()))
}

/// A pool from the virtual-memory API: slots written, checksummed on the
/// GPU and read back.
fn pool(gpu: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let p = gpu.alloc_pool(64 << 20).map_err(e)?;
    let stride = 64 + (1 << 20) + 64;
    let slots = p.range().len() / stride;
    for _ in 0..8 {
        let s = rng.below(slots);
        let payload = rng.bytes(1 << 20);
        let r = p.range().sub(s * stride + 64, payload.len()).map_err(e)?;
        gpu.copy_to_device(r, &payload).map_err(e)?;
        let g = gpu.kvsum64(r).map_err(e)?;
        if g != kvsum64(&payload) {
            return Err(format!("slot {s}: GPU checksum differs from CPU"));
        }
        let mut back = vec![0u8; payload.len()];
        gpu.copy_to_host(&mut back, r).map_err(e)?;
        if back != payload {
            return Err(format!("slot {s}: bytes read back differ"));
        }
    }
    Ok(format!(
        "{} MiB pool ({} slots), GPUDirect-RDMA-capable allocation: {}",
        p.range().len() >> 20,
        slots,
        p.rdma_capable()
    ))
}

/// Lends a pool to a second process on device `to` and checks it reads
/// the block in place and that what it writes is seen here.
fn lending(gpu: &Gpu, to: usize, rng: &mut Rng) -> Result<String, String> {
    let p = gpu.alloc_pool(32 << 20).map_err(e)?;
    if to != gpu.ordinal() {
        p.grant(to).map_err(e)?;
    }
    let len = 4 << 20;
    let data = rng.bytes(len);
    gpu.copy_to_device(p.range().sub(0, len).map_err(e)?, &data).map_err(e)?;
    let fd = p.export_fd().map_err(e)?;
    let dir = std::env::temp_dir().join(format!("kvmesh-gpu-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|x| x.to_string())?;
    let path = dir.join("lend.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|x| x.to_string())?;
    let exe = std::env::current_exe().map_err(|x| x.to_string())?;
    let mut child = Command::new(exe).arg("--child").arg(&path).spawn().map_err(|x| x.to_string())?;
    let (mut sock, _) = listener.accept().map_err(|x| x.to_string())?;
    let msg = format!("{} {} {} {}\n", p.range().len(), to, len, kvsum64(&data));
    kvmesh_ffi_os::fdpass::send_fds(sock.as_fd(), msg.as_bytes(), &[fd.as_fd()]).map_err(|x| x.to_string())?;
    let mut answer = String::new();
    sock.read_to_string(&mut answer).map_err(|x| x.to_string())?;
    let status = child.wait().map_err(|x| x.to_string())?;
    let _ = std::fs::remove_dir_all(&dir);
    if !status.success() || !answer.starts_with("ok") {
        return Err(format!("child on device {to}: {status}, said {answer:?}"));
    }
    // The child wrote 4 KiB of 0xA5 right after the block.
    let mut mark = vec![0u8; 4096];
    gpu.copy_to_host(&mut mark, p.range().sub(len, 4096).map_err(e)?).map_err(e)?;
    if mark.iter().any(|&b| b != 0xA5) {
        return Err("the child's write into the lent pool is not seen by the owner".into());
    }
    Ok(format!(
        "device {to} mapped the pool, read 4 MiB in place (checksum on its GPU), its write seen here; {}",
        answer.trim()
    ))
}

/// The borrowing process: imports the pool, checks the block in place,
/// writes a mark after it.
fn child(path: &str) -> Result<(), String> {
    let mut sock = UnixStream::connect(path).map_err(|x| x.to_string())?;
    let mut buf = [0u8; 256];
    let (n, mut fds) = kvmesh_ffi_os::fdpass::recv_fds(sock.as_fd(), &mut buf, 1).map_err(|x| x.to_string())?;
    let msg = std::str::from_utf8(&buf[..n]).map_err(|x| x.to_string())?;
    let v: Vec<u64> = msg.split_whitespace().filter_map(|s| s.parse().ok()).collect();
    let [bytes, to, len, sum] = v[..] else { return Err(format!("bad message {msg:?}")) };
    let fd = fds.pop().ok_or("no fd received")?;
    let gpu = Gpu::open(to as usize).map_err(e)?;
    let p = gpu.import_pool(&fd, bytes as usize).map_err(e)?;
    let block = p.range().sub(0, len as usize).map_err(e)?;
    let t = Instant::now();
    let got = gpu.kvsum64(block).map_err(e)?;
    let took = t.elapsed();
    if got != sum {
        let _ = sock.write_all(format!("bad checksum {got:#x} != {sum:#x}").as_bytes());
        return Err("checksum of the lent block differs".into());
    }
    gpu.copy_to_device(p.range().sub(len as usize, 4096).map_err(e)?, &[0xA5; 4096]).map_err(e)?;
    gpu.synchronize().map_err(e)?;
    sock.write_all(format!("ok (in-place checksum in {took:?})").as_bytes()).map_err(|x| x.to_string())?;
    Ok(())
}

fn shapes(rng: &mut Rng, layout: Layout, dtype: DType) -> PagedKv {
    PagedKv {
        layout,
        dtype,
        num_layers: 1 + rng.below(6),
        num_blocks: 2 + rng.below(9),
        block_tokens: 1 + rng.below(20),
        kv_heads: 1 + rng.below(5),
        head_dim: [1, 3, 8, 16, 64, 72, 128][rng.below(7)],
    }
}

/// Every kernel against its CPU reference: gather of random pages into
/// slots of a pool, scatter back into zeroed tensors.
fn kernels(gpu: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let layouts = [Layout::Nhd, Layout::Hnd, Layout::FlashInfer, Layout::Mla, Layout::CrossLayer];
    let mut cases = 0;
    let p = gpu.alloc_pool(64 << 20).map_err(e)?;
    for layout in layouts {
        for dtype in [DType::F16, DType::Bf16, DType::Fp8] {
            for _ in 0..4 {
                let s = shapes(rng, layout, dtype);
                let (n, bytes) = s.tensors().map_err(|x| x.to_string())?;
                let block = s.block_bytes().map_err(|x| x.to_string())?;
                let host: Vec<Vec<u8>> = (0..n).map(|_| rng.bytes(bytes)).collect();
                let dev: Vec<_> = (0..n).map(|_| gpu.alloc(bytes)).collect::<Result<_, _>>().map_err(e)?;
                for (d, h) in dev.iter().zip(&host) {
                    gpu.copy_to_device(d.range(), h).map_err(e)?;
                }
                let tensors: Vec<DeviceRange> = dev.iter().map(|d| d.range()).collect();
                let stride = (64 + block + 64).next_multiple_of(64);
                let pages: Vec<usize> = (0..1 + rng.below(s.num_blocks)).map(|_| rng.below(s.num_blocks)).collect();
                let pairs: Vec<(usize, DeviceRange)> = pages
                    .iter()
                    .enumerate()
                    .map(|(i, &pg)| p.range().sub(i * stride + 64, block).map(|r| (pg, r)))
                    .collect::<Result<_, _>>()
                    .map_err(e)?;
                gpu.gather(&s, &tensors, &pairs).map_err(e)?;
                let views: Vec<&[u8]> = host.iter().map(|t| &t[..]).collect();
                for (pg, r) in &pairs {
                    let mut want = vec![0u8; block];
                    s.gather(&views, *pg, &mut want).map_err(|x| x.to_string())?;
                    let mut got = vec![0u8; block];
                    gpu.copy_to_host(&mut got, *r).map_err(e)?;
                    if got != want {
                        return Err(format!("gather {s:?} page {pg}: differs from the CPU reference"));
                    }
                }
                // Scatter the first gathered slot into page `dst` of zeroed tensors.
                let dst = rng.below(s.num_blocks);
                for d in &dev {
                    gpu.copy_to_device(d.range(), &vec![0u8; bytes]).map_err(e)?;
                }
                gpu.scatter(&s, &tensors, &[(dst, pairs[0].1)]).map_err(e)?;
                let mut slot = vec![0u8; block];
                gpu.copy_to_host(&mut slot, pairs[0].1).map_err(e)?;
                let mut want: Vec<Vec<u8>> = vec![vec![0u8; bytes]; n];
                let mut wv: Vec<&mut [u8]> = want.iter_mut().map(|t| &mut t[..]).collect();
                s.scatter(&slot, dst, &mut wv).map_err(|x| x.to_string())?;
                for (i, d) in dev.iter().enumerate() {
                    let mut got = vec![0u8; bytes];
                    gpu.copy_to_host(&mut got, d.range()).map_err(e)?;
                    if got != want[i] {
                        return Err(format!("scatter {s:?} page {dst}: tensor {i} differs from the CPU reference"));
                    }
                }
                cases += 1;
            }
        }
    }
    Ok(format!("{cases} random shapes (5 layouts x 3 dtypes): gather and scatter equal to the CPU reference"))
}

/// Bandwidth of gather, scatter and pool-to-pool copies, each as a ratio of
/// a plain device-to-device copy of the same bytes in the same run.
fn bandwidth(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<Value>, String> {
    let mut rows = Vec::new();
    // (name, shape): a 256 KiB and a 2 MiB block of a Llama-8B-like model
    // (8 KV heads of 128, fp16), vLLM's NHD, and the same in HND.
    let base = PagedKv {
        layout: Layout::Nhd,
        dtype: DType::F16,
        num_layers: 32,
        num_blocks: 128,
        block_tokens: 2,
        kv_heads: 8,
        head_dim: 128,
    };
    let cases = [
        ("nhd-256k", base),
        ("nhd-2m", PagedKv { block_tokens: 16, ..base }),
        ("hnd-2m", PagedKv { block_tokens: 16, layout: Layout::Hnd, ..base }),
        (
            "mla-576k",
            PagedKv { layout: Layout::Mla, num_layers: 61, block_tokens: 8, head_dim: 576, kv_heads: 1, ..base },
        ),
    ];
    let pages = 64usize;
    let reps = 10;
    for (name, s) in cases {
        let (n, bytes) = s.tensors().map_err(|x| x.to_string())?;
        let block = s.block_bytes().map_err(|x| x.to_string())?;
        let dev: Vec<_> = (0..n).map(|_| gpu.alloc(bytes)).collect::<Result<_, _>>().map_err(e)?;
        let fill = rng.bytes(bytes.min(1 << 20));
        for d in &dev {
            gpu.copy_to_device(d.range().sub(0, fill.len()).map_err(e)?, &fill).map_err(e)?;
        }
        let tensors: Vec<DeviceRange> = dev.iter().map(|d| d.range()).collect();
        let stride = (64 + block + 64).next_multiple_of(64);
        let pool = gpu.alloc_pool(stride * pages).map_err(e)?;
        let pool2 = gpu.alloc_pool(stride * pages).map_err(e)?;
        let pairs: Vec<(usize, DeviceRange)> = (0..pages)
            .map(|i| pool.range().sub(i * stride + 64, block).map(|r| (i % s.num_blocks, r)))
            .collect::<Result<_, _>>()
            .map_err(e)?;
        let total = block * pages;
        let a = gpu.alloc(total).map_err(e)?;
        let b = gpu.alloc(total).map_err(e)?;
        let base_ms = gpu.time_ms(reps, || gpu.copy_device(b.range(), a.range(), total)).map_err(e)?;
        let gbps = |ms: f64| (total * reps) as f64 / (ms / 1e3) / 1e9;
        let base = gbps(base_ms);
        let mut row = |op: &str, ms: f64, target: Option<f64>| {
            let g = gbps(ms);
            rows.push(json!({"op": op, "shape": name, "block_bytes": block, "pages": pages,
                "gbps": g, "baseline_gbps": base, "ratio": g / base, "target": target}));
        };
        let ms = gpu.time_ms(reps, || gpu.gather(&s, &tensors, &pairs)).map_err(e)?;
        row("gather", ms, Some(0.8));
        let ms = gpu.time_ms(reps, || gpu.scatter(&s, &tensors, &pairs)).map_err(e)?;
        row("scatter", ms, Some(0.8));
        let copy = |check: bool| -> Result<(), GpuError> {
            for i in 0..pages {
                let src = pool.range().sub(i * stride, stride)?;
                let dst = pool2.range().sub(i * stride, stride)?;
                gpu.copy_device(dst, src, stride)?;
                if check {
                    gpu.kvsum64(dst.sub(64, block)?)?;
                }
            }
            Ok(())
        };
        let ms = gpu.time_ms(reps, || copy(false)).map_err(e)?;
        row("pool-to-pool copy (a cuMemcpy per slot)", ms, Some(0.8));
        let ms = gpu.time_ms(reps, || copy(true)).map_err(e)?;
        row("pool-to-pool copy + kvsum64 validation", ms, None);
        let ms = gpu.time_ms(reps, || pairs.iter().try_for_each(|(_, r)| gpu.kvsum64(*r).map(|_| ()))).map_err(e)?;
        row("kvsum64 alone", ms, None);
    }
    Ok(rows)
}
