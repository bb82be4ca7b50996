"""Eviction policies: exact victims on hand-made access streams, protection and pinning."""

from __future__ import annotations

import random

import pytest

from engine.experts.policy import (
    BeladyPolicy,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    PinnedPolicy,
    make_policy,
    next_use_indices,
    top_keys,
)

A, B, C, D = (0, 0), (0, 1), (0, 2), (0, 3)


def replay(policy: EvictionPolicy, stream, capacity: int):
    """Minimal cache over a flat stream; returns (misses, evictions in order)."""
    resident: set = set()
    misses, evicted = 0, []
    for now, key in enumerate(stream):
        if key in resident:
            policy.on_hit(key, now)
            continue
        misses += 1
        if len(resident) >= capacity:
            v = policy.victim(resident, set(), now)
            assert v in resident
            resident.remove(v)
            policy.on_remove(v)
            evicted.append(v)
        resident.add(key)
        policy.on_insert(key, now)
    return misses, evicted


# ---- LRU --------------------------------------------------------------------------------------


def test_lru_abacb_capacity_2_evicts_b_then_a():
    misses, evicted = replay(LRUPolicy(), [A, B, A, C, B], 2)
    assert evicted == [B, A]
    assert misses == 4


def test_lru_order_tracks_hits():
    p = LRUPolicy()
    for now, k in enumerate([A, B, C]):
        p.on_insert(k, now)
    p.on_hit(A, 3)
    assert p.order() == [B, C, A]
    p.on_remove(C)
    assert p.order() == [B, A]
    assert p.victim({A, B}, set(), 4) == B


# Silberschatz's reference string: 3 frames -> LRU 12 faults, OPT 9 faults.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def test_lru_textbook_12_faults():
    stream = [(0, x) for x in TEXTBOOK]
    misses, evicted = replay(LRUPolicy(), stream, 3)
    assert misses == 12
    assert [e for _, e in evicted] == [7, 1, 2, 3, 0, 4, 0, 3, 2]


# ---- Belady -----------------------------------------------------------------------------------


def test_belady_textbook_exact_victims():
    stream = [(0, x) for x in TEXTBOOK]
    misses, evicted = replay(BeladyPolicy(stream), stream, 3)
    assert misses == 9
    assert [e for _, e in evicted] == [7, 1, 0, 4, 3, 2]


def test_belady_never_used_again_ties_go_to_least_recent():
    stream = [A, B, C, D]  # at D, A/B/C are never used again
    _, evicted = replay(BeladyPolicy(stream), stream, 3)
    assert evicted == [A]


def test_belady_requires_now_to_index_the_stream():
    p = BeladyPolicy([A, B])
    with pytest.raises(ValueError, match="now=1"):
        p.on_insert(A, 1)


def test_next_use_indices():
    assert next_use_indices([A, B, A, C, B]) == [2, 4, 5, 5, 5]


def test_belady_shared_next_use_length_checked():
    with pytest.raises(ValueError, match="next_use"):
        BeladyPolicy([A, B], next_use=[1])


# ---- LFU --------------------------------------------------------------------------------------


def test_lfu_pure_evicts_least_frequent():
    _, evicted = replay(LFUPolicy(half_life=None), [A, A, B, C, B], 2)
    assert evicted == [B, C]


def test_lfu_ties_broken_by_recency():
    _, evicted = replay(LFUPolicy(half_life=None), [A, B, C], 2)
    assert evicted == [A]
    _, evicted = replay(LFUPolicy(half_life=None), [A, B, A, B, C], 2)
    assert evicted == [A]


def test_lfu_aging_lets_old_popularity_fade():
    stream = [A, A, A, B, B, C]
    # plain counts: A=3 beats B=2, so B goes
    assert replay(LFUPolicy(half_life=None), stream, 2)[1] == [B]
    # half-life 1 access: A's uses at 0,1,2 weigh 1+2+4 < B's at 3,4 weigh 8+16 -> A goes
    assert replay(LFUPolicy(half_life=1.0), stream, 2)[1] == [A]
    assert replay(LFUPolicy(decay=0.5), stream, 2)[1] == [A]
    # a long half-life behaves like plain counts here
    assert replay(LFUPolicy(half_life=1000.0), stream, 2)[1] == [B]


def test_lfu_score_decays():
    p = LFUPolicy(half_life=10.0)
    p.on_insert(A, 0)
    assert p.score(A, 0) == pytest.approx(1.0)
    assert p.score(A, 10) == pytest.approx(0.5)
    p.on_hit(A, 10)
    assert p.score(A, 10) == pytest.approx(1.5)
    assert p.score(B, 10) == 0.0
    assert LFUPolicy(decay=0.5).half_life == pytest.approx(1.0)
    assert LFUPolicy(decay=1.0).half_life is None


def test_lfu_history_vs_in_cache():
    stream = [A, B, B, C, A, D, A]
    # with history: at C {A1, B2} evict A; at A {B2, C1} evict C, A returns with count 2;
    # at D {B2 last@2, A2 last@4} tie -> evict the older B; then A hits.
    assert replay(LFUPolicy(half_life=None), stream, 2)[1] == [A, C, B]
    # in-cache: A returns with count 1, so at D {B2, A1} A goes and misses again, evicting D.
    assert replay(LFUPolicy(half_life=None, keep_history=False), stream, 2)[1] == [A, C, A, D]


def test_lfu_bad_arguments():
    with pytest.raises(ValueError, match="decay"):
        LFUPolicy(decay=0.0)
    with pytest.raises(ValueError, match="half_life"):
        LFUPolicy(half_life=-1.0)


# ---- protection and pinning ---------------------------------------------------------------------


def _all_policies(stream):
    return [
        LRUPolicy(),
        LFUPolicy(half_life=8.0),
        LFUPolicy(half_life=None, keep_history=False),
        BeladyPolicy(stream),
        PinnedPolicy(LRUPolicy(), {A}),
        PinnedPolicy(BeladyPolicy(stream), {B}),
    ]


@pytest.mark.parametrize("i", range(6))
def test_victim_skips_protected_and_returns_none_when_all_protected(i):
    stream = [A, B, C, A]
    p = _all_policies(stream)[i]
    for now, k in enumerate([A, B, C]):
        p.on_insert(k, now)
    p.on_hit(A, 3)
    resident = {A, B, C}
    pinned = getattr(p, "pinned", frozenset())
    for protected in [set(), {A}, {B}, {C}, {A, B}, {A, C}, {B, C}]:
        v = p.victim(resident, protected, 4)
        allowed = resident - protected - pinned
        if allowed:
            assert v in allowed
        else:
            assert v is None
    assert p.victim(resident, resident, 4) is None


def test_lru_victim_with_protected_oldest():
    p = LRUPolicy()
    for now, k in enumerate([A, B, C]):
        p.on_insert(k, now)
    assert p.victim({A, B, C}, {A}, 3) == B
    assert p.victim({A, B, C}, {A, B}, 3) == C
    # victim does not change the bookkeeping
    assert p.order() == [A, B, C]


def test_victim_only_from_resident_and_untracked_fallback():
    p = LRUPolicy()
    p.on_insert(A, 0)
    p.on_insert(B, 1)
    assert p.victim({B}, set(), 2) == B  # A tracked but not resident
    assert p.victim([B, A], set(), 2) == A  # any iterable works
    assert p.victim({D}, set(), 2) == D  # resident but never inserted
    assert p.victim({D}, {D}, 2) is None


def test_pinned_keys_never_evicted():
    p = PinnedPolicy(LRUPolicy(), {A})
    assert p.name == "pinned+lru"
    misses, evicted = replay(p, [A, B, C, B, D, C, A, D], 2)
    assert A not in evicted
    assert evicted == [B, C, B, D, C]
    with pytest.raises(ValueError, match="pinned"):
        p.on_remove(A)


def test_protection_randomised():
    rnd = random.Random(0)
    keys = [(l, e) for l in range(2) for e in range(6)]
    stream = [rnd.choice(keys) for _ in range(400)]
    for p in _all_policies(stream):
        resident: set = set()
        pinned = getattr(p, "pinned", frozenset())
        for now, key in enumerate(stream):
            if key in resident:
                p.on_hit(key, now)
            else:
                if len(resident) >= 5:
                    protected = set(rnd.sample(sorted(resident), rnd.randint(0, len(resident))))
                    v = p.victim(resident, protected, now)
                    allowed = resident - protected - pinned
                    if not allowed:
                        assert v is None
                        protected = set()
                        v = p.victim(resident, protected, now)
                    assert v in resident and v not in protected and v not in pinned
                    if v is None:
                        continue
                    resident.remove(v)
                    p.on_remove(v)
                resident.add(key)
                p.on_insert(key, now)


def test_make_policy_names():
    s = [A, B]
    assert make_policy("lru").name == "lru"
    assert make_policy("lfu").name == "lfu"
    assert make_policy("lfu-pure").name == "lfu-pure"
    assert make_policy("belady", future=s).name == "belady"
    assert make_policy("pinned+lru", pinned={A}).name == "pinned+lru"
    assert make_policy("lru", pinned={A}).name == "pinned+lru"
    with pytest.raises(ValueError, match="allowed: lru"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="future"):
        make_policy("belady")


def test_top_keys():
    stream = [A, B, A, C, A, B, (1, 0)]
    assert top_keys(stream, 2) == {A, B}
    assert top_keys(stream, 0) == set()
    assert top_keys(stream, 3) == {A, B, C}  # C and (1,0) tie at 1: smaller key first
