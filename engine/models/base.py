"""The decoder shared by every architecture: embeddings, N x (attention, FFN), norm, LM head.

Architecture differences are config switches (qk_norm, attention_bias, which layers are sparse,
shared experts); the per-architecture files only describe names. Parameter names equal the
canonical tensor names of engine.loading.source, so weights load with ``load_state_dict``.
Routed experts are not parameters: they come through each SparseMoE's ExpertProvider.

The modules here are the torch reference and nothing else: their forward runs the torch layers.
How a step runs (the native CPU step, per-layer CUDA graphs, or these layers) is chosen per step
by engine.executor, which every caller that runs a step goes through.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from engine.config import ModelConfig
from engine.cuda_graphs import reset as reset_graphs
from engine.kv.base import BatchLayout, KVCache
from engine.layers.attention import Attention
from engine.layers.mlp import SwiGLU
from engine.layers.moe import SparseMoE
from engine.layers.norm import RMSNorm
from engine.layers.rope import Rotary


class Block(nn.Module):
    """A pre-norm residual layer: x + mixer(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)).
    Subclasses give the mixer half (:meth:`mixer_residual`) and ``input_layernorm``,
    ``post_attention_layernorm`` and ``mlp``. engine.cuda_graphs runs the halves apart: each half
    through its graphs where they can run, else these methods."""

    # whether engine.cuda_graphs may run the mixer half as an attention graph (standard attention
    # layers; it still checks the attention module and the step per call)
    graph_attention = True

    def mixer_residual(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: BatchLayout,
                       kv: KVCache, state=None) -> torch.Tensor:
        raise NotImplementedError

    def ffn_residual(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, layout, kv, state=None):
        return self.ffn_residual(self.mixer_residual(x, cos, sin, layout, kv, state))


class DecoderLayer(Block):
    """Architectures pass their own attention / MLP modules (gpt-oss's sinks attention,
    DeepSeek's MLA); the default is standard attention and a SparseMoE or dense SwiGLU by the
    config."""

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

    def mixer_residual(self, x, cos, sin, layout, kv, state=None):
        return x + self.self_attn(self.input_layernorm(x), cos, sin, layout, kv)


LayerFactory = Callable[[ModelConfig, int], nn.Module]


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: LayerFactory = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# (layer, x, cos, sin, layout, kv, state) -> x: how a step runs one layer (engine.cuda_graphs)
LayerRunner = Callable[..., torch.Tensor]


class CausalLM(nn.Module):
    # bumped by :meth:`modules_changed`: what was built from the modules (engine.executor's
    # native step) is stale when it differs
    revision = 0

    def __init__(self, cfg: ModelConfig, layer: LayerFactory = DecoderLayer) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg, layer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, max_positions=min(cfg.max_position_embeddings, 4096))

    def native_step_type(self):
        """The class of this architecture's native step (engine.step.NativeStep or a subclass):
        what engine.executor builds when the native path can run this model."""
        from engine.step import NativeStep

        return NativeStep

    def modules_changed(self) -> None:
        """Call after swapping modules (engine.quant.linear does) or their expert provider: any
        captured CUDA graphs are dropped, and the revision moves on so that a native step built
        from the old modules is rebuilt."""
        self.revision += 1
        reset_graphs(self)

    @property
    def moe_blocks(self) -> list[SparseMoE]:
        return [l.mlp for l in self.model.layers if isinstance(l.mlp, SparseMoE)]

    @contextmanager
    def step_state(self, layout: BatchLayout, kv: KVCache, rows: list[int] | None) -> Iterator[object]:
        """Around one step: the per-sequence state the layers read beside the KV cache (None
        here; hybrid models position and advance their recurrent state)."""
        yield None

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, layout: BatchLayout, kv: KVCache,
                all_logits: bool = False, rows: list[int] | None = None) -> torch.Tensor:
        """The torch reference of one step: tokens [T] (flat over the batch) -> logits [T, V] if
        all_logits, [len(rows), V] for the flat rows ``rows`` (speculative verification: a
        sequence's drafts), else [S, V], one row per sequence for its last token."""
        with self.step_state(layout, kv, rows) as state:
            return self.run_layers(tokens, layout, kv, state, all_logits, rows)

    def run_layers(self, tokens: torch.Tensor, layout: BatchLayout, kv: KVCache, state, all_logits: bool,
                   rows: list[int] | None, run_layer: LayerRunner | None = None) -> torch.Tensor:
        """Embeddings, every layer, final norm and LM head. ``run_layer``: how each layer runs
        (engine.executor passes the CUDA-graph runner); None: the layer's own forward."""
        device = self.model.embed_tokens.weight.device
        tokens = tokens.to(device)  # callers build them on the CPU
        cos, sin = self.rotary.cos_sin(layout.positions().to(device))
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = (layer(x, cos, sin, layout, kv, state) if run_layer is None
                 else run_layer(layer, x, cos, sin, layout, kv, state))
        self.tap_hidden(x, layout)
        return self.final_logits(x, layout, all_logits, rows)

    def tap_hidden(self, x: torch.Tensor, layout: BatchLayout) -> None:
        """Hand the final hidden states x [T, H] (before the final norm, every row of the step)
        to the taps that asked for them (``hidden_taps``: the MTP drafter reads its sequence's
        rows, engine.models.qwen3_5_moe.mtp_draft). The torch layers and the native step
        (engine.step.NativeStep.forward) both call this."""
        for tap in self.__dict__.get("hidden_taps", ()):
            tap(x, layout)

    def final_logits(self, x: torch.Tensor, layout: BatchLayout, all_logits: bool,
                     rows: list[int] | None = None) -> torch.Tensor:
        """Final norm and LM head of every row (all_logits), of ``rows``, or of each sequence's
        last one."""
        if not all_logits:
            rows = rows if rows is not None else layout.last_rows()
            x = x[torch.tensor(rows, device=x.device)]
        return self.lm_head(self.model.norm(x)).float()
