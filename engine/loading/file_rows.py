"""Rows of a 2-D tensor stored contiguously in a file, read with ``pread`` as they are looked up.

The embedding table a decoded token reads one row of: looked up through a mapping of the file, a
row's fault maps the whole page-cache folio it sits in (2 MiB once the file was read
sequentially, as a load's checksum reads it), so 48 random token ids put 40 MiB of a 65 MB table
into the process's RSS. Read with ``pread``, a row is its own bytes in a fresh buffer and nothing
of the file is mapped.
"""

from __future__ import annotations

import contextlib
import os

import torch

from engine.errors import ModelFormatError


class FileRows:
    """``rows(ids)`` -> ``[*ids.shape, cols]`` tensor of ``dtype``, read from ``path`` where a
    ``[num_rows, cols]`` tensor starts at byte ``offset``. Ids out of range raise IndexError;
    a short read (a file truncated since it was opened) raises ModelFormatError."""

    def __init__(self, path: str | os.PathLike[str], offset: int, shape: tuple[int, int],
                 dtype: torch.dtype) -> None:
        self.path, self.offset = str(path), offset
        self.num_rows, self.cols = shape
        self.dtype = dtype
        self.row_bytes = self.cols * torch.empty((), dtype=dtype).element_size()
        self._fd: int | None = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self._fd is None:
            raise ValueError(f"{self.path}: rows read after close()")
        flat = ids.reshape(-1).tolist()
        bad = [i for i in flat if not 0 <= i < self.num_rows]
        if bad:
            raise IndexError(f"token id {bad[0]} is out of range for an embedding of {self.num_rows} rows")
        out = torch.empty(len(flat), self.cols, dtype=self.dtype)
        raw = out.view(torch.uint8).numpy().reshape(-1)  # the same memory, as bytes
        rb = self.row_bytes
        for k, i in enumerate(flat):
            got = os.preadv(self._fd, [raw[k * rb:(k + 1) * rb]], self.offset + i * rb)
            if got != rb:
                raise ModelFormatError(self.path, f"row {i} read {got} of {rb} bytes: the file is shorter "
                                                  f"than its header says (truncated since it was opened?)")
        return out.reshape(*ids.shape, self.cols)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        # a failed __init__ left no _fd; a destructor raises nothing
        with contextlib.suppress(OSError, AttributeError):
            self.close()
