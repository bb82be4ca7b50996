"""The count of host synchronisations of a GPU step, and the seam that counts them on any device.

Every place on the step's path where the host waits for the device (a device-to-host read such
as ``ids.tolist()``, a ``stream.synchronize()``) calls :func:`host_sync` with its reason, on every
device: on a CPU the call does not wait for anything, but it is where a GPU run would, so the CPU
tests and ``bench/gpu_check.py --headline --dry-run`` count the synchronisations of a decode step
without a GPU. Each one is a pipeline bubble on a GPU (the queue drains, the host round trip, the
next launches start cold): the per-layer path pays one per sparse layer for the routed ids plus
one per miss; the device cache in one graph per step pays none between the first layer and the
sampler.

    with counting() as c:
        ... one decode step ...
    c.total, c.by_reason            # {"routed ids": 24, "miss copy": 7, ...}
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

_lock = threading.Lock()
_active: list["SyncCount"] = []


@dataclass
class SyncCount:
    by_reason: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())


def host_sync(reason: str) -> None:
    """Record that the host waits on the device here (see the module docstring)."""
    if _active:
        with _lock:
            for c in _active:
                c.by_reason[reason] += 1


@contextmanager
def counting() -> Iterator[SyncCount]:
    """Count every :func:`host_sync` (all threads) while the block runs."""
    c = SyncCount()
    with _lock:
        _active.append(c)
    try:
        yield c
    finally:
        with _lock:
            _active.remove(c)
