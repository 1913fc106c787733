#!/usr/bin/env bash
# Installs what building and testing kvmesh needs on a Debian machine, only
# where it is missing. Idempotent; safe to run on every build.
set -euo pipefail

# Debian packages: a C toolchain (linker for Rust, cc for -sys crates),
# pkg-config, UCX (libucx-dev >= 1.13; ucx-utils for ucx_perftest), libclang
# (bindgen generates the UCX and rdma-core bindings at build time) and
# rdma-core's headers (topology discovery); protoc (the etcd-client crate
# compiles etcd's protos at build time) and etcd itself (the membership
# tests start a real one on loopback); DejaVu Sans (the replay plots' PNG text)
# and redis-server (the replay's baseline store); prometheus for promtool (the
# metrics and alert-rule checks), systemd for systemd-analyze (the unit check),
# adduser and python3 (the Debian package's install test).
PACKAGES=(gcc libc6-dev pkg-config libucx-dev ucx-utils libclang-dev libibverbs-dev librdmacm-dev
    protobuf-compiler etcd-server fonts-dejavu-core redis-server prometheus systemd adduser python3)

missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}" >&2
    SUDO=""
    if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Rust: edition 2024 and File::try_lock need rustc >= 1.89.
if ! command -v cargo >/dev/null 2>&1 && [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: no cargo found; installing the stable Rust toolchain with rustup" >&2
    if ! command -v curl >/dev/null 2>&1; then
        SUDO=""; if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
        $SUDO apt-get install -y -qq --no-install-recommends curl ca-certificates
    fi
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component clippy,rustfmt
    export PATH="$HOME/.cargo/bin:$PATH"
fi
# The format check and the lints need rustfmt and clippy: add them where
# cargo came without (rustup toolchains only; a distribution cargo cannot).
for comp in rustfmt clippy; do
    probe=$([[ $comp == rustfmt ]] && echo "cargo fmt --version" || echo "cargo clippy --version")
    if ! $probe >/dev/null 2>&1 && command -v rustup >/dev/null 2>&1; then
        echo "setup: installing the $comp component with rustup" >&2
        rustup component add "$comp" >&2 || true
    fi
done
ver=$(rustc --version | awk '{print $2}')
if [[ "$(printf '%s\n1.89.0\n' "$ver" | sort -V | head -1)" != "1.89.0" ]]; then
    echo "setup: rustc $ver is too old; kvmesh needs 1.89 or newer (rustup update stable)" >&2
    exit 1
fi
