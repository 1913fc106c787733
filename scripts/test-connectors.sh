#!/usr/bin/env bash
# The engine connectors inside the engines themselves (heavy: not part of
# scripts/test.sh). One virtualenv per engine (they pin different PyTorch
# builds; each is the CUDA build from the Python package registry, ~4 GB,
# and runs on CPU here), ./python built and installed into each, kvmeshd
# built, then:
#   - vLLM (python/tests/test_vllm_engine.py): vLLM's own Scheduler with
#     KvmeshConnector loaded from kv_connector_module_path, two engine
#     processes with different PYTHONHASHSEED sharing one daemon;
#   - SGLang (python/tests/test_sglang_engine.py): KvmeshStorage created by
#     SGLang's StorageBackendFactory ("dynamic" backend) over SGLang's host
#     pool, a writer and a reader process.
#
#   scripts/test-connectors.sh                 # both; venvs in ~/.cache/kvmesh
#   scripts/test-connectors.sh vllm|sglang     # one
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
CACHE=${KVMESH_ENGINES_CACHE:-$HOME/.cache/kvmesh}
PY=${PYTHON:-python3}
which=${1:-all}
case $which in
all | vllm | sglang) ;;
*)
    echo "usage: scripts/test-connectors.sh [all|vllm|sglang]" >&2
    exit 2
    ;;
esac

venv() { # name package version -> prints the venv's python
    local dir="$CACHE/$1-venv" pkg=$2 version=$3
    [[ -x "$dir/bin/python" ]] || "$PY" -m venv "$dir"
    if ! "$dir/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$pkg') != '$version')" 2>/dev/null; then
        echo "test-connectors: installing $pkg $version into $dir (several GB, once)" >&2
        "$dir/bin/python" -m pip install -q --disable-pip-version-check "$pkg==$version" >&2
    fi
    "$dir/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.9.4,<2" "pytest>=7" >&2
    PATH="$dir/bin:$PATH" PYO3_PYTHON="$dir/bin/python" MATURIN_PEP517_ARGS="--profile dev --locked" \
        "$dir/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
        --force-reinstall ./python >&2
    echo "$dir/bin/python"
}

# SGLang compiles its page-hash extension at first use (torch's JIT: g++,
# ninja from its virtualenv, OpenSSL's libcrypto headers).
need=()
for p in g++ libssl-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
    echo "test-connectors: installing ${need[*]}" >&2
    SUDO=""
    [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
cargo build --locked -q -p kvmeshd --bin kvmeshd
export KVMESHD="$PWD/target/debug/kvmeshd"
if [[ $which == all || $which == vllm ]]; then
    py=$(venv vllm vllm "$VLLM_VERSION")
    "$py" -c "import torch, vllm" # the tests skip without them: here that is a failure
    PATH="$(dirname "$py"):$PATH" "$py" -m pytest -q -rs python/tests/test_vllm_engine.py
fi
if [[ $which == all || $which == sglang ]]; then
    py=$(venv sglang sglang "$SGLANG_VERSION")
    "$py" -c "import torch, sglang"
    PATH="$(dirname "$py"):$PATH" "$py" -m pytest -q -rs python/tests/test_sglang_engine.py
fi
