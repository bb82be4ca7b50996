"""Tensor names of a Qwen4-Exp checkpoint -> canonical names.

    model.language_model.X      -> model.X   (the VLM layout; Qwen4ExpForCausalLM stores model.X)
    model.visual.*, mtp.*       -> dropped (the vision tower is not served; no MTP drafter yet)
    ...ple.ple_embedding.{layer_multipliers, ngram_heads_vocab_sizes, ngram_heads_offsets}
                                -> dropped: buffers the config determines (engine.models.qwen4_exp.ngram
                                   recomputes them; tests compare with transformers')
    ...ple.ple_embedding.ngram_embedding.shard_{k}.weight
                                -> kept as shards (canonical ``model.layers.{i}.ple.ngram.shard_{k}``):
                                   the table is ``split_ngram_parts`` row chunks (torch.chunk sizes:
                                   ceil(rows / parts) each, the last shorter), never concatenated,
                                   so no loader ever holds two copies of a table of tens of GiB
    ...ple.ple_embedding.ngram_embedding.weight (an unsplit table) -> shard_0 of a 1-part table

The DeltaNet projections are Qwen3.5-MoE's (split on disk, fused here) and block-FP8 weights are
dequantized when read: both by engine.models.qwen3_5_moe.names.hf_split.
"""

from __future__ import annotations

import math
import re

from engine.config import ModelConfig
from engine.models.qwen3_5_moe import names as q35
from engine.models.spec import canonical_name

HF_RENAMES = ((r"^model\.(?:language_model\.)?(layers\.\d+\.ple\.)ple_embedding\.ngram_embedding\.(shard_\d+)"
               r"\.weight$", r"model.\1ngram.\2"),
              (r"^model\.(?:language_model\.)?(layers\.\d+\.ple\.)ple_embedding\.ngram_embedding\.weight$",
               r"model.\1ngram.shard_0"),
              (r"^model\.language_model\.", "model."))
_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_TEXT_ONLY = re.compile(r"^model\.(?!language_model\.|visual\.)")


def canonical(stored: str) -> str:
    return canonical_name(HF_RENAMES, stored)


def shard_rows(rows: int, parts: int) -> list[int]:
    """Row counts of the shards torch.chunk(table, parts) writes (fewer than ``parts`` when the
    rows run out)."""
    size = math.ceil(rows / parts)
    return [min(size, rows - a) for a in range(0, rows, size)]


def hf_split(stored: str, shape: tuple[int, ...], dtype: str, get, config: ModelConfig):
    """ArchSpec.hf_split: [] for tensors never read; PLE shards renamed; the rest as Qwen3.5-MoE
    (VLM-layout names; a text-only checkpoint's ``model.*`` are looked at as if under
    ``model.language_model.``)."""
    if stored.endswith(_BUFFERS) or stored.endswith(".weight_scale_inv"):
        return []
    if ".ple.ple_embedding.ngram_embedding." in stored:
        if dtype not in q35.FP8_DTYPES:
            return None  # the generic path under HF_RENAMES
        return [(canonical(stored), shape, dtype, lambda: q35._read(get, stored))]
    if _TEXT_ONLY.match(stored):
        vlm = "model.language_model." + stored[len("model."):]

        def get_vlm(name: str):
            return get("model." + name[len("model.language_model."):] if name.startswith("model.language_model.")
                       else name)

        return q35.hf_split(vlm, shape, dtype, get_vlm, config)
    return q35.hf_split(stored, shape, dtype, get, config)
