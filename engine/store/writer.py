"""``convert``: a Hugging Face directory or GGUF file -> an expert store (see manifest.py).

Order of work, each step atomic (temp name, fsync, record in progress.json, rename, fsync of the
directory)::

    tokenizer/  ->  dense.safetensors  ->  experts-L{l:03d}.bin per MoE layer  ->  manifest.json

``progress.json`` (also written atomically) records the conversion parameters, the tokenizer's
files, the dense file and every finished layer with its entries and digests, each *before* the
file gets its final name, so every file of ours in the directory is recorded. An interrupted run
leaves no manifest, so the store never opens; the next run with the same parameters reuses every
finished layer whose file size and blob digests still match what progress.json says, and
converts the rest. The manifest is written last; after it, progress.json is removed.

Re-running on a finished store with the same source fingerprint and parameters verifies the
store (sizes and every digest, engine.store.verify) and touches nothing when it is intact; a
damaged store is repaired in place (intact layers reused). Where convert may write, what
``--overwrite`` removes and how temporary files and the lock are cleaned up: engine.store.outdir.

Concurrent converts into one directory are refused (an exclusive ``flock`` on ``.convert.lock``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import ConfigError, ModelFormatError, TokenizerNotFoundError
from engine.store import outdir
from engine.store.manifest import (
    BLOB_ALIGN, DENSE_NAME, MANIFEST_NAME, SCHEMA_VERSION, TOKENIZER_DIR, ConversionInfo, DataFile,
    DenseInfo, ExpertEntry, PLETableEntry, QuantInfo, SourceInfo, StoreManifest, StoreTotals, align_up, blob_check,
    blob_digest, check_manifest, layer_file_name, sha256_file,
)
from engine.store.outdir import LOCK_NAME, PROGRESS_NAME, TMP_SUFFIX, fsync_dir
from engine.store.ple_store import (PLE_DTYPES, PLE_SHARD, check_row_files, ple_file_name, ple_shards,
                                   write_ple_tables)

log = logging.getLogger(__name__)

PROGRESS_VERSION = 2
DENSE_DTYPES = ("auto", "bf16", "fp32")


class _SimulatedInterrupt(RuntimeError):
    """Raised by ``convert(_fail_after_layers=n)`` (tests): the run stops as if killed."""


# ------------------------------------------------------------------------------------- summary

@dataclass
class ConvertSummary:
    """What a conversion produced (or found already there)."""

    store: str
    arch: str
    quant: str  # e.g. "int4 g32"
    num_moe_layers: int
    num_experts: int  # blobs in the store
    expert_nbytes: int  # largest blob, padding excluded
    layer_nbytes: int  # largest expert data file, padding included
    expert_file_bytes: int  # all expert data files
    dense_nbytes: int
    total_nbytes: int
    bits_per_weight: float  # nominal, of the format
    stored_bits_per_weight: float  # blob bytes * 8 / expert weights (64-byte part padding included)
    elapsed_s: float
    layers_converted: int = 0
    layers_reused: int = 0
    already_done: bool = False  # finished with these parameters and verified intact: nothing touched
    repaired: str = ""  # the damage found in a finished store that this run repaired
    tokenizer: bool = True

    def __str__(self) -> str:
        if self.already_done:
            state = "already converted with these parameters and verified intact; nothing to do"
        else:
            state = f"{self.layers_converted} layers converted, {self.layers_reused} reused"
            if self.repaired:
                state = f"damaged store repaired ({self.repaired}): {state}"
        rows = [("store", self.store),
                ("model", f"{self.arch}, {self.num_moe_layers} MoE layers, {self.num_experts} experts")]
        if self.num_experts:
            rows += [
                ("quant", f"{self.quant}: {self.bits_per_weight:.2f} bits/weight nominal, "
                          f"{self.stored_bits_per_weight:.2f} stored"),
                ("per expert", _fmt_bytes(self.expert_nbytes)),
                ("per layer", _fmt_bytes(self.layer_nbytes)),
                ("experts", _fmt_bytes(self.expert_file_bytes)),
            ]
        else:
            rows += [("experts", "none (dense model)")]
        rows += [
            ("dense", _fmt_bytes(self.dense_nbytes)),
            ("total", _fmt_bytes(self.total_nbytes)),
            ("tokenizer", "saved" if self.tokenizer else "none in the source"),
            ("elapsed", f"{self.elapsed_s:.2f} s ({state})"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _summary_from_manifest(m: StoreManifest, store: Path, elapsed: float, **kw: Any) -> ConvertSummary:
    t = m.totals
    per_file: dict[str, int] = {name: f.nbytes for name, f in m.data_files.items()}
    return ConvertSummary(
        store=str(store), arch=str(m.model_config_.get("arch")),
        quant=f"{m.quant.format} g{m.quant.group_size}" if m.quant.format != "bf16" else "bf16",
        num_moe_layers=t.num_moe_layers, num_experts=t.num_experts,
        expert_nbytes=max((e.nbytes for e in m.experts), default=0),
        layer_nbytes=max(per_file.values(), default=0),
        expert_file_bytes=t.expert_file_bytes, dense_nbytes=t.dense_bytes, total_nbytes=t.total_bytes,
        bits_per_weight=t.bits_per_weight,
        stored_bits_per_weight=(8 * t.expert_bytes / t.expert_params) if t.expert_params else 0.0,
        elapsed_s=elapsed, tokenizer=m.tokenizer_dir is not None, **kw)



# ---------------------------------------------------------------------------------- file helpers

def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def source_fingerprint(src: Path) -> tuple[str, str]:
    """``(kind, fingerprint)``: sha256 over (name, size, mtime_ns) of the source files, reading no
    data. For a directory: every regular file directly inside it (weights, index, configs,
    tokenizer files)."""
    if src.is_file():
        kind, files = "gguf", [src]
    else:
        kind, files = "hf", sorted(p for p in src.iterdir() if p.is_file())
    rows = []
    for p in files:
        st = p.stat()
        rows.append([p.name, st.st_size, st.st_mtime_ns])
    return kind, hashlib.sha256(json.dumps(rows).encode()).hexdigest()


# ------------------------------------------------------------------------------- parameters

def _params(kind: str, fingerprint: str, fmt, dense_dtype: str, ple_dtype: str = "checkpoint") -> dict[str, Any]:
    p = {"schema_version": SCHEMA_VERSION, "source_kind": kind, "fingerprint": fingerprint,
         "quant": fmt.to_dict(), "dense_dtype": dense_dtype}
    if ple_dtype != "checkpoint":  # absent by default: stores without PLE tables are unchanged
        p["ple_dtype"] = ple_dtype
    return p


def _manifest_params(m: StoreManifest) -> dict[str, Any]:
    return {"schema_version": m.schema_version, "source_kind": m.source.kind,
            "fingerprint": m.source.fingerprint,
            "quant": {"name": m.quant.format, "group_size": m.quant.group_size},
            "dense_dtype": m.conversion.dense_dtype,
            **({"ple_dtype": "int8"} if any(t.dtype == "int8" for t in m.ple_tables) else {})}


def _describe(p: dict[str, Any]) -> str:
    q = p["quant"]
    return (f"quant {q['name']} g{q['group_size']}, dense {p['dense_dtype']}, "
            f"source fingerprint {p['fingerprint'][:12]}")


def _fresh_progress(params: dict[str, Any]) -> dict[str, Any]:
    return {"version": PROGRESS_VERSION, "params": params, "dense": None, "tokenizer": None, "layers": {}}


def _progress_from_manifest(m: StoreManifest, params: dict[str, Any]) -> dict[str, Any]:
    """The progress a finished store amounts to: a repair reuses every part still intact."""
    prog = _fresh_progress(params)
    prog["dense"] = m.dense.model_dump()
    if m.tokenizer_dir is not None:
        prog["tokenizer"] = {"files": dict(m.tokenizer_files)}
    for e in m.experts:
        rec = prog["layers"].setdefault(str(e.layer), {"nbytes": m.data_files[e.file].nbytes, "entries": []})
        rec["entries"].append(e.model_dump())
    prog["ple_tables"] = [t.model_dump() for t in m.ple_tables]
    return prog


def _resume_progress(raw: dict[str, Any] | None, out: Path, params: dict[str, Any]) -> dict[str, Any] | None:
    """progress.json of an interrupted run with these parameters, or None (start over)."""
    if raw is None:
        return None
    if raw.get("version") != PROGRESS_VERSION or raw.get("params") != params:
        log.warning("%s: a conversion with other parameters (or by another moestream version) was "
                    "interrupted here; starting over", out)
        return None
    return raw


def _save_progress(out: Path, prog: dict[str, Any]) -> None:
    _write_atomic(out / PROGRESS_NAME, json.dumps(prog, indent=1).encode())


def _commit(out: Path, prog: dict[str, Any], tmp: Path, final: Path) -> None:
    """Record the part in progress.json, then give it its final name: every file of ours under a
    final name is recorded (engine.store.outdir refuses unrecorded ones)."""
    _save_progress(out, prog)
    os.replace(tmp, final)
    fsync_dir(out)


# ------------------------------------------------------------------------------------ convert

def convert(src: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, fmt,
            dense_dtype: str = "auto", progress: bool = True, overwrite: bool = False,
            ple_dtype: str = "checkpoint", _fail_after_layers: int | None = None) -> ConvertSummary:
    """Convert ``src`` (HF checkpoint directory or ``.gguf``) into an expert store at ``out_dir``.

    ``fmt``: the routed experts' :class:`~engine.quant.formats.QuantFormat`. ``dense_dtype``:
    "auto" keeps f16/bf16/f32 tensors as stored (anything else becomes f32), "bf16"/"fp32" force.
    ``overwrite``: replace a store converted with other parameters (or by an older moestream);
    never anything that is not a moestream store. ``ple_dtype``: the PLE n-gram tables' row
    files (engine.store.ple_store): "checkpoint" keeps the checkpoint's precision, "int8" a
    per-row scale. ``_fail_after_layers``: tests only; stop with
    an exception after that many layers.
    """
    from engine.quant.formats import QuantFormat

    t0 = time.perf_counter()
    if not isinstance(fmt, QuantFormat):
        raise ConfigError(f"fmt must be an engine.quant.formats.QuantFormat, got {fmt!r}")
    if dense_dtype not in DENSE_DTYPES:
        raise ConfigError(f"dense_dtype {dense_dtype!r} is not supported; allowed: {', '.join(DENSE_DTYPES)}")
    if ple_dtype not in PLE_DTYPES:
        raise ConfigError(f"ple_dtype {ple_dtype!r} is not supported; allowed: {', '.join(PLE_DTYPES)}")
    src, out = Path(src), Path(out_dir)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such file or directory")
    if src.is_file() and src.suffix != ".gguf":
        raise ModelFormatError(src, "expected a Hugging Face checkpoint directory or a .gguf file")
    with outdir.io_errors(out):
        outdir.check_out_path(out)
    if src.is_dir() and out.resolve() == src.resolve():
        raise ConfigError(f"--out {out} is the source checkpoint directory; choose another directory")
    kind, fingerprint = source_fingerprint(src)
    job = _Job(src, out, fmt, dense_dtype, _params(kind, fingerprint, fmt, dense_dtype, ple_dtype), kind,
               fingerprint, progress, _fail_after_layers, t0, ple_dtype)

    from engine.loading import open_model_files

    files = open_model_files(src)  # headers only; validates every tensor shape
    with contextlib.ExitStack() as stack:
        stack.callback(files.source.close)
        _check_shapes(src, files.config, fmt)
        with outdir.io_errors(out):
            outdir.refuse_unless_store(out)  # before anything, the lock included, is created
            created = outdir.make_dirs(out)
            try:
                with outdir.exclusive(out):
                    return _convert_locked(job, files, overwrite)
            except BaseException:
                outdir.remove_if_empty(created)
                raise


@dataclass
class _Job:
    src: Path
    out: Path
    fmt: Any
    dense_dtype: str
    params: dict[str, Any]
    kind: str
    fingerprint: str
    progress: bool
    fail_after: int | None
    t0: float
    ple_dtype: str = "checkpoint"


def _convert_locked(job: _Job, files, overwrite: bool) -> ConvertSummary:
    from engine.store.verify import verify_store

    out = job.out
    d = outdir.inspect(out)
    outdir.refuse_foreign(d)
    repaired = ""
    if d.manifest_raw is not None:
        m = d.manifest
        if m is not None and _manifest_params(m) == job.params:
            report = verify_store(out, max_problems=1, stop_early=True)
            if report.ok:
                (out / PROGRESS_NAME).unlink(missing_ok=True)  # left by a run killed at its end
                return _summary_from_manifest(m, out, time.perf_counter() - job.t0, already_done=True)
            repaired = report.problems[0]
            log.warning("%s: finished store is damaged (%s); converting the damaged parts again", out, repaired)
            prog = _progress_from_manifest(m, job.params)
            _save_progress(out, prog)  # records every file, so the manifest can go
            (out / MANIFEST_NAME).unlink()  # the directory never looks finished while repaired
            fsync_dir(out)
        elif not overwrite:
            old = _manifest_params(m) if m is not None else None
            what = _describe(old) if old else f"an unusable manifest ({d.manifest_problem})"
            raise ConfigError(
                f"{out} already holds a store converted with {what}; this run asks for "
                f"{_describe(job.params)}. Pass --overwrite (overwrite=True) to replace it, or "
                f"choose another --out")
        else:
            prog = _start_over(d, job.params)
    else:
        resumed = _resume_progress(d.progress, out, job.params)
        prog = resumed if resumed is not None and "stale" not in resumed else _start_over(d, job.params)
    summary = _run(job, files, prog, d.tokenizer_owned)
    summary.repaired = repaired
    return summary


def _start_over(d: outdir.OutDir, params: dict[str, Any]) -> dict[str, Any]:
    """Remove every part the directory records (another conversion's) and return a fresh
    progress. Crash-safe: the fresh progress.json is saved first with those parts listed as
    "stale", so that whatever a killed removal leaves is still recorded as convert's."""
    prog = _fresh_progress(params)
    stale = d.owned - {PROGRESS_NAME}
    if stale:
        prog["stale"] = {"names": sorted(stale), "tokenizer_files": sorted(d.tokenizer_owned)}
        _save_progress(d.path, prog)
        d.owned = stale
        outdir.remove_owned(d)  # the manifest first
        del prog["stale"]
    _save_progress(d.path, prog)
    return prog


def _reusable_dense(out: Path, rec: Any) -> DenseInfo | None:
    try:
        info = DenseInfo.model_validate(rec)
    except Exception:
        return None
    p = out / info.file
    if info.file != DENSE_NAME or not p.is_file() or p.stat().st_size != info.nbytes:
        return None
    return info if sha256_file(p) == info.sha256 else None


def _reusable_layer(out: Path, layer: int, rec: Any, n_exp: int, fmt) -> tuple[list[ExpertEntry], int] | None:
    """The layer's entries and file size from progress.json, if its file still matches them."""
    try:
        entries = [ExpertEntry.model_validate(e) for e in rec["entries"]]
        size = rec["nbytes"]
    except Exception:
        return None
    name = layer_file_name(layer)
    p = out / name
    if (not p.is_file() or p.stat().st_size != size
            or [(e.layer, e.expert, e.file) for e in entries] != [(layer, j, name) for j in range(n_exp)]):
        return None
    with open(p, "rb") as f:
        for e in entries:
            f.seek(e.offset)
            if blob_digest(layer, e.expert, fmt.name, fmt.group_size, f.read(e.nbytes)) != e.sha256:
                log.warning("%s: blob of expert %d does not match its record; converting layer %d "
                            "again", p, e.expert, layer)
                return None
    return entries, size


def _dense_tensors(source, names: list[str], dense_dtype: str) -> tuple[dict[str, torch.Tensor], str]:
    keep = (torch.float16, torch.bfloat16, torch.float32)
    forced = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dense_dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        t = source.get(name)
        if t.is_floating_point():
            target = forced or (t.dtype if t.dtype in keep else torch.float32)
            t = t.to(target)
        tensors[name] = t.contiguous()
    short = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
    kinds = sorted({short.get(t.dtype, str(t.dtype).removeprefix("torch.")) for t in tensors.values()
                    if t.is_floating_point()})
    return tensors, "+".join(kinds) or "none"


def _write_dense(out: Path, source, dense_dtype: str, prog: dict[str, Any]) -> DenseInfo:
    from engine.loading.source import parse_expert_name
    from safetensors.torch import save_file

    names = [n for n in source.names() if parse_expert_name(n) is None and not PLE_SHARD.match(n)]
    tensors, dtype = _dense_tensors(source, names, dense_dtype)
    final = out / DENSE_NAME
    tmp = final.with_name(final.name + TMP_SUFFIX)
    # One metadata key only: safetensors serializes the metadata map in hash order, and the
    # file must be byte-identical across runs (resume, digests).
    with outdir.library_io(tmp):
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    del tensors
    os.chmod(tmp, 0o644)  # safetensors creates the file owner-only
    _fsync_file(tmp)
    info = DenseInfo(file=DENSE_NAME, nbytes=tmp.stat().st_size, sha256=sha256_file(tmp), dtype=dtype)
    prog["dense"] = info.model_dump()
    _commit(out, prog, tmp, final)
    return info


def _reusable_ple(out: Path, rec: Any) -> bool:
    """progress.json's PLE row files, if every one is there and as recorded (a convert killed
    while writing them left names recorded before their files: not reusable)."""
    if rec is None:
        return False
    try:
        entries = [PLETableEntry.model_validate(e) for e in rec]
        check_row_files(out, entries)
    except Exception:
        return False
    return all((out / e.file).stat().st_size == e.nbytes for e in entries)


def _write_ple(out: Path, source, ple_dtype: str, prog: dict[str, Any]) -> None:
    """Each PLE layer's n-gram table as a row file, shard by shard (engine.store.ple_store). The
    names are recorded first, so a killed run's files are ours to replace."""
    prog["ple_tables"] = [{"file": ple_file_name(layer)} for layer in ple_shards(source.names())]
    _save_progress(out, prog)
    prog["ple_tables"] = write_ple_tables(out, source, ple_dtype)
    _save_progress(out, prog)
    fsync_dir(out)


def _write_tokenizer(job: _Job, files, prog: dict[str, Any], owned: set[str]) -> bool:
    """Save the source's tokenizer into tokenizer/ (replacing only files recorded as ours)."""
    out = job.out
    try:
        tok = files.tokenizer()
    except TokenizerNotFoundError as e:
        log.warning("%s: no tokenizer (%s); the store will have none", job.src, e)
        outdir.remove_tokenizer_dir(out / TOKENIZER_DIR, owned)  # one of an earlier conversion
        return False
    final, tmp = out / TOKENIZER_DIR, out / (TOKENIZER_DIR + TMP_SUFFIX)
    outdir.remove_tmp(tmp)
    with outdir.library_io(tmp):
        tok.hf.save_pretrained(str(tmp))
    gen = job.src / "generation_config.json"
    if job.src.is_dir() and gen.is_file():  # Tokenizer.from_hf_dir reads extra eos ids from it
        shutil.copyfile(gen, tmp / gen.name)
    digests = {}
    for p in sorted(tmp.iterdir()):
        _fsync_file(p)
        digests[p.name] = sha256_file(p)
    fsync_dir(tmp)
    outdir.remove_tokenizer_dir(final, owned)
    prog["tokenizer"] = {"files": digests}
    _commit(out, prog, tmp, final)
    return True


def _write_layer(out: Path, source, layer: int, n_exp: int, fmt, bar,
                 prog: dict[str, Any]) -> tuple[list[ExpertEntry], int]:
    from engine.loading.source import expert_name
    from engine.quant.expert_blob import pack_expert

    name = layer_file_name(layer)
    final = out / name
    tmp = final.with_name(name + TMP_SUFFIX)
    entries: list[ExpertEntry] = []
    offset = 0
    with open(tmp, "wb") as f:
        for j in range(n_exp):
            names = [expert_name(layer, j, p) for p in ("gate_proj", "up_proj", "down_proj")]
            native = getattr(source, "get_quantized", None)  # e.g. MXFP4 experts kept as released
            w = [(native(n, fmt) if native is not None else None) for n in names]
            w = [q if q is not None else source.get(n) for q, n in zip(w, names)]
            blob, layout = pack_expert(*w, fmt)
            entries.append(ExpertEntry(layer=layer, expert=j, file=name, offset=offset, nbytes=len(blob),
                                       sha256=blob_digest(layer, j, fmt.name, fmt.group_size, blob),
                                       xxh3=blob_check(layer, j, fmt.name, fmt.group_size, blob),
                                       layout=layout))
            f.write(blob)
            padded = align_up(len(blob), BLOB_ALIGN)
            f.write(b"\0" * (padded - len(blob)))  # the file ends 4 KiB aligned too (O_DIRECT)
            offset += padded
            bar.update(1)
        f.flush()
        os.fsync(f.fileno())
    prog["layers"][str(layer)] = {"nbytes": offset, "entries": [e.model_dump() for e in entries]}
    _commit(out, prog, tmp, final)
    return entries, offset


def _check_shapes(src: Path, config, fmt) -> None:
    """Fail before touching the store if the format cannot hold the experts' shapes."""
    if config.moe is None or not config.moe_layers:
        return
    i, h = config.moe.expert_intermediate_size, config.hidden_size
    try:
        fmt.check_shape((i, h))
        fmt.check_shape((h, i))
    except ConfigError as e:
        raise ConfigError(f"{src}: experts (gate/up [{i}, {h}], down [{h}, {i}]) cannot be "
                          f"stored as {fmt.name} g{fmt.group_size}: {e}") from None


def _run(job: _Job, files, prog: dict[str, Any], tokenizer_owned: set[str]) -> ConvertSummary:
    from tqdm import tqdm

    out, fmt = job.out, job.fmt
    for p in out.iterdir():  # leftovers of a killed run
        if outdir.tmp_name(p.name):
            outdir.remove_tmp(p)
    config, source = files.config, files.source
    moe_layers = config.moe_layers
    n_exp = config.moe.num_experts if config.moe is not None else 0
    tokenizer_ok = _write_tokenizer(job, files, prog, tokenizer_owned)
    if not tokenizer_ok:
        prog["tokenizer"] = None

    dense = _reusable_dense(out, prog.get("dense")) if prog.get("dense") else None
    if dense is None:
        dense = _write_dense(out, source, job.dense_dtype, prog)
    if not _reusable_ple(out, prog.get("ple_tables")):
        _write_ple(out, source, job.ple_dtype, prog)

    all_entries: list[ExpertEntry] = []
    data_files: dict[str, DataFile] = {}
    converted = reused = 0
    with tqdm(total=len(moe_layers) * n_exp, unit="expert", desc=f"convert {fmt.name}",
              disable=not job.progress, leave=False) as bar:
        for layer in moe_layers:
            rec = prog["layers"].get(str(layer))
            got = _reusable_layer(out, layer, rec, n_exp, fmt) if rec is not None else None
            if got is not None:
                reused += 1
                bar.update(n_exp)
            else:
                got = _write_layer(out, source, layer, n_exp, fmt, bar, prog)
                converted += 1
                if job.fail_after is not None and converted >= job.fail_after:
                    raise _SimulatedInterrupt(f"simulated interruption after {converted} layers")
            entries, size = got
            all_entries.extend(entries)
            data_files[layer_file_name(layer)] = DataFile(nbytes=size)

    manifest = _manifest(job, config, dense, prog, data_files, all_entries)
    check_manifest(manifest, out / MANIFEST_NAME)  # never write a manifest the reader refuses
    _write_atomic(out / MANIFEST_NAME, manifest.to_json().encode())
    (out / PROGRESS_NAME).unlink(missing_ok=True)
    fsync_dir(out)
    return _summary_from_manifest(manifest, out, time.perf_counter() - job.t0,
                                  layers_converted=converted, layers_reused=reused)


def _manifest(job: _Job, config, dense: DenseInfo, prog: dict[str, Any], data_files: dict[str, DataFile],
              entries: list[ExpertEntry]) -> StoreManifest:
    fmt = job.fmt
    expert_params = len(entries) * 3 * config.hidden_size * (
        config.moe.expert_intermediate_size if config.moe else 0)
    expert_file_bytes = sum(f.nbytes for f in data_files.values())
    tok = prog.get("tokenizer")
    return StoreManifest(
        schema_version=SCHEMA_VERSION,
        source=SourceInfo(path=str(job.src.resolve()), kind=job.kind, fingerprint=job.fingerprint),
        model_config=config.to_dict(),
        quant=QuantInfo(format=fmt.name, group_size=fmt.group_size),
        dense=dense,
        tokenizer_dir=TOKENIZER_DIR if tok else None,
        tokenizer_files=dict(tok["files"]) if tok else {},
        data_files=data_files,
        experts=entries,
        totals=StoreTotals(
            num_moe_layers=len(config.moe_layers), num_experts=len(entries),
            expert_params=expert_params, expert_bytes=sum(e.nbytes for e in entries),
            expert_file_bytes=expert_file_bytes, dense_bytes=dense.nbytes,
            total_bytes=expert_file_bytes + dense.nbytes, bits_per_weight=fmt.bits_per_weight),
        ple_tables=[PLETableEntry.model_validate(e) for e in prog.get("ple_tables") or []],
        conversion=ConversionInfo(
            created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            moestream_version=_version(), dense_dtype=job.dense_dtype),
    )


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("moestream")
    except Exception:  # not installed (running from a checkout)
        return "0+unknown"


__all__ = ["ConvertSummary", "convert", "source_fingerprint", "LOCK_NAME", "PROGRESS_NAME"]
