"""A synthetic model's experts written once to a real expert store on disk, and removed after.

The headline run's disk-backed variant (bench/headline.py ``--disk DIR``): the blobs of a
:class:`~engine.experts.synthetic_store.RAMExpertSource` are written in the store format
``convert`` writes (engine.store.manifest: ``experts-L{l:03d}.bin`` with 4 KiB-aligned blobs and
identity-bound digests, ``dense.safetensors``, ``manifest.json`` last), so
:class:`engine.store.reader.ExpertStore` opens it and the normal tiers (HostTier's O_DIRECT
reads, the Ray loaders) serve misses from it.

What it may touch (like convert, engine.store.outdir): ``DIR`` must not exist, be empty, or be
a directory this class wrote (its ledger ``synthetic-store.json`` is there: a killed run's
leftovers). The ledger is written first and lists every name the run will create; cleanup
removes exactly those (regular files only), then the ledger, then ``DIR`` if this run created
it. Any other file in ``DIR`` makes it refuse before writing anything.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

import torch

from engine.errors import ConfigError
from engine.store.manifest import (
    BLOB_ALIGN, DENSE_NAME, MANIFEST_NAME, SCHEMA_VERSION, ConversionInfo, DataFile, DenseInfo, ExpertEntry,
    QuantInfo, SourceInfo, StoreManifest, StoreTotals, align_up, blob_check, blob_digest, check_manifest,
    layer_file_name, sha256_file,
)
from engine.store.outdir import TMP_SUFFIX, store_name, tmp_name

LEDGER = "synthetic-store.json"
_KIND = "moestream synthetic store"

__all__ = ["LEDGER", "SyntheticDiskStore"]


class SyntheticDiskStore:
    """``with SyntheticDiskStore(source, out) as path:`` the store at ``path`` while inside."""

    def __init__(self, source, out: str | os.PathLike[str]) -> None:
        self.source = source
        self.store = source.store
        self.out = Path(out)
        self.created = False
        self.owned = False  # out checked to hold nothing but ours: cleanup may remove our names
        self.bytes_written = 0
        self.write_seconds = 0.0
        layers = range(self.store.shape.layers)
        final = [DENSE_NAME, MANIFEST_NAME] + [layer_file_name(l) for l in layers]
        self.names = final + [n + TMP_SUFFIX for n in final]

    # ---- what we may touch --------------------------------------------------------------------
    def _ledger_names(self) -> list[str] | None:
        """The names a previous run's ledger lists, or None when ``out`` holds no ledger of ours."""
        p = self.out / LEDGER
        try:
            if p.is_symlink() or not p.is_file() or p.stat().st_size > 1 << 20:
                return None
            raw = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(raw, dict) or raw.get("kind") != _KIND or not isinstance(raw.get("names"), list):
            return None
        # only names a store of ours has (as convert: a ledger cannot make us delete notes.txt)
        return [n for n in raw["names"] if isinstance(n, str) and (store_name(n) or tmp_name(n))]

    def _check_out(self) -> None:
        out = self.out
        if out.is_symlink() or (out.exists() and not out.is_dir()):
            raise ConfigError(f"--disk {out} is not a directory; give a new or empty directory")
        if not out.exists():
            return
        present = sorted(os.listdir(out))
        if not present:
            return
        ours = self._ledger_names()
        if ours is None:
            raise ConfigError(f"--disk {out} is not empty and not a synthetic store of ours "
                              f"(it holds {', '.join(present[:5])}{', ...' if len(present) > 5 else ''}); "
                              f"give a new or empty directory")
        foreign = [n for n in present if n != LEDGER and (n not in ours or not (out / n).is_file()
                                                            or (out / n).is_symlink())]
        if foreign:
            raise ConfigError(f"--disk {out} holds files this run did not write: {', '.join(foreign[:5])}; "
                              f"give a new or empty directory")

    def _remove(self, names) -> None:
        for n in names:
            p = self.out / n
            if p.is_file() and not p.is_symlink():
                p.unlink()

    # ---- write / clean up ---------------------------------------------------------------------
    def write(self) -> Path:
        import time

        self._check_out()
        self.owned = True
        t0 = time.perf_counter()
        if not self.out.exists():
            self.out.mkdir(parents=True)
            self.created = True
        leftovers = self._ledger_names() or []
        self._remove(leftovers)  # a killed run's files (checked to be only ours above)
        (self.out / LEDGER).write_text(json.dumps({"kind": _KIND, "names": self.names}))
        dense = self._write_dense()
        entries, files = [], {}
        for layer in range(self.store.shape.layers):
            got, size = self._write_layer(layer)
            entries += got
            files[layer_file_name(layer)] = DataFile(nbytes=size)
        m = self._manifest(dense, files, entries)
        check_manifest(m, self.out / MANIFEST_NAME)
        self._atomic(MANIFEST_NAME, lambda f: f.write(m.to_json().encode()))
        self.write_seconds = time.perf_counter() - t0
        return self.out

    def cleanup(self) -> None:
        """Remove what :meth:`write` created (the ledger's names), the ledger, and ``out`` if we
        made it. Never anything else: nothing at all when ``out`` was refused (a real store there
        has files of the same names)."""
        if not self.owned or not self.out.is_dir():
            return
        self._remove(self.names)
        self._remove([LEDGER])
        if self.created:
            try:
                self.out.rmdir()
            except OSError:  # someone put a file there meanwhile: leave it
                pass

    def __enter__(self) -> Path:
        try:
            return self.write()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    # ---- the files ----------------------------------------------------------------------------
    def _atomic(self, name: str, fill) -> Path:
        tmp, final = self.out / (name + TMP_SUFFIX), self.out / name
        with open(tmp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
            self.bytes_written += f.tell()
        os.replace(tmp, final)
        return final

    def _write_dense(self) -> DenseInfo:
        from engine.loading.source import parse_expert_name
        from safetensors.torch import save_file

        src = self.store.dense_source()
        tensors = {n: src.get(n).to(torch.bfloat16).contiguous() for n in src.names() if parse_expert_name(n) is None}
        tmp, final = self.out / (DENSE_NAME + TMP_SUFFIX), self.out / DENSE_NAME
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, final)
        self.bytes_written += final.stat().st_size
        return DenseInfo(file=DENSE_NAME, nbytes=final.stat().st_size, sha256=sha256_file(final), dtype="bf16")

    def _write_layer(self, layer: int) -> tuple[list[ExpertEntry], int]:
        fmt, name = self.store.fmt, layer_file_name(layer)
        entries, offset = [], 0
        pad = bytes(BLOB_ALIGN)

        def fill(f):
            nonlocal offset
            for e in range(self.store.shape.experts):
                blob = self.source.blob((layer, e)).numpy().tobytes()
                entries.append(ExpertEntry(layer=layer, expert=e, file=name, offset=offset, nbytes=len(blob),
                                           sha256=blob_digest(layer, e, fmt.name, fmt.group_size, blob),
                                           xxh3=blob_check(layer, e, fmt.name, fmt.group_size, blob),
                                           layout=self.store.layout))
                f.write(blob)
                padded = align_up(len(blob), BLOB_ALIGN)
                f.write(pad[:padded - len(blob)])
                offset += padded

        self._atomic(name, fill)
        return entries, offset

    def _manifest(self, dense: DenseInfo, files: dict, entries: list) -> StoreManifest:
        from engine.store.writer import _version as version

        s, fmt, cfg = self.store.shape, self.store.fmt, self.store.config
        expert_file_bytes = sum(f.nbytes for f in files.values())
        return StoreManifest(
            schema_version=SCHEMA_VERSION,
            # no checkpoint: the source is the generator; "hf" because the schema knows no other kind
            source=SourceInfo(path=str(self.out.resolve()), kind="hf",
                              fingerprint=f"synthetic {s.name} seed {self.store.seed}"),
            model_config=cfg.to_dict(), quant=QuantInfo(format=fmt.name, group_size=fmt.group_size),
            dense=dense, tokenizer_dir=None, tokenizer_files={}, data_files=files, experts=entries,
            totals=StoreTotals(num_moe_layers=len(cfg.moe_layers), num_experts=len(entries),
                               expert_params=len(entries) * 3 * s.hidden * s.expert_width,
                               expert_bytes=sum(e.nbytes for e in entries), expert_file_bytes=expert_file_bytes,
                               dense_bytes=dense.nbytes, total_bytes=expert_file_bytes + dense.nbytes,
                               bits_per_weight=fmt.bits_per_weight),
            conversion=ConversionInfo(created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                                      moestream_version=version(), dense_dtype="bf16"))
