"""The grouped MoE kernels (two launches per layer over the slot pool) against the per-expert
reference, in Triton's interpreter on CPU tensors (compiled on CUDA: tests/gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.executor import executor_for
from engine.quant import triton_kernels as TK
from engine.quant import triton_moe as TM
from engine.quant.formats import QuantFormat
from engine.quant.expert_blob import pack_expert, unpack_expert
from engine.quant.reference import dequantize

pytestmark = pytest.mark.skipif(not TK.supports(torch.device("cpu")),
                                reason="Triton's interpreter is not available in this process")


def _pool(num_experts: int, inter: int, hidden: int, fmt: QuantFormat, seed: int):
    """Experts packed as the store packs them, copied into a slot pool in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    blobs = []
    for _ in range(num_experts):
        g, u = (torch.randn(inter, hidden, generator=gen) * 0.1 for _ in range(2))
        d = torch.randn(hidden, inter, generator=gen) * 0.1
        blobs.append(pack_expert(g, u, d, fmt))
    nbytes = blobs[0][1]["nbytes"]
    slot_of = torch.randperm(num_experts + 3, generator=gen)[:num_experts]  # spare slots too
    slots = torch.zeros(num_experts + 3, nbytes, dtype=torch.uint8)
    views = {}
    for e, (blob, layout) in enumerate(blobs):
        s = int(slot_of[e])
        slots[s] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        views[e] = unpack_expert(slots[s], layout)
    return slots, slot_of, views


def _reference(x, weights, ids, views):
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            g, u, d = (dequantize(q).float() for q in views[int(ids[t, j])])
            h = F.silu(x[t] @ g.T) * (x[t] @ u.T)
            out[t] += weights[t, j] * (h @ d.T)
    return out


@pytest.mark.parametrize("fmt,inter,hidden,tokens,top_k", [
    (QuantFormat("int4", 32), 96, 64, 1, 2),     # decode
    (QuantFormat("int4", 64), 64, 128, 3, 3),    # a verify step's rows
    (QuantFormat("int8", 32), 64, 96, 2, 2),     # H not a multiple of BLOCK_K
])
def test_grouped_moe_equals_the_per_expert_reference(fmt, inter, hidden, tokens, top_k):
    slots, slot_of, views = _pool(6, inter, hidden, fmt, seed=inter + tokens)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    layout = TM.slot_layout(*views[0], slots[int(slot_of[0])])
    assert layout is not None and (layout.inter, layout.hidden) == (inter, hidden)
    got = TM.grouped_moe(x, weights, slot_of[ids].reshape(-1), slots, layout)
    want = _reference(x, weights, ids, views)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_row_does_not_depend_on_the_batch():
    fmt = QuantFormat("int4", 32)
    slots, slot_of, views = _pool(4, 32, 64, fmt, seed=3)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 64, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    w = torch.softmax(torch.randn(3, 2, generator=gen), -1)
    layout = TM.slot_layout(*views[0], slots[int(slot_of[0])])
    both = TM.grouped_moe(x, w, slot_of[ids].reshape(-1), slots, layout)
    alone = torch.cat([TM.grouped_moe(x[i:i + 1], w[i:i + 1], slot_of[ids[i]], slots, layout) for i in range(3)])
    assert torch.equal(both, alone)


def test_formats_the_kernels_do_not_decode_take_the_per_expert_path():
    slots, slot_of, views = _pool(2, 32, 64, QuantFormat("nf4", 32), seed=4)
    assert TM.slot_layout(*views[0], slots[int(slot_of[0])]) is None


def test_the_expert_cache_runs_each_layer_as_two_grouped_launches(tmp_path, monkeypatch):
    """The MoE layer on the grouped path (the CUDA shape, interpreted here): the expert cache's
    device slot map names each pick's slot, misses through a small cache included; the logits
    equal the per-expert path's and greedy tokens are the same."""
    from engine.experts.runtime import load_from_store, store_expert_bytes
    from engine.generate import Request
    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine
    from engine.store import convert
    from tests.engine.models.hf_tiny import make_checkpoint

    make_checkpoint("qwen3_moe", tmp_path / "hf", hidden_size=64, num_hidden_layers=2, head_dim=16,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    convert(tmp_path / "hf", tmp_path / "store", fmt=QuantFormat("int4", 32), progress=False)
    prompt = [5, 17, 33, 8, 61, 12, 40, 3, 27, 9]
    calls = []
    real = TM.grouped_moe
    monkeypatch.setattr(TM, "grouped_moe", lambda *a: calls.append(a[0].shape[0]) or real(*a))

    def run(grouped: bool):
        budget = store_expert_bytes(tmp_path / "store") // 2  # 8 of 16 experts: misses
        with load_from_store(tmp_path / "store", device_budget=budget, dense="fp32") as sm:
            sm.cache.grouped = grouped
            c = sm.model.config
            kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim)
            logits = executor_for(sm.model)(torch.tensor(prompt), BatchLayout.single(0, len(prompt), 0), kv,
                                            all_logits=True)
            engine = Engine.for_requests(sm.model, None, len(prompt) + 12)
            tokens = engine.generate([Request(prompt, SamplingConfig(max_tokens=12, ignore_eos=True))])[0]
            return logits, tokens.output_ids, sm.cache.slot_map.clone()

    from engine.options import configure

    prev = configure(int8_activations=False)  # the per-expert CPU path in float, like the kernels
    try:
        ref_logits, ref_tokens, _ = run(False)
    finally:
        configure(prev)
    assert calls == []
    logits, tokens, slot_map = run(True)
    assert calls[:2] == [len(prompt)] * 2 and len(calls) == 2 + 2 * 12  # prefill, then per step
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens
    assert (slot_map >= 0).any()
