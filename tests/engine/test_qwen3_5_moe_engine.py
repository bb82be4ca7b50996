"""Qwen3.5-MoE (the vision-language checkpoint, served text-only) in the serving engine, the
native CPU step and through the store: concurrent requests equal each alone (chunked prefill,
forced preemption), the native step greedy-identical to the torch layers, an int4 store
greedy-identical between a minimal expert cache and full residency (alone and batched), and
`generate --model` against transformers."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from engine.generate import Request, generate_ids
from engine.kv.state import HybridKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import load_model, open_model_files
from engine.models.load import build_model
from engine.quant.kernels import load_extension
from engine.runner import Engine
from engine.scheduler import SchedulerConfig
from tests.engine.models.hf_tiny import add_mixtral_tokenizer
from tests.engine.models.qwen3_5_moe_tiny import make_qwen3_5_moe
from tests.engine.test_step import fused  # noqa: F401  (fixture)

PROMPT_LENS = [1, 3, 9, 17, 40, 66, 70, 130]  # three of them longer than one DeltaNet chunk
MAX_TOKENS = [1, 4, 7, 10, 12, 3, 9, 6]
# int4 g32 needs expert widths divisible by 32; rotary width 8 of head_dim 16 (sections sum to 4)
SHAPE = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=32)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    make_qwen3_5_moe(path, seed=7, full_attention_interval=2, **SHAPE)
    return path


@pytest.fixture(scope="module")
def model(hf_dir):
    files = open_model_files(hf_dir)
    return build_model(files.config, files.source)


def requests(vocab: int, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(3, vocab, (n,), generator=g).tolist(),
                    SamplingConfig(max_tokens=m, ignore_eos=True))
            for n, m in zip(PROMPT_LENS, MAX_TOKENS)]


def alone(model, req: Request) -> list[int]:
    return [t for t, _, _ in generate_ids(model, req.prompt_ids, req.sampling)]


def hybrid(model, blocks: int = 256, slots: int = 8, block_size: int = 4) -> HybridKVCache:
    return HybridKVCache(model.config, blocks, slots, block_size, torch.float32)


@pytest.fixture(scope="module")
def reference(model):
    reqs = requests(model.config.vocab_size)
    return reqs, [alone(model, r) for r in reqs]


@pytest.mark.parametrize("blocks,slots,budget", [
    (256, 8, 16),  # chunked prefill: the 130-token prompt takes 9 steps, state carried across
    (40, 3, 24),  # forced preemption and fewer state slots than requests
])
def test_concurrent_requests_equal_each_alone(model, reference, blocks, slots, budget):
    reqs, want = reference
    engine = Engine(model, kv=hybrid(model, blocks, slots), config=SchedulerConfig(max_num_batched_tokens=budget))
    results = engine.generate(reqs)
    assert [r.output_ids for r in results] == want
    m = engine.metrics()
    if blocks == 40:
        assert m.preemptions > 0 and m.recomputed_tokens > 0
    assert (m.kv.blocks_used, m.kv.state_slots_used, m.kv.bytes_used) == (0, 0, 0)


@pytest.mark.skipif(load_extension() is None, reason="native kernels unavailable")
def test_native_step_is_greedy_identical_to_the_torch_layers(hf_dir, fused):  # noqa: F811
    """bf16 dense linears on the CPU: the native step (engine.models.qwen3_next.step: deltanet_block
    and the gated attn_block) runs every layer and gives the torch layers' greedy tokens, alone and in a
    batch with chunked prefill."""
    from engine.options import configure
    from engine.quant.linear import quantize_dense
    from tests.engine.test_step import spy

    configure(int8_activations=False)
    files = open_model_files(hf_dir)
    native = quantize_dense(build_model(files.config, files.source), "bf16")
    reqs = requests(native.config.vocab_size, seed=3)
    fused(False)
    want = [alone(native, r) for r in reqs]
    calls = spy(native, fused).calls
    assert [alone(native, r) for r in reqs] == want
    engine = Engine(native, kv=hybrid(native), config=SchedulerConfig(max_num_batched_tokens=24))
    assert [r.output_ids for r in engine.generate(requests(native.config.vocab_size, seed=3))] == want
    assert calls["deltanet_block"] > 0 and calls["attn_block"] > 0


def test_int4_store_minimal_cache_equals_full_residency(hf_dir, model, tmp_path):
    from engine.experts.runtime import load_from_store
    from engine.experts.tiers import align_up
    from engine.quant.formats import QuantFormat
    from engine.store import convert

    convert(hf_dir, tmp_path / "store", fmt=QuantFormat("int4", 32), progress=False)
    full = load_from_store(tmp_path / "store", prefetch_depth=0)
    top_k = full.model.config.moe.top_k
    small = load_from_store(tmp_path / "store", device_budget=top_k * align_up(full.store.expert_nbytes),
                            prefetch_depth=1)
    try:
        assert full.model.config == model.config  # the manifest's round trip, arch_params included
        prompt = torch.randint(3, 96, (100,), generator=torch.Generator().manual_seed(4))
        sampling = SamplingConfig(max_tokens=32, ignore_eos=True)
        tokens_full = [t for t, _, _ in generate_ids(full.model, prompt.tolist(), sampling)]
        tokens_small = [t for t, _, _ in generate_ids(small.model, prompt.tolist(), sampling)]
        assert tokens_small == tokens_full
        assert small.cache.metrics.total().misses > 0  # the minimal cache really evicted
        engine = Engine(small.model, kv=hybrid(small.model, 128, 4), config=SchedulerConfig(max_num_batched_tokens=32))
        reqs = requests(96, seed=9)[:5]
        assert [r.output_ids for r in engine.generate(reqs)] == [alone(full.model, r) for r in reqs]
    finally:
        full.close()
        small.close()


def test_generate_cli_matches_transformers(tmp_path):
    from services.cli import main

    d = tmp_path / "hf"
    ref = make_qwen3_5_moe(d, seed=3, vocab=32000, tied=True, **SHAPE)
    add_mixtral_tokenizer(d)
    _, tok, _ = load_model(d)
    ids = tok.encode("Hello there, tell me about recurrent state")
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    r = CliRunner().invoke(main, ["generate", "--model", str(d), "--dense", "fp32", "--max-tokens", "32",
                                  "Hello there, tell me about recurrent state"])
    assert r.exit_code == 0, r.output
    assert not set(hf) & set(tok.eos_token_ids) and len(hf) == 32  # 32 tokens, no early end
    assert r.stdout.rstrip("\n") == tok.decode(hf)
