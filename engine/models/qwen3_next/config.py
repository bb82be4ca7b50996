"""Qwen3-Next's config.json fields beyond the shared decoder's (ArchSpec.hf_fields): the Qwen MoE
block with a gated shared expert, q/k norms, gated attention with partial RoPE, zero-centred
norms and the Gated DeltaNet layers' shapes."""

from __future__ import annotations

from typing import Any, Mapping

from engine.config import LinearAttentionConfig
from engine.configio.fields import hf_qwen_moe, number
from engine.errors import ModelFormatError


def hf_fields(raw: Mapping[str, Any], integer, source: object) -> dict[str, Any]:
    """Which layers are full attention (``layer_types``, else every
    ``full_attention_interval``-th), the DeltaNet shapes, partial RoPE
    (``partial_rotary_factor``, top level or in ``rope_parameters``; default 0.25)."""
    layers = integer("num_hidden_layers")
    moe = hf_qwen_moe(raw, integer, source, shared=True)
    types = raw.get("layer_types")
    if types is not None:
        if not (isinstance(types, list) and len(types) == layers
                and all(t in ("linear_attention", "full_attention") for t in types)):
            raise ModelFormatError(source, f"layer_types must list 'linear_attention' or "
                                           f"'full_attention' for each of the {layers} layers")
        full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    else:
        interval = integer("full_attention_interval", default=4)
        if interval < 1:
            raise ModelFormatError(source, f"full_attention_interval must be >= 1, got {interval}")
        full = tuple(i for i in range(layers) if (i + 1) % interval == 0)
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    prf = raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.25))
    return dict(
        moe=moe,
        qk_norm=True,
        attn_output_gate=True,
        partial_rotary_factor=number(prf, "partial_rotary_factor", source),
        norm_zero_centred=True,
        linear_attn=LinearAttentionConfig(
            num_key_heads=integer("linear_num_key_heads", default=16),
            num_value_heads=integer("linear_num_value_heads", default=32),
            key_head_dim=integer("linear_key_head_dim", default=128),
            value_head_dim=integer("linear_value_head_dim", default=128),
            conv_kernel=integer("linear_conv_kernel_dim", default=4),
            full_attention_layers=full,
        ),
    )
