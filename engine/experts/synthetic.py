"""Synthetic routing traces with controllable skew and temporal locality.

Model, per layer l (independently):
- popularity: expert of rank r has weight ``(r + 1) ** -zipf_l``; ranks are a random
  permutation of the experts per layer, so the hot experts differ between layers;
- token t, layer l: each expert the same layer picked for token t-1 is reused with probability
  ``locality`` (in its previous routing order); the remaining slots are sampled without
  replacement from the popularity distribution restricted to experts not already chosen
  (Plackett-Luce via Gumbel top-k, which is exact sampling without replacement);
- records come out in execution order: token by token, layer by layer.

Deterministic given ``seed`` (numpy PCG64).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.experts.trace import RoutingTrace

__all__ = ["synthetic_trace", "cyclic_trace"]


def synthetic_trace(
    num_tokens: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    zipf: float | Sequence[float] = 1.0,
    locality: float = 0.0,
    seed: int = 0,
) -> RoutingTrace:
    """A :class:`RoutingTrace` of ``num_tokens`` tokens; see the module docstring."""
    for name, v, lo in (("num_tokens", num_tokens, 0), ("num_layers", num_layers, 1),
                        ("num_experts", num_experts, 1), ("top_k", top_k, 1)):
        if isinstance(v, bool) or int(v) != v or v < lo:
            raise ValueError(f"synthetic_trace {name} must be an integer >= {lo}, got {v!r}")
    T, L, E, K = int(num_tokens), int(num_layers), int(num_experts), int(top_k)
    if K > E:
        raise ValueError(f"synthetic_trace top_k={K} exceeds num_experts={E}")
    if not (0.0 <= locality <= 1.0):
        raise ValueError(f"synthetic_trace locality must be in [0, 1], got {locality!r}")
    if np.ndim(zipf) == 0:
        zipfs = np.full(L, float(zipf))
    else:
        zipfs = np.asarray(zipf, dtype=np.float64)
        if zipfs.shape != (L,):
            raise ValueError(f"synthetic_trace zipf has {zipfs.size} exponents, expected one or num_layers={L}")
    if not np.all(np.isfinite(zipfs)) or np.any(zipfs < 0):
        raise ValueError(f"synthetic_trace zipf exponents must be finite and >= 0, got {zipfs.tolist()}")

    rng = np.random.default_rng(seed)
    ranks = np.log(np.arange(1, E + 1, dtype=np.float64))
    experts = np.empty((T, L, K), dtype=np.int64)
    for l in range(L):
        logw = np.empty(E)
        logw[rng.permutation(E)] = -zipfs[l] * ranks  # expert perm[r] has rank r
        # Gumbel top-k per token: candidates in sampling order, first K suffice because at most
        # the reused experts (<= K - needed) can collide with them.
        g = logw[None, :] + rng.gumbel(size=(T, E))
        cand = np.argpartition(-g, K - 1, axis=1)[:, :K] if K < E else np.tile(np.arange(E), (T, 1))
        order = np.argsort(-np.take_along_axis(g, cand, axis=1), axis=1, kind="stable")
        cand = np.take_along_axis(cand, order, axis=1)
        keep = rng.random((T, K)) < locality
        cand_l = cand.tolist()
        keep_l = keep.tolist()
        prev: list[int] | None = None
        for t in range(T):
            if prev is None:
                row = cand_l[t]
            else:
                row = [e for e, k in zip(prev, keep_l[t]) if k]
                if len(row) < K:
                    chosen = set(row)
                    for e in cand_l[t]:
                        if e not in chosen:
                            row.append(e)
                            if len(row) == K:
                                break
            experts[t, l] = row
            prev = row
    tok = np.repeat(np.arange(T, dtype=np.int64), L)
    lay = np.tile(np.arange(L, dtype=np.int64), T)
    return RoutingTrace(L, E, K, tok, lay, experts.reshape(T * L, K))


def cyclic_trace(num_tokens: int, num_layers: int, num_experts: int, top_k: int) -> RoutingTrace:
    """Every token routes layer l to the same experts ``0..top_k-1``: the pure cyclic sweep of
    length ``num_layers * top_k`` (DESIGN §3), where LRU below the working set gets 0% hits."""
    T, L, K = num_tokens, num_layers, top_k
    tok = np.repeat(np.arange(T), L)
    lay = np.tile(np.arange(L), T)
    ex = np.tile(np.arange(K), (T * L, 1))
    return RoutingTrace(L, num_experts, K, tok, lay, ex)
