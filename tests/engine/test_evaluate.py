"""Quality harness (perplexity, KL, routing traces), the quality CLI, and the shipped real
routing traces of the moefied SmolLM2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from engine.evaluate import (
    EvalResult,
    evaluate,
    generation_trace,
    open_model,
    reference_run,
    routing_stats,
    routing_trace,
    save_trace,
    trace_info,
)
from engine.experts.simulate import budgets_from_fractions, sweep
from engine.experts.trace import RoutingTrace
from engine.moefy import fit_moe, write_checkpoint
from engine.text import calibration_text, heldout_text, split_topics, windows
from tests.engine.test_moefy import SENTENCE, calib_windows, make_dense

DATA = Path(__file__).resolve().parents[1] / "data"
TEXT = heldout_text()[:6000]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """dense tiny Llama, its MoE with K = E (reproduces it) and with K = 1 (does not)."""
    root = tmp_path_factory.mktemp("eval")
    make_dense(root / "dense")
    fit = fit_moe(root / "dense", experts=4, shared_fraction=0.0, calib_windows=calib_windows(),
                  progress=False)
    write_checkpoint(fit, root / "k4", top_k=4, max_weight_deviation=1e-6)
    write_checkpoint(fit, root / "k1", top_k=1)
    return root


# ---- text -------------------------------------------------------------------------------------


def test_text_splits_are_disjoint_and_deterministic():
    cal, held = set(split_topics("calibration")), set(split_topics("heldout"))
    assert cal and held and not cal & held
    assert len(held) == pytest.approx((len(cal) + len(held)) / 5, abs=1)
    assert calibration_text() == calibration_text() and heldout_text() == heldout_text()
    from engine.text import paragraphs

    cal_p = {p.strip() for p in paragraphs("calibration")}
    held_p = [p.strip() for p in paragraphs("heldout")]
    assert len(held_p) > 100 and not any(p in cal_p for p in held_p)
    assert len(heldout_text()) > 40_000 and len(calibration_text()) > 4 * len(heldout_text())
    # longer held-out paragraphs do not even occur inside calibration paragraphs
    long = [p for p in held_p if len(p) > 300][:30]
    cal = calibration_text()
    assert long and not any(p in cal for p in long)


def test_windows(models):
    tok = open_model(models / "dense").tokenizer
    w = windows(tok, TEXT, 64, 5)
    assert len(w) == 5 and all(len(x) == 64 for x in w)
    assert w == windows(tok, TEXT, 64, 5)
    first = windows(tok, TEXT, 64, 2, spread=False)
    assert first[0] == w[0]  # spread windows start at the first one too
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="windows of 64 fit"):
        windows(tok, TEXT, 64, 10_000)
    assert len(windows(tok, TEXT, 64, 10_000, strict=False)) == len(tok.encode(TEXT, add_special_tokens=False)) // 64


# ---- perplexity and KL ------------------------------------------------------------------------


def test_eval_model_against_itself(models):
    r = evaluate(models / "dense", models / "dense", TEXT, window=64, max_windows=4, progress=False)
    assert isinstance(r, EvalResult)
    assert math.isfinite(r.ppl) and r.ppl > 1 and r.ppl == pytest.approx(r.ref_ppl, rel=1e-6)
    assert abs(r.mean_kl) < 1e-6 and r.tokens == 4 * 63 and r.windows == 4
    assert r.top1_agreement == 1.0


def test_eval_moe_against_dense(models):
    ref = reference_run(models / "dense", TEXT, window=64, max_windows=4, progress=False)
    exact = evaluate(models / "k4", ref, None, progress=False)
    assert exact.mean_kl < 1e-6 and exact.ppl == pytest.approx(exact.ref_ppl, rel=1e-4)
    sparse = evaluate(models / "k1", ref, None, progress=False)
    assert math.isfinite(sparse.ppl) and sparse.mean_kl > 1e-4 and math.isfinite(sparse.max_kl)
    assert sparse.ref_ppl == pytest.approx(exact.ref_ppl)
    # the cached reference scores exactly as a fresh one
    fresh = evaluate(models / "k1", models / "dense", TEXT, window=64, max_windows=4, progress=False)
    assert fresh.mean_kl == pytest.approx(sparse.mean_kl, rel=1e-6)


def test_eval_from_expert_store(models, tmp_path):
    from engine.quant.formats import QuantFormat
    from engine.store import convert

    convert(models / "k4", tmp_path / "store", fmt=QuantFormat("bf16", 64), progress=False)
    r = evaluate(tmp_path / "store", models / "dense", TEXT, window=64, max_windows=2, progress=False)
    assert math.isfinite(r.ppl) and 0 <= r.mean_kl < 1e-2  # bf16 experts: close, not exact


# ---- routing traces ---------------------------------------------------------------------------


def test_routing_trace_prefill(models):
    lo = open_model(models / "k1")
    wins = [lo.tokenizer.encode(SENTENCE)[:20], lo.tokenizer.encode(SENTENCE)[20:45]]
    tr = routing_trace(lo.model, lo.tokenizer, None, wins)
    assert (tr.num_layers, tr.num_experts, tr.top_k) == (2, 4, 1)
    assert len(tr) == 2 * (20 + 25) and tr.num_tokens == 45
    # execution order: per window, layer 0's tokens then layer 1's
    assert tr.sequence.tolist() == [0] * 40 + [1] * 50
    assert tr.layer[:40].tolist() == [0] * 20 + [1] * 20
    assert tr.token_index[:20].tolist() == list(range(20))
    assert tr.experts.min() >= 0 and tr.experts.max() < 4
    again = routing_trace(lo.model, lo.tokenizer, TEXT, 2, window=32)
    assert len(again) == 2 * 32 * 2
    assert not lo.model.moe_blocks[0].observers  # observers removed afterwards
    stats = routing_stats(tr)
    assert len(stats["entropy"]) == 2 and all(0 <= e <= 1 for e in stats["entropy"])
    assert all(0 < s <= 1 for s in stats["top10_share"]) and stats["tokens"] == 45


def test_generation_trace_and_files(models, tmp_path):
    lo = open_model(models / "k1")
    prompt = lo.tokenizer.encode(SENTENCE)[:10]
    tr, outs = generation_trace(lo.model, [prompt, prompt], 6)
    assert [len(o) for o in outs] == [6, 6] and outs[0] == outs[1]  # greedy
    # 5 decode steps per generation (the 6th token is never fed back), 2 layers each
    assert len(tr) == 2 * 5 * 2
    assert tr.token_index[:2].tolist() == [10, 10] and tr.token_index[-1] == 14
    with_prompt, _ = generation_trace(lo.model, [prompt], 3, include_prompt=True)
    assert len(with_prompt) == 2 * 10 + 2 * 2
    path = save_trace(tr, tmp_path / "t.npz", {"expert_bytes": 1234, "model": "k1"})
    assert RoutingTrace.load(path) == tr
    assert trace_info(path) == {"expert_bytes": 1234, "model": "k1"}
    assert trace_info(save_trace(tr, tmp_path / "plain.npz")) == {}


# ---- shipped real traces ----------------------------------------------------------------------

SHIPPED = sorted(DATA.glob("smollm2_moe*.npz"))


def test_shipped_traces_exist_and_are_small():
    assert len(SHIPPED) >= 2, f"expected shipped traces in {DATA}"
    for p in SHIPPED:
        assert p.stat().st_size < 200_000, p


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_trace_simulator_invariants(path):
    tr = RoutingTrace.load(path)
    info = trace_info(path)
    assert (tr.num_layers, tr.num_experts, tr.top_k) == (30, 16, 8)
    assert info["expert_bytes"] > 0 and tr.num_tokens >= 100
    budgets = budgets_from_fractions(tr, [0.1, 0.25, 0.5, 0.75])
    table = sweep(tr, ["lru", "lfu", "belady"], budgets, expert_bytes=info["expert_bytes"])
    prev = {}
    for cap in budgets:
        bel = table.hit_rate("belady", cap)
        for pol in ("lru", "lfu"):
            assert bel >= table.hit_rate(pol, cap) - 1e-12, (pol, cap)
        for pol in ("lru", "lfu", "belady"):
            r = table.get(pol, cap)
            assert r.hits + r.misses == r.accesses == tr.num_accesses
            assert r.misses >= r.compulsory_misses
            assert r.bytes_missed == r.misses * info["expert_bytes"]
        if "belady" in prev:  # Belady's hit rate grows with the budget
            assert bel >= prev["belady"] - 1e-12
        prev["belady"] = bel
    stats = routing_stats(tr)
    assert 0 < stats["mean_entropy"] <= 1


# ---- CLI --------------------------------------------------------------------------------------


def test_cli_eval_trace_simulate(models, tmp_path):
    from services.cli_quality import eval_cmd, simulate_cmd, trace_cmd

    runner = CliRunner()
    txt = tmp_path / "t.txt"
    txt.write_text(TEXT)
    r = runner.invoke(eval_cmd, ["--model", str(models / "k1"), "--reference", str(models / "dense"),
                                 "--text", str(txt), "--windows", "2", "--window", "64", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "ratio" in r.output and "mean KL" in r.output
    out = tmp_path / "tr.npz"
    r = runner.invoke(trace_cmd, ["--model", str(models / "k1"), "--out", str(out), "--heldout",
                                  "--tokens", "128", "--window", "64"])
    assert r.exit_code == 0, r.output
    tr = RoutingTrace.load(out)
    assert len(tr) == 2 * 64 * 2 and trace_info(out)["mode"] == "prefill"
    assert trace_info(out)["expert_bytes"] == 3 * 32 * 16 * 4
    gen = tmp_path / "gen.npz"
    r = runner.invoke(trace_cmd, ["--model", str(models / "k1"), "--out", str(gen),
                                  "--generate", "Hello", "--max-tokens", "5"])
    assert r.exit_code == 0, r.output
    assert trace_info(gen)["mode"] == "generate"
    png = tmp_path / "hit.png"
    r = runner.invoke(simulate_cmd, [str(out), "--budget", "25%,50%", "--policy", "lru,belady",
                                     "--plot", str(png), "--per-layer"])
    assert r.exit_code == 0, r.output
    assert "belady" in r.output and png.stat().st_size > 0
    lines = [ln for ln in r.output.splitlines() if ln.strip().startswith(("lru", "belady"))]
    assert len(lines) == 4


def test_cli_typed_errors_exit_2(models, tmp_path):
    from services.cli_quality import eval_cmd, moefy_cmd, simulate_cmd, trace_cmd

    runner = CliRunner()
    r = runner.invoke(moefy_cmd, [str(models / "dense"), "--experts", "5", "--top-k", "2",
                                  "--shared-fraction", "0", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "not divisible" in r.output
    r = runner.invoke(eval_cmd, ["--reference", str(models / "dense")])
    assert r.exit_code == 2 and "exactly one of --model" in r.output
    r = runner.invoke(trace_cmd, ["--model", str(models / "dense"), "--out", str(tmp_path / "t.npz")])
    assert r.exit_code == 2 and "dense model" in r.output
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    r = runner.invoke(simulate_cmd, [str(bad)])
    assert r.exit_code == 2 and "routing trace" in r.output
    r = runner.invoke(simulate_cmd, [str(SHIPPED[0]), "--budget", "150%"])
    assert r.exit_code == 2 and "--budget" in r.output


def test_cli_moefy(models, tmp_path):
    from services.cli_quality import moefy_cmd

    r = CliRunner().invoke(moefy_cmd, [str(models / "dense"), "--experts", "4", "--top-k", "2",
                                       "--shared-fraction", "0.5", "--calib-tokens", "256",
                                       "--out", str(tmp_path / "m"), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "Qwen2MoeForCausalLM" in r.output
    meta = json.loads((tmp_path / "m" / "config.json").read_text())["moestream_moefy"]
    assert meta["calibration"]["tokens"] == 256 and meta["top_k"] == 2
