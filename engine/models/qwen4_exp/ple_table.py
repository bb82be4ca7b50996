"""The PLE n-gram embedding tables as the model reads them: one :class:`PLETable` per PLE layer
(``model.ple_tables[p]``, p = 0..P-1 in layer order).

Each step the model computes every PLE layer's row ids before layer 1 runs
(engine.models.qwen4_exp.ngram.ngram_row_ids: [T, G] for the T tokens of the step), hands them
to ``prefetch`` of every table, and the PLE layer later ``gather``s them. A table is
[num_rows, row_dim] with row_dim = ple_embed_dim / G; the model never touches the table's
storage otherwise, so a disk-backed table with a row cache (the PLE tier) can stand in for
:class:`InMemoryPLETable` (the default: the checkpoint's tensor, kept in RAM).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from engine.errors import ModelFormatError


@runtime_checkable
class PLETable(Protocol):
    row_dim: int  # = ple_embed_dim // ngram heads
    num_rows: int  # padded n-gram vocabulary of this layer

    def gather(self, row_ids: torch.Tensor) -> torch.Tensor:
        """row_ids [...] int64 -> rows [..., row_dim] float32."""

    def prefetch(self, row_ids: torch.Tensor) -> None:
        """A hint that ``row_ids`` will be gathered soon (may do nothing)."""


class InMemoryPLETable:
    """The whole table as one tensor [num_rows, row_dim] (any float dtype; rows come out fp32)."""

    def __init__(self, weight: torch.Tensor, name: str = "ple table") -> None:
        if weight.dim() != 2:
            raise ModelFormatError(name, f"a PLE table must be 2-D [rows, row_dim], got shape {list(weight.shape)}")
        self.weight = weight
        self.num_rows, self.row_dim = weight.shape

    def gather(self, row_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[row_ids.to(self.weight.device)].float()

    def prefetch(self, row_ids: torch.Tensor) -> None:
        return None

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
