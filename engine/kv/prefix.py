"""Prefix caching: content addresses of full KV blocks.

A full block (``BS`` tokens) is named by ``block_hash(parent, tokens)``: a 16-byte BLAKE2b
digest of the parent block's name followed by the block's token ids as little-endian int64.
Chaining makes the name stand for the whole prefix up to the block's end, so two sequences
whose first ``k * BS`` tokens agree name their first ``k`` blocks the same, and a block can be
shared by reference (engine.kv.paged.BlockPool keeps ``hash -> block`` and refcounts).

Invariants the engine keeps (engine.kv.paged.PagedKVCache, engine.runner.Engine):
- a block gets a name only once every one of its positions holds committed K/V (a computed
  prompt or output token; speculative drafts count only once accepted), so rejected drafts
  never enter a named block;
- a named block is never written again: a sequence writes at positions >= its computed count,
  and a match always leaves at least one token to compute, in a block of its own.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

ROOT = b""  # the parent name of a sequence's first block


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a full block: BLAKE2b-128 over ``parent`` + the token ids as int64 LE."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.digest()


def chain_hashes(tokens: Sequence[int], block_size: int, n_blocks: int) -> list[bytes]:
    """Names of the first ``n_blocks`` full blocks of ``tokens``."""
    out, parent = [], ROOT
    for b in range(n_blocks):
        parent = block_hash(parent, tokens[b * block_size:(b + 1) * block_size])
        out.append(parent)
    return out


@dataclass
class PrefixStats:
    """Prompt tokens looked up at admission, and how many of them the cache held."""

    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class SnapshotStore:
    """Recurrent-state snapshots keyed by block name, at most ``capacity``, least recently used
    evicted first: on a hybrid model (engine.kv.state.HybridKVCache) a cached prefix is only
    usable up to a block boundary whose state was kept. The values are whatever the state
    object's own ``snapshot`` returns (opaque here), restored with its ``restore``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._snaps: OrderedDict[bytes, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._snaps)

    def __contains__(self, name: bytes) -> bool:
        return name in self._snaps

    def get(self, name: bytes) -> object:
        """The snapshot of ``name`` (KeyError if none), now the most recently used."""
        self._snaps.move_to_end(name)
        return self._snaps[name]

    def put(self, name: bytes, take: Callable[[], object]) -> None:
        """Keep the snapshot ``take()`` under ``name`` (taken only if not already kept)."""
        if self.capacity == 0:
            return
        if name in self._snaps:
            self._snaps.move_to_end(name)
            return
        self._snaps[name] = take()
        while len(self._snaps) > self.capacity:
            self._snaps.popitem(last=False)

    def discard(self, name: bytes) -> None:
        """Its block left the cache: the snapshot can never be matched again."""
        self._snaps.pop(name, None)
