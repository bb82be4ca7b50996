"""One graph per decode step with the device expert cache (engine.cuda_graphs.step_graph,
engine.experts.device_cache), through the CPU seam: RecordedGraph re-runs the step's callable,
the device policy, copy and grouped expert kernels run in Triton's interpreter. The reference is
the eager model on the host cache. Each deliberate break (a stale slot map, a victim still in
use, a copy that has not landed) is shown to change the tokens, so the comparison can fail."""

from __future__ import annotations

import pytest
import torch

from engine import cuda_graphs as CG
from engine.cuda_graphs import step_graph
from engine.cuda_graphs.syncs import counting
from engine.quant import triton_kernels as TK
from tests.engine.test_cuda_graphs import _load, store  # noqa: F401 (the same tiny Qwen3-MoE store)

pytestmark = pytest.mark.skipif(not TK.supports(torch.device("cpu")),
                                reason="Triton's interpreter is not available in this process")

PROMPT = [5, 17, 33, 8, 61, 12, 40, 3, 27, 9]
REQUESTS = [(PROMPT, 6), (PROMPT[:4], 5), ([7, 7, 2, 50, 11], 3)]


@pytest.fixture(autouse=True)
def float_options():
    from engine.options import configure

    prev = configure(int8_activations=False, fused_step=False)
    yield
    configure(prev)


def _generate(model):
    """(the greedy tokens of REQUESTS, the logits of every step in order) through the engine."""
    from engine.executor import Executor
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine

    logits, real = [], Executor.__call__

    def call(self, *args, **kw):
        out = real(self, *args, **kw)
        logits.append(out.detach().float().cpu().clone())
        return out

    Executor.__call__ = call
    try:
        engine = Engine.for_requests(model, None, len(PROMPT) + 8, seqs=3)
        out = engine.generate([Request(p, SamplingConfig(max_tokens=n, ignore_eos=True)) for p, n in REQUESTS])
    finally:
        Executor.__call__ = real
    return [r.output_ids for r in out], logits


def same_outputs(got, want) -> bool:
    """The same tokens, and every step's logits within float reordering (the grouped kernels
    against the eager per-expert combine): a wrong expert anywhere shows here even when no greedy
    token flips."""
    (tokens, logits), (want_tokens, want_logits) = got, want
    return tokens == want_tokens and len(logits) == len(want_logits) and all(
        a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(logits, want_logits))


def eager_tokens(store, device: str = "cpu"):
    """Greedy tokens and step logits of the eager model on the host cache (12 of the 32 experts
    resident)."""
    from engine.options import configure

    prev = configure(int8_activations=False, fused_step=False)
    sm = _load(store, 12, device)
    try:
        CG.disable(sm.model)
        return _generate(sm.model)
    finally:
        sm.close()
        configure(prev)


@pytest.fixture(scope="module")
def reference(store):
    return eager_tokens(store)


def run_device(store, monkeypatch, prefetch: int = 0, break_with=None, slots: int = 12, device: str = "cpu",
               factory=CG.RecordedGraph):
    """Batched greedy decode with the device cache and one graph per decode step; returns the
    outputs (tokens, step logits), the host synchronisations and misses of each step that ran as
    one graph, every slot each expert held after a step, the graph set and the cache's counts."""
    sm = _load(store, slots, device, prefetch=prefetch, device_cache=True)
    cache = sm.cache
    if break_with is not None:
        break_with(cache, monkeypatch)
    seen: dict = {}
    steps = []
    real_run = step_graph.run_step

    def run(*args, **kw):
        before = cache.device_counts()["misses"]
        with counting() as c:
            out = real_run(*args, **kw)
        if out is not None:
            steps.append((c.total, cache.device_counts()["misses"] - before))
        # the slots after each step, read outside it: a reader inside the step would be a host
        # synchronisation, which a CUDA graph capture refuses
        for key, slot in cache.dpolicy.slot_of().items():
            seen.setdefault(key, set()).add(slot)
        return out

    monkeypatch.setattr("engine.executor.run_step", run)
    try:
        gs = CG.enable(sm.model, factory, whole_step=True)
        outputs = _generate(sm.model)
        return outputs, steps, seen, gs, cache.device_counts()
    finally:
        sm.close()


def test_one_graph_per_decode_step_gives_the_eager_tokens(store, reference, monkeypatch):
    outputs, steps, seen, gs, counts = run_device(store, monkeypatch)
    assert same_outputs(outputs, reference)
    # every decode step (3, 2 and 1 sequences: buckets 4, 2, 1) ran as one graph, with no host
    # synchronisation between the first layer and the sampler, misses included
    assert len(steps) == 5 and {b for b, _, _ in gs.steps} == {1, 2, 4}
    assert all(syncs == 0 for syncs, _ in steps)
    assert any(m > 0 for _, m in steps)
    # the cache moved experts between slots mid-run: evicted, and back in another slot
    assert counts["misses"] > 12 and counts["unserved"] == 0
    assert any(len(slots) > 1 for slots in seen.values())


def test_steps_whose_experts_all_hit_synchronise_nothing(store, reference, monkeypatch):
    """Every expert fits (32 slots): after the prefills the decode steps hit, and run with no
    host synchronisation either."""
    outputs, steps, _, _, counts = run_device(store, monkeypatch, slots=32)
    assert same_outputs(outputs, reference) and counts["misses"] <= 32
    assert any(m == 0 for _, m in steps) and all(syncs == 0 for syncs, _ in steps)


def test_device_prefetch_keeps_the_tokens(store, reference, monkeypatch):
    outputs, steps, _, _, counts = run_device(store, monkeypatch, prefetch=1)
    assert same_outputs(outputs, reference)
    assert counts["prefetched"] > 0 and all(syncs == 0 for syncs, _ in steps)


def test_the_per_layer_host_path_synchronises_every_sparse_layer(store):
    """The host cache on per-layer graphs: at least the routed ids of each sparse layer per
    decode step, plus one per miss (what the one-graph path removes)."""
    from engine.executor import executor_for
    from engine.kv.base import BatchLayout
    from engine.kv.paged import PagedKVCache

    sm = _load(store, 12)
    try:
        CG.enable(sm.model, CG.RecordedGraph)
        c = sm.model.config
        kv = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=8, block_size=16, dtype=torch.float32)
        kv.allocate(0, len(PROMPT) + 1)
        run = executor_for(sm.model)
        run(torch.tensor(PROMPT), BatchLayout.single(0, len(PROMPT), 0), kv)
        with counting() as sync:
            run(torch.tensor([3]), BatchLayout.single(0, 1, len(PROMPT)), kv)
        assert sync.by_reason["routed ids"] == 2  # two sparse layers
        assert sync.total == 2 + sync.by_reason["miss copy"]
    finally:
        sm.close()


def _stale_slot_map(cache, monkeypatch):
    """The graph binds a snapshot of the slot map taken at capture, not the live map the
    policy writes: the grouped kernels read the slots experts had then (an expert not resident
    then reads slot 0, not out of bounds: the outcome must not depend on stray memory)."""
    from engine.cuda_graphs.feedforward import FeedForwardGraphs

    real = FeedForwardGraphs.device_experts_fn

    def stale(self, mlp, e, layout):
        live = cache.slot_map
        cache.slot_map = live.clone().clamp_(min=0)
        try:
            return real(self, mlp, e, layout)
        finally:
            cache.slot_map = live

    monkeypatch.setattr(FeedForwardGraphs, "device_experts_fn", stale)


def _victim_in_use(cache, monkeypatch):
    """The launch does not pin its own experts: a miss may evict one the layer is about to read,
    and the layer reads the slot that expert had, now holding the miss's bytes (the kernel's map
    says -1 for it; the reader of this race gathered the slot before the eviction)."""
    dp = cache.dpolicy
    dp.pin = False
    assign = dp.assign

    def racing(layer, ids, prefetch=False):
        before = dp.slot_map[layer].clone()
        assign(layer, ids, prefetch)
        routed = ids.reshape(-1).unique()
        row = dp.slot_map[layer]
        lost = routed[(row[routed] < 0) & (before[routed] >= 0)]
        row[lost] = before[lost]

    monkeypatch.setattr(dp, "assign", racing)


def _copy_not_landed(cache, monkeypatch):
    """The experts read their slots before the copies land (here: never; the pool starts zeroed
    so what they read does not depend on stray memory)."""
    cache.slots.zero_()
    cache.copy_misses = lambda n: None


def test_the_smallest_pool_for_the_bucket_gives_the_eager_tokens(store, reference, monkeypatch):
    """8 slots: the 4-row bucket's 8 distinct experts at most (3 rows and a padding row that
    routes like row 0), so a step's misses evict experts of the other layer, never its own."""
    outputs, steps, _, _, counts = run_device(store, monkeypatch, slots=8)
    assert same_outputs(outputs, reference)
    assert counts["unserved"] == 0 and len(steps) == 5


@pytest.mark.parametrize("break_with", [_stale_slot_map, _victim_in_use, _copy_not_landed])
def test_each_deliberate_break_changes_the_outputs(store, reference, monkeypatch, break_with):
    outputs, _, _, _, _ = run_device(store, monkeypatch, break_with=break_with, slots=8)
    assert not same_outputs(outputs, reference)
