"""Every fast kernel equals the reference (reference.linear_ref / expert_ref) within tolerance."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from engine.errors import ConfigError
from engine.quant import FORMATS, GROUP_SIZES, NF4_CODEBOOK, QuantFormat, QuantizedTensor, quantize
from engine.quant import kernels as K
from engine.quant.reference import (activation_bits, dequantize, dequantize_activations, expert_ref, linear_ref,
                                    linear_ref_int8_act, quantize_activations,
                                    takes_int8_activations)

SHAPES = [(16, 128), (72, 256), (33, 384)]   # N not a multiple of the row tiles on purpose
TOKENS = [1, 2, 3, 4, 17]   # direct (decode) loop, its odd tail, the scratch loop
HAVE_CPP = K.load_extension() is not None


def assert_close_to_ref(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> None:
    """Tolerance stated in kernels.py: |y - ref| <= 1e-4 * (|x| @ |w|.T) + 1e-5, elementwise."""
    assert y.dtype == torch.float32 and y.shape == ref.shape
    bound = 1e-4 * (x.float().abs() @ w.abs().T) + 1e-5
    excess = ((y - ref).abs() - bound).max().item()
    assert excess <= 0, f"max excess over tolerance {excess:.3g}"


def cpp_ref(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """What the C++ backend computes: int4 weights take int8 activations when that is on."""
    x = x.reshape(-1, q.shape[1])
    return linear_ref_int8_act(x, q) if takes_int8_activations(q) and K.int8_activations() else linear_ref(x, q)


def assert_close_to_cpp_ref(y: torch.Tensor, x: torch.Tensor, q: QuantizedTensor) -> None:
    """As assert_close_to_ref against cpp_ref; the bound also covers the quantized activations."""
    x = x.reshape(-1, q.shape[1]).float()
    w = dequantize(q)
    xq = dequantize_activations(x, activation_bits(q))
    bound = 1e-4 * ((x.abs() + xq.abs()) @ w.abs().T) + 1e-5
    err = (y.reshape(-1, q.shape[0]) - cpp_ref(x, q)).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g}"


@pytest.fixture
def backend():
    yield K.set_backend
    K.set_backend(None)


def _candidates(fmt_name: str) -> list[str]:
    c = ["torch", "dequant_f32"]
    if HAVE_CPP:
        c.append("cpp")
    if fmt_name == "int4":
        c.append("torch_int4pack")
    return c


def on_grid(n: int, k: int, fmt: QuantFormat, gen: torch.Generator) -> torch.Tensor:
    """A float weight [n, k] the format holds exactly, built from the format's definition (not
    from engine.quant): per group a power-of-two scale, codes spanning the group's range (so
    quantize recovers that scale and min exactly), w = decoded codes."""
    if fmt.name == "bf16":
        return torch.randn(n, k, generator=gen).to(torch.bfloat16).float()
    g = fmt.group_size
    s = 2.0 ** -torch.randint(4, 9, (n, k // g, 1), generator=gen).float()
    if fmt.name == "int8":
        c = torch.randint(-127, 128, (n, k // g, g), generator=gen).float()
        c[..., 0] = 127.0  # the group's absmax is 127 s: scale = s exactly
        return (c * s).reshape(n, k)
    c = torch.randint(0, 16, (n, k // g, g), generator=gen)
    c[..., 0], c[..., 1] = 0, 15
    if fmt.name == "nf4":
        return (torch.tensor(NF4_CODEBOOK)[c] * s).reshape(n, k)  # absmax = s (NF4[15] = 1)
    m = -torch.randint(0, 16, (n, k // g, 1), generator=gen).float() * s  # int4: min, scale s
    return (m + c.float() * s).reshape(n, k)


@pytest.mark.parametrize("g", GROUP_SIZES)
@pytest.mark.parametrize("name", FORMATS)
def test_qlinear_candidates_match_reference(name, g):
    """Every candidate against x @ w.T of the float weights themselves (weights on the format's
    grid): independent of reference.dequantize, which the torch candidates call."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{g}".encode()))
    fmt = QuantFormat(name, g)
    for n, k in SHAPES:
        w = on_grid(n, k, fmt, gen)
        q = quantize(w, fmt)
        assert torch.equal(dequantize(q), w)  # what was encoded decodes exactly
        for t in TOKENS:
            x = torch.randn(t, k, generator=gen)
            exact = (x.double() @ w.double().T).float()
            for cand in _candidates(name):
                if cand == "torch_int4pack" and not K.int4pack_supported(q):
                    continue
                fn = K.qlinear_torch if cand == "torch" else K.CANDIDATES[cand]
                if cand == "cpp":
                    assert_close_to_cpp_ref(fn(x, q), x, q)
                else:
                    assert_close_to_ref(fn(x, q), x, w, exact)


def test_a_wrong_weight_fails_the_candidate_check():
    """The check above can fail: one weight flipped to the other end of its group's range."""
    gen = torch.Generator().manual_seed(zlib.crc32(b"mutation"))
    fmt = QuantFormat("int8", 32)
    w = on_grid(16, 128, fmt, gen)
    q = quantize(w, fmt)
    q.parts["codes"][3, 5] = -127 if int(q.parts["codes"][3, 5]) >= 0 else 127
    x = torch.ones(1, 128)
    with pytest.raises(AssertionError, match="excess over tolerance"):
        assert_close_to_ref(K.qlinear_torch(x, q), x, w, (x.double() @ w.double().T).float())


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_qlinear_public_entry(mode, backend):
    backend(mode)
    gen = torch.Generator().manual_seed(11)
    for name in FORMATS:
        q = quantize(torch.randn(40, 256, generator=gen), QuantFormat(name, 64))
        assert K.backend_for(q) == ("cpp" if HAVE_CPP and mode == "auto" else "torch")
        w = dequantize(q)
        for t in (1, 5):
            x = torch.randn(2, t, 256, generator=gen)           # leading dims are flattened
            y = K.qlinear(x, q)
            assert y.shape == (2, t, 40)
            xb = x.to(torch.bfloat16)                            # bf16 input: computed in fp32
            if K.backend_for(q) == "cpp":
                assert_close_to_cpp_ref(y, x, q)
                assert_close_to_cpp_ref(K.qlinear(xb, q), xb, q)
            else:
                assert_close_to_ref(y.reshape(-1, 40), x.reshape(-1, 256), w, linear_ref(x.reshape(-1, 256), q))
                assert_close_to_ref(K.qlinear(xb, q).reshape(-1, 40), xb.reshape(-1, 256), w,
                                    linear_ref(xb.reshape(-1, 256), q))


@pytest.mark.parametrize("mode", ["auto", "torch"])
@pytest.mark.parametrize("name", FORMATS)
def test_expert_forward_matches_reference(name, mode, backend):
    backend(mode)
    gen = torch.Generator().manual_seed(12)
    i, h = 96, 128
    fmt = QuantFormat(name, 32)
    g, u, d = (quantize(torch.randn(*s, generator=gen) * 0.1, fmt) for s in ((i, h), (i, h), (h, i)))
    lin = cpp_ref if K.backend_for(g) == "cpp" else linear_ref
    for t in TOKENS:
        x = torch.randn(t, h, generator=gen)
        hid = torch.nn.functional.silu(lin(x, g)) * lin(x, u)
        ref = lin(hid, d)
        y = K.expert_forward(x, g, u, d)
        # the bound of each linear propagates; the hidden activation is formed in fp32 either way
        bound = 1e-4 * (hid.abs() @ dequantize(d).abs().T) * 4 + 1e-5
        if lin is cpp_ref and takes_int8_activations(d) and K.int8_activations():
            # int8 activations: a reordering difference in hid can flip the rounding of a few of
            # its codes by one step, each moving the output by at most dx * max |w_down|
            _, dh = quantize_activations(hid, activation_bits(d))
            bound = bound + 4 * dh.max() * dequantize(d).abs().amax(1)[None, :]
        assert y.shape == (t, h) and ((y - ref).abs() <= bound).all()
        if lin is linear_ref or not K.int8_activations() or not any(map(takes_int8_activations, (g, u, d))):
            assert ((y - expert_ref(x, g, u, d)).abs() <= bound).all()


def test_kernels_on_zero_copy_views():
    q = quantize(torch.randn(64, 256), QuantFormat("nf4", 128))
    q2 = QuantizedTensor.from_buffer(q.to_bytes(), q.layout())   # read-only bytes: never written
    x = torch.randn(3, 256)
    assert torch.equal(K.qlinear(x, q2), K.qlinear(x, q))


def test_fallback_when_extension_missing(monkeypatch, backend):
    isa = K.native_isa()
    monkeypatch.setitem(K._exts, isa, None)
    monkeypatch.setitem(K._errors, isa, "RuntimeError: no compiler (simulated)")
    backend("auto")
    q = quantize(torch.randn(16, 128), QuantFormat("int4", 32))
    assert K.backend_for(q) == "torch"
    x = torch.randn(2, 128)
    assert_close_to_ref(K.qlinear(x, q), x, dequantize(q), linear_ref(x, q))
    backend("cpp")
    with pytest.raises(ConfigError, match="unavailable"):
        K.qlinear(x, q)


def test_bad_inputs():
    q = quantize(torch.randn(16, 128), QuantFormat("int8", 32))
    with pytest.raises(ConfigError, match="in-dim 128"):
        K.qlinear(torch.randn(2, 64), q)
    with pytest.raises(ConfigError, match="gate"):
        K.expert_forward(torch.randn(1, 128), q, q, q)
    with pytest.raises(ConfigError):
        K.set_backend("gpu")


def test_empty_token_batch():
    q = quantize(torch.randn(16, 128), QuantFormat("int4", 64))
    assert K.qlinear(torch.randn(0, 128), q).shape == (0, 16)


def test_cpp_kernels_build_where_a_compiler_and_avx512_exist():
    """Guard against a silent fallback: with g++ and AVX-512 present the C++ path must build."""
    import shutil
    if shutil.which("g++") is None or shutil.which("ninja") is None or not K.cpu_has_avx512():
        pytest.skip("no g++/ninja/AVX-512 here: the torch fallback is expected")
    assert K.load_extension() is not None, K.extension_error()


needs_i8a = pytest.mark.skipif(not (HAVE_CPP and K.int8_activations()), reason="needs the integer-activation kernels (AVX512-VNNI or AVX2)")


@needs_i8a
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_int8_activation_path_matches_its_reference_with_tails_and_any_t(g):
    """K not a multiple of the 128-weight chunk (tail chunks), T on both sides of DIRECT_MAX_T."""
    gen = torch.Generator().manual_seed(g)
    for n, k in [(20, 96), (70, 576), (33, 384), (9, 1024)]:
        if k % g:
            continue
        q = quantize(torch.randn(n, k, generator=gen) * 0.05, QuantFormat("int4", g))
        for t in (1, 2, 3, 4, 9):
            x = torch.randn(t, k, generator=gen)
            y = K.qlinear(x, q)
            assert_close_to_cpp_ref(y, x, q)
            exact = linear_ref(x, q)  # the approximation itself stays small
            assert float((y - exact).norm() / exact.norm()) < 0.05


@needs_i8a
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_int8_activation_results_do_not_depend_on_the_batch(fmt):
    """The same bits alone or in a batch (docs/native-step.md, batch invariance): 13 rows are two
    register tiles of 6 tokens and a tile of 1. int8 weights: calls of up to 3 tokens take the
    256-bit kernel (quant.cpp HALVES_MAX_T), larger ones the 512-bit one, with the same bits."""
    gen = torch.Generator().manual_seed(5)
    q = quantize(torch.randn(64, 256, generator=gen) * 0.05, QuantFormat(fmt, 64))
    x = torch.randn(13, 256, generator=gen)
    alone = torch.cat([K.qlinear(x[i:i + 1], q) for i in range(13)])
    assert torch.equal(K.qlinear(x, q), alone)
    assert torch.equal(K.qlinear(x[:3], q), alone[:3])


needs_amx = pytest.mark.skipif(not (HAVE_CPP and K.int8_activations() and K.load_extension().amx_usable()),
                               reason="needs AMX-INT8 (and a kernel that grants tile state)")


@needs_amx
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_amx_kernel_gives_the_vnni_bits(g):
    """The AMX kernel (prefill-sized calls, engine/csrc/amx.cpp) computes i8a.h's sum with the
    VNNI kernel's bits: K with tail chunks and tail 16-block groups, K over one 32-block chunk
    (2,048: two; 3,072: three, the lane sums carried), N not a multiple of 16, T on
    both sides of AMX_MIN_ROWS (16) and of 16-token tiles; each row equals that row alone (the
    VNNI kernel, one token) and stays close to the reference."""
    ext = K.load_extension()
    gen = torch.Generator().manual_seed(40 + g)
    for n, k in [(20, 96), (70, 576), (33, 384), (9, 1024), (48, 2048), (17, 3072)]:
        if k % g:
            continue
        q = quantize(torch.randn(n, k, generator=gen) * 0.05, QuantFormat("int4", g))
        for t in (15, 16, 17, 33, 47, 64):
            x = torch.randn(t, k, generator=gen)
            prev = ext.set_amx(False)
            try:
                vnni = K.qlinear(x, q)
                alone = torch.cat([K.qlinear(x[i:i + 1], q) for i in range(t)])
            finally:
                ext.set_amx(prev)
            assert ext.amx_on()
            tiles = K.qlinear(x, q)
            assert torch.equal(tiles, vnni), (n, k, t)
            assert torch.equal(tiles, alone), (n, k, t)
            assert_close_to_cpp_ref(tiles, x, q)


@needs_amx
def test_amx_expert_forward_gives_the_vnni_bits():
    ext = K.load_extension()
    gen = torch.Generator().manual_seed(44)
    gate, up, down = (quantize(torch.randn(*s, generator=gen) * 0.05, QuantFormat("int4", 32))
                      for s in ((96, 256), (96, 256), (256, 96)))
    x = torch.randn(40, 256, generator=gen)
    prev = ext.set_amx(False)
    try:
        vnni = K.expert_forward(x, gate, up, down)
    finally:
        ext.set_amx(prev)
    assert torch.equal(K.expert_forward(x, gate, up, down), vnni)


@pytest.mark.skipif(not HAVE_CPP, reason="needs the native kernels")
@pytest.mark.parametrize("i8a", [True, False])
def test_stream_hint_follows_the_option_and_keeps_the_bits(i8a):
    """The ``stream_nta`` option (how the kernels request the weight rows they stream:
    engine/csrc/quant.h) reaches the extension's switch at the next step after a configure(), and
    only the requests change: every format, with integer or float activations, decode-sized calls
    (the int8 kernel's 256-bit halves) and larger ones give the same bits either way."""
    from engine.options import configure

    ext = K.load_extension()
    gen = torch.Generator().manual_seed(46)
    prev = configure(int8_activations=i8a)
    try:
        for on in (False, True):
            configure(stream_nta=on)
            K.int8_activations()  # what every step asks first
            assert ext.stream_nta() is on
        for fmt in ("int4", "int8", "nf4", "bf16"):
            q = quantize(torch.randn(70, 1024, generator=gen) * 0.05, QuantFormat(fmt, 64))
            for t in (1, 3, 5, 17):
                x = torch.randn(t, 1024, generator=gen)
                ys = []
                for on in (True, False):
                    was = ext.set_stream_nta(on)
                    try:
                        ys.append(K.qlinear(x, q))
                    finally:
                        ext.set_stream_nta(was)
                assert torch.equal(ys[0], ys[1]), (fmt, t)
                assert_close_to_cpp_ref(ys[0], x, q)
    finally:
        configure(prev)
        K.int8_activations()
    assert ext.stream_nta() is prev.stream_nta


@pytest.mark.skipif(not (HAVE_CPP and K.int8_activations()), reason="needs the VNNI int8-activation kernel")
def test_int8_activations_cover_what_the_vnni_kernel_reads():
    """The VNNI kernel loads a token's int8 activations 16 blocks (512 bytes) at a time, whatever K:
    the buffer must hold whole groups (K 768 once got 768 bytes and the kernel read 1,024, a rare
    SIGSEGV in bench/beyond_ram.py's 8 GB model), zero past K, and the kernel must still agree with
    the reference on such K."""
    ext = K.load_extension()
    for k in range(32, 4097, 32):
        assert ext.i8a_act_bytes(k) >= -(-k // 512) * 512, k
        assert ext.i8a_act_bytes(k) % 512 == 0 and ext.i8a_act_bytes(k) < k + 512, k
    g = torch.Generator().manual_seed(7)
    for k in (96, 768, 1312):  # not a multiple of 512: the last group is partial
        w = torch.randn(48, k, generator=g)
        q = quantize(w, QuantFormat("int4", 32))
        x = torch.randn(3, k, generator=g)
        torch.testing.assert_close(K.qlinear(x, q), linear_ref_int8_act(x, q), rtol=1e-4, atol=1e-4)


def test_amx_is_a_runtime_option():
    """MOESTREAM_AMX=0 keeps a process off the tiles (the VNNI kernel, the same bits), and
    configure(amx=...) switches it in-process."""
    if not (HAVE_CPP and K.int8_activations()):
        pytest.skip("no native build with int8 activations here")
    from engine.options import configure

    code = ("from engine.quant import kernels as K; K.int8_activations(); e = K.load_extension(); "
            "print(e.amx_on())")
    env = {**os.environ, "MOESTREAM_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
    ext = K.load_extension()
    prev = configure(amx=False)
    try:
        K.int8_activations()
        assert not ext.amx_on()
    finally:
        configure(prev)
    K.int8_activations()
    assert ext.amx_on() == ext.amx_usable()


@needs_i8a
def test_int8_activations_can_be_switched_off():
    from engine.options import configure

    gen = torch.Generator().manual_seed(6)
    q = quantize(torch.randn(32, 256, generator=gen) * 0.05, QuantFormat("int4", 64))
    x = torch.randn(1, 256, generator=gen)
    prev = configure(int8_activations=False)
    try:
        assert not K.int8_activations()
        assert_close_to_ref(K.qlinear(x, q), x, dequantize(q), linear_ref(x, q))  # exact float path
    finally:
        configure(prev)
    assert K.int8_activations()


@pytest.mark.parametrize("bits,dtype", [(8, torch.int8), (16, torch.int16)])
def test_quantize_activations_rule_and_zero_blocks(bits, dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 96, generator=gen)
    x[1, 32:64] = 0.0
    qmax = 2 ** (bits - 1) - 1
    q, d = quantize_activations(x, bits)
    assert q.dtype == dtype and d.shape == (2, 3)
    torch.testing.assert_close(d, x.reshape(2, 3, 32).abs().amax(-1) / qmax)
    assert d[1, 1] == 0 and (q[1, 32:64] == 0).all()
    nz = d > 0
    want = torch.round(x.reshape(2, 3, 32) * (1.0 / torch.where(nz, d, torch.ones_like(d)))[..., None])
    assert torch.equal(q.reshape(2, 3, 32)[nz], want.to(dtype)[nz])
    assert int(q.abs().max()) == qmax


@pytest.mark.skipif(not HAVE_CPP, reason="C++ kernels unavailable")
def test_int8_weights_keep_outlier_blocks_close_to_float():
    """A dense model's outlier channel (one value ~500x the rest of its block, as SmolLM2's
    residual stream has) leaves int8 activation codes of 0 for the rest of the block; int8 weights
    therefore take int16 activations, which stay within float rounding of the float product."""
    if not K.int8_activations():
        pytest.skip("no VNNI here: int8 weights take float activations")
    gen = torch.Generator().manual_seed(31)
    q = quantize(torch.randn(64, 256, generator=gen) * 0.05, QuantFormat("int8", 64))
    x = torch.randn(3, 256, generator=gen)
    x[:, 5] = 500.0  # block 0's outlier
    x[:, 5 + 32 * 3] = -800.0
    w = dequantize(q)
    assert activation_bits(q) == 16
    # the kernel's own product, all channels: close to float (int8 codes would lose the blocks)
    y = K.qlinear(x, q)
    assert float((y - x @ w.T).abs().max()) < 1e-3 * float((x.abs() @ w.abs().T).max())
    i8 = linear_ref(dequantize_activations(x, 8), q)
    assert float((i8 - x @ w.T).abs().max()) > 10 * float((y - x @ w.T).abs().max())


@pytest.mark.skipif(not HAVE_CPP, reason="C++ kernels unavailable")
@pytest.mark.parametrize("name", ["int4", "int8", "bf16"])
def test_rows_split_over_the_pool_match_the_reference_and_one_thread(name):
    """Weights large enough that linear()/expert() split their rows over two pool threads (each
    worker reads the caller's quantized input): the same numbers as one thread, and the reference."""
    from engine.options import configure

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    fmt = QuantFormat(name, 64)
    q = quantize(torch.randn(512, 1024, generator=gen) * 0.05, fmt)
    g, u = (quantize(torch.randn(512, 1024, generator=gen) * 0.05, fmt) for _ in range(2))
    d = quantize(torch.randn(1024, 512, generator=gen) * 0.05, fmt)
    x = torch.randn(5, 1024, generator=gen)
    prev = configure(native_threads=2)
    try:
        K.load_extension().set_threads(2)
        two = [(K.qlinear(x[:t], q), K.expert_forward(x[:t], g, u, d)) for t in (1, 5)]
        K.load_extension().set_threads(1)
        one = [(K.qlinear(x[:t], q), K.expert_forward(x[:t], g, u, d)) for t in (1, 5)]
    finally:
        configure(prev)
        K.load_extension().set_threads(K.native_threads())
    for (y2, e2), (y1, e1), t in zip(two, one, (1, 5)):
        assert torch.equal(y2, y1) and torch.equal(e2, e1)
        assert_close_to_cpp_ref(y2, x[:t], q)


def test_pool_resizes_back_to_back_never_hang():
    """set_threads(n) right after set_threads(m), faster than the OS starts the new workers: each
    resize must still stop and join the workers of the one before (a worker that first read the
    generation after the stop signal waited for another signal forever). In a child process
    with a timeout, so a hang fails the test instead of the run."""
    import subprocess
    import sys

    code = ("from engine.quant import kernels as K\n"
            "ext = K.load_extension()\n"
            "for i in range(300):\n"
            "    ext.set_threads(8)\n"
            "    ext.set_threads(1 + i % 3)\n"
            "ext.set_threads(1)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_pool_runs_every_item_once_over_many_tiny_jobs():
    """The pool's contract, job after job: 100,000 parallel() calls of 8 items (a worker still
    arriving at a job the caller has finished is most likely here) and 2,000 of 4,096, at 2 and
    3 threads (3 on 2 cores: a worker preempted mid-job): every item runs exactly once per job.
    A caller that returned while a worker could still reach its finished job (the handshake in
    pool.cpp's run()) lets that worker work on whatever the stack holds next: a hang here, a
    wrong count or a crash (this test did not catch that race in 120 million jobs on the 2-core
    dev machine: it is a check of the contract, the memory-order argument in pool.cpp is the
    fix's proof). In a child with a timeout, so a hang fails the test instead of the run."""
    import subprocess
    import sys

    code = ("from engine.quant import kernels as K\n"
            "ext = K.load_extension()\n"
            "for t in (2, 3):\n"
            "    ext.set_threads(t)\n"
            "    print(ext.parallel_selfcheck(100000, 8), ext.parallel_selfcheck(2000, 4096))\n"
            "ext.set_threads(1)\n"
            "print(ext.parallel_selfcheck(10, 100))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0"] * 5, r.stdout


def test_a_native_build_killed_half_way_blocks_no_later_build(tmp_path, caplog):
    """A process that dies inside build_lock (a first build OOM-killed in a memory-limited cgroup,
    or a Ctrl-C) leaves torch's lock file behind, on which every later torch build would wait
    forever; the kernel drops the dead holder's flock and the next build_lock removes the file."""
    import fcntl
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, time\nfrom pathlib import Path\nfrom engine.quant.kernels import build_lock\n"
            "d = Path(sys.argv[1])\nwith build_lock(d):\n"
            "    (d / 'lock').touch()  # as torch's FileBaton does while it builds\n"
            "    print('building', flush=True)\n    time.sleep(120)\n")
    root = Path(__file__).resolve().parents[3]
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "building"
        with open(tmp_path / ".moestream-build.flock") as f:  # held: a second builder would wait
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        p.kill()
        p.wait()
    assert (tmp_path / "lock").exists()
    with caplog.at_level("WARNING", logger="engine.quant.kernels"), K.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "did not finish" in caplog.text


def test_two_checkouts_build_in_two_directories(monkeypatch, tmp_path):
    """The build directory's name covers the sources' path: two checkouts of the same sources
    (a CI clone beside a working tree) do not rebuild in each other's directory, in turn."""
    import shutil

    names = []
    for checkout in ("a", "b", "a"):
        if not (tmp_path / checkout).exists():
            shutil.copytree(K.CSRC, tmp_path / checkout)
        monkeypatch.setattr(K, "CSRC", tmp_path / checkout)
        names.append(K._cache_dir("avx512", ["-O3"]).name)
    assert names[0] != names[1] and names[0] == names[2]


def test_a_built_extension_loads_without_asking_ninja():
    """The build directory is named by a hash of the sources' bytes, so a library built there is
    loaded as it is: torch's load (ninja) rebuilds whenever a source's mtime is newer than its
    object, and such a rebuild inside a memory-limited child (bench/beyond_ram.py's cgroups) was
    OOM-killed. A child whose torch load would fail still gets the kernels."""
    import subprocess
    import sys
    from pathlib import Path

    if K.load_extension() is None:
        pytest.skip(f"no native kernels here: {K.extension_error()}")
    code = ("import torch.utils.cpp_extension as C\n"
            "def refuse(*a, **k):\n    raise RuntimeError('a build was started')\n"
            "C.load = refuse\n"
            "from engine.quant import kernels as K\n"
            "ext = K.load_extension()\n"
            "print('loaded' if ext is not None and hasattr(ext, 'run_layers') else K.extension_error())\n")
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "loaded", (r.stdout, r.stderr[-2000:])


def test_a_library_that_does_not_load_is_built_again(tmp_path):
    """A link killed half-way leaves a truncated library: it is not loaded (None: build it)."""
    d = tmp_path / "moestream_avx512_000000000000"
    d.mkdir()
    assert K._load_built(d) is None  # nothing built yet
    (d / f"{d.name}.so").write_bytes(b"\x7fELF truncated")
    assert K._load_built(d) is None
