"""Model configuration: frozen dataclasses built from HF ``config.json`` or GGUF metadata.

One :class:`ModelConfig` describes every architecture moestream runs. Architecture-specific
switches (q/k norm, qkv bias, shared expert, which layers are sparse) are plain fields, so model
code branches on capabilities, never on architecture names.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from engine.errors import ConfigError, ModelFormatError, UnsupportedArchitectureError, quote

# HF "architectures" entry -> our architecture key (engine.models registry key).
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
# HF "model_type" (used when "architectures" is absent) -> our key.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "mixtral",
                  "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe"}
HF_MODEL_TYPES["qwen3_next"] = "qwen3_next"
HF_MODEL_TYPES.update({"gpt_oss": "gpt_oss", "deepseek_v3": "deepseek_v3", "qwen3_5_moe": "qwen3_5_moe"})
# GGUF "general.architecture" -> our key.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
GGUF_ARCHITECTURES.update({"gpt-oss": "gpt_oss", "deepseek2": "deepseek_v3"})
GGUF_ARCHITECTURES["qwen3next"] = "qwen3_next"
GGUF_ARCHITECTURES["qwen35moe"] = "qwen3_5_moe"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# config.json fields that hold special-token ids; eos may be a list of ids.
HF_SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _kind(value: Any) -> str:
    """A JSON value's kind for messages (never the value itself: it may be anything)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "a list"
    return {int: "an integer", float: "a number with a fraction", str: "a string",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def token_ids(value: Any, field: str, source: object, vocab_size: int | None = None,
              allow_list: bool = False) -> tuple[int, ...]:
    """A special-token id field of a config file -> its ids (empty for null).

    Accepts null, an integer or (``allow_list``: eos) a flat list of integers; JSON booleans,
    strings, floats and nested lists are refused, as is an id outside ``[0, vocab_size)``,
    with a ModelFormatError naming ``source`` and ``field``."""
    if value is None:
        return ()
    items = value if allow_list and isinstance(value, list) else [value]
    allowed = "an integer or a list of integers" if allow_list else "an integer"
    ids = []
    for v in items:
        if v is None and items is value:
            continue  # [2, null]: transformers writes null entries for unset ids
        if not isinstance(v, int) or isinstance(v, bool):
            where = " inside the list" if items is value else ""
            raise ModelFormatError(source, f"{field} must be {allowed}, got {_kind(v)}{where}")
        if vocab_size is not None and not 0 <= v < vocab_size:
            raise ModelFormatError(
                source, f"{field} {v} is outside the vocabulary (vocab_size {vocab_size})")
        ids.append(v)
    return tuple(dict.fromkeys(ids))


def _bad_value(e: BaseException, what: str = "bad value") -> str:
    """Message for a conversion that failed deep inside (``float("x")``, ``dict(3)``): the
    exception's own text can quote the file, so only a bounded excerpt of it is kept."""
    return f"{what} ({type(e).__name__}): {quote(str(e), 80)}"


def first_present(raw: Mapping[str, Any], *keys: str) -> str:
    """The first of ``keys`` present in ``raw`` (else the first key): names a field in messages."""
    return next((k for k in keys if k in raw), keys[0])


def read_hf_config_json(cfg_path: Path) -> dict[str, Any]:
    """The parsed top-level object of a config.json (ModelFormatError if it is not one)."""
    if not cfg_path.is_file():
        raise ModelFormatError(cfg_path, "config.json not found; is this a Hugging Face checkpoint directory?")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ModelFormatError(cfg_path, f"not valid UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ModelFormatError(cfg_path, f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ModelFormatError(cfg_path, "not valid JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ModelFormatError(cfg_path, "top level must be a JSON object")
    return raw


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


REQUIRED: Any = ...  # gguf_keys: no default, the key must be there


def gguf_keys(meta: Mapping[str, Any], prefix: str, source: object) -> Callable[..., Any]:
    """``get(key, default=REQUIRED)``: the GGUF metadata value of ``{prefix}.{key}``, ``default``
    when it is absent; a ModelFormatError naming the key when it is absent and required. One
    reader for the generic parser and the architectures that parse their own keys."""

    def get(key: str, default: Any = REQUIRED) -> Any:
        full = f"{prefix}.{key}"
        if full in meta:
            return meta[full]
        if default is REQUIRED:
            raise ModelFormatError(source, f"missing GGUF metadata key {full!r}")
        return default
    return get


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
    # e.g. engine.models.gpt_oss.GptOssParams); None for the architectures of the shared decoder.
    arch_params: Any = None

    def __post_init__(self) -> None:
        from engine.models.registry import ARCHITECTURES  # late: registry imports model files

        if self.arch not in ARCHITECTURES:
            raise UnsupportedArchitectureError(self.arch, list(ARCHITECTURES))
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        rope = dict(d["rope"])
        rope["freq_factors"] = tuple(rope.get("freq_factors", ()))
        d["rope"] = RopeConfig(**rope)
        if d.get("moe") is not None:
            moe = dict(d["moe"])
            moe["mlp_only_layers"] = tuple(moe.get("mlp_only_layers", ()))
            d["moe"] = MoEConfig(**moe)
        if d.get("linear_attn") is not None:
            la = dict(d["linear_attn"])
            la["full_attention_layers"] = tuple(la.get("full_attention_layers", ()))
            d["linear_attn"] = LinearAttentionConfig(**la)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if d.get("arch_params") is not None:
            from engine.models.registry import get_spec

            d["arch_params"] = get_spec(d["arch"]).params_from_dict(d["arch_params"])
        return cls(**d)

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dir_raw(path)[0]

    @classmethod
    def from_hf_dir_raw(cls, path: str | Path) -> tuple["ModelConfig", dict[str, Any]]:
        """``(config, the parsed config.json)`` of a checkpoint directory; config.json must
        resolve inside the directory (engine.loading.paths)."""
        from engine.loading.paths import confine  # late: engine.loading imports this module

        cfg_path = confine(Path(path), "config.json")
        raw = read_hf_config_json(cfg_path)
        try:
            return cls.from_hf_dict(raw, source=cfg_path), raw
        except ConfigError as e:  # a value out of range: name the file it came from
            raise ModelFormatError(cfg_path, str(e)) from None

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any], source: object = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise ModelFormatError(source, f"architectures must be a list of strings, got {_kind(archs)}")
        if model_type is not None and not isinstance(model_type, str):
            raise ModelFormatError(source, f"model_type must be a string, got {_kind(model_type)}")
        arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = HF_MODEL_TYPES.get(model_type)  # type: ignore[arg-type]
        if arch is None:
            raise UnsupportedArchitectureError(archs[0] if archs else model_type,
                                               list(HF_ARCHITECTURES))

        def integer(key: str, *aliases: str, default: int | None = None) -> int:
            """An integer field (JSON null counts as absent); ``default`` None: required."""
            name = first_present(raw, key, *aliases)
            value = raw.get(name)
            if value is None:
                if default is None:
                    raise ModelFormatError(source, f"missing required field {key!r}")
                return default
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ModelFormatError(source, f"{name} must be an integer, got {_kind(value)}")
            return value

        def layer_list(key: str) -> tuple[int, ...]:
            value = raw.get(key) or []
            if not (isinstance(value, list)
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in value)):
                raise ModelFormatError(source, f"{key} must be a list of integers")
            return tuple(value)

        try:
            from engine.models.registry import get_spec

            own_parser = get_spec(arch).config_from_hf
            if own_parser is not None:  # architectures with their own layers parse their fields
                return own_parser(raw, source)
            hidden = integer("hidden_size")
            heads = integer("num_attention_heads")
            head_dim = integer("head_dim", default=0) or hidden // heads
            moe = None
            if arch == "mixtral":
                moe = MoEConfig(
                    num_experts=integer("num_local_experts"),
                    top_k=integer("num_experts_per_tok"),
                    expert_intermediate_size=integer("intermediate_size"),
                    norm_topk_prob=True,
                )
            elif arch in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
                shared = integer("shared_expert_intermediate_size", default=0)
                moe = MoEConfig(
                    num_experts=integer("num_experts", "num_local_experts"),
                    top_k=integer("num_experts_per_tok"),
                    expert_intermediate_size=integer("moe_intermediate_size"),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=shared if arch in ("qwen2_moe", "qwen3_next") else 0,
                    shared_expert_gate=arch in ("qwen2_moe", "qwen3_next") and shared > 0,
                    decoder_sparse_step=integer("decoder_sparse_step", default=1) or 1,
                    mlp_only_layers=layer_list("mlp_only_layers"),
                )
            if arch == "qwen2_moe":
                bias = bool(raw.get("qkv_bias", True))
            else:
                bias = bool(raw.get("attention_bias", False))
            vocab = integer("vocab_size")
            ids = {f: token_ids(raw.get(f), f, source, vocab if vocab > 0 else None,
                                allow_list=f == "eos_token_id") for f in HF_SPECIAL_TOKEN_FIELDS}
            return cls(
                arch=arch,
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=integer("intermediate_size", default=0),
                num_layers=integer("num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=integer("num_key_value_heads", default=0) or heads,
                head_dim=head_dim,
                max_position_embeddings=integer("max_position_embeddings", default=4096),
                rms_norm_eps=_number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
                rope=_rope_from_hf(raw, source),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bias,
                qk_norm=arch in ("qwen3_moe", "qwen3_next"),
                moe=moe,
                bos_token_id=ids["bos_token_id"][0] if ids["bos_token_id"] else None,
                eos_token_ids=ids["eos_token_id"],
                **(_qwen3_next_fields(raw, integer, source) if arch == "qwen3_next" else {}),
            )
        except (TypeError, ValueError, ArithmeticError) as e:
            if isinstance(e, (ConfigError, ModelFormatError, UnsupportedArchitectureError)):
                raise
            raise ModelFormatError(source, _bad_value(e)) from None

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: object = "model.gguf") -> "ModelConfig":
        """Build from GGUF key/values (already parsed: ints, floats, strings, lists)."""
        garch = meta.get("general.architecture")
        if garch not in GGUF_ARCHITECTURES:
            raise UnsupportedArchitectureError(garch, list(GGUF_ARCHITECTURES))
        arch = GGUF_ARCHITECTURES[garch]
        from engine.models.registry import get_spec

        own_parser = get_spec(arch).config_from_gguf
        if own_parser is not None:  # architectures with their own layers parse their keys
            try:
                return own_parser(meta, source)
            except (TypeError, ValueError, ArithmeticError) as e:
                if isinstance(e, (ConfigError, ModelFormatError, UnsupportedArchitectureError)):
                    raise
                raise ModelFormatError(source, _bad_value(e, "bad metadata value")) from None
        if arch == "llama" and int(meta.get("llama.expert_count", 0) or 0) > 0:
            arch = "mixtral"  # llama.cpp writes Mixtral as a llama with experts

        need = get = gguf_keys(meta, garch, source)

        try:
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
                    norm_topk_prob=arch == "mixtral" or bool(get("expert_weights_norm", arch == "qwen3_moe")),
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
            bos = meta.get("tokenizer.ggml.bos_token_id")
            eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
            eos = [int(meta[f"tokenizer.ggml.{k}"]) for k in eos_keys if f"tokenizer.ggml.{k}" in meta]
            return cls(
                arch=arch,
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
                qk_norm=arch == "qwen3_moe",
                moe=moe,
                bos_token_id=None if bos is None else int(bos),
                eos_token_ids=tuple(dict.fromkeys(eos)),
            )
        except (TypeError, ValueError, ArithmeticError) as e:
            if isinstance(e, (ConfigError, ModelFormatError, UnsupportedArchitectureError)):
                raise
            raise ModelFormatError(source, _bad_value(e, "bad metadata value")) from None


def _qwen3_next_fields(raw: Mapping[str, Any], integer, source: object) -> dict[str, Any]:
    """The ModelConfig fields of a Qwen3-Next config.json: which layers are full attention
    (``layer_types``, else every ``full_attention_interval``-th), the DeltaNet shapes, partial
    RoPE (``partial_rotary_factor``, top level or in ``rope_parameters``; default 0.25)."""
    layers = integer("num_hidden_layers")
    types = raw.get("layer_types")
    if types is not None:
        if not (isinstance(types, list) and len(types) == layers
                and all(t in ("linear_attention", "full_attention") for t in types)):
            raise ModelFormatError(source, f"layer_types must list 'linear_attention' or "
                                           f"'full_attention' for each of the {layers} layers")
        full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    else:
        interval = integer("full_attention_interval", default=4)
        if interval < 1:
            raise ModelFormatError(source, f"full_attention_interval must be >= 1, got {interval}")
        full = tuple(i for i in range(layers) if (i + 1) % interval == 0)
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    prf = raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.25))
    return dict(
        attn_output_gate=True,
        partial_rotary_factor=_number(prf, "partial_rotary_factor", source),
        norm_zero_centred=True,
        linear_attn=LinearAttentionConfig(
            num_key_heads=integer("linear_num_key_heads", default=16),
            num_value_heads=integer("linear_num_value_heads", default=32),
            key_head_dim=integer("linear_key_head_dim", default=128),
            value_head_dim=integer("linear_value_head_dim", default=128),
            conv_kernel=integer("linear_conv_kernel_dim", default=4),
            full_attention_layers=full,
        ),
    )


def _number(value: Any, field: str, source: object) -> float:
    """A numeric config field (JSON integer or float, not a boolean) as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFormatError(source, f"{field} must be a number, got {_kind(value)}")
    return float(value)


def _rope_from_hf(raw: Mapping[str, Any], source: object = "config.json") -> RopeConfig:
    """transformers 5 writes ``rope_parameters``; older configs ``rope_theta`` + ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    if not isinstance(rtype, str):
        raise ModelFormatError(source, f"rope_type must be a string, got {_kind(rtype)}")
    kw: dict[str, Any] = {"theta": _number(theta, "rope_theta", source), "type": rtype}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim", "attention_factor"):
        if params.get(key) is not None:
            kw[key] = _number(params[key], key, source)
    if "truncate" in params:
        kw["truncate"] = bool(params["truncate"])
    omp = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    if omp:
        kw["original_max_position_embeddings"] = int(_number(omp, "original_max_position_embeddings", source))
    return RopeConfig(**kw)
