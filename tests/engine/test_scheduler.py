"""Scheduler bookkeeping on a tiny paged cache (1 layer, 1 head, head dim 1): exact plans,
chunked-prefill splits, preemption victims and block ids, admission rejection, aborts."""

from __future__ import annotations

import pytest
import torch

from engine.errors import CapacityError, ConfigError, RequestValidationError
from engine.kv.paged import PagedKVCache
from engine.layers.sampler import SamplingConfig
from engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int, block_size: int, budget: int, max_seqs: int = 8) -> Scheduler:
    kv = PagedKVCache(1, 1, 1, num_blocks=num_blocks, block_size=block_size, dtype=torch.float32)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv)


def seq(name: str, i: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(name, i, list(range(3, 3 + prompt_len)), SamplingConfig(max_tokens=max_tokens),
                    arrival_time=float(i))


def shape(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(s.request_id, n, ctx) for s, n, ctx in plan]


def run(sched: Scheduler, plan: StepPlan) -> None:
    """What the runner does after the forward: commit, sample (token 7) where due, retire."""
    sched.commit(plan)
    for s, _, _ in plan:
        if s.num_uncomputed_tokens == 0:
            s.append_token(7, 0.0)
            if len(s.output_ids) >= s.sampling.max_tokens:
                sched.finish(s, "length")


def test_chunked_prefill_splits_and_mixes_with_decode():
    sched = make(num_blocks=32, block_size=4, budget=8)
    a, b = seq("a", 0, 20), seq("b", 1, 3)
    sched.add(a)
    sched.add(b)
    plans = []
    for _ in range(4):
        plan = sched.schedule()
        plans.append(shape(plan))
        run(sched, plan)
    assert plans == [
        [("a", 8, 0)],
        [("a", 8, 8)],
        [("a", 4, 16), ("b", 3, 0)],  # a's last chunk and b's whole prompt in one batch
        [("a", 1, 20), ("b", 1, 3)],  # both decode
    ]
    assert a.output_ids == [7, 7] and b.output_ids == [7, 7]
    assert sched.kv.block_table(0) == [0, 1, 2, 3, 4, 6] and sched.kv.block_table(1) == [5]
    assert sched.stats.steps == 4 and sched.stats.scheduled_tokens == 8 + 8 + 7 + 2


def test_budget_and_max_num_seqs_limits_take_oldest_first():
    sched = make(num_blocks=32, block_size=4, budget=2, max_seqs=3)
    seqs = [seq(n, i, 1) for i, n in enumerate("abcd")]
    for s in seqs:
        sched.add(s)
    got = []
    for _ in range(4):
        plan = sched.schedule()
        got.append(shape(plan))
        run(sched, plan)
    assert got == [
        [("a", 1, 0), ("b", 1, 0)],
        [("a", 1, 1), ("b", 1, 1)],  # c is admitted only when budget is left
        [("a", 1, 2), ("b", 1, 2)],
        [("a", 1, 3), ("b", 1, 3)],
    ]
    sched = make(num_blocks=32, block_size=4, budget=16, max_seqs=3)
    for s in [seq(n, i, 1) for i, n in enumerate("abcd")]:
        sched.add(s)
    assert [r for r, _, _ in shape(sched.schedule())] == ["a", "b", "c"]  # d waits for a slot
    assert [s.request_id for s in sched.waiting] == ["d"]


def test_preemption_picks_most_recent_arrival_and_recomputes():
    # 6 blocks of 2 tokens; three prompts fill the cache, then decodes need more blocks
    sched = make(num_blocks=6, block_size=2, budget=16)
    a, b, c = seq("a", 0, 4), seq("b", 1, 4), seq("c", 2, 3)
    for s in (a, b, c):
        sched.add(s)
    p1 = sched.schedule()
    assert shape(p1) == [("a", 4, 0), ("b", 4, 0), ("c", 3, 0)]
    assert [sched.kv.block_table(i) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    run(sched, p1)

    p2 = sched.schedule()  # a needs a 3rd block: c (newest) is preempted; b takes the other
    assert shape(p2) == [("a", 1, 4), ("b", 1, 4)] and p2.preempted == (c,)
    assert c.status is SequenceStatus.PREEMPTED and c.num_computed_tokens == 0
    assert sched.kv.block_table(0) == [0, 1, 4] and sched.kv.block_table(1) == [2, 3, 5]
    run(sched, p2)

    p3 = sched.schedule()  # 6 tokens each fit in 3 blocks; c (4 tokens to recompute) can't
    assert shape(p3) == [("a", 1, 5), ("b", 1, 5)] and p3.preempted == ()
    run(sched, p3)

    p4 = sched.schedule()  # a needs a 4th block: b is now the newest running
    assert shape(p4) == [("a", 1, 6)] and p4.preempted == (b,)
    assert [s.request_id for s in sched.waiting] == ["b", "c"]  # older preempted first
    assert sched.stats.preemptions == 2 and sched.stats.recomputed_tokens == 3 + 6
    run(sched, p4)

    p5 = sched.schedule()  # two blocks free: b needs 4 for its 7 tokens -> nothing admitted
    assert shape(p5) == [("a", 1, 7)]
    run(sched, p5)
    p6 = sched.schedule()  # a finishes after this step (max_tokens 8 reached after it)
    assert shape(p6) == [("a", 1, 8)]
    for _ in range(3):
        run(sched, p6)
        p6 = sched.schedule()
        if not any(s.request_id == "a" for s, _, _ in p6):
            break
    assert a.is_finished and a.finish_reason == "length" and a.output_ids == [7] * 8
    # b comes back first, prefilling prompt + its 3 generated tokens in one chunk
    assert shape(p6)[0] == ("b", 7, 0) and b.status is SequenceStatus.RUNNING


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    sched = make(num_blocks=3, block_size=2, budget=16)
    a, b = seq("a", 0, 2, max_tokens=4), seq("b", 1, 2, max_tokens=4)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())  # a: [0], b: [1]
    plan = sched.schedule()  # a takes block 2; b needs a block and is itself the newest
    assert shape(plan) == [("a", 1, 2)] and plan.preempted == (b,)
    assert sched.kv.pool.num_free == 1  # b's block came back


def test_admission_rejects_what_can_never_fit():
    sched = make(num_blocks=4, block_size=4, budget=16)
    sched.add(seq("fits", 0, 10, max_tokens=7))  # 10 + 7 - 1 = 16 KV slots = 4 blocks
    with pytest.raises(CapacityError) as e:
        sched.add(seq("big", 1, 10, max_tokens=8))
    msg = str(e.value)
    for part in ("'big'", "prompt 10", "max_tokens 8", "17 KV slots", "5 blocks of 4",
                 "4 blocks (16 tokens)"):
        assert part in msg, msg
    assert [s.request_id for s in sched.waiting] == ["fits"]
    with pytest.raises(RequestValidationError, match="already in use"):
        sched.add(seq("fits", 2, 1))
    with pytest.raises(ConfigError, match="max_num_seqs=0"):
        SchedulerConfig(max_num_seqs=0)


def test_abort_waiting_running_and_preempted_frees_blocks():
    sched = make(num_blocks=6, block_size=2, budget=16)
    a, b, c, d = seq("a", 0, 4), seq("b", 1, 4), seq("c", 2, 3), seq("d", 3, 1)
    for s in (a, b, c, d):
        sched.add(s)
    run(sched, sched.schedule())  # a, b, c running; d waits (no blocks)
    run(sched, sched.schedule())  # c preempted
    assert c.status is SequenceStatus.PREEMPTED and d.status is SequenceStatus.WAITING
    for s in (c, d, b):
        assert sched.abort(s.request_id) is s
        assert s.finish_reason == "abort" and s.is_finished
    assert sched.abort("c") is None and sched.abort("nope") is None
    assert sched.running == [a] and not sched.waiting
    assert sched.kv.pool.num_free == 6 - 3
    sched.abort("a")
    assert not sched.has_unfinished() and sched.kv.pool.num_free == 6 and not sched.kv.tables


def test_token_slice_is_a_slice_of_prompt_output_and_pending():
    """Every (start, n) over prompt + output (+ accepted drafts not yet appended) gives what
    slicing the concatenation gives; a decode step's one-token slice past a long history is
    built without copying that history."""
    import random

    rng = random.Random(7)
    for _ in range(200):
        p, o, d = rng.randrange(0, 6), rng.randrange(0, 6), rng.randrange(0, 4)
        seq = Sequence("s", 0, [rng.randrange(1000) for _ in range(p)], SamplingConfig(max_tokens=8), 0.0)
        seq.output_ids = [rng.randrange(1000) for _ in range(o)]
        pending = [rng.randrange(1000) for _ in range(d)]
        whole = seq.prompt_ids + seq.output_ids + pending
        for start in range(0, len(whole) + 2):
            for n in range(0, len(whole) - start + 3):
                assert seq.token_slice(start, n, pending) == whole[start:start + n], (p, o, d, start, n)
                if start + n <= p + o:
                    assert seq.token_slice(start, n) == whole[start:start + n]

    seq = Sequence("long", 1, list(range(100_000)), SamplingConfig(max_tokens=8), 0.0)
    seq.output_ids = [5, 6, 7]
    seq.prompt_ids = _NoCopy(seq.prompt_ids)  # a slice past the prompt must not read it whole
    assert seq.token_slice(100_002, 1) == [7]
    assert seq.token_slice(99_999, 2) == [99_999, 5]


class _NoCopy(list):
    """A list whose whole-list copies fail: ``+`` or an unbounded slice of it."""

    def __add__(self, other):
        raise AssertionError("the history was concatenated")

    def __getitem__(self, i):
        if isinstance(i, slice) and (i.stop or len(self)) - (i.start or 0) > 10:
            raise AssertionError(f"a slice of {i} copies the history")
        return list.__getitem__(self, i)
