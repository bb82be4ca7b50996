"""Build a model from a config and a TensorSource: dense weights into the module, routed experts
into an ExpertProvider (all resident by default; the expert cache supplies its own)."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.layers.moe import DenseExpert, ExpertProvider, ResidentExperts
from engine.loading.source import TensorSource, expert_name, parse_expert_name
from engine.models.base import CausalLM


def dense_state_dict(cfg: ModelConfig, source: TensorSource, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every non-expert tensor the model needs, cast to ``dtype``."""
    with torch.device("meta"):
        skeleton = model_class(cfg)(cfg)
    wanted = [n for n in skeleton.state_dict() if not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    return {n: source.get(n).to(dtype) for n in wanted}


def resident_experts(cfg: ModelConfig, source: TensorSource, dtype: torch.dtype) -> ResidentExperts:
    experts = {}
    for layer in cfg.moe_layers:
        for e in range(cfg.moe.num_experts):  # type: ignore[union-attr]
            g, u, d = (source.get(expert_name(layer, e, p)).to(dtype)
                       for p in ("gate_proj", "up_proj", "down_proj"))
            experts[(layer, e)] = DenseExpert(g, u, d)
    return ResidentExperts(experts)


def build_model(cfg: ModelConfig, source: TensorSource, *, dtype: torch.dtype = torch.float32,
                provider: ExpertProvider | None = None) -> CausalLM:
    """The model with dense weights loaded and ``provider`` (default: every expert resident)
    attached to each sparse layer."""
    state = dense_state_dict(cfg, source, dtype)
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
