"""What load_from_store holds beyond the expert tiers (issue 27): the dense weights are converted
tensor by tensor from the store's own tensors (never a full-precision copy of the model), by
blocks of rows, and give the same model as the full-precision path."""

from __future__ import annotations

import pytest
import torch

from engine.quant.formats import QuantFormat
from engine.quant.reference import quantize, quantize_by_rows


@pytest.mark.parametrize("name,group", [("int8", 32), ("int4", 32), ("bf16", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_by_rows_is_quantize_bit_for_bit(name, group, dtype):
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(50, 128, generator=g) * 0.05).to(dtype)
    fmt = QuantFormat(name, group)
    whole, blocks = quantize(w.float(), fmt), quantize_by_rows(w, fmt, rows=7)
    assert blocks.shape == whole.shape and blocks.parts.keys() == whole.parts.keys()
    for k in whole.parts:
        assert torch.equal(blocks.parts[k], whole.parts[k]), k


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from engine.store import convert
    from tests.engine.models.hf_tiny import make_checkpoint

    d = tmp_path_factory.mktemp("footprint")
    make_checkpoint("qwen3_moe", d / "hf", seed=5, hidden_size=64, num_hidden_layers=2, head_dim=16,
                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), dense_dtype="bf16", progress=False)
    return d / "store"


def test_dense_weights_reach_the_quantizer_as_stored_not_in_float32(store, monkeypatch):
    """The quantizer sees the store's bf16 tensors themselves: a float32 copy of the model made
    before quantizing (the 1.4 GB peak of issue 27) would show up here as float32 weights."""
    from engine.experts.runtime import load_from_store, quantized_names
    from engine.quant import linear

    seen: list[torch.dtype] = []
    real = linear.QuantLinear.from_linear.__func__

    def spy(cls, lin, fmt):
        seen.append(lin.weight.dtype)
        return real(cls, lin, fmt)

    monkeypatch.setattr(linear.QuantLinear, "from_linear", classmethod(spy))
    with load_from_store(store, dense="int8", prefetch_depth=0) as sm:
        src = sm.store.dense_source(verify=False)
        names = quantized_names(src, "int8")
        src.close()
        assert len(seen) == len(names) > 0 and set(seen) == {torch.bfloat16}
        # after the load: no 2-D float weight is left but the embedding and the routers
        left = {n for n, p in sm.model.named_parameters() if p.dim() == 2}
        assert all("embed_tokens" in n or n.endswith("mlp.gate.weight") for n in left), left
    assert quantized_names(src, "fp32") == frozenset()


def test_the_as_stored_model_equals_the_full_precision_path(store):
    """Reference: the whole model built in float32, then quantized; the same logits."""
    from engine.executor import executor_for
    from engine.experts.runtime import load_from_store
    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.models.load import build_model
    from engine.quant.linear import quantize_dense

    ids = torch.tensor([3, 17, 5, 60, 2, 9])

    def logits(model):
        cfg = model.config
        kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        with torch.inference_mode():
            return executor_for(model)(ids, BatchLayout.single(0, len(ids), 0), kv)

    with load_from_store(store, dense="int8", prefetch_depth=0) as sm:
        fast = logits(sm.model)
        src = sm.store.dense_source()
        ref = quantize_dense(build_model(sm.model.config, src, provider=sm.cache), "int8")
        slow = logits(ref)
        src.close()
    assert torch.equal(fast, slow)
