"""The AVX2 build of the native kernels (engine/csrc/quant_avx2.cpp), forced with the ``cpu_isa``
runtime option on whatever x86 CPU runs the tests: qlinear and the SwiGLU expert against the torch
reference for every format, group size and token count through both loop nests, the integer
activations (int4 x int8 through vpmaddubsw, int8 x int16 through vpmaddwd) against their reference
and, where the CPU has AVX512-VNNI, bit for bit against the VNNI kernels, and the fused native step
on a tiny MoE model giving the torch layers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine.executor import executor_for
from engine.experts.runtime import load_from_store
from engine.experts.tiers import align_up
from engine.generate import generate_ids
from engine.layers.sampler import SamplingConfig
from engine.options import configure, options
from engine.quant import FORMATS, GROUP_SIZES, QuantFormat, QuantizedTensor, quantize
from engine.quant import kernels as K
from engine.quant.reference import (activation_bits, dequantize, dequantize_activations, expert_ref, linear_ref,
                                    linear_ref_int8_act, takes_int8_activations)
from engine.store import ExpertStore, convert
from tests.engine.models.hf_tiny import make_checkpoint

TOKENS = (1, 2, 3, 4, 7, 16, 33)
SHAPES = ((37, 384), (5, 128))  # N: 4-row tiles and a tail; K: 1-12 groups


@pytest.fixture(scope="module")
def ext():
    """The AVX2 extension, with cpu_isa=avx2 and the C++ backend forced (a weight the AVX2
    kernels do not take is an error, not a silent torch fallback) for this module."""
    if not K.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    prev = configure(cpu_isa="avx2", quant_kernel="cpp")
    try:
        mod = K.load_extension()
        err = K.extension_error() or ""
        if mod is None and "already registered" in err:
            # built, but its pybind classes clash with the AVX-512 module loaded earlier in this
            # process: module.cpp must declare them py::module_local() (not a missing toolchain)
            pytest.fail(f"AVX2 module built but not importable beside the AVX-512 one: {err}")
        if mod is None or K.native_isa() != "avx2":
            pytest.skip(f"AVX2 kernels unavailable: {err}")
        assert "avx2" in mod.__name__  # the AVX2 build, not the AVX-512 one
        yield mod
    finally:
        configure(prev)


def weight(n: int, k: int, fmt: QuantFormat, gen: torch.Generator) -> QuantizedTensor:
    """A random weight whose groups differ in scale by up to ~50x (a wrong group index shows)."""
    g = fmt.group_size if fmt.grouped else 32
    spread = torch.exp(torch.randn(n, k // g, 1, generator=gen))
    w = (torch.randn(n, k // g, g, generator=gen) * spread + 0.3 * torch.randn(n, k // g, 1, generator=gen) * spread)
    return quantize(w.reshape(n, k), fmt)


def assert_close(y: torch.Tensor, x: torch.Tensor, q: QuantizedTensor, ref: torch.Tensor) -> None:
    """kernels.py's bound: |y - ref| <= 1e-4 * (|x| @ |w|.T) + 1e-5 elementwise."""
    assert y.dtype == torch.float32 and y.shape == ref.shape
    bound = 1e-4 * (x.float().abs() @ dequantize(q).abs().T) + 1e-5
    err = (y - ref).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g}, max excess {float((err - bound).max()):.3g}"


@pytest.mark.parametrize("g", GROUP_SIZES)
@pytest.mark.parametrize("name", FORMATS)
def test_qlinear_matches_reference_for_every_t_and_loop_nest(ext, name, g):
    gen = torch.Generator().manual_seed(101)
    fmt = QuantFormat(name, g)
    for n, k in SHAPES:
        q = weight(n, k, fmt, gen)
        assert K.backend_for(q) == "cpp"
        args = K._kargs(q)
        for t in TOKENS:
            x = torch.randn(t, k, generator=gen) * 2
            ref = linear_ref(x, q)
            if takes_int8_activations(q):  # the public entry takes integer activations where it can
                assert_close_i8a(K.qlinear(x, q), x, q)
            else:
                assert_close(K.qlinear(x, q), x, q, ref)
            # every T through each loop nest: scratch (0), direct with token triples and tails (64)
            for dmt in (0, 64):
                assert_close(ext.qlinear(x, *args, dmt, 0), x, q, ref)


def test_bf16_input_and_leading_dims(ext):
    gen = torch.Generator().manual_seed(7)
    q = weight(24, 256, QuantFormat("nf4", 64), gen)
    x = torch.randn(2, 3, 256, generator=gen).to(torch.bfloat16)
    y = K.qlinear(x, q)
    assert y.shape == (2, 3, 24)
    assert_close(y.reshape(6, 24), x.reshape(6, 256), q, linear_ref(x.reshape(6, 256), q))


def assert_close_i8a(y: torch.Tensor, x: torch.Tensor, q: QuantizedTensor) -> None:
    """Against linear_ref_int8_act (the quantized activations' product), test_kernels.py's bound."""
    xq = dequantize_activations(x.float(), activation_bits(q))
    bound = 1e-4 * ((x.float().abs() + xq.abs()) @ dequantize(q).abs().T) + 1e-5
    err = (y - linear_ref_int8_act(x, q)).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g}"


@pytest.fixture(scope="module")
def vnni():
    """The AVX-512 build where this CPU has AVX512-VNNI (its integer kernels), else None."""
    if not K.cpu_has_avx512():
        return None
    prev = configure(cpu_isa="avx512")
    try:
        mod = K.load_extension()
        return mod if mod is not None and mod.has_vnni() else None
    finally:
        configure(prev)


I8A_CASES = [("int4", 32, 20, 96), ("int4", 64, 70, 576), ("int4", 128, 33, 384), ("int4", 64, 9, 1024),
             ("int4", 32, 16, 160), ("int8", 32, 24, 256), ("int8", 64, 40, 1024), ("int8", 128, 12, 384)]


@pytest.mark.parametrize("name,g,n,k", I8A_CASES)
def test_integer_activations_match_their_reference_and_the_vnni_bits(ext, vnni, name, g, n, k):
    """int4 weights x int8 activations and int8 weights x int16 ones on AVX2: the reference's
    numbers for every token count (register tiles of 3 and their tails; K with 1-3 trailing
    blocks past a 512-weight group, 4-bit rows of 3 and 5 blocks), the same bits as the VNNI
    kernels where the CPU has them (i8a.h: one sum for every instruction set), and on by default."""
    prev = configure(int8_activations=True)
    try:
        assert options().cpu_isa == "avx2"
        assert K.int8_activations() is True and ext.has_int8_dots() is True and ext.has_vnni() is False
    finally:
        configure(prev)
    gen = torch.Generator().manual_seed(n * 1000 + k)
    q = weight(n, k, QuantFormat(name, g), gen)
    assert takes_int8_activations(q)
    for t in (1, 2, 3, 4, 7):
        x = torch.randn(t, k, generator=gen) * 2
        y = ext.qlinear(x, *K._kargs(q), K.DIRECT_MAX_T, 1)
        assert_close_i8a(y, x, q)
        assert not torch.equal(y, ext.qlinear(x, *K._kargs(q), K.DIRECT_MAX_T, 0))  # the integer path ran
        if vnni is not None:
            assert torch.equal(y, vnni.qlinear(x, *K._kargs(q), K.DIRECT_MAX_T, 1))


@pytest.mark.parametrize("g,k", [(64, 1024), (32, 576), (64, 768), (128, 384)])
def test_integer_activations_split_rows_give_the_decode_kernels_bits(ext, g, k):
    """More tokens than a register tile take the split-rows kernel (the rows' nibbles as bytes,
    one 32-bit lane per block: no fold); a token alone takes the decode kernel (codes split in
    registers, vphaddd fold). The same integer sums and float steps: bit for bit the same rows,
    also when K ends inside a 512-weight group (576, 768, 384)."""
    gen = torch.Generator().manual_seed(k + g)
    q = weight(40, k, QuantFormat("int4", g), gen)
    x = torch.randn(9, k, generator=gen) * 3
    alone = torch.cat([ext.qlinear(x[t:t + 1], *K._kargs(q), K.DIRECT_MAX_T, 1) for t in range(9)])
    for t in (4, 5, 9):
        assert torch.equal(ext.qlinear(x[:t], *K._kargs(q), K.DIRECT_MAX_T, 1), alone[:t])
    assert_close_i8a(alone, x, q)


def test_integer_activation_experts_match_the_vnni_bits(ext, vnni):
    """A SwiGLU expert whose down projection takes the quantized hidden activation: its
    reference's numbers, and the VNNI kernels' bits where the CPU has them."""
    gen = torch.Generator().manual_seed(13)
    i, h = 128, 256
    fmt = QuantFormat("int4", 64)
    gate, up, down = (weight(*s, fmt, gen) for s in ((i, h), (i, h), (h, i)))
    parts = (*K._kargs(gate)[4:], *K._kargs(up)[4:], *K._kargs(down)[4:])
    for t in (1, 3, 5):
        x = torch.randn(t, h, generator=gen)
        y = ext.expert_forward(x, K.FORMAT_IDS["int4"], 64, i, h, *parts, K.DIRECT_MAX_T, 1)
        hid = torch.nn.functional.silu(linear_ref_int8_act(x, gate)) * linear_ref_int8_act(x, up)
        ref = linear_ref_int8_act(hid, down)
        assert float((y - ref).abs().max()) <= 1e-3 * (1 + float(ref.abs().max()))
        if vnni is not None:
            assert torch.equal(y, vnni.expert_forward(x, K.FORMAT_IDS["int4"], 64, i, h, *parts, K.DIRECT_MAX_T, 1))


def test_prefetch_distance_does_not_change_results(ext):
    gen = torch.Generator().manual_seed(9)
    q = weight(40, 512, QuantFormat("int4", 64), gen)
    x = torch.randn(5, 512, generator=gen)
    outs = []
    try:
        for rows in (0, 1, 16, 1000):
            ext.set_prefetch_rows(rows)
            outs.append([ext.qlinear(x[:t], *K._kargs(q), K.DIRECT_MAX_T, 0) for t in (1, 5)])
    finally:
        ext.set_prefetch_rows(16)
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0]))


def row_slice(q: QuantizedTensor, a: int, b: int) -> QuantizedTensor:
    """Rows [a, b) of q as a weight of its own (every part is row-major)."""
    return QuantizedTensor(q.fmt, (b - a, q.shape[1]), {k: v[a:b].contiguous() for k, v in q.parts.items()})


@pytest.mark.parametrize("name", FORMATS)
def test_results_depend_neither_on_t_nor_on_the_row_split(ext, name):
    """A token's output row is bit for bit the same alone or in a batch, through either loop nest,
    and whether its weight rows are computed in one call (200 x 512: split over the pool's
    threads where there are several) or as slices too small to split, in other tiles."""
    gen = torch.Generator().manual_seed(21)
    q = weight(200, 512, QuantFormat(name, 64), gen)
    x = torch.randn(9, 512, generator=gen)
    alone = torch.cat([ext.qlinear(x[t:t + 1], *K._kargs(q), K.DIRECT_MAX_T, 0) for t in range(9)])
    for dmt in (0, 3, 64):
        assert torch.equal(ext.qlinear(x, *K._kargs(q), dmt, 0), alone)
        parts = [ext.qlinear(x, *K._kargs(row_slice(q, a, b)), dmt, 0) for a, b in ((0, 3), (3, 61), (61, 200))]
        assert torch.equal(torch.cat(parts, dim=1), alone)
    assert_close(alone, x, q, linear_ref(x, q))


@pytest.mark.parametrize("g", GROUP_SIZES)
@pytest.mark.parametrize("name", FORMATS)
def test_expert_forward_matches_reference(ext, name, g):
    gen = torch.Generator().manual_seed(12)
    i, h = 128, 256
    fmt = QuantFormat(name, g)
    gate, up, down = (quantize(torch.randn(*s, generator=gen) * 0.1, fmt) for s in ((i, h), (i, h), (h, i)))
    for t in (1, 2, 3, 5, 33):
        x = torch.randn(t, h, generator=gen)
        hid = torch.nn.functional.silu(linear_ref(x, gate)) * linear_ref(x, up)
        # each linear's bound, propagated through the hidden activation (as in test_kernels.py)
        bound = 4e-4 * (hid.abs() @ dequantize(down).abs().T) + 1e-5
        ref = expert_ref(x, gate, up, down)
        y = ext.expert_forward(x, K.FORMAT_IDS[name], g, i, h, *K._kargs(gate)[4:], *K._kargs(up)[4:],
                               *K._kargs(down)[4:], K.DIRECT_MAX_T, 0)  # float activations
        assert y.shape == (t, h) and bool(((y - ref).abs() <= bound).all()), float((y - ref).abs().max())
        # the other loop nest for the same tokens
        y2 = ext.expert_forward(x, K.FORMAT_IDS[name], g, i, h, *K._kargs(gate)[4:], *K._kargs(up)[4:],
                                *K._kargs(down)[4:], 0 if t <= K.DIRECT_MAX_T else 64, 0)
        assert bool(((y2 - ref).abs() <= bound).all()), float((y2 - ref).abs().max())


# ------------------------------------------------------------------ the fused step under AVX2

PROMPT = [5, 17, 33, 8, 61, 12, 40, 3, 27]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("avx2_qwen3_moe")
    make_checkpoint("qwen3_moe", d / "hf", hidden_size=64, num_hidden_layers=3, head_dim=16,
                    num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32, num_experts=8,
                    num_experts_per_tok=2, norm_topk_prob=True)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


def greedy(model, n=16):
    out = [(t, logits.float().clone()) for t, logits, _ in
           generate_ids(model, PROMPT, SamplingConfig(max_tokens=n, ignore_eos=True))]
    return [t for t, _ in out], torch.stack([lg.reshape(-1) for _, lg in out])


def test_fused_step_greedy_tokens_match_the_torch_layers(ext, store):
    """The torch layers on the torch reference kernels vs the native step on the AVX2 kernels with
    float activations: the same greedy tokens, everything resident and with misses computed on
    the CPU (the integer activations' own checks are above: the kernels' bits)."""
    with ExpertStore(store) as s:
        slot, top_k = align_up(s.expert_nbytes), s.config.moe.top_k
    prev = configure(fused_step=False, quant_kernel="torch")
    try:
        sm = load_from_store(store, prefetch_depth=0, dense="int8")
        try:
            assert executor_for(sm.model).native() is None
            want, want_logits = greedy(sm.model)
        finally:
            sm.close()
        configure(fused_step=True, quant_kernel="cpp", int8_activations=False)
        for kw in (dict(prefetch_depth=0), dict(device_budget=top_k * slot, prefetch_depth=0, miss_compute="cpu")):
            sm = load_from_store(store, dense="int8", **kw)
            try:
                step = executor_for(sm.model).native()
                assert step is not None and step.ext is ext
                calls = {"ffn_block": 0, "run_layers": 0}

                class Spy:  # counts the native MoE calls, so a silent torch fallback fails the test
                    def __getattr__(self, name):
                        f = getattr(ext, name)
                        if name not in calls:
                            return f

                        def counted(*a, **k):
                            calls[name] += 1
                            return f(*a, **k)
                        return counted
                step.ext = Spy()
                got, got_logits = greedy(sm.model)
                assert got == want, kw
                assert calls["ffn_block"] + calls["run_layers"] > 0
                scale = float(want_logits.abs().max())
                assert float((got_logits - want_logits).abs().max()) <= 2e-3 * (1 + scale)
            finally:
                sm.close()
    finally:
        configure(prev)
