"""The tensors a Qwen4-Exp config implies (ArchSpec.expected_tensors): Qwen3-Next's DeltaNet,
gated attention and MoE tensors without its pre-norms and final norm (the hyper-connections'
grouped norms take their place), plus per layer the two hyper-connections, the QSA indexer of
each attention layer, the PLE layer (its n-gram table as row shards), and the final mixer."""

from __future__ import annotations

import re
from typing import Iterator

from engine.config import ModelConfig
from engine.models.qwen3_next.tensors import expected_tensors as qwen3_next_tensors
from engine.models.qwen4_exp.names import shard_rows

_DROPPED = ("model.norm.weight",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def hyper_tensors(prefix: str, width: int, lowrank: int, streams: int, inject: bool):
    yield prefix + "hc_norm.weight", (width,)
    yield prefix + "input_mix_weight_down.weight", (lowrank, width)
    yield prefix + "input_mix_weight_up.weight", (width, lowrank)
    if inject:
        yield prefix + "block_inject_weight.weight", (streams, width)


def ple_tensors(c: ModelConfig, i: int, ple_index: int):
    a = c.arch_params
    p, hc = f"model.layers.{i}.ple.", a.hc_count * c.hidden_size
    yield p + "key_proj.weight", (hc, a.ple_embed_dim)
    yield p + "value_proj.weight", (c.hidden_size, a.ple_embed_dim)
    for norm in ("norm_key", "norm_query", "norm_conv"):
        yield p + f"{norm}.weight", (hc,)
    yield p + "conv1d.weight", (hc, 1, a.ple_conv_kernel)
    rows = a.ngram_hash(c, ple_index).num_rows
    for k, n in enumerate(shard_rows(rows, a.split_ngram_parts)):
        yield p + f"ngram.shard_{k}", (n, a.ple_row_dim)


def expected_tensors(c: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    a = c.arch_params
    H, width = c.hidden_size, a.hc_count * c.hidden_size
    by_layer: dict[int, list] = {}
    for name, shape in qwen3_next_tensors(c):
        m = _LAYER.match(name)
        if m is None:
            if name not in _DROPPED:
                yield name, shape
        elif not name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            by_layer.setdefault(int(m.group(1)), []).append((name, shape))
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        yield from by_layer.get(i, [])
        if a.qsa and not c.is_linear_attention_layer(i):
            q = p + "self_attn.indexer."
            yield q + "index_qk_proj.weight", ((a.indexer_heads + 1) * a.indexer_head_dim, H)
            yield q + "q_layernorm.weight", (a.indexer_head_dim,)
            yield q + "k_layernorm.weight", (a.indexer_head_dim,)
        if i in a.ple_layers:
            yield from ple_tensors(c, i, a.ple_layers.index(i))
        for part in ("attn", "mlp"):
            yield from hyper_tensors(p + f"{part}_hyper_connection.", width, a.hc_lowrank, a.hc_count, True)
    yield from hyper_tensors("model.hyper_connection_mixer.", width, a.hc_lowrank, a.hc_count, False)
