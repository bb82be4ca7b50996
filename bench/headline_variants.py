"""The headline run's other expert sources, measured beside the in-process RAM tier on the same
model, trace and slot count (bench/headline.py ``--disk DIR``, ``--ray``):

- ``disk``: the synthetic experts written once to a real expert store in DIR
  (engine.experts.synthetic_disk), served by the in-process HostTier, whose RAM is a share
  (``--ram-tier``) of the experts: RAM-tier misses are O_DIRECT reads of the store.
- ``Ray loaders``: the same store behind the Ray pipeline's loader actors
  (services.expert_loader): the decode side copies each missed expert out of a loader's shared
  memory (an actor call the first time, a seqlock-checked direct read after). The loaders hold
  every expert (filled before the run), so the comparison with the in-process RAM tier is the
  loader path's own cost. The CPU is the "device" here: its memory holds the slots, the
  copies are the link.

Each variant has its own expert cache (same slots and policy) and its own replay of the trace;
bench/headline.py runs their decode blocks interleaved with the in-process blocks, so a shared
machine's load falls on all alike.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

from engine.units import format_bytes


@dataclass
class Variant:
    label: str
    cache: object
    routing: object
    source: object
    times: list = field(default_factory=list)
    nvme0: tuple = (0, 0.0)

    def start(self) -> None:
        """Start measuring: fresh cache metrics, the source's disk counters as of now."""
        from engine.experts.cache import CacheMetrics

        self.cache.metrics = CacheMetrics()
        self.times = []
        self.nvme0 = self._nvme()

    def _nvme(self) -> tuple:
        c = self.source.counters().get("nvme")
        return (c.bytes_in, c.seconds) if c is not None else (0, 0.0)

    def figures(self) -> dict:
        m = self.cache.metrics.total()
        steps = len(self.times)
        wall = sum(self.times)
        acc = m.hits + m.misses
        nb, ns = (a - b for a, b in zip(self._nvme(), self.nvme0))
        return dict(label=self.label, tok_s=1.0 / statistics.median(self.times),
                    tok_s_mean=steps / wall if wall else 0.0, hit_rate=m.hits / acc if acc else 0.0,
                    to_device_per_token=m.bytes_to_device / steps, disk_per_token=nb / steps,
                    copy_gbs=m.bytes_to_device / m.copy_s / 1e9 if m.copy_s else float("nan"),
                    disk_gbs=nb / ns / 1e9 if ns else float("nan"), stall_fraction=m.stall_s / wall if wall else 0.0,
                    stall_ms_per_token=m.stall_s / steps * 1e3)


def print_table(rows: list[dict]) -> None:
    print("| expert source | tok/s (median step / mean) | device hit rate | bytes to device / token | from disk / token "
          "| device copy GB/s (incl. reads below) | disk read GB/s | stall fraction | stall ms / token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        disk = f"{r['disk_gbs']:.3g}" if r["disk_gbs"] == r["disk_gbs"] else "n/a"
        print(f"| {r['label']} | {r['tok_s']:.2f} / {r['tok_s_mean']:.2f} | {r['hit_rate']:.1%} | {format_bytes(r['to_device_per_token'])} | "
              f"{format_bytes(r['disk_per_token'])} | {r['copy_gbs']:.3g} | {disk} | {r['stall_fraction']:.1%} | "
              f"{r['stall_ms_per_token']:.2f} |")


def disk_tier(store, share: float, policy: str = "lru"):
    """The in-process RAM tier over the on-disk store, holding ``share`` of the experts."""
    from engine.errors import ConfigError
    from engine.experts.tiers import HostTier, align_up

    if not 0 < share < 1:
        raise ConfigError(f"--ram-tier must be in (0, 1) (a share of the experts, smaller than all of them "
                          f"so misses come from disk), got {share}")
    slot = align_up(store.expert_nbytes)
    return HostTier(store, max(1, int(share * store.num_experts_total)) * slot, policy=policy)


class RayLoaders:
    """``count`` ExpertLoader actors over the store at ``path`` (a local loopback cluster started
    here unless this process is already connected to one), and the decode side's
    LoaderPoolSource. Each loader's RAM holds its whole shard; :meth:`fill` reads every expert
    once so the measured run sees a RAM-resident pipeline. :meth:`close` unlinks the loaders'
    segments, ends them, and the cluster if it was started here."""

    def __init__(self, path, store, count: int = 2) -> None:
        import math

        import ray

        from engine.errors import ConfigError
        from engine.experts.tiers import align_up
        from services.app import init_ray
        from services.expert_loader import ExpertLoader, LoaderPoolSource, rendezvous_owner

        if count < 1:
            raise ConfigError(f"--loaders must be >= 1, got {count}")
        self.ns = f"headline-{os.getpid()}"
        self.owns = init_ray(namespace=self.ns)
        names = [f"headline-{os.getpid()}-loader-{i}" for i in range(count)]
        keys = [(l, e) for l in store.config.moe_layers for e in range(store.config.moe.num_experts)]
        shard = max(sum(rendezvous_owner(k, sorted(names)) == n for k in keys) for n in names)
        slot = align_up(store.expert_nbytes)
        self.handles = {}
        try:
            for n in names:
                self.handles[n] = ray.remote(ExpertLoader).options(num_cpus=0, max_task_retries=-1).remote(
                    n, str(path), math.ceil(shard * 1.05 + 2) * slot, self.ns, "lru")
            ray.get([h.check_health.remote() for h in self.handles.values()], timeout=120)
        except BaseException:
            self.close()
            raise
        self.keys = keys
        self.source = LoaderPoolSource(store, self.handles, fetch_timeout_s=30.0)

    def fill(self) -> float:
        """Read every expert once through the loaders (into a scratch buffer); returns seconds."""
        import time

        import torch

        buf = torch.empty(self.source.slot_bytes, dtype=torch.uint8)
        t = time.perf_counter()
        for k in self.keys:
            self.source.read_into(k, buf)
        return time.perf_counter() - t

    def close(self) -> None:
        import ray

        for h in self.handles.values():
            try:
                ray.get(h.close.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(h)
        self.handles = {}
        if self.owns:
            ray.shutdown()
            self.owns = False
