"""Build a model from a config and a TensorSource: dense weights into the module, routed experts
into an ExpertProvider (all resident by default; the expert cache supplies its own)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from engine.config import ModelConfig
from engine.layers.moe import DenseExpert, ExpertProvider, ResidentExperts
from engine.loading.source import TensorSource, expert_name, parse_expert_name
from engine.models.base import CausalLM


# torch.nn.init's initialisers. On a meta tensor they compute nothing, yet run through torch's
# reference decompositions, whose first use imports torch._dynamo, sympy and triton: building a
# model's skeleton cost ~150 MB of RSS for the rest of the process (measured, 1.3B store).
_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
          "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
_init_lock = threading.Lock()
_init_users = 0


@contextmanager
def _meta_init_skipped() -> Iterator[None]:
    """torch.nn.init's initialisers return a meta tensor untouched (any other: as before, so
    another thread building a real module meanwhile is initialised as usual)."""
    global _init_users
    init = torch.nn.init
    with _init_lock:
        if _init_users == 0:
            for name in _INITS:
                real = getattr(init, name)

                def skip(tensor, *a, _real=real, **k):
                    return tensor if isinstance(tensor, torch.Tensor) and tensor.is_meta else _real(tensor, *a, **k)

                skip.real = real  # type: ignore[attr-defined]
                setattr(init, name, skip)
        _init_users += 1
    try:
        yield
    finally:
        with _init_lock:
            _init_users -= 1
            if _init_users == 0:
                for name in _INITS:
                    setattr(init, name, getattr(init, name).real)


def skeleton(cfg: ModelConfig) -> CausalLM:
    """``cfg``'s model on the meta device (no memory, no initialisation), for stored weights."""
    with torch.device("meta"), _meta_init_skipped():
        return model_class(cfg)(cfg)


def dense_state_dict(cfg: ModelConfig, source: TensorSource, dtype: torch.dtype,
                     as_stored: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every non-expert tensor the model needs, cast to ``dtype``; those ``as_stored`` names are
    left as the source holds them (a zero-copy view of a mapped file: no full-precision copy),
    for a caller that converts them one at a time next (engine.quant.linear.quantize_dense)."""
    wanted = [n for n in skeleton(cfg).state_dict() if not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
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
    model = skeleton(cfg)
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
