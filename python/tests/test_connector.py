"""kvmesh.connector against a real daemon, with NumPy engine tensors in the
engines' layouts: keys equal across processes whatever their hash seed,
prefix matching in whole chunks, load and save plans across steps (the
call sequence of vLLM's scheduler and workers, replayed on two engine
instances sharing one daemon), engine blocks already computed left alone,
and failed loads reported with their engine blocks."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kvmesh
from kvmesh import kernels
from kvmesh.connector import KeyScheme, Mover, Packing, Planner

L, NB, BT, H, D = 2, 24, 4, 2, 8  # layers, engine blocks, tokens per block, heads, head dim


def engine(layout, seed):
    """An engine's per-layer KV tensors (uint8 with the element bytes last)."""
    shapes = {"nhd": (2, NB, BT, H, D), "hnd": (2, NB, H, BT, D), "flashinfer": (NB, 2, BT, H, D), "mla": (NB, BT, D)}
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=shapes[layout] + (2,), dtype=np.uint8) for _ in range(L)]


def page_bytes(layout, tensors, page):
    """The bytes of engine block `page`, all layers, in the engine's own order."""
    parts = []
    for t in tensors:
        parts.append((t[page] if layout in ("flashinfer", "mla") else t[:, page]).tobytes())
    return b"".join(parts)


def setup(client, layout, chunk_blocks, tp_rank=0, tp_size=1, mla=None):
    mla = layout == "mla" if mla is None else mla
    scheme = KeyScheme("test-model", "float16", layout, BT, chunk_blocks, tp_rank, tp_size, mla=mla)
    shape = kernels.KvShape(layout, "float16", L, NB, BT, H, D)
    packing = Packing(shape, chunk_blocks)
    ns = client.register_namespace(scheme.namespace, packing.block_bytes, "kvmesh-packed")
    return scheme, packing, ns


def tokens(n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(0, 50_000, size=n)]


def test_keys_are_the_same_in_processes_with_different_hash_seeds():
    code = (
        "import kvmesh.connector as c;"
        "s=c.KeyScheme('m','bfloat16','nhd',16,2);"
        "print(','.join(k.hex() for k in s.keys(list(range(100)), salt=b'lora-a')))"
    )
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
    assert len(outs) == 1, outs
    keys = outs.pop().strip().split(",")
    assert len(keys) == 3, "100 tokens: three full chunks of 32"
    s = KeyScheme("m", "bfloat16", "nhd", 16, 2)
    assert [k.hex() for k in s.keys(list(range(100)), salt=b"lora-a")] == keys
    # Keys are chained: a change anywhere changes every later key; a salt
    # changes all of them.
    other = list(range(100))
    other[40] = 7
    k2 = s.keys(other, salt=b"lora-a")
    assert k2[0].hex() == keys[0] and k2[1].hex() != keys[1] and k2[2].hex() != keys[2]
    assert all(a != b for a, b in zip(s.keys(list(range(100))), s.keys(list(range(100)), salt=b"lora-a")))


def test_namespaces_separate_ranks_except_mla():
    a = KeyScheme("m", "torch.float16", "nhd", 16, 1, tp_rank=0, tp_size=2)
    b = KeyScheme("m", "float16", "nhd", 16, 1, tp_rank=1, tp_size=2)
    assert a.namespace != b.namespace and a.writes and b.writes
    assert KeyScheme("m", "float16", "hnd", 16, 1).namespace == KeyScheme("m", "float16", "flashinfer", 16, 1).namespace
    m0 = KeyScheme("m", "float16", "mla", 16, 1, tp_rank=0, tp_size=2, mla=True)
    m1 = KeyScheme("m", "float16", "mla", 16, 1, tp_rank=1, tp_size=2, mla=True)
    assert m0.namespace == m1.namespace and m0.writes and not m1.writes
    with pytest.raises(ValueError):
        KeyScheme("m", "float16", "nhd", 16, 1, tp_rank=2, tp_size=2)
    # Pipeline stages hold other layers: other namespaces (MLA too); no PP,
    # the names as before.
    p0 = KeyScheme("m", "float16", "nhd", 16, 1, pp_rank=0, pp_size=2)
    p1 = KeyScheme("m", "float16", "nhd", 16, 1, pp_rank=1, pp_size=2)
    assert p0.namespace != p1.namespace
    assert KeyScheme("m", "float16", "nhd", 16, 1).namespace == "kvmesh/m/float16/b16x1/tp0of1"
    q0 = KeyScheme("m", "float16", "mla", 16, 1, mla=True, pp_rank=0, pp_size=2)
    q1 = KeyScheme("m", "float16", "mla", 16, 1, mla=True, pp_rank=1, pp_size=2)
    assert q0.namespace != q1.namespace and q0.writes and q1.writes
    with pytest.raises(ValueError):
        KeyScheme("m", "float16", "nhd", 16, 1, pp_rank=2, pp_size=2)


@pytest.mark.parametrize("layout", ["nhd", "hnd", "flashinfer", "mla"])
@pytest.mark.parametrize("chunk_blocks", [1, 2])
def test_two_engines_share_a_prefix_through_the_daemon(client, layout, chunk_blocks):
    """vLLM's sequence on engine A (miss, compute, save), then on engine B
    (a longer prompt with the same prefix: match, allocate, load, save the
    rest); B's loaded engine blocks hold exactly A's bytes."""
    scheme, packing, ns = setup(client, layout, chunk_blocks)
    c = scheme.chunk_tokens
    prompt = tokens(5 * c + 3, seed=len(layout) * 10 + chunk_blocks)
    tag = f"{layout}-{chunk_blocks}".encode()
    # Engine A: nothing cached yet.
    a = engine(layout, 1)
    pa = Planner(client, scheme, ns)
    assert pa.matched_tokens(prompt, 0, salt=tag) == 0
    pa.add("a", prompt, salt=tag)
    blocks_a = list(range(3, 3 + len(prompt) // BT + 1))
    pa.allocated("a", blocks_a, 0, 0)
    plan = pa.step({"a": len(prompt)})
    assert not plan.loads and [len(t.keys) for t in plan.saves] == [5]
    ma = Mover(client, ns, packing, a)
    assert ma.save(plan.saves[0]) == 5
    assert not pa.step({"a": len(prompt)}).saves, "saved once"
    pa.finished("a")

    # Engine B: the same 5 chunks and more; its own prefix cache has the
    # first engine block.
    b = engine(layout, 2)
    b_before = [t.copy() for t in b]
    longer = prompt[: 5 * c] + tokens(2 * c, seed=99)
    pb = Planner(client, scheme, ns)
    computed = BT
    matched = pb.matched_tokens(longer, computed, salt=tag)
    assert matched == 5 * c - computed, "whole chunks, beyond what B computed"
    assert pb.matched_tokens(longer, computed, salt=tag) == matched, "side-effect free"
    pb.add("b", longer, salt=tag)
    blocks_b = list(range(NB - 1, NB - 1 - len(longer) // BT - 1, -1))
    pb.allocated("b", blocks_b, computed, matched)
    plan = pb.step({"b": computed + matched})
    # A chunk B computed whole is not loaded; one it computed in part is,
    # without its computed engine blocks.
    assert len(plan.loads) == 1 and len(plan.loads[0].keys) == 5 - computed // c
    if chunk_blocks > 1:
        assert plan.loads[0].pages[0][0] is None, "B's own engine block is not loaded over"
    mb = Mover(client, ns, packing, b)
    assert mb.load(plan.loads[0]) == set()
    for i in range(5 * chunk_blocks):
        src, dst = blocks_a[i], blocks_b[i]
        want = page_bytes(layout, b_before, dst) if i == 0 else page_bytes(layout, a, src)
        assert page_bytes(layout, b, dst) == want, f"engine block {i}"
    for p in set(range(NB)) - set(blocks_b[1 : 5 * chunk_blocks]):
        assert page_bytes(layout, b, p) == page_bytes(layout, b_before, p), f"block {p} not of the load was written"
    # B computes the rest: only its two new chunks are saved.
    plan = pb.step({"b": len(longer)})
    assert [len(t.keys) for t in plan.saves] == [2]
    assert mb.save(plan.saves[0]) == 2
    assert client.lookup(ns, scheme.keys(longer, salt=tag)) == 7


def test_a_chunk_gone_before_the_load_is_reported_with_its_engine_blocks(client):
    scheme, packing, ns = setup(client, "nhd", 2)
    c = scheme.chunk_tokens
    prompt = tokens(4 * c + 1, seed=5)
    a = engine("nhd", 3)
    pa = Planner(client, scheme, ns)
    pa.add("a", prompt)
    pa.allocated("a", list(range(10)), 0, 0)
    Mover(client, ns, packing, a).save(pa.step({"a": len(prompt)}).saves[0])
    pb = Planner(client, scheme, ns)
    matched = pb.matched_tokens(prompt, 0)
    assert matched == 4 * c
    pb.add("b", prompt)
    blocks = list(range(12, 22))
    pb.allocated("b", blocks, 0, matched)
    plan = pb.step({})
    # The third chunk disappears between the plan and the load.
    assert client.remove(ns, [plan.loads[0].keys[2]]) == [True]
    b = engine("nhd", 4)
    failed = Mover(client, ns, packing, b).load(plan.loads[0])
    assert failed == set(blocks[4:8]), "the missing chunk and everything after it"
    for i in range(4):
        assert page_bytes("nhd", b, blocks[i]) == page_bytes("nhd", a, i)


def test_a_load_that_outlives_its_pin_is_a_miss_and_a_failed_save_no_crash(client, monkeypatch):
    scheme, packing, ns = setup(client, "nhd", 2)
    c = scheme.chunk_tokens
    prompt = tokens(2 * c + 1, seed=8)
    a = engine("nhd", 5)
    pa = Planner(client, scheme, ns)
    pa.add("a", prompt)
    pa.allocated("a", list(range(4)), 0, 0)
    save = pa.step({"a": len(prompt)}).saves[0]
    # A save whose packing fails (a kernel error, a device gone) stores
    # nothing and raises nothing into the engine.
    broken = Mover(client, ns, packing, a)
    monkeypatch.setattr(broken.packing, "save", lambda *a: (_ for _ in ()).throw(RuntimeError("device lost")))
    assert broken.save(save) == 0
    monkeypatch.undo()
    # (Its allocation is aborted in the background: wait for that.)
    deadline = time.time() + 10
    while client.stats()["allocations_outstanding"] and time.time() < deadline:
        time.sleep(0.01)
    assert Mover(client, ns, packing, a).save(save) == 2
    pb = Planner(client, scheme, ns)
    assert pb.matched_tokens(prompt, 0) == 2 * c
    pb.add("b", prompt)
    blocks = list(range(12, 16))
    pb.allocated("b", blocks, 0, 2 * c)
    plan = pb.step({})
    # The copies end after the pin's lease (a long GC pause, say): what
    # they read may be a reused slot, so nothing of it counts as loaded.
    monkeypatch.setattr(kvmesh.Batch, "lease_remaining_ms", property(lambda self: 0))
    assert Mover(client, ns, packing, engine("nhd", 6)).load(plan.loads[0]) == set(blocks)
    monkeypatch.undo()
    b = engine("nhd", 6)
    assert Mover(client, ns, packing, b).load(plan.loads[0]) == set()
    for i in range(4):
        assert page_bytes("nhd", b, blocks[i]) == page_bytes("nhd", a, i)


def test_a_daemon_that_cannot_answer_means_compute(client):
    scheme, packing, ns = setup(client, "nhd", 1)
    p = Planner(client, scheme, ns)
    p.ns = 123456  # a namespace id the daemon does not know
    assert p.matched_tokens(tokens(40, seed=1), 0) == 0 and p.lookup_errors == 1


def test_mla_ranks_share_blocks_and_one_writes(client):
    s0, packing, ns = setup(client, "mla", 1, tp_rank=0, tp_size=2, mla=True)
    s1 = KeyScheme("test-model", "float16", "mla", BT, 1, 1, 2, mla=True)
    assert s1.namespace == s0.namespace
    prompt = tokens(3 * BT + 1, seed=8)
    p1 = Planner(client, s1, ns)
    p1.add("r", prompt)
    p1.allocated("r", [0, 1, 2, 3], 0, 0)
    assert not p1.step({"r": len(prompt)}).saves, "rank 1 does not write MLA blocks"
    p0 = Planner(client, s0, ns)
    p0.add("r", prompt)
    p0.allocated("r", [0, 1, 2, 3], 0, 0)
    saves = p0.step({"r": len(prompt)}).saves
    assert Mover(client, ns, packing, engine("mla", 9)).save(saves[0]) == 3
    assert Planner(client, s1, ns).matched_tokens(prompt, 0) == 3 * BT, "rank 1 finds rank 0's blocks"


class HostPool:
    """SGLang's MHA host pool in the page_first layout, over NumPy memory:
    kv_buffer [2, size, layers, heads, head_dim] (bytes), pages of
    `page_size` tokens; get_page_buffer_meta as SGLang's."""

    def __init__(self, pages, page_size=4, layers=2, heads=2, dim=8, seed=0):
        self.page_size, self.layout = page_size, "page_first"
        self.size = pages * page_size
        self.kv = np.random.default_rng(seed).integers(0, 256, size=(2, self.size, layers, heads, dim), dtype=np.uint8)
        self.per_token = layers * heads * dim

    def get_page_buffer_meta(self, indices):
        base = self.kv.ctypes.data
        ptrs, sizes = [], []
        for idx0 in list(indices)[:: self.page_size]:
            k = base + int(idx0) * self.per_token
            ptrs += [k, k + self.size * self.per_token]
            sizes += [self.page_size * self.per_token] * 2
        return ptrs, sizes

    def page(self, first):
        return self.kv[:, first : first + self.page_size].tobytes()


def test_sglang_storage_moves_pages_between_two_host_pools(daemon, monkeypatch):
    from types import SimpleNamespace

    from kvmesh.sglang import KvmeshStorage, page_key

    cfg = SimpleNamespace(extra_config={"socket": daemon.socket}, is_mla_model=False, tp_rank=0, tp_size=1, model_name="m")
    a, b = KvmeshStorage(cfg, {}), KvmeshStorage(cfg, {})
    pa, pb = HostPool(8, seed=1), HostPool(8, seed=2)
    a.register_mem_pool_host(pa)
    b.register_mem_pool_host(pb)
    keys = [f"sglang-page-{i:064x}" for i in range(4)]
    assert a.batch_exists(keys) == 0
    a_idx = np.arange(4 * 4, 8 * 4, dtype=np.int64)  # pages 4..7 of A
    assert a.batch_set_v1(keys[:3], a_idx[:12]) == [True] * 3
    assert b.batch_exists(keys) == 3, "the consecutive prefix held"
    b_idx = np.arange(0, 4 * 4, dtype=np.int64)  # pages 0..3 of B
    before = pb.page(12)
    got = b.batch_get_v1(keys, b_idx)
    assert got == [True, True, True, False]
    for i in range(3):
        assert pb.page(i * 4) == pa.page(16 + i * 4), f"page {i}"
    assert pb.page(12) == before, "a missing page is left alone"
    # A copy that ends after the pin's lease is a miss (the slot may have
    # been reused under it).
    monkeypatch.setattr(kvmesh.Batch, "lease_remaining_ms", property(lambda self: 0))
    assert b.batch_get_v1(keys, b_idx) == [False] * 4
    monkeypatch.undo()
    # Set again: already held pages count as stored.
    assert a.batch_set_v1(keys[:3], a_idx[:12]) == [True] * 3
    assert page_key(keys[0]) != page_key(keys[1]) and len(page_key(keys[0])) == 16
    # Pages of another KV dtype, or of another pipeline stage, are other
    # namespaces: same size, other bytes (before, bf16 and fp16 pages, and
    # the stages' layers, were read as each other's).
    pf = HostPool(8, seed=3)
    pf.dtype = "float16"
    pa.dtype = "bfloat16"
    fp16, bf16 = KvmeshStorage(cfg, {}), KvmeshStorage(cfg, {})
    fp16.register_mem_pool_host(pf)
    bf16.register_mem_pool_host(pa)
    assert bf16.batch_set_v1(keys[:2], a_idx[:8]) == [True] * 2
    assert fp16.batch_exists(keys) == 0, "bf16 pages found by an fp16 engine"
    pp = [KvmeshStorage(SimpleNamespace(**{**cfg.__dict__, "pp_rank": r, "pp_size": 2}), {}) for r in (0, 1)]
    pp[0].register_mem_pool_host(HostPool(8, seed=4))
    pp[1].register_mem_pool_host(HostPool(8, seed=5))
    assert pp[0].batch_set_v1(keys[:2], a_idx[:8]) == [True] * 2
    assert pp[1].batch_exists(keys) == 0, "stage 0's layers found by stage 1"
    # A daemon not reachable: no shared cache, not a failed start.
    gone = KvmeshStorage(SimpleNamespace(**{**cfg.__dict__, "extra_config": {"socket": "/nonexistent/kvmesh.sock"}}), {})
    gone.register_mem_pool_host(HostPool(8, seed=6))
    assert gone.batch_exists(keys) == 0 and gone.batch_get_v1(keys, b_idx) == [False] * 4
    # MLA: rank 1 does not write, and says so as success.
    mla1 = KvmeshStorage(SimpleNamespace(**{**cfg.__dict__, "is_mla_model": True, "tp_rank": 1, "tp_size": 2}), {})
    mla1.register_mem_pool_host(pb)
    assert mla1.batch_set_v1(["x"], b_idx[:4]) == [True] and mla1.batch_exists(["x"]) == 0


def fake_vllm(monkeypatch, version="0.33.0"):
    """A stand-in for the few vLLM names the connector imports (vLLM is not
    installed in the default suite; scripts/test-connectors.sh runs the
    connector inside vLLM itself): the base class keeps the metadata as
    vLLM's does."""
    import enum
    import types

    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        pass

    class KVConnectorBase_V1:
        def __init__(self, vllm_config, role, kv_cache_config):
            self._vllm_config, self._role, self._connector_metadata = vllm_config, role, None
            self._kv_cache_config = kv_cache_config

        def bind_connector_metadata(self, m):
            self._connector_metadata = m

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

    base.KVConnectorRole, base.KVConnectorMetadata, base.KVConnectorBase_V1 = (
        KVConnectorRole,
        KVConnectorMetadata,
        KVConnectorBase_V1,
    )
    root = types.ModuleType("vllm")
    root.__version__ = version
    monkeypatch.setitem(sys.modules, "vllm", root)
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer.kv_connector.v1.base", base)
    monkeypatch.delitem(sys.modules, "kvmesh.vllm", raising=False)
    return KVConnectorRole


def test_the_vllm_adapter_in_vllms_call_order(daemon, monkeypatch):
    """The connector class driven as vLLM 0.33's scheduler and worker drive
    it (names from vLLM's API; vLLM itself is not installed here): engine
    A saves a prompt, engine B finds it, loads it into its blocks, and
    reports a chunk removed meanwhile for recompute."""
    from types import SimpleNamespace as NS

    worker, sched_of = _vllm_pair(daemon, monkeypatch, "m-vllm")
    prompt = tokens(4 * BT + 2, seed=21)
    wa, ta = worker()
    sa = sched_of()
    req = NS(request_id="a", all_token_ids=prompt, num_computed_tokens=0, lora_request=None, cache_salt=None)
    assert sa.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks_a = [5, 6, 7, 8, 9]
    sa.update_state_after_alloc(req, NS(get_block_ids=lambda: (blocks_a,)), 0)
    new = NS(req_id="a", prompt_token_ids=prompt, block_ids=(blocks_a,), num_computed_tokens=0)
    meta = _vllm_step(sa, wa, [new], {"a": len(prompt)})
    assert len(meta.plan.saves[0].keys) == 4 and wa._mover.saved_chunks == 4
    assert sa.request_finished(req, blocks_a) == (False, None)

    wb, tb = worker()
    sb = sched_of()
    reqb = NS(request_id="b", all_token_ids=prompt, num_computed_tokens=0, lora_request=None, cache_salt=None)
    n, is_async = sb.get_num_new_matched_tokens(reqb, 0)
    assert (n, is_async) == (4 * BT, False)
    blocks_b = [20, 1, 14, 3, 11]
    sb.update_state_after_alloc(reqb, NS(get_block_ids=lambda: (blocks_b,)), n)
    # The last chunk goes before the workers load.
    ns = wb._client.namespace(wb._scheme_w.namespace)
    assert wb._client.remove(ns, [wb._scheme_w.keys(prompt)[3]]) == [True]
    newb = NS(req_id="b", prompt_token_ids=prompt, block_ids=(blocks_b,), num_computed_tokens=n)
    _vllm_step(sb, wb, [newb], {"b": 2})
    assert wb.get_block_ids_with_load_errors() == {blocks_b[3]}
    assert wb.get_block_ids_with_load_errors() == set(), "reported once"
    for i in range(3):
        for la, lb in zip(ta, tb):
            assert np.array_equal(la[:, blocks_a[i]], lb[:, blocks_b[i]]), f"block {i}"


def _vllm_pair(daemon, monkeypatch, model):
    """A vLLM adapter's worker factory and scheduler factory on `daemon`."""
    from types import SimpleNamespace as NS

    Role = fake_vllm(monkeypatch)
    import kvmesh.vllm as kv

    cfg = NS(
        kv_transfer_config=NS(kv_connector_extra_config={"socket": daemon.socket}),
        model_config=NS(model=model, dtype="float16", use_mla=False),
        cache_config=NS(block_size=BT, cache_dtype="auto"),
        parallel_config=NS(tensor_parallel_size=1, rank=0),
    )
    rng = np.random.default_rng(5)

    def worker():
        w = kv.KvmeshConnector(cfg, Role.WORKER)
        caches = {f"layer.{i}": rng.standard_normal((2, NB, BT, H, D)).astype(np.float16) for i in range(L)}
        w.register_kv_caches(caches)
        return w, list(caches.values())

    return worker, lambda: kv.KvmeshConnector(cfg, Role.SCHEDULER)


def _vllm_step(sched, w, new_reqs, scheduled, cached=None):
    from types import SimpleNamespace as NS

    cached = cached or NS(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    out = NS(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
    )
    meta = sched.build_connector_meta(out)
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    return meta


def _vllm_save(worker, sched_of, prompt, blocks):
    """Engine A puts `prompt`'s whole chunks; returns its tensors."""
    from types import SimpleNamespace as NS

    wa, ta = worker()
    sa = sched_of()
    req = NS(request_id="a", all_token_ids=prompt, num_computed_tokens=0, lora_request=None, cache_salt=None)
    assert sa.get_num_new_matched_tokens(req, 0) == (0, False)
    sa.update_state_after_alloc(req, NS(get_block_ids=lambda: (blocks,)), 0)
    new = NS(req_id="a", prompt_token_ids=prompt, block_ids=(blocks,), num_computed_tokens=0)
    _vllm_step(sa, wa, [new], {"a": len(prompt)})
    return ta


def test_the_vllm_adapter_loads_after_the_engines_own_prefix(daemon, monkeypatch):
    """vLLM asks for matches with the tokens its own prefix cache covers and
    sets `request.num_computed_tokens` only after `update_state_after_alloc`:
    the load must start after the engine's own blocks (kept as they are)
    and cover every matched chunk. Before, it started at 0 (the stale
    count): the engine's own block was overwritten and the last matched
    chunk never loaded."""
    from types import SimpleNamespace as NS

    worker, sched_of = _vllm_pair(daemon, monkeypatch, "m-vllm-local")
    prompt = tokens(4 * BT + 2, seed=31)
    blocks_a = [5, 6, 7, 8, 9]
    ta = _vllm_save(worker, sched_of, prompt, blocks_a)
    wb, tb = worker()
    sb = sched_of()
    reqb = NS(request_id="b", all_token_ids=prompt, num_computed_tokens=0, lora_request=None, cache_salt=None)
    # B's own prefix cache holds the first block.
    n, _ = sb.get_num_new_matched_tokens(reqb, BT)
    assert n == 3 * BT
    blocks_b = [20, 1, 14, 3, 11]
    own = [t[:, blocks_b[0]].copy() for t in tb]
    sb.update_state_after_alloc(reqb, NS(get_block_ids=lambda: (blocks_b,)), n)
    new = NS(req_id="b", prompt_token_ids=prompt, block_ids=(blocks_b,), num_computed_tokens=BT + n)
    meta = _vllm_step(sb, wb, [new], {"b": 2})
    assert [len(t.keys) for t in meta.plan.loads] == [3]
    assert wb.get_block_ids_with_load_errors() == set()
    for la, lb, o in zip(ta, tb, own):
        assert np.array_equal(lb[:, blocks_b[0]], o), "the engine's own block was overwritten"
        for i in range(1, 4):
            assert np.array_equal(la[:, blocks_a[i]], lb[:, blocks_b[i]]), f"block {i} not loaded"


def test_the_vllm_adapter_saves_nothing_computed_over_a_failed_load(daemon, monkeypatch):
    """A load that failed in a step leaves that step's forward pass without
    its context (vLLM recomputes the request afterwards): the chunks that
    step computed must not be saved. Before, they were: wrong KV under valid
    keys."""
    from types import SimpleNamespace as NS

    worker, sched_of = _vllm_pair(daemon, monkeypatch, "m-vllm-failed")
    prompt = tokens(8 * BT + 2, seed=32)
    _vllm_save(worker, sched_of, prompt[: 4 * BT + 2], [5, 6, 7, 8, 9])
    wb, _ = worker()
    sb = sched_of()
    reqb = NS(request_id="b", all_token_ids=prompt, num_computed_tokens=0, lora_request=None, cache_salt=None)
    n, _ = sb.get_num_new_matched_tokens(reqb, 0)
    assert n == 4 * BT
    blocks_b = list(range(10, 19))
    sb.update_state_after_alloc(reqb, NS(get_block_ids=lambda: (blocks_b,)), n)
    keys = wb._scheme_w.keys(prompt)
    ns = wb._client.namespace(wb._scheme_w.namespace)
    assert wb._client.remove(ns, [keys[1]]) == [True]
    new = NS(req_id="b", prompt_token_ids=prompt, block_ids=(blocks_b,), num_computed_tokens=n)
    meta = _vllm_step(sb, wb, [new], {"b": len(prompt) - n})
    assert meta.plan.saves and meta.plan.saves[0].keys == keys[4:8], "the plan saves chunks 4-7"
    assert wb.get_block_ids_with_load_errors(), "the load failed"
    present = wb._client.contains(ns, keys[4:8])
    assert not any(present), f"chunks computed over a failed load were saved: {present}"


def test_a_preempted_request_is_loaded_again_into_its_new_blocks():
    """A request preempted after its load (its blocks freed) and resumed:
    its load is planned again, into the new block table, which replaces the
    old one (vLLM sends the whole new table as the resumed request's new
    block ids). Before, no load was planned on resume and the table was
    doubled (later saves read the wrong blocks)."""
    scheme = KeyScheme("test-model", "float16", "nhd", BT, 1, 0, 1)
    p = Planner(None, scheme)
    prompt = tokens(4 * BT + 2, seed=33)
    p.restart("r", prompt)
    p.allocated("r", [1, 2, 3, 4, 5], 0, 4 * BT)
    first = p.step({"r": 4 * BT + 2})
    assert [t.pages for t in first.loads] == [[[1], [2], [3], [4]]]
    # Preempted, resumed with other blocks.
    p.restart("r", prompt)
    p.allocated("r", [7, 8, 9, 10, 11], 0, 4 * BT)
    p.replace_blocks("r", [7, 8, 9, 10, 11])
    again = p.step({"r": 4 * BT + 2})
    assert [t.pages for t in again.loads] == [[[7], [8], [9], [10]]]
    assert p.reqs["r"].block_ids == [7, 8, 9, 10, 11]


def test_the_vllm_adapter_refuses_other_vllm_versions_at_import(monkeypatch):
    fake_vllm(monkeypatch, version="0.11.0")
    with pytest.raises(ImportError, match="0.33"):
        import kvmesh.vllm  # noqa: F401


def test_engines_with_different_layouts_share_blocks(client):
    """FlashAttention (NHD) writes, FlashInfer reads: one namespace, the
    same packed bytes."""
    s_nhd, p_nhd, ns = setup(client, "nhd", 1)
    s_fi, p_fi, ns2 = setup(client, "flashinfer", 1)
    assert s_nhd.namespace == s_fi.namespace and ns.id == ns2.id
    prompt = tokens(2 * BT + 1, seed=77)
    a, b = engine("nhd", 5), engine("flashinfer", 6)
    pa = Planner(client, s_nhd, ns)
    pa.add("a", prompt)
    pa.allocated("a", [2, 3, 4], 0, 0)
    assert Mover(client, ns, p_nhd, a).save(pa.step({"a": len(prompt)}).saves[0]) == 2
    pb = Planner(client, s_fi, ns)
    n = pb.matched_tokens(prompt, 0)
    assert n == 2 * BT
    pb.add("b", prompt)
    pb.allocated("b", [9, 10, 11], 0, n)
    assert Mover(client, ns, p_fi, b).load(pb.step({}).loads[0]) == set()
    for src, dst in [(2, 9), (3, 10)]:
        for la, lb in zip(a, b):
            assert np.array_equal(la[:, src], lb[dst]), f"block {src} -> {dst}"
