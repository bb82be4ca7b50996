"""Qwen3-Next: a hybrid of Gated DeltaNet (linear attention with a per-sequence recurrent state)
and gated full attention (every ``full_attention_interval``-th layer, 4 in the 80B-A3B), each
followed by a sparse MoE (512 experts, top-10 renormalised, plus a shared expert scaled by
sigmoid(x @ shared_expert_gate)). Norms are zero-centred ((1 + w)); RoPE covers the first
25% of each head. HF tensor names are already canonical (``linear_attn.*``, ``self_attn.*``,
per-expert ``mlp.experts.{j}.*``); the MTP weights of released checkpoints are not part of the
model (Qwen3.5-MoE's drafter reads them: engine.models.qwen3_5_moe.mtp).

The KV cache holds only the attention layers (compact indices 0..La-1); the DeltaNet layers'
state lives in engine.kv.state (a HybridKVCache in the serving engine, a growable store beside
any other cache).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kv.base import BatchLayout, KVCache
from engine.kv.state import RecurrentState, recurrent_state_for
from engine.layers.centred_norm import CentredRMSNorm
from engine.layers.deltanet import GatedDeltaNet
from engine.layers.gated_attention import GatedAttention
from engine.layers.mlp import SwiGLU
from engine.layers.moe import SparseMoE
from engine.layers.rope import Rotary
from engine.models.base import Block, CausalLM


class HybridLayer(Block):
    graph_attention = False  # the mixer half runs eager; the feed-forward half may run as graphs

    def __init__(self, cfg: ModelConfig, layer: int, kv_layer: int, state_layer: int) -> None:
        super().__init__()
        self.linear = cfg.is_linear_attention_layer(layer)
        self.input_layernorm = CentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, layer, state_layer)
        else:
            self.self_attn = GatedAttention(cfg, layer, kv_layer)
        self.post_attention_layernorm = CentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (SparseMoE(cfg, layer) if cfg.is_moe_layer(layer)
                               else SwiGLU(cfg.hidden_size, cfg.intermediate_size))

    def mixer_residual(self, x, cos, sin, layout, kv, state=None):
        h = self.input_layernorm(x)
        h = self.linear_attn(h, layout, state) if self.linear else self.self_attn(h, cos, sin, layout, kv)
        return x + h


class HybridDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers, kv_i, st_i = [], 0, 0
        for i in range(cfg.num_layers):
            layers.append(HybridLayer(cfg, i, kv_i, st_i))
            if cfg.is_linear_attention_layer(i):
                st_i += 1
            else:
                kv_i += 1
        self.layers = nn.ModuleList(layers)
        self.norm = CentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3NextForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = HybridDecoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.rotary_dim, max_positions=min(cfg.max_position_embeddings, 4096))

    def native_step_type(self):
        """Gated attention and DeltaNet layers as native calls (engine.models.qwen3_next.step)."""
        from engine.models.qwen3_next.step import HybridStep

        return HybridStep

    @contextmanager
    def step_state(self, layout: BatchLayout, kv: KVCache, rows: list[int] | None) -> Iterator[RecurrentState]:
        """The DeltaNet layers read and advance each sequence's recurrent state (engine.kv.state),
        which must stand at the sequence's context length: positioned here before the step
        (raises before computing from a wrong state), advanced after it. A sequence of several
        tokens whose every row is in ``rows`` is a speculative verify row: its state is kept
        after each position, for ``kv.keep`` after acceptance."""
        state = recurrent_state_for(kv, self.config)
        state.begin(layout, verify_rows(layout, rows))
        yield state
        state.advance(layout)

    def dense_linear_slots(self) -> list[tuple[nn.Module, str]]:
        """(parent, attribute) of every dense linear engine.quant.linear may swap."""
        out: list[tuple[nn.Module, str]] = []
        for layer in self.model.layers:
            if layer.linear:
                out += [(layer.linear_attn, n) for n in ("in_proj_qkvz", "in_proj_ba", "out_proj")]
            else:
                out += [(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            mlp = layer.mlp.shared_expert if isinstance(layer.mlp, SparseMoE) else layer.mlp
            if mlp is not None:
                out += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        out.append((self, "lm_head"))
        return out


def verify_rows(layout: BatchLayout, rows: list[int] | None) -> frozenset[int]:
    """The sequences of ``layout`` with more than one new token whose every row's logits are
    asked for: speculative verification (engine.runner feeds [last, d_1..d_k] and samples
    each row), whose state the caller may cut back to any of those positions. (All rows of a
    longer span, e.g. a prompt's logprobs, are computed but not checkpointed: see
    engine.kv.state.MAX_CHECKPOINTS.)"""
    if not rows:
        return frozenset()
    wanted = set(rows)
    return frozenset(seq for seq, start, n in zip(layout.seq_ids, layout.offsets, layout.query_lens)
                     if n > 1 and all(r in wanted for r in range(start, start + n)))


def info_lines(cfg: ModelConfig, human) -> list[str]:
    """Extra lines of `moestream info` for a model with DeltaNet layers: the layer mix, the
    recurrent state one sequence keeps (read and rewritten by every decoded token), KV per token
    of the attention layers alone, and the bytes one decoded token reads split into dense (bf16),
    routed experts (4.5-bit) and state."""
    from engine.kv.state import slot_bytes

    la = cfg.linear_attn
    assert la is not None
    counts = cfg.parameter_counts()
    n_lin = cfg.num_layers - len(cfg.attention_layers)
    state = slot_bytes(cfg)
    kv_token = len(cfg.attention_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    dense = (counts["active"] - counts["routed_active"]) * 2
    experts = counts["routed_active"] * 4.5 / 8
    return [
        f"layers        {n_lin} Gated DeltaNet (k heads {la.num_key_heads}x{la.key_head_dim}, v heads "
        f"{la.num_value_heads}x{la.value_head_dim}, conv {la.conv_kernel}) + {len(cfg.attention_layers)} gated "
        f"attention (RoPE on {cfg.rotary_dim} of {cfg.head_dim} dims)",
        f"state         {human(state, 'B')} per sequence (fp32 conv windows + delta-rule matrices), "
        f"KV {human(kv_token, 'B')} per token (bf16, attention layers only)",
        f"read/token    dense {human(dense, 'B')} (bf16) + routed experts {human(experts, 'B')} (4.5 b/w) "
        f"+ state {human(2 * state, 'B')} (read and rewritten) = {human(dense + experts + 2 * state, 'B')} "
        f"per sequence",
    ]
