"""DeepSeek-V3 on the native step (engine.step): per layer

    h = mla_block(x)               fused norm, q path (q LoRA or q_proj), kv_a -> latent norm +
                                   decoupled RoPE key, the latent written into the paged cache
                                   through the block tables, absorbed attention over the cached
                                   latents, o_proj, residual add; returns the post-attention norm
    ids, w = route_grouped(h)      sigmoid scores, e_score_correction_bias for selection only,
                                   group-limited top-k, normalised weights x routed_scaling_factor
    experts acquired               the expert cache (as for every MoE)
    ffn_block(x, h, ...)           routed experts from their slots + the shared experts (or the
                                   dense SwiGLU of the first first_k_dense_replace layers)

MLA runs in its absorbed form for every token, prefill included (the torch layer expands the
context for prefills of more than ABSORB_MAX_N tokens; the two are equal within float32
tolerance, tests/engine/test_step_deepseek.py). kv_b_proj's key and value parts are kept as
float32 [Nh, dn, R] and [Nh, dv, R] (dequantized once when the dense linears are quantized): they
are small per head and read once per token and head. The other dense linears run through the
native Linear in the format engine.quant.linear gave them.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.mla import MLAttention
from engine.layers.moe import SparseMoE
from engine.quant.kernels import load_extension
from engine.step import EMPTY, NativeStep, _f32, _lin


def _mla(ext: Any, layer, eps: float) -> Any:
    a: MLAttention = layer.self_attn
    lora = hasattr(a, "q_a_proj")
    w = a._kv_b_weight().view(a.nh, a.nope + a.vd, a.rank)
    return ext.MLA(_lin(ext, a.q_a_proj) if lora else None, _lin(ext, a.q_b_proj if lora else a.q_proj),
                   _lin(ext, a.kv_a_proj_with_mqa), _lin(ext, a.o_proj),
                   _f32(layer.input_layernorm.weight), _f32(layer.post_attention_layernorm.weight),
                   _f32(a.q_a_layernorm.weight) if lora else EMPTY, _f32(a.kv_a_layernorm.weight),
                   _f32(w[:, :a.nope]), _f32(w[:, a.nope:]), a.nh, a.rank, a.rope, a.nope, a.vd, a.half,
                   eps, float(a.q_a_layernorm.eps) if lora else eps, float(a.kv_a_layernorm.eps),
                   float(a.scale), bool(a.interleave))


class DeepseekNativeStep(NativeStep):
    """Per-layer native handles of a DeepSeek-V3 model: MLA blocks and group-limited routers."""

    def _mixer(self, layer) -> Any:
        return _mla(self.ext, layer, self.eps)

    def _router(self, mlp: SparseMoE) -> Any:
        g = mlp.gate
        return self.ext.GroupRouter(_f32(g.weight), _f32(g.e_score_correction_bias), g.top_k, g.n_group,
                                    g.topk_group, bool(g.normalize), float(g.scaling))

    @classmethod
    def for_model(cls, model) -> "DeepseekNativeStep | None":
        ext = load_extension()
        if ext is None or not hasattr(ext, "mla_block"):
            return None
        return super().for_model(model)

    def _attention(self, i, x, cos, sin, positions, storage, tables, qlens, ctxs, dmt, i8a) -> torch.Tensor:
        return self.ext.mla_block(self.attn[i], x, cos, sin, positions, storage, i, tables, qlens, ctxs, dmt, i8a)

    def _route(self, mlp: SparseMoE, i: int, h: torch.Tensor):
        return self.ext.route_grouped(h, self.routers[i])
