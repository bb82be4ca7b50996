"""ggml tensor types: the block-size table and vectorised dequantizers (numpy, no per-block loops).

Every ggml type stores a row as whole *blocks*: ``block_size`` logical elements packed into
``type_size`` bytes. Unquantized types are blocks of one element. A tensor whose innermost
dimension ``ne[0]`` is a multiple of ``block_size`` therefore occupies exactly
``n_elements // block_size * type_size`` bytes, and any run of whole rows is a run of whole
blocks (the GGUF reader relies on this to slice one expert out of a stacked tensor).

Dequantizers take the raw bytes of ``n_blocks`` blocks, viewed as ``uint8[n_blocks, type_size]``,
and return ``float32[n_blocks, block_size]``. They follow ggml's reference ``dequantize_row_*``
(ggml-quants.c) operation for operation in float32, so results are bit-identical to ggml's
scalar path. Layouts below are per block; "f16" fields are IEEE half, little-endian.

Shape legend: nb = number of blocks in the call; all intermediates are [nb, ...].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

QK_K = 256  # super-block size of the k-quants


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str  # lower case, as TensorInfo.dtype spells it ("q4_k")
    block_size: int  # logical elements per block
    type_size: int  # bytes per block


# Every type id ggml currently defines (ids 4, 5, 31-33, 36-38 were removed from ggml and are
# rejected as unknown). The table is used for layout validation of *any* valid file; which of
# these we can dequantize is DEQUANTIZERS below.
_TYPES = [
    GGMLType(0, "f32", 1, 4),
    GGMLType(1, "f16", 1, 2),
    GGMLType(2, "q4_0", 32, 2 + 16),
    GGMLType(3, "q4_1", 32, 2 + 2 + 16),
    GGMLType(6, "q5_0", 32, 2 + 4 + 16),
    GGMLType(7, "q5_1", 32, 2 + 2 + 4 + 16),
    GGMLType(8, "q8_0", 32, 2 + 32),
    GGMLType(9, "q8_1", 32, 4 + 4 + 32),
    GGMLType(10, "q2_k", QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    GGMLType(11, "q3_k", QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    GGMLType(12, "q4_k", QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType(13, "q5_k", QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType(14, "q6_k", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    GGMLType(15, "q8_k", QK_K, 4 + QK_K + QK_K // 8),
    GGMLType(16, "iq2_xxs", QK_K, 2 + QK_K // 4),
    GGMLType(17, "iq2_xs", QK_K, 2 + QK_K // 4 + QK_K // 32),
    GGMLType(18, "iq3_xxs", QK_K, 2 + QK_K // 4 + QK_K // 8),
    GGMLType(19, "iq1_s", QK_K, 2 + QK_K // 8 + QK_K // 16),
    GGMLType(20, "iq4_nl", 32, 2 + 16),
    GGMLType(21, "iq3_s", QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    GGMLType(22, "iq2_s", QK_K, 2 + QK_K // 4 + QK_K // 16),
    GGMLType(23, "iq4_xs", QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    GGMLType(24, "i8", 1, 1),
    GGMLType(25, "i16", 1, 2),
    GGMLType(26, "i32", 1, 4),
    GGMLType(27, "i64", 1, 8),
    GGMLType(28, "f64", 1, 8),
    GGMLType(29, "iq1_m", QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    GGMLType(30, "bf16", 1, 2),
    GGMLType(34, "tq1_0", QK_K, 2 + 4 * 13),
    GGMLType(35, "tq2_0", QK_K, 2 + 64),
    GGMLType(39, "mxfp4", 32, 1 + 16),
    GGMLType(40, "nvfp4", 64, 4 + 32),
    GGMLType(41, "q1_0", 128, 2 + 16),
]
GGML_TYPES: dict[int, GGMLType] = {t.id: t for t in _TYPES}
GGML_TYPE_BY_NAME: dict[str, GGMLType] = {t.name: t for t in _TYPES}


# ---- field helpers ----------------------------------------------------------------------------
def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte ``start`` of each block, as float32 [nb, 1]."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> uint8 [..., 2, n]: low nibbles first, then high nibbles."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


# ---- unquantized ------------------------------------------------------------------------------
def _deq_f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.copy().view(np.float32)


def _deq_f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.copy().view(np.float16).astype(np.float32)


def _deq_bf16(blocks: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32: widen the 16 bits into the high half of a uint32.
    return (blocks.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# ---- 32-element blocks --------------------------------------------------------------------------
def _deq_q4_0(blocks: np.ndarray) -> np.ndarray:
    # {f16 d; u8 qs[16]}: y[j] = (lo(qs[j]) - 8) * d, y[j+16] = (hi(qs[j]) - 8) * d
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).reshape(-1, 32).astype(np.int8) - np.int8(8)
    return q.astype(np.float32) * d


def _deq_q4_1(blocks: np.ndarray) -> np.ndarray:
    # {f16 d; f16 m; u8 qs[16]}: y = q * d + m, q as Q4_0 without the -8 offset
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:20]).reshape(-1, 32)
    return q.astype(np.float32) * d + m


def _q5_high_bits(qh: np.ndarray) -> np.ndarray:
    """u8 qh[4] (a little-endian u32) -> [nb, 32] of 0/16: bit j is the 5th bit of element j."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _deq_q5_0(blocks: np.ndarray) -> np.ndarray:
    # {f16 d; u8 qh[4]; u8 qs[16]}: y = ((nibble | bit << 4) - 16) * d
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:22]).reshape(-1, 32) | _q5_high_bits(blocks[:, 2:6])
    return (q.astype(np.int8) - np.int8(16)).astype(np.float32) * d


def _deq_q5_1(blocks: np.ndarray) -> np.ndarray:
    # {f16 d; f16 m; u8 qh[4]; u8 qs[16]}: y = (nibble | bit << 4) * d + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:24]).reshape(-1, 32) | _q5_high_bits(blocks[:, 4:8])
    return q.astype(np.float32) * d + m


def _deq_q8_0(blocks: np.ndarray) -> np.ndarray:
    # {f16 d; i8 qs[32]}: y = qs * d
    d = _f16(blocks, 0)
    return blocks[:, 2:34].view(np.int8).astype(np.float32) * d


# ---- k-quants (256-element super-blocks) ------------------------------------------------------
def _k4_scales_mins(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, each [nb, 8] (uint8).

    Sub-blocks 0-3 keep their low 6 bits in bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7 keep
    their low 4 bits in the nibbles of bytes 8-11 and their top 2 bits in the top 2 bits of
    bytes 0-3 (scale) and 4-7 (min)."""
    a, b, c = sc12[:, 0:4], sc12[:, 4:8], sc12[:, 8:12]
    scales = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return scales, mins


def _deq_q4_k(blocks: np.ndarray) -> np.ndarray:
    # {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}: 8 sub-blocks of 32;
    # sub-block s reads qs[32*(s//2) : +32], low nibbles if s is even, high if odd;
    # y = (d * scale_s) * q - (dmin * min_s)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k4_scales_mins(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    d1 = (d * sc.astype(np.float32))[:, :, None]
    m1 = (dmin * mn.astype(np.float32))[:, :, None]
    return (d1 * q.astype(np.float32) - m1).reshape(-1, QK_K)


def _deq_q5_k(blocks: np.ndarray) -> np.ndarray:
    # {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: as Q4_K, plus a 5th bit:
    # element l of sub-block s takes bit s of qh[l].
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k4_scales_mins(blocks[:, 4:16])
    qh = blocks[:, 16:48]
    q = _nibbles(blocks[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    hi = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = q | (hi << 4)
    d1 = (d * sc.astype(np.float32))[:, :, None]
    m1 = (dmin * mn.astype(np.float32))[:, :, None]
    return (d1 * q.astype(np.float32) - m1).reshape(-1, QK_K)


_SHIFTS_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]


def _deq_q6_k(blocks: np.ndarray) -> np.ndarray:
    # {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}: two halves of 128 elements; in half h,
    # element k has low 4 bits from the nibbles of ql[64h : 64h+64] (low nibbles: k < 64, high
    # nibbles: k >= 64, at index k % 64) and top 2 bits from qh[32h + k % 32] >> 2*(k // 32).
    # y = d * scale[e // 16] * (q - 32) for element e of the block.
    ql = blocks[:, 0:128].reshape(-1, 2, 64)
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [nb, 16]
    d = _f16(blocks, 208)
    low = _nibbles(ql).reshape(-1, 2, 128)
    high = ((qh[:, :, None, :] >> _SHIFTS_2BIT) & 3).reshape(-1, 2, 128)
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(-1, 16, 16)
    return ((d * sc)[:, :, None] * q.astype(np.float32)).reshape(-1, QK_K)


def _deq_q2_k(blocks: np.ndarray) -> np.ndarray:
    # {u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}: element 128h + 32j + l is
    # (qs[32h + l] >> 2j) & 3; scale byte e // 16: low nibble scales d, high nibble scales dmin.
    sc = blocks[:, 0:16]
    qs = blocks[:, 16:80].reshape(-1, 2, 32)
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    q = ((qs[:, :, None, :] >> _SHIFTS_2BIT) & 3).reshape(-1, 16, 16)
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * q.astype(np.float32) - ml).reshape(-1, QK_K)


def _deq_q3_k(blocks: np.ndarray) -> np.ndarray:
    # {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}: element 128h + 32j + l has low bits
    # (qs[32h + l] >> 2j) & 3 and loses 4 when bit (4h + j) of hmask[l] is clear. Sixteen 6-bit
    # scales (minus 32): low 4 bits in nibbles of bytes 0-7 (scales 0-7 low nibbles, 8-15 high),
    # top 2 bits of scale i in bits 2*(i // 4) of byte 8 + i % 4.
    hmask = blocks[:, 0:32]
    qs = blocks[:, 32:96].reshape(-1, 2, 32)
    s = blocks[:, 96:108]
    d = _f16(blocks, 108)
    low4 = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)  # [nb, 16]
    hi2 = (s[:, None, 8:12] >> _SHIFTS_2BIT.reshape(1, 4, 1)) & 3  # [nb, i // 4, i % 4]
    scales = (low4 | (hi2.reshape(-1, 16) << 4)).astype(np.int8) - np.int8(32)
    q = ((qs[:, :, None, :] >> _SHIFTS_2BIT) & 3).astype(np.int8)  # [nb, 2, 4, 32]
    bit = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)  # bit 4h + j
    hm = (hmask[:, None, None, :] >> bit) & 1
    q = (q - np.int8(4) * (1 - hm).astype(np.int8)).reshape(-1, 16, 16)
    dl = (d * scales.astype(np.float32))[:, :, None]
    return (dl * q.astype(np.float32)).reshape(-1, QK_K)


# type id -> blocks uint8[nb, type_size] -> float32[nb, block_size]
# E2M1 values by 4-bit code (OCP MX): 0-7 positive, 8-15 their negatives.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                 dtype=np.float32)


def _deq_mxfp4(blocks: np.ndarray) -> np.ndarray:
    # {u8 e (E8M0); u8 qs[16]}: y[j] = E2M1[lo(qs[j])] * 2^(e-127), y[j+16] = E2M1[hi(qs[j])] * 2^(e-127)
    # (ggml writes E2M1 doubled times 2^(e-128): the same values)
    e = blocks[:, 0:1].astype(np.int32) - 127
    return np.ldexp(_E2M1[_nibbles(blocks[:, 1:17]).reshape(-1, 32)], e)


DEQUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    0: _deq_f32,
    1: _deq_f16,
    30: _deq_bf16,
    2: _deq_q4_0,
    3: _deq_q4_1,
    6: _deq_q5_0,
    7: _deq_q5_1,
    8: _deq_q8_0,
    10: _deq_q2_k,
    11: _deq_q3_k,
    12: _deq_q4_k,
    13: _deq_q5_k,
    14: _deq_q6_k,
    39: _deq_mxfp4,
}

# Blocks per vectorised call: bounds the temporaries (a few x 1 KiB per k-quant block) while
# keeping numpy's per-call overhead negligible.
_CHUNK_BLOCKS = 1 << 15


def can_dequantize(type_id: int) -> bool:
    return type_id in DEQUANTIZERS


def dequantize(raw: np.ndarray | bytes | memoryview, type_id: int, n_elements: int) -> np.ndarray:
    """Dequantize ``n_elements`` elements of ggml type ``type_id`` from ``raw`` -> float32[n_elements].

    ``raw`` must hold exactly ``n_elements / block_size`` whole blocks. Raises ValueError for a
    type we cannot dequantize or a size mismatch (the GGUF reader validates sizes earlier and
    turns these into ModelFormatError)."""
    t = GGML_TYPES.get(type_id)
    fn = DEQUANTIZERS.get(type_id)
    if t is None or fn is None:
        name = t.name if t is not None else f"id {type_id}"
        supported = ", ".join(GGML_TYPES[i].name for i in sorted(DEQUANTIZERS))
        raise ValueError(f"cannot dequantize ggml type {name}; supported: {supported}")
    if isinstance(raw, np.ndarray):
        buf = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    else:
        buf = np.frombuffer(raw, dtype=np.uint8)
    if n_elements % t.block_size or buf.size != n_elements // t.block_size * t.type_size:
        raise ValueError(
            f"{t.name}: {buf.size} bytes do not hold {n_elements} elements "
            f"(blocks of {t.block_size} elements in {t.type_size} bytes)"
        )
    blocks = buf.reshape(-1, t.type_size)
    out = np.empty((blocks.shape[0], t.block_size), dtype=np.float32)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        stop = min(start + _CHUNK_BLOCKS, blocks.shape[0])
        out[start:stop] = fn(blocks[start:stop])
    return out.reshape(-1)
