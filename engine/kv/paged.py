"""Paged KV cache: a fixed pool of blocks, one block table per sequence.

Shape legend:
    L   layers                 NB  blocks in the pool        BS  tokens per block
    Nkv key/value heads        D   head dim                  n   new tokens of one sequence

storage   [L, 2, NB, BS, Nkv, D]   (index 0 = keys, 1 = values), bf16/fp16/fp32, or FP8 e4m3
scales    [L, 2, NB] float32       FP8 only: dequantized value = stored * scale
table     seq_id -> [block ids]    token position p lives at (table[p // BS], p % BS)

Blocks are reserved ahead of a forward by whoever plans the step (``allocate``), so a forward
never runs out of blocks half-way through its layers; ``store_and_load`` still allocates on
demand for callers that never reserve (e.g. the single-sequence loop in engine.generate), and
raises :class:`CapacityError` when the pool is empty.

FP8 scales:
    "block"  (default) one scale per (layer, k/v, block), raised as larger values arrive; when
             it grows, the tokens already in the block are requantized to the new scale.
    float    one fixed scale for the whole cache (per-tensor, static); values beyond
             +-448 * scale saturate.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from engine.config import ModelConfig
from engine.errors import CapacityError, ConfigError
from engine.hugepages import huge_empty
from engine.kv.base import KVCache
from engine.kv.prefix import ROOT, block_hash, chain_hashes

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8)


class BlockPool:
    """Block ids ``0 .. num_blocks-1`` with free lists, reference counts and content names.

    Order: FIFO. ``allocate`` takes ids from the head of the free list (initially ascending:
    0, 1, 2, ...); a block whose refcount drops to zero goes to the tail, so the least recently
    freed block is reused first. ``free(ids)`` releases in the order given.

    Prefix caching (engine.kv.prefix): a block may carry a name (``set_hash``). A named block
    whose refcount drops to zero stays cached: it goes to the tail of a second free list (least
    recently used at the head) and a later request can take it back (``take``). ``allocate``
    uses unnamed free blocks first and evicts named ones, LRU first, only when no unnamed block
    is left; eviction drops the name (and calls ``on_evict(name)``). Both lists count as free.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ConfigError(f"num_blocks={num_blocks} is invalid; allowed: >= 1")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # unnamed
        self._cached: OrderedDict[int, None] = OrderedDict()  # named, refcount 0, LRU first
        self.refcounts = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.evictions = 0
        self.on_evict: Callable[[bytes], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a named prefix."""
        return len(self._cached)

    def free_ids(self) -> list[int]:
        """The free lists, head first (the order ``allocate`` will hand ids out)."""
        return list(self._free) + list(self._cached)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with refcount 1; raises CapacityError (taking nothing) if fewer are free."""
        if n > self.num_free:
            raise CapacityError(f"KV block pool: {n} blocks requested, {self.num_free} of "
                                f"{self.num_blocks} free")
        ids = []
        for _ in range(n):
            if self._free:
                ids.append(self._free.popitem(last=False)[0])
                continue
            i = self._cached.popitem(last=False)[0]
            self._drop_name(i)
            self.evictions += 1
            ids.append(i)
        for i in ids:
            self.refcounts[i] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        for i in ids:
            assert self.refcounts[i] > 0, f"incref of free block {i}"
            self.refcounts[i] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference to each id; blocks reaching zero return to a free list's tail."""
        for i in ids:
            assert self.refcounts[i] > 0, f"double free of block {i}"
            self.refcounts[i] -= 1
            if self.refcounts[i] == 0:
                (self._cached if i in self.hash_of else self._free)[i] = None

    # ---- names (prefix caching) ------------------------------------------------------------
    def lookup(self, name: bytes) -> int | None:
        return self.by_hash.get(name)

    def take(self, i: int) -> None:
        """One more reference to named block ``i``, which may be free (cached): it leaves the
        free list."""
        if self.refcounts[i] == 0:
            del self._cached[i]
        self.refcounts[i] += 1

    def set_hash(self, i: int, name: bytes) -> bool:
        """Name block ``i`` (in use); False (nothing changes) when the name or the block already
        has one: another block holds the same content, or this one is named."""
        assert self.refcounts[i] > 0, f"naming free block {i}"
        if name in self.by_hash or i in self.hash_of:
            return False
        self.hash_of[i], self.by_hash[name] = name, i
        return True

    def _drop_name(self, i: int) -> None:
        name = self.hash_of.pop(i)
        del self.by_hash[name]
        if self.on_evict is not None:
            self.on_evict(name)


@dataclass(frozen=True)
class KVMetrics:
    blocks_total: int
    blocks_used: int
    blocks_free: int
    block_size: int
    bytes_total: int  # storage (+ FP8 scales) of the whole pool
    bytes_used: int  # the same for the used blocks
    num_sequences: int
    tokens_stored: int  # tokens written, over all sequences
    blocks_cached: int = 0  # of blocks_free: those still holding a named prefix (prefix caching)

    @property
    def utilisation(self) -> float:
        """Fraction of blocks in use."""
        return self.blocks_used / self.blocks_total


class PagedKVCache(KVCache):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                 fp8_scale: str | float = "block", device: torch.device | str = "cpu",
                 prefix_cache: bool = True) -> None:
        if dtype not in STORAGE_DTYPES:
            raise ConfigError(f"KV dtype {dtype} is not supported; allowed: "
                              f"{', '.join(str(d) for d in STORAGE_DTYPES)}")
        if block_size < 1:
            raise ConfigError(f"block_size={block_size} is invalid; allowed: >= 1")
        if dtype == FP8 and not (fp8_scale == "block" or
                                 (isinstance(fp8_scale, (int, float)) and fp8_scale > 0)):
            raise ConfigError(f"fp8_scale={fp8_scale!r} is invalid; allowed: 'block' or a number > 0")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.dtype = block_size, dtype
        self.fp8 = dtype == FP8
        self.per_block_scale = self.fp8 and fp8_scale == "block"
        self.pool = BlockPool(num_blocks)
        self.storage = huge_empty(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device).zero_()
        self.scales: torch.Tensor | None = None
        if self.fp8:
            init = 0.0 if self.per_block_scale else float(fp8_scale)
            self.scales = torch.full((num_layers, 2, num_blocks), init, dtype=torch.float32,
                                     device=device)
        # a sequence's block ids; a table only grows (allocate extends it in place) until free()
        # drops it or adopt() starts a new one
        self.tables: dict[int, list[int]] = {}
        # seq_id -> (the table mirrored, int32 buffer whose first entries are its ids, entries filled):
        # native_view's block tables without rebuilding a tensor of the whole table every step
        self._table_rows: dict[int, tuple[list[int], torch.Tensor, int]] = {}
        self.lengths: dict[int, int] = {}  # tokens written per sequence (max end over layers)
        self._scratch: int | None = None  # see scratch_block
        # prefix caching (engine.kv.prefix): seq_id -> names of its leading full blocks
        self.prefix_cache = prefix_cache
        self.chains: dict[int, list[bytes]] = {}

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, keys and values (+ its FP8 scales)."""
        elem = torch.empty(0, dtype=dtype).element_size()
        data = cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem
        return data + (cfg.num_layers * 2 * 4 if dtype == FP8 else 0)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, block_size: int = 16,
                    dtype: torch.dtype = torch.bfloat16, **kw) -> "PagedKVCache":
        """As many blocks as ``budget_bytes`` holds."""
        per_block = cls.block_bytes(cfg, block_size, dtype)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ConfigError(f"KV budget of {budget_bytes} bytes holds no block: one block of "
                              f"{block_size} tokens takes {per_block} bytes at {dtype}")
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size,
                   dtype, **kw)

    # ---- block accounting (used by the scheduler) -----------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _missing(self, seq_id: int, n_tokens: int) -> int:
        return max(0, self.blocks_for(n_tokens) - len(self.tables.get(seq_id, ())))

    def can_allocate(self, seq_id: int, n_tokens: int) -> bool:
        """Whether ``seq_id`` can grow to hold ``n_tokens`` tokens in total."""
        return self._missing(seq_id, n_tokens) <= self.pool.num_free

    def allocate(self, seq_id: int, n_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``n_tokens`` tokens in total; returns the new ids."""
        new = self.pool.allocate(self._missing(seq_id, n_tokens))
        if new and self.per_block_scale:
            self.scales[:, :, new] = 0.0
        self.tables.setdefault(seq_id, []).extend(new)
        self.lengths.setdefault(seq_id, 0)
        return new

    def scratch_block(self) -> int | None:
        """A block no sequence owns, where writes that must land nowhere go (the padding rows of
        a captured decode step: engine.cuda_graphs): taken from the pool on first use and kept
        for the cache's life; None while the pool has no free block."""
        if self._scratch is None and self.pool.num_free:
            self._scratch = self.pool.allocate(1)[0]
        return self._scratch

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.tables.get(seq_id, ()))

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references; its named blocks stay cached (BlockPool)."""
        self.pool.free(self.tables.pop(seq_id, ()))
        self._table_rows.pop(seq_id, None)
        self.lengths.pop(seq_id, None)
        self.chains.pop(seq_id, None)

    # ---- prefix caching (engine.kv.prefix) ---------------------------------------------------
    def cached_chain(self, tokens: Sequence[int]) -> list[bytes]:
        """Names of the longest run of leading full blocks of ``tokens`` the pool holds, leaving
        at least one token outside them (a forward must produce the last token's logits)."""
        if not self.prefix_cache or len(tokens) < 2:
            return []
        out = []
        for name in chain_hashes(tokens, self.block_size, (len(tokens) - 1) // self.block_size):
            if self.pool.lookup(name) is None:
                break
            out.append(name)
        return out

    def adopt(self, seq_id: int, names: list[bytes]) -> int:
        """Start ``seq_id`` (holding no block) on the cached blocks ``names`` (from
        ``cached_chain``): one reference each; returns the tokens they hold."""
        assert seq_id not in self.tables, f"sequence {seq_id} already holds blocks"
        ids = [self.pool.lookup(n) for n in names]
        for i in ids:
            self.pool.take(i)
        self.tables[seq_id] = ids
        self.lengths[seq_id] = len(ids) * self.block_size
        self.chains[seq_id] = list(names)
        return len(ids) * self.block_size

    def match_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        """Admission of a sequence that holds no block: reuse its longest cached prefix of full
        blocks; returns the tokens reused (0 with prefix caching off or nothing cached)."""
        return self.adopt(seq_id, self.cached_chain(tokens)) if self.prefix_cache else 0

    def chunk_limit(self, seq_id: int, start: int, n: int, prompt_len: int) -> int:
        """How many of the ``n`` tokens from ``start`` a prefill step may feed (all: positional
        K/V needs no stop at a block boundary; engine.kv.state.HybridKVCache does)."""
        return n

    def register(self, seq_id: int, n_computed: int, token_slice: Callable[[int, int], Sequence[int]]) -> int:
        """After a step: name the sequence's blocks that ``n_computed`` committed tokens now fill
        (``token_slice(start, n)``: the ids at those positions); returns how many leading full
        blocks the sequence has named (its chain's length)."""
        if not self.prefix_cache:
            return 0
        chain = self.chains.setdefault(seq_id, [])
        table = self.tables.get(seq_id, ())
        full = min(n_computed // self.block_size, len(table))
        while len(chain) < full:
            b = len(chain)
            chain.append(block_hash(chain[-1] if chain else ROOT,
                                    token_slice(b * self.block_size, self.block_size)))
            self.pool.set_hash(table[b], chain[-1])  # False: the same content is cached elsewhere
        return len(chain)

    # ---- data path -------------------------------------------------------------------------
    def store_and_load(self, layer, seq_id, start, k, v):
        ids = self.store(layer, seq_id, start, k, v)
        end = start + k.shape[0]
        nb = self.blocks_for(end)
        return (self._read(layer, 0, ids[:nb], end).to(k.dtype),
                self._read(layer, 1, ids[:nb], end).to(v.dtype))

    def store(self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k/v [n, Nkv, D] for positions [start, start+n) of ``seq_id`` (allocating blocks
        it lacks) without reading anything back; returns the sequence's block ids (long)."""
        end = start + k.shape[0]
        if self._missing(seq_id, end):
            self.allocate(seq_id, end)
        ids = self.table_row(seq_id).to(self.storage.device, torch.long)  # not the list rebuilt per layer
        pos = torch.arange(start, end, device=self.storage.device)
        blk, off = ids[pos // self.block_size], pos % self.block_size
        for i, x in enumerate((k, v)):
            self._write(layer, i, ids, blk, off, x)
        self.lengths[seq_id] = max(self.lengths[seq_id], end)
        return ids

    def write_at(self, layer: int, blk: torch.Tensor, off: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """Write k/v [T, Nkv, D] at the token slots (blk[i], off[i]) of blocks the caller has
        allocated (a whole step's rows at once: engine.layers.qsa); lengths are the caller's."""
        for i, x in enumerate((k, v)):
            self._write(layer, i, None, blk, off, x)

    def gather(self, layer: int, blk: torch.Tensor, off: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at the token slots (blk, off) (long tensors of one shape [...]): each
        [..., Nkv, D], FP8 dequantized to float32, else in the storage dtype. Reads only those
        slots (QSA's attention over selected blocks: engine.layers.qsa)."""
        out = []
        for kv in (0, 1):
            x = self.storage[layer, kv][blk, off]
            if self.fp8:
                x = x.float() * self.scales[layer, kv][blk][..., None, None]
            out.append(x)
        return out[0], out[1]

    def _write(self, layer: int, kv: int, ids: torch.Tensor | None, blk: torch.Tensor,
               off: torch.Tensor, x: torch.Tensor) -> None:
        """x [n, Nkv, D] into positions (blk[i], off[i])."""
        dst = self.storage[layer, kv]  # [NB, BS, Nkv, D] view
        if not self.fp8:
            dst[blk, off] = x.to(self.dtype)
            return
        scales = self.scales[layer, kv]  # [NB] view
        x = x.float()
        if self.per_block_scale:
            touched = torch.unique(blk)
            amax = torch.zeros(self.num_blocks, device=x.device).scatter_reduce_(
                0, blk, x.abs().amax(dim=(1, 2)), "amax")[touched]
            old = scales[touched]
            new = torch.maximum(old, amax / FP8_MAX)
            grow = (new > old) & (old > 0)
            if bool(grow.any()):  # requantize what the block already holds to the larger scale
                g, f = touched[grow], (old[grow] / new[grow])[:, None, None, None]
                dst[g] = (dst[g].float() * f).to(FP8)
            scales[touched] = new  # stays 0 while a block holds only zeros
        s = scales[blk]
        s = torch.where(s > 0, s, torch.ones_like(s))[:, None, None]
        dst[blk, off] = (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    def _read(self, layer: int, kv: int, ids: torch.Tensor, end: int) -> torch.Tensor:
        """The sequence's first ``end`` tokens, contiguous: [end, Nkv, D]."""
        blocks = self.storage[layer, kv, ids]  # gather: [nb, BS, Nkv, D]
        if self.fp8:
            blocks = blocks.float() * self.scales[layer, kv, ids][:, None, None, None]
        return blocks.reshape(-1, self.num_kv_heads, self.head_dim)[:end]

    def native_view(self, layout, device):
        if self.fp8 or self.storage.device != device:
            return None
        ends = [c + n for c, n in zip(layout.context_lens, layout.query_lens)]
        for seq_id, end in zip(layout.seq_ids, ends):
            if self._missing(seq_id, end):
                self.allocate(seq_id, end)
            self.lengths[seq_id] = max(self.lengths[seq_id], end)
        rows = [self.table_row(s) for s in layout.seq_ids]
        if len(rows) == 1:
            return self.storage, rows[0][None]  # a view: entries [:len] never change (tables only grow)
        tables = torch.zeros(len(rows), max(r.shape[0] for r in rows), dtype=torch.int32)
        for i, r in enumerate(rows):
            tables[i, :r.shape[0]] = r
        return self.storage, tables

    def table_row(self, seq_id: int) -> torch.Tensor:
        """The sequence's block ids as an int32 CPU tensor [blocks]: a view of a buffer kept in step
        with its table, only the ids allocated since the last call converted (capacity doubling),
        so a decode step's cost does not grow with the context (rebuilding it from the list took
        120 us a step at 2,000 blocks, a 32K context)."""
        t = self.tables[seq_id]
        mirrored, buf, filled = self._table_rows.get(seq_id, (None, None, 0))
        if mirrored is not t or filled > len(t):  # a new table (adopt, or freed and allocated again)
            buf, filled = None, 0
        if buf is None or len(t) > buf.shape[0]:
            grown = torch.empty(max(64, 2 * len(t)), dtype=torch.int32)
            if filled:
                grown[:filled] = buf[:filled]
            buf = grown
        if filled < len(t):
            buf[filled:len(t)] = torch.tensor(t[filled:], dtype=torch.int32)
        self._table_rows[seq_id] = (t, buf, len(t))
        return buf[:len(t)]

    # ---- metrics ---------------------------------------------------------------------------
    def metrics(self) -> KVMetrics:
        per_block = self.storage[:, :, 0].numel() * self.storage.element_size()
        if self.scales is not None:
            per_block += self.num_layers * 2 * 4
        used = self.pool.num_used
        return KVMetrics(blocks_total=self.num_blocks, blocks_used=used,
                         blocks_free=self.pool.num_free, block_size=self.block_size,
                         bytes_total=per_block * self.num_blocks, bytes_used=per_block * used,
                         num_sequences=len(self.tables), tokens_stored=sum(self.lengths.values()),
                         blocks_cached=self.pool.num_cached_free)
