"""DeepSeek-V3 (and R1, and models of the same design): multi-head latent attention
(engine.layers.mla), YaRN RoPE with mscale on the decoupled RoPE dims, the first
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
engine.step_deepseek (MLA and the router in C++); the torch layers are the reference.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from engine.config import REQUIRED, ModelConfig, MoEConfig, _number, _rope_from_hf, gguf_keys, token_ids
from engine.errors import ModelFormatError
from engine.layers.mla import MLAttention, latent_half
from engine.layers.mlp import SwiGLU
from engine.layers.moe import SparseMoE
from engine.layers.rope import Rotary
from engine.layers.routing import GroupLimitedSigmoidRouter
from engine.loading.source import expert_name
from engine.models.base import CausalLM, DecoderLayer
from engine.models.gpt_oss import _int
from engine.models.spec import ArchSpec

FP8_BLOCK = 128


@dataclass(frozen=True)
class DeepseekV3Params:
    q_lora_rank: int  # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        from engine.errors import ConfigError

        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                     "topk_group"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")

    def expected_tensors(self, c: ModelConfig):
        return _expected_tensors(c)

    def parameter_counts(self, c: ModelConfig) -> dict[str, int]:
        return _parameter_counts(c)

    def kv_note(self, c: ModelConfig) -> str:
        b = mla_kv_bytes_per_token(c)
        return (f"(MLA: the latent, {self.kv_lora_rank} + {self.qk_rope_head_dim} values per layer; "
                f"standard attention with these {c.num_heads} heads would cache "
                f"{b['standard'] / 1e3:.2f}KB per token, {b['standard'] / b['mla']:.1f}x)")

    def softmax_scale(self, c: ModelConfig) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's rule)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        r = c.rope
        if r.type != "default" and r.mscale_all_dim:
            m = 1.0 if r.factor <= 1 else 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
            scale *= m * m
        return scale


def params_from_dict(d: Mapping[str, Any]) -> DeepseekV3Params:
    return DeepseekV3Params(**dict(d))


def config_from_hf(raw: Mapping[str, Any], source: object) -> ModelConfig:
    layers = _int(raw, "num_hidden_layers", source)
    heads = _int(raw, "num_attention_heads", source)
    vocab = _int(raw, "vocab_size", source)
    experts = _int(raw, "n_routed_experts", source)
    moe_inter = _int(raw, "moe_intermediate_size", source)
    dense_layers = _int(raw, "first_k_dense_replace", source, 0)
    if raw.get("moe_layer_freq", 1) != 1:
        raise ModelFormatError(source, "moe_layer_freq other than 1 is not supported")
    params = DeepseekV3Params(
        q_lora_rank=_int(raw, "q_lora_rank", source, 0),
        kv_lora_rank=_int(raw, "kv_lora_rank", source),
        qk_nope_head_dim=_int(raw, "qk_nope_head_dim", source),
        qk_rope_head_dim=_int(raw, "qk_rope_head_dim", source),
        v_head_dim=_int(raw, "v_head_dim", source),
        n_group=_int(raw, "n_group", source, 1),
        topk_group=_int(raw, "topk_group", source, 1),
        routed_scaling_factor=_number(raw.get("routed_scaling_factor", 1.0), "routed_scaling_factor", source),
        rope_interleave=bool(raw.get("rope_interleave", True)))
    if experts % params.n_group:
        raise ModelFormatError(source, f"n_routed_experts ({experts}) must be a multiple of n_group "
                                       f"({params.n_group})")
    bos = token_ids(raw.get("bos_token_id"), "bos_token_id", source, vocab)
    eos = token_ids(raw.get("eos_token_id"), "eos_token_id", source, vocab, allow_list=True)
    return ModelConfig(
        arch="deepseek_v3",
        vocab_size=vocab,
        hidden_size=_int(raw, "hidden_size", source),
        intermediate_size=_int(raw, "intermediate_size", source),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=1,  # the cache holds one latent row per token (engine.layers.mla)
        head_dim=latent_half(params.kv_lora_rank, params.qk_rope_head_dim),
        max_position_embeddings=_int(raw, "max_position_embeddings", source, 4096),
        rms_norm_eps=_number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        rope=_rope_from_hf(raw, source),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        moe=MoEConfig(num_experts=experts, top_k=_int(raw, "num_experts_per_tok", source),
                      expert_intermediate_size=moe_inter,
                      norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                      shared_expert_intermediate_size=_int(raw, "n_shared_experts", source, 0) * moe_inter,
                      mlp_only_layers=tuple(range(min(dense_layers, layers)))),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=eos,
        arch_params=params,
    )


# ---------------------------------------------------------------------------------- tensors

def _attn_shapes(c: ModelConfig):
    p, H, nh = c.arch_params, c.hidden_size, c.num_heads
    qk, R, r = p.qk_nope_head_dim + p.qk_rope_head_dim, p.kv_lora_rank, p.qk_rope_head_dim
    b = c.attention_bias
    if p.q_lora_rank:
        yield "q_a_proj.weight", (p.q_lora_rank, H)
        if b:
            yield "q_a_proj.bias", (p.q_lora_rank,)
        yield "q_a_layernorm.weight", (p.q_lora_rank,)
        yield "q_b_proj.weight", (nh * qk, p.q_lora_rank)
    else:
        yield "q_proj.weight", (nh * qk, H)
    yield "kv_a_proj_with_mqa.weight", (R + r, H)
    if b:
        yield "kv_a_proj_with_mqa.bias", (R + r,)
    yield "kv_a_layernorm.weight", (R,)
    yield "kv_b_proj.weight", (nh * (p.qk_nope_head_dim + p.v_head_dim), R)
    yield "o_proj.weight", (H, nh * p.v_head_dim)
    if b:
        yield "o_proj.bias", (H,)


def _expected_tensors(c: ModelConfig):
    V, H, m = c.vocab_size, c.hidden_size, c.moe
    yield "model.embed_tokens.weight", (V, H)
    yield "model.norm.weight", (H,)
    if not c.tie_word_embeddings:
        yield "lm_head.weight", (V, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (H,)
        yield p + "post_attention_layernorm.weight", (H,)
        for name, shape in _attn_shapes(c):
            yield p + "self_attn." + name, shape
        if c.is_moe_layer(i):
            I, S = m.expert_intermediate_size, m.shared_expert_intermediate_size
            yield p + "mlp.gate.weight", (m.num_experts, H)
            yield p + "mlp.gate.e_score_correction_bias", (m.num_experts,)
            for j in range(m.num_experts):
                yield expert_name(i, j, "gate_proj"), (I, H)
                yield expert_name(i, j, "up_proj"), (I, H)
                yield expert_name(i, j, "down_proj"), (H, I)
            if S:
                yield p + "mlp.shared_expert.gate_proj.weight", (S, H)
                yield p + "mlp.shared_expert.up_proj.weight", (S, H)
                yield p + "mlp.shared_expert.down_proj.weight", (H, S)
        else:
            I = c.intermediate_size
            yield p + "mlp.gate_proj.weight", (I, H)
            yield p + "mlp.up_proj.weight", (I, H)
            yield p + "mlp.down_proj.weight", (H, I)


def _parameter_counts(c: ModelConfig) -> dict[str, int]:
    h, m = c.hidden_size, c.moe
    attn = sum(math.prod(s) for _, s in _attn_shapes(c))
    dense = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h
    routed_total = routed_active = 0
    per_expert = 3 * h * m.expert_intermediate_size
    for i in range(c.num_layers):
        dense += attn + 2 * h
        if c.is_moe_layer(i):
            dense += m.num_experts * (h + 1) + 3 * h * m.shared_expert_intermediate_size
            routed_total += m.num_experts * per_expert
            routed_active += m.top_k * per_expert
        else:
            dense += 3 * h * c.intermediate_size
    embed_read = c.vocab_size * h if not c.tie_word_embeddings else 0
    return {"total": dense + routed_total, "active": dense + routed_active - embed_read + h,
            "dense": dense, "routed_total": routed_total, "routed_active": routed_active}


def mla_kv_bytes_per_token(c: ModelConfig, elem_bytes: int = 2) -> dict[str, int]:
    """KV bytes one context token takes over all layers: MLA's cached latent against the
    per-head keys and values standard attention of the same heads would cache."""
    p = c.arch_params
    latent = (p.kv_lora_rank + p.qk_rope_head_dim) * c.num_layers * elem_bytes
    expanded = c.num_heads * (p.qk_nope_head_dim + p.qk_rope_head_dim + p.v_head_dim) * c.num_layers * elem_bytes
    return {"mla": latent, "standard": expanded}


def dequantize_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor, name: str = "<fp8>") -> torch.Tensor:
    """Block-FP8 weight [out, in] (float8_e4m3fn) times its per-128x128-block ``scale_inv``
    [ceil(out/128), ceil(in/128)] -> float32 [out, in]."""
    out, inp = w.shape
    want = (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ModelFormatError(name, f"weight_scale_inv has shape {list(scale_inv.shape)}; a weight of "
                                     f"{[out, inp]} needs {list(want)} (one per {FP8_BLOCK}x{FP8_BLOCK} block)")
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inp]
    return w.float() * s


_MTP_RE = re.compile(r"^model\.layers\.(\d+)\.")


def hf_split(stored: str, shape: tuple[int, ...], dtype: str, get, config: ModelConfig):
    """Block-FP8 weights (with their ``_scale_inv``) -> one float canonical tensor; MTP layers'
    tensors dropped; everything else: None (the generic handling)."""
    m = _MTP_RE.match(stored)
    if m is not None and int(m.group(1)) >= config.num_layers:
        return []  # multi-token-prediction module: not used for decoding
    if stored.endswith(".weight_scale_inv"):
        return []  # read with its weight
    if dtype in ("f8_e4m3", "f8_e5m2"):
        canonical = SPEC.canonical_name(stored)
        return [(canonical, shape, dtype,
                 lambda: dequantize_block_fp8(get(stored), _scale_of(get, stored), stored))]
    return None


def _scale_of(get, stored: str) -> torch.Tensor:
    try:
        return get(stored + "_scale_inv")
    except KeyError:
        raise ModelFormatError(stored, "FP8 weight without its weight_scale_inv tensor") from None


# ------------------------------------------------------------------------------------- GGUF
# llama.cpp's converter (arch "deepseek2"): MLA written as MQA (head_count_kv 1, key_length
# R + r), kv_b split into attn_k_b [Nh, R, dn] (transposed) and attn_v_b [Nh, dv, R] (older files:
# one attn_kv_b), the selection bias as exp_probs_b.bias, experts stacked, shared experts *_shexp,
# interleaved RoPE as in the released weights; YaRN's mscale_all_dim as yarn_log_multiplier / 0.1.

_GGUF_RE = re.compile(r"^blk\.(\d+)\.(attn_q_a|attn_q_a_norm|attn_q_b|attn_kv_a_mqa|attn_kv_a_norm|"
                      r"attn_kv_b|attn_k_b|attn_v_b|exp_probs_b)\.(weight|bias)$")
_GGUF_NAMES = {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
               "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
               "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj"}


def gguf_split(gname: str, shape: tuple[int, ...], config: ModelConfig):
    m = _GGUF_RE.match(gname)
    if m is None:
        return None
    layer, comp, kind = m.group(1), m.group(2), m.group(3)
    p = f"model.layers.{layer}."
    if comp == "exp_probs_b":
        return [(p + "mlp.gate.e_score_correction_bias", shape, None)]
    if comp == "attn_v_b":
        return []  # read with attn_k_b
    if comp == "attn_k_b":
        a, nh = config.arch_params, config.num_heads
        k_name, v_name = gname, f"blk.{layer}.attn_v_b.weight"

        def kv_b(source) -> torch.Tensor:
            k = source.stored_tensor(k_name)  # [Nh, R, dn]
            v = source.stored_tensor(v_name)  # [Nh, dv, R]
            if tuple(k.shape) != (nh, a.kv_lora_rank, a.qk_nope_head_dim) or \
                    tuple(v.shape) != (nh, a.v_head_dim, a.kv_lora_rank):
                raise ModelFormatError(k_name, f"attn_k_b {list(k.shape)} / attn_v_b {list(v.shape)} do not "
                                               f"match {nh} heads of MLA rank {a.kv_lora_rank}")
            return torch.cat([k.transpose(1, 2), v], dim=1).reshape(-1, a.kv_lora_rank)
        rows = nh * (a.qk_nope_head_dim + a.v_head_dim)
        return [(p + "self_attn.kv_b_proj.weight", (rows, a.kv_lora_rank), None, kv_b)]
    return [(p + f"{_GGUF_NAMES[comp]}.{kind}", shape, None)]


def config_from_gguf(meta: Mapping[str, Any], source: object) -> ModelConfig:
    from engine.config import RopeConfig

    get = gguf_keys(meta, "deepseek2", source)

    layers, hidden, heads = int(get("block_count")), int(get("embedding_length")), int(get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(get("vocab_size", len(tokens) if tokens is not None else REQUIRED))
    rank, rope_dim = int(get("attention.kv_lora_rank")), int(get("rope.dimension_count"))
    qk = int(get("attention.key_length_mla"))
    if int(get("attention.key_length", rank + rope_dim)) != rank + rope_dim:
        raise ModelFormatError(source, "deepseek2.attention.key_length must be kv_lora_rank + rope dims (MLA)")
    if int(get("expert_gating_func", 2)) != 2:
        raise ModelFormatError(source, "only sigmoid expert gating (expert_gating_func 2) is supported")
    params = DeepseekV3Params(
        q_lora_rank=int(get("attention.q_lora_rank", 0)), kv_lora_rank=rank, qk_nope_head_dim=qk - rope_dim,
        qk_rope_head_dim=rope_dim, v_head_dim=int(get("attention.value_length_mla")),
        n_group=int(get("expert_group_count", 1)), topk_group=int(get("expert_group_used_count", 1)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)), rope_interleave=True)
    scaling = get("rope.scaling.type", "none")
    mscale_all = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    rope = RopeConfig(theta=float(get("rope.freq_base", 10000.0)),
                      type={"none": "default", "yarn": "yarn"}.get(scaling, scaling),
                      factor=float(get("rope.scaling.factor", 1.0) or 1.0),
                      original_max_position_embeddings=int(get("rope.scaling.original_context_length", 4096)),
                      beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                      beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
                      mscale=mscale_all or None, mscale_all_dim=mscale_all or None)
    moe_inter = int(get("expert_feed_forward_length"))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [int(meta[f"tokenizer.ggml.{k}"]) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if f"tokenizer.ggml.{k}" in meta]
    return ModelConfig(
        arch="deepseek_v3", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_layers=layers, num_heads=heads,
        num_kv_heads=1, head_dim=latent_half(rank, rope_dim),
        max_position_embeddings=int(get("context_length", 4096)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)), rope=rope,
        tie_word_embeddings=bool(meta.get("_tied_embeddings", False)),
        attention_bias=bool(meta.get("_attention_bias", False)),
        moe=MoEConfig(num_experts=int(get("expert_count")), top_k=int(get("expert_used_count")),
                      expert_intermediate_size=moe_inter, norm_topk_prob=bool(get("expert_weights_norm", False)),
                      shared_expert_intermediate_size=int(get("expert_shared_count", 0)) * moe_inter,
                      mlp_only_layers=tuple(range(min(int(get("leading_dense_block_count", 0)), layers)))),
        bos_token_id=None if bos is None else int(bos), eos_token_ids=tuple(dict.fromkeys(eos)),
        arch_params=params,
    )


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
        """The native step with MLA and the group-limited router (engine.step_deepseek)."""
        from engine.step_deepseek import DeepseekNativeStep

        return DeepseekNativeStep

    def dense_linear_slots(self) -> list[tuple[nn.Module, str]]:
        out: list[tuple[nn.Module, str]] = []
        for layer in self.model.layers:
            out += [(layer.self_attn, n) for n in layer.self_attn.linear_names()]
            mlp = layer.mlp.shared_expert if isinstance(layer.mlp, SparseMoE) else layer.mlp
            if mlp is not None:
                out += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        return out + [(self, "lm_head")]


SPEC = ArchSpec(
    key="deepseek_v3",
    hf_architectures=("DeepseekV3ForCausalLM",),
    hf_renames=((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),),
    gguf_arch="deepseek2",
    config_from_hf=config_from_hf,
    params_from_dict=params_from_dict,
    model_class=lambda: DeepseekV3ForCausalLM,
    hf_split=hf_split,
    config_from_gguf=config_from_gguf,
    gguf_split=gguf_split,
)
