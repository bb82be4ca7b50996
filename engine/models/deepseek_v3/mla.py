"""Multi-head latent attention (DeepSeek-V2/V3), over a KV cache that holds only the latent.

Shape legend:
    T  tokens in this forward        n  new tokens of one sequence   ctx  tokens cached before
    Nh heads      R  kv_lora_rank     r  qk_rope_head_dim (decoupled RoPE key, shared by heads)
    dn qk_nope_head_dim               dv v_head_dim

    q        [T, Nh, dn + r]     from x (q_proj, or q_a_proj -> RMSNorm -> q_b_proj)
    latent   [T, R + r]          c = RMSNorm(kv_a(x)[:R]) and RoPE(kv_a(x)[R:]): what is cached
    kv_b     [Nh * (dn + dv), R] expands c into per-head k_nope [dn] and v [dv]

Cache layout: the latent row of a token (R + r values, zero-padded to 2 * half) is split in two
halves stored as a one-head "key" and "value" of width ``half`` (ModelConfig.num_kv_heads = 1,
head_dim = half), so every KV cache (contiguous, paged, FP8) holds MLA with no waste: R + r
values per token and layer (576 for DeepSeek-V3, against Nh * (dn + r + dv) = 40,960 for the
expanded keys and values).

Two forms of the same attention:
- expanded (the reference, transformers' computation): K = [kv_b(c)_k, k_rope], V = kv_b(c)_v
  for every context token, then ordinary attention;
- absorbed (decode): kv_b's key part folded into the query (q_lat = q_nope W_uk, [Nh, R]) and its
  value part applied after the weighted sum of latents, so the context is never expanded:
  per token O(Nh * R) instead of O(Nh * (dn + dv) * R) work per context position.
``mode`` "auto" uses absorbed for n <= ABSORB_MAX_N new tokens (decode), expanded otherwise;
tests compare the two on random inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv.base import BatchLayout, KVCache
from engine.layers.norm import RMSNorm
from engine.layers.rope import apply_rotary
from engine.quant.reference import dequantize

ABSORB_MAX_N = 4
MODES = ("auto", "expanded", "absorbed")


def latent_half(kv_lora_rank: int, rope_dim: int) -> int:
    """Width of each cached half: the latent row (R + r) padded to a multiple of 4, halved."""
    return -(-(kv_lora_rank + rope_dim) // 4) * 2


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's released layout), written out
    de-interleaved ([rotated evens, rotated odds]) as transformers does; x [T, N, r], cos/sin
    [T, r] (the r/2 frequencies repeated twice)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half].to(x.dtype), sin[:, None, :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 nope_dim: int, rope_dim: int, v_dim: int, bias: bool, scale: float,
                 interleave: bool, layer: int) -> None:
        super().__init__()
        self.layer, self.nh = layer, num_heads
        self.rank, self.nope, self.rope, self.vd = kv_lora_rank, nope_dim, rope_dim, v_dim
        self.half = latent_half(kv_lora_rank, rope_dim)
        self.scale, self.interleave = scale, interleave
        self.mode = "auto"
        qk = nope_dim + rope_dim
        if q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_dim, hidden, bias=bias)
        self._kvb: tuple[object, torch.Tensor] | None = None

    def linear_names(self) -> tuple[str, ...]:
        q = ("q_a_proj", "q_b_proj") if hasattr(self, "q_a_proj") else ("q_proj",)
        return (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layout: BatchLayout, kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_rot = q.view(t, self.nh, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        rot = apply_rotary_interleaved if self.interleave else apply_rotary
        q_rot, k_rot = rot(q_rot, cos, sin), rot(k_rot[:, None, :], cos, sin)[:, 0]
        latent = torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)  # [T, R + r]
        latent = F.pad(latent, (0, 2 * self.half - latent.shape[1])).view(t, 2, 1, self.half)
        out = torch.empty(t, self.nh, self.vd, dtype=x.dtype, device=x.device)
        for seq_id, start, n, ctx in zip(layout.seq_ids, layout.offsets, layout.query_lens,
                                         layout.context_lens):
            sl = slice(start, start + n)
            keys, values = kv.store_and_load(self.layer, seq_id, ctx, latent[sl, 0], latent[sl, 1])
            ctx_latent = torch.cat([keys[:, 0], values[:, 0]], dim=-1)[:, :self.rank + self.rope].to(x.dtype)
            absorbed = self.mode == "absorbed" or (self.mode == "auto" and n <= ABSORB_MAX_N)
            attend = self._attend_absorbed if absorbed else self._attend_expanded
            out[sl] = attend(q_nope[sl], q_rot[sl], ctx_latent, ctx)
        return self.o_proj(out.view(t, self.nh * self.vd))

    # ---- the two forms --------------------------------------------------------------------
    def _probs(self, scores: torch.Tensor, ctx: int) -> torch.Tensor:
        """scores [Nh, n, total] (float32, unscaled) -> causal softmax."""
        _, n, total = scores.shape
        if n > 1:
            ar = torch.arange(total, device=scores.device)
            scores = scores.masked_fill(ar[None, :] > (ar[:n, None] + ctx), float("-inf"))
        return torch.softmax(scores * self.scale, dim=-1)

    def _attend_expanded(self, q_nope, q_rot, ctx_latent, ctx):
        """The reference: expand every context latent into per-head keys and values."""
        c, k_rot = ctx_latent.split([self.rank, self.rope], dim=-1)
        kvx = self.kv_b_proj(c).view(-1, self.nh, self.nope + self.vd)
        k_nope, v = kvx.split([self.nope, self.vd], dim=-1)
        scores = (torch.einsum("nhd,thd->hnt", q_nope.float(), k_nope.float())
                  + torch.einsum("nhd,td->hnt", q_rot.float(), k_rot.float()))
        probs = self._probs(scores, ctx)
        return torch.einsum("hnt,thd->nhd", probs, v.float()).to(q_nope.dtype)

    def _attend_absorbed(self, q_nope, q_rot, ctx_latent, ctx):
        """kv_b folded into the query and the output: attention over the latents themselves."""
        c, k_rot = ctx_latent.float().split([self.rank, self.rope], dim=-1)
        w = self._kv_b_weight().view(self.nh, self.nope + self.vd, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]  # [Nh, dn, R], [Nh, dv, R]
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope.float(), w_uk)
        scores = torch.einsum("nhr,tr->hnt", q_lat, c) + torch.einsum("nhd,td->hnt", q_rot.float(), k_rot)
        o_lat = torch.einsum("hnt,tr->nhr", self._probs(scores, ctx), c)
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv).to(q_nope.dtype)

    def _kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight [Nh * (dn + dv), R] in float32 (dequantized once when
        engine.quant.linear swapped in a QuantLinear)."""
        m = self.kv_b_proj
        if isinstance(m, nn.Linear):
            return m.weight.float()
        if self._kvb is None or self._kvb[0] is not m:
            self._kvb = (m, dequantize(m.q).to(m.q.device))
        return self._kvb[1]
