"""The config.json of a Qwen4-Exp checkpoint -> ModelConfig with :class:`Qwen4ExpParams`.

Two layouts: the published ``Qwen4ExpForConditionalGeneration`` (model_type ``qwen4_exp``, the
text model's fields nested in ``text_config`` of model_type ``qwen4_exp_text``, tied head by the
top-level ``tie_word_embeddings``) and the text-only ``Qwen4ExpForCausalLM`` (the same fields
flat). The base fields are Qwen3.5-MoE's (Qwen3-Next's DeltaNet shapes, gated attention,
partial RoPE, the multimodal-RoPE sections); ``layer_types`` may say ``full_attention`` or
``indexed_attention`` for the attention layers (the published config says the former; with
QSA configured every attention layer is indexed).

What the reference's config class refuses is refused here, each with a ModelFormatError naming
the file and field: a layer type other than those, an output gate other than silu / sigmoid,
hc_count <= 1, a partial QSA config, non-positive QSA values, indexer_kv_heads != 1,
indexer_budget not divisible by indexer_compress_ratio, a rotary width wider than the index
head, ple_embed_dim not divisible by the n-gram heads, PLE layer ids outside 1..layers or on a
non-linear layer, PLE without eos_token_id.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from engine.config import ModelConfig
from engine.configio.fields import kind
from engine.configio.hf_decoder import decoder_config
from engine.errors import ConfigError, ModelFormatError
from engine.kv.qsa_index import QSASpec
from engine.models.qwen3_5_moe.config import DEFAULT_MROPE_SECTION, mrope_layout, rope_params
from engine.models.qwen3_next.config import hf_fields
from engine.models.qwen4_exp.ngram import NGramHash, ngram_hash, stated_hash

HF_ARCHITECTURES = ("Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLM")
MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
LAYER_TYPES = ("linear_attention", "full_attention", "indexed_attention")
GATES = ("silu", "sigmoid")
_QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
# text_config keys the generic reader must not see (read here, or not ModelConfig's)
_OWN_FIELDS = ("decoder_sparse_step", "mlp_only_layers", "intermediate_size")


@dataclass(frozen=True)
class Qwen4ExpParams:
    """ModelConfig.arch_params of a Qwen4-Exp (kept in the store manifest). ``ple_layers`` are
    0-based layer indices (the config's ``ple_layer_ids`` are 1-based); indexer_heads 0: no QSA
    (plain gated attention)."""

    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layers: tuple[int, ...] = ()
    ple_embed_dim: int = 0
    ple_conv_kernel: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_base: int = 20_000_000
    ngram_vocab_divisor: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    ple_eos: int = -1
    indexer_heads: int = 0
    indexer_head_dim: int = 0
    indexer_budget: int = 0
    indexer_ratio: int = 1
    output_gate: str = "silu"
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION
    mrope_interleaved: bool = True
    # A GGUF states the hash of its one PLE layer instead of (seed, ngram_vocab_base): the
    # multipliers [ngram_size] and head vocab sizes [ngram heads]; () = derived (ngram.ngram_hash)
    ngram_multipliers: tuple[int, ...] = ()
    ngram_head_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.hc_count <= 1:
            raise ConfigError(f"Qwen4-Exp needs hc_count > 1 (hyper-connection streams), got {self.hc_count}")
        if self.hc_lowrank < 1:
            raise ConfigError(f"hc_lowrank must be >= 1, got {self.hc_lowrank}")
        if self.output_gate not in GATES:
            raise ConfigError(f"output_gate_type {self.output_gate!r} is not supported; allowed: {', '.join(GATES)}")
        if self.indexer_heads:
            for name in ("indexer_head_dim", "indexer_budget", "indexer_ratio"):
                if getattr(self, name) < 1:
                    raise ConfigError(f"QSA {name} must be positive, got {getattr(self, name)}")
            if self.indexer_budget % self.indexer_ratio:
                raise ConfigError(f"indexer_budget ({self.indexer_budget}) must be divisible by "
                                  f"indexer_compress_ratio ({self.indexer_ratio})")
        if self.ple_layers:
            heads = self.ngram_heads
            if heads <= 0 or self.ple_embed_dim <= 0 or self.ple_embed_dim % heads:
                raise ConfigError(f"ple_embed_dim ({self.ple_embed_dim}) must be positive and divisible by the "
                                  f"{heads} n-gram heads ((ngram_size - 1) * heads_per_ngram)")
            if self.ple_eos < 0:
                raise ConfigError("eos_token_id must be set when Qwen4-Exp PLE layers are enabled "
                                  "(n-grams are cut at eos and padded with it)")
            for name in ("ngram_vocab_base", "ngram_vocab_divisor", "ple_conv_kernel", "split_ngram_parts"):
                if getattr(self, name) < 1:
                    raise ConfigError(f"PLE {name} must be >= 1, got {getattr(self, name)}")

    # ---- derived -----------------------------------------------------------------------------
    @property
    def qsa(self) -> bool:
        return self.indexer_heads > 0

    def qsa_spec(self, cfg: ModelConfig) -> QSASpec | None:
        """The paged QSA index's sizes (engine.kv.qsa_index), None without QSA."""
        if not self.qsa:
            return None
        return QSASpec(len(cfg.attention_layers), self.indexer_heads, self.indexer_head_dim, self.indexer_budget,
                       self.indexer_ratio)

    @property
    def ngram_heads(self) -> int:
        """G: hash heads of one PLE layer."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_row_dim(self) -> int:
        return self.ple_embed_dim // self.ngram_heads

    @property
    def ple_conv_window(self) -> int:
        """Inputs the dilated PLE conv keeps per channel: (kernel - 1) * dilation (= ngram_size)."""
        return (self.ple_conv_kernel - 1) * self.ngram_size

    def ngram_hash(self, cfg: ModelConfig, ple_index: int) -> NGramHash:
        if self.ngram_multipliers:
            return stated_hash(self.ngram_multipliers, self.ngram_head_sizes, self.heads_per_ngram,
                               self.ngram_vocab_divisor, self.ple_eos)
        return ngram_hash(vocab_size=cfg.vocab_size, ngram_size=self.ngram_size, heads_per_ngram=self.heads_per_ngram,
                          vocab_base=self.ngram_vocab_base, divisor=self.ngram_vocab_divisor, seed=self.seed,
                          ple_layer_index=ple_index, eos=self.ple_eos)

    def parameter_counts(self, cfg: ModelConfig) -> dict[str, int]:
        from engine.models.qwen4_exp.counts import parameter_counts

        return parameter_counts(cfg)

    def info_lines(self, cfg: ModelConfig, human) -> list[str]:
        from engine.models.qwen4_exp.info import info_lines

        return info_lines(cfg, human)

    def recurrent_state(self, cfg: ModelConfig, num_slots: int | None, device) -> Any:
        """engine.kv.state's hook: the per-sequence state of this model (DeltaNet + PLE conv + n-gram
        context + QSA index keys)."""
        from engine.models.qwen4_exp.state import Qwen4ExpState

        return Qwen4ExpState(cfg, num_slots, device)

    def extra_state_bytes(self, cfg: ModelConfig) -> int:
        """Bytes per sequence beyond the DeltaNet state: the PLE conv windows (fp32) and the n-gram
        context (int64)."""
        if not self.ple_layers:
            return 0
        return len(self.ple_layers) * self.hc_count * cfg.hidden_size * self.ple_conv_window * 4 + (
            (self.ngram_size - 1) * 8)


def params_from_dict(d: Mapping[str, Any]) -> Qwen4ExpParams:
    d = dict(d)
    d["ple_layers"] = tuple(d["ple_layers"])
    d["mrope_section"] = tuple(d["mrope_section"])
    for name in ("ngram_multipliers", "ngram_head_sizes"):
        d[name] = tuple(d.get(name, ()))
    return Qwen4ExpParams(**d)


def text_fields(raw: Mapping[str, Any], source: object) -> dict[str, Any]:
    """The text model's fields: ``text_config`` of the VLM layout, else the flat config."""
    if raw.get("model_type") == "qwen4_exp_text" or "text_config" not in raw:
        if "hidden_size" in raw:
            return dict(raw)
    text = raw.get("text_config")
    if not isinstance(text, dict):
        what = "missing" if text is None else f"{kind(text)}, not an object"
        raise ModelFormatError(source, f"Qwen4-Exp: 'text_config' is {what}; the text model's fields "
                                       f"(hidden_size, layer_types, ...) must be nested in a text_config object")
    return dict(text)


def _int(text: Mapping[str, Any], name: str, default: Any, source: object) -> Any:
    v = text.get(name, default)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise ModelFormatError(source, f"text_config.{name} must be an integer, got {kind(v)}")
    return v


def _layer_types(text: Mapping[str, Any], layers: int, source: object) -> list[str]:
    types = text.get("layer_types")
    if types is None:
        interval = _int(text, "full_attention_interval", 4, source)
        if interval < 1:
            raise ModelFormatError(source, f"text_config.full_attention_interval must be >= 1, got {interval}")
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise ModelFormatError(source, f"text_config.layer_types must list one type for each of the {layers} layers")
    bad = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if bad:
        raise ModelFormatError(source, f"unsupported Qwen4-Exp layer types {bad}; allowed: {', '.join(LAYER_TYPES)}")
    return ["full_attention" if t == "indexed_attention" else t for t in types]


def _qsa(text: Mapping[str, Any], rotary_dim: int, source: object) -> dict[str, int]:
    values = {n: _int(text, n, None, source) for n in _QSA_FIELDS}
    if all(v is None for v in values.values()):
        return {}
    missing = [n for n, v in values.items() if v is None]
    if missing:
        raise ModelFormatError(source, f"QSA config is missing {missing} (all of {', '.join(_QSA_FIELDS)} or none)")
    bad = {n: v for n, v in values.items() if v <= 0}
    if bad:
        raise ModelFormatError(source, f"QSA config values must be positive, got {bad}")
    if values["indexer_kv_heads"] != 1:
        raise ModelFormatError(source, f"Qwen4-Exp QSA needs indexer_kv_heads=1, got {values['indexer_kv_heads']}")
    if values["indexer_budget"] % values["indexer_compress_ratio"]:
        raise ModelFormatError(source, f"indexer_budget ({values['indexer_budget']}) must be divisible by "
                                       f"indexer_compress_ratio ({values['indexer_compress_ratio']})")
    if rotary_dim > values["indexer_head_dim"]:
        raise ModelFormatError(source, f"the attention's RoPE width {rotary_dim} must fit the QSA index head: "
                                       f"indexer_head_dim={values['indexer_head_dim']}")
    return dict(indexer_heads=values["indexer_n_heads"], indexer_head_dim=values["indexer_head_dim"],
                indexer_budget=values["indexer_budget"], indexer_ratio=values["indexer_compress_ratio"])


def _ple(text: Mapping[str, Any], types: list[str], hidden: int, eos: tuple[int, ...], source: object) -> dict:
    ids = text.get("ple_layer_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelFormatError(source, "text_config.ple_layer_ids must be a list of integers (1-based layer ids)")
    ids = sorted(set(ids))
    out = dict(ple_embed_dim=_int(text, "ple_embed_dim", None, source) or hidden,
               ple_conv_kernel=_int(text, "ple_conv_kernel_size", 4, source),
               ngram_size=_int(text, "ngram_size", 3, source), heads_per_ngram=_int(text, "heads_per_ngram", 8, source),
               ngram_vocab_base=_int(text, "ngram_vocab_size_base", 20_000_000, source),
               ngram_vocab_divisor=_int(text, "make_ngram_vocab_size_divisible_by", 128, source),
               seed=_int(text, "seed", 1234, source), split_ngram_parts=_int(text, "split_ngram_parts", 512, source))
    if not ids:
        return out
    outside = [i for i in ids if not 1 <= i <= len(types)]
    if outside:
        raise ModelFormatError(source, f"ple_layer_ids must be 1-based ids in [1, {len(types)}], got {outside}")
    not_linear = [i for i in ids if types[i - 1] != "linear_attention"]
    if not_linear:
        raise ModelFormatError(source, f"Qwen4-Exp PLE sits on linear_attention layers only; ple_layer_ids "
                                       f"{not_linear} are attention layers")
    if not eos:
        raise ModelFormatError(source, "eos_token_id must be set when Qwen4-Exp PLE layers are enabled")
    return dict(out, ple_layers=tuple(i - 1 for i in ids), ple_eos=eos[0])


def config_from_hf(raw: Mapping[str, Any], source: object) -> ModelConfig:
    text = text_fields(raw, source)
    layers = _int(text, "num_hidden_layers", None, source)
    if layers is None or layers < 1:
        raise ModelFormatError(source, "text_config.num_hidden_layers must be a positive integer")
    types = _layer_types(text, layers, source)
    gate = text.get("output_gate_type") or text.get("hidden_act", "silu")
    if gate not in GATES:
        raise ModelFormatError(source, f"unsupported Qwen4-Exp output gate activation {gate!r}; allowed: {', '.join(GATES)}")
    hc = _int(text, "hc_count", 4, source)
    if hc <= 1:
        raise ModelFormatError(source, f"Qwen4-Exp requires hc_count > 1, got {hc}")
    flat = {k: v for k, v in text.items() if k not in _OWN_FIELDS}
    flat.update(layer_types=types, norm_topk_prob=text.get("norm_topk_prob", True) is not False,
                tie_word_embeddings=(raw if "text_config" in raw else text).get("tie_word_embeddings", False) is True)
    base = decoder_config("qwen4_exp", flat, source, hf_fields)
    params = rope_params(text, source)
    section, interleaved = mrope_layout(params, base.rotary_dim, source)
    fields = dict(hc_count=hc, hc_lowrank=_int(text, "hc_lowrank", 320, source), output_gate=gate,
                  mrope_section=section, mrope_interleaved=interleaved,
                  **_qsa(text, base.rotary_dim, source),
                  **_ple(text, types, base.hidden_size, base.eos_token_ids, source))
    try:
        arch = Qwen4ExpParams(**fields)
    except ConfigError as e:
        raise ModelFormatError(source, str(e)) from None
    return replace(base, arch_params=arch)
