"""Qwen2-MoE: qkv bias, optional top-k renormalisation, a shared expert scaled by
``sigmoid(x @ shared_expert_gate)``, ``decoder_sparse_step`` / ``mlp_only_layers``."""

from __future__ import annotations

from typing import Any, Mapping

from engine.configio.fields import hf_qwen_moe
from engine.models.spec import ArchSpec


def hf_fields(raw: Mapping[str, Any], integer, source: object) -> dict[str, Any]:
    """Routed experts with the gated shared expert; bias on q/k/v unless ``qkv_bias`` is false."""
    return {"moe": hf_qwen_moe(raw, integer, source, shared=True),
            "attention_bias": bool(raw.get("qkv_bias", True))}


SPEC = ArchSpec(
    key="qwen2_moe",
    hf_architectures=("Qwen2MoeForCausalLM",),
    gguf_arch="qwen2moe",
    hf_fields=hf_fields,
)
