"""Admission control in the live expert cache: a miss the policy declines is served from a
staging slot and freed at release. Live hits equal the simulator's ``bypass=True`` on the same
access stream; declined misses never evict; staging slots are reused and never leak; tokens are
identical with and without it; the budget counts the staging slots."""

from __future__ import annotations

import random

import pytest
import torch

from engine.costmodel import ModelShape
from engine.errors import CacheCapacityError, ConfigError
from engine.experts.cache import CacheConfig, ExpertCache
from engine.experts.simulate import budgets_from_fractions, simulate
from engine.experts.synthetic_store import SyntheticExpertStore
from engine.experts.trace import RoutingTrace

DECODE_TRACES = {  # the two real decode traces docs/expert-cache.md's policy table uses
    "demo": "tests/data/smollm2_demo_generate.npz",  # sweep was tuned on it
    "moe16": "tests/data/smollm2_moe16_top8_heldout_generate.npz",  # held out
}
_stores: dict = {}


def store_for(layers: int, experts: int, top_k: int) -> SyntheticExpertStore:
    """A disk-free store of small random int4 experts of a trace's shape (one per shape)."""
    key = (layers, experts, top_k)
    if key not in _stores:
        shape = ModelShape(f"t{layers}x{experts}", layers=layers, hidden=64, experts=experts, expert_width=64,
                           top_k=top_k, shared_width=0, vocab=64, heads=1, kv_heads=1, head_dim=64)
        store = SyntheticExpertStore(shape, seed=7)
        _stores[key] = (store, store.ram_source(pin_memory=False))
    return _stores[key]


def make_cache(tr: RoutingTrace, slots: int, admission: bool, **kw) -> ExpertCache:
    """A cache of ``slots`` cache slots (plus top_k staging slots with admission control)."""
    store, source = store_for(tr.num_layers, tr.num_experts, tr.top_k)
    slot = source.slot_bytes
    budget = (slots + (tr.top_k if admission else 0)) * slot
    cache = ExpertCache(store, source, CacheConfig(device_budget=budget, prefetch_depth=0, admission=admission, **kw))
    assert cache.num_slots == slots and cache.num_staging == (tr.top_k if admission else 0)
    return cache


def replay(cache: ExpertCache, tr: RoutingTrace, check=None) -> None:
    """Acquire and release every record of ``tr`` in order (one decode token's layer each)."""
    for l, ids in zip(tr.layer.tolist(), tr.experts.tolist()):
        before = check and (set(cache.slot_of), cache.metrics.total())
        cache.acquire(l, ids)
        if check:
            check(l, ids, *before)
        cache.release(l, ids)


@pytest.mark.parametrize("name", sorted(DECODE_TRACES))
def test_live_hits_equal_the_simulator_with_and_without_bypass(name):
    """Live hit counts, declined misses and bytes moved equal simulate(bypass=...) exactly, and
    admission control raises the hit rate at the same number of cache slots; at the same device
    budget (top_k of its slots staging) it does not at every budget: why it is off by default."""
    tr = RoutingTrace.load(DECODE_TRACES[name])
    nbytes = store_for(tr.num_layers, tr.num_experts, tr.top_k)[0].expert_nbytes
    same_budget_wins = []
    for cap in budgets_from_fractions(tr, [0.1, 0.25, 0.5]):
        rates = {}
        for admission in (False, True):
            sim = simulate(tr, "sweep", cap, bypass=admission)
            cache = make_cache(tr, cap, admission)
            try:
                t = cache.replay(tr)
                assert (t.hits, t.misses, t.bypassed) == (sim.hits, sim.misses, sim.bypassed), (cap, admission)
                assert t.bytes_to_device == sim.misses * nbytes  # a declined miss moves its bytes too
                assert t.staging_full == 0  # a decode record never needs more than top_k staging slots
                rates[admission] = t.hits / (t.hits + t.misses)
            finally:
                cache.close()
        assert sim.bypassed > 0
        assert rates[True] > rates[False], (name, cap, rates)
        cache = make_cache(tr, cap - tr.top_k, admission=True)  # the budget of ``cap`` slots
        try:
            t = cache.replay(tr)
            assert t.hits == simulate(tr, "sweep", cap - tr.top_k, bypass=True).hits
            same_budget_wins.append(t.hits / (t.hits + t.misses) > rates[False])
        finally:
            cache.close()
    assert not all(same_budget_wins), name


def test_declined_misses_never_evict():
    tr = RoutingTrace.load(DECODE_TRACES["demo"])
    cap = budgets_from_fractions(tr, [0.25])[0]
    cache = make_cache(tr, cap, admission=True)
    seen = {"declined": 0}

    def check(layer, ids, resident_before, m0):
        m1 = cache.metrics.total()
        resident = set(cache.slot_of)
        staged = set(cache.staged)
        assert len(staged) == m1.bypassed - m0.bypassed  # every declined miss, and only those
        assert not staged & resident  # ... is not cached
        admitted = resident - resident_before
        evicted = resident_before - resident
        assert admitted == {(layer, e) for e in ids} - resident_before - staged
        assert len(evicted) <= len(admitted)  # only an admitted miss evicts
        if staged and not admitted:
            assert resident == resident_before
            seen["declined"] += 1

    try:
        replay(cache, tr, check)
        assert seen["declined"] > 10
    finally:
        cache.close()


@pytest.mark.parametrize("batch,in_ram", [(1, True), (3, True), (3, False)])
def test_staging_slots_are_reused_and_never_leak(batch, in_ram, monkeypatch):
    """Random routing of ``batch`` tokens a step (more declined misses than staging slots at
    batch 3: the rest are cached, never an error); after every release the staging area is
    empty again; what an acquire returns from a staging slot computes like the expert's bytes.
    ``in_ram`` False: the source says every blob needs a disk read, so the copies (staging ones
    included) run on the I/O pool."""
    from engine.quant.kernels import expert_forward

    tr = RoutingTrace.load(DECODE_TRACES["moe16"])  # its shape: 30 layers, 16 experts top-8
    store, source = store_for(tr.num_layers, tr.num_experts, tr.top_k)
    monkeypatch.setattr(source, "likely_in_ram", lambda key: in_ram)
    cache = make_cache(tr, 24, admission=True)
    staging = set(range(cache.num_slots, cache.num_slots + cache.num_staging))
    rng = random.Random(5)
    x = torch.randn(2, store.config.hidden_size, generator=torch.Generator().manual_seed(5))
    used, checked = set(), 0
    try:
        for step in range(60):
            for layer in range(tr.num_layers):
                ids = sorted({e for _ in range(batch) for e in rng.sample(range(tr.num_experts), tr.top_k)})
                out = cache.acquire(layer, ids)
                _, slots = cache.slot_table(layer, ids, out)
                for e, s in zip(ids, slots):
                    if s in staging:
                        used.add(s)
                        assert (layer, e) in cache.staged and (layer, e) not in cache.slot_of
                        if checked < 5:
                            checked += 1
                            want = expert_forward(x, *store.expert_tensors(layer, e, source.blob((layer, e)).clone()))
                            assert torch.equal(out[e].forward(x), want)
                assert len(cache.staged) <= cache.num_staging
                cache.release(layer, ids)
                assert not cache.staged and sorted(cache.staging_free) == sorted(staging)
                assert cache.pins == {} and not cache.loading
        t = cache.metrics.total()
        assert used == staging  # every staging slot served
        assert t.bypassed > 10 * cache.num_staging  # ... many times over
        assert (t.staging_full > 0) == (batch > 1)
    finally:
        cache.close()


def test_a_staged_expert_acquired_twice_is_shared_until_the_last_release():
    tr = RoutingTrace.load(DECODE_TRACES["demo"])
    cache = make_cache(tr, tr.top_k, admission=True)
    try:
        cache.acquire(0, list(range(6)))
        cache.release(0, list(range(6)))  # the cache is full of layer 0
        a = cache.acquire(1, [0])
        assert (1, 0) in cache.staged  # never used before: declined
        misses = cache.metrics.total().misses
        b = cache.acquire(1, [0])  # shared, nothing moves
        assert b[0].views is a[0].views and cache.metrics.total().misses == misses and cache.staged[(1, 0)].pins == 2
        cache.release(1, [0])
        assert (1, 0) in cache.staged
        cache.release(1, [0])
        assert not cache.staged and len(cache.staging_free) == cache.num_staging and cache.pins == {}
    finally:
        cache.close()


def test_the_budget_counts_staging_slots():
    tr = RoutingTrace.load(DECODE_TRACES["demo"])
    store, source = store_for(tr.num_layers, tr.num_experts, tr.top_k)
    slot, k = source.slot_bytes, tr.top_k
    for budget_slots, kw, want in [(40, {}, (40, 0)), (40, dict(admission=True), (34, 6)),
                                   (2 * k, dict(admission=True), (k, k))]:
        c = ExpertCache(store, source, CacheConfig(device_budget=budget_slots * slot + slot - 1, **kw))
        try:
            assert (c.num_slots, c.num_staging) == want
            assert c.device_bytes == c.slots.numel() == budget_slots * slot <= c.config.device_budget
            assert c.admission == (want[1] > 0) and c.slot_rows.shape[0] == budget_slots
        finally:
            c.close()
    c = ExpertCache(store, source, CacheConfig(device_budget=40 * slot, admission=True, staging_slots=10))
    assert (c.num_slots, c.num_staging) == (30, 10)
    c.close()
    with pytest.raises(CacheCapacityError, match="staging"):
        ExpertCache(store, source, CacheConfig(device_budget=(2 * k - 1) * slot, admission=True))
    with pytest.raises(ConfigError, match="never declines"):
        ExpertCache(store, source, CacheConfig(device_budget=40 * slot, policy="lru", admission=True))
    with pytest.raises(ConfigError):
        CacheConfig(device_budget=1, staging_slots=0)
    with pytest.raises(ConfigError):
        CacheConfig(device_budget=1, admission=None)


def test_a_failed_staging_copy_frees_its_slot():
    tr = RoutingTrace.load(DECODE_TRACES["demo"])
    cache = make_cache(tr, tr.top_k, admission=True)
    real = cache.source.read_into

    def failing(key, out):
        if key == (1, 3):
            raise OSError("layer 1 expert 3: simulated read failure")
        return real(key, out)

    try:
        cache.acquire(0, list(range(6)))
        cache.release(0, list(range(6)))
        cache.source.read_into = failing
        with pytest.raises(OSError, match="simulated"):
            cache.acquire(1, [2, 3])
        assert not cache.staged and len(cache.staging_free) == cache.num_staging and cache.pins == {}
        cache.source.read_into = real
        out = cache.acquire(1, [2, 3])
        assert set(out) == {2, 3}
        cache.release(1, [2, 3])
    finally:
        cache.source.read_into = real
        cache.close()


PROMPT = [5, 17, 33, 8, 61, 12, 40, 3, 27]


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint (3 layers, 8 experts top-2) converted to an int4 store."""
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.hf_tiny import make_checkpoint

    d = tmp_path_factory.mktemp("admission")
    make_checkpoint("qwen3_moe", d / "hf", hidden_size=64, num_hidden_layers=3, head_dim=16, num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


def greedy(model, prompt=PROMPT, n=16):
    from engine.generate import generate_ids
    from engine.layers.sampler import SamplingConfig

    return [t for t, _, _ in generate_ids(model, prompt, SamplingConfig(max_tokens=n, ignore_eos=True))]


def swap_cache(sm, **changes) -> None:
    """Replace a StoreModel's expert cache by one with ``changes`` to its config."""
    old = sm.cache
    old.close()
    sm.cache = old.reconfigured(**changes)
    sm.cache.attach(sm.model)


def staging_spy(cache) -> list[int]:
    """Records the slots the step's slot table resolves (the native CPU step's view)."""
    seen, real = [], cache.slot_table

    def spying(layer, ids, experts):
        got = real(layer, ids, experts)
        if got is not None:
            seen.extend(got[1])
        return got
    cache.slot_table = spying
    return seen


@pytest.mark.parametrize("dense", ["int8", "fp32"])  # int8: the native CPU step; fp32: the torch layers
def test_greedy_tokens_identical_with_and_without_admission(tiny_store, dense):
    from engine.experts.runtime import load_from_store
    from engine.experts.tiers import align_up
    from engine.store import ExpertStore

    with ExpertStore(tiny_store) as s:
        slot = align_up(s.expert_nbytes)
    with load_from_store(tiny_store, prefetch_depth=0, dense=dense) as full:
        want = greedy(full.model)
    for kw in (dict(prefetch_depth=0), dict(prefetch_depth=1), dict(prefetch_depth=0, miss_compute="cpu")):
        got = {}
        for admission in (False, True):
            with load_from_store(tiny_store, device_budget=7 * slot, dense=dense, **kw) as sm:
                assert (sm.cache.num_slots, sm.cache.num_staging) == (7, 0)  # the default: off
                if admission:
                    swap_cache(sm, admission=True)
                    assert (sm.cache.num_slots, sm.cache.num_staging) == (5, 2)  # out of the same budget
                seen = staging_spy(sm.cache)
                got[admission] = greedy(sm.model)
                sm.cache.drain()
                t = sm.cache.metrics.total()
                assert sm.cache.pins == {} and not sm.cache.staged, kw
                assert len(sm.cache.staging_free) == sm.cache.num_staging
                if admission and kw.get("miss_compute") != "cpu":
                    assert t.bypassed > 0, kw
                    if dense == "int8":
                        assert any(s >= sm.cache.num_slots for s in seen)  # staging slots reached the step
        assert got[False] == got[True] == want, kw


def test_grouped_triton_path_reads_staging_slots_through_the_slot_map(tiny_store, monkeypatch):
    """The CUDA path's grouped launches (interpreted on the CPU): a declined miss's slot map
    entry names its staging slot, and the tokens equal those without admission control."""
    tk = pytest.importorskip("engine.quant.triton_kernels")
    if not tk.supports(torch.device("cpu")):
        pytest.skip("triton cannot interpret here (CUDA present: see tests/gpu)")
    from engine.experts.runtime import load_from_store
    from engine.experts.tiers import align_up
    from engine.options import configure
    from engine.quant import triton_moe as TM
    from engine.store import ExpertStore

    with ExpertStore(tiny_store) as s:
        slot = align_up(s.expert_nbytes)
    pairs: list[list[int]] = []
    real = TM.grouped_moe
    monkeypatch.setattr(TM, "grouped_moe", lambda x, w, pair, *a: pairs.append(pair.tolist()) or real(x, w, pair, *a))
    prev = configure(int8_activations=False)
    got = {}
    try:
        for admission in (False, True):
            with load_from_store(tiny_store, device_budget=7 * slot, prefetch_depth=0, dense="fp32") as sm:
                if admission:
                    swap_cache(sm, admission=True)
                sm.cache.grouped = True  # before any copy: the slot map is written as experts land
                pairs.clear()
                got[admission] = greedy(sm.model, n=8)
                assert pairs, "the grouped path did not run"
                if admission:
                    assert sm.cache.metrics.total().bypassed > 0
                    assert any(p >= sm.cache.num_slots for pair in pairs for p in pair)
                assert not sm.cache.staged and sm.cache.pins == {}
    finally:
        configure(prev)
    assert got[True] == got[False]


def test_headline_counts_staging_in_the_vram_split(tmp_path, capsys):
    """bench/headline.py --admission: the staging slots are charged to the device ledger under
    --vram-budget and printed in the split; the live hit rate is the simulator's with bypass."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    import headline

    out = tmp_path / "tiny.json"
    # 4 cache slots and uniform routing: the policy declines misses
    assert headline.main(["--shape", "tiny", "--device", "cpu", "--admission", "--slots", "0.25", "--zipf", "0",
                          "--locality", "0", "--predict-tokens", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "staging slots 2 x" in text and "staging slots" in text.split("device ledger:")[1]
    f = json.loads(out.read_text())
    assert f["admission"] and f["staging_slots"] == 2 and f["staging_bytes"] > 0 and f["bypassed"] > 0
    assert abs(f["hit_rate"] - f["sim_hit_rate"]) < 1e-9 and f["peak"] <= f["budget"]
    assert headline.main(["--shape", "tiny", "--dry-run", "--admission", "--policy", "lru"]) == 2
    assert "never declines" in capsys.readouterr().err


def test_an_acquire_failing_before_its_copies_start_undoes_their_claims(monkeypatch):
    """Disk misses start on the I/O pool; a pool that refuses them fails the acquire with every
    claim undone: no slot left loading, no staging slot held, nothing pinned."""
    tr = RoutingTrace.load(DECODE_TRACES["demo"])
    cache = make_cache(tr, tr.top_k, admission=True)
    monkeypatch.setattr(cache.source, "likely_in_ram", lambda key: False)
    try:
        cache.acquire(0, list(range(6)))
        cache.release(0, list(range(6)))
        resident = set(cache.slot_of)
        cache.pool.shutdown()
        with pytest.raises(RuntimeError, match="shutdown"):
            cache.acquire(1, [0, 1, 2])  # declined misses: staging slots claimed, none filled
        assert not cache.loading and not cache.staged and cache.pins == {}
        assert len(cache.staging_free) == cache.num_staging and set(cache.slot_of) == resident
    finally:
        cache.close()
