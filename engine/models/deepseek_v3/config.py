"""DeepSeek-V3's config: its parameters (MLA ranks and head dims, router groups, scaling), read
with the rest of a ModelConfig from a config.json or GGUF metadata; the tensors, parameter counts
and KV bytes such a config implies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from engine.config import ModelConfig, MoEConfig
from engine.configio.fields import REQUIRED, gguf_keys, gguf_rope, gguf_special_tokens, hf_integers, number, rope_from_hf, token_ids
from engine.errors import ModelFormatError
from engine.loading.expected import layered_tensors
from engine.loading.source import expert_name
from engine.models.deepseek_v3.mla import latent_half


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

    def parameter_counts(self, c: ModelConfig) -> dict[str, int]:
        return parameter_counts(c)

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
    integer = hf_integers(raw, source)
    layers = integer("num_hidden_layers")
    heads = integer("num_attention_heads")
    vocab = integer("vocab_size")
    experts = integer("n_routed_experts")
    moe_inter = integer("moe_intermediate_size")
    dense_layers = integer("first_k_dense_replace", default=0)
    if raw.get("moe_layer_freq", 1) != 1:
        raise ModelFormatError(source, "moe_layer_freq other than 1 is not supported")
    params = DeepseekV3Params(
        q_lora_rank=integer("q_lora_rank", default=0),
        kv_lora_rank=integer("kv_lora_rank"),
        qk_nope_head_dim=integer("qk_nope_head_dim"),
        qk_rope_head_dim=integer("qk_rope_head_dim"),
        v_head_dim=integer("v_head_dim"),
        n_group=integer("n_group", default=1),
        topk_group=integer("topk_group", default=1),
        routed_scaling_factor=number(raw.get("routed_scaling_factor", 1.0), "routed_scaling_factor", source),
        rope_interleave=bool(raw.get("rope_interleave", True)))
    if experts % params.n_group:
        raise ModelFormatError(source, f"n_routed_experts ({experts}) must be a multiple of n_group "
                                       f"({params.n_group})")
    bos = token_ids(raw.get("bos_token_id"), "bos_token_id", source, vocab)
    eos = token_ids(raw.get("eos_token_id"), "eos_token_id", source, vocab, allow_list=True)
    return ModelConfig(
        arch="deepseek_v3",
        vocab_size=vocab,
        hidden_size=integer("hidden_size"),
        intermediate_size=integer("intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=1,  # the cache holds one latent row per token (engine.models.deepseek_v3.mla)
        head_dim=latent_half(params.kv_lora_rank, params.qk_rope_head_dim),
        max_position_embeddings=integer("max_position_embeddings", default=4096),
        rms_norm_eps=number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        rope=rope_from_hf(raw, source),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        moe=MoEConfig(num_experts=experts, top_k=integer("num_experts_per_tok"),
                      expert_intermediate_size=moe_inter,
                      norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                      shared_expert_intermediate_size=integer("n_shared_experts", default=0) * moe_inter,
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


def expected_tensors(c: ModelConfig):
    H, m = c.hidden_size, c.moe

    def layer(i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        p = f"model.layers.{i}."
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

    return layered_tensors(c, layer)


def parameter_counts(c: ModelConfig) -> dict[str, int]:
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


# ------------------------------------------------------------------------------------- GGUF

def config_from_gguf(meta: Mapping[str, Any], source: object) -> ModelConfig:
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
    mscale_all = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    rope = gguf_rope(get, 10000.0, mscale=mscale_all or None, mscale_all_dim=mscale_all or None)
    moe_inter = int(get("expert_feed_forward_length"))
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
        **gguf_special_tokens(meta),
        arch_params=params,
    )
