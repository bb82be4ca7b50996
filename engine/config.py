"""Model configuration: frozen dataclasses, validated on construction, and nothing else.

One :class:`ModelConfig` describes every architecture moestream runs. Architecture-specific
switches (q/k norm, qkv bias, shared expert, which layers are sparse) are plain fields, so model
code branches on capabilities, never on architecture names. Reading one from a config.json, GGUF
metadata or the store manifest's dict is engine.configio's (with each architecture's own fields
in its home, engine.models.<arch>); this module imports neither, nor any model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. ``type`` is one of SUPPORTED_ROPE_TYPES."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # Per-frequency divisors of the inverse frequencies (GGUF ``rope_freqs.weight``: how
    # llama.cpp stores Llama 3.x rope scaling); empty = none.
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope type {self.type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise ConfigError(f"rope theta must be a positive finite number, got {self.theta}")
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise ConfigError(f"rope factor must be a positive finite number, got {self.factor}")


@dataclass(frozen=True)
class MoEConfig:
    """Routed-expert configuration of the sparse layers."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ w) scales the shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}"
            )
        if self.expert_intermediate_size < 1:
            raise ConfigError(
                f"expert_intermediate_size must be >= 1, got {self.expert_intermediate_size}"
            )
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3-Next): every layer not in ``full_attention_layers`` mixes
    tokens with a gated delta rule over a per-sequence state instead of attention."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    full_attention_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"linear attention {name} must be a positive integer, got {value!r}")
        if self.num_value_heads % self.num_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.num_key_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_elements(self) -> tuple[int, int]:
        """(conv window, delta-rule matrix) elements one layer keeps per sequence."""
        return (self.conv_dim * (self.conv_kernel - 1),
                self.num_value_heads * self.key_head_dim * self.value_head_dim)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model core needs; validated on construction."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (dense layers only)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v projections
    qk_norm: bool = False  # RMSNorm over head_dim on q and k (Qwen3)
    moe: MoEConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Qwen3-Next: gated attention (q_proj also yields a per-head sigmoid gate), RoPE on the first
    # partial_rotary_factor of head_dim, norms weighted by (1 + w), Gated DeltaNet layers
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    norm_zero_centred: bool = False
    linear_attn: LinearAttentionConfig | None = None
    # Architecture-specific parameters (a frozen dataclass defined by the architecture's file,
    # e.g. engine.models.gpt_oss.config.GptOssParams); None for the architectures of the shared decoder.
    arch_params: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.arch, str) or not self.arch:
            raise ConfigError(f"arch must be a non-empty string, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (0 < self.rms_norm_eps < 1):
            raise ConfigError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        if self.moe is None and self.intermediate_size < 1:
            raise ConfigError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} of head_dim "
                              f"{self.head_dim} must give an even rotary width >= 2")

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_attention_layer(self, layer: int) -> bool:
        """Whether ``layer`` is a Gated DeltaNet (recurrent state) layer instead of attention."""
        la = self.linear_attn
        return la is not None and layer not in la.full_attention_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with a KV cache (all of them unless some are linear attention)."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_attention_layer(i))

    # ---- structure -------------------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` has routed experts (Qwen2/3-MoE ``decoder_sparse_step`` rules)."""
        m = self.moe
        if m is None or layer in m.mlp_only_layers:
            return False
        return (layer + 1) % m.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def num_moe_layers(self) -> int:
        """``len(self.moe_layers)`` in O(len(mlp_only_layers)): usable on a declared layer
        count before it has been checked against the weights."""
        m = self.moe
        if m is None:
            return 0
        excluded = {i for i in m.mlp_only_layers if 0 <= i < self.num_layers}
        return self.num_layers // m.decoder_sparse_step - sum(
            1 for i in excluded if (i + 1) % m.decoder_sparse_step == 0)

    def parameter_counts(self) -> dict[str, int]:
        """Total and active-per-token parameter counts, split into dense and routed-expert parts."""
        custom = getattr(self.arch_params, "parameter_counts", None)
        if custom is not None:  # architectures with their own layers count them themselves
            return custom(self)
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        if self.attn_output_gate:
            attn += h * hd * self.num_heads
        per_layer_dense = attn + 2 * h
        la = self.linear_attn
        if la is not None:
            lin = (h * (2 * la.key_dim + 2 * la.value_dim) + h * 2 * la.num_value_heads
                   + la.conv_dim * la.conv_kernel + 2 * la.num_value_heads + la.value_head_dim
                   + la.value_dim * h)
        dense = self.vocab_size * h + h + (0 if self.tie_word_embeddings else self.vocab_size * h)
        routed_total = routed_active = 0
        for i in range(self.num_layers):
            dense += (lin + 2 * h) if self.is_linear_attention_layer(i) else per_layer_dense
            if self.is_moe_layer(i):
                m = self.moe
                assert m is not None
                per_expert = 3 * h * m.expert_intermediate_size
                routed_total += m.num_experts * per_expert
                routed_active += m.top_k * per_expert
                dense += m.num_experts * h  # router
                if m.shared_expert_intermediate_size:
                    dense += 3 * h * m.shared_expert_intermediate_size
                    dense += h if m.shared_expert_gate else 0
            else:
                dense += 3 * h * self.intermediate_size
        # The embedding table is read one row per token, not whole.
        embed_read = self.vocab_size * h if not self.tie_word_embeddings else 0
        return {
            "total": dense + routed_total,
            "active": dense + routed_active - embed_read + h,
            "dense": dense,
            "routed_total": routed_total,
            "routed_active": routed_active,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
