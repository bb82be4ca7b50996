"""Fused dequantize-and-multiply kernels in Triton: the GPU path for quantized weights.

A decode step multiplies one or a few token rows by each routed expert. Dequantizing the expert
to fp16/fp32 first would write the whole weight to global memory and read it back, per expert,
per token: 4-8x the bytes of the 4-bit codes. These kernels read the packed codes and the
per-group scales, decode them in registers and accumulate in float32, so the only weight bytes
that cross global memory are the stored ones.

Shapes (as in ``kernels.py``): ``x`` ``[T, K]``, weight ``[N, K]`` (out, in), out ``[T, N]``
float32. Grid ``(N / BLOCK_N, SPLIT, T / BLOCK_T)``: each program owns ``BLOCK_N`` output columns
of ``BLOCK_T`` tokens over one of ``SPLIT`` slices of K, and writes its partial sums to
``[SPLIT, T, N]``; the host sums the slices (deterministic, unlike atomics). Split-K matters
because an expert is narrow: a 512 x 2048 gate gives 16 column blocks, far fewer programs than a
GPU has SMs.

Every format's decode matches ``reference.dequantize`` exactly (same integer codes, same fp16
scale and min, one multiply-add in float32); only the summation order differs, so the results
agree with ``reference.linear_ref`` within the float32 reordering bound the C++ kernels use.

The kernel is used for ``T <= MAX_T`` (decode and small batches). Larger T is compute-bound and
goes to dequantize + matmul, where the materialised weight is amortised over many tokens.

Without a GPU the same kernel runs in Triton's interpreter on CPU tensors (numpy, slow): that is
how the tests check it against the reference on machines without CUDA (see ``supports``).
"""

import functools
import os
from typing import Any

import torch

from engine.quant.formats import NF4_CODEBOOK, QuantizedTensor

if not torch.cuda.is_available():
    # Without CUDA, Triton can only interpret. Its interpreter is chosen when triton.language is
    # first imported (the standard library's own @jit functions are built then), so the switch
    # must be set before that import; a process that imported triton earlier without it cannot
    # run these kernels on CPU tensors (``interpreting()`` says so).
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # triton ships with CUDA builds of torch; on CPU it is an optional (dev) dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

# Kernel parameters annotated with this are compile-time constants (a real annotation object:
# Triton's interpreter does not read string annotations, so this module has no
# ``from __future__ import annotations``).
constexpr = tl.constexpr if tl is not None else int

FORMAT_IDS = {"int4": 0, "nf4": 1, "int8": 2, "bf16": 3, "mxfp4": 4}
MAX_T = 8            # token rows handled by the fused kernel; more -> dequantize + matmul
BLOCK_N = 32
TARGET_PROGRAMS = 256  # aim for about this many programs per launch (>= 2 per SM on big GPUs)


def available() -> bool:
    return triton is not None


def _qmm_kernel(x_ptr, w_ptr, s_ptr, m_ptr, cb_ptr, out_ptr, T, N, K, K_PER_SPLIT,
                FMT: constexpr, G: constexpr, BLOCK_T: constexpr,
                BLOCK_N: constexpr, BLOCK_K: constexpr):
    """out[split, t, n] = sum over k in split of x[t, k] * w[n, k], w decoded from its format."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_t = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < N
    tmask = toks < T
    rows64 = rows.to(tl.int64)
    toks64 = toks.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    k_begin = pid_s * K_PER_SPLIT
    for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        wmask = rmask[:, None] & kmask[None, :]
        if FMT == 3:  # bf16, passed as int16 bits: widen to the float32 with the same value
            bits = tl.load(w_ptr + rows64[:, None] * K + ks[None, :], mask=wmask, other=0)
            w = ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        elif FMT == 4:  # mxfp4: E2M1[code] * 2^(e - 127); byte k // 2, low nibble for even k
            e = tl.load(s_ptr + rows64[:, None] * (K // 32) + (ks // 32)[None, :], mask=wmask,
                        other=127).to(tl.int32)
            b = tl.load(w_ptr + rows64[:, None] * (K // 2) + (ks // 2)[None, :], mask=wmask, other=0)
            c = (b.to(tl.int32) >> ((ks % 2) * 4)[None, :]) & 0xF
            # 2^(e-127) from the exponent bits; e = 0 is the subnormal 2^-127 (bits 0x400000)
            scale = tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True)
            w = tl.load(cb_ptr + c) * scale
        else:
            s = tl.load(s_ptr + rows64[:, None] * (K // G) + (ks // G)[None, :], mask=wmask,
                        other=0.0).to(tl.float32)
            if FMT == 2:  # int8: code * scale
                c = tl.load(w_ptr + rows64[:, None] * K + ks[None, :], mask=wmask, other=0)
                w = c.to(tl.float32) * s
            else:  # 4-bit: per block of 32 weights, byte j holds weight j (low) and j + 16 (high)
                byte = (ks // 32) * 16 + (ks % 16)
                shift = ((ks // 16) % 2) * 4
                b = tl.load(w_ptr + rows64[:, None] * (K // 2) + byte[None, :], mask=wmask, other=0)
                c = (b.to(tl.int32) >> shift[None, :]) & 0xF
                if FMT == 0:  # int4: code * scale + min
                    m = tl.load(m_ptr + rows64[:, None] * (K // G) + (ks // G)[None, :], mask=wmask,
                                other=0.0).to(tl.float32)
                    w = c.to(tl.float32) * s + m
                else:  # nf4: codebook[code] * absmax
                    w = tl.load(cb_ptr + c) * s
        xv = tl.load(x_ptr + toks64[:, None] * K + ks[None, :], mask=tmask[:, None] & kmask[None, :],
                     other=0.0)
        acc += tl.sum(xv[:, None, :] * w[None, :, :], axis=2)
    out = out_ptr + pid_s * T * N + toks64[:, None] * N + rows64[None, :]
    tl.store(out, acc, mask=tmask[:, None] & rmask[None, :])


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    return triton.jit(_qmm_kernel)


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (numpy on CPU tensors) in this process.

    Both the kernel and Triton's own library functions (``tl.zeros``, ``tl.sum``: built when
    triton.language was imported) must be interpreted; if triton was imported before
    ``TRITON_INTERPRET=1`` was set, neither mode works on CPU tensors and this is False."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_kernel(), InterpretedFunction) and isinstance(tl.zeros, InterpretedFunction)


def why_not(device: torch.device) -> str:
    """Why ``supports(device)`` is False, for error messages."""
    if triton is None:
        return "triton is not installed (pip install triton)"
    if device.type == "cpu":
        return ("CPU tensors need Triton's interpreter, which must be on before triton is first "
                "imported: set TRITON_INTERPRET=1 in the environment")
    if device.type != "cuda":
        return f"no Triton backend for {device.type}"
    return "Triton's interpreter is on (TRITON_INTERPRET=1): unset it to compile for CUDA"


def supports(device: torch.device) -> bool:
    """The fused kernels can run on tensors of ``device`` here: compiled on CUDA, or interpreted
    on CPU where CUDA is absent."""
    if triton is None:
        return False
    return interpreting() if device.type == "cpu" else device.type == "cuda" and not interpreting()


@functools.lru_cache(maxsize=None)
def _codebook(device: torch.device, fmt: str = "nf4") -> torch.Tensor:
    """The kernel's value table: NF4's code book, or E2M1's values for mxfp4."""
    if fmt == "mxfp4":
        from engine.quant.reference import E2M1_VALUES
        return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_shape(t: int, n: int, k: int, split: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_K, SPLIT, K_PER_SPLIT) for a [t, k] x [n, k]^T product.

    BLOCK_T * BLOCK_N * BLOCK_K is capped at 8192 elements (the 3-D product each step forms),
    and SPLIT is chosen so that column blocks x splits reaches about TARGET_PROGRAMS."""
    block_t = min(_pow2_at_least(max(t, 1)), MAX_T)
    block_k = max(32, 8192 // (block_t * BLOCK_N))
    k_blocks = -(-k // block_k)
    if split is None:
        n_blocks = -(-n // BLOCK_N)
        split = max(1, min(k_blocks, TARGET_PROGRAMS // n_blocks))
    split = max(1, min(split, k_blocks))
    k_per_split = -(-k_blocks // split) * block_k
    split = -(-k // k_per_split)
    return block_t, block_k, split, k_per_split


def _operands(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes-or-bits, scales, mins) as the kernel reads them, cached on q."""
    c = q.cache.get("triton_args")
    if c is None:
        p = q.parts
        if q.fmt.name == "bf16":
            w = p["weight"].view(torch.int16)
            c = (w, w, w)  # scales / mins unused
        else:
            c = (p["codes"], p["scales"], p.get("mins", p["scales"]))
        q.cache["triton_args"] = c
    return c


def qlinear_triton(x: torch.Tensor, q: QuantizedTensor, *, split: int | None = None) -> torch.Tensor:
    """``x @ dequantize(q).T`` in float32 with the fused kernel; x ``[T, K]``, any T (token
    blocks of at most MAX_T rows per program). CUDA tensors run compiled; CPU tensors run in
    Triton's interpreter (for tests)."""
    n, k = q.shape
    t = x.shape[0]
    dev = x.device
    if not supports(dev):
        raise RuntimeError(f"the Triton kernels cannot run on {dev} tensors here: {why_not(dev)}")
    w, s, m = _operands(q)
    if w.device != dev:
        raise ValueError(f"input on {dev} but weight on {w.device}")
    x = x.float().contiguous()
    if t == 0:
        return torch.zeros(0, n, dtype=torch.float32, device=dev)
    block_t, block_k, split, k_per_split = launch_shape(t, n, k, split)
    out = torch.empty(split, t, n, dtype=torch.float32, device=dev)
    grid = (-(-n // BLOCK_N), split, -(-t // block_t))
    _kernel()[grid](
        x, w, s, m, _codebook(dev, q.fmt.name), out, t, n, k, k_per_split,
        FMT=FORMAT_IDS[q.fmt.name], G=q.fmt.group_size, BLOCK_T=block_t, BLOCK_N=BLOCK_N,
        BLOCK_K=block_k)
    return out[0] if split == 1 else out.sum(0)
