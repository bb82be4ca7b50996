"""Qwen3-Next's gated attention: grouped-query attention whose q_proj also yields a per-head
gate (laid out per head beside the query: [q_h | gate_h] for each head h), q/k RMSNorm with
(1 + w) weights, RoPE on the first ``rotary_dim`` dims of each head only, and the attention
output multiplied by sigmoid(gate) before o_proj.

Shapes: x [T, H]; q_proj(x) [T, Nh * 2D] -> q, gate [T, Nh, D]; k, v [T, Nkv, D].
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kv.base import BatchLayout, KVCache
from engine.layers.attention import Attention
from engine.layers.centred_norm import CentredRMSNorm
from engine.layers.rope import apply_rotary


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, N, D]; cos/sin [T, R] with R <= D: rotate the first R dims, pass the rest."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)


class GatedAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, kv_layer: int) -> None:
        super().__init__(cfg, layer)
        h = cfg.hidden_size
        self.kv_layer = kv_layer  # index of this layer among the KV-cached ones
        self.q_proj = nn.Linear(h, self.nh * self.d * 2, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.d, h, bias=cfg.attention_bias)
        self.q_norm = CentredRMSNorm(self.d, self.eps)
        self.k_norm = CentredRMSNorm(self.d, self.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layout: BatchLayout, kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.nh, 2 * self.d).split(self.d, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.nkv, self.d))
        v = self.v_proj(x).view(t, self.nkv, self.d)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        out = torch.empty(t, self.nh, self.d, dtype=x.dtype, device=x.device)
        for seq_id, start, n, ctx in zip(layout.seq_ids, layout.offsets, layout.query_lens,
                                         layout.context_lens):
            sl = slice(start, start + n)
            keys, values = kv.store_and_load(self.kv_layer, seq_id, ctx, k[sl], v[sl])
            out[sl] = self._attend(q[sl], keys, values, ctx)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(t, self.nh * self.d))
