"""MXFP4 on the CPU, and MXFP4 checkpoints (gpt-oss's released ``*_blocks`` / ``*_scales``).

The format (engine.quant.formats): codes u8 [N, K/2] (byte j: weight 2j low nibble, 2j+1 high),
scales u8 [N, K/32] (E8M0: 2^(s - 127)); the reference is ``reference._dequantize_mxfp4``.

CPU kernels: the native one (engine/csrc, format id 4 of engine.quant.kernels: AVX-512 and
AVX2) reads the codes and E8M0 scales directly: a 16-entry table E2M1 * 2^(s-127) per block of
32 (exact: a power of two), looked up by nibble, the even/odd weights interleaved back; the
expert cache's MXFP4 experts run on it from their slots (engine.step). Where the native kernels
are not built, the torch-vectorised one here runs: it decodes a byte at a time through a
256-entry table of value pairs (one gather per two weights), builds each group's 2^(s-127)
directly from the exponent bits, and multiplies with one ``F.linear`` in float32. Both equal
``x @ reference.dequantize(q).T`` up to float32 summation order (tests/engine/quant/test_mxfp4.py).

HF layout: ``blocks`` [E, out, in/32, 16] uint8 and ``scales`` [E, out, in/32] uint8 per fused
expert tensor; one expert's ``blocks[e]`` flattened to [out, in/2] *is* our codes part and
``scales[e]`` our scales part (the same nibble order), so loading is a reshape, not a
re-quantization.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.quant.formats import QuantFormat, QuantizedTensor
from engine.quant.reference import E2M1_VALUES

MXFP4 = QuantFormat("mxfp4", 32)


@functools.lru_cache(maxsize=None)
def _pair_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two weights byte b decodes to (low nibble first)."""
    v = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    b = torch.arange(256)
    return torch.stack([v[b & 0xF], v[b >> 4]], dim=1).to(device)


def exp2_bits(s: torch.Tensor) -> torch.Tensor:
    """2^(s - 127) as float32 for E8M0 bytes ``s``, built from the exponent bits (s = 0 is the
    subnormal 2^-127, s = 255 gives inf: E8M0's NaN has no meaning for weights)."""
    s32 = s.to(torch.int32)
    normal = (s32 << 23).view(torch.float32)
    return torch.where(s32 == 0, torch.tensor(2.0 ** -127), normal)


def dequantize_fast(q: QuantizedTensor) -> torch.Tensor:
    """The weight [N, K] float32 through the byte table (same values as the reference)."""
    n, k = q.shape
    pairs = _pair_table(q.device)[q.parts["codes"].long()]  # [N, K/2, 2]
    return (pairs.reshape(n, k // 32, 32) * exp2_bits(q.parts["scales"])[..., None]).reshape(n, k)


def qlinear_mxfp4_cpu(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """``x @ dequantize(q).T`` in float32; x [T, K]."""
    return F.linear(x.float(), dequantize_fast(q))


def from_hf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor:
    """One matrix of an HF MXFP4 tensor: blocks [out, in/32, 16], scales [out, in/32] -> an
    ``mxfp4`` QuantizedTensor [out, in] holding the same bytes."""
    out, groups, sixteen = blocks.shape
    if sixteen != 16 or tuple(scales.shape) != (out, groups) or blocks.dtype != torch.uint8 \
            or scales.dtype != torch.uint8:
        from engine.errors import ModelFormatError

        raise ModelFormatError("<mxfp4>", f"MXFP4 blocks {list(blocks.shape)} {blocks.dtype} and scales "
                                          f"{list(scales.shape)} {scales.dtype} do not pair up "
                                          "([out, in/32, 16] and [out, in/32], uint8)")
    return QuantizedTensor(MXFP4, (out, groups * 32), {"codes": blocks.reshape(out, groups * 16).contiguous(),
                                                       "scales": scales.contiguous()})


def hf_expert_matrix(blocks: torch.Tensor, scales: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of one expert's HF MXFP4 matrix, dequantized to float32 [len(rows), in]
    (gpt-oss interleaves gate and up rows: ``slice(0, None, 2)`` / ``slice(1, None, 2)``)."""
    from engine.quant.reference import dequantize

    return dequantize(from_hf_blocks(blocks[rows], scales[rows]))
