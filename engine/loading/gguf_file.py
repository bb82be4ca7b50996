"""A validating GGUF (v2/v3, little-endian) file reader: header, metadata, tensor table, mmap'd
data (engine.loading.gguf maps its tensors to canonical names as a :class:`TensorSource`).

File layout (all integers little-endian)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      { string key | u32 value_type | value }
    n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
    padding to ``general.alignment`` (default 32)
    data section: tensor i occupies [data_start + offset_i, + n_bytes_i)

    string = u64 length | UTF-8 bytes;  array = u32 element_type | u64 count | elements

``ne`` is ggml order, innermost (contiguous) dimension first, so the logical (torch) shape is
``reversed(ne)``: a 2-D weight with ne = [in, out] is ``[out, in]``, a stacked expert tensor
with ne = [H, I, E] is ``[E, I, H]``.

Everything a file declares is checked against the bytes it actually has *before* anything is
allocated from it (docs/design.md §8): a declared length or count is
compared with the bytes left, shapes use bounded integer arithmetic, and every tensor must lie
inside the file, aligned and not overlapping another. Any violation raises
:class:`ModelFormatError` naming the file and the problem. Data are read lazily from a
read-only mmap; :meth:`GGUFSource.get` returns tensors that own their memory.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import ModelFormatError, quote
from engine.loading.gguf_quants import GGML_TYPES, GGMLType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_BAD_MAGIC = "bad magic: the file does not start with 'GGUF', so it is not a GGUF file"
HEADER_BYTES = 24  # magic 4 + version 4 + n_tensors 8 + n_kv 8
# ggml's own caps (gguf.cpp GGUF_MAX_STRING_LENGTH / GGUF_MAX_ARRAY_ELEMENTS, GGML_MAX_NAME,
# GGML_MAX_DIMS). A count within these may still be rejected against the bytes left.
MAX_STRING_BYTES = 1 << 30
MAX_ARRAY_ELEMENTS = 1 << 30
MAX_TENSOR_NAME_BYTES = 63
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 62
# Smallest possible encodings, for "count absurd vs file size": a kv is key length (8) + at
# least one key byte + type (4) + a 1-byte value; a tensor info is name length (8) + one name
# byte + n_dims (4) + type (4) + offset (8).
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8

# GGUF metadata value types.
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL = range(8)
T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = range(8, 13)
_SCALAR_FORMATS = {  # type -> (struct reader, numpy dtype)
    vtype: (struct.Struct(fmt), dtype) for vtype, fmt, dtype in (
        (T_UINT8, "<B", "<u1"), (T_INT8, "<b", "<i1"), (T_UINT16, "<H", "<u2"),
        (T_INT16, "<h", "<i2"), (T_UINT32, "<I", "<u4"), (T_INT32, "<i", "<i4"),
        (T_FLOAT32, "<f", "<f4"), (T_BOOL, "<B", "<u1"), (T_UINT64, "<Q", "<u8"),
        (T_INT64, "<q", "<i8"), (T_FLOAT64, "<d", "<f8"),
    )
}
# Special-token ids a GGUF may declare (llama.cpp spells "seperator").
SPECIAL_TOKEN_KEYS = tuple(f"tokenizer.ggml.{k}_token_id" for k in (
    "bos", "eos", "eot", "eom", "padding", "unknown", "seperator", "mask"))
_INT_TYPES = (T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_UINT64, T_INT64)
_TYPE_NAMES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool",
               "string", "array", "uint64", "int64", "float64")

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor as the file declares it (validated)."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    ne: tuple[int, ...]  # ggml order: innermost dimension first
    type: GGMLType
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (torch) shape: outermost dimension first."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


class _Cursor:
    """Bounds-checked little-endian reads from the mmap; every failure names the file."""

    __slots__ = ("buf", "pos", "size", "path")

    def __init__(self, buf: mmap.mmap, size: int, path: str) -> None:
        self.buf, self.pos, self.size, self.path = buf, 0, size, path

    def fail(self, problem: str) -> ModelFormatError:
        return ModelFormatError(self.path, problem)

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"{what} needs {n} bytes at offset {self.pos} but only {self.size - self.pos} remain "
                "(truncated or corrupt file)"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str) -> bytes:
        n = self.u64(f"length of {what}")
        if n > MAX_STRING_BYTES:
            raise self.fail(f"{what} declares length {n}, above the limit of {MAX_STRING_BYTES} bytes")
        self.need(n, what)
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def string(self, what: str) -> str:
        b = self.raw_string(what)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


class GGUFFile:
    """The parsed, validated structure of a GGUF file over a read-only mmap.

    Attributes: ``path``, ``version``, ``metadata`` (key -> int/float/str/bool/list, in file
    order), ``metadata_types`` (key -> GGUF value type id), ``alignment``, ``data_start``,
    ``tensors`` (GGUF name -> :class:`GGUFTensorInfo`, in file order).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self._mm: mmap.mmap | None = None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise ModelFormatError(self.path, f"cannot open: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ModelFormatError(self.path, "file is empty (0 bytes): not a GGUF file")
            if size < HEADER_BYTES:
                head = os.pread(fd, 4, 0)
                if head != GGUF_MAGIC[:len(head)]:
                    raise ModelFormatError(self.path, _BAD_MAGIC)
                raise ModelFormatError(
                    self.path, f"file is {size} bytes, shorter than the {HEADER_BYTES}-byte GGUF header"
                )
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.size = size
        try:
            self._parse()
        except ModelFormatError:
            self.close()
            raise
        except (struct.error, UnicodeDecodeError, OverflowError, IndexError, MemoryError) as e:
            # Safety net: every read above is bounds-checked, so this means a bug here; still
            # report it as a format problem of this file, not a crash.
            self.close()
            raise ModelFormatError(self.path, f"unreadable structure ({type(e).__name__}): "
                                             f"{quote(str(e), 80)}") from None
        except BaseException:
            self.close()
            raise

    # ---- parsing ------------------------------------------------------------------------------
    def _parse(self) -> None:
        assert self._mm is not None
        c = _Cursor(self._mm, self.size, self.path)
        magic = self._mm[0:4]
        if magic != GGUF_MAGIC:
            raise c.fail(_BAD_MAGIC)
        c.pos = 4
        version = c.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                raise c.fail("big-endian GGUF files are not supported")
            raise c.fail(f"unsupported GGUF version {version}; supported: 2, 3")
        self.version = version
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        # Reject absurd counts before looping over them: each entry needs a minimum of bytes.
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > c.left():
            raise c.fail(
                f"header declares {n_tensors} tensors and {n_kv} metadata entries, "
                f"which cannot fit in the {c.left()} bytes after the header"
            )

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, int] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            if not key:
                raise c.fail(f"metadata key #{i} is empty")
            if key in self.metadata:
                raise c.fail(f"duplicate metadata key {quote(key)}")
            vtype = c.u32(f"value type of {quote(key)}")
            self.metadata[key] = self._read_value(c, vtype, key)
            self.metadata_types[key] = vtype

        self.alignment = self._alignment(c)

        self.tensors: dict[str, GGUFTensorInfo] = {}
        pending: list[tuple[str, tuple[int, ...], GGMLType, int, int]] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            info = self._read_tensor_info(c, i)
            if info[0] in seen:
                raise c.fail(f"duplicate tensor name {info[0]!r}")
            seen.add(info[0])
            pending.append(info)

        # Data section starts at the next multiple of the alignment.
        data_start = -(-c.pos // self.alignment) * self.alignment
        self.data_start = data_start
        data_size = self.size - data_start
        if pending and data_size < 0:
            raise c.fail(f"data section would start at offset {data_start}, past the end of the "
                         f"{self.size}-byte file (truncated)")
        for name, ne, gtype, rel_offset, n_bytes in pending:
            if rel_offset % self.alignment:
                raise c.fail(f"tensor {name!r}: offset {rel_offset} is not a multiple of the "
                             f"alignment {self.alignment}")
            if rel_offset > data_size or n_bytes > data_size - rel_offset:
                raise c.fail(
                    f"tensor {name!r}: data [{rel_offset}, {rel_offset + n_bytes}) of the data section "
                    f"extends past the end of the file (data section has {max(data_size, 0)} bytes; "
                    "truncated file?)"
                )
            self.tensors[name] = GGUFTensorInfo(name, ne, gtype, data_start + rel_offset, n_bytes)
        # No two tensors may share bytes: sort by start, each must begin at or after the
        # previous one's end.
        by_start = sorted(self.tensors.values(), key=lambda t: (t.offset, t.n_bytes))
        for prev, cur in zip(by_start, by_start[1:]):
            if cur.offset < prev.offset + prev.n_bytes:
                raise c.fail(
                    f"tensors {prev.name!r} and {cur.name!r} overlap (bytes "
                    f"[{prev.offset}, {prev.offset + prev.n_bytes}) and [{cur.offset}, "
                    f"{cur.offset + cur.n_bytes}))"
                )

    def _read_value(self, c: _Cursor, vtype: int, key: str) -> Any:
        if vtype == T_STRING:
            return c.string(f"value of {quote(key)}")
        if vtype == T_ARRAY:
            return self._read_array(c, key)
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise c.fail(f"metadata {quote(key)} has unknown value type {vtype} (known: 0-12)")
        st = fmt[0]
        c.need(st.size, f"value of {quote(key)}")
        (v,) = st.unpack_from(c.buf, c.pos)
        c.pos += st.size
        return bool(v) if vtype == T_BOOL else v

    def _read_array(self, c: _Cursor, key: str) -> list[Any]:
        etype = c.u32(f"element type of array {quote(key)}")
        count = c.u64(f"length of array {quote(key)}")
        if count > MAX_ARRAY_ELEMENTS:
            raise c.fail(f"array {quote(key)} declares {count} elements, above the limit of "
                         f"{MAX_ARRAY_ELEMENTS}")
        if etype == T_STRING:
            # Each string needs at least its 8-byte length: bound the count before looping.
            if count * 8 > c.left():
                raise c.fail(f"array {quote(key)} declares {count} strings but only {c.left()} bytes remain")
            return self._read_string_array(c, key, count)
        if etype == T_ARRAY:
            raise c.fail(f"array {quote(key)} holds arrays; nested arrays are not supported")
        fmt = _SCALAR_FORMATS.get(etype)
        if fmt is None:
            raise c.fail(f"array {quote(key)} has unknown element type {etype} (known: 0-12)")
        width = fmt[0].size
        c.need(count * width, f"array {quote(key)} of {count} {_TYPE_NAMES[etype]}")
        values = np.frombuffer(c.buf, dtype=fmt[1], count=count, offset=c.pos)
        c.pos += count * width
        out = values.tolist()  # copies into Python objects; the mmap view is dropped
        del values
        return [bool(v) for v in out] if etype == T_BOOL else out

    def _read_string_array(self, c: _Cursor, key: str, count: int) -> list[str]:
        # Hot path for tokenizer vocabularies (50k-250k entries): locals, no per-item method calls.
        buf, pos, size = c.buf, c.pos, c.size
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if pos + 8 > size:
                c.pos = pos
                raise c.fail(f"array {quote(key)}: string #{i} length is past the end of the file")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                c.pos = pos
                raise c.fail(f"array {quote(key)}: string #{i} declares {n} bytes but only "
                             f"{size - pos} remain")
            try:
                append(buf[pos:pos + n].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise c.fail(f"array {quote(key)}: string #{i} is not valid UTF-8 ({e.reason})") from None
            pos += n
        c.pos = pos
        return out

    def _alignment(self, c: _Cursor) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        value, vtype = self.metadata["general.alignment"], self.metadata_types["general.alignment"]
        if vtype not in _INT_TYPES:
            raise c.fail(f"general.alignment must be an integer, got a {_TYPE_NAMES[vtype]}")
        if value <= 0 or value & (value - 1):
            raise c.fail(f"general.alignment must be a nonzero power of two, got {value}")
        return value

    def _read_tensor_info(self, c: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLType, int, int]:
        raw = c.raw_string(f"name of tensor #{i}")
        if not raw:
            raise c.fail(f"tensor #{i} has an empty name")
        if len(raw) > MAX_TENSOR_NAME_BYTES:
            raise c.fail(f"tensor #{i} name is {len(raw)} bytes; ggml allows at most "
                         f"{MAX_TENSOR_NAME_BYTES}")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise c.fail(f"tensor #{i} name is not valid UTF-8") from None
        n_dims = c.u32(f"n_dims of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise c.fail(f"tensor {name!r} has {n_dims} dimensions; at most {MAX_DIMS} are allowed")
        ne = []
        n_elements = 1
        for d in range(n_dims):
            v = c.u64(f"dimension {d} of tensor {name!r}")
            if v >= 1 << 63:
                raise c.fail(f"tensor {name!r}: dimension {d} is negative ({v - (1 << 64)})")
            if v == 0:
                raise c.fail(f"tensor {name!r}: dimension {d} is zero")
            # Checked multiplication: both factors are <= 2^62 here, so the product is exact and
            # bounded before the comparison.
            if v > MAX_ELEMENTS or n_elements * v > MAX_ELEMENTS:
                raise c.fail(f"tensor {name!r}: shape {ne + [v]}... has more than 2^62 elements")
            n_elements *= v
            ne.append(v)
        type_id = c.u32(f"type of tensor {name!r}")
        gtype = GGML_TYPES.get(type_id)
        if gtype is None:
            raise c.fail(f"tensor {name!r} has unknown ggml type {type_id}")
        rel_offset = c.u64(f"offset of tensor {name!r}")
        inner = ne[0] if ne else 1
        if inner % gtype.block_size:
            raise c.fail(
                f"tensor {name!r}: innermost dimension {inner} is not a multiple of the "
                f"{gtype.name} block size {gtype.block_size}"
            )
        n_bytes = n_elements // gtype.block_size * gtype.type_size
        return name, tuple(ne), gtype, rel_offset, n_bytes

    # ---- data ---------------------------------------------------------------------------------
    def raw(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """uint8 view of bytes [start, stop) of a tensor's data (zero-copy; valid until close())."""
        if self._mm is None:
            raise ValueError(f"{self.path}: GGUF file is closed")
        t = self.tensors[name]
        stop = t.n_bytes if stop is None else stop
        if not 0 <= start <= stop <= t.n_bytes:
            raise ValueError(f"byte range [{start}, {stop}) outside tensor {name!r} ({t.n_bytes} bytes)")
        return np.frombuffer(self._mm, dtype=np.uint8, count=stop - start, offset=t.offset + start)

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a caller still holds a raw() view; the mapping goes when that view does
