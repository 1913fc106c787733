//! The C ABI from C: the test program `tests/c/capi_test.c` and the
//! example `examples/basic.c`, compiled with the system `cc` against
//! `include/kvmesh.h` and `libkvmesh.so`, run against a real daemon (the
//! kvmeshd server, in this test process; the C programs are separate
//! processes that connect to its socket).

use std::path::{Path, PathBuf};
use std::process::Command;

struct Daemon {
    socket: PathBuf,
    dir: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Daemon {
    fn start(tag: &str) -> Daemon {
        let dir = std::env::temp_dir().join(format!("kvmesh-capi-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("kvmeshd.sock");
        let text = format!(
            "[server]\nsocket = {:?}\n[metrics]\nlisten = \"\"\n[[pools]]\nname = \"host0\"\nbytes = \"32MiB\"\nslot_payload_bytes = \"64KiB\"\nmlock = false\n",
            socket.display().to_string()
        );
        let cfg = kvmeshd::Config::parse(&text, "capi-test.toml").expect("test config");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            rt.block_on(kvmeshd::server::run(
                cfg,
                async move {
                    let _ = rx.await;
                },
                false,
            ))
            .expect("daemon runs");
        });
        let t0 = std::time::Instant::now();
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(t0.elapsed().as_secs() < 20, "daemon did not come up");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Daemon { socket, dir, stop: Some(tx), thread: Some(thread) }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directory holding `libkvmesh.so` built for this test run.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    assert!(deps.join("libkvmesh.so").exists(), "libkvmesh.so not built next to {}", exe.display());
    deps
}

fn cc(src: &Path, out: &Path, extra: &[&str]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = lib_dir();
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-g"])
        .args(extra)
        .arg("-I")
        .arg(dir.join("include"))
        .arg(src)
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lkvmesh", "-lpthread"])
        .status()
        .expect("run the system C compiler (cc)");
    assert!(status.success(), "cc failed on {}", src.display());
}

fn run(bin: &Path, socket: &Path, env: &[(&str, &str)]) -> String {
    // The library built for this run: cargo's LD_LIBRARY_PATH (searched
    // before the binary's RUNPATH) may name target/debug, where an older
    // libkvmesh.so from a `cargo build` can lie.
    let out =
        Command::new(bin).arg(socket).env("LD_LIBRARY_PATH", lib_dir()).envs(env.iter().copied()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{} failed ({}):\n{stdout}\n{stderr}", bin.display(), out.status);
    stdout
}

#[test]
fn c_tests_pass_against_a_real_daemon() {
    let d = Daemon::start("tests");
    let bin = d.dir.join("capi_test");
    cc(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/capi_test.c"), &bin, &[]);
    let out = run(&bin, &d.socket, &[]);
    assert!(out.contains(", 0 failures"), "{out}");
    eprint!("{out}");
}

/// The kernels' entry points on host memory against a C reference of the
/// layouts (no daemon needed); device memory without a driver is
/// KVMESH_E_NO_DEVICE. Under AddressSanitizer: an access outside a buffer
/// is a failure.
#[test]
fn c_kernels_match_a_c_reference_of_the_layouts() {
    let dir = std::env::temp_dir().join(format!("kvmesh-capi-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join("kernels_test");
    cc(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/kernels_test.c"),
        &bin,
        &["-fsanitize=address", "-fno-omit-frame-pointer"],
    );
    let out = run(&bin, &dir.join("unused.sock"), &[("ASAN_OPTIONS", "detect_leaks=1:exitcode=23")]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.contains(", 0 failures"), "{out}");
    eprint!("{out}");
}

#[test]
fn c_example_runs() {
    let d = Daemon::start("example");
    let bin = d.dir.join("basic");
    cc(&Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/basic.c"), &bin, &[]);
    let out = run(&bin, &d.socket, &[]);
    assert!(out.contains("cached prefix: 4 of 4 blocks"), "{out}");
    assert_eq!(out.matches("matches: yes").count(), 4, "{out}");
}

/// The same C tests under AddressSanitizer (with LeakSanitizer): a wrong
/// pointer handed out, a double free, or a leak of the handles (or of what
/// the library allocates for them) is a failure.
#[test]
fn c_tests_are_clean_under_address_sanitizer() {
    let d = Daemon::start("asan");
    let bin = d.dir.join("capi_test_asan");
    cc(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/capi_test.c"),
        &bin,
        &["-fsanitize=address", "-fno-omit-frame-pointer"],
    );
    let out = run(&bin, &d.socket, &[("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:exitcode=23")]);
    assert!(out.contains(", 0 failures"), "{out}");
}
