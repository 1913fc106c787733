"""kvmesh.sglang: an SGLang HiCache storage backend backed by kvmesh.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvmesh",
            "module_path": "kvmesh.sglang", "class_name": "KvmeshStorage",
            "interface_v1": true, "socket": "/run/kvmesh/kvmeshd.sock"}'

One kvmesh block per SGLang page: the page's bytes as the host pool's
``get_page_buffer_meta`` describes them (MHA ``page_first``: the K part then
the V part; MLA: the latent part), copied between the pool's pinned host
memory and the daemon's pool (``batch_get_v1`` / ``batch_set_v1``, the
zero-copy interface). ``batch_exists`` is a cluster-wide lookup: the length
of the prefix held anywhere in the cluster. Keys: SGLang's own page hashes
(computed from token ids, the same in every process), hashed to 128 bits;
the namespace names the model, the rank (MLA: one for all ranks, rank 0
writes) and the page size in bytes.

Written against SGLang's ``HiCacheStorage`` (``sglang/srt/mem_cache/
hicache_storage.py``) and tested with SGLang 0.5.23 on CPU
(``scripts/test-connectors.sh``: created by SGLang's
``StorageBackendFactory`` over SGLang's own ``MHATokenToKVPoolHost``, two
processes with different ``PYTHONHASHSEED``); the default suite tests its
methods against a host pool that implements ``get_page_buffer_meta`` over
NumPy memory. Without SGLang installed the class derives from ``object``
so that it can be tested.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, List, Optional

import kvmesh
from kvmesh.connector import _salt_tokens

try:  # pragma: no cover - with SGLang
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError:  # tested without SGLang
    HiCacheStorage = object  # type: ignore[misc,assignment]

__all__ = ["KvmeshStorage"]

log = logging.getLogger("kvmesh.sglang")


def page_key(key: str) -> bytes:
    """A 16-byte kvmesh key for an SGLang page hash string."""
    return kvmesh.chain_key(None, _salt_tokens(key.encode()))


class KvmeshStorage(HiCacheStorage):  # type: ignore[misc,valid-type]
    def __init__(self, storage_config: Any = None, kwargs: Optional[dict] = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.config = storage_config
        self.mla = bool(getattr(storage_config, "is_mla_model", False))
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0))
        self.tp_size = int(getattr(storage_config, "tp_size", 1))
        self.pp_rank = int(getattr(storage_config, "pp_rank", 0) or 0)
        self.pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        # A daemon not (yet) reachable: the server runs without the shared
        # cache (every page a miss), not fail to start.
        try:
            self.client: Any = kvmesh.Client(extra.get("socket") or os.environ.get("KVMESH_SOCKET"))
        except kvmesh.KvmeshError as e:
            log.warning("kvmesh: daemon not reachable (%s): running without the shared cache", e)
            self.client = None
        self.model = str(extra.get("model_tag") or getattr(storage_config, "model_name", None) or "model")
        self.mem_pool_host: Any = None
        self.ns: Any = None
        self.page_bytes = 0
        self.errors = 0

    # ----- setup -----

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool whose pages move; the namespace is sized by its
        page (every part of one page in one block)."""
        self.mem_pool_host = mem_pool_host
        _, sizes = mem_pool_host.get_page_buffer_meta(self._first_page_indices(mem_pool_host))
        self.page_bytes = int(sum(sizes))
        rank = "mla" if self.mla else f"tp{self.tp_rank}of{self.tp_size}"
        # What changes a page's bytes is in the name, so that engines whose
        # pages differ never read each other's: the KV dtype (bf16 and fp16
        # pages have the same size), and the pipeline stage (stages hold
        # different layers, often as many).
        if self.pp_size > 1:
            rank += f"/pp{self.pp_rank}of{self.pp_size}"
        dtype = str(getattr(mem_pool_host, "dtype", "") or "")
        layout = str(getattr(mem_pool_host, "layout", ""))
        name = f"kvmesh/sglang/{self.model}/{rank}/{dtype}/page{mem_pool_host.page_size}/{self.page_bytes}B/{layout}"
        if self.client is None:
            return
        try:
            self.ns = self.client.register_namespace(name, self.page_bytes, layout)
        except kvmesh.KvmeshError as e:
            log.warning("kvmesh: namespace %s not registered (%s): running without the shared cache", name, e)

    @staticmethod
    def _first_page_indices(pool: Any) -> Any:
        import numpy as np

        return np.arange(pool.page_size, dtype=np.int64)

    def _parts(self, host_indices: Any, n: int) -> List[List[tuple]]:
        """Per page: its (address, bytes) parts in the host pool."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) % n:
            raise ValueError(f"{len(ptrs)} buffers for {n} pages")
        per = len(ptrs) // n
        return [list(zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per])) for i in range(n)]

    # ----- the v1 (zero-copy) interface -----

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        if self.ns is None or not keys:
            return 0
        try:
            return self.client.locate(self.ns, [page_key(k) for k in keys]).prefix_len
        except kvmesh.KvmeshError as e:
            self.errors += 1
            log.warning("kvmesh lookup failed: %s", e)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        out = [False] * len(keys)
        if self.ns is None or not keys:
            return out
        try:
            parts = self._parts(host_indices, len(keys))
            with self.client.pin(self.ns, [page_key(k) for k in keys]) as batch:
                for i in range(len(keys)):
                    out[i] = self._copy_out(batch, i, parts[i])
        except (kvmesh.KvmeshError, ValueError) as e:
            self.errors += 1
            log.warning("kvmesh get failed: %s", e)
        return out

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        if self.ns is None or not keys:
            return [False] * len(keys)
        if self.mla and self.tp_rank != 0:
            return [True] * len(keys)  # rank 0 writes the (identical) MLA pages
        try:
            parts = self._parts(host_indices, len(keys))
            with self.client.allocate(self.ns, [page_key(k) for k in keys]) as alloc:
                for i in range(len(keys)):
                    self._copy_in(alloc, i, parts[i])
                status = alloc.commit()
            # A page already held (or being put by another rank) is stored.
            return [s in ("stored", "exists", "in_progress") for s in status]
        except (kvmesh.KvmeshError, ValueError) as e:
            self.errors += 1
            log.warning("kvmesh set failed: %s", e)
            return [False] * len(keys)

    def _copy_out(self, batch: Any, i: int, parts: List[tuple]) -> bool:
        block = batch[i]
        if not isinstance(block, memoryview):
            return False
        if sum(int(size) for _, size in parts) > len(block):
            return False  # the page is larger than a block: never copy past it
        src = _address(block)
        off = 0
        for ptr, size in parts:
            ctypes.memmove(int(ptr), src + off, int(size))
            off += int(size)
        # Only a copy that ended within the pin's lease read this block (past
        # it the slot may have been reused): a miss otherwise.
        return batch.lease_remaining_ms > 0

    def _copy_in(self, alloc: Any, i: int, parts: List[tuple]) -> None:
        block = alloc[i]
        if not isinstance(block, memoryview):
            return
        if sum(int(size) for _, size in parts) > len(block):
            raise ValueError(f"a page of {sum(int(s) for _, s in parts)} bytes does not fit a {len(block)}-byte block")
        dst = _address(block)
        off = 0
        for ptr, size in parts:
            ctypes.memmove(dst + off, int(ptr), int(size))
            off += int(size)

    # ----- the rest of the interface -----

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("kvmesh.sglang implements the zero-copy interface: set interface_v1")

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("kvmesh.sglang implements the zero-copy interface: set interface_v1")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvmesh.sglang implements the zero-copy interface: set interface_v1")

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvmesh.sglang implements the zero-copy interface: set interface_v1")

    def clear(self) -> None:
        if self.ns is not None and self.client is not None:
            self.client.invalidate_namespace(self.ns)

    def get_stats(self) -> Any:
        return None


def _address(block: memoryview) -> int:
    """The address of a host block view (valid while the view lives)."""
    import numpy as np

    return int(np.frombuffer(block, dtype=np.uint8).ctypes.data)
