"""`moestream info` on the reconstructed Qwen4-Exp config (engine/models/qwen4_exp/published/):
total and active parameters against transformers' own model built from the same file on the
meta device (text part; the PLE tables counted apart, a token reading one row per hash head),
and the lines by part: experts, dense, PLE rows, KV per token, state per sequence."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner

from engine.configio.fields import read_hf_config_json
from engine.configio.hf import config_from_hf_dict
from engine.kv.state import slot_bytes
from services.cli import _human, main

PATH = Path(__file__).resolve().parents[3] / "engine" / "models" / "qwen4_exp" / "published" / "Qwen3.8-Flash-Next.json"


def transformers_counts() -> dict[str, int]:
    import transformers as T

    raw = json.loads(PATH.read_text())
    cfg = T.Qwen4ExpConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = T.Qwen4ExpForConditionalGeneration(cfg)
    tc = cfg.text_config
    out = dict(total=0, active=0, ple_total=0)
    for name, p in model.named_parameters():
        if name.startswith("model.visual."):
            continue
        n = p.numel()
        out["total"] += n
        if "ngram_embedding" in name:
            out["ple_total"] += n
            n = (tc.ngram_size - 1) * tc.heads_per_ngram * p.shape[1]  # one row per hash head
        elif ".mlp.experts." in name:
            n = n * tc.num_experts_per_tok // tc.num_experts
        elif name.endswith("embed_tokens.weight"):
            n = tc.hidden_size
        out["active"] += n
    return out


def test_parameter_counts_equal_transformers():
    cfg = config_from_hf_dict(read_hf_config_json(PATH), source=PATH)
    assert cfg.arch == "qwen4_exp" and len(cfg.attention_layers) == 12 and cfg.arch_params.qsa
    counts = cfg.parameter_counts()
    assert {k: counts[k] for k in ("total", "active", "ple_total")} == transformers_counts()
    # the shape: ~125B without the table, ~6B active, 2.76 MB per expert at 4.5 bits
    assert 124e9 < counts["total"] - counts["ple_total"] < 126e9 and 5.5e9 < counts["active"] < 6.5e9
    assert abs(3 * 2560 * 640 * 4.5 / 8 - 2.76e6) < 0.01e6


def test_info_prints_parts_per_token_and_state_per_sequence():
    cfg = config_from_hf_dict(read_hf_config_json(PATH), source=PATH)
    c = cfg.parameter_counts()
    r = CliRunner().invoke(main, ["info", str(PATH)])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "architecture  qwen4_exp  layers=48 hidden=2560" in out
    assert f"total {_human(c['total'])}, active per token {_human(c['active'])}" in out
    assert f"without the PLE tables: total {_human(c['total'] - c['ple_total'])}" in out
    assert f"experts {_human(c['routed_active'] * 4.5 / 8, 'B')} (4.5 b/w)" in out
    assert f"PLE rows {_human(16 * 160, 'B')} (FP8" in out
    kv = 12 * 2 * 2 * 256 * 2 + 12 * 128 * 2
    assert f"KV {_human(kv, 'B')} written per token" in out
    ple_state = 4 * 2560 * 3 * 3 * 4 + 2 * 8
    deltanet = 36 * ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) * 4
    assert slot_bytes(cfg) == deltanet + ple_state
    assert f"state {_human(deltanet + ple_state, 'B')} (DeltaNet {_human(deltanet, 'B')}" in out
