#!/usr/bin/env bash
# Create (once) the virtualenv used by bench/mooncake/driver.py.
# Idempotent: re-running with a working venv only prints where it is.
#   KVMESH_MOONCAKE_VENV   venv location (default ~/.cache/kvmesh/mooncake-venv)
#   KVMESH_MOONCAKE_PKG    pip requirement (default mooncake-transfer-engine-non-cuda)
# Prints the venv path as the last line on stdout; logs go to stderr.
set -euo pipefail

VENV="${KVMESH_MOONCAKE_VENV:-$HOME/.cache/kvmesh/mooncake-venv}"
PKG="${KVMESH_MOONCAKE_PKG:-mooncake-transfer-engine-non-cuda}"
PY="${PYTHON:-python3}"

check() {
    "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import numpy
from mooncake.store import MooncakeDistributedStore
PY
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "mooncake venv already set up: $VENV" >&2
    echo "$VENV"
    exit 0
fi

echo "creating mooncake venv at $VENV" >&2
mkdir -p "$(dirname "$VENV")"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV" >&2
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip >&2 || true
"$VENV/bin/python" -m pip install --quiet "$PKG" numpy >&2

if ! check; then
    echo "error: $PKG installed but 'from mooncake.store import MooncakeDistributedStore' fails:" >&2
    "$VENV/bin/python" -c 'from mooncake.store import MooncakeDistributedStore' >&2 || true
    exit 1
fi
ver="$("$VENV/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$PKG" 2>/dev/null || echo unknown)"
echo "installed $PKG $ver into $VENV" >&2
echo "$VENV"
