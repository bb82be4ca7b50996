"""Gated DeltaNet decode step in Triton: the CUDA path of engine.layers.deltanet's decode form.

One new token per row (a row is one sequence), two launches whatever the head counts:

    conv   grid (C / BLOCK_C, N)      y[n, c] = silu(sum_j w[c, j] * (window_n[c, :], x[n, c])[j]);
                                      window_n[c, :] shifted left by one, x[n, c] written last
    rule   grid (Dv / BLOCK_V, Nv, N) per value head h and a block of state columns:
                                      q, k = l2norm(y's q / k head of h // r) (q * Dk^-1/2);
                                      S <- exp(g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q

The state columns of a value head are independent (S^T k, the rank-one update and S^T q all read
column j of S alone), so each ``rule`` program owns a [Dk, BLOCK_V] tile of S: loads it once,
updates it in registers, stores it back in place. The conv is a separate launch because the q/k
channels of a key head are shared by its r value heads: the window shift must happen once, after
every reader. Row n reads and writes the state at ``slots[n]`` of ``window`` [S, C, K-1] and
``state`` [S, Nv, Dk, Dv] (float32, contiguous), so a batch of sequences is one pair of launches;
:func:`decode_step` is the one-sequence contract of engine/csrc/deltanet.cpp (the CPU kernel).

The torch reference is ``causal_conv`` + ``l2norm`` + ``recurrent_delta_rule``
(engine/layers/deltanet.py); tests/engine/layers/test_deltanet_triton.py compares them in
Triton's interpreter on CPU tensors, tests/gpu compiled.
"""

import torch

from engine.quant import triton_kernels as TK

triton, tl, constexpr = TK.triton, TK.tl, TK.constexpr

BLOCK_C = 128
BLOCK_V = 32


def _conv_kernel(x_ptr, w_ptr, win_ptr, slots_ptr, y_ptr, C,
                 KW: constexpr, KP: constexpr, BLOCK_C: constexpr):
    pid_c = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < C
    ch64 = ch.to(tl.int64)
    taps = tl.arange(0, KP)
    xv = tl.load(x_ptr + n * C + ch64, mask=cmask, other=0.0)
    wmask = cmask[:, None] & (taps < KW)[None, :]
    w = tl.load(w_ptr + ch64[:, None] * KW + taps[None, :], mask=wmask, other=0.0)
    win = win_ptr + slot * C * (KW - 1) + ch64[:, None] * (KW - 1) + taps[None, :]
    hmask = cmask[:, None] & (taps < KW - 1)[None, :]
    hist = tl.load(win, mask=hmask, other=0.0)
    # the taps in order: the K-1 remembered inputs, then x (tap K-1)
    full = tl.where((taps == KW - 1)[None, :], xv[:, None], hist)
    acc = tl.sum(w * full, axis=1)
    tl.store(y_ptr + n * C + ch64, acc / (1.0 + tl.exp(-acc)), mask=cmask)
    # shift in registers: window[j] = full[j + 1] (a 0/1 selection over the taps: exact)
    sel = (taps[None, :] == taps[:, None] + 1).to(tl.float32)  # [j, t]
    shifted = tl.sum(full[:, None, :] * sel[None, :, :], axis=2)
    tl.store(win, shifted, mask=hmask)


def _rule_kernel(y_ptr, state_ptr, slots_ptr, g_ptr, beta_ptr, o_ptr, C, NK, NV, DK, DV,
                 R: constexpr, BK: constexpr, BLOCK_V: constexpr):
    pid_v = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    n = tl.program_id(2).to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    kh = h // R
    ki = tl.arange(0, BK)
    kmask = ki < DK
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = cols < DV
    row = y_ptr + n * C
    q = tl.load(row + kh * DK + ki, mask=kmask, other=0.0)
    k = tl.load(row + NK * DK + kh * DK + ki, mask=kmask, other=0.0)
    v = tl.load(row + 2 * NK * DK + h * DV + cols, mask=vmask, other=0.0)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) / tl.sqrt(DK * 1.0)
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    decay = tl.exp(tl.load(g_ptr + n * NV + h))
    beta = tl.load(beta_ptr + n * NV + h)
    tile = state_ptr + ((slot * NV + h) * DK + ki[:, None]) * DV + cols[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(tile, mask=smask, other=0.0) * decay
    mem = tl.sum(s * k[:, None], axis=0)  # S^T k, [BLOCK_V]
    delta = (v - mem) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(tile, s, mask=smask)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + (n * NV + h) * DV + cols, o, mask=vmask)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernels():
    k = _kernels.__dict__.get("k")
    if k is None:
        k = _kernels.__dict__["k"] = (triton.jit(_conv_kernel), triton.jit(_rule_kernel))
    return k


def supports(device: torch.device) -> bool:
    """The kernels can run on tensors of ``device`` here (compiled on CUDA, interpreted on CPU)."""
    return TK.supports(device)


def _check(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device != device:
        raise ValueError(f"deltanet_triton: {name} must be float32, contiguous, on {device}; "
                         f"got {t.dtype}, contiguous={t.is_contiguous()}, {t.device}")


def decode_rows(window: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, state: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
                nk: int, dk: int, dv: int) -> torch.Tensor:
    """One token for each of N rows: x [N, C] (q | k | v before the conv), g, beta [N, Nv],
    slots [N] (int) naming each row's state in window [S, C, K-1] and state [S, Nv, Dk, Dv]
    (both advanced in place; rows must name distinct slots), weight [C, K]. -> o [N, Nv, Dv]."""
    dev = x.device
    if not supports(dev):
        raise RuntimeError(f"the Triton kernels cannot run on {dev} tensors here: {TK.why_not(dev)}")
    for name, t in (("window", window), ("weight", weight), ("x", x), ("state", state),
                    ("g", g), ("beta", beta)):
        _check(name, t, dev)
    n, c = x.shape
    kw = weight.shape[1]
    nv = state.shape[1]
    if (c != 2 * nk * dk + nv * dv or weight.shape[0] != c or window.shape[1:] != (c, kw - 1)
            or state.shape[2:] != (dk, dv) or nv % nk or kw < 2 or g.shape != (n, nv)
            or beta.shape != (n, nv) or slots.shape != (n,)):
        raise ValueError(f"deltanet_triton: inconsistent shapes x {list(x.shape)}, weight "
                         f"{list(weight.shape)}, window {list(window.shape)}, state {list(state.shape)}, "
                         f"g {list(g.shape)}, beta {list(beta.shape)}, slots {list(slots.shape)} "
                         f"for nk={nk} dk={dk} dv={dv}")
    out = torch.empty(n, nv, dv, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    slots = slots.to(device=dev, dtype=torch.int64).contiguous()
    y = torch.empty_like(x)
    conv, rule = _kernels()
    conv[(-(-c // BLOCK_C), n)](x, weight, window, slots, y, c,
                                KW=kw, KP=_pow2_at_least(kw), BLOCK_C=BLOCK_C)
    rule[(-(-dv // BLOCK_V), nv, n)](y, state, slots, g, beta, out, c, nk, nv, dk, dv,
                                     R=nv // nk, BK=_pow2_at_least(dk), BLOCK_V=BLOCK_V)
    return out


def decode_step(window: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, state: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor, nk: int, dk: int, dv: int) -> torch.Tensor:
    """The contract of engine/csrc/deltanet.cpp: one token x [C] of one sequence, window
    [C, K-1] and state [Nv, Dk, Dv] advanced in place, g and beta [Nv]. -> o [Nv, Dv]."""
    zero = torch.zeros(1, dtype=torch.int64, device=x.device)
    return decode_rows(window[None], weight, x[None], state[None], g[None], beta[None], zero,
                       nk, dk, dv)[0]
