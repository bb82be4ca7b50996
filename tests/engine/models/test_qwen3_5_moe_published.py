"""`moestream info` on the published Qwen3.5-MoE configs (engine/models/qwen3_5_moe/published/):
total and active parameters against transformers' own model built from the same config on the
meta device (text part: the language model and the head; the vision tower and the MTP head are
not served), and the KV / recurrent state per sequence against their definitions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from engine.configio.fields import read_hf_config_json
from engine.configio.hf import config_from_hf_dict
from services.cli import _human, main

PUBLISHED = Path(__file__).resolve().parents[3] / "engine" / "models" / "qwen3_5_moe" / "published"
NAMES = ["Qwen3.5-35B-A3B", "Qwen3.5-122B-A10B", "Qwen3.5-397B-A17B"]


def transformers_counts(path: Path) -> tuple[int, int]:
    """(total, active per token) text parameters of transformers' Qwen3_5MoeForConditionalGeneration
    on the meta device: routed experts count top_k / num_experts of theirs as active, the input
    embedding one row."""
    import transformers as T

    raw = json.loads(path.read_text())
    cfg = T.Qwen3_5MoeConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = T.Qwen3_5MoeForConditionalGeneration(cfg)
    tc = cfg.text_config
    total = active = 0
    for name, p in model.named_parameters():
        if name.startswith("model.visual."):
            continue
        n = p.numel()
        total += n
        if ".mlp.experts." in name:
            n = n * tc.num_experts_per_tok // tc.num_experts
        elif name.endswith("embed_tokens.weight"):
            n = tc.hidden_size
        active += n
    return total, active


@pytest.mark.parametrize("name", NAMES)
def test_parameter_counts_equal_transformers(name):
    path = PUBLISHED / f"{name}.json"
    cfg = config_from_hf_dict(read_hf_config_json(path), source=path)
    assert cfg.arch == "qwen3_5_moe"
    counts = cfg.parameter_counts()
    assert (counts["total"], counts["active"]) == transformers_counts(path)


@pytest.mark.parametrize("name", NAMES)
def test_info_prints_parameters_bytes_kv_and_state(name):
    path = PUBLISHED / f"{name}.json"
    tc = json.loads(path.read_text())["text_config"]
    r = CliRunner().invoke(main, ["info", str(path)])
    assert r.exit_code == 0, r.output
    total, active = transformers_counts(path)
    out = r.output
    assert f"total {_human(total)}, active per token {_human(active)}" in out
    attn = tc["layer_types"].count("full_attention")
    lin = tc["num_hidden_layers"] - attn
    kv_token = 2 * attn * tc["num_key_value_heads"] * tc["head_dim"] * 2  # K and V, bf16
    conv = (2 * tc["linear_num_key_heads"] * tc["linear_key_head_dim"]
            + tc["linear_num_value_heads"] * tc["linear_value_head_dim"])
    # fp32: the conv window (kernel - 1 past inputs per channel) and one dk x dv matrix per value head
    state = lin * 4 * (conv * (tc["linear_conv_kernel_dim"] - 1)
                       + tc["linear_num_value_heads"] * tc["linear_key_head_dim"] * tc["linear_value_head_dim"])
    assert f"kv cache      {_human(kv_token, 'B')} per context token" in out
    assert f"state         {_human(state, 'B')} per sequence" in out
    assert "bytes/token   bf16:" in out and "read/token    dense" in out
