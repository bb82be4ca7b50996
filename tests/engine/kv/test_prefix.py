"""Prefix caching bookkeeping (engine.kv.prefix, BlockPool names, PagedKVCache match/register,
the scheduler's admission): exact ids and orders, and 200 random requests with shared prefixes,
preemption and random aborts that return every block to the pool."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from engine.kv.paged import BlockPool, PagedKVCache
from engine.kv.prefix import ROOT, SnapshotStore, block_hash, chain_hashes
from engine.layers.sampler import SamplingConfig
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence


def test_block_hash_is_blake2b_of_parent_and_int64_tokens():
    want = hashlib.blake2b(b"", digest_size=16)
    want.update(np.array([1, 2, 70000, 3], dtype="<i8").tobytes())
    assert block_hash(ROOT, [1, 2, 70000, 3]) == want.digest()
    a, b = chain_hashes(list(range(12)), 4, 3), chain_hashes(list(range(8)) + [9, 9, 9, 9], 4, 3)
    assert a[:2] == b[:2] and a[2] != b[2]  # the same prefix names the same blocks
    assert chain_hashes([5, 6, 7, 8, 1, 2, 3, 4], 4, 2)[1] != chain_hashes([1, 2, 3, 4], 4, 1)[0]


def test_pool_keeps_named_blocks_cached_and_evicts_lru_last():
    pool = BlockPool(5)
    evicted = []
    pool.on_evict = evicted.append
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    assert pool.set_hash(0, b"x") and pool.set_hash(1, b"y")
    assert not pool.set_hash(2, b"x") and not pool.set_hash(0, b"z")  # name or block taken
    pool.free([1, 0, 2])
    assert pool.free_ids() == [3, 4, 2, 1, 0]  # unnamed first; named ones LRU first
    assert (pool.num_free, pool.num_cached_free, pool.num_used) == (5, 2, 0)
    pool.take(pool.lookup(b"x"))  # a cached block back in use
    assert pool.refcounts[0] == 1 and pool.free_ids() == [3, 4, 2, 1]
    assert pool.allocate(3) == [3, 4, 2] and evicted == [] and pool.evictions == 0
    assert pool.allocate(1) == [1] and evicted == [b"y"] and pool.lookup(b"y") is None
    pool.free([0, 1, 2, 3, 4])
    assert pool.free_ids() == [1, 2, 3, 4, 0] and pool.refcounts == [0] * 5


def test_match_and_register_share_blocks_and_leave_a_token_to_compute():
    kv = PagedKVCache(1, 1, 2, num_blocks=8, block_size=4)
    tokens = list(range(10, 22))  # 12 tokens: 3 full blocks
    kv.allocate(0, 12)
    assert kv.register(0, 7, lambda s, n: tokens[s:s + n]) == 1  # only block 0 is full
    assert kv.register(0, 12, lambda s, n: tokens[s:s + n]) == 3
    assert kv.match_prefix(1, tokens) == 8  # 12 tokens: the last block is left to compute
    assert kv.block_table(1) == kv.block_table(0)[:2] and kv.pool.refcounts[:3] == [2, 2, 1]
    assert kv.match_prefix(2, tokens + [99]) == 12
    assert kv.match_prefix(3, [10, 11, 12, 0, 5]) == 0 and kv.block_table(3) == []
    off = PagedKVCache(1, 1, 2, num_blocks=8, block_size=4, prefix_cache=False)
    off.allocate(0, 12)
    assert off.register(0, 12, lambda s, n: tokens[s:s + n]) == 0 and off.match_prefix(1, tokens) == 0
    for s in (0, 1, 2, 3):
        kv.free(s)
    assert kv.pool.refcounts == [0] * 8 and kv.metrics().blocks_cached == 3


def test_snapshot_store_lru_and_discard():
    st = SnapshotStore(2)
    st.put(b"a", lambda: 1)
    st.put(b"b", lambda: 2)
    st.put(b"a", lambda: pytest.fail("kept already: not taken again"))
    st.put(b"c", lambda: 3)  # evicts b (a was used more recently)
    assert b"b" not in st and st.get(b"a") == 1 and len(st) == 2
    st.discard(b"c")
    assert b"c" not in st and len(SnapshotStore(0).__dict__["_snaps"]) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_requests_with_shared_prefixes_and_aborts_return_every_block(seed):
    """200 requests drawn from 5 shared prefixes, decoded with random tokens, in a 24-block pool
    (preemption happens), with random aborts. Every step: each block's refcount equals the tables
    that hold it, a named block is named for its content. At the end every block is free."""
    rng = random.Random(seed)
    bs = 4
    kv = PagedKVCache(1, 1, 2, num_blocks=24, block_size=bs)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8), kv)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    pending = list(range(200))
    live: dict[str, Sequence] = {}
    aborted = preempted = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                i = pending.pop(0)
                prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
                seq = Sequence(f"r{i}", i, prompt, SamplingConfig(max_tokens=rng.randrange(1, 16)))
                sched.add(seq)
                live[seq.request_id] = seq
        if live and rng.random() < 0.15:
            sched.abort(rng.choice(sorted(live)))
            aborted += 1
        plan = sched.schedule()
        preempted += len(plan.preempted)
        sched.commit(plan)
        for seq, n, ctx in plan:
            kv.register(seq.seq_id, seq.num_computed_tokens, seq.token_slice)
            if seq.num_uncomputed_tokens == 0:
                seq.output_ids.append(rng.randrange(1000))
                if len(seq.output_ids) >= seq.sampling.max_tokens:
                    sched.finish(seq, "length")
        live = {k: s for k, s in live.items() if not s.is_finished}
        held = [0] * kv.num_blocks
        for table in kv.tables.values():
            for b in table:
                held[b] += 1
        assert held == kv.pool.refcounts
        for sid, chain in kv.chains.items():
            seq = next(s for s in sched.running if s.seq_id == sid)
            assert chain == chain_hashes(seq.all_ids, bs, len(chain))
            for name, b in zip(chain, kv.tables[sid]):
                assert kv.pool.hash_of.get(b, name) == name
    assert aborted > 10 and preempted > 0 and sched.stats.prefix_hit_tokens > 0
    assert kv.tables == {} and kv.chains == {}
    assert kv.pool.refcounts == [0] * kv.num_blocks and kv.pool.num_free == kv.num_blocks
    assert kv.metrics().blocks_cached > 0
