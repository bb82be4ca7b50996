"""The token embedding table left as the store holds it.

A decoded token reads one row of the embedding, yet a float32 copy of the table is the largest
dense tensor of many MoEs (Qwen3-30B's 151,936 x 2,048: 1.24 GB, more than all its attention
weights at int8). Built from a store's mapped file, the table stays bf16/f16 file pages that the
kernel pages in row by row and may drop under memory pressure (a cgroup limit counts them as
reclaimable cache, not as the process's own memory); each looked-up row is converted to the
compute dtype. Given a row reader (engine.loading.file_rows.FileRows), a table on the CPU is not
even indexed through the mapping: each row is read by pread, since a fault on a mapped row maps
its whole page-cache folio (up to 2 MiB) into the process. The exact reference
(``dense="fp32"``) keeps the float copy.
"""

from __future__ import annotations

import torch
from torch import nn


class StoredEmbedding(nn.Embedding):
    """nn.Embedding over ``weight`` as stored; rows come out in ``out_dtype``."""

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype, rows=None) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        self.out_dtype = out_dtype
        # the same bytes by pread; only when they are this table's (same shape and dtype)
        same = rows is not None and (rows.num_rows, rows.cols) == tuple(weight.shape) and rows.dtype == weight.dtype
        self.rows = rows if same else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows is not None and self.weight.device.type == "cpu" and ids.device.type == "cpu":
            return self.rows(ids).to(self.out_dtype)
        return super().forward(ids).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stored={self.weight.dtype}, out={self.out_dtype}"


def compute_dtype(model) -> torch.dtype:
    """The dtype a model computes in (its activations, its KV cache): its embedding's output."""
    emb = model.model.embed_tokens
    return getattr(emb, "out_dtype", emb.weight.dtype)
