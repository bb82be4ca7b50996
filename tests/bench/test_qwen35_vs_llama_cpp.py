"""bench/qwen35_vs_llama_cpp.py's building blocks on its tiny shape: the random Qwen3.5-MoE
written as F32 GGUF by llama.cpp's converter gives the same greedy tokens in moestream's GGUF
load and in llama.cpp. Skips without llama_cpp or without the converter (no network)."""

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
        yield importlib.import_module("qwen35_vs_llama_cpp")
    finally:
        sys.path.remove(str(BENCH))


def test_greedy_tokens_agree_with_llama_cpp(B, request, tmp_path):
    pytest.importorskip("llama_cpp")
    B.build_checkpoint(tmp_path / "hf", B.TINY)
    try:
        path = B.to_gguf(tmp_path / "hf", tmp_path / "f32.gguf", request.config.cache.mkdir("llama_cpp_converter"))
    except B.ConverterUnavailable as e:
        pytest.skip(str(e))
    ours = B.load_fp32(path)
    assert ours.config.arch == "qwen3_5_moe"
    prompt = B.make_prompt(40, ours.config.vocab_size)
    theirs = B.LlamaCpp(path, 2, 80, 40)
    try:
        want, _, _ = theirs.greedy(prompt, 16)
    finally:
        theirs.close()
    got, prefill, decode = B.moestream_greedy(ours, prompt, 16)
    assert got == want and len(set(got)) > 1  # a constant stream would agree by accident
    assert prefill > 0 and decode > 0
