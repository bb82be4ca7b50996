"""``moestream verify STORE``: check a whole expert store without trusting any part of it.

Checks, in order: the manifest (schema, structure, declared counts: manifest.load_manifest); the
dense file (present, its recorded size and sha256, every tensor the model config implies with its
shape); every expert data file (present, exactly its recorded size: truncated or grown files are
named); every blob (read, digest over its identity and bytes, so a corrupted blob and a blob the
manifest gives to another expert are both found; layout valid for its bytes); the tokenizer the
manifest records (every listed file present with its sha256); every PLE row file (present, its
recorded size, its header as the manifest says, every page's crc32: engine.store.ple_rows).

Problems are collected up to a cap (the rest only counted), so a badly broken store costs no
more memory than a good one; ``stop_early`` returns at the first (convert's check of a finished
store).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ModelFormatError, MoestreamError
from engine.store.manifest import ExpertEntry, StoreManifest, load_manifest, sha256_file


class _Enough(Exception):
    """Internal: the first problem is all a ``stop_early`` caller wants."""


@dataclass
class VerifyReport:
    """What :func:`verify_store` found."""

    store: Path
    manifest: StoreManifest | None = None
    problems: list[str] = field(default_factory=list)
    more: int = 0  # problems beyond the cap, counted only
    max_problems: int = 20
    stop_early: bool = False
    experts_checked: int = 0
    data_files_checked: int = 0
    dense_checked: bool = False
    tokenizer_files_checked: int = 0
    ple_files_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        if len(self.problems) < self.max_problems:
            self.problems.append(problem)
        else:
            self.more += 1
        if self.stop_early:
            raise _Enough

    def summary(self) -> str:
        m = self.manifest
        if m is None:
            return f"{self.store}: manifest unusable; nothing else checked"
        tok = (f"tokenizer {self.tokenizer_files_checked} files" if m.tokenizer_dir is not None
               else "no tokenizer (its source had none)")
        n = len(self.problems) + self.more
        state = "ok" if self.ok else f"{n} problem{'s' if n != 1 else ''}"
        return (f"{self.store}: schema {m.schema_version}, {m.model_config_.get('arch')}, quant "
                f"{m.quant.format} g{m.quant.group_size}; checked {self.experts_checked}/{len(m.experts)} "
                f"expert blobs in {self.data_files_checked}/{len(m.data_files)} data files, dense "
                f"{'yes' if self.dense_checked else 'no'}, {tok}"
                + (f", PLE row files {self.ple_files_checked}/{len(m.ple_tables)}" if m.ple_tables else "")
                + f": {state}")


def _size_problem(path: Path, want: int) -> str | None:
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size
    if size < want:
        return f"{path}: truncated: {size} bytes, the manifest says {want}"
    if size != want:
        return f"{path}: {size} bytes, the manifest says {want}"
    return None


def _check_dense(rep: VerifyReport, root: Path, m: StoreManifest) -> None:
    from engine.store.manifest import parse_model_config
    from engine.store.reader import StoreDenseSource, check_dense_tensors

    path = root / m.dense.file
    problem = _size_problem(path, m.dense.nbytes)
    if problem is None and sha256_file(path) != m.dense.sha256:
        problem = f"{path}: sha256 differs from the manifest's (corrupted or replaced)"
    if problem is not None:
        rep.add(problem)
        return
    try:
        with StoreDenseSource(path) as source:
            from engine.store.ple_store import WithoutPLETables

            # the PLE tables live in row files (_check_ple), not in the dense file
            check_dense_tensors(parse_model_config(m.model_config_, root),
                                WithoutPLETables(source, m.ple_tables), path)
    except MoestreamError as e:
        rep.add(str(e))
        return
    rep.dense_checked = True


def _check_blob(rep: VerifyReport, m: StoreManifest, path: Path, fd: int, e: ExpertEntry) -> None:
    from engine.quant.expert_blob import unpack_expert

    where = f"{path.name}: layer {e.layer} expert {e.expert} (offset {e.offset}, {e.nbytes} bytes)"
    data = os.pread(fd, e.nbytes, e.offset)
    if len(data) < e.nbytes:
        rep.add(f"{where}: only {len(data)} bytes there (file truncated)")
        return
    if m.digest_of(e.layer, e.expert, data) != e.sha256 or \
            (e.xxh3 is not None and m.check_of(e.layer, e.expert, data) != e.xxh3):
        rep.add(f"{where}: digest mismatch: the bytes are corrupted or are another expert's")
        return
    try:
        unpack_expert(data, e.layout, source=f"{path} (layer {e.layer} expert {e.expert})")
    except MoestreamError as err:
        rep.add(str(err))
        return
    rep.experts_checked += 1


def _check_experts(rep: VerifyReport, root: Path, m: StoreManifest) -> None:
    by_file: dict[str, list[ExpertEntry]] = {}
    for e in m.experts:
        by_file.setdefault(e.file, []).append(e)
    for name in sorted(m.data_files):
        path = root / name
        problem = _size_problem(path, m.data_files[name].nbytes)
        if problem is not None:
            rep.add(problem)
            if not path.is_file():
                continue
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            for e in sorted(by_file.get(name, ()), key=lambda x: x.offset):
                _check_blob(rep, m, path, fd, e)
        finally:
            os.close(fd)
        if problem is None:
            rep.data_files_checked += 1


def _check_tokenizer(rep: VerifyReport, root: Path, m: StoreManifest) -> None:
    from engine.store.reader import tokenizer_problem

    problem = tokenizer_problem(root, m)
    if problem is not None:
        rep.add(f"{root}: {problem}")
        return
    if m.tokenizer_dir is None:
        return
    for name, digest in sorted(m.tokenizer_files.items()):
        path = root / m.tokenizer_dir / name
        if sha256_file(path) != digest:
            rep.add(f"{path}: sha256 differs from the manifest's (corrupted or replaced)")
        else:
            rep.tokenizer_files_checked += 1


def _check_ple(rep: VerifyReport, root: Path, m: StoreManifest) -> None:
    from engine.store.ple_rows import PLERowChecksumError, check_page, read_layout
    from engine.store.ple_store import check_row_files

    for e in m.ple_tables:
        path = root / e.file
        problem = _size_problem(path, e.nbytes)
        if problem is not None:
            rep.add(problem)
            continue
        try:
            check_row_files(root, [e])
        except ModelFormatError as err:
            rep.add(str(err))
            continue
        lay = read_layout(path)
        bad = 0
        with open(path, "rb") as f:
            for first in range(0, lay.num_pages, 256):
                n = min(256, lay.num_pages - first)
                f.seek(lay.page_offset(first))
                data = memoryview(f.read(n * lay.page_bytes))
                for i in range(n):
                    try:
                        check_page(lay, first + i, data[i * lay.page_bytes:(i + 1) * lay.page_bytes], path)
                    except PLERowChecksumError as err:
                        bad += 1
                        if bad == 1:
                            rep.add(str(err))
        if not bad:
            rep.ple_files_checked += 1


def verify_store(path: str | os.PathLike[str], *, max_problems: int = 20,
                 stop_early: bool = False) -> VerifyReport:
    """Check the whole store at ``path``; never raises for a bad store (problems are reported)."""
    root = Path(path)
    rep = VerifyReport(root, max_problems=max(1, max_problems), stop_early=stop_early)
    try:
        try:
            rep.manifest = m = load_manifest(root)
        except ModelFormatError as e:
            rep.add(str(e))
            return rep
        for check in (_check_dense, _check_experts, _check_tokenizer, _check_ple):
            try:
                check(rep, root, m)
            except OSError as e:
                rep.add(f"{e.filename or root}: cannot read: {e.strerror or type(e).__name__}")
    except _Enough:
        pass
    return rep


__all__ = ["VerifyReport", "verify_store"]
