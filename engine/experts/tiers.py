"""Host tiers below the device cache: a RAM tier of fixed slots in front of the NVMe store.

The device cache (engine.experts.cache) asks an :class:`ExpertSource` for an expert's bytes.
:class:`HostTier` is the in-process source: a preallocated block of RAM slots (pinned memory when
CUDA is present, so host->device copies are DMA: registered in bounded chunks by
engine.experts.pinning, staged copies when that fails) with its own eviction policy, filled from the
store with digests checked when a blob first enters RAM. The Ray loader actors implement the same
interface over shared memory (services.expert_loader).

Shapes: every slot is one expert blob, ``slot_bytes`` = the store's largest blob rounded up to 4 KiB.
"""

from __future__ import annotations

import threading
import time
import weakref
from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from engine.errors import CacheCapacityError
from engine.experts.pinning import PinLimits, Registrar, StagedCopier, pin_buffer
from engine.experts.policy import make_policy
from engine.experts.slots import Key, SlotTable
from engine.hugepages import huge_empty

ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class TierCounters:
    hits: int = 0  # served from this tier
    misses: int = 0  # had to go to the tier below
    bytes_in: int = 0  # bytes that entered this tier from below
    seconds: float = 0.0  # time spent reading them from below (summed over threads)


class ExpertSource(ABC):
    """Where the device cache gets expert bytes from."""

    slot_bytes: int

    @abstractmethod
    def read_into(self, key: Key, out: torch.Tensor) -> str:
        """Copy the expert's blob into ``out`` (uint8, >= blob size, any device) and return the
        tier that served it ("ram" or "nvme"). Thread-safe."""

    @abstractmethod
    @contextmanager
    def host_view(self, key: Key) -> Iterator[torch.Tensor]:
        """A CPU uint8 view of the blob, valid inside the ``with`` (the slot is pinned)."""

    def counters(self) -> dict[str, TierCounters]:
        return {}

    def likely_in_ram(self, key: Key) -> bool:
        """A hint, without locking: the blob can probably be served from host RAM now (a
        memcpy, not an NVMe read). Wrong answers cost time, never correctness."""
        return False


class HostTier(ExpertSource):
    """RAM slots in front of an ExpertStore. ``budget`` bytes -> budget // slot_bytes slots.

    ``pin_memory`` (None: when CUDA is available) registers the slot block in chunks within
    ``pin_limits`` (engine.experts.pinning; ``registrar`` is a test seam); ``pinning`` is that
    registration, a PinnedBank (None when not pinning; not named ``bank``: a source's ``bank()``
    is the device expert cache's, engine.experts.device_cache), ``pinning.pinned`` False when it
    failed and copies are staged. :meth:`close` unregisters it."""

    def __init__(self, store, budget: int, *, policy: str = "lru", verify: bool = True,
                 pin_memory: bool | None = None, pin_limits: PinLimits | None = None,
                 registrar: Registrar | None = None, read_around: bool = False) -> None:
        self.store = store
        # read_around: a miss not held here is read from the store straight into the caller's
        # 4 KiB-aligned CPU buffer (read_into's ``out``: one O_DIRECT read, no copy through a RAM
        # slot) and not kept here. For a CPU run whose device tier is host memory and larger than
        # this tier, which could only hold a second copy of what the device tier holds: the copy
        # cost ~1 ms of a core per 2.65 MB miss (bench/beyond_ram.py, 50% limit).
        self.read_around = read_around
        self.slot_bytes = align_up(store.expert_nbytes)
        self.num_slots = budget // self.slot_bytes
        if self.num_slots < 1:
            raise CacheCapacityError(
                f"RAM budget {budget} bytes is smaller than one expert ({self.slot_bytes} bytes); "
                f"give --ram-budget of at least {self.slot_bytes}")
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        # 4 KiB-aligned slots (slot_bytes is a multiple of 4 KiB): the store reads straight into
        # them with O_DIRECT, so NVMe reads bypass the page cache and are honestly NVMe reads.
        self.buf = huge_empty(self.num_slots, self.slot_bytes)
        # chunk boundaries on slot boundaries: no slot's copy spans two registrations
        self.pinning = pin_buffer(self.buf, pin_limits, registrar, granule=self.slot_bytes) if pin else None
        self.copier = StagedCopier(self.slot_bytes)  # for an unpinned bank: copies to the GPU
        # unregister before the block is freed, should the tier be dropped without close()
        self._unregister = weakref.finalize(self, self.pinning.close) if self.pinning is not None else None
        if self._unregister is not None:
            self._unregister.atexit = False  # at exit the process's registrations go with it
        # each blob's digest is checked the first time this tier reads it; a blob read again (a
        # model bigger than RAM re-reads its experts every few tokens) is trusted: sha256 runs at
        # ~1.8 GB/s here, as long as a 2.65 MB expert takes to read (1.5 ms), on the cores that compute
        self.verify = verify
        self.verified: set[Key] = set()  # under self.lock
        # under self.lock
        self.table = SlotTable(self.num_slots, make_policy(policy), keys=store.num_experts_total)
        self.lock = threading.Lock()
        self.slot_freed = threading.Condition(self.lock)  # a pin dropped to zero
        self.ram = TierCounters()
        self.nvme = TierCounters()

    def counters(self) -> dict[str, TierCounters]:
        return {"ram": self.ram, "nvme": self.nvme}

    def close(self) -> None:
        """Unregister the pinned slot block. Idempotent; the tier still serves afterwards, its
        copies to the GPU then staged."""
        if self._unregister is not None:
            self._unregister()

    def _acquire_slot(self, key: Key) -> tuple[int, Future | None, bool]:
        """Under the lock: (slot, future to wait on or None, whether we must load it). When
        every slot holds a blob that other threads are copying out right now (more concurrent
        copies than RAM slots), waits for one of them to finish."""
        t = self.table
        t.tick()
        while True:
            if key in t.slot_of:
                fut = t.loading.get(key)
                t.pin(key)
                if fut is None:
                    t.hit(key)
                    self.ram.hits += 1
                return t.slot_of[key], fut, False
            taken = t.reserve(key)
            if taken is not None:
                break
            if not t.pins:  # pragma: no cover - cannot happen: every slot is pinned or loading
                raise CacheCapacityError(f"RAM tier: no slot of {self.num_slots} can be taken")
            self.slot_freed.wait()
        self.ram.misses += 1
        fut: Future = Future()
        t.loading[key] = fut
        t.pin(key)
        return taken[0], fut, True

    def _unpin(self, key: Key) -> None:
        with self.lock:
            if self.table.unpin(key):
                self.slot_freed.notify()

    @contextmanager
    def host_view(self, key: Key) -> Iterator[torch.Tensor]:
        with self.lock:
            slot, fut, must_load = self._acquire_slot(key)
        try:
            if must_load:
                self._load(key, slot, fut)
            elif fut is not None:
                fut.result()
            yield self.buf[slot]
        finally:
            self._unpin(key)

    def _read_store(self, key: Key, out: torch.Tensor) -> int:
        """``key``'s blob read from the store into ``out`` (its digest checked on its first read
        in this process), counted as an NVMe read; its bytes."""
        with self.lock:
            verify = self.verify and key not in self.verified
        t0 = time.perf_counter()
        n = len(self.store.read_expert(*key, out=out, verify=verify))
        dt = time.perf_counter() - t0
        with self.lock:
            if verify:
                self.verified.add(key)
            self.nvme.hits += 1
            self.nvme.bytes_in += n
            self.nvme.seconds += dt
        return n

    def _load(self, key: Key, slot: int, fut: Future) -> None:
        try:
            n = self._read_store(key, self.buf[slot])
            with self.lock:
                self.ram.bytes_in += n
                self.table.loaded(key)
            fut.set_result(slot)
        except BaseException as e:
            with self.lock:  # forget the slot: the bytes in it are not the expert's
                self.table.rollback(key)
                self.slot_freed.notify()
            fut.set_exception(e)
            raise

    def likely_in_ram(self, key: Key) -> bool:
        return self.table.resident(key)

    @torch.inference_mode()  # runs on I/O threads; see ExpertCache._copy_in
    def read_into(self, key: Key, out: torch.Tensor) -> str:
        with self.lock:
            hit = self.table.resident(key)
            around = (self.read_around and not out.is_cuda and key not in self.table.slot_of
                      and out.data_ptr() % ALIGN == 0)
            if around:  # read_around: straight into ``out``, no RAM slot
                self.ram.misses += 1
        if around:
            self._read_store(key, out)
            return "nvme"
        with self.host_view(key) as view:
            n = self.store.entry(*key).nbytes
            if self.pinning is not None and not self.pinning.pinned:
                self.copier.copy(view[:n], out)
            else:
                out[:n].copy_(view[:n], non_blocking=out.is_cuda)
                if out.is_cuda:
                    torch.cuda.current_stream().synchronize()  # the RAM slot may be reused after this
        return "ram" if hit else "nvme"
