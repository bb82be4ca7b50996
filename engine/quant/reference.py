"""Torch reference implementations of the weight formats (see ``formats.py`` for the layouts).

Straightforward and slow on purpose: every fast kernel is checked against these.

Shape legend: weight ``w`` ``[N, K]`` (out, in); ``G`` group size; ``NG = K // G``; ``x`` ``[T, K]``.

Quantization rules (scales/mins are rounded to fp16 first, then codes are chosen against the
rounded values, so ``dequantize`` is exactly what the codes and stored metadata say):

- int4: per group ``min``/``max``; ``scale = (max - min) / 15``; ``code = round((w - min) / scale)``
  clamped to [0, 15]; ``w' = code * scale + min``.
- nf4: per group ``absmax``; ``code = nearest NF4 value to w / absmax``; ``w' = NF4[code] * absmax``.
- int8: per group ``absmax``; ``scale = absmax / 127``; ``code = round(w / scale)`` clamped to
  [-127, 127]; ``w' = code * scale``.
- bf16: ``w' = w.to(bfloat16)``.
- mxfp4: per group of 32 ``e = floor(log2(absmax)) - 2`` (6 = 1.5 * 2^2 is E2M1's largest
  value; OCP MX rule), stored biased (``e + 127``, clamped to [0, 254]); ``code`` = the E2M1
  value nearest to ``w / 2^e`` (clamped to +-6); ``w' = E2M1[code] * 2^e``.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.errors import ConfigError
from engine.quant.formats import NF4_CODEBOOK, PACK_BLOCK, QuantFormat, QuantizedTensor

_FP16_MAX = 65504.0


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15] ``[N, K]`` -> packed ``[N, K/2]``: per block of 32, byte j = c[j] | c[j+16] << 4."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // PACK_BLOCK, 2, PACK_BLOCK // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``[N, K/2]`` uint8 -> codes ``[N, K]`` uint8."""
    n, k2 = packed.shape
    b = packed.reshape(n, k2 // (PACK_BLOCK // 2), PACK_BLOCK // 2)
    return torch.stack([b & 0xF, b >> 4], dim=2).reshape(n, k2 * 2)


def _check_weight(w: torch.Tensor, fmt: QuantFormat) -> tuple[int, int]:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ConfigError(f"weight to quantize must be a floating-point tensor, got {type(w).__name__} "
                          f"{getattr(w, 'dtype', '')}")
    n, k = fmt.check_shape(tuple(w.shape))
    if not bool(torch.isfinite(w).all()):
        raise ConfigError(f"weight of shape {list(w.shape)} contains NaN or infinite values")
    amax = float(w.abs().max())
    if fmt.name != "bf16" and amax > _FP16_MAX:
        raise ConfigError(f"weight of shape {list(w.shape)} has |w| = {amax:g} beyond the fp16 range "
                          f"of the {fmt.name} scales ({_FP16_MAX:g})")
    return n, k


def _codebook(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device)


def quantize(w: torch.Tensor, fmt: QuantFormat) -> QuantizedTensor:
    """Quantize a float weight ``[N, K]`` into ``fmt``."""
    n, k = _check_weight(w, fmt)
    w = w.detach().to("cpu", torch.float32)
    if fmt.name == "bf16":
        return QuantizedTensor(fmt, (n, k), {"weight": w.to(torch.bfloat16).contiguous()})
    if fmt.name == "mxfp4":
        return _quantize_mxfp4(w, fmt)
    g = fmt.group_size
    wg = w.reshape(n, k // g, g)
    if fmt.name == "int4":
        mn, mx = wg.amin(-1), wg.amax(-1)
        scale16 = ((mx - mn) / 15).to(torch.float16)
        min16 = mn.to(torch.float16)
        s, m = scale16.float()[..., None], min16.float()[..., None]
        safe = torch.where(s > 0, s, torch.ones_like(s))
        codes = torch.where(s > 0, torch.round((wg - m) / safe), torch.zeros_like(wg)).clamp_(0, 15)
        codes = codes.to(torch.uint8).reshape(n, k)
        return QuantizedTensor(fmt, (n, k), {"codes": pack_nibbles(codes), "scales": scale16.contiguous(),
                                             "mins": min16.contiguous()})
    absmax = wg.abs().amax(-1)
    if fmt.name == "nf4":
        scale16 = absmax.to(torch.float16)
        s = scale16.float()[..., None]
        safe = torch.where(s > 0, s, torch.ones_like(s))
        normed = (wg / safe).clamp_(-1, 1)
        cb = _codebook()
        mids = (cb[1:] + cb[:-1]) / 2
        codes = torch.bucketize(normed, mids).to(torch.uint8).reshape(n, k)  # nearest code book entry
        return QuantizedTensor(fmt, (n, k), {"codes": pack_nibbles(codes), "scales": scale16.contiguous()})
    # int8
    scale16 = (absmax / 127).to(torch.float16)
    s = scale16.float()[..., None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.where(s > 0, torch.round(wg / safe), torch.zeros_like(wg)).clamp_(-127, 127)
    return QuantizedTensor(fmt, (n, k), {"codes": codes.to(torch.int8).reshape(n, k).contiguous(),
                                         "scales": scale16.contiguous()})


def quantize_by_rows(w: torch.Tensor, fmt: QuantFormat, rows: int = 1024,
                     release: Callable[[torch.Tensor], object] | None = None,
                     out: QuantizedTensor | None = None) -> QuantizedTensor:
    """:func:`quantize` of ``w`` ``[N, K]`` (any float dtype, e.g. a bf16 view of a mapped file)
    ``rows`` rows at a time: every part is row-major with N first, so the parts of the blocks
    concatenate to the whole's, equal to quantize(w) bit for bit; the float32 temporaries are
    those of ``rows`` rows, not of the whole weight (a 32000 x 1024 head: ~130 MB in float32,
    several times that in quantize's intermediates). ``release(block)``: called with each block of
    ``w`` once quantized (a mapped file's view drops its pages as the conversion goes: the 1.3B
    bench store's 65 MB head was mapped whole by the end of its conversion). ``out``: a weight of
    ``w``'s shape in ``fmt`` (views of a buffer: engine.quant.linear.DenseArena) that the blocks
    are written into and that is returned: beside it, at most one block's quantized copy."""
    n = w.shape[0]
    if out is not None and (out.fmt != fmt or out.shape != tuple(w.shape)):
        raise ConfigError(f"quantize_by_rows: out is {out.fmt.name} {list(out.shape)}, the weight "
                          f"{fmt.name} {list(w.shape)}")
    if n <= rows:  # one block: no release (the caller's own release follows)
        whole = quantize(w, fmt)
        if out is None:
            return whole
        for name, p in whole.parts.items():
            out.parts[name].copy_(p)
        return out
    # each block's parts land in the whole's, allocated at the first block: no list of blocks
    # beside a concatenated copy (the head's int8 codes twice), and each block's temporaries are
    # freed before the next block allocates its own
    parts: dict[str, torch.Tensor] = {} if out is None else out.parts
    per_row: dict[str, int] = {}  # a part's leading entries per row of w
    for i in range(0, n, rows):
        block = quantize(w[i:i + rows], fmt)
        if not per_row:
            per_row = {name: p.shape[0] // rows for name, p in block.parts.items()}
        if not parts:
            parts = {name: torch.empty((n * per_row[name], *p.shape[1:]), dtype=p.dtype)
                     for name, p in block.parts.items()}
        for name, p in block.parts.items():
            parts[name][i * per_row[name]:i * per_row[name] + p.shape[0]] = p
        del block
        if release is not None:
            release(w[i:i + rows])
    return out if out is not None else QuantizedTensor(fmt, tuple(w.shape), parts)


# E2M1 (4-bit float: sign, 2 exponent bits, 1 mantissa bit), indexed by code; the OCP MX order
# (transformers' FP4_VALUES): codes 0-7 positive, 8-15 their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_mxfp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """MXFP4 codes ``[N, K/2]`` (byte j: weight 2j low nibble, 2j+1 high) -> ``[N, K]`` uint8."""
    n, k2 = packed.shape
    return torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(n, k2 * 2)


def _quantize_mxfp4(w: torch.Tensor, fmt: QuantFormat) -> QuantizedTensor:
    n, k = w.shape
    wg = w.reshape(n, k // 32, 32)
    amax = wg.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2,
                    torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = (wg / torch.ldexp(torch.ones_like(e), e.int())[..., None]).clamp(-6, 6)
    mags = torch.tensor(E2M1_VALUES[:8])
    idx = torch.bucketize(scaled.abs(), (mags[1:] + mags[:-1]) / 2)  # nearest magnitude, 0..7
    codes = (idx + 8 * (scaled < 0)).to(torch.uint8).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return QuantizedTensor(fmt, (n, k), {"codes": packed, "scales": (e + 127).to(torch.uint8).contiguous()})


def _dequantize_mxfp4(q: QuantizedTensor) -> torch.Tensor:
    n, k = q.shape
    codes = unpack_mxfp4_codes(q.parts["codes"]).long()
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[codes]
    exps = q.parts["scales"].to(torch.int32) - 127
    return torch.ldexp(values.reshape(n, k // 32, 32), exps[..., None]).reshape(n, k)


def unpack_codes(q: QuantizedTensor) -> torch.Tensor:
    """Integer codes ``[N, K]`` (uint8 for int4/nf4, int8 for int8)."""
    if q.fmt.name in ("int4", "nf4"):
        return unpack_nibbles(q.parts["codes"])
    if q.fmt.name == "int8":
        return q.parts["codes"]
    raise ConfigError(f"format {q.fmt.name} has no integer codes")


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """The weight ``[N, K]`` a QuantizedTensor stands for, as float32, on the parts' device."""
    n, k = q.shape
    if q.fmt.name == "bf16":
        return q.parts["weight"].float()
    if q.fmt.name == "mxfp4":
        return _dequantize_mxfp4(q)
    g = q.fmt.group_size
    codes = unpack_codes(q).reshape(n, k // g, g)
    s = q.parts["scales"].float()[..., None]
    if q.fmt.name == "int4":
        w = codes.float() * s + q.parts["mins"].float()[..., None]
    elif q.fmt.name == "nf4":
        w = _codebook(codes.device)[codes.long()] * s
    else:
        w = codes.float() * s
    return w.reshape(n, k)


def linear_ref(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """``x @ dequantize(q).T`` in float32; ``x`` ``[..., K]`` -> ``[..., N]``."""
    return x.float() @ dequantize(q).T


def quantize_activations(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[T, K]`` -> (integer codes ``[T, K]``, scales ``[T, K/32]``): per block of 32,
    ``d = absmax / qmax`` and ``q = round-half-even(x * (1 / d))`` in float32 (0 where d = 0);
    ``bits`` 8 (qmax 127, int8 codes) or 16 (qmax 32767, int16 codes)."""
    if bits not in (8, 16):
        raise ConfigError(f"activation codes are 8 or 16 bits, not {bits}")
    qmax = float(2 ** (bits - 1) - 1)
    t, k = x.shape
    xb = x.float().reshape(t, k // 32, 32)
    d = xb.abs().amax(-1) / qmax
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp_(-qmax, qmax).to(torch.int8 if bits == 8 else torch.int16)
    return q.reshape(t, k), d


def dequantize_activations(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``x'``: x ``[T, K]`` through :func:`quantize_activations` and back (``q * dx``), float32."""
    t, k = x.shape
    qx, d = quantize_activations(x, bits)
    return (qx.float().reshape(t, k // 32, 32) * d[..., None]).reshape(t, k)


def takes_int8_activations(q: QuantizedTensor) -> bool:
    """Whether the C++ kernels multiply ``q`` by integer activations when the ``int8_activations``
    option is on: int4 weights, and int8 weights whose in-dim is a multiple of 64
    (engine/csrc/quant.cpp, use_i8a); :func:`activation_bits` says how many bits."""
    return q.fmt.name == "int4" or (q.fmt.name == "int8" and q.shape[1] % 64 == 0)


def activation_bits(q: QuantizedTensor) -> int:
    """The activations' code width the C++ kernels use with ``q``: 8 for int4 weights (vpdpbusd),
    16 for int8 weights (vpdpwssd: int8 activations turn a dense model's outlier channels into
    wrong greedy answers, docs/quantization.md#the-default-dense-format)."""
    return 16 if q.fmt.name == "int8" else 8


def linear_ref_int8_act(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """What the integer-activation kernels compute: ``linear_ref(x', q)`` with ``x'`` the
    activations quantized to :func:`activation_bits` (:func:`dequantize_activations`); float32 ``[T, N]``."""
    if not takes_int8_activations(q):
        raise ConfigError(f"integer activations are implemented for int4 weights and int8 weights with an "
                          f"in-dim multiple of 64, not {q.fmt.name} [{q.shape[0]}, {q.shape[1]}]")
    return linear_ref(dequantize_activations(x.reshape(-1, q.shape[1]).float(), activation_bits(q)), q)


def expert_ref(x: torch.Tensor, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor) -> torch.Tensor:
    """SwiGLU expert in float32: ``(silu(x @ gate.T) * (x @ up.T)) @ down.T``."""
    x = x.float()
    h = torch.nn.functional.silu(linear_ref(x, gate)) * linear_ref(x, up)
    return linear_ref(h, down)


def quant_error(w: torch.Tensor, fmt: QuantFormat, x: torch.Tensor | None = None) -> dict[str, float]:
    """Relative Frobenius errors of quantizing ``w``: of the weight and of ``x @ w.T``.

    ``x`` defaults to 64 standard-normal rows. ``rel_err_w = |w' - w| / |w|``,
    ``rel_err_wx = |x w'^T - x w^T| / |x w^T|``.
    """
    w = w.detach().float().cpu()
    wq = dequantize(quantize(w, fmt))
    if x is None:
        x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.float().reshape(-1, w.shape[1])
    y, yq = x @ w.T, x @ wq.T

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        den = float(torch.linalg.vector_norm(b))
        return float(torch.linalg.vector_norm(a - b)) / den if den > 0 else float(torch.linalg.vector_norm(a - b))

    return {"rel_err_w": rel(wq, w), "rel_err_wx": rel(yq, y)}
