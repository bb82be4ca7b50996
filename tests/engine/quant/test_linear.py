"""Dense linears swapped onto the quantized kernels: each against its reference on random inputs,
and whole models against their fp32 selves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.errors import ConfigError
from engine.executor import executor_for
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.quant.formats import QuantFormat
from engine.quant.linear import QuantLinear, dense_linears, quantize_dense
from engine.quant.reference import dequantize
from tests.engine.models.hf_tiny import make_checkpoint


@pytest.mark.parametrize("name", ["bf16", "int8"])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_quant_linear_equals_reference(name, t):
    g = torch.Generator().manual_seed(t)
    lin = nn.Linear(128, 72, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(72, 128, generator=g))
        lin.bias.copy_(torch.randn(72, generator=g))
    q = QuantLinear.from_linear(lin, QuantFormat(name, 64))
    x = torch.randn(t, 128, generator=g)
    from engine.quant.kernels import backend_for, int8_activations
    from engine.quant.reference import linear_ref_int8_act, takes_int8_activations

    i8a = backend_for(q.q) == "cpp" and int8_activations() and takes_int8_activations(q.q)
    want = (linear_ref_int8_act(x, q.q) if i8a else x @ dequantize(q.q).T) + lin.bias
    torch.testing.assert_close(q(x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_quantized_dense_model_tracks_fp32(tmp_path, arch):
    make_checkpoint(arch, tmp_path, hidden_size=64, intermediate_size=128, head_dim=16,
                    **({"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}
                       if arch == "qwen2_moe" else {}))
    files = open_model_files(tmp_path)
    cfg = files.config
    ref = build_model(cfg, files.source)
    prompt = torch.arange(3, 19)

    def logits(m):
        return executor_for(m)(prompt, BatchLayout.single(0, len(prompt), 0),
                               ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), all_logits=True)

    want = logits(ref)
    for name, tol in (("bf16", 0.02), ("int8", 0.05)):
        model = quantize_dense(build_model(cfg, files.source), name)
        swapped = [getattr(p, n) for p, n in dense_linears(model)]
        assert all(isinstance(m, QuantLinear) for m in swapped)
        err = float((logits(model) - want).abs().max() / want.abs().max())
        assert err < tol, (name, err)
        assert err > 0  # the weights really changed format


def test_unknown_dense_format_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="allowed: auto, fp32, bf16, int8"):
        quantize_dense(None, "fp8")


def test_lm_head_gets_its_own_format(tmp_path):
    make_checkpoint("llama", tmp_path, hidden_size=64, intermediate_size=128, head_dim=16, vocab=160)
    files = open_model_files(tmp_path)
    cfg = files.config
    prompt = torch.arange(3, 19)

    def logits(m):
        return executor_for(m)(prompt, BatchLayout.single(0, len(prompt), 0),
                               ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), all_logits=True)

    want = logits(build_model(cfg, files.source))
    model = quantize_dense(build_model(cfg, files.source), "int8", head="int4")
    assert model.lm_head.q.fmt == QuantFormat("int4", 64)
    assert model.model.layers[0].self_attn.q_proj.q.fmt == QuantFormat("int8", 64)
    err = float((logits(model) - want).abs().max() / want.abs().max())
    assert 0 < err < 0.15, err  # int4 head: ~4x the int8 error, still close
    keep = quantize_dense(build_model(cfg, files.source), "bf16", head="fp32")
    assert isinstance(keep.lm_head, nn.Linear) and isinstance(keep.model.layers[0].self_attn.o_proj, QuantLinear)
    with pytest.raises(ConfigError, match="LM head format 'int3'; allowed: fp32, bf16, int8, int4"):
        quantize_dense(build_model(cfg, files.source), "int8", head="int3")


def test_dense_weights_share_one_arena_in_reading_order(tmp_path):
    """quantize_dense copies every converted weight into one buffer (2 MiB pages where THP
    allows), in the order the model lists them: each weight's parts are views of that buffer,
    bit for bit what converting the weight alone gives, and the weights follow one another."""
    make_checkpoint("qwen2_moe", tmp_path, hidden_size=64, intermediate_size=128, head_dim=16,
                    moe_intermediate_size=32, shared_expert_intermediate_size=64)
    files = open_model_files(tmp_path)
    cfg = files.config
    alone = build_model(cfg, files.source)
    model = quantize_dense(build_model(cfg, files.source), "int8", head="int4")
    swapped = [getattr(p, n) for p, n in dense_linears(model)]
    originals = [getattr(p, n) for p, n in dense_linears(alone)]
    bases = {part.untyped_storage().data_ptr() for m in swapped for part in m.q.parts.values()}
    assert len(bases) == 1  # one buffer holds them all
    starts = [min(p.data_ptr() for p in m.q.parts.values()) for m in swapped]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)  # model order, no overlap
    for m, orig in zip(swapped, originals):
        fmt = m.q.fmt
        want = QuantLinear.from_linear(orig, fmt).q
        for name, part in m.q.parts.items():
            assert torch.equal(part, want.parts[name]), (fmt, name)
            assert part.data_ptr() % 64 == 0  # aligned as in a store's blob
    assert swapped[-1].q.fmt == QuantFormat("int4", 64)  # the head, last, in its own format


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="no transparent huge pages here")
def test_dense_arena_is_backed_by_huge_pages(tmp_path):
    """The arena holding the dense weights (here 8 MB: a vocab-16384 x 512 int8 head among them)
    gets 2 MiB pages, what the decode step streams every token."""
    from tests.engine.test_hugepages import huge_kib_at

    make_checkpoint("llama", tmp_path, hidden_size=512, intermediate_size=64, head_dim=64, vocab=16384,
                    num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2)
    files = open_model_files(tmp_path)
    model = quantize_dense(build_model(files.config, files.source), "int8")
    codes = model.lm_head.q.parts["codes"]
    assert codes.numel() >= 4 * 2**20
    assert huge_kib_at(codes.data_ptr() + codes.numel() // 2) >= 2048
