"""gpt-oss on the native step (engine.models.gpt_oss.step over engine/csrc/step.cpp) against the torch
layers, on random tiny gpt-oss models (window smaller than the prompt, sinks non-zero, YaRN,
biases everywhere, the SwiGLU clamp reached): logits of mixed prefill/decode batches on paged
KV caches, the routed experts' ffn_block (biases, clamped SwiGLU, MXFP4 slots) against
GptOssMoE.run_expert under both instruction sets, greedy tokens over 32 steps from an int4 and
an MXFP4 store (full residency, a minimal cache, misses computed on the CPU), and the calls and
dispatcher ops per decoded layer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.executor import executor_for
from engine.experts.runtime import load_from_store
from engine.generate import generate_ids
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.kv.paged import PagedKVCache
from engine.layers.sampler import SamplingConfig
from engine.options import configure
from engine.quant import kernels as K
from engine.quant.formats import QuantFormat
from engine.quant.reference import dequantize, quantize
from engine.store import convert
from tests.engine.models.test_gpt_oss import make_gpt_oss, make_mxfp4_checkpoint
from tests.engine.test_step import BOUND, check_minimal_caches, close, fused, spy, steps  # noqa: F401  (fused: a fixture)

pytestmark = pytest.mark.skipif(K.load_extension() is None, reason="native kernels unavailable")

PROMPT = [5, 17, 3, 44, 9, 81, 23, 6, 12, 60, 33, 7]  # 12 tokens: longer than the windows (5)


@pytest.fixture(scope="module", params=["int4", "mxfp4"])
def store(request, tmp_path_factory):
    """A 3-layer gpt-oss (sliding, full, sliding; window 5) as an int4 store, or the 2-layer
    MXFP4 checkpoint (released layout) as an mxfp4 store holding its bytes."""
    d = tmp_path_factory.mktemp(f"gpt_oss_native_{request.param}")
    if request.param == "int4":
        make_gpt_oss(d / "hf", seed=7, num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    else:
        make_mxfp4_checkpoint(d / "hf", seed=5)
    convert(d / "hf", d / "store", fmt=QuantFormat(request.param, 32), progress=False)
    return d / "store"


@pytest.mark.parametrize("dense,i8a", [("int8", False), ("bf16", False), ("int8", True)])
@pytest.mark.parametrize("kv_kind", ["paged-bf16", "paged-fp32"])
def test_native_step_matches_torch_layers_on_mixed_batches(store, dense, i8a, kv_kind, fused):
    """Three sequences (5, 9 and 3 prompt tokens: two beyond the window), then a decode step of
    all three, then 2 + 1 tokens: every step's logits native vs torch."""
    prev = configure(int8_activations=i8a)
    try:
        dtype = torch.bfloat16 if kv_kind == "paged-bf16" else torch.float32
        with load_from_store(store, prefetch_depth=0, dense=dense) as sm:
            cfg = sm.model.config
            assert cfg.arch == "gpt_oss" and cfg.arch_params.sliding_window < 9
            assert sm.model.model.layers[0].self_attn.sinks.abs().min() > 0

            def kv():
                return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4,
                                    dtype=dtype)

            want = steps(sm.model, kv(), False, fused)
            calls = spy(sm.model, fused).calls
            got = steps(sm.model, kv(), True, fused)
            assert calls["attn_block"] == 3 * cfg.num_layers and calls["ffn_block"] == 3 * cfg.num_layers
            for a, b in zip(got, want):
                close(a, b, BOUND[i8a and K.int8_activations()])
    finally:
        configure(prev)


def greedy(model, n=32):
    return [t for t, _, _ in generate_ids(model, PROMPT, SamplingConfig(max_tokens=n, ignore_eos=True))]


def test_greedy_tokens_identical_over_32_tokens(store, fused):
    """Torch layers vs the native step from the same store: fully resident, a minimal cache
    (chunked prefill, misses, prefetch) and misses computed on the CPU (run_expert fallback)."""
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        fused(False)
        want = greedy(sm.model)
        calls = spy(sm.model, fused).calls
        assert greedy(sm.model) == want
        assert calls["route"] > 0 and calls["ffn_block"] > 0
        if "mxfp4" in str(store):  # the MXFP4 experts ran from slot rows of their own format
            assert K.FORMAT_IDS["mxfp4"] in sm.cache.slot_rows[:, 0].tolist()
    check_minimal_caches(store, want, greedy, fused)


def test_decode_is_three_native_calls_and_few_ops_per_layer(store, fused):
    """A decode step: attn_block, route and ffn_block per layer and head_block once; and at
    most 10 torch dispatcher ops per layer (profiler events, nested ones included: the step with
    every layer minus the step with the first layer alone, per further layer)."""
    from torch.profiler import ProfilerActivity, profile

    fused(True)
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        cfg = sm.model.config
        kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        executor_for(sm.model)(torch.tensor(PROMPT), BatchLayout.single(0, len(PROMPT), 0), kv)
        executor_for(sm.model)(torch.tensor([7]), BatchLayout.single(0, 1, len(PROMPT)), kv)  # first-use work
        calls = spy(sm.model, fused).calls
        layers, n, ops = sm.model.model.layers, cfg.num_layers, {}
        for keep in (n, 1):
            sm.model.model.layers = layers[:keep]
            try:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    executor_for(sm.model)(torch.tensor([9]), BatchLayout.single(0, 1, len(PROMPT) + 1), kv)
            finally:
                sm.model.model.layers = layers
            ops[keep] = Counter()
            for e in prof.key_averages():
                ops[keep][e.key] += e.count
        assert dict(calls) == {"attn_block": n + 1, "route": n + 1, "ffn_block": n + 1, "head_block": 2}
        per_layer = (sum(ops[n].values()) - sum(ops[1].values())) / (n - 1)
        assert per_layer <= 10, (per_layer, ops[n] - ops[1])


# ------------------------------------------------------------ ffn_block's gpt-oss experts, both ISAs

@pytest.fixture(params=["native", "avx2"])
def ext(request):
    """The extension this CPU builds by default, and the AVX2 one forced (cpu_isa option)."""
    if request.param == "native":
        yield K.load_extension()
        return
    if not K.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    prev = configure(cpu_isa="avx2", quant_kernel="cpp")
    try:
        mod = K.load_extension()
        if mod is None or K.native_isa() != "avx2":
            pytest.skip(f"AVX2 kernels unavailable: {K.extension_error()}")
        yield mod
    finally:
        configure(prev)


@pytest.mark.parametrize("fmt", ["mxfp4", "int4", "bf16"])
@pytest.mark.parametrize("t", [1, 2, 5, 9])
def test_ffn_block_gpt_oss_experts_match_run_expert(ext, fmt, t):
    """x += sum_k w * expert(h) with biases and the clamped SwiGLU, experts read from a slot
    table, against GptOssMoE.run_expert on the same weights dequantized by the reference (gate/up large enough
    that the clamp at 7 is reached), for T = 1 (decode) and several tokens (both loop nests)."""
    from types import SimpleNamespace

    from engine.models.gpt_oss.model import GptOssMoE
    from engine.models.gpt_oss.step import ACT_CLAMPED_SWIGLU

    g = torch.Generator().manual_seed(40 + t)
    E, I, H, k = 4, 64, 96, 2
    q = QuantFormat(fmt, 32)
    experts, rows, keep = [], [], []  # keep: the quantized parts the slot rows point at
    for e in range(E):
        ws = [quantize(torch.randn(*s, generator=g) * c, q) for s, c in (((I, H), 0.8), ((I, H), 0.8), ((H, I), 0.1))]
        experts.append(SimpleNamespace(gate=dequantize(ws[0]), up=dequantize(ws[1]), down=dequantize(ws[2])))
        rows.append(K.slot_row(*ws))  # slot e holds expert e
        keep.append(ws)
    table = torch.tensor(rows, dtype=torch.int64)
    mlp = SimpleNamespace(alpha=1.702, limit=7.0, gate_proj_bias=torch.randn(E, I, generator=g),
                          up_proj_bias=torch.randn(E, I, generator=g), down_proj_bias=torch.randn(E, H, generator=g))
    h = torch.randn(t, H, generator=g)
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    uniq = torch.unique(ids).tolist()
    want = x.clone()
    clamped = False
    for e in uniq:
        tok, kk = (ids == e).nonzero(as_tuple=True)
        want.index_add_(0, tok, GptOssMoE.run_expert(mlp, e, experts[e], h[tok]) * w[tok, kk, None])
        clamped |= bool((h[tok] @ experts[e].gate.T + mlp.gate_proj_bias[e] > 7).any())
    assert clamped  # the clamp is exercised
    act = ext.ExpertAct(ACT_CLAMPED_SWIGLU, 1.702, 7.0, mlp.gate_proj_bias, mlp.up_proj_bias, mlp.down_proj_bias)
    for dmt in (0, 64):  # the scratch loop and the direct loop for every T
        got = x.clone()
        ext.ffn_block(got, h, ids, w, uniq, uniq, table, None, dmt, False, act)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_native_step_under_avx2_matches_torch_layers(store, fused):
    """The whole gpt-oss step (sinks and window in the 8-lane softmax, the experts) on the AVX2
    build, forced: every step's logits of the mixed schedule against the torch layers."""
    if not K.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    prev = configure(int8_activations=False)
    try:
        with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
            cfg = sm.model.config

            def kv():
                return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4)

            want = steps(sm.model, kv(), False, fused)
            configure(cpu_isa="avx2")
            if K.load_extension() is None or K.native_isa() != "avx2":
                pytest.skip(f"AVX2 kernels unavailable: {K.extension_error()}")
            fused(True)
            step = executor_for(sm.model).native()
            assert step is not None and "avx2" in step.ext.__name__
            calls = spy(sm.model, fused).calls
            got = steps(sm.model, kv(), True, fused)
            assert calls["attn_block"] == 3 * cfg.num_layers
            for a, b in zip(got, want):
                close(a, b, BOUND[False])
    finally:
        configure(prev)
