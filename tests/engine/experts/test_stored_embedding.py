"""The embedding table of a bf16 store stays as the store holds it (file pages, rows converted as
looked up) whenever the dense linears are quantized: the same logits as a float32 copy of the
same table, the native step still taken, the budget's dense bytes without the table, and the
exact reference (dense fp32) and a tied fp32 head keeping the float copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.executor import executor_for
from engine.experts.runtime import dense_resident_bytes, load_from_store
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.layers.embedding import StoredEmbedding, compute_dtype
from engine.quant.formats import QuantFormat
from engine.quant.kernels import load_extension
from engine.step import NativeStep
from engine.store import ExpertStore, convert
from tests.engine.models.hf_tiny import make_checkpoint

PROMPT = [5, 17, 33, 8, 61, 12, 40, 3, 27, 90, 2, 44]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def store(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16store")
    make_checkpoint("qwen3_moe", d / "hf", hidden_size=64, num_hidden_layers=2, head_dim=16,
                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                    tie_word_embeddings=request.param)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), dense_dtype="bf16", progress=False)
    return d / "store"


def logits(sm) -> torch.Tensor:
    cfg = sm.model.config
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    with torch.no_grad():
        return executor_for(sm.model)(torch.tensor(PROMPT), BatchLayout.single(0, len(PROMPT), 0), kv,
                                      all_logits=True)


@pytest.mark.parametrize("dense", ["int8", "bf16"])
def test_stored_table_equals_a_float_copy_of_it(store, dense):
    with load_from_store(store, dense=dense, prefetch_depth=0) as sm:
        emb = sm.model.model.embed_tokens
        assert isinstance(emb, StoredEmbedding) and emb.weight.dtype == torch.bfloat16
        assert emb.rows is not None  # rows read by pread, not through the mapping
        assert compute_dtype(sm.model) == torch.float32
        if load_extension() is not None:  # the native step takes a bf16 table with fp32 compute
            assert NativeStep.for_model(sm.model) is not None
        got = logits(sm)
        copy = nn.Embedding.from_pretrained(emb.weight.detach().float(), freeze=True)
        sm.model.model.embed_tokens = copy  # the previous behaviour: a float32 copy
        want = logits(sm)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_the_budget_counts_the_table_only_where_it_is_a_copy(store):
    with ExpertStore(store) as s:
        table = s.config.vocab_size * s.config.hidden_size
        int8, fp32 = dense_resident_bytes(s, dense="int8"), dense_resident_bytes(s, dense="fp32")
        with load_from_store(s.path, dense="fp32", prefetch_depth=0) as ref:
            assert type(ref.model.model.embed_tokens) is nn.Embedding
            assert ref.model.model.embed_tokens.weight.dtype == torch.float32
            linears = sum(m.weight.numel() for m in ref.model.modules() if isinstance(m, nn.Linear)
                          and m is not ref.model.lm_head)
    # fp32: the float table is counted (4 bytes a weight); int8: not at all (file pages)
    assert fp32 >= 4 * table + 4 * linears
    assert int8 < fp32 - 4 * table


def test_a_tied_fp32_head_keeps_the_float_table(store):
    with load_from_store(store, dense="int8", head="fp32", prefetch_depth=0) as sm:
        tied = sm.model.config.tie_word_embeddings
        emb = sm.model.model.embed_tokens
        assert isinstance(emb, StoredEmbedding) != tied
        assert sm.model.lm_head.weight.dtype == torch.float32
        logits(sm)  # runs: no bf16 weight meets fp32 activations
