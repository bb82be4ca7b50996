"""Read an expert store: validated manifest, positional reads of expert blobs, digest checks.

Reads use ``os.pread``/``os.preadv`` (no shared file offset, so any number of threads may read
at once, and a file truncated under us gives a short read -> ExpertLoadError, never SIGBUS as
an mmap would). Where the filesystem supports it, a blob is read with ``O_DIRECT`` into a
4096-aligned buffer, bypassing the page cache (the blob's offset and padded length are 4 KiB
multiples by construction); otherwise, silently, a buffered read.

Every blob is checked (``verify=True``) when it is read from disk: its xxh3 check (its sha256
digest in stores written before the check) covers the blob's identity (layer, expert, quant
format) and its bytes (manifest.blob_check, manifest.blob_digest), so a corrupted blob
and a blob the manifest places at another expert's offset both raise ChecksumError naming the
layer and expert, never silently wrong tokens. The dense tensors are checked against the
manifest's model config (name and shape) before a model is built from them.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ChecksumError, ExpertLoadError, ModelFormatError, TokenizerNotFoundError
from engine.loading.source import TensorInfo, TensorSource
from engine.store.manifest import (
    BLOB_ALIGN, RECONVERT_HINT, ExpertEntry, StoreManifest, align_up, load_manifest,
)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class StoreDenseSource(TensorSource):
    """The store's dense tensors (``dense.safetensors``) under canonical names."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from engine.loading.safetensors import SafetensorsFile

        self.path = str(path)
        self._file = SafetensorsFile(path)

    def names(self) -> list[str]:
        return self._file.names()

    def __contains__(self, name: str) -> bool:
        return name in self._file

    def info(self, name: str) -> TensorInfo:
        shape, dtype = self._file.info(name)
        return TensorInfo(name=name, shape=shape, dtype=dtype)

    def get(self, name: str) -> torch.Tensor:
        """Zero-copy view of the file's copy-on-write mapping (writes never reach the file)."""
        return self._file.get(name)

    def release(self, t: torch.Tensor) -> bool:
        """Drop the pages of ``t``, a view of the dense file no longer used (SafetensorsFile.release)."""
        return self._file.release(t)

    def rows(self, name: str):
        """A pread reader of a 2-D tensor's rows (SafetensorsFile.rows), or None."""
        return self._file.rows(name)

    def close(self) -> None:
        self._file.close()


def _address(buf: Any) -> int:
    """Address of the first byte of a writable buffer or CPU tensor."""
    if isinstance(buf, torch.Tensor):
        return buf.data_ptr()
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def _writable_u8(out: Any, need: int) -> memoryview:
    """``out`` as a flat writable byte memoryview of at least ``need`` bytes."""
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu" or out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous CPU uint8 tensor, got {out.dtype} on {out.device}")
        mv = memoryview(out.numpy()).cast("B")  # shares memory with the tensor
    else:
        mv = memoryview(out)
        if mv.readonly:
            raise ValueError("out must be a writable buffer")
        if not mv.contiguous:
            raise ValueError("out must be a contiguous buffer")
        mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    if mv.nbytes < need:
        raise ValueError(f"out has {mv.nbytes} bytes, the blob needs {need}")
    return mv


def check_dense_tensors(config, source: TensorSource, path: object) -> None:
    """Every non-expert tensor ``config`` implies must be in ``source`` with its shape; raises
    ModelFormatError naming the tensor (a manifest model config that disagrees with the dense
    file fails here, not inside a matmul). ``config``'s counts were checked against the files
    by check_manifest, so the expected list is bounded by them."""
    from engine.loading.source import parse_expert_name
    from engine.loading.validate import expected_shapes

    for name, shape in expected_shapes(config).items():
        if parse_expert_name(name) is not None:
            continue
        if name not in source:
            raise ModelFormatError(path, f"tensor {name!r} is missing; the manifest's model config "
                                         f"({config.arch}, {config.num_layers} layers) implies it "
                                         f"with shape {list(shape)}")
        got = tuple(source.info(name).shape)
        if got != shape:
            raise ModelFormatError(path, f"tensor {name!r} has shape {list(got)} but the manifest's "
                                         f"model config implies {list(shape)}")


def tokenizer_problem(root: Path, m: StoreManifest) -> str | None:
    """Why the tokenizer the manifest records is not all there (None: present, or none recorded)."""
    if m.tokenizer_dir is None:
        return None
    tdir = root / m.tokenizer_dir
    if not tdir.is_dir():
        return f"the manifest records a tokenizer in {m.tokenizer_dir}/ but the directory is missing"
    for name in m.tokenizer_files:
        if not (tdir / name).is_file():
            return f"tokenizer file {name} is missing"
    return None


class ExpertStore:
    """An expert store opened for reading. Thread-safe; call :meth:`close` (or use ``with``)."""

    def __init__(self, path: str | os.PathLike[str], *, direct_io: bool = True) -> None:
        self.path = Path(path)
        self.manifest: StoreManifest = load_manifest(self.path)
        m = self.manifest
        from engine.configio.plain import config_from_dict
        from engine.quant.formats import QuantFormat

        self.config = config_from_dict(m.model_config_)
        self.fmt = QuantFormat(m.quant.format, m.quant.group_size)
        self._entries: dict[tuple[int, int], ExpertEntry] = {(e.layer, e.expert): e for e in m.experts}
        self.expert_nbytes = max((e.nbytes for e in m.experts), default=0)
        self.read_nbytes = align_up(self.expert_nbytes, BLOB_ALIGN)  # buffer size for any read
        self.num_experts_total = len(m.experts)
        self.bytes_read = 0
        self.reads = 0
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int] = {}
        self._direct = bool(direct_io and _O_DIRECT)
        self._closed = False
        self._spans: dict[str, list] = {}  # layout json -> part spans (tensor unpack)
        self._entry_spans: dict[tuple[int, int], list] = {}  # (layer, expert) -> its layout's spans
        self._spans_lock = threading.Lock()
        try:
            self._open_files()
            if m.ple_tables:  # a missing or short row file fails here, not mid-generation
                from engine.store.ple_store import check_row_files

                check_row_files(self.path, m.ple_tables)
        except BaseException:
            self.close()
            raise

    def _open_files(self) -> None:
        m = self.manifest
        need: dict[str, int] = {}
        for e in m.experts:
            need[e.file] = max(need.get(e.file, 0), e.offset + e.nbytes)
        dense = self.path / m.dense.file
        if not dense.is_file():
            raise ExpertLoadError(f"{dense}: dense weights file missing; re-run moestream convert")
        if dense.stat().st_size != m.dense.nbytes:
            raise ExpertLoadError(f"{dense}: truncated or changed: {dense.stat().st_size} bytes, the "
                                  f"manifest says {m.dense.nbytes}; re-run moestream convert")
        for name in sorted(need):
            p = self.path / name
            try:
                fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise ExpertLoadError(f"{p}: expert data file missing; re-run moestream convert") from None
            except OSError as e:
                raise ExpertLoadError(f"{p}: cannot open: {e}") from None
            self._fds[name] = fd
            size = os.fstat(fd).st_size
            if size < need[name]:
                raise ExpertLoadError(
                    f"{p}: truncated: the file is {size} bytes but the manifest places expert blobs up "
                    f"to byte {need[name]}; re-run moestream convert")
            if self._direct:
                try:
                    self._direct_fds[name] = os.open(p, os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                except OSError:  # tmpfs and some others refuse O_DIRECT
                    self._direct = False

    # ---- metadata --------------------------------------------------------------------------
    def entry(self, layer: int, expert: int) -> ExpertEntry:
        try:
            return self._entries[(layer, expert)]
        except KeyError:
            raise KeyError(f"no expert (layer {layer}, expert {expert}) in store {self.path}; MoE "
                           f"layers {list(self.config.moe_layers)}, "
                           f"{self.config.moe.num_experts if self.config.moe else 0} experts each") from None

    @property
    def direct_io(self) -> bool:
        """Whether O_DIRECT reads are (still) in use."""
        return self._direct

    def empty_buffer(self) -> torch.Tensor:
        """A 4096-aligned uint8 CPU tensor of ``read_nbytes``: an ``out`` that allows O_DIRECT."""
        raw = torch.empty(self.read_nbytes + BLOB_ALIGN, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % BLOB_ALIGN
        return raw[skip:skip + self.read_nbytes]

    # ---- reads -----------------------------------------------------------------------------
    def read_expert(self, layer: int, expert: int, out: Any = None, verify: bool = True) -> memoryview:
        """The blob's ``nbytes`` bytes, read from disk (into ``out`` when given, no copy)."""
        if self._closed:
            raise ExpertLoadError(f"store {self.path} is closed")
        e = self.entry(layer, expert)
        path = self.path / e.file
        padded = align_up(e.nbytes, BLOB_ALIGN)
        if out is None:
            buf: memoryview = memoryview(mmap.mmap(-1, padded))  # page aligned, writable
        else:
            buf = _writable_u8(out, e.nbytes)
        n = -1
        try:
            if self._direct and e.file in self._direct_fds and buf.nbytes >= padded \
                    and _address(buf) % BLOB_ALIGN == 0:
                try:
                    n = os.preadv(self._direct_fds[e.file], [buf[:padded]], e.offset)
                except OSError:  # EINVAL: the filesystem accepted O_DIRECT at open but not here
                    self._direct = False
                    n = -1
            if n < e.nbytes:
                n = os.preadv(self._fds[e.file], [buf[:e.nbytes]], e.offset)
        except OSError as err:
            raise ExpertLoadError(f"{path}: reading layer {layer} expert {expert} "
                                  f"(offset {e.offset}, {e.nbytes} bytes) failed: {err}") from None
        except KeyError:
            raise ExpertLoadError(f"store {self.path} is closed") from None
        if n < e.nbytes:
            raise ExpertLoadError(
                f"{path}: short read for layer {layer} expert {expert}: got {max(n, 0)} of "
                f"{e.nbytes} bytes at offset {e.offset} (file truncated?); re-run moestream convert")
        view = buf[:e.nbytes]
        with self._lock:
            self.bytes_read += e.nbytes
            self.reads += 1
        if verify:  # the xxh3 check where the store has one (30x cheaper), else the sha256
            kind, want = ("xxh3", e.xxh3) if e.xxh3 is not None else ("sha256", e.sha256)
            actual = (self.manifest.check_of if e.xxh3 is not None else self.manifest.digest_of)(layer, expert, view)
            if actual != want:
                raise ChecksumError(layer, expert, path, want, actual, kind)
        return view

    def expert_tensors(self, layer: int, expert: int, buf: Any):
        """Zero-copy ``(gate, up, down)`` QuantizedTensors viewing a blob read by :meth:`read_expert`.

        ``buf`` may be the memoryview returned, any buffer holding the blob at offset 0, or a
        uint8 tensor on any device (e.g. a CUDA slot the blob was copied into)."""
        from engine.quant.expert_blob import unpack_expert

        e = self.entry(layer, expert)
        if isinstance(buf, torch.Tensor):
            return self._tensor_views(layer, expert, e, buf)
        return unpack_expert(buf, e.layout, source=f"{self.path / e.file} (layer {layer} expert {expert})")

    def layout_key(self, layer: int, expert: int) -> int:
        """Equal for two experts exactly when their blobs have the same layout, so that views of
        one slot made for the first serve the second (the expert cache reuses them)."""
        return id(self._spans_of(layer, expert))

    def _spans_of(self, layer: int, expert: int) -> list:
        """The byte ranges of an expert's parts: its layout is validated once per distinct
        layout, on a CPU probe (unpack_expert takes CPU buffers only), then remembered per
        expert, so the cache's hot path neither re-validates nor re-serializes the layout."""
        from engine.quant.expert_blob import unpack_expert

        spans = self._entry_spans.get((layer, expert))  # the hot path: one dict lookup
        if spans is not None:
            return spans
        e = self.entry(layer, expert)
        source = f"{self.path / e.file} (layer {layer} expert {expert})"
        with self._spans_lock:  # one spans object per layout, also when I/O threads race here
            key = json.dumps(e.layout, sort_keys=True)
            spans = self._spans.get(key)
            if spans is None:
                probe = torch.zeros(e.nbytes, dtype=torch.uint8)
                base = probe.data_ptr()
                spans = []
                for q in unpack_expert(probe, e.layout, source=source):
                    spans.append((q.fmt, q.shape, {name: (t.data_ptr() - base, t.numel() * t.element_size(),
                                                          t.dtype, tuple(t.shape))
                                                   for name, t in q.parts.items()}))
                self._spans[key] = spans
            self._entry_spans[(layer, expert)] = spans
        return spans

    def _tensor_views(self, layer: int, expert: int, e: ExpertEntry, buf: torch.Tensor):
        """Views of a uint8 tensor (CPU or device): three slicings per weight (the parts were
        validated against the format when the layout was first seen, see ``_spans_of``)."""
        from engine.quant.formats import QuantizedTensor

        if buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise ValueError(f"expert buffer must be a contiguous uint8 tensor, got {buf.dtype}")
        spans = self._spans_of(layer, expert)
        flat = buf.reshape(-1)
        if flat.numel() < e.nbytes:
            raise ValueError(f"expert buffer has {flat.numel()} bytes, the blob needs {e.nbytes}")
        out = []
        for fmt, shape, parts in spans:
            views = {name: flat[off:off + nb].view(dtype).view(pshape)
                     for name, (off, nb, dtype, pshape) in parts.items()}
            q = QuantizedTensor.trusted(fmt, shape, views)
            q.cache["buffer"] = buf
            out.append(q)
        return tuple(out)

    # ---- the rest of the model -------------------------------------------------------------
    def dense_source(self, verify: bool = True) -> TensorSource:
        """The non-expert tensors under canonical names, checked against the model config (every
        tensor it implies present with its shape). ``verify`` also checks the file's sha256."""
        path = self.path / self.manifest.dense.file
        if verify:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
            if h.hexdigest() != self.manifest.dense.sha256:
                raise ModelFormatError(path, f"checksum mismatch: manifest says sha256 "
                                             f"{self.manifest.dense.sha256[:16]}..., file has "
                                             f"{h.hexdigest()[:16]}...; re-run moestream convert")
        source = StoreDenseSource(path)
        if self.manifest.ple_tables:  # the PLE tables live in row files: meta stand-ins here
            from engine.store.ple_store import WithoutPLETables

            source = WithoutPLETables(source, self.manifest.ple_tables)
        try:
            check_dense_tensors(self.config, source, path)
        except BaseException:
            source.close()
            raise
        return source

    def tokenizer(self):
        """The store's tokenizer. TokenizerNotFoundError when its source had none;
        ModelFormatError when the manifest records one that is missing or incomplete."""
        from engine.tokenizer import Tokenizer

        m = self.manifest
        if m.tokenizer_dir is None:
            raise TokenizerNotFoundError(f"store {self.path} has no tokenizer (its source had none)")
        root = self.path / m.tokenizer_dir
        problem = tokenizer_problem(self.path, m)
        if problem is not None:
            raise ModelFormatError(root, f"{problem}; {RECONVERT_HINT}")
        tok = Tokenizer.from_hf_dir(root)
        extra = set(self.config.eos_token_ids) - tok.eos_token_ids
        if extra:
            tok = Tokenizer(tok.hf, source=tok.source, extra_eos_ids=tok.eos_token_ids | extra)
        return tok

    def close(self) -> None:
        self._closed = True
        for fds in (self._fds, self._direct_fds):
            while fds:
                _, fd = fds.popitem()
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ExpertStore({str(self.path)!r}, {self.config.arch}, {self.num_experts_total} experts, "
                f"{self.fmt.name} g{self.fmt.group_size})")


__all__ = ["ExpertStore", "StoreDenseSource", "check_dense_tensors", "tokenizer_problem"]
