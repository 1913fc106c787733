"""kvmesh from Python: store blocks, read them back in place, copy them out.

    python python/examples/basic.py            # the default socket; or: basic.py SOCKET
"""
import sys

import numpy as np

import kvmesh

client = kvmesh.Client(sys.argv[1] if len(sys.argv) > 1 else None)
ns = client.register_namespace("example/python", 4096, "demo-layout")

tokens = list(range(1000, 1064))  # a 64-token prompt
keys = kvmesh.prefix_keys(tokens, 16)  # 4 chained block keys (same in every process)
blocks = [bytes([i + 1]) * 4096 for i in range(len(keys))]
print(client.put(ns, zip(keys, blocks)))

n = client.lookup(ns, keys)
print(f"cached prefix: {n} of {len(keys)} blocks")

with client.pin(ns, keys[:n]) as batch:  # zero copy: read-only views into the pool
    for i in range(n):
        arr = np.frombuffer(batch[i], dtype=np.uint8)
        print(f"block {i}: {arr.nbytes} bytes, first byte {arr[0]}, matches: {arr.tobytes() == blocks[i]}")
        del arr  # a view keeps its pin while it lives

out = bytearray(len(keys) * 4096)  # or copy into a buffer of your own
print("copied:", client.get_into(ns, keys, out))
