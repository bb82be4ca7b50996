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
from dataclasses import dataclass
from typing import Iterator

import torch

from engine.errors import ConfigError, DeviceBudgetError, HostMemoryError
from engine.experts.host_memory import (  # noqa: F401  (the budgets' host side, re-exported)
    CGROUP_GROWTH, CGROUP_MARGIN, HOST_HEADROOM, available_host_memory, cgroup_memory_limit, cgroup_working_set,
    host_limit, host_memory,
)
from engine.units import format_bytes

__all__ = ["Budgets", "CGROUP_MARGIN", "DeviceBudget", "GiB", "HOST_HEADROOM", "HostMemoryError",
           "auto_device_budget", "auto_ram_budget", "available_host_memory", "cgroup_memory_limit", "host_limit",
           "resolve_budgets"]

GiB = 2**30


def _fmt(n: int) -> str:
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

SMALLER_DENSE = " or use smaller dense formats (--dense int8)"  # a refusal's advice, where it applies
DEVICE_WORKSPACE = GiB // 2  # device memory "auto" leaves for activations and kernel workspaces (GPU)


@dataclass(frozen=True)
class Budgets:
    """The two expert-tier budgets of a run and where each came from: ``device_from`` /
    ``ram_from`` say "given" or how budgets ``auto`` resolved it; ``resident`` what auto counted
    beside the device slots. ``experts``: every expert's slot bytes (the 100% budget)."""

    device: int
    ram: int
    experts: int
    device_from: str = "given"
    ram_from: str = "given"
    resident: str = ""

    @property
    def auto(self) -> bool:
        return self.device_from != "given" or self.ram_from != "given"

    @property
    def line(self) -> str:
        """One line to print at start-up (``budgets auto: ...`` when either was resolved)."""
        total = max(self.experts, 1)
        return (f"budgets {'auto' if self.auto else 'given'}: device {format_bytes(self.device)} "
                f"({self.device / total:.0%} of the experts; {self.device_from}), RAM tier {format_bytes(self.ram)} "
                f"({self.ram / total:.0%}; {self.ram_from})" + (f"; {self.resident}" if self.resident else ""))


def _nothing_left(what: str, where: str) -> DeviceBudgetError:
    return DeviceBudgetError(f"budgets auto leave no memory for {what}: {where}. "
                             f"Give --device-budget and --ram-budget explicitly")


def auto_ram_budget(experts_total: int, *, headroom: int = HOST_HEADROOM,
                    host_available: int | None = None) -> tuple[int, str]:
    """The RAM tier ``auto`` beside a GPU's device tier: the available host RAM
    (``host_available``, default :func:`available_host_memory`) less ``headroom``, capped at
    ``experts_total``; ``(bytes, how)``."""
    avail = available_host_memory() if host_available is None else host_available
    where = f"available host RAM {format_bytes(avail)} - headroom {format_bytes(headroom)}"
    if avail - headroom <= 0:
        raise _nothing_left("the RAM tier", where)
    return min(avail - headroom, experts_total), where


def auto_device_budget(experts_total: int, *, device: str | torch.device, resident: int,
                       workspace: int = DEVICE_WORKSPACE, device_free: int | None = None) -> tuple[int, str]:
    """A GPU's expert slots ``auto``: the free device memory (``device_free``, default
    ``torch.cuda.mem_get_info``) less ``resident`` (dense weights, KV cache, recurrent state) and
    ``workspace``, capped at ``experts_total``; ``(bytes, how)``."""
    if device_free is None:
        device_free = torch.cuda.mem_get_info(torch.device(device))[0]
    where = (f"free device memory {format_bytes(device_free)} - dense/KV/state {format_bytes(resident)} - workspace "
             f"{format_bytes(workspace)}")
    d = device_free - resident - workspace
    if d <= 0:
        raise _nothing_left("expert slots on the device", where)
    return min(d, experts_total), where


def resolve_budgets(experts_total: int, *, device: str | torch.device, resident: int,
                    headroom: int | None = None, workspace: int = DEVICE_WORKSPACE,
                    device_free: int | None = None, host_available: int | None = None,
                    device_budget: int | None = None, ram_budget: int | None = None,
                    ram_from: str = "given", resident_note: str = "", min_tiers: int = 0,
                    staging: int = 0, growth: int = CGROUP_GROWTH,
                    remedy: str = "raise the limit" + SMALLER_DENSE) -> Budgets:
    """Budgets ``auto`` for the tiers not given (``device_budget`` / ``ram_budget`` None), each
    capped at ``experts_total``. On a GPU: :func:`auto_device_budget` and
    :func:`auto_ram_budget`. On a CPU the device tier is host memory too: the memory the
    process may use (``host_available``, default :func:`host_limit`: its cgroup's limit when
    that is lower than the available RAM) less ``headroom`` (None: under a cgroup limit what the
    group holds now plus ``growth``, what the run will add beyond what the budgets count
    (host_memory.host_limit, growth_allowance), :data:`HOST_HEADROOM` else) and ``resident`` is
    shared: with both auto the device slots (what experts are computed from) first, less
    ``staging`` bytes that the RAM tier keeps for reads in flight, the RAM
    tier the rest; a given budget is taken out of it before the other is resolved, so nothing is
    counted twice. On a CPU, memory that cannot hold ``resident`` + headroom + ``min_tiers``
    (the least the tiers run with; checked when a budget is auto or the limit is a cgroup's)
    raises :class:`~engine.errors.HostMemoryError` naming that minimum, before anything is
    loaded (``remedy``: what its message tells the user to do); a budget that comes out <= 0 raises
    DeviceBudgetError naming the figures.
    ``ram_from``: how a given RAM budget was chosen."""
    from engine.units import format_bytes as fb

    dev = torch.device(device)
    if dev.type != "cuda":
        limited = False  # a cgroup limit: even given budgets must leave the dense part room under it
        if host_available is None:
            host_available, auto_headroom, what = host_limit(growth)
            limited = what.startswith("cgroup")
        else:
            auto_headroom, what = HOST_HEADROOM, f"available RAM {fb(host_available)}"
        headroom = auto_headroom if headroom is None else headroom
        need = resident + headroom + min_tiers
        if need > host_available and (limited or device_budget is None or ram_budget is None):
            raise HostMemoryError(
                f"{what} cannot hold this model: it needs at least {fb(need)} ({need} B): dense/KV/state "
                f"{fb(resident)} + margin {fb(headroom)} + the smallest expert tiers {fb(min_tiers)}; {remedy}")
    elif headroom is None:
        headroom = HOST_HEADROOM
    d_from = r_from = "given"
    if ram_budget is not None:
        r_from = ram_from
    # the resident bytes count where the device tier is resolved, and on a CPU for both tiers
    counted = device_budget is None or (dev.type != "cuda" and ram_budget is None)
    if dev.type == "cuda":
        if device_budget is None:
            device_budget, d_from = auto_device_budget(experts_total, device=dev, resident=resident,
                                                       workspace=workspace, device_free=device_free)
        if ram_budget is None:
            ram_budget, r_from = auto_ram_budget(experts_total, headroom=headroom, host_available=host_available)
    elif device_budget is None or ram_budget is None:
        usable = host_available - headroom - resident
        where = f"{what} - headroom {format_bytes(headroom)} - dense/KV/state {format_bytes(resident)}"
        if device_budget is None and ram_budget is None:
            # both auto: the slots the experts are computed from first; the RAM tier then holds
            # what is left, at least ``staging`` (the reads in flight): an expert in both tiers
            # is a second copy of it, which only pays when everything fits twice
            device_budget = min(experts_total, usable - staging)
            d_from = f"{where} - staging {format_bytes(staging)}: on a CPU the device tier is host memory too"
            if device_budget <= 0:
                raise _nothing_left("expert slots (the device tier)", d_from)
            ram_budget = min(experts_total, usable - device_budget)
            r_from = f"{where} - the device tier"
        elif ram_budget is None:
            ram_budget = min(experts_total, usable - device_budget)
            r_from = f"{where} - device tier {format_bytes(device_budget)}"
        else:
            device_budget = min(experts_total, usable - ram_budget)
            d_from = f"{where} - the RAM tier: on a CPU the device tier is host memory too"
        if ram_budget <= 0:
            raise _nothing_left("the RAM tier", r_from)
        if device_budget <= 0:
            raise _nothing_left("expert slots (the device tier)", d_from)
    return Budgets(device_budget, ram_budget, experts_total, d_from, r_from, resident_note if counted else "")
