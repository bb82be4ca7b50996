"""ModelConfig from its plain-dict form (``ModelConfig.to_dict``, as the store manifest keeps
it): nested dataclasses rebuilt, lists back to tuples, ``arch_params`` by the architecture's
own reader (ArchSpec.params_from_dict)."""

from __future__ import annotations

from typing import Any, Mapping

from engine.config import LinearAttentionConfig, ModelConfig, MoEConfig, RopeConfig
from engine.models.registry import get_spec


def config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    d = dict(d)
    spec = get_spec(d["arch"])  # UnsupportedArchitectureError for a key the registry lacks
    rope = dict(d["rope"])
    rope["freq_factors"] = tuple(rope.get("freq_factors", ()))
    d["rope"] = RopeConfig(**rope)
    if d.get("moe") is not None:
        moe = dict(d["moe"])
        moe["mlp_only_layers"] = tuple(moe.get("mlp_only_layers", ()))
        d["moe"] = MoEConfig(**moe)
    if d.get("linear_attn") is not None:
        la = dict(d["linear_attn"])
        la["full_attention_layers"] = tuple(la.get("full_attention_layers", ()))
        d["linear_attn"] = LinearAttentionConfig(**la)
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    if d.get("arch_params") is not None:
        d["arch_params"] = spec.params_from_dict(d["arch_params"])  # type: ignore[misc]
    return ModelConfig(**d)

