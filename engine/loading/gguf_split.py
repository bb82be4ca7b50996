"""Split GGUF files (``NAME-00001-of-0000N.gguf``, llama.cpp's gguf-split / converter
``--split-max-*``), read as one file.

Every shard is a complete GGUF file carrying ``split.no`` (0-based), ``split.count`` and
``split.tensors.count``; the first shard holds the model's metadata, each shard its own tensors.
:func:`open_gguf` opens a path as a :class:`GGUFFile` or, when it is the first of several
shards, as a :class:`SplitGGUF` with the same reading interface (``metadata``,
``metadata_types``, ``tensors``, ``raw``, ``close``) over all of them. Every shard must be
present, numbered and counted consistently, and no tensor may appear twice; each problem is a
ModelFormatError naming the shard.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelFormatError
from engine.loading.gguf_file import GGUFFile

SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_SHARDS = 9999


def open_gguf(path: str | os.PathLike[str]):
    """A GGUFFile, or a SplitGGUF when ``path`` is shard 1 of a split model."""
    first = GGUFFile(path)
    count = first.metadata.get("split.count", 1)
    if count in (0, 1):
        return first
    try:
        return SplitGGUF(first)
    except BaseException:
        first.close()
        raise


class SplitGGUF:
    def __init__(self, first) -> None:
        self.path = first.path
        count, no = first.metadata.get("split.count"), first.metadata.get("split.no", 0)
        p = Path(first.path)
        m = SPLIT_RE.match(p.name)
        if not isinstance(count, int) or not 1 < count <= MAX_SHARDS:
            raise ModelFormatError(p, f"split.count must be an integer in [2, {MAX_SHARDS}], got {count!r}")
        if no != 0 or m is None or int(m.group("no")) != 1 or int(m.group("count")) != count:
            raise ModelFormatError(p, f"open the first shard of a split GGUF (NAME-00001-of-{count:05d}.gguf); "
                                      f"this file is shard {no + 1 if isinstance(no, int) else no!r} of {count}")
        self.shards = [first]
        self.metadata: dict[str, Any] = first.metadata
        self.metadata_types: dict[str, int] = first.metadata_types
        self.tensors: dict = dict(first.tensors)
        self._owner: dict[str, Any] = {n: first for n in first.tensors}
        try:
            for i in range(2, count + 1):
                shard = p.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf")
                if not shard.is_file():
                    raise ModelFormatError(shard, f"shard {i} of {count} is missing")
                f = GGUFFile(shard)
                self.shards.append(f)
                if f.metadata.get("split.no") != i - 1 or f.metadata.get("split.count") != count:
                    raise ModelFormatError(shard, f"split.no/split.count are {f.metadata.get('split.no')!r}/"
                                                  f"{f.metadata.get('split.count')!r}; expected {i - 1}/{count}")
                for name, info in f.tensors.items():
                    if name in self.tensors:
                        raise ModelFormatError(shard, f"tensor {name!r} also appears in {self._owner[name].path}")
                    self.tensors[name] = info
                    self._owner[name] = f
            declared = first.metadata.get("split.tensors.count")
            if declared is not None and declared != len(self.tensors):
                raise ModelFormatError(p, f"split.tensors.count is {declared} but the {count} shards hold "
                                          f"{len(self.tensors)} tensors")
        except BaseException:
            self.close()
            raise

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._owner[name].raw(name, start, stop)

    def close(self) -> None:
        for f in self.shards:
            f.close()
