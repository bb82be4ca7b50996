"""Per-sequence state of a Qwen4-Exp beyond the DeltaNet layers' (engine.kv.state.RecurrentState):

    ple_conv   [P, S, S_hc H, W]  float32  each PLE layer's conv window (W = (K - 1) ngram_size)
    ngram      [S, N - 1]         int64    the sequence's last N - 1 token ids (eos before its start)
    index keys seq -> [La, L, Di]          the QSA indexer's raw key of every token, per attention
                                           layer; positional like K/V (a rollback needs nothing:
                                           positions beyond the context are rewritten before read)

(P PLE layers, S slots, S_hc streams of H.) The slot life cycle is RecurrentState's: zeroed (the
n-gram context eos-filled) when a sequence starts at position 0, freed with it; a speculative
verify forward keeps every position's PLE windows and n-gram context beside the DeltaNet
checkpoints, and ``keep`` restores all three; ``snapshot``/``restore`` copy all three.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.kv.base import BatchLayout
from engine.kv.state import MAX_CHECKPOINTS, RecurrentState, StateSnapshot


@dataclass(frozen=True)
class Qwen4ExpSnapshot(StateSnapshot):
    ple_conv: torch.Tensor | None = None  # [P, S_hc H, W]
    ngram: torch.Tensor | None = None  # [N - 1]


class Qwen4ExpState(RecurrentState):
    def __init__(self, cfg: ModelConfig, num_slots: int | None = None, device: torch.device | str = "cpu") -> None:
        a = cfg.arch_params
        self.num_ple = len(a.ple_layers)
        self.ple_shape = (a.hc_count * cfg.hidden_size, a.ple_conv_window)
        self.context_len = a.ngram_size - 1 if self.num_ple else 0
        self.eos = a.ple_eos
        self.ple_conv = self.ngram = torch.empty(0)
        self._index_keys: dict[int, torch.Tensor] = {}
        self._index_shape = (len(cfg.attention_layers), a.indexer_head_dim)
        # seq_id -> (ple conv [P, n, S_hc H, W], ngram [n, N-1]) after each position of a verify forward
        self._extra_checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        super().__init__(cfg, num_slots, device)

    def _alloc(self, n: int) -> None:
        super()._alloc(n)
        old_p, old_n = self.ple_conv, self.ngram
        self.ple_conv = torch.zeros(self.num_ple, n, *self.ple_shape, device=self.device)
        self.ngram = torch.full((n, self.context_len), self.eos, dtype=torch.long, device=self.device)
        if old_p.numel() or old_n.numel():
            self.ple_conv[:, :old_p.shape[1]] = old_p
            self.ngram[:old_n.shape[0]] = old_n

    def _reset(self, s: int) -> None:
        self.ple_conv[:, s].zero_()
        self.ngram[s].fill_(self.eos)

    def acquire(self, seq_id: int) -> int:
        new = seq_id not in self.slot
        s = super().acquire(seq_id)
        if new:
            self._reset(s)
        return s

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self._extra_checkpoints.pop(seq_id, None)
        self._index_keys.pop(seq_id, None)

    def begin(self, layout: BatchLayout, verify: frozenset[int] = frozenset()) -> None:
        super().begin(layout, verify)
        for seq_id, ctx, n in zip(layout.seq_ids, layout.context_lens, layout.query_lens):
            self._extra_checkpoints.pop(seq_id, None)
            if ctx == 0:
                self._reset(self.slot[seq_id])
            if seq_id in verify and n <= MAX_CHECKPOINTS:
                self._extra_checkpoints[seq_id] = (
                    torch.empty(self.num_ple, n, *self.ple_shape, device=self.device),
                    torch.empty(n, self.context_len, dtype=torch.long, device=self.device))

    # ---- what the layers read --------------------------------------------------------------
    def ple_window(self, ple_index: int, seq_id: int) -> torch.Tensor:
        return self.ple_conv[ple_index, self.slot[seq_id]]

    def ple_checkpoint(self, ple_index: int, seq_id: int) -> torch.Tensor | None:
        ck = self._extra_checkpoints.get(seq_id)
        return None if ck is None else ck[0][ple_index]

    def ngram_context(self, seq_id: int) -> torch.Tensor:
        return self.ngram[self.slot[seq_id]]

    def advance_ngram(self, seq_id: int, tokens: torch.Tensor) -> None:
        """Move the n-gram context past ``tokens`` (checkpointing each position of a verify row)."""
        k = self.context_len
        if not k:
            return
        ctx = self.ngram[self.slot[seq_id]]
        history = torch.cat((ctx, tokens.to(ctx.device).long()))
        ck = self._extra_checkpoints.get(seq_id)
        if ck is not None:
            for j in range(tokens.shape[0]):
                ck[1][j].copy_(history[j + 1:j + 1 + k])
        ctx.copy_(history[-k:])

    def index_keys(self, layer: int, seq_id: int, start: int, keys: torch.Tensor) -> torch.Tensor:
        """Write the raw index keys [n, Di] of positions start.. of one attention layer (its compact
        index); -> the keys of positions 0 .. start + n - 1 [start + n, Di]."""
        end = start + keys.shape[0]
        buf = self._index_keys.get(seq_id)
        if buf is None or buf.shape[1] < end or buf.dtype != keys.dtype:
            grown = torch.zeros(self._index_shape[0], max(end, 2 * (0 if buf is None else buf.shape[1]), 64),
                                self._index_shape[1], dtype=keys.dtype, device=keys.device)
            if buf is not None:
                grown[:, :buf.shape[1]] = buf.to(keys.dtype)
            self._index_keys[seq_id] = buf = grown
        buf[layer, start:end] = keys
        return buf[layer, :end]

    # ---- rollback --------------------------------------------------------------------------
    @torch.inference_mode()
    def keep(self, seq_id: int, n_tokens: int) -> None:
        ck = self._checkpoints.get(seq_id)
        extra = self._extra_checkpoints.get(seq_id)
        moved = self.tokens.get(seq_id) != n_tokens
        super().keep(seq_id, n_tokens)  # raises (checkpoints kept) when n_tokens cannot be kept
        self._extra_checkpoints.pop(seq_id, None)
        if moved and ck is not None and extra is not None:
            s, i = self.slot[seq_id], n_tokens - ck[0] - 1
            self.ple_conv[:, s].copy_(extra[0][:, i])
            self.ngram[s].copy_(extra[1][i])

    def snapshot(self, seq_id: int) -> Qwen4ExpSnapshot:
        base = super().snapshot(seq_id)
        s = self.slot[seq_id]
        return Qwen4ExpSnapshot(base.conv, base.matrix, base.tokens, self.ple_conv[:, s].clone(),
                                self.ngram[s].clone())

    @torch.inference_mode()
    def restore(self, seq_id: int, snap: StateSnapshot) -> None:
        super().restore(seq_id, snap)
        if isinstance(snap, Qwen4ExpSnapshot):
            s = self.slot[seq_id]
            self.ple_conv[:, s].copy_(snap.ple_conv)
            self.ngram[s].copy_(snap.ngram)
