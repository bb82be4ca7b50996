"""The device expert cache: the fetch stage of every sparse layer (an ExpertProvider).

Slots: one preallocated uint8 pool of ``device_budget // slot_bytes`` expert blobs on the compute
device (CPU memory on a machine without a GPU, so the whole mechanism runs and is tested there).
Quantized expert tensors are zero-copy views into their slot.

Invariants:
- a key is *resident* when its bytes are complete in its slot; *loading* while a copy runs;
- a slot whose key is pinned (acquired by the running step) or loading is never chosen as a
  victim, so a running step never sees its weights overwritten;
- every demand miss and every wait on an in-flight prefetch is counted as stall time.

Misses are served by copying from the ExpertSource (RAM tier / loaders) into a slot, or, when
``miss_compute`` says so, computed on the CPU straight from the RAM tier's bytes (no transfer).
Prefetch applies the next sparse layers' routers to the current hidden state and starts loads
for the experts they would pick, on worker threads, overlapping the current layer's compute.

Admission control (``CacheConfig.admission``, off by default; for a policy that can decline, as
``sweep`` does): when a demand miss would evict a victim, the policy's ``admit(key, victim)``
decides whether it is cached; a declined miss is copied into a *staging slot* instead, used by
that acquire's compute and freed at its release, without entering the cache or evicting
anything (``simulate(bypass=True)`` replays the same rule). Staging slots are rows of the same
pool after the cache slots (``slots[num_slots:]``), so the slot map, the slot table and the
views address them like cache slots; their bytes come out of ``device_budget``. There are
``staging_slots`` of them (default ``top_k``: every miss of one token's acquire); a miss that
finds them all in use is cached as without admission control (``staging_full`` counts it), so
a full staging area never fails an acquire. Prefetches are always cached: the next layer's
router predicted them, a stronger signal than the policy's estimate of their next use.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from engine.cuda_graphs.syncs import host_sync
from engine.errors import CacheCapacityError, ConfigError
from engine.experts.policy import PinnedPolicy, can_decline, make_policy
from engine.experts.slots import Key, SlotTable
from engine.experts.tiers import ExpertSource, TierCounters, align_up
from engine.hugepages import huge_empty
from engine.layers.moe import ExpertProvider
from engine.quant.kernels import SLOT_ROW, slot_row

MISS_MODES = ("transfer", "cpu", "auto")


@dataclass(frozen=True)
class CacheConfig:
    device_budget: int  # bytes for device slots
    policy: str = "sweep"  # eviction policy of the device tier: sweep | lru | lfu | lfu-pure
    pinned: frozenset = frozenset()  # always-resident keys (filled at start)
    prefetch_depth: int = 1  # sparse layers ahead to predict; 0 = off
    miss_compute: str = "transfer"  # transfer | cpu | auto (cost model)
    io_threads: int = 2
    # admission control (see the module docstring); off by default: at the same device budget
    # its staging slots cost more hits than declining wins (docs/expert-cache.md)
    admission: bool = False
    staging_slots: int | None = None  # staging slots with admission control; None: top_k

    def __post_init__(self) -> None:
        if self.device_budget <= 0:
            raise ConfigError(f"device_budget must be > 0 bytes, got {self.device_budget}")
        if self.miss_compute not in MISS_MODES:
            raise ConfigError(f"miss_compute={self.miss_compute!r}; allowed: {', '.join(MISS_MODES)}")
        if self.prefetch_depth < 0:
            raise ConfigError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {self.io_threads}")
        if not isinstance(self.admission, bool):
            raise ConfigError(f"admission must be True or False, got {self.admission!r}")
        if self.staging_slots is not None and (isinstance(self.staging_slots, bool)
                                               or not isinstance(self.staging_slots, int) or self.staging_slots < 1):
            raise ConfigError(f"staging_slots must be an int >= 1 (or None: top_k), got {self.staging_slots!r}")
        check_admission(self.policy, self.admission)


def check_admission(policy: str, admission: bool) -> None:
    """ConfigError when admission control is asked of a policy that never declines a miss (one
    without ``admit``: LRU, LFU); the CLI calls it before anything is sized or loaded."""
    if admission and not can_decline(make_policy(policy)):
        raise ConfigError(f"admission=True: policy {policy!r} never declines a miss "
                          f"(admission control needs one with admit(), e.g. 'sweep')")


def plan_slots(config: CacheConfig, slot_bytes: int, top_k: int) -> tuple[int, int]:
    """(cache slots, staging slots) of ``config.device_budget``: with admission control the
    staging slots come out of the budget, and at least ``top_k`` cache slots must remain."""
    total = config.device_budget // slot_bytes
    if not config.admission:
        return total, 0
    staging = config.staging_slots or top_k
    if total - staging < top_k:
        raise CacheCapacityError(
            f"admission control needs {staging} staging slots beside top_k={top_k} cache slots of "
            f"{slot_bytes} bytes: give at least {(staging + top_k) * slot_bytes} bytes, or admission=False")
    return total - staging, staging


@dataclass
class LayerMetrics:
    hits: int = 0
    misses: int = 0
    bypassed: int = 0  # misses the policy declined to cache: served from a staging slot
    staging_full: int = 0  # misses that evicted without asking the policy: every staging slot in use
    late_prefetch: int = 0  # needed while its prefetch was still in flight
    cpu_computed: int = 0  # misses computed on the CPU from RAM instead of transferred
    overlapped: int = 0  # hits computed while the same layer's misses were read (acquire_overlapped)
    bytes_to_device: int = 0
    stall_s: float = 0.0
    copy_s: float = 0.0  # time in the source's read_into (device copies, and reads below RAM)
    predicted_tp: int = 0
    predicted_fp: int = 0
    predicted_fn: int = 0


@dataclass
class CacheMetrics:
    layers: dict[int, LayerMetrics] = field(default_factory=dict)
    tokens: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    ple: Any = None  # engine.store.ple_disk.PLECounters when the model reads a PLE tier

    def layer(self, i: int) -> LayerMetrics:
        m = self.layers.get(i)
        if m is None:  # not setdefault: that builds a LayerMetrics (14 fields) on every call
            m = self.layers[i] = LayerMetrics()
        return m

    def total(self) -> LayerMetrics:
        t = LayerMetrics()
        for m in self.layers.values():
            for k in vars(t):
                setattr(t, k, getattr(t, k) + getattr(m, k))
        return t

    def summary(self, tiers: Mapping[str, TierCounters] = {}) -> dict[str, float]:
        t = self.total()
        acc = t.hits + t.misses
        tok = max(self.tokens, 1)
        out = {
            "device_hit_rate": t.hits / acc if acc else 0.0,
            "device_hits": t.hits, "device_misses": t.misses,
            "device_bypassed": t.bypassed, "staging_full": t.staging_full,
            "cpu_computed": t.cpu_computed, "overlapped_hits": t.overlapped,
            "bytes_to_device_per_token": t.bytes_to_device / tok,
            "stall_s": t.stall_s,
            "prefetch_issued": self.prefetch_issued, "prefetch_used": self.prefetch_used,
            "prefetch_precision": t.predicted_tp / max(t.predicted_tp + t.predicted_fp, 1),
            "prefetch_recall": t.predicted_tp / max(t.predicted_tp + t.predicted_fn, 1),
            "tokens": self.tokens,
        }
        for name, c in tiers.items():
            out[f"{name}_hits"] = c.hits
            out[f"{name}_misses"] = c.misses
            out[f"{name}_bytes_per_token"] = c.bytes_in / tok
        if self.ple is not None:
            out.update(self.ple.summary(self.tokens))
        return out


class QuantizedExpert:
    """A routed expert as three quantized tensors (views into a slot or a RAM buffer)."""

    def __init__(self, gate, up, down, on_cpu: bool = False) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.on_cpu = on_cpu  # computed on the CPU although the model may live on the GPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.quant.kernels import expert_forward

        if self.on_cpu and x.device.type != "cpu":
            return expert_forward(x.cpu(), self.gate, self.up, self.down).to(x.device, x.dtype)
        return expert_forward(x, self.gate, self.up, self.down).to(x.dtype)


class _SlotExpert:
    """An acquired expert in a cache slot as acquire hands it out: its views (QuantizedExpert)
    are made on the first use of ``gate``, ``up``, ``down`` or ``forward`` (ExpertCache._slot_view:
    once per slot and layout, then reused). The native step reads the slot table instead and
    never makes them: they are ~5.6 KiB of tensor objects a slot (issue 27: ~12 MB at 75% of the
    8 GB bench model, ~40 MB at 30% of a 24,576-expert model)."""

    __slots__ = ("_cache", "_key", "_slot")
    on_cpu = False

    def __init__(self, cache: "ExpertCache", key: Key, slot: int) -> None:
        self._cache, self._key, self._slot = cache, key, slot

    @property
    def views(self) -> QuantizedExpert:
        return self._cache._slot_view(self._key, self._slot)

    gate = property(lambda self: self.views.gate)
    up = property(lambda self: self.views.up)
    down = property(lambda self: self.views.down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.views.forward(x)


@dataclass
class _Staged:
    """A declined miss in a staging slot: held by ``pins`` acquires, filled when ``future`` is."""

    slot: int
    pins: int
    future: Future


class ExpertCache(ExpertProvider):
    def __init__(self, store, source: ExpertSource, config: CacheConfig,
                 routers: Mapping[int, torch.Tensor] | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.store, self.source, self.config = store, source, config
        self.device = torch.device(device)
        self.slot_bytes = align_up(store.expert_nbytes)
        top_k = store.config.moe.top_k
        policy = make_policy(config.policy, num_experts=store.config.moe.num_experts, top_k=top_k)
        if config.pinned:
            policy = PinnedPolicy(policy, config.pinned)
        # cache slots, then the staging slots of admission control (rows num_slots.. of the pool)
        self.num_slots, self.num_staging = plan_slots(config, self.slot_bytes, top_k)
        if self.num_slots < top_k:
            raise CacheCapacityError(
                f"device budget {config.device_budget} bytes holds {self.num_slots} expert slots of "
                f"{self.slot_bytes} bytes; one token needs top_k={top_k}: give at least "
                f"{top_k * self.slot_bytes} bytes")
        total = self.num_slots + self.num_staging
        self.slots = huge_empty(total, self.slot_bytes, device=self.device)
        # which key each slot holds, pins, loads in flight, the policy: under self.lock
        self.table = SlotTable(self.num_slots, policy, keys=store.num_experts_total)
        # staging: free staging slots (pop() hands out the first) and the declined misses held
        self.staging_free: list[int] = list(range(total - 1, self.num_slots - 1, -1))
        self.staged: dict[Key, _Staged] = {}
        self._slot_views: dict[int, tuple[int, QuantizedExpert]] = {}  # slot -> (layout key, views)
        # the fused step's view of the same slots: one row per slot (engine.quant.kernels.slot_row),
        # written at every copy-in from its layout's template (_write_row)
        self.slot_rows = torch.zeros(total, SLOT_ROW, dtype=torch.int64)
        self._row_templates: dict[int, tuple[list[int], list[int]]] = {}  # layout key -> (head, offsets)
        self.prefetched: set[Key] = set()  # loaded by prefetch and not used yet
        self.needed: set[Key] = set()  # routed by the running layer: never a prefetch victim
        self.predicted: dict[int, set[int]] = {}
        self.routers = {l: w.to(self.device) for l, w in (routers or {}).items()}
        self.sparse_layers = sorted(store.config.moe_layers)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="expert-io")
        self.metrics = CacheMetrics()
        self.restrict_to_resident = False  # set while drafting self-speculatively
        # the grouped GPU path (engine.quant.triton_moe): each layer's experts as two launches
        # reading their slots through a device slot map [layers, experts] (written as experts
        # are copied in; only entries of acquired, hence resident and pinned, experts are read)
        self.grouped = self.device.type == "cuda"
        n_layers = max(self.sparse_layers) + 1 if self.sparse_layers else 0
        self.slot_map = torch.full((n_layers, store.config.moe.num_experts), -1, dtype=torch.int32,
                                   device=self.device)
        self._grouped_layouts: dict[int, object] = {}  # layer -> SlotLayout or None
        self._resident: tuple[torch.Tensor, int] | None = None  # resident_map: (table, resident keys)
        # cost model for miss_compute="auto": seconds per byte moved vs per byte computed on CPU
        self._transfer_s_per_byte = 1 / 10e9
        self._cpu_s_per_byte = 1 / 10e9
        self._cpu_calibrated = False
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # CUDA: per slot, an event on the compute stream after the last kernel that read it was
        # queued (recorded at release). Kernels run after the Python step that queued them has
        # released its pins, so a copy into an evicted slot must wait for this, not for the pin.
        self._slot_fence: dict[int, torch.cuda.Event] = {}
        if config.pinned:
            self._fill_pinned(config.pinned)

    # the table's state, for readers (tests, metrics): key -> slot, pins, loads in flight
    @property
    def slot_of(self) -> dict[Key, int]:
        return self.table.slot_of

    @property
    def pins(self) -> dict[Key, int]:
        return self.table.pins

    @property
    def loading(self) -> dict[Key, Future]:
        return self.table.loading

    @property
    def policy(self):
        return self.table.policy

    # ---- sizing --------------------------------------------------------------------------
    @property
    def max_experts_per_acquire(self) -> int:
        return self.num_slots - len(self.config.pinned)

    @property
    def admission(self) -> bool:
        """Whether admission control is on (staging slots exist)."""
        return self.num_staging > 0

    @property
    def device_bytes(self) -> int:
        """Device bytes of the slot pool: cache and staging slots."""
        return (self.num_slots + self.num_staging) * self.slot_bytes

    def warm(self) -> int:
        """Fill the free device slots now, before any step: every sparse layer's experts in turn
        (expert 0 of each layer, then expert 1, ...), so a budget of a fraction of the experts
        holds that fraction of each layer, until no slot is free. The reads run on the cache's I/O
        threads (``io_threads`` at once); the policy is told of each expert as of a miss, so they
        are evicted as any other. Returns the number of experts read. A run that starts with
        empty slots pays a miss for the first use of every expert, where llama.cpp's load reads
        the model's pages into the page cache first (bench/beyond_ram.py compares the two)."""
        import logging
        import sys

        from tqdm import tqdm

        cfg = self.store.config
        keys = [(layer, e) for e in range(cfg.moe.num_experts) for layer in cfg.moe_layers]
        t0 = time.perf_counter()
        futures: list[Future] = []
        with self.lock:
            for key in keys:
                if not self.table.free_slots:
                    break
                if key in self.table.slot_of:  # a pinned expert, placed already
                    continue
                slot, _ = self.table.reserve(key)
                fut: Future = Future()
                self.table.loading[key] = fut
                futures.append(fut)
                self.pool.submit(self._fill, key, slot, fut, False)
        bar = tqdm(total=len(futures), desc="warming expert slots", unit="expert", file=sys.stderr,
                   disable=not sys.stderr.isatty() or not futures)
        try:
            for fut in futures:
                fut.result()  # a corrupt or unreadable blob raises here, at load
                bar.update()
        finally:
            wait(futures)
            bar.close()
        if futures and bar.disable:  # not a terminal: one summary line
            logging.getLogger(__name__).info("expert cache: %d experts read into free slots in %.1f s",
                                             len(futures), time.perf_counter() - t0)
        with self.lock:  # reads at load are not a step's: the metrics and tier counters start at zero
            for layer in self.sparse_layers:
                self.metrics.layer(layer).bytes_to_device = 0
                self.metrics.layer(layer).copy_s = 0.0
            for c in self.source.counters().values():
                c.hits = c.misses = c.bytes_in = 0
                c.seconds = 0.0
        return len(futures)

    def _fill_pinned(self, keys) -> None:
        if len(keys) > self.num_slots - self.store.config.moe.top_k:
            raise CacheCapacityError(
                f"{len(keys)} pinned experts leave fewer than top_k free slots of {self.num_slots}")
        for key in sorted(keys):
            self._copy_in(key, self.table.place(key))

    # ---- the ExpertProvider interface ------------------------------------------------------
    def acquire(self, layer: int, expert_ids: list[int]):
        return self._acquire(layer, expert_ids, None)

    def acquire_overlapped(self, layer, expert_ids, ready):
        """ExpertProvider.acquire_overlapped: every NVMe miss is read on the pool (none inline),
        the RAM ones copied, then ``ready`` computes the hits while the reads run."""
        return self._acquire(layer, expert_ids, ready)

    def _acquire(self, layer: int, expert_ids: list[int], ready):
        keys = [(layer, e) for e in expert_ids]
        m = self.metrics.layer(layer)
        self._score_prediction(layer, expert_ids, m)
        t0 = time.perf_counter()
        waits: list[tuple[Key, Future]] = []
        cpu_keys: list[Key] = []
        hits: list[int] = []  # resident when asked: what ``ready`` computes
        fills: list[tuple[Key, int, Future, bool]] = []  # demand misses this acquire copies in
        later: list[Key] = []  # misses that found every slot pinned or loading
        with self.lock:
            self.table.tick()
            self.needed = set(keys)
            for key in keys:
                self.table.pin(key)
            # one pass in routing order, as the simulator replays a record: hits, and a slot
            # (cache or staging) for each miss, so the policy sees the same sequence of calls
            for key in keys:
                if self.table.resident(key):
                    m.hits += 1
                    hits.append(key[1])
                    self.table.hit(key)
                    if key in self.prefetched:
                        self.prefetched.discard(key)
                        self.metrics.prefetch_used += 1
                elif key in self.loading:
                    m.late_prefetch += 1
                    m.misses += 1
                    self.prefetched.discard(key)
                    waits.append((key, self.loading[key]))
                elif key in self.staged:  # staged by another acquire still running: shared
                    st = self.staged[key]
                    st.pins += 1
                    m.hits += 1  # its bytes are on the device: nothing moves
                    waits.append((key, st.future))
                elif self._compute_on_cpu(len(keys)):
                    m.misses += 1
                    m.cpu_computed += 1
                    cpu_keys.append(key)
                else:
                    m.misses += 1
                    claim = self._claim(key, self.needed, m)
                    if claim is None:
                        later.append(key)
                    else:
                        fills.append(claim)
        # Misses whose blob is in host RAM are a memcpy: this thread copies them (a pool thread
        # would only add a hand-off). The others need NVMe reads, which overlap best in parallel:
        # all but the last start first, on the pool; this thread copies the RAM ones meanwhile,
        # then reads the last. (Demo store, 60% budget, 1 thread: 35 -> 38-40 tok/s; 1.3B store,
        # 10% RAM, synthetic routing: every miss on the pool 8.5, every miss inline 7.3, this 9.5.)
        # With ``ready`` and hits to compute, every NVMe miss goes to the pool: this thread
        # computes the hits while they are read.
        needed = set(keys)
        in_ram, nvme = [], []
        for f in fills:
            (in_ram if self.source.likely_in_ram(f[0]) else nvme).append(f)
        # hits compute while anything this acquire waits for is in flight: its own NVMe reads, or
        # a prefetch of one of its experts that has not landed yet (a late prefetch)
        overlap = ready is not None and bool(hits) and (bool(nvme) or any(not f.done() for _, f in waits))
        pooled = len(nvme) if overlap else len(nvme) - 1
        order = nvme[:pooled] + in_ram + nvme[pooled:]
        started = 0
        computing = 0.0
        try:
            for i, f in enumerate(order):
                waits.append((f[0], f[2]))
                if i < pooled:
                    self.pool.submit(self._fill, *f)
                else:
                    self._fill(*f)
                started += 1
            if overlap:
                t1 = time.perf_counter()
                ready({e: self._view_of((layer, e)) for e in hits})
                computing = time.perf_counter() - t1
                m.overlapped += len(hits)
            for key in later:
                waits.append((key, self._load_on_demand(key, needed, m)))
            for key, fut in waits:
                fut.result()
        except BaseException:
            # before release frees this acquire's staging slots, no copy may still write them
            for i, (key, slot, fut, staged) in enumerate(order):
                if i < started or fut.done():
                    _settle(fut)
                else:  # never started: its claim is undone here
                    self._abandon(key, slot, fut, staged)
            self.release(layer, expert_ids)
            raise
        out = {key[1]: self._view_of(key) for key in keys if key not in cpu_keys}
        for key in cpu_keys:
            out[key[1]] = self._cpu_expert(key)
        if waits:  # the time computing hits in ``ready`` is not a stall
            m.stall_s += time.perf_counter() - t0 - computing
        return out

    def _claim(self, key: Key, protect: set[Key], m: LayerMetrics) -> tuple[Key, int, Future, bool] | None:
        """Under the lock: a slot for the demand miss ``key``, as (key, slot, future, staged) for
        :meth:`_fill`: a cache slot (free, or the policy's victim's), or, when the policy
        declines to evict the victim for it, a staging slot. None: every slot is pinned or
        loading. The policy is asked only while a staging slot is free."""
        ask = bool(self.staging_free)
        taken = self.table.reserve(key, protect, admit=ask)
        if taken is None:
            return None
        slot, victim = taken
        fut: Future = Future()
        if slot is None:  # declined: used once from a staging slot, never cached
            slot = self.staging_free.pop()
            self.staged[key] = _Staged(slot, 1, fut)
            m.bypassed += 1
            return key, slot, fut, True
        if victim is not None and self.num_staging and not ask:
            m.staging_full += 1
        self.prefetched.discard(victim)
        self.loading[key] = fut
        return key, slot, fut, False

    def _fill(self, key: Key, slot: int, fut: Future, staged: bool) -> None:
        """Copy ``key`` into its claimed slot and settle ``fut`` (its waiters re-raise an error).
        A failed copy into a cache slot frees the slot; a staging slot is freed at release."""
        try:
            self._copy_in(key, slot)
        except BaseException as e:
            if not staged:
                with self.lock:
                    self.table.rollback(key, slot)
                    self.prefetched.discard(key)
            fut.set_exception(e)
            return
        if not staged:
            with self.lock:
                self.table.loaded(key)
        fut.set_result(None)

    def _abandon(self, key: Key, slot: int, fut: Future, staged: bool) -> None:
        """A claim whose copy never started (the acquire failed first): free its cache slot
        (a staging slot is freed at release) and fail its future for anyone waiting on it."""
        if not staged:
            with self.lock:
                self.table.rollback(key, slot)
        fut.set_exception(CacheCapacityError(f"layer {key[0]} expert {key[1]}: the acquire failed before its copy"))

    def _load_on_demand(self, key: Key, needed: set[Key], m: LayerMetrics) -> Future:
        """A demand miss that found every slot pinned or loading: a prefetch may be holding the
        slot this step needs, so wait for one to land (it becomes evictable) and retry; only when
        nothing but this step's own experts is in the way is it a capacity error. The copy runs
        in this thread; returns its finished future."""
        while True:
            with self.lock:
                if key in self.loading:  # someone started it meanwhile
                    return self.loading[key]
                if key in self.slot_of:  # ... and finished it
                    done: Future = Future()
                    done.set_result(None)
                    return done
                claim = self._claim(key, needed, m)
                if claim is not None:
                    break
                others = [f for k, f in self.loading.items() if k not in needed]
                if not others:
                    raise CacheCapacityError(
                        f"all {self.num_slots} device slots are pinned or loading; a step needs more "
                        f"distinct experts at once than the device budget holds")
            _settle(others[0])  # that prefetch's error belongs to whoever needs its expert
        self._fill(*claim)
        return claim[2]

    def _view_of(self, key: Key) -> _SlotExpert:
        """Under a pin: an acquired expert in its slot (staging or cache); views made on use."""
        st = self.staged.get(key)
        return _SlotExpert(self, key, st.slot if st is not None else self.slot_of[key])

    @property
    def views(self) -> dict[int, QuantizedExpert]:
        """The views made so far, by slot (only where an expert was computed through them)."""
        return {slot: v for slot, (_, v) in list(self._slot_views.items())}

    def release(self, layer: int, expert_ids: list[int]) -> None:
        keys = [(layer, e) for e in expert_ids]
        fence = None
        if self.copy_stream is not None:
            fence = torch.cuda.Event()
            fence.record(torch.cuda.current_stream(self.device))
        with self.lock:
            for key in keys:
                st = self.staged.get(key)
                slot = st.slot if st is not None else self.slot_of.get(key)
                if fence is not None and slot is not None:
                    self._slot_fence[slot] = fence
                if st is not None:
                    st.pins -= 1
                    if st.pins == 0:  # the last acquire holding it: the staging slot is free
                        del self.staged[key]
                        self.staging_free.append(st.slot)
            self._unpin(keys)

    def _unpin(self, keys: list[Key]) -> None:
        """Under the lock."""
        for key in keys:
            self.table.unpin(key)

    def allowed_experts(self, layer: int) -> list[int] | None:
        if not self.restrict_to_resident:
            return None
        with self.lock:
            ids = sorted(e for (l, e), _ in self.slot_of.items() if l == layer and (l, e) not in self.loading)
        return ids or None  # nothing resident in this layer: route freely (a miss is unavoidable)

    def predictions(self, layer: int, hidden: torch.Tensor):
        """(next sparse layer, predicted ids [T, top_k] on the device) for the ``prefetch_depth``
        layers after ``layer``: their routers applied to this layer's MoE input. Nothing while
        drafting on resident experts (a draft must move no bytes) or with prefetch off."""
        depth = self.config.prefetch_depth
        if not depth or not self.routers or self.restrict_to_resident:
            return
        idx = self.sparse_layers.index(layer)
        top_k = self.store.config.moe.top_k
        for nxt in self.sparse_layers[idx + 1: idx + 1 + depth]:
            w = self.routers.get(nxt)
            if w is not None:
                yield nxt, torch.topk(hidden.to(w.dtype) @ w.T, top_k, dim=-1).indices

    def observe_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """Predict the next sparse layers' experts from this layer's MoE input and prefetch."""
        for nxt, ids in self.predictions(layer, hidden):
            host_sync("predicted ids")
            picks = ids.unique().tolist()
            self.predicted[nxt] = set(picks)
            with self.lock:
                for e in picks:
                    key = (nxt, e)
                    if key in self.slot_of or key in self.staged:  # a staged key is never cached too
                        continue
                    try:
                        slot = self._reserve(key, protect=self.needed | {(nxt, p) for p in picks})
                    except CacheCapacityError:
                        break  # nothing evictable now: skip the rest of this prediction
                    self.prefetched.add(key)
                    self.metrics.prefetch_issued += 1
                    self._start_load(key, slot)

    # ---- internals -------------------------------------------------------------------------
    def _score_prediction(self, layer: int, expert_ids: list[int], m: LayerMetrics) -> None:
        pred = self.predicted.pop(layer, None)
        if pred is None:
            return
        actual = set(expert_ids)
        m.predicted_tp += len(pred & actual)
        m.predicted_fp += len(pred - actual)
        m.predicted_fn += len(actual - pred)

    def _reserve(self, key: Key, protect: set[Key]) -> int:
        """Under the lock: a slot for ``key`` (free, or a victim's), marked as holding ``key``."""
        taken = self.table.reserve(key, protect)
        if taken is None:
            raise CacheCapacityError(
                f"all {self.num_slots} device slots are pinned or loading; a step needs more "
                f"distinct experts at once than the device budget holds")
        slot, victim = taken
        self.prefetched.discard(victim)
        return slot

    def _start_load(self, key: Key, slot: int) -> Future:
        """Under the lock: copy ``key`` into its reserved cache slot on the pool (a prefetch)."""
        fut = self.loading[key] = Future()
        self.pool.submit(self._fill, key, slot, fut, False)
        return fut

    @torch.inference_mode()  # grad mode is per thread: slots made under inference_mode stay writable
    def _copy_in(self, key: Key, slot: int) -> None:
        t0 = time.perf_counter()
        nbytes = self.store.entry(*key).nbytes
        if self.copy_stream is not None:
            with self.lock:
                fence = self._slot_fence.pop(slot, None)
            with torch.cuda.stream(self.copy_stream):
                if fence is not None:  # the slot's previous expert may still be read by queued kernels
                    self.copy_stream.wait_event(fence)
                self.source.read_into(key, self.slots[slot])
            host_sync("miss copy")
            self.copy_stream.synchronize()
        else:
            host_sync("miss copy")  # where a GPU waits for the copy stream (above)
            self.source.read_into(key, self.slots[slot])
        copied = time.perf_counter() - t0
        self._write_row(key, slot)
        if self.grouped:
            self.slot_map[key[0], key[1]] = slot
        dt = time.perf_counter() - t0
        self._transfer_s_per_byte = 0.8 * self._transfer_s_per_byte + 0.2 * dt / nbytes
        with self.lock:
            m = self.metrics.layer(key[0])
            m.bytes_to_device += nbytes
            m.copy_s += copied

    def _slot_view(self, key: Key, slot: int) -> QuantizedExpert:
        """The expert in ``slot``: views of the slot's bytes, made once per slot and layout and
        reused by every expert later copied there (their caches hold only bound kernels and
        argument tuples over the same memory; see QuantizedTensor). Making them costs ~40 µs,
        more than copying a small expert."""
        layout = self.store.layout_key(*key)
        made = self._slot_views.get(slot)
        if made is None or made[0] != layout:
            made = self._slot_views[slot] = (layout, self._unpack(key, self.slots[slot]))
        return made[1]

    def _write_row(self, key: Key, slot: int) -> None:
        """The slot table's row of ``key``, just copied into ``slot``: its layout's row (made once,
        by slot_row over views of the first slot it landed in) with the addresses moved to this
        slot, so no views are made per slot (the native step reads only the row)."""
        layout = self.store.layout_key(*key)
        base = self.slots[slot].data_ptr()
        t = self._row_templates.get(layout)
        if t is None:
            v = self._unpack(key, self.slots[slot])
            row = slot_row(v.gate, v.up, v.down)
            t = self._row_templates[layout] = (row[:4], [a - base if a else -1 for a in row[4:]])
        head, offsets = t
        self.slot_rows[slot] = torch.tensor(head + [base + o if o >= 0 else 0 for o in offsets], dtype=torch.int64)

    def grouped_layout(self, layer: int, device: torch.device):
        """The layer's SlotLayout for the grouped kernels (engine.quant.triton_moe), or None: the
        grouped path is off, Triton cannot run on ``device``, the experts' format is not one the
        kernels decode, or the layer's experts do not share one blob layout."""
        if not self.grouped:
            return None
        if layer not in self._grouped_layouts:
            from engine.quant import triton_moe

            store = self.store
            n = store.config.moe.num_experts
            layout = None
            if len({store.layout_key(layer, e) for e in range(n)}) == 1 and triton_moe.supports(device, True):
                probe = torch.zeros(self.slot_bytes, dtype=torch.uint8)
                layout = triton_moe.slot_layout(*store.expert_tensors(layer, 0, probe), probe)
            self._grouped_layouts[layer] = layout
        return self._grouped_layouts[layer]

    def slot_table(self, layer, expert_ids, experts):
        """Slots of acquired experts (pinned until release); -1 for one computed on the CPU."""
        if self.device.type != "cpu":
            return None
        with self.lock:
            slots = [-1 if experts[e].on_cpu else self._slot_of_acquired((layer, e)) for e in expert_ids]
        return self.slot_rows, slots

    def resident_slots(self, layer, expert_ids):
        """ExpertProvider.resident_slots: on the CPU, with a slot for every expert of the store
        (the table never evicts: SlotTable.tracks False) and no prefetch (nothing is scored or
        loaded behind the step), a resident key's slot never changes, so a step that finds all of
        its experts resident reads their slots without pins. Per sparse layer of a decode step
        this skips acquire, slot_table and release (1.3B test store, int8 dense, 64-token prompt:
        12.1 -> 10.6 ms per decoded token)."""
        if not self._never_moves():
            return None
        keys = [(layer, e) for e in expert_ids]
        with self.lock:
            slot_of, loading = self.table.slot_of, self.table.loading
            slots = [slot_of.get(k, -1) for k in keys]
            if -1 in slots or any(k in loading for k in keys) or self.staged:
                return None
            self.table.tick()
            self.metrics.layer(layer).hits += len(keys)
        return self.slot_rows, slots

    def _never_moves(self) -> bool:
        """A resident key keeps its slot without a pin: on the CPU, a slot for every expert of the
        store (SlotTable.tracks False), nothing loaded or scored behind the step (no prefetch)."""
        return (not self.table.tracks and self.device.type == "cpu" and not self.config.prefetch_depth
                and not self.predicted and not self.restrict_to_resident)

    def resident_map(self):
        """ExpertProvider.resident_map, under the conditions of ``resident_slots``. Residency only
        grows then (no key is ever evicted), so the table is rebuilt only when the count of
        resident keys changed since the last step (after a step that loaded experts)."""
        if not self._never_moves():
            return None
        with self.lock:
            if self.staged:
                return None
            loading = self.table.loading
            count = len(self.table.slot_of) - len(loading)
            if self._resident is None or self._resident[1] != count:
                table = torch.full(self.slot_map.shape, -1, dtype=torch.int32)
                keys = [k for k in self.table.slot_of if k not in loading]
                if keys:
                    ls, es = zip(*keys)
                    table[list(ls), list(es)] = torch.tensor([self.table.slot_of[k] for k in keys], dtype=torch.int32)
                self._resident = (table, count)
        return self._resident[0], self.slot_rows

    def count_hits(self, hits: list[int]) -> None:
        """A step's hits per layer (run_layers'): one tick of the slot table's clock per layer that
        had any, as the per-layer path ticks once per acquire."""
        with self.lock:
            layer = self.metrics.layer
            ticks = 0
            for i, n in enumerate(hits):
                if n:
                    ticks += 1
                    layer(i).hits += n
            self.table.clock += ticks

    def _slot_of_acquired(self, key: Key) -> int:
        """Under the lock: the slot (staging or cache) of an acquired expert."""
        st = self.staged.get(key)
        return st.slot if st is not None else self.slot_of[key]

    def _unpack(self, key: Key, buf: torch.Tensor, on_cpu: bool = False) -> QuantizedExpert:
        g, u, d = self.store.expert_tensors(*key, buf)
        return QuantizedExpert(g, u, d, on_cpu=on_cpu)

    def _compute_on_cpu(self, n_needed: int) -> bool:
        mode = self.config.miss_compute
        if mode == "transfer":
            return False
        if mode == "cpu":
            return True
        # auto: moving the blob costs bytes * transfer; computing on the CPU costs one pass over
        # the weights (memory-bound at small token counts). Both are measured: the transfer on
        # every copy (EMA), the CPU pass once, on the first resident expert.
        if not self._cpu_calibrated and self.slot_of:
            self._calibrate_cpu()
        return self._cpu_s_per_byte < self._transfer_s_per_byte

    def _calibrate_cpu(self) -> None:
        """Under the lock: time one CPU pass over a resident cache slot's expert (none yet: later)."""
        key, slot = next(((k, s) for k, s in self.slot_of.items() if k not in self.loading), (None, None))
        if key is None:
            return
        nbytes = self.store.entry(*key).nbytes
        cpu_view = self._unpack(key, self.slots[slot].cpu(), on_cpu=True)
        x = torch.zeros(1, self.store.config.hidden_size)
        cpu_view.forward(x)  # warm-up
        t0 = time.perf_counter()
        for _ in range(3):
            cpu_view.forward(x)
        self._cpu_s_per_byte = (time.perf_counter() - t0) / 3 / nbytes
        self._cpu_calibrated = True

    def _cpu_expert(self, key: Key) -> QuantizedExpert:
        # The RAM-tier view is only valid while pinned: copy the blob out for the compute. This
        # is a host memcpy, not a device transfer; the GPU path would compute in place.
        with self.source.host_view(key) as view:
            n = self.store.entry(*key).nbytes
            buf = view[:n].clone()
        return self._unpack(key, buf, on_cpu=True)

    def drain(self) -> None:
        """Wait for every in-flight load (prefetches may outlive the step that issued them)."""
        while True:
            with self.lock:
                pending = list(self.loading.values())
            if not pending:
                return
            for fut in pending:
                try:
                    fut.result()
                except Exception:
                    pass  # the error belongs to whoever acquires that expert; drain only waits

    def reconfigured(self, **changes) -> "ExpertCache":
        """A new, empty cache over the same store, source, routers and device, its config this
        one's with ``changes`` (``dataclasses.replace``); this one is left as it is."""
        from dataclasses import replace

        return ExpertCache(self.store, self.source, replace(self.config, **changes), routers=self.routers,
                           device=self.device)

    def attach(self, model) -> None:
        """Serve ``model``'s sparse layers from this cache (its native step is rebuilt)."""
        for block in model.moe_blocks:
            block.provider = self
        model.modules_changed()

    def replay(self, trace) -> LayerMetrics:
        """Acquire and release every record of a routing trace in order (one token's experts in
        one layer each: what decode at batch 1 asks); the totals of the metrics after. Replays
        the access stream ``engine.experts.simulate.simulate`` replays (``bypass`` = admission)."""
        for layer, ids in zip(trace.layer.tolist(), trace.experts.tolist()):
            self.acquire(layer, ids)
            self.release(layer, ids)
        return self.metrics.total()

    def resident_keys(self) -> set[Key]:
        with self.lock:
            return {k for k in self.slot_of if k not in self.loading}

    def close(self) -> None:
        self.drain()
        self.pool.shutdown(wait=True)


def _settle(fut: Future) -> None:
    """Wait for ``fut`` to finish; its error is its owner's to raise."""
    wait([fut])
