"""CUDA-only: per-layer CUDA graphs captured for real (torch.cuda.CUDAGraph) against the eager
layers (feed-forward and attention halves), and the compiled Triton DeltaNet decode step and
paged decode-attention kernel against their torch references on the CPU. The same checks run
through the CPU seam / the interpreter in tests/engine (test_cuda_graphs.py,
test_attention_graphs.py, layers/test_deltanet_triton.py, layers/test_paged_attention_triton.py).
Skipped without CUDA; bench/gpu_check.py runs this file."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from engine import cuda_graphs as CG  # noqa: E402
from tests.engine.layers.test_deltanet_triton import random_case, reference  # noqa: E402
from tests.engine.test_attention_graphs import check_attention_graphs  # noqa: E402
from tests.engine.test_cuda_graphs import (check_model, check_slot_moves, float_options,  # noqa: E402,F401
                                           store)


def test_captured_graphs_give_the_eager_logits_and_tokens(store, float_options):  # noqa: F811
    check_model(store, CG.CudaGraph, "cuda")


def test_captured_replay_follows_the_slot_map(store, float_options):  # noqa: F811
    check_slot_moves(store, CG.CudaGraph, "cuda")


def test_the_option_turns_graphs_on_for_cuda(store, float_options):  # noqa: F811
    from engine.experts.runtime import load_from_store
    from engine.options import configure
    from engine.generate import generate_ids
    from engine.layers.sampler import SamplingConfig

    prev = configure(cuda_graphs=True)
    sm = load_from_store(store, device="cuda", prefetch_depth=0)
    try:
        list(generate_ids(sm.model, [5, 17, 33], SamplingConfig(max_tokens=4, ignore_eos=True)))
        gs = CG.graph_set(sm.model)
        assert gs is not None and gs.counters.captures > 0 and gs.counters.capture_failures == 0
    finally:
        sm.close()
        configure(prev)


@pytest.mark.parametrize("nk,nv,dk,dv,kw", [(1, 1, 16, 16, 4), (2, 4, 32, 16, 4), (2, 6, 24, 40, 4),
                                            (16, 32, 128, 128, 4)])
def test_compiled_deltanet_step_equals_the_torch_reference(nk, nv, dk, dv, kw):
    from engine.layers import deltanet_triton as DT

    window, state, weight, x, g, beta = random_case(nk, nv, dk, dv, kw, rows=3, slots=4, seed=dv)
    slots = torch.tensor([2, 0, 3])
    ref_w, ref_s = window.clone(), state.clone()
    cuda = [t.cuda() for t in (window, weight, x, state, g, beta)]
    got = DT.decode_rows(cuda[0], cuda[1], cuda[2], cuda[3], cuda[4], cuda[5], slots.cuda(), nk, dk, dv).cpu()
    for i, s in enumerate(slots.tolist()):
        want = reference(ref_w[s], weight, x[i], ref_s[s], g[i], beta[i], nk, dk, dv)
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cuda[0].cpu(), ref_w, rtol=0, atol=0)
    torch.testing.assert_close(cuda[3].cpu(), ref_s, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_captured_attention_graphs_equal_eager(store, float_options, kv_dtype):  # noqa: F811
    check_attention_graphs(store, CG.CudaGraph, "cuda", kv_dtype)


@pytest.mark.parametrize("nh,nkv,d,bs,lens,dtype", [
    (4, 4, 16, 4, [1, 4, 5, 13], torch.float32),
    (6, 2, 24, 16, [17, 1, 40], torch.float32),
    (32, 4, 128, 16, [1, 16, 17, 300, 1000], torch.bfloat16),  # a Qwen3-30B-A3B layer's heads
    (64, 4, 128, 16, [33, 512], torch.float16),
])
def test_compiled_paged_attention_equals_the_reference(nh, nkv, d, bs, lens, dtype):
    from engine.layers import paged_attention_triton as PA
    from tests.engine.layers.test_paged_attention_triton import random_case as attn_case
    from tests.engine.layers.test_paged_attention_triton import reference as attn_reference

    q, kc, vc, tables, lt = attn_case(nh, nkv, d, bs, lens, dtype, seed=nh + d)
    want = attn_reference(q, kc, vc, tables, lt)
    got = PA.decode(q.cuda(), kc.cuda(), vc.cuda(), tables.cuda(), lt.cuda()).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
