"""ModelConfig from GGUF metadata (already parsed: ints, floats, strings, lists): the
architecture from ``general.architecture`` through the registry, the keys every decoder shares
here, the architecture's own from its home (ArchSpec.gguf_fields, or ArchSpec.config_from_gguf
for the architectures that read all their keys themselves)."""

from __future__ import annotations

from typing import Any, Mapping

from engine.config import ModelConfig, MoEConfig, RopeConfig
from engine.configio.fields import bad_value, gguf_keys, gguf_special_tokens
from engine.errors import ConfigError, ModelFormatError, UnsupportedArchitectureError
from engine.models import registry


def config_from_gguf_metadata(meta: Mapping[str, Any], source: object = "model.gguf") -> ModelConfig:
    garch = meta.get("general.architecture")
    try:
        spec = registry.spec_for_gguf(garch, meta)
        if spec.config_from_gguf is not None:  # architectures with their own layers parse their keys
            return spec.config_from_gguf(meta, source)
        need = get = gguf_keys(meta, garch, source)  # type: ignore[arg-type]
        hidden = int(need("embedding_length"))
        heads = int(need("attention.head_count"))
        kv = get("attention.head_count_kv", heads)
        head_dim = int(get("attention.key_length", hidden // heads))
        vocab = get("vocab_size", None)
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ModelFormatError(source, "no vocab_size and no tokenizer.ggml.tokens")
            vocab = len(tokens)
        moe = None
        n_exp = int(get("expert_count", 0) or 0)
        if n_exp:
            shared = int(get("expert_shared_feed_forward_length", 0) or 0)
            moe = MoEConfig(
                num_experts=n_exp,
                top_k=int(need("expert_used_count")),
                expert_intermediate_size=int(
                    get("expert_feed_forward_length", 0) or need("feed_forward_length")
                ),
                norm_topk_prob=bool(get("expert_weights_norm", False)),
                shared_expert_intermediate_size=shared,
                shared_expert_gate=shared > 0,
            )
        scaling = get("rope.scaling.type", "none")
        rope = RopeConfig(
            theta=float(get("rope.freq_base", 10000.0)),
            type={"none": "default", "linear": "linear", "yarn": "yarn"}.get(scaling, scaling),
            factor=float(get("rope.scaling.factor", 1.0) or 1.0),
            original_max_position_embeddings=int(
                get("rope.scaling.original_context_length", 8192) or 8192
            ),
            freq_factors=tuple(float(f) for f in meta.get("_rope_freq_factors", ())),
        )
        fields: dict[str, Any] = dict(
            arch=spec.key,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", 0) or 0),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv),
            head_dim=head_dim,
            max_position_embeddings=int(get("context_length", 4096)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope=rope,
            # Not metadata keys: the GGUF reader derives these from which tensors exist
            # (no output.weight -> tied; attn_q.bias present -> bias) and passes them in.
            tie_word_embeddings=bool(meta.get("_tied_embeddings", False)),
            attention_bias=bool(meta.get("_attention_bias", False)),
            moe=moe,
            **gguf_special_tokens(meta),
        )
        if spec.gguf_fields is not None:  # the architecture adjusts the generic fields
            fields = spec.gguf_fields(get, fields)
        return ModelConfig(**fields)
    except (TypeError, ValueError, ArithmeticError) as e:
        if isinstance(e, (ConfigError, ModelFormatError, UnsupportedArchitectureError)):
            raise
        raise ModelFormatError(source, bad_value(e, "bad metadata value")) from None
