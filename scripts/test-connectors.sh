#!/usr/bin/env bash
# The engine connectors inside the engines themselves (heavy: not part of
# scripts/test.sh). Makes a virtualenv with vLLM (pinned below; its CUDA
# build of PyTorch from the Python package registry, ~4 GB, runs on CPU
# here), builds and installs ./python into it, builds kvmeshd, and runs
# python/tests/test_vllm_engine.py: vLLM's own Scheduler with
# KvmeshConnector loaded from kv_connector_module_path, two engine
# processes with different PYTHONHASHSEED sharing one daemon.
#
#   scripts/test-connectors.sh            # venv in ~/.cache/kvmesh/vllm-venv
#   KVMESH_VLLM_VENV=/path scripts/test-connectors.sh
#
# SGLang is not installed here yet (see docs/ENGINES.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
VENV=${KVMESH_VLLM_VENV:-$HOME/.cache/kvmesh/vllm-venv}
PY=${PYTHON:-python3}
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
fi
pipi() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
    echo "test-connectors: installing vLLM $VLLM_VERSION into $VENV (several GB, once)" >&2
    pipi "vllm==$VLLM_VERSION"
fi
pipi "maturin>=1.9.4,<2" "pytest>=7"
PATH="$VENV/bin:$PATH" PYO3_PYTHON="$VENV/bin/python" MATURIN_PEP517_ARGS="--profile dev --locked" \
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps --force-reinstall ./python
cargo build --locked -q -p kvmeshd --bin kvmeshd
KVMESHD="$PWD/target/debug/kvmeshd" "$VENV/bin/python" -m pytest -q -rs python/tests/test_vllm_engine.py "$@"
