"""``convert``: a Hugging Face directory or GGUF file -> an expert store (see manifest.py).

Order of work, each step atomic (temp name, fsync, rename, fsync of the directory)::

    tokenizer/  ->  dense.safetensors  ->  experts-L{l:03d}.bin per MoE layer  ->  manifest.json

``progress.json`` (also written atomically) records the conversion parameters, the dense file and
every finished layer with its entries and digests. An interrupted run leaves no manifest, so the
store never opens; the next run with the same parameters reuses every finished layer whose file
size and blob digests still match what progress.json says, and converts the rest. The manifest is
written last; after it, progress.json is removed. Re-running on a finished store with the same
source fingerprint and parameters touches nothing.

Concurrent converts into one directory are refused (an exclusive ``flock`` on ``.convert.lock``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from engine.errors import ConfigError, ModelFormatError, TokenizerNotFoundError
from engine.store.manifest import (
    BLOB_ALIGN, DENSE_NAME, MANIFEST_NAME, SCHEMA_VERSION, TOKENIZER_DIR, ConversionInfo, DataFile,
    DenseInfo, ExpertEntry, QuantInfo, SourceInfo, StoreManifest, StoreTotals, align_up,
    check_manifest, layer_file_name, load_manifest,
)

log = logging.getLogger(__name__)

PROGRESS_NAME = "progress.json"
LOCK_NAME = ".convert.lock"
TMP_SUFFIX = ".tmp"
DENSE_DTYPES = ("auto", "bf16", "fp32")
_HASH_CHUNK = 16 << 20


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
    already_done: bool = False  # the store was finished with these parameters: nothing touched
    tokenizer: bool = True

    def __str__(self) -> str:
        if self.already_done:
            state = "already converted with these parameters; nothing to do"
        else:
            state = f"{self.layers_converted} layers converted, {self.layers_reused} reused"
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

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _sha256_file(path: Path, start: int = 0, length: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while left is None or left > 0:
            chunk = f.read(_HASH_CHUNK if left is None else min(_HASH_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h.hexdigest()


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


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{out}: another moestream convert is writing to this store; wait "
                              f"for it to finish") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def _our_files(out: Path) -> list[Path]:
    """Everything convert writes into a store directory (what --overwrite may remove)."""
    names = {MANIFEST_NAME, PROGRESS_NAME, DENSE_NAME, TOKENIZER_DIR}
    found = []
    for p in out.iterdir():
        base = p.name.removesuffix(TMP_SUFFIX)
        if base in names or (base.startswith("experts-L") and base.endswith(".bin")):
            found.append(p)
    return found


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ convert

def _params(kind: str, fingerprint: str, fmt, dense_dtype: str) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "source_kind": kind, "fingerprint": fingerprint,
            "quant": fmt.to_dict(), "dense_dtype": dense_dtype}


def _manifest_params(m: StoreManifest) -> dict[str, Any]:
    return {"schema_version": m.schema_version, "source_kind": m.source.kind,
            "fingerprint": m.source.fingerprint,
            "quant": {"name": m.quant.format, "group_size": m.quant.group_size},
            "dense_dtype": m.conversion.dense_dtype}


def _describe(p: dict[str, Any]) -> str:
    q = p["quant"]
    return (f"quant {q['name']} g{q['group_size']}, dense {p['dense_dtype']}, "
            f"source fingerprint {p['fingerprint'][:12]}")


def _store_is_intact(out: Path, m: StoreManifest) -> str | None:
    """None if every file the manifest names is there with its recorded size; else the problem."""
    checks = [(m.dense.file, m.dense.nbytes)] + [(n, f.nbytes) for n, f in m.data_files.items()]
    for name, size in checks:
        p = out / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} is {p.stat().st_size} bytes, the manifest says {size}"
    if m.tokenizer_dir is not None and not (out / m.tokenizer_dir).is_dir():
        return f"{m.tokenizer_dir}/ is missing"
    return None


def convert(src: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, fmt,
            dense_dtype: str = "auto", progress: bool = True, overwrite: bool = False,
            _fail_after_layers: int | None = None) -> ConvertSummary:
    """Convert ``src`` (HF checkpoint directory or ``.gguf``) into an expert store at ``out_dir``.

    ``fmt``: the routed experts' :class:`~engine.quant.formats.QuantFormat`. ``dense_dtype``:
    "auto" keeps f16/bf16/f32 tensors as stored (anything else becomes f32), "bf16"/"fp32" force.
    ``overwrite``: replace a finished store converted with other parameters (otherwise an error).
    ``_fail_after_layers``: tests only; stop with an exception after that many layers.
    """
    from engine.quant.formats import QuantFormat

    t0 = time.perf_counter()
    if not isinstance(fmt, QuantFormat):
        raise ConfigError(f"fmt must be an engine.quant.formats.QuantFormat, got {fmt!r}")
    if dense_dtype not in DENSE_DTYPES:
        raise ConfigError(f"dense_dtype {dense_dtype!r} is not supported; allowed: {', '.join(DENSE_DTYPES)}")
    src, out = Path(src), Path(out_dir)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such file or directory")
    if src.is_file() and src.suffix != ".gguf":
        raise ModelFormatError(src, "expected a Hugging Face checkpoint directory or a .gguf file")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    if src.is_dir() and out.resolve() == src.resolve():
        raise ConfigError(f"--out {out} is the source checkpoint directory; choose another directory")
    kind, fingerprint = source_fingerprint(src)
    params = _params(kind, fingerprint, fmt, dense_dtype)

    from engine.loading import open_model_files

    files = open_model_files(src)  # headers only; validates every tensor shape
    try:
        _check_shapes(src, files.config, fmt)
        out.mkdir(parents=True, exist_ok=True)  # only once the source is known to be good
    except BaseException:
        files.source.close()
        raise
    with contextlib.ExitStack() as stack:
        stack.callback(files.source.close)
        stack.enter_context(_exclusive(out))
        # ---- a finished store? -----------------------------------------------------------
        if (out / MANIFEST_NAME).exists():
            try:
                m = load_manifest(out)
                old, problem = _manifest_params(m), None
            except ModelFormatError as e:
                m, old, problem = None, None, str(e)
            if m is not None and old == params:
                problem = _store_is_intact(out, m)
                if problem is None:
                    return _summary_from_manifest(m, out, time.perf_counter() - t0, already_done=True)
                log.warning("%s: finished store is damaged (%s); converting it again", out, problem)
            elif not overwrite:
                what = _describe(old) if old else f"an unreadable manifest ({problem})"
                raise ConfigError(
                    f"{out} already holds a store converted with {what}; this run asks for "
                    f"{_describe(params)}. Pass --overwrite (overwrite=True) to replace it, or "
                    f"choose another --out")
            # Replace: the manifest goes first, so the directory never looks finished meanwhile.
            (out / MANIFEST_NAME).unlink()
            _fsync_dir(out)
            for p in _our_files(out):
                _remove(p)
        else:
            ours = set(_our_files(out))
            foreign = [p.name for p in out.iterdir() if p.name != LOCK_NAME and p not in ours]
            if foreign and not (out / PROGRESS_NAME).exists() and not overwrite:
                raise ConfigError(
                    f"--out {out} is not empty and is not a moestream store (it holds "
                    f"{', '.join(sorted(foreign)[:3])}{', ...' if len(foreign) > 3 else ''}); choose an "
                    f"empty or new directory, or pass --overwrite")
        return _run(src, out, files, fmt, dense_dtype, params, kind, fingerprint, progress,
                    _fail_after_layers, t0)


def _load_progress(out: Path, params: dict[str, Any]) -> dict[str, Any]:
    fresh = {"version": 1, "params": params, "dense": None, "tokenizer": None, "layers": {}}
    path = out / PROGRESS_NAME
    if not path.exists():
        return fresh
    try:
        prog = json.loads(path.read_text(encoding="utf-8"))
        ok = (isinstance(prog, dict) and prog.get("version") == 1 and isinstance(prog.get("layers"), dict))
    except (UnicodeDecodeError, json.JSONDecodeError):
        ok = False
    if not ok:
        log.warning("%s: unreadable progress.json; starting the conversion over", out)
        return fresh
    if prog.get("params") != params:
        log.warning("%s: a conversion with other parameters was interrupted here; starting over", out)
        return fresh
    return prog


def _save_progress(out: Path, prog: dict[str, Any]) -> None:
    _write_atomic(out / PROGRESS_NAME, json.dumps(prog, indent=1).encode())


def _reusable_dense(out: Path, rec: Any) -> DenseInfo | None:
    try:
        info = DenseInfo.model_validate(rec)
    except Exception:
        return None
    p = out / info.file
    if info.file != DENSE_NAME or not p.is_file() or p.stat().st_size != info.nbytes:
        return None
    return info if _sha256_file(p) == info.sha256 else None


def _reusable_layer(out: Path, layer: int, rec: Any, n_exp: int) -> tuple[list[ExpertEntry], int] | None:
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
            if hashlib.sha256(f.read(e.nbytes)).hexdigest() != e.sha256:
                log.warning("%s: blob of expert %d does not match progress.json; converting layer %d "
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


def _write_dense(out: Path, source, dense_dtype: str) -> DenseInfo:
    from engine.loading.source import parse_expert_name
    from safetensors.torch import save_file

    names = [n for n in source.names() if parse_expert_name(n) is None]
    tensors, dtype = _dense_tensors(source, names, dense_dtype)
    final = out / DENSE_NAME
    tmp = final.with_name(final.name + TMP_SUFFIX)
    # One metadata key only: safetensors serializes the metadata map in hash order, and the
    # file must be byte-identical across runs (resume, digests).
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    del tensors
    os.chmod(tmp, 0o644)  # safetensors creates the file owner-only
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(out)
    return DenseInfo(file=DENSE_NAME, nbytes=final.stat().st_size, sha256=_sha256_file(final), dtype=dtype)


def _write_tokenizer(out: Path, files, src: Path) -> bool:
    try:
        tok = files.tokenizer()
    except TokenizerNotFoundError as e:
        log.warning("%s: no tokenizer (%s); the store will have none", src, e)
        return False
    final = out / TOKENIZER_DIR
    tmp = out / (TOKENIZER_DIR + TMP_SUFFIX)
    _remove(tmp)
    tok.hf.save_pretrained(str(tmp))
    gen = src / "generation_config.json"
    if src.is_dir() and gen.is_file():  # Tokenizer.from_hf_dir reads extra eos ids from it
        shutil.copyfile(gen, tmp / gen.name)
    for p in tmp.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        _remove(final)
    os.replace(tmp, final)
    _fsync_dir(out)
    return True


def _write_layer(out: Path, source, layer: int, n_exp: int, fmt, bar) -> tuple[list[ExpertEntry], int]:
    from engine.loading.source import expert_name
    from engine.quant.formats import pack_expert

    name = layer_file_name(layer)
    final = out / name
    tmp = final.with_name(name + TMP_SUFFIX)
    entries: list[ExpertEntry] = []
    offset = 0
    with open(tmp, "wb") as f:
        for j in range(n_exp):
            w = [source.get(expert_name(layer, j, p)) for p in ("gate_proj", "up_proj", "down_proj")]
            blob, layout = pack_expert(*w, fmt)
            entries.append(ExpertEntry(layer=layer, expert=j, file=name, offset=offset, nbytes=len(blob),
                                       sha256=hashlib.sha256(blob).hexdigest(), layout=layout))
            f.write(blob)
            padded = align_up(len(blob), BLOB_ALIGN)
            f.write(b"\0" * (padded - len(blob)))  # the file ends 4 KiB aligned too (O_DIRECT)
            offset += padded
            bar.update(1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(out)
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


def _run(src: Path, out: Path, files, fmt, dense_dtype: str, params: dict[str, Any], kind: str,
         fingerprint: str, progress: bool, fail_after: int | None, t0: float) -> ConvertSummary:
    from tqdm import tqdm

    for p in out.iterdir():  # leftovers of a killed run
        if p.name.endswith(TMP_SUFFIX):
            _remove(p)
    try:
        config, source = files.config, files.source
        moe_layers = config.moe_layers
        n_exp = config.moe.num_experts if config.moe is not None else 0
        prog = _load_progress(out, params)
        tokenizer_ok = _write_tokenizer(out, files, src)

        dense = _reusable_dense(out, prog.get("dense")) if prog.get("dense") else None
        if dense is None:
            dense = _write_dense(out, source, dense_dtype)
            prog["dense"] = dense.model_dump()
            _save_progress(out, prog)

        all_entries: list[ExpertEntry] = []
        data_files: dict[str, DataFile] = {}
        converted = reused = 0
        with tqdm(total=len(moe_layers) * n_exp, unit="expert", desc=f"convert {fmt.name}",
                  disable=not progress, leave=False) as bar:
            for layer in moe_layers:
                rec = prog["layers"].get(str(layer))
                got = _reusable_layer(out, layer, rec, n_exp) if rec is not None else None
                if got is not None:
                    reused += 1
                    bar.update(n_exp)
                else:
                    got = _write_layer(out, source, layer, n_exp, fmt, bar)
                    prog["layers"][str(layer)] = {"nbytes": got[1],
                                                  "entries": [e.model_dump() for e in got[0]]}
                    _save_progress(out, prog)
                    converted += 1
                    if fail_after is not None and converted >= fail_after:
                        raise _SimulatedInterrupt(f"simulated interruption after {converted} layers")
                entries, size = got
                all_entries.extend(entries)
                data_files[layer_file_name(layer)] = DataFile(nbytes=size)

        expert_params = len(all_entries) * 3 * config.hidden_size * (
            config.moe.expert_intermediate_size if config.moe else 0)
        expert_file_bytes = sum(f.nbytes for f in data_files.values())
        manifest = StoreManifest(
            schema_version=SCHEMA_VERSION,
            source=SourceInfo(path=str(src.resolve()), kind=kind, fingerprint=fingerprint),
            model_config=config.to_dict(),
            quant=QuantInfo(format=fmt.name, group_size=fmt.group_size),
            dense=dense,
            tokenizer_dir=TOKENIZER_DIR if tokenizer_ok else None,
            data_files=data_files,
            experts=all_entries,
            totals=StoreTotals(
                num_moe_layers=len(moe_layers), num_experts=len(all_entries),
                expert_params=expert_params, expert_bytes=sum(e.nbytes for e in all_entries),
                expert_file_bytes=expert_file_bytes, dense_bytes=dense.nbytes,
                total_bytes=expert_file_bytes + dense.nbytes, bits_per_weight=fmt.bits_per_weight),
            conversion=ConversionInfo(
                created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                moestream_version=_version(), dense_dtype=dense_dtype),
        )
        check_manifest(manifest, out / MANIFEST_NAME)  # never write a manifest the reader refuses
        _write_atomic(out / MANIFEST_NAME, manifest.to_json().encode())
        (out / PROGRESS_NAME).unlink(missing_ok=True)
        _fsync_dir(out)
    finally:
        files.source.close()  # views of its mappings are gone; closing twice is harmless
    return _summary_from_manifest(manifest, out, time.perf_counter() - t0,
                                  layers_converted=converted, layers_reused=reused)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("moestream")
    except Exception:  # not installed (running from a checkout)
        return "0+unknown"


__all__ = ["ConvertSummary", "convert", "source_fingerprint", "PROGRESS_NAME"]
