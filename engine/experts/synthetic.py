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

Because the model is known, so is the best any *online* cache can do on its traces:
:func:`online_ceiling`. When layer ``l`` is visited for token ``t`` the experts of ``l`` it holds
were chosen before the routing was seen, so its expected hits are the sum of the conditional
pick probabilities of what it holds (given the past: here the previous token's experts of that
layer, since layers are independent), and what it holds of layer ``l`` then was already held
since ``l``'s previous visit (only misses of ``l`` add experts of ``l``), so the holdings at the
visits of one sweep sum to at most the capacity on average. The bound is therefore the
capacity x tokens largest conditional probabilities over all (token, layer, expert), divided by
the accesses. Belady knows the routing itself and can exceed it by far on near-uniform routing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.experts.trace import RoutingTrace

__all__ = ["synthetic_trace", "cyclic_trace", "pick_probabilities", "online_ceiling"]


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
    experts = np.empty((T, L, K), dtype=np.int64)
    for l in range(L):
        logw = _log_weights(rng, E, zipfs[l])
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


def _log_weights(rng: np.random.Generator, num_experts: int, zipf: float) -> np.ndarray:
    """Log popularity of every expert of one layer: expert ``perm[r]`` has rank ``r``."""
    ranks = np.log(np.arange(1, num_experts + 1, dtype=np.float64))
    logw = np.empty(num_experts)
    logw[rng.permutation(num_experts)] = -zipf * ranks
    return logw


def _zipfs(zipf, num_layers: int) -> np.ndarray:
    return np.full(num_layers, float(zipf)) if np.ndim(zipf) == 0 else np.asarray(zipf, np.float64)


def pick_probabilities(trace: RoutingTrace, zipf: float | Sequence[float], locality: float, seed: int,
                       samples: int = 1000) -> np.ndarray:
    """``[records, num_experts]``: for each record of ``trace`` (made by :func:`synthetic_trace`
    with these ``zipf``, ``locality`` and ``seed``), the probability of each expert being
    picked given the previous token's experts of the same layer, by Monte Carlo over
    ``samples`` draws of the generator's own process (fixed seed ``seed + 1``)."""
    T, L, E, K = trace.num_tokens, trace.num_layers, trace.num_experts, trace.top_k
    if len(trace) != T * L:
        raise ValueError("pick_probabilities needs a trace made by synthetic_trace (token by token, every layer)")
    rng = np.random.default_rng(seed)
    logws = []
    for l in range(L):  # replay the generator's draws to recover its weights
        logws.append(_log_weights(rng, E, _zipfs(zipf, L)[l]))
        rng.gumbel(size=(T, E))
        rng.random((T, K))
    mc = np.random.default_rng(seed + 1)
    ex = trace.experts.reshape(T, L, K)
    out = np.empty((T, L, E))
    for l in range(L):
        for t in range(T):
            g = logws[l][None, :] + mc.gumbel(size=(samples, E))
            if t > 0:  # reused experts of the previous token come first
                keep = mc.random((samples, K)) < locality
                rows = np.repeat(np.arange(samples), K)[keep.reshape(-1)]
                g[rows, np.tile(ex[t - 1, l], samples)[keep.reshape(-1)]] = np.inf
            top = np.argpartition(-g, K - 1, axis=1)[:, :K] if K < E else np.tile(np.arange(E), (samples, 1))
            out[t, l] = np.bincount(top.reshape(-1), minlength=E) / samples
    return out.reshape(T * L, E)


def online_ceiling(probabilities: np.ndarray, capacity: int, num_layers: int, top_k: int) -> float:
    """The hit rate no online policy exceeds in expectation (module docstring), from
    :func:`pick_probabilities` (``[records, experts]``, one record per token and layer)."""
    if capacity < 1:
        raise ValueError(f"online_ceiling capacity must be >= 1, got {capacity}")
    flat = np.sort(probabilities.reshape(-1))[::-1]
    tokens = probabilities.shape[0] / num_layers
    n = min(flat.size, int(round(capacity * tokens)))
    return float(flat[:n].sum() / (probabilities.shape[0] * top_k))


def cyclic_trace(num_tokens: int, num_layers: int, num_experts: int, top_k: int) -> RoutingTrace:
    """Every token routes layer l to the same experts ``0..top_k-1``: the pure cyclic sweep of
    length ``num_layers * top_k`` (DESIGN §3), where LRU below the working set gets 0% hits."""
    T, L, K = num_tokens, num_layers, top_k
    tok = np.repeat(np.arange(T), L)
    lay = np.tile(np.arange(L), T)
    ex = np.tile(np.arange(K), (T * L, 1))
    return RoutingTrace(L, num_experts, K, tok, lay, ex)
