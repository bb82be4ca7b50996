"""Qwen4-Exp's QSA over the paged KV cache: block selection batched over a step's rows, and
attention over the selected tokens gathered from the pages (no dense [T, S] mask).

The maths (transformers' Qwen4ExpTextQSAIndexer): the indexer projects each token to Hi query
heads and one key head of Di dims. Queries: per-head centred RMSNorm, RoPE at the token's
position. Keys are kept raw; the pooled key of block j (tokens jR .. jR+R-1) is the float32
mean of its raw keys, centred RMSNorm'd, then rotated at position jR. A query at position p
sees the nb = (p + 1) // R complete blocks (its own block too, once complete), scores each as
sum over heads of ReLU(q_h . k_j) / sqrt(Di), keeps the top min(budget / R, nb) and the
incomplete tail nb*R .. p, and the attention (Qwen3.5's gated attention, unchanged) runs over
those tokens only. Ties in the scores (ReLU zeros are common with few indexer heads) are
broken as the reference's torch.topk breaks them: the top-k runs over exactly the nb scores
a query sees, grouped by nb (torch.topk's order for ties depends on the length it is given).

Shapes: T rows; q [T, Nh, D]; k, v [T, Nkv, D]; index queries iq [T, Hi, Di]; raw index keys
[T, Di]; K_sel = budget + R - 1 tokens attended per row at most.

Costs per layer and row (a query at position p, nb = (p + 1) // R blocks): scoring nb * Hi * Di
multiply-adds against pooled keys read from the pages, a top-k of nb scores, then attention
over <= K_sel tokens (Nh * D * K_sel * 2) gathered by slot: O(nb + budget), not O(p) in D.
Pooling costs R * Di once per completed block (amortised Di per token).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from engine.kv.base import BatchLayout, KVCache
from engine.kv.qsa_index import QSAIndexStore, QSAPlan, QSASpec, paged_of, qsa_index_for
from engine.layers.centred_norm import _normalised
from engine.layers.gated_attention import apply_partial_rotary

GATHER_ELEMENTS = 1 << 24  # K/V elements gathered at once: rows are processed in chunks below this


def centred_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with (1 + w), computed in float32, returned in x's dtype."""
    return (_normalised(x, eps) * (1.0 + weight.float())).to(x.dtype)


def index_queries(iq: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Raw index queries [T, Hi, Di] -> normed and rotated (cos/sin [T, R] of each row's position)."""
    return apply_partial_rotary(centred_norm(iq, norm_weight, eps), cos, sin)


def pool_keys(mean: torch.Tensor, positions: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              cos_of: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Mean raw keys [m, Di] (float32) of blocks starting at ``positions`` [m]: cast to the
    model's dtype (as the reference does), normed, rotated at the block's first position
    (``cos_of(positions)`` -> cos, sin [m, R])."""
    x = centred_norm(mean.to(dtype), norm_weight, eps)
    cos, sin = cos_of(positions)
    return apply_partial_rotary(x[:, None, :], cos, sin)[:, 0]


def select_tokens(store: QSAIndexStore, layer: int, plan: QSAPlan,
                  iq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each row attends: positions [T, K] (long) and validity [T, K] (bool), K <=
    K_sel. Scores are one matmul per sequence (its rows against its pooled keys); the top-k,
    the block -> token expansion and the tail are batched over all rows."""
    spec, r = store.spec, store.spec.compress_ratio
    t = iq.shape[0]
    nb_max = plan.pool_blk.shape[1]
    scores = torch.full((t, nb_max), float("-inf"), device=iq.device)
    scale = 1.0 / math.sqrt(spec.index_head_dim)
    for s, (start, n, nb) in enumerate(plan.seq_rows):
        if nb == 0 or n == 0:
            continue
        keys = store.pooled_keys(layer, plan, s)  # [nb, Di]
        dots = torch.matmul(iq[start:start + n].float(), keys.t())  # [n, Hi, nb]
        scores[start:start + n, :nb] = torch.relu(dots).sum(dim=1) * scale
    k = min(spec.block_topk, nb_max)
    order = torch.zeros(t, k, dtype=torch.long, device=iq.device)  # [T, k] kept block ids
    kept = torch.zeros(t, k, dtype=torch.bool, device=iq.device)
    # one top-k per distinct visible-block count nb over exactly nb scores: the reference's
    # torch.topk on the same values, so even exact ties (ReLU zeros) pick the same blocks
    for nb, rows in plan.by_blocks:
        kk = min(k, nb)
        order[rows, :kk] = scores[rows, :nb].topk(kk, dim=1).indices
        kept[rows, :kk] = True
    span = torch.arange(r, device=iq.device)
    block_pos = (order[:, :, None] * r + span).reshape(t, k * r)
    block_ok = kept[:, :, None].expand(t, k, r).reshape(t, k * r)
    tail_pos = plan.row_blocks[:, None] * r + span[None, :r - 1]  # [T, R-1]
    tail_ok = tail_pos <= plan.row_pos[:, None]
    pos = torch.cat([block_pos, tail_pos], dim=1)
    ok = torch.cat([block_ok, tail_ok], dim=1)
    return pos.masked_fill(~ok, 0), ok


def attend_selected(kv_paged, layer: int, plan: QSAPlan, q: torch.Tensor, pos: torch.Tensor,
                    ok: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Nh, D] over the K/V of the selected positions [T, K] (gathered from the pages by
    slot, rows in chunks of at most GATHER_ELEMENTS K/V elements) -> [T, Nh, D]."""
    t, nh, d = q.shape
    nkv, bs = kv_paged.num_kv_heads, kv_paged.block_size
    g = nh // nkv
    blk = plan.tables[plan.row_seq[:, None], pos // bs]  # [T, K]
    off = pos % bs
    out = torch.empty_like(q)
    step = max(1, GATHER_ELEMENTS // max(1, pos.shape[1] * nkv * d))
    for a in range(0, t, step):
        b = min(t, a + step)
        keys, values = kv_paged.gather(layer, blk[a:b], off[a:b])  # [c, K, Nkv, D]
        qh = q[a:b].view(b - a, nkv, g, d)
        sc = torch.einsum("cngd,cknd->cngk", qh.float(), keys.float()) * scale
        sc = sc.masked_fill(~ok[a:b, None, None, :], float("-inf"))
        probs = torch.softmax(sc, dim=-1)
        o = torch.einsum("cngk,cknd->cngd", probs, values.float())
        out[a:b] = o.reshape(b - a, nh, d).to(q.dtype)
    return out


def qsa_attention(kv: KVCache, spec: QSASpec, layer: int, layout: BatchLayout, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor, index_keys: torch.Tensor,
                  pool, scale: float) -> torch.Tensor | None:
    """One QSA layer's attention core over a paged cache: write k/v [T, Nkv, D] and the raw
    index keys [T, Di], pool the blocks they complete (``pool``: see pool_keys), select per row
    with the index queries iq [T, Hi, Di] (normed, rotated), attend q [T, Nh, D] (normed,
    rotated) over the selection. ``layer``: the layer's compact KV index. None when ``kv`` is
    not paged (the caller runs the reference, engine.models.qwen4_exp.qsa_reference)."""
    paged = paged_of(kv)
    if paged is None:
        return None
    store = qsa_index_for(paged, spec)
    plan = store.plan(paged, layout)
    paged.write_at(layer, plan.write_blk, plan.write_off, k, v)
    store.write(layer, plan, index_keys, pool)
    pos, ok = select_tokens(store, layer, plan, iq)
    return attend_selected(paged, layer, plan, q, pos, ok, scale)
