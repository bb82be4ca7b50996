"""A validating reader of the safetensors format over a private (copy-on-write) memory map: writes never reach the file.

File layout (all integers little-endian)::

    [0, 8)                 u64 N: byte length of the JSON header
    [8, 8 + N)             UTF-8 JSON object: {name: {"dtype", "shape", "data_offsets": [s, e]},
                                               "__metadata__": {str: str}}   (metadata optional)
    [8 + N, file end)      the data area; tensor bytes live at [8 + N + s, 8 + N + e)

Everything is checked before a tensor is touched (see notes/reliability.md §1): the header must
fit a 100 MB cap and the file, be UTF-8 JSON with an object at the top and no duplicate keys,
every entry must have a known dtype, non-negative integer dims whose product does not overflow,
``e - s == numel * itemsize``, and the entries sorted by offset must tile the data area exactly
(start at 0, no gaps, no overlaps, no trailing bytes, nothing past the end of the file).
Zero-size tensors and scalars (shape ``[]``) are allowed.

We deliberately do not call the ``safetensors`` package here: the checks are ours, spelled out,
and every failure is a :class:`~engine.errors.ModelFormatError` naming the file and the problem.
Not protected against (as upstream): the file changing while it is mapped.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import sys
import warnings
from typing import Any

import torch

from engine.errors import ModelFormatError, quote
from engine.hugepages import libc_madvise

MAX_HEADER_BYTES = 100_000_000  # upstream's limit; bounds the only allocation made before checks
MAX_DIMS = 64  # no tensor has more; bounds the shape arithmetic on a hostile header
_MAX_BYTES = 2**63 - 1  # anything larger cannot be an offset in a real file (and overflows i64)
PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4  # <sys/mman.h>

# safetensors dtype -> (torch dtype, itemsize, our short name as used in TensorInfo.dtype).
DTYPES: dict[str, tuple[torch.dtype, int, str]] = {
    "F64": (torch.float64, 8, "f64"),
    "F32": (torch.float32, 4, "f32"),
    "F16": (torch.float16, 2, "f16"),
    "BF16": (torch.bfloat16, 2, "bf16"),
    "F8_E4M3": (torch.float8_e4m3fn, 1, "f8_e4m3"),
    "F8_E5M2": (torch.float8_e5m2, 1, "f8_e5m2"),
    "I64": (torch.int64, 8, "i64"),
    "I32": (torch.int32, 4, "i32"),
    "I16": (torch.int16, 2, "i16"),
    "I8": (torch.int8, 1, "i8"),
    "U64": (torch.uint64, 8, "u64"),
    "U32": (torch.uint32, 4, "u32"),
    "U16": (torch.uint16, 2, "u16"),
    "U8": (torch.uint8, 1, "u8"),
    "BOOL": (torch.bool, 1, "bool"),
}

if sys.byteorder != "little":  # pragma: no cover - every platform we run on is little-endian
    raise ImportError("engine.loading.safetensors assumes a little-endian host")


# torch.frombuffer warns (once per process, TORCH_WARN_ONCE) that a read-only buffer gives a
# writable tensor; that is the documented contract of SafetensorsFile.get. Spend the one warning
# here, silenced, instead of wrapping every get() in warnings.catch_warnings (not thread-safe).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook: json.loads would silently keep the last of two equal keys."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    # NaN / Infinity are not JSON; Python's json accepts them by default.
    raise ValueError(f"non-standard JSON constant {name}")


class _Entry:
    """One tensor's header entry after validation. Offsets are relative to the data area."""

    __slots__ = ("name", "st_dtype", "shape", "start", "end", "numel")

    def __init__(self, name: str, st_dtype: str, shape: tuple[int, ...], start: int, end: int,
                 numel: int) -> None:
        self.name, self.st_dtype, self.shape = name, st_dtype, shape
        self.start, self.end, self.numel = start, end, numel


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true/false are not dims


def _parse_entry(path: str, name: str, raw: object) -> _Entry:
    def bad(problem: str) -> ModelFormatError:
        return ModelFormatError(path, f"tensor {quote(name)}: {problem}")

    if not isinstance(raw, dict):
        raise bad(f"header entry must be a JSON object, got {type(raw).__name__}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in raw:
            raise bad(f"header entry is missing {quote(key)}")
    st_dtype = raw["dtype"]
    if not isinstance(st_dtype, str) or st_dtype not in DTYPES:
        raise bad(f"unknown dtype {quote(st_dtype)}; known: {', '.join(DTYPES)}")
    shape = raw["shape"]
    if not isinstance(shape, list):
        raise bad(f"shape must be a list of integers, got {quote(shape)}")
    if len(shape) > MAX_DIMS:
        raise bad(f"shape has {len(shape)} dimensions; at most {MAX_DIMS} are allowed")
    for d in shape:
        if not _is_int(d):
            raise bad(f"shape {quote(shape)} has a non-integer dimension {quote(d)}")
        if d < 0:
            raise bad(f"shape {quote(shape)} has a negative dimension {d}")
    itemsize = DTYPES[st_dtype][1]
    # Python ints do not wrap, so compare against the i64 limit explicitly: a C reader computing
    # the same product in 64 bits would wrap to a small number (llama.cpp PR #18674).
    numel = math.prod(shape)
    if numel * itemsize > _MAX_BYTES:
        raise bad(f"shape {quote(shape)} overflows: its elements x {itemsize} bytes exceed 2^63-1")
    offs = raw["data_offsets"]
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
        raise bad(f"data_offsets must be a list of two integers, got {quote(offs)}")
    start, end = offs
    if start < 0 or end < 0:
        raise bad(f"data_offsets {quote(offs)} are negative")
    if end < start:
        raise bad(f"data_offsets {quote(offs)} end before they start")
    if end - start != numel * itemsize:
        raise bad(
            f"byte length {end - start} (data_offsets {quote(offs)}) != numel {numel} x itemsize "
            f"{itemsize} = {numel * itemsize} for dtype {st_dtype} shape {quote(shape)}"
        )
    return _Entry(name, st_dtype, tuple(shape), start, end, numel)


class SafetensorsFile:
    """Validated, lazily read view of one ``.safetensors`` file.

    The constructor reads and checks the header only; tensor bytes are reached through a
    read-only ``mmap`` when :meth:`get` is called. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self._mm: mmap.mmap | None = None
        self.metadata: dict[str, str] = {}
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ModelFormatError(
                    self.path, f"file is {size} bytes, too small for the 8-byte header length"
                )
            n = int.from_bytes(f.read(8), "little")
            if n > MAX_HEADER_BYTES:
                raise ModelFormatError(
                    self.path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit"
                )
            if 8 + n > size:
                raise ModelFormatError(
                    self.path, f"header length {n} runs past the end of the file ({size} bytes)"
                )
            header_bytes = f.read(n)
            self._data_start = 8 + n  # absolute file offset of the data area
            self._data_len = size - self._data_start
            self._entries = self._parse_header(header_bytes)
            # mmap of the whole file (size >= 8 > 0, so mmap accepts it). ACCESS_COPY (a private
            # mapping): pages are shared with the page cache until written; a write makes a
            # private copy of its page and never reaches the file. (ACCESS_READ would make any
            # in-place write to a tensor view, e.g. a user editing a loaded weight, a SIGSEGV.)
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            view = ctypes.c_char.from_buffer(self._mm)  # an export, dropped at once: mmap.close stays possible
            self._base, self._size = ctypes.addressof(view), size
            del view

    # ---- header ----------------------------------------------------------------------------
    def _parse_header(self, header_bytes: bytes) -> dict[str, _Entry]:
        path = self.path
        try:
            text = header_bytes.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFormatError(path, f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            # Writers may pad the header with trailing spaces to align the data area.
            header = json.loads(text, object_pairs_hook=_no_duplicates,
                                parse_constant=_reject_constant)
        except _DuplicateKey as e:
            raise ModelFormatError(path, f"header has duplicate key {quote(e.key)}") from None
        except (json.JSONDecodeError, ValueError, RecursionError) as e:
            raise ModelFormatError(path, f"header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise ModelFormatError(path, f"header must be a JSON object, got {type(header).__name__}")

        entries: list[_Entry] = []
        for name, raw in header.items():
            if name == "__metadata__":
                if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
                    raise ModelFormatError(path, "__metadata__ must be an object of strings")
                self.metadata = dict(raw)
                continue
            entries.append(_parse_entry(path, name, raw))

        # The entries sorted by (start, end) must tile [0, data_len) exactly. Zero-size tensors
        # (start == end) may sit anywhere a boundary is, including several at the same offset.
        entries.sort(key=lambda e: (e.start, e.end))
        pos = 0
        prev: _Entry | None = None
        for e in entries:
            if e.start != pos:
                if e.start < pos:
                    assert prev is not None
                    raise ModelFormatError(
                        path, f"tensor {quote(e.name)} (offsets [{e.start}, {e.end}]) overlaps "
                              f"tensor {quote(prev.name)} (offsets [{prev.start}, {prev.end}])")
                where = f"after tensor {quote(prev.name)}" if prev else "at the start of the data area"
                raise ModelFormatError(
                    path, f"gap of {e.start - pos} bytes {where}: tensor {quote(e.name)} starts at "
                          f"{e.start}, expected {pos} (offsets must be contiguous from 0)")
            pos = e.end
            prev = e
        if pos > self._data_len:
            assert prev is not None
            raise ModelFormatError(
                path, f"truncated: tensor {quote(prev.name)} ends at data offset {pos} but the data "
                      f"area has only {self._data_len} bytes")
        if pos < self._data_len:
            raise ModelFormatError(
                path, f"{self._data_len - pos} trailing bytes after the last tensor "
                      f"(data area is {self._data_len} bytes, tensors cover {pos})")
        return {e.name: e for e in entries}

    # ---- access ----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor in {self.path}") from None

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """``(shape, dtype)`` without reading data; dtype is our short name ("bf16", "f32", ...)."""
        e = self._entry(name)
        return e.shape, DTYPES[e.st_dtype][2]

    def nbytes(self, name: str) -> int:
        e = self._entry(name)
        return e.end - e.start

    def get(self, name: str, *, copy: bool = False) -> torch.Tensor:
        """The tensor, shaped and typed as stored.

        Unless ``copy`` is true, the result is a zero-copy view of the file's private
        (copy-on-write) mapping: writing to it in place changes this process's copy of the
        touched pages only, never the file, and views of the same tensor from this object see the
        write (as views of one storage do); ``copy=True`` gives an independent tensor. The view keeps the mapping alive after
        :meth:`close` (it holds a reference to the mmap object). Tensors whose offset is not a
        multiple of the itemsize (possible only in hand-made files, writers align the data
        area) are copied so kernels see aligned data.
        """
        if self._mm is None:
            raise ValueError(f"{self.path} is closed")
        e = self._entry(name)
        torch_dtype, itemsize, _ = DTYPES[e.st_dtype]
        if e.numel == 0:
            return torch.empty(e.shape, dtype=torch_dtype)  # frombuffer rejects count=0
        offset = self._data_start + e.start
        if offset % itemsize:
            buf: Any = bytearray(self._mm[offset:offset + e.end - e.start])
            t = torch.frombuffer(buf, dtype=torch_dtype, count=e.numel)
            return t.reshape(e.shape)
        t = torch.frombuffer(self._mm, dtype=torch_dtype, count=e.numel, offset=offset)
        t = t.reshape(e.shape)
        return t.clone() if copy else t

    def rows(self, name: str):
        """A reader of a 2-D tensor's rows by pread (engine.loading.file_rows.FileRows), or None
        where the tensor is not 2-D or its offset is not a multiple of its itemsize."""
        from engine.loading.file_rows import FileRows

        e = self._entry(name)
        torch_dtype, itemsize, _ = DTYPES[e.st_dtype]
        offset = self._data_start + e.start
        if len(e.shape) != 2 or offset % itemsize or e.numel == 0:
            return None
        return FileRows(self.path, offset, e.shape, torch_dtype)

    def release(self, t: torch.Tensor) -> bool:
        """Drop this process's pages of ``t``, a view of this file's mapping that will not be read
        again soon (a weight just converted to another format, engine.quant.linear.quantize_dense):
        they leave the process's RSS (MADV_DONTNEED; a later read faults the file's bytes back,
        so a view still in use, e.g. a tied embedding, reads what it read before) and the page
        cache is advised to drop them (a cgroup counts page cache). Only pages wholly inside
        ``t``; a page written in place would lose the write (nothing writes weights at load).
        False when ``t`` is not a view of this mapping: nothing done."""
        start, n = t.data_ptr(), t.numel() * t.element_size()
        if self._mm is None or n == 0 or not (self._base <= start and start + n <= self._base + self._size):
            return False
        lo, hi = -(-start // PAGE) * PAGE, (start + n) // PAGE * PAGE
        if hi <= lo:
            return True
        madvise = libc_madvise()
        if madvise is not None:
            madvise(lo, hi - lo, MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, lo - self._base, hi - lo, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return True

    def close(self) -> None:
        # Drop our reference only; never mm.close(). torch.frombuffer does not hold a buffer
        # export (so mmap.close() would *succeed* and unmap pages that live views still point
        # at: a segfault on the next read) but does hold a reference to the mmap object. The
        # mapping and its file descriptor are released when the last view is freed.
        self._mm = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self._entries)} tensors)"


def read_header(path: str | os.PathLike[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype)}`` of a file, validated, without mapping tensor data."""
    with SafetensorsFile(path) as f:
        return {n: f.info(n) for n in f.names()}


__all__ = ["SafetensorsFile", "read_header", "DTYPES", "MAX_HEADER_BYTES"]
