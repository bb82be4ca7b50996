"""The serving engine: many requests, one flat batch per step over a paged KV cache.

    step():  plan = scheduler.schedule()         # which sequences, how many tokens each
             drafts for speculating decode rows   # engine.speculative: k tokens per sequence
             logits = executor(tokens, layout, kv)  # one forward (engine.executor picks the
                                                     # path); MoE groups tokens by expert
             accept_tokens per sequence that finished its prefill or is decoding (no drafts:
             plain sampling; drafts: the accepted prefix + one target token)
             update sequences, stream text, retire the finished (their KV blocks freed)

This is the one decode loop: the CLI's in-process ``generate``, the decode actor (and through
it the Ray client and the HTTP API) and the benchmarks all run it; engine.generate.generate_ids
stays only as the single-sequence test oracle.

Each request samples with its own SamplerState, so a seeded request gives the same tokens
alone or inside any batch. Expert pins are taken and released inside each MoE layer during
the forward, so nothing is pinned between steps and an abort has only KV blocks to free.

Prefix caching (engine.kv.prefix, on unless the cache was built with prefix_cache=False): the
scheduler starts a new sequence on its longest cached prefix of full blocks; after each step
the engine names the blocks that committed tokens filled (``_name_blocks``), so later requests
(the next turn of a conversation) reuse them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence as Seq

import torch

from engine.errors import ConfigError, RequestValidationError
from engine.executor import executor_for, kv_dtype
from engine.generate import GenerationStats, Request, validate_prompt
from engine.kv.base import BatchLayout
from engine.kv.paged import KVMetrics, PagedKVCache
from engine.layers.sampler import SamplingConfig, top_logprobs
from engine.models.base import CausalLM
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerStats, StepPlan
from engine.sequence import FinishReason, Sequence
from engine.speculative import SeqSpeculation, SpeculativeConfig, SpecStats, accept_tokens, cache_counters


@dataclass
class RequestOutput:
    """What one step produced for one request (a streamed delta)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[dict] | None = None
    spec: SpecStats | None = None  # on the final output of a request that speculated
    cached_tokens: int = 0  # on the final output: prompt tokens reused from the prefix cache


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
    spec: SpecStats | None = None  # None: the request did not speculate
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not computed)


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
    draft_tokens: int = 0  # speculative drafts verified
    accepted_draft_tokens: int = 0
    prefix_query_tokens: int = 0  # tokens of admitted sequences looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, reused from cached blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class Engine:
    """Requests in (``add_request``), streamed deltas out (``step``). Not thread-safe: one
    caller drives it (the decode actor's loop); ``abort`` is called between steps."""

    def __init__(self, model: CausalLM, tokenizer=None, kv: PagedKVCache | None = None,
                 config: SchedulerConfig = SchedulerConfig(),
                 speculative: SpeculativeConfig | None = None, detokenize: bool = True) -> None:
        """``detokenize`` False: the tokenizer gives only its end-of-sequence ids and outputs
        carry no text (the decode actor: its router makes the text, services/text_stage.py)."""
        if kv is None:
            raise ConfigError("Engine needs a PagedKVCache (e.g. PagedKVCache.from_budget)")
        if speculative is not None:
            speculative.check_target(model)
        self.model, self.tokenizer, self.kv = model, tokenizer, kv
        self.executor = executor_for(model)  # how each step runs: native, CUDA graphs or torch
        self.speculative = speculative
        self.detokenize = detokenize and tokenizer is not None
        self.scheduler = Scheduler(config, kv)
        cfg = model.config
        self.eos_ids = frozenset(cfg.eos_token_ids) | frozenset(
            getattr(tokenizer, "eos_token_ids", ()) if tokenizer is not None else ())
        self._next_seq_id = 0
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._drafted = self._accepted = 0
        self._grammars = None  # engine.agent.grammar.GrammarBackend, built on first use

    @classmethod
    def for_requests(cls, model: CausalLM, tokenizer=None, tokens: int = 2048, seqs: int = 1,
                     speculative: SpeculativeConfig | None = None, max_batched_tokens: int = 512,
                     block_size: int = 16, prefix_cache: bool = True) -> "Engine":
        """An engine whose KV cache holds ``seqs`` sequences of ``tokens`` tokens (prompt +
        max_tokens) each, at the model's dtype: the in-process CLI, benchmarks and tests.
        ``prefix_cache``: reuse cached full blocks across requests (engine.kv.prefix)."""
        from engine.kv.state import kv_cache_from_budget, slot_bytes

        cfg = model.config
        dtype = kv_dtype(model)
        budget = seqs * (-(-tokens // block_size) + 1) * PagedKVCache.block_bytes(cfg, block_size, dtype)
        if cfg.linear_attn is not None:  # recurrent state gets at most half of a hybrid budget
            budget = 2 * (budget + seqs * slot_bytes(cfg))
        kv = kv_cache_from_budget(cfg, budget, block_size, dtype=dtype, max_seqs=seqs,
                                  device=model.model.embed_tokens.weight.device,
                                  prefix_cache=prefix_cache)
        return cls(model, tokenizer, kv, SchedulerConfig(max_num_batched_tokens=max_batched_tokens,
                                                         max_num_seqs=seqs), speculative)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Seq[int],
                    sampling: SamplingConfig = SamplingConfig()) -> None:
        """Queue a request. Raises RequestValidationError (bad prompt or parameters) or
        CapacityError (prompt + max_tokens can never fit in the KV cache); the engine is
        unaffected either way."""
        cfg = self.model.config
        validate_prompt(prompt_ids, cfg.vocab_size, sampling.max_tokens, cfg.max_position_embeddings)
        if sampling.stop and not self.detokenize:
            raise RequestValidationError("stop strings need an Engine that detokenizes (built with a "
                                         "tokenizer); the served path matches them in the router")
        spec = self.speculative
        wants = sampling.speculative if sampling.speculative is not None else (spec is not None and spec.default)
        if wants and spec is None:
            raise RequestValidationError("speculative=true: this engine has no drafter (start it with "
                                         "a speculative mode, e.g. `--speculative ngram`)")
        matcher = self._grammar_matcher(sampling.grammar) if sampling.grammar is not None else None
        wants = wants and matcher is None  # a constrained request is masked row by row: no drafts
        seq = Sequence(str(request_id), self._next_seq_id, list(prompt_ids), sampling)
        seq.grammar = matcher
        if wants:
            seq.spec = SeqSpeculation(spec, self.model, self.kv, seq.seq_id, seq.sampler,
                                      sampling.num_speculative_tokens)
        if self.detokenize:
            from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher

            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids=seq.prompt_ids)
            seq.stop_matcher = StopStringMatcher(sampling.stop)
        self.scheduler.add(seq)
        self._next_seq_id += 1
        self._prompt_tokens += len(seq.prompt_ids)

    def _grammar_matcher(self, constraint):
        """A fresh matcher for ``constraint`` (compiled once per distinct grammar)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestValidationError("structured output needs the model's tokenizer; this "
                                             "engine has none")
            from engine.agent.grammar import GrammarBackend

            self._grammars = GrammarBackend(self.tokenizer, self.model.config.vocab_size, sorted(self.eos_ids))
        return self._grammars.matcher(constraint)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request with reason "abort" and free its KV blocks; None if unknown."""
        seq = self.scheduler.abort(str(request_id))
        if seq is None:
            return None
        self._end_spec(seq)
        return RequestOutput(seq.request_id, [], "", True, "abort", spec=self._spec_stats(seq),
                             cached_tokens=seq.num_cached_tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over the scheduled batch; one output per request that sampled."""
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            if seq.spec is not None:
                seq.spec.discard()
        if not plan.entries:
            assert not self.has_unfinished(), "scheduler stalled with requests queued"
            return []
        plan = self._draft(plan)
        tokens, layout, rows = self._prepare(plan, self.model.model.embed_tokens.weight.device)
        cache = self.speculative.cache if self.speculative is not None else None
        b0, s0, _ = cache_counters(cache)
        t0 = time.perf_counter()
        # [R, V], R = the rows that sample (each sequence's last, plus its drafts' rows); the
        # samplers' generators are on the CPU
        logits = self.executor(tokens, layout, self.kv, rows=rows)
        if logits.device.type != "cpu":
            logits = logits.cpu()
        t_forward = time.perf_counter() - t0
        b1, s1, _ = cache_counters(cache)
        self.scheduler.commit(plan)
        self._mask(plan, logits)
        now = time.perf_counter()
        outputs, r = [], 0
        for seq, n, ctx in plan:
            spec = seq.spec
            drafts = spec.drafts if spec is not None else []
            rows_here = logits[r:r + 1 + len(drafts)]
            r += 1 + len(drafts)
            if seq.num_uncomputed_tokens + len(drafts) > 0:
                self._name_blocks(seq)
                continue  # a prefill chunk that does not end the prompt: nothing to sample
            tokens_out, accepted = accept_tokens(rows_here, drafts, spec.qs if spec else None, seq.sampler)
            if seq.grammar is not None:
                for t in tokens_out:
                    seq.grammar.accept_token(t)
            if drafts:
                # the K/V of rejected drafts is stale: resume after the last accepted one
                seq.num_computed_tokens = ctx + n - len(drafts) + accepted
                self.kv.keep(seq.seq_id, seq.num_computed_tokens)  # recurrent state rolls back too
                self._drafted += len(drafts)
                self._accepted += accepted
            # before _update can finish it (and free its blocks); accepted drafts are committed
            # but not yet in output_ids
            self._name_blocks(seq, tokens_out[:accepted])
            if spec is not None and spec.started and n - len(drafts) == 1:  # a decode row
                spec.observe(accepted, t_forward, s1 - s0, b1 - b0)
            outputs.append(self._update(seq, tokens_out, rows_here, now))
        return outputs

    def _name_blocks(self, seq: Sequence, pending: list[int] = ()) -> None:
        """Prefix caching: name the blocks the sequence's committed tokens now fill (accepted
        tokens only: ``num_computed_tokens`` is already rolled back past rejected drafts);
        ``pending``: accepted drafts, committed at the positions after ``all_ids``."""
        if not getattr(self.kv, "prefix_cache", False):
            return
        ids = seq.token_slice if not pending else (lambda s, n: seq.token_slice(s, n, pending))
        self.kv.register(seq.seq_id, seq.num_computed_tokens, ids)

    @staticmethod
    def _mask(plan: StepPlan, logits: torch.Tensor) -> None:
        """Grammar masks on the rows of constrained sequences that sample this step, in one
        batched call (engine.agent.grammar.apply_masks); no other row is touched. Constrained
        sequences never draft, so each has one row, its last."""
        rows, matchers, r = [], [], 0
        for seq, _, _ in plan:
            d = len(seq.spec.drafts) if seq.spec is not None else 0
            if seq.grammar is not None and seq.num_uncomputed_tokens == 0:
                rows.append(r)
                matchers.append(seq.grammar)
            r += 1 + d
        if rows:
            from engine.agent.grammar import apply_masks

            apply_masks(logits, rows, matchers)

    def _draft(self, plan: StepPlan) -> StepPlan:
        """Give each speculating decode row its drafts: the entry grows from 1 token to 1 + k,
        within the step's token budget, the request's max_tokens and the KV cache's free blocks."""
        budget = self.scheduler.config.max_num_batched_tokens - plan.num_tokens
        entries = list(plan.entries)
        for i, (seq, n, ctx) in enumerate(entries):
            spec = seq.spec
            if spec is None or n != 1 or seq.num_uncomputed_tokens != 1:
                continue  # not speculating, or not decoding (prefill chunks never draft)
            # k + 1 tokens can come out of a step: never draft past max_tokens
            k = spec.draft_length(min(seq.sampling.max_tokens - len(seq.output_ids) - 1, budget))
            if k > 0 and not self.kv.can_allocate(seq.seq_id, ctx + 1 + k):
                k = 0  # no room for drafts: a plain step
            if k > 0:
                self.kv.allocate(seq.seq_id, ctx + 1 + k)  # self-speculation writes there
            drafts = spec.propose(seq.all_ids, k)
            budget -= len(drafts)
            self.scheduler.stats.scheduled_tokens += len(drafts)
            entries[i] = ScheduledSeq(seq, 1 + len(drafts), ctx)
        return StepPlan(tuple(entries), plan.preempted)

    @staticmethod
    def _prepare(plan: StepPlan, device: torch.device) -> tuple[torch.Tensor, BatchLayout, list[int] | None]:
        ids: list[int] = []
        rows: list[int] = []
        speculating = False
        for seq, n, ctx in plan:
            d = len(seq.spec.drafts) if seq.spec is not None else 0
            ids += seq.token_slice(ctx, n - d) + (seq.spec.drafts if d else [])
            rows += range(len(ids) - 1 - d, len(ids))
            speculating |= d > 0
        layout = BatchLayout(tuple(e.seq.seq_id for e in plan), tuple(e.n_tokens for e in plan),
                             tuple(e.context_len for e in plan))
        # rows None: each sequence's last row (the common case, no index list to build)
        return torch.tensor(ids, dtype=torch.long, device=device), layout, (rows if speculating else None)

    def _update(self, seq: Sequence, tokens: list[int], logits: torch.Tensor, now: float) -> RequestOutput:
        """Emit ``tokens`` (logits row i produced token i) until a stop rule ends the request."""
        c = seq.sampling
        out = RequestOutput(seq.request_id, [])
        if c.logprobs is not None:
            out.logprobs = []
        reason: FinishReason | None = None
        for i, token in enumerate(tokens):  # not zip(tokens, logits): a view per row, unused without logprobs
            seq.append_token(token, now)
            self._generated_tokens += 1
            out.new_token_ids.append(token)
            if c.logprobs is not None:
                out.logprobs.append(top_logprobs(logits[i], token, c.logprobs))
            if token in c.stop_token_ids or (token in self.eos_ids and not c.ignore_eos):
                reason = "stop"  # the stop token's text is not streamed
            elif seq.detokenizer is not None:
                text, stopped = seq.stop_matcher.feed(seq.detokenizer.push(token))
                out.new_text += text
                reason = "stop" if stopped else None
            if reason is None and len(seq.output_ids) >= c.max_tokens:
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            if seq.detokenizer is not None and not seq.stop_matcher.stopped:
                text, stopped = seq.stop_matcher.feed(seq.detokenizer.flush())
                out.new_text += text if stopped else text + seq.stop_matcher.flush()
            self.scheduler.finish(seq, reason)
            self._end_spec(seq)
            out.finished, out.finish_reason = True, reason
            out.spec = self._spec_stats(seq)
            out.cached_tokens = seq.num_cached_tokens
        seq.text += out.new_text
        return out

    @staticmethod
    def _end_spec(seq: Sequence) -> None:
        if seq.spec is not None:
            seq.spec.end()

    @staticmethod
    def _spec_stats(seq: Sequence) -> SpecStats | None:
        return seq.spec.stats if seq.spec is not None else None

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
                              s.ttft, s.inter_token_latencies, s.num_preemptions, self._spec_stats(s),
                              s.num_cached_tokens)
                for s in seqs]

    def metrics(self) -> EngineMetrics:
        st: SchedulerStats = self.scheduler.stats
        return EngineMetrics(steps=st.steps, preemptions=st.preemptions,
                             prompt_tokens=self._prompt_tokens, computed_tokens=st.scheduled_tokens,
                             generated_tokens=self._generated_tokens,
                             recomputed_tokens=st.recomputed_tokens,
                             running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                             kv=self.kv.metrics(), draft_tokens=self._drafted,
                             accepted_draft_tokens=self._accepted,
                             prefix_query_tokens=st.prefix_query_tokens,
                             prefix_hit_tokens=st.prefix_hit_tokens)


def stream_request(model: CausalLM, prompt_ids: Seq[int], sampling: SamplingConfig, tokenizer=None,
                   speculative: SpeculativeConfig | None = None,
                   prefix_cache: bool = True) -> Iterator[tuple[RequestOutput, GenerationStats]]:
    """One request through a fresh Engine sized for it (the in-process CLI and the benchmarks):
    yields (output, figures so far) per step that produced tokens. The whole prompt is one
    prefill step; prefill time runs to the first token, decode time from it to the latest."""
    engine = Engine.for_requests(model, tokenizer, len(prompt_ids) + sampling.max_tokens,
                                 speculative=speculative, max_batched_tokens=max(512, len(prompt_ids)),
                                 prefix_cache=prefix_cache)
    engine.add_request("stream", prompt_ids, sampling)
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    t0 = time.perf_counter()
    t_first = None
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and t_first is None:
                t_first = now
                stats.prefill_seconds = now - t0
            stats.generated_tokens += len(out.new_token_ids)
            stats.decode_seconds = now - (t_first or now)
            yield out, stats
