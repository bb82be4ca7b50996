"""Single-sequence generation over a KV cache: prefill, then decode token by token. This is
the reference the serving engine (engine.runner.Engine, the one decode loop every caller uses)
is checked against in tests, and the prompt validation both share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from engine.errors import RequestValidationError
from engine.executor import executor_for, kv_dtype
from engine.kv.base import BatchLayout, ContiguousKVCache, KVCache
from engine.layers.sampler import (SamplerState, SamplingConfig, is_int, sample, short_repr,
                                   top_logprobs)
from engine.models.base import CausalLM


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # The first generated token comes out of prefill; decode steps produce the rest.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0

    def summary(self) -> str:
        return (f"prompt {self.prompt_tokens} tok, generated {self.generated_tokens} tok, "
                f"prefill {self.prefill_tps:.1f} tok/s, decode {self.decode_tps:.1f} tok/s")


@dataclass
class StreamEvent:
    token_id: int | None  # None on the final event
    text: str  # newly completed text (may be empty while a multi-byte char is pending)
    finish_reason: str | None = None  # "stop" | "length" on the final event
    stats: GenerationStats | None = None
    logprob: dict | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


MAX_REPORTED_IDS = 4  # bad prompt ids an error names; the rest are only counted


def validate_prompt(prompt_ids: Sequence[int], vocab_size: int, max_tokens: int, context: int) -> None:
    """Raise RequestValidationError unless ``prompt_ids`` is a non-empty sequence of integers in
    the vocabulary that fits the context with ``max_tokens``. One pass, stopping its list of bad
    ids at MAX_REPORTED_IDS: 10^6 bad ids cost one short message."""
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
        raise RequestValidationError(
            f"prompt ids must be a sequence of token ids, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise RequestValidationError("the prompt is empty; give at least one token")
    first: list[str] = []
    count = 0
    for i, t in enumerate(prompt_ids):
        if not (is_int(t) and 0 <= t < vocab_size):
            count += 1
            if len(first) < MAX_REPORTED_IDS:
                first.append(f"[{i}]={short_repr(t)}")
    if count:
        raise RequestValidationError(
            f"{count} of {len(prompt_ids)} prompt token ids out of range or not integers "
            f"(first: {', '.join(first)}); allowed: integers 0 <= id < vocab size {vocab_size}")
    if len(prompt_ids) + max_tokens > context:
        raise RequestValidationError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({short_repr(max_tokens)}) exceeds the model's "
            f"context of {context} tokens")


def generate_ids(model: CausalLM, prompt_ids: Sequence[int], sampling: SamplingConfig,
                 eos_ids: Sequence[int] = (), kv: KVCache | None = None,
                 seq_id: int = 0) -> Iterator[tuple[int, torch.Tensor, GenerationStats]]:
    """Yield (token, logits, stats) per generated token. Stops at max_tokens or an EOS/stop id;
    the caller stops early for stop strings by closing the generator."""
    cfg = model.config
    validate_prompt(prompt_ids, cfg.vocab_size, sampling.max_tokens, cfg.max_position_embeddings)
    kv = kv or ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                 dtype=kv_dtype(model))
    state = SamplerState(sampling)
    state.prompt_tokens = set(int(t) for t in prompt_ids)
    stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_ids))
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    step = executor_for(model)
    try:
        t0 = time.perf_counter()
        tokens = torch.tensor(list(prompt_ids), dtype=torch.long)
        logits = step(tokens, BatchLayout.single(seq_id, len(prompt_ids), 0), kv)[0]
        stats.prefill_seconds = time.perf_counter() - t0
        pos = len(prompt_ids)
        t_decode = time.perf_counter()
        while True:
            token = sample(logits, state)
            state.accept(token)
            stats.generated_tokens += 1
            stats.decode_seconds = time.perf_counter() - t_decode
            yield token, logits, stats
            if token in stop_ids or stats.generated_tokens >= sampling.max_tokens:
                return
            logits = step(torch.tensor([token]), BatchLayout.single(seq_id, 1, pos), kv)[0]
            pos += 1
    finally:
        kv.free(seq_id)


def generate_text(model: CausalLM, tokenizer, prompt_ids: Sequence[int],
                  sampling: SamplingConfig) -> Iterator[StreamEvent]:
    """Stream text: each event carries the text completed by one token (never half a UTF-8
    character, never a prefix of a stop string), then one final event with the finish reason.
    The single-sequence oracle of the serving engine's streamed text (tests)."""
    from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher

    detok = IncrementalDetokenizer(tokenizer, prompt_ids=list(prompt_ids))
    stops = StopStringMatcher(list(sampling.stop))
    eos = set(tokenizer.eos_token_ids) | set(model.config.eos_token_ids)
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    reason = "length"

    gen = generate_ids(model, prompt_ids, sampling, eos_ids=sorted(eos))
    stopped = False
    for token, logits, stats in gen:
        lp = top_logprobs(logits, token, sampling.logprobs) if sampling.logprobs is not None else None
        if (token in eos and not sampling.ignore_eos) or token in sampling.stop_token_ids:
            reason = "stop"
            gen.close()
            break
        text, stopped = stops.feed(detok.push(token))
        yield StreamEvent(token, text, logprob=lp)
        if stopped:
            reason = "stop"
            gen.close()
            break
    if not stopped:  # text held back for an unfinished character or a possible stop string
        text, stopped = stops.feed(detok.flush())
        tail = text if stopped else text + stops.flush()
        if tail:
            yield StreamEvent(None, tail)
    yield StreamEvent(None, "", finish_reason=reason, stats=stats)
