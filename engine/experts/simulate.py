"""Trace-replay simulator for the expert cache.

Replays a :class:`RoutingTrace`'s access stream against a cache of ``capacity`` expert slots
and counts hits and misses exactly. The cache model is the live cache's:

- a record (one token's top-k experts in one layer) is one ``ensure(layer, ids)``: all of its
  experts are *protected* from eviction while its misses are filled (a hit later in the record
  is never evicted by a miss earlier in it); accesses are still replayed in routing order.
  ``whole_record=False`` is the classic flat paging model instead: access by access, only the
  record's already-used experts protected. The two differ only when a miss would evict a
  resident expert that the same record uses later. On a pure cyclic sweep of W = L * K keys,
  flat LRU gets 0 hits for every capacity < W; whole-record LRU gets 0 hits for capacity
  <= W - K and some hits between (its victims skip the record's own resident experts).
  A pool with fewer free slots than a record needs raises :class:`CacheCapacityError`;
- a miss inserts the expert, evicting the policy's victim if the pool is full;
- pinned experts are loaded before the first access (no miss is charged for them), count
  against capacity and are never evicted;
- ``bypass=True`` lets a policy decline to cache a miss: when the pool is full the policy's
  ``admit(key, victim, now)`` (policies without one always admit) decides whether the missed
  expert takes the victim's slot or is used once from a staging buffer and dropped (counted as a
  miss, ``SimResult.bypassed``). The bound for such a run is Belady with bypass (cache a miss
  only if it is used again before the farthest resident key), which is >= plain Belady;
- ``per_layer=True`` splits capacity into one pool per layer (layer l gets
  ``capacity // L`` slots, plus one for the first ``capacity % L`` layers), each with its
  own policy instance; otherwise one global pool.

``now`` passed to the policies is the index of the access in the flat stream.

Online policies see the past only: the replay tells a policy about an access when it happens
(``on_hit``/``on_insert``/``admit`` at that access) and never hands it the trace; only
``belady`` is built with the future stream. :class:`SweepTable` prints every policy's hit rate
as a ratio to the bound of its run (Belady, or Belady with bypass).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from engine.errors import CacheCapacityError
from engine.experts.policy import (
    EvictionPolicy,
    Key,
    PinnedPolicy,
    make_policy,
    next_use_indices,
    top_keys,
)
from engine.experts.trace import RoutingTrace

__all__ = ["SimResult", "SweepTable", "simulate", "sweep", "budgets_from_fractions", "layer_capacities",
           "frequency_oracle"]


@dataclass
class SimResult:
    policy: str
    capacity: int
    per_layer: bool
    num_keys: int  # num_layers * num_experts
    accesses: int
    hits: int
    misses: int
    compulsory_misses: int  # first touches of experts that were not pinned
    tokens: int
    bytes_missed: int
    pinned: int  # number of pinned experts
    evictions: int
    layer_hits: np.ndarray  # [num_layers]
    layer_accesses: np.ndarray  # [num_layers]
    evicted: list[Key] | None = field(default=None, repr=False)  # only with record_evictions
    bypass: bool = False  # admission control was allowed (see simulate)
    bypassed: int = 0  # misses served without caching

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else float("nan")

    @property
    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else float("nan")

    @property
    def budget_fraction(self) -> float:
        return self.capacity / self.num_keys

    @property
    def bytes_missed_per_token(self) -> float:
        return self.bytes_missed / self.tokens if self.tokens else float("nan")

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else float("nan")

    @property
    def per_layer_hit_rate(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.layer_accesses > 0, self.layer_hits / np.maximum(self.layer_accesses, 1), np.nan)

    def as_dict(self) -> dict:
        return {
            "policy": self.policy,
            "capacity": self.capacity,
            "budget_fraction": self.budget_fraction,
            "per_layer": self.per_layer,
            "accesses": self.accesses,
            "hits": self.hits,
            "misses": self.misses,
            "compulsory_misses": self.compulsory_misses,
            "hit_rate": self.hit_rate,
            "tokens": self.tokens,
            "bytes_missed": self.bytes_missed,
            "bytes_missed_per_token": self.bytes_missed_per_token,
            "pinned": self.pinned,
            "evictions": self.evictions,
            "bypass": self.bypass,
            "bypassed": self.bypassed,
            "per_layer_hit_rate": self.per_layer_hit_rate.tolist(),
        }


def layer_capacities(capacity: int, num_layers: int) -> list[int]:
    """Even split of ``capacity`` slots over layers; the first ``capacity % L`` get one more."""
    q, r = divmod(capacity, num_layers)
    return [q + (1 if l < r else 0) for l in range(num_layers)]


def _bytes_fn(expert_bytes: int | Mapping, trace: RoutingTrace) -> Callable[[Key], int]:
    if isinstance(expert_bytes, Mapping):
        def f(key: Key) -> int:
            if key in expert_bytes:
                return int(expert_bytes[key])
            if key[0] in expert_bytes:  # per-layer sizes
                return int(expert_bytes[key[0]])
            raise ValueError(f"expert_bytes has no size for layer {key[0]} expert {key[1]}")
        return f
    if isinstance(expert_bytes, bool) or int(expert_bytes) != expert_bytes or expert_bytes < 0:
        raise ValueError(f"expert_bytes must be a non-negative int or a mapping, got {expert_bytes!r}")
    size = int(expert_bytes)
    return lambda key: size


def simulate(
    trace: RoutingTrace,
    policy_name: str | Callable[[], EvictionPolicy],
    capacity: int,
    *,
    per_layer: bool = False,
    pinned: Iterable[Key] = (),
    expert_bytes: int | Mapping = 1,
    pin_fraction: float = 0.5,
    half_life: float | None = None,
    whole_record: bool = True,
    record_evictions: bool = False,
    bypass: bool = False,
) -> SimResult:
    """Replay ``trace`` through a cache of ``capacity`` expert slots.

    ``policy_name``: ``lru``, ``lfu`` (aging, ``half_life`` in accesses; default 32 tokens'
    worth, ``32 * num_layers * top_k``), ``lfu-pure``, ``belady``; or a zero-argument factory
    returning an :class:`EvictionPolicy`. A ``pinned+`` prefix pins experts: ``pinned`` if
    given, else the ``int(pin_fraction * capacity)`` most frequent experts of this trace (per
    layer: of each layer's share; never more than leaves ``top_k`` free slots), an optimistic
    offline profile. A non-empty ``pinned`` pins
    with any policy.

    ``expert_bytes``: size of one expert, or a mapping ``(layer, expert) -> bytes`` or
    ``layer -> bytes``; only misses are charged. ``whole_record``: see the module docstring.
    ``record_evictions`` keeps the evicted keys in order in ``SimResult.evicted``. ``bypass``:
    admission control, see the module docstring.
    """
    L, E = trace.num_layers, trace.num_experts
    if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 1:
        raise ValueError(f"capacity must be a positive number of expert slots, got {capacity!r}")
    capacity = int(capacity)
    caps = layer_capacities(capacity, L) if per_layer else [capacity]
    nbytes = _bytes_fn(expert_bytes, trace)

    keys = trace.access_list()
    pinned = set(pinned)
    for k in pinned:
        if not (isinstance(k, tuple) and len(k) == 2 and 0 <= k[0] < L and 0 <= k[1] < E):
            raise ValueError(f"pinned key {k!r} is not a (layer, expert) with layer < {L}, expert < {E}")
    if callable(policy_name):
        factory = policy_name
        label = None
    else:
        name = policy_name
        if name.startswith("pinned+") and not pinned:
            if per_layer:
                for l in range(L):
                    n = max(0, min(int(pin_fraction * caps[l]), caps[l] - trace.top_k))
                    pinned |= {k for k in top_keys(_layer_stream(keys, l), n)}
            else:
                pinned = top_keys(keys, max(0, min(int(pin_fraction * capacity), capacity - trace.top_k)))
        base = name[len("pinned+"):] if name.startswith("pinned+") else name
        hl = half_life if half_life is not None else 32.0 * L * trace.top_k
        nu = next_use_indices(keys) if base == "belady" else None
        factory = lambda: make_policy(base, future=keys, next_use=nu, half_life=hl,  # noqa: E731
                                      num_experts=E, top_k=trace.top_k)
        label = name
    pools = len(caps)
    policies: list[EvictionPolicy] = []
    for p in range(pools):
        pol = factory()
        pool_pins = {k for k in pinned if per_layer is False or k[0] == p}
        if pool_pins:
            if not isinstance(pol, PinnedPolicy):
                pol = PinnedPolicy(pol, pool_pins)
        policies.append(pol)
    if label is None:
        label = policies[0].name
    elif pinned and not label.startswith("pinned+"):
        label = f"pinned+{label}"

    # residents per pool; pinned experts preloaded
    resident: list[set[Key]] = [set() for _ in range(pools)]
    for k in pinned:
        resident[k[0] if per_layer else 0].add(k)
    for p in range(pools):
        if len(resident[p]) > caps[p]:
            where = f"layer {p}" if per_layer else "the cache"
            raise CacheCapacityError(
                f"{len(resident[p])} pinned experts do not fit in {where}'s {caps[p]} slots"
            )

    layers = trace.layer.tolist()
    K = trace.top_k
    hits = misses = evictions = bypassed = 0
    bytes_missed = 0
    seen: set[Key] = set(pinned)
    compulsory = 0
    layer_hits = [0] * L
    evicted: list[Key] | None = [] if record_evictions else None
    now = 0
    for r, l in enumerate(layers):
        p = l if per_layer else 0
        res = resident[p]
        pol = policies[p]
        cap = caps[p]
        base_i = r * K
        rec = keys[base_i : base_i + K]
        # whole_record: ensure(layer, ids) holds the whole record, so its hits stay put;
        # otherwise only the record's already-used experts are held (flat paging model).
        protected = set(rec) if whole_record else set()
        h0 = hits
        for key in rec:
            if key in res:
                hits += 1
                pol.on_hit(key, now)
            else:
                misses += 1
                bytes_missed += nbytes(key)
                if key not in seen:
                    seen.add(key)
                    compulsory += 1
                if len(res) >= cap:
                    v = pol.victim(res, protected, now)
                    if v is None:
                        where = f"layer {l}'s pool" if per_layer else "the cache"
                        raise CacheCapacityError(
                            f"{where} has {cap} slots, all protected (pinned or in use by the "
                            f"current step: token {trace.token_index[r]}, layer {l}, needs "
                            f"{K} experts); raise capacity or pin fewer experts"
                        )
                    admit = getattr(pol, "admit", None) if bypass else None
                    if admit is not None and not admit(key, v, now):
                        bypassed += 1
                        if not whole_record:
                            protected.add(key)
                        now += 1
                        continue
                    res.discard(v)
                    pol.on_remove(v)
                    evictions += 1
                    if evicted is not None:
                        evicted.append(v)
                res.add(key)
                pol.on_insert(key, now)
            if not whole_record:
                protected.add(key)
            now += 1
        layer_hits[l] += hits - h0

    layer_acc = np.bincount(np.asarray(layers, np.int64), minlength=L) * K
    return SimResult(
        policy=label,
        capacity=capacity,
        per_layer=per_layer,
        num_keys=L * E,
        accesses=len(keys),
        hits=hits,
        misses=misses,
        compulsory_misses=compulsory,
        tokens=trace.num_tokens,
        bytes_missed=bytes_missed,
        pinned=len(pinned),
        evictions=evictions,
        layer_hits=np.asarray(layer_hits, np.int64),
        layer_accesses=layer_acc.astype(np.int64),
        evicted=evicted,
        bypass=bypass,
        bypassed=bypassed,
    )


def in_acquire_order(trace: RoutingTrace) -> RoutingTrace:
    """``trace`` with each record's experts in ascending order: the order in which the MoE layer
    asks the live cache for them (it acquires a layer's distinct routed experts sorted), so
    ``simulate(in_acquire_order(trace), ...)`` replays the access stream the live cache sees.
    Without admission control the order within a record hardly matters (the whole record is
    protected while its misses are filled); with ``bypass=True`` it does: each miss is weighed
    against the victim of that moment."""
    return replace(trace, experts=np.sort(trace.experts, axis=1))


def _layer_stream(keys: Sequence[Key], layer: int) -> list[Key]:
    return [k for k in keys if k[0] == layer]


def budgets_from_fractions(
    trace: RoutingTrace, fractions: Sequence[float], *, per_layer: bool = False
) -> list[int]:
    """Capacities (expert slots) for fractions of all ``num_layers * num_experts`` experts,
    rounded, and at least ``top_k`` so one record fits (``per_layer``: at least ``top_k`` per
    layer, ``top_k * num_layers``; the budget fraction of such a result is then larger)."""
    floor = trace.top_k * (trace.num_layers if per_layer else 1)
    out = []
    for f in fractions:
        if not (0.0 < f <= 1.0):
            raise ValueError(f"budget fraction must be in (0, 1], got {f!r}")
        out.append(max(floor, int(round(f * trace.num_keys))))
    return out


@dataclass
class SweepTable:
    """Results of :func:`sweep`: one :class:`SimResult` per (policy, budget), and per budget
    the bound each policy is judged against (Belady; Belady with bypass for a bypass run)."""

    results: list[SimResult]
    bounds: dict[int, SimResult] = field(default_factory=dict)  # capacity -> Belady's result

    @property
    def policies(self) -> list[str]:
        return list(dict.fromkeys(r.policy for r in self.results))

    @property
    def capacities(self) -> list[int]:
        return sorted({r.capacity for r in self.results})

    def get(self, policy: str, capacity: int) -> SimResult:
        for r in self.results:
            if r.policy == policy and r.capacity == capacity:
                return r
        raise KeyError(f"no result for policy {policy!r} at capacity {capacity}")

    def hit_rate(self, policy: str, capacity: int) -> float:
        return self.get(policy, capacity).hit_rate

    def ratio(self, policy: str, capacity: int) -> float:
        """Hit rate of ``policy`` over its bound's at ``capacity`` (NaN without a bound, or when
        the bound has no hits)."""
        bound = self.bounds.get(capacity)
        if bound is None or not bound.hits:
            return float("nan")
        return self.get(policy, capacity).hit_rate / bound.hit_rate

    def rows(self) -> list[dict]:
        out = []
        for r in self.results:
            d = r.as_dict()
            d["ratio_to_bound"] = self.ratio(r.policy, r.capacity)
            out.append(d)
        return out

    def format(self) -> str:
        """Hit-rate table: one row per budget, one column per policy; each cell is the hit rate
        and, after it, the ratio to the bound (Belady, or Belady with bypass)."""
        pols = self.policies
        bypass = any(r.bypass for r in self.results)
        head = f"{'slots':>7} {'budget':>7} " + " ".join(f"{p:>14}" for p in pols)
        head += f"   (hit rate, ratio to {'Belady with bypass' if bypass else 'Belady'})"
        lines = [head, "-" * len(head)]
        for c in self.capacities:
            frac = c / self.results[0].num_keys
            cells = []
            for p in pols:
                try:
                    r = self.get(p, c)
                    ratio = self.ratio(p, c)
                    cells.append(f"{100 * r.hit_rate:6.1f}% {ratio:6.2f}" if ratio == ratio
                                 else f"{100 * r.hit_rate:13.1f}%")
                except KeyError:
                    cells.append(f"{'-':>14}")
            lines.append(f"{c:>7} {100 * frac:6.1f}% " + " ".join(cells))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def sweep(
    trace: RoutingTrace,
    policies: Sequence[str],
    budgets: Sequence[int],
    **kwargs,
) -> SweepTable:
    """:func:`simulate` for every policy and capacity in ``budgets`` (expert slots; see
    :func:`budgets_from_fractions`). ``kwargs`` go to :func:`simulate`. Belady (with bypass
    when ``bypass=True``) is run at every capacity as the bound, listed or not."""
    results, bounds = [], {}
    for cap in budgets:
        for pol in policies:
            r = simulate(trace, pol, cap, **kwargs)
            results.append(r)
            if pol == "belady":
                bounds[cap] = r
        if cap not in bounds:
            bounds[cap] = simulate(trace, "belady", cap, **kwargs)
    return SweepTable(results, bounds)


def frequency_oracle(trace: RoutingTrace, capacity: int) -> float:
    """Hit rate of a static cache holding the ``capacity`` keys the whole trace uses most (it
    knows the trace's counts, not their order; first uses count as hits). A yardstick for
    online policies on real traces, whose generating model is unknown: a policy that only
    learns how often experts are picked cannot expect more when routing is stationary. Not a
    strict bound: a policy can beat it by following drift and token-to-token reuse."""
    counts = np.unique(trace.layer.astype(np.int64)[:, None] * trace.num_experts + trace.experts,
                       return_counts=True)[1]
    top = np.sort(counts)[::-1][:max(capacity, 0)]
    return float(top.sum() / trace.num_accesses) if trace.num_accesses else 0.0
