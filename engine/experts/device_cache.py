"""The expert cache with its bookkeeping and its miss copies on the device: a sparse layer's fetch
stage without the host.

:class:`DeviceExpertCache` is an :class:`~engine.experts.cache.ExpertCache` (same slot pool, slot
map, views and grouped-kernel layout) whose slot table and eviction policy are the device state
of :class:`~engine.experts.device_policy.DevicePolicy`, and whose misses are copied into their
slots by :func:`copy_misses`, a Triton kernel that reads the RAM tier's *bank* (every expert's
blob in one host block, mapped pinned memory on a GPU: UVA) at the rows the miss list names. Per
sparse layer of a decode step::

    ids [T, K] (router, on the device)
      -> assign   one launch: hits, a slot per miss (free or the policy's victim), slot map
                  updated, miss list (slot, key)                       engine.experts.device_policy
      -> copy     one launch: the missed blobs, bank -> slots          copy_misses
      -> experts  the grouped kernels read slot_map[layer][ids]        engine.quant.triton_moe
      -> predict  the next layer's router on this hidden state, then assign (prefetch) + copy

All of it is stream-ordered device work: no host synchronisation, so it runs inside one graph per
decode step (engine.cuda_graphs.step_graph). Kernels of a layer run after the copies that fill
their slots and before the next layer's launches can evict them: stream order is the pin, and an
acquire's keys are protected from its own launch's evictions (and a prefetch's from the running
layer's).

What it needs: every expert in the bank (``source.bank()``; a RAM tier that holds them all). A
miss that is not in RAM would make the device wait on the disk inside a graph, which this path
never does: a model whose experts do not fit in RAM runs the host cache (engine.experts.cache),
whose per-layer acquire reads NVMe outside any graph. Policies: ``lru`` and ``sweep``; no
always-resident set, no admission control, misses always transferred (``miss_compute`` transfer).
The host calls (``acquire`` for eager steps: prefill, fallbacks) run the same launches and then
read the slot map (a host synchronisation, counted), so host and device paths share one state.
"""

from __future__ import annotations

import logging

import torch

from engine.cuda_graphs.syncs import host_sync
from engine.errors import CacheCapacityError, ConfigError
from engine.experts.cache import CacheConfig, ExpertCache
from engine.experts.device_policy import MISS_N, DevicePolicy, _MISS_N
from engine.experts.slots import Key
from engine.quant import triton_kernels as TK

triton, tl, constexpr = TK.triton, TK.tl, TK.constexpr
COPY_BLOCK = 1024  # 8-byte words per program of the copy kernel
log = logging.getLogger("engine.experts.device_cache")


def _copy_kernel(miss_slot, miss_key, st, bank, bank_row, pool, WORDS, BANK_STRIDE, POOL_STRIDE,
                 BLOCK: constexpr):
    """Program (i, c): words c*BLOCK.. of the i-th miss of the last assign, bank row -> slot."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    if i < tl.load(st + _MISS_N):
        s = tl.load(miss_slot + i)
        if s >= 0:
            r = tl.load(bank_row + tl.load(miss_key + i))
            offs = c * BLOCK + tl.arange(0, BLOCK)
            m = offs < WORDS
            v = tl.load(bank + r * BANK_STRIDE + offs, mask=m)
            tl.store(pool + s.to(tl.int64) * POOL_STRIDE + offs, v, mask=m)


_jit: dict = {}


def _copy():
    k = _jit.get("copy")
    if k is None:
        k = _jit["copy"] = triton.jit(_copy_kernel)
    return k


def host_tier_bank(store, tier) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A RAM tier (engine.experts.tiers.HostTier) with a slot for every expert as a bank: every
    expert read into it now (once; a tier with a slot per key never evicts), and the row of each
    (layer, expert), -1 for layers without experts. None: the tier cannot hold them all."""
    from engine.experts.tiers import HostTier

    if not isinstance(tier, HostTier) or tier.num_slots < store.num_experts_total:
        return None
    import sys
    import time

    from tqdm import tqdm

    cfg = store.config
    rows = torch.full((cfg.num_layers, cfg.moe.num_experts), -1, dtype=torch.int32)
    keys = [(layer, e) for layer in cfg.moe_layers for e in range(cfg.moe.num_experts)]
    t0 = time.perf_counter()
    bar = tqdm(keys, desc="experts into RAM", unit="expert", file=sys.stderr, disable=not sys.stderr.isatty())
    for key in bar:
        with tier.host_view(key):  # entering reads the blob into its RAM slot (held only inside)
            pass
    if bar.disable:  # not a terminal: one summary line
        log.info("device cache: %d experts read into the RAM tier in %.1f s", len(keys), time.perf_counter() - t0)
    with tier.lock:
        for (layer, e), slot in tier.table.slot_of.items():
            rows[layer, e] = slot
    return tier.buf, rows


def _bank_pinned(source) -> bool:
    """The source's block is pinned (mapped) host memory a GPU kernel can read."""
    pinning = getattr(source, "pinning", None)  # a HostTier's chunked registration
    if pinning is not None:
        return bool(pinning.pinned)
    return bool(getattr(source, "pinned", False))  # RAMExpertSource: one pinned allocation


class DeviceExpertCache(ExpertCache):
    """The device-resident expert cache (module docstring). ``source`` must offer ``bank()``."""

    def __init__(self, store, source, config: CacheConfig, routers=None, device="cpu") -> None:
        if config.pinned or config.admission or config.miss_compute != "transfer":
            raise ConfigError("the device expert cache runs without always-resident experts, admission "
                              "control or CPU-computed misses (use the host cache for those)")
        bank = source.bank() if hasattr(source, "bank") else host_tier_bank(store, source)
        if bank is None:
            raise ConfigError("the device expert cache needs every expert in the RAM tier (a bank the "
                              "copy kernel reads); give a RAM budget that holds them all, or use the host cache")
        if torch.device(device).type == "cuda" and not _bank_pinned(source):
            raise ConfigError("the device expert cache's copy kernel reads the RAM tier through mapped pinned "
                              "memory, and pinning it failed (see the warning above): use the host cache")
        super().__init__(store, source, config, routers=routers, device=device)
        self.grouped = True  # the grouped kernels read the slot map the device state writes
        buf, rows = bank
        self.bank = buf.reshape(buf.shape[0], -1).view(torch.int64)
        moe = store.config.moe
        self.dpolicy = DevicePolicy(config.policy, sparse_layers=self.sparse_layers, num_experts=moe.num_experts,
                                    top_k=moe.top_k, num_slots=self.num_slots, slot_map=self.slot_map)
        self.bank_row = rows[self.sparse_layers].reshape(-1).to(torch.int64).to(self.device)
        if int(self.bank_row.min()) < 0:
            raise ConfigError("the device expert cache needs every expert in the RAM tier's bank")
        self.words = -(-store.expert_nbytes // 8)
        self.pool_words = self.slots.view(torch.int64)
        self.copy_launches = 0

    @property
    def metrics(self):
        """The host metrics, with hits, misses and bytes moved read from the device counters
        (a host synchronisation: for summaries, not for the step)."""
        m = self._metrics
        if hasattr(self, "dpolicy"):
            hits, misses = self.dpolicy.hits.tolist(), self.dpolicy.misses.tolist()
            for i, layer in enumerate(self.sparse_layers):
                lm = m.layer(layer)
                lm.hits, lm.misses = hits[i], misses[i]
                lm.bytes_to_device = misses[i] * self.store.expert_nbytes
        return m

    @metrics.setter
    def metrics(self, value) -> None:
        self._metrics = value

    # ---- the device path (no host synchronisation) --------------------------------------
    def device_acquire(self, layer: int, ids: torch.Tensor) -> None:
        """Assign slots to ``layer``'s routed ids (a device tensor) and copy the misses in."""
        self.dpolicy.assign(layer, ids)
        self.copy_misses(min(ids.numel(), self.dpolicy.num_experts))

    def device_prefetch(self, layer: int, hidden: torch.Tensor) -> None:
        """The next sparse layers' predicted experts from this layer's MoE input: assigned and
        copied like misses (protecting this layer's), on the device."""
        for nxt, picks in self.predictions(layer, hidden):
            self.dpolicy.assign(nxt, picks, prefetch=True)
            self.copy_misses(min(picks.numel(), self.dpolicy.num_experts))

    def copy_misses(self, max_misses: int) -> None:
        """One launch: every miss of the last assign, bank row -> slot (grid sized to the most
        misses the assign can have; programs past the device's count return at once)."""
        if max_misses < 1:
            return
        self.copy_launches += 1
        chunks = -(-self.words // COPY_BLOCK)
        _copy()[(max_misses, chunks)](
            self.dpolicy.miss_slot, self.dpolicy.miss_key, self.dpolicy.state, self.bank, self.bank_row,
            self.pool_words, self.words, self.bank.shape[1], self.pool_words.shape[1], BLOCK=COPY_BLOCK)

    # ---- the ExpertProvider interface for eager steps (reads the device) ----------------
    def acquire_overlapped(self, layer, expert_ids, ready):
        """Misses are device copies from the bank, not disk reads: nothing to compute behind them
        (ExpertProvider's default, not ExpertCache's host-side one)."""
        return self.acquire(layer, expert_ids)

    def acquire(self, layer: int, expert_ids: list[int]):
        ids = torch.tensor(expert_ids, dtype=torch.int64, device=self.device)
        self.device_acquire(layer, ids)
        host_sync("eager acquire: slots")
        slots = self.slot_map[layer, ids].tolist()
        if min(slots, default=0) < 0:
            raise CacheCapacityError(
                f"all {self.num_slots} device slots are pinned; a step needs more distinct experts at "
                f"once than the device budget holds")
        return {e: self._slot_view((layer, e), s) for e, s in zip(expert_ids, slots)}

    def release(self, layer: int, expert_ids: list[int]) -> None:
        """Nothing to unpin: a launch's pins end with the next launch (stream order)."""

    def observe_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        self.device_prefetch(layer, hidden)

    def allowed_experts(self, layer: int) -> list[int] | None:
        if not self.restrict_to_resident:
            return None
        host_sync("resident experts")
        ids = [e for e, s in enumerate(self.slot_map[layer].tolist()) if s >= 0]
        return ids or None

    def slot_table(self, layer, expert_ids, experts):
        return None  # the fused CPU step's slot rows are the host cache's

    @property
    def slot_of(self) -> dict[Key, int]:
        return self.dpolicy.slot_of()

    @property
    def pins(self) -> dict[Key, int]:
        return {}

    @property
    def loading(self) -> dict:
        return {}

    def resident_keys(self) -> set[Key]:
        return set(self.dpolicy.slot_of())

    def device_counts(self) -> dict[str, int]:
        """Hits, misses, prefetched experts and unserved misses so far (reads the device)."""
        from engine.experts.device_policy import ERRORS, PREFETCHED

        st = self.dpolicy.state.tolist()
        return {"hits": int(self.dpolicy.hits.sum()), "misses": int(self.dpolicy.misses.sum()),
                "prefetched": st[PREFETCHED], "unserved": st[ERRORS], "last_misses": st[MISS_N]}

    def reconfigured(self, **changes) -> "DeviceExpertCache":
        from dataclasses import replace

        return DeviceExpertCache(self.store, self.source, replace(self.config, **changes), routers=self.routers,
                                 device=self.device)
