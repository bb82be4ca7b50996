"""Readers of single config values, shared by the generic parsers (engine.configio.hf, .gguf)
and the architectures that parse their own fields: each refuses a wrongly typed or missing
value with a ModelFormatError naming the file and the field. Imports nothing of engine.models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from engine.config import MoEConfig, RopeConfig
from engine.errors import ModelFormatError, quote

# config.json fields that hold special-token ids; eos may be a list of ids.
HF_SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def kind(value: Any) -> str:
    """A JSON value's kind for messages (never the value itself: it may be anything)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "a list"
    return {int: "an integer", float: "a number with a fraction", str: "a string",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def bad_value(e: BaseException, what: str = "bad value") -> str:
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
            raise ModelFormatError(source, f"{field} must be {allowed}, got {kind(v)}{where}")
        if vocab_size is not None and not 0 <= v < vocab_size:
            raise ModelFormatError(
                source, f"{field} {v} is outside the vocabulary (vocab_size {vocab_size})")
        ids.append(v)
    return tuple(dict.fromkeys(ids))


def number(value: Any, field: str, source: object) -> float:
    """A numeric config field (JSON integer or float, not a boolean) as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFormatError(source, f"{field} must be a number, got {kind(value)}")
    return float(value)


Integer = Callable[..., int]  # integer(key, *aliases, default=None) -> int


def hf_integers(raw: Mapping[str, Any], source: object) -> Integer:
    """``integer(key, *aliases, default=None)``: an integer field of ``raw`` under ``key`` or
    the first alias present (JSON null counts as absent, 2.0 as 2); ``default`` None: required."""

    def integer(key: str, *aliases: str, default: int | None = None) -> int:
        name = first_present(raw, key, *aliases)
        value = raw.get(name)
        if value is None:
            if default is None:
                raise ModelFormatError(source, f"missing required field {key!r}")
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelFormatError(source, f"{name} must be an integer, got {kind(value)}")
        return value
    return integer


def layer_list(raw: Mapping[str, Any], key: str, source: object) -> tuple[int, ...]:
    """A list-of-layer-indices field (absent or null: empty)."""
    value = raw.get(key) or []
    if not (isinstance(value, list)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value)):
        raise ModelFormatError(source, f"{key} must be a list of integers")
    return tuple(value)


def hf_special_tokens(raw: Mapping[str, Any], source: object, vocab: int) -> dict[str, Any]:
    """The ``bos_token_id`` / ``eos_token_ids`` ModelConfig fields of a config.json."""
    ids = {f: token_ids(raw.get(f), f, source, vocab if vocab > 0 else None,
                        allow_list=f == "eos_token_id") for f in HF_SPECIAL_TOKEN_FIELDS}
    return {"bos_token_id": ids["bos_token_id"][0] if ids["bos_token_id"] else None,
            "eos_token_ids": ids["eos_token_id"]}


def hf_qwen_moe(raw: Mapping[str, Any], integer: Integer, source: object, shared: bool) -> MoEConfig:
    """The routed-expert block of a Qwen-family config.json (Qwen2-MoE, Qwen3-MoE, Qwen3-Next):
    ``decoder_sparse_step`` / ``mlp_only_layers``; ``shared``: a shared expert behind a sigmoid
    gate when ``shared_expert_intermediate_size`` > 0 (Qwen3-MoE has none)."""
    width = integer("shared_expert_intermediate_size", default=0)
    return MoEConfig(
        num_experts=integer("num_experts", "num_local_experts"),
        top_k=integer("num_experts_per_tok"),
        expert_intermediate_size=integer("moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=width if shared else 0,
        shared_expert_gate=shared and width > 0,
        decoder_sparse_step=integer("decoder_sparse_step", default=1) or 1,
        mlp_only_layers=layer_list(raw, "mlp_only_layers", source),
    )


def rope_from_hf(raw: Mapping[str, Any], source: object = "config.json") -> RopeConfig:
    """transformers 5 writes ``rope_parameters``; older configs ``rope_theta`` + ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    if not isinstance(rtype, str):
        raise ModelFormatError(source, f"rope_type must be a string, got {kind(rtype)}")
    kw: dict[str, Any] = {"theta": number(theta, "rope_theta", source), "type": rtype}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim", "attention_factor"):
        if params.get(key) is not None:
            kw[key] = number(params[key], key, source)
    if "truncate" in params:
        kw["truncate"] = bool(params["truncate"])
    omp = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    if omp:
        kw["original_max_position_embeddings"] = int(number(omp, "original_max_position_embeddings", source))
    return RopeConfig(**kw)


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


def gguf_rope(get: Callable[..., Any], theta: float, **extra: Any) -> RopeConfig:
    """The RoPE of llama.cpp's ``rope.*`` keys read through ``get`` (a :func:`gguf_keys` reader):
    base frequency (``theta`` when absent) and the YaRN scaling fields; ``extra`` sets the
    architecture's own RopeConfig fields (mscale, truncate)."""
    scaling = get("rope.scaling.type", "none")
    return RopeConfig(theta=float(get("rope.freq_base", theta)),
                      type={"none": "default", "yarn": "yarn"}.get(scaling, scaling),
                      factor=float(get("rope.scaling.factor", 1.0) or 1.0),
                      original_max_position_embeddings=int(get("rope.scaling.original_context_length", 4096)),
                      beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                      beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)), **extra)


def gguf_special_tokens(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``bos_token_id`` / ``eos_token_ids`` ModelConfig fields of GGUF metadata (eos: the
    eos, eot and eom ids present, deduplicated)."""
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [int(meta[f"tokenizer.ggml.{k}"]) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if f"tokenizer.ggml.{k}" in meta]
    return {"bos_token_id": None if bos is None else int(bos), "eos_token_ids": tuple(dict.fromkeys(eos))}
