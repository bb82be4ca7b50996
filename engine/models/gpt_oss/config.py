"""gpt-oss's config: its parameters (sliding window, layer types, the clamped SwiGLU's
constants), read with the rest of a ModelConfig from a config.json or GGUF metadata; the
tensors and parameter counts such a config implies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from engine.config import ModelConfig, MoEConfig
from engine.configio.fields import REQUIRED, gguf_keys, gguf_rope, gguf_special_tokens, hf_integers, number, rope_from_hf, token_ids
from engine.errors import ModelFormatError
from engine.loading.expected import layered_tensors
from engine.loading.source import expert_name

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssParams:
    sliding_window: int
    layer_types: tuple[str, ...]
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        from engine.errors import ConfigError

        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer_types entry {bad[0]!r} is not one of {', '.join(LAYER_TYPES)}")

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def parameter_counts(self, c: ModelConfig) -> dict[str, int]:
        return parameter_counts(c)


def params_from_dict(d: Mapping[str, Any]) -> GptOssParams:
    d = dict(d)
    d["layer_types"] = tuple(d.get("layer_types", ()))
    return GptOssParams(**d)


def config_from_hf(raw: Mapping[str, Any], source: object) -> ModelConfig:
    integer = hf_integers(raw, source)
    layers = integer("num_hidden_layers")
    heads = integer("num_attention_heads")
    hidden = integer("hidden_size")
    types = raw.get("layer_types")
    if types is None:  # transformers' default: sliding on even layers, full on odd ones
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not (isinstance(types, list) and len(types) == layers):
        raise ModelFormatError(source, f"layer_types must list one of {', '.join(LAYER_TYPES)} for "
                                       f"each of the {layers} layers")
    if raw.get("attention_bias", True) is not True:
        raise ModelFormatError(source, "gpt-oss attention without biases (attention_bias false) is "
                                       "not supported")
    vocab = integer("vocab_size")
    bos = token_ids(raw.get("bos_token_id"), "bos_token_id", source, vocab)
    eos = token_ids(raw.get("eos_token_id"), "eos_token_id", source, vocab, allow_list=True)
    return ModelConfig(
        arch="gpt_oss",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=0,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=integer("num_key_value_heads", default=heads),
        head_dim=integer("head_dim", default=0) or hidden // heads,
        max_position_embeddings=integer("max_position_embeddings", default=131072),
        rms_norm_eps=number(raw.get("rms_norm_eps", 1e-5), "rms_norm_eps", source),
        rope=rope_from_hf(raw, source),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=True,
        moe=MoEConfig(num_experts=integer("num_local_experts"),
                      top_k=integer("num_experts_per_tok"),
                      expert_intermediate_size=integer("intermediate_size"),
                      norm_topk_prob=True),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=eos,
        arch_params=GptOssParams(
            sliding_window=integer("sliding_window", default=128),
            layer_types=tuple(types),
            swiglu_alpha=number(raw.get("swiglu_alpha", 1.702), "swiglu_alpha", source),
            swiglu_limit=number(raw.get("swiglu_limit", 7.0), "swiglu_limit", source)),
    )


# ---------------------------------------------------------------------------------- tensors

def expected_tensors(c: ModelConfig):
    H, D, E = c.hidden_size, c.head_dim, c.moe.num_experts
    I = c.moe.expert_intermediate_size
    q_out, kv_out = c.num_heads * D, c.num_kv_heads * D

    def layer(i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        p = f"model.layers.{i}."
        for name, out, inp in (("q", q_out, H), ("k", kv_out, H), ("v", kv_out, H), ("o", H, q_out)):
            yield p + f"self_attn.{name}_proj.weight", (out, inp)
            yield p + f"self_attn.{name}_proj.bias", (out,)
        yield p + "self_attn.sinks", (c.num_heads,)
        yield p + "mlp.gate.weight", (E, H)
        yield p + "mlp.gate.bias", (E,)
        yield p + "mlp.gate_proj_bias", (E, I)
        yield p + "mlp.up_proj_bias", (E, I)
        yield p + "mlp.down_proj_bias", (E, H)
        for j in range(E):
            yield expert_name(i, j, "gate_proj"), (I, H)
            yield expert_name(i, j, "up_proj"), (I, H)
            yield expert_name(i, j, "down_proj"), (H, I)

    return layered_tensors(c, layer)


def parameter_counts(c: ModelConfig) -> dict[str, int]:
    h, hd, m = c.hidden_size, c.head_dim, c.moe
    nh, nkv = c.num_heads, c.num_kv_heads
    attn = h * hd * (2 * nh + 2 * nkv) + hd * (nh + 2 * nkv) + h + nh  # q/k/v/o, biases, sinks
    per_layer = attn + 2 * h + m.num_experts * (h + 1)  # norms, router with bias
    per_expert = 3 * h * m.expert_intermediate_size + 2 * m.expert_intermediate_size + h  # + biases
    dense = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h + c.num_layers * per_layer
    routed_total = c.num_layers * m.num_experts * per_expert
    routed_active = c.num_layers * m.top_k * per_expert
    embed_read = c.vocab_size * h if not c.tie_word_embeddings else 0
    return {"total": dense + routed_total, "active": dense + routed_active - embed_read + h,
            "dense": dense, "routed_total": routed_total, "routed_active": routed_active}


# ------------------------------------------------------------------------------------- GGUF

def config_from_gguf(meta: Mapping[str, Any], source: object) -> ModelConfig:
    get = gguf_keys(meta, "gpt-oss", source)

    layers, hidden, heads = int(get("block_count")), int(get("embedding_length")), int(get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(get("vocab_size", len(tokens) if tokens is not None else REQUIRED))
    rope = gguf_rope(get, 150000.0, truncate=False)  # gpt-oss's YaRN does not round the correction range
    return ModelConfig(
        arch="gpt_oss", vocab_size=vocab, hidden_size=hidden, intermediate_size=0, num_layers=layers,
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length", 131072)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)), rope=rope,
        tie_word_embeddings=bool(meta.get("_tied_embeddings", False)), attention_bias=True,
        moe=MoEConfig(num_experts=int(get("expert_count")), top_k=int(get("expert_used_count")),
                      expert_intermediate_size=int(get("expert_feed_forward_length")), norm_topk_prob=True),
        **gguf_special_tokens(meta),
        # llama.cpp: sliding-window attention on every other layer, starting with layer 0
        arch_params=GptOssParams(sliding_window=int(get("attention.sliding_window", 128)),
                                 layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                                   for i in range(layers))),
    )
