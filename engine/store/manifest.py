"""The expert store's ``manifest.json``: schema (pydantic v2) and structural validation.

A store is one directory::

    manifest.json            this schema; written last (temp file, fsync, rename)
    dense.safetensors        every non-routed-expert tensor under canonical names
    experts-L{layer:03d}.bin routed experts of one MoE layer, one pack_expert blob each,
                             every blob starting at a multiple of BLOB_ALIGN (4 KiB), zero padded
    tokenizer/               the tokenizer (transformers save_pretrained), optional; its files
                             and their digests are listed in the manifest

Each blob's digest binds its identity: ``sha256(blob_identity(layer, expert, quant) + blob)``
(:func:`blob_digest`), so a manifest that swaps two experts' offsets and digests is caught like
a flipped byte. Stores of schema 1 (digests over the bytes alone) are refused with a
"re-convert" error. Each blob also has a check, ``xxh3_64`` over the same identity and bytes
(:func:`blob_check`): what a read verifies, at ~50 GB/s on one core against sha256's ~1.6 GB/s
(hashing a 2.65 MB expert took 1.6 ms, as long as reading it). The sha256 stays for ``moestream
verify`` and for stores written before the check (their reads fall back to it).

Invariants checked by :func:`check_manifest` (every failure is a ``ModelFormatError`` naming the
manifest and the problem, raised before any data file is opened and before anything
proportional to a count the manifest declares is built):

- ``schema_version`` is 2; every file name is a plain relative name (no ``/``, ``\\``, ``..``);
- the model config's fields have their declared types; its layer count fits the dense file
  (every layer needs at least :data:`MIN_DENSE_BYTES_PER_LAYER` bytes of it) and its routed
  expert count (MoE layers x experts, computed, not enumerated) fits the data files (one 4 KiB
  slot per blob) and equals the number of entries;
- every blob offset is a multiple of 4096 and ``[offset, offset + nbytes)`` lies inside the size
  the manifest records for its data file; blobs of one file do not overlap;
- each ``(layer, expert)`` appears once and is a routed expert of the model config;
- each blob's layout is in the store's quant format and says the blob's own size.

:func:`load_manifest` also refuses, before reading it, a manifest larger than the store's files
could justify (:data:`MANIFEST_BASE_BYTES` plus one byte per byte of dense and expert data: an
entry's JSON is far smaller than the 4 KiB its blob occupies at least), so a manifest listing
200,000 extra entries is refused by its size, not parsed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import ConfigError, ModelFormatError, MoestreamError, quote

SCHEMA_VERSION = 2  # 2: blob digests bind (layer, expert, quant); tokenizer files listed
BLOB_ALIGN = 4096  # every expert blob starts at a multiple of this (O_DIRECT, page aligned)
MANIFEST_NAME = "manifest.json"
DENSE_NAME = "dense.safetensors"
TOKENIZER_DIR = "tokenizer"
MAX_MANIFEST_BYTES = 256 << 20  # 24k experts x ~1.3 KB of layout each is ~32 MB
MANIFEST_BASE_BYTES = 1 << 20  # model config, totals, ...: what a manifest may hold beyond its entries
MAX_TOKENIZER_FILES = 256
# Every decoder layer has at least six tensors in the dense file (two norms, q/k/v/o), each with
# a safetensors header entry of more than 64 bytes, and two norms of hidden_size >= 2-byte values.
MIN_DENSE_BYTES_PER_LAYER = 6 * 64
RECONVERT_HINT = "re-convert it: moestream convert SRC --out STORE --overwrite"


def layer_file_name(layer: int) -> str:
    return f"experts-L{layer:03d}.bin"


def align_up(n: int, a: int = BLOB_ALIGN) -> int:
    return (n + a - 1) // a * a


def blob_identity(layer: int, expert: int, quant_format: str, group_size: int) -> bytes:
    """What a blob claims to be, hashed ahead of its bytes (:func:`blob_digest`)."""
    return (f"moestream expert blob v{SCHEMA_VERSION}\nlayer {layer}\nexpert {expert}\n"
            f"format {quant_format} g{group_size}\n").encode()


def blob_digest(layer: int, expert: int, quant_format: str, group_size: int, data: Any) -> str:
    """sha256 over the blob's identity and its bytes: intact *and* the expert it claims to be."""
    h = hashlib.sha256(blob_identity(layer, expert, quant_format, group_size))
    h.update(data)
    return h.hexdigest()


def blob_check(layer: int, expert: int, quant_format: str, group_size: int, data: Any) -> str:
    """xxh3_64 over the blob's identity and its bytes (:func:`blob_digest`'s input): the check a
    read makes. Not a cryptographic digest: it catches corruption and a misplaced blob, as the
    manifest beside it cannot vouch against a deliberate change either."""
    h = xxhash.xxh3_64(blob_identity(layer, expert, quant_format, group_size))
    h.update(data)
    return h.hexdigest()


class _Model(BaseModel):
    # strict: a JSON "4096" or 4096.0 is not an offset; forbid: a misspelt field is an error.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SourceInfo(_Model):
    path: str = Field(description="Absolute path of the checkpoint the store was converted from.")
    kind: Literal["hf", "gguf"] = Field(description="Source format: Hugging Face directory or GGUF file.")
    fingerprint: str = Field(
        description="sha256 over (name, size, mtime_ns) of the source files; identifies the source "
                    "version without reading its data.")


class QuantInfo(_Model):
    format: str = Field(description="Expert weight format: int4, nf4, int8 or bf16 (engine.quant.formats).")
    group_size: int = Field(description="Weights per scale group along the input dimension (32, 64, 128).")


class DenseInfo(_Model):
    file: str = Field(description="Name of the safetensors file holding every non-expert tensor.")
    nbytes: int = Field(ge=8, description="Size of that file in bytes.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the whole file.")
    dtype: str = Field(description="Floating dtype(s) the dense tensors are stored in, e.g. 'f32', "
                                   "'bf16', or 'bf16+f32' when mixed.")


class DataFile(_Model):
    nbytes: int = Field(ge=0, description="Size in bytes of the data file as written (padding included).")


class ExpertEntry(_Model):
    layer: int = Field(ge=0, description="Decoder layer index (a MoE layer of the model config).")
    expert: int = Field(ge=0, description="Routed expert index within the layer.")
    file: str = Field(description="Data file holding the blob (a plain name inside the store).")
    offset: int = Field(ge=0, description="Byte offset of the blob in the file; a multiple of 4096.")
    nbytes: int = Field(gt=0, description="Blob size in bytes, padding excluded.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
                        description="blob_digest: sha256 of the blob's identity (layer, expert, quant "
                                    "format) followed by its nbytes bytes.")
    xxh3: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$",
                             description="blob_check: xxh3_64 of the same identity and bytes, what a "
                                         "read verifies; absent in stores written before it (reads "
                                         "verify the sha256 then).")
    layout: dict[str, Any] = Field(
        description="The layout dict engine.quant.expert_blob.pack_expert returned for this blob "
                    "(format, per-projection part offsets, dtypes and shapes).")


class PLETableEntry(_Model):
    layer: int = Field(ge=0, description="Decoder layer whose PLE n-gram table this is.")
    file: str = Field(description="Row file (engine.store.ple_rows) inside the store.")
    num_rows: int = Field(gt=0, description="Rows of the table (the layer's padded n-gram vocabulary).")
    row_dim: int = Field(gt=0, description="Values per row (ple_embed_dim / n-gram heads).")
    dtype: Literal["fp32", "bf16", "fp16", "fp8_e4m3", "int8"] = Field(
        description="Row encoding: the checkpoint's precision, or int8 with a per-row fp32 scale.")
    nbytes: int = Field(gt=0, description="Size of the row file (header page and page padding included).")
    shards: list[list[int]] = Field(description="Shapes of the checkpoint's split_ngram_parts shards, in row order.")


class StoreTotals(_Model):
    num_moe_layers: int = Field(ge=0, description="Number of layers with routed experts.")
    num_experts: int = Field(ge=0, description="Routed expert blobs in the store (layers x experts).")
    expert_params: int = Field(ge=0, description="Weights in all routed experts (3 x H x I each).")
    expert_bytes: int = Field(ge=0, description="Sum of the expert blobs' sizes, padding excluded.")
    expert_file_bytes: int = Field(ge=0, description="Sum of the expert data files' sizes, 4 KiB padding included.")
    dense_bytes: int = Field(ge=0, description="Size of the dense safetensors file.")
    total_bytes: int = Field(ge=0, description="expert_file_bytes + dense_bytes.")
    bits_per_weight: float = Field(ge=0, description="Nominal bits per expert weight of the quant "
                                                     "format, group metadata included.")


class ConversionInfo(_Model):
    created_at: str = Field(description="UTC time the manifest was written (ISO 8601).")
    moestream_version: str = Field(description="Version of the moestream that wrote the store.")
    dense_dtype: Literal["auto", "bf16", "fp32"] = Field(
        description="The dense dtype policy convert was asked for (auto keeps f16/bf16/f32 as stored).")


class StoreManifest(_Model):
    schema_version: Literal[2] = Field(description="Manifest schema version; this reader knows 2.")
    source: SourceInfo = Field(description="Where the store was converted from.")
    model_config_: dict[str, Any] = Field(
        alias="model_config",
        description="engine.config.ModelConfig.to_dict() of the converted model (generation eos ids included).")
    quant: QuantInfo = Field(description="Format of every routed expert blob (QuantFormat.to_dict()).")
    dense: DenseInfo = Field(description="The non-expert weights file.")
    tokenizer_dir: Optional[str] = Field(
        description="Directory (inside the store) holding the tokenizer, or null when the source had none.")
    tokenizer_files: dict[str, str] = Field(
        max_length=MAX_TOKENIZER_FILES,
        description="Every file convert wrote into tokenizer_dir -> its sha256 (empty without one).")
    data_files: dict[str, DataFile] = Field(description="Every expert data file and its size.")
    experts: list[ExpertEntry] = Field(description="One entry per routed expert, sorted by (layer, expert).")
    totals: StoreTotals = Field(description="Aggregate sizes, for summaries and budgeting.")
    conversion: ConversionInfo = Field(description="When and how the store was written.")
    ple_tables: list[PLETableEntry] = Field(
        default_factory=list, description="One row file per PLE layer (qwen4_exp), in layer order; "
                                          "read row by row at run time, never loaded whole.")

    # ``model_config`` is pydantic's own class attribute, so the field is ``model_config_`` in
    # Python and ``model_config`` in JSON.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)

    def digest_of(self, layer: int, expert: int, data: Any) -> str:
        """:func:`blob_digest` of ``data`` as the blob of (layer, expert) in this store's format."""
        return blob_digest(layer, expert, self.quant.format, self.quant.group_size, data)

    def check_of(self, layer: int, expert: int, data: Any) -> str:
        """:func:`blob_check` of ``data`` as the blob of (layer, expert) in this store's format."""
        return blob_check(layer, expert, self.quant.format, self.quant.group_size, data)


def plain_name(name: object) -> bool:
    """A file name that stays inside the directory it is joined to."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and not os.path.isabs(name)
            and Path(name).name == name)


# ------------------------------------------------------------------------- model config checks

def _type_problem(value: object, hint: object) -> str | None:
    """Why ``value`` is not of the (simple) annotated type ``hint``, or None."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _type_problem(value, next(a for a in args if a is not type(None)))
    if origin is tuple:
        if not isinstance(value, tuple):
            return f"{quote(value)} is not a list"
        return next((p for v in value if (p := _type_problem(v, args[0])) is not None), None)
    if dataclasses.is_dataclass(hint):
        return _config_type_problem(value) if isinstance(value, hint) else f"{quote(value)} is not an object"
    if hint is int and type(value) is not int:
        return f"{quote(value)} is not an integer"
    if hint is bool and type(value) is not bool:
        return f"{quote(value)} is not true/false"
    if hint is float and (type(value) not in (int, float) or not math.isfinite(value)):
        return f"{quote(value)} is not a finite number"
    if hint is str and type(value) is not str:
        return f"{quote(value)} is not a string"
    return None


def _config_type_problem(obj: object) -> str | None:
    """The first field of a config dataclass (recursively) whose value has the wrong type."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        problem = _type_problem(getattr(obj, f.name), hints[f.name])
        if problem is not None:
            return f"{f.name}: {problem}"
    return None


def parse_model_config(raw: Mapping[str, Any], path: object):
    """``config_from_dict`` (engine.configio.plain) with every failure (and every wrongly typed
    field) a ModelFormatError naming ``path``."""
    from engine.configio.plain import config_from_dict

    try:
        config = config_from_dict(raw)
    except (MoestreamError, TypeError, KeyError, ValueError, AttributeError, ArithmeticError) as e:
        raise ModelFormatError(path, f"model_config: {type(e).__name__}: {str(e)[:200]}") from None
    problem = _config_type_problem(config)
    if problem is not None:
        raise ModelFormatError(path, f"model_config: {problem}")
    return config


def is_moe_layer(config, layer: int, mlp_only: frozenset[int]) -> bool:
    """``config.is_moe_layer`` for an index that may lie outside the model, with a set lookup."""
    m = config.moe
    return (m is not None and 0 <= layer < config.num_layers and layer not in mlp_only
            and (layer + 1) % m.decoder_sparse_step == 0)


# ------------------------------------------------------------------------------- the manifest

def _check_names(m: StoreManifest, bad: Callable[[str], ModelFormatError]) -> None:
    if not plain_name(m.dense.file):
        raise bad(f"dense file {quote(m.dense.file)} must be a plain file name inside the store "
                  f"(no '/', '\\' or '..')")
    if m.tokenizer_dir is not None and not plain_name(m.tokenizer_dir):
        raise bad(f"tokenizer_dir {quote(m.tokenizer_dir)} must be a plain directory name inside the store")
    if m.tokenizer_dir is None and m.tokenizer_files:
        raise bad("tokenizer_files lists files but tokenizer_dir is null")
    for name, digest in m.tokenizer_files.items():
        if not plain_name(name) or not (isinstance(digest, str) and len(digest) == 64
                                        and all(c in "0123456789abcdef" for c in digest)):
            raise bad(f"tokenizer_files entry {quote(name)} needs a plain file name and a sha256 hex digest")
    for name in m.data_files:
        if not plain_name(name):
            raise bad(f"data file {quote(name)} must be a plain file name inside the store "
                      f"(no '/', '\\' or '..')")
        if name in (m.dense.file, MANIFEST_NAME, m.tokenizer_dir):
            raise bad(f"data file {quote(name)} collides with another file of the store")


def _check_capacity(m: StoreManifest, config, bad: Callable[[str], ModelFormatError]) -> int:
    """Declared counts against what the files (as the manifest records them; the readers check
    the files' real sizes before using them) can hold, computed, not enumerated; returns the
    number of routed experts the model config declares."""
    dense_cap = m.dense.nbytes
    if config.num_layers * MIN_DENSE_BYTES_PER_LAYER > dense_cap:
        raise bad(f"model_config declares {config.num_layers} layers, but {m.dense.file} "
                  f"({dense_cap} bytes) can hold at most {dense_cap // MIN_DENSE_BYTES_PER_LAYER}")
    n_exp = config.moe.num_experts if config.moe is not None else 0
    n_moe = config.num_moe_layers
    declared = n_moe * n_exp
    slots = sum(-(-f.nbytes // BLOB_ALIGN) for f in m.data_files.values())
    if declared > slots:
        raise bad(f"model_config declares {declared} routed experts ({n_exp} in each of {n_moe} MoE "
                  f"layers), but the data files can hold at most {slots} blobs of {BLOB_ALIGN} bytes")
    return declared


def _first_missing(config, by_layer: dict[int, set[int]], mlp_only: frozenset[int]) -> tuple[int, int]:
    """The first routed expert without an entry, when fewer entries than experts exist; at most
    (entries + mlp_only_layers + 1) steps."""
    for layer in sorted(by_layer):
        got = by_layer[layer]
        if len(got) < config.moe.num_experts:
            return layer, next(j for j in range(len(got) + 1) if j not in got)
    step = config.moe.decoder_sparse_step
    layer = step - 1
    while layer in by_layer or layer in mlp_only:
        layer += step
    return layer, 0


def _check_entries(m: StoreManifest, config, fmt, declared: int,
                   bad: Callable[[str], ModelFormatError]) -> None:
    n_exp = config.moe.num_experts if config.moe is not None else 0
    mlp_only = frozenset(config.moe.mlp_only_layers) if config.moe is not None else frozenset()
    by_layer: dict[int, set[int]] = {}
    by_file: dict[str, list[ExpertEntry]] = {}
    want_layout_fmt = fmt.to_dict()
    for e in m.experts:
        where = f"expert entry (layer {e.layer}, expert {e.expert})"
        if e.expert in by_layer.get(e.layer, ()):
            raise bad(f"duplicate {where}")
        by_layer.setdefault(e.layer, set()).add(e.expert)
        if not is_moe_layer(config, e.layer, mlp_only) or e.expert >= n_exp:
            raise bad(f"{where} is not a routed expert of the model ({config.num_layers} layers, "
                      f"{n_exp} experts in each MoE layer)")
        if not plain_name(e.file):
            raise bad(f"{where}: file {quote(e.file)} must be a plain file name inside the store "
                      f"(no '/', '\\' or '..')")
        if e.file not in m.data_files:
            raise bad(f"{where}: file {quote(e.file)} is not listed in data_files")
        if e.offset % BLOB_ALIGN:
            raise bad(f"{where}: offset {e.offset} is not a multiple of {BLOB_ALIGN}")
        size = m.data_files[e.file].nbytes
        if e.offset + e.nbytes > size:
            raise bad(f"{where}: blob [{e.offset}, {e.offset + e.nbytes}) lies beyond the end of "
                      f"{e.file} ({size} bytes)")
        lay_fmt = e.layout.get("format")
        if lay_fmt != want_layout_fmt:
            raise bad(f"{where}: layout format {quote(lay_fmt)} is not the store's quant {want_layout_fmt}")
        if e.layout.get("nbytes") != e.nbytes:
            raise bad(f"{where}: layout says {quote(e.layout.get('nbytes'))} bytes, entry says {e.nbytes}")
        by_file.setdefault(e.file, []).append(e)
    # Every entry is a distinct routed expert of the model, so there are at most as many as it
    # declares, and as many exactly when every routed expert has one.
    if len(m.experts) < declared:
        layer, expert = _first_missing(config, by_layer, mlp_only)
        more = declared - len(m.experts) - 1
        raise bad(f"missing expert entry (layer {layer}, expert {expert})"
                  f"{f' and {more} more' if more else ''}; the model config declares {declared} "
                  f"routed experts ({n_exp} in each of {config.num_moe_layers} MoE layers)")
    if m.totals.num_experts != len(m.experts):
        raise bad(f"totals.num_experts is {m.totals.num_experts} but there are {len(m.experts)} entries")
    for name, entries in by_file.items():
        entries.sort(key=lambda x: x.offset)
        for a, b in zip(entries, entries[1:]):
            if a.offset + a.nbytes > b.offset:
                raise bad(f"{name}: blob of (layer {a.layer}, expert {a.expert}) at "
                          f"[{a.offset}, {a.offset + a.nbytes}) overlaps blob of "
                          f"(layer {b.layer}, expert {b.expert}) at [{b.offset}, {b.offset + b.nbytes})")


def check_manifest(m: StoreManifest, path: object) -> None:
    """Structural invariants (module docstring); raises ModelFormatError(path, problem)."""
    from engine.quant.formats import QuantFormat

    def bad(problem: str) -> ModelFormatError:
        return ModelFormatError(path, problem)

    try:
        fmt = QuantFormat.from_dict({"name": m.quant.format, "group_size": m.quant.group_size})
    except ConfigError as e:
        raise bad(f"quant: {e}") from None
    config = parse_model_config(m.model_config_, path)
    _check_names(m, bad)
    declared = _check_capacity(m, config, bad)
    _check_entries(m, config, fmt, declared, bad)


def parse_manifest(text: str | bytes, path: object = MANIFEST_NAME) -> StoreManifest:
    """Parse and validate manifest JSON text."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise ModelFormatError(path, f"manifest is {len(text)} bytes, over the "
                                     f"{MAX_MANIFEST_BYTES}-byte limit")
    try:
        raw = _load_shared(text)
    except (ValueError, TypeError, RecursionError) as e:  # JSONDecodeError, NaN/Infinity, bad bytes
        raise ModelFormatError(path, f"invalid manifest: not JSON: {e}") from None
    try:
        m = StoreManifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors(include_url=False, include_context=False, include_input=False)[0]
        loc = ".".join(str(p) for p in first["loc"]) or "<top>"
        if loc == "schema_version":
            version = raw.get("schema_version") if isinstance(raw, dict) else None
            raise ModelFormatError(path, _schema_problem(version)) from None
        n = e.error_count()
        more = f" (and {n - 1} more problems)" if n > 1 else ""
        raise ModelFormatError(path, f"invalid manifest: {loc}: {first['msg']}{more}") from None
    check_manifest(m, path)
    return m


def _schema_problem(raw: object) -> str:
    if type(raw) is int and 1 <= raw < SCHEMA_VERSION:
        return (f"store written by an older moestream (schema_version {raw}: expert digests do not "
                f"bind the expert's identity); this moestream reads schema_version {SCHEMA_VERSION}; "
                f"{RECONVERT_HINT}")
    shown = quote(raw) if type(raw) in (int, type(None)) else f"of type {type(raw).__name__}"
    return (f"schema_version {shown} is not supported; this moestream reads schema_version "
            f"{SCHEMA_VERSION}")


def _load_shared(text: str | bytes) -> Any:
    """The JSON value of ``text`` with every object equal to one seen before replaced by that one
    (objects are built innermost first, so equal nested objects are one object by the time their
    parent is compared). A store's expert entries each carry their blob's layout, ~40 nested
    objects (13 KB of Python) that are equal across a layer or the whole store: parsed one by one
    they left 41 MB of the 8 GB bench store's 3,072 entries in the process (freed, the heap kept
    it: 7 MB parsed this way), ~330 MB at the mission model's 24,576. NaN and Infinity are
    refused (not JSON)."""
    seen: dict[tuple, dict] = {}

    def key(v: Any) -> Any:
        if isinstance(v, list):
            return ("[", *(key(x) for x in v))
        return id(v) if isinstance(v, dict) else (type(v).__name__, v)  # 1 and 1.0 and True differ

    def obj(pairs: list[tuple[str, Any]]) -> dict:
        k = tuple((name, key(v)) for name, v in pairs)
        d = seen.get(k)
        if d is None:
            d = seen[k] = dict(pairs)
        return d

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, object_pairs_hook=obj, parse_constant=constant)


def _file_sizes(root: Path) -> dict[str, int]:
    """Sizes of the regular files directly inside ``root`` (symlinks followed)."""
    sizes = {}
    with os.scandir(root) as it:
        for entry in it:
            try:
                if entry.is_file():
                    sizes[entry.name] = entry.stat().st_size
            except OSError:
                continue
    return sizes


def load_manifest(store_dir: str | os.PathLike[str]) -> StoreManifest:
    """Read ``<store>/manifest.json``; raises ModelFormatError for a missing or bad manifest."""
    root = Path(store_dir)
    if not root.is_dir():
        raise ModelFormatError(root, "not a store directory (does not exist or is not a directory)")
    path = root / MANIFEST_NAME
    try:
        sizes = _file_sizes(root)
    except OSError as e:
        raise ModelFormatError(root, f"cannot list the store directory: {e.strerror}") from None
    if MANIFEST_NAME not in sizes:
        raise ModelFormatError(root, "incomplete store: manifest.json missing; re-run moestream convert")
    size = sizes.pop(MANIFEST_NAME)
    limit = min(MAX_MANIFEST_BYTES, MANIFEST_BASE_BYTES + sum(sizes.values()))
    if size > limit:
        raise ModelFormatError(path, f"manifest is {size} bytes, more than the store's files can "
                                     f"justify (at most {limit}: {MANIFEST_BASE_BYTES} plus one byte "
                                     f"per byte of dense and expert data, capped at {MAX_MANIFEST_BYTES})")
    try:
        text = path.read_bytes()
    except OSError as e:
        raise ModelFormatError(path, f"cannot read: {e.strerror}") from None
    return parse_manifest(text, path)


__all__ = [
    "BLOB_ALIGN", "DENSE_NAME", "MANIFEST_NAME", "SCHEMA_VERSION", "TOKENIZER_DIR",
    "ConversionInfo", "DataFile", "DenseInfo", "ExpertEntry", "QuantInfo", "SourceInfo",
    "StoreManifest", "StoreTotals", "align_up", "blob_check", "blob_digest", "blob_identity", "check_manifest",
    "layer_file_name", "load_manifest", "parse_manifest", "parse_model_config",
    "plain_name",
]


def sha256_file(path: Path) -> str:
    """sha256 of a whole file, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()
