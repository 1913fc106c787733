"""The kvmesh HiCache storage backend through SGLang's own classes (on CPU).

Needs SGLang (``scripts/test-connectors.sh`` installs it into a cached
virtualenv); without it every test here is skipped, saying so. SGLang's
``StorageBackendFactory`` creates ``KvmeshStorage`` from the ``dynamic``
backend config (as ``--hicache-storage-backend dynamic`` does), over a real
SGLang host pool (``MHATokenToKVPoolHost``, ``page_first`` layout, built
from an ``MHATokenToKVPool`` on CPU). One engine process stores pages of
random K/V; a second process, with another ``PYTHONHASHSEED`` and its own
host pool, finds the prefix with ``batch_exists``, loads it with
``batch_get_v1`` into other host pages, and must hold the same bytes.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="needs PyTorch (scripts/test-connectors.sh installs SGLang and torch)")
pytest.importorskip("sglang", reason="needs SGLang (scripts/test-connectors.sh installs it into a virtualenv)")

ENGINE = r'''
import hashlib, json, sys
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

a = json.loads(sys.argv[1])
PAGE, HEADS, DIM, LAYERS = a["page"], a["heads"], a["dim"], a["layers"]
dev = MHATokenToKVPool(size=1024, page_size=PAGE, dtype=torch.float16, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
                       device="cpu", enable_memory_saver=False, start_layer=0, end_layer=LAYERS - 1)
host = MHATokenToKVPoolHost(
    dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first", pin_memory=False, device="cpu",
    device_capacity_tokens=dev.size if dev.host_capacity_tokens is None else dev.host_capacity_tokens,
    start_layer=dev.start_layer, end_layer=dev.end_layer, write_back_staging=dev.hicache_write_back_staging,
)
cfg = HiCacheStorageConfig(
    tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
    enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny",
    extra_config={"backend_name": "kvmesh", "module_path": "kvmesh.sglang", "class_name": "KvmeshStorage",
                  "interface_v1": True, "socket": a["socket"]},
)
store = StorageBackendFactory.create_backend("dynamic", cfg, host)
assert isinstance(store, HiCacheStorage) and type(store).__name__ == "KvmeshStorage", type(store)
store.register_mem_pool_host(host)

# SGLang's own page keys (what HiRadixCache hands storage backends): a
# chain of hashes over each page's token ids.
from sglang.srt.mem_cache.utils import get_hash_str
keys, prev = [], None
for p in range(a["pages"]):
    prev = get_hash_str(a["tokens"][p * PAGE:(p + 1) * PAGE], prev)
    keys.append(prev)

def page_bytes(indices):
    # The pages' bytes as the pool describes them to storage backends.
    import ctypes
    ptrs, sizes = host.get_page_buffer_meta(indices)
    return b"".join(ctypes.string_at(int(p), int(s)) for p, s in zip(ptrs, sizes))

base = a["first_page"] * PAGE
indices = torch.arange(base, base + a["pages"] * PAGE, dtype=torch.int64)
result = {"exists_before": store.batch_exists(keys)}
if a["role"] == "writer":
    g = torch.Generator().manual_seed(7)
    host.kv_buffer.view(-1)[:] = torch.rand(host.kv_buffer.numel(), generator=g).to(host.kv_buffer.dtype)
    result["set"] = store.batch_set_v1(keys, indices)
    result["digest"] = hashlib.sha256(page_bytes(indices)).hexdigest()
else:
    host.kv_buffer.zero_()
    result["get"] = store.batch_get_v1(keys, indices)
    result["digest"] = hashlib.sha256(page_bytes(indices)).hexdigest()
    result["exists_partial"] = store.batch_exists(keys[:2] + ["not-" + keys[2]] + keys[3:])
print(json.dumps(result))
'''


def _engine(daemon, role: str, first_page: int, hashseed: str, tokens=None) -> dict:
    args = {"page": 16, "heads": 2, "dim": 32, "layers": 4, "pages": 6, "socket": daemon.socket, "role": role,
            "first_page": first_page, "tokens": tokens or [(i * 13 + 5) % 1000 for i in range(6 * 16)]}
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    p = subprocess.run([sys.executable, "-c", ENGINE, json.dumps(args)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_second_engine_finds_and_loads_the_pages_the_first_stored(daemon):
    w = _engine(daemon, "writer", first_page=3, hashseed="1")
    print("writer:", w)
    assert w["exists_before"] == 0, w
    assert w["set"] == [True] * 6, w
    r = _engine(daemon, "reader", first_page=10, hashseed="2")  # other pages, another process and hash seed
    print("reader:", r)
    assert r["exists_before"] == 6, r
    assert r["get"] == [True] * 6, r
    assert r["digest"] == w["digest"], (r, w)  # the same bytes in the reader's pages
    assert r["exists_partial"] == 2, r  # the consecutive prefix, up to the missing page
    other = _engine(daemon, "reader", first_page=10, hashseed="3", tokens=list(range(6 * 16)))
    print("reader of another prompt:", other)
    assert other["exists_before"] == 0, other
