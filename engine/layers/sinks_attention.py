"""Grouped-query attention with attention sinks and an optional sliding window (gpt-oss).

Shapes: x [T, H]; q [n, Nh, D]; k, v [n, Nkv, D] per sequence; context K, V [ctx, Nkv, D];
sinks [Nh] (one learned logit per query head).

Per head, the softmax runs over the visible keys *and* the head's sink logit, and the sink's
share is dropped: ``p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i))``, so a head may attend to
"nothing". A sliding-window layer lets query position p see keys p - window < j <= p
(transformers' ``sliding_window`` semantics); full layers see every earlier key. q, k, v and o
all carry biases.

KV cache: sliding-window layers keep their full KV like every other layer (the cache is one
[L, 2, ...] pool; correct and simple); attention reads only the last ``window`` keys of it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kv.base import BatchLayout, KVCache
from engine.layers.rope import apply_rotary


class SinkAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, layer: int,
                 window: int | None) -> None:
        super().__init__()
        self.layer, self.window = layer, window
        self.nh, self.nkv, self.d = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=True)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=True)
        self.sinks = nn.Parameter(torch.empty(num_heads))
        self.q_norm = self.k_norm = None  # none (the native step's Attn asks)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layout: BatchLayout, kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(t, self.nh, self.d), cos, sin)
        k = apply_rotary(self.k_proj(x).view(t, self.nkv, self.d), cos, sin)
        v = self.v_proj(x).view(t, self.nkv, self.d)
        out = torch.empty(t, self.nh, self.d, dtype=x.dtype, device=x.device)
        for seq_id, start, n, ctx in zip(layout.seq_ids, layout.offsets, layout.query_lens,
                                         layout.context_lens):
            sl = slice(start, start + n)
            keys, values = kv.store_and_load(self.layer, seq_id, ctx, k[sl], v[sl])
            out[sl] = attend_with_sinks(q[sl], keys, values, ctx, self.sinks, self.window)
        return self.o_proj(out.view(t, self.nh * self.d))


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int,
                      sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [n, Nh, D] at positions [ctx, ctx+n); keys/values [ctx+n, Nkv, D]; sinks [Nh]
    -> [n, Nh, D]. Scores and softmax in float32."""
    n, nh, d = q.shape
    nkv = keys.shape[1]
    g = nh // nkv
    first = 0
    if window is not None:
        first = max(0, ctx - window + 1)  # keys before this are outside every query's window
        keys, values = keys[first:], values[first:]
    total = keys.shape[0]
    qh = q.view(n, nkv, g, d).permute(1, 2, 0, 3).reshape(nkv, g * n, d)
    scores = torch.matmul(qh, keys.transpose(0, 1).transpose(1, 2)).float() * d ** -0.5
    scores = scores.view(nkv, g, n, total)
    pos_q = torch.arange(ctx, ctx + n, device=q.device)[:, None]  # [n, 1]
    pos_k = torch.arange(first, first + total, device=q.device)[None, :]  # [1, total]
    hidden = pos_k > pos_q
    if window is not None:
        hidden = hidden | (pos_k <= pos_q - window)
    scores = scores.masked_fill(hidden, float("-inf"))
    sink = sinks.float().view(nkv, g, 1, 1).expand(nkv, g, n, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(values.dtype)  # the sink's share dropped
    o = torch.matmul(probs.reshape(nkv, g * n, total), values.transpose(0, 1))  # [Nkv, g*n, D]
    return o.view(nkv, g, n, d).permute(2, 0, 1, 3).reshape(n, nh, d)
