"""The PLE tier in the expert store: convert writes each PLE layer's n-gram table as a row file
(engine.store.ple_rows) instead of into dense.safetensors; loading builds the model without the
table and swaps ``model.ple_tables`` for DiskPLETables (engine.store.ple_disk).

Canonical table names (engine.models.qwen4_exp.names): ``model.layers.{i}.ple.ngram.shard_{k}``,
the ``split_ngram_parts`` row chunks of layer i's [rows, row_dim] table, in row order. Convert
reads them shard by shard, in chunks of rows of each shard's (memory-mapped) tensor, so the table
is never whole in RAM. The manifest's ``ple_tables`` lists one entry per PLE layer, in layer order.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from engine.errors import ModelFormatError
from engine.loading.source import TensorInfo, TensorSource
from engine.store.ple_rows import RowLayout, checkpoint_dtype, read_layout, row_chunks, write_row_file

PLE_SHARD = re.compile(r"^model\.layers\.(\d+)\.ple\.ngram\.shard_(\d+)$")
PLE_DTYPES = ("checkpoint", "int8")


def ple_file_name(layer: int) -> str:
    return f"ple-layer-{layer:03d}.rows"


def ple_shards(names) -> dict[int, list[str]]:
    """layer -> its shard names in shard order (only layers with PLE tables)."""
    found: dict[int, dict[int, str]] = {}
    for n in names:
        m = PLE_SHARD.match(n)
        if m:
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = n
    out = {}
    for layer, shards in sorted(found.items()):
        if sorted(shards) != list(range(len(shards))):
            raise ModelFormatError(f"layer {layer}", f"PLE table shards {sorted(shards)}; expected 0..{len(shards) - 1}")
        out[layer] = [shards[k] for k in range(len(shards))]
    return out


def write_ple_tables(out: Path, source: TensorSource, ple_dtype: str) -> list[dict]:
    """Write every PLE layer's table from ``source`` as a row file in ``out``; returns the
    manifest entries (dicts of engine.store.manifest.PLETableEntry)."""
    if ple_dtype not in PLE_DTYPES:
        raise ModelFormatError(out, f"PLE table dtype {ple_dtype!r}; allowed: {', '.join(PLE_DTYPES)}")
    entries = []
    for layer, names in ple_shards(source.names()).items():
        infos = [source.info(n) for n in names]
        dims = {i.shape[1] if len(i.shape) == 2 else -1 for i in infos}
        if len(dims) != 1 or -1 in dims:
            raise ModelFormatError(names[0], f"PLE table shards of shapes {[list(i.shape) for i in infos]}; "
                                             "expected [rows, row_dim] with one row_dim")
        rows = sum(i.shape[0] for i in infos)
        dtype = "int8" if ple_dtype == "int8" else checkpoint_dtype(source.get(names[0]).dtype)

        def chunks():
            for n in names:
                yield from row_chunks(source.get(n))

        path = out / ple_file_name(layer)
        layout = write_row_file(path, chunks(), rows, dims.pop(), dtype)
        entries.append({"layer": layer, "file": path.name, "num_rows": layout.num_rows,
                        "row_dim": layout.row_dim, "dtype": layout.dtype, "nbytes": layout.file_bytes,
                        "shards": [list(i.shape) for i in infos]})
    return entries


class WithoutPLETables(TensorSource):
    """A store's dense source plus meta-device stand-ins for the PLE shards (they live in row
    files): the model is built without allocating its tables; :func:`attach_disk_tables` then
    drops the stand-ins."""

    def __init__(self, inner: TensorSource, entries) -> None:
        self.inner = inner
        self.shapes: dict[str, tuple[int, ...]] = {}
        for e in entries:
            for k, shape in enumerate(e.shards):
                self.shapes[f"model.layers.{e.layer}.ple.ngram.shard_{k}"] = tuple(shape)

    def names(self) -> list[str]:
        return self.inner.names() + list(self.shapes)

    def __contains__(self, name: str) -> bool:
        return name in self.shapes or name in self.inner

    def info(self, name: str) -> TensorInfo:
        if name in self.shapes:
            return TensorInfo(name=name, shape=self.shapes[name], dtype="F32")
        return self.inner.info(name)

    def get(self, name: str) -> torch.Tensor:
        if name in self.shapes:
            return torch.empty(self.shapes[name], device="meta")
        return self.inner.get(name)

    def release(self, t: torch.Tensor) -> bool:
        """The inner source's release (a converted weight's file pages leave the process)."""
        release = getattr(self.inner, "release", None)
        return bool(release and release(t))

    def rows(self, name: str):
        """The inner source's pread reader of a table's rows, or None."""
        rows = getattr(self.inner, "rows", None)
        return None if rows is None or name in self.shapes else rows(name)

    def close(self) -> None:
        self.inner.close()


def attach_disk_tables(model, store_root: Path, entries, tier) -> list:
    """Swap ``model.ple_tables`` for DiskPLETables over the store's row files (checked against
    the model's declared rows and row_dim) and drop the stand-in shard parameters."""
    from torch import nn

    tables = model.ple_tables
    if len(entries) != len(tables):
        raise ModelFormatError(store_root, f"store has {len(entries)} PLE row files; the model has "
                                           f"{len(tables)} PLE layers")
    expect = []
    for e, t in zip(entries, tables):
        if (e.num_rows, e.row_dim) != (t.num_rows, t.row_dim):
            raise ModelFormatError(store_root / e.file, f"PLE table [{e.num_rows}, {e.row_dim}] in the manifest; "
                                                        f"the model declares [{t.num_rows}, {t.row_dim}]")
        expect.append(RowLayout(e.num_rows, e.row_dim, e.dtype))
    disk = tier.open_tables([store_root / e.file for e in entries], expect)
    for layer in model.ple_layers:
        layer.ple.ngram = nn.Module()  # the meta stand-ins: nothing of the table stays in the model
    model.ple_tables = disk
    return disk


def check_row_files(store_root: Path, entries) -> None:
    """Every row file present and as long as its manifest says (ModelFormatError at open)."""
    for e in entries:
        layout = read_layout(store_root / e.file)
        if (layout.num_rows, layout.row_dim, layout.dtype) != (e.num_rows, e.row_dim, e.dtype):
            raise ModelFormatError(store_root / e.file, f"row file holds [{layout.num_rows}, {layout.row_dim}] "
                                                        f"{layout.dtype}; the manifest says [{e.num_rows}, "
                                                        f"{e.row_dim}] {e.dtype}")
