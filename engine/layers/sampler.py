"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition/presence/frequency
penalties, per-request seeds. Reference path for one sequence's logits [V]."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from engine.errors import RequestValidationError


def is_int(x: object) -> bool:
    """An integer as the API takes one: int or a numpy integer; not bool, not float."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """A number as the API takes one: int, float or a numpy scalar; not bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def short_repr(value: object) -> str:
    """repr for an error message: at most 60 characters (never a megabyte of input)."""
    if isinstance(value, int) and value.bit_length() > 64:  # repr may not even be allowed
        return f"<{value.bit_length()}-bit integer>"
    text = repr(value) if isinstance(value, (int, float, str, bytes)) else type(value).__name__
    return text if len(text) <= 60 else f"{text[:57]}..."


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # speculative decoding (engine.speculative): None = the engine's default; the number of
    # draft tokens per step caps the engine's own maximum. Neither changes the distribution.
    speculative: bool | None = None
    num_speculative_tokens: int | None = None
    # structured output (engine.agent.grammar.Constraint): the engine masks this request's
    # logits to what the grammar allows next; None: unconstrained
    grammar: object | None = None

    def __post_init__(self) -> None:
        def bad(field_name: str, value: object, allowed: str) -> RequestValidationError:
            return RequestValidationError(f"{field_name}={short_repr(value)} is invalid; allowed: {allowed}")

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not (is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 = off)")
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            raise bad("top_p", self.top_p, "a number in (0, 1]")
        if not (is_real(self.min_p) and 0 <= self.min_p <= 1):
            raise bad("min_p", self.min_p, "a number in [0, 1]")
        if not (is_real(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            raise bad("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (is_real(v) and math.isfinite(v) and -2 <= v <= 2):
                raise bad(name, v, "a number in [-2, 2]")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < 2**63):
            raise bad("seed", self.seed, "an integer in [0, 2^63)")
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "an integer in [0, 20]")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "True or False")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise bad("speculative", self.speculative, "True, False or None (the engine's default)")
        if self.num_speculative_tokens is not None and not (
                is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 64):
            raise bad("num_speculative_tokens", self.num_speculative_tokens, "an integer in 1..64 or None")
        if self.grammar is not None and not (isinstance(getattr(self.grammar, "kind", None), str)
                                             and isinstance(getattr(self.grammar, "text", None), str)):
            raise bad("grammar", self.grammar, "None or an engine.agent.grammar.Constraint")
        if not (isinstance(self.stop, (tuple, list)) and all(isinstance(x, str) for x in self.stop)):
            raise bad("stop", self.stop, "a tuple of strings")
        if not (isinstance(self.stop_token_ids, (tuple, list))
                and all(is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise bad("stop_token_ids", self.stop_token_ids, "a tuple of integers >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SamplerState:
    """Per-request sampling state: its random generator and token counts for penalties."""

    config: SamplingConfig
    generator: torch.Generator = field(init=False)
    counts: dict[int, int] = field(default_factory=dict)  # generated-token counts
    prompt_tokens: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        seed = self.config.seed if self.config.seed is not None else torch.seed() % 2**63
        self.generator.manual_seed(seed)

    def accept(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1


def apply_penalties(logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    c = state.config
    if c.repetition_penalty != 1.0 and (state.counts or state.prompt_tokens):
        seen = torch.tensor(sorted(set(state.counts) | state.prompt_tokens), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / c.repetition_penalty, vals * c.repetition_penalty)
    if (c.presence_penalty or c.frequency_penalty) and state.counts:
        ids = torch.tensor(list(state.counts), dtype=torch.long)
        cnt = torch.tensor(list(state.counts.values()), dtype=logits.dtype)
        logits[ids] -= c.frequency_penalty * cnt + c.presence_penalty
    return logits


def distribution(logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    """logits [V] -> the probabilities [V] float32 that ``sample`` draws from: penalties,
    temperature, top-k, min-p, top-p, in that order. Greedy configs give a point mass on the
    argmax. Speculative decoding's rejection rule uses the same function. Runs on the CPU
    whatever device made the logits (one [V] copy per token), so a seed draws the same tokens
    on every device."""
    c = state.config
    logits = apply_penalties(logits.detach().to("cpu", torch.float32, copy=True), state)
    if c.greedy:
        out = torch.zeros_like(logits)
        out[int(torch.argmax(logits))] = 1.0
        return out
    logits = logits / c.temperature
    if c.top_k and c.top_k < logits.numel():
        kth = torch.topk(logits, c.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if c.min_p > 0:
        probs = probs.masked_fill(probs < c.min_p * probs.max(), 0.0)
    if c.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0)
        drop = (cum - sorted_p) >= c.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs / probs.sum()


def greedy_token(logits: torch.Tensor, state: SamplerState) -> int:
    """The argmax of ``distribution``'s point mass without building it: the first index of the
    largest penalised logit. Without penalties no copy is made, and the argmax of float32 CPU
    logits is numpy's (one pass; torch's argmax on a 32K-entry row cost ~60 us per token on 2
    cores, a parallel reduction's hand-off included, against ~10)."""
    c = state.config
    if c.repetition_penalty != 1.0 or c.presence_penalty or c.frequency_penalty:
        logits = apply_penalties(logits.detach().to("cpu", torch.float32, copy=True), state)
    elif logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.requires_grad:
        logits = logits.detach().to("cpu", torch.float32)  # a no-op .to still dispatches: skipped
    if logits.is_contiguous():
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


def sample(logits: torch.Tensor, state: SamplerState) -> int:
    """logits [V] float32 -> next token id."""
    if state.config.greedy:
        return greedy_token(logits, state)
    probs = distribution(logits, state)
    return int(torch.multinomial(probs, 1, generator=state.generator))


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> dict:
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = {"token": token, "logprob": float(lp[token])}
    if k:
        vals, ids = torch.topk(lp, k)
        out["top"] = [(int(i), float(v)) for i, v in zip(ids, vals)]
    return out
