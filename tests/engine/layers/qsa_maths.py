"""Test helpers for QSA: a direct per-query reference of the maths (written from transformers'
Qwen4ExpTextQSAIndexer / Qwen4ExpTextAttention: loops, a dense boolean mask per query) and a
glue that drives the paged path (engine.layers.qsa) with the projections of a transformers
Qwen4ExpTextAttention's own weights, so both can be compared with that module itself.

Shapes: S tokens of one sequence; x [S, H]; q, gate [S, Nh, D]; k, v [S, Nkv, D];
iq [S, Hi, Di]; raw index keys [S, Di]; cos/sin tables [P, R] (R rotary dims <= D, Di).
"""

from __future__ import annotations

import math

import torch
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextAttention, Qwen4ExpTextRotaryEmbedding

from engine.kv.base import BatchLayout, KVCache
from engine.kv.qsa_index import QSASpec
from engine.layers.gated_attention import apply_partial_rotary
from engine.layers.qsa import centred_norm, index_queries, pool_keys, qsa_attention


def tiny_config(budget: int = 8, ratio: int = 4, index_heads: int = 3, rotary: float = 0.5,
                **kw) -> Qwen4ExpTextConfig:
    args = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=4, indexer_n_heads=index_heads, indexer_kv_heads=1, indexer_head_dim=16,
                indexer_budget=budget, indexer_compress_ratio=ratio, moe_intermediate_size=8,
                shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2, hc_lowrank=8,
                vocab_size=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": rotary})
    args.update(kw)
    cfg = Qwen4ExpTextConfig(**args)
    cfg._attn_implementation = "eager"
    return cfg


def hf_attention(cfg: Qwen4ExpTextConfig, seed: int) -> Qwen4ExpTextAttention:
    """The transformers module with random weights (norm weights too: they are (1 + w))."""
    torch.manual_seed(seed)
    att = Qwen4ExpTextAttention(cfg, cfg.num_hidden_layers - 1).eval()
    with torch.no_grad():
        for p in att.parameters():
            p.normal_(0.0, 0.3)
    return att


def rope_tables(cfg: Qwen4ExpTextConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    rot = Qwen4ExpTextRotaryEmbedding(cfg)
    cos, sin = rot(torch.zeros(1, n, cfg.hidden_size), torch.arange(n)[None])
    return cos[0], sin[0]


@torch.no_grad()
def hf_forward(att: Qwen4ExpTextAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' module over one whole sequence x [S, H] (no cache) -> [S, H]."""
    s = x.shape[0]
    visible = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    causal = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)  # eager: additive
    out, _ = att(x[None], (cos[None, :s], sin[None, :s]), causal, cache=None)
    return out[0]


class Glue:
    """The projections of one transformers QSA attention, as the engine's hook computes them."""

    def __init__(self, att: Qwen4ExpTextAttention, cfg: Qwen4ExpTextConfig, cos: torch.Tensor,
                 sin: torch.Tensor, layer: int = 0, num_layers: int = 1) -> None:
        self.att, self.cos, self.sin, self.layer = att, cos, sin, layer
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hi, self.di, self.eps = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.rms_norm_eps
        self.spec = QSASpec(num_layers, self.hi, self.di, cfg.indexer_budget, cfg.indexer_compress_ratio)

    def project(self, x: torch.Tensor, pos: torch.Tensor):
        a, t = self.att, x.shape[0]
        q, gate = a.q_proj(x).view(t, self.nh, 2 * self.d).split(self.d, dim=-1)
        q = centred_norm(q, a.q_norm.weight, self.eps)
        k = centred_norm(a.k_proj(x).view(t, self.nkv, self.d), a.k_norm.weight, self.eps)
        v = a.v_proj(x).view(t, self.nkv, self.d)
        cos, sin = self.cos[pos], self.sin[pos]
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        qk = a.indexer.index_qk_proj(x)
        iq, ik = qk[:, :self.hi * self.di].view(t, self.hi, self.di), qk[:, self.hi * self.di:]
        iq = index_queries(iq, a.indexer.q_layernorm.weight, self.eps, cos, sin)
        return q, gate, k, v, iq, ik

    def pool(self, mean: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return pool_keys(mean, positions, self.att.indexer.k_layernorm.weight, self.eps,
                         lambda p: (self.cos[p], self.sin[p]), torch.float32)

    @torch.no_grad()
    def paged(self, kv: KVCache, layout: BatchLayout, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] rows of ``layout`` -> attention output [T, H] through the paged QSA path."""
        q, gate, k, v, iq, ik = self.project(x, layout.positions())
        out = qsa_attention(kv, self.spec, self.layer, layout, q, k, v, iq, ik, self.pool, self.d ** -0.5)
        out = out * torch.sigmoid(gate)
        return self.att.o_proj(out.reshape(x.shape[0], self.nh * self.d))

    @torch.no_grad()
    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """One whole sequence x [S, H] through :func:`reference_qsa` -> [S, H]."""
        s = x.shape[0]
        q, gate, k, v, iq, ik = self.project(x, torch.arange(s))
        a = self.att.indexer
        out = reference_qsa(q, k, v, iq, ik, a.k_layernorm.weight, self.eps, self.cos, self.sin,
                            self.spec.budget, self.spec.compress_ratio)
        return self.att.o_proj((out * torch.sigmoid(gate)).reshape(s, self.nh * self.d))


def reference_selection(iq: torch.Tensor, raw_keys: torch.Tensor, norm_w: torch.Tensor, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, budget: int, ratio: int) -> list[list[int]]:
    """Per query p: the token positions it attends, recomputing every pooled key per query (as
    the reference indexer does): mean over R raw keys, norm, RoPE at the block start, ReLU
    scores summed over heads / sqrt(Di), top budget/R blocks, plus the tail nb*R .. p."""
    s, _, di = iq.shape
    out = []
    for p in range(s):
        nb = (p + 1) // ratio
        chosen: list[int] = []
        if nb:
            groups = raw_keys[:nb * ratio].view(nb, ratio, di).float().mean(dim=1).to(raw_keys.dtype)
            pooled = centred_norm(groups, norm_w, eps)
            starts = torch.arange(nb) * ratio
            pooled = apply_partial_rotary(pooled[:, None], cos[starts], sin[starts])[:, 0]
            scores = torch.relu(iq[p].float() @ pooled.float().t()).sum(dim=0) / math.sqrt(di)
            blocks = scores.topk(min(budget // ratio, nb)).indices.tolist()
            chosen = [b * ratio + i for b in blocks for i in range(ratio)]
        out.append(sorted(chosen + list(range(nb * ratio, p + 1))))
    return out


def reference_qsa(q, k, v, iq, raw_keys, norm_w, eps, cos, sin, budget, ratio) -> torch.Tensor:
    """Dense attention per query under its selection mask: q [S, Nh, D] -> [S, Nh, D]."""
    s, nh, d = q.shape
    g = nh // k.shape[1]
    sel = reference_selection(iq, raw_keys, norm_w, eps, cos, sin, budget, ratio)
    out = torch.empty_like(q)
    for p in range(s):
        mask = torch.zeros(s, dtype=torch.bool)
        mask[sel[p]] = True
        for h in range(nh):
            sc = (k[:, h // g] @ q[p, h]) * d ** -0.5
            probs = torch.softmax(sc.masked_fill(~mask, float("-inf")), dim=0)
            out[p, h] = probs @ v[:, h // g]
    return out
