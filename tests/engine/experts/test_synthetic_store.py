"""The disk-free synthetic store: blob contents, views against the format's own unpacker, the
RAM source, trace-injected routing, and a model through the live cache at any budget giving
the numbers of the fully resident one."""

from __future__ import annotations

import pytest
import torch

from engine.costmodel import SHAPES
from engine.experts.synthetic import synthetic_trace
from engine.experts.synthetic_store import SyntheticExpertStore, TraceRouting, build_synthetic_model
from engine.generate import generate_ids
from engine.layers.sampler import SamplingConfig

TINY = SHAPES["tiny"]


@pytest.fixture(scope="module")
def store():
    return SyntheticExpertStore(TINY, seed=3)


@pytest.fixture(scope="module")
def source(store):
    return store.ram_source(pin_memory=False)


def test_blobs_share_scales_and_have_their_own_codes(store, source):
    n = store.expert_nbytes
    codes = [(off, nb) for off, nb in store.code_spans]
    mask = torch.ones(n, dtype=torch.bool)
    for off, nb in codes:
        mask[off:off + nb] = False
    a, b = source.blob((0, 0)), source.blob((1, 5))
    assert torch.equal(a[mask], store.prototype[mask]) and torch.equal(b[mask], store.prototype[mask])
    for off, nb in codes:
        assert not torch.equal(a[off:off + nb], b[off:off + nb])
    assert source.nbytes == TINY.num_experts_total * source.slot_bytes
    again = SyntheticExpertStore(TINY, seed=3).ram_source(pin_memory=False)
    assert torch.equal(again.buf[:, :n], source.buf[:, :n])  # deterministic


def test_views_match_the_format_unpacker(store, source):
    from engine.quant import dequantize
    from engine.quant.expert_blob import unpack_expert

    for key in ((0, 0), (1, 7), (0, 3)):
        blob = source.blob(key).clone()
        mine = store.expert_tensors(*key, blob)
        ref = unpack_expert(blob.numpy().tobytes(), store.layout)
        for q, r in zip(mine, ref):
            d = dequantize(q)
            assert torch.isfinite(d).all()
            assert torch.equal(d, dequantize(r))
    with pytest.raises(KeyError, match="no expert"):
        store.entry(2, 0)
    with pytest.raises(ValueError, match="needs"):
        store.expert_tensors(0, 0, torch.zeros(10, dtype=torch.uint8))


def test_read_into_copies_the_blob_and_counts(store, source):
    out = torch.zeros(source.slot_bytes, dtype=torch.uint8)
    before = source.ram.hits
    assert source.read_into((1, 2), out) == "ram"
    assert torch.equal(out[:store.expert_nbytes], source.blob((1, 2)))
    assert source.ram.hits == before + 1 and source.link_bandwidth() > 0


def test_trace_routing_gives_the_trace_experts(store, source):
    tr = synthetic_trace(12, TINY.layers, TINY.experts, TINY.top_k, zipf=1.0, locality=0.3, seed=1)
    sm = build_synthetic_model(TINY, device_budget=TINY.num_experts_total * TINY.slot_bytes, trace=tr,
                               source=source)
    seen = []
    for block in sm.model.moe_blocks:
        block.observers.append(lambda layer, ids: seen.append((layer, ids.tolist())))
    with sm:
        for _ in generate_ids(sm.model, [1, 2, 3], SamplingConfig(max_tokens=4, ignore_eos=True)):
            pass
    ex = tr.experts.reshape(12, TINY.layers, TINY.top_k)
    # prefill: 3 tokens at once per layer, then one token per step
    assert seen[0] == (0, ex[0:3, 0].tolist()) and seen[1] == (1, ex[0:3, 1].tolist())
    assert seen[2] == (0, [ex[3, 0].tolist()])
    with pytest.raises(ValueError, match="layers"):
        TraceRouting(synthetic_trace(4, 3, TINY.experts, TINY.top_k), [0, 1])


def test_any_budget_gives_the_resident_numbers(source):
    """Through the live cache with a quarter of the experts resident, the logits are the ones
    of the model with every expert resident (same weights, same routing)."""
    tr = synthetic_trace(16, TINY.layers, TINY.experts, TINY.top_k, zipf=0.5, locality=0.2, seed=2)
    logits = {}
    for slots in (TINY.num_experts_total, TINY.top_k * 2):
        with build_synthetic_model(TINY, device_budget=slots * TINY.slot_bytes, trace=tr, source=source,
                                   policy="sweep") as sm:
            logits[slots] = [l.clone() for _, l, _ in
                             generate_ids(sm.model, [5, 6], SamplingConfig(max_tokens=8, ignore_eos=True))]
            if slots < TINY.num_experts_total:
                assert sm.cache.metrics.total().misses > TINY.num_experts_total  # it really streamed
    full, small = logits[TINY.num_experts_total], logits[TINY.top_k * 2]
    assert len(full) == len(small) == 8
    for a, b in zip(full, small):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
