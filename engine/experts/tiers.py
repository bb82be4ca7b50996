"""Host tiers below the device cache: a RAM tier of fixed slots in front of the NVMe store.

The device cache (engine.experts.cache) asks an :class:`ExpertSource` for an expert's bytes.
:class:`HostTier` is the in-process source: a preallocated block of RAM slots (pinned memory when
CUDA is present, so host->device copies are DMA) with its own eviction policy, filled from the
store with digests checked when a blob first enters RAM. The Ray loader actors implement the same
interface over shared memory (services.expert_loader).

Shapes: every slot is one expert blob, ``slot_bytes`` = the store's largest blob rounded up to 4 KiB.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from engine.errors import CacheCapacityError
from engine.experts.policy import make_policy

Key = tuple[int, int]  # (layer, expert)
ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class TierCounters:
    hits: int = 0  # served from this tier
    misses: int = 0  # had to go to the tier below
    bytes_in: int = 0  # bytes that entered this tier from below


def take_slot(key: Key, slot_of: dict[Key, int], free_slots: list[int], policy, protected,
              clock: int) -> tuple[int, Key | None] | None:
    """The slot bookkeeping both tiers share: a free slot, else the policy's victim's (removed
    from ``slot_of`` and the policy); ``key`` is recorded in it. Returns (slot, evicted key or
    None), or None when every resident key is protected. Caller holds its lock."""
    victim = None
    if free_slots:
        slot = free_slots.pop()
    else:
        victim = policy.victim(slot_of.keys(), protected, clock)
        if victim is None:
            return None
        slot = slot_of.pop(victim)
        policy.on_remove(victim)
    slot_of[key] = slot
    policy.on_insert(key, clock)
    return slot, victim


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
    """RAM slots in front of an ExpertStore. ``budget`` bytes -> budget // slot_bytes slots."""

    def __init__(self, store, budget: int, *, policy: str = "lru", verify: bool = True,
                 pin_memory: bool | None = None) -> None:
        self.store = store
        self.slot_bytes = align_up(store.expert_nbytes)
        self.num_slots = budget // self.slot_bytes
        if self.num_slots < 1:
            raise CacheCapacityError(
                f"RAM budget {budget} bytes is smaller than one expert ({self.slot_bytes} bytes); "
                f"give --ram-budget of at least {self.slot_bytes}")
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        # 4 KiB-aligned slots (slot_bytes is a multiple of 4 KiB): the store reads straight into
        # them with O_DIRECT, so NVMe reads bypass the page cache and are honestly NVMe reads.
        raw = torch.empty(self.num_slots * self.slot_bytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
        skip = (-raw.data_ptr()) % ALIGN
        self.buf = raw[skip: skip + self.num_slots * self.slot_bytes].view(self.num_slots, self.slot_bytes)
        self.verify = verify
        self.policy = make_policy(policy)
        self.slot_of: dict[Key, int] = {}
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.loading: dict[Key, Future] = {}
        self.pins: dict[Key, int] = {}
        self.lock = threading.Lock()
        self.slot_freed = threading.Condition(self.lock)  # a pin dropped to zero
        self.clock = 0
        self.ram = TierCounters()
        self.nvme = TierCounters()

    def counters(self) -> dict[str, TierCounters]:
        return {"ram": self.ram, "nvme": self.nvme}

    def _acquire_slot(self, key: Key) -> tuple[int, Future | None, bool]:
        """Under the lock: (slot, future to wait on or None, whether we must load it). When
        every slot holds a blob that other threads are copying out right now (more concurrent
        copies than RAM slots), waits for one of them to finish."""
        self.clock += 1
        while True:
            if key in self.slot_of:
                fut = self.loading.get(key)
                self.pins[key] = self.pins.get(key, 0) + 1
                if fut is None:
                    self.policy.on_hit(key, self.clock)
                    self.ram.hits += 1
                return self.slot_of[key], fut, False
            taken = take_slot(key, self.slot_of, self.free_slots, self.policy,
                              set(self.pins) | set(self.loading), self.clock)
            if taken is not None:
                break
            if not self.pins:  # pragma: no cover - cannot happen: every slot is pinned or loading
                raise CacheCapacityError(f"RAM tier: no slot of {self.num_slots} can be taken")
            self.slot_freed.wait()
        self.ram.misses += 1
        slot = taken[0]
        fut: Future = Future()
        self.loading[key] = fut
        self.pins[key] = 1
        return slot, fut, True

    def _unpin(self, key: Key) -> None:
        with self.lock:
            n = self.pins[key] - 1
            if n:
                self.pins[key] = n
            else:
                del self.pins[key]
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

    def _load(self, key: Key, slot: int, fut: Future) -> None:
        layer, expert = key
        try:
            view = self.store.read_expert(layer, expert, out=self.buf[slot], verify=self.verify)
            with self.lock:
                self.nvme.hits += 1
                self.nvme.bytes_in += len(view)
                self.ram.bytes_in += len(view)
                del self.loading[key]
            fut.set_result(slot)
        except BaseException as e:
            with self.lock:  # forget the slot: the bytes in it are not the expert's
                self.loading.pop(key, None)
                self.slot_of.pop(key, None)
                self.policy.on_remove(key)
                self.free_slots.append(slot)
                self.slot_freed.notify()
            fut.set_exception(e)
            raise

    def likely_in_ram(self, key: Key) -> bool:
        return key in self.slot_of and key not in self.loading

    @torch.inference_mode()  # runs on I/O threads; see ExpertCache._copy_in
    def read_into(self, key: Key, out: torch.Tensor) -> str:
        with self.lock:
            hit = key in self.slot_of and key not in self.loading
        with self.host_view(key) as view:
            n = self.store.entry(*key).nbytes
            out[:n].copy_(view[:n], non_blocking=out.is_cuda)
            if out.is_cuda:
                torch.cuda.current_stream().synchronize()  # the RAM slot may be reused after this
        return "ram" if hit else "nvme"
