"""QSA over the paged KV cache (engine.layers.qsa, engine.kv.qsa_index) against transformers'
Qwen4ExpTextAttention and a direct per-query reference of the maths, on contexts longer than
the indexer budget (selection really drops blocks): prefill chunks, decode rows, verify rows
with rollback, batched mixed steps, preemption (recompute) and abort."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.kv.base import BatchLayout
from engine.kv.paged import FP8, PagedKVCache
from engine.kv.qsa_index import QSASpec, qsa_index_for
from engine.layers.qsa import select_tokens
from tests.engine.layers.qsa_maths import (Glue, hf_attention, hf_forward, reference_selection, rope_tables,
                                          tiny_config)

ATOL = 2e-5


def _setup(seed=0, budget=8, ratio=4, n=64, **kw):
    cfg = tiny_config(budget=budget, ratio=ratio, **kw)
    att = hf_attention(cfg, seed)
    cos, sin = rope_tables(cfg, 256)
    torch.manual_seed(seed + 100)
    x = torch.randn(n, cfg.hidden_size)
    return cfg, att, Glue(att, cfg, cos, sin), x


def _cache(cfg, block_size, num_blocks=64, dtype=torch.float32):
    return PagedKVCache(1, cfg.num_key_value_heads, cfg.head_dim, num_blocks, block_size, dtype)


def _run_chunks(glue, kv, seq_id, x, chunks, start=0):
    """Feed x[start:] in chunks of the given sizes; returns the outputs, concatenated."""
    outs, pos = [], start
    for n in chunks:
        outs.append(glue.paged(kv, BatchLayout.single(seq_id, n, pos), x[pos:pos + n]))
        pos += n
    return torch.cat(outs)


def test_reference_matches_transformers_and_drops_blocks():
    cfg, att, glue, x = _setup(n=48)
    want = hf_forward(att, x, glue.cos, glue.sin)
    torch.testing.assert_close(glue.reference(x), want, atol=ATOL, rtol=0)
    q, gate, k, v, iq, ik = glue.project(x, torch.arange(48))
    sel = reference_selection(iq, ik, att.indexer.k_layernorm.weight, glue.eps, glue.cos, glue.sin, 8, 4)
    assert all(len(s) == p + 1 for p, s in enumerate(sel[:11]))  # budget not yet reached: all tokens
    assert all(len(s) < p + 1 for p, s in enumerate(sel) if p >= 12)  # beyond: blocks dropped
    assert len({tuple(s[:8]) for s in sel[20:]}) > 1  # selections differ between queries


@pytest.mark.parametrize("budget,ratio,block_size,rotary,chunks", [
    (8, 4, 16, 0.5, [13, 7, 1, 1, 9, 1, 16, 1, 1, 14]),
    (16, 8, 4, 1.0, [1] * 5 + [30, 3, 1, 1, 24]),  # compress ratio larger than the KV block
    (12, 4, 8, 0.5, [64]),  # one prefill chunk
    (6, 2, 2, 0.5, [5, 1, 1, 1, 40, 16]),
    (4, 1, 4, 0.5, [7, 1, 1, 55]),  # ratio 1: every token a block
    (12, 3, 16, 0.5, [2, 1, 20, 1, 1, 1, 38]),  # ratio dividing no block size
    (10, 5, 8, 0.5, [9, 1, 1, 1, 1, 51]),  # blocks straddling KV blocks
])
def test_paged_matches_transformers(budget, ratio, block_size, rotary, chunks):
    cfg, att, glue, x = _setup(seed=budget + ratio, budget=budget, ratio=ratio, rotary=rotary)
    got = _run_chunks(glue, _cache(cfg, block_size), 7, x, chunks)
    torch.testing.assert_close(got, hf_forward(att, x, glue.cos, glue.sin), atol=ATOL, rtol=0)
    torch.testing.assert_close(got, glue.reference(x), atol=ATOL, rtol=0)


def test_paged_selection_equals_reference_selection():
    cfg, att, glue, x = _setup(seed=3, budget=8, ratio=4, n=50)
    kv = _cache(cfg, 8)
    _run_chunks(glue, kv, 1, x, [30])
    layout = BatchLayout.single(1, 20, 30)  # re-run 30..49 and compare each row's selection
    q, gate, k, v, iq, ik = glue.project(x[30:], layout.positions())
    glue.paged(kv, layout, x[30:])
    store = qsa_index_for(kv, glue.spec)
    pos, ok = select_tokens(store, 0, store.plan(kv, layout), iq)
    _, _, _, _, iq_all, ik_all = glue.project(x, torch.arange(50))
    want = reference_selection(iq_all, ik_all, att.indexer.k_layernorm.weight, glue.eps, glue.cos, glue.sin, 8, 4)
    for row in range(20):
        assert sorted(pos[row][ok[row]].tolist()) == want[30 + row]


def test_mixed_step_prefill_decode_and_verify_rows_batched():
    """One step with a prefill chunk, decode rows and a verify row of 5, interleaved blocks."""
    cfg, att, glue, _ = _setup(seed=5, budget=8, ratio=4)
    torch.manual_seed(9)
    xs = {s: torch.randn(60, cfg.hidden_size) for s in (10, 11, 12, 13)}
    kv = _cache(cfg, 4, num_blocks=80)
    got = {s: [] for s in xs}
    # warm-up: sequences at different lengths, their blocks interleaved in the pool
    for s, n in ((10, 3), (11, 17), (12, 2), (13, 21), (10, 20), (12, 24)):
        ctx = sum(t.shape[0] for t in got[s])
        got[s].append(glue.paged(kv, BatchLayout.single(s, n, ctx), xs[s][ctx:ctx + n]))
    lens = {s: sum(t.shape[0] for t in got[s]) for s in xs}
    assert lens == {10: 23, 11: 17, 12: 26, 13: 21}
    q_lens = {10: 14, 11: 1, 12: 5, 13: 1}  # a chunk, a decode row, a verify row, a decode row
    layout = BatchLayout(tuple(xs), tuple(q_lens[s] for s in xs), tuple(lens[s] for s in xs))
    out = glue.paged(kv, layout, torch.cat([xs[s][lens[s]:lens[s] + q_lens[s]] for s in xs]))
    for s, start, n in zip(layout.seq_ids, layout.offsets, layout.query_lens):
        got[s].append(out[start:start + n])
    for s in xs:
        have = torch.cat(got[s])
        want = hf_forward(att, xs[s][:have.shape[0]], glue.cos, glue.sin)
        torch.testing.assert_close(have, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("accept", [0, 1, 3, 5])
def test_verify_rollback_recomputes_pooled_blocks(accept):
    """Verify rows [last, d1..d5] crossing a pooled-block boundary; drafts beyond ``accept`` are
    wrong. After keep, decoding the true tokens gives transformers' outputs: the index keys and
    the pooled block completed from rejected drafts are rewritten, nothing stale is read."""
    cfg, att, glue, x = _setup(seed=11, budget=8, ratio=4, n=40)
    kv = _cache(cfg, 8)
    torch.manual_seed(12)
    wrong = torch.randn(6, cfg.hidden_size)
    got = [_run_chunks(glue, kv, 4, x, [21])]  # positions 0..20
    rows = torch.cat([x[21:22 + accept], wrong[accept + 1:]])  # 6 rows: positions 21..26
    verify = glue.paged(kv, BatchLayout.single(4, 6, 21), rows)
    keep = 22 + accept  # the bonus token of the last accepted row comes next
    got.append(verify[:keep - 21])
    kv.keep(4, keep)
    got.append(_run_chunks(glue, kv, 4, x, [1, 1, 1, 40 - keep - 3], start=keep))
    torch.testing.assert_close(torch.cat(got), hf_forward(att, x, glue.cos, glue.sin), atol=ATOL, rtol=0)


def test_preemption_recompute_and_abort_reuse_blocks():
    cfg, att, glue, _ = _setup(seed=13, budget=8, ratio=4)
    torch.manual_seed(14)
    xa, xb, xc = (torch.randn(48, cfg.hidden_size) for _ in range(3))
    kv = _cache(cfg, 4, num_blocks=30)
    _run_chunks(glue, kv, 1, xa, [20, 1, 1])
    _run_chunks(glue, kv, 2, xb, [16])
    kv.free(1)  # preempted: its blocks go back to the pool (holding stale index keys)
    b_rest = _run_chunks(glue, kv, 2, xb, [12, 1], start=16)  # b takes some of a's old blocks
    a_again = _run_chunks(glue, kv, 1, xa, [9, 9, 9, 1, 1, 19])  # recompute from 0, other chunks
    torch.testing.assert_close(a_again, hf_forward(att, xa, glue.cos, glue.sin), atol=ATOL, rtol=0)
    kv.free(2)  # abort b mid-way
    c = _run_chunks(glue, kv, 3, xc, [30, 1, 1, 16])  # c reuses b's blocks
    torch.testing.assert_close(c, hf_forward(att, xc, glue.cos, glue.sin), atol=ATOL, rtol=0)
    torch.testing.assert_close(b_rest, hf_forward(att, xb[:29], glue.cos, glue.sin)[16:], atol=ATOL, rtol=0)


def test_fp8_kv_bounded_error():
    cfg, att, glue, x = _setup(seed=17, budget=8, ratio=4, n=40)
    got = _run_chunks(glue, _cache(cfg, 8, dtype=FP8), 1, x, [17, 1, 1, 21])
    want = hf_forward(att, x, glue.cos, glue.sin)
    assert float((got - want).norm() / want.norm()) < 0.08


def test_bf16_kv_keeps_a_bf16_index_close_to_fp32():
    cfg, att, glue, x = _setup(seed=23, budget=8, ratio=4, n=40)
    kv = _cache(cfg, 8, dtype=torch.bfloat16)
    got = _run_chunks(glue, kv, 1, x, [17, 1, 1, 21])
    store = qsa_index_for(kv, glue.spec)
    assert store.keys.dtype == store.pooled.dtype == torch.bfloat16
    assert store.nbytes == (store.keys.numel() + store.pooled.numel()) * 2
    want = hf_forward(att, x, glue.cos, glue.sin)
    assert float((got - want).norm() / want.norm()) < 0.05


def test_pooled_keys_kept_incrementally():
    """After a step, the stored pooled keys equal a from-scratch pooling of the stored raw keys,
    and a decode step pools only the block its token completes."""
    cfg, att, glue, x = _setup(seed=19, budget=8, ratio=4, n=40)
    kv = _cache(cfg, 16)
    _run_chunks(glue, kv, 1, x, [22])
    store = qsa_index_for(kv, glue.spec)
    calls = []
    orig = glue.pool
    glue.pool = lambda mean, pos: (calls.append(pos.tolist()), orig(mean, pos))[1]
    _run_chunks(glue, kv, 1, x, [1, 1], start=22)  # positions 22, 23: block 5 completes at 23
    assert calls == [[20]]
    plan = store.plan(kv, BatchLayout.single(1, 1, 23))
    raw = store.raw_keys(0, plan, 0, 24)
    fresh = orig(raw.view(6, 4, -1).mean(dim=1), torch.arange(6) * 4)
    torch.testing.assert_close(store.pooled_keys(0, plan, 0), fresh, atol=1e-6, rtol=0)


def test_bad_qsa_configs_raise_config_error():
    with pytest.raises(ConfigError, match="not divisible"):
        QSASpec(1, 2, 16, 10, 4)
    with pytest.raises(ConfigError, match="index_heads"):
        QSASpec(1, 0, 16, 8, 4)
    kv = PagedKVCache(1, 2, 16, 8, 8, torch.float32)
    qsa_index_for(kv, QSASpec(1, 2, 16, 8, 4))
    with pytest.raises(ConfigError, match="already holds"):
        qsa_index_for(kv, QSASpec(1, 2, 16, 16, 4))
    with pytest.raises(ConfigError, match="KV cache holds 1"):
        qsa_index_for(PagedKVCache(1, 2, 16, 8, 8, torch.float32), QSASpec(2, 2, 16, 8, 4))
