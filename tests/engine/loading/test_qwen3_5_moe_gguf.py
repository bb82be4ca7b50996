"""Qwen3.5-MoE from GGUF: tiny random Qwen3_5MoeForConditionalGeneration checkpoints (the VLM
layout, vision tower and an MTP head on disk) converted by llama.cpp's own converter
(convert_hf_to_gguf.py, arch ``qwen35moe``; the ``converter`` fixture, conftest.py) load in
moestream with every tensor equal to the HF checkpoint's, logits equal to transformers', greedy
tokens equal to llama.cpp's on the same file; the MTP blocks the converter appends are never
read; a file missing a DeltaNet tensor is one ModelFormatError.

Tokenizer: SmolLM2's (tokenizer.json), as in test_qwen3_next_gguf.py; see
bench/llama_cpp_converter.py for the one transformers mapping the converter is run with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import ModelFormatError
from engine.generate import generate_ids
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.models.qwen3_5_moe.gguf import config_from_gguf
from tests.engine.loading.converted import (all_logits, assert_generate_equal, assert_matches_transformers,
                                            assert_same_model, converter_module, llama_cpp_greedy,
                                            llama_cpp_scores, rewrite_gguf)
from tests.engine.models.qwen3_5_moe_tiny import add_mtp, make_qwen3_5_moe

pytestmark = pytest.mark.slow  # llama.cpp's own converter end to end: `pytest -m slow`

# grouped: 2 key heads, 4 value heads (the converter re-orders value heads), untied, attention
# every 4th layer; tied_r1: as many key as value heads, tied head, attention every 2nd layer.
SHAPES = {
    "grouped": dict(),
    "tied_r1": dict(tied=True, full_attention_interval=2, linear_num_value_heads=2, num_hidden_layers=4),
}


def hf_checkpoint(path: Path, seed: int = 4, **shape):
    """A tiny random Qwen3.5-MoE with SmolLM2's tokenizer and an MTP head; the transformers model."""
    from transformers import AutoTokenizer

    from engine.assets import smollm2_gguf

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ref = make_qwen3_5_moe(path, seed=seed, vocab=len(tok), **shape)
    add_mtp(path, seed + 1)
    tok.save_pretrained(str(path))
    return ref


@pytest.fixture(scope="module", params=sorted(SHAPES))
def converted(request, converter, tmp_path_factory):
    """(transformers model, HF dir, GGUF with the MTP block, GGUF without it)"""
    conv = converter_module()
    d = tmp_path_factory.mktemp(f"qwen35moe_gguf_{request.param}")
    ref = hf_checkpoint(d / "hf", **SHAPES[request.param])
    with_mtp = conv.convert(converter, d / "hf", d / "mtp.gguf", "--outtype", "f32")
    no_mtp = conv.convert(converter, d / "hf", d / "model.gguf", "--outtype", "f32", "--no-mtp")
    return ref, d / "hf", with_mtp, no_mtp


def test_converted_gguf_loads_with_the_hf_tensors(converted):
    _, hf_dir, with_mtp, no_mtp = converted
    h = open_model_files(hf_dir)
    for path in (no_mtp, with_mtp):
        g = open_model_files(path)
        assert g.source.metadata["general.architecture"] == "qwen35moe"
        assert g.config.arch == "qwen3_5_moe"
        assert g.config.arch_params.mrope_section == h.config.arch_params.mrope_section
        assert_same_model(g, h)


def test_mtp_blocks_are_never_read(converted):
    """The converter appends the MTP head as block num_layers (nextn_predict_layers 1): it is not a
    layer of the model and none of its tensors is read."""
    _, _, with_mtp, _ = converted
    files = open_model_files(with_mtp)
    n = files.config.num_layers
    meta = files.source.metadata
    assert meta["qwen35moe.nextn_predict_layers"] == 1 and meta["qwen35moe.block_count"] == n + 1
    mtp = [g for g in files.source.tensor_infos if g.startswith(f"blk.{n}.")]
    assert "blk.%d.nextn.eh_proj.weight" % n in mtp and len(mtp) > 10
    read: list[str] = []
    stored, raw = files.source.stored_tensor, files.source._file.raw
    files.source.stored_tensor = lambda g: read.append(g) or stored(g)
    files.source._file.raw = lambda g, *a: read.append(g) or raw(g, *a)
    build_model(files.config, files.source)
    assert read and not [g for g in read if g.startswith(f"blk.{n}.")]


def test_converted_gguf_matches_transformers(converted):
    ref, hf_dir, with_mtp, _ = converted
    assert_matches_transformers(ref, with_mtp, hf_dir, max_tokens=32)


def test_llama_cpp_greedy_tokens_equal_moestreams(converted):
    """llama.cpp's own qwen35moe runtime (llama-cpp-python, when installed) on the converter's
    F32 GGUF: logits over 80 prompt tokens close to moestream's on the same file, and the same
    32 greedy tokens."""
    llama_cpp = pytest.importorskip("llama_cpp")
    _, _, with_mtp, _ = converted
    files = open_model_files(with_mtp)
    cfg = files.config
    model = build_model(cfg, files.source)
    ids = torch.randint(3, cfg.vocab_size, (80,), generator=torch.Generator().manual_seed(6)).tolist()
    theirs = llama_cpp_scores(llama_cpp, with_mtp, ids, n_ctx=160)
    lc_tokens = llama_cpp_greedy(llama_cpp, with_mtp, ids, 32, n_ctx=160)
    ours = all_logits(model, ids).numpy()
    # measured: max |difference| 3.2e-4 with logits up to 1.7 (llama.cpp's own kernels and order)
    assert np.abs(theirs - ours).max() < 5e-3 * np.abs(ours).max()
    sampling = SamplingConfig(max_tokens=32, ignore_eos=True)
    assert lc_tokens == [t for t, _, _ in generate_ids(model, ids, sampling)]


def test_generate_from_the_gguf_equals_generate_from_the_checkpoint(converted):
    """`moestream generate --model x.gguf` on a qwen35moe GGUF: the text equals the checkpoint's."""
    _, hf_dir, with_mtp, _ = converted
    assert_generate_equal(with_mtp, hf_dir)


@pytest.mark.parametrize("drop", ["blk.0.ssm_a", "blk.0.attn_gate.weight", "blk.0.ssm_alpha.weight"])
def test_gguf_missing_a_deltanet_tensor_is_one_format_error(converted, tmp_path, drop):
    _, _, _, no_mtp = converted
    full = open_model_files(rewrite_gguf(no_mtp, tmp_path / "full.gguf"))
    build_model(full.config, full.source)  # the rewrite itself loses nothing
    bad = rewrite_gguf(no_mtp, tmp_path / "bad.gguf", drop=drop)
    with pytest.raises(ModelFormatError) as e:
        files = open_model_files(bad)
        build_model(files.config, files.source)
    # a stored partner (attn_gate, ssm_alpha) is named by its GGUF name; a tensor of its own by
    # the canonical one it would have been
    named = {"blk.0.ssm_a": "model.layers.0.linear_attn.A_log"}.get(drop, drop)
    assert named in str(e.value) and "missing" in str(e.value)


def _meta(**changes):
    meta = {"general.architecture": "qwen35moe", "qwen35moe.block_count": 4, "qwen35moe.embedding_length": 32,
            "qwen35moe.attention.head_count": 4, "qwen35moe.attention.head_count_kv": 2,
            "qwen35moe.attention.key_length": 16, "qwen35moe.vocab_size": 96, "qwen35moe.expert_count": 4,
            "qwen35moe.expert_used_count": 2, "qwen35moe.expert_feed_forward_length": 16,
            "qwen35moe.ssm.group_count": 2, "qwen35moe.ssm.time_step_rank": 4, "qwen35moe.ssm.inner_size": 32,
            "qwen35moe.ssm.state_size": 8, "qwen35moe.rope.dimension_count": 8,
            "qwen35moe.rope.dimension_sections": [2, 1, 1, 0]}
    meta.update({f"qwen35moe.{k}": v for k, v in changes.items()})
    return {k: v for k, v in meta.items() if v is not None}


def test_metadata_is_parsed_as_the_vlm_config():
    cfg = config_from_gguf(_meta(), "x.gguf")
    assert cfg.arch == "qwen3_5_moe" and cfg.arch_params.mrope_section == (2, 1, 1)
    assert cfg.attention_layers == (3,) and cfg.rotary_dim == 8 and cfg.linear_attn.value_head_dim == 8
    with_mtp = config_from_gguf(_meta(block_count=5, nextn_predict_layers=1), "x.gguf")
    assert with_mtp.num_layers == 4 and with_mtp.attention_layers == (3,)


@pytest.mark.parametrize("sections, match", [
    (None, "rope.dimension_sections"), ([2, 1, 1, 3], "dimension_sections"), ([8], "dimension_sections"),
    ([3, 1, 1, 0], "mrope"),
])
def test_bad_rope_sections_are_a_format_error(sections, match):
    with pytest.raises(ModelFormatError, match=match):
        config_from_gguf(_meta(**{"rope.dimension_sections": sections}), "x.gguf")


# ---- the MTP head against llama.cpp's MTP context ------------------------------------------------

def _f32_rows(ptr, n_rows: int, width: int) -> np.ndarray:
    return np.ctypeslib.as_array(ptr, shape=(n_rows * width,)).reshape(n_rows, width).copy()


def _llama_cpp_mtp(llama_cpp, gguf_path: Path, ids: list[int], chain: int):
    """llama.cpp end to end, through its low-level API (as common/speculative.cpp's draft-mtp):
    the target context's normed hidden states h_p of ``ids`` (llama_get_embeddings_nextn_ith),
    then an MTP context (LLAMA_CONTEXT_TYPE_MTP, the model loaded with load_mtp) fed each
    (x_{p+1}, h_p) at position p + 1 in one batch (the token id plus its state row through
    llama_batch_ext_set_embd_token: set_embd_state is a stub returning false in this wheel),
    then ``chain`` greedy drafts each fed back with the head's own h_nextn. Returns (target h
    [T, H], head logits [T-1, V], the chained drafts)."""
    import ctypes

    import llama_cpp.llama_cpp_ext as ext

    L = llama_cpp
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.load_mtp = True
    model = L.llama_model_load_from_file(str(gguf_path).encode(), mp)
    ctxs, batches = [], []
    try:
        def context(mtp: bool, other=None):
            cp = L.llama_context_default_params()
            cp.n_ctx = cp.n_batch = cp.n_ubatch = 128
            cp.n_threads = cp.n_threads_batch = 2
            if mtp:
                cp.ctx_type, cp.ctx_other, cp.n_rs_seq = L.LLAMA_CONTEXT_TYPE_MTP, other, 0
            c = L.llama_init_from_model(model, cp)
            assert c, "llama.cpp refused the context"
            ctxs.append(c)
            return c

        def feed(ctx, rows):  # rows: (token, position, state row or None)
            b = L.llama_batch_ext_init(ctx)
            batches.append(b)
            for tok, pos, state in rows:
                i = L.llama_batch_ext_add_token(b, 0, tok)
                assert i >= 0 and L.llama_batch_ext_set_pos(b, i, (L.llama_pos * 1)(pos))
                if state is not None:
                    e = L.llama_embd(state.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, state.shape[0])
                    assert L.llama_batch_ext_set_embd_token(b, i, e)
                L.llama_batch_ext_set_output_logits(b, i, True)
            assert L.llama_process(ctx, L.LLAMA_PROCESS_TYPE_DECODE, b) == 0

        n_embd = L.llama_model_n_embd(model)
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        tgt = context(False)
        ext.llama_set_embeddings_nextn(tgt, True, False)
        feed(tgt, [(t, p, None) for p, t in enumerate(ids)])
        h = np.stack([_f32_rows(ext.llama_get_embeddings_nextn_ith(tgt, i), 1, n_embd)[0] for i in range(len(ids))])
        dft = context(True, tgt)
        ext.llama_set_embeddings_nextn(dft, True, False)
        t = len(ids) - 1
        feed(dft, [(ids[p + 1], p + 1, np.ascontiguousarray(h[p])) for p in range(t)])
        logits = np.stack([_f32_rows(L.llama_get_logits_ith(dft, i), 1, n_vocab)[0] for i in range(t)])
        drafts, last, g = [], logits[-1], _f32_rows(ext.llama_get_embeddings_nextn_ith(dft, t - 1), 1, n_embd)[0]
        for j in range(chain):
            drafts.append(int(last.argmax()))
            if j + 1 < chain:
                feed(dft, [(drafts[-1], t + 1 + j, np.ascontiguousarray(g))])
                last = _f32_rows(L.llama_get_logits_ith(dft, 0), 1, n_vocab)[0]
                g = _f32_rows(ext.llama_get_embeddings_nextn_ith(dft, 0), 1, n_embd)[0]
        return h, logits, drafts
    finally:
        for b in batches:
            L.llama_batch_ext_free(b)
        for c in reversed(ctxs):
            L.llama_free(c)
        L.llama_model_free(model)


def test_mtp_head_matches_llama_cpps_mtp_context(converted):
    """The MTP head loaded from the HF checkpoint (engine/models/qwen3_5_moe/mtp.py) against
    llama.cpp's MTP context on the converter's F32 GGUF of the same weights: the target hidden
    states, the head's logits at every one of 40 slots (a prompt of 41 tokens), and 4 chained
    greedy drafts equal. (The head is read from HF checkpoints only: a GGUF's nextn block is
    refused by name.)"""
    from engine.kv.base import BatchLayout
    from engine.models.qwen3_5_moe.mtp import load_mtp_head

    _, hf_dir, with_mtp, _ = converted
    files = open_model_files(hf_dir)
    model = build_model(files.config, files.source)
    with pytest.raises(ModelFormatError, match="GGUF files: not supported"):
        load_mtp_head(model, open_model_files(with_mtp).source)
    llama_cpp = pytest.importorskip("llama_cpp")
    head = load_mtp_head(model, files.source)
    ids = torch.randint(3, files.config.vocab_size, (41,), generator=torch.Generator().manual_seed(8)).tolist()
    their_h, their_logits, their_drafts = _llama_cpp_mtp(llama_cpp, with_mtp, ids, chain=4)

    seen: list[torch.Tensor] = []
    model.__dict__["hidden_taps"] = [lambda x, layout: seen.append(model.model.norm(x))]
    try:
        from engine.kv.state import HybridKVCache

        model(torch.tensor(ids), BatchLayout.single(0, len(ids), 0),
              HybridKVCache(files.config, 16, 1, 8, torch.float32))
    finally:
        model.__dict__["hidden_taps"] = []
    h = seen[0]
    # the target's hidden states (llama.cpp's own kernels for the whole model): measured 8e-4
    # with values up to 2.6, as the logits in test_llama_cpp_greedy_tokens_equal_moestreams
    assert np.abs(h.numpy() - their_h).max() < 5e-3 * np.abs(their_h).max()
    # the head alone, fed llama.cpp's h: measured 7e-5 with logits up to 1.6
    h = torch.from_numpy(their_h)
    kv = head.new_cache()
    ours, g = head(torch.tensor(ids[1:]), h[:-1], BatchLayout.single(0, 40, 0), kv)
    assert np.abs(ours.numpy() - their_logits).max() < 1e-3 * np.abs(their_logits).max()
    drafts, last, gl = [], ours[-1], g[-1:]
    for j in range(4):
        drafts.append(int(last.argmax()))
        last, gl = head(torch.tensor([drafts[-1]]), gl, BatchLayout.single(0, 1, 40 + j), kv)
        last = last[-1]
    assert drafts == their_drafts


def test_generate_speculative_mtp_gives_the_plain_text(converted):
    """`moestream generate --model HF_DIR --speculative mtp`: the checkpoint's MTP head drafts,
    the text equals plain decoding's; the same with a GGUF is refused by name."""
    import re

    from click.testing import CliRunner

    from services.cli import main

    _, hf_dir, with_mtp, _ = converted

    def run(*args):
        return CliRunner().invoke(main, ["generate", *map(str, args), "--max-tokens", "16", "one two three"])

    plain, mtp = run("--model", hf_dir), run("--model", hf_dir, "--speculative", "mtp")
    assert plain.exit_code == 0 and mtp.exit_code == 0, mtp.output
    assert mtp.stdout == plain.stdout
    drafted = re.search(r"drafted (\d+), accepted (\d+)", mtp.stderr)
    assert drafted and int(drafted.group(1)) > 0, mtp.stderr
    bad = run("--model", with_mtp, "--speculative", "mtp")
    assert bad.exit_code != 0 and "GGUF files: not supported" in bad.stderr
