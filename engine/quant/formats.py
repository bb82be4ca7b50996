"""Group-wise weight formats for expert weights: metadata, containers and the on-disk layout.

Shape legend (F.linear orientation): a weight is ``[N, K]`` = ``[out, in]``; groups run along
``K`` (the input dimension), ``G`` consecutive weights of one output row per group, so a format
with group size ``G`` needs ``K % G == 0``.

Formats (``QuantFormat.name``), their named parts and what a weight decodes to:

==========  ===========================================================  =========================
name        parts (name dtype shape)                                     weight[n, k] =
==========  ===========================================================  =========================
``int4``    codes u8 [N, K/2], scales f16 [N, K/G], mins f16 [N, K/G]     code * scale + min
``nf4``     codes u8 [N, K/2], scales f16 [N, K/G]                        NF4[code] * scale (absmax)
``int8``    codes i8 [N, K],   scales f16 [N, K/G]                        code * scale (symmetric)
``bf16``    weight bf16 [N, K]                                            weight
``mxfp4``   codes u8 [N, K/2], scales u8 [N, K/32] (G = 32 only)          E2M1[code] * 2^(scale-127)
==========  ===========================================================  =========================

``mxfp4`` (OCP microscaling FP4, as gpt-oss ships its experts): 4-bit E2M1 values (sign, 2-bit
exponent, 1-bit mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) with one E8M0 exponent
byte per 32 weights. Its codes keep the released byte order (byte j of a row holds weight 2j in
its low nibble and 2j+1 in its high nibble), so a checkpoint's blocks are stored unchanged.

4-bit packing (``int4`` and ``nf4``): codes are packed two per byte in blocks of 32 consecutive
weights of a row: byte ``j`` (0..15) of a block holds the code of weight ``j`` in its low nibble
and the code of weight ``j + 16`` in its high nibble (the llama.cpp Q4_0 order, which lets a SIMD
kernel expand 16 bytes into two contiguous 16-lane vectors without a shuffle). Every group size
(32/64/128) is a multiple of the block.

Serialization: a :class:`QuantizedTensor` is one blob; its parts follow each other in the order
above, each starting at an offset that is a multiple of :data:`ALIGN` (64 bytes) from the blob's
start, padded with zeros. :meth:`QuantizedTensor.layout` describes it as a json-able dict and
:meth:`QuantizedTensor.from_buffer` maps it back without copying (``torch.frombuffer`` views).
Alignment requirement of ``from_buffer``: every part must start at an address that is a multiple
of its element size (2 bytes for fp16/bf16); this holds whenever the blob itself starts 2-byte
aligned. For full-speed SIMD loads the blob should start 64-byte aligned (the expert store aligns
every blob to 4 KiB and mmap is page aligned); the kernels use unaligned loads, so a
less-aligned blob is correct, only possibly slower. Views of a read-only buffer (``bytes``, a
read-only mmap) must not be written to; nothing in moestream writes quantized weights in place.

An expert (gate ``[I, H]``, up ``[I, H]``, down ``[H, I]``) is one blob of three such tensors,
each again 64-byte aligned: :func:`pack_expert` / :func:`unpack_expert`.

Nothing is inferred from names: every blob comes with its format, group size and logical shape.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from engine.errors import ConfigError, ModelFormatError

FORMATS = ("int4", "nf4", "int8", "bf16")  # group-wise: every group size of GROUP_SIZES
MX_FORMATS = ("mxfp4",)  # microscaling: a fixed block of 32 (group_size must be 32)
GROUP_SIZES = (32, 64, 128)
ALIGN = 64          # every part / tensor of a blob starts at a multiple of this many bytes
PACK_BLOCK = 32     # 4-bit codes are packed in blocks of 32 weights (byte j: weight j | weight j+16)
LAYOUT_VERSION = 1

# NF4 code book (QLoRA, Dettmers et al. 2023; the values bitsandbytes uses), ascending.
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982985687256, 0.5626170039176941, 0.7229568362236023, 1.0,
)

_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "float16": torch.float16,
           "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class QuantFormat:
    """A weight format: ``name`` in :data:`FORMATS`, ``group_size`` in :data:`GROUP_SIZES`.

    ``bf16`` has no groups; its ``group_size`` is kept (so a store has one uniform record) but
    imposes no divisibility on the input dimension.
    """

    name: str
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.name not in FORMATS + MX_FORMATS:
            raise ConfigError(f"quant format {self.name!r} is not supported; supported: "
                              f"{', '.join(FORMATS + MX_FORMATS)}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                or self.group_size not in GROUP_SIZES:
            raise ConfigError(
                f"quant group_size {self.group_size!r} (format {self.name}) is not supported; "
                f"allowed: {', '.join(map(str, GROUP_SIZES))}"
            )
        if self.name == "mxfp4" and self.group_size != 32:
            raise ConfigError(f"quant format mxfp4 has one exponent per 32 weights; group_size "
                              f"{self.group_size} is not allowed (use 32)")

    @property
    def grouped(self) -> bool:
        return self.name != "bf16"

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight including the per-group fp16 metadata (padding excluded)."""
        g = self.group_size
        return {"int4": 4 + 32 / g, "nf4": 4 + 16 / g, "int8": 8 + 16 / g, "bf16": 16.0,
                "mxfp4": 4 + 8 / g}[self.name]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "group_size": self.group_size}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantFormat":
        try:
            return cls(d["name"], d["group_size"])
        except (KeyError, TypeError) as e:
            raise ConfigError(f"quant format record {d!r} needs 'name' and 'group_size'") from e

    def check_shape(self, shape: Iterable[int]) -> tuple[int, int]:
        """Validate a weight shape ``[out, in]`` for this format; returns it as a tuple."""
        shape = tuple(shape)
        if len(shape) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
            raise ConfigError(f"quantized weight shape must be [out, in] with positive ints, got {list(shape)}")
        n, k = shape
        if self.grouped and k % self.group_size:
            raise ConfigError(
                f"weight of shape [{n}, {k}]: input dim {k} is not divisible by group_size "
                f"{self.group_size} (format {self.name}); allowed group sizes dividing {k}: "
                f"{', '.join(str(g) for g in GROUP_SIZES if k % g == 0) or 'none'}"
            )
        return n, k


def bits_per_weight(fmt: QuantFormat) -> float:
    return fmt.bits_per_weight


def part_specs(shape: Iterable[int], fmt: QuantFormat) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The named parts ``(name, dtype, shape)`` of a weight of ``shape`` in ``fmt``, in blob order."""
    n, k = fmt.check_shape(shape)
    ng = k // fmt.group_size if fmt.grouped else 0
    if fmt.name == "int4":
        return [("codes", torch.uint8, (n, k // 2)), ("scales", torch.float16, (n, ng)),
                ("mins", torch.float16, (n, ng))]
    if fmt.name == "nf4":
        return [("codes", torch.uint8, (n, k // 2)), ("scales", torch.float16, (n, ng))]
    if fmt.name == "int8":
        return [("codes", torch.int8, (n, k)), ("scales", torch.float16, (n, ng))]
    if fmt.name == "mxfp4":
        return [("codes", torch.uint8, (n, k // 2)), ("scales", torch.uint8, (n, ng))]
    return [("weight", torch.bfloat16, (n, k))]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _layout_parts(shape, fmt) -> list[dict[str, Any]]:
    parts, off = [], 0
    for name, dtype, pshape in part_specs(shape, fmt):
        nb = _nbytes(dtype, pshape)
        parts.append({"name": name, "dtype": _DTYPE_NAMES[dtype], "shape": list(pshape),
                      "offset": off, "nbytes": nb})
        off = _align_up(off + nb)
    return parts


def bytes_for(shape: Iterable[int], fmt: QuantFormat) -> int:
    """Size in bytes of the serialized blob of a weight (parts plus alignment padding)."""
    parts = _layout_parts(tuple(shape), fmt)
    return _align_up(parts[-1]["offset"] + parts[-1]["nbytes"])


def layout_for(shape: Iterable[int], fmt: QuantFormat) -> dict[str, Any]:
    """The layout (:meth:`QuantizedTensor.layout`) of a weight of ``shape`` in ``fmt``: what
    :meth:`QuantizedTensor.from_buffer` needs to view a blob before anything is written in it."""
    shape = tuple(shape)
    return {"version": LAYOUT_VERSION, "format": fmt.to_dict(), "shape": list(shape), "align": ALIGN,
            "nbytes": bytes_for(shape, fmt), "parts": _layout_parts(shape, fmt)}


def payload_bytes(shape: Iterable[int], fmt: QuantFormat) -> int:
    """Bytes a kernel must read for one weight (no padding)."""
    return sum(p["nbytes"] for p in _layout_parts(tuple(shape), fmt))


# ----------------------------------------------------------------------------------- buffers

def _as_u8(buf: Any) -> torch.Tensor:
    """A flat uint8 tensor viewing ``buf`` (bytes, bytearray, memoryview, mmap, uint8 tensor)."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.device.type != "cpu":
            raise ModelFormatError("<buffer>", f"buffer tensor must be a CPU uint8 tensor, got {buf.dtype} on {buf.device}")
        if not buf.is_contiguous():
            raise ModelFormatError("<buffer>", "buffer tensor must be contiguous")
        return buf.reshape(-1)
    mv = memoryview(buf)
    if not mv.contiguous:
        raise ModelFormatError("<buffer>", "buffer must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # torch warns that a read-only buffer (bytes, read-only mmap) gives a tensor that must not be
        # written; we never write quantized weights in place (see module docstring).
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8)


@dataclass(eq=False)
class QuantizedTensor:
    """A weight ``[out, in]`` in a :class:`QuantFormat`: its named parts (see module docstring).

    Parts are tensors on one device (CPU, or e.g. views of a CUDA expert slot), possibly views
    into a shared buffer (``from_buffer``, CPU buffers only). ``cache`` holds kernel-specific data
    derived from where the parts live (argument tuples, bound kernels), never from their values:
    the expert cache reuses one slot's QuantizedTensors for every expert copied into that slot.
    It is never serialized.
    """

    fmt: QuantFormat
    shape: tuple[int, int]
    parts: dict[str, torch.Tensor]
    cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.shape = self.fmt.check_shape(self.shape)
        specs = part_specs(self.shape, self.fmt)
        if set(self.parts) != {s[0] for s in specs}:
            raise ConfigError(f"{self.fmt.name} weight {list(self.shape)} needs parts "
                              f"{[s[0] for s in specs]}, got {sorted(self.parts)}")
        for name, dtype, pshape in specs:
            t = self.parts[name]
            if t.dtype != dtype or tuple(t.shape) != pshape or not t.is_contiguous():
                raise ConfigError(f"{self.fmt.name} weight {list(self.shape)}: part {name!r} must be a contiguous "
                                  f"{dtype} tensor of shape {list(pshape)}, got {t.dtype} {list(t.shape)}")

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @classmethod
    def trusted(cls, fmt: QuantFormat, shape: tuple[int, int], parts: dict[str, torch.Tensor]) -> "QuantizedTensor":
        """Construct without re-checking the parts: only for parts sliced by spans that a checked
        construction of the same layout produced (the expert cache's hot path, ~10x cheaper)."""
        q = cls.__new__(cls)
        q.fmt, q.shape, q.parts, q.cache = fmt, shape, parts, {}
        return q

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        """The same weight with its parts on ``device`` (self when they are there already)."""
        device = torch.device(device)
        if self.device == device:
            return self
        return QuantizedTensor(self.fmt, self.shape, {k: v.to(device) for k, v in self.parts.items()})

    @property
    def nbytes(self) -> int:
        """Bytes of the parts (what a kernel reads), without padding."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def layout(self) -> dict[str, Any]:
        """json-able description of :meth:`to_bytes`: format, shape, total bytes and the parts."""
        return layout_for(self.shape, self.fmt)

    def to_bytes(self) -> bytes:
        out = bytearray(bytes_for(self.shape, self.fmt))
        self.write_into(out)
        return bytes(out)

    def write_into(self, out: Any, offset: int = 0) -> None:
        """Write the blob into a writable buffer at ``offset`` (used by :func:`pack_expert`)."""
        if isinstance(out, bytes) or (isinstance(out, memoryview) and out.readonly):
            raise TypeError("write_into needs a writable buffer (bytearray, writable mmap, uint8 tensor)")
        dst = _as_u8(out)
        for p in _layout_parts(self.shape, self.fmt):
            src = self.parts[p["name"]].contiguous().view(-1).view(torch.uint8)
            dst[offset + p["offset"]: offset + p["offset"] + p["nbytes"]].copy_(src)

    @classmethod
    def from_buffer(cls, buf: Any, layout: Mapping[str, Any], shape: Iterable[int] | None = None,
                    fmt: QuantFormat | None = None, *, offset: int = 0,
                    source: str = "<buffer>") -> "QuantizedTensor":
        """Zero-copy view of a blob written by :meth:`to_bytes` starting at ``buf[offset]``.

        ``layout`` is the dict from :meth:`layout` (as stored in the manifest); ``shape`` and
        ``fmt``, when given (from the manifest's own records), must agree with it. The layout is
        checked against what the format prescribes (part names, dtypes, shapes, aligned,
        in-range offsets) before anything is viewed; problems raise ``ModelFormatError`` naming
        ``source``. The returned parts are views into ``buf`` (their ``data_ptr`` lies inside it).
        """
        try:
            lfmt = QuantFormat.from_dict(layout["format"])
            lshape = tuple(int(s) for s in layout["shape"])
            lparts = list(layout["parts"])
        except (KeyError, TypeError, ValueError, ConfigError) as e:
            raise ModelFormatError(source, f"malformed quantized-tensor layout: {e}") from e
        if fmt is not None and fmt != lfmt:
            raise ModelFormatError(source, f"layout format {lfmt} does not match expected {fmt}")
        if shape is not None and tuple(shape) != lshape:
            raise ModelFormatError(source, f"layout shape {list(lshape)} does not match expected {list(shape)}")
        try:
            expected = _layout_parts(lshape, lfmt)
        except ConfigError as e:
            raise ModelFormatError(source, str(e)) from e
        if offset < 0 or offset % 2:
            raise ModelFormatError(source, f"blob offset {offset} must be a non-negative multiple of 2")
        base = _as_u8(buf)
        parts: dict[str, torch.Tensor] = {}
        for want, got in zip(expected, lparts + [None] * max(0, len(expected) - len(lparts))):
            if not isinstance(got, Mapping) or any(got.get(k) != want[k] for k in ("name", "dtype", "shape", "nbytes")):
                raise ModelFormatError(source, f"{lfmt.name} {list(lshape)} layout part {got!r} does not match "
                                               f"the format's part {want}")
            off = got.get("offset")
            if not isinstance(off, int) or off < 0 or off % ALIGN:
                raise ModelFormatError(source, f"part {want['name']!r} offset {off!r} is not a non-negative "
                                               f"multiple of {ALIGN}")
            start, end = offset + off, offset + off + want["nbytes"]
            if end > base.numel():
                raise ModelFormatError(source, f"part {want['name']!r} [{start}, {end}) lies beyond the "
                                               f"buffer of {base.numel()} bytes")
            parts[want["name"]] = base[start:end].view(_DTYPES[want["dtype"]]).view(want["shape"])
        if len(lparts) != len(expected):
            raise ModelFormatError(source, f"layout has {len(lparts)} parts, {lfmt.name} needs {len(expected)}")
        spans = sorted((p["offset"], p["offset"] + p["nbytes"]) for p in lparts)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            raise ModelFormatError(source, f"layout parts overlap: {spans}")
        q = cls(lfmt, lshape, parts)
        q.cache["buffer"] = buf  # keep the owner alive as long as the views are
        return q
