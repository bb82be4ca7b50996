"""bench/qwen4exp_vs_llama_cpp.py's building blocks on its tiny shape: the random Qwen4-Exp written
as F32 GGUF by llama.cpp's converter gives the same greedy tokens in moestream's GGUF load, in
llama.cpp and in transformers; the bytes per token count the token's PLE rows, not the table.
Skips without llama_cpp or without the converter (no network)."""

from __future__ import annotations

import pytest

from tests.bench.side_by_side import bench_module, greedy_both


@pytest.fixture(scope="module")
def B():
    with bench_module("qwen4exp_vs_llama_cpp") as mod:
        yield mod


def test_greedy_tokens_agree_with_llama_cpp_and_transformers(B, request, tmp_path):
    # 40 prompt tokens > the budget (8): QSA selection drops tokens. 12 new tokens: the 14th's two
    # best logits lie 0.0017 apart in the reference, inside llama.cpp's rounding (it picks the
    # other; moestream and transformers agree on all 16).
    ours, path, prompt, (got, prefill, decode), want = greedy_both(B, B.build, request, tmp_path, 40, 12)
    cfg = ours.config
    a = cfg.arch_params
    assert cfg.arch == "qwen4_exp" and a.qsa and len(a.ple_layers) == 1
    assert got == want == B.transformers_greedy(tmp_path / "hf", prompt, 12)
    assert len(set(got)) > 1 and prefill > 0 and decode > 0  # a constant stream would agree by accident
    read, what = B.read_bytes(path, cfg)
    without_table = B.gguf_active_bytes(path, cfg, {"per_layer_token_embd.weight": 0}) + 2 * B.state_bytes(cfg)
    assert f"{a.ngram_heads} PLE rows" in what
    assert read - without_table == pytest.approx(a.ngram_heads * a.ple_row_dim * 4)
