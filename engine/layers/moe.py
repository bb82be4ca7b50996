"""Sparse MoE block as four named stages: route -> fetch -> compute -> combine.

Shape legend:
    T  tokens in this forward (all sequences of the batch, flattened)
    H  hidden size            I  expert intermediate size
    E  routed experts         K  experts per token (top-k)

route:   x [T, H] -> weights [T, K] (float32), ids [T, K]
fetch:   the distinct ids of this layer -> resident experts (the expert cache plugs in here,
         and only here: it may load, pin, or choose to compute a miss elsewhere)
compute: tokens grouped by expert; each expert runs once on all of its tokens [T_e, H]
combine: out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])  (+ gated shared expert)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.cuda_graphs.syncs import host_sync
from engine.layers.mlp import SwiGLU


class Expert(Protocol):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T_e, H] -> [T_e, H]."""


@dataclass
class DenseExpert:
    """A routed expert held as plain float tensors ([out, in] each)."""

    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))


class ExpertProvider(ABC):
    """The fetch stage. ``acquire`` returns every requested expert ready to compute and keeps
    them from being evicted until ``release``; a step acquires and releases once per layer
    (or once per chunk of ``max_experts_per_acquire`` experts when a layer needs more distinct
    experts than the provider can hold at once, e.g. a long prefill through a small cache)."""

    max_experts_per_acquire: int | None = None

    @abstractmethod
    def acquire(self, layer: int, expert_ids: list[int]) -> Mapping[int, Expert]: ...

    def acquire_overlapped(self, layer: int, expert_ids: list[int],
                           ready: Callable[[Mapping[int, Expert]], None]) -> Mapping[int, Expert]:
        """``acquire``, calling ``ready(experts)`` with the requested experts that are resident
        already once the others' loads have started and before waiting for them, so a step
        computes those while the rest load (a disk-bound CPU run). The default never loads
        behind the caller: plain ``acquire``, ``ready`` not called."""
        return self.acquire(layer, expert_ids)

    def release(self, layer: int, expert_ids: list[int]) -> None:
        """Unpin what ``acquire`` pinned (no-op for providers that never evict)."""

    def allowed_experts(self, layer: int) -> list[int] | None:
        """Experts the router may pick in ``layer`` right now; None = all. Self-speculative
        drafting restricts routing to device-resident experts so drafts move no bytes."""
        return None

    def slot_table(self, layer: int, expert_ids: list[int],
                   experts: Mapping[int, Expert]) -> tuple[torch.Tensor, list[int]] | None:
        """For the fused step (engine.step): the provider's slot table (int64 [slots, 13], one row
        per slot: format, group, I, H and the addresses of the expert's parts) and the slot of each
        acquired expert, -1 for one that must run through ``Expert.forward`` (e.g. computed on the
        CPU from RAM). None: the provider has no slots, every expert runs through its forward."""
        return None

    def resident_slots(self, layer: int, expert_ids: list[int]) -> tuple[torch.Tensor, list[int]] | None:
        """The fused step's shortcut past acquire / slot_table / release: ``slot_table``'s answer
        when every one of ``expert_ids`` is resident and stays so without a pin (nothing can evict
        it), the hits counted as ``acquire`` counts them. None (the default): take the full path."""
        return None

    def resident_map(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused step's view of residency for a whole step (engine/csrc/layers.cpp): (int32
        [layers, experts], the slot of each expert that is resident and stays so without a pin, -1
        for any other; ``slot_table``'s table). A step reading it must report its hits through
        ``count_hits``. None (the default): ask per layer (``resident_slots``)."""
        return None

    def count_hits(self, hits: list[int]) -> None:
        """The hits of experts a step found through ``resident_map``: ``hits[layer]`` each."""

    def observe_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """Called with a sparse layer's MoE input once its first experts are acquired, before
        they compute: prefetching for the next layers overlaps this layer's compute."""


def fetch_and_compute(provider: ExpertProvider, layer: int, expert_ids: list[int], hidden: torch.Tensor,
                      compute: Callable[[int, list[int], Mapping[int, Expert]], None],
                      early: Callable[[Mapping[int, Expert]], None] | None = None) -> None:
    """The fetch stage around the compute stage: ``expert_ids`` in chunks the provider can hold at
    once, each acquired (pinned), computed by ``compute(start, part, experts)`` (``start``: the
    chunk's offset in ``expert_ids``) and released whatever compute raises; prefetch for the next
    layers starts once the first chunk is acquired, so it overlaps this layer's compute.
    ``early``: when all fit in one acquire, called with the experts resident already while the
    others load (ExpertProvider.acquire_overlapped); ``compute`` then gets them all."""
    chunk = provider.max_experts_per_acquire or len(expert_ids)
    for start in range(0, len(expert_ids), chunk):
        part = expert_ids[start:start + chunk]
        if early is not None and len(part) == len(expert_ids):
            experts = provider.acquire_overlapped(layer, part, early)
        else:
            experts = provider.acquire(layer, part)
        try:
            if start == 0:
                provider.observe_hidden(layer, hidden)
            compute(start, part, experts)
        finally:
            provider.release(layer, part)


class ResidentExperts(ExpertProvider):
    """Every expert resident in memory: the reference fetch stage."""

    def __init__(self, experts: dict[tuple[int, int], Expert]) -> None:
        self.experts = experts

    def acquire(self, layer, expert_ids):
        return {e: self.experts[(layer, e)] for e in expert_ids}


@dataclass(frozen=True)
class Routing:
    weights: torch.Tensor  # [T, K] float32
    ids: torch.Tensor  # [T, K] int64


class Router(nn.Module):
    """Softmax over all experts in float32, top-k, optional renormalisation over the top-k."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.normalize = top_k, normalize

    def forward(self, x: torch.Tensor, allowed: list[int] | None = None) -> Routing:
        logits = F.linear(x, self.weight).float()
        top_k = self.top_k
        if allowed is not None:  # restricted routing (self-speculative drafts): mask the rest
            mask = torch.full_like(logits, float("-inf"))
            mask[:, allowed] = 0.0
            logits = logits + mask
            top_k = max(1, min(top_k, len(allowed)))
        probs = F.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights, ids)


RouteObserver = Callable[[int, torch.Tensor], None]  # (layer, ids [T, K])
# (x [T, H], allowed experts or None) -> Routing: a routing that replaces the layer's router
RouterOverride = Callable[[torch.Tensor, list[int] | None], Routing]


class SparseMoE(nn.Module):
    # routing replaced per step (a replayed routing trace: engine.experts.synthetic_store,
    # bench/expert_cache.py), set on the instance. Declared here so the fast paths (engine.step,
    # engine.cuda_graphs) see it and route through :meth:`route` (eager, never captured) instead
    # of their own router. A class default: architectures' MoE blocks with their own __init__ have it
    router_override: RouterOverride | None = None

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        m = cfg.moe
        assert m is not None
        self.layer = layer
        self.gate = Router(cfg.hidden_size, m.num_experts, m.top_k, m.norm_topk_prob)
        self.shared_expert = (
            SwiGLU(cfg.hidden_size, m.shared_expert_intermediate_size)
            if m.shared_expert_intermediate_size else None
        )
        self.shared_expert_gate = (
            nn.Linear(cfg.hidden_size, 1, bias=False) if m.shared_expert_gate else None
        )
        self.provider: ExpertProvider | None = None  # set by the model loader
        self.observers: list[RouteObserver] = []

    def route(self, x: torch.Tensor, allowed: list[int] | None = None) -> Routing:
        """The route stage: the layer's router, or its declared :attr:`router_override`."""
        if self.router_override is not None:
            return self.router_override(x, allowed)
        return self.gate(x, allowed)

    def run_expert(self, e: int, expert: Expert, x: torch.Tensor) -> torch.Tensor:
        """The compute stage for one expert: x [T_e, H] -> [T_e, H] (unweighted). Architectures
        whose experts are not a plain SwiGLU (biases, other activations) override this."""
        return expert.forward(x)

    def _grouped_layout(self, provider: ExpertProvider, x: torch.Tensor):
        """The slot layout when this layer's experts can run as two grouped launches over the
        provider's slot pool (engine.quant.triton_moe: the CUDA path), else None."""
        layout_of = getattr(provider, "grouped_layout", None)
        if layout_of is None or type(self).run_expert is not SparseMoE.run_expert:
            return None  # no slot pool, or experts that are not a plain SwiGLU
        return layout_of(self.layer, x.device)

    def _routed_grouped(self, x: torch.Tensor, routing: Routing, provider: ExpertProvider, layout) -> torch.Tensor:
        """fetch, then compute + combine in two launches: every (token, pick) reads its expert
        from the slot the provider's device slot map names."""
        from engine.quant.triton_moe import grouped_moe

        host_sync("routed ids")
        uniq = torch.unique(routing.ids).tolist()
        result: list[torch.Tensor] = []

        def compute(start: int, part: list[int], experts: Mapping[int, Expert]) -> None:
            if start == 0 and len(part) == len(uniq) and not any(
                    getattr(experts[e], "on_cpu", False) for e in part):
                pair_slot = provider.slot_map[self.layer][routing.ids].reshape(-1)
                result.append(grouped_moe(x, routing.weights, pair_slot, provider.slots, layout))
            else:  # chunked acquisition or experts computed on the CPU: one expert at a time
                result.append(self._per_expert_part(x, routing, part, experts))

        fetch_and_compute(provider, self.layer, uniq, x, compute)
        return result[0].to(x.dtype) if len(result) == 1 else torch.stack(result).sum(0).to(x.dtype)

    def _per_expert_part(self, x: torch.Tensor, routing: Routing, part: list[int],
                         experts: Mapping[int, Expert]) -> torch.Tensor:
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in part:
            tok, k = (routing.ids == e).nonzero(as_tuple=True)
            y = self.run_expert(e, experts[e], x[tok]).float() * routing.weights[tok, k, None]
            out.index_add_(0, tok, y)
        return out

    def _routed_per_expert(self, x: torch.Tensor, routing: Routing, provider: ExpertProvider) -> torch.Tensor:
        # group the (token, pick) pairs by expert once: a stable sort of the flat picks, so each
        # expert's tokens are one contiguous run (in token order) of the gathered rows
        k = routing.ids.shape[1]
        order = torch.argsort(routing.ids.reshape(-1), stable=True)
        uniq, counts = torch.unique_consecutive(routing.ids.reshape(-1)[order], return_counts=True)
        host_sync("routed ids")
        ids, counts = uniq.tolist(), counts.tolist()
        rows = order // k  # token of each pick, grouped by expert
        xs = x[rows]
        ws = routing.weights.reshape(-1)[order, None]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        contributions = []

        def compute(start: int, part: list[int], experts: Mapping[int, Expert]) -> None:
            for j, e in enumerate(part, start):  # grouped by expert
                a, b = starts[j], starts[j + 1]
                contributions.append(self.run_expert(e, experts[e], xs[a:b]) * ws[a:b])

        fetch_and_compute(provider, self.layer, ids, x, compute)  # fetch + compute
        # combine: one scatter-add for the whole layer (a per-expert index_add_ cost ~0.15 ms
        # each, more than the int4 expert itself at decode)
        return torch.zeros_like(x).index_add_(0, rows, torch.cat(contributions).to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        provider = self.provider
        assert provider is not None, "experts not attached (engine.models.load.build_model)"
        routing = self.route(x, provider.allowed_experts(self.layer))
        for observe in self.observers:
            observe(self.layer, routing.ids)
        return self.experts_and_shared(x, routing, provider)

    def experts_and_shared(self, x: torch.Tensor, routing: Routing, provider: ExpertProvider) -> torch.Tensor:
        """fetch + compute + combine of routed rows, plus the (gated) shared expert: [T, H]."""
        grouped = self._grouped_layout(provider, x)
        if grouped is not None:
            out = self._routed_grouped(x, routing, provider, grouped)
        else:
            out = self._routed_per_expert(x, routing, provider)
        return out + self.shared(x) if self.shared_expert is not None else out

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, times its sigmoid gate where it has one."""
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return shared
