"""Qwen4-Exp (Qwen3.8-Flash-Next) from GGUF: llama.cpp's ``qwen4exp`` metadata and tensor names.

llama.cpp's converter (conversion/qwen4exp.py, Qwen4ExpTextModel) writes the text model as a
``qwen35moe`` file does (DeltaNet value heads re-tiled, norms stored 1 + w, ``A_log`` as -exp:
undone by engine.models.qwen3_5_moe.gguf) plus, with H = hidden and S = hc_count x H:

    HF (model.language_model.)                    GGUF                          here
    layers.N.{attn,mlp}_hyper_connection.hc_norm  blk.N.hc_{attn,ffn}_norm [S]   w - 1
      .input_mix_weight_down / _up                  _down [lr, S] / _up [S, lr]  as is
      .block_inject_weight                          _inject [hc, S]              as is
    hyper_connection_mixer.*  (no final norm)     output_hc_{norm,down,up}       as above
    layers.N.self_attn.indexer.index_qk_proj      blk.N.indexer.q_proj [h D, H]  one tensor again
      [(h + 1) D, H]                                + indexer.k_proj [D, H]        (q rows, then k)
    .indexer.{q,k}_layernorm                      blk.N.indexer.{q,k}_norm       w - 1
    layers.N.ple.{key,value}_proj                 blk.N.ple_{key,value}          as is
    layers.N.ple.norm_{key,query,conv}            blk.N.ple_norm_*               w - 1
    layers.N.ple.conv1d [S, 1, K]                 blk.N.ple_conv1d [S, K]        [S, 1, K]
    layers.N.ple.ple_embedding.ngram_embedding    per_layer_token_embd [R, d]    one shard: the rows
      (split_ngram_parts shards of rows)            (one table, no block id)       of the heads' ranges

Metadata: ``qwen35moe``'s keys under ``qwen4exp.`` plus ``hyper_connection.{count,low_rank}``,
``attention.indexer.{head_count,key_length,top_k}`` (top_k is the token budget),
``attention.compress_ratios`` (per layer; the attention layers' ratio, 0 elsewhere), ``ple.layers``
(0-based), ``ple.{ngram_size,heads_per_ngram,conv_kernel,eos_token_id}``, the hash constants
``ple.{layer_multipliers,head_offsets,head_vocab_sizes}`` and ``embedding_length_per_layer_input``
(the table's row width). What the format cannot say, and how it is read, as llama.cpp reads it:

* one PLE layer at most (the file holds one table and one set of hash constants);
* the DeltaNet output gate is sigmoid (llama.cpp's graph has no other);
* a compress ratio of 0 on every attention layer means dense attention (no QSA; the indexer
  tensors are then not read). llama.cpp's converter writes exactly that when transformers 5
  loads the config (it renames ``full_attention`` to ``indexed_attention``, which the
  converter's ratio rule does not recognise); bench/llama_cpp_converter.py names them back.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Mapping

import torch

from engine.config import ModelConfig
from engine.configio.fields import gguf_keys
from engine.errors import ConfigError, ModelFormatError
from engine.models.qwen3_5_moe import gguf as q35_gguf
from engine.models.qwen4_exp.config import config_from_hf

GGUF_ARCH = "qwen4exp"
_NAME_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9.]+)$")
_HYPER = {"norm.weight": "hc_norm.weight", "down.weight": "input_mix_weight_down.weight",
          "up.weight": "input_mix_weight_up.weight", "inject.weight": "block_inject_weight.weight"}
_PLE = {"ple_key.weight": "key_proj.weight", "ple_value.weight": "value_proj.weight",
        "ple_norm_key.weight": "norm_key.weight", "ple_norm_query.weight": "norm_query.weight",
        "ple_norm_conv.weight": "norm_conv.weight"}
PLE_TABLE = "per_layer_token_embd.weight"


def config_from_gguf(meta: Mapping[str, Any], source: object) -> ModelConfig:
    """The ModelConfig of a ``qwen4exp`` GGUF, parsed as its VLM config.json (module doc)."""
    get = gguf_keys(meta, GGUF_ARCH, source)
    text = q35_gguf.hf_text_dict(meta, GGUF_ARCH, source)
    n = text["num_hidden_layers"]
    text.update(model_type="qwen4_exp_text", hc_count=int(get("hyper_connection.count")),
                hc_lowrank=int(get("hyper_connection.low_rank")), output_gate_type="sigmoid")
    text.update(_qsa_fields(get, text.get("layer_types"), n, source))
    hash_consts = _ple_fields(get, text, source)
    tied = text.pop("tie_word_embeddings")
    raw = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
           "text_config": text, "tie_word_embeddings": tied}
    cfg = config_from_hf(raw, source)
    if hash_consts:
        try:
            cfg = replace(cfg, arch_params=replace(cfg.arch_params, **hash_consts))
        except ConfigError as e:
            raise ModelFormatError(source, str(e)) from None
    return cfg


def _qsa_fields(get, layer_types: list[str] | None, layers: int, source: object) -> dict[str, Any]:
    """The indexer fields of text_config, or {} (dense attention) when every ratio is 0."""
    ratios = get("attention.compress_ratios", None)
    if ratios is None:
        return {}
    if not isinstance(ratios, list) or len(ratios) < layers:
        raise ModelFormatError(source, f"{GGUF_ARCH}.attention.compress_ratios must list one ratio for each "
                                       f"of the {layers} blocks, got {ratios!r}")
    attention = [i for i in range(layers) if layer_types is None or layer_types[i] != "linear_attention"]
    used = {int(ratios[i]) for i in attention}
    if used == {0} or not attention:
        return {}
    if len(used) != 1 or 0 in used:
        raise ModelFormatError(source, f"{GGUF_ARCH}.attention.compress_ratios gives the attention layers "
                                       f"{attention} the ratios {[ratios[i] for i in attention]}; moestream "
                                       f"needs one ratio > 0 shared by all of them (or 0 on all: no QSA)")
    return dict(indexer_n_heads=int(get("attention.indexer.head_count")), indexer_kv_heads=1,
                indexer_head_dim=int(get("attention.indexer.key_length")),
                indexer_budget=int(get("attention.indexer.top_k")), indexer_compress_ratio=used.pop())


def _ple_fields(get, text: dict[str, Any], source: object) -> dict[str, Any]:
    """Put the PLE fields into ``text``; returns the hash constants the file states ({} without
    PLE), checked against each other the way llama.cpp checks them."""
    layers = get("ple.layers", None) or []
    if not layers:
        return {}
    if not isinstance(layers, list) or len(layers) != 1:
        raise ModelFormatError(source, f"{GGUF_ARCH}.ple.layers lists {layers!r}; a GGUF holds one PLE "
                                       f"table and one set of hash constants, so exactly one PLE layer")
    ngram, per = int(get("ple.ngram_size")), int(get("ple.heads_per_ngram"))
    heads, row_dim = (ngram - 1) * per, int(get("embedding_length_per_layer_input"))
    mult, offsets, sizes = (get(f"ple.{k}") for k in ("layer_multipliers", "head_offsets", "head_vocab_sizes"))
    for key, values, want in (("layer_multipliers", mult, ngram), ("head_offsets", offsets, heads),
                              ("head_vocab_sizes", sizes, heads)):
        if not isinstance(values, list) or len(values) != want or not all(int(v) > 0 or key == "head_offsets"
                                                                          for v in values):
            raise ModelFormatError(source, f"{GGUF_ARCH}.ple.{key} must list {want} positive integers "
                                           f"(ngram_size {ngram}, heads_per_ngram {per}), got {values!r}")
    sizes = tuple(int(v) for v in sizes)
    if [int(v) for v in offsets] != [sum(sizes[:h]) for h in range(heads)]:
        raise ModelFormatError(source, f"{GGUF_ARCH}.ple.head_offsets {offsets!r} are not the heads' tables "
                                       f"laid end to end (running sums of head_vocab_sizes {list(sizes)})")
    eos = int(get("ple.eos_token_id"))
    text.update(ple_layer_ids=[int(layers[0]) + 1], ngram_size=ngram, heads_per_ngram=per,
                ple_embed_dim=row_dim * heads, ple_conv_kernel_size=int(get("ple.conv_kernel")),
                ngram_vocab_size_base=min(sizes), split_ngram_parts=1, make_ngram_vocab_size_divisible_by=1)
    text.setdefault("eos_token_id", [eos])  # PLE needs one; the file's own eos stays the stop token
    return dict(ngram_multipliers=tuple(int(m) for m in mult), ngram_head_sizes=sizes, ple_eos=eos)


def gguf_split(gname: str, shape: tuple[int, ...], config: ModelConfig):
    """[(canonical name, shape, expert None, load)] for the names the module doc lists; [] for a
    partner read with another (indexer.k_proj) or not read (the indexer without QSA); the rest
    as Qwen3.5-MoE's (DeltaNet, gated attention, MoE; engine.models.qwen3_5_moe.gguf)."""
    a = config.arch_params
    if gname.startswith("output_hc_"):
        return _hyper("model.hyper_connection_mixer.", gname, gname[len("output_hc_"):], shape)
    if gname == PLE_TABLE:
        return _ple_table(config, shape)
    m = _NAME_RE.match(gname)
    if m is None or int(m.group(1)) >= config.num_layers:
        return q35_gguf.gguf_split(gname, shape, config)
    layer, rest = int(m.group(1)), m.group(2)
    p = f"model.layers.{layer}."
    for part, module in (("hc_attn_", "attn_hyper_connection."), ("hc_ffn_", "mlp_hyper_connection.")):
        if rest.startswith(part):
            return _hyper(p + module, gname, rest[len(part):], shape)
    if rest in _PLE:
        load = _shifted(gname) if rest.startswith("ple_norm_") else None
        return [(p + "ple." + _PLE[rest], shape, None, *([load] if load else []))]
    if rest == "ple_conv1d.weight":
        want = (a.hc_count * config.hidden_size, a.ple_conv_kernel)
        return [(p + "ple.conv1d.weight", (want[0], 1, want[1]), None,
                 lambda src: q35_gguf._stored(src, gname, want)[:, None, :])]
    if rest.startswith("indexer."):
        return _indexer(config, layer, rest[len("indexer."):], shape)
    return q35_gguf.gguf_split(gname, shape, config)


def _hyper(prefix: str, gname: str, part: str, shape: tuple[int, ...]):
    if part not in _HYPER:
        return None  # not a hyper-connection tensor: left unmapped
    load = [_shifted(gname)] if part == "norm.weight" else []
    return [(prefix + _HYPER[part], shape, None, *load)]


def _indexer(config: ModelConfig, layer: int, part: str, shape: tuple[int, ...]):
    a = config.arch_params
    if not a.qsa:
        return []  # compress ratio 0: the layer attends densely, as in llama.cpp
    q = f"model.layers.{layer}.self_attn.indexer."
    if part in ("q_norm.weight", "k_norm.weight"):
        return [(q + f"{part[0]}_layernorm.weight", shape, None, _shifted(f"blk.{layer}.indexer.{part}"))]
    if part == "k_proj.weight":
        return []  # read with q_proj
    if part == "q_proj.weight":
        d, h = a.indexer_head_dim, config.hidden_size
        b = f"blk.{layer}.indexer."

        def qk(src) -> torch.Tensor:
            return torch.cat([q35_gguf._stored(src, b + "q_proj.weight", (a.indexer_heads * d, h)),
                              q35_gguf._stored(src, b + "k_proj.weight", (d, h))])
        return [(q + "index_qk_proj.weight", ((a.indexer_heads + 1) * d, h), None, qk)]
    return None


def _ple_table(config: ModelConfig, shape: tuple[int, ...]):
    """The one PLE layer's table as its single shard: the rows of the hash heads' ranges (the
    config's divisor is 1), the converter's padding rows after them cut off (never looked up)."""
    a = config.arch_params
    if len(a.ple_layers) != 1:
        raise ModelFormatError(PLE_TABLE, f"the file has a PLE table but its metadata declares "
                                          f"{len(a.ple_layers)} PLE layers ({GGUF_ARCH}.ple.layers)")
    h = a.ngram_hash(config, 0)
    used = h.head_offsets[-1] + h.head_sizes[-1]
    if len(shape) != 2 or shape[1] != a.ple_row_dim or shape[0] < used:
        raise ModelFormatError(PLE_TABLE, f"shape {list(shape)}; expected [rows >= {used} (the hash heads' "
                                          f"ranges), {a.ple_row_dim} (embedding_length_per_layer_input)]")

    return [(f"model.layers.{a.ple_layers[0]}.ple.ngram.shard_0", (used, a.ple_row_dim), None,
             lambda src: src.stored_tensor(PLE_TABLE)[:used].clone())]


def _shifted(gname: str):
    return lambda src: src.stored_tensor(gname) - 1.0
