"""Qwen4-Exp from GGUF: tiny random Qwen4ExpForConditionalGeneration checkpoints (hyper-connections,
QSA, one PLE layer; tests/engine/models/qwen4_exp_tiny.py) converted by llama.cpp's own converter
(arch ``qwen4exp``; the ``converter`` fixture, conftest.py) load in moestream with every tensor
equal to the checkpoint's, logits equal to transformers' over 150 positions (QSA dropping
blocks), greedy tokens equal to transformers' and to llama.cpp's on the same file; a file
missing a PLE tensor, or holding one of the wrong shape, is one ModelFormatError each.

The shapes are what llama.cpp's qwen4exp graph can run: DeltaNet key and value heads of one
width, the PLE embedding as wide as the hidden state, one PLE layer, the sigmoid output gate
(its graph has no other; the reference's default is silu). Tokenizer: SmolLM2's, as in
test_qwen3_5_moe_gguf.py.

llama.cpp's QSA (llama-cpp-python 0.3.36) keeps a fixed budget + ratio - 1 tokens: the
incomplete tail first, then whole blocks by score, and the rest of the width from the next
block; the reference keeps budget / ratio whole blocks and the tail only. The two agree
when the tail holds ratio - 1 tokens, or with ratio 1; test_llama_cpp_qsa_differs_by_its_width
pins that down, the token test runs ratio 1 (selection still drops tokens)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import ModelFormatError
from engine.generate import generate_ids
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.models.qwen4_exp.gguf import config_from_gguf
from tests.engine.loading.converted import (all_logits, assert_generate_equal, assert_matches_transformers,
                                            converter_module, llama_cpp_greedy, llama_cpp_scores,
                                            rewrite_gguf)
from tests.engine.models.qwen4_exp_tiny import make_qwen4_exp

pytestmark = pytest.mark.slow  # llama.cpp's own converter end to end: `pytest -m slow`

# llama.cpp-compatible tiny shapes (module doc). qsa_r4: 1 PLE layer (layer 2), hc 2, ngram 3,
# budget 8 of blocks of 4; r1_ple: hc 4, ngram 2, budget 6 of single tokens, 8 index heads: with
# the default 2, a block score (a sum of ReLUs) is often exactly 0, and a tie of zeros at the
# budget's cut is broken one way by torch.topk and another by ggml_top_k (seen: 2 positions of 40).
SHAPES = {
    "qsa_r4": dict(ple_layer_ids=[2], ple_embed_dim=32),
    "r1_ple": dict(hc_count=4, ple_layer_ids=[3], ngram_size=2, heads_per_ngram=4, ple_embed_dim=32,
                   indexer_n_heads=8, indexer_budget=6, indexer_compress_ratio=1),
}


def hf_checkpoint(path: Path, seed: int, **shape):
    """A tiny random Qwen4-Exp with SmolLM2's tokenizer; the transformers model."""
    from transformers import AutoTokenizer

    from engine.assets import smollm2_gguf

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ref = make_qwen4_exp(path, seed=seed, vocab=len(tok), output_gate_type="sigmoid", **shape)
    tok.save_pretrained(str(path))
    return ref


@pytest.fixture(scope="module", params=sorted(SHAPES))
def converted(request, converter, tmp_path_factory):
    """(shape name, transformers model, HF dir, F32 GGUF)"""
    d = tmp_path_factory.mktemp(f"qwen4exp_gguf_{request.param}")
    ref = hf_checkpoint(d / "hf", seed=5, **SHAPES[request.param])
    path = converter_module().convert(converter, d / "hf", d / "model.gguf", "--outtype", "f32")
    return request.param, ref, d / "hf", path


def test_converted_gguf_loads_with_the_hf_tensors(converted):
    """Every tensor of the checkpoint under its canonical name; the PLE table's shards are one
    table in the file, equal to the shards end to end; nothing unmapped; the stated hash is the
    checkpoint's."""
    _, _, hf_dir, path = converted
    g, h = open_model_files(path), open_model_files(hf_dir)
    assert g.config.arch == h.config.arch == "qwen4_exp" and g.source.unmapped == []
    ga, ha = g.config.arch_params, h.config.arch_params
    assert (ga.hc_count, ga.hc_lowrank, ga.ple_layers, ga.ple_embed_dim, ga.indexer_budget, ga.indexer_ratio,
            ga.indexer_heads, ga.mrope_section) == (ha.hc_count, ha.hc_lowrank, ha.ple_layers, ha.ple_embed_dim,
                                                   ha.indexer_budget, ha.indexer_ratio, ha.indexer_heads,
                                                   ha.mrope_section)
    gh, hh = ga.ngram_hash(g.config, 0), ha.ngram_hash(h.config, 0)
    assert gh == replace(hh, num_rows=sum(hh.head_sizes))  # the padding rows are not read
    table = f"model.layers.{ha.ple_layers[0]}.ple.ngram.shard_"
    shards = sorted((n for n in h.source.names() if n.startswith(table)), key=lambda n: int(n.rsplit("_", 1)[1]))
    assert len(shards) > 1 and set(g.source.names()) == set(h.source.names()) - set(shards) | {table + "0"}
    assert torch.equal(g.source.get(table + "0"), torch.cat([h.source.get(n) for n in shards])[:gh.num_rows])
    for name in h.source.names():
        if not name.startswith(table):
            torch.testing.assert_close(g.source.get(name), h.source.get(name), rtol=0, atol=1e-6, msg=name)


def test_converted_gguf_matches_transformers(converted):
    _, ref, hf_dir, path = converted
    assert_matches_transformers(ref, path, hf_dir, max_tokens=32)


def test_greedy_tokens_equal_transformers_and_llama_cpp(converted):
    """40 prompt tokens (QSA drops blocks from position budget + ratio on), 32 greedy tokens: the
    same from transformers' generate, moestream on the GGUF and (ratio 1) llama.cpp on the GGUF."""
    name, ref, _, path = converted
    files = open_model_files(path)
    model = build_model(files.config, files.source)
    ids = torch.randint(3, files.config.vocab_size, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    ours = [t for t, _, _ in generate_ids(model, ids, SamplingConfig(max_tokens=32, ignore_eos=True))]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, 40:].tolist()
    assert ours == want and len(set(ours)) > 1
    if name != "r1_ple":
        return
    llama_cpp = pytest.importorskip("llama_cpp")
    assert llama_cpp_greedy(llama_cpp, path, ids, 32, n_ctx=96) == ours
    scores = llama_cpp_scores(llama_cpp, path, ids, n_ctx=96)
    logits = all_logits(model, ids).numpy()
    # llama.cpp's own kernels and summation order
    assert np.abs(scores - logits).max() < 5e-3 * np.abs(logits).max()


def test_llama_cpp_qsa_differs_by_its_width(converted):
    """ratio 4, budget 8 (module doc): llama.cpp's logits equal ours where the incomplete tail
    holds 3 tokens (or nothing is dropped yet: position < 11) and not at every other position."""
    name, _, _, path = converted
    if name != "qsa_r4":
        pytest.skip("the ratio-4 shape shows the difference")
    llama_cpp = pytest.importorskip("llama_cpp")
    files = open_model_files(path)
    a = files.config.arch_params
    model = build_model(files.config, files.source)
    ids = torch.randint(3, files.config.vocab_size, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    diff = np.abs(llama_cpp_scores(llama_cpp, path, ids, n_ctx=96) - all_logits(model, ids).numpy()).max(axis=1)
    same = [i for i in range(40) if i < a.indexer_budget + a.indexer_ratio - 1 or (i + 1) % a.indexer_ratio == 3]
    assert diff[same].max() < 1e-3
    assert diff[[i for i in range(40) if i not in same]].max() > 1e-2  # measured: 0.03 .. 0.24


def test_generate_from_the_gguf_equals_generate_from_the_checkpoint(converted):
    name, _, hf_dir, path = converted
    if name != "r1_ple":
        pytest.skip("one shape is enough for the CLI")
    assert_generate_equal(path, hf_dir)


# ---- malformed files ---------------------------------------------------------------------------

def _bad(path: Path, tmp: Path, **kw):
    with pytest.raises(ModelFormatError) as e:
        files = open_model_files(rewrite_gguf(path, tmp / "bad.gguf", **kw))
        build_model(files.config, files.source)
    return str(e.value)


@pytest.mark.parametrize("drop, named", [
    ("per_layer_token_embd.weight", "ple.ngram.shard_0"), ("blk.{L}.ple_key.weight", "ple.key_proj.weight"),
    ("blk.{L}.ple_norm_conv.weight", "ple.norm_conv.weight"), ("blk.{L}.ple_conv1d.weight", "ple.conv1d.weight"),
])
def test_gguf_missing_a_ple_tensor_is_one_format_error(converted, tmp_path, drop, named):
    name, _, _, path = converted
    if name != "qsa_r4":
        pytest.skip("one shape is enough")
    full = open_model_files(rewrite_gguf(path, tmp_path / "full.gguf"))
    build_model(full.config, full.source)  # the rewrite itself loses nothing
    layer = full.config.arch_params.ple_layers[0]
    msg = _bad(path, tmp_path, drop=drop.format(L=layer))
    assert named in msg and "missing" in msg


def test_gguf_with_a_ple_tensor_of_the_wrong_shape_is_one_format_error(converted, tmp_path):
    """A table of the wrong row width, a table shorter than the hash heads' ranges, a key
    projection of the wrong width: each is named with the shape it should have."""
    import gguf

    name, _, _, path = converted
    if name != "qsa_r4":
        pytest.skip("one shape is enough")
    r = gguf.GGUFReader(str(path))
    stored = {t.name: np.asarray(t.data) for t in r.tensors}
    table = stored["per_layer_token_embd.weight"]  # gguf-py order: [rows, row width]
    key = next(n for n in stored if n.endswith("ple_key.weight"))
    msg = _bad(path, tmp_path, replace={"per_layer_token_embd.weight": table[:, :-1].copy()})
    assert "per_layer_token_embd.weight" in msg and f"{table.shape[1]}" in msg
    msg = _bad(path, tmp_path, replace={"per_layer_token_embd.weight": table[: table.shape[0] // 2].copy()})
    assert "per_layer_token_embd.weight" in msg and "ranges" in msg
    msg = _bad(path, tmp_path, replace={key: stored[key][:, :-1].copy()})
    assert "ple.key_proj.weight" in msg and "shape" in msg


# ---- metadata ------------------------------------------------------------------------------------

def _meta(**changes):
    """A qwen4exp header: 4 blocks (attention last), hc 2, QSA ratio 4 of budget 8, PLE on block 1
    (ngram 3, 2 heads per order, rows of 8)."""
    sizes = [53, 59, 61, 67]
    meta = {"general.architecture": "qwen4exp", "qwen4exp.block_count": 4, "qwen4exp.embedding_length": 32,
            "qwen4exp.attention.head_count": 4, "qwen4exp.attention.head_count_kv": 2,
            "qwen4exp.attention.key_length": 16, "qwen4exp.vocab_size": 96, "qwen4exp.expert_count": 4,
            "qwen4exp.expert_used_count": 2, "qwen4exp.expert_feed_forward_length": 16,
            "qwen4exp.expert_shared_feed_forward_length": 24, "qwen4exp.ssm.group_count": 2,
            "qwen4exp.ssm.time_step_rank": 4, "qwen4exp.ssm.inner_size": 32, "qwen4exp.ssm.state_size": 8,
            "qwen4exp.rope.dimension_count": 8, "qwen4exp.rope.dimension_sections": [2, 1, 1, 0],
            "qwen4exp.attention.recurrent_layers": [True, True, True, False],
            "qwen4exp.hyper_connection.count": 2, "qwen4exp.hyper_connection.low_rank": 8,
            "qwen4exp.attention.indexer.head_count": 2, "qwen4exp.attention.indexer.key_length": 16,
            "qwen4exp.attention.indexer.top_k": 8, "qwen4exp.attention.compress_ratios": [0, 0, 0, 4],
            "qwen4exp.ple.layers": [1], "qwen4exp.ple.ngram_size": 3, "qwen4exp.ple.heads_per_ngram": 2,
            "qwen4exp.ple.conv_kernel": 3, "qwen4exp.ple.eos_token_id": 2,
            "qwen4exp.embedding_length_per_layer_input": 8,
            "qwen4exp.ple.layer_multipliers": [12345, 678901, 2345679],
            "qwen4exp.ple.head_offsets": [0, 53, 112, 173], "qwen4exp.ple.head_vocab_sizes": sizes,
            "tokenizer.ggml.eos_token_id": 2}
    meta.update({f"qwen4exp.{k}": v for k, v in changes.items()})
    return {k: v for k, v in meta.items() if v is not None}


def test_metadata_is_parsed_as_the_vlm_config():
    cfg = config_from_gguf(_meta(), "x.gguf")
    a = cfg.arch_params
    assert cfg.arch == "qwen4_exp" and cfg.attention_layers == (3,) and a.output_gate == "sigmoid"
    assert (a.hc_count, a.hc_lowrank, a.indexer_heads, a.indexer_budget, a.indexer_ratio) == (2, 8, 2, 8, 4)
    assert (a.ple_layers, a.ple_embed_dim, a.ple_row_dim, a.ple_conv_kernel, a.ple_eos) == ((1,), 32, 8, 3, 2)
    h = a.ngram_hash(cfg, 0)
    assert h.multipliers == (12345, 678901, 2345679) and h.head_sizes == (53, 59, 61, 67)
    assert h.head_offsets == (0, 53, 112, 173) and h.num_rows == 240
    assert cfg.eos_token_ids == (2,)


def test_zero_compress_ratios_mean_dense_attention():
    """What the converter writes when transformers 5 renamed the layer types (module doc of
    engine.models.qwen4_exp.gguf): llama.cpp attends densely, and so does moestream."""
    assert not config_from_gguf(_meta(**{"attention.compress_ratios": [0, 0, 0, 0]}), "x.gguf").arch_params.qsa


def test_no_ple_keys_mean_no_ple():
    cfg = config_from_gguf(_meta(**{"ple.layers": None}), "x.gguf")
    assert cfg.arch_params.ple_layers == () and cfg.arch_params.ngram_multipliers == ()


@pytest.mark.parametrize("changes, match", [
    ({"ple.layers": [1, 2]}, "exactly one PLE layer"),
    ({"ple.layers": [3]}, "linear_attention"),
    ({"ple.layer_multipliers": [1, 2]}, "layer_multipliers"),
    ({"ple.head_vocab_sizes": [53, 59, 61]}, "head_vocab_sizes"),
    ({"ple.head_offsets": [0, 53, 112, 170]}, "head_offsets"),
    ({"ple.eos_token_id": None}, "ple.eos_token_id"),
    ({"attention.compress_ratios": [0, 0]}, "compress_ratios"),
    ({"attention.compress_ratios": [0, 0, 4, 4], "attention.recurrent_layers": [True, True, False, False]}, None),
    ({"attention.compress_ratios": [0, 0, 4, 2], "attention.recurrent_layers": [True, True, False, False]},
     "one ratio"),
    ({"attention.indexer.top_k": 6}, "divisible"),
    ({"hyper_connection.count": 1}, "hc_count"),
    ({"hyper_connection.low_rank": None}, "hyper_connection.low_rank"),
])
def test_bad_metadata_is_a_format_error(changes, match):
    if match is None:  # the control: two attention layers sharing one ratio are fine
        assert config_from_gguf(_meta(**changes), "x.gguf").attention_layers == (2, 3)
        return
    with pytest.raises(ModelFormatError, match=match):
        config_from_gguf(_meta(**changes), "x.gguf")
