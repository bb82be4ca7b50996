"""A device memory budget (``--vram-budget``) that allocations are charged against.

Every device allocation of a run is charged by name (dense weights, KV cache, recurrent state,
expert slots, workspace); one that would take the total past the budget raises
:class:`~engine.errors.DeviceBudgetError` naming it, its size, what is already charged and the
budget, before anything is allocated. On a GPU the budget is also the CUDA caching allocator's
hard limit (``torch.cuda.set_per_process_memory_fraction`` of the budget less the memory the
process already holds outside the allocator, the CUDA context), so anything the process
allocates on the device past the budget fails too; :meth:`DeviceBudget.guard` turns the
allocator's out-of-memory error into the same typed error, and :meth:`check_peak` compares the
allocator's peak with the budget after a run. On a CPU run the "device" is host memory and the
ledger is the enforcement.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from engine.errors import ConfigError, DeviceBudgetError

__all__ = ["DeviceBudget", "GiB", "HOST_HEADROOM", "auto_budgets", "available_host_memory"]

GiB = 2**30


def _fmt(n: int) -> str:
    from engine.units import format_bytes

    return f"{format_bytes(n)} ({n} B)"


class DeviceBudget:
    def __init__(self, budget: int, device: str | torch.device = "cpu") -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ConfigError(f"device budget must be a positive number of bytes, got {budget!r}")
        self.budget = budget
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the allocator calls want an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.charges: dict[str, int] = {}
        self.context = 0  # bytes the process holds on the device outside the allocator
        if self.device.type == "cuda":
            self._limit_allocator()

    @property
    def used(self) -> int:
        return self.context + sum(self.charges.values())

    @property
    def free(self) -> int:
        return self.budget - self.used

    def charge(self, what: str, nbytes: int) -> None:
        """Record ``nbytes`` for ``what`` (added to an earlier charge of the same name); raises
        DeviceBudgetError, recording nothing, when the budget would be exceeded."""
        if nbytes < 0:
            raise ConfigError(f"charge for {what!r} must be >= 0 bytes, got {nbytes}")
        if self.used + nbytes > self.budget:
            held = ", ".join(f"{k} {_fmt(v)}" for k, v in self.charges.items()) or "nothing"
            ctx = f" (+ CUDA context {_fmt(self.context)})" if self.context else ""
            raise DeviceBudgetError(
                f"{what}: {_fmt(nbytes)} does not fit the device budget of {_fmt(self.budget)}: "
                f"{_fmt(self.used)} already charged ({held}{ctx}), {_fmt(max(self.free, 0))} free")
        self.charges[what] = self.charges.get(what, 0) + nbytes

    def release(self, what: str) -> None:
        self.charges.pop(what, None)

    def _limit_allocator(self) -> None:
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info(self.device)
        # what this process holds beyond the allocator (context, cuBLAS handles); the lent
        # machine runs one process per device, so total - free is ours
        self.context = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        allowed = self.budget - self.context
        if allowed <= 0:
            raise DeviceBudgetError(f"the CUDA context alone ({_fmt(self.context)}) exceeds the device budget "
                                    f"of {_fmt(self.budget)}")
        torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), self.device)

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn the allocator's out-of-memory error (the hard limit) into DeviceBudgetError."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            raise DeviceBudgetError(f"{what}: the device allocator refused an allocation past the budget "
                                    f"of {_fmt(self.budget)} ({_fmt(self.used)} charged): "
                                    f"{str(e).splitlines()[0]}") from None

    def check_peak(self) -> int:
        """Peak device bytes of the run (allocator peak + context on CUDA; the ledger on CPU);
        raises DeviceBudgetError if past the budget."""
        peak = (torch.cuda.max_memory_reserved(self.device) + self.context if self.device.type == "cuda"
                else self.used)
        if peak > self.budget:
            raise DeviceBudgetError(f"peak device memory {_fmt(peak)} exceeded the budget of {_fmt(self.budget)}")
        return peak

    def rows(self) -> list[tuple[str, int]]:
        out = list(self.charges.items())
        if self.context:
            out.append(("CUDA context", self.context))
        return out


# ---- budgets "auto" ---------------------------------------------------------------------------

HOST_HEADROOM = 4 * GiB  # host RAM left free beside the tiers by "auto" (the OS, the page cache, Python)
DEVICE_WORKSPACE = GiB // 2  # device memory "auto" leaves for activations and kernel workspaces (GPU)


def host_memory(available: bool = False) -> int:
    """Bytes of RAM this process may use: physical memory (``available``: MemAvailable from
    /proc/meminfo, else physical memory), or the cgroup limit when lower."""
    import os
    from pathlib import Path

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if available:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    mem = int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            pass
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            mem = min(mem, int(text))
    return mem


def available_host_memory() -> int:
    """MemAvailable (bytes), else physical memory; the cgroup limit when lower."""
    return host_memory(available=True)


def auto_budgets(experts_total: int, *, device: str | torch.device, resident: int,
                 headroom: int = HOST_HEADROOM, workspace: int = DEVICE_WORKSPACE,
                 device_free: int | None = None, host_available: int | None = None) -> tuple[int, int, str]:
    """Budgets ``auto``: ``(device_budget, ram_budget, line to print)``, each capped at
    ``experts_total`` (every expert's slot bytes).

    ``resident``: the bytes the model keeps where the device tier lives besides expert slots
    (dense weights, KV cache, recurrent state). On a GPU the device budget is the free device
    memory (``device_free``, default ``torch.cuda.mem_get_info``) less ``resident`` and
    ``workspace``, and the RAM tier is the available host RAM less ``headroom``. On a CPU the
    device tier is host memory too: the available RAM less ``headroom`` and ``resident`` goes
    to the RAM tier first (the source of every miss), the rest to device slots. A budget that
    comes out <= 0 raises DeviceBudgetError naming the figures."""
    dev = torch.device(device)
    avail = available_host_memory() if host_available is None else host_available
    if dev.type == "cuda":
        if device_free is None:
            device_free = torch.cuda.mem_get_info(dev)[0]
        d = device_free - resident - workspace
        r = avail - headroom
        where = (f"free device memory {_fmt(device_free)} - dense/KV/state {_fmt(resident)} - workspace "
                 f"{_fmt(workspace)}")
    else:
        usable = avail - headroom - resident
        r = min(experts_total, usable)
        d = usable - r
        where = (f"available RAM {_fmt(avail)} - headroom {_fmt(headroom)} - dense/KV/state {_fmt(resident)}, "
                 f"less the RAM tier (the device tier is host memory on a CPU)")
    if d <= 0 or r <= 0:
        raise DeviceBudgetError(
            f"budgets auto leave no memory for expert slots (device {_fmt(max(d, 0))}, RAM tier {_fmt(max(r, 0))}): "
            f"{where}; RAM headroom {_fmt(headroom)}. Give --device-budget and --ram-budget explicitly")
    d, r = min(d, experts_total), min(r, experts_total)
    line = (f"budgets auto: device {_fmt(d)} ({d / experts_total:.0%} of the experts; {where}), RAM tier {_fmt(r)} "
            f"({r / experts_total:.0%}; available host RAM {_fmt(avail)} - headroom {_fmt(headroom)})")
    return d, r, line
