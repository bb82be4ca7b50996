"""Build a model from a config and a TensorSource: dense weights into the module, routed experts
into an ExpertProvider (all resident by default; the expert cache supplies its own)."""

from __future__ import annotations

from typing import Callable

import torch

from engine.config import ModelConfig
from engine.layers.moe import DenseExpert, ExpertProvider, ResidentExperts
from engine.loading.source import TensorSource, expert_name, parse_expert_name
from engine.models.base import CausalLM


def dense_state_dict(cfg: ModelConfig, source: TensorSource, dtype: torch.dtype,
                     as_stored: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every non-expert tensor the model needs, cast to ``dtype``; those ``as_stored`` names are
    left as the source holds them (a zero-copy view of a mapped file: no full-precision copy),
    for a caller that converts them one at a time next (engine.quant.linear.quantize_dense)."""
    with torch.device("meta"):
        skeleton = model_class(cfg)(cfg)
    wanted = [n for n in skeleton.state_dict() if not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    return {n: source.get(n) if as_stored is not None and as_stored(n) else source.get(n).to(dtype)
            for n in wanted}


def resident_experts(cfg: ModelConfig, source: TensorSource, dtype: torch.dtype) -> ResidentExperts:
    experts = {}
    for layer in cfg.moe_layers:
        for e in range(cfg.moe.num_experts):  # type: ignore[union-attr]
            g, u, d = (source.get(expert_name(layer, e, p)).to(dtype)
                       for p in ("gate_proj", "up_proj", "down_proj"))
            experts[(layer, e)] = DenseExpert(g, u, d)
    return ResidentExperts(experts)


def build_model(cfg: ModelConfig, source: TensorSource, *, dtype: torch.dtype = torch.float32,
                provider: ExpertProvider | None = None,
                as_stored: Callable[[str], bool] | None = None) -> CausalLM:
    """The model with dense weights loaded and ``provider`` (default: every expert resident)
    attached to each sparse layer. ``as_stored``: see :func:`dense_state_dict` (those weights
    are not in ``dtype`` until the caller converts them)."""
    state = dense_state_dict(cfg, source, dtype, as_stored)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    model.rotary = type(model.rotary)(cfg.rope, cfg.rotary_dim, min(cfg.max_position_embeddings, 4096))
    if cfg.moe is not None:
        provider = provider or resident_experts(cfg, source, dtype)
        for block in model.moe_blocks:
            block.provider = provider
    return model.eval()


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The module class of ``cfg``'s architecture: its own (ArchSpec.model_class) or the shared
    decoder."""
    from engine.models.registry import get_spec

    own = get_spec(cfg.arch).model_class
    return own() if own is not None else CausalLM


def is_expert_tensor(name: str) -> bool:
    return parse_expert_name(name) is not None
