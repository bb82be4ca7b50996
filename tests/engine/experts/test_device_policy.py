"""The device policy (engine.experts.device_policy, in Triton's interpreter on the CPU) against the
host cache it copies (engine.experts.cache.ExpertCache over SlotTable and the eviction policy):
the same hits, victims and slots, record by record, on the demo model's real decode trace and on
two synthetic traces. The engine names a layer's experts in ascending order (the distinct ids
of its routing), so both sides are given each record sorted."""

from __future__ import annotations

import pytest
import torch

from engine.costmodel import ModelShape
from engine.experts.cache import CacheConfig, ExpertCache
from engine.experts.synthetic import synthetic_trace
from engine.experts.synthetic_store import SyntheticExpertStore
from engine.experts.tiers import align_up
from engine.experts.trace import RoutingTrace
from engine.quant import triton_kernels as TK

pytestmark = pytest.mark.skipif(not TK.supports(torch.device("cpu")),
                                reason="Triton's interpreter is not available in this process")

DEMO = "tests/data/smollm2_demo_generate.npz"


def _store(trace) -> SyntheticExpertStore:
    shape = ModelShape(name="policy", layers=trace.num_layers, hidden=64, experts=trace.num_experts,
                       expert_width=64, top_k=trace.top_k, shared_width=0, vocab=32, heads=2, kv_heads=1,
                       head_dim=32)
    return SyntheticExpertStore(shape)


def replay_both(trace, slots: int, policy: str, records: int | None = None):
    """Replay ``trace`` through the host cache and the device policy; after every record the
    resident set with its slots and the hits so far must be equal. Returns (hits, misses)."""
    from engine.experts.device_policy import DevicePolicy

    store = _store(trace)
    cache = ExpertCache(store, store.ram_source(), CacheConfig(
        device_budget=slots * align_up(store.expert_nbytes), policy=policy, prefetch_depth=0, io_threads=1))
    L, E = trace.num_layers, trace.num_experts
    dev = DevicePolicy(policy, sparse_layers=list(range(L)), num_experts=E, top_k=trace.top_k,
                       num_slots=cache.num_slots, slot_map=torch.full((L, E), -1, dtype=torch.int32))
    try:
        pairs = list(zip(trace.layer.tolist(), trace.experts.tolist()))[:records]
        for i, (layer, ids) in enumerate(pairs):
            ids = sorted(ids)
            cache.acquire(layer, ids)
            cache.release(layer, ids)
            dev.assign(layer, torch.tensor(ids[::-1] + ids[:1]))  # any order, repeats: the same set
            assert dev.slot_of() == cache.slot_of, f"record {i} (layer {layer}, experts {ids})"
            m = cache.metrics.layer(layer)
            assert (int(dev.hits[layer]), int(dev.misses[layer])) == (m.hits, m.misses), f"record {i}"
        t = cache.metrics.total()
        assert dev.errors() == 0
        return t.hits, t.misses
    finally:
        cache.close()


@pytest.mark.parametrize("policy", ["sweep", "lru"])
def test_same_decisions_on_the_demo_decode_trace(policy):
    """The demo model's decode routing (30 layers, 12 experts top-6): the first 8 tokens at a
    budget of 100 of its 360 experts (the whole trace at two budgets: the slow test below)."""
    trace = RoutingTrace.load(DEMO)
    hits, misses = replay_both(trace, 100, policy, records=8 * trace.num_layers)
    assert misses > 100  # the cache was full and evicting for most of the replay
    if policy == "sweep":
        assert hits > 0.2 * (hits + misses)  # sweep keeps experts across the sweep; LRU thrashes


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["sweep", "lru"])
@pytest.mark.parametrize("slots", [100, 200])
def test_same_decisions_on_the_whole_demo_trace(policy, slots):
    replay_both(RoutingTrace.load(DEMO), slots, policy)


@pytest.mark.parametrize("policy", ["sweep", "lru"])
@pytest.mark.parametrize("kind", ["skewed", "local"])
def test_same_decisions_on_synthetic_traces(policy, kind):
    """Zipf-skewed routing without locality, and near-uniform routing with token-to-token
    reuse: 25 tokens of 6 layers x 16 experts top-4, at a third of the experts."""
    trace = (synthetic_trace(25, 6, 16, 4, zipf=1.2, seed=3) if kind == "skewed"
             else synthetic_trace(25, 6, 16, 4, zipf=0.2, locality=0.6, seed=4))
    hits, misses = replay_both(trace, 32, policy)
    assert hits > 0 and misses > 32


def test_prefetch_takes_free_then_victim_slots_and_protects_the_running_layer():
    """A prefetch assigns slots to the predicted experts that are missing (resident ones are
    left alone and not counted as hits), never evicts the running acquire's experts, and skips
    what cannot be placed without evicting them."""
    from engine.experts.device_policy import MISS_N, DevicePolicy

    sm = torch.full((2, 8), -1, dtype=torch.int32)
    dev = DevicePolicy("lru", sparse_layers=[0, 1], num_experts=8, top_k=2, num_slots=4, slot_map=sm)
    dev.assign(1, torch.tensor([5, 6]))
    dev.assign(0, torch.tensor([0, 1]))  # the running layer: slots 2, 3
    dev.assign(1, torch.tensor([6, 7, 2]), prefetch=True)
    # in order: 2 takes the only evictable slot, (1, 5)'s ((1, 6) is predicted, layer 0's are
    # running); 6 is resident: nothing; 7 finds nothing evictable: skipped, as the host's loop
    assert dev.slot_of() == {(1, 2): 0, (1, 6): 1, (0, 0): 2, (0, 1): 3}
    assert int(dev.state[MISS_N]) == 1 and dev.misses_of_last() == [(0, (1, 2))]
    assert int(dev.hits.sum()) == 0 and int(dev.misses[1]) == 2  # the prefetch counted nothing


def test_an_acquire_larger_than_the_slots_is_counted_not_served():
    from engine.experts.device_policy import DevicePolicy

    sm = torch.full((2, 8), -1, dtype=torch.int32)
    dev = DevicePolicy("sweep", sparse_layers=[0, 1], num_experts=8, top_k=2, num_slots=3, slot_map=sm)
    dev.assign(0, torch.tensor([0, 1, 2, 3]))
    assert dev.errors() == 1 and sorted(dev.slot_of()) == [(0, 0), (0, 1), (0, 2)]
    assert [s for s, _ in dev.misses_of_last()] == [0, 1, 2, -1]


def test_refuses_what_it_does_not_model():
    from engine.errors import ConfigError
    from engine.experts.device_policy import DevicePolicy

    sm = torch.full((2, 8), -1, dtype=torch.int32)
    with pytest.raises(ConfigError, match="lru, sweep"):
        DevicePolicy("lfu", sparse_layers=[0, 1], num_experts=8, top_k=2, num_slots=4, slot_map=sm)
    with pytest.raises(ConfigError, match="two sparse layers"):
        DevicePolicy("sweep", sparse_layers=[0], num_experts=8, top_k=2, num_slots=4, slot_map=sm)
