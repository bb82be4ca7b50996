"""Sweep-aware eviction: evict the expert whose next use is expected farthest away.

Decode visits every sparse layer once per token, in order: the access stream is a cyclic sweep
(docs/design.md §3). LRU evicts exactly the experts the sweep needs next, and LFU ignores *when* a
layer comes round again. This policy estimates, for every resident expert, the number of
records (layer visits) until its next use and evicts the largest, an online stand-in for
Belady's farthest-next-use rule:

    next_use(l, e) = d(l) + (1 / p(l, e) - 1) * L

- ``L``: sparse layers in the sweep (learned: the distinct layers seen, in ascending order);
- ``d(l)``: records until layer ``l`` is visited again, from the layer visited last
  (``1 .. L``; the layer just visited is ``L`` records away);
- ``p(l, e)``: probability that layer ``l`` picks expert ``e`` at its next visit, estimated
  online as an exponential moving average of "picked at this visit" over the layer's visits
  with a half-life of ``half_life`` visits (tokens); a short half-life follows the
  token-to-token locality of routing, a long one its skew. With the use at visit ``v_i`` the
  estimate at visit ``v`` is ``a * sum_i 2 ** ((v_i - v) / h)``, ``a = 1 - 2 ** (-1 / h)``.
  With ``recency`` (default) an expert the layer picked at its latest visit is estimated at
  least at the measured reuse rate (the share of a visit's picks the layer's next visit makes
  again, pooled over layers, updated once per sweep): token-to-token locality, which LRU
  exploits when the cache holds about one token's working set.

Within one layer the ranking by ``p`` does not change while no key of that layer is used (all
of them decay by the same factor), so each layer keeps a lazy-deletion min-heap of its keys by
``S = log2(sum_i 2 ** (v_i / h))`` (its latest picks, at most a record's worth, are looked at
one by one); the layers' best victims sit on one heap by absolute expected next use, so an
eviction costs O(log L + K) amortised. :meth:`SweepPolicy.reference_victim` is the rule by
brute force, for tests. Scores of evicted keys are kept (an expert coming back brings
its history), as in :class:`~engine.experts.policy.LFUPolicy` with ``keep_history``.

Only the past is used: the policy sees the order of keys it is told about (``on_hit`` and
``on_insert``), never the future. Visits are detected from the keys themselves: a key of a
different layer than the previous key starts a visit of its layer, and so does a key already
used in the current visit when there is only one layer (a one-layer trace). A batch step whose
acquire of one layer is split into chunks is one visit, as it should be, and so is a prefetch of
the next layer followed by its acquire (the prefetched keys are used again in the same visit).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Collection

from engine.experts.policy_base import EvictionPolicy, Key, _first_eligible

__all__ = ["SweepPolicy", "DEFAULT_HALF_LIFE", "half_life_for"]


class _Either:
    """Membership in either of two containers, no copy."""

    __slots__ = ("a", "b")

    def __init__(self, a, b) -> None:
        self.a, self.b = a, b

    def __contains__(self, key) -> bool:
        return key in self.a or key in self.b

DEFAULT_HALF_LIFE = 4.0


def half_life_for(num_experts: int | None, top_k: int | None) -> float:
    """Half-life in visits: ``2 * num_experts / top_k``, the visits in which an average expert
    is picked twice (4 for 12 experts top-6, where it was tuned; ~100 for 512 experts top-10,
    where a short memory of rare picks is noise). DEFAULT_HALF_LIFE when either is unknown."""
    if not num_experts or not top_k:
        return DEFAULT_HALF_LIFE
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"half_life_for: need 1 <= top_k <= num_experts, got {top_k} of {num_experts}")
    return max(1.0, 2.0 * num_experts / top_k)


class SweepPolicy(EvictionPolicy):
    """Farthest expected next use under a cyclic layer sweep; see the module docstring."""

    def __init__(self, half_life: float = DEFAULT_HALF_LIFE, recency: bool = True) -> None:
        if not (isinstance(half_life, (int, float)) and math.isfinite(half_life) and half_life > 0):
            raise ValueError(f"SweepPolicy half_life must be a positive number of visits, got {half_life!r}")
        self.half_life = float(half_life)
        self.recency = recency
        self._last_keys: dict = {}  # layer -> keys used at its latest visit
        self._prev_keys: dict = {}  # layer -> keys used at the visit before
        self._reuse = [0, 0]  # picks of a visit that the layer's previous visit also made, picks
        self._reuse_rate = 0.5  # their ratio, updated once per sweep
        self.name = "sweep"
        self._alpha = 1.0 - 2.0 ** (-1.0 / self.half_life)
        self._layers: list = []  # sweep order: distinct layers seen, ascending
        self._visit: dict = {}  # layer -> visits so far (the current one included)
        self._current = None  # layer of the last key seen
        self._in_visit: set[Key] = set()  # keys used in the current visit
        self._score: dict[Key, float] = {}  # S, including evicted keys' history
        self._used_at: dict[Key, int] = {}  # key -> visit of its layer it was last used in
        self._tracked: set[Key] = set()
        self._version: dict[Key, int] = {}
        self._heaps: dict = {}  # layer -> [(S, seq, key)], lazy
        self._seq = 0
        self._visits_started = 0  # visits of any layer so far
        self._rebuild = False  # rebuild _vheap before the next pick
        self._vheap: list = []  # (-absolute next use, layer, key, version, layer's visit)

    # ---- observation ---------------------------------------------------------------------
    def _layer_of(self, key: Key):
        return key[0] if isinstance(key, tuple) and key else key

    def _observe(self, key: Key) -> int:
        """Advance the visit clock for ``key``'s layer; returns the layer's current visit."""
        layer = self._layer_of(key)
        if layer not in self._visit:
            insort(self._layers, layer)
            self._rebuild = True  # the sweep grew: every layer's distance changed
            self._visit[layer] = 0
            self._heaps[layer] = []
            self._last_keys[layer] = set()
            self._prev_keys[layer] = set()
        if layer != self._current or (key in self._in_visit and len(self._layers) == 1):
            previous = self._current
            self._visit[layer] += 1
            self._visits_started += 1
            self._current = layer
            prev, last = self._prev_keys[layer], self._last_keys[layer]
            if prev and last:  # how many of the visit before last's picks the last visit made again
                self._reuse[0] += len(prev & last)
                self._reuse[1] += len(last)
            self._prev_keys[layer], self._last_keys[layer] = last, set()
            if self._visits_started % len(self._layers) == 0 and self._reuse[1]:
                self._reuse_rate = self._reuse[0] / self._reuse[1]
                self._rebuild = True  # every recent key's estimate changed
            if previous is not None and previous != layer:
                key0 = self._candidate(previous, self._tracked, ())
                if key0 is not None:
                    self._push_layer(previous, key0)
            self._in_visit = set()
        self._in_visit.add(key)
        self._last_keys[layer].add(key)
        return self._visit[layer]

    def _use(self, key: Key) -> None:
        v = self._observe(key)
        if self._used_at.get(key) == v:  # already counted in this visit
            if key not in self._version:  # removed and admitted again since: ranked again
                self._push(key)
            return
        self._used_at[key] = v
        x = v / self.half_life
        old = self._score.get(key)
        if old is None:
            new = x
        else:  # log2(2**old + 2**x), stable
            hi, lo = (old, x) if old >= x else (x, old)
            new = hi + math.log2(1.0 + 2.0 ** (lo - hi))
        self._score[key] = new
        self._push(key)

    def _push(self, key: Key) -> None:
        self._seq += 1
        self._version[key] = self._seq
        heap = self._heaps[self._layer_of(key)]
        heapq.heappush(heap, (self._score[key], self._seq, key))
        if len(heap) > 2 * len(self._tracked) + 64:
            self._compact(heap)

    def _compact(self, heap: list) -> None:
        heap[:] = [e for e in heap if e[2] in self._tracked and self._version.get(e[2]) == e[1]]
        heapq.heapify(heap)

    def on_hit(self, key: Key, now: int | float = 0) -> None:
        self._tracked.add(key)
        self._use(key)

    def on_insert(self, key: Key, now: int | float = 0) -> None:
        self._tracked.add(key)
        self._use(key)

    def on_remove(self, key: Key) -> None:
        self._tracked.discard(key)
        self._version.pop(key, None)

    def _tracks(self, key: Key) -> bool:
        return key in self._tracked

    # ---- estimates -----------------------------------------------------------------------
    def probability(self, key: Key) -> float:
        """Estimated probability that ``key``'s layer picks it at its next visit (0 if unseen)."""
        s = self._score.get(key)
        if s is None:
            return 0.0
        layer = self._layer_of(key)
        p = min(1.0, self._alpha * 2.0 ** (s - self._visit[layer] / self.half_life))
        if self.recency and key in self._last_keys[layer]:  # picked at the layer's latest visit
            p = max(p, self._reuse_rate)
        return p

    def distance(self, layer) -> int:
        """Records until ``layer`` is visited again (1 .. L; L for the layer visited last)."""
        n = len(self._layers)
        if self._current is None or layer not in self._visit:
            return n
        d = (bisect_left(self._layers, layer) - bisect_left(self._layers, self._current)) % n
        return d or n

    def expected_next_use(self, key: Key) -> float:
        """Records until the next expected use of ``key`` (inf for a never-seen key)."""
        p = self.probability(key)
        if p <= 0.0:
            return math.inf
        return self.distance(self._layer_of(key)) + (1.0 / p - 1.0) * len(self._layers)

    def admit(self, key: Key, victim: Key, now: int | float = 0) -> bool:
        """Admission control (caches that may decline to cache, see ``simulate(bypass=True)``):
        cache the missed ``key`` only if its next use is expected before ``victim``'s. Counts
        this use of ``key`` either way."""
        self._use(key)
        return self.expected_next_use(key) < self.expected_next_use(victim)

    def _candidate(self, layer, resident, protected):
        """The least likely evictable key of ``layer`` (lazy heap), or None."""
        heap = self._heaps[layer]
        recent = self._last_keys[layer] if self.recency else ()
        if heap:  # fast path: the top is valid
            s, seq, key = heap[0]
            if (key in self._tracked and self._version.get(key) == seq and key not in protected
                    and key in resident and key not in recent):
                best = key
            else:
                best = None
        else:
            best = None
        if best is None:
            best = _first_eligible(heap, lambda e: e[2],
                                   lambda e: e[2] not in self._tracked or self._version.get(e[2]) != e[1],
                                   _Either(protected, recent) if recent else protected, resident)
        if recent:  # the layer's latest picks rank by max(estimate, reuse rate): look at each
            r_best = self.rank_in_layer(best) if best is not None else None
            for key in recent:
                if key in self._tracked and key not in protected and key in resident:
                    r = self.rank_in_layer(key)
                    if r_best is None or r < r_best:
                        best, r_best = key, r
        return best

    def rank_in_layer(self, key: Key) -> tuple[float, float, int]:
        """A tracked key's order among its layer's candidates, least likely first: (probability,
        score S, seq of its last push). The heap orders the layer's keys outside its latest picks
        by (S, seq), the same order (the probability grows with S); the seq breaks exact ties:
        the key used least recently goes first. One order, so a device copy of this policy
        (engine.experts.device_policy) makes the same choices."""
        return self.probability(key), self._score[key], self._version[key]

    def _pick(self, resident: Collection[Key], protected: Collection[Key], now):
        # Other layers' keys: on a regular sweep the absolute record index of a layer's next
        # visit and its keys' probabilities stand still until the layer is visited again, so
        # each layer's best victim sits on one lazy max-heap keyed by its absolute expected next
        # use, pushed when the layer's visit ends (and again after its victim is taken); the
        # layer being visited is looked at directly. O(log L) per eviction.
        if self._rebuild:
            self._rebuild = False
            self._vheap = []
            for layer in self._layers:
                key = self._candidate(layer, resident, protected) if layer != self._current else None
                if key is not None:
                    self._push_layer(layer, key)
        heap, best, best_t = self._vheap, None, -math.inf
        while heap:
            neg_t, layer, key, seq, v = heap[0]
            if layer == self._current or v != self._visit[layer]:
                heapq.heappop(heap)  # pushed again when the layer's visit ends
                continue
            if (key in self._tracked and self._version.get(key) == seq and key not in protected
                    and key in resident):
                best, best_t = key, -neg_t
                break
            heapq.heappop(heap)  # evicted, or protected now: the layer's next candidate
            key = self._candidate(layer, resident, protected)
            if key is not None:
                self._push_layer(layer, key)
        if self._current is not None:  # ties between layers go to the lower layer
            key = self._candidate(self._current, resident, protected)
            if key is not None:
                t = self._absolute_next_use(key)
                if t > best_t or (t == best_t and self._current < self._layer_of(best)):
                    best = key
        if best is None:  # slow path: a layer whose candidates were all protected when looked at
            for layer in self._layers:
                key = self._candidate(layer, resident, protected)
                if key is not None and self._absolute_next_use(key) > best_t:
                    best, best_t = key, self._absolute_next_use(key)
        return best

    def victim_rank(self, key: Key) -> tuple:
        """The total order victims are chosen in, smallest first: the farthest absolute expected
        next use, then the lower layer, then :meth:`rank_in_layer`. Exact ties of the estimate are
        common (keys used at the same visits, the latest picks at the reuse rate), so the order
        is spelled out rather than left to heap and set iteration order."""
        return (-self._absolute_next_use(key), self._layer_of(key)) + self.rank_in_layer(key)

    def reference_victim(self, resident: Collection[Key], protected: Collection[Key] = frozenset()) -> Key | None:
        """The rule by brute force (the reference of :meth:`victim`): the tracked, resident,
        unprotected key first in :meth:`victim_rank`."""
        keys = [k for k in self._tracked if k not in protected and k in resident]
        return min(keys, key=self.victim_rank) if keys else None

    def _absolute_next_use(self, key: Key) -> float:
        """Records from the start of the stream to the next expected use of ``key``: the layer's
        next visit (an integer, the same whenever it is computed during a regular sweep) plus the
        expected extra sweeps, added in one rounding."""
        p = self.probability(key)
        if p <= 0.0:
            return math.inf
        return (self._visits_started + self.distance(self._layer_of(key))) + (1.0 / p - 1.0) * len(self._layers)

    def _push_layer(self, layer, key: Key) -> None:
        heapq.heappush(self._vheap, (-self._absolute_next_use(key), layer, key, self._version[key],
                                     self._visit[layer]))
        if len(self._vheap) > 4 * len(self._layers) + 64:
            keep = {}
            for e in self._vheap:  # the newest entry of each layer
                if e[1] not in keep or e[3] > keep[e[1]][3]:
                    keep[e[1]] = e
            self._vheap = list(keep.values())
            heapq.heapify(self._vheap)
