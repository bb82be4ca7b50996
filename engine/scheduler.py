"""Continuous batching: which sequences run this step and how many tokens each.

Every step is one flat batch under a token budget (``max_num_batched_tokens``) and a cap on
running sequences (``max_num_seqs``). There is no separate prefill or decode phase:

1. Running sequences, oldest arrival first: a decoding sequence takes 1 token, one in the
   middle of a prefill takes its next chunk (as much as the budget left allows). If the KV
   cache cannot hold a sequence's tokens, the most recently arrived running sequence is
   preempted by recompute (blocks freed, back to the head of the waiting queue, prompt +
   generated tokens to be prefilled again) until it can, or until it is the victim itself.
2. Waiting sequences, in queue order (preempted ones first, then by arrival), while budget,
   sequence slots and blocks last. A prompt longer than the budget left is prefilled in chunks
   over several steps. Nothing new is admitted in a step that preempted.

Admission (``add``) rejects a request whose prompt + max_tokens can never fit in the whole
cache, so a queued request always makes progress: the oldest running sequence can always
preempt every other one.

Prefix caching (engine.kv.prefix): a sequence that holds no block (new, or preempted) first
takes its longest cached prefix of full blocks (``match_prefix``) and computes only the rest;
if what is left does not fit, the matched blocks go back and it waits.

The scheduler knows nothing about the model: it sees sequences, token counts and the KV
cache's block accounting (``block_size``, ``num_blocks``, ``can_allocate``, ``allocate``,
``free``, ``match_prefix``, ``chunk_limit``). After the forward the runner calls ``commit(plan)``, then ``finish`` on sequences
that are done.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Protocol

from engine.errors import CapacityError, ConfigError, RequestValidationError
from engine.sequence import FinishReason, Sequence, SequenceStatus


class BlockSpace(Protocol):
    """The part of a paged KV cache the scheduler uses (engine.kv.paged.PagedKVCache)."""

    block_size: int

    @property
    def num_blocks(self) -> int: ...
    def can_allocate(self, seq_id: int, n_tokens: int) -> bool: ...
    def allocate(self, seq_id: int, n_tokens: int) -> list[int]: ...
    def free(self, seq_id: int) -> None: ...
    # prefix caching (engine.kv.prefix; PagedKVCache documents them)
    def match_prefix(self, seq_id: int, tokens: list[int]) -> int: ...
    def chunk_limit(self, seq_id: int, start: int, n: int, prompt_len: int) -> int: ...


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # tokens per step, all sequences together
    max_num_seqs: int = 64  # sequences running (holding KV) at once

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} is invalid; allowed: an integer >= 1")


class ScheduledSeq(NamedTuple):
    seq: Sequence
    n_tokens: int  # tokens fed this step: all_ids[context_len : context_len + n_tokens]
    context_len: int  # tokens already in the KV cache


@dataclass(frozen=True)
class StepPlan:
    entries: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...] = ()

    def __iter__(self) -> Iterator[ScheduledSeq]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(e.n_tokens for e in self.entries)


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0
    recomputed_tokens: int = 0  # computed tokens thrown away by preemption
    prefix_query_tokens: int = 0  # tokens of admitted sequences looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens reused from cached blocks (not computed)


@dataclass
class Scheduler:
    config: SchedulerConfig
    kv: BlockSpace
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)  # kept in arrival order
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    def __post_init__(self) -> None:
        self._by_id: dict[str, Sequence] = {}

    # ---- requests in and out ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise RequestValidationError(f"request id {seq.request_id!r} is already in use")
        bs = self.kv.block_size
        need = -(-seq.max_kv_tokens // bs)
        if need > self.kv.num_blocks:
            raise CapacityError(
                f"request {seq.request_id!r} can never fit in the KV cache: prompt "
                f"{len(seq.prompt_ids)} + max_tokens {seq.sampling.max_tokens} tokens need "
                f"{seq.max_kv_tokens} KV slots = {need} blocks of {bs}, but the cache has "
                f"{self.kv.num_blocks} blocks ({self.kv.num_blocks * bs} tokens); lower "
                f"max_tokens or the prompt to at most {self.kv.num_blocks * bs + 1} tokens in total")
        seq.status = SequenceStatus.WAITING
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire ``seq`` (running or waiting) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif not seq.is_finished:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        self._by_id.pop(seq.request_id, None)
        seq.finish(reason)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a waiting, running or preempted request with reason "abort"; None if unknown."""
        seq = self._by_id.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        entries: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget)
            end = seq.num_computed_tokens + n
            while not self.kv.can_allocate(seq.seq_id, end):
                victim = max(self.running, key=lambda s: s.arrival_key)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                entries.append(self._take(seq, n))
                budget -= n

        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            cached = self.kv.match_prefix(seq.seq_id, seq.all_ids)  # it holds no block yet
            seq.num_computed_tokens = cached
            n = self._chunk(seq, budget)
            if not self.kv.can_allocate(seq.seq_id, cached + n):
                self.kv.free(seq.seq_id)  # the matched blocks go back to the cache
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.stats.prefix_query_tokens += seq.num_tokens
            self.stats.prefix_hit_tokens += cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            entries.append(self._take(seq, n))
            budget -= n

        self.stats.steps += 1
        self.stats.scheduled_tokens += self.config.max_num_batched_tokens - budget
        return StepPlan(tuple(entries), tuple(preempted))

    def commit(self, plan: StepPlan) -> None:
        """The plan's tokens are now in the KV cache."""
        for seq, n, ctx in plan:
            assert seq.num_computed_tokens == ctx, (seq.request_id, seq.num_computed_tokens, ctx)
            seq.num_computed_tokens = ctx + n

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens ``seq`` feeds this step within ``budget`` (the cache may stop a prefill at a
        block boundary: a hybrid model's state snapshot, engine.kv.state)."""
        n = min(seq.num_uncomputed_tokens, budget)
        return self.kv.chunk_limit(seq.seq_id, seq.num_computed_tokens, n, len(seq.prompt_ids))

    def _take(self, seq: Sequence, n: int) -> ScheduledSeq:
        assert n > 0, f"{seq.request_id} has nothing to compute (sample after every full compute)"
        self.kv.allocate(seq.seq_id, seq.num_computed_tokens + n)
        return ScheduledSeq(seq, n, seq.num_computed_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        self.stats.preemptions += 1
        self.stats.recomputed_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
