"""bench/qwen4exp_vs_llama_cpp.py's building blocks on its tiny shape: the random Qwen4-Exp written
as F32 GGUF by llama.cpp's converter gives the same greedy tokens in moestream's GGUF load, in
llama.cpp and in transformers; the bytes per token count 1 of each table's rows, not the
tables. Skips without llama_cpp or without the converter (no network)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def B():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("qwen4exp_vs_llama_cpp")
    finally:
        sys.path.remove(str(BENCH))


def test_greedy_tokens_agree_with_llama_cpp_and_transformers(B, request, tmp_path):
    pytest.importorskip("llama_cpp")
    B.build(tmp_path / "hf", B.TINY)
    try:
        path = B.to_gguf(tmp_path / "hf", tmp_path / "f32.gguf", request.config.cache.mkdir("llama_cpp_converter"))
    except B.ConverterUnavailable as e:
        pytest.skip(str(e))
    ours = B.load_fp32(path)
    cfg = ours.config
    assert cfg.arch == "qwen4_exp" and cfg.arch_params.qsa and len(cfg.arch_params.ple_layers) == 1
    prompt = B.make_prompt(40, cfg.vocab_size)  # > the budget (8): selection drops tokens
    theirs = B.LlamaCpp(path, 2, 80, 40)
    try:
        want, _, _ = theirs.greedy(prompt, 16)
    finally:
        theirs.close()
    got, prefill, decode = B.moestream_greedy(ours, prompt, 16)
    assert got == want == B.transformers_greedy(tmp_path / "hf", prompt, 16)
    assert len(set(got)) > 1 and prefill > 0 and decode > 0  # a constant stream would agree by accident
    a = cfg.arch_params
    read, what = B.read_bytes(path, cfg)
    without_table = B.gguf_active_bytes(path, cfg, {"per_layer_token_embd.weight": 0}) + 2 * B.state_bytes(cfg)
    assert f"{a.ngram_heads} PLE rows" in what and read - without_table == pytest.approx(a.ngram_heads * a.ple_row_dim * 4)
