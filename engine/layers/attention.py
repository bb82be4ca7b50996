"""Grouped-query self-attention over a flat token batch with a KV cache.

Shapes: x [T, H]; q [n, Nh, D]; k, v [n, Nkv, D] per sequence; context K, V [ctx, Nkv, D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
        out = torch.empty(t, self.nh, self.d, dtype=x.dtype)
        for seq_id, start, n, ctx in zip(layout.seq_ids, layout.offsets, layout.query_lens,
                                         layout.context_lens):
            sl = slice(start, start + n)
            keys, values = kv.store_and_load(self.layer, seq_id, ctx, k[sl], v[sl])
            out[sl] = self._attend(q[sl], keys, values, ctx)
        return self.o_proj(out.view(t, self.nh * self.d))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int) -> torch.Tensor:
        """q [n, Nh, D] at positions [ctx, ctx+n); keys/values [ctx+n, Nkv, D] -> [n, Nh, D]."""
        n, total = q.shape[0], keys.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Nh, n, D]
        kh = keys.transpose(0, 1).unsqueeze(0)  # [1, Nkv, total, D]
        vh = values.transpose(0, 1).unsqueeze(0)
        if n == 1:
            o = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
        elif ctx == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        else:
            # query i sits at absolute position ctx + i and may see keys 0 .. ctx + i
            mask = torch.arange(total)[None, :] <= (torch.arange(n)[:, None] + ctx)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
