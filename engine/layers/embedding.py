"""The token embedding table left as the store holds it.

A decoded token reads one row of the embedding, yet a float32 copy of the table is the largest
dense tensor of many MoEs (Qwen3-30B's 151,936 x 2,048: 1.24 GB, more than all its attention
weights at int8). Built from a store's mapped file, the table stays bf16/f16 file pages that the
kernel pages in row by row and may drop under memory pressure (a cgroup limit counts them as
reclaimable cache, not as the process's own memory); each looked-up row is converted to the
compute dtype. The exact reference (``dense="fp32"``) keeps the float copy.
"""

from __future__ import annotations

import torch
from torch import nn


class StoredEmbedding(nn.Embedding):
    """nn.Embedding over ``weight`` as stored; rows come out in ``out_dtype``."""

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        self.out_dtype = out_dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stored={self.weight.dtype}, out={self.out_dtype}"


def compute_dtype(model) -> torch.dtype:
    """The dtype a model computes in (its activations, its KV cache): its embedding's output."""
    emb = model.model.embed_tokens
    return getattr(emb, "out_dtype", emb.weight.dtype)
