"""DeepSeek-V3 on the native step (engine.models.deepseek_v3.step: engine/csrc/mla.cpp, route_grouped.cpp)
against the torch layers, on random tiny DeepSeek-V3 models in several shapes (group settings,
dense first layers, with and without shared experts, q LoRA or a plain q_proj, YaRN with mscale,
interleaved or plain RoPE, biases, a padded latent row): logits of mixed prefill/decode batches on
paged bf16/fp32 latent caches, 32 greedy tokens identical (full residency, a minimal cache with
chunked prefill and prefetch, misses computed on the CPU), the router against the torch router,
and the calls per decoded layer. kv_b read in its dense format (int8 / bf16, engine/csrc/mla_kvb.cpp)
by one mla_block against the torch layer, the float32 reference path and the original weights."""

from __future__ import annotations

import copy
import importlib
import sys
from pathlib import Path

import pytest
import torch

from engine.errors import ConfigError
from engine.executor import executor_for
from engine.experts.runtime import load_from_store
from engine.kv.base import BatchLayout
from engine.kv.paged import PagedKVCache
from engine.layers.routing import GroupLimitedSigmoidRouter
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.options import configure
from engine.quant.formats import QuantFormat
from engine.quant.kernels import DIRECT_MAX_T, load_extension
from engine.quant.linear import QuantLinear, quantize_dense
from engine.quant.reference import dequantize
from engine.step import _lin
from engine.models.deepseek_v3.step import DeepseekNativeStep, kv_b_bytes, mla_handle
from engine.store import convert
from tests.engine.models.test_deepseek_v3 import YARN, make_deepseek
from tests.engine.test_step import (BOUND, PROMPT, check_minimal_caches, close, decode_calls, fused,  # noqa: F401
                                    greedy, spy, steps)  # (fused: a fixture)

pytestmark = pytest.mark.skipif(load_extension() is None, reason="native kernels unavailable")

# in-dims of the dense linears a multiple of 32 (the native kernels' condition; the published
# shapes all are): q LoRA 32, latent 32, heads x v_head_dim 32 or 64, dense width 64
NATIVE = dict(q_lora_rank=32, kv_lora_rank=32, v_head_dim=16, intermediate_size=64, moe_intermediate_size=32)
SHAPES = {  # kv_b: int8 g64 under --dense int8 where kv_lora_rank is 64, else its bf16 fall-back
    "groups4of2-dense1-shared1-qlora": dict(kv_lora_rank=64),
    "one-group-no-shared-no-dense": dict(n_group=1, topk_group=1, n_shared_experts=0, first_k_dense_replace=0),
    "groups8of3-dense2-no-qlora": dict(n_routed_experts=16, n_group=8, topk_group=3, num_experts_per_tok=3,
                                       first_k_dense_replace=2, q_lora_rank=None, num_hidden_layers=4),
    "yarn-plain-rope-unnormalised-shared2": dict(rope_parameters=YARN, rope_interleave=False,
                                                 norm_topk_prob=False, n_shared_experts=2),
    "yarn-bias-padded-latent": dict(rope_parameters=YARN, num_attention_heads=2, qk_rope_head_dim=6,
                                    attention_bias=True),  # latent 32 + 6 padded to 40
}


@pytest.fixture(scope="module", params=list(SHAPES))
def store(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_deepseek(d / "hf", seed=len(request.param), **{**NATIVE, **SHAPES[request.param]})
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


def latent_kv(cfg, dtype):
    return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4, dtype=dtype)


@pytest.mark.parametrize("dense,i8a,kv_dtype", [("int8", False, torch.float32), ("bf16", False, torch.bfloat16),
                                                ("int8", True, torch.bfloat16)])
def test_native_step_matches_torch_layers_on_mixed_batches(store, dense, i8a, kv_dtype, fused):
    configure(int8_activations=i8a)
    with load_from_store(store, prefetch_depth=0, dense=dense) as sm:
        cfg = sm.model.config
        want = steps(sm.model, latent_kv(cfg, kv_dtype), False, fused)
        calls = spy(sm.model, fused).calls
        step = executor_for(sm.model).native()
        assert isinstance(step, DeepseekNativeStep)
        assert all(h.kvb is not None for h in step.attn)  # kv_b read in its dense format
        got = steps(sm.model, latent_kv(cfg, kv_dtype), True, fused)
        assert calls["mla_block"] == 3 * cfg.num_layers and calls["attn_block"] == 0  # native every step
        assert calls["route_grouped"] == 3 * len(sm.model.moe_blocks) and calls["route"] == 0
        for a, b in zip(got, want):
            close(a, b, BOUND[i8a and executor_for(sm.model).native().ext.ext.has_int8_dots()])


def test_greedy_tokens_identical_through_the_expert_cache(store, fused):
    configure(kv_bf16=False)  # both paths on a float32 cache (the fixture restores the options)
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        fused(False)
        want = greedy(sm.model, 32)
        calls = spy(sm.model, fused).calls
        assert greedy(sm.model, 32) == want
        assert calls["mla_block"] > 0
    check_minimal_caches(store, want, lambda m: greedy(m, 32), fused, native_call="route_grouped")


def test_eight_concurrent_requests_equal_each_alone(store, fused):
    """The batching engine on a paged latent cache: mixed prefill/decode steps, each request's
    tokens equal to the request alone (the native step is batch invariant)."""
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine
    from engine.scheduler import SchedulerConfig

    fused(True)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(3, 96, (n,), generator=g).tolist(), SamplingConfig(max_tokens=m, ignore_eos=True))
            for n, m in zip([1, 3, 5, 8, 13, 17, 24, 31], [1, 4, 7, 10, 12, 3, 9, 6])]
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        c = sm.model.config
        calls = spy(sm.model, fused).calls
        alone = [greedy_of(sm.model, r) for r in reqs]
        kv = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 64, 4, torch.float32)
        engine = Engine(sm.model, kv=kv, config=SchedulerConfig(max_num_batched_tokens=16))
        assert [r.output_ids for r in engine.generate(reqs)] == alone
        assert calls["mla_block"] > 0 and calls["attn_block"] == 0


def greedy_of(model, request) -> list[int]:
    from engine.generate import generate_ids

    return [t for t, _, _ in generate_ids(model, request.prompt_ids, request.sampling)]


def test_decode_is_three_native_calls_per_layer_and_one_for_the_head(store, fused):
    """A decoded token: mla_block, route_grouped (sparse layers), ffn_block per layer, the head."""
    fused(True)
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        cfg = sm.model.config
        assert decode_calls(sm, fused) == {"mla_block": cfg.num_layers, "route_grouped": len(sm.model.moe_blocks),
                               "ffn_block": cfg.num_layers, "head_block": 1}


def test_mla_layers_decode_in_under_ten_ops_per_layer(tmp_path, fused):
    """Every torch dispatcher op and native call of a decoded token (the profiler count of
    bench/vs_llama_cpp.py, sampling included) on a 12-layer DeepSeek-V3 whose layers are all dense
    (MLA and the SwiGLU; the sparse layers' expert-cache lookups are the shared MoE path's)."""
    make_deepseek(tmp_path, seed=5, num_hidden_layers=12, first_k_dense_replace=12, **NATIVE)
    files = open_model_files(tmp_path)
    model = quantize_dense(build_model(files.config, files.source), "int8")
    fused(True)
    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    try:
        c = importlib.import_module("vs_llama_cpp").op_counts(model, PROMPT, 2)
    finally:
        sys.path.remove(str(bench))
    assert c["native_by_name"] == {"mla_block": 12, "ffn_block": 12, "head_block": 1}
    assert c["ops_per_layer"] + c["native_per_layer"] <= 10, c


@pytest.mark.parametrize("experts,top_k,groups,topk_group,normalize", [
    (8, 2, 4, 2, True), (8, 2, 1, 1, True), (16, 3, 8, 3, True), (12, 4, 4, 4, False), (6, 1, 6, 2, True)])
def test_route_grouped_equals_the_torch_router(experts, top_k, groups, topk_group, normalize):
    ext = load_extension()
    g = torch.Generator().manual_seed(experts * 100 + top_k * 10 + groups)
    r = GroupLimitedSigmoidRouter(24, experts, top_k, groups, topk_group, normalize, 2.5)
    with torch.no_grad():
        r.weight.copy_(torch.randn(experts, 24, generator=g) * 0.3)
        r.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.1)
    h = torch.randn(64, 24, generator=g)
    want = r(h)
    ids, w, uniq = ext.route_grouped(h, ext.GroupRouter(r.weight.detach().contiguous(), r.e_score_correction_bias,
                                                        top_k, groups, topk_group, normalize, 2.5))
    order_w, order_n = want.ids.sort(-1), ids.sort(-1)
    assert torch.equal(order_n.values, order_w.values)
    torch.testing.assert_close(w.gather(1, order_n.indices), want.weights.gather(1, order_w.indices),
                               atol=1e-6, rtol=1e-5)
    assert uniq == torch.unique(want.ids).tolist()


def test_bad_router_shapes_are_refused():
    ext = load_extension()
    w, b = torch.randn(8, 16), torch.zeros(8)
    with pytest.raises(RuntimeError, match="n_group"):
        ext.route_grouped(torch.randn(2, 16), ext.GroupRouter(w, b, 2, 3, 1, True, 1.0))  # 8 % 3
    with pytest.raises(RuntimeError, match="top_k"):
        ext.route_grouped(torch.randn(2, 16), ext.GroupRouter(w, b, 5, 4, 2, True, 1.0))  # 5 > 2 groups x 2
    with pytest.raises(RuntimeError, match="router"):
        ext.route_grouped(torch.randn(2, 12), ext.GroupRouter(w, b, 2, 4, 2, True, 1.0))


def test_native_step_on_the_avx2_build(tmp_path, fused):
    """mla.cpp and route_grouped.cpp compiled for AVX2 (cpu_isa forced, as tests/engine/quant/
    test_avx2.py does): the mixed batches against the torch layers."""
    from engine.quant import kernels as K

    if not K.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    make_deepseek(tmp_path / "hf", seed=3, **{**NATIVE, **SHAPES["yarn-bias-padded-latent"]})
    convert(tmp_path / "hf", tmp_path / "store", fmt=QuantFormat("int4", 32), progress=False)
    prev = configure(cpu_isa="avx2")
    try:
        if K.load_extension() is None or K.native_isa() != "avx2":
            pytest.skip(f"AVX2 kernels unavailable: {K.extension_error()}")
        with load_from_store(tmp_path / "store", prefetch_depth=0, dense="int8") as sm:
            cfg = sm.model.config
            want = steps(sm.model, latent_kv(cfg, torch.float32), False, fused)
            calls = spy(sm.model, fused).calls
            assert "avx2" in executor_for(sm.model).native().ext.ext.__name__
            got = steps(sm.model, latent_kv(cfg, torch.float32), True, fused)
            assert calls["mla_block"] == 3 * cfg.num_layers and calls["route_grouped"] > 0
            for a, b in zip(got, want):
                close(a, b, BOUND[False])  # the AVX2 build has float activations only
    finally:
        configure(prev)


# ---- kv_b read in its dense format (engine/csrc/mla_kvb.cpp) -------------------------------------
# one MLA layer: 4 heads of nope 16 / rope 8 / v 16, q LoRA 32, kv_lora_rank 192 (int8 in groups of
# 32 or 64; the kernels take in-dims that are multiples of 32)
KVB_SHAPE = dict(kv_lora_rank=192, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=32, num_hidden_layers=1,
                 first_k_dense_replace=1, intermediate_size=64)
KVB_PLAN = [BatchLayout((0, 1, 2), (5, 11, 3), (0, 0, 0)),  # 11 > KVB_TILE: a tile and a rest
            BatchLayout((0, 1, 2), (1, 1, 1), (5, 11, 3)),
            BatchLayout((0, 2), (2, 1), (6, 4))]


def mla_outputs(model, run) -> list[torch.Tensor]:
    """Layer 0's attention output (after o_proj) on each step of KVB_PLAN, fresh paged fp32 cache;
    ``run(x, cos, sin, positions, storage, tables, layout, kv)`` adds it to x in place."""
    cfg = model.config
    kv = latent_kv(cfg, torch.float32)
    g = torch.Generator().manual_seed(11)
    out = []
    for layout in KVB_PLAN:
        x = torch.randn(layout.num_tokens, cfg.hidden_size, generator=g)
        positions = [c + i for c, n in zip(layout.context_lens, layout.query_lens) for i in range(n)]
        y = x.clone()
        run(y, positions, layout, kv)
        out.append(y - x)
    return out


def native_run(ext, handle, model):
    def run(x, positions, layout, kv):
        storage, tables = kv.native_view(layout, x.device)
        cos, sin = model.rotary.tables(max(positions) + 1)
        ext.mla_block(handle, x, cos, sin, positions, storage, 0, tables, list(layout.query_lens),
                      list(layout.context_lens), DIRECT_MAX_T, False)
    return run


def torch_run(model):
    layer = model.model.layers[0]

    def run(x, positions, layout, kv):
        with torch.no_grad():
            cos, sin = model.rotary.cos_sin(torch.tensor(positions))
            x += layer.self_attn(layer.input_layernorm(x), cos, sin, layout, kv)
    return run


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("fmt,group,rank", [("int8", 64, 192), ("int8", 32, 192), ("bf16", 64, 192)])
def test_mla_block_reads_kv_b_in_its_format(tmp_path, fmt, group, rank, isa):
    """mla_block on kv_b's int8 / bf16 codes (prefill tiles of KVB_TILE tokens and a rest, decode,
    a mixed step) against (1) the torch layer with the same quantized kv_b (its dequantized
    weight): float32 summation order only; and the native float32 path on that dequantized weight:
    bit for bit; (2) the native float32 path on the original weights (the reference path without
    the quantization): off by the quantization error, bounded by the weights' own."""
    from engine.quant import kernels as K

    if isa == "avx2":
        if not K.cpu_has_avx2():
            pytest.skip("this CPU has no AVX2 + FMA + F16C")
        prev = configure(cpu_isa="avx2", int8_activations=False)
    else:
        prev = configure(int8_activations=False)  # the torch layer's o_proj on float activations too
    try:
        ext = K.load_extension()
        if ext is None or (isa == "avx2" and K.native_isa() != "avx2"):
            pytest.skip(f"{isa} kernels unavailable: {K.extension_error()}")
        make_deepseek(tmp_path, seed=9, **{**NATIVE, **KVB_SHAPE, "kv_lora_rank": rank})
        files = open_model_files(tmp_path)
        model = build_model(files.config, files.source)
        a, eps = model.model.layers[0].self_attn, float(model.config.rms_norm_eps)
        original = copy.deepcopy(a.kv_b_proj)
        quantize_dense(model, "int8")
        a.kv_b_proj = QuantLinear.from_linear(original, QuantFormat(fmt, group))
        layer = model.model.layers[0]
        quantized = mla_handle(ext, layer, eps)
        assert quantized.kvb is not None
        dequantized = mla_handle(ext, layer, eps, float_kv_b=True)
        assert dequantized.kvb is None
        got = mla_outputs(model, native_run(ext, quantized, model))
        same_weights = mla_outputs(model, native_run(ext, dequantized, model))
        want = mla_outputs(model, torch_run(model))
        a.kv_b_proj = original
        before = mla_outputs(model, native_run(ext, mla_handle(ext, layer, eps), model))
    finally:
        configure(prev)
    for g, s, w in zip(got, same_weights, want):
        close(g, w, 1e-6)  # measured: 1.6e-7 of the output's scale
        assert torch.equal(g, s)  # the same weight values (code * scale) in the same operations
    # the quantization error of the weights: relative RMS of (dequantized - original) over kv_b
    wq, w0 = dequantize(QuantLinear.from_linear(original, QuantFormat(fmt, group)).q), original.weight.float()
    eps_w = rel_rms(wq, w0)
    assert 0 < eps_w < (0.01 if fmt == "int8" else 0.003)
    # both products of kv_b carry it into the output at about its size (errors of independent
    # weights add in quadrature as the weights themselves do; measured 0.8-1.15 x eps_w): within
    # 2x eps_w, and above a third of it (the codes, not the original weights, were read)
    for g, b in zip(got, before):
        assert eps_w / 3 < rel_rms(g, b) < 2 * eps_w, (rel_rms(g, b), eps_w)


def test_mla_block_float_kv_b_with_a_scalar_tail(tmp_path):
    """The float32 reference path on a kv_lora_rank that is no multiple of the vector width (200:
    12 or 8 values after the 16- or 8-lane vectors) against the torch layer."""
    ext = load_extension()
    make_deepseek(tmp_path, seed=4, **{**NATIVE, **KVB_SHAPE, "kv_lora_rank": 200})
    files = open_model_files(tmp_path)
    model = build_model(files.config, files.source)
    a = model.model.layers[0].self_attn
    kv_b = a.kv_b_proj
    quantize_dense(model, "int8")
    a.kv_b_proj = kv_b  # float32: the reference path
    prev = configure(int8_activations=False)
    try:
        handle = mla_handle(ext, model.model.layers[0], float(model.config.rms_norm_eps))
        assert handle.kvb is None
        got = mla_outputs(model, native_run(ext, handle, model))
        want = mla_outputs(model, torch_run(model))
    finally:
        configure(prev)
    for g, w in zip(got, want):
        close(g, w, 1e-6)


def test_bad_kv_b_is_refused(tmp_path):
    """A quantized kv_b of the wrong shape (a handle built from another layer's weights) or format
    is refused with a clear error before any work."""
    ext = load_extension()
    make_deepseek(tmp_path, seed=9, **{**NATIVE, **KVB_SHAPE})
    files = open_model_files(tmp_path)
    model = quantize_dense(build_model(files.config, files.source), "int8")
    layer, eps = model.model.layers[0], float(model.config.rms_norm_eps)
    a = layer.self_attn
    h = mla_handle(ext, layer, eps)
    wrong = QuantLinear.from_linear(torch.nn.Linear(a.rank, 8, bias=False), QuantFormat("int8", 64))
    h.kvb = _lin(ext, wrong)
    with pytest.raises(RuntimeError, match="kv_b must be int8 or bf16"):
        native_run(ext, h, model)(torch.zeros(1, model.config.hidden_size), [0], BatchLayout((0,), (1,), (0,)),
                                  latent_kv(model.config, torch.float32))
    h.kvb = _lin(ext, QuantLinear.from_linear(torch.nn.Linear(a.rank, a.kv_b_proj.out_features, bias=False),
                                               QuantFormat("int4", 64)))
    with pytest.raises(RuntimeError, match="kv_b must be int8 or bf16"):
        native_run(ext, h, model)(torch.zeros(1, model.config.hidden_size), [0], BatchLayout((0,), (1,), (0,)),
                                  latent_kv(model.config, torch.float32))


def test_kv_b_bytes_at_the_published_shape():
    """DeepSeek-V3: 128 heads x (128 + 128) rows of kv_lora_rank 512 per layer."""
    assert kv_b_bytes(128, 128, 128, 512) == 64 * 2**20
    assert kv_b_bytes(128, 128, 128, 512, "bf16") == 32 * 2**20
    assert kv_b_bytes(128, 128, 128, 512, "int8") == 16 * 2**20 + 2**19  # + 8 fp16 scales per row
    with pytest.raises(ConfigError):
        kv_b_bytes(128, 128, 128, 512, "int4")
    with pytest.raises(ConfigError):
        kv_b_bytes(128, 128, 128, 500, "int8")
