"""Attention halves in the per-layer graphs (engine.cuda_graphs) through the CPU seam
(RecordedGraph), the paged decode kernel in Triton's interpreter: graphed decode against the
eager layers on a paged KV cache with small blocks, so sequences cross block boundaries and
their tables are scattered. The CUDA capture itself: tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import pytest
import torch

from engine import cuda_graphs as CG
from engine.executor import executor_for
from engine.kv.base import BatchLayout
from engine.kv.paged import PagedKVCache
from tests.engine.test_cuda_graphs import _load, float_options, needs_triton, store  # noqa: F401

PROMPTS = ([5, 17, 33], [8, 61, 12, 40, 3, 27, 9], [7, 7, 2, 50])  # 1, 2 and 1 full blocks of 4


def run_decode(model, kv, steps: int, graphs, drop_last_after: int | None = None):
    """Prefill each prompt alone, then ``steps`` batched greedy decode steps of all sequences
    (3 rows: bucket 4, one padding row), the last sequence leaving after ``drop_last_after``
    steps (2 rows: bucket 2). -> (per-step logits, tokens, the GraphSet or None)."""
    gs = CG.enable(model, graphs) if graphs else CG.disable(model)
    lens, last, logits = [], [], []
    for i, p in enumerate(PROMPTS):
        out = executor_for(model)(torch.tensor(p), BatchLayout.single(i, len(p), 0), kv)
        lens.append(len(p))
        last.append(int(out[0].argmax()))
    tokens = [list() for _ in PROMPTS]
    for step in range(steps):
        live = [0, 1] if drop_last_after is not None and step >= drop_last_after else [0, 1, 2]
        layout = BatchLayout(tuple(live), (1,) * len(live), tuple(lens[i] for i in live))
        out = executor_for(model)(torch.tensor([last[i] for i in live]), layout, kv)
        logits.append(out)
        for r, i in enumerate(live):
            lens[i] += 1
            last[i] = int(out[r].argmax())
            tokens[i].append(last[i])
    return logits, tokens, gs


def gathered(kv: PagedKVCache, seq: int, n: int) -> torch.Tensor:
    """Sequence ``seq``'s first n positions, every layer, keys and values: [L, 2, n, Nkv, D]."""
    ids = torch.tensor(kv.block_table(seq))
    s = kv.storage[:, :, ids]
    return s.reshape(s.shape[0], 2, -1, *s.shape[4:])[:, :, :n]


@needs_triton
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_graphed_decode_equals_eager_and_padding_writes_only_scratch(store, float_options, kv_dtype):  # noqa: F811
    check_attention_graphs(store, CG.RecordedGraph, "cpu", kv_dtype)


def check_attention_graphs(store, factory, device: str, kv_dtype: torch.dtype) -> None:  # noqa: F811
    """Eight decode steps (contexts 3..11, 7..15, 4..12 over blocks of 4: each sequence gains
    blocks at its own steps): the same logits and greedy tokens as eager; the graphs are captured
    once per bucket (replays read the new tables and lengths: frozen ones would attend over the
    first step's context); every sequence's KV equals eager's, the padding row wrote only the
    scratch block, and no block outside the sequences and the scratch was touched."""
    sm_e, sm_g = _load(store, slots=32, device=device), _load(store, slots=32, device=device)
    try:
        c = sm_e.model.config
        make = lambda: PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=24,  # noqa: E731
                                    block_size=4, dtype=kv_dtype, device=device)
        kv_e, kv_g = make(), make()
        ref_logits, ref_tokens, _ = run_decode(sm_e.model, kv_e, 8, None, drop_last_after=6)
        logits, tokens, gs = run_decode(sm_g.model, kv_g, 8, factory, drop_last_after=6)
        for got, want in zip(logits, ref_logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert tokens == ref_tokens
        layers = sm_g.model.model.layers
        assert [sorted(k[0] for k in l._layer_graphs.attn_entries) for l in layers] == [[2, 4]] * len(layers)
        attn_graphs = [sorted(e.graphs) for l in layers for e in l._layer_graphs.attn_entries.values()]
        assert attn_graphs == [["attention+route"]] * 2 * len(layers)  # buckets 4 and 2, once each
        for l in layers:  # the padding row's feed-forward input copies row 0: it routes like row 0
            e4 = l._layer_graphs.entries[(4, torch.float32)]
            assert torch.equal(e4.ids[3], e4.ids[0])
        assert gs.counters.capture_failures == 0
        assert gs.counters.attention_eager == len(PROMPTS) * len(layers)  # the prefills only

        owned = set()
        for i, p in enumerate(PROMPTS):
            n = len(p) + (8 if i < 2 else 6)
            torch.testing.assert_close(gathered(kv_g, i, n), gathered(kv_e, i, n), rtol=1e-4, atol=1e-4)
            owned |= set(kv_g.block_table(i))
        scratch = kv_g.scratch_block()
        assert scratch is not None and scratch not in owned
        assert bool(kv_g.storage[:, :, scratch].ne(0).any())  # the padding row's k/v went there
        assert len({tuple(kv_g.block_table(i)) for i in range(3)}) == 3
        assert any(b != a + 1 for i in range(3) for a, b in zip(kv_g.block_table(i), kv_g.block_table(i)[1:]))
        untouched = [b for b in range(kv_g.num_blocks) if b not in owned and b != scratch]
        assert untouched and not bool(kv_g.storage[:, :, untouched].ne(0).any())
    finally:
        sm_e.close()
        sm_g.close()


@needs_triton
def test_steps_that_are_not_pure_decode_run_attention_eager(store, float_options):  # noqa: F811
    """A prefill, a mixed step (one sequence's prompt beside another's decode token), a
    contiguous KV cache, and a decode step with attention graphs turned off run the eager
    attention (counted)."""
    from engine.kv.base import ContiguousKVCache

    sm = _load(store, slots=32)
    try:
        model, c = sm.model, sm.model.config
        gs = CG.enable(model, CG.RecordedGraph)
        kv = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=8, block_size=4,
                          dtype=torch.float32)
        executor_for(model)(torch.tensor(PROMPTS[0]), BatchLayout.single(0, 3, 0), kv)
        executor_for(model)(torch.tensor([4, 9, 8, 1, 2]), BatchLayout((0, 1), (1, 4), (3, 0)), kv)
        contiguous = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim)
        executor_for(model)(torch.tensor([3]), BatchLayout.single(5, 1, 0), contiguous)
        assert gs.counters.attention_eager == 3 * c.num_layers
        assert all(not l._layer_graphs.attn_entries for l in model.model.layers)
        assert kv._scratch is None  # eager steps take no scratch block
        gs = CG.enable(model, CG.RecordedGraph, attention=False)  # feed-forward graphs only
        executor_for(model)(torch.tensor([6, 2]), BatchLayout((0, 1), (1, 1), (4, 4)), kv)
        assert gs.counters.attention_eager == c.num_layers and gs.counters.captures > 0
    finally:
        sm.close()


@needs_triton
def test_a_failed_merged_capture_runs_that_layers_attention_eager(store, float_options):  # noqa: F811
    """The first layer's attention + route capture raises (an op CUDA cannot capture): logged and
    counted, that layer's attention runs eager from then on and its feed-forward half through
    its own route and experts graphs; every step still gives the eager logits."""

    class MergedCaptureFails(CG.RecordedGraph):
        made = 0

        def capture(self, fn):
            if "run_layer" in fn.__qualname__:  # a merged graph
                MergedCaptureFails.made += 1
                if MergedCaptureFails.made == 1:  # the first: layer 0's attention + route
                    raise RuntimeError("operation not permitted when stream is capturing")
            super().capture(fn)

    sm_e, sm_g = _load(store, slots=32), _load(store, slots=32)
    try:
        c = sm_e.model.config
        make = lambda: PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=24,  # noqa: E731
                                    block_size=4, dtype=torch.float32)
        ref_logits, ref_tokens, _ = run_decode(sm_e.model, make(), 3, None)
        logits, tokens, gs = run_decode(sm_g.model, make(), 3, MergedCaptureFails)
        for got, want in zip(logits, ref_logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert tokens == ref_tokens and gs.counters.capture_failures == 1
        first, second = (l._layer_graphs for l in sm_g.model.model.layers)
        assert [e.broken for e in first.attn_entries.values()] == [True]
        assert sorted(first.entries[(4, torch.float32)].graphs) == ["experts", "route"]
        assert [sorted(e.graphs) for e in second.attn_entries.values()] == [["attention+route"]]
    finally:
        sm_e.close()
        sm_g.close()
