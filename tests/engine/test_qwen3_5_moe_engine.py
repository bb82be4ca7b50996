"""Qwen3.5-MoE (the vision-language checkpoint, served text-only) in the serving engine, the
native CPU step and through the store, with the checks of Qwen3-Next's engine tests
(tests/engine/test_qwen3_next_engine.py): concurrent requests equal each alone (chunked prefill,
forced preemption with fewer state slots than requests), the native step greedy-identical to the
torch layers, an int4 store greedy-identical between a minimal expert cache and full residency
(alone and batched), and `generate --model` printing transformers' 32 greedy tokens."""

from __future__ import annotations

import pytest

from engine.loading import open_model_files
from engine.models.load import build_model
from engine.quant.kernels import load_extension
from engine.runner import Engine
from engine.scheduler import SchedulerConfig
from tests.engine.models.qwen3_5_moe_tiny import make_qwen3_5_moe
from tests.engine.test_qwen3_next_engine import (SHAPE, alone, check_concurrent, check_generate_cli,
                                                 check_int4_store, hybrid, requests)
from tests.engine.test_step import fused  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    make_qwen3_5_moe(path, seed=7, full_attention_interval=2, **SHAPE)
    return path


@pytest.fixture(scope="module")
def model(hf_dir):
    files = open_model_files(hf_dir)
    assert files.config.arch == "qwen3_5_moe"
    return build_model(files.config, files.source)


@pytest.fixture(scope="module")
def reference(model):
    reqs = requests(model.config.vocab_size)
    return reqs, [alone(model, r) for r in reqs]


@pytest.mark.parametrize("blocks,slots,budget", [
    (256, 8, 16),  # chunked prefill: the 130-token prompt takes 9 steps, state carried across
    (40, 3, 24),  # forced preemption and fewer state slots than requests
])
def test_concurrent_requests_equal_each_alone(model, reference, blocks, slots, budget):
    check_concurrent(model, reference, blocks, slots, budget)


@pytest.mark.skipif(load_extension() is None, reason="native kernels unavailable")
def test_native_step_is_greedy_identical_to_the_torch_layers(hf_dir, fused):  # noqa: F811
    """bf16 dense linears on the CPU: the native step (engine.models.qwen3_next.step: deltanet_block
    and the gated attn_block) runs every layer and gives the torch layers' greedy tokens, alone and in a
    batch with chunked prefill."""
    from engine.options import configure
    from engine.quant.linear import quantize_dense
    from tests.engine.test_step import spy

    configure(int8_activations=False, kv_bf16=False)  # both paths on a float32 cache: the same K/V
    files = open_model_files(hf_dir)
    native = quantize_dense(build_model(files.config, files.source), "bf16")
    reqs = requests(native.config.vocab_size, seed=3)
    fused(False)
    want = [alone(native, r) for r in reqs]
    calls = spy(native, fused).calls
    assert [alone(native, r) for r in reqs] == want
    engine = Engine(native, kv=hybrid(native, 256, 8), config=SchedulerConfig(max_num_batched_tokens=24))
    assert [r.output_ids for r in engine.generate(requests(native.config.vocab_size, seed=3))] == want
    assert calls["deltanet_block"] > 0 and calls["attn_block"] > 0


def test_int4_store_minimal_cache_equals_full_residency(hf_dir, model, tmp_path):
    check_int4_store(hf_dir, model, tmp_path / "store")


def test_generate_cli_matches_transformers(tmp_path):
    d = tmp_path / "hf"
    ref = make_qwen3_5_moe(d, seed=3, vocab=32000, tied=True, **SHAPE)
    assert check_generate_cli(ref, d) == 32  # no end of sequence among them
