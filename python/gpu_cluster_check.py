"""The cluster half of scripts/gpu-check.sh: GPU blocks moving between two
daemons through host staging slots (docs/GPU.md, "Data plane between
daemons").

Starts two kvmeshd (nodes 1 and 2, UCX tcp on loopback, peer TLS off),
each with a pool on DEVICE; puts random blocks into a namespace on DEVICE
through daemon 1, pins them through daemon 2 (a remote fetch: the holder
copies each slot device -> host into a staging slot and sends it, the
getter receives into one, validates it there and copies it host ->
device), and checks the bytes (read in place on the GPU with torch), the
slots' own verification (kvsum64 computed on the GPU) and both daemons'
staging counters. Prints one JSON line; exit 0 ok, 1 failed, 77 skipped.

    python3 gpu_cluster_check.py --kvmeshd PATH [--device cuda:0|host]

`--device host` runs the same check on host pools with both daemons
started with KVMESH_TEST_HOOK=stage-host-pools (they stage host pools as
they would GPU pools): how the check itself is tested without a GPU
(python/tests/test_cluster_check.py).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

BLOCK = 1 << 20
BLOCKS = 48


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kvmeshd: str, d: str, node: int, ports, device: str, env) -> subprocess.Popen:
    other = 2 if node == 1 else 1
    host_pool = "" if device == "host" else (
        '[[pools]]\nname = "host0"\nbytes = "16MiB"\nslot_payload_bytes = 65536\nmlock = false\n'
    )
    cfg = f"""[server]
socket = "{d}/kvmeshd.sock"
[metrics]
listen = ""
[node]
id = {node}
[peer]
listen = "127.0.0.1:{ports[node - 1]}"
transports = "tcp"
staging_slots = 16
tls = {{ mode = "off" }}
[[peers]]
id = {other}
addr = "127.0.0.1:{ports[other - 1]}"
[[pools]]
name = "p0"
device = "{device}"
bytes = "128MiB"
slot_payload_bytes = {BLOCK}
mlock = false
{host_pool}"""
    with open(os.path.join(d, "kvmeshd.toml"), "w") as f:
        f.write(cfg)
    log = open(os.path.join(d, "kvmeshd.log"), "w")
    return subprocess.Popen(
        [kvmeshd, "--config", os.path.join(d, "kvmeshd.toml")], stdout=subprocess.DEVNULL, stderr=log, env=env
    )


def log_tail(d: str) -> str:
    try:
        with open(os.path.join(d, "kvmeshd.log")) as f:
            return f.read()[-1500:]
    except OSError:
        return ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvmeshd", required=True)
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args()
    gpu = a.device != "host"
    torch = None
    if gpu:
        try:
            import torch  # noqa: F811
        except ImportError as e:
            print(json.dumps({"check": "cluster-gpu", "skipped": f"{e}"}))
            return 77
        if not torch.cuda.is_available():
            print(json.dumps({"check": "cluster-gpu", "skipped": "torch sees no CUDA device"}))
            return 77
    import numpy as np

    import kvmesh

    env = dict(os.environ)
    if not gpu:
        env["KVMESH_TEST_HOOK"] = "stage-host-pools"
    ports = [free_port(), free_port()]
    dirs = [tempfile.mkdtemp(prefix=f"kvmesh-cluster-check-{n}-") for n in (1, 2)]
    procs = [start(a.kvmeshd, dirs[i], i + 1, ports, a.device, env) for i in range(2)]
    failures = []
    result = {"check": "cluster-gpu" if gpu else "cluster-staged-host", "device": a.device}
    try:
        clients = []
        t0 = time.time()
        for d, p in zip(dirs, procs):
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"kvmeshd exited {p.returncode}: {log_tail(d)}")
                try:
                    c = kvmesh.Client(os.path.join(d, "kvmeshd.sock"))
                    co = c.stats().get("coherence") or {}
                    if co.get("serving") and co.get("members") == 2 and co.get("directory_ready"):
                        clients.append(c)
                        break
                except kvmesh.KvmeshError:
                    pass
                if time.time() - t0 > 60:
                    raise RuntimeError(f"the two daemons never formed a cluster: {log_tail(d)}")
                time.sleep(0.1)
        ca, cb = clients
        dev = "" if not gpu else a.device
        na = ca.register_namespace("staged-check", BLOCK, "check", device=dev)
        nb = cb.register_namespace("staged-check", BLOCK, "check", device=dev)
        rng = np.random.default_rng(7)
        data = [rng.integers(0, 256, size=BLOCK, dtype=np.uint8) for _ in range(BLOCKS)]
        keys = [kvmesh.key(i + 1) for i in range(BLOCKS)]
        s = ca.put(na, [(k, d.tobytes()) for k, d in zip(keys, data)])
        if s.stored != BLOCKS:
            failures.append(f"put stored {s.stored} of {BLOCKS}: {s}")
        t1 = time.time()
        with cb.pin(nb, keys) as b:
            elapsed = time.time() - t1
            for i in range(BLOCKS):
                v = b[i]
                if v is None:
                    failures.append(f"block {i} not fetched")
                    continue
                if gpu:
                    if not isinstance(v, kvmesh.DeviceView):
                        failures.append(f"block {i}: {type(v).__name__}, not a DeviceView")
                        continue
                    got = torch.as_tensor(v, device=f"cuda:{v.device_id}").cpu().numpy().tobytes()
                else:
                    got = bytes(v)
                if got != data[i].tobytes():
                    failures.append(f"block {i}: bytes differ from the put")
                try:
                    b.verify(i)
                except kvmesh.KvmeshError as e:
                    failures.append(f"block {i}: verify: {e}")
        sa, sb = ca.stats(), cb.stats()
        ka, kb = sa["coherence"], sb["coherence"]
        if sb["remote_fetched"] != BLOCKS:
            failures.append(f"daemon 2 fetched {sb['remote_fetched']} blocks, {BLOCKS} expected")
        if kb["staged_reads"] != BLOCKS or ka["staged_sends"] != BLOCKS:
            failures.append(f"staged reads {kb['staged_reads']} / sends {ka['staged_sends']}, {BLOCKS} expected")
        if sb["remote_validation_failures"] or kb["validation_failures"]:
            failures.append(f"validation failures on daemon 2: {sb['remote_validation_failures']}")
        result.update(
            {
                "blocks": BLOCKS,
                "block_bytes": BLOCK,
                "pin_seconds": round(elapsed, 4),
                "gbps": round(BLOCKS * BLOCK / elapsed / 1e9, 3) if elapsed > 0 else None,
                "staged_reads": kb["staged_reads"],
                "staged_sends": ka["staged_sends"],
                "staging_exhausted": kb["staging_exhausted"] + ka["staging_exhausted"],
            }
        )
    except Exception as e:  # noqa: BLE001 - one JSON line whatever happened
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    if failures:
        result["logs"] = [log_tail(d)[-600:] for d in dirs]
    ok = not failures
    result.update({"ok": ok, "failures": failures[:20]})
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
