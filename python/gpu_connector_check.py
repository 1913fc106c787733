"""The connector half of scripts/gpu-check.sh (issue 16): CUDA tensors in
vLLM's NHD layout, saved through ``kvmesh.connector`` and loaded back into
other blocks of other tensors, with a kvmeshd at SOCKET that has a GPU pool
(blocks stay on the device: the kernels move them) and a host pool (one
device staging buffer, one host<->device copy per block). Bytes compared
with torch. Prints one JSON line; exit 0 ok, 1 failed, 77 skipped.

    python3 gpu_connector_check.py SOCKET
"""

import json
import os
import sys


def main() -> int:
    try:
        import torch
    except ImportError:
        print(json.dumps({"check": "connector-gpu", "skipped": "no torch"}))
        return 77
    if not torch.cuda.is_available():
        print(json.dumps({"check": "connector-gpu", "skipped": "torch sees no CUDA device"}))
        return 77
    import kvmesh
    from kvmesh import kernels
    from kvmesh.connector import KeyScheme, Mover, Packing, Planner

    gpu = int(os.environ.get("KVMESH_GPU", "0"))
    dev = torch.device("cuda", gpu)
    L, NB, BT, H, D = 4, 16, 16, 8, 128
    c = kvmesh.Client(sys.argv[1])
    results = {}
    for pool in (f"cuda:{gpu}", ""):
        what = "gpu_pool" if pool else "host_pool_staged"
        scheme = KeyScheme(f"gpu-connector-{what}", "float16", "nhd", BT, 1)
        packing = Packing(kernels.KvShape("nhd", "float16", L, NB, BT, H, D), 1)
        ns = c.register_namespace(scheme.namespace, packing.block_bytes, "kvmesh-packed", device=pool)
        g = torch.Generator(device=dev).manual_seed(7)
        src = [torch.randn(2, NB, BT, H, D, dtype=torch.float16, device=dev, generator=g) for _ in range(L)]
        dst = [torch.zeros_like(t) for t in src]
        prompt = list(range(4 * BT + 1))
        p = Planner(c, scheme, ns)
        p.add("w", prompt)
        p.allocated("w", [0, 1, 2, 3, 4], 0, 0)
        saved = Mover(c, ns, packing, src).save(p.step({"w": len(prompt)}).saves[0])
        q = Planner(c, scheme, ns)
        n = q.matched_tokens(prompt, 0)
        q.add("r", prompt)
        q.allocated("r", [10, 11, 12, 13, 14], 0, n)
        failed = Mover(c, ns, packing, dst).load(q.step({}).loads[0])
        torch.cuda.synchronize(dev)
        same = all(
            torch.equal(s[:, i].view(torch.int16), d[:, 10 + i].view(torch.int16)) for s, d in zip(src, dst) for i in range(4)
        )
        untouched = all(not d[:, :10].any() and not d[:, 14:].any() for d in dst)
        results[what] = {"saved": saved, "matched_tokens": n, "failed": len(failed), "bytes_equal": same, "untouched": untouched}
    ok = all(r["saved"] == 4 and r["matched_tokens"] == 4 * BT and r["failed"] == 0 and r["bytes_equal"] and r["untouched"] for r in results.values())
    print(json.dumps({"check": "connector-gpu", "ok": ok, **results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
