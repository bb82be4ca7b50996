"""The native step of Qwen3-Next (engine.models.qwen3_next): gated attention and Gated DeltaNet
layers, each followed by the MoE, as a few native calls per layer (engine.step's contract).

Per layer, for every row of the step (prefill chunks, decode rows and verify rows together):

    h = attn_block(x)        gated attention: the Attn of engine/csrc/step.cpp with q_proj's per-head
                             [q_h | gate_h] rows, output x sigmoid(gate), RoPE on the first
                             rotary_dim dims, KV at the layer's compact attention index
      | deltanet_block(x)    Gated DeltaNet (engine/csrc/deltanet_block.cpp): norm, in_proj_qkvz,
                             in_proj_ba, then per sequence the causal conv and the gated delta rule
                             over its rows in order on its state slot (a verify row's state also
                             written after each position into its checkpoint buffers, for
                             KVCache.keep), gated RMSNorm x silu(z), out_proj, residual; returns the
                             post-attention norm
    route + ffn_block        the MoE with its sigmoid-gated shared expert (engine.step.NativeStep)

Zero-centred norms run as plain RMSNorms with the weight 1 + w (no kernel change). The native
block runs the delta rule position by position (the recurrent form); the torch layers
(engine.layers.deltanet, the reference path) run a prefill chunk in the chunked form, equal up to
float32 summation order. The recurrent state is positioned (``begin``, which also allocates the
checkpoints) and advanced by the model's forward around this step, as for the torch layers.
"""

from __future__ import annotations

import torch

from engine.kv.base import BatchLayout, KVCache
from engine.quant.kernels import DIRECT_MAX_T, int8_activations
from engine.step import NativeStep, _f32, _lin


def _centred(norm) -> torch.Tensor:
    """A CentredRMSNorm's weight as applied: 1 + w (float32)."""
    return (1.0 + norm.weight.detach().float()).contiguous()


class HybridStep(NativeStep):
    """Per-layer native handles of a Qwen3-Next model."""

    def __init__(self, model, ext) -> None:
        self.rotary_dim = model.config.rotary_dim
        super().__init__(model, ext)

    def _mixer(self, layer):
        ext, eps = self.ext, self.eps
        ln1, ln2 = _centred(layer.input_layernorm), _centred(layer.post_attention_layernorm)
        if layer.linear:
            d = layer.linear_attn
            return ext.DeltaNet(_lin(ext, d.in_proj_qkvz), _lin(ext, d.in_proj_ba), _lin(ext, d.out_proj), ln1, ln2,
                                _f32(d.conv1d.weight[:, 0, :]), _f32(-d.A_log.float().exp()), _f32(d.dt_bias),
                                _f32(d.norm.weight), d.nk, d.nv, d.dk, d.dv, eps)
        a = layer.self_attn
        attn = ext.Attn(_lin(ext, a.q_proj), _lin(ext, a.k_proj), _lin(ext, a.v_proj), _lin(ext, a.o_proj),
                        ln1, ln2, _centred(a.q_norm), _centred(a.k_norm), a.nh, a.nkv, a.d, eps)
        attn.gated, attn.rotary_dim = True, self.rotary_dim
        return attn

    def _norm_weight(self, norm) -> torch.Tensor:
        return _centred(norm)

    @classmethod
    def for_model(cls, model) -> "HybridStep | None":
        if model.config.rotary_dim % 2:
            return None
        step = super().for_model(model)
        return step if step is None or hasattr(step.ext, "deltanet_block") else None

    def forward(self, model, tokens: torch.Tensor, layout: BatchLayout, kv: KVCache, state=None,
                all_logits: bool = False, rows: list[int] | None = None) -> torch.Tensor | None:
        """Logits as the model's forward returns them, or None when the KV cache cannot hand out
        block tables (the caller runs the torch layers). ``state``: the RecurrentState, already
        positioned (``begin``) for ``layout``; the caller advances it after."""
        view = kv.native_view(layout, tokens.device)
        if view is None:
            return None
        storage, tables = view
        ext, dmt, i8a = self.ext, DIRECT_MAX_T, int8_activations()
        qlens, ctxs = list(layout.query_lens), list(layout.context_lens)
        positions = [c + i for c, n in zip(ctxs, qlens) for i in range(n)]
        cos, sin = model.rotary.tables(max(positions) + 1)
        slots = [state.slot[s] for s in layout.seq_ids]
        verify = [s for s, n in zip(layout.seq_ids, qlens) if n > 1 and state.checkpoint(0, s) is not None]
        x = model.model.embed_tokens(tokens).float().contiguous()
        for i, layer in enumerate(model.model.layers):
            if not layer.linear:
                h = ext.attn_block(self.attn[i], x, cos, sin, positions, storage, layer.self_attn.kv_layer,
                                   tables, qlens, ctxs, dmt, i8a)
            else:
                ck_conv, ck_matrix = self._checkpoints(state, layer.linear_attn.state_layer, layout, verify)
                h = ext.deltanet_block(self.attn[i], x, state.conv, state.matrix, layer.linear_attn.state_layer,
                                       slots, qlens, ck_conv, ck_matrix, dmt, i8a)
            self._mlp(layer.mlp, i, x, h)
        model.tap_hidden(x, layout)  # the MTP drafter's hidden states (engine.models.qwen3_next)
        return self._logits(model, x, layout, all_logits, rows)

    @staticmethod
    def _checkpoints(state, layer: int, layout: BatchLayout, verify: list[int]):
        """Per sequence the verify row's checkpoint buffers of this DeltaNet layer, or None; two
        empty lists when no sequence of the step is a verify row."""
        if not verify:
            return [], []
        cks = [state.checkpoint(layer, s) if s in verify else None for s in layout.seq_ids]
        return [None if c is None else c[0] for c in cks], [None if c is None else c[1] for c in cks]
