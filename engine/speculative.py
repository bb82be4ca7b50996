"""Lossless speculative decoding: a drafter proposes k tokens, one forward of the target model
over [last token, d_1 .. d_k] checks them all, the longest acceptable prefix is emitted plus one
token sampled by the target itself (a correction on rejection, a bonus when all k pass).

Lossless means the emitted token stream has exactly the distribution of plain decoding
(engine.generate.generate_ids):
- greedy: a draft is accepted iff it equals the target's argmax (after penalties), so the output
  is token-for-token identical to plain greedy decoding;
- sampling: the standard speculative rejection rule (Leviathan et al. 2023, Chen et al. 2023).
  With p the target's processed distribution at a position (penalties, temperature, top-k,
  min-p, top-p, exactly as engine.layers.sampler.sample) and q the drafter's, draft x is accepted
  with probability min(1, p(x) / q(x)); on rejection the token is drawn from
  normalize(max(0, p - q)). For deterministic drafters (n-gram lookup, greedy drafting) q is a
  point mass on x: accept with probability p(x), else draw from p with x removed.

KV bookkeeping (shapes: one sequence, positions are absolute):
    target KV holds positions [0, n) for history[:n]; history[n] (the last emitted token) is not
    in it yet. A verify forward writes positions [n, n+k+1) for [history[n], d_1..d_k]; with a
    accepted the valid prefix becomes n+a+1 and whatever lies beyond is stale. Stale entries are
    never read (attention loads K/V for [0, start+len) only) and the next forward overwrites them,
    so rejecting drafts needs no copy: we just resume from the accepted length.

Drafters:
    NgramDrafter       prompt lookup: copy what followed the latest earlier occurrence of the
                       trailing n-gram (no model, no bytes)
    DraftModelDrafter  a small model sharing the tokenizer, with its own KV cache kept in sync by
                       longest-common-prefix against the accepted history (rollback = truncation; a draft
                       model with recurrent state also restores its state checkpoint there)
    SelfSpecDrafter    the target model itself routed only to device-resident experts
                       (``ExpertCache.restrict_to_resident``): drafts move no expert bytes; its
                       draft positions are written into the shared KV cache and then overwritten
                       by the verify pass, which recomputes every one of them with the full model.

The draft length is adaptive; see :class:`DraftLengthController` for the rule.

Where it runs: inside the serving engine's step (engine.runner.Engine), for any batch of
sequences: each speculating request has its own drafter and controller
(:class:`SeqSpeculation`), its drafts ride in the step's one batched forward beside other
requests' prefill chunks and decode rows, and :func:`accept_tokens` is the one sampling rule for
every row (no drafts = plain sampling). So the CLI, the decode actor and the HTTP API all get it.

Greedy identity needs more than the rejection rule: a row's logits must not depend on what else
is in the step (how many rows of the same sequence, or of others, pass through an expert). The
native kernels guarantee that bit for bit (tests/engine/quant/test_batch_invariance.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from engine.errors import ConfigError
from engine.executor import executor_for, kv_dtype
from engine.kv.base import BatchLayout, ContiguousKVCache, KVCache
from engine.kv.state import StateSnapshot, restore_state, snapshot_state
from engine.layers.sampler import SamplerState, SamplingConfig, distribution, sample
from engine.models.base import CausalLM

__all__ = [
    "DraftContext", "DraftLengthController", "DraftModelDrafter", "Drafter", "NgramDrafter",
    "SelfSpecDrafter", "SeqSpeculation", "SpecStats", "SpeculativeConfig", "accept_tokens",
    "chain_drafts", "layer_skip_draft", "processed_probs",
]


# ---- the target's sampling distribution ---------------------------------------------------------

@dataclass
class _PenaltyView:
    """What apply_penalties reads from a SamplerState, with counts we may extend by drafts."""

    config: SamplingConfig
    counts: dict[int, int]
    prompt_tokens: set[int]


def _with_tokens(state, tokens: Sequence[int]) -> _PenaltyView:
    counts = dict(state.counts)
    for t in tokens:
        counts[t] = counts.get(t, 0) + 1
    return _PenaltyView(state.config, counts, state.prompt_tokens)


def processed_probs(logits: torch.Tensor, state) -> torch.Tensor:
    """logits [V] -> the distribution [V] that ``sample(logits, state)`` draws from (one
    implementation: engine.layers.sampler.distribution)."""
    return distribution(logits, state)


# ---- drafters ------------------------------------------------------------------------------------

@dataclass
class DraftContext:
    """What a drafter may use: the target's KV cache and sequence (self-speculation writes
    draft positions there), the request's sampler state (penalty counts, generator)."""

    kv: KVCache
    seq_id: int
    state: SamplerState
    vocab_size: int

    @property
    def greedy(self) -> bool:
        return self.state.config.greedy

    def choose(self, logits: torch.Tensor, drafts: Sequence[int],
               sample_drafts: bool = True) -> tuple[int, torch.Tensor | None]:
        """Pick the next draft token from a draft model's logits [V], with penalty counts as if
        ``drafts`` had been accepted: greedy request or ``sample_drafts=False`` -> (argmax of the
        processed logits, None: a point-mass q); else (x ~ q, q)."""
        view = _with_tokens(self.state, drafts)
        if self.greedy or not sample_drafts:
            greedy_view = _PenaltyView(dataclasses.replace(self.state.config, temperature=0.0),
                                       view.counts, view.prompt_tokens)
            return sample(logits, greedy_view), None  # type: ignore[arg-type]
        q = processed_probs(logits, view)
        return int(torch.multinomial(q, 1, generator=self.state.generator)), q


class Drafter(Protocol):
    def begin(self, prompt_ids: Sequence[int], ctx: DraftContext) -> None:
        """Called once after the target's prefill."""

    def propose(self, history: Sequence[int], k: int, ctx: DraftContext
                ) -> tuple[list[int], list[torch.Tensor] | None]:
        """history = prompt + every emitted token (the last one is not in the target's KV yet).
        Returns at most k draft tokens and, for sampled drafts, the distribution q [V] each was
        drawn from (None: every draft is a point mass)."""

    def end(self) -> None:
        """Free per-sequence state."""


class NgramDrafter:
    """Prompt-lookup drafting. For m = n, n-1, .., min_n: find the latest earlier occurrence of
    the trailing m-gram of history and propose the tokens that followed it, copying
    LZ77-style (the copy may run into the tokens it is producing, so a period shorter than
    k is extended periodically). No match for any m: no drafts (a plain step)."""

    def __init__(self, n: int = 3, max_draft: int = 8, min_n: int = 1) -> None:
        if not (1 <= min_n <= n):
            raise ConfigError(f"NgramDrafter needs 1 <= min_n <= n, got min_n={min_n}, n={n}")
        if max_draft < 1:
            raise ConfigError(f"max_draft must be >= 1, got {max_draft}")
        self.n, self.min_n, self.max_draft = n, min_n, max_draft
        self._index: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # n-grams ending at positions < _indexed are in the index

    def begin(self, prompt_ids, ctx) -> None:
        self._index = {m: {} for m in range(self.min_n, self.n + 1)}
        self._indexed = 0

    def _update(self, history: Sequence[int]) -> None:
        # index every m-gram ending before the last position: index[m][gram] = its end (exclusive),
        # the latest one wins. The trailing m-gram (ending at len) is never in the index.
        for end in range(max(self._indexed, 1), len(history)):
            for m, idx in self._index.items():
                if end >= m:
                    idx[tuple(history[end - m:end])] = end
        self._indexed = max(self._indexed, len(history))

    def propose(self, history, k, ctx):
        self._update(history)
        for m in range(self.n, self.min_n - 1, -1):
            if len(history) < m:
                continue
            end = self._index[m].get(tuple(history[len(history) - m:]))
            if end is None:
                continue
            seq = list(history)
            drafts = []
            for i in range(min(k, self.max_draft)):
                seq.append(seq[end + i])
                drafts.append(seq[-1])
            return drafts, None
        return [], None

    def end(self) -> None:
        self._index = {}


class DraftModelDrafter:
    """A separate (smaller) model sharing the tokenizer, on its own KV cache.

    Sync rule: ``fed`` lists the tokens whose K/V the draft cache holds. Before drafting, the
    longest common prefix of ``fed`` and the accepted history is kept (everything after it,
    i.e. rejected drafts, is stale and will be overwritten) and the rest of history is fed.
    A draft model with recurrent state (engine.kv.state) cannot truncate that: before each draft
    forward beyond the history its state is snapshotted, and a rollback restores the one at the
    common prefix (no snapshot there: its prefill again)."""

    def __init__(self, draft_model: CausalLM, max_draft: int = 8, seq_id: int = 0,
                 sample_drafts: bool = True) -> None:
        self.model, self.max_draft, self.seq_id = draft_model, max_draft, seq_id
        self.forward = executor_for(draft_model)  # the draft's steps
        self.sample_drafts = sample_drafts  # False: argmax drafts even when sampling
        cfg = draft_model.config
        self.kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=kv_dtype(draft_model))
        self.fed: list[int] = []
        self._snaps: dict[int, StateSnapshot] = {}  # position -> the draft's recurrent state there

    def begin(self, prompt_ids, ctx) -> None:
        if self.model.config.vocab_size != ctx.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({self.model.config.vocab_size}) differs "
                              f"from the target's ({ctx.vocab_size}); they must share a tokenizer")
        self.kv.free(self.seq_id)
        self.fed, self._snaps = [], {}
        self._catch_up(list(prompt_ids)[:-1])  # the draft's prefill; the last token comes later

    def _catch_up(self, history: list[int]) -> torch.Tensor | None:
        keep = 0
        for a, b in zip(self.fed, history):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(history) - 1) if history else 0  # feed >= 1 token to get logits
        if keep < len(self.fed):
            keep = self._rewind(keep)
        self._snaps = {}
        new = history[keep:]
        self.fed = self.fed[:keep]
        if not new:
            return None
        logits = self.forward(torch.tensor(new, dtype=torch.long),
                              BatchLayout.single(self.seq_id, len(new), keep), self.kv)[0]
        self.fed += new
        return logits

    def _rewind(self, pos: int) -> int:
        """Roll the draft's cache back to ``pos``; returns where it now stands: ``pos`` (KV is
        cut by position alone; recurrent state from its snapshot) or 0 (recurrent state with no
        snapshot at ``pos``: a prefill again)."""
        snap = self._snaps.get(pos)
        if snap is not None:
            restore_state(self.kv, self.seq_id, snap)
            return pos
        return pos if snapshot_state(self.kv, self.seq_id) is None else 0

    def propose(self, history, k, ctx):
        def advance(i: int, tok: int) -> torch.Tensor:
            snap = snapshot_state(self.kv, self.seq_id)  # None: no recurrent state
            if snap is not None:
                self._snaps[len(self.fed)] = snap
            logits = self.forward(torch.tensor([tok]), BatchLayout.single(self.seq_id, 1, len(self.fed)),
                                  self.kv)[0]
            self.fed.append(tok)
            return logits

        return chain_drafts(ctx, self._catch_up(list(history)), min(k, self.max_draft),
                            self.sample_drafts, advance)

    def end(self) -> None:
        self.kv.free(self.seq_id)
        self.fed, self._snaps = [], {}


def chain_drafts(ctx: DraftContext, logits: torch.Tensor, k: int, sample_drafts: bool,
                 advance: Callable[[int, int], torch.Tensor]) -> tuple[list[int], list[torch.Tensor] | None]:
    """k drafts, one at a time: draft i is chosen from ``logits`` [V] (ctx.choose), then, unless
    it is the last, ``advance(i, draft)`` feeds it to the drafter and returns the next logits."""
    drafts: list[int] = []
    qs: list[torch.Tensor] = []
    for i in range(k):
        tok, q = ctx.choose(logits, drafts, sample_drafts)
        drafts.append(tok)
        if q is not None:
            qs.append(q)
        if i + 1 < k:
            logits = advance(i, tok)
    return drafts, (qs if qs else None)


@contextlib.contextmanager
def _resident_only(cache):
    """Route to device-resident experts only (the cache starts no prefetch meanwhile), so a
    draft forward moves no bytes."""
    if cache is None:
        yield
        return
    cache.restrict_to_resident = True
    try:
        yield
    finally:
        cache.restrict_to_resident = False


class SelfSpecDrafter:
    """The target drafts for itself with routing restricted to device-resident experts.

    Draft i (0-based) runs the target on one token at position n+i of the *shared* KV cache
    (n = verified length), so positions [n, n+k) hold restricted-routing K/V after drafting;
    the verify forward then writes positions [n, n+k] with the full model, overwriting every one
    of them before anything reads them again. A target with recurrent state (engine.kv.state)
    cannot be overwritten that way: its state at n is snapshotted before drafting and restored
    after. ``cache`` may be None (all experts resident: the drafts equal the target's own
    tokens)."""

    def __init__(self, model: CausalLM, cache=None, max_draft: int = 8,
                 sample_drafts: bool = True) -> None:
        self.model, self.cache, self.max_draft = model, cache, max_draft
        self.forward = executor_for(model)  # the target's own executor: drafts run as its steps do
        self.sample_drafts = sample_drafts  # False: argmax drafts even when sampling

    def begin(self, prompt_ids, ctx) -> None:
        """Nothing to set up: drafts run on the target's own KV cache."""

    def propose(self, history, k, ctx):
        k = min(k, self.max_draft)
        n = len(history) - 1
        tok = history[-1]
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        snap = snapshot_state(ctx.kv, ctx.seq_id)  # None: no recurrent state to roll back
        try:
            with _resident_only(self.cache):
                for i in range(k):
                    logits = self.forward(torch.tensor([tok]), BatchLayout.single(ctx.seq_id, 1, n + i), ctx.kv)[0]
                    tok, q = ctx.choose(logits, drafts, self.sample_drafts)
                    drafts.append(tok)
                    if q is not None:
                        qs.append(q)
        finally:
            restore_state(ctx.kv, ctx.seq_id, snap)
        return drafts, (qs if qs else None)

    def end(self) -> None:
        """Nothing to free: the verify pass owns every position drafts wrote."""


def layer_skip_draft(model: CausalLM, num_layers: int) -> CausalLM:
    """A cheap draft model: the first ``num_layers`` decoder layers of ``model`` followed by its
    final norm and LM head. Shares every module (no copy, any dense format) and so the experts'
    provider."""
    cfg = model.config
    if not (1 <= num_layers <= cfg.num_layers):
        raise ConfigError(f"num_layers={num_layers}; allowed: 1..{cfg.num_layers}")
    decoder = copy.copy(model.model)  # shallow: the same embedding, layers and norm modules
    decoder._modules = dict(model.model._modules)
    decoder.layers = nn.ModuleList(list(model.model.layers)[:num_layers])
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft.model = decoder
    draft.config = dataclasses.replace(cfg, num_layers=num_layers)
    return draft.eval()


# ---- the draft-length controller ----------------------------------------------------------------

class DraftLengthController:
    r"""Chooses the draft length k of the next step to maximise emitted tokens per second.

    Expected tokens per step. Acceptance is modelled as i.i.d. per draft position with
    probability alpha, so a step with k drafts emits the accepted prefix plus one target token:

        E(k) = sum_{i=0..k} alpha^i = (1 - alpha^(k+1)) / (1 - alpha)          (k + 1 at alpha = 1)

    alpha is the maximum-likelihood estimate under that model with exponential forgetting:
    A <- lam*A + accepted, R <- lam*R + [a draft was rejected], alpha = (A + 1) / (A + R + 2).

    Cost of a step with k drafts, in seconds:

        C(k) = V(k) + k * c_d + s * X(k)

        V(k)  target compute seconds of a verify forward over k+1 tokens (wall time minus
              expert-load stall), an EMA per k; V(0) = c0 is a plain one-token step.
        X(k)  expert bytes that forward moves to the device (cache.metrics bytes_to_device),
              an EMA per k; X(0) is a plain step's. X(k) - X(0) is the extra bytes the drafts
              pull in: the union of the experts routed by k+1 tokens exceeds one token's, and
              every byte of it must cross to the device before the step can finish.
        c_d   drafting seconds per draft token (EMA).
        s     the price of one byte moved, seconds/byte: ``seconds_per_byte`` if given (e.g.
              1/25e9 for PCIe 4.0 x16), else measured as stall seconds / bytes moved.

    A k not yet observed is extrapolated from the nearest observed k' as
    V(k') + m_V * (k - k') (same for X with m_X), with m the slope between the smallest and
    largest observed k >= 1, or before two such k are seen the priors m_V = c0 / 16 (a verify
    token is cheap next to reading the weights) and m_X = X(0) / 4.

        k* = argmax_{k in [min_draft, max_draft]} E(k) / C(k)

    Plain steps (k = 0) measure c0 and X(0): the first decode step, every ``probe_every``-th
    step, and steps where the drafter proposed nothing. Every ``probe_every``-th step offset by
    half a period explores k* + 1. Without an expert cache X = 0. With ``fixed`` set, k = fixed
    always (no probes, for tests and ablations).
    """

    def __init__(self, max_draft: int = 8, min_draft: int = 1, fixed: int | None = None,
                 seconds_per_byte: float | None = None, probe_every: int = 16,
                 accept_decay: float = 0.9, ema: float = 0.3) -> None:
        if not (0 <= min_draft <= max_draft) or max_draft < 1:
            raise ConfigError(f"need 0 <= min_draft <= max_draft and max_draft >= 1; got "
                              f"min_draft={min_draft}, max_draft={max_draft}")
        if fixed is not None and not (0 <= fixed <= max_draft):
            raise ConfigError(f"fixed={fixed}; allowed: 0..max_draft={max_draft}")
        if probe_every < 0:
            raise ConfigError(f"probe_every={probe_every}; allowed: >= 0 (0 = never)")
        self.max_draft, self.min_draft, self.fixed = max_draft, min_draft, fixed
        self.seconds_per_byte = seconds_per_byte
        self.probe_every, self.lam, self.ema = probe_every, accept_decay, ema
        self.A = self.R = 0.0
        self.V: dict[int, float] = {}  # k -> verify compute seconds (EMA)
        self.X: dict[int, float] = {}  # k -> expert bytes moved by the verify forward (EMA)
        self.cd: float | None = None
        self.s_: float | None = seconds_per_byte
        self.steps = 0
        self._last = 1

    @property
    def alpha(self) -> float:
        return (self.A + 1.0) / (self.A + self.R + 2.0)

    @property
    def c0(self) -> float | None:
        return self.V.get(0)

    @property
    def s(self) -> float:
        return self.s_ or 0.0

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    @staticmethod
    def expected_tokens(alpha: float, k: int) -> float:
        return k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)

    @staticmethod
    def _estimate(table: dict[int, float], k: int, prior_slope: float) -> float:
        if k in table:
            return table[k]
        seen = sorted(j for j in table if j >= 1)
        slope = prior_slope
        if len(seen) >= 2:
            slope = max((table[seen[-1]] - table[seen[0]]) / (seen[-1] - seen[0]), 0.0)
        if not seen:
            return table.get(0, 0.0) + slope * k
        near = min(seen, key=lambda j: (abs(j - k), j))
        return max(table[near] + slope * (k - near), table.get(0, 0.0))

    def verify_seconds(self, k: int) -> float:
        return self._estimate(self.V, k, (self.c0 or 1e-3) / 16)

    def verify_bytes(self, k: int) -> float:
        return self._estimate(self.X, k, self.X.get(0, 0.0) / 4)

    def cost(self, k: int) -> float:
        return self.verify_seconds(k) + k * (self.cd or 0.0) + self.s * self.verify_bytes(k)

    def best(self) -> int:
        a = self.alpha
        return max(range(self.min_draft, self.max_draft + 1),
                   key=lambda k: self.expected_tokens(a, k) / self.cost(k))

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        p = self.probe_every
        if self.c0 is None or (p and self.steps % p == 0):
            return 0  # a plain step: measures c0 and X(0)
        k = self.best()
        if p and self.steps % p == p // 2:
            k = min(k + 1, self.max_draft)  # explore one longer
        return k

    def observe(self, k: int, accepted: int, t_draft: float, t_verify: float, stall: float,
                nbytes: int) -> None:
        """One step: k drafts verified (0: a plain step), ``accepted`` of them passed; the verify
        forward took ``t_verify`` seconds of which ``stall`` waiting for ``nbytes`` expert bytes."""
        self.steps += 1
        if self.seconds_per_byte is None and nbytes > 0 and stall > 0:
            self.s_ = self._avg(self.s_, stall / nbytes)
        self.V[k] = self._avg(self.V.get(k), max(t_verify - stall, 0.0))
        self.X[k] = self._avg(self.X.get(k), float(nbytes))
        if k == 0:
            return
        self.A = self.lam * self.A + accepted
        self.R = self.lam * self.R + (1.0 if accepted < k else 0.0)
        self.cd = self._avg(self.cd, t_draft / k)


# ---- per-sequence speculation inside the engine ----------------------------------------------------

SPEC_MODES = ("ngram", "self", "draft")


@dataclass
class SpeculativeConfig:
    """How an Engine drafts (engine.runner.Engine(speculative=...)).

    mode      "ngram" (prompt lookup), "self" (the target on its device-resident experts; needs
              ``cache``) or "draft" (``draft_model``, a smaller model sharing the tokenizer)
    max_draft the most draft tokens one step verifies (a request may ask for fewer)
    default   whether requests that do not say (``SamplingConfig.speculative`` None) speculate
    fixed     a fixed draft length instead of the adaptive controller (tests, ablations)
    make_drafter  (target, max_draft) -> Drafter: a drafter of one's own instead of ``mode``'s"""

    mode: str
    max_draft: int = 8
    default: bool = True
    draft_model: CausalLM | None = None
    cache: object | None = None  # engine.experts.cache.ExpertCache
    fixed: int | None = None
    seconds_per_byte: float | None = None
    make_drafter: Callable[[CausalLM, int], "Drafter"] | None = None

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES and self.make_drafter is None:
            raise ConfigError(f"speculative mode {self.mode!r}; allowed: {', '.join(SPEC_MODES)}")
        if not (isinstance(self.max_draft, int) and 1 <= self.max_draft <= 64):
            raise ConfigError(f"max_draft={self.max_draft!r}; allowed: an integer in 1..64")
        if self.make_drafter is not None:
            return
        if self.mode == "draft" and self.draft_model is None:
            raise ConfigError("speculative mode 'draft' needs a draft model")
        if self.mode == "self" and self.cache is None:
            raise ConfigError("speculative mode 'self' drafts on the device-resident experts: it "
                              "needs the target's expert cache (an expert store)")

    def check_target(self, target: CausalLM) -> None:
        if self.draft_model is not None and self.draft_model.config.vocab_size != target.config.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({self.draft_model.config.vocab_size}) "
                              f"differs from the target's ({target.config.vocab_size}); they must "
                              "share a tokenizer")

    def new_drafter(self, target: CausalLM, max_draft: int) -> "Drafter":
        if self.make_drafter is not None:
            return self.make_drafter(target, max_draft)
        if self.mode == "ngram":
            return NgramDrafter(n=3, max_draft=max_draft)
        if self.mode == "self":
            return SelfSpecDrafter(target, self.cache, max_draft=max_draft)
        return DraftModelDrafter(self.draft_model, max_draft=max_draft)


@dataclass
class SpecStats:
    """One request's speculation figures."""

    drafted: int = 0  # draft tokens proposed and verified
    accepted: int = 0  # of which the target accepted
    steps: int = 0  # verification forwards this request took part in after its prefill
    plain_steps: int = 0  # of which had no drafts
    draft_seconds: float = 0.0
    draft_expert_bytes: int = 0  # expert bytes that reached the device while drafting
    draft_expert_misses: int = 0  # cache misses of draft forwards (self-speculation)
    k_history: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class SeqSpeculation:
    """A request's drafter, draft-length controller and figures, owned by its engine.Sequence.

    Per engine step (engine.runner.Engine.step), for a decoding sequence whose target KV holds
    history[:n] (history[n], the last emitted token, is fed this step):
        propose(...)  k drafts (k from the controller, capped by max_tokens and the step's
                      token budget); the step feeds [history[n], d_1 .. d_k] at positions n..n+k
        accept_tokens the target's k+1 logit rows -> the accepted prefix + one target token
        observe(...)  the controller learns acceptance, draft and verify cost
    Rejected positions' K/V are stale and never read: the sequence's computed length is set
    back to n+1+accepted and the next forward overwrites them (no copy, no re-prefill)."""

    def __init__(self, config: SpeculativeConfig, target: CausalLM, kv: KVCache, seq_id: int,
                 state: SamplerState, max_draft: int | None = None) -> None:
        k = min(max_draft or config.max_draft, config.max_draft)
        self.drafter = config.new_drafter(target, k)
        self.controller = DraftLengthController(max_draft=k, fixed=None if config.fixed is None
                                                else min(config.fixed, k),
                                                seconds_per_byte=config.seconds_per_byte)
        self.ctx = DraftContext(kv, seq_id, state, target.config.vocab_size)
        attach = getattr(self.drafter, "attach", None)
        if attach is not None:  # a drafter reading the target's own forwards (MTP) sees its prefill
            attach(seq_id)
        self.cache = config.cache
        self.stats = SpecStats()
        self.started = False
        self.drafts: list[int] = []
        self.qs: list[torch.Tensor] | None = None
        self._t_draft = 0.0

    def draft_length(self, limit: int) -> int:
        """The controller's draft length for the next step, at most ``limit`` (>= 0)."""
        return max(0, min(self.controller.choose(), limit))

    def propose(self, history: list[int], k: int) -> list[int]:
        """Draft at most ``k`` tokens after ``history`` (its last token not yet in the target's
        KV); the target's KV must already have room for history + the drafts."""
        if not self.started:
            self.drafter.begin(history, self.ctx)
            self.started = True
        b0, _, m0 = cache_counters(self.cache)
        t0 = time.perf_counter()
        drafts, qs = self.drafter.propose(history, k, self.ctx) if k > 0 else ([], None)
        self._t_draft = time.perf_counter() - t0
        b1, _, m1 = cache_counters(self.cache)
        self.drafts, self.qs = list(drafts[:k]), (qs[:k] if qs is not None else None)
        st = self.stats
        st.draft_seconds += self._t_draft
        st.draft_expert_bytes += b1 - b0
        st.draft_expert_misses += m1 - m0
        return self.drafts

    def observe(self, accepted: int, t_verify: float, stall: float, nbytes: int) -> None:
        k = len(self.drafts)
        self.controller.observe(k, accepted, self._t_draft, t_verify, stall, nbytes)
        st = self.stats
        st.steps += 1
        st.plain_steps += k == 0
        st.drafted += k
        st.accepted += accepted
        st.k_history.append(k)
        self.drafts, self.qs, self._t_draft = [], None, 0.0

    def discard(self) -> None:
        """Forget drafts proposed for a step that did not run them (preemption)."""
        self.drafts, self.qs, self._t_draft = [], None, 0.0

    def end(self) -> None:
        self.drafter.end()


def cache_counters(cache) -> tuple[int, float, int]:
    """(bytes moved to the device, stall seconds, misses) so far, over all layers."""
    if cache is None:
        return 0, 0.0, 0
    layers = list(cache.metrics.layers.values())
    return (sum(m.bytes_to_device for m in layers), sum(m.stall_s for m in layers),
            sum(m.misses for m in layers))


def _residual(p: torch.Tensor, q: torch.Tensor | None, d: int) -> torch.Tensor:
    """Unnormalised distribution of the correction after draft d was rejected: max(0, p - q),
    with q a point mass on d for deterministic drafters (p with d removed)."""
    if q is None:
        r = p.clone()
        r[d] = 0.0
        return r
    return torch.clamp(p - q, min=0.0)


def accept_tokens(logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor] | None,
                  state: SamplerState) -> tuple[list[int], int]:
    """logits [k+1, V]: row i is the target's prediction after [last, d_1..d_i].
    Returns (tokens to emit in order, number of accepted drafts); ``state`` has accepted them.
    Row i is processed with the penalty counts of the tokens before it (all accepted so far).
    With no drafts this is plain sampling: one token drawn from logits[0] (the engine samples
    every sequence this way, so plain and speculative decoding share one rule)."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        row = logits[i]
        if state.config.greedy:
            t = sample(row, state)
            state.accept(t)
            out.append(t)
            if t != d:
                return out, i
            continue
        p = processed_probs(row, state)
        q = qs[i] if qs is not None else None
        u = float(torch.rand((), generator=state.generator))
        if q is None:  # point-mass draft: accept with probability min(1, p(d) / 1)
            ok = u < float(p[d])
        else:
            ok = u * float(q[d]) < float(p[d])
        if ok:
            state.accept(d)
            out.append(d)
            continue
        residual = _residual(p, q, d)
        total = float(residual.sum())
        # total > 0 whenever a rejection has positive probability; guard float round-off
        dist = residual / total if total > 0 else p
        t = int(torch.multinomial(dist, 1, generator=state.generator))
        state.accept(t)
        out.append(t)
        return out, i
    t = sample(logits[len(drafts)], state)  # the bonus token
    state.accept(t)
    out.append(t)
    return out, len(drafts)
