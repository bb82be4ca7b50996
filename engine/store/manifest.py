"""The expert store's ``manifest.json``: schema (pydantic v2) and structural validation.

A store is one directory::

    manifest.json            this schema; written last (temp file, fsync, rename)
    dense.safetensors        every non-routed-expert tensor under canonical names
    experts-L{layer:03d}.bin routed experts of one MoE layer, one pack_expert blob each,
                             every blob starting at a multiple of BLOB_ALIGN (4 KiB), zero padded
    tokenizer/               the tokenizer (transformers save_pretrained), optional

Invariants checked by :func:`check_manifest` (every failure is a ``ModelFormatError`` naming the
manifest and the problem, raised before any data file is opened):

- ``schema_version`` is 1; every file name is a plain relative name (no ``/``, ``\\``, ``..``);
- every blob offset is a multiple of 4096 and ``[offset, offset + nbytes)`` lies inside the size
  the manifest records for its data file; blobs of one file do not overlap;
- each ``(layer, expert)`` appears once, and every expert of every MoE layer of the model config
  is present (and nothing else);
- each blob's layout is in the store's quant format and says the blob's own size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import ConfigError, ModelFormatError, MoestreamError

SCHEMA_VERSION = 1
BLOB_ALIGN = 4096  # every expert blob starts at a multiple of this (O_DIRECT, page aligned)
MANIFEST_NAME = "manifest.json"
DENSE_NAME = "dense.safetensors"
TOKENIZER_DIR = "tokenizer"
MAX_MANIFEST_BYTES = 1 << 30  # 24k experts x ~1 KB of layout each is ~25 MB; 1 GiB is absurd


def layer_file_name(layer: int) -> str:
    return f"experts-L{layer:03d}.bin"


def align_up(n: int, a: int = BLOB_ALIGN) -> int:
    return (n + a - 1) // a * a


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
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the blob's nbytes bytes.")
    layout: dict[str, Any] = Field(
        description="The layout dict engine.quant.formats.pack_expert returned for this blob "
                    "(format, per-projection part offsets, dtypes and shapes).")


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
    schema_version: Literal[1] = Field(description="Manifest schema version; this reader knows 1.")
    source: SourceInfo = Field(description="Where the store was converted from.")
    model_config_: dict[str, Any] = Field(
        alias="model_config",
        description="engine.config.ModelConfig.to_dict() of the converted model (generation eos ids included).")
    quant: QuantInfo = Field(description="Format of every routed expert blob (QuantFormat.to_dict()).")
    dense: DenseInfo = Field(description="The non-expert weights file.")
    tokenizer_dir: Optional[str] = Field(
        description="Directory (inside the store) holding the tokenizer, or null when the source had none.")
    data_files: dict[str, DataFile] = Field(description="Every expert data file and its size.")
    experts: list[ExpertEntry] = Field(description="One entry per routed expert, sorted by (layer, expert).")
    totals: StoreTotals = Field(description="Aggregate sizes, for summaries and budgeting.")
    conversion: ConversionInfo = Field(description="When and how the store was written.")

    # ``model_config`` is pydantic's own class attribute, so the field is ``model_config_`` in
    # Python and ``model_config`` in JSON.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)


def _plain_name(name: object) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and not os.path.isabs(name)
            and Path(name).name == name)


def check_manifest(m: StoreManifest, path: object) -> None:
    """Structural invariants (module docstring); raises ModelFormatError(path, problem)."""
    from engine.config import ModelConfig
    from engine.quant.formats import QuantFormat

    def bad(problem: str) -> ModelFormatError:
        return ModelFormatError(path, problem)

    try:
        fmt = QuantFormat.from_dict({"name": m.quant.format, "group_size": m.quant.group_size})
    except ConfigError as e:
        raise bad(f"quant: {e}") from None
    try:
        config = ModelConfig.from_dict(m.model_config_)
    except (MoestreamError, TypeError, KeyError, ValueError) as e:
        raise bad(f"model_config: {type(e).__name__}: {e}") from None

    if not _plain_name(m.dense.file):
        raise bad(f"dense file {m.dense.file!r} must be a plain file name inside the store "
                  f"(no '/', '\\' or '..')")
    if m.tokenizer_dir is not None and not _plain_name(m.tokenizer_dir):
        raise bad(f"tokenizer_dir {m.tokenizer_dir!r} must be a plain directory name inside the store")
    for name in m.data_files:
        if not _plain_name(name):
            raise bad(f"data file {name!r} must be a plain file name inside the store "
                      f"(no '/', '\\' or '..')")
        if name in (m.dense.file, MANIFEST_NAME):
            raise bad(f"data file {name!r} collides with the store's {name}")

    seen: dict[tuple[int, int], ExpertEntry] = {}
    by_file: dict[str, list[ExpertEntry]] = {}
    want_layout_fmt = fmt.to_dict()
    for e in m.experts:
        where = f"expert entry (layer {e.layer}, expert {e.expert})"
        key = (e.layer, e.expert)
        if key in seen:
            raise bad(f"duplicate {where}")
        seen[key] = e
        if not _plain_name(e.file):
            raise bad(f"{where}: file {e.file!r} must be a plain file name inside the store "
                      f"(no '/', '\\' or '..')")
        if e.file not in m.data_files:
            raise bad(f"{where}: file {e.file!r} is not listed in data_files")
        if e.offset % BLOB_ALIGN:
            raise bad(f"{where}: offset {e.offset} is not a multiple of {BLOB_ALIGN}")
        size = m.data_files[e.file].nbytes
        if e.offset + e.nbytes > size:
            raise bad(f"{where}: blob [{e.offset}, {e.offset + e.nbytes}) lies beyond the end of "
                      f"{e.file} ({size} bytes)")
        lay_fmt = e.layout.get("format")
        if lay_fmt != want_layout_fmt:
            raise bad(f"{where}: layout format {lay_fmt!r} is not the store's quant {want_layout_fmt}")
        if e.layout.get("nbytes") != e.nbytes:
            raise bad(f"{where}: layout says {e.layout.get('nbytes')!r} bytes, entry says {e.nbytes}")
        by_file.setdefault(e.file, []).append(e)

    for name, entries in by_file.items():
        entries.sort(key=lambda x: x.offset)
        for a, b in zip(entries, entries[1:]):
            if a.offset + a.nbytes > b.offset:
                raise bad(f"{name}: blob of (layer {a.layer}, expert {a.expert}) at "
                          f"[{a.offset}, {a.offset + a.nbytes}) overlaps blob of "
                          f"(layer {b.layer}, expert {b.expert}) at [{b.offset}, {b.offset + b.nbytes})")

    moe_layers = config.moe_layers
    n_exp = config.moe.num_experts if config.moe is not None else 0
    want = {(layer, j) for layer in moe_layers for j in range(n_exp)}
    missing = sorted(want - seen.keys())
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise bad(f"missing expert entry (layer {missing[0][0]}, expert {missing[0][1]}){more}; the "
                  f"model has {n_exp} experts in each of layers {list(moe_layers)}")
    extra = sorted(seen.keys() - want)
    if extra:
        raise bad(f"expert entry (layer {extra[0][0]}, expert {extra[0][1]}) is not a routed expert "
                  f"of the model (MoE layers {list(moe_layers)}, {n_exp} experts each)")
    if m.totals.num_experts != len(m.experts):
        raise bad(f"totals.num_experts is {m.totals.num_experts} but there are {len(m.experts)} entries")


def parse_manifest(text: str | bytes, path: object = MANIFEST_NAME) -> StoreManifest:
    """Parse and validate manifest JSON text."""
    try:
        m = StoreManifest.model_validate_json(text)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        loc = ".".join(str(p) for p in first["loc"]) or "<top>"
        if loc == "schema_version":
            raw = _peek_schema_version(text)
            raise ModelFormatError(path, f"schema_version {raw!r} is not supported; this moestream "
                                         f"reads schema_version {SCHEMA_VERSION}") from None
        more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
        raise ModelFormatError(path, f"invalid manifest: {loc}: {first['msg']}{more}") from None
    check_manifest(m, path)
    return m


def _peek_schema_version(text: str | bytes) -> object:
    try:
        raw = json.loads(text)
        return raw.get("schema_version") if isinstance(raw, dict) else None
    except (ValueError, TypeError):
        return None


def load_manifest(store_dir: str | os.PathLike[str]) -> StoreManifest:
    """Read ``<store>/manifest.json``; raises ModelFormatError for a missing or bad manifest."""
    root = Path(store_dir)
    if not root.is_dir():
        raise ModelFormatError(root, "not a store directory (does not exist or is not a directory)")
    path = root / MANIFEST_NAME
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ModelFormatError(root, "incomplete store: manifest.json missing; re-run moestream convert") from None
    if size > MAX_MANIFEST_BYTES:
        raise ModelFormatError(path, f"manifest is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    return parse_manifest(path.read_bytes(), path)


__all__ = [
    "BLOB_ALIGN", "DENSE_NAME", "MANIFEST_NAME", "SCHEMA_VERSION", "TOKENIZER_DIR",
    "ConversionInfo", "DataFile", "DenseInfo", "ExpertEntry", "QuantInfo", "SourceInfo",
    "StoreManifest", "StoreTotals", "align_up", "check_manifest", "layer_file_name",
    "load_manifest", "parse_manifest",
]
