"""gpt-oss on the native step (engine.step, engine/csrc/step.cpp): the same three calls per layer,
with gpt-oss's parts passed to them.

- attention (``attn_block``): q/k/v/o biases (the Linear handles carry them), the YaRN cos/sin
  tables of ``model.rotary`` (its attention factor is in the tables), each head's sink logit in
  the softmax denominator (``Attn.sinks``) and the sliding window of alternate layers
  (``Attn.window``: a query at p reads keys p - window < j <= p);
- router (``route``): the router's bias added to its logits, softmax over the top-k (a softmax
  over all experts renormalised over the top-k: the same weights);
- experts (``ffn_block``): each routed expert read from its cache slot (int4, nf4, int8, bf16 or
  MXFP4 codes, no dequantized copy) with the layer's expert biases and the clamped SwiGLU
  (``ExpertAct``: activation id 1, alpha, limit; engine/csrc/quant.h), as
  ``engine.models.gpt_oss.GptOssMoE.run_expert`` computes them. An expert without a slot row
  (computed on the CPU from the RAM tier) runs through ``run_expert``.

Tests: tests/engine/test_step_gpt_oss.py (native against the torch layers).
"""

from __future__ import annotations

import torch

from engine.step import NativeStep, _f32

ACT_CLAMPED_SWIGLU = 1  # engine/csrc/quant.h


class GptOssNativeStep(NativeStep):
    def __init__(self, model, ext) -> None:
        super().__init__(model, ext)
        self.router_bias = []
        for i, layer in enumerate(model.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            self.attn[i].sinks = _f32(a.sinks)
            self.attn[i].window = a.window or 0
            self.router_bias.append(_f32(mlp.gate.bias))
            self.acts[i] = ext.ExpertAct(ACT_CLAMPED_SWIGLU, float(mlp.alpha), float(mlp.limit),
                                         _f32(mlp.gate_proj_bias), _f32(mlp.up_proj_bias),
                                         _f32(mlp.down_proj_bias))

    def _route(self, mlp, i: int, h: torch.Tensor):
        return self.ext.route(h, self.routers[i], mlp.gate.top_k, True, self.router_bias[i])

    def _expert(self, mlp, e: int, expert, x: torch.Tensor) -> torch.Tensor:
        return mlp.run_expert(e, expert, x)
