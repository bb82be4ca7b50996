"""QSA's index keys, paged beside K/V (Qwen4-Exp's query-sparse attention; docs/qwen4_exp.md,
"QSA in the paged KV cache").

Every QSA layer keeps one raw index key per token (the indexer's key projection, before norm
and RoPE) and, per complete pooled block of ``R`` = compress_ratio tokens, one pooled key:
mean of the block's raw keys, RMS-normed, rotated at the block's first position. Both live in
the KV cache's own blocks (same block ids, same block tables), so whatever the cache does to a
sequence's blocks (allocate, free on finish / abort / preemption) it does to its index too.

Shape legend:
    Lq  QSA layers (their compact KV indices)   NB  blocks in the pool    BS  tokens per block
    Di  index head dim    R  compress ratio     PB  pooled keys per block = (BS - 1) // R + 1

keys     [Lq, NB, BS, Di] X   raw index key of token p at (table[p // BS], p % BS)
pooled   [Lq, NB, PB, Di] X   pooled key of block j (tokens jR .. jR+R-1) at the KV block
                              holding its last token e = jR+R-1: (table[e // BS], (e % BS) // R)

X = index_dtype(KV dtype): the KV cache's dtype when it is float32, bfloat16 or float16, bfloat16
under an FP8 KV cache (the index has no scales); the mean is taken in float32 either way.

The last tokens of the pooled blocks ending in one KV block lie R apart, so (e % BS) // R is
a distinct slot below PB for each, whatever R and BS are. Storing a pooled key with the block of
its last token means a pooled key only ever depends on tokens of blocks at or before the block
that holds it.

Incremental pooling and rollback: a write of positions [start, end) (re)computes exactly the
pooled blocks whose last token lies in it (j in [start // R, end // R)), reading the block's
raw keys back from the pages (its first tokens may come from earlier forwards). Writes always
start at the sequence's current length, so after a rollback (speculative rejection: the engine
continues from n < written length) a pooled block that held rejected tokens is recomputed
when its last token is written again, and no query reads it before then (a query at position p
scores only blocks j < (p + 1) // R, all written by then). Nothing per sequence lives here
beyond the block table, so keep / abort / preemption need no call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from engine.errors import ConfigError
from engine.kv.base import BatchLayout, KVCache
from engine.kv.paged import PagedKVCache


@dataclass(frozen=True)
class QSASpec:
    """The indexer's sizes (Qwen4-Exp config: indexer_n_heads, indexer_head_dim, indexer_budget,
    indexer_compress_ratio) and how many QSA layers the cache holds."""

    num_layers: int
    index_heads: int
    index_head_dim: int
    budget: int
    compress_ratio: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "index_heads", "index_head_dim", "budget", "compress_ratio"):
            if getattr(self, name) < 1:
                raise ConfigError(f"QSA {name}={getattr(self, name)} is invalid; allowed: >= 1")
        if self.budget % self.compress_ratio:
            raise ConfigError(f"QSA indexer_budget={self.budget} is not divisible by "
                              f"indexer_compress_ratio={self.compress_ratio}")

    @property
    def block_topk(self) -> int:
        """Complete pooled blocks a query keeps."""
        return self.budget // self.compress_ratio

    @property
    def max_selected(self) -> int:
        """Tokens one query attends at most: the kept blocks plus an incomplete tail (< R)."""
        return self.budget + self.compress_ratio - 1

    def bytes_per_block(self, block_size: int, dtype: torch.dtype = torch.float32) -> int:
        """Index bytes one KV block carries over all QSA layers (keys + pooled keys) in the index
        dtype that goes with a KV cache of ``dtype``."""
        pb = (block_size - 1) // self.compress_ratio + 1
        elem = torch.empty(0, dtype=index_dtype(dtype)).element_size()
        return self.num_layers * (block_size + pb) * self.index_head_dim * elem


def index_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The index's storage dtype beside K/V of ``kv_dtype`` (module doc)."""
    return kv_dtype if kv_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16


# (mean raw keys [m, Di] float32, block first positions [m] long) -> pooled keys [m, Di]
PoolFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class QSAPlan:
    """Where one step's rows write and read, shared by every QSA layer of the step.

    T rows (the layout's flat tokens), S sequences, W widest block table, M pooled blocks that
    complete in this step, NBmax most complete pooled blocks any sequence has after it."""

    tables: torch.Tensor  # [S, W] long, block ids (0-padded)
    row_seq: torch.Tensor  # [T] long, each row's sequence index
    row_pos: torch.Tensor  # [T] long, each row's position
    row_blocks: torch.Tensor  # [T] long, complete pooled blocks row t may score: (pos + 1) // R
    write_blk: torch.Tensor  # [T] long, block id of each row's token
    write_off: torch.Tensor  # [T] long, slot in that block
    done_pos: torch.Tensor  # [M] long, first position of each completed pooled block
    done_src_blk: torch.Tensor  # [M, R] long, where its R raw keys live
    done_src_off: torch.Tensor  # [M, R] long
    done_dst_blk: torch.Tensor  # [M] long, where its pooled key goes
    done_dst_slot: torch.Tensor  # [M] long
    seq_rows: tuple[tuple[int, int, int], ...]  # per sequence: (first row, rows, complete pooled blocks)
    pool_blk: torch.Tensor  # [S, NBmax] long, where pooled key j of each sequence lives
    pool_slot: torch.Tensor  # [S, NBmax] long
    by_blocks: tuple[tuple[int, torch.Tensor], ...]  # (nb >= 1, the rows [r] that see nb blocks)


class QSAIndexStore:
    """Index keys and pooled keys of every QSA layer, in the blocks of one PagedKVCache."""

    def __init__(self, spec: QSASpec, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", kv_dtype: torch.dtype = torch.float32) -> None:
        self.spec, self.block_size = spec, block_size
        self.per_block = (block_size - 1) // spec.compress_ratio + 1
        self.kv_dtype, dt = kv_dtype, index_dtype(kv_dtype)
        self.keys = torch.zeros(spec.num_layers, num_blocks, block_size, spec.index_head_dim, dtype=dt,
                                device=device)
        self.pooled = torch.zeros(spec.num_layers, num_blocks, self.per_block, spec.index_head_dim, dtype=dt,
                                  device=device)
        self._plan: tuple[BatchLayout, tuple, QSAPlan] | None = None

    @property
    def nbytes(self) -> int:
        return (self.keys.numel() + self.pooled.numel()) * self.keys.element_size()

    # ---- one step's plan --------------------------------------------------------------------
    def plan(self, paged: PagedKVCache, layout: BatchLayout) -> QSAPlan:
        """The step's plan (blocks reserved for every row first); built once per step and
        reused by its layers (a plan is a function of the layout and the block tables alone)."""
        ends = [c + n for c, n in zip(layout.context_lens, layout.query_lens)]
        for seq_id, end in zip(layout.seq_ids, ends):
            if paged.blocks_for(end) > len(paged.tables.get(seq_id, ())):
                paged.allocate(seq_id, end)
            paged.lengths[seq_id] = max(paged.lengths.get(seq_id, 0), end)
        tables = tuple(tuple(paged.tables[s]) for s in layout.seq_ids)
        if self._plan is not None and self._plan[0] == layout and self._plan[1] == tables:
            return self._plan[2]
        plan = self._build(layout, tables)
        self._plan = (layout, tables, plan)
        return plan

    def _build(self, layout: BatchLayout, tables: tuple[tuple[int, ...], ...]) -> QSAPlan:
        dev, bs, r = self.keys.device, self.block_size, self.spec.compress_ratio
        width = max(len(t) for t in tables)
        tab = torch.zeros(len(tables), width, dtype=torch.long)
        for i, t in enumerate(tables):
            tab[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        row_seq = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(layout.query_lens)])
        row_pos = layout.positions()
        done_pos, seq_rows = [], []
        for i, (ctx, n, start) in enumerate(zip(layout.context_lens, layout.query_lens, layout.offsets)):
            first, last = ctx // r, (ctx + n) // r  # pooled blocks whose last token this write covers
            done_pos.append(torch.arange(first, last, dtype=torch.long) * r)
            seq_rows.append((start, n, last))
        done_seq = torch.cat([torch.full((len(p),), i, dtype=torch.long) for i, p in enumerate(done_pos)])
        done = torch.cat(done_pos)
        src = done[:, None] + torch.arange(r)  # [M, R] token positions
        end = done + r - 1  # each completed block's last token
        nb_max = max(nb for _, _, nb in seq_rows)
        j = torch.arange(nb_max)
        last_tok = j * r + r - 1  # [NBmax]
        pool_blk = tab.gather(1, (last_tok // bs).clamp(max=width - 1).expand(len(tables), -1))
        row_blocks = (row_pos + 1) // r
        by_blocks = tuple((nb, (row_blocks == nb).nonzero(as_tuple=True)[0].to(dev))
                          for nb in torch.unique(row_blocks).tolist() if nb > 0)
        return QSAPlan(
            tables=tab.to(dev), row_seq=row_seq.to(dev), row_pos=row_pos.to(dev),
            row_blocks=row_blocks.to(dev),
            write_blk=tab[row_seq, row_pos // bs].to(dev), write_off=(row_pos % bs).to(dev),
            done_pos=done.to(dev), done_src_blk=tab[done_seq[:, None], src // bs].to(dev),
            done_src_off=(src % bs).to(dev), done_dst_blk=tab[done_seq, end // bs].to(dev),
            done_dst_slot=((end % bs) // r).to(dev), seq_rows=tuple(seq_rows),
            pool_blk=pool_blk.to(dev), pool_slot=((last_tok % bs) // r).expand(len(tables), -1).to(dev),
            by_blocks=by_blocks)

    # ---- the data path ----------------------------------------------------------------------
    def write(self, layer: int, plan: QSAPlan, raw_keys: torch.Tensor, pool: PoolFn) -> None:
        """Store the step's raw index keys [T, Di] of one layer, then (re)compute every pooled
        block they complete: mean of its R raw keys (float32) through ``pool`` (norm + RoPE)."""
        keys = self.keys[layer]  # [NB, BS, Di] view
        keys[plan.write_blk, plan.write_off] = raw_keys.to(keys.dtype)
        if plan.done_pos.numel():
            mean = keys[plan.done_src_blk, plan.done_src_off].float().mean(dim=1)  # [M, Di]
            self.pooled[layer][plan.done_dst_blk, plan.done_dst_slot] = pool(mean, plan.done_pos).to(keys.dtype)

    def pooled_keys(self, layer: int, plan: QSAPlan, seq: int) -> torch.Tensor:
        """Pooled keys of sequence ``seq``'s complete blocks after this step: [nb, Di] float32."""
        nb = plan.seq_rows[seq][2]
        return self.pooled[layer][plan.pool_blk[seq, :nb], plan.pool_slot[seq, :nb]].float()

    def raw_keys(self, layer: int, plan: QSAPlan, seq: int, length: int) -> torch.Tensor:
        """Raw index keys of sequence ``seq``'s first ``length`` tokens: [length, Di] (tests)."""
        pos = torch.arange(length, device=self.keys.device)
        return self.keys[layer][plan.tables[seq, pos // self.block_size], pos % self.block_size].float()


def paged_of(kv: KVCache) -> PagedKVCache | None:
    """The PagedKVCache under ``kv`` (itself, or a HybridKVCache's), None for any other cache."""
    if isinstance(kv, PagedKVCache):
        return kv
    inner = getattr(kv, "paged", None)
    return inner if isinstance(inner, PagedKVCache) else None


_STORES: "weakref.WeakKeyDictionary[PagedKVCache, QSAIndexStore]" = weakref.WeakKeyDictionary()


def qsa_index_for(paged: PagedKVCache, spec: QSASpec) -> QSAIndexStore:
    """The index store of ``paged`` (made on first use with its block count and size, on its
    device, and kept for the cache's lifetime)."""
    store = _STORES.get(paged)
    if store is None:
        if spec.num_layers > paged.num_layers:
            raise ConfigError(f"QSA over {spec.num_layers} layers but the KV cache holds {paged.num_layers}")
        store = _STORES[paged] = QSAIndexStore(spec, paged.num_blocks, paged.block_size,
                                               paged.storage.device, paged.dtype)
    elif store.spec != spec:
        raise ConfigError(f"KV cache already holds a QSA index for {store.spec}, asked for {spec}")
    return store


def qsa_spec_of(cfg) -> QSASpec | None:
    """The QSA sizes of a model config (``arch_params.qsa_spec(cfg)``: Qwen4-Exp), None without QSA."""
    own = getattr(cfg.arch_params, "qsa_spec", None)
    return own(cfg) if callable(own) else None


def qsa_block_bytes(cfg, block_size: int, kv_dtype: torch.dtype) -> int:
    """Index bytes one KV block of ``cfg`` carries besides its K/V (0 without QSA)."""
    spec = qsa_spec_of(cfg)
    return spec.bytes_per_block(block_size, kv_dtype) if spec is not None else 0


def index_bytes_per_block(paged: PagedKVCache) -> int:
    """Index bytes per block of ``paged``'s store (0 while it has none)."""
    store = _STORES.get(paged)
    return store.spec.bytes_per_block(store.block_size, store.kv_dtype) if store is not None else 0
