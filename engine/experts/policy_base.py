"""The eviction-policy interface (engine.experts.policy's module doc) and the lazy-deletion
heap helpers its implementations share; here so that a policy in its own module
(engine.experts.policy_sweep) and the factory (engine.experts.policy.make_policy) that builds
every policy do not import each other."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from collections.abc import Set as AbstractSet

Key = Hashable  # (layer, expert) in practice


def _as_container(resident: Iterable[Key]) -> Collection[Key]:
    """Return something with O(1) membership for ``resident``."""
    if isinstance(resident, (AbstractSet, Mapping)):
        return resident  # type: ignore[return-value]
    return set(resident)


class _Union:
    """Membership view of two containers (protected keys plus the pinned set), no copy."""

    __slots__ = ("a", "b")

    def __init__(self, a: Collection[Key], b: Collection[Key]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


def _first_eligible(heap: list, key_of: Callable, is_stale: Callable,
                    protected: Collection[Key], resident: Collection[Key]) -> Key | None:
    """The best key on a lazy-deletion heap that is resident and not protected: stale entries
    are dropped on the way, protected / non-resident ones are put back afterwards."""
    skipped, found = [], None
    while heap:
        entry = heap[0]
        if is_stale(entry):
            heapq.heappop(heap)
            continue
        key = key_of(entry)
        if key in protected or key not in resident:
            skipped.append(heapq.heappop(heap))
            continue
        found = key
        break
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found


class EvictionPolicy(ABC):
    """Ranks resident keys; see the module docstring for the contract."""

    name: str = "abstract"

    @abstractmethod
    def on_hit(self, key: Key, now: int | float) -> None:
        """A resident ``key`` was used at time ``now``."""

    @abstractmethod
    def on_insert(self, key: Key, now: int | float) -> None:
        """``key`` became resident at time ``now`` (it is also a use of ``key``)."""

    @abstractmethod
    def on_remove(self, key: Key) -> None:
        """``key`` left the cache. Removing a key the policy does not track is a no-op."""

    @abstractmethod
    def _pick(self, resident: Collection[Key], protected: Collection[Key], now: int | float) -> Key | None:
        """Best victim among tracked keys in ``resident`` and not in ``protected``; None if none."""

    def victim(
        self, resident: Iterable[Key], protected: Collection[Key] = frozenset(), now: int | float = 0
    ) -> Key | None:
        """The key to evict, never one in ``protected``; None if every resident key is protected."""
        resident = _as_container(resident)
        key = self._pick(resident, protected, now)
        if key is not None:
            return key
        # Slow path: resident keys the policy was never told about (the cache inserted them
        # without on_insert). They rank below everything tracked; pick the first one in order.
        for key in resident:
            if key not in protected and not self._tracks(key):
                return key
        return None

    @abstractmethod
    def _tracks(self, key: Key) -> bool:
        """Whether ``key`` is in the policy's bookkeeping (inserted and not removed)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
