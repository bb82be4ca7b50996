"""Grouped-query self-attention over a flat token batch with a KV cache.

Shapes: x [T, H]; q [n, Nh, D]; k, v [n, Nkv, D] per sequence; context K, V [ctx, Nkv, D].
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kv.base import BatchLayout, KVCache
from engine.layers.norm import RMSNorm
from engine.layers.rope import apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.nkv * self.d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.nkv * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.d, h, bias=False)
        self.q_norm = RMSNorm(self.d, self.eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, self.eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layout: BatchLayout, kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.nh, self.d)
        k = self.k_proj(x).view(t, self.nkv, self.d)
        v = self.v_proj(x).view(t, self.nkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = torch.empty(t, self.nh, self.d, dtype=x.dtype, device=x.device)
        for seq_id, start, n, ctx in zip(layout.seq_ids, layout.offsets, layout.query_lens,
                                         layout.context_lens):
            sl = slice(start, start + n)
            keys, values = kv.store_and_load(self.layer, seq_id, ctx, k[sl], v[sl])
            out[sl] = self._attend(q[sl], keys, values, ctx)
        return self.o_proj(out.view(t, self.nh * self.d))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int) -> torch.Tensor:
        return attend(q, keys, values, ctx, self.nkv)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int, nkv: int) -> torch.Tensor:
    """q [n, Nh, D] at positions [ctx, ctx+n); keys/values [ctx+n, Nkv, D] -> [n, Nh, D].

    The g = Nh/Nkv query heads sharing a KV head are stacked into one matmul against that
    head's keys ([Nkv, g*n, D] @ [Nkv, D, ctx+n]); no KV expansion, no copies of the cache.
    (torch's SDPA with enable_gqa took ~7 ms per decode call here on strided cache views.)
    The reference of the paged decode kernel (engine.layers.paged_attention_triton)."""
    n, nh, d = q.shape
    total = keys.shape[0]
    g = nh // nkv
    qh = q.view(n, nkv, g, d).permute(1, 2, 0, 3).reshape(nkv, g * n, d)
    kh = keys.transpose(0, 1).to(q.dtype)  # [Nkv, total, D]; a bf16 cache beside float32 queries read exactly
    vh = values.transpose(0, 1).to(q.dtype)
    scores = torch.matmul(qh, kh.transpose(1, 2)).float() * d ** -0.5  # [Nkv, g*n, total]
    if n > 1:
        # query i sits at absolute position ctx + i and may see keys 0 .. ctx + i
        ar = torch.arange(total, device=q.device)
        hidden = ar[None, :] > (ar[:n, None] + ctx)  # [n, total]
        scores = scores.view(nkv, g, n, total).masked_fill(hidden, float("-inf"))
        scores = scores.view(nkv, g * n, total)
    probs = torch.softmax(scores, dim=-1).to(vh.dtype)
    o = torch.matmul(probs, vh)  # [Nkv, g*n, D]
    return o.view(nkv, g, n, d).permute(2, 0, 1, 3).reshape(n, nh, d)
