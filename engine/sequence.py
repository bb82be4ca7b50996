"""One request's state inside the serving engine.

Token bookkeeping: ``all_ids = prompt_ids + output_ids``. ``num_computed_tokens`` of them have
their keys/values in the KV cache. A sequence is fed ``all_ids[num_computed:num_tokens]`` (in
chunks during prefill); once the cache holds every token it samples the next one. While
decoding, that is exactly one uncomputed token: the last one sampled. Preemption by recompute
sets ``num_computed_tokens`` back to 0, so prompt and generated tokens are prefilled again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

from engine.layers.sampler import SamplerState, SamplingConfig

FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed; recomputes prompt + output
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    seq_id: int  # the KV cache's key; also breaks arrival-time ties (lower = earlier)
    prompt_ids: list[int]
    sampling: SamplingConfig
    arrival_time: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held at its first admission
    sampler: SamplerState = field(init=False)
    # streaming text (set by the runner when it has a tokenizer)
    detokenizer: object | None = None  # engine.tokenizer.IncrementalDetokenizer
    stop_matcher: object | None = None  # engine.tokenizer.StopStringMatcher
    text: str = ""  # text emitted so far
    spec: object | None = None  # engine.speculative.SeqSpeculation when this request speculates
    grammar: object | None = None  # its xgrammar GrammarMatcher when constrained (engine.agent.grammar)
    # latency bookkeeping (time.perf_counter seconds)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        self.sampler = SamplerState(self.sampling)
        self.sampler.prompt_tokens = set(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_kv_tokens(self) -> int:
        """KV slots the sequence can ever need: the last sampled token is never fed back."""
        return len(self.prompt_ids) + self.sampling.max_tokens - 1

    @property
    def arrival_key(self) -> tuple[float, int]:
        return (self.arrival_time, self.seq_id)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, n: int, pending: list[int] = ()) -> list[int]:
        """Token ids at positions [start, start + n) of prompt + output (+ ``pending``: ids that
        follow the output, accepted drafts not yet appended). Only the slice is copied: a decode
        step asks for its one token, and building ``all_ids`` for it cost O(context) per token."""
        out: list[int] = []
        end = start + n
        for part in (self.prompt_ids, self.output_ids, pending):
            m = len(part)
            if start < m and end > 0:
                out += part[max(start, 0):min(end, m)]
            start, end = start - m, end - m
        return out

    def append_token(self, token: int, now: float) -> None:
        """Record an emitted token (the sampler state has counted it: speculative.accept_tokens)."""
        self.output_ids.append(int(token))
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def finish(self, reason: FinishReason) -> None:
        self.status, self.finish_reason = SequenceStatus.FINISHED, reason

    # ---- latency ---------------------------------------------------------------------------
    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]
