"""The Python half of scripts/gpu-check.sh: kvmesh.kernels on torch CUDA
tensors against torch indexing (every layout and dtype, random pages),
scatter round trips, and kvsum64 on the GPU against its definition.
Prints one JSON line; exit 0 ok, 1 failed, 77 skipped (no torch or GPU)."""

import json
import random
import sys


def main() -> int:
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"check": "python-gpu", "skipped": f"no torch: {e}"}))
        return 77
    if not torch.cuda.is_available():
        print(json.dumps({"check": "python-gpu", "skipped": "torch sees no CUDA device"}))
        return 77
    from kvmesh import kernels

    rnd = random.Random(11)
    failures, cases = [], 0
    for layout in kernels.LAYOUTS:
        for dtype, torch_dtype in [("float16", torch.float16), ("bfloat16", torch.bfloat16), ("fp8", torch.uint8)]:
            for _ in range(3):
                L, NB, T, H, D = rnd.randint(1, 6), rnd.randint(2, 9), rnd.randint(1, 17), rnd.randint(1, 4), rnd.choice([8, 64, 128])
                if layout == "mla":
                    H = 1
                shapes = {
                    "nhd": (2, NB, T, H, D),
                    "hnd": (2, NB, H, T, D),
                    "flashinfer": (NB, 2, T, H, D),
                    "mla": (NB, T, D),
                    "cross_layer": (NB, L, 2, T, H, D),
                }
                count = 1 if layout == "cross_layer" else L
                if torch_dtype == torch.uint8:
                    ts = [torch.randint(0, 256, shapes[layout], dtype=torch.uint8, device="cuda") for _ in range(count)]
                else:
                    ts = [torch.randn(shapes[layout], device="cuda").to(torch_dtype) for _ in range(count)]

                def packed(tensors, page):
                    if layout == "cross_layer":
                        return tensors[0][page].contiguous()
                    parts = []
                    for t in tensors:
                        if layout == "nhd":
                            parts.append(t[:, page])
                        elif layout == "hnd":
                            parts.append(t[:, page].transpose(1, 2))
                        else:
                            parts.append(t[page])
                    return torch.stack(parts).contiguous()

                shape = kernels.KvShape(layout, dtype, L, NB, T, H, D)
                block, _, _ = shape.sizes()
                pages = [rnd.randrange(NB) for _ in range(rnd.randint(1, NB))]
                slots = [torch.zeros(block, dtype=torch.uint8, device="cuda") for _ in pages]
                kernels.gather(shape, ts, pages, slots)
                for p, s in zip(pages, slots):
                    want = packed(ts, p).view(torch.uint8).flatten()
                    if not torch.equal(s, want):
                        failures.append(f"gather {layout}/{dtype} page {p} {shape}")
                out = [torch.zeros_like(t) for t in ts]
                dst = rnd.randrange(NB)
                kernels.scatter(shape, out, [dst], slots[:1])
                if not torch.equal(packed(out, dst).view(torch.uint8).flatten(), slots[0]):
                    failures.append(f"scatter {layout}/{dtype} page {dst}")
                others = [p for p in range(NB) if p != dst]
                if any(packed(out, p).view(torch.uint8).any().item() for p in others):
                    failures.append(f"scatter {layout}/{dtype} wrote outside page {dst}")
                cases += 1
    for n in [8, 64, 4096, 65536 + 8, 1 << 20]:
        buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        if kernels.kvsum64(buf) != kernels.kvsum64_py(buf.cpu().numpy().tobytes()):
            failures.append(f"kvsum64 of {n} bytes")
    ok = not failures
    print(json.dumps({"check": "python-gpu", "ok": ok, "cases": cases, "failures": failures[:20], "torch": torch.__version__}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
