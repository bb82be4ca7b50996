"""Eviction policies for the expert cache: pure bookkeeping, no bytes move here.

A policy ranks the keys a cache holds and names a victim when the cache is full. The cache
(the trace-replay simulator in ``simulate.py`` now, the live VRAM cache later) owns the resident
set and tells the policy what happened:

    on_insert(key, now)   key became resident (after a miss)
    on_hit(key, now)      a resident key was used again
    on_remove(key)        key left the cache (evicted or dropped)
    victim(resident, protected, now) -> key | None

Keys are ``(layer, expert)`` tuples (any hashable works). ``now`` is a monotone clock in the
cache's units; the simulator uses the index of the access in the flat access stream, which is
what :class:`BeladyPolicy` requires and what :class:`LFUPolicy`'s ``half_life`` is measured in.

Invariants every policy keeps:
- ``victim`` never returns a key in ``protected`` (experts pinned by the running step, or the
  always-resident set) and only returns keys in ``resident``; it returns None when every
  resident key is protected.
- ``victim`` does not remove anything: the cache calls ``on_remove`` for the key it evicts.
- Cost: ``victim`` is O(log n) amortised (ordered dict or lazy-deletion heap) plus the protected
  or non-resident keys it has to step over; it never scans the whole resident set on the
  fast path. ``resident`` should support O(1) ``in`` (a set, dict or keys view); anything else is
  copied into a set first.

The always-resident (pinned) set is :class:`PinnedPolicy`: it wraps any policy, keeps pinned
keys out of the inner policy's bookkeeping and never offers them as victims. Choose the pinned
set with :func:`top_keys` (most frequent experts of a trace).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from engine.experts.policy_base import EvictionPolicy, Key, _first_eligible, _Union

if TYPE_CHECKING:  # pragma: no cover
    from engine.experts.trace import RoutingTrace


__all__ = [
    "Key",
    "EvictionPolicy",
    "LRUPolicy",
    "LFUPolicy",
    "BeladyPolicy",
    "PinnedPolicy",
    "POLICY_NAMES",
    "make_policy",
    "can_decline",
    "next_use_indices",
    "top_keys",
]


class LRUPolicy(EvictionPolicy):
    """Least recently used. An ordered dict, oldest first; hits move a key to the end."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_hit(self, key: Key, now: int | float = 0) -> None:
        if key in self._order:
            self._order.move_to_end(key)
        else:  # a hit on a key we never saw inserted: start tracking it
            self._order[key] = None

    def on_insert(self, key: Key, now: int | float = 0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def _tracks(self, key: Key) -> bool:
        return key in self._order

    def _pick(self, resident, protected, now):
        for key in self._order:  # oldest first; protected keys are usually the newest
            if key not in protected and key in resident:
                return key
        return None

    def order(self) -> list[Key]:
        """Tracked keys, least recently used first (for tests and debugging)."""
        return list(self._order)


class LFUPolicy(EvictionPolicy):
    """Least frequently used, with aging; ties go to the least recently used key.

    Every use adds weight 1 that halves every ``half_life`` units of ``now`` (accesses in the
    simulator), so old popularity fades. ``decay`` is the same thing given as a per-unit factor:
    ``decay=d`` means ``half_life = ln(0.5) / ln(d)``. ``half_life=None`` (or ``decay=1``) is
    plain LFU with integer counts.

    Scores are kept in the log2 domain relative to time 0, ``S = log2(sum_i 2**(t_i / h))``, so
    the ranking of two keys does not change while neither is used: a lazy-deletion min-heap
    ordered by ``(S, last_use)`` gives the victim in O(log n).

    ``keep_history=True`` (default) remembers the decayed score of evicted keys, so an expert
    that was popular comes back with its count (perfect LFU, right for routing skew);
    ``False`` is in-cache LFU, where a re-inserted key starts from one use.
    """

    def __init__(
        self,
        half_life: float | None = 4096.0,
        *,
        decay: float | None = None,
        keep_history: bool = True,
    ) -> None:
        if decay is not None:
            if not (0.0 < decay <= 1.0):
                raise ValueError(f"LFUPolicy decay must be in (0, 1], got {decay!r}")
            half_life = None if decay == 1.0 else math.log(0.5) / math.log(decay)
        if half_life is not None and not (half_life > 0 and math.isfinite(half_life)):
            raise ValueError(f"LFUPolicy half_life must be a positive finite number or None, got {half_life!r}")
        self.half_life = half_life
        self.keep_history = keep_history
        self.name = "lfu" if half_life is not None else "lfu-pure"
        self._score: dict[Key, float] = {}  # log2-domain (or plain count) score, incl. history
        self._last: dict[Key, float] = {}
        self._tracked: set[Key] = set()
        self._version: dict[Key, int] = {}
        self._heap: list[tuple[float, float, int, Key]] = []
        self._seq = 0

    def _bump(self, key: Key, now: int | float) -> None:
        h = self.half_life
        old = self._score.get(key)
        if h is None:
            new = 1.0 if old is None else old + 1.0
        else:
            x = now / h
            if old is None:
                new = x
            else:  # log2(2**old + 2**x), stable
                hi, lo = (old, x) if old >= x else (x, old)
                new = hi + math.log2(1.0 + 2.0 ** (lo - hi))
        self._score[key] = new
        self._last[key] = now
        self._seq += 1
        self._version[key] = self._seq
        heapq.heappush(self._heap, (new, now, self._seq, key))
        if len(self._heap) > 2 * len(self._tracked) + 64:
            self._compact()

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if e[3] in self._tracked and self._version.get(e[3]) == e[2]]
        heapq.heapify(self._heap)

    def on_hit(self, key: Key, now: int | float = 0) -> None:
        self._tracked.add(key)
        self._bump(key, now)

    def on_insert(self, key: Key, now: int | float = 0) -> None:
        if not self.keep_history:
            self._score.pop(key, None)
        self._tracked.add(key)
        self._bump(key, now)

    def on_remove(self, key: Key) -> None:
        self._tracked.discard(key)
        self._version.pop(key, None)
        if not self.keep_history:
            self._score.pop(key, None)
            self._last.pop(key, None)

    def _tracks(self, key: Key) -> bool:
        return key in self._tracked

    def score(self, key: Key, now: int | float) -> float:
        """Decayed use count of ``key`` at time ``now`` (0 if never used or forgotten)."""
        s = self._score.get(key)
        if s is None:
            return 0.0
        return s if self.half_life is None else 2.0 ** (s - now / self.half_life)

    def _pick(self, resident, protected, now):
        heap = self._heap
        return _first_eligible(
            heap, lambda e: e[3],
            lambda e: e[3] not in self._tracked or self._version.get(e[3]) != e[2],
            protected, resident)


def next_use_indices(future: Sequence[Key]) -> list[int]:
    """``out[i]`` = index of the next access to ``future[i]`` after ``i``, or ``len(future)``."""
    n = len(future)
    out = [n] * n
    seen: dict[Key, int] = {}
    for i in range(n - 1, -1, -1):
        key = future[i]
        out[i] = seen.get(key, n)
        seen[key] = i
    return out


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN (the offline optimum): evict the key whose next use is farthest away.

    ``future`` is the whole access stream and ``now`` the index of the current access in it;
    ``on_hit``/``on_insert`` at ``now`` require ``future[now] == key``. Keys never used again
    rank farthest; ties go to the least recently used key. ``next_use`` (from
    :func:`next_use_indices`) can be passed to share the O(n) precomputation between instances
    (one per layer in a per-layer cache).
    """

    name = "belady"

    def __init__(self, future: Sequence[Key], *, next_use: Sequence[int] | None = None) -> None:
        self._future = future
        self._next_use = next_use if next_use is not None else next_use_indices(future)
        if len(self._next_use) != len(future):
            raise ValueError(
                f"BeladyPolicy next_use has {len(self._next_use)} entries, future has {len(future)}"
            )
        self._next: dict[Key, int] = {}  # tracked key -> index of its next use
        self._heap: list[tuple[int, float, Key]] = []  # (-next_use, last_use, key), lazy

    def _touch(self, key: Key, now: int | float) -> None:
        i = int(now)
        if not (0 <= i < len(self._future)) or self._future[i] != key:
            got = self._future[i] if 0 <= i < len(self._future) else "<out of range>"
            raise ValueError(
                f"BeladyPolicy: access {key!r} at now={now!r} does not match the future stream "
                f"(which has {got!r} there); now must be the index into the access stream"
            )
        nxt = self._next_use[i]
        self._next[key] = nxt
        heapq.heappush(self._heap, (-nxt, now, key))
        if len(self._heap) > 2 * len(self._next) + 64:
            self._heap = [e for e in self._heap if self._next.get(e[2]) == -e[0]]
            heapq.heapify(self._heap)

    def on_hit(self, key: Key, now: int | float) -> None:
        self._touch(key, now)

    def on_insert(self, key: Key, now: int | float) -> None:
        self._touch(key, now)

    def on_remove(self, key: Key) -> None:
        self._next.pop(key, None)

    def _tracks(self, key: Key) -> bool:
        return key in self._next

    def admit(self, key: Key, victim: Key, now: int | float) -> bool:
        """Belady with bypass: cache the missed ``key`` (accessed at ``now``) only if it is used
        again before ``victim`` is."""
        return self._next_use[int(now)] < self._next.get(victim, len(self._future))

    def next_use(self, key: Key) -> int | None:
        """Index of the next use of a tracked key (``len(future)`` = never), None if untracked."""
        return self._next.get(key)

    def _pick(self, resident, protected, now):
        heap = self._heap
        # stale: the key was re-touched or removed since this entry was pushed
        return _first_eligible(heap, lambda e: e[2], lambda e: self._next.get(e[2]) != -e[0],
                               protected, resident)


class PinnedPolicy(EvictionPolicy):
    """An always-resident set on top of any policy.

    Pinned keys never reach the inner policy (so it never has to step over them) and are never
    victims. The cache loads them up front and counts them against its capacity. Removing a
    pinned key is a bookkeeping bug and raises.
    """

    def __init__(self, inner: EvictionPolicy, pinned: Iterable[Key]) -> None:
        self.inner = inner
        self.pinned = frozenset(pinned)
        self.name = f"pinned+{inner.name}"

    def on_hit(self, key: Key, now: int | float) -> None:
        if key not in self.pinned:
            self.inner.on_hit(key, now)

    def on_insert(self, key: Key, now: int | float) -> None:
        if key not in self.pinned:
            self.inner.on_insert(key, now)

    def on_remove(self, key: Key) -> None:
        if key in self.pinned:
            raise ValueError(f"pinned key {key!r} cannot be removed from the cache")
        self.inner.on_remove(key)

    def _tracks(self, key: Key) -> bool:
        return key in self.pinned or self.inner._tracks(key)

    def _pick(self, resident, protected, now):
        return self.inner._pick(resident, _Union(protected, self.pinned), now)

    def victim(self, resident, protected=frozenset(), now=0):
        return self.inner.victim(resident, _Union(protected, self.pinned), now)

    def admit(self, key: Key, victim: Key, now: int | float) -> bool:
        """The inner policy's admission decision; always admit when it has none."""
        admit = getattr(self.inner, "admit", None)
        return True if admit is None else admit(key, victim, now)


def can_decline(policy: EvictionPolicy) -> bool:
    """Whether ``policy`` may decline to cache a miss (admission control: it has an
    ``admit(key, victim, now)``; a pinned set counts its inner policy's)."""
    if isinstance(policy, PinnedPolicy):
        return can_decline(policy.inner)
    return callable(getattr(policy, "admit", None))


def top_keys(source: "RoutingTrace | Iterable[Key]", n: int, *, per_layer: bool = False) -> set[Key]:
    """The ``n`` most frequently accessed keys (ties: smaller key first).

    ``source`` is a RoutingTrace or an access stream. With ``per_layer=True`` (trace only)
    ``n`` is per layer: the top ``n`` experts of every layer.
    """
    if n < 0:
        raise ValueError(f"top_keys n must be >= 0, got {n}")
    accesses = source.accesses() if hasattr(source, "accesses") else source
    counts = Counter(accesses)
    if not per_layer:
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return {k for k, _ in ranked[:n]}
    by_layer: dict[Any, list[tuple[Key, int]]] = {}
    for k, c in counts.items():
        by_layer.setdefault(k[0], []).append((k, c))
    out: set[Key] = set()
    for items in by_layer.values():
        items.sort(key=lambda kv: (-kv[1], kv[0]))
        out.update(k for k, _ in items[:n])
    return out


POLICY_NAMES = ("lru", "lfu", "lfu-pure", "sweep", "belady")


def make_policy(
    name: str,
    *,
    future: Sequence[Key] | None = None,
    next_use: Sequence[int] | None = None,
    half_life: float | None = 4096.0,
    pinned: Iterable[Key] = (),
    num_experts: int | None = None,
    top_k: int | None = None,
) -> EvictionPolicy:
    """Build a policy by name: ``lru``, ``lfu``, ``lfu-pure`` (no aging), ``sweep``, ``belady``;
    a ``pinned+`` prefix or a non-empty ``pinned`` wraps it in :class:`PinnedPolicy`.
    ``num_experts`` and ``top_k`` (per layer) size ``sweep``'s half-life (see
    :func:`engine.experts.policy_sweep.half_life_for`)."""
    base = name[len("pinned+"):] if name.startswith("pinned+") else name
    factories: dict[str, Callable[[], EvictionPolicy]] = {
        "lru": LRUPolicy,
        "lfu": lambda: LFUPolicy(half_life=half_life),
        "lfu-pure": lambda: LFUPolicy(half_life=None),
        "sweep": lambda: _sweep(num_experts, top_k),
        "belady": lambda: _belady(future, next_use),
    }
    if base not in factories:
        allowed = ", ".join(list(POLICY_NAMES) + [f"pinned+{p}" for p in POLICY_NAMES])
        raise ValueError(f"unknown eviction policy {name!r}; allowed: {allowed}")
    policy = factories[base]()
    pinned = frozenset(pinned)
    if pinned or name.startswith("pinned+"):
        policy = PinnedPolicy(policy, pinned)
    return policy


def _sweep(num_experts: int | None, top_k: int | None) -> EvictionPolicy:
    from engine.experts.policy_sweep import SweepPolicy, half_life_for  # it subclasses EvictionPolicy

    return SweepPolicy(half_life_for(num_experts, top_k))


def _belady(future: Sequence[Key] | None, next_use: Sequence[int] | None) -> BeladyPolicy:
    if future is None:
        raise ValueError("the 'belady' policy needs the future access stream (future=...)")
    return BeladyPolicy(future, next_use=next_use)
