"""The decoder shared by every architecture: embeddings, N x (attention, FFN), norm, LM head.

Architecture differences are config switches (qk_norm, attention_bias, which layers are sparse,
shared experts); the per-architecture files only describe names. Parameter names equal the
canonical tensor names of engine.loading.source, so weights load with ``load_state_dict``.
Routed experts are not parameters: they come through each SparseMoE's ExpertProvider.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.cuda_graphs import decoder_layer, prepare as prepare_graphs
from engine.cuda_graphs import reset as reset_graphs
from engine.kv.base import BatchLayout, KVCache, last_rows
from engine.layers.attention import Attention
from engine.layers.mlp import SwiGLU
from engine.layers.moe import SparseMoE
from engine.layers.norm import RMSNorm
from engine.layers.rope import Rotary
from engine.threads import step_threads


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). Architectures pass
    their own attention / MLP modules (gpt-oss's sinks attention, DeepSeek's MLA); the default
    is standard attention and a SparseMoE or dense SwiGLU by the config."""

    def __init__(self, cfg: ModelConfig, layer: int, attn: nn.Module | None = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn if attn is not None else Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = mlp if mlp is not None else (
            SparseMoE(cfg, layer) if cfg.is_moe_layer(layer)
            else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(self, x, cos, sin, layout, kv):
        # x + attn(norm(x)), then x + mlp(norm(x)): through per-layer graphs where they are on
        return decoder_layer(self, x, cos, sin, layout, kv)


LayerFactory = Callable[[ModelConfig, int], nn.Module]


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: LayerFactory = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: LayerFactory = DecoderLayer) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg, layer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, max_positions=min(cfg.max_position_embeddings, 4096))

    def native_step(self):
        """The fused native step for this model (engine.step), built on first use and again after
        a runtime-option change or :meth:`invalidate_native_step`; None: the torch layers."""
        from engine.options import generation

        cached = self.__dict__.get("_native")
        if cached is None or cached[0] != generation():
            cached = self.__dict__["_native"] = (generation(), self.native_step_type().for_model(self))
        return cached[1]

    def native_step_type(self):
        """The class of this architecture's native step (engine.step.NativeStep or a subclass)."""
        from engine.step import NativeStep

        return NativeStep

    def invalidate_native_step(self) -> None:
        """Call after swapping modules (engine.quant.linear does): the native step and any
        captured CUDA graphs read the old ones."""
        self.__dict__.pop("_native", None)
        reset_graphs(self)

    @property
    def moe_blocks(self) -> list[SparseMoE]:
        return [l.mlp for l in self.model.layers if isinstance(l.mlp, SparseMoE)]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, layout: BatchLayout, kv: KVCache,
                all_logits: bool = False, rows: list[int] | None = None) -> torch.Tensor:
        """tokens [T] (flat over the batch) -> logits [T, V] if all_logits, [len(rows), V] for
        the flat rows ``rows`` (speculative verification: a sequence's drafts), else [S, V], one
        row per sequence for its last token."""
        device = self.model.embed_tokens.weight.device
        tokens = tokens.to(device)  # callers build them on the CPU
        with step_threads(tokens.shape[0], device):
            native = self.native_step() if device.type == "cpu" else None
            out = native.forward(self, tokens, layout, kv, all_logits, rows) if native is not None else None
            if out is not None:
                return out
            # the torch layers: the reference path (feed-forward halves through per-layer CUDA
            # graphs on a GPU: engine.cuda_graphs)
            prepare_graphs(self, device)
            positions = layout.positions().to(device)
            cos, sin = self.rotary.cos_sin(positions)
            x = self.model.embed_tokens(tokens)
            for layer in self.model.layers:
                x = layer(x, cos, sin, layout, kv)
            return self.final_logits(x, layout, all_logits, rows)

    def final_logits(self, x: torch.Tensor, layout: BatchLayout, all_logits: bool,
                     rows: list[int] | None = None) -> torch.Tensor:
        """Final norm and LM head of every row (all_logits), of ``rows``, or of each sequence's
        last one."""
        if not all_logits:
            rows = rows if rows is not None else last_rows(layout)
            x = x[torch.tensor(rows, device=x.device)]
        return self.lm_head(self.model.norm(x)).float()
