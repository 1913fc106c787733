"""The kvmesh connector inside vLLM's own scheduler (on CPU).

Needs vLLM (``scripts/test-connectors.sh`` installs it into a cached
virtualenv); without it every test here is skipped, saying so. vLLM's
``Scheduler`` runs with ``KvmeshConnector`` loaded the way ``vllm serve
--kv-transfer-config`` loads it (``kv_connector_module_path``); the worker
half of the connector runs in the same process on CPU tensors in vLLM's
per-layer layout, and a stand-in for the forward pass writes each computed
token's K/V as a function of (layer, position, token). Two engines share
one daemon: the second, a separate process started with another
``PYTHONHASHSEED``, is asked for the same prompt, must be told by the
connector that the prefix is cached, load it, and end up with the same
bytes in its pages the first one computed, without computing them.
"""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (scripts/test-connectors.sh installs vLLM and torch)")
pytest.importorskip("vllm", reason="needs vLLM (scripts/test-connectors.sh installs it into a virtualenv)")

BLOCK = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, DIM = 2, 8
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Llama config: vLLM's ModelConfig reads it; no weights."""
    d = str(tmp_path_factory.mktemp("kvmesh-vllm-model"))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HEADS * DIM,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "num_hidden_layers": len(LAYERS),
        "intermediate_size": 32,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
        "rms_norm_eps": 1e-6,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


ENGINE = r'''
import json, sys
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

args = json.loads(sys.argv[1])
BLOCK, LAYERS, HEADS, DIM, NUM_BLOCKS = args["block"], args["layers"], args["heads"], args["dim"], args["num_blocks"]

model = ModelConfig(model=args["model"], dtype="float16", seed=0, skip_tokenizer_init=True)
vcfg = VllmConfig(
    model_config=model,
    scheduler_config=SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=256, max_model_len=4096, enable_chunked_prefill=True,
        is_encoder_decoder=False, disable_hybrid_kv_cache_manager=True,
    ),
    cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True),
    kv_transfer_config=KVTransferConfig(
        kv_connector="KvmeshConnector", kv_connector_module_path="kvmesh.vllm", kv_role="kv_both",
        kv_connector_extra_config={"socket": args["socket"], "model_tag": "tiny-llama"},
    ),
    device_config=DeviceConfig("cpu"),
)
kv_cfg = KVCacheConfig(
    num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
    kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16))],
)
vcfg.cache_config.num_gpu_blocks = NUM_BLOCKS
sched = Scheduler(vllm_config=vcfg, kv_cache_config=kv_cfg, log_stats=True,
                  structured_output_manager=StructuredOutputManager(vcfg), block_size=BLOCK)
conn = sched.connector
assert type(conn).__name__ == "KvmeshConnector", type(conn)

# The worker half, in vLLM's per-layer layout [2, blocks, tokens, heads, dim].
from kvmesh.vllm import KvmeshConnector
worker = KvmeshConnector(vcfg, KVConnectorRole.WORKER, kv_cfg)
caches = {name: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM, dtype=torch.float16) for name in LAYERS}
worker.register_kv_caches(caches)

def kv(layer, pos, tok):
    # What a forward pass would write for a token: any function of the
    # prefix works; this one is cheap and distinct per (layer, pos, tok).
    base = (layer * 131 + pos * 7 + tok * 3) % 251
    k = torch.arange(HEADS * DIM, dtype=torch.float32).reshape(HEADS, DIM) + base
    return k.to(torch.float16), (-k).to(torch.float16)

init_none_hash(sha256)
prompt = args["prompt"]
sp = SamplingParams(max_tokens=2)
sp.update_from_generation_config({}, 50256)
req = Request(request_id="r1", prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
              mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
sched.add_request(req)

computed_here = 0
external = None
block_ids = None
load_errors = set()
for step in range(20):
    out = sched.schedule()
    if not out.num_scheduled_tokens:
        break
    # Tokens computed before this step (the scheduler has already counted
    # the scheduled ones in the request).
    for new in out.scheduled_new_reqs:
        block_ids = list(new.block_ids[0])
        start = new.num_computed_tokens
        if external is None:
            external = new.num_computed_tokens
    cached = out.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        if cached.new_block_ids[i] is not None:
            block_ids += list(cached.new_block_ids[i][0])
        start = cached.num_computed_tokens[i]
    worker.bind_connector_metadata(out.kv_connector_metadata)
    worker.start_load_kv(None)
    # The forward pass: K/V of every scheduled token into its page.
    n = out.num_scheduled_tokens["r1"]
    toks = req.all_token_ids
    for pos in range(start, start + n):
        page, off = block_ids[pos // BLOCK], pos % BLOCK
        for li, name in enumerate(LAYERS):
            k, v = kv(li, pos, toks[pos])
            caches[name][0, page, off] = k
            caches[name][1, page, off] = v
    computed_here += n
    worker.wait_for_save()
    load_errors |= worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    mro = ModelRunnerOutput(req_ids=["r1"], req_id_to_index={"r1": 0}, sampled_token_ids=[[7]], logprobs=None,
                            prompt_logprobs_dict={}, pooler_output=None)
    sched.update_from_output(out, mro)

# Every prompt position's K/V in this engine's pages, as the forward pass
# would have written it.
mismatch = []
for pos in range(len(prompt)):
    page, off = block_ids[pos // BLOCK], pos % BLOCK
    for li, name in enumerate(LAYERS):
        k, v = kv(li, pos, prompt[pos])
        if not (torch.equal(caches[name][0, page, off], k) and torch.equal(caches[name][1, page, off], v)):
            mismatch.append((pos, li))
print(json.dumps({"external_tokens": external, "computed_here": computed_here, "mismatched": len(mismatch),
                  "first_mismatch": mismatch[:3], "load_errors": sorted(load_errors), "finished": req.is_finished()}))
'''


def _engine(daemon, model: str, prompt, hashseed: str) -> dict:
    args = {"block": BLOCK, "layers": list(LAYERS), "heads": HEADS, "dim": DIM, "num_blocks": NUM_BLOCKS,
            "model": model, "socket": daemon.socket, "prompt": prompt}
    env = dict(os.environ, PYTHONHASHSEED=hashseed, VLLM_LOGGING_LEVEL="WARNING")
    p = subprocess.run([sys.executable, "-c", ENGINE, json.dumps(args)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_second_engine_loads_the_prefix_the_first_computed(daemon, model_dir):
    prompt = [(i * 37 + 11) % 997 for i in range(5 * BLOCK + 3)]  # 5 full blocks and a tail
    first = _engine(daemon, model_dir, prompt, "1")
    print("first engine:", first)
    assert first["external_tokens"] == 0, first  # nothing cached yet
    assert first["computed_here"] >= len(prompt), first
    assert first["mismatched"] == 0, first

    second = _engine(daemon, model_dir, prompt, "2")  # another process, another hash seed
    print("second engine:", second)
    # The 5 full blocks are cached; vLLM computes the tail (and at least one
    # token) itself.
    assert second["external_tokens"] == 5 * BLOCK, second
    assert second["computed_here"] < len(prompt) - 4 * BLOCK, second
    assert second["load_errors"] == [], second
    assert second["mismatched"] == 0, second  # the loaded pages hold the first engine's bytes

    other = _engine(daemon, model_dir, [p + 1 for p in prompt], "3")  # a different prompt: no hit
    print("third engine (another prompt):", other)
    assert other["external_tokens"] == 0, other
