"""The Triton Gated DeltaNet decode step against the torch reference (causal_conv + l2norm +
recurrent_delta_rule), in Triton's interpreter on CPU tensors (compiled on CUDA: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from engine.layers import deltanet_triton as DT
from engine.layers.deltanet import reference_step as reference

pytestmark = pytest.mark.skipif(not DT.supports(torch.device("cpu")),
                                reason="Triton's interpreter is not available in this process")


def random_case(nk, nv, dk, dv, kw, rows, slots, seed):
    gen = torch.Generator().manual_seed(seed)
    c = 2 * nk * dk + nv * dv
    window = torch.randn(slots, c, kw - 1, generator=gen)
    state = torch.randn(slots, nv, dk, dv, generator=gen) * 0.3
    weight = torch.randn(c, kw, generator=gen) * 0.5
    x = torch.randn(rows, c, generator=gen)
    g = -torch.rand(rows, nv, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(rows, nv, generator=gen)
    return window, state, weight, x, g, beta


@pytest.mark.parametrize("nk,nv,dk,dv,kw", [
    (1, 1, 16, 16, 4),   # one head
    (2, 4, 32, 16, 4),   # two value heads per key head
    (2, 6, 24, 40, 4),   # dims not powers of two, Dv over two column blocks
    (4, 4, 16, 32, 3),   # another conv width
])
def test_a_step_equals_the_torch_reference(nk, nv, dk, dv, kw):
    window, state, weight, x, g, beta = random_case(nk, nv, dk, dv, kw, rows=1, slots=1, seed=nk * 100 + dv)
    w_ref, s_ref = window[0].clone(), state[0].clone()
    want = reference(w_ref, weight, x[0], s_ref, g[0], beta[0], nk, dk, dv)
    got = DT.decode_step(window[0], weight, x[0], state[0], g[0].contiguous(), beta[0].contiguous(), nk, dk, dv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(window[0], w_ref, rtol=0, atol=0)  # the shift is exact
    torch.testing.assert_close(state[0], s_ref, rtol=1e-5, atol=1e-5)


def test_rows_advance_their_own_slots_over_several_steps():
    """Three sequences in slots 3, 0, 2 of a pool of 4 (slot 1 untouched), eight decode steps in
    a row: every step's outputs and the final states equal three reference runs."""
    nk, nv, dk, dv, kw = 2, 4, 16, 24, 4
    window, state, weight, x, g, beta = random_case(nk, nv, dk, dv, kw, rows=3, slots=4, seed=5)
    slots = torch.tensor([3, 0, 2])
    ref_w = {int(s): window[s].clone() for s in slots}
    ref_s = {int(s): state[s].clone() for s in slots}
    untouched = (window[1].clone(), state[1].clone())
    gen = torch.Generator().manual_seed(6)
    for step in range(8):
        xs = torch.randn(3, x.shape[1], generator=gen)
        gs = -torch.rand(3, nv, generator=gen) * 2
        bs = torch.rand(3, nv, generator=gen)
        got = DT.decode_rows(window, weight, xs, state, gs, bs, slots, nk, dk, dv)
        for i, s in enumerate(slots.tolist()):
            want = reference(ref_w[s], weight, xs[i], ref_s[s], gs[i], bs[i], nk, dk, dv)
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4, msg=f"step {step} row {i}")
    for s in slots.tolist():
        torch.testing.assert_close(window[s], ref_w[s], rtol=0, atol=0)
        torch.testing.assert_close(state[s], ref_s[s], rtol=1e-4, atol=1e-4)
    assert torch.equal(window[1], untouched[0]) and torch.equal(state[1], untouched[1])


def test_bad_inputs_are_refused():
    nk, nv, dk, dv = 1, 2, 16, 16
    window, state, weight, x, g, beta = random_case(nk, nv, dk, dv, 4, rows=1, slots=1, seed=1)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        DT.decode_step(window[0], weight, x[0], state[0], g[0], beta[0], nk, dk + 1, dv)
    with pytest.raises(ValueError, match="float32"):
        DT.decode_step(window[0], weight, x[0].double(), state[0], g[0], beta[0], nk, dk, dv)


def test_gated_deltanet_dispatches_to_the_kernel_where_triton_runs(monkeypatch):
    """GatedDeltaNet._token takes the Triton step when the tensors' device is one the kernels
    compile for (CUDA); elsewhere the native / torch paths, which give the same numbers."""
    from engine.layers import deltanet as D

    calls = []
    real = DT.decode_step
    monkeypatch.setattr(DT, "decode_step", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(D, "_use_triton", lambda device: True)
    nk, nv, dk, dv = 2, 4, 16, 16
    window, state, weight, x, g, beta = random_case(nk, nv, dk, dv, 4, rows=1, slots=1, seed=2)
    layer = D.GatedDeltaNet.__new__(D.GatedDeltaNet)
    torch.nn.Module.__init__(layer)
    layer.nk, layer.nv, layer.dk, layer.dv = nk, nv, dk, dv
    layer.key_dim, layer.value_dim = nk * dk, nv * dv
    w_ref, s_ref = window[0].clone(), state[0].clone()
    got = layer._token(x[0], window[0], weight, state[0], g[0], beta[0])
    want = reference(w_ref, weight, x[0], s_ref, g[0], beta[0], nk, dk, dv)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
