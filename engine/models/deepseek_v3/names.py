"""DeepSeek-V3's tensor names: block-FP8 HF weights dequantized with their scales, MTP layers
dropped, and llama.cpp's ``deepseek2`` GGUF names mapped to canonical ones (kv_b from two)."""

from __future__ import annotations

import re

import torch

from engine.config import ModelConfig
from engine.errors import ModelFormatError
from engine.models.spec import canonical_name

FP8_BLOCK = 128
# HF names that differ from the canonical ones (the spec's hf_renames)
HF_RENAMES = ((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),)


def dequantize_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor, name: str = "<fp8>") -> torch.Tensor:
    """Block-FP8 weight [out, in] (float8_e4m3fn) times its per-128x128-block ``scale_inv``
    [ceil(out/128), ceil(in/128)] -> float32 [out, in]."""
    out, inp = w.shape
    want = (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ModelFormatError(name, f"weight_scale_inv has shape {list(scale_inv.shape)}; a weight of "
                                     f"{[out, inp]} needs {list(want)} (one per {FP8_BLOCK}x{FP8_BLOCK} block)")
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inp]
    return w.float() * s


_MTP_RE = re.compile(r"^model\.layers\.(\d+)\.")


def hf_split(stored: str, shape: tuple[int, ...], dtype: str, get, config: ModelConfig):
    """Block-FP8 weights (with their ``_scale_inv``) -> one float canonical tensor; MTP layers'
    tensors dropped; everything else: None (the generic handling)."""
    m = _MTP_RE.match(stored)
    if m is not None and int(m.group(1)) >= config.num_layers:
        return []  # multi-token-prediction module: not used for decoding
    if stored.endswith(".weight_scale_inv"):
        return []  # read with its weight
    if dtype in ("f8_e4m3", "f8_e5m2"):
        canonical = canonical_name(HF_RENAMES, stored)
        return [(canonical, shape, dtype,
                 lambda: dequantize_block_fp8(get(stored), _scale_of(get, stored), stored))]
    return None


def _scale_of(get, stored: str) -> torch.Tensor:
    try:
        return get(stored + "_scale_inv")
    except KeyError:
        raise ModelFormatError(stored, "FP8 weight without its weight_scale_inv tensor") from None


# ------------------------------------------------------------------------------------- GGUF
# llama.cpp's converter (arch "deepseek2"): MLA written as MQA (head_count_kv 1, key_length
# R + r), kv_b split into attn_k_b [Nh, R, dn] (transposed) and attn_v_b [Nh, dv, R] (older files:
# one attn_kv_b), the selection bias as exp_probs_b.bias, experts stacked, shared experts *_shexp,
# interleaved RoPE as in the released weights; YaRN's mscale_all_dim as yarn_log_multiplier / 0.1.

_GGUF_RE = re.compile(r"^blk\.(\d+)\.(attn_q_a|attn_q_a_norm|attn_q_b|attn_kv_a_mqa|attn_kv_a_norm|"
                      r"attn_kv_b|attn_k_b|attn_v_b|exp_probs_b)\.(weight|bias)$")
_GGUF_NAMES = {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
               "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
               "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj"}


def gguf_split(gname: str, shape: tuple[int, ...], config: ModelConfig):
    m = _GGUF_RE.match(gname)
    if m is None:
        return None
    layer, comp, kind = m.group(1), m.group(2), m.group(3)
    p = f"model.layers.{layer}."
    if comp == "exp_probs_b":
        return [(p + "mlp.gate.e_score_correction_bias", shape, None)]
    if comp == "attn_v_b":
        return []  # read with attn_k_b
    if comp == "attn_k_b":
        a, nh = config.arch_params, config.num_heads
        k_name, v_name = gname, f"blk.{layer}.attn_v_b.weight"

        def kv_b(source) -> torch.Tensor:
            k = source.stored_tensor(k_name)  # [Nh, R, dn]
            v = source.stored_tensor(v_name)  # [Nh, dv, R]
            if tuple(k.shape) != (nh, a.kv_lora_rank, a.qk_nope_head_dim) or \
                    tuple(v.shape) != (nh, a.v_head_dim, a.kv_lora_rank):
                raise ModelFormatError(k_name, f"attn_k_b {list(k.shape)} / attn_v_b {list(v.shape)} do not "
                                               f"match {nh} heads of MLA rank {a.kv_lora_rank}")
            return torch.cat([k.transpose(1, 2), v], dim=1).reshape(-1, a.kv_lora_rank)
        rows = nh * (a.qk_nope_head_dim + a.v_head_dim)
        return [(p + "self_attn.kv_b_proj.weight", (rows, a.kv_lora_rank), None, kv_b)]
    return [(p + f"{_GGUF_NAMES[comp]}.{kind}", shape, None)]
