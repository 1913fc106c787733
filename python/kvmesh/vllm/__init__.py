"""kvmesh.vllm: a vLLM V1 KV connector backed by kvmesh.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvmeshConnector",
        "kv_connector_module_path": "kvmesh.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": "/run/kvmesh/kvmeshd.sock",
                                      "chunk_blocks": 1}}'

Written against the connector API of vLLM 0.33 (``KVConnectorBase_V1``:
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) and tested with
vLLM 0.33.0 on CPU: ``scripts/test-connectors.sh`` runs vLLM's own
``Scheduler`` with this connector (loaded from ``kv_connector_module_path``)
and its worker half on CPU tensors, two engine processes with different
``PYTHONHASHSEED`` sharing one daemon (``python/tests/test_vllm_engine.py``).
The vLLM-independent logic (``kvmesh.connector``: keys, plans, packing,
loads and saves) is tested in the default suite. Importing it with another
vLLM version fails at import, naming the versions it was tested with. Run
vLLM with ``--disable-hybrid-kv-cache-manager`` (one KV-cache group).

Loads are synchronous (``start_load_kv`` loads every layer before the
forward pass; ``wait_for_layer_load`` returns at once); saves happen in
``wait_for_save`` once the forward pass wrote every layer. A chunk that
cannot be loaded is reported by ``get_block_ids_with_load_errors``, and vLLM
recomputes it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Set, Tuple

try:
    import vllm  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as e:  # pragma: no cover - needs vLLM
    raise ImportError(f"kvmesh.vllm needs vLLM 0.33 (pip install 'vllm==0.33.*'): {e}") from e

import kvmesh
from kvmesh import kernels
from kvmesh.connector import KeyScheme, LoadTask, Mover, Packing, Planner, SaveTask, StepPlan

__all__ = ["KvmeshConnector", "SUPPORTED_VLLM"]

#: vLLM versions this connector is tested with.
SUPPORTED_VLLM = ("0.33",)

if not any(vllm.__version__.startswith(v) for v in SUPPORTED_VLLM):  # pragma: no cover - needs vLLM
    raise ImportError(
        f"kvmesh.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}.x; this is vLLM {vllm.__version__}"
    )

log = logging.getLogger("kvmesh.vllm")


class KvmeshMetadata(KVConnectorMetadata):
    """The step's plan, sent from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _layout_of(t: Any, use_mla: bool) -> str:
    """vLLM's per-layer KV tensor layout: MLA ``[blocks, tokens, latent]``,
    FlashAttention ``[2, blocks, tokens, heads, dim]`` (NHD), FlashInfer
    ``[blocks, 2, tokens, heads, dim]``."""
    if use_mla:
        return "mla"
    return "nhd" if t.shape[0] == 2 else "flashinfer"


class KvmeshConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._extra = dict(extra)
        self._scheme_w: Optional[KeyScheme] = None
        self._client = kvmesh.Client(extra.get("socket") or os.environ.get("KVMESH_SOCKET"))
        mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        self._block_tokens = cc.block_size
        self._chunk_blocks = int(extra.get("chunk_blocks", 1))
        self._use_mla = bool(getattr(mc, "use_mla", False))
        self._model = str(extra.get("model_tag") or mc.model)
        self._dtype = str(cc.cache_dtype if cc.cache_dtype != "auto" else mc.dtype).replace("torch.", "")
        self._tp = (getattr(pc, "rank", 0) % pc.tensor_parallel_size, pc.tensor_parallel_size)
        self._pp = (0, max(1, int(getattr(pc, "pipeline_parallel_size", 1) or 1)))
        self._layout: Optional[str] = None
        self._planner: Optional[Planner] = None
        self._mover: Optional[Mover] = None
        self._ns = None
        self._load_errors: Set[int] = set()
        # Requests whose load failed in the step being run: nothing of theirs
        # is saved in that step (it was computed over missing context).
        self._failed_loads: Set[str] = set()
        # Per request: the tokens the engine had computed itself when vLLM
        # asked for matches (`request.num_computed_tokens` is set only after
        # `update_state_after_alloc`).
        self._local_computed: Dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            # The namespace does not name the layout (blocks are packed the
            # same for every layout): the scheduler needs none.
            self._layout = "mla" if self._use_mla else "nhd"
            scheme = self._scheme(self._layout, rank=0)
            self._planner = Planner(self._client, scheme, self._namespace(scheme))

    # ----- helpers -----

    def _scheme(self, layout: str, rank: int, pp_rank: int = 0) -> KeyScheme:
        return KeyScheme(
            self._model,
            self._dtype,
            layout,
            self._block_tokens,
            self._chunk_blocks,
            rank,
            self._tp[1],
            mla=self._use_mla,
            pp_rank=pp_rank,
            pp_size=self._pp[1],
        )

    def _namespace(self, scheme: KeyScheme) -> Any:
        try:
            return self._client.namespace(scheme.namespace)
        except kvmesh.errors.NotFound:
            return None  # no worker registered it yet: nothing cached

    @staticmethod
    def _salt(request: Any) -> Optional[bytes]:
        parts = []
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            parts.append(f"lora:{lora.lora_name}")
        salt = getattr(request, "cache_salt", None)
        if salt:
            parts.append(f"salt:{salt}")
        for f in getattr(request, "mm_features", None) or []:
            parts.append(f"mm:{getattr(f, 'identifier', '')}")
        return "|".join(parts).encode() if parts else None

    # ----- scheduler side -----

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        p = self._planner
        assert p is not None
        if p.ns is None:
            p.ns = self._namespace(p.scheme)
        self._local_computed[request.request_id] = num_computed_tokens
        return p.matched_tokens(request.all_token_ids, num_computed_tokens, self._salt(request)), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        p = self._planner
        assert p is not None
        # Called once per scheduling from the start: a new request, or one
        # resumed after a preemption (its blocks were freed): plan it anew.
        # The engine's own computed tokens are those it told
        # `get_num_new_matched_tokens` (vLLM sets `request.num_computed_tokens`
        # only after this call: a new request still says 0 here, and loads
        # planned from 0 overwrote the engine's own prefix blocks and left
        # the matched chunks after them unloaded).
        computed = self._local_computed.pop(request.request_id, request.num_computed_tokens)
        p.restart(request.request_id, request.all_token_ids, self._salt(request))
        p.allocated(request.request_id, blocks.get_block_ids()[0], computed, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        p = self._planner
        assert p is not None
        done: Dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in p.reqs:
                p.add(new.req_id, new.prompt_token_ids or [])
                p.allocated(new.req_id, new.block_ids[0], new.num_computed_tokens, 0)
            done[new.req_id] = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
        cached = scheduler_output.scheduled_cached_reqs
        resumed_ids = getattr(cached, "resumed_req_ids", None)
        resumed_flags = getattr(cached, "resumed_from_preemption", None)
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in p.reqs:
                continue
            ids = cached.new_block_ids[i]
            resumed = (resumed_ids is not None and req_id in resumed_ids) or (
                resumed_flags is not None and i < len(resumed_flags) and bool(resumed_flags[i])
            )
            if ids is not None:
                # A resumed request's new block ids are its whole new table.
                if resumed:
                    p.replace_blocks(req_id, ids[0])
                else:
                    p.extend(req_id, ids[0])
            done[req_id] = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
        # Only prompt tokens are saved (generated tokens are not in the
        # prompt of a later request unless it repeats them as its prompt).
        for req_id in list(done):
            done[req_id] = min(done[req_id], len(p.reqs[req_id].tokens))
        return KvmeshMetadata(p.step(done))

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[dict]]:
        self._local_computed.pop(request.request_id, None)
        if self._planner is not None:
            self._planner.finished(request.request_id)
        return False, None

    # ----- worker side -----

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        tensors = list(kv_caches.values())
        t = tensors[0]
        self._layout = _layout_of(t, self._use_mla)
        if self._use_mla:
            num_blocks, block_tokens, latent = t.shape
            heads, dim = 1, latent
        elif self._layout == "nhd":
            _, num_blocks, block_tokens, heads, dim = t.shape
        else:
            num_blocks, _, block_tokens, heads, dim = t.shape
        rank = self._tp[0]
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except Exception:  # pragma: no cover - depends on vLLM's state
            pass
        pp_rank = 0
        if self._pp[1] > 1:
            # Each pipeline stage its own namespace (its own layers). The
            # scheduler looks up stage 0's: a block another stage lacks is
            # a failed load there, recomputed.
            from vllm.distributed.parallel_state import get_pp_group

            pp_rank = get_pp_group().rank_in_group
        scheme = self._scheme(self._layout, rank, pp_rank)
        shape = kernels.KvShape(self._layout, str(t.dtype), len(tensors), num_blocks, block_tokens, heads, dim)
        packing = Packing(shape, self._chunk_blocks)
        # With `"gpu_pool": true` the daemon has a pool on this GPU and the
        # blocks stay on it; otherwise they are staged through host memory.
        dev = getattr(t, "device", None)
        on_gpu = getattr(dev, "type", "cpu") == "cuda" and bool(self._extra.get("gpu_pool", False))
        device = f"cuda:{dev.index or 0}" if on_gpu else ""
        self._ns = self._client.register_namespace(scheme.namespace, packing.block_bytes, "kvmesh-packed", device)
        self._mover = Mover(self._client, self._ns, packing, tensors)
        self._scheme_w = scheme

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._mover is None or not isinstance(meta, KvmeshMetadata):
            return
        self._failed_loads = set()
        for task in meta.plan.loads:
            failed = self._mover.load(task)
            if failed:
                self._failed_loads.add(task.req_id)
            self._load_errors |= failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # every layer is saved at once in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._mover is None or not isinstance(meta, KvmeshMetadata) or not (self._scheme_w and self._scheme_w.writes):
            return
        for task in meta.plan.saves:
            # This step computed those chunks over context whose load failed
            # (vLLM recomputes the request after the step): saved, they
            # would be wrong KV under valid keys.
            if task.req_id in self._failed_loads:
                continue
            self._mover.save(task)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

