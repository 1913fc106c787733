#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what is
# missing, checks formatting, lints, the unsafe policy, runs every test and
# a small smoke run of the benchmark (correctness only, no timing).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"

echo "== format" >&2
if cargo fmt --version >/dev/null 2>&1; then
    cargo fmt --all -- --check
else
    echo "rustfmt not installed; skipping the format check" >&2
fi
echo "== unsafe policy" >&2
scripts/check-unsafe.sh
echo "== clippy" >&2
if cargo clippy --version >/dev/null 2>&1; then
    cargo clippy --workspace --all-targets --locked -- -D warnings
else
    echo "clippy not installed; skipping lints" >&2
fi
echo "== tests" >&2
cargo test --workspace --locked
echo "== benchmark smoke run (small pools; verifies content, ignores timing)" >&2
cargo run --locked -q -p kvmesh-bench -- local --json --pool-mib 32 --block-kib 64,256 --bytes-mib 64 --pin-batches-min 4 >/dev/null
echo "== all tests passed" >&2
