"""A validating GGUF (v2/v3, little-endian) reader exposed as a :class:`TensorSource`.

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
allocated from it (docs/design.md §8, notes/reliability.md §1): a declared length or count is
compared with the bytes left, shapes use bounded integer arithmetic, and every tensor must lie
inside the file, aligned and not overlapping another. Any violation raises
:class:`ModelFormatError` naming the file and the problem. Data are read lazily from a
read-only mmap; :meth:`GGUFSource.get` returns tensors that own their memory.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import ConfigError, ModelFormatError, quote
from engine.loading.gguf_quants import GGML_TYPES, GGMLType, can_dequantize, dequantize
from engine.loading.source import TensorInfo, TensorSource, expert_name
from engine.loading.validate import CountFields

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


# ---- GGUF name -> canonical name ----------------------------------------------------------------
# Per-layer components: GGUF "blk.N.<component>.<weight|bias>" -> canonical suffix after
# "model.layers.N.".
_LAYER_COMPONENTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_STACKED_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_SPLIT_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
# llama.cpp's converter permutes q/k rows into interleaved-rope order for these architectures.
_PERMUTED_ARCHS = ("llama",)


@dataclass(frozen=True)
class _Entry:
    gguf_name: str
    shape: tuple[int, ...]  # canonical logical shape
    expert: int | None = None  # index into a stacked [E, out, in] tensor
    unpermute_heads: int = 0  # >0: undo llama.cpp's q/k row permutation with this many heads
    load: object = None  # ArchSpec.gguf_split: load(source) builds the tensor (e.g. from two)


class GGUFSource(TensorSource):
    """A GGUF file's tensors under canonical names (see engine.loading.source).

    ``metadata`` is the parsed key/value dict, ``config`` the :class:`ModelConfig` built from it,
    ``tensor_infos`` the raw per-GGUF-name :class:`GGUFTensorInfo` map, ``unmapped`` the GGUF
    tensor names with no canonical counterpart (e.g. ``rope_freqs.weight``), which are not
    served by :meth:`get`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(Path(path))
        from engine.loading.gguf_split import open_gguf

        self._file = open_gguf(self.path)  # one file, or every shard of a split model
        try:
            self.metadata: dict[str, Any] = self._file.metadata
            self.tensor_infos: dict[str, GGUFTensorInfo] = self._file.tensors
            meta = dict(self.metadata)
            meta["_tied_embeddings"] = "output.weight" not in self.tensor_infos
            meta["_attention_bias"] = "blk.0.attn_q.bias" in self.tensor_infos
            if "rope_freqs.weight" in self.tensor_infos:
                # Llama 3.x GGUFs carry their rope scaling as per-frequency divisors in a tensor,
                # not as metadata; the config applies them to the inverse frequencies.
                meta["_rope_freq_factors"] = self._rope_freq_factors()
            self._check_vocabulary()
            try:
                self.config: ModelConfig = ModelConfig.from_gguf_metadata(meta, source=self.path)
            except ConfigError as e:  # a value out of range: name the file it came from
                raise self._fail(str(e)) from None
            except (ArithmeticError, AttributeError, KeyError) as e:
                # from_gguf_metadata maps TypeError/ValueError itself; a zero head count or a
                # value of an unexpected kind can still escape as these.
                raise self._fail(f"bad metadata value ({type(e).__name__}): {quote(str(e), 80)}") from None
            garch = self.metadata.get("general.architecture")
            self.count_fields = CountFields(self.path, f"{garch}.block_count", f"{garch}.expert_count")
            self._entries: dict[str, _Entry] = {}
            self.unmapped: list[str] = []
            self._build_entries()
        except BaseException:
            self._file.close()
            raise

    def _check_vocabulary(self) -> None:
        """The tokenizer's token list must match the embedding rows one to one (as llama.cpp
        requires): with fewer tokens the model can generate ids nothing decodes, with more the
        tokenizer can produce ids the embedding has no row for. Special-token ids must be
        integers inside the vocabulary."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if tokens is not None and (self.metadata_type("tokenizer.ggml.tokens") != T_ARRAY
                                   or not all(isinstance(t, str) for t in tokens)):
            raise self._fail("tokenizer.ggml.tokens must be an array of strings")
        embd = self.tensor_infos.get("token_embd.weight")
        rows = embd.shape[0] if embd is not None else None
        if tokens is not None and rows is not None and len(tokens) != rows:
            raise self._fail(
                f"the tokenizer has {len(tokens)} tokens (tokenizer.ggml.tokens) but the "
                f"embedding token_embd.weight has {rows} rows; they must be equal, or the model "
                "produces ids the tokenizer cannot decode (or the reverse)")
        vocab = len(tokens) if tokens is not None else rows
        for key in SPECIAL_TOKEN_KEYS:
            if key not in self.metadata:
                continue
            value = self.metadata[key]
            if self.metadata_type(key) not in _INT_TYPES:
                raise self._fail(f"{key} must be an integer, got a "
                                 f"{_TYPE_NAMES[self.metadata_type(key)]}")
            if vocab is not None and not 0 <= value < vocab:
                raise self._fail(f"{key} {value} is outside the vocabulary ({vocab} tokens)")

    def metadata_type(self, key: str) -> int:
        """GGUF value type id of a metadata key."""
        return self._file.metadata_types[key]

    def _rope_freq_factors(self) -> list[float]:
        from engine.loading.gguf_quants import dequantize

        info = self.tensor_infos["rope_freqs.weight"]
        if len(info.shape) != 1 or info.n_elements > 4096:
            raise self._fail(f"rope_freqs.weight has shape {list(info.shape)}; expected [head_dim / 2]")
        return dequantize(self._file.raw("rope_freqs.weight"), info.type.id, info.n_elements).tolist()

    def _fail(self, problem: str) -> ModelFormatError:
        return ModelFormatError(self.path, problem)

    def _add(self, canonical: str, entry: _Entry) -> None:
        if canonical in self._entries:
            raise self._fail(f"tensors {self._entries[canonical].gguf_name!r} and "
                             f"{entry.gguf_name!r} both map to {canonical!r}")
        self._entries[canonical] = entry

    def _build_entries(self) -> None:
        cfg = self.config
        permuted = self.metadata.get("general.architecture") in _PERMUTED_ARCHS
        from engine.models.registry import get_spec

        own_split = get_spec(cfg.arch).gguf_split
        for gname, t in self.tensor_infos.items():
            shape = t.shape
            own = own_split(gname, shape, cfg) if own_split is not None else None
            if own is not None:  # names of an architecture with its own layers
                for canonical, cshape, expert, *load in own:
                    self._add(canonical, _Entry(gname, tuple(cshape), expert=expert,
                                                load=load[0] if load else None))
                continue
            if gname in _GLOBAL_NAMES:
                self._add(_GLOBAL_NAMES[gname], _Entry(gname, shape))
                continue
            m = _STACKED_EXPERTS_RE.match(gname)
            if m:
                layer, proj = int(m.group(1)), f"{m.group(2)}_proj"
                if len(shape) != 3:
                    raise self._fail(f"stacked expert tensor {gname!r} has shape {list(shape)}; "
                                     "expected [experts, out, in]")
                n_exp = shape[0]
                if cfg.moe is None:
                    raise self._fail(f"stacked expert tensor {gname!r} holds {n_exp} experts but "
                                     "the metadata declares no expert_count")
                if n_exp != cfg.moe.num_experts:
                    raise self._fail(f"stacked expert tensor {gname!r} holds {n_exp} experts; "
                                     f"metadata says expert_count={cfg.moe.num_experts}")
                for j in range(n_exp):
                    self._add(expert_name(layer, j, proj), _Entry(gname, shape[1:], expert=j))
                continue
            m = _SPLIT_EXPERT_RE.match(gname)
            if m:
                layer, proj, j = int(m.group(1)), f"{m.group(2)}_proj", int(m.group(3))
                self._add(expert_name(layer, j, proj), _Entry(gname, shape))
                continue
            m = _LAYER_RE.match(gname)
            if m and m.group(2) in _LAYER_COMPONENTS:
                layer, comp, kind = int(m.group(1)), m.group(2), m.group(3)
                canonical = f"model.layers.{layer}.{_LAYER_COMPONENTS[comp]}.{kind}"
                heads = 0
                if permuted and comp in ("attn_q", "attn_k"):
                    heads = cfg.num_heads if comp == "attn_q" else cfg.num_kv_heads
                    rows = shape[0]
                    if rows % (2 * heads):
                        raise self._fail(f"{gname!r} has {rows} rows, not a multiple of "
                                         f"2 x {heads} heads; cannot undo the rope permutation")
                if comp == "ffn_gate_inp_shexp":
                    # Written as [H] by llama.cpp's converter (or [1, H]); canonical is [1, H].
                    if t.n_elements != shape[-1]:
                        raise self._fail(f"{gname!r} has shape {list(shape)}; expected [H] or [1, H]")
                    shape = (1, shape[-1])
                self._add(canonical, _Entry(gname, shape, unpermute_heads=heads))
                continue
            self.unmapped.append(gname)

    # ---- TensorSource -------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> TensorInfo:
        e = self._entries[name]
        return TensorInfo(name=name, shape=e.shape, dtype=self.tensor_infos[e.gguf_name].type.name)

    def get(self, name: str) -> torch.Tensor:
        e = self._entries[name]  # KeyError for unknown names, as the ABC specifies
        if e.load is not None:
            return e.load(self)
        t = self.tensor_infos[e.gguf_name]
        if e.expert is None:
            start, stop = 0, t.n_bytes
        else:
            # One expert of a stacked [E, out, in] tensor is a contiguous run of whole rows, and
            # rows are whole blocks, so its bytes are exactly 1/E of the tensor's.
            per = t.n_bytes // t.shape[0]
            start, stop = e.expert * per, (e.expert + 1) * per
        n = 1
        for d in e.shape:
            n *= d
        raw = self._file.raw(e.gguf_name, start, stop)
        try:
            out = self._decode(raw, t.type, n, name)
        finally:
            del raw  # drop the mmap view so close() can unmap
        out = out.reshape(e.shape)
        if e.unpermute_heads:
            out = _unpermute_rope_rows(out, e.unpermute_heads)
        return out

    def raw(self, name: str) -> tuple[np.ndarray, GGMLType]:
        """The stored bytes of a canonical tensor, undecoded: (uint8 [*shape[:-1], row_bytes], type).

        Lets a converter keep GGUF quantization (e.g. copy one expert's Q4_K blocks into the
        expert store) without a dequantize/requantize round trip. Rows are whole blocks, so the
        llama q/k rope unpermute is applied to the rows of bytes. The array owns its memory."""
        e = self._entries[name]
        t = self.tensor_infos[e.gguf_name]
        per = t.n_bytes // t.shape[0] if e.expert is not None else t.n_bytes
        start = per * e.expert if e.expert is not None else 0
        view = self._file.raw(e.gguf_name, start, start + per)
        rows = view.copy().reshape(*e.shape[:-1], -1)
        del view
        if e.unpermute_heads:
            rows = _unpermute_rope_rows(torch.from_numpy(rows), e.unpermute_heads).numpy()
        return rows, t.type

    def stored_tensor(self, gguf_name: str) -> torch.Tensor:
        """A tensor by its GGUF name, decoded to float (for ArchSpec.gguf_split loaders that
        build one canonical tensor from several stored ones)."""
        t = self.tensor_infos[gguf_name]
        raw = self._file.raw(gguf_name)
        try:
            return self._decode(raw, t.type, t.n_elements, gguf_name).reshape(t.shape)
        finally:
            del raw

    def get_quantized(self, name: str, fmt) -> object | None:
        """``name`` as a QuantizedTensor in ``fmt`` without re-quantizing, when it is stored in
        that format (GGML MXFP4 -> the ``mxfp4`` store format: the same values; the nibbles are
        reordered from ggml's j | j+16 pairs to 2j | 2j+1), else None."""
        e = self._entries[name]
        if fmt.name != "mxfp4" or self.tensor_infos[e.gguf_name].type.name != "mxfp4" or len(e.shape) != 2:
            return None
        from engine.quant.formats import QuantizedTensor

        rows, _ = self.raw(name)  # uint8 [out, in/32 * 17]
        out, inp = e.shape
        blocks = torch.from_numpy(rows).reshape(out, inp // 32, 17)
        qs = blocks[:, :, 1:]
        codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # [out, G, 32] in weight order
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(out, inp // 2).contiguous()
        return QuantizedTensor(fmt, (out, inp), {"codes": packed, "scales": blocks[:, :, 0].contiguous()})

    def _decode(self, raw: np.ndarray, gtype: GGMLType, n: int, name: str) -> torch.Tensor:
        if gtype.name == "f32":
            return torch.from_numpy(raw.view("<f4").copy())
        if gtype.name == "f16":
            return torch.from_numpy(raw.view("<f2").copy())
        if gtype.name == "bf16":
            return torch.from_numpy(raw.view("<i2").copy()).view(torch.bfloat16)
        if not can_dequantize(gtype.id):
            raise self._fail(f"tensor {name!r} is stored as ggml type {gtype.name}, which moestream "
                             "cannot dequantize")
        return torch.from_numpy(dequantize(raw, gtype.id, n))

    def close(self) -> None:
        self._file.close()


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf ``LlamaModel.permute``).

    HF keeps each head's rows as [2, D/2] (the two rotate_half halves); llama.cpp rewrites them
    as [D/2, 2] (interleaved pairs, ggml's "normal" rope). So the file's rows, viewed as
    [n_heads, D/2, 2, ...], are transposed back to [n_heads, 2, D/2, ...]. Works for weights
    [rows, H] and biases [rows].
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
