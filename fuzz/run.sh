#!/usr/bin/env bash
# Coverage-guided fuzzing of every target (libFuzzer through cargo-fuzz, on
# the nightly toolchain), each for SECONDS (default 120), growing the corpora
# in fuzz/corpus/, then minimising them (cargo fuzz cmin). A crash leaves
# its input in fuzz/libfuzzer/artifacts/<target>/ and stops the script.
#   fuzz/run.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-120}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(batch_decode core_batches peer_messages engine_messages config trace)
rustup toolchain list | grep -q nightly || { echo "fuzz/run.sh needs the nightly toolchain (rustup toolchain install nightly)" >&2; exit 2; }
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
# Build output under the main target directory (ignored, and outside what
# the source checks read).
export CARGO_TARGET_DIR="$PWD/target/fuzz"
# Seeds first (no-op when the corpora exist).
KVMESH_FUZZ_WRITE_SEEDS=1 cargo test -q -p kvmesh-fuzz-targets --test smoke write_seeds_when_asked >/dev/null
for t in "${targets[@]}"; do
    echo "== $t: ${secs}s"
    cargo +nightly fuzz run --fuzz-dir fuzz/libfuzzer "$t" "fuzz/corpus/$t" -- \
        -max_total_time="$secs" -max_len=4096 -rss_limit_mb=4096 2>&1 \
        | grep -E "^#[0-9]+ *(DONE|pulse)|Done|ERROR|panicked|SUMMARY" | tail -3
    cargo +nightly fuzz cmin --fuzz-dir fuzz/libfuzzer "$t" "fuzz/corpus/$t" >/dev/null 2>&1 || true
done
