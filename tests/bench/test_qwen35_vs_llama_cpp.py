"""bench/qwen35_vs_llama_cpp.py's building blocks on its tiny shape: the random Qwen3.5-MoE
written as F32 GGUF by llama.cpp's converter gives the same greedy tokens in moestream's GGUF
load and in llama.cpp. Skips without llama_cpp or without the converter (no network)."""

from __future__ import annotations

import pytest

from tests.bench.side_by_side import bench_module, greedy_both


@pytest.fixture(scope="module")
def B():
    with bench_module("qwen35_vs_llama_cpp") as mod:
        yield mod


def test_greedy_tokens_agree_with_llama_cpp(B, request, tmp_path):
    ours, _, _, (got, prefill, decode), want = greedy_both(B, B.build_checkpoint, request, tmp_path, 40, 16)
    assert ours.config.arch == "qwen3_5_moe"
    assert got == want and len(set(got)) > 1  # a constant stream would agree by accident
    assert prefill > 0 and decode > 0
