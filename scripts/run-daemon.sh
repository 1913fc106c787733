#!/usr/bin/env bash
# Builds and runs kvmeshd (release) on its embedded default config, after
# installing what is missing. Extra arguments go to kvmeshd, e.g.
#   scripts/run-daemon.sh --config /etc/kvmesh/kvmeshd.toml
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --locked --release -p kvmeshd --bins
exec target/release/kvmeshd "$@"
