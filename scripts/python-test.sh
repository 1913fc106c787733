#!/usr/bin/env bash
# The Python package, from source: makes a virtualenv (target/pyvenv), installs
# maturin, pytest and numpy from the package registry, builds and installs
# ./python with pip (the PEP 517 build, Cargo.lock respected), and runs the
# pytest suite against a real kvmeshd. PROFILE=release builds an optimized
# extension (for python/bench.py); the default is the dev profile.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1 || ! "$PY" -c "import venv, ensurepip" >/dev/null 2>&1; then
    echo "python-test: installing python3 and python3-venv" >&2
    SUDO=""
    if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends python3 python3-venv python3-pip
    PY=python3
fi
VENV=target/pyvenv
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.9.4,<2" "pytest>=7" "numpy>=1.21"
profile=${PROFILE:-dev}
PATH="$PWD/$VENV/bin:$PATH" PYO3_PYTHON="$PWD/$VENV/bin/python" MATURIN_PEP517_ARGS="--profile $profile --locked" \
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps --force-reinstall ./python
if [[ "${1:-}" == "--install-only" ]]; then
    exit 0
fi
cargo build --locked -q -p kvmeshd --bin kvmeshd
KVMESHD="$PWD/target/debug/kvmeshd" "$VENV/bin/python" -m pytest -q -rs python/tests
