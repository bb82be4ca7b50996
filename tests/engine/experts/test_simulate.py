"""Trace-replay simulator, routing traces (files, validation, recorder) and the plot."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from engine.errors import CacheCapacityError
from engine.experts.plot import plot_hit_rates
from engine.experts.policy import LRUPolicy
from engine.experts.simulate import (
    SweepTable,
    budgets_from_fractions,
    layer_capacities,
    simulate,
    sweep,
)
from engine.experts.synthetic import cyclic_trace, synthetic_trace
from engine.experts.trace import (
    RoutingTrace,
    TraceRecorder,
    concat,
    expert_counts,
    top_share,
    usage_entropy,
)


def stream_trace(experts, num_experts=8):
    """One layer, top-1: a plain access stream."""
    return RoutingTrace.from_records(
        [(t, 0, [e]) for t, e in enumerate(experts)], num_layers=1, num_experts=num_experts, top_k=1
    )


# ---- reference simulator: O(n * capacity) scans, written independently -----------------------


def reference(trace, policy, capacity, per_layer=False, whole_record=True):
    keys = list(trace.accesses())
    K = trace.top_k
    L = trace.num_layers
    caps = layer_capacities(capacity, L) if per_layer else [capacity]
    res = [dict() for _ in caps]  # key -> last use
    count: dict = {}
    hits, evicted = 0, []
    for i, key in enumerate(keys):
        p = key[0] if per_layer else 0
        rec_start = (i // K) * K
        protected = set(keys[rec_start:rec_start + K] if whole_record else keys[rec_start:i])
        count[key] = count.get(key, 0) + 1
        if key in res[p]:
            hits += 1
        else:
            if len(res[p]) >= caps[p]:
                cands = [k for k in res[p] if k not in protected]

                def nxt(k):
                    for j in range(i + 1, len(keys)):
                        if keys[j] == k:
                            return j
                    return len(keys)

                if policy == "lru":
                    v = min(cands, key=lambda k: res[p][k])
                elif policy == "lfu-pure":
                    v = min(cands, key=lambda k: (count[k], res[p][k]))
                elif policy == "belady":
                    v = min(cands, key=lambda k: (-nxt(k), res[p][k]))
                del res[p][v]
                evicted.append(v)
        res[p][key] = i
    return hits, evicted


@pytest.mark.parametrize("policy", ["lru", "lfu-pure", "belady"])
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("whole_record", [True, False])
def test_simulator_matches_reference_exactly(policy, per_layer, whole_record):
    for seed in range(4):
        tr = synthetic_trace(30, 3, 8, 3, zipf=0.8, locality=0.3, seed=seed)
        cap = [4, 7, 9, 12][seed] if not per_layer else [9, 10, 12, 14][seed]
        r = simulate(tr, policy, cap, per_layer=per_layer, whole_record=whole_record,
                     record_evictions=True)
        hits, evicted = reference(tr, policy, cap, per_layer, whole_record)
        assert r.hits == hits
        assert r.evicted == evicted
        assert r.hits + r.misses == r.accesses == tr.num_accesses


# ---- exact small cases -------------------------------------------------------------------------


def test_lru_abacb_capacity_2():
    r = simulate(stream_trace([0, 1, 0, 2, 1]), "lru", 2, record_evictions=True)
    assert r.evicted == [(0, 1), (0, 0)]
    assert (r.hits, r.misses, r.compulsory_misses) == (1, 4, 3)
    assert r.hit_rate == pytest.approx(0.2)


def test_belady_textbook_through_simulator():
    ref = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    r = simulate(stream_trace(ref), "belady", 3, record_evictions=True)
    assert r.misses == 9
    assert [e for _, e in r.evicted] == [7, 1, 0, 4, 3, 2]
    assert simulate(stream_trace(ref), "lru", 3).misses == 12


def test_full_capacity_only_compulsory_misses():
    tr = synthetic_trace(60, 4, 16, 4, zipf=0.5, locality=0.2, seed=3)
    distinct = len(set(tr.accesses()))
    for policy in ["lru", "lfu", "lfu-pure", "belady", "pinned+lru"]:
        for per_layer in (False, True):
            r = simulate(tr, policy, tr.num_keys, per_layer=per_layer)
            pinned_first = r.pinned  # pinned experts are preloaded: no compulsory miss
            assert r.misses == r.compulsory_misses
            assert r.compulsory_misses == distinct - pinned_first
            if r.pinned == 0:
                assert r.hit_rate == pytest.approx(1 - distinct / tr.num_accesses)
            assert r.evictions == 0


def test_cyclic_sweep_lru_zero_hits_below_working_set():
    T, L, K = 20, 4, 4
    tr = cyclic_trace(num_tokens=T, num_layers=L, num_experts=16, top_k=K)
    W = L * K  # one token's working set
    # flat paging model: LRU thrashes at every capacity below the working set
    for cap in range(K, W):
        r = simulate(tr, "lru", cap, whole_record=False)
        assert r.hits == 0 and r.hit_rate == 0.0
    # ensure(layer, ids) semantics: 0 hits up to W - K ...
    for cap in range(K, W - K + 1):
        assert simulate(tr, "lru", cap).hits == 0
    # ... and at W - 1 each record keeps its K - 1 resident experts and misses one:
    # 16 compulsory misses on token 0, then one miss per record.
    assert simulate(tr, "lru", W - 1).misses == W + (T - 1) * L
    for cap in (8, W - 1):
        assert simulate(tr, "belady", cap).hits > 0
        assert simulate(tr, "belady", cap, whole_record=False).hits > 0
    assert simulate(tr, "belady", K).hits == 0  # cap == top_k: one record at a time
    full = simulate(tr, "lru", W)
    assert full.misses == W  # compulsory only
    # per-layer pools of top_k slots each hold every layer's working set
    assert simulate(tr, "lru", W, per_layer=True).misses == W


def test_belady_at_least_lru_and_lfu_random_traces():
    rnd = random.Random(1)
    for seed in range(30):
        L, E, K = rnd.randint(1, 4), rnd.randint(4, 12), rnd.randint(1, 3)
        tr = synthetic_trace(rnd.randint(10, 60), L, E, K, zipf=rnd.uniform(0, 1.5),
                             locality=rnd.uniform(0, 0.9), seed=seed)
        per_layer = rnd.random() < 0.5
        lo = K * L if per_layer else K
        cap = rnd.randint(lo, L * E)
        kw = dict(per_layer=per_layer, whole_record=rnd.random() < 0.5)
        b = simulate(tr, "belady", cap, **kw).hits
        for p in ("lru", "lfu", "lfu-pure"):
            assert b >= simulate(tr, p, cap, **kw).hits, (seed, p, cap, kw)
        # with the same pinned set, pinned Belady still beats pinned LRU
        assert simulate(tr, "pinned+belady", cap, **kw).hits >= simulate(tr, "pinned+lru", cap, **kw).hits


def test_pinned_never_evicted_and_always_hit():
    tr = synthetic_trace(80, 3, 12, 3, zipf=1.0, locality=0.2, seed=5)
    pinned = {(0, 1), (1, 2), (2, 3)}
    for policy in ("lru", "lfu", "belady"):
        r = simulate(tr, policy, 10, pinned=pinned, record_evictions=True)
        assert r.policy == f"pinned+{policy}"
        assert r.pinned == 3
        assert not pinned & set(r.evicted)
        # preloaded and never evicted: the pinned experts' accesses are all hits, and the
        # other experts see a 7-slot cache
        pinned_accesses = sum(1 for k in tr.accesses() if k in pinned)
        assert r.hits >= pinned_accesses
        assert r.compulsory_misses == len(set(tr.accesses()) - pinned)
    # exact ids on a top-1 stream with one pinned and one dynamic slot
    st = [0, 1, 2, 0, 3, 1, 0, 2]
    trace1 = RoutingTrace.from_records([(t, 0, [e]) for t, e in enumerate(st)],
                                       num_layers=1, num_experts=4, top_k=1)
    r = simulate(trace1, "lru", 2, pinned={(0, 0)}, record_evictions=True)
    # slot 1 is dynamic: 1 miss, 2 miss (evict 1), 3 miss (evict 2), 1 miss (evict 3),
    # 2 miss (evict 1); the three accesses to 0 hit
    assert r.evicted == [(0, 1), (0, 2), (0, 3), (0, 1)]
    assert (r.hits, r.misses) == (3, 5)
    auto = simulate(tr, "pinned+lru", 10, pin_fraction=0.5)
    assert auto.pinned == 5
    # auto-pinning always leaves room for one record
    assert simulate(tr, "pinned+lru", 4, pin_fraction=1.0).pinned == 1


def test_per_layer_split_and_hit_rates():
    assert layer_capacities(10, 4) == [3, 3, 2, 2]
    # layer 0 always routes to {0,1}; layer 1 alternates {2,3} and {4,5}
    recs = []
    for t in range(10):
        recs.append((t, 0, [0, 1]))
        recs.append((t, 1, [2, 3] if t % 2 == 0 else [4, 5]))
    tr = RoutingTrace.from_records(recs, num_layers=2, num_experts=6, top_k=2)
    r = simulate(tr, "lru", 4, per_layer=True)  # 2 slots per layer
    assert r.per_layer_hit_rate.tolist() == [pytest.approx(18 / 20), 0.0]
    assert r.layer_accesses.tolist() == [20, 20]
    r = simulate(tr, "lru", 6)  # global: 6 slots hold everything
    assert r.per_layer_hit_rate.tolist() == [pytest.approx(18 / 20), pytest.approx(16 / 20)]


def test_bytes_missed_per_token():
    tr = cyclic_trace(5, 2, 8, 2)  # 5 tokens, working set 4
    r = simulate(tr, "lru", 3, expert_bytes=1000, whole_record=False)  # thrashes
    assert r.misses == 20 and r.tokens == 5
    assert r.bytes_missed == 20_000
    assert r.bytes_missed_per_token == pytest.approx(4000.0)
    r = simulate(tr, "lru", 3, expert_bytes={0: 10, 1: 100}, whole_record=False)  # per layer
    assert r.bytes_missed == 10 * 10 + 10 * 100
    sizes = {(l, e): 1 + l for l in range(2) for e in range(8)}
    r = simulate(tr, "lru", 3, expert_bytes=sizes, whole_record=False)
    assert r.bytes_missed == 10 * 1 + 10 * 2
    # whole-record: 4 compulsory, then one miss per record: layer 0 pays 2+4, layer 1 pays 2+4
    r = simulate(tr, "lru", 3, expert_bytes={0: 10, 1: 100})
    assert r.misses == 12 and r.bytes_missed == 6 * 10 + 6 * 100
    with pytest.raises(ValueError, match="layer 1 expert 0"):
        simulate(tr, "lru", 3, expert_bytes={0: 10})


def test_capacity_errors():
    tr = cyclic_trace(3, 2, 8, 4)
    with pytest.raises(CacheCapacityError, match="4 experts"):
        simulate(tr, "lru", 3)  # a record needs 4 slots
    with pytest.raises(CacheCapacityError, match="layer"):
        simulate(tr, "lru", 6, per_layer=True)  # 3 per layer
    with pytest.raises(CacheCapacityError, match="pinned"):
        simulate(tr, "lru", 2, pinned={(0, 0), (0, 1), (1, 0)})
    with pytest.raises(ValueError, match="capacity"):
        simulate(tr, "lru", 0)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        simulate(tr, "fifo", 8)
    with pytest.raises(ValueError, match="pinned key"):
        simulate(tr, "lru", 8, pinned={(5, 0)})


def test_policy_factory_accepted():
    tr = stream_trace([0, 1, 0, 2, 1])
    r = simulate(tr, LRUPolicy, 2)
    assert r.policy == "lru" and r.misses == 4


def test_sweep_budgets_table_and_plot(tmp_path):
    tr = synthetic_trace(40, 4, 16, 4, zipf=1.0, locality=0.3, seed=0)
    budgets = budgets_from_fractions(tr, [0.1, 0.25, 0.5, 1.0])
    assert budgets == [6, 16, 32, 64]
    with pytest.raises(ValueError, match="fraction"):
        budgets_from_fractions(tr, [0.0])
    table = sweep(tr, ["lru", "lfu", "belady"], budgets)
    assert isinstance(table, SweepTable)
    assert table.policies == ["lru", "lfu", "belady"]
    assert table.capacities == budgets
    assert len(table.rows()) == 12
    for c in budgets:
        assert table.hit_rate("belady", c) >= table.hit_rate("lru", c)
    # hit rate is monotone in capacity for Belady
    hr = [table.hit_rate("belady", c) for c in budgets]
    assert hr == sorted(hr)
    text = table.format()
    assert "belady" in text and "25.0%" in text
    png = plot_hit_rates(table, tmp_path / "hit.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png2 = plot_hit_rates(table.rows(), tmp_path / "rows.png", "rows")
    assert png2.stat().st_size > 1000


def test_replay_speed_1e6_accesses():
    import time

    tr = synthetic_trace(5000, 24, 64, 8, zipf=1.0, locality=0.3, seed=0)  # 960k accesses
    for p in ("lru", "belady"):
        t = time.perf_counter()
        r = simulate(tr, p, 384)
        assert r.accesses == 960_000
        assert time.perf_counter() - t < 10.0, p  # ~1 s on the 2-core dev machine


# ---- traces ------------------------------------------------------------------------------------


def small_trace():
    return RoutingTrace.from_records(
        [(0, 0, [1, 2]), (0, 1, [0, 3]), (1, 0, [2, 1]), (1, 1, [3, 0])],
        num_layers=2, num_experts=4, top_k=2,
    )


def test_accesses_execution_order():
    tr = small_trace()
    assert list(tr.accesses()) == [(0, 1), (0, 2), (1, 0), (1, 3), (0, 2), (0, 1), (1, 3), (1, 0)]
    assert tr.access_list() == list(tr.accesses())
    assert list(tr.records())[2] == (1, 0, (2, 1))
    assert (len(tr), tr.num_tokens, tr.num_accesses, tr.num_keys) == (4, 2, 8, 8)


def test_trace_validation_names_record():
    ok = dict(num_layers=2, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match=r"record 1 .*out of range, allowed 0..3"):
        RoutingTrace.from_records([(0, 0, [1, 2]), (0, 1, [0, 4])], **ok)
    with pytest.raises(ValueError, match=r"record 1 .*3 experts"):
        RoutingTrace.from_records([(0, 0, [1, 2]), (0, 1, [0, 1, 2])], **ok)
    with pytest.raises(ValueError, match=r"record 0 .*layer out of range"):
        RoutingTrace.from_records([(0, 2, [1, 2])], **ok)
    with pytest.raises(ValueError, match=r"record 0 .*duplicate experts"):
        RoutingTrace.from_records([(0, 0, [1, 1])], **ok)
    with pytest.raises(ValueError, match=r"record 0 .*out of range"):
        RoutingTrace.from_records([(0, 0, [-1, 1])], **ok)
    with pytest.raises(ValueError, match="top_k=5 exceeds"):
        RoutingTrace(1, 4, 5, [], [], np.zeros((0, 5)))


def test_npz_roundtrip_and_compact(tmp_path):
    tr = synthetic_trace(500, 4, 16, 4, zipf=1.0, locality=0.5, seed=1)
    path = tr.save(tmp_path / "t.npz")
    back = RoutingTrace.load(path)
    assert back == tr
    with np.load(path) as z:
        assert z["experts"].dtype == np.uint8
    assert path.stat().st_size < tr.num_accesses  # < 1 byte per access


def test_npz_bad_file(tmp_path):
    p = tmp_path / "bad.npz"
    np.savez(p, meta=np.array([1, 2, 4, 2]), token_index=np.array([0]), layer=np.array([0]),
             experts=np.array([[0, 9]]), sequence=np.array([0]))
    with pytest.raises(ValueError, match=r"bad.npz: record 0"):
        RoutingTrace.load(p)
    q = tmp_path / "junk.npz"
    q.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="junk.npz"):
        RoutingTrace.load(q)


def test_jsonl_roundtrip(tmp_path):
    tr = small_trace()
    path = tr.to_jsonl(tmp_path / "t.jsonl")
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    assert head["format"] == "moestream-routing-trace" and head["top_k"] == 2
    assert json.loads(lines[3]) == {"seq": 0, "token": 1, "layer": 0, "experts": [2, 1]}
    assert RoutingTrace.from_jsonl(path) == tr


def test_recorder_and_concat():
    rec = TraceRecorder(num_layers=2, num_experts=4, top_k=2)
    rec.record(0, 0, [1, 2])
    rec.record(0, 1, np.array([0, 3]))
    with pytest.raises(ValueError, match=r"record 2 \(token 1, layer 0\): experts \[1, 7\]"):
        rec.record(1, 0, [1, 7])
    with pytest.raises(ValueError, match="expected top_k=2"):
        rec.record(1, 0, [1])
    rec.new_sequence()
    rec.record(0, 0, [3, 2])
    tr = rec.trace()
    assert tr.sequence.tolist() == [0, 0, 1]
    assert tr.num_tokens == 2
    both = concat([tr, small_trace()])
    assert len(both) == 7
    assert both.sequence.tolist() == [0, 0, 1, 2, 2, 2, 2]
    assert both.num_tokens == 4


def test_routing_statistics():
    tr = small_trace()
    assert expert_counts(tr).tolist() == [[0, 2, 2, 0], [2, 0, 0, 2]]
    np.testing.assert_allclose(usage_entropy(tr), [0.5, 0.5])
    np.testing.assert_allclose(top_share(tr, 0.25), [0.5, 0.5])
    np.testing.assert_allclose(top_share(tr, 0.5), [1.0, 1.0])


def test_budgets_per_layer_floor():
    tr = synthetic_trace(5, 4, 16, 4, seed=0)
    assert budgets_from_fractions(tr, [0.1, 0.5]) == [6, 32]
    assert budgets_from_fractions(tr, [0.1, 0.5], per_layer=True) == [16, 32]


def test_frequency_oracle_holds_the_most_used_keys():
    from engine.experts.simulate import frequency_oracle

    # layer 0 picks (0, 1) twice and (0, 2) once; layer 1 picks (1, 1) three times, top-1 records
    tr = RoutingTrace.from_records([(0, 0, [1]), (0, 1, [1]), (1, 0, [1]), (1, 1, [1]), (2, 0, [2]),
                                    (2, 1, [1])], num_layers=2, num_experts=4, top_k=1)
    assert frequency_oracle(tr, 1) == pytest.approx(3 / 6)
    assert frequency_oracle(tr, 2) == pytest.approx(5 / 6)
    assert frequency_oracle(tr, 3) == frequency_oracle(tr, 10) == pytest.approx(1.0)
    assert frequency_oracle(tr, 0) == 0.0
