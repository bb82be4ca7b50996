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
tolerance, tests/engine/test_step_deepseek.py). kv_b_proj is read in its dense format (int8 with
per-group scales, or bf16) by mla_block itself (engine/csrc/mla_kvb.cpp): its key rows folded into
the query, its value rows after the weighted sum of latents, a head's rows read once per tile of
KVB_TILE tokens. At DeepSeek-V3's shape that is 16.5 MiB per layer at int8 instead of the 64 MiB of
the float32 copies the reference path (``float_kv_b``) keeps. The other dense linears run through
the native Linear in the format engine.quant.linear gave them.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import ConfigError
from engine.models.deepseek_v3.mla import MLAttention
from engine.layers.moe import SparseMoE
from engine.quant.kernels import load_extension
from engine.quant.linear import QuantLinear
from engine.step import EMPTY, NativeStep, StepContext, _f32, _lin


KV_B_FORMATS = ("int8", "bf16")  # kv_b_proj formats mla_block reads in place (engine/csrc/mla_kvb.cpp)


def mla_handle(ext: Any, layer, eps: float, float_kv_b: bool = False) -> Any:
    """Layer's MLA handle. kv_b_proj in a format of KV_B_FORMATS is read by the kernels as it is
    stored; otherwise (or with ``float_kv_b``: the reference path) its key and value parts are
    float32 copies (a dequantized kv_b, cached on the torch layer)."""
    a: MLAttention = layer.self_attn
    lora = hasattr(a, "q_a_proj")
    m = a.kv_b_proj
    quantized = (not float_kv_b and isinstance(m, QuantLinear) and m.q.fmt.name in KV_B_FORMATS
                 and m.bias is None)
    if quantized:
        wuk = wuv = EMPTY
    else:
        w = a._kv_b_weight().view(a.nh, a.nope + a.vd, a.rank)
        wuk, wuv = _f32(w[:, :a.nope]), _f32(w[:, a.nope:])
    h = ext.MLA(_lin(ext, a.q_a_proj) if lora else None, _lin(ext, a.q_b_proj if lora else a.q_proj),
                _lin(ext, a.kv_a_proj_with_mqa), _lin(ext, a.o_proj),
                _f32(layer.input_layernorm.weight), _f32(layer.post_attention_layernorm.weight),
                _f32(a.q_a_layernorm.weight) if lora else EMPTY, _f32(a.kv_a_layernorm.weight),
                wuk, wuv, a.nh, a.rank, a.rope, a.nope, a.vd, a.half,
                eps, float(a.q_a_layernorm.eps) if lora else eps, float(a.kv_a_layernorm.eps),
                float(a.scale), bool(a.interleave))
    if quantized:
        h.kvb = _lin(ext, m)
    return h


def kv_b_bytes(num_heads: int, nope_dim: int, v_dim: int, kv_lora_rank: int, fmt: str = "float32",
               group_size: int = 64) -> int:
    """Bytes of one layer's kv_b as mla_block reads them per decoded token: float32 (the
    reference path), bf16, or int8 (+ an fp16 scale per ``group_size`` weights)."""
    from engine.quant.formats import QuantFormat

    n = num_heads * (nope_dim + v_dim) * kv_lora_rank
    if fmt == "float32":
        return 4 * n
    if fmt not in KV_B_FORMATS:
        raise ConfigError(f"kv_b format {fmt!r}; allowed: float32, {', '.join(KV_B_FORMATS)}")
    if fmt == "int8" and kv_lora_rank % group_size:
        raise ConfigError(f"int8 kv_b: group {group_size} does not divide kv_lora_rank {kv_lora_rank}")
    return int(n * QuantFormat(fmt, group_size).bits_per_weight) // 8


class DeepseekNativeStep(NativeStep):
    """Per-layer native handles of a DeepSeek-V3 model: MLA blocks and group-limited routers."""

    # kv_b as float32 copies (the reference path) instead of its dense format: set on the class
    # before the step is built (tests, bench/deepseek_step.py --kv-b float32)
    float_kv_b: bool = False

    def _mixer(self, layer) -> Any:
        return mla_handle(self.ext, layer, self.eps, self.float_kv_b)

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

    def _attention(self, ctx: StepContext, i: int, layer) -> torch.Tensor:
        return self.ext.mla_block(self.attn[i], ctx.x, ctx.cos, ctx.sin, ctx.positions, ctx.storage, i,
                                  ctx.tables, ctx.qlens, ctx.ctxs, ctx.dmt, ctx.i8a)

    def _route(self, mlp: SparseMoE, i: int, h: torch.Tensor):
        return self.ext.route_grouped(h, self.routers[i])
