"""Expert loaders: N actors, each owning a shard of the store and its share of the RAM tier.

Data plane (no pickle, no Python-level copy of expert bytes):

    store file --pread (O_DIRECT), sha256 checked--> loader's shared-memory segment (RAM tier)
    decode process maps the segment read-only and copies slot -> device slot
                   (CPU: straight into the slot; CUDA: into a pinned staging buffer, then H2D)

Control plane: one actor call per RAM-tier miss of the device cache, carrying protocol frames
(ExpertFetch -> ExpertReady | ErrorReply, msgpack via protocol.codec).

Why our own POSIX shared memory and not the Ray object store (figures: bench/pipeline.py,
docs/serving.md "Inside the pipeline"): both give the decode process a zero-copy view, but
  * a blob enters the segment by one pread straight into its slot (the object store needs a
    read into a private buffer plus a ``ray.put`` copy: ~1 extra memcpy per blob entering RAM);
  * the decode side can re-read a RAM-resident blob *without any actor call*: each slot has a
    header (sequence number, layer, expert, nbytes) and a reader validates a copy seqlock-style
    (sequence even and unchanged across the copy, key matches). A ``ray.get`` of a cached
    ObjectRef would also skip the loader, but it pins the object past the loader's eviction
    (the RAM budget stops being a budget) and the ref dies with its owner when the loader is
    killed;
  * the budget is exact: ``num_slots * slot_bytes`` bytes, never spilled to disk by Ray.
The cost: segments are node-local, so loaders are placed on the decode actor's node (soft
affinity is not enough: a remote loader's segment could not be mapped).

Segment layout (all little-endian):

    [0, 64)                       preamble: magic, num_slots, slot_bytes, data_offset
    [64, 64 + 32 * num_slots)     slot headers: seq u64, layer i32, expert i32, nbytes u64, pad
    [data_offset, ...)            slot i at data_offset + i * slot_bytes (4 KiB aligned)

Seqlock: the writer sets seq odd, fills the slot, writes the key, sets seq even (seq only grows).
A reader copies, then accepts the copy only if seq was even, unchanged, and the key matched.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import mmap
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

from engine.errors import ExpertLoadError
from engine.experts.policy import make_policy
from engine.experts.slots import Key, SlotTable
from engine.experts.tiers import ALIGN, ExpertSource, TierCounters, align_up
from protocol import (
    ErrorCode,
    ErrorReply,
    ExpertFetch,
    ExpertReady,
    HealthReply,
    ProtocolError,
    decode,
    encode,
)
from services.handles import NAMESPACE

log = logging.getLogger(__name__)

MAGIC = 0x31304D4853454F4D  # b"MOESHM01"
PREAMBLE = np.dtype([("magic", "<u8"), ("num_slots", "<u8"), ("slot_bytes", "<u8"),
                     ("data_offset", "<u8"), ("pad", "<u8", 4)])
SLOT_HEADER = np.dtype([("seq", "<u8"), ("layer", "<i4"), ("expert", "<i4"),
                        ("nbytes", "<u8"), ("pad", "<u8")])
assert PREAMBLE.itemsize == 64 and SLOT_HEADER.itemsize == 32


# Naming, sweeps and the reaper live in services/shm.py (stdlib only: it is also the reaper).
from services.shm import (  # noqa: E402  (re-exported: app.py and the tests import them here)
    SEGMENT_TAG,
    SHM_DIR,
    Reaper,
    segment_name,
    segment_prefix,
    sweep_dead_segments,
    sweep_segments,
)


# --------------------------------------------------------------------------- writer side


class ShmRamTier:
    """A loader's RAM tier: ``budget // slot_bytes`` slots in one shared-memory segment.

    All bookkeeping runs on one asyncio loop (the actor's); only the disk read runs on a thread,
    into a slot nobody else can be handed until the read finished.
    """

    def __init__(self, store, budget: int, name_prefix: str, policy: str = "lru") -> None:
        self.store = store
        self.slot_bytes = align_up(store.expert_nbytes)
        self.num_slots = budget // self.slot_bytes
        if self.num_slots < 1:
            raise ExpertLoadError(f"loader RAM budget {budget} bytes holds no expert of "
                                  f"{self.slot_bytes} bytes; raise --ram-budget")
        self.data_offset = align_up(PREAMBLE.itemsize + SLOT_HEADER.itemsize * self.num_slots, ALIGN)
        size = self.data_offset + self.num_slots * self.slot_bytes
        self.name = segment_name(name_prefix)
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        try:  # unlinks the segment if this process dies without close() (SIGKILL, ray stop)
            self.reaper: Reaper | None = Reaper(self.path)
        except OSError as e:
            self.reaper = None
            log.warning("no reaper for %s (%s): a killed loader leaves it to the next start's "
                        "sweep", self.name, e)
        pre = np.frombuffer(self.mm, dtype=PREAMBLE, count=1)
        pre["num_slots"], pre["slot_bytes"], pre["data_offset"] = self.num_slots, self.slot_bytes, self.data_offset
        pre["magic"] = MAGIC
        self.hdr = np.frombuffer(self.mm, dtype=SLOT_HEADER, count=self.num_slots, offset=PREAMBLE.itemsize)
        self.hdr["layer"] = -1
        self.hdr["expert"] = -1
        self.table = SlotTable(self.num_slots, make_policy(policy))  # on the actor's event loop
        self.ram = TierCounters()
        self.nvme = TierCounters()

    def slot_view(self, slot: int) -> memoryview:
        off = self.data_offset + slot * self.slot_bytes
        return memoryview(self.mm)[off:off + self.slot_bytes]

    async def fetch(self, key: Key) -> tuple[int, str]:
        """Make ``key`` resident; returns (slot, tier that served it: "ram" or "nvme")."""
        t = self.table
        t.tick()
        fut = t.loading.get(key)
        if fut is not None:  # someone is reading it from disk right now: wait, then look again
            await asyncio.shield(fut)
            return await self.fetch(key)
        if key in t.slot_of:
            t.hit(key)
            self.ram.hits += 1
            return t.slot_of[key], "ram"
        self.ram.misses += 1
        taken = t.reserve(key)
        if taken is None:
            raise ExpertLoadError(f"loader RAM tier: all {self.num_slots} slots are being "
                                  f"loaded at once; raise --ram-budget")
        slot = taken[0]
        h = self.hdr[slot:slot + 1]
        h["seq"] += 1  # odd: being written; readers reject it
        h["layer"], h["expert"], h["nbytes"] = -1, -1, 0
        fut = asyncio.get_running_loop().create_future()
        t.loading[key] = fut
        try:
            view = await asyncio.to_thread(self.store.read_expert, key[0], key[1],
                                           self.slot_view(slot), True)
            n = len(view)
            del view
        except BaseException as e:
            t.rollback(key, slot)
            h["seq"] += 1  # even again, key -1: an empty slot
            fut.set_exception(e)
            fut.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        h["layer"], h["expert"], h["nbytes"] = key[0], key[1], n
        h["seq"] += 1  # even: stable
        self.nvme.hits += 1
        self.nvme.bytes_in += n
        self.ram.bytes_in += n
        t.loaded(key)
        fut.set_result(slot)
        return slot, "nvme"

    def offset_of(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_bytes

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self.reaper is not None:
            self.reaper.close()
            self.reaper = None
        self.hdr = None
        try:
            self.mm.close()
        except BufferError:  # a view is still exported; the mapping goes with the object
            pass


# --------------------------------------------------------------------------- reader side


class MappedSegment:
    """A loader's segment mapped read-only in the decode process."""

    def __init__(self, name: str) -> None:
        self.name = name
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        try:
            self.mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        pre = np.frombuffer(self.mm, dtype=PREAMBLE, count=1)[0]
        if int(pre["magic"]) != MAGIC:
            raise ExpertLoadError(f"shared-memory segment {name} is not a moestream RAM tier")
        self.num_slots, self.slot_bytes = int(pre["num_slots"]), int(pre["slot_bytes"])
        self.data_offset = int(pre["data_offset"])
        self.hdr = np.frombuffer(self.mm, dtype=SLOT_HEADER, count=self.num_slots, offset=PREAMBLE.itemsize)
        self.data = np.frombuffer(self.mm, dtype=np.uint8)

    def slot_at(self, offset: int) -> int:
        slot, rem = divmod(offset - self.data_offset, self.slot_bytes)
        if rem or not 0 <= slot < self.num_slots:
            raise ExpertLoadError(f"offset {offset} is not a slot of segment {self.name}")
        return slot

    def copy_out(self, slot: int, key: Key, dst: np.ndarray) -> int:
        """Copy the blob in ``slot`` into ``dst`` if it holds ``key``; returns its byte count, or
        0 when the slot holds something else or changed during the copy (seqlock)."""
        h = self.hdr[slot]
        seq = int(h["seq"])
        if seq & 1 or int(h["layer"]) != key[0] or int(h["expert"]) != key[1]:
            return 0
        n = int(h["nbytes"])
        off = self.data_offset + slot * self.slot_bytes
        dst[:n] = self.data[off:off + n]
        return n if int(self.hdr["seq"][slot]) == seq else 0


def rendezvous_owner(key: Key, names: list[str]) -> str:
    """Highest-random-weight owner of ``key`` among ``names``: adding or removing a loader moves
    only the keys that loader gains or loses. Stable across processes (no ``hash()``)."""
    if not names:
        raise ExpertLoadError("no expert loader is running; `moestream scale --loaders N`")
    tag = f"{key[0]}:{key[1]}".encode()
    return max(names, key=lambda n: hashlib.blake2b(n.encode() + b"|" + tag, digest_size=8).digest())


@dataclass
class PoolCounters:
    direct_hits: int = 0  # RAM-tier hits copied without an actor call
    fetch_calls: int = 0
    retries: int = 0  # fetch attempts that failed (timeout, loader gone) and were retried
    raced: int = 0  # copies rejected by the seqlock (slot reused under us)
    last_error: str = ""
    errors: list = field(default_factory=list)


class LoaderPoolSource(ExpertSource):
    """The decode side of the loaders: routes a key to its owning loader, copies from shared
    memory into the device slot. Thread-safe (the device cache calls it from its I/O threads).

    Failure behaviour: each fetch waits ``fetch_timeout_s``; on a timeout, a dead or restarting
    loader, the owner is re-resolved (membership may have changed) and the fetch is retried, up
    to ``fetch_attempts`` times, then ExpertLoadError. Ray also retries the idempotent fetch on a
    restarted loader by itself (max_task_retries=-1). An ErrorReply from a live loader (checksum
    mismatch, I/O error) is raised at once as ExpertLoadError: retrying cannot fix the bytes.
    """

    def __init__(self, store, loaders: Mapping[str, Any], *, fetch_timeout_s: float = 5.0,
                 fetch_attempts: int = 6, direct_reads: bool = True,
                 get: Callable | None = None) -> None:
        self.store = store
        self.slot_bytes = align_up(store.expert_nbytes)
        self.fetch_timeout_s, self.fetch_attempts = fetch_timeout_s, fetch_attempts
        self.direct_reads = direct_reads
        self._get = get  # ray.get, injectable for tests without Ray
        self.lock = threading.Lock()
        self.loaders: dict[str, Any] = dict(loaders)
        self.segments: dict[str, MappedSegment] = {}  # loader name -> its current segment
        self.locations: dict[Key, tuple[str, MappedSegment, int]] = {}  # key -> (loader, seg, slot)
        self.ram, self.nvme = TierCounters(), TierCounters()
        self.pool = PoolCounters()
        self._seq = 0
        self._local = threading.local()
        self._cuda = torch.cuda.is_available()

    # ---- membership --------------------------------------------------------------------------
    def set_loaders(self, loaders: Mapping[str, Any]) -> None:
        """New membership: forget segments of removed loaders and locations whose owner moved."""
        with self.lock:
            self.loaders = dict(loaders)
            names = sorted(self.loaders)
            for name in [n for n in self.segments if n not in self.loaders]:
                del self.segments[name]  # unmapped when the last in-flight copy drops it
            self.locations = {k: v for k, v in self.locations.items()
                              if v[0] in self.loaders and rendezvous_owner(k, names) == v[0]}

    def owner(self, key: Key) -> tuple[str, Any]:
        with self.lock:
            name = rendezvous_owner(key, sorted(self.loaders))
            return name, self.loaders[name]

    def counters(self) -> dict[str, TierCounters]:
        return {"ram": self.ram, "nvme": self.nvme}

    # ---- ExpertSource ------------------------------------------------------------------------
    def likely_in_ram(self, key: Key) -> bool:
        return self.direct_reads and key in self.locations  # a shared-memory read, no actor call

    def read_into(self, key: Key, out: torch.Tensor) -> str:
        n_expected = self.store.entry(*key).nbytes
        if out.is_cuda:  # seqlock-validated copy into pinned staging, then DMA to the device
            staging = self._staging()
            tier = self._read_host(key, staging.numpy(), n_expected)
            out[:n_expected].copy_(staging[:n_expected], non_blocking=True)
            torch.cuda.current_stream().synchronize()  # staging is reused by this thread next
            return tier
        return self._read_host(key, out.numpy(), n_expected)

    @contextmanager
    def host_view(self, key: Key) -> Iterator[torch.Tensor]:
        buf = torch.empty(self.slot_bytes, dtype=torch.uint8)
        self._read_host(key, buf.numpy(), self.store.entry(*key).nbytes)
        yield buf

    def _staging(self) -> torch.Tensor:
        buf = getattr(self._local, "staging", None)
        if buf is None:
            buf = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
            self._local.staging = buf
        return buf

    def _read_host(self, key: Key, dst: np.ndarray, n_expected: int) -> str:
        if self.direct_reads:
            with self.lock:
                loc = self.locations.get(key)
            if loc is not None and loc[1].copy_out(loc[2], key, dst) == n_expected:
                with self.lock:
                    self.pool.direct_hits += 1
                    self.ram.hits += 1
                return "ram"
        last: BaseException | None = None
        for attempt in range(self.fetch_attempts):
            if attempt:
                time.sleep(min(0.05 * 2 ** attempt, 1.0))
            try:
                name, handle = self.owner(key)
                ready = self._fetch(handle, key)
            except _Retryable as e:
                last = e.cause
                with self.lock:
                    self.pool.retries += 1
                    self.pool.last_error = f"{type(e.cause).__name__}: {e.cause}"[:200]
                log.warning("expert fetch (layer %d, expert %d) attempt %d failed: %s",
                            key[0], key[1], attempt + 1, self.pool.last_error)
                continue
            try:
                seg = self._segment(name, ready.shm_name)
            except OSError as e:  # unlinked by a loader that closed after answering
                last = e
                with self.lock:
                    self.pool.retries += 1
                continue
            slot = seg.slot_at(ready.shm_offset)
            if seg.copy_out(slot, key, dst) == n_expected:
                with self.lock:
                    if self.loaders.get(name) is handle:
                        self.locations[key] = (name, seg, slot)
                    c = self.ram if ready.tier == "ram" else self.nvme
                    c.hits += 1
                    c.bytes_in += n_expected
                return ready.tier
            with self.lock:  # evicted between the reply and our copy: ask again
                self.pool.raced += 1
        raise ExpertLoadError(
            f"layer {key[0]} expert {key[1]}: no loader delivered it in {self.fetch_attempts} "
            f"attempts of {self.fetch_timeout_s}s; last error: {type(last).__name__ if last else 'slot raced'}"
            f"{': ' + str(last)[:200] if last else ''}")

    def _fetch(self, handle: Any, key: Key) -> ExpertReady:
        with self.lock:
            self._seq += 1
            seq = self._seq
            self.pool.fetch_calls += 1
        msg = ExpertFetch(layer=key[0], expert=key[1], seq=seq)
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        get = self._get or ray.get
        try:
            frames = get(handle.fetch.remote(encode(msg)), timeout=self.fetch_timeout_s)
        except (GetTimeoutError, RayActorError, TimeoutError) as e:
            raise _Retryable(e) from None
        except Exception as e:
            if type(e).__name__ in ("ActorUnavailableError", "ActorDiedError", "OwnerDiedError"):
                raise _Retryable(e) from None
            raise
        reply, _ = decode(frames, expect=(ExpertReady, ErrorReply))
        if isinstance(reply, ErrorReply) and reply.code in _RETRY_CODES:
            raise _Retryable(ExpertLoadError(f"[{reply.code}] {reply.message}"))
        if isinstance(reply, ErrorReply):
            raise ExpertLoadError(f"loader refused layer {key[0]} expert {key[1]}: "
                                  f"[{reply.code}] {reply.message}")
        if (reply.layer, reply.expert, reply.seq) != (key[0], key[1], seq) or reply.shm_name is None:
            raise ExpertLoadError(f"loader answered {reply.layer}/{reply.expert} seq {reply.seq} "
                                  f"to a fetch of {key[0]}/{key[1]} seq {seq}")
        return reply

    def _segment(self, loader: str, shm_name: str) -> MappedSegment:
        with self.lock:
            seg = self.segments.get(loader)
            if seg is not None and seg.name == shm_name:
                return seg
        new = MappedSegment(shm_name)  # outside the lock: a syscall
        with self.lock:
            old = self.segments.get(loader)
            if old is not None and old.name != shm_name:  # the loader restarted: new segment
                self.locations = {k: v for k, v in self.locations.items() if v[1] is not old}
            self.segments[loader] = new
        return new

    def stats(self) -> dict[str, Any]:
        with self.lock:
            p = self.pool
            return {"direct_hits": p.direct_hits, "fetch_calls": p.fetch_calls,
                    "retries": p.retries, "raced": p.raced, "last_error": p.last_error,
                    "loaders": sorted(self.loaders), "locations": len(self.locations),
                    "ram_hits": self.ram.hits, "nvme_hits": self.nvme.hits}


# A loader that is closing (scale-down) or overloaded answers BUSY: ask the (new) owner again.
_RETRY_CODES = frozenset({ErrorCode.BUSY, ErrorCode.ENGINE_DEAD, ErrorCode.TIMEOUT})


class _Retryable(Exception):
    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(str(cause))


# --------------------------------------------------------------------------- the actor shell


class ExpertLoader:
    """Ray actor (async): one shard of the store behind a shared-memory RAM tier.

    Thin shell over :class:`ShmRamTier`; create with ``ray.remote(...)(ExpertLoader)`` or build
    directly in tests. ``fetch`` is idempotent, so the actor runs with max_task_retries=-1.
    """

    def __init__(self, name: str, store_path: str, ram_budget: int, namespace: str = NAMESPACE,
                 policy: str = "lru") -> None:
        from engine.store.reader import ExpertStore

        self.name = name
        prefix = segment_prefix(namespace, name)
        # a killed predecessor's segment, and any of this account whose creator is gone
        swept = sweep_segments(prefix) + sweep_dead_segments()
        if swept:
            log.info("loader %s: removed stale segments %s", name, swept)
        self.store = ExpertStore(store_path)
        self.tier = ShmRamTier(self.store, ram_budget, prefix, policy)
        self.started = time.time()
        self.errors = 0
        self.last_error = ""

    async def fetch(self, frames: list[bytes]) -> list[bytes]:
        """ExpertFetch frames -> ExpertReady frames (or ErrorReply frames; never raises)."""
        try:
            msg, _ = decode(frames, expect=ExpertFetch)
        except ProtocolError as e:
            return encode(ErrorReply.for_code(e.code, e.message))
        key = (msg.layer, msg.expert)
        if self.tier.hdr is None:
            return encode(ErrorReply.for_code(ErrorCode.BUSY, f"loader {self.name} is closing"))
        try:
            entry = self.store.entry(*key)
            slot, tier = await self.tier.fetch(key)
        except Exception as e:  # checksum, I/O, unknown key: reported, the loader stays up
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"[:512]
            reply = ErrorReply.from_exception(e)
            if reply.code is ErrorCode.INTERNAL and isinstance(e, KeyError):
                reply = ErrorReply.for_code(ErrorCode.NOT_FOUND, str(e))
            return encode(reply)
        return encode(ExpertReady(layer=key[0], expert=key[1], seq=msg.seq, nbytes=entry.nbytes,
                                  sha256=entry.sha256, shm_name=self.tier.name,
                                  shm_offset=self.tier.offset_of(slot), tier=tier))

    async def health(self) -> list[bytes]:
        t = self.tier
        return encode(HealthReply(service=self.name, ok=t.hdr is not None, detail={
            "pid": os.getpid(), "slots": t.num_slots, "resident": len(t.table.slot_of),
            "loading": len(t.table.loading), "ram_hits": t.ram.hits, "ram_misses": t.ram.misses,
            "nvme_bytes": t.nvme.bytes_in, "errors": self.errors, "segment": t.name,
            "last_error": self.last_error}))

    async def check_health(self) -> None:
        """Raises when the loader cannot serve (Ray restarts actors whose check fails)."""
        if self.tier.hdr is None:
            raise ExpertLoadError(f"loader {self.name} is closed")

    async def close(self) -> None:
        """Unlink the segment (scale-down, shutdown). Readers keep their mappings until done."""
        self.tier.close()
        self.store.close()
