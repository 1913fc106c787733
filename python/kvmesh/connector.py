"""kvmesh.connector: what an inference engine's KV connector needs, without
the engine. The vLLM connector (``kvmesh.vllm``) and the SGLang storage
backend (``kvmesh.sglang``) are thin adapters over it; everything here is
tested against a real daemon with NumPy arrays in the engines' layouts.

- ``KeyScheme``: keys of an engine's KV blocks, chained over the **token
  ids** (and a salt: LoRA, cache salt, multimodal hashes), not over the
  engine's own block hashes, whose seed differs between processes unless
  ``PYTHONHASHSEED`` is set. One kvmesh block holds ``chunk_blocks``
  engine blocks (all layers); the namespace names the model, KV dtype,
  block size, chunk and tensor-parallel rank (not the layout: blocks are
  packed the same way for every layout) (MLA caches are the
  same on every rank: one namespace for all ranks, one writer).
- ``Packing``: moves chunks between the engine's paged tensors and kvmesh
  blocks with ``kvmesh.kernels`` (CPU or CUDA).
- ``Planner`` (scheduler side): how many tokens of a request are cached in
  the cluster (a cluster-wide lookup: side-effect free), which chunks to
  load into which engine blocks, which newly full chunks to save; state per
  request across steps.
- ``Mover`` (worker side): carries out load and save plans against the
  daemon (zero-copy pins and allocations); a chunk that cannot be loaded is
  reported with its engine blocks so the engine recomputes them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from . import _kvmesh, chain_key, kernels
from .errors import KvmeshError

__all__ = ["KeyScheme", "Packing", "Planner", "Mover", "LoadTask", "SaveTask", "StepPlan"]

log = logging.getLogger("kvmesh.connector")


def _salt_tokens(salt: Optional[bytes]) -> List[int]:
    # Bytes as 32-bit words (zero-padded), prefixed by their length.
    if not salt:
        return []
    padded = salt + b"\0" * (-len(salt) % 4)
    return [len(salt)] + [int.from_bytes(padded[i : i + 4], "little") for i in range(0, len(padded), 4)]


class KeyScheme:
    """Keys and namespace of one engine instance's KV cache.

    ``keys(token_ids, salt)`` gives one key per full chunk of
    ``chunk_blocks * block_tokens`` tokens, chained: the key of chunk i
    depends on every token before its end, so equal keys mean equal
    prefixes. Every process that uses the same scheme and tokens gets the
    same keys, whatever its hash seed."""

    def __init__(
        self,
        model: str,
        kv_dtype: str,
        layout: str,
        block_tokens: int,
        chunk_blocks: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
        mla: bool = False,
        tag: str = "",
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> None:
        if block_tokens <= 0 or chunk_blocks <= 0:
            raise ValueError("block_tokens and chunk_blocks must be positive")
        if not (0 <= tp_rank < tp_size):
            raise ValueError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
        if not (0 <= pp_rank < pp_size):
            raise ValueError(f"pp_rank {pp_rank} outside pp_size {pp_size}")
        self.model = model
        self.kv_dtype = str(kv_dtype).replace("torch.", "")
        self.layout = layout
        self.block_tokens = block_tokens
        self.chunk_blocks = chunk_blocks
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.mla = mla
        self.tag = tag
        self.pp_rank = pp_rank
        self.pp_size = pp_size

    @property
    def chunk_tokens(self) -> int:
        return self.block_tokens * self.chunk_blocks

    @property
    def namespace(self) -> str:
        """The namespace name: what must match for blocks to be shared."""
        # Not the layout: a block is packed the same way whatever the
        # engine's layout (kvmesh.kernels), so engines with different
        # attention backends share blocks.
        rank = "mla" if self.mla else f"tp{self.tp_rank}of{self.tp_size}"
        parts = [self.model, self.kv_dtype, f"b{self.block_tokens}x{self.chunk_blocks}", rank]
        # Pipeline stages hold different layers (MLA ones too): each its own
        # namespace. (Not named without PP: names stay what they were.)
        if self.pp_size > 1:
            parts.append(f"pp{self.pp_rank}of{self.pp_size}")
        if self.tag:
            parts.append(self.tag)
        return "kvmesh/" + "/".join(parts)

    @property
    def writes(self) -> bool:
        """Whether this rank saves (MLA: rank 0 only; the data is the same)."""
        return not self.mla or self.tp_rank == 0

    def keys(self, token_ids: Sequence[int], salt: Optional[bytes] = None) -> List[bytes]:
        n = len(token_ids) // self.chunk_tokens
        parent = chain_key(None, _salt_tokens(salt)) if salt else None
        out = []
        c = self.chunk_tokens
        for i in range(n):
            parent = chain_key(parent, list(token_ids[i * c : (i + 1) * c]))
            out.append(parent)
        return out


class Packing:
    """One chunk (``chunk_blocks`` engine blocks, every layer) in one kvmesh
    block: the engine blocks' packed slots back to back."""

    def __init__(self, shape: kernels.KvShape, chunk_blocks: int) -> None:
        self.shape = shape
        self.chunk_blocks = chunk_blocks
        self.page_bytes = shape.sizes()[0]
        self.block_bytes = self.page_bytes * chunk_blocks

    def _views(self, block: Any, n: int) -> List[Any]:
        if n == 1:
            return [block]
        if not hasattr(block, "__getitem__") and hasattr(block, "__cuda_array_interface__"):
            import torch  # a kvmesh.DeviceView of a GPU pool: sliced as a tensor

            block = torch.as_tensor(block, device=f"cuda:{getattr(block, 'device_id', 0)}")
        return [block[i * self.page_bytes : (i + 1) * self.page_bytes] for i in range(n)]

    def save(self, tensors: Sequence[Any], pages: Sequence[int], block: Any) -> None:
        """Packs engine blocks ``pages`` (a whole chunk) into ``block`` (a
        writable byte array of at least ``block_bytes``)."""
        if len(pages) != self.chunk_blocks:
            raise ValueError(f"a chunk is {self.chunk_blocks} engine blocks, got {len(pages)}")
        kernels.gather(self.shape, tensors, list(pages), self._views(block, len(pages)))

    def load(self, tensors: Sequence[Any], pages: Sequence[Optional[int]], block: Any) -> None:
        """Unpacks ``block`` into engine blocks ``pages`` (``None``: that
        engine block of the chunk is not written, e.g. already computed)."""
        if len(pages) != self.chunk_blocks:
            raise ValueError(f"a chunk is {self.chunk_blocks} engine blocks, got {len(pages)}")
        views = self._views(block, len(pages))
        todo = [(p, v) for p, v in zip(pages, views) if p is not None]
        if todo:
            kernels.scatter(self.shape, tensors, [p for p, _ in todo], [v for _, v in todo])


@dataclass
class LoadTask:
    """Load chunks ``keys`` into engine blocks ``pages`` (per chunk, ``None``
    where the engine block is already computed)."""

    req_id: str
    keys: List[bytes]
    pages: List[List[Optional[int]]]


@dataclass
class SaveTask:
    """Save the full chunks ``keys`` from engine blocks ``pages``."""

    req_id: str
    keys: List[bytes]
    pages: List[List[int]]


@dataclass
class StepPlan:
    """What the workers do in one step (pickled from scheduler to workers)."""

    loads: List[LoadTask] = field(default_factory=list)
    saves: List[SaveTask] = field(default_factory=list)


@dataclass
class _Req:
    tokens: List[int]
    salt: Optional[bytes]
    keys: List[bytes]
    block_ids: List[int] = field(default_factory=list)
    # Chunks known saved (or being saved) by this request, from the start.
    saved: int = 0
    # Tokens the engine computed itself before a load (its prefix cache).
    computed: int = 0
    # Chunks to load (from `computed` to `computed + load`), once allocated.
    load_chunks: int = 0
    load_planned: bool = False


class Planner:
    """Scheduler-side bookkeeping. Calls mirror vLLM's scheduler hooks but
    take plain values.

    ``matched_tokens`` never changes state (vLLM may call it several times
    per request); every other call is once per event."""

    def __init__(self, client: Any, scheme: KeyScheme, namespace: Any = None, cluster_wide: bool = True) -> None:
        self.client = client
        self.scheme = scheme
        self.ns = namespace
        self.cluster_wide = cluster_wide
        self.reqs: Dict[str, _Req] = {}
        self.lookup_errors = 0

    def _loadable_keys(self, tokens: Sequence[int], salt: Optional[bytes]) -> List[bytes]:
        # At least one token is left to compute: an engine needs the last
        # token's logits.
        usable = max(0, len(tokens) - 1)
        return self.scheme.keys(tokens[:usable], salt)

    def matched_tokens(self, tokens: Sequence[int], num_computed_tokens: int, salt: Optional[bytes] = None) -> int:
        """Tokens beyond ``num_computed_tokens`` (the engine's own prefix
        cache) that can be loaded: whole chunks present in the cluster, in
        one cluster-wide lookup. 0 when the daemon cannot answer (the engine
        computes them)."""
        keys = self._loadable_keys(tokens, salt)
        c = self.scheme.chunk_tokens
        if len(keys) * c <= num_computed_tokens or self.ns is None:
            return 0
        try:
            loc = self.client.locate(self.ns, keys, local_only=not self.cluster_wide)
            prefix = loc.prefix_len
        except KvmeshError as e:
            self.lookup_errors += 1
            log.warning("kvmesh lookup failed (%s): computing instead", e)
            return 0
        return max(0, prefix * c - num_computed_tokens)

    def add(self, req_id: str, tokens: Sequence[int], salt: Optional[bytes] = None) -> None:
        """A request the scheduler will run."""
        if req_id not in self.reqs:
            self.reqs[req_id] = _Req(list(tokens), salt, self.scheme.keys(tokens, salt))

    def restart(self, req_id: str, tokens: Sequence[int], salt: Optional[bytes] = None) -> None:
        """A request scheduled from the start again (new, or resumed after
        a preemption freed its blocks): what was planned for it before is
        forgotten (its load is planned anew; what it saved stays saved)."""
        self.reqs.pop(req_id, None)
        self.add(req_id, tokens, salt)

    def replace_blocks(self, req_id: str, block_ids: Sequence[int]) -> None:
        """The request's whole block table (a request resumed after a
        preemption gets a new one)."""
        self.reqs[req_id].block_ids = list(block_ids)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_computed_tokens: int, num_external_tokens: int) -> None:
        """Blocks were allocated: the request's whole block table so far, the
        tokens the engine had computed, and the external tokens it accepted
        (``matched_tokens``)."""
        r = self.reqs[req_id]
        r.block_ids = list(block_ids)
        r.computed = num_computed_tokens
        c = self.scheme.chunk_tokens
        if num_external_tokens > 0 and not r.load_planned:
            first = num_computed_tokens // c
            last = (num_computed_tokens + num_external_tokens) // c
            r.load_chunks = max(0, last - first)
            r.load_planned = True
        # Chunks the cluster already holds are not saved again.
        r.saved = max(r.saved, (num_computed_tokens + num_external_tokens) // c)

    def extend(self, req_id: str, new_block_ids: Sequence[int], tokens: Optional[Sequence[int]] = None) -> None:
        """More blocks (a running request grew), and its tokens so far."""
        r = self.reqs[req_id]
        r.block_ids.extend(new_block_ids)
        if tokens is not None and len(tokens) > len(r.tokens):
            r.tokens = list(tokens)
            r.keys = self.scheme.keys(r.tokens, r.salt)

    def step(self, computed_tokens: Dict[str, int]) -> StepPlan:
        """The plan of one step. ``computed_tokens``: per request scheduled,
        the tokens whose KV will exist after this step (its prefix KV in
        engine blocks, which may then be saved)."""
        plan = StepPlan()
        B, k, c = self.scheme.block_tokens, self.scheme.chunk_blocks, self.scheme.chunk_tokens
        for req_id, r in self.reqs.items():
            if r.load_chunks:
                first = r.computed // c
                keys = r.keys[first : first + r.load_chunks]
                pages: List[List[Optional[int]]] = []
                for i in range(first, first + len(keys)):
                    chunk = r.block_ids[i * k : (i + 1) * k]
                    # Engine blocks the engine computed itself are kept.
                    pages.append([p if (i * k + j) * B >= r.computed else None for j, p in enumerate(chunk)])
                plan.loads.append(LoadTask(req_id, keys, pages))
                r.load_chunks = 0
            done = computed_tokens.get(req_id)
            if done is None or not self.scheme.writes:
                continue
            full = min(done // c, len(r.keys), len(r.block_ids) // k)
            if full > r.saved:
                keys = r.keys[r.saved : full]
                pages_s = [r.block_ids[i * k : (i + 1) * k] for i in range(r.saved, full)]
                plan.saves.append(SaveTask(req_id, keys, pages_s))
                r.saved = full
        return plan

    def finished(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)


class Mover:
    """Worker-side execution of plans against the daemon, on the engine's
    tensors (NumPy/torch CPU tensors, or CUDA tensors with a GPU pool)."""

    def __init__(self, client: Any, namespace: Any, packing: Packing, tensors: Sequence[Any]) -> None:
        self.client = client
        self.ns = namespace
        self.packing = packing
        self.tensors = list(tensors)
        self.loaded_chunks = 0
        self.saved_chunks = 0
        self.failed_chunks = 0
        self._lock = threading.Lock()
        self._stage: Any = None

    def load(self, task: LoadTask) -> Set[int]:
        """Loads a task's chunks; returns the engine blocks that could not
        be loaded (the chunks from the first miss on: the engine recomputes
        them, and with them everything after)."""
        failed: Set[int] = set()
        if not task.keys:
            return failed
        try:
            batch = self.client.pin(self.ns, task.keys, stop_at_first_miss=True)
        except KvmeshError as e:
            log.warning("kvmesh pin failed (%s): %d chunks recomputed", e, len(task.keys))
            batch = None
        ok = 0
        if batch is not None:
            with batch:
                for i in range(len(batch)):
                    try:
                        if not self._unpack(batch, i, task.pages[i]):
                            break
                    except Exception as e:  # a bad block is a miss, never a crash
                        # (The text only: a record that kept the exception
                        # would keep its traceback's views, and with them
                        # the pins.)
                        log.warning("kvmesh load of chunk %d failed: %s", i, str(e))
                        break
                    ok += 1
        for pages in task.pages[ok:]:
            failed.update(p for p in pages if p is not None)
        with self._lock:
            self.loaded_chunks += ok
            self.failed_chunks += len(task.keys) - ok
        return failed

    # One block at a time in a function of its own: its views die at the
    # return (a commit or release while a view lives is refused). CUDA
    # tensors with a host pool go through a device staging buffer (one
    # host<->device copy per block).
    def _unpack(self, batch: Any, i: int, pages: List[Optional[int]]) -> bool:
        block = batch[i]
        if block is None:
            return False
        staging = self._staging(block)
        if staging is None:
            self.packing.load(self.tensors, pages, _bytes_array(block))
        else:
            staging.copy_(_torch_host(block, len(staging)))
            self.packing.load(self.tensors, pages, staging)
        # Copied out of the daemon's slot: only while the pin held it (a
        # copy that ended after the lease may have read a reused slot).
        return batch.lease_remaining_ms > 0

    def _fill(self, alloc: Any, i: int, pages: List[int]) -> None:
        block = alloc[i]
        if block is None:
            return
        staging = self._staging(block)
        if staging is None:
            self.packing.save(self.tensors, pages, _bytes_array(block))
        else:
            self.packing.save(self.tensors, pages, staging)
            _torch_host(block, len(staging)).copy_(staging)

    def _staging(self, block: Any) -> Any:
        t = self.tensors[0]
        dev = getattr(t, "device", None)
        if not isinstance(block, memoryview) or getattr(dev, "type", "cpu") != "cuda":
            return None
        if self._stage is None:
            import torch

            self._stage = torch.empty(self.packing.block_bytes, dtype=torch.uint8, device=dev)
        return self._stage

    def save(self, task: SaveTask) -> int:
        """Saves a task's chunks (keys already cached are left alone);
        returns how many were stored."""
        if not task.keys:
            return 0
        try:
            alloc = self.client.allocate(self.ns, task.keys)
        except KvmeshError as e:
            log.warning("kvmesh allocate failed (%s): %d chunks not saved", e, len(task.keys))
            return 0
        try:
            with alloc:
                for i in range(len(alloc)):
                    self._fill(alloc, i, task.pages[i])
                status = alloc.commit()
        except Exception as e:  # a failed save is a miss later, never a crash
            # (The text only: the exception's traceback holds views of the
            # allocation, which stays held while they live.)
            log.warning("kvmesh save failed (%s): %d chunks not saved", str(e), len(task.keys))
            return 0
        stored = sum(1 for s in status if s == "stored")
        with self._lock:
            self.saved_chunks += stored
        return stored


def _torch_host(block: memoryview, n: int) -> Any:
    import warnings

    import numpy as np
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only pinned block: only read
        return torch.from_numpy(np.frombuffer(block, dtype=np.uint8)[:n])


def _bytes_array(block: Any) -> Any:
    """A block (memoryview of a host pool, or a device view) as an array the
    kernels take."""
    if isinstance(block, memoryview):
        import numpy as np

        return np.frombuffer(block, dtype=np.uint8)
    return block
