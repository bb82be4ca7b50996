"""The config.json of a Qwen3.5/3.6 MoE checkpoint (``Qwen3_5MoeForConditionalGeneration``,
model_type ``qwen3_5_moe``) -> ModelConfig.

The text model's fields live in the nested ``text_config`` object (transformers'
Qwen3_5MoeTextConfig); they are Qwen3-Next's fields minus ``norm_topk_prob`` (the router always
renormalises its top-k), ``decoder_sparse_step`` and ``mlp_only_layers`` (every layer is sparse),
``intermediate_size`` (no dense layers). The head is tied when the *top-level*
``tie_word_embeddings`` says so (the VLM class ties by its own config; default false).

Multimodal RoPE: ``rope_parameters.mrope_section`` [t, h, w] splits the rotary frequencies
(rotary_dim / 2 of them: the reference's convention) between the temporal, height and width
position grids, interleaved (``mrope_interleaved``: frequency i takes grid h when i % 3 == 1 and
i < 3 h, grid w when i % 3 == 2 and i < 3 w, else t; transformers applies this layout whatever
the flag says). Text tokens have the three grids equal to the token position, so every frequency
sees the same position and the tables are plain partial RoPE (engine.layers.rope.Rotary), which
the model runs; the sections are still checked, as the reference's layout needs them to cover
the rotary frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from engine.config import ModelConfig
from engine.configio.fields import kind
from engine.configio.hf_decoder import decoder_config
from engine.errors import ModelFormatError
from engine.models.qwen3_next.config import hf_fields

HF_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
MODEL_TYPE = "qwen3_5_moe"

# transformers' default when rope_parameters omit it (Qwen3_5MoeTextRotaryEmbedding)
DEFAULT_MROPE_SECTION = (11, 11, 10)
# text_config keys the reference's text config does not have (deleted or AttributeError there)
_NOT_TEXT_FIELDS = ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "intermediate_size")


@dataclass(frozen=True)
class Qwen35MoeParams:
    """ModelConfig.arch_params of a Qwen3.5-MoE: its multimodal RoPE layout (text-only serving
    uses it only to validate the config; kept in the store manifest)."""

    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION
    mrope_interleaved: bool = True


def params_from_dict(d: Mapping[str, Any]) -> Qwen35MoeParams:
    return Qwen35MoeParams(mrope_section=tuple(d["mrope_section"]),  # type: ignore[arg-type]
                           mrope_interleaved=bool(d["mrope_interleaved"]))


def config_from_hf(raw: Mapping[str, Any], source: object) -> ModelConfig:
    """ModelConfig of a Qwen3_5MoeForConditionalGeneration config.json: the text model parsed
    as Qwen3-Next's fields (engine.models.qwen3_next.config) under the key ``qwen3_5_moe``."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        what = "missing" if text is None else f"{kind(text)}, not an object"
        raise ModelFormatError(source, f"Qwen3.5-MoE: 'text_config' is {what}; the text "
                                       f"model's fields (hidden_size, layer_types, ...) must be nested "
                                       f"in a text_config object")
    flat = {k: v for k, v in text.items() if k not in _NOT_TEXT_FIELDS}
    flat.update(norm_topk_prob=True, tie_word_embeddings=raw.get("tie_word_embeddings", False) is True)
    params = rope_params(text, source)
    base = decoder_config(MODEL_TYPE, flat, source, hf_fields)
    section, interleaved = mrope_layout(params, base.rotary_dim, source)
    return replace(base, arch_params=Qwen35MoeParams(mrope_section=section, mrope_interleaved=interleaved))


def rope_params(text: Mapping[str, Any], source: object) -> dict[str, Any]:
    params = text.get("rope_parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ModelFormatError(source, f"text_config.rope_parameters must be an object, got {kind(params)}")
    return params


def mrope_layout(params: Mapping[str, Any], rotary_dim: int, source: object) -> tuple[tuple[int, int, int], bool]:
    """(mrope_section, mrope_interleaved) of ``rope_parameters``, checked: three non-negative
    integers summing to rotary_dim / 2 (one per rotary frequency)."""
    section = params.get("mrope_section", list(DEFAULT_MROPE_SECTION))
    if not (isinstance(section, list) and len(section) == 3
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)):
        raise ModelFormatError(source, "text_config.rope_parameters.mrope_section must be a list of "
                                       "three non-negative integers [t, h, w]")
    if sum(section) != rotary_dim // 2:
        origin = "" if "mrope_section" in params else " (absent: transformers' default)"
        raise ModelFormatError(source, f"text_config.rope_parameters.mrope_section {section}{origin} sums "
                                       f"to {sum(section)}; it must cover the {rotary_dim // 2} rotary "
                                       f"frequencies (half the rotary width {rotary_dim})")
    interleaved = params.get("mrope_interleaved", True)
    if not isinstance(interleaved, bool):
        raise ModelFormatError(source, f"text_config.rope_parameters.mrope_interleaved must be a "
                                       f"boolean, got {kind(interleaved)}")
    return (section[0], section[1], section[2]), interleaved
