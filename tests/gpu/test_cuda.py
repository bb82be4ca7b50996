"""CUDA-only checks of the GPU path: the store model on the GPU against the CPU reference,
pinned host RAM, device-resident slots. Skipped without CUDA (CI has none); run them with
``python bench/gpu_check.py`` on a GPU machine, which runs this file too."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from engine.executor import executor_for  # noqa: E402
from engine.experts.runtime import load_from_store  # noqa: E402
from engine.generate import generate_ids  # noqa: E402
from engine.layers.sampler import SamplingConfig  # noqa: E402
from engine.quant import kernels  # noqa: E402
from engine.quant.formats import QuantFormat  # noqa: E402
from engine.store import convert  # noqa: E402
from tests.engine.models.hf_tiny import make_checkpoint  # noqa: E402

PROMPT = [5, 17, 33, 8, 61, 12, 40, 3, 27]


@pytest.fixture(scope="module", params=["int4", "nf4", "int8"])
def store(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"gpu_{request.param}")
    make_checkpoint("qwen3_moe", d / "hf", hidden_size=64, num_hidden_layers=3, head_dim=16,
                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    convert(d / "hf", d / "store", fmt=QuantFormat(request.param, 32), progress=False)
    return d / "store"


def greedy(sm, n=16):
    return [t for t, _, _ in generate_ids(sm.model, PROMPT, SamplingConfig(max_tokens=n, ignore_eos=True))]


def test_gpu_store_model_gives_the_cpu_tokens(store):
    cpu = load_from_store(store, device="cpu", prefetch_depth=0)
    want = greedy(cpu)
    slot = cpu.cache.slot_bytes
    cpu.close()
    for kw in (dict(), dict(device_budget=2 * slot, prefetch_depth=1), dict(device_budget=3 * slot, ram_budget=2 * slot)):
        sm = load_from_store(store, device="cuda", **kw)
        try:
            assert sm.cache.slots.is_cuda and sm.cache.copy_stream is not None
            assert next(sm.model.parameters()).is_cuda
            assert greedy(sm) == want, kw
            views = list(sm.cache.views.values())
            assert views and all(kernels.backend_for(v.gate) == "triton" for v in views)
            assert sm.cache.source.buf.is_pinned()
            sm.cache.drain()
            assert sm.cache.pins == {}
        finally:
            sm.close()


def test_bf16_dense_linears_run_on_the_gpu(store):
    sm = load_from_store(store, device="cuda", dense="bf16")
    try:
        q = sm.model.lm_head.q
        assert q.device.type == "cuda" and kernels.backend_for(q) == "triton"
        assert len(greedy(sm, n=4)) == 4
    finally:
        sm.close()


def test_grouped_kernels_compiled_equal_the_per_expert_path(store):
    """On CUDA every int4/int8 layer runs as two grouped launches over the slot pool
    (engine.quant.triton_moe); its logits equal the per-expert Triton path's."""
    import torch as T

    from engine.kv.base import BatchLayout, ContiguousKVCache

    out = {}
    for grouped in (False, True):
        sm = load_from_store(store, device="cuda", prefetch_depth=0)
        try:
            sm.cache.grouped = grouped
            c = sm.model.config
            kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim)
            out[grouped] = executor_for(sm.model)(T.tensor(PROMPT), BatchLayout.single(0, len(PROMPT), 0), kv,
                                                  all_logits=True).cpu()
            layout = sm.cache.grouped_layout(sm.model.moe_blocks[0].layer, T.device("cuda"))
            # int4 and int8 run grouped; nf4 keeps the per-expert kernels
            assert (layout is not None) == (grouped and "nf4" not in str(store))
        finally:
            sm.close()
    T.testing.assert_close(out[True], out[False], rtol=1e-3, atol=1e-3)
