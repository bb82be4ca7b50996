"""DeepSeek-V3 on the native step (engine.step_deepseek: engine/csrc/mla.cpp, route_grouped.cpp)
against the torch layers, on random tiny DeepSeek-V3 models in several shapes (group settings,
dense first layers, with and without shared experts, q LoRA or a plain q_proj, YaRN with mscale,
interleaved or plain RoPE, biases, a padded latent row): logits of mixed prefill/decode batches on
paged bf16/fp32 latent caches, 32 greedy tokens identical (full residency, a minimal cache with
chunked prefill and prefetch, misses computed on the CPU), the router against the torch router,
and the calls per decoded layer."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from engine.experts.runtime import load_from_store
from engine.kv.paged import PagedKVCache
from engine.layers.routing import GroupLimitedSigmoidRouter
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.options import configure
from engine.quant.formats import QuantFormat
from engine.quant.kernels import load_extension
from engine.quant.linear import quantize_dense
from engine.step_deepseek import DeepseekNativeStep
from engine.store import convert
from tests.engine.models.test_deepseek_v3 import YARN, make_deepseek
from tests.engine.test_step import (BOUND, PROMPT, check_minimal_caches, close, decode_calls, fused,  # noqa: F401
                                    greedy, spy, steps)  # (fused: a fixture)

pytestmark = pytest.mark.skipif(load_extension() is None, reason="native kernels unavailable")

# in-dims of the dense linears a multiple of 32 (the native kernels' condition; the published
# shapes all are): q LoRA 32, latent 32, heads x v_head_dim 32 or 64, dense width 64
NATIVE = dict(q_lora_rank=32, kv_lora_rank=32, v_head_dim=16, intermediate_size=64, moe_intermediate_size=32)
SHAPES = {
    "groups4of2-dense1-shared1-qlora": {},
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
        assert isinstance(sm.model.native_step(), DeepseekNativeStep)
        got = steps(sm.model, latent_kv(cfg, kv_dtype), True, fused)
        assert calls["mla_block"] == 3 * cfg.num_layers and calls["attn_block"] == 0  # native every step
        assert calls["route_grouped"] == 3 * len(sm.model.moe_blocks) and calls["route"] == 0
        for a, b in zip(got, want):
            close(a, b, BOUND[i8a and sm.model.native_step().ext.ext.has_vnni()])


def test_greedy_tokens_identical_through_the_expert_cache(store, fused):
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
            assert "avx2" in sm.model.native_step().ext.ext.__name__
            got = steps(sm.model, latent_kv(cfg, torch.float32), True, fused)
            assert calls["mla_block"] == 3 * cfg.num_layers and calls["route_grouped"] > 0
            for a, b in zip(got, want):
                close(a, b, BOUND[False])  # the AVX2 build has float activations only
    finally:
        configure(prev)
