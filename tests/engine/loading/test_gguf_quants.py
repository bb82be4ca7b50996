"""Our ggml dequantizers against gguf-py's reference (gguf.quants.dequantize), bit for bit.

Blocks come from two sources: gguf-py's own quantizer where it has one (realistic blocks), and
random bytes with sane f16 scale fields for every type (covers every bit pattern of the packed
fields, including the k-quant scale packing that a quantizer might never emit).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from engine.loading import gguf_quants as gq

# Byte offsets of the f16 scale fields per type: overwritten with finite values so that
# random blocks do not carry NaN/inf scales.
F16_FIELDS = {
    "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0],
    "q2_k": [80, 82], "q3_k": [108], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208],
}
QUANTIZED = sorted(F16_FIELDS)


def _random_blocks(rng: np.random.Generator, name: str, n_blocks: int) -> np.ndarray:
    t = gq.GGML_TYPE_BY_NAME[name]
    raw = rng.integers(0, 256, size=(n_blocks, t.type_size), dtype=np.uint8)
    for pos in F16_FIELDS[name]:
        scales = rng.uniform(-0.5, 0.5, size=(n_blocks, 1)).astype(np.float16)
        raw[:, pos:pos + 2] = scales.view(np.uint8)
    return raw


def test_type_table_matches_ggml():
    # Every type gguf-py knows has our block geometry, and we know no type gguf-py doesn't.
    for qt, (block, size) in GGML_QUANT_SIZES.items():
        t = gq.GGML_TYPES[int(qt)]
        assert (t.block_size, t.type_size) == (block, size), qt.name
        assert t.name == qt.name.lower()
    assert set(gq.GGML_TYPES) == {int(q) for q in GGML_QUANT_SIZES}


@pytest.mark.parametrize("name", QUANTIZED)
def test_random_blocks_match_reference(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    t = gq.GGML_TYPE_BY_NAME[name]
    n_blocks = 300  # more than one of every packed pattern, small enough to be instant
    raw = _random_blocks(rng, name, n_blocks)
    ours = gq.dequantize(raw.reshape(-1), t.id, n_blocks * t.block_size)
    ref = ref_dequantize(raw.reshape(-1), GGMLQuantizationType(t.id)).reshape(-1)
    assert ours.dtype == np.float32 and ours.shape == (n_blocks * t.block_size,)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "bf16"])
def test_quantized_floats_match_reference(name):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((8, 256)) * 3).astype(np.float32)
    qt = GGMLQuantizationType[name.upper()]
    raw = ref_quantize(x, qt)
    ours = gq.dequantize(raw, int(qt), x.size)
    np.testing.assert_array_equal(ours, ref_dequantize(raw, qt).reshape(-1))
    # and the round trip is sane: within one 4-bit step (amax / 8) of the input
    assert np.abs(ours - x.reshape(-1)).max() < np.abs(x).max() / 8


@pytest.mark.parametrize("name,dtype", [("f32", np.float32), ("f16", np.float16)])
def test_unquantized(name, dtype):
    x = np.random.default_rng(1).standard_normal(96).astype(dtype)
    out = gq.dequantize(x.view(np.uint8), gq.GGML_TYPE_BY_NAME[name].id, x.size)
    np.testing.assert_array_equal(out, x.astype(np.float32))


def test_bf16_is_top_half_of_f32():
    x = np.array([1.0, -2.5, 3.140625, 0.0, -0.0, np.inf], dtype=np.float32)
    bf16_bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    out = gq.dequantize(bf16_bits.view(np.uint8), gq.GGML_TYPE_BY_NAME["bf16"].id, x.size)
    np.testing.assert_array_equal(out, x)


def test_known_q8_0_block():
    # d = 0.5, qs = -16..15 -> y = qs * 0.5
    block = np.float16(0.5).tobytes() + np.arange(-16, 16, dtype=np.int8).tobytes()
    out = gq.dequantize(block, gq.GGML_TYPE_BY_NAME["q8_0"].id, 32)
    np.testing.assert_array_equal(out, np.arange(-16, 16, dtype=np.float32) * 0.5)


def test_known_q4_0_block():
    # d = 2, qs[j] = lo j, hi 15 - j  -> y[j] = (j - 8) * 2, y[16 + j] = (7 - j) * 2
    qs = bytes((j & 0xF) | ((15 - j) << 4) for j in range(16))
    out = gq.dequantize(np.float16(2).tobytes() + qs, gq.GGML_TYPE_BY_NAME["q4_0"].id, 32)
    j = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(out, np.concatenate([(j - 8) * 2, (7 - j) * 2]))


def test_chunking_is_invisible(monkeypatch):
    # Many blocks across several internal chunks give the same result as one call per block.
    monkeypatch.setattr(gq, "_CHUNK_BLOCKS", 7)
    rng = np.random.default_rng(3)
    t = gq.GGML_TYPE_BY_NAME["q4_k"]
    raw = _random_blocks(rng, "q4_k", 30)
    whole = gq.dequantize(raw, t.id, 30 * t.block_size)
    per_block = np.concatenate([gq.dequantize(b, t.id, t.block_size) for b in raw])
    np.testing.assert_array_equal(whole, per_block)


def test_size_mismatch_and_unsupported_types_raise():
    t = gq.GGML_TYPE_BY_NAME["q4_0"]
    with pytest.raises(ValueError, match="do not hold"):
        gq.dequantize(np.zeros(t.type_size - 1, np.uint8), t.id, 32)
    with pytest.raises(ValueError, match="do not hold"):
        gq.dequantize(np.zeros(t.type_size, np.uint8), t.id, 31)
    iq = gq.GGML_TYPE_BY_NAME["iq2_xxs"]
    assert not gq.can_dequantize(iq.id)
    with pytest.raises(ValueError, match="cannot dequantize ggml type iq2_xxs"):
        gq.dequantize(np.zeros(iq.type_size, np.uint8), iq.id, iq.block_size)
    with pytest.raises(ValueError, match="id 4"):
        gq.dequantize(b"", 4, 0)
