"""DeepSeek-V3 (and R1, and models of the same design): multi-head latent attention
(engine.models.deepseek_v3.mla), YaRN RoPE with mscale on the decoupled RoPE dims, the first
``first_k_dense_replace`` layers dense, the others sparse with a sigmoid router,
``e_score_correction_bias`` for selection only, group-limited top-k (``n_group``,
``topk_group``), normalised weights times ``routed_scaling_factor`` (engine.layers.routing), and
``n_shared_experts`` shared experts (one SwiGLU of n_shared * moe_intermediate_size).

KV cache: the latent (kv_lora_rank + qk_rope_head_dim per token and layer) as a one-head cache of
width ``latent_half`` per K and V half: ModelConfig.num_kv_heads = 1, head_dim = latent_half.

Weights: bf16/fp32 checkpoints, and the released block-FP8 ones (``weight`` in F8_E4M3 with
``weight_scale_inv`` [ceil(out/128), ceil(in/128)] float32: w = fp8 * scale of its 128x128
block), dequantized when read (so at ``convert``). Multi-token-prediction layers (``model.layers.
{num_hidden_layers}...``) are not used and their tensors are ignored.

On the CPU with natively quantized dense linears the layers run as the native step of
engine.models.deepseek_v3.step (MLA and the router in C++); the torch layers are the reference.
"""

from __future__ import annotations

from torch import nn

from engine.config import ModelConfig
from engine.layers.mlp import SwiGLU
from engine.layers.moe import SparseMoE
from engine.layers.rope import Rotary
from engine.layers.routing import GroupLimitedSigmoidRouter
from engine.models.base import CausalLM, DecoderLayer
from engine.models.deepseek_v3.mla import MLAttention

# ----------------------------------------------------------------------------------- layers

class DeepseekMoE(SparseMoE):
    """SparseMoE (plain SwiGLU experts, an ungated shared expert) with DeepSeek's router."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        m, p = cfg.moe, cfg.arch_params
        self.gate = GroupLimitedSigmoidRouter(cfg.hidden_size, m.num_experts, m.top_k, p.n_group,
                                              p.topk_group, m.norm_topk_prob, p.routed_scaling_factor)


def deepseek_layer(cfg: ModelConfig, layer: int) -> DecoderLayer:
    """MLA, and DeepSeek's MoE on sparse layers (the first first_k_dense_replace are dense)."""
    p = cfg.arch_params
    attn = MLAttention(cfg.hidden_size, cfg.num_heads, p.q_lora_rank, p.kv_lora_rank,
                       p.qk_nope_head_dim, p.qk_rope_head_dim, p.v_head_dim,
                       cfg.attention_bias, p.softmax_scale(cfg), p.rope_interleave, layer)
    mlp = DeepseekMoE(cfg, layer) if cfg.is_moe_layer(layer) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
    return DecoderLayer(cfg, layer, attn=attn, mlp=mlp)


class DeepseekV3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, deepseek_layer)

    # RoPE turns only the qk_rope_head_dim decoupled dims (config.head_dim is the cached latent
    # half): whatever table engine.models.load assigns after building on the meta device, the
    # model keeps one of its own rope width, built where tensors are real.
    @property
    def rotary(self) -> Rotary:
        return self.__dict__["_rotary"]

    @rotary.setter
    def rotary(self, _value) -> None:
        cfg = self.config
        self.__dict__["_rotary"] = Rotary(cfg.rope, cfg.arch_params.qk_rope_head_dim,
                                          max_positions=min(cfg.max_position_embeddings, 4096))

    def native_step_type(self):
        """The native step with MLA and the group-limited router (engine.models.deepseek_v3.step)."""
        from engine.models.deepseek_v3.step import DeepseekNativeStep

        return DeepseekNativeStep

    def dense_linear_slots(self) -> list[tuple[nn.Module, str]]:
        out: list[tuple[nn.Module, str]] = []
        for layer in self.model.layers:
            out += [(layer.self_attn, n) for n in layer.self_attn.linear_names()]
            mlp = layer.mlp.shared_expert if isinstance(layer.mlp, SparseMoE) else layer.mlp
            if mlp is not None:
                out += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        return out + [(self, "lm_head")]
