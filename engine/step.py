"""The forward step as a few native calls per layer (docs/design.md, "The step contract").

Per layer (engine/csrc/step.cpp):

    h = attn_block(x)          fused norm, QKV, q/k norm, RoPE, KV write + attention through the
                               block tables, o_proj and the residual add (x in place); returns the
                               post-attention norm of x
    ids, w = route(h)          float32 softmax top-k (+ renormalisation)
    experts acquired           the expert cache makes them resident and pins them (Python: the
                               cache's bookkeeping), then hands out slot numbers
    ffn_block(x, h, ...)       every routed expert read from its slot, weighted and summed, the
                               shared expert (or a dense SwiGLU) beside them, residual add

and after the last layer ``head_block``: the final norm and LM head of each sequence's last row.
So a decode layer is three native calls plus the cache's lookups, instead of hundreds of torch
ops; and where the architecture adds no hooks and the expert cache can hand out a residency table
(ExpertProvider.resident_map), the whole loop of layers and the head is one native call,
``run_layers`` (engine/csrc/layers.cpp), that returns to Python only for a layer with an expert
to fetch: a decoded token whose experts are resident is one native call.
The torch layers (engine.layers) stay the reference: :func:`NativeStep.for_model` says when the
model can run this way (CPU, native kernels built, dense linears quantized by
engine.quant.linear, float32 activations) and :meth:`NativeStep.supports` per step (the KV
cache can hand out block tables: not FP8). Anything else runs the torch path; engine.executor
chooses per step. The ``fused_step`` runtime option (engine.options) turns it off. Tests compare
both paths on random inputs.

One step is one loop over the layers (:meth:`NativeStep.forward`); what differs between
architectures are per-layer hooks, each given the step's :class:`StepContext`: ``_attention``
(the layer's mixer block: attention, MLA, gated attention or Gated DeltaNet), ``_route`` and
``_expert``, and the handles built once per model (``_mixer``, ``_router``, ``_norm_weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.kv.base import BatchLayout, KVCache
from engine.layers.mlp import SwiGLU
from engine.layers.moe import SparseMoE, fetch_and_compute
from engine.options import options
from engine.quant.kernels import DIRECT_MAX_T, backend_for, int8_activations, load_extension, native_linear
from engine.quant.linear import QuantLinear

EMPTY = torch.empty(0)
EMPTY_IDS = torch.empty(0, dtype=torch.int64)
NO_EXPERTS = torch.empty(0, 0, dtype=torch.int32)  # the residency table of a model without experts


def _lin(ext: Any, m: nn.Module) -> Any:
    return native_linear(ext, m.q, m.bias)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def _ffn(ext: Any, mlp: SwiGLU, gate: nn.Linear | None) -> Any:
    g = EMPTY if gate is None else _f32(gate.weight).view(-1)
    return ext.FFN(_lin(ext, mlp.gate_proj), _lin(ext, mlp.up_proj), _lin(ext, mlp.down_proj), g)


def _native_linears(model) -> bool:
    """Every dense linear of the layers is a QuantLinear the C++ kernels take."""
    from engine.quant.linear import dense_linears

    for parent, name in dense_linears(model):
        if parent is model:  # the LM head runs through QuantLinear / nn.Linear either way
            continue
        m = getattr(parent, name)
        if not isinstance(m, QuantLinear) or backend_for(m.q) != "cpp":
            return False
    return True


@dataclass(frozen=True, slots=True)
class StepContext:
    """One step's inputs as every per-layer hook sees them (built once per step).

    ``x`` [T, H] float32: the hidden rows of the step (flat over its sequences), updated in place
    by every block; ``positions`` [T]: each row's position; ``cos``/``sin``: the RoPE tables up to
    the largest position; ``storage``/``tables``: the KV cache's native view (its storage tensor,
    the block table of each sequence); ``qlens``/``ctxs``: new tokens and context length per
    sequence; ``state``: the recurrent state of a hybrid model (engine.kv.state, positioned for
    ``layout``), else None; ``dmt``/``i8a``: the kernels' direct-path row limit and whether
    activations are quantized to int8."""

    x: torch.Tensor
    layout: BatchLayout
    positions: list[int]
    cos: torch.Tensor
    sin: torch.Tensor
    storage: torch.Tensor
    tables: Any
    qlens: list[int]
    ctxs: list[int]
    state: Any
    dmt: int
    i8a: bool


class NativeStep:
    """Per-layer native handles of one model (built once; they hold its weight tensors)."""

    context_type: type[StepContext] = StepContext  # architectures with more per-step inputs extend it

    def __init__(self, model, ext: Any) -> None:
        from engine.quant.kernels import native_threads

        self.ext = ext
        ext.set_threads(native_threads())
        self.eps = float(model.config.rms_norm_eps)
        self.attn: list[Any] = []  # each layer's mixer handle (Attn, MLA, DeltaNet)
        self.ffn: list[Any] = []  # each layer's shared expert or dense SwiGLU (FFN) or None
        self.routers: list[Any] = []  # each MoE layer's router handle, None for a dense layer
        self.acts: list[Any] = [None] * len(model.model.layers)  # routed experts' ExpertAct (gpt-oss)
        for layer in model.model.layers:
            self.attn.append(self._mixer(layer))
            self._add_mlp(layer.mlp)
        head = model.lm_head
        self.head = (_lin(ext, head) if isinstance(head, QuantLinear) and backend_for(head.q) == "cpp"
                     else None)
        self.norm = self._norm_weight(model.model.norm)
        self.sparse: list[SparseMoE] = []  # the sparse layers' MoE blocks, when self.layers is set
        self.layers = self._plan(model)

    def _plan(self, model) -> Any:
        """Every layer as one native call (engine/csrc/layers.cpp: ``run_layers``), or None (the
        Python loop of layers): an architecture with its own hooks, per-expert activations
        (gpt-oss), a sparse block whose ``layer`` is not its index. Per step, ``_resident_map``
        decides whether the plan runs."""
        base = NativeStep
        if (type(self)._attention is not base._attention or type(self)._route is not base._route
                or type(self)._mlp is not base._mlp or type(self)._router is not base._router
                or any(a is not None for a in self.acts)):
            return None
        layers = model.model.layers
        sparse = [(i, layer.mlp) for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoE)]
        if any(mlp.layer != i for i, mlp in sparse):
            return None
        self.sparse = [mlp for _, mlp in sparse]
        self._hits = torch.zeros(len(layers), dtype=torch.int64)  # run_layers zeroes it per step
        routers = [EMPTY if r is None else r for r in self.routers]
        top_k = [layer.mlp.gate.top_k if r is not None else 0 for layer, r in zip(layers, self.routers)]
        norm = [bool(layer.mlp.gate.normalize) if r is not None else False for layer, r in zip(layers, self.routers)]
        return self.ext.Layers(self.attn, self.ffn, routers, top_k, norm, self.head, self.norm, self.eps)

    # Architectures override these three (engine/models/{qwen3_next,deepseek_v3,gpt_oss}/step.py).
    def _mixer(self, layer: nn.Module) -> Any:
        """Layer's attention handle: RMSNorm, QKV (+ q/k norm), RoPE, paged attention, o_proj."""
        ext, a = self.ext, layer.self_attn
        qn = _f32(a.q_norm.weight) if a.q_norm is not None else EMPTY
        kn = _f32(a.k_norm.weight) if a.k_norm is not None else EMPTY
        return ext.Attn(_lin(ext, a.q_proj), _lin(ext, a.k_proj), _lin(ext, a.v_proj), _lin(ext, a.o_proj),
                        self._norm_weight(layer.input_layernorm),
                        self._norm_weight(layer.post_attention_layernorm), qn, kn, a.nh, a.nkv, a.d, self.eps)

    def _router(self, mlp: SparseMoE) -> Any:
        """The handle ``_route`` passes to the native router: the float32 router weight."""
        return _f32(mlp.gate.weight)

    def _norm_weight(self, norm: nn.Module) -> torch.Tensor:
        """An RMSNorm's weight as the kernels apply it (x * r * w)."""
        return _f32(norm.weight)

    def _add_mlp(self, mlp: nn.Module) -> None:
        """One layer's feed-forward handles: a MoE's router and shared expert, or a dense SwiGLU."""
        if isinstance(mlp, SparseMoE):
            shared = (_ffn(self.ext, mlp.shared_expert, mlp.shared_expert_gate)
                      if mlp.shared_expert is not None else None)
            self.ffn.append(shared)
            self.routers.append(self._router(mlp))
        else:
            self.ffn.append(_ffn(self.ext, mlp, None))
            self.routers.append(None)

    @classmethod
    def for_model(cls, model) -> "NativeStep | None":
        """The native step of ``model`` if it can run that way now, else None (torch layers)."""
        if not options().fused_step:
            return None
        from engine.layers.embedding import compute_dtype

        if model.model.embed_tokens.weight.device.type != "cpu" or compute_dtype(model) != torch.float32:
            return None
        if model.config.head_dim % 2 or not _native_linears(model):
            return None
        ext = load_extension()
        if ext is None or not hasattr(ext, "attn_block"):
            return None
        return cls(model, ext)

    def forward(self, model, tokens: torch.Tensor, layout: BatchLayout, kv: KVCache, state=None,
                all_logits: bool = False, rows: list[int] | None = None) -> torch.Tensor | None:
        """Logits as the model's forward returns them, or None when the KV cache cannot hand out
        block tables (the caller runs the torch layers). ``state``: a hybrid model's recurrent
        state, already positioned (``begin``) for ``layout``; the caller advances it after."""
        ctx = self._context(model, tokens, layout, kv, state)
        if ctx is None:
            return None
        resident = self._resident_map()
        logits = None
        if resident is not None:  # the head in the same call where the kernels run it
            head_rows = [] if all_logits or self.head is None else rows if rows is not None else layout.last_rows()
            logits = self._run_layers(ctx, model.model.layers, *resident, head_rows)
        else:
            for i, layer in enumerate(model.model.layers):
                h = self._attention(ctx, i, layer)
                self._mlp(ctx, i, layer.mlp, h)
        model.tap_hidden(ctx.x, layout)  # the MTP drafter's hidden states (CausalLM.tap_hidden)
        # (the head reads x without changing it: the taps see the same rows after it)
        return logits if logits is not None else self._logits(model, ctx.x, layout, all_logits, rows)

    def _resident_map(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(residency table, slot table) for ``run_layers`` when this step can run its layers as
        one native call: a plan, and a provider that keeps residency still (ExpertProvider.
        resident_map), no route observers and no injected routing on any sparse layer."""
        if self.layers is None:
            return None
        if not self.sparse:  # a dense model: no experts to look up
            return NO_EXPERTS, EMPTY_IDS
        provider = self.sparse[0].provider
        if any(mlp.observers or mlp.router_override is not None or mlp.provider is not provider
               for mlp in self.sparse):
            return None
        return provider.resident_map()

    def _run_layers(self, ctx: StepContext, layers, resident: torch.Tensor, slot_rows: torch.Tensor,
                    head_rows: list[int]) -> torch.Tensor | None:
        """Every layer through ``run_layers``; a layer it stops at (an expert not resident) takes
        the fetch path of ``_moe`` with the routing run_layers computed, then the rest go on. The
        call that finishes the layers returns the logits of ``head_rows`` (None: none asked)."""
        hits = self._hits  # experts found resident per layer: zeroed by the call that starts at 0
        start = 0
        while True:
            stop, h, ids, w, uniq, logits = self.ext.run_layers(
                self.layers, start, ctx.x, ctx.cos, ctx.sin, ctx.positions, ctx.storage, ctx.tables, ctx.qlens,
                ctx.ctxs, ctx.dmt, ctx.i8a, resident, slot_rows, hits, head_rows)
            if stop == len(layers):
                break
            self._moe(ctx, stop, layers[stop].mlp, h, (ids, w, uniq))
            start = stop + 1
        if self.sparse:
            self.sparse[0].provider.count_hits(hits.tolist())
        return logits

    def _context(self, model, tokens: torch.Tensor, layout: BatchLayout, kv: KVCache,
                 state) -> StepContext | None:
        """The step's context, or None when the KV cache cannot hand out block tables."""
        view = kv.native_view(layout, tokens.device)
        if view is None:
            return None
        storage, tables = view
        qlens, ctxs = list(layout.query_lens), list(layout.context_lens)
        positions = [c + i for c, n in zip(ctxs, qlens) for i in range(n)]
        cos, sin = model.rotary.tables(max(positions) + 1)
        x = model.model.embed_tokens(tokens)
        if x.dtype != torch.float32:  # a call per token: .float() dispatches even when it is a no-op
            x = x.float()
        x = x.contiguous()
        return self.context_type(x, layout, positions, cos, sin, storage, tables, qlens, ctxs, state,
                                 DIRECT_MAX_T, int8_activations(), *self._extra_context(layout, state))

    def _extra_context(self, layout: BatchLayout, state) -> tuple:
        """The values of the fields ``context_type`` adds to StepContext (none here)."""
        return ()

    def _mlp(self, ctx: StepContext, i: int, mlp: nn.Module, h: torch.Tensor) -> None:
        """ctx.x += layer i's feed-forward of h (its post-attention norm), in place."""
        if self.routers[i] is None:
            self.ext.ffn_block(ctx.x, h, EMPTY_IDS, EMPTY, [], [], EMPTY_IDS, self.ffn[i], ctx.dmt, ctx.i8a)
        else:
            self._moe(ctx, i, mlp, h)

    def _logits(self, model, x: torch.Tensor, layout: BatchLayout, all_logits: bool,
                rows: list[int] | None) -> torch.Tensor:
        if all_logits or self.head is None:
            return model.final_logits(x, layout, all_logits, rows)
        return self.ext.head_block(x, rows if rows is not None else layout.last_rows(), self.norm, self.eps,
                                   self.head, DIRECT_MAX_T, int8_activations())

    def _attention(self, ctx: StepContext, i: int, layer: nn.Module) -> torch.Tensor:
        """Layer i's mixer block (ctx.x updated in place); its post-attention norm. Architectures
        with another mixer override this (deepseek_v3/step.py: MLA; qwen3_next/step.py: gated
        attention and Gated DeltaNet)."""
        return self.ext.attn_block(self.attn[i], ctx.x, ctx.cos, ctx.sin, ctx.positions, ctx.storage, i,
                                   ctx.tables, ctx.qlens, ctx.ctxs, ctx.dmt, ctx.i8a)

    def _moe(self, ctx: StepContext, i: int, mlp: SparseMoE, h: torch.Tensor, routed: tuple | None = None) -> None:
        """route -> fetch (the provider) -> compute + combine (native), ctx.x updated in place.
        ``routed``: (ids, weights, distinct ids) already computed by the native router."""
        ext, provider, x = self.ext, mlp.provider, ctx.x
        allowed = provider.allowed_experts(mlp.layer) if routed is None else None
        if routed is not None:
            ids, w, uniq = routed
        elif allowed is None and mlp.router_override is None:
            # uniq: the routed experts, ascending (as the torch layer groups them)
            ids, w, uniq = self._route(mlp, i, h)
        else:  # restricted routing (self-speculative drafts: the torch router masks the rest),
            # or a declared router override (benchmarks replaying a routing trace)
            r = mlp.route(h, allowed)
            ids, w = r.ids.contiguous(), r.weights.contiguous()
            uniq = torch.unique(ids).tolist()
        for observe in mlp.observers:
            observe(mlp.layer, ids)
        dense = self.ffn[i]
        # routed: run_layers stopped here because an expert is not resident, so no shortcut
        fast = provider.resident_slots(mlp.layer, uniq) if allowed is None and routed is None else None
        if fast is not None:  # every expert resident for good: no acquire / release around it
            ext.ffn_block(x, h, ids, w, uniq, fast[1], fast[0], dense, ctx.dmt, ctx.i8a, self.acts[i])
            return

        # the experts may come in several acquires (a batch routes to more than the slots hold):
        # then each adds its contributions straight into one zeroed sum (ffn_block's direct), in
        # expert order, the shared/dense expert last, then x += sum, the bits one call gives (as
        # alone, or on the shortcut above): a token's result does not depend on its batch
        single = len(uniq) <= (provider.max_experts_per_acquire or len(uniq))
        total = x if single else torch.zeros_like(x)
        pre: dict[int, torch.Tensor] = {}  # outputs of the experts computed while others loaded

        def early(experts) -> None:  # the resident experts, while the layer's misses are read
            part = sorted(experts)
            resolved = provider.slot_table(mlp.layer, part, experts)
            if resolved is not None:
                pre.update(zip(part, ext.expert_outputs(h, ids, w, part, resolved[1], resolved[0], ctx.dmt,
                                                        ctx.i8a, self.acts[i])))

        def compute(start: int, part: list[int], experts) -> None:
            resolved = provider.slot_table(mlp.layer, part, experts)
            table, slots = resolved if resolved is not None else (EMPTY_IDS, [-1] * len(part))
            ext.ffn_block(total, h, ids, w, part, slots, table, dense if single else None, ctx.dmt, ctx.i8a,
                          self.acts[i], not single, [pre.get(e, EMPTY) for e in part] if pre else [])
            for e, slot in zip(part, slots):
                if slot < 0:  # computed through the expert's own forward
                    tok, k = (ids == e).nonzero(as_tuple=True)
                    y = self._expert(mlp, e, experts[e], h[tok]).float() * w[tok, k, None]
                    total.index_add_(0, tok, y)

        fetch_and_compute(provider, mlp.layer, uniq, h, compute, early)
        if not single:
            if dense is not None:
                ext.ffn_block(total, h, EMPTY_IDS, EMPTY, [], [], EMPTY_IDS, dense, ctx.dmt, ctx.i8a, None, True)
            x.add_(total)

    def _route(self, mlp: SparseMoE, i: int, h: torch.Tensor):
        """(ids, weights, distinct ids ascending) of layer i's router (native)."""
        return self.ext.route(h, self.routers[i], mlp.gate.top_k, mlp.gate.normalize)

    def _expert(self, mlp: SparseMoE, e: int, expert, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x through its torch forward (an expert without a native slot row)."""
        return expert.forward(x)
