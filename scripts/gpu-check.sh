#!/usr/bin/env bash
# The device check of the GPU paths (issue 15), in two halves:
#
#   scripts/gpu-check.sh --build   here, with cargo: builds the release
#       kvmesh-gpu-check (stripped) and the Python package's native module
#       into target/gpu-check/ (a few MiB; carry that folder to the GPU
#       machine, e.g. the device tool's `carry`).
#   scripts/gpu-check.sh           on a machine with an NVIDIA GPU, its
#       driver, and no Rust toolchain: finds libnvrtc (CUDA toolkit, or the
#       nvidia-* wheels PyTorch brings), runs kvmesh-gpu-check and, if torch
#       is there, python/gpu_check.py (kernels on torch tensors) and
#       python/gpu_daemon_check.py against a kvmeshd with a GPU pool (put,
#       pin read in place with torch, verify, zero-copy put, a second
#       process reading the lent pool), and python/gpu_cluster_check.py
#       (two kvmeshd with GPU pools on loopback tcp: GPU blocks fetched
#       from one by the other through host staging slots). Prints a JSON
#       last line, valid whatever a part printed (a part whose last line is
#       not JSON — a panic, a timeout — is carried as a string); a few
#       minutes, at most 8.5 when every part runs into its timeout (under
#       the device tool's 10 minutes a command). Exit 0 ok, 1 a check
#       failed, 77 no GPU here (skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${KVMESH_GPU_BUNDLE:-target/gpu-check}

if [[ "${1:-}" == "--build" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
    rm -rf "$BUNDLE"
    mkdir -p "$BUNDLE/python"
    cargo build --locked --release -q -p kvmesh-kernels --bin kvmesh-gpu-check
    cargo build --locked --release -q -p kvmeshd --bin kvmeshd
    cp target/release/kvmesh-gpu-check target/release/kvmeshd "$BUNDLE/"
    strip "$BUNDLE/kvmesh-gpu-check" "$BUNDLE/kvmeshd"
    # The GPU machine has no UCX or rdma-core: carry the shared libraries
    # kvmeshd links (all but glibc's own), used only for kvmeshd there.
    mkdir -p "$BUNDLE/lib"
    ldd "$BUNDLE/kvmeshd" | awk '/=> \//{print $1, $3}' | while read -r name path; do
        case "$name" in libc.so*|libm.so*|libgcc_s.so*|ld-linux*|libpthread.so*|libdl.so*|librt.so*) continue ;; esac
        cp -L "$path" "$BUNDLE/lib/$name"
    done
    PROFILE=release scripts/python-test.sh --install-only
    site=$(target/pyvenv/bin/python -c 'import kvmesh, os; print(os.path.dirname(kvmesh.__file__))')
    cp -r "$site" "$BUNDLE/python/kvmesh"
    find "$BUNDLE/python" -name '__pycache__' -prune -exec rm -rf {} +
    find "$BUNDLE/python" -name '*.so' -exec strip {} \;
    cp python/gpu_check.py python/gpu_daemon_check.py python/gpu_connector_check.py python/gpu_cluster_check.py \
        "$BUNDLE/python/"
    du -sh "$BUNDLE" >&2
    echo "gpu-check: bundle in $BUNDLE" >&2
    exit 0
fi

if [[ ! -x "$BUNDLE/kvmesh-gpu-check" ]]; then
    echo "gpu-check: no $BUNDLE/kvmesh-gpu-check; run scripts/gpu-check.sh --build where cargo is" >&2
    exit 2
fi

# libnvrtc: the CUDA toolkit's, or the one the nvidia-* Python wheels bring.
dirs=()
for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/local/cuda-*/lib64 /usr/lib/x86_64-linux-gnu; do
    compgen -G "$d/libnvrtc.so*" >/dev/null && dirs+=("$d")
done
if command -v python3 >/dev/null; then
    while IFS= read -r d; do dirs+=("$d"); done < <(python3 - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
seen = set()
for r in roots:
    for f in glob.glob(os.path.join(r, "nvidia", "**", "libnvrtc.so*"), recursive=True):
        d = os.path.dirname(f)
        if d not in seen:
            seen.add(d)
            print(d)
PY
)
fi
if ((${#dirs[@]})); then
    LD_LIBRARY_PATH="$(IFS=:; echo "${dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
    echo "gpu-check: libnvrtc from ${dirs[*]}" >&2
else
    echo "gpu-check: no libnvrtc found (the kernels' checks will fail with NVRTC errors)" >&2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true

set +e
rust_out=$(timeout 150 "$BUNDLE/kvmesh-gpu-check")
rust_rc=$?
set -e
printf '%s\n' "$rust_out" | sed '$d'
rust_json=$(printf '%s\n' "$rust_out" | tail -1)
py_json='{"check":"python-gpu","skipped":"python3 missing"}'
py_rc=77
if command -v python3 >/dev/null; then
    set +e
    py_json=$(PYTHONPATH="$BUNDLE/python" timeout 60 python3 "$BUNDLE/python/gpu_check.py" | tail -1)
    py_rc=$?
    set -e
fi
echo "python: $py_json" >&2

# The daemon with a GPU pool, and the Python client against it.
dm_json='{"check":"daemon-gpu","skipped":"no GPU driver (the Rust check skipped)"}'
dm_rc=77
cn_json='{"check":"connector-gpu","skipped":"no GPU driver (the Rust check skipped)"}'
cn_rc=77
if [[ $rust_rc -ne 77 ]] && command -v python3 >/dev/null; then
    dir=$(mktemp -d)
    cat >"$dir/kvmeshd.toml" <<TOML
[server]
socket = "$dir/kvmeshd.sock"
[[pools]]
name = "gpu0"
device = "cuda:${KVMESH_GPU:-0}"
bytes = "256MiB"
slot_payload_bytes = 1048576
[[pools]]
name = "host0"
bytes = "64MiB"
slot_payload_bytes = 1048576
mlock = false
TOML
    LD_LIBRARY_PATH="$PWD/$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$BUNDLE/kvmeshd" --config "$dir/kvmeshd.toml" >"$dir/kvmeshd.log" 2>&1 &
    dpid=$!
    for _ in $(seq 100); do [[ -S "$dir/kvmeshd.sock" ]] && break; sleep 0.1; done
    set +e
    dm_json=$(PYTHONPATH="$BUNDLE/python" timeout 90 python3 "$BUNDLE/python/gpu_daemon_check.py" "$dir/kvmeshd.sock" | tail -1)
    dm_rc=$?
    cn_json=$(PYTHONPATH="$BUNDLE/python" timeout 90 python3 "$BUNDLE/python/gpu_connector_check.py" "$dir/kvmeshd.sock" | tail -1)
    cn_rc=$?
    set -e
    kill "$dpid" 2>/dev/null || true
    wait "$dpid" 2>/dev/null || true
    if [[ $dm_rc -ne 0 && $dm_rc -ne 77 ]] || [[ $cn_rc -ne 0 && $cn_rc -ne 77 ]]; then
        echo "kvmeshd log:" >&2
        tail -30 "$dir/kvmeshd.log" >&2
    fi
    rm -rf "$dir"
fi
echo "daemon: $dm_json" >&2
echo "connector: $cn_json" >&2

# Two daemons with GPU pools: blocks fetched between them through host
# staging slots (UCX tcp on loopback; the bundle's UCX has no CUDA support).
cl_json='{"check":"cluster-gpu","skipped":"no GPU driver (the Rust check skipped)"}'
cl_rc=77
if [[ $rust_rc -ne 77 ]] && command -v python3 >/dev/null; then
    set +e
    cl_json=$(LD_LIBRARY_PATH="$PWD/$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONPATH="$BUNDLE/python" \
        timeout 120 python3 "$BUNDLE/python/gpu_cluster_check.py" --kvmeshd "$BUNDLE/kvmeshd" \
        --device "cuda:${KVMESH_GPU:-0}" | tail -1)
    cl_rc=$?
    set -e
fi
echo "cluster: $cl_json" >&2
ok=false
if [[ $rust_rc -eq 0 && ( $py_rc -eq 0 || $py_rc -eq 77 ) && ( $dm_rc -eq 0 || $dm_rc -eq 77 ) && ( $cn_rc -eq 0 || $cn_rc -eq 77 ) && ( $cl_rc -eq 0 || $cl_rc -eq 77 ) ]]; then ok=true; fi
# Each part's last line as JSON: as it is when it parses, else as a string
# (what a panic or a timeout left), so the line below always parses.
as_json() {
    if [[ -z "$1" ]]; then
        echo null
    elif command -v python3 >/dev/null; then
        python3 -c 'import json,sys; s=sys.argv[1]
try: json.loads(s); print(s)
except ValueError: print(json.dumps({"unparsed": s}))' "$1"
    elif [[ $1 == \{*\} ]]; then
        echo "$1"
    else
        printf '{"unparsed":"%s"}\n' "$(printf '%s' "$1" | tr -d '"\\' | tr -c '[:print:]' ' ')"
    fi
}
rust_json=$(as_json "$rust_json")
py_json=$(as_json "$py_json")
dm_json=$(as_json "$dm_json")
cn_json=$(as_json "$cn_json")
cl_json=$(as_json "$cl_json")
echo "{\"bench\":\"gpu-check-all\",\"ok\":$ok,\"rust_rc\":$rust_rc,\"python_rc\":$py_rc,\"daemon_rc\":$dm_rc,\"connector_rc\":$cn_rc,\"cluster_rc\":$cl_rc,\"rust\":$rust_json,\"python\":$py_json,\"daemon\":$dm_json,\"connector\":$cn_json,\"cluster\":$cl_json}"
if [[ $rust_rc -eq 77 ]]; then exit 77; fi
$ok
