"""QSA (Qwen4-Exp's indexed sparse attention), the reference: dense selection, recomputed pools.

Shape legend:
    n  new tokens of one sequence (at positions ctx .. ctx+n-1)     L = ctx + n
    Hi indexer query heads, Di their dim (one index key head)       r compress ratio
    B  complete blocks of r tokens a query sees                     k = budget / r blocks kept

Per attention layer an indexer projects each token to Hi query heads and one raw index key
(``index_qk_proj``); the raw keys of every token are kept per sequence, positionally like K/V.
A query at position p sees the tokens 0..p: its B = (p + 1) // r complete blocks are the raw
keys mean-pooled over each block, RMS-normed (``k_layernorm``, (1 + w)) and rotated at the
block's first position; its query heads are RMS-normed (``q_layernorm``) and rotated at p. Each
block scores sum_h relu(q_h . k_b) / sqrt(Di); the query keeps the top min(k, B) blocks plus the
incomplete tail (tokens B r .. p) and attends only to those tokens. RoPE covers the first
rotary_dim dims of the index head (the attention's rotary width; the config checks it fits).

This file recomputes the pools for every step and builds a dense [n, L] mask; the paged path
(index keys beside K/V, pools kept incrementally, batched selection) is tested against it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers.centred_norm import CentredRMSNorm
from engine.layers.gated_attention import apply_partial_rotary


class QSAIndexer(nn.Module):
    """Parameter names are the checkpoint's (``self_attn.indexer.*``)."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int, budget: int, ratio: int, eps: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.budget, self.ratio = n_heads, head_dim, budget, ratio
        self.block_topk = budget // ratio
        self.index_qk_proj = nn.Linear(hidden, (n_heads + 1) * head_dim, bias=False)
        self.q_layernorm = CentredRMSNorm(head_dim, eps)
        self.k_layernorm = CentredRMSNorm(head_dim, eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], cos/sin [T, R] -> (queries [T, Hi, Di] normed and rotated, raw keys [T, Di])."""
        t = x.shape[0]
        q, keys = self.index_qk_proj(x).split([self.n_heads * self.head_dim, self.head_dim], dim=-1)
        q = self.q_layernorm(q.reshape(t, self.n_heads, self.head_dim))
        return apply_partial_rotary(q, cos, sin), keys

    def block_keys(self, raw_keys: torch.Tensor, cos_of, count: int) -> torch.Tensor:
        """The first ``count`` complete blocks' keys [count, Di] of raw keys [L, Di]; cos_of(positions)
        -> (cos, sin) [count, R] at the blocks' first positions."""
        r = self.ratio
        pooled = raw_keys[:count * r].float().view(count, r, self.head_dim).mean(dim=1).to(raw_keys.dtype)
        cos, sin = cos_of(torch.arange(count) * r)
        return apply_partial_rotary(self.k_layernorm(pooled)[:, None], cos, sin)[:, 0]

    def select(self, q: torch.Tensor, raw_keys: torch.Tensor, ctx: int, cos_of) -> torch.Tensor:
        """q [n, Hi, Di] of the queries at ctx.., raw_keys [L, Di] -> mask [n, L] bool: which tokens
        each query attends to (always within 0..its own position)."""
        n, total, r = q.shape[0], raw_keys.shape[0], self.ratio
        mask = torch.zeros(n, total, dtype=torch.bool, device=q.device)
        all_blocks = total // r
        keys = self.block_keys(raw_keys, cos_of, all_blocks) if all_blocks else None
        for i in range(n):
            seen = ctx + i + 1
            blocks = seen // r
            mask[i, blocks * r:seen] = True  # the incomplete tail
            if blocks == 0:
                continue
            if blocks <= self.block_topk:
                mask[i, :blocks * r] = True
                continue
            scores = (q[i].float() @ keys[:blocks].float().t()).t()  # [B, Hi]
            scores = torch.relu(scores).sum(dim=-1) / math.sqrt(self.head_dim)
            chosen = scores.topk(self.block_topk, dim=0).indices
            tokens = (chosen[:, None] * r + torch.arange(r, device=q.device)).flatten()
            mask[i, tokens] = True
        return mask


def attend_selected(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    nkv: int) -> torch.Tensor:
    """Attention of q [n, Nh, D] over keys/values [L, Nkv, D] restricted to mask [n, L] -> [n, Nh, D]
    (dense: every masked-out score is -inf; each row keeps at least its own token)."""
    n, nh, d = q.shape
    g = nh // nkv
    qh = q.view(n, nkv, g, d).permute(1, 2, 0, 3)  # [Nkv, g, n, D]
    scores = torch.matmul(qh, keys.transpose(0, 1)[:, None].transpose(-1, -2)).float() * d ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))  # [Nkv, g, n, L]
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    o = torch.matmul(probs, values.transpose(0, 1)[:, None])  # [Nkv, g, n, D]
    return o.permute(2, 0, 1, 3).reshape(n, nh, d)
