"""Qwen3-MoE: RMSNorm over head_dim on q and k before RoPE, no qkv bias, no shared expert,
``norm_topk_prob`` renormalises the top-k weights."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from engine.configio.fields import hf_qwen_moe
from engine.models.spec import ArchSpec


def hf_fields(raw: Mapping[str, Any], integer, source: object) -> dict[str, Any]:
    return {"moe": hf_qwen_moe(raw, integer, source, shared=False), "qk_norm": True}


def gguf_fields(get, fields: dict[str, Any]) -> dict[str, Any]:
    """q/k norms; the top-k renormalised unless ``expert_weights_norm`` says otherwise."""
    moe = fields["moe"] and dataclasses.replace(
        fields["moe"], norm_topk_prob=bool(get("expert_weights_norm", True)))
    return {**fields, "moe": moe, "qk_norm": True}


SPEC = ArchSpec(
    key="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    gguf_arch="qwen3moe",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
)
