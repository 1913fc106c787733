"""The Python side of `kvmesh-bench bindings` (run by it; see
docs/BENCHMARKS.md): copy-get, pin + read (copy of each pinned block out of
the pool) and a one-key lookup through the kvmesh package.

    python python/bench.py SOCKET NAMESPACE BLOCKS ITERS LOOKUPS

Keys: kvmesh.prefix_keys(range(BLOCKS*16), 16), as the Rust and C sides.
Prints one JSON line of medians (seconds; the lookup in microseconds)."""

import json
import os
import statistics
import sys
import time

# Import the installed package, not the source tree next to this script
# (which has no native module).
_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
import kvmesh  # noqa: E402


def main() -> None:
    socket, name = sys.argv[1], sys.argv[2]
    blocks, iters, lookups = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    c = kvmesh.Client(socket)
    ns = c.namespace(name)
    bs = ns.block_bytes
    keys = kvmesh.prefix_keys(list(range(blocks * 16)), 16)
    dst = bytearray(blocks * bs)
    out = memoryview(dst)
    copy, pin, look = [], [], []
    checksum = 0
    clock = time.perf_counter
    for it in range(iters):
        t0 = clock()
        hits = c.get_into(ns, keys, dst)
        copy.append(clock() - t0)
        if not all(hits):
            sys.exit(f"copy-get: {sum(hits)} of {blocks} hits")
        checksum += dst[it % len(dst)]
        t0 = clock()
        with c.pin(ns, keys) as b:
            for i in range(blocks):
                out[i * bs : (i + 1) * bs] = b[i]
        pin.append(clock() - t0)
        checksum += dst[(it * 7) % len(dst)]
    one = keys[:1]
    for _ in range(lookups):
        t0 = clock()
        c.lookup(ns, one)
        look.append((clock() - t0) * 1e6)
    print(json.dumps({
        "copy_s": statistics.median(copy),
        "pin_read_s": statistics.median(pin),
        "lookup_us": statistics.median(look),
        "checksum": checksum,
    }))


if __name__ == "__main__":
    main()
