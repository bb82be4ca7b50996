"""Tensor names of a Qwen3.5-MoE checkpoint -> moestream's canonical (Qwen3-Next) names.

    model.language_model.X          -> model.X        (the text model)
    lm_head.weight                  -> lm_head.weight (absent when tied)
    model.visual.*, mtp.*           -> dropped, never read by the model (the vision tower is
                                       not served; the multi-token-prediction head is read on
                                       its own by mtp.py for --speculative mtp)

The Gated DeltaNet input projections are stored split where Qwen3-Next (whose layers run this
model: engine.layers.deltanet) stores them fused and grouped by key head:

    in_proj_qkv [2 Nk Dk + Nv Dv, H]: q (Nk Dk) | k (Nk Dk) | v (Nv Dv), heads in order
    in_proj_z   [Nv Dv, H]            in_proj_b, in_proj_a [Nv, H]
 -> in_proj_qkvz [Nk (2 Dk + 2 r Dv), H]: per key head i: q_i | k_i | v_i | z_i, where v_i, z_i
                                          are value heads i r .. i r + r - 1 (r = Nv / Nk)
    in_proj_ba   [2 Nv, H]:               per key head i: b_i | a_i (r rows each)

A pure row permutation (value head j belongs to key head j // r in both: the reference repeats
each key head r times), so the fused weights give bit-identical projections. The conv1d channels
(q, k, v flat) need none. The canonical tensor is read (lazily) when the *_qkv / *_b tensor's
name is asked for; its partner *_z / *_a has no canonical name of its own.

Block-FP8 checkpoints (``weight`` F8_E4M3 + ``weight_scale_inv`` per 128 x 128 block, as
DeepSeek's) are dequantized when read (engine.models.deepseek_v3.names.dequantize_block_fp8).
"""

from __future__ import annotations

import re

import torch

from engine.config import ModelConfig
from engine.errors import ModelFormatError, quote
from engine.models.deepseek_v3.names import _scale_of, dequantize_block_fp8
from engine.models.spec import canonical_name

HF_RENAMES = ((r"^model\.language_model\.", "model."),)
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
FP8_DTYPES = ("f8_e4m3", "f8_e5m2")
_FP8_TORCH = (torch.float8_e4m3fn, torch.float8_e5m2)
_SPLIT_RE = re.compile(r"^(model\.language_model\.layers\.\d+\.linear_attn\.)in_proj_(qkv|z|b|a)\.weight$")
# stored part read first -> (its partner, the canonical fused name)
_FUSED = {"qkv": ("z", "in_proj_qkvz"), "b": ("a", "in_proj_ba")}


def canonical(stored: str) -> str:
    return canonical_name(HF_RENAMES, stored)


def merge_qkvz(qkv: torch.Tensor, z: torch.Tensor, nk: int, dk: int, nv: int, dv: int) -> torch.Tensor:
    """in_proj_qkv [2 Nk Dk + Nv Dv, H] and in_proj_z [Nv Dv, H] -> in_proj_qkvz grouped by key head."""
    h, r = qkv.shape[1], nv // nk
    q, k, v = qkv.split([nk * dk, nk * dk, nv * dv])
    return torch.cat((q.reshape(nk, dk, h), k.reshape(nk, dk, h), v.reshape(nk, r * dv, h),
                      z.reshape(nk, r * dv, h)), dim=1).reshape(-1, h)


def merge_ba(b: torch.Tensor, a: torch.Tensor, nk: int, nv: int) -> torch.Tensor:
    """in_proj_b, in_proj_a [Nv, H] -> in_proj_ba [2 Nv, H] grouped by key head."""
    h, r = b.shape[1], nv // nk
    return torch.cat((b.reshape(nk, r, h), a.reshape(nk, r, h)), dim=1).reshape(-1, h)


def _read(get, stored: str) -> torch.Tensor:
    """A stored tensor, dequantized (float32) when it is block-FP8."""
    t = get(stored)
    return dequantize_block_fp8(t, _scale_of(get, stored), stored) if t.dtype in _FP8_TORCH else t


def hf_split(stored: str, shape: tuple[int, ...], dtype: str, get, config: ModelConfig):
    """ArchSpec.hf_split: [] for tensors never read (vision tower, MTP head, FP8 scales, the
    partners of split projections), the fused DeltaNet projections, FP8 weights dequantized;
    None for the rest (the generic handling under ``HF_RENAMES``)."""
    if stored.startswith(SKIPPED_PREFIXES) or stored.endswith(".weight_scale_inv"):
        return []
    m = _SPLIT_RE.match(stored)
    if m is None:
        if dtype in FP8_DTYPES:
            return [(canonical(stored), shape, dtype, lambda: _read(get, stored))]
        return None
    prefix, part = m.groups()
    if part not in _FUSED:
        return []  # z / a: read with in_proj_qkv / in_proj_b
    la = config.linear_attn
    assert la is not None
    partner_part, fused = _FUSED[part]
    own_rows, partner_rows = ((la.conv_dim, la.value_dim) if part == "qkv"
                              else (la.num_value_heads, la.num_value_heads))
    if len(shape) != 2 or shape[0] != own_rows:
        raise ModelFormatError(stored, f"shape {list(shape)}; the config's linear attention needs "
                                       f"[{own_rows}, hidden_size]")
    partner = f"{prefix}in_proj_{partner_part}.weight"

    def load() -> torch.Tensor:
        try:
            other = get(partner)
        except KeyError:
            raise ModelFormatError(stored, f"its partner {quote(partner)} is not in the checkpoint") from None
        if tuple(other.shape) != (partner_rows, shape[1]):
            raise ModelFormatError(partner, f"shape {list(other.shape)}; needs [{partner_rows}, {shape[1]}]")
        mine, theirs = _read(get, stored), _read(get, partner)
        if part == "qkv":
            return merge_qkvz(mine, theirs.to(mine.dtype), la.num_key_heads, la.key_head_dim,
                              la.num_value_heads, la.value_head_dim)
        return merge_ba(mine, theirs.to(mine.dtype), la.num_key_heads, la.num_value_heads)

    rows = own_rows + partner_rows
    return [(canonical(prefix) + fused + ".weight", (rows, shape[1]), dtype, load)]
