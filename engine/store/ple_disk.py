"""The PLE tier: n-gram table rows read from the store's row files on demand, never loaded whole.

One :class:`DiskPLETable` per PLE layer (the PLETable protocol of
engine/models/qwen4_exp/ple_table.py: ``row_dim``, ``num_rows``, ``gather``, ``prefetch``), all
sharing one :class:`PLETier`: the read pool, the counters, the RAM budget.

- Reads: one 4 KiB-aligned page per read with ``O_DIRECT`` (no page cache, so the table never
  occupies host RAM behind our back); where the filesystem refuses ``O_DIRECT`` (tmpfs, some
  overlays) a plain ``pread`` followed by ``posix_fadvise(DONTNEED)`` on the page, said once.
  Every page's crc32 is checked as it arrives (PLERowChecksumError).
- Row cache: LRU of raw rows in one preallocated [slots, row_bytes] uint8 block per layer,
  slots = the tier's budget / layers / row_bytes (0 slots: no caching, every row read).
- ``prefetch(ids)`` (called for every PLE layer as soon as the step's token ids are known,
  before layer 1) submits the pages of rows neither cached nor in flight to the pool (queue depth
  = the pool's threads, >= 8); ``gather(ids)`` waits only for what is not yet there and reads
  synchronously what was never prefetched. Pages read ahead and not gathered by the next
  ``prefetch`` are dropped (counted as wasted). Only the model's thread calls gather/prefetch and
  touches the cache and counters; the pool's threads only fill page buffers.

Ledger (:class:`PLECounters`, shared by the tier's tables, merged into the expert cache's
CacheMetrics.summary and so into ``generate``'s figures and ``/metrics``): rows looked up, served
from the row cache, from a prefetch, or read synchronously; pages and bytes read from disk.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import ConfigError, ExpertLoadError
from engine.store.ple_rows import PAGE_ALIGN, RowLayout, check_page, decode_rows, read_layout

log = logging.getLogger(__name__)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)
_REFUSED_SAID: set[str] = set()  # O_DIRECT refusals already reported (once per filesystem dir)
MIN_QUEUE_DEPTH = 8
DEFAULT_PLE_BUDGET = 256 * 2**20  # RAM row cache of the whole tier (all PLE layers together)


@dataclass
class PLECounters:
    lookups: int = 0       # distinct rows a gather asked for (per call)
    cache_hits: int = 0    # served from the RAM row cache
    prefetched: int = 0    # served from a page a prefetch had read (or was reading)
    sync_reads: int = 0    # read by gather itself: never prefetched
    pages_read: int = 0
    bytes_read: int = 0    # bytes from disk (whole pages)
    wasted_pages: int = 0  # prefetched pages no gather used
    stall_s: float = 0.0   # gather time spent waiting for reads

    def summary(self, tokens: int) -> dict[str, float]:
        tok = max(tokens, 1)
        rows_read = self.prefetched + self.sync_reads
        return {"ple_lookups": self.lookups, "ple_cache_hits": self.cache_hits,
                "ple_hit_rate": self.cache_hits / self.lookups if self.lookups else 0.0,
                "ple_rows_read": rows_read, "ple_pages_read": self.pages_read,
                "ple_bytes_read": self.bytes_read, "ple_rows_per_token": self.lookups / tok,
                "ple_rows_read_per_token": rows_read / tok, "ple_bytes_per_token": self.bytes_read / tok,
                "ple_prefetched": self.prefetched, "ple_sync_reads": self.sync_reads,
                "ple_wasted_pages": self.wasted_pages, "ple_stall_s": self.stall_s}


class _PageReader:
    """Positional page reads of one row file into 4096-aligned buffers (thread-safe: pread)."""

    def __init__(self, path: Path, layout: RowLayout, direct: bool) -> None:
        self.path, self.layout = path, layout
        self.direct = False
        self.fd = -1
        if direct and _O_DIRECT:
            try:
                self.fd = os.open(path, os.O_RDONLY | _O_DIRECT)
                self.direct = True
                self._read(0)  # some filesystems accept the flag and refuse the read
            except OSError:
                if self.fd >= 0:
                    os.close(self.fd)
                self.fd, self.direct = -1, False
                _say_refused(path)
        if self.fd < 0:
            self.fd = os.open(path, os.O_RDONLY)

    def _read(self, page: int) -> np.ndarray:
        n = self.layout.page_bytes
        raw = np.empty(n + PAGE_ALIGN, dtype=np.uint8)
        skip = (-raw.ctypes.data) % PAGE_ALIGN
        buf = raw[skip:skip + n]
        off = self.layout.page_offset(page)
        got = os.preadv(self.fd, [memoryview(buf)], off)
        if got != n:
            raise ExpertLoadError(f"PLE row file {self.path}: short read of page {page} ({got} of {n} bytes "
                                  f"at offset {off}): the file was truncated")
        if not self.direct and _FADV_DONTNEED is not None:
            os.posix_fadvise(self.fd, off, n, _FADV_DONTNEED)  # keep the table out of the page cache
        return buf

    def read(self, page: int) -> np.ndarray:
        buf = self._read(page)
        check_page(self.layout, page, buf, self.path)
        return buf

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _say_refused(path: Path) -> None:
    key = str(path.parent)
    if key not in _REFUSED_SAID:
        _REFUSED_SAID.add(key)
        log.warning("O_DIRECT refused for PLE row files in %s: reading with pread + "
                    "posix_fadvise(DONTNEED) instead", key)


class PLETier:
    """The shared parts of a model's disk PLE tables: read pool, counters, RAM budget."""

    def __init__(self, budget_bytes: int = DEFAULT_PLE_BUDGET, queue_depth: int = 16, direct: bool = True) -> None:
        if budget_bytes < 0:
            raise ConfigError(f"PLE row-cache budget {budget_bytes} bytes; allowed: >= 0")
        if queue_depth < MIN_QUEUE_DEPTH:
            raise ConfigError(f"PLE read queue depth {queue_depth}; allowed: >= {MIN_QUEUE_DEPTH}")
        self.budget_bytes, self.direct = budget_bytes, direct
        self.pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="ple-read")
        self.counters = PLECounters()
        self.tables: list[DiskPLETable] = []

    def open_tables(self, paths: list[str | os.PathLike[str]], expect: list[RowLayout] | None = None) -> list["DiskPLETable"]:
        """One DiskPLETable per row file; the budget is split evenly between them."""
        share = self.budget_bytes // max(len(paths), 1)
        self.tables = [DiskPLETable(p, self, share, expect[i] if expect else None) for i, p in enumerate(paths)]
        return self.tables

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for t in self.tables:
            t.close()


class DiskPLETable:
    """One PLE layer's table read from its row file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], tier: PLETier, budget_bytes: int,
                 expect: RowLayout | None = None) -> None:
        from engine.store.ple_rows import expect_layout

        self.path = Path(path)
        self.layout = read_layout(self.path)
        if expect is not None:
            expect_layout(self.path, self.layout, expect)
        self.tier, self.counters = tier, tier.counters
        self.row_dim, self.num_rows = self.layout.row_dim, self.layout.num_rows
        self._reader = _PageReader(self.path, self.layout, tier.direct)
        self.slots = max(0, budget_bytes // self.layout.row_bytes)
        self._cache_block = torch.empty(self.slots, self.layout.row_bytes, dtype=torch.uint8)  # untouched until used
        self._where: OrderedDict[int, int] = OrderedDict()  # row id -> slot, LRU first
        self._free = list(range(self.slots - 1, -1, -1))
        self._pending: dict[int, Future] = {}  # page -> future of its buffer

    @property
    def direct_io(self) -> bool:
        return self._reader.direct

    def _check(self, row_ids: torch.Tensor) -> torch.Tensor:
        flat = row_ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_rows):
            raise ConfigError(f"PLE row ids out of range [0, {self.num_rows}) for {self.path.name}: "
                              f"min {int(flat.min())}, max {int(flat.max())}")
        return flat

    def prefetch(self, row_ids: torch.Tensor) -> None:
        """Start reading the pages of rows neither cached nor in flight; returns at once."""
        stale = [p for p, f in self._pending.items() if f.done()]
        for p in stale:  # a previous step's read-ahead that no gather used
            del self._pending[p]
            self.counters.wasted_pages += 1
        rpp = self.layout.rows_per_page
        for r in torch.unique(self._check(row_ids)).tolist():
            if r in self._where:
                continue
            page = r // rpp
            if page not in self._pending:
                self._pending[page] = self.tier.pool.submit(self._reader.read, page)
                self.counters.pages_read += 1
                self.counters.bytes_read += self.layout.page_bytes

    def gather(self, row_ids: torch.Tensor) -> torch.Tensor:
        """[...] row ids -> [..., row_dim] fp32 rows."""
        flat = self._check(row_ids)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        raw = torch.empty(uniq.numel(), self.layout.row_bytes, dtype=torch.uint8)
        c, rpp, rb = self.counters, self.layout.rows_per_page, self.layout.row_bytes
        c.lookups += uniq.numel()
        used: dict[int, Future] = {}
        sync_pages: set[int] = set()  # pages this gather had to read itself
        todo: list[tuple[int, int]] = []  # (index in uniq, row) not cached
        for i, r in enumerate(uniq.tolist()):
            slot = self._where.get(r)
            if slot is not None:
                self._where.move_to_end(r)
                raw[i] = self._cache_block[slot]
                c.cache_hits += 1
                continue
            page = r // rpp
            if page not in self._pending:
                self._pending[page] = self.tier.pool.submit(self._reader.read, page)
                sync_pages.add(page)
                c.pages_read += 1
                c.bytes_read += self.layout.page_bytes
            if page in sync_pages:
                c.sync_reads += 1
            else:
                c.prefetched += 1
            used[page] = self._pending[page]
            todo.append((i, r))
        t0 = time.perf_counter()
        try:
            bufs = {p: torch.from_numpy(f.result()) for p, f in used.items()}
        finally:
            for p in used:
                self._pending.pop(p, None)
        c.stall_s += time.perf_counter() - t0
        for i, r in todo:
            start = (r % rpp) * rb
            raw[i] = bufs[r // rpp][start:start + rb]
            self._admit(r, raw[i])
        return decode_rows(raw, self.layout)[inverse].reshape(*row_ids.shape, self.row_dim)

    def _admit(self, row: int, data: torch.Tensor) -> None:
        if self.slots == 0:
            return
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._where.popitem(last=False)
        self._cache_block[slot] = data
        self._where[row] = slot

    def close(self) -> None:
        for f in self._pending.values():
            f.cancel()
        self._pending.clear()
        self._reader.close()
