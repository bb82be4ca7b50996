"""The paged QSA path (engine.layers.qsa) against the engine's reference
(engine.models.qwen4_exp.qsa_reference: index keys per sequence, pools recomputed, a dense
mask) on random inputs with contexts far beyond the budget, several sequences sharing steps."""

from __future__ import annotations

import pytest
import torch

from engine.kv.base import BatchLayout
from engine.kv.paged import PagedKVCache
from engine.kv.qsa_index import QSASpec
from engine.layers.gated_attention import apply_partial_rotary
from engine.layers.qsa import pool_keys, qsa_attention
from engine.models.qwen4_exp.qsa_reference import QSAIndexer, attend_selected

H, NH, NKV, D, ROT, EPS = 40, 4, 2, 16, 8, 1e-6


def _rope(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROT, 2).float() / ROT))
    f = torch.outer(torch.arange(n).float(), inv)
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()


def _reference(ix: QSAIndexer, x, q, k, v, cos, sin) -> torch.Tensor:
    """One whole sequence through the reference: [S, Nh, D]."""
    s = x.shape[0]
    iq, raw = ix.project(x, cos[:s], sin[:s])
    mask = ix.select(iq, raw, 0, lambda p: (cos[p], sin[p]))
    return attend_selected(q, k, v, mask, NKV)


@pytest.mark.parametrize("heads,budget,ratio,block_size", [(2, 8, 4, 16), (4, 4, 2, 4), (2, 12, 3, 16),
                                                           (3, 16, 8, 4)])
@torch.no_grad()
def test_paged_qsa_matches_reference(heads, budget, ratio, block_size):
    torch.manual_seed(budget * 10 + ratio)
    ix = QSAIndexer(H, heads, 16, budget, ratio, EPS).eval()
    for p in ix.parameters():
        p.normal_(0.0, 0.3)
    cos, sin = _rope(256)
    n = {0: 70, 1: 45, 2: 90}
    xs = {s: torch.randn(m, H) for s, m in n.items()}
    qkv = {s: tuple(apply_partial_rotary(torch.randn(m, c, D), cos[:m], sin[:m]) if i < 2 else torch.randn(m, c, D)
                    for i, c in enumerate((NH, NKV, NKV))) for s, m in n.items()}
    kv = PagedKVCache(1, NKV, D, 64, block_size, torch.float32)
    spec = QSASpec(1, heads, 16, budget, ratio)

    def pool(mean, pos):
        return pool_keys(mean, pos, ix.k_layernorm.weight, EPS, lambda p: (cos[p], sin[p]), torch.float32)

    done = {s: 0 for s in n}
    got = {s: [] for s in n}
    plan = [{0: 17, 1: 9}, {0: 1, 1: 1, 2: 30}, {0: 6, 1: 1, 2: 1}, {0: 40, 1: 30, 2: 1}, {0: 6, 1: 4, 2: 58}]
    for step in plan:
        seqs = [s for s in step if done[s] < n[s]]
        lens = [min(step[s], n[s] - done[s]) for s in seqs]
        layout = BatchLayout(tuple(seqs), tuple(lens), tuple(done[s] for s in seqs))
        sl = [slice(done[s], done[s] + m) for s, m in zip(seqs, lens)]
        x = torch.cat([xs[s][c] for s, c in zip(seqs, sl)])
        q, k, v = (torch.cat([qkv[s][i][c] for s, c in zip(seqs, sl)]) for i in range(3))
        pos = layout.positions()
        iq, raw = ix.project(x, cos[pos], sin[pos])
        out = qsa_attention(kv, spec, 0, layout, q, k, v, iq, raw, pool, D ** -0.5)
        for s, start, m in zip(layout.seq_ids, layout.offsets, layout.query_lens):
            got[s].append(out[start:start + m])
            done[s] += m
    for s in n:
        assert done[s] == n[s]
        want = _reference(ix, xs[s], *qkv[s], cos, sin)
        torch.testing.assert_close(torch.cat(got[s]), want, atol=2e-5, rtol=0)
