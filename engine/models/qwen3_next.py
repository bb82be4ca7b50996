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

from typing import Iterator

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kv.base import BatchLayout, KVCache
from engine.kv.state import recurrent_state_for
from engine.layers.centred_norm import CentredRMSNorm
from engine.layers.deltanet import GatedDeltaNet
from engine.layers.gated_attention import GatedAttention
from engine.layers.mlp import SwiGLU
from engine.layers.moe import SparseMoE
from engine.layers.rope import Rotary
from engine.cuda_graphs import mlp_residual, prepare as prepare_graphs
from engine.models.base import CausalLM
from engine.threads import step_threads


class HybridLayer(nn.Module):
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

    def forward(self, x, cos, sin, layout, kv, state):
        h = self.input_layernorm(x)
        h = self.linear_attn(h, layout, state) if self.linear else self.self_attn(h, cos, sin, layout, kv)
        x = x + h
        return mlp_residual(self, x)  # x + mlp(norm(x)): per-layer graphs where they are on


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
        """Gated attention and DeltaNet layers as native calls (engine.step_hybrid)."""
        from engine.step_hybrid import HybridStep

        return HybridStep

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, layout: BatchLayout, kv: KVCache,
                all_logits: bool = False, rows: list[int] | None = None) -> torch.Tensor:
        """As CausalLM.forward; the DeltaNet layers read and advance each sequence's recurrent
        state (engine.kv.state), which must stand at the sequence's context length. A sequence
        of several tokens whose every row is in ``rows`` is a speculative verify row: its state
        is kept after each position, for ``kv.keep`` after acceptance."""
        device = self.model.embed_tokens.weight.device
        tokens = tokens.to(device)
        state = recurrent_state_for(kv, self.config)
        state.begin(layout, verify_rows(layout, rows))  # raises before computing from a wrong state
        with step_threads(tokens.shape[0], device):
            native = self.native_step() if device.type == "cpu" else None
            out = native.forward(self, tokens, layout, kv, state, all_logits, rows) if native is not None else None
            if out is None:  # the torch layers: the reference path (per-layer CUDA graphs on a GPU)
                cos, sin = self.rotary.cos_sin(layout.positions().to(device))
                x = self.model.embed_tokens(tokens)
                prepare_graphs(self, device)
                for layer in self.model.layers:
                    x = layer(x, cos, sin, layout, kv, state)
                self.tap_hidden(x, layout)
                out = self.final_logits(x, layout, all_logits, rows)
            state.advance(layout)
            return out

    def tap_hidden(self, x: torch.Tensor, layout: BatchLayout) -> None:
        """Hand the final hidden states x [T, H] (before the final norm, every row of the
        forward) to the taps that asked for them: the MTP drafter reads its sequence's rows
        (engine.models.qwen3_5_moe.mtp_draft). Both the torch and the native step call this."""
        for tap in self.__dict__.get("hidden_taps", ()):
            tap(x, layout)

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


def expected_tensors(c: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(canonical name, shape) of every tensor a Qwen3-Next config implies, in layer order
    (engine.loading.validate)."""
    from engine.loading.validate import mlp_tensors

    la = c.linear_attn
    assert la is not None
    V, H, D = c.vocab_size, c.hidden_size, c.head_dim
    yield "model.embed_tokens.weight", (V, H)
    yield "model.norm.weight", (H,)
    if not c.tie_word_embeddings:
        yield "lm_head.weight", (V, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (H,)
        yield p + "post_attention_layernorm.weight", (H,)
        if c.is_linear_attention_layer(i):
            a = p + "linear_attn."
            yield a + "in_proj_qkvz.weight", (2 * la.key_dim + 2 * la.value_dim, H)
            yield a + "in_proj_ba.weight", (2 * la.num_value_heads, H)
            yield a + "conv1d.weight", (la.conv_dim, 1, la.conv_kernel)
            yield a + "dt_bias", (la.num_value_heads,)
            yield a + "A_log", (la.num_value_heads,)
            yield a + "norm.weight", (la.value_head_dim,)
            yield a + "out_proj.weight", (H, la.value_dim)
        else:
            a = p + "self_attn."
            q_out, kv_out = c.num_heads * D, c.num_kv_heads * D
            yield a + "q_proj.weight", (2 * q_out, H)
            yield a + "k_proj.weight", (kv_out, H)
            yield a + "v_proj.weight", (kv_out, H)
            yield a + "o_proj.weight", (H, q_out)
            if c.attention_bias:
                yield a + "q_proj.bias", (2 * q_out,)
                yield a + "k_proj.bias", (kv_out,)
                yield a + "v_proj.bias", (kv_out,)
                yield a + "o_proj.bias", (H,)
            yield a + "q_norm.weight", (D,)
            yield a + "k_norm.weight", (D,)
        yield from mlp_tensors(c, i)


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
