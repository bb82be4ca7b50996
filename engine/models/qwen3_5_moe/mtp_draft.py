"""``--speculative mtp``: the MTP head (mtp.py) drafts for its own target.

Bookkeeping for one sequence (positions absolute; history = prompt + emitted tokens, the target's
KV holds history[:n], history[n] is fed by the next step):

    hidden[p]  the target's normed final hidden state at position p, copied from every target
               forward that writes p (CausalLM.tap_hidden); the latest write wins, so
               when p < n it is the one computed from the accepted token at p.
    slots      the head's cache holds slots [0, fed) computed from (history[p+1], hidden[p]);
               slot p needs the target at p, so fed <= n.

propose(history, k): feed slots fed..n-1 (one head forward, causal over the new slots) -> the
last row's logits give d_1 and its normed hidden g; draft i+1 feeds (d_i, g) at slot n+i-1, the
way llama.cpp's draft-mtp and vLLM chain one MTP head. Those draft slots are not counted in
``fed``: the next catch-up overwrites them (attention reads slots [0, start+len) only), so a
rejection needs no copy. Verification is the engine's (engine.speculative.accept_tokens), so the
output is lossless whatever the head proposes.
"""

from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.kv.base import BatchLayout
from engine.models.qwen3_5_moe.mtp import MTPHead, load_mtp_head
from engine.speculative import SpeculativeConfig, chain_drafts


class MTPDrafter:
    """Drafts with ``head`` for the sequence it is attached to (``attach(seq_id)``, called when
    the request is admitted, before its prefill, so every target row is seen)."""

    def __init__(self, head: MTPHead, max_draft: int = 8, sample_drafts: bool = True) -> None:
        self.head, self.max_draft, self.sample_drafts = head, max_draft, sample_drafts
        self.kv = head.new_cache()
        self.seq_id: int | None = None
        self.hidden: dict[int, torch.Tensor] = {}  # position -> [H] normed target hidden
        self.fed = 0
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # slot fed-1's (logits [V], g [1, H])
        self.missing = 0  # steps with no draft because a target hidden state was not seen

    # ---- the target's forwards ------------------------------------------------------------
    def attach(self, seq_id: int) -> None:
        self.seq_id = seq_id
        taps = self.head.target.__dict__.setdefault("hidden_taps", [])
        taps.append(self._tap)

    def _tap(self, x: torch.Tensor, layout: BatchLayout) -> None:
        """x [T, H]: every row of a target forward before its final norm."""
        for seq, start, n, ctx in zip(layout.seq_ids, layout.offsets, layout.query_lens, layout.context_lens):
            if seq != self.seq_id:
                continue
            with torch.inference_mode():
                h = self.head.target.model.norm(x[start:start + n].to(self.head.fc.weight.dtype))
            for i in range(n):
                self.hidden[ctx + i] = h[i].clone()

    # ---- the Drafter protocol -------------------------------------------------------------
    def begin(self, prompt_ids, ctx) -> None:
        if ctx.vocab_size != self.head.target.config.vocab_size:
            raise ConfigError("the MTP head belongs to another model than the target")
        if self.seq_id is None:  # used outside the engine: attach late (the prefill is lost)
            self.attach(ctx.seq_id)

    def propose(self, history, k, ctx):
        k = min(k, self.max_draft)
        n = len(history) - 1
        if k <= 0 or n < 1:
            return [], None
        if self.fed < n:  # catch up: slots fed..n-1, one head forward
            if any(p not in self.hidden for p in range(self.fed, n)):
                self.missing += 1
                return [], None
            new = range(self.fed, n)
            hid = torch.stack([self.hidden.pop(p) for p in new])
            for p in [p for p in self.hidden if p < self.fed]:  # recomputed after a preemption
                del self.hidden[p]
            toks = torch.tensor([history[p + 1] for p in new], dtype=torch.long)
            logits, g = self.head(toks, hid, BatchLayout.single(self.seq_id, len(new), self.fed), self.kv)
            self.fed, self._last = n, (logits[-1], g[-1:])
        elif self._last is None:
            return [], None
        # (fed == n: the step these drafts were for did not run, e.g. a preemption: same start)
        logits, g = self._last
        state = {"g": g}

        def advance(i: int, tok: int) -> torch.Tensor:  # slot n + i: (d_{i+1}, the head's own g)
            out, state["g"] = self.head(torch.tensor([tok]), state["g"], BatchLayout.single(self.seq_id, 1, n + i),
                                        self.kv)
            return out[-1]

        return chain_drafts(ctx, logits, k, self.sample_drafts, advance)

    def end(self) -> None:
        taps = self.head.target.__dict__.get("hidden_taps", [])
        if self._tap in taps:
            taps.remove(self._tap)
        if self.seq_id is not None:
            self.kv.free(self.seq_id)
        self.hidden, self.fed, self._last = {}, 0, None


def mtp_speculative_config(target, checkpoint, **kw) -> SpeculativeConfig:
    """The engine's SpeculativeConfig drafting with ``target``'s MTP head read from ``checkpoint``
    (an HF checkpoint directory or an open TensorSource); ``kw`` as SpeculativeConfig's."""
    from engine.loading import open_model_files

    source = checkpoint if hasattr(checkpoint, "names") else open_model_files(checkpoint).source
    head = load_mtp_head(target, source)
    return SpeculativeConfig("mtp", make_drafter=lambda t, k: MTPDrafter(head, max_draft=k), **kw)
