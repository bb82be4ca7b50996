"""The serving engine: many requests, one flat batch per step over a paged KV cache.

    step():  plan = scheduler.schedule()         # which sequences, how many tokens each
             logits = model(tokens, layout, kv)  # one forward; MoE groups tokens by expert
             sample each sequence that finished its prefill or is decoding
             update sequences, stream text, retire the finished (their KV blocks freed)

Each request samples with its own SamplerState, so a seeded request gives the same tokens
alone or inside any batch. Expert pins are taken and released inside each MoE layer during
the forward, so nothing is pinned between steps and an abort has only KV blocks to free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence as Seq

import torch

from engine.errors import ConfigError, RequestValidationError
from engine.generate import Request, validate_prompt
from engine.kv.base import BatchLayout
from engine.kv.paged import KVMetrics, PagedKVCache
from engine.layers.sampler import SamplingConfig, sample, top_logprobs
from engine.models.base import CausalLM
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats, StepPlan
from engine.sequence import FinishReason, Sequence


@dataclass
class RequestOutput:
    """What one step produced for one request (a streamed delta)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[dict] | None = None


@dataclass
class RequestResult:
    """A finished request, as ``Engine.generate`` returns it."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    ttft: float | None  # seconds from add_request to the first token
    inter_token_latencies: list[float]
    num_preemptions: int


@dataclass(frozen=True)
class EngineMetrics:
    steps: int
    preemptions: int
    prompt_tokens: int  # prompt tokens of admitted requests
    computed_tokens: int  # tokens fed through the model, recomputation included
    generated_tokens: int
    recomputed_tokens: int
    running: int
    waiting: int
    kv: KVMetrics


class Engine:
    """Requests in (``add_request``), streamed deltas out (``step``). Not thread-safe: one
    caller drives it (the decode actor's loop); ``abort`` is called between steps."""

    def __init__(self, model: CausalLM, tokenizer=None, kv: PagedKVCache | None = None,
                 config: SchedulerConfig = SchedulerConfig()) -> None:
        if kv is None:
            raise ConfigError("Engine needs a PagedKVCache (e.g. PagedKVCache.from_budget)")
        self.model, self.tokenizer, self.kv = model, tokenizer, kv
        self.scheduler = Scheduler(config, kv)
        cfg = model.config
        self.eos_ids = frozenset(cfg.eos_token_ids) | frozenset(
            getattr(tokenizer, "eos_token_ids", ()) if tokenizer is not None else ())
        self._next_seq_id = 0
        self._prompt_tokens = 0
        self._generated_tokens = 0

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Seq[int],
                    sampling: SamplingConfig = SamplingConfig()) -> None:
        """Queue a request. Raises RequestValidationError (bad prompt or parameters) or
        CapacityError (prompt + max_tokens can never fit in the KV cache); the engine is
        unaffected either way."""
        cfg = self.model.config
        validate_prompt(prompt_ids, cfg.vocab_size, sampling.max_tokens, cfg.max_position_embeddings)
        if sampling.stop and self.tokenizer is None:
            raise RequestValidationError("stop strings need an Engine built with a tokenizer")
        seq = Sequence(str(request_id), self._next_seq_id, list(prompt_ids), sampling)
        if self.tokenizer is not None:
            from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher

            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids=seq.prompt_ids)
            seq.stop_matcher = StopStringMatcher(sampling.stop)
        self.scheduler.add(seq)
        self._next_seq_id += 1
        self._prompt_tokens += len(seq.prompt_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request with reason "abort" and free its KV blocks; None if unknown."""
        seq = self.scheduler.abort(str(request_id))
        return None if seq is None else RequestOutput(seq.request_id, [], "", True, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over the scheduled batch; one output per request that sampled."""
        plan = self.scheduler.schedule()
        if not plan.entries:
            assert not self.has_unfinished(), "scheduler stalled with requests queued"
            return []
        tokens, layout = self._prepare(plan, self.model.model.embed_tokens.weight.device)
        logits = self.model(tokens, layout, self.kv).cpu()  # [S, V]; samplers' generators are CPU
        self.scheduler.commit(plan)
        now = time.perf_counter()
        outputs = []
        for row, (seq, _, _) in zip(logits, plan):
            if seq.num_uncomputed_tokens == 0:  # prefill done or decoding: sample
                token = sample(row, seq.sampler)
                outputs.append(self._update(seq, token, row, now))
        return outputs

    @staticmethod
    def _prepare(plan: StepPlan, device: torch.device) -> tuple[torch.Tensor, BatchLayout]:
        ids: list[int] = []
        for seq, n, ctx in plan:
            ids += seq.token_slice(ctx, n)
        layout = BatchLayout(tuple(e.seq.seq_id for e in plan), tuple(e.n_tokens for e in plan),
                             tuple(e.context_len for e in plan))
        return torch.tensor(ids, dtype=torch.long, device=device), layout

    def _update(self, seq: Sequence, token: int, logits: torch.Tensor, now: float) -> RequestOutput:
        seq.append_token(token, now)
        self._generated_tokens += 1
        c = seq.sampling
        out = RequestOutput(seq.request_id, [token])
        if c.logprobs is not None:
            out.logprobs = [top_logprobs(logits, token, c.logprobs)]
        reason: FinishReason | None = None
        if token in c.stop_token_ids or (token in self.eos_ids and not c.ignore_eos):
            reason = "stop"  # the stop token's text is not streamed
        elif seq.detokenizer is not None:
            out.new_text, stopped = seq.stop_matcher.feed(seq.detokenizer.push(token))
            reason = "stop" if stopped else None
        if reason is None and len(seq.output_ids) >= c.max_tokens:
            reason = "length"
        if reason is not None:
            if seq.detokenizer is not None and not seq.stop_matcher.stopped:
                text, stopped = seq.stop_matcher.feed(seq.detokenizer.flush())
                out.new_text += text if stopped else text + seq.stop_matcher.flush()
            self.scheduler.finish(seq, reason)
            out.finished, out.finish_reason = True, reason
        seq.text += out.new_text
        return out

    # ---- conveniences ----------------------------------------------------------------------
    def generate(self, requests: Iterable[Request | tuple[Seq[int], SamplingConfig]]) -> list[RequestResult]:
        """Run requests to completion together; results in the order given."""
        seqs: list[Sequence] = []
        try:
            for r in requests:
                prompt, sampling = (r.prompt_ids, r.sampling) if isinstance(r, Request) else r
                rid = f"generate-{self._next_seq_id}"
                self.add_request(rid, prompt, sampling)
                seqs.append(self.scheduler.get(rid))
        except Exception:  # a bad request: drop the ones already queued, nothing half-run
            for s in seqs:
                self.scheduler.abort(s.request_id)
            raise
        while any(not s.is_finished for s in seqs):
            self.step()
        return [RequestResult(s.request_id, s.prompt_ids, s.output_ids, s.text, s.finish_reason,
                              s.ttft, s.inter_token_latencies, s.num_preemptions) for s in seqs]

    def metrics(self) -> EngineMetrics:
        st: SchedulerStats = self.scheduler.stats
        return EngineMetrics(steps=st.steps, preemptions=st.preemptions,
                             prompt_tokens=self._prompt_tokens, computed_tokens=st.scheduled_tokens,
                             generated_tokens=self._generated_tokens,
                             recomputed_tokens=st.recomputed_tokens,
                             running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                             kv=self.kv.metrics())
