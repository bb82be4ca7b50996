"""The feed-forward half of a decoder layer as graphs, per (bucket, dtype): a dense SwiGLU layer's
``x + mlp(norm(x))`` in one graph; a sparse layer's route graph (norm, router: weights and ids
into static buffers), then the host's acquire of the distinct experts, then the experts graph
(slot-map gather at replay, grouped expert kernels, shared expert, residual)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from engine.cuda_graphs.core import bucket_for, layer_label
from engine.cuda_graphs.syncs import host_sync

if TYPE_CHECKING:
    from engine.cuda_graphs.core import Graph, GraphSet


@dataclass
class _Entry:
    """Static buffers and graphs of one (layer, bucket, dtype)."""

    x: torch.Tensor  # [B, H] the layer's input rows, padded
    out: torch.Tensor  # [B, H]
    h: torch.Tensor | None = None  # [B, H] normed (sparse layers)
    weights: torch.Tensor | None = None  # [B, K] float32
    ids: torch.Tensor | None = None  # [B, K] int64
    graphs: dict[str, Graph] = field(default_factory=dict)
    broken: bool = False  # a capture failed: this entry runs eager




class FeedForwardGraphs:
    """The graphs of one decoder layer's feed-forward half (``layer.post_attention_layernorm``,
    ``layer.mlp``), captured lazily per bucket on first use (when the step's experts are
    resident, so the warm-up computes on real slots)."""

    def __init__(self, layer: torch.nn.Module, owner: "GraphSet") -> None:
        self.layer, self.owner = layer, owner
        self.entries: dict[tuple[int, torch.dtype], _Entry] = {}

    def run(self, x: torch.Tensor) -> torch.Tensor | None:
        """x + mlp(norm(x)) through the graphs, or None: the caller runs the eager layer."""
        from engine.layers.mlp import SwiGLU
        from engine.layers.moe import SparseMoE

        rows = x.shape[0]
        bucket = bucket_for(rows, self.owner.buckets) if rows else None
        mlp = self.layer.mlp
        out = None
        if bucket is not None:
            if isinstance(mlp, SparseMoE):
                out = self._sparse(mlp, x, rows, bucket)
            elif type(mlp) is SwiGLU:
                out = self._dense(x, rows, bucket)
        if out is None:
            self.owner.counters.eager += 1
        return out

    def entry(self, x: torch.Tensor, bucket: int, top_k: int | None) -> _Entry:
        key = (bucket, x.dtype)
        e = self.entries.get(key)
        if e is None:
            z = lambda *shape, dtype=x.dtype: torch.zeros(*shape, dtype=dtype, device=x.device)  # noqa: E731
            h = x.shape[1]
            e = _Entry(x=z(bucket, h), out=z(bucket, h))
            if top_k is not None:
                e.h, e.weights, e.ids = z(bucket, h), z(bucket, top_k, dtype=torch.float32), \
                    z(bucket, top_k, dtype=torch.int64)
            self.entries[key] = e
        return e

    def _dense(self, x: torch.Tensor, rows: int, bucket: int) -> torch.Tensor | None:
        e = self.entry(x, bucket, None)
        if e.broken:
            return None
        self.owner.stage_into(e.x, x, rows)
        return e.out[:rows] if self.owner.replay(e, "dense", self.dense_fn(e), layer_label(self.layer)) else None

    def dense_fn(self, e: _Entry) -> Callable[[], None]:
        norm, mlp = self.layer.post_attention_layernorm, self.layer.mlp

        def block() -> None:
            e.out.copy_(e.x + mlp(norm(e.x)))

        return block

    @staticmethod
    def sparse_layout(mlp, x: torch.Tensor):
        """The grouped kernels' layout when this MoE half can run through the graphs, else None."""
        from engine.layers.moe import SparseMoE

        provider, top_k = mlp.provider, getattr(mlp.gate, "top_k", None)
        if type(mlp).forward is not SparseMoE.forward or top_k is None:
            return None  # an architecture with its own MoE forward
        if provider is None or provider.allowed_experts(mlp.layer) is not None:
            return None  # no experts attached, or drafting on resident experts only
        return mlp._grouped_layout(provider, x)  # None: no slot pool here, or a format the kernels lack

    def route_fn(self, mlp, e: _Entry) -> Callable[[], None]:
        norm = self.layer.post_attention_layernorm

        def route() -> None:
            h = norm(e.x)
            r = mlp.route(h)  # the router, or a declared capturable override (step_graph)
            e.h.copy_(h)
            e.weights.copy_(r.weights)
            e.ids.copy_(r.ids)

        return route

    def _sparse(self, mlp, x: torch.Tensor, rows: int, bucket: int) -> torch.Tensor | None:
        layout = self.sparse_layout(mlp, x)
        if layout is None:
            return None
        e = self.entry(x, bucket, mlp.gate.top_k)
        if e.broken:
            return None
        norm = self.layer.post_attention_layernorm
        if mlp.router_override is not None:
            # routing injected per step (a trace replay: engine.experts.synthetic_store) keeps
            # Python state a graph would freeze: route eagerly on the real rows, pad into the
            # static buffers, graph the rest
            h = norm(x)
            r = mlp.route(h)
            for dst, src in ((e.x, x), (e.h, h), (e.weights, r.weights), (e.ids, r.ids)):
                self.owner.stage_into(dst, src, rows)
        else:
            self.owner.stage_into(e.x, x, rows)
            if not self.owner.replay(e, "route", self.route_fn(mlp, e), layer_label(self.layer)):
                return None
        return self.experts(mlp, e, x, rows, layout)

    def experts(self, mlp, e: _Entry, x: torch.Tensor, rows: int, layout) -> torch.Tensor:
        """After routing (e.h, e.weights, e.ids hold the bucket's rows): the cache's acquire, then
        the experts graph (or the eager combine where it cannot run); x: the half's input rows."""
        from engine.layers.moe import Routing

        provider = mlp.provider
        h, ids = e.h[:rows], e.ids[:rows]
        for observe in mlp.observers:
            observe(mlp.layer, ids)
        if device_cache_fits(provider, e.ids.shape[0], e.ids.shape[1]):  # the fetch stage on the device
            if not self.owner.replay(e, "experts", self.device_experts_fn(mlp, e, layout), layer_label(self.layer)):
                return _eager_combine(mlp, e, x, rows, provider)
            return e.out[:rows]
        # every bucket row's experts (padding copies row 0: the same ones), so no replayed read
        # of the slot map can name a slot this acquire did not pin
        host_sync("routed ids")
        uniq = torch.unique(e.ids).tolist()
        limit = provider.max_experts_per_acquire
        if limit is not None and len(uniq) > limit:  # acquired in chunks: the eager combine
            return _eager_combine(mlp, e, x, rows, provider)
        experts = provider.acquire(mlp.layer, uniq)
        try:
            provider.observe_hidden(mlp.layer, h)
            if any(getattr(experts[i], "on_cpu", False) for i in uniq):  # misses computed on the CPU
                routing = Routing(e.weights[:rows], ids)
                y = mlp._per_expert_part(h, routing, uniq, experts).to(x.dtype)
                return x + (y + mlp.shared(h) if mlp.shared_expert is not None else y)
            slot_row, pool = provider.slot_map[mlp.layer], provider.slots  # bound at capture

            def combine() -> None:
                from engine.quant.triton_moe import grouped_moe

                pair = slot_row[e.ids].reshape(-1)
                y = grouped_moe(e.h, e.weights, pair, pool, layout).to(e.x.dtype)
                if mlp.shared_expert is not None:
                    y = y + mlp.shared(e.h)
                e.out.copy_(e.x + y)

            if not self.owner.replay(e, "experts", combine, layer_label(self.layer)):
                routing = Routing(e.weights[:rows], ids)
                return x + mlp.experts_and_shared(h.clone(), routing, _Acquired(provider, experts))
        finally:
            provider.release(mlp.layer, uniq)
        return e.out[:rows]

    def device_experts_fn(self, mlp, e: _Entry, layout) -> Callable[[], None]:
        """The experts half with the device cache (engine.experts.device_cache): slots assigned
        and misses copied on the device, the grouped kernels, then the next layer's prefetch;
        no host synchronisation, so it runs inside a graph."""
        from engine.quant.triton_moe import grouped_moe

        provider, layer = mlp.provider, mlp.layer
        slot_row, pool = provider.slot_map[layer], provider.slots

        def combine() -> None:
            provider.device_acquire(layer, e.ids)
            pair = slot_row[e.ids].reshape(-1)
            y = grouped_moe(e.h, e.weights, pair, pool, layout).to(e.x.dtype)
            if mlp.shared_expert is not None:
                y = y + mlp.shared(e.h)
            e.out.copy_(e.x + y)
            provider.device_prefetch(layer, e.h)

        return combine


def _eager_combine(mlp, e: _Entry, x: torch.Tensor, rows: int, provider) -> torch.Tensor:
    """x + the eager experts and shared expert on the entry's routed rows (copies: the static
    buffers are overwritten by the next replay)."""
    from engine.layers.moe import Routing

    routing = Routing(e.weights[:rows].clone(), e.ids[:rows].clone())
    return x + mlp.experts_and_shared(e.h[:rows].clone(), routing, provider)


def device_cache_fits(provider, rows: int, top_k: int) -> bool:
    """The provider is a device expert cache whose slots hold every distinct expert a step of
    ``rows`` rows can route to (else that step acquires in chunks on the host)."""
    if getattr(provider, "device_acquire", None) is None:
        return False
    return min(provider.dpolicy.num_experts, rows * top_k) <= provider.num_slots


class _Acquired:
    """A provider view over experts already acquired (the eager fallback after a failed capture,
    inside the acquire that pinned them): acquire returns them, release is the caller's."""

    def __init__(self, provider, experts) -> None:
        self.provider, self.experts = provider, experts
        self.max_experts_per_acquire = None
        self.slot_map, self.slots = getattr(provider, "slot_map", None), getattr(provider, "slots", None)

    def acquire(self, layer, expert_ids):
        return {i: self.experts[i] for i in expert_ids}

    def release(self, layer, expert_ids) -> None:
        pass

    def observe_hidden(self, layer, hidden) -> None:
        pass

    def grouped_layout(self, layer, device):
        return None  # per expert: the graph path failed on this layer
