"""Qwen3-Next from GGUF: llama.cpp's ``qwen3next`` metadata and tensor names.

What llama.cpp's converter (convert_hf_to_gguf.py, Qwen3NextModel) changes, undone here:

    HF                                   GGUF (qwen3next)            here
    input/post_attention_layernorm, q/k  attn_norm, post_attention_  w - 1 (the converter stores
      norm, model.norm (zero-centred)      norm, attn_q/k_norm,        1 + w; the model applies
                                           output_norm                 1 + w itself)
    linear_attn.in_proj_qkvz [per key    attn_qkv [all q | all k |   re-interleaved per key head
      head: q, k, v, z]                    all v], attn_gate [all z]   (one tensor from two)
    linear_attn.A_log                    ssm_a = -exp(A_log)         log(-ssm_a)
    linear_attn.dt_bias                  ssm_dt.bias                 as is
    linear_attn.conv1d.weight [C, 1, K]  ssm_conv1d [C, K]           [C, 1, K]
    linear_attn.in_proj_ba, norm,        ssm_ba, ssm_norm, ssm_out   as is (the gated norm is
      out_proj                                                         not zero-centred)

The rest (attn_q with its gate, attn_k/v/output, the router, stacked experts, the shared expert
and its gate, embeddings, output) uses the generic map (engine.loading.gguf). Metadata: the
``ssm.*`` keys give the DeltaNet shapes (state_size = key head dim, group_count = key heads,
time_step_rank = value heads, inner_size = value heads x value head dim), the attention layers
come from ``attention.recurrent_layers`` (else ``full_attention_interval``) and partial RoPE from
``rope.dimension_count``. MTP (nextn) layers, if the file has them, are not loaded.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from engine.config import ModelConfig
from engine.configio.fields import REQUIRED, gguf_keys
from engine.configio.hf_decoder import decoder_config
from engine.errors import ModelFormatError
from engine.models.qwen3_next.config import hf_fields

_CENTRED = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
            "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_AS_IS = {"ssm_ba.weight": "linear_attn.in_proj_ba.weight", "ssm_norm.weight": "linear_attn.norm.weight",
          "ssm_out.weight": "linear_attn.out_proj.weight", "ssm_dt.bias": "linear_attn.dt_bias"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_NAME_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+(?:\.(?:weight|bias))?)$")


def config_from_gguf(meta: Mapping[str, Any], source: object) -> ModelConfig:
    """The ModelConfig of a ``qwen3next`` GGUF: its keys as the config.json they came from, read
    by the one Qwen3-Next config parser (engine.models.qwen3_next.config)."""
    raw = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
           **hf_text_dict(meta, "qwen3next", source)}
    return decoder_config("qwen3_next", raw, source, hf_fields)


def hf_text_dict(meta: Mapping[str, Any], arch: str, source: object) -> dict[str, Any]:
    """The text model's config.json fields from the GGUF keys under ``arch`` (``qwen3next`` and
    ``qwen35moe`` write the same ones): no architectures/model_type, for the caller to add."""
    get = gguf_keys(meta, arch, source)

    # block_count includes the MTP (nextn) blocks the converter appends after the model's own
    layers = int(get("block_count")) - int(get("nextn_predict_layers", 0) or 0)
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", len(tokens) if tokens is not None else REQUIRED)
    nk, nv = int(get("ssm.group_count")), int(get("ssm.time_step_rank"))
    inner = int(get("ssm.inner_size"))
    if nv < 1 or inner % nv:
        raise ModelFormatError(source, f"{arch}.ssm.inner_size {inner} is not a multiple of "
                                       f"ssm.time_step_rank {nv} (value heads)")
    raw: dict[str, Any] = {
        "vocab_size": int(vocab), "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": int(get("feed_forward_length", 0) or 0),
        "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim, "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0)),
                            "partial_rotary_factor": int(get("rope.dimension_count", head_dim // 4)) / head_dim},
        "tie_word_embeddings": bool(meta.get("_tied_embeddings", False)),
        "attention_bias": bool(meta.get("_attention_bias", False)),
        "num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0) or 0),
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "linear_num_key_heads": nk, "linear_num_value_heads": nv,
        "linear_key_head_dim": int(get("ssm.state_size")), "linear_value_head_dim": inner // nv,
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel", 4)),
    }
    recurrent = get("attention.recurrent_layers", None)
    if recurrent is not None:  # per block, MTP blocks appended (never recurrent)
        if not isinstance(recurrent, list) or len(recurrent) < layers:
            raise ModelFormatError(source, f"{arch}.attention.recurrent_layers must list at least "
                                           f"the {layers} blocks")
        raw["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent[:layers]]
    else:
        raw["full_attention_interval"] = int(get("full_attention_interval", 4))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        raw["bos_token_id"] = int(bos)
    eos = [int(meta[f"tokenizer.ggml.{k}"]) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if f"tokenizer.ggml.{k}" in meta]
    if eos:
        raw["eos_token_id"] = list(dict.fromkeys(eos))
    return raw


def gguf_split(gname: str, shape: tuple[int, ...], config: ModelConfig):
    """[(canonical name, shape, expert None, load)] for the names llama.cpp's converter changed
    (module doc); [] for a name read together with another (attn_gate) or not loaded (MTP
    blocks); None: the generic map."""
    if gname == "output_norm.weight":
        return [("model.norm.weight", shape, None, _shifted(gname))]
    block = _BLOCK_RE.match(gname)
    if block is not None and int(block.group(1)) >= config.num_layers:
        return []  # an MTP (nextn) block (blk.N.nextn.eh_proj.weight, ...): not part of the model
    m = _NAME_RE.match(gname)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    p = f"model.layers.{layer}."
    comp, _, kind = rest.partition(".")
    if comp in _CENTRED and kind == "weight":
        return [(p + f"{_CENTRED[comp]}.weight", shape, None, _shifted(gname))]
    if rest in _AS_IS:
        return [(p + _AS_IS[rest], shape, None)]
    la = config.linear_attn
    if la is None:
        return None
    if rest == "ssm_a":
        return [(p + "linear_attn.A_log", shape, None, lambda src: torch.log(-src.stored_tensor(gname)))]
    if rest == "ssm_conv1d.weight":
        want = (la.conv_dim, la.conv_kernel)
        return [(p + "linear_attn.conv1d.weight", (want[0], 1, want[1]), None,
                 lambda src: _checked(src.stored_tensor(gname), want, gname)[:, None, :])]
    if rest == "attn_gate.weight":
        return []  # read with attn_qkv
    if rest == "attn_qkv.weight":
        rows = 2 * la.key_dim + 2 * la.value_dim
        return [(p + "linear_attn.in_proj_qkvz.weight", (rows, config.hidden_size), None,
                 lambda src: _qkvz(src, layer, config))]
    return None


def _shifted(gname: str):
    return lambda src: src.stored_tensor(gname) - 1.0


def _checked(t: torch.Tensor, shape: tuple[int, ...], gname: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise ModelFormatError(gname, f"shape {list(t.shape)}; expected {list(shape)}")
    return t


def _qkvz(src, layer: int, config: ModelConfig) -> torch.Tensor:
    """HF's in_proj_qkvz (rows per key head: q, k, then its r value heads' v, then their z) from
    llama.cpp's attn_qkv (all q, all k, all v) and attn_gate (all z)."""
    la = config.linear_attn
    h = config.hidden_size
    nk, dk, r, dv = la.num_key_heads, la.key_head_dim, la.num_value_heads // la.num_key_heads, la.value_head_dim
    qkv = _checked(src.stored_tensor(f"blk.{layer}.attn_qkv.weight"), (2 * la.key_dim + la.value_dim, h),
                   f"blk.{layer}.attn_qkv.weight")
    z = _checked(src.stored_tensor(f"blk.{layer}.attn_gate.weight"), (la.value_dim, h), f"blk.{layer}.attn_gate.weight")
    q, k, v = qkv.split([la.key_dim, la.key_dim, la.value_dim])
    parts = (q.view(nk, dk, h), k.view(nk, dk, h), v.view(nk, r * dv, h), z.view(nk, r * dv, h))
    return torch.cat(parts, dim=1).reshape(-1, h)
