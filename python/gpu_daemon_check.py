"""The daemon-level half of scripts/gpu-check.sh: a kvmeshd with a GPU pool
(device cuda:0) is running at SOCKET. Checks, with torch: put of blocks
into the GPU namespace (copies to the device), pin -> DeviceView read in
place with torch (zero copy) equal to what was put, verify on the GPU,
a zero-copy put through an allocation's DeviceView, and a second process
that pins the blocks and checksums them on its GPU in place (lending over
the fd handshake). Prints one JSON line; exit 0 ok, 1 failed, 77 skipped.

    python3 gpu_daemon_check.py SOCKET
"""

import json
import subprocess
import sys


def reader(sock: str, hexkeys: str, sums: str) -> int:
    import kvmesh
    from kvmesh import kernels

    c = kvmesh.Client(sock)
    ns = c.namespace("gpu-check")
    keys = hexkeys.split(",")
    want = [int(s) for s in sums.split(",")]
    with c.pin(ns, keys) as b:
        for i, w in enumerate(want):
            v = b[i]
            if not isinstance(v, kvmesh.DeviceView):
                print(f"entry {i}: {type(v).__name__}, not a DeviceView")
                return 1
            got = kernels.kvsum64(v)
            if got != w:
                print(f"entry {i}: kvsum64 {got:#x} != {w:#x}")
                return 1
    print("reader ok")
    return 0


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--reader":
        return reader(sys.argv[2], sys.argv[3], sys.argv[4])
    sock = sys.argv[1]
    try:
        import numpy as np
        import torch
    except ImportError as e:
        print(json.dumps({"check": "daemon-gpu", "skipped": f"{e}"}))
        return 77
    if not torch.cuda.is_available():
        print(json.dumps({"check": "daemon-gpu", "skipped": "torch sees no CUDA device"}))
        return 77
    import kvmesh
    from kvmesh import kernels

    failures = []
    block = 1 << 20
    c = kvmesh.Client(sock)
    import os

    ns = c.register_namespace("gpu-check", block, "check", device=f"cuda:{os.environ.get('KVMESH_GPU', '0')}")
    rng = np.random.default_rng(5)
    data = [rng.integers(0, 256, size=block, dtype=np.uint8) for _ in range(16)]
    keys = [kvmesh.key(i + 1) for i in range(16)]
    s = c.put(ns, [(k, d.tobytes()) for k, d in zip(keys, data)])
    if s.stored != 16:
        failures.append(f"put stored {s.stored} of 16: {s}")
    with c.pin(ns, keys) as b:
        for i in range(16):
            v = b[i]
            if not isinstance(v, kvmesh.DeviceView):
                failures.append(f"pin entry {i}: {type(v).__name__}, not a DeviceView")
                continue
            t = torch.as_tensor(v, device=f"cuda:{v.device_id}")
            if t.data_ptr() != v.address:
                failures.append(f"entry {i}: torch copied the block (zero copy expected)")
            if t.cpu().numpy().tobytes() != data[i].tobytes():
                failures.append(f"entry {i}: bytes read on the GPU differ from the put")
            try:
                b.verify(i)
            except kvmesh.KvmeshError as e:
                failures.append(f"entry {i}: verify: {e}")
    # get_into copies device -> host.
    dst = bytearray(block * 2)
    hits = c.get_into(ns, keys[:2], dst)
    if hits != [True, True] or bytes(dst[:block]) != data[0].tobytes():
        failures.append("get_into of GPU blocks differs")
    # Zero-copy put: write through the allocation's DeviceView with torch.
    k = kvmesh.key(1000)
    src = torch.randint(0, 256, (block,), dtype=torch.uint8, device="cuda")
    with c.allocate(ns, [k]) as a:
        v = a[0]
        torch.as_tensor(v, device="cuda").copy_(src)
        torch.cuda.synchronize()
        del v
        out = a.commit()
    if out != ["stored"]:
        failures.append(f"zero-copy put: {out}")
    with c.pin(ns, [k]) as b:
        if not torch.equal(torch.as_tensor(b[0], device="cuda"), src):
            failures.append("zero-copy put: bytes differ")
        b.verify(0)
    # A second process pins and checksums in place on its GPU.
    sums = [kernels.kvsum64(d) for d in data]
    r = subprocess.run(
        [sys.executable, __file__, "--reader", sock, ",".join(x.hex() for x in keys), ",".join(map(str, sums))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0:
        failures.append(f"second process: rc {r.returncode}: {r.stdout.strip()} {r.stderr.strip()[-500:]}")
    ok = not failures
    print(json.dumps({"check": "daemon-gpu", "ok": ok, "blocks": 17, "failures": failures[:20]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
