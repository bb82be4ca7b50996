"""gpt-oss (OpenAI's open-weight MoE, 20b/120b): every layer sparse; attention with sinks, biases
on q/k/v/o, alternating sliding-window and full layers (``layer_types``), YaRN RoPE; a router
with a bias and a softmax over its top-k; experts with biases and a clamped SwiGLU:

    gate = min(x W_g^T + b_g, limit);  up = clamp(x W_u^T + b_u, -limit, limit)
    out  = ((up + 1) * gate * sigmoid(alpha * gate)) W_d^T + b_d      (alpha 1.702, limit 7.0)

HF layout (transformers 5): ``mlp.router.{weight,bias}``, fused experts
``mlp.experts.gate_up_proj`` [E, H, 2I] (input-major, gate and up *interleaved* along the last
dim: column 2i is gate row i, 2i+1 up row i), ``gate_up_proj_bias`` [E, 2I] (interleaved too),
``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]; the released checkpoints hold the expert
matrices as MXFP4 instead: ``*_blocks`` [E, out, in/32, 16] uint8 + ``*_scales`` [E, out, in/32]
(output-major). Both are split here into canonical per-expert ``[out, in]`` matrices; the expert
biases stay dense tensors (``mlp.{gate,up,down}_proj_bias`` [E, I|H]), so any expert store
format carries them (they live in the store's dense file, beside the router).

The torch layers are the reference; on the CPU the native step runs it (engine.models.gpt_oss.step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers.moe import Expert, SparseMoE
from engine.layers.routing import BiasedSoftmaxRouter
from engine.layers.sinks_attention import SinkAttention
from engine.models.base import CausalLM, DecoderLayer

# ----------------------------------------------------------------------------------- layers

def expert_linear(x: torch.Tensor, w: Any) -> torch.Tensor:
    """x @ w.T for a float weight or a QuantizedTensor (computed where the weight lives)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w.to(x.dtype))
    from engine.quant.kernels import qlinear

    return qlinear(x.to(w.device), w).to(x.device, x.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssMoE(SparseMoE):
    """SparseMoE with gpt-oss's router and experts (biases, clamped SwiGLU); experts come from
    the provider as usual (resident, or the expert cache's quantized slots)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        nn.Module.__init__(self)
        m, p = cfg.moe, cfg.arch_params
        self.layer = layer
        self.gate = BiasedSoftmaxRouter(cfg.hidden_size, m.num_experts, m.top_k)
        self.shared_expert = self.shared_expert_gate = None
        self.gate_proj_bias = nn.Parameter(torch.empty(m.num_experts, m.expert_intermediate_size))
        self.up_proj_bias = nn.Parameter(torch.empty(m.num_experts, m.expert_intermediate_size))
        self.down_proj_bias = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size))
        self.alpha, self.limit = p.swiglu_alpha, p.swiglu_limit
        self.provider = None
        self.observers = []

    def run_expert(self, e: int, expert: Expert, x: torch.Tensor) -> torch.Tensor:
        g = expert_linear(x, expert.gate) + self.gate_proj_bias[e]
        u = expert_linear(x, expert.up) + self.up_proj_bias[e]
        return expert_linear(clamped_swiglu(g, u, self.alpha, self.limit), expert.down) + self.down_proj_bias[e]


def gpt_oss_layer(cfg: ModelConfig, layer: int) -> DecoderLayer:
    """Sinks attention (windowed on alternate layers) and the biased, clamped-SwiGLU MoE."""
    return DecoderLayer(cfg, layer,
                        attn=SinkAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                           layer, cfg.arch_params.window(layer)),
                        mlp=GptOssMoE(cfg, layer))


class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, gpt_oss_layer)

    def native_step_type(self):
        """The native step with sinks, windows, the biased router and the experts' biases and
        clamped SwiGLU (engine.models.gpt_oss.step)."""
        from engine.models.gpt_oss.step import GptOssNativeStep

        return GptOssNativeStep

    def dense_linear_slots(self) -> list[tuple[nn.Module, str]]:
        """(parent, name) of every dense linear engine.quant.linear may quantize."""
        out = [(l.self_attn, n) for l in self.model.layers for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        return out + [(self, "lm_head")]
