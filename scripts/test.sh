#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what is
# missing, checks formatting, lints, the unsafe policy, runs every test and
# a small smoke run of the benchmark (correctness only, no timing).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
# One build from clean: incremental caches would double the disk it takes
# (CI's free disk varies; a full run once ran out of it).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# A check that cannot run is a failure in CI (CI=true), a warning elsewhere.
skipped() {
    echo "$1" >&2
    if [[ "${CI:-}" == "true" ]]; then
        echo "CI=true: a skipped check is a failure" >&2
        exit 1
    fi
}
echo "== format" >&2
if cargo fmt --version >/dev/null 2>&1; then
    cargo fmt --all -- --check
else
    skipped "rustfmt not installed; skipping the format check"
fi
echo "== unsafe policy" >&2
scripts/check-unsafe.sh
echo "== clippy" >&2
if cargo clippy --version >/dev/null 2>&1; then
    cargo clippy --workspace --all-targets --locked -- -D warnings
else
    skipped "clippy not installed; skipping lints"
fi
echo "== tests" >&2
cargo test --workspace --locked
echo "== Python package: built from source with pip into target/pyvenv, pytest against a real kvmeshd" >&2
scripts/python-test.sh
# The connector's load path end to end on a small prefix (bytes checked; timing ignored).
target/pyvenv/bin/python python/bench_connector.py target/debug/kvmeshd --blocks 4 --rounds 1 --iters 1 | cut -c1-200 >&2
echo "== CUDA kernels: the source compiles with NVRTC (from the Python registry; no GPU or driver needed)" >&2
if [[ ! -d target/nvrtc/nvidia ]]; then
    target/pyvenv/bin/python -m pip install -q --disable-pip-version-check --target target/nvrtc "nvidia-cuda-nvrtc>=13,<14" ||
        skipped "could not install nvidia-cuda-nvrtc; the kernels' NVRTC compile check did not run"
fi
nvrtc_lib=$(find target/nvrtc -name 'libnvrtc.so.*' -printf '%h\n' 2>/dev/null | head -1)
if [[ -n "$nvrtc_lib" ]]; then
    LD_LIBRARY_PATH="$PWD/$nvrtc_lib" KVMESH_REQUIRE_NVRTC=1 cargo test --locked -q -p kvmesh-kernels --lib kernels_compile_with_nvrtc
else
    skipped "no libnvrtc under target/nvrtc; the kernels' NVRTC compile check did not run"
fi
echo "== coherence simulator: 1000 seeds, then each planted bug must be caught" >&2
cargo build --locked --release -q -p kvmesh-cluster-tests --bin kvmesh-sim
target/release/kvmesh-sim --seeds 1000 | tail -1
target/release/kvmesh-sim --seeds 1000 --membership etcd | tail -1
echo "== coherence simulator at scale: 100,000 keys on 3 nodes, full-scan checks every 1000 events" >&2
target/release/kvmesh-sim --seeds 3 --nodes 3 --background 100000 --check-every 1000 | tail -1
target/release/kvmesh-sim --seeds 2 --nodes 3 --background 100000 --check-every 1000 --membership etcd | tail -1
# Each planted bug must be caught by an invariant it breaks (skipping the
# ack wait breaks S1, S3 and REG; whichever the run meets first).
for planted in skip-ack-wait:S1/S3/REG ack-without-invalidate:S3/REG skip-validation:DATA reuse-granted-slot:S4 \
    coordinator-no-wait:M1 etcd-short-ttl:M1 leave-before-stop:M1 lookup-counts-pending-put:LOOKUP \
    take-late-registration:REG/S1/S3 early-valid-across-epochs:REG/S1/S3 capacity-per-keepalive:CAP \
    incarnation-per-keepalive:INC table-misses-dropped-copy:TABLE; do
    bug=${planted%%:*}
    invariants=${planted##*:}
    # A late registration needs a calm seed (long epochs), a stream that
    # breaks in the millisecond between a read and its registration, and a
    # read-mostly key fetched again before the held batch lands: about one
    # seed in 200-300 of 20,000 events before locate-time registration
    # (seed 206); a late duplicate locate meets it far more often since
    # (seed 1).
    args=(--seeds 1000)
    [[ $bug == take-late-registration ]] && args=(--seeds 300 --steps 20000)
    rc=0
    out=$(target/release/kvmesh-sim "${args[@]}" --inject-bug "$bug") || rc=$?
    if [[ $rc -ne 1 ]]; then
        echo "planted bug $bug was NOT caught (kvmesh-sim exit $rc)" >&2
        exit 1
    fi
    line=$(echo "$out" | grep -m1 '^seed=')
    echo "$line" >&2
    inv=$(sed -E 's/^seed=[0-9]+ violation ([A-Z0-9]+):.*/\1/' <<<"$line")
    if [[ "/$invariants/" != *"/$inv/"* ]]; then
        echo "planted bug $bug was caught by $inv, not by $invariants" >&2
        exit 1
    fi
done
echo "== benchmark smoke run (small pools; verifies content, ignores timing)" >&2
cargo run --locked -q -p kvmesh-bench -- local --json --pool-mib 32 --block-kib 64,256 --bytes-mib 64 --pin-batches-min 4 >/dev/null
echo "== coherence benchmark smoke run (3 daemons, 600 keys; checks wrong_reads, ignores timing)" >&2
out=$(cargo run --locked -q -p kvmesh-bench -- coherence --json --daemons 3 --keys 600 --no-baseline | tail -1)
echo "$out" >&2
if ! grep -q '"wrong_reads":0' <<<"$out"; then
    echo "coherence bench: wrong reads (or no result)" >&2
    exit 1
fi
echo "== scale benchmark smoke run (2 daemons, small levels; verifies bytes and invalidations, ignores timing)" >&2
cargo run --locked -q -p kvmesh-bench -- scale --json --blocks 2000,4000 --samples 40 --idle-s 1 >/dev/null
echo "== bindings benchmark smoke run (C and Python sides against a daemon; checks hits, ignores timing)" >&2
cargo build --locked -q -p kvmesh-capi
cargo run --locked -q -p kvmesh-bench -- bindings --json --block-kib 64 --iters 2 --rounds 1 >/dev/null
echo "== breakdown benchmark smoke run (sm, 64 KiB; checks every stage was measured, ignores timing)" >&2
out=$(cargo run --locked -q -p kvmesh-bench -- breakdown --json --transports sm --block-kib 64 --calls 20 --batch 4 | tail -1)
echo "$out" | cut -c1-300 >&2
for field in locate_mean_us read_mean_us register_mean_us move_mean_us_per_batch; do
    if [[ $(grep -o "\"$field\":[0-9]" <<<"$out" | wc -l) -ne 2 ]]; then
        echo "breakdown bench: $field missing or not a number in a row" >&2
        exit 1
    fi
done
echo "== peers benchmark smoke run (kvmesh tcp and sm, Redis; 64 KiB; fails on any wrong byte, ignores timing)" >&2
out=$(cargo run --locked -q -p kvmesh-bench -- peers --json --systems kvmesh-tcp,kvmesh-sm,redis --block-kib 64 --batches 1,4 --samples 20 --rounds 2 | tail -1)
echo "$out" | cut -c1-300 >&2
if [[ $(grep -o '"wrong_bytes":0' <<<"$out" | wc -l) -ne 6 ]]; then
    echo "peers bench: a row missing or with wrong bytes" >&2
    exit 1
fi
echo "== peers and transfer with --split-cpus 0:0 (the placement path: taskset on every process; fails on wrong bytes)" >&2
out=$(cargo run --locked -q -p kvmesh-bench -- peers --json --systems kvmesh-sm,redis --block-kib 64 --batches 1 --samples 10 --rounds 1 --split-cpus 0:0 | tail -1)
if [[ $(grep -o '"wrong_bytes":0' <<<"$out" | wc -l) -ne 2 || $out != *'"split_cpus":"0:0"'* ]]; then
    echo "peers bench with --split-cpus: $out" >&2
    exit 1
fi
out=$(cargo run --locked -q -p kvmesh-bench -- transfer --json --transports sm --block-kib 64 --bytes-mib 8 --pool-mib 16 --no-perftest --split-cpus 0:0 | tail -1)
if [[ $out != *'"split_cpus":"0:0"'* || $out != *'"ratio_raw"'* ]]; then
    echo "transfer bench with --split-cpus: $out" >&2
    exit 1
fi
echo "== rpc benchmark smoke run (gRPC and the fast path on one daemon; fails if the fast path is not offered)" >&2
cargo run --locked -q -p kvmesh-bench -- rpc --calls 20 | tail -1 | cut -c1-200 >&2
# KV events under a paced put load: the bench fails on any gap in the sequence numbers.
cargo run --locked -q -p kvmesh-bench -- events --rate 2000 --seconds 0.5 --rounds 1 | tail -1 | cut -c1-200 >&2
cargo run --locked -q -p kvmesh-bench -- events --rate 2000 --seconds 0.5 --rounds 1 --daemons 3 | tail -1 | cut -c1-200 >&2
# Cluster-wide lookups on a small filled cluster: the bench fails on any answer
# that names the wrong daemon, on an incomplete answer, or on a fetch.
cargo run --locked -q -p kvmesh-bench -- lookup --daemons 3 --fill 2000 --batch 16 --samples 60 --rounds 2 | tail -1 | cut -c1-200 >&2
echo "== nemesis: 3 daemons and etcd in network namespaces, 60 s of partitions, pauses, kills, drains, pool pressure, with namespace invalidations, twice (mutual TLS: coherence on gRPC streams; without: as UCX active messages), 30 s with every pool staged (the GPU data path on host pools); then with a planted bug" >&2
cargo build --locked -q -p kvmesh-cluster-tests --bin kvmesh-nemesis
cargo build --locked -q -p kvmeshd --bin kvmeshd --bin kvmesh
rc=0
out=$(target/debug/kvmesh-nemesis --kvmeshd target/debug/kvmeshd --daemons 3 --minutes 1 --seed 1 --tls | tail -1) || rc=$?
echo "$out" | cut -c1-300 >&2
if [[ $rc -eq 0 ]]; then
    out=$(target/debug/kvmesh-nemesis --kvmeshd target/debug/kvmeshd --daemons 3 --minutes 1 --seed 3 --peer-control ucx | tail -1) || rc=$?
    echo "$out" | cut -c1-300 >&2
fi
if [[ $rc -eq 0 ]]; then
    # Every pool staged as GPU pools are without a CUDA-capable UCX (blocks
    # through host staging slots, sent on orders), under the same faults.
    out=$(KVMESH_TEST_HOOK=stage-host-pools target/debug/kvmesh-nemesis --kvmeshd target/debug/kvmeshd --daemons 3 \
        --minutes 0.5 --seed 4 | tail -1) || rc=$?
    echo "staged: $out" | cut -c1-300 >&2
fi
if [[ $rc -eq 77 ]]; then
    skipped "nemesis: $out"
elif [[ $rc -ne 0 ]]; then
    echo "nemesis found wrong bytes, stale reads or lost puts, or the cluster did not heal (exit $rc)" >&2
    exit 1
else
    # The checker must be able to fail: with acks sent before invalidating,
    # it finds stale reads.
    rc=0
    out=$(target/debug/kvmesh-nemesis --kvmeshd target/debug/kvmeshd --daemons 3 --minutes 0.25 --seed 2 \
        --plant-bug ack-without-invalidate 2>/dev/null | tail -1) || rc=$?
    if [[ $rc -ne 1 ]] || ! grep -q '"stale_reads":[1-9]' <<<"$out"; then
        echo "nemesis did NOT catch the planted bug (exit $rc): $out" >&2
        exit 1
    fi
    echo "planted ack-without-invalidate caught: $(grep -o '"stale_reads":[0-9]*' <<<"$out")" >&2
fi
echo "== Debian package: build, install (dpkg -i), run as the kvmesh user, drain, purge" >&2
bash scripts/test-deb.sh
echo "== disk: target/ holds $(du -sh target 2>/dev/null | cut -f1); $(df -h --output=avail . | tail -1 | tr -d ' ') left" >&2
echo "== all tests passed" >&2
