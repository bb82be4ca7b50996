"""Formats: packing, quantization error bounds, serialization (zero-copy), validation."""

from __future__ import annotations

import json
import mmap

import pytest
import torch

from engine.errors import ConfigError, ModelFormatError
from engine.quant import (
    ALIGN, FORMATS, GROUP_SIZES, QuantFormat, QuantizedTensor, bytes_for, dequantize,
    expert_bytes_for, pack_expert, payload_bytes, quant_error, quantize, unpack_expert,
)
from engine.quant.reference import pack_nibbles, unpack_codes, unpack_nibbles

ALL_FORMATS = [QuantFormat(n, g) for n in FORMATS for g in GROUP_SIZES]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- packing

@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (17, 384)])
def test_nibble_pack_round_trip_is_exact(shape):
    codes = torch.randint(0, 16, shape, generator=_gen(), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)


def test_nibble_order_is_j_and_j_plus_16():
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).reshape(1, 32)
    codes[0, 16:] = torch.arange(15, -1, -1, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    for j in range(16):
        assert int(packed[0, j]) == int(codes[0, j]) | (int(codes[0, j + 16]) << 4)


@pytest.mark.parametrize("fmt", [f for f in ALL_FORMATS if f.name in ("int4", "nf4", "int8")], ids=str)
def test_codes_survive_serialization_exactly(fmt):
    q = quantize(torch.randn(24, 256, generator=_gen(1)), fmt)
    q2 = QuantizedTensor.from_buffer(q.to_bytes(), q.layout())
    assert torch.equal(unpack_codes(q2), unpack_codes(q))
    for name, t in q.parts.items():
        assert torch.equal(q2.parts[name], t), name
    assert torch.equal(dequantize(q2), dequantize(q))


def test_int4_codes_are_exact_on_representable_weights():
    # a group holding min + c * scale for every code c is reproduced exactly
    scale, mn = 0.125, -1.0
    w = (torch.arange(64) % 16).float().reshape(1, 64) * scale + mn
    q = quantize(w, QuantFormat("int4", 32))
    assert torch.equal(unpack_codes(q)[0], (torch.arange(64) % 16).to(torch.uint8))
    assert torch.equal(dequantize(q), w)


def test_all_zero_groups_and_constant_groups():
    w = torch.zeros(4, 64)
    w[1] = 3.0
    for name in ("int4", "nf4", "int8"):
        wq = dequantize(quantize(w, QuantFormat(name, 32)))
        assert torch.isfinite(wq).all()
        assert torch.allclose(wq, w, atol=1e-2), name


# ----------------------------------------------------------------------------- error bounds

@pytest.mark.parametrize("g", GROUP_SIZES)
def test_error_bounds_on_normal_weights(g):
    w = torch.randn(256, 512, generator=_gen(2))
    x = torch.randn(32, 512, generator=_gen(3))
    err = {n: quant_error(w, QuantFormat(n, g), x) for n in FORMATS}
    for e in err.values():
        assert set(e) == {"rel_err_w", "rel_err_wx"}
    # measured (G=32/64/128): int4 0.078/0.090/0.100, nf4 0.087/0.092/0.095, int8 0.005-0.0065
    assert err["int4"]["rel_err_w"] < 0.11
    assert err["nf4"]["rel_err_w"] < 0.11
    assert err["int8"]["rel_err_w"] < 0.008
    assert err["bf16"]["rel_err_w"] < 0.003
    assert err["int8"]["rel_err_w"] * 8 < min(err["int4"]["rel_err_w"], err["nf4"]["rel_err_w"])
    assert 0.7 < err["int4"]["rel_err_w"] / err["nf4"]["rel_err_w"] < 1.4  # int4 ~ nf4
    for e in err.values():
        assert e["rel_err_wx"] < 1.5 * e["rel_err_w"] + 1e-6


def test_error_shrinks_with_group_size():
    w = torch.randn(128, 512, generator=_gen(4))
    for n in ("int4", "nf4", "int8"):
        e = [quant_error(w, QuantFormat(n, g))["rel_err_w"] for g in GROUP_SIZES]
        assert e[0] < e[1] < e[2], (n, e)


def test_elementwise_bound_int4_half_step():
    w = torch.randn(64, 256, generator=_gen(5))
    q = quantize(w, QuantFormat("int4", 64))
    step = q.parts["scales"].float().repeat_interleave(64, dim=1)
    # half a quantization step, plus the fp16 rounding of the min
    assert ((dequantize(q) - w).abs() <= 0.5 * step + 1e-3 * w.abs().amax()).all()


# ----------------------------------------------------------------------------- layout / sizes

def test_bits_and_bytes():
    assert QuantFormat("int4", 32).bits_per_weight == 5.0
    assert QuantFormat("int4", 128).bits_per_weight == 4.25
    assert QuantFormat("nf4", 64).bits_per_weight == 4.25
    assert QuantFormat("int8", 64).bits_per_weight == 8.25
    assert QuantFormat("bf16", 64).bits_per_weight == 16.0
    for fmt in ALL_FORMATS:
        q = quantize(torch.randn(40, 256, generator=_gen(6)), fmt)
        assert len(q.to_bytes()) == bytes_for((40, 256), fmt) == q.layout()["nbytes"]
        assert q.nbytes == payload_bytes((40, 256), fmt) == 40 * 256 * fmt.bits_per_weight / 8
        assert bytes_for((40, 256), fmt) % ALIGN == 0
        for p in q.layout()["parts"]:
            assert p["offset"] % ALIGN == 0


def test_layout_is_json_and_explicit():
    q = quantize(torch.randn(8, 128, generator=_gen(7)), QuantFormat("int4", 32))
    lay = json.loads(json.dumps(q.layout()))
    assert lay["format"] == {"name": "int4", "group_size": 32} and lay["shape"] == [8, 128]
    assert [(p["name"], p["dtype"], p["shape"]) for p in lay["parts"]] == [
        ("codes", "uint8", [8, 64]), ("scales", "float16", [8, 4]), ("mins", "float16", [8, 4])]
    q2 = QuantizedTensor.from_buffer(q.to_bytes(), lay, (8, 128), QuantFormat("int4", 32))
    assert torch.equal(dequantize(q2), dequantize(q))


# ----------------------------------------------------------------------------- zero copy

def _inside(t: torch.Tensor, base: int, size: int) -> bool:
    return base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + size


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "tensor", "mmap"])
def test_from_buffer_is_zero_copy(kind):
    q = quantize(torch.randn(16, 128, generator=_gen(8)), QuantFormat("int4", 64))
    blob = q.to_bytes()
    backing = torch.zeros(len(blob) + 128, dtype=torch.uint8)
    backing[64:64 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    if kind == "bytes":
        buf, off = blob, 0
    elif kind == "bytearray":
        buf, off = bytearray(blob), 0
    elif kind == "memoryview":
        buf, off = memoryview(bytearray(backing.numpy().tobytes())), 64
    elif kind == "tensor":
        buf, off = backing, 64
    else:
        buf = mmap.mmap(-1, len(blob) + 64)
        buf[64:64 + len(blob)] = blob
        off = 64
    base_t = buf if isinstance(buf, torch.Tensor) else torch.frombuffer(buf, dtype=torch.uint8)
    base, size = base_t.data_ptr(), base_t.numel()
    q2 = QuantizedTensor.from_buffer(buf, q.layout(), offset=off)
    for t in q2.parts.values():
        assert _inside(t, base, size)
    assert torch.equal(dequantize(q2), dequantize(q))
    if kind == "tensor":  # a write to the buffer is seen through the view: it is the same memory
        backing[64] ^= 0xFF
        assert int(q2.parts["codes"][0, 0]) == int(backing[64])


def test_expert_pack_unpack_zero_copy():
    i, h = 128, 256
    g, u, d = (torch.randn(*s, generator=_gen(s[0] + s[1] + k)) for k, s in enumerate([(i, h), (i, h), (h, i)]))
    for fmt in (QuantFormat("int4", 32), QuantFormat("nf4", 64), QuantFormat("int8", 128), QuantFormat("bf16", 64)):
        blob, layout = pack_expert(g, u, d, fmt)
        assert len(blob) == layout["nbytes"] == expert_bytes_for(i, h, fmt)
        layout = json.loads(json.dumps(layout))
        buf = bytearray(blob)
        base = torch.frombuffer(buf, dtype=torch.uint8)
        qg, qu, qd = unpack_expert(buf, layout)
        assert (qg.shape, qu.shape, qd.shape) == ((i, h), (i, h), (h, i))
        for q, w in zip((qg, qu, qd), (g, u, d)):
            assert layout["tensors"]["gate"]["offset"] % ALIGN == 0
            assert torch.equal(dequantize(q), dequantize(quantize(w, fmt)))
            for t in q.parts.values():
                assert _inside(t, base.data_ptr(), base.numel())
        # already-quantized tensors pack to the same blob
        assert pack_expert(quantize(g, fmt), quantize(u, fmt), quantize(d, fmt), fmt)[0] == blob


def test_expert_shape_mismatch():
    with pytest.raises(ConfigError, match="gate"):
        pack_expert(torch.randn(64, 128), torch.randn(64, 128), torch.randn(64, 128), QuantFormat("int4", 32))


# ----------------------------------------------------------------------------- validation

def test_bad_group_size_names_shape_and_group():
    with pytest.raises(ConfigError, match=r"\[8, 96\].*group_size 64"):
        quantize(torch.randn(8, 96), QuantFormat("int4", 64))
    with pytest.raises(ConfigError, match="group_size 48"):
        QuantFormat("int4", 48)
    with pytest.raises(ConfigError, match="not supported"):
        QuantFormat("int3", 64)
    with pytest.raises(ConfigError):
        bytes_for((8, 100), QuantFormat("nf4", 32))
    # bf16 has no groups: any in-dim is fine
    assert dequantize(quantize(torch.ones(2, 10), QuantFormat("bf16", 64))).shape == (2, 10)


def test_bad_weights():
    with pytest.raises(ConfigError, match="NaN"):
        quantize(torch.tensor([[float("nan")] * 32]), QuantFormat("int4", 32))
    with pytest.raises(ConfigError, match="fp16"):
        quantize(torch.full((1, 32), 1e6), QuantFormat("int8", 32))
    with pytest.raises(ConfigError):
        quantize(torch.randn(2, 3, 32), QuantFormat("int4", 32))


def test_from_buffer_rejects_bad_layouts():
    q = quantize(torch.randn(8, 128, generator=_gen(9)), QuantFormat("nf4", 32))
    blob, lay = q.to_bytes(), q.layout()

    def bad(mutate, buf=blob, **kw):
        l2 = json.loads(json.dumps(lay))
        mutate(l2)
        with pytest.raises(ModelFormatError):
            QuantizedTensor.from_buffer(buf, l2, **kw)

    bad(lambda l: l["parts"][0].update(dtype="float16"))
    bad(lambda l: l["parts"][1].update(offset=blob.__len__()))      # out of range
    bad(lambda l: l["parts"][1].update(offset=lay["parts"][1]["offset"] + 2))  # misaligned
    bad(lambda l: l["parts"][1].update(offset=0))                    # overlaps codes
    bad(lambda l: l["parts"].pop())
    bad(lambda l: l.update(format={"name": "int5", "group_size": 32}))
    bad(lambda l: l.pop("shape"))
    bad(lambda l: None, buf=blob[:-100])                              # truncated
    bad(lambda l: None, fmt=QuantFormat("nf4", 64))                   # manifest disagrees
    bad(lambda l: None, shape=(8, 256))
    with pytest.raises(ModelFormatError):
        unpack_expert(blob, {"format": lay["format"], "tensors": {}})
