"""The shared decoder's ModelConfig from a config.json whose architecture is known: the fields
every decoder has, read here, overridden by the architecture's own (ArchSpec.hf_fields). No
registry here: an architecture's home may call it (Qwen3-Next's GGUF reader does)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from engine.config import ModelConfig
from engine.configio.fields import bad_value, hf_integers, hf_special_tokens, number, rope_from_hf
from engine.errors import ConfigError, ModelFormatError, UnsupportedArchitectureError


def decoder_config(arch: str, raw: Mapping[str, Any], source: object = "config.json",
                   own_fields: Callable[..., dict[str, Any]] | None = None) -> ModelConfig:
    """``own_fields(raw, integer, source)`` -> fields that override the defaults read here."""
    integer = hf_integers(raw, source)
    try:
        hidden = integer("hidden_size")
        heads = integer("num_attention_heads")
        head_dim = integer("head_dim", default=0) or hidden // heads
        # the architecture's fields (routed experts, qk norm, ...) override these defaults
        own = own_fields(raw, integer, source) if own_fields is not None else {}
        vocab = integer("vocab_size")
        fields: dict[str, Any] = dict(
            arch=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size", default=0),
            num_layers=integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=integer("num_key_value_heads", default=0) or heads,
            head_dim=head_dim,
            max_position_embeddings=integer("max_position_embeddings", default=4096),
            rms_norm_eps=number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
            rope=rope_from_hf(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            **hf_special_tokens(raw, source, vocab),
        )
        return ModelConfig(**{**fields, **own})
    except (TypeError, ValueError, ArithmeticError) as e:
        if isinstance(e, (ConfigError, ModelFormatError, UnsupportedArchitectureError)):
            raise
        raise ModelFormatError(source, bad_value(e)) from None
