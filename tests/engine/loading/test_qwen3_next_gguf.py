"""Qwen3-Next from GGUF: a tiny random checkpoint converted by llama.cpp's own converter
(convert_hf_to_gguf.py from the llama-cpp-python source distribution) loads in moestream with
every tensor equal to the HF checkpoint's, and the model's logits match transformers'.

The converter is fetched once with pip into the pytest cache (the ``converter`` fixture,
tests/engine/loading/conftest.py); without it (no network) the converter tests skip. The
converter needs a tokenizer whose pre-tokenizer it recognises: SmolLM2's (the default model's
GGUF, here as tokenizer.json), so the tiny model has its 49152-token vocabulary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.errors import ModelFormatError
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.models.qwen3_next.gguf import config_from_gguf
from tests.engine.loading.converted import (all_logits, assert_generate_equal, assert_matches_transformers,
                                            assert_same_model, llama_cpp_scores)
from tests.engine.models.qwen3_next_tiny import make_qwen3_next

pytestmark = pytest.mark.slow  # llama.cpp's own converter end to end: `pytest -m slow`

SHAPES = {
    "interval4": dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, linear_key_head_dim=16, linear_value_head_dim=16,
                      shared_expert_intermediate_size=32),
    "interval2_r1": dict(full_attention_interval=2, linear_num_value_heads=2, num_key_value_heads=1,
                         linear_value_head_dim=16, num_experts_per_tok=1, num_experts=4),
}


def _hf_checkpoint(path: Path, shape: dict):
    from transformers import AutoTokenizer

    from engine.assets import smollm2_gguf

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ref = make_qwen3_next(path, seed=4, vocab=len(tok), **shape)
    tok.save_pretrained(str(path))
    return ref


@pytest.fixture(scope="module", params=sorted(SHAPES))
def converted(request, converter, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"qwen3next_gguf_{request.param}")
    ref = _hf_checkpoint(d / "hf", SHAPES[request.param])
    out = d / "model.gguf"
    r = subprocess.run([sys.executable, str(converter), str(d / "hf"), "--outfile", str(out),
                        "--outtype", "f32", "--no-mtp"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return ref, d / "hf", out


def test_converted_gguf_loads_with_the_hf_tensors(converted):
    _, hf_dir, gguf_path = converted
    g, h = open_model_files(gguf_path), open_model_files(hf_dir)
    assert g.source.metadata["general.architecture"] == "qwen3next"
    assert_same_model(g, h)


def test_converted_gguf_matches_transformers(converted):
    ref, hf_dir, gguf_path = converted
    assert_matches_transformers(ref, gguf_path, hf_dir, max_tokens=16)


def test_bad_ssm_metadata_is_a_format_error():
    meta = {"general.architecture": "qwen3next", "qwen3next.block_count": 4, "qwen3next.embedding_length": 64,
            "qwen3next.attention.head_count": 4, "qwen3next.attention.head_count_kv": 2,
            "qwen3next.attention.key_length": 16, "qwen3next.vocab_size": 96, "qwen3next.expert_count": 4,
            "qwen3next.expert_used_count": 2, "qwen3next.expert_feed_forward_length": 16,
            "qwen3next.ssm.group_count": 2, "qwen3next.ssm.time_step_rank": 4,
            "qwen3next.ssm.inner_size": 30, "qwen3next.ssm.state_size": 8}
    with pytest.raises(ModelFormatError, match="not a multiple of ssm.time_step_rank"):
        config_from_gguf(meta, "x.gguf")
    meta["qwen3next.ssm.inner_size"] = 32
    del meta["qwen3next.ssm.state_size"]
    with pytest.raises(ModelFormatError, match="qwen3next.ssm.state_size"):
        config_from_gguf(meta, "x.gguf")
    meta["qwen3next.ssm.state_size"] = 8
    cfg = config_from_gguf(meta, "x.gguf")
    la = cfg.linear_attn
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim) == (2, 4, 8, 8)
    assert cfg.attention_layers == (3,) and cfg.rotary_dim == 4  # interval 4, 25% of 16 by default


def test_llama_cpp_runs_the_converted_gguf_as_moestream_does(converted):
    """llama.cpp's own qwen3next runtime (llama-cpp-python, when installed) on the converter's
    GGUF: its logits over 80 tokens agree with moestream's on the same file."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    _, _, gguf_path = converted
    files = open_model_files(gguf_path)
    cfg = files.config
    la = cfg.linear_attn
    if la.key_head_dim != la.value_head_dim:  # its check_tensor_dims refuses attn_qkv then
        pytest.skip("llama.cpp's qwen3next assumes equal DeltaNet key and value head dims")
    model = build_model(cfg, files.source)
    ids = torch.randint(3, cfg.vocab_size, (80,), generator=torch.Generator().manual_seed(6)).tolist()
    theirs = llama_cpp_scores(llama_cpp, gguf_path, ids, n_ctx=128)
    ours = all_logits(model, ids).numpy()
    # measured: max |difference| 3.7e-4 with logits up to 2.3 (llama.cpp's own kernels and order)
    assert np.abs(theirs - ours).max() < 5e-3 * np.abs(ours).max()
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() > 0.95


def test_generate_from_the_gguf_equals_generate_from_the_checkpoint(converted):
    """`moestream generate --model x.gguf`: the tokenizer comes from the GGUF's tokenizer.ggml.*
    keys (transformers' AutoTokenizer refuses the qwen3next architecture; the fast tokenizer is
    built directly) and the text equals the HF checkpoint directory's."""
    _, hf_dir, gguf_path = converted
    assert_generate_equal(gguf_path, hf_dir)
