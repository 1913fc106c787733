"""The connector's overhead per block (docs/BENCHMARKS.md, issue 16): loading
N chunks into NumPy tensors in vLLM's NHD layout through
``kvmesh.connector.Mover`` (a pin of the prefix, the scatter kernel from
each pinned block into the engine's pages, the release) against the Python
client's raw pin + one copy of each block into a buffer (the same bytes
read from the pool once), in interleaved rounds on one daemon this script
starts. The first and last loaded blocks are compared with the saved ones
every round.

    python python/bench_connector.py [KVMESHD] [--blocks N] [--rounds R] [--iters I]

Prints one JSON line: medians in milliseconds and the ratio."""

import argparse
import json
import os
import shutil
import socket as _socket
import statistics
import subprocess
import sys
import tempfile
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
import numpy as np  # noqa: E402

import kvmesh  # noqa: E402
from kvmesh import kernels  # noqa: E402
from kvmesh.connector import KeyScheme, Mover, Packing, Planner  # noqa: E402

# A 7B-class model: 32 layers, 8 KV heads of 128, fp16, 16-token blocks:
# 2 MiB per vLLM block (all layers).
LAYERS, HEADS, DIM, BT = 32, 8, 128, 16


def start_daemon(binary: str, pool_mib: int, slot: int):
    d = tempfile.mkdtemp(prefix="kvmesh-bench-connector-")
    sock = os.path.join(d, "kvmeshd.sock")
    cfg = os.path.join(d, "kvmeshd.toml")
    with open(cfg, "w") as f:
        f.write(
            f'[server]\nsocket = "{sock}"\n[metrics]\nlisten = ""\n'
            f'[[pools]]\nname = "p"\nbytes = "{pool_mib}MiB"\nslot_payload_bytes = {slot}\nmlock = false\n'
        )
    proc = subprocess.Popen([binary, "--config", cfg], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    while True:
        try:
            s = _socket.socket(_socket.AF_UNIX)
            s.connect(sock)
            s.close()
            return proc, sock, d
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                sys.exit("kvmeshd did not come up")
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kvmeshd", nargs="?", default=os.path.join(_here, "..", "target", "release", "kvmeshd"))
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    nb = 2 * a.blocks + 8
    shape = kernels.KvShape("nhd", "float16", LAYERS, nb, BT, HEADS, DIM)
    packing = Packing(shape, 1)
    pool_mib = (packing.block_bytes + 65536) * (a.blocks + 16) // (1 << 20) + 16
    proc, sock, tmp = start_daemon(a.kvmeshd, pool_mib, packing.block_bytes)
    try:
        c = kvmesh.Client(sock)
        scheme = KeyScheme("bench-7b", "float16", "nhd", BT, 1)
        ns = c.register_namespace(scheme.namespace, packing.block_bytes, "kvmesh-packed")
        rng = np.random.default_rng(1)
        src = [rng.integers(0, 1 << 16, size=(2, nb, BT, HEADS, DIM), dtype=np.uint16).view(np.float16) for _ in range(LAYERS)]
        prompt = [int(x) for x in rng.integers(0, 50_000, size=a.blocks * BT + 1)]
        p = Planner(c, scheme, ns)
        p.add("w", prompt)
        p.allocated("w", list(range(a.blocks + 1)), 0, 0)
        if Mover(c, ns, packing, src).save(p.step({"w": len(prompt)}).saves[0]) != a.blocks:
            sys.exit("the prefix was not stored")
        dst = [np.zeros_like(t) for t in src]
        mover = Mover(c, ns, packing, dst)
        q = Planner(c, scheme, ns)
        n = q.matched_tokens(prompt, 0)
        if n != a.blocks * BT:
            sys.exit(f"matched {n} tokens, expected {a.blocks * BT}")
        keys = scheme.keys(prompt)
        raw_buf = np.empty(a.blocks * packing.block_bytes, dtype=np.uint8)
        conn, raw = [], []
        for r in range(a.rounds):
            for kind in (("conn", "raw") if r % 2 == 0 else ("raw", "conn")):
                for _ in range(a.iters):
                    if kind == "conn":
                        q.reqs.pop("r", None)
                        q.add("r", prompt)
                        blocks = list(range(a.blocks + 1, 2 * a.blocks + 2))
                        q.allocated("r", blocks, 0, n)
                        task = q.step({}).loads[0]
                        t0 = time.perf_counter()
                        failed = mover.load(task)
                        conn.append(time.perf_counter() - t0)
                        if failed:
                            sys.exit(f"load failed for {len(failed)} blocks")
                    else:
                        t0 = time.perf_counter()
                        with c.pin(ns, keys) as b:
                            for i in range(a.blocks):
                                raw_buf[i * packing.block_bytes : (i + 1) * packing.block_bytes] = np.frombuffer(b[i], dtype=np.uint8)
                        raw.append(time.perf_counter() - t0)
            # The loaded pages are the saved ones.
            for i in (0, a.blocks - 1):
                if not all(np.array_equal(s.view(np.uint16)[:, i], d.view(np.uint16)[:, a.blocks + 1 + i]) for s, d in zip(src, dst)):
                    sys.exit(f"block {i} loaded wrong")
        mc, mr = statistics.median(conn), statistics.median(raw)
        mib = a.blocks * packing.block_bytes / (1 << 20)
        print(json.dumps({
            "bench": "connector", "blocks": a.blocks, "block_mib": packing.block_bytes / (1 << 20),
            "connector_load_ms": mc * 1e3, "raw_pin_copy_ms": mr * 1e3, "ratio": mc / mr,
            "connector_per_block_us": mc / a.blocks * 1e6, "raw_per_block_us": mr / a.blocks * 1e6,
            "connector_gib_s": mib / 1024 / mc, "raw_gib_s": mib / 1024 / mr, "samples": len(conn),
        }))
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
