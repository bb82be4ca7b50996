"""MXFP4: the reference against transformers' own dequantization of the same blocks and scales,
the CPU kernel and the Triton kernel (interpreted here) against the reference, quantization
round trips, expert blobs, and gpt-oss checkpoints whose experts are MXFP4 (_blocks/_scales)."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.quant.formats import QuantFormat, QuantizedTensor
from engine.quant.expert_blob import pack_expert, unpack_expert
from engine.quant.mxfp4 import MXFP4, dequantize_fast, from_hf_blocks, qlinear_mxfp4_cpu
from engine.quant.reference import dequantize, linear_ref, quantize


def random_blocks(g: torch.Generator, e: int, out: int, groups: int, lo: int = 110, hi: int = 135):
    blocks = torch.randint(0, 256, (e, out, groups, 16), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(lo, hi, (e, out, groups), generator=g, dtype=torch.int64).to(torch.uint8)
    return blocks, scales


def test_reference_equals_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks, scales = random_blocks(g, 3, 24, 4, lo=0, hi=255)  # every exponent, subnormal 2^-127 too
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    for e in range(3):
        ours = dequantize(from_hf_blocks(blocks[e], scales[e]))  # [out, in]
        assert torch.equal(ours, hf[e].T), e


@pytest.mark.parametrize("t", [1, 3, 17])
def test_cpu_kernel_equals_reference(t):
    g = torch.Generator().manual_seed(t)
    blocks, scales = random_blocks(g, 1, 40, 6)
    q = from_hf_blocks(blocks[0], scales[0])
    assert torch.equal(dequantize_fast(q), dequantize(q))
    x = torch.randn(t, 192, generator=g)
    torch.testing.assert_close(qlinear_mxfp4_cpu(x, q), linear_ref(x, q), atol=1e-5, rtol=1e-5)


def test_qlinear_and_expert_forward_route_mxfp4_to_its_kernel():
    from engine.quant.kernels import backend_for, expert_forward, load_extension, qlinear
    from engine.quant.reference import expert_ref

    g = torch.Generator().manual_seed(4)
    gate, up, down = (quantize(torch.randn(*s, generator=g), MXFP4) for s in ((64, 96), (64, 96), (96, 64)))
    # the native kernel where it is built, else the torch-vectorised one
    assert backend_for(gate) == ("cpp" if load_extension() is not None else "torch")
    x = torch.randn(5, 96, generator=g)
    torch.testing.assert_close(qlinear(x, gate), linear_ref(x, gate), atol=1e-5, rtol=1e-5)
    # float rounding, propagated through the hidden activation as in test_avx2.py (an elementwise
    # rtol failed on the AVX2 build, 1 of 480 outputs: a sum of terms far larger than itself)
    hid = torch.nn.functional.silu(linear_ref(x, gate)) * linear_ref(x, up)
    bound = 4e-4 * (hid.abs() @ dequantize(down).abs().T) + 1e-5
    err = (expert_forward(x, gate, up, down) - expert_ref(x, gate, up, down)).abs()
    assert bool((err <= bound).all()), float(err.max())


@pytest.fixture(params=["native", "avx2"])
def native(request):
    """The native extension (engine/csrc) this CPU builds by default, and the AVX2 one forced
    with the cpu_isa option (quant_kernel=cpp: no silent torch fallback)."""
    from engine.options import configure
    from engine.quant import kernels as K

    if request.param == "avx2" and not K.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    prev = configure(cpu_isa="avx2" if request.param == "avx2" else "auto", quant_kernel="cpp")
    try:
        mod = K.load_extension()
        if mod is None or (request.param == "avx2" and K.native_isa() != "avx2"):
            pytest.skip(f"native kernels unavailable: {K.extension_error()}")
        yield mod
    finally:
        configure(prev)


@pytest.mark.parametrize("n,k", [(40, 192), (5, 32), (33, 1024)])
def test_native_kernel_equals_reference(native, n, k):
    """The native MXFP4 kernel (e2m1 codes and e8m0 scales read directly) against
    x @ reference.dequantize(q).T: every exponent byte (the subnormal 2^-127 included), T = 1 and
    T > 1 through both loop nests (direct and dequantize-to-scratch), int8 activations asked for
    and ignored (MXFP4 takes float activations), kernels.py's bound."""
    from engine.quant import kernels as K

    g = torch.Generator().manual_seed(n + k)
    blocks, scales = random_blocks(g, 1, n, k // 32, lo=100, hi=140)
    scales[0, 0, 0] = 0  # 2^-127
    q = from_hf_blocks(blocks[0], scales[0])
    assert K.backend_for(q) == "cpp"
    args = K._kargs(q)
    assert args[0] == K.FORMAT_IDS["mxfp4"] == 4
    for t in (1, 2, 3, 4, 7, 17):
        x = torch.randn(t, k, generator=g)
        want = linear_ref(x, q)
        bound = 1e-4 * (x.abs() @ dequantize(q).abs().T) + 1e-5
        for dmt in (0, 3, 64):
            for i8a in (0, 1):
                y = native.qlinear(x, *args, dmt, i8a)
                assert bool(((y - want).abs() <= bound).all()), (t, dmt, float((y - want).abs().max()))
        assert torch.equal(K.qlinear(x, q), native.qlinear(x, *args, K.DIRECT_MAX_T, 0))
    # a token's row does not depend on the batch
    x = torch.randn(9, k, generator=g)
    alone = torch.cat([native.qlinear(x[i:i + 1], *args, K.DIRECT_MAX_T, 0) for i in range(9)])
    assert torch.equal(native.qlinear(x, *args, K.DIRECT_MAX_T, 0)[:3], alone[:3])


def test_native_expert_equals_reference(native):
    from engine.quant import kernels as K
    from engine.quant.reference import expert_ref

    g = torch.Generator().manual_seed(11)
    i, h = 64, 128
    gate, up, down = (quantize(torch.randn(*s, generator=g) * 0.3, MXFP4) for s in ((i, h), (i, h), (h, i)))
    for t in (1, 5):
        x = torch.randn(t, h, generator=g)
        torch.testing.assert_close(K.expert_forward(x, gate, up, down), expert_ref(x, gate, up, down),
                                   atol=1e-4, rtol=1e-4)


def test_native_kernel_rejects_bad_mxfp4_parts(native):
    q = quantize(torch.randn(8, 64), MXFP4)
    c, s = q.parts["codes"], q.parts["scales"]
    with pytest.raises(RuntimeError, match="bad scales"):
        native.qlinear(torch.randn(1, 64), 4, 32, 8, 64, c, s[:, :1].contiguous(), torch.empty(0), 3, 0)
    with pytest.raises(RuntimeError, match="blocks of 32"):
        native.qlinear(torch.randn(1, 64), 4, 64, 8, 64, c, s, torch.empty(0), 3, 0)


def test_triton_kernel_equals_reference():
    tk = pytest.importorskip("engine.quant.triton_kernels")
    if not tk.available() or not tk.supports(torch.device("cpu")):
        pytest.skip("Triton cannot run on CPU tensors in this process")
    g = torch.Generator().manual_seed(2)
    for t, n, k in [(1, 48, 256), (3, 70, 384), (tk.MAX_T + 2, 33, 128)]:
        blocks, scales = random_blocks(g, 1, n, k // 32)
        q = from_hf_blocks(blocks[0], scales[0])
        x = torch.randn(t, k, generator=g)
        want = linear_ref(x, q)
        bound = 1e-4 * (x.abs() @ dequantize(q).abs().T) + 1e-5
        assert bool(((tk.qlinear_triton(x, q) - want).abs() <= bound).all())


def test_quantize_round_trip_and_error():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 128, generator=g)
    q = quantize(w, MXFP4)
    assert q.parts["codes"].shape == (32, 64) and q.parts["scales"].shape == (32, 4)
    assert torch.equal(dequantize(quantize(dequantize(q), MXFP4)), dequantize(q))  # grid points stay
    rel = (dequantize(q) - w).norm() / w.norm()
    assert 0.05 < rel < 0.2  # 4-bit float with a power-of-two scale
    assert torch.equal(dequantize(quantize(torch.zeros(2, 32), MXFP4)), torch.zeros(2, 32))
    assert MXFP4.bits_per_weight == 4.25


def test_group_size_other_than_32_is_refused():
    with pytest.raises(ConfigError, match="mxfp4"):
        QuantFormat("mxfp4", 64)


def test_expert_blob_round_trip_keeps_the_bytes():
    g = torch.Generator().manual_seed(3)
    blocks, scales = random_blocks(g, 3, 64, 2)
    gate, up = from_hf_blocks(blocks[0], scales[0]), from_hf_blocks(blocks[1], scales[1])
    db, ds = random_blocks(g, 1, 64, 2)
    down = from_hf_blocks(db[0], ds[0])
    blob, layout = pack_expert(gate, up, down, MXFP4)
    g2, u2, d2 = unpack_expert(blob, layout)
    for a, b in ((gate, g2), (up, u2), (down, d2)):
        assert isinstance(b, QuantizedTensor) and b.fmt == MXFP4
        assert torch.equal(a.parts["codes"], b.parts["codes"]) and torch.equal(a.parts["scales"], b.parts["scales"])


def test_ggml_mxfp4_dequantizer_equals_gguf_py():
    """GGML type 39 ({e8m0; 16 bytes: weight j low nibble, j + 16 high}) against llama.cpp's
    gguf-py, exponents 0-249 (the subnormal 2^-127 included)."""
    import numpy as np

    gguf = pytest.importorskip("gguf")
    from engine.loading.gguf_quants import dequantize as ggml_dequantize

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(300, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(300) % 250  # exponents 0..249 (6 * 2^(e-127) is finite in float32)
    want = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType.MXFP4).reshape(-1)
    got = ggml_dequantize(blocks, 39, 300 * 32)
    assert np.isfinite(want).all() and np.array_equal(got, want)


def test_split_gguf_with_a_missing_shard_is_refused(tmp_path):
    import numpy as np

    gguf = pytest.importorskip("gguf")
    from engine.errors import ModelFormatError
    from engine.loading.gguf_split import open_gguf

    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama", split_max_tensors=1)
    for i in range(3):
        w.add_tensor(f"t{i}", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first = tmp_path / "m-00001-of-00003.gguf"
    f = open_gguf(first)
    assert sorted(f.tensors) == ["t0", "t1", "t2"] and f.raw("t2").size == 2 * 32 * 4
    f.close()
    with pytest.raises(ModelFormatError, match="first shard"):
        open_gguf(tmp_path / "m-00002-of-00003.gguf")
    (tmp_path / "m-00003-of-00003.gguf").unlink()
    with pytest.raises(ModelFormatError, match="shard 3 of 3 is missing"):
        open_gguf(first)
