"""One graph per pure decode step: embedding, every layer (attention, router, the device expert
cache's assign and copy launches, grouped experts, shared expert), final norm and LM head.

With the host cache, a sparse layer's experts cannot be captured with its attention: the host
must read the routed ids to acquire them (engine.cuda_graphs.feedforward). With the device cache
(engine.experts.device_cache) nothing in a decode step needs the host, so the whole step is one
graph per (bucket, dtype, block-table width, KV cache): the host stages the step's inputs (token
ids and the attention inputs of :class:`~engine.cuda_graphs.attention.StepInputs`), enqueues one
replay, and reads the logits for the sampler.

The per-layer callables are the per-layer graphs' own (attention, route, experts with the device
cache; attention + MLP for a dense layer), chained through their static buffers: layer i's
output buffer is copied into layer i+1's input buffer inside the graph. Padding rows copy row 0
(token and attention inputs), as in the per-layer graphs.

A step runs this way when every layer is a standard decoder layer (paged attention graphable,
a plain SwiGLU or a SparseMoE on a device expert cache whose slots hold the bucket's distinct
experts, no route observers, injected routing only where it is marked ``capturable``: reads
nothing from the host, as engine.experts.synthetic_store.TraceRouting(on_device=True)), the model runs the standard layer loop and
the step is pure decode; otherwise :func:`run_step` returns None and the per-layer path runs.
Capturing runs the body once more (a warm-up, as every capture here does): on that step the
device cache counts its uses twice and writes the same KV twice, and the outputs are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.cuda_graphs.attention import step_inputs
from engine.cuda_graphs.core import GraphSet, bucket_for
from engine.cuda_graphs.feedforward import device_cache_fits
from engine.layers.embedding import compute_dtype
from engine.layers.moe import SparseMoE


@dataclass
class _StepEntry:
    tokens: torch.Tensor  # [B] int64, padding rows: row 0's token
    logits: torch.Tensor | None = None  # [B, V] float32, made at capture
    hidden: torch.Tensor | None = None  # [B, H] the last layer's output buffer
    graphs: dict = field(default_factory=dict)
    broken: bool = False
    storage: object = None


def _standard(model) -> bool:
    from engine.models.base import CausalLM

    return type(model).run_layers is CausalLM.run_layers and type(model).final_logits is CausalLM.final_logits


def _layer_ok(layer, rows: int) -> bool:
    from engine.layers.attention import Attention
    from engine.layers.mlp import SwiGLU

    if "_layer_graphs" not in layer.__dict__ or not getattr(layer, "graph_attention", False):
        return False
    if type(layer.self_attn) is not Attention:
        return False
    mlp = layer.mlp
    if type(mlp) is SwiGLU:
        return True
    if not isinstance(mlp, SparseMoE) or type(mlp).forward is not SparseMoE.forward:
        return False
    override = mlp.router_override
    if mlp.observers or (override is not None and not getattr(override, "capturable", False)):
        return False
    p = mlp.provider
    return device_cache_fits(p, rows, mlp.gate.top_k) and p.allowed_experts(mlp.layer) is None


def run_step(model, gs: GraphSet, tokens: torch.Tensor, layout, kv, state, all_logits: bool,
             rows_arg) -> torch.Tensor | None:
    """The step's logits through one graph ([rows, V], every row a sequence's last), or None: the
    step cannot run that way (module docstring) and the caller runs the per-layer path."""
    if not gs.whole_step or state is not None or rows_arg is not None or not _standard(model):
        return None
    rows = tokens.shape[0]
    if not rows or len(layout.query_lens) != rows or any(n != 1 for n in layout.query_lens):
        return None
    bucket = bucket_for(rows, gs.buckets)
    layers = list(model.model.layers)
    if bucket is None or not layers or not all(_layer_ok(l, bucket) for l in layers):
        return None
    device = model.model.embed_tokens.weight.device
    cos, sin = model.rotary.cos_sin(layout.positions().to(device))
    step = step_inputs(gs, layout, kv, cos, sin, bucket, device)
    if step is None:
        return None
    dtype = compute_dtype(model)
    x = torch.empty(rows, model.config.hidden_size, dtype=dtype, device=device)  # shapes the entries
    parts = []  # per layer: (attention entry, feed-forward entry, layer, grouped layout or None)
    for layer in layers:
        graphs = layer.__dict__["_layer_graphs"]
        a = graphs.attn.entry(x, cos, sin, layout, kv, count=False)
        if a is None:
            return None
        top_k = layer.mlp.gate.top_k if isinstance(layer.mlp, SparseMoE) else None
        e = graphs.ff.entry(x, bucket, top_k)
        layout_ = graphs.ff.sparse_layout(layer.mlp, x) if top_k is not None else None
        if e.broken or (top_k is not None and layout_ is None):
            return None
        parts.append((a[0], e, layer, layout_))
    key = (bucket, dtype, step.tables.shape[1])
    entry = gs.steps.get(key)
    if entry is None or entry.storage is not kv.storage:
        entry = gs.steps[key] = _StepEntry(tokens=torch.zeros(bucket, dtype=torch.int64, device=device),
                                           storage=kv.storage)
    if entry.broken:
        return None
    gs.stage_into(entry.tokens, tokens.to(device), rows)
    # the body is only needed to capture; a captured graph replays what it bound then
    body = _body(model, parts, step, bucket, entry) if "step" not in entry.graphs else None
    if not gs.replay(entry, "step", body, "step"):
        return None
    model.tap_hidden(entry.hidden[:rows], layout)
    return entry.logits[:rows].clone()  # the static buffer is overwritten by the next replay


def _body(model, parts, step, bucket: int, entry: _StepEntry):
    """The step as one callable over static buffers (captured once per entry)."""
    fns = []
    for ae, e, layer, layout in parts:
        graphs = layer.__dict__["_layer_graphs"]
        attention = graphs.attn.fn(ae, step, bucket, e.x)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            tail = (graphs.ff.route_fn(mlp, e), graphs.ff.device_experts_fn(mlp, e, layout))
        else:
            tail = (graphs.ff.dense_fn(e),)
        fns.append((ae, attention, tail, e))
    embed, norm, head = model.model.embed_tokens, model.model.norm, model.lm_head
    entry.hidden = parts[-1][1].out

    def block() -> None:
        fns[0][0].x.copy_(embed(entry.tokens))
        for i, (ae, attention, tail, e) in enumerate(fns):
            attention()
            for fn in tail:
                fn()
            if i + 1 < len(fns):
                fns[i + 1][0].x.copy_(e.out)
        logits = head(norm(entry.hidden)).float()
        if entry.logits is None:
            entry.logits = torch.empty_like(logits)
        entry.logits.copy_(logits)

    return block
