"""The KV-cache interface the attention layer talks to.

A forward pass carries a :class:`BatchLayout` (which sequences, how many new tokens each, how
many tokens each already has cached). Attention hands each sequence's new keys/values to the
cache and gets back the whole context for that sequence. The contiguous cache below is the
simple reference; the paged cache (engine.kv.paged) implements the same interface.

Shapes: k, v [n, Nkv, D] for the n new tokens; returned K, V [context + n, Nkv, D].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.hugepages import huge_empty


@dataclass(frozen=True)
class BatchLayout:
    """Flat token batch: sequence s owns tokens [offsets[s], offsets[s] + query_lens[s])."""

    seq_ids: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # tokens already in the cache before this forward

    def __post_init__(self) -> None:
        assert len(self.seq_ids) == len(self.query_lens) == len(self.context_lens)

    @property
    def offsets(self) -> list[int]:
        out, acc = [], 0
        for n in self.query_lens:
            out.append(acc)
            acc += n
        return out

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def last_rows(self) -> list[int]:
        """The flat row of each sequence's last token."""
        return [o + n - 1 for o, n in zip(self.offsets, self.query_lens)]

    def positions(self) -> torch.Tensor:
        """Absolute position of every token in the flat batch, [T]."""
        parts = [torch.arange(c, c + n) for c, n in zip(self.context_lens, self.query_lens)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    @staticmethod
    def single(seq_id: int, query_len: int, context_len: int) -> "BatchLayout":
        return BatchLayout((seq_id,), (query_len,), (context_len,))


class KVCache(ABC):
    @abstractmethod
    def store_and_load(
        self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v for positions [start, start+n) of ``seq_id`` and return K/V for [0, start+n)."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Drop everything cached for ``seq_id``."""

    def keep(self, seq_id: int, n_tokens: int) -> None:
        """After speculative verification: ``seq_id`` continues from ``n_tokens`` (rejected
        drafts lie beyond). Positional K/V needs nothing (stale entries are overwritten before
        they are read); a cache with recurrent state restores the state at ``n_tokens``
        (engine.kv.state.HybridKVCache)."""

    def native_view(self, layout: BatchLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For the fused step (engine.step): make room for every sequence of ``layout`` (its context
        plus its new tokens) and return (storage [L, 2, NB, BS, Nkv, D], block tables int32
        [S, max blocks]), the native attention writing and reading positions through the tables;
        None when this cache cannot be used that way (the step then runs the torch layers)."""
        return None


class ContiguousKVCache(KVCache):
    """One growable [L, 2, capacity, Nkv, D] tensor per sequence, on the device of the keys it is
    given. Simple and exact."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, initial_capacity: int = 256) -> None:
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype = dtype
        self.initial_capacity = initial_capacity
        self._seqs: dict[int, torch.Tensor] = {}

    def _ensure(self, seq_id: int, length: int, device: torch.device) -> torch.Tensor:
        buf = self._seqs.get(seq_id)
        cap = 0 if buf is None else buf.shape[2]
        if length > cap:
            new_cap = max(length, 2 * cap, self.initial_capacity)
            L, nkv, d = self.shape
            grown = huge_empty(L, 2, new_cap, nkv, d, dtype=self.dtype, device=device)
            if buf is not None:
                grown[:, :, :cap] = buf
            self._seqs[seq_id] = buf = grown
        return buf

    def store_and_load(self, layer, seq_id, start, k, v):
        end = start + k.shape[0]
        buf = self._ensure(seq_id, end, k.device)
        buf[layer, 0, start:end] = k
        buf[layer, 1, start:end] = v
        return buf[layer, 0, :end], buf[layer, 1, :end]

    def free(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def native_view(self, layout, device):
        """One sequence's buffer [L, 2, cap, Nkv, D] is one block of ``cap`` positions."""
        if len(layout.seq_ids) != 1 or self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        buf = self._ensure(layout.seq_ids[0], layout.context_lens[0] + layout.query_lens[0], device)
        return buf.unsqueeze(2), torch.zeros(1, 1, dtype=torch.int32)

    def num_sequences(self) -> int:
        return len(self._seqs)
