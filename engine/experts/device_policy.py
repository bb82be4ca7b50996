"""The expert cache's bookkeeping on the device: slot lookup, eviction policy and miss list in one
Triton launch per sparse layer, with no host round trip.

The host cache (engine.experts.cache.ExpertCache over engine.experts.slots.SlotTable and an
eviction policy) is the reference: on the same sequence of acquires this state makes the same
decisions, hit for hit, victim for victim, slot for slot (tests/engine/experts/test_device_policy.py
replays the demo model's decode trace and synthetic traces through both). What it keeps, all
device tensors:

    slot_map [layers, E] int32   slot of (layer, expert), -1 when not resident (the cache's own
                                 map, read by the grouped expert kernels)
    slot_key [S] int32           key (sparse layer index * E + expert) in each slot, -1 free
    free     [S] int32           free slots as a stack: the host table pops slot 0 first
    mark     [keys] int64        the acquire (epoch) that last named a key: pinned while it is the
                                 running one (the previous one too, for a prefetch)
    lru:   stamp [keys]          the order of uses (the host LRU's ordered dict)
    sweep: score, used_at, seq, last, prev, tracked, version [keys]; visit, seen [layers];
           scalars: current layer, visits started, reuse counts, reuse rate
           (engine.experts.policy_sweep.SweepPolicy's state, one entry per key)

One launch (:meth:`DevicePolicy.assign`) takes a layer's routed ids [N] (any order, repeats
allowed: the distinct ones are processed in ascending order, as the engine's acquires name
them), pins them, counts hits, and for each miss takes a free slot or evicts the policy's
victim; it writes the slot map and a miss list (slot, key) that the copy kernel
(engine.experts.device_cache) reads. Victims follow the host policy's total order: LRU the least
recent use; sweep :meth:`SweepPolicy.victim_rank` (farthest absolute expected next use, lower
layer, probability, score, seq), computed in float64 by the same formulas. When a miss is the
first key of a visit and no slot is free, the host picks its victim before the visit starts
(reserve before on_insert); so does this kernel.

A prefetch launch (``prefetch=True``) names a later layer's predicted experts: resident ones
are left alone (no use is counted), missing ones take slots as a demand miss would, protecting
the current acquire's keys and the predicted ones; when nothing is evictable the rest are
skipped (the host breaks out of its prefetch loop the same way).

An acquire whose misses find every slot pinned cannot be served: the kernel counts it in
``state[ERRORS]`` and leaves those experts unassigned; callers size the pool so that a step's
distinct experts always fit (``DeviceExpertCache`` refuses a bucket otherwise) and check the
count where they read the device anyway.
"""

import math

import torch

from engine.errors import ConfigError
from engine.quant import triton_kernels as TK

triton, tl, constexpr = TK.triton, TK.tl, TK.constexpr

# int64 scalars of DevicePolicy.state (host indices; the kernels read the constexpr copies below:
# a Triton kernel may only read globals that are constexpr)
SCALARS = ("clock", "cur", "visits", "reuse0", "reuse1", "nseen", "seq", "free_n", "stamp", "miss_n",
           "errors", "prefetched")
CLOCK, CUR, VISITS, REUSE0, REUSE1, NSEEN, SEQ, FREE_N, STAMP, MISS_N, ERRORS, PREFETCHED = range(len(SCALARS))
(_CLOCK, _CUR, _VISITS, _REUSE0, _REUSE1, _NSEEN, _SEQ, _FREE_N, _STAMP, _MISS_N, _ERRORS,
 _PREFETCHED) = (constexpr(i) for i in range(len(SCALARS)))
# float64 scalars of DevicePolicy.fstate: reuse rate, half-life, alpha (float64 in a tensor: a
# Python float argument would reach the kernel as float32)
RATE, HALF, ALPHA = range(3)
_RATE, _HALF, _ALPHA = (constexpr(i) for i in range(3))
POLICIES = {"lru": 0, "sweep": 1}
BLOCK_N = 64
MAX_SLOTS = 1 << 16  # one block holds the pool's rank terms


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _eligible(offs, S, slot_key, tracked, mark, protect_from):
    """Per slot of ``offs``: (whether it may be evicted: it holds a tracked key that no running
    launch pins, the key or 0 where the slot is free)."""
    om = offs < S
    k = tl.load(slot_key + offs, mask=om, other=-1)
    ks = tl.where(k >= 0, k, 0)
    elig = om & (k >= 0) & (tl.load(tracked + ks, mask=om, other=0) != 0) & \
        (tl.load(mark + ks, mask=om, other=0) < protect_from)
    return elig, ks


def _terms(offs, S, E, slot_key, tracked, mark, score, seq_a, last, visit, lrank, stamp,
           protect_from, cur, nseen, vs, rate, half, alpha, POLICY: constexpr, RECENCY: constexpr):
    """Per slot of ``offs``: eligible (:func:`_eligible`), then the rank terms: LRU (stamp);
    sweep (-absolute next use, layer, probability, score, seq)."""
    om = offs < S
    elig, ks = _eligible(offs, S, slot_key, tracked, mark, protect_from)
    li = ks // E
    if POLICY == 0:
        q = tl.load(stamp + ks, mask=om, other=0)
        a = q.to(tl.float64)
        p = a
        sc = a
    else:
        sc = tl.load(score + ks, mask=om, other=float("-inf"))
        vis = tl.load(visit + li, mask=om, other=0)
        p = alpha * tl.exp2(sc - vis.to(tl.float64) / half)
        p = tl.minimum(p, 1.0)
        if RECENCY:
            lk = tl.load(last + ks, mask=om, other=0)
            p = tl.where(lk != 0, tl.maximum(p, rate), p)
        lr = tl.load(lrank + li, mask=om, other=0)
        lc = tl.load(lrank + tl.maximum(cur, 0))
        d = ((lr - lc) % nseen + nseen) % nseen
        d = tl.where(d == 0, nseen, d)
        d = tl.where(cur < 0, nseen, d)
        t = (vs + d).to(tl.float64) + (1.0 / tl.where(p > 0.0, p, 1.0) - 1.0) * nseen.to(tl.float64)
        t = tl.where(p <= 0.0, float("inf"), t)
        a = -t
        q = tl.load(seq_a + ks, mask=om, other=0)
    return elig, a, li, p, sc, q


def _slot_terms(S, E, slot_key, tracked, mark, score, seq_a, last, visit, lrank, stamp, st, fst,
                protect_from, POLICY: constexpr, RECENCY: constexpr, BLOCK_S: constexpr):
    """The rank terms of every slot (one block holds the whole pool), from the current state."""
    offs = tl.arange(0, BLOCK_S)
    cur = tl.load(st + _CUR)
    nseen = tl.maximum(tl.load(st + _NSEEN), 1)
    el, a, b, c, d, q = _terms(offs, S, E, slot_key, tracked, mark, score, seq_a, last, visit, lrank, stamp,
                               protect_from, cur, nseen, tl.load(st + _VISITS), tl.load(fst + _RATE),
                               tl.load(fst + _HALF), tl.load(fst + _ALPHA), POLICY, RECENCY)
    return offs, el, a, b, c, d, q


def _victim(offs, el, a, b, c, d, q, S):
    """The slot first in the rank order (lexicographic minimum of the terms, one reduction per
    term) among eligible slots, or -1 when none is eligible."""
    inf = float("inf")
    big = 1 << 62
    m1 = tl.min(tl.where(el, a, inf))
    found = -1
    if m1 < inf:
        k1 = el & (a == m1)
        m2 = tl.min(tl.where(k1, b, big))
        k2 = k1 & (b == m2)
        m3 = tl.min(tl.where(k2, c, inf))
        k3 = k2 & (c == m3)
        m4 = tl.min(tl.where(k3, d, inf))
        k4 = k3 & (d == m4)
        m5 = tl.min(tl.where(k4, q, big))
        found = tl.min(tl.where(k4 & (q == m5), offs, S))
    return found


def _layer_ranks(seen, lrank, L, BLOCK_L: constexpr):
    """lrank[l] = seen layers before l (the position of l in the sweep order)."""
    lo = tl.arange(0, BLOCK_L)
    lm = lo < L
    sv = tl.load(seen + lo, mask=lm, other=0).to(tl.int64)
    tl.store(lrank + lo, tl.cumsum(sv, axis=0) - sv, mask=lm)


def _assign_kernel(ids, n_ids, layer, li, slot_map, layers, slot_key, free, st, fst,
                   stamp, score, used_at, seq_a, last, prev, tracked, version, mark, visit, seen, lrank,
                   miss_slot, miss_key, hits, misses, E, S, L,
                   POLICY: constexpr, PREFETCH: constexpr, RECENCY: constexpr, PIN: constexpr,
                   BLOCK_E: constexpr, BLOCK_N: constexpr, BLOCK_S: constexpr, BLOCK_L: constexpr):
    e = tl.arange(0, BLOCK_E)
    em = e < E
    want = tl.zeros([BLOCK_E], dtype=tl.int32)
    for n0 in range(0, n_ids, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        got = tl.load(ids + n, mask=n < n_ids, other=-1)
        want = tl.maximum(want, tl.max((got[None, :] == e[:, None]).to(tl.int32), axis=1))
    want = (want != 0) & em
    row = slot_map + layer * E
    slot = tl.load(row + e, mask=em, other=-1)
    hit = want & (slot >= 0)
    miss = want & (slot < 0)
    n_miss = tl.sum(miss.to(tl.int32))
    epoch = tl.load(st + _CLOCK) + 1
    tl.store(st + _CLOCK, epoch)
    if not PIN:  # (tests only: shows that a victim still in use is caught)
        protect_from = epoch * 0 + (1 << 62)
    elif PREFETCH:
        protect_from = epoch - 1  # the acquire of the running layer, then this prediction
    else:
        protect_from = epoch
    if not PREFETCH:
        tl.store(hits + li, tl.load(hits + li) + tl.sum(hit.to(tl.int64)))
        tl.store(misses + li, tl.load(misses + li) + n_miss.to(tl.int64))
    kb = li * E
    tl.store(mark + kb + e, epoch, mask=want)
    free_n = tl.load(st + _FREE_N)
    tl.debug_barrier()
    if PREFETCH:  # the misses that can take a slot: free ones, then evictable ones; the rest skipped
        ok, _ = _eligible(tl.arange(0, BLOCK_S), S, slot_key, tracked, mark, protect_from)
        room = free_n + tl.sum(ok.to(tl.int64))
        before = tl.cumsum(miss.to(tl.int64), axis=0)  # misses up to and including each expert
        miss = miss & (before <= room)
        n_miss = tl.sum(miss.to(tl.int32))
        used = miss
    else:
        used = want
    n_used = tl.sum(used.to(tl.int32))
    first = tl.min(tl.where(used, e, BLOCK_E))
    first_is_miss = tl.sum((miss & (e == first)).to(tl.int32)) > 0
    v0 = -1
    if POLICY == 1:
        _layer_ranks(seen, lrank, L, BLOCK_L)
        tl.debug_barrier()
        if first_is_miss & (free_n == 0):  # the host picks this victim before the visit starts
            offs, el, a, b, c, d, q = _slot_terms(S, E, slot_key, tracked, mark, score, seq_a, last, visit,
                                                  lrank, stamp, st, fst, protect_from, POLICY, RECENCY, BLOCK_S)
            v0 = _victim(offs, el, a, b, c, d, q, S)
        tl.debug_barrier()
        if n_used > 0:
            _sweep_use(li, kb, e, em, used, st, fst, score, used_at, seq_a, last, prev, tracked, version,
                       visit, seen, lrank, L, BLOCK_L)
    else:
        if n_used > 0:
            base = tl.load(st + _STAMP)
            order = tl.cumsum(used.to(tl.int64), axis=0)
            tl.store(stamp + kb + e, base + order, mask=used)
            tl.store(tracked + kb + e, 1, mask=used)
            tl.store(st + _STAMP, base + n_used.to(tl.int64))
    tl.debug_barrier()
    # the order victims are taken in is fixed from here on (the keys this launch uses are pinned)
    offs, el, a, b, c, d, q = _slot_terms(S, E, slot_key, tracked, mark, score, seq_a, last, visit, lrank,
                                          stamp, st, fst, protect_from, POLICY, RECENCY, BLOCK_S)
    el = el & (offs != v0)
    after = -1
    for j in range(0, n_miss):
        ej = tl.min(tl.where(miss & (e > after), e, BLOCK_E))
        after = ej
        s = -1
        if free_n > 0:
            s = tl.load(free + free_n - 1)
            free_n -= 1
        else:
            if (j == 0) & (v0 >= 0):
                s = v0
            else:
                s = _victim(offs, el, a, b, c, d, q, S)
            el = el & (offs != s)
            if s >= 0:
                vk = tl.load(slot_key + s)
                tl.store(slot_map + tl.load(layers + vk // E) * E + vk % E, -1)
                tl.store(tracked + vk, 0)
                tl.store(version + vk, 0)
        if s >= 0:
            tl.store(slot_key + s, kb + ej)
            tl.store(row + ej, s)
        else:
            tl.store(st + _ERRORS, tl.load(st + _ERRORS) + 1)
        tl.store(miss_slot + j, s)
        tl.store(miss_key + j, kb + ej)
        tl.debug_barrier()
    tl.store(st + _FREE_N, free_n)
    tl.store(st + _MISS_N, n_miss.to(tl.int64))
    if PREFETCH:
        tl.store(st + _PREFETCHED, tl.load(st + _PREFETCHED) + n_miss.to(tl.int64))


def _sweep_use(li, kb, e, em, used, st, fst, score, used_at, seq_a, last, prev, tracked, version,
               visit, seen, lrank, L, BLOCK_L: constexpr):
    """SweepPolicy._use for every used key of layer ``li`` (in expert order): the visit starts
    first (when the layer changes), then each key's score, seq and recency are updated."""
    if tl.load(seen + li) == 0:
        tl.store(seen + li, 1)
        tl.store(st + _NSEEN, tl.load(st + _NSEEN) + 1)
        tl.store(visit + li, 0)
    cur = tl.load(st + _CUR)
    if cur != li:
        tl.store(visit + li, tl.load(visit + li) + 1)
        vs = tl.load(st + _VISITS) + 1
        tl.store(st + _VISITS, vs)
        tl.store(st + _CUR, li)
        pv = tl.load(prev + kb + e, mask=em, other=0)
        lv = tl.load(last + kb + e, mask=em, other=0)
        if (tl.sum(pv.to(tl.int32)) > 0) & (tl.sum(lv.to(tl.int32)) > 0):
            tl.store(st + _REUSE0, tl.load(st + _REUSE0) + tl.sum(((pv != 0) & (lv != 0)).to(tl.int64)))
            tl.store(st + _REUSE1, tl.load(st + _REUSE1) + tl.sum((lv != 0).to(tl.int64)))
        tl.store(prev + kb + e, lv, mask=em)
        tl.store(last + kb + e, tl.zeros_like(lv), mask=em)
        r1 = tl.load(st + _REUSE1)
        if (vs % tl.load(st + _NSEEN) == 0) & (r1 > 0):
            tl.store(fst + _RATE, tl.load(st + _REUSE0).to(tl.float64) / r1.to(tl.float64))
    tl.debug_barrier()
    _layer_ranks(seen, lrank, L, BLOCK_L)
    v = tl.load(visit + li)
    half = tl.load(fst + _HALF)
    ua = tl.load(used_at + kb + e, mask=em, other=-1)
    ver = tl.load(version + kb + e, mask=em, other=0)
    push = used & ((ua != v) | (ver == 0))
    fresh = used & (ua != v)
    x = v.to(tl.float64) / half
    old = tl.load(score + kb + e, mask=em, other=float("-inf"))
    hi = tl.maximum(old, x)
    lo = tl.minimum(old, x)
    new = tl.where(old == float("-inf"), x, hi + tl.log2(1.0 + tl.exp2(lo - hi)))
    tl.store(score + kb + e, new, mask=fresh)
    tl.store(used_at + kb + e, tl.zeros_like(ua) + v, mask=fresh)
    base = tl.load(st + _SEQ)
    order = tl.cumsum(push.to(tl.int64), axis=0)
    tl.store(seq_a + kb + e, base + order, mask=push)
    tl.store(st + _SEQ, base + tl.sum(push.to(tl.int64)))
    tl.store(version + kb + e, tl.zeros_like(ver) + 1, mask=push)
    tl.store(tracked + kb + e, tl.zeros_like(ver) + 1, mask=used)
    tl.store(last + kb + e, tl.zeros_like(ver) + 1, mask=used)


_jitted: dict = {}


def _kernel():
    k = _jitted.get("assign")
    if k is None:
        for name in ("_eligible", "_terms", "_slot_terms", "_victim", "_layer_ranks", "_sweep_use"):
            globals()[name] = triton.jit(globals()[name])
        k = _jitted["assign"] = triton.jit(_assign_kernel)
    return k


class DevicePolicy:
    """The device copy of one cache's slot table and eviction policy (module docstring).

    ``slot_map``: the cache's [layers, E] int32 map (shared, written here); ``sparse_layers``:
    the layers with routed experts, in order; ``num_slots``: cache slots (staging slots of
    admission control are a host-only mechanism and are not modelled)."""

    def __init__(self, policy: str, *, sparse_layers: list[int], num_experts: int, top_k: int,
                 num_slots: int, slot_map: torch.Tensor, recency: bool = True) -> None:
        from engine.experts.policy_sweep import half_life_for

        if policy not in POLICIES:
            raise ConfigError(f"the device cache runs the policies {', '.join(POLICIES)}; got {policy!r}")
        if policy == "sweep" and len(sparse_layers) < 2:
            raise ConfigError("the device sweep policy needs at least two sparse layers (a one-layer "
                              "sweep starts its visits at repeated keys, which the device does not model)")
        if num_slots > MAX_SLOTS:
            raise ConfigError(f"the device cache ranks at most {MAX_SLOTS} slots in one block, got {num_slots}")
        if triton is None:
            raise ConfigError(f"the device cache needs Triton: {TK.why_not(slot_map.device)}")
        self.policy, self.recency = policy, recency
        self.device = slot_map.device
        self.sparse_layers = list(sparse_layers)
        self.index = {l: i for i, l in enumerate(self.sparse_layers)}
        self.num_experts, self.num_slots = num_experts, num_slots
        self.slot_map = slot_map
        n_keys = len(self.sparse_layers) * num_experts
        dev = self.device

        def z(n, dtype, fill=0):
            return torch.full((n,), fill, dtype=dtype, device=dev)

        self.layers = torch.tensor(self.sparse_layers, dtype=torch.int64, device=dev)
        self.slot_key = z(num_slots, torch.int32, -1)
        self.free = torch.arange(num_slots - 1, -1, -1, dtype=torch.int32, device=dev)
        self.state = z(len(SCALARS), torch.int64)
        self.state[CUR] = -1
        self.state[FREE_N] = num_slots
        half = half_life_for(num_experts, top_k)
        self.fstate = torch.tensor([0.5, half, 1.0 - 2.0 ** (-1.0 / half)], dtype=torch.float64, device=dev)
        self.stamp = z(n_keys, torch.int64)
        self.score = z(n_keys, torch.float64, -math.inf)  # no score yet
        self.used_at = z(n_keys, torch.int64, -1)
        self.seq = z(n_keys, torch.int64)
        self.last = z(n_keys, torch.int8)
        self.prev = z(n_keys, torch.int8)
        self.tracked = z(n_keys, torch.int8)
        self.version = z(n_keys, torch.int8)
        self.mark = z(n_keys, torch.int64)
        n_layers = len(self.sparse_layers)
        self.visit = z(n_layers, torch.int64)
        self.seen = z(n_layers, torch.int8)
        self.lrank = z(n_layers, torch.int64)
        self.hits = z(n_layers, torch.int64)
        self.misses = z(n_layers, torch.int64)
        self.miss_slot = z(num_experts, torch.int32, -1)  # at most E distinct misses per launch
        self.miss_key = z(num_experts, torch.int32, -1)
        self.launches = 0  # kernel launches (the step's counting)
        self.pin = True  # a launch protects its own experts from its evictions (False: tests of the tests)

    def assign(self, layer: int, ids: torch.Tensor, prefetch: bool = False) -> None:
        """One launch: pin ``ids`` (routed experts of ``layer``, [N] any integer dtype on this
        device), count hits, give each miss a slot (free, else the victim's), update the slot map
        and write the miss list (``miss_slot``/``miss_key``, ``state[MISS_N]`` long)."""
        li = self.index[layer]
        flat = ids.reshape(-1)
        if flat.dtype != torch.int64:
            flat = flat.to(torch.int64)
        E, S, L = self.num_experts, self.num_slots, len(self.sparse_layers)
        _kernel()[(1,)](
            flat, flat.numel(), layer, li, self.slot_map, self.layers, self.slot_key, self.free, self.state,
            self.fstate, self.stamp, self.score, self.used_at, self.seq, self.last, self.prev, self.tracked,
            self.version, self.mark, self.visit, self.seen, self.lrank, self.miss_slot, self.miss_key,
            self.hits, self.misses, E, S, L,
            POLICY=POLICIES[self.policy], PREFETCH=prefetch, RECENCY=self.recency, PIN=self.pin,
            BLOCK_E=_pow2(E), BLOCK_N=BLOCK_N, BLOCK_S=_pow2(S), BLOCK_L=_pow2(L))
        self.launches += 1

    # ---- host readers (each one reads the device: for tests, metrics and the eager path) -------
    def misses_of_last(self) -> list[tuple[int, tuple[int, int]]]:
        """The last launch's miss list: (slot, (layer, expert)), slot -1 for an unserved miss."""
        n = int(self.state[MISS_N])
        E = self.num_experts
        return [(s, (self.sparse_layers[k // E], k % E))
                for s, k in zip(self.miss_slot[:n].tolist(), self.miss_key[:n].tolist())]

    def slot_of(self) -> dict[tuple[int, int], int]:
        """(layer, expert) -> slot of every resident key."""
        E = self.num_experts
        return {(self.sparse_layers[k // E], k % E): s for s, k in enumerate(self.slot_key.tolist()) if k >= 0}

    def errors(self) -> int:
        """Misses left unserved so far (every slot pinned)."""
        return int(self.state[ERRORS])
