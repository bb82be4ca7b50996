"""Per-layer CUDA graphs of a decoder layer's halves, for decode batch buckets.

A decode step on a GPU is launch-bound: a sparse layer's MoE half is ~20 kernel launches
(norm, router, softmax, top-k, renormalisation, slot-map gather, two grouped expert launches,
the shared expert's linears and gate, adds) of a few microseconds of work each, its attention
half another ~20. Here the static parts are captured once per (layer, bucket) and replayed as
graph launches. With the host cache a whole-step graph could replay only when every one of a
step's ~480 expert lookups were resident; with the device expert cache
(engine.experts.device_cache) the lookups run inside the graph, and a pure decode step is one
graph (engine.cuda_graphs.step_graph: ``enable(..., whole_step=True)`` or the ``step_graph``
option).

A sparse layer of a pure decode step (every sequence one new token) on a paged KV cache is two
graphs, split where the host must see the routing:

    attention  a = input_layernorm(x); q, k, v (+ q/k norm, RoPE from the step's cos/sin rows);
    + route    k, v written at the step's slots; paged decode attention through the step's block
               tables and context lengths (engine.layers.paged_attention_triton); x = x + o_proj;
               h = post_attention_layernorm(x);  weights, ids = router(h)        [B rows]
    (host)     the expert cache acquires the distinct ids: misses are copied in (and the device
               slot map updated) before the replay below; prefetch for the next layers starts
    experts    pair = slot_map[layer][ids];  y = grouped_moe(h, weights, pair) (+ shared expert);
               out = x + y

A dense (SwiGLU) layer of such a step is one graph (attention + MLP). Other steps (prefill,
mixed, verify: see below for attention) run the halves apart: an attention graph where it can,
else eager attention, then a route graph (or, for a dense layer, one graph: x + mlp(norm(x)))
and the experts graph. The slot map is read by the replay, on the device, so a graph follows
whatever slots the cache chose this step.
The attention graph reads the step's inputs from static buffers shared by every layer
(:class:`StepInputs`: cos/sin rows, block tables padded to a power-of-two width, context
lengths, KV slots), staged once per step before the first layer replays, so one graph per
(layer, bucket, width) serves every context length up to width x block size. Padding rows
attend over the KV cache's scratch block and write their k/v there, never into a sequence's
blocks, and the merged graph's padding rows of x copy row 0 before the route, so they route
like row 0. Prefill, mixed and verify steps, other attention modules (sinks, MLA, gated, linear
attention) and other KV caches (contiguous, FP8) run the attention half eager.

Buckets: rows 1, 2, 4, ..., 64 and the speculative verify shapes n (k + 1) for draft lengths k;
a step of ``rows`` rows uses the smallest bucket >= rows. Its inputs go into the bucket's static
buffer with the padding rows copied from row 0 (one index_select), so padding routes to experts
row 0 already uses: it never reads a slot the cache did not acquire, and it adds no expert. Rows
never mix (norms, linears and the grouped kernels are per row), so a row's output does not
depend on the padding. The result is a view of the graph's static output, valid until the same
(layer, bucket) replays (the next step: the caller consumes it before).

Routing injected per step (a layer's declared ``router_override``: trace replay in
engine.experts.synthetic_store, bench/expert_cache.py) runs eagerly on the real rows and is
padded into the static buffers; the experts graph replays as usual.

The eager layers are the reference, and run whenever a graph cannot: more rows than the largest
bucket, restricted routing (self-speculative drafts), a provider without a slot pool, experts
computed on the CPU, a step that needs more distinct experts than the cache can pin at once.

Graphs come from a factory: :class:`CudaGraph` captures with ``torch.cuda.CUDAGraph`` (one memory
pool shared by all graphs of a model: they replay one after another on one stream);
:class:`RecordedGraph` is the CPU seam the tests use: it records the callable at capture and
re-runs it at replay. The callables communicate only through static buffers and tensors bound
at capture (the slot pool, the slot map row), never through Python values computed per step, so
what the seam replays is what a CUDA graph would. On by default on CUDA (``cuda_graphs`` option,
``MOESTREAM_CUDA_GRAPHS=0`` turns them off; bench/gpu_check.py verified the capture against the
eager layers on an H200, 2026-12-04); off elsewhere unless :func:`enable` says otherwise.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.cuda_graphs.core import (MAX_ROWS, VERIFY_DRAFTS, CudaGraph, Graph, GraphCounters, GraphSet,
                                     RecordedGraph, bucket_for, decode_buckets, layer_label)
from engine.cuda_graphs.attention import AttentionGraphs, StepInputs
from engine.cuda_graphs.feedforward import FeedForwardGraphs

__all__ = ["MAX_ROWS", "VERIFY_DRAFTS", "AttentionGraphs", "CudaGraph", "FeedForwardGraphs", "Graph",
           "GraphCounters", "GraphSet", "LayerGraphs", "RecordedGraph", "StepInputs", "attention_residual",
           "bucket_for", "decode_buckets", "disable", "enable", "graph_layer", "graph_set", "mlp_residual",
           "prepare", "reset"]


class LayerGraphs:
    """One decoder layer's graphs: its attention half's (:class:`AttentionGraphs`) and its
    feed-forward half's (:class:`FeedForwardGraphs`), and the merged graph of a pure decode step
    (attention + route, or attention + MLP) that needs no host in between."""

    def __init__(self, layer: torch.nn.Module, owner: GraphSet) -> None:
        self.layer, self.owner = layer, owner
        self.attn = AttentionGraphs(layer, owner)
        self.ff = FeedForwardGraphs(layer, owner)

    @property
    def entries(self) -> dict:
        """The feed-forward entries per (bucket, dtype); the merged graphs live there too."""
        return self.ff.entries

    @property
    def attn_entries(self) -> dict:
        """The attention entries per (bucket, dtype, table width)."""
        return self.attn.entries

    def run(self, x: torch.Tensor) -> torch.Tensor | None:
        """x + mlp(norm(x)) through the graphs, or None: the caller runs the eager layer."""
        return self.ff.run(x)

    def run_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, kv) -> torch.Tensor | None:
        """x + attention(input_layernorm(x)) through the layer's attention graph, or None: the
        caller runs the eager layer."""
        return self.attn.run(x, cos, sin, layout, kv)

    def run_layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, kv) -> torch.Tensor | None:
        """The whole layer on a pure decode step as one graph per layer half that needs no host
        in between: attention + route (then the host's acquire, then the experts graph) for a
        sparse layer, attention + MLP for a dense one; None: the caller runs the halves apart
        (:func:`attention_residual`, :func:`mlp_residual`)."""
        from engine.layers.mlp import SwiGLU
        from engine.layers.moe import SparseMoE

        a = self.attn.entry(x, cos, sin, layout, kv, count=False)
        if a is None:
            return None
        ae, step, bucket = a
        rows, mlp = x.shape[0], self.layer.mlp
        if isinstance(mlp, SparseMoE):
            grouped = self.ff.sparse_layout(mlp, x)
            if grouped is None or mlp.router_override is not None:
                return None  # the halves apart: the feed-forward half decides how it runs
            e, name = self.ff.entry(x, bucket, mlp.gate.top_k), "attention+route"
            tail = self.ff.route_fn(mlp, e)
        elif type(mlp) is SwiGLU:
            e, name = self.ff.entry(x, bucket, None), "attention+mlp"
            tail = self.ff.dense_fn(e)
        else:
            return None
        if e.broken:
            return None
        attention = self.attn.fn(ae, step, bucket, e.x)

        def block() -> None:
            attention()
            tail()

        self.owner.stage_into(ae.x, x, rows)
        if not self.owner.replay(ae, name, block, layer_label(self.layer)):
            return None  # ae is broken now: the halves apart run attention eager
        if name == "attention+mlp":
            return e.out[:rows]
        return self.ff.experts(mlp, e, e.x[:rows], rows, grouped)


def _layers(model) -> list[torch.nn.Module]:
    return [l for l in model.model.layers if hasattr(l, "post_attention_layernorm") and hasattr(l, "mlp")]


def enable(model, factory: Callable[[object], Graph] | None = None,
           buckets: tuple[int, ...] | None = None, attention: bool = True, whole_step: bool = False) -> GraphSet:
    """Run ``model``'s feed-forward halves (and, with ``attention``, the attention halves of pure
    decode steps) through per-layer graphs from ``factory`` (default :class:`CudaGraph`) for
    ``buckets`` (default :func:`decode_buckets`), on any device (the tests pass
    :class:`RecordedGraph` on the CPU). ``whole_step``: a pure decode step whose every layer can
    runs as one graph (engine.cuda_graphs.step_graph: needs the device expert cache). Replaces
    graphs captured before."""
    gs = GraphSet(factory or CudaGraph, tuple(sorted(buckets or decode_buckets())), attention, whole_step)
    for layer in _layers(model):
        layer.__dict__["_layer_graphs"] = LayerGraphs(layer, gs)
    model.__dict__["_graph_set"] = gs
    return gs


def disable(model) -> None:
    """The eager layers only, whatever the device and option (drops captured graphs)."""
    for layer in _layers(model):
        layer.__dict__.pop("_layer_graphs", None)
    model.__dict__["_graph_set"] = False


def reset(model) -> None:
    """Forget the graphs and the explicit choice: the next forward decides again (call after
    swapping modules or weights: captured graphs read the old tensors)."""
    for layer in _layers(model):
        layer.__dict__.pop("_layer_graphs", None)
    model.__dict__.pop("_graph_set", None)


def prepare(model, device: torch.device) -> GraphSet | None:
    """Called by engine.executor before a torch-layers step: the graphs in force (enable / disable win; otherwise on for
    CUDA when the ``cuda_graphs`` option is on (the default), and off elsewhere)."""
    from engine.options import generation, options

    gs = model.__dict__.get("_graph_set")
    if gs is not None and gs is not False and gs.auto and gs.generation != generation():
        reset(model)  # chosen by the option, which changed since: decide again
        gs = None
    if gs is None:
        if device.type != "cuda" or not options().cuda_graphs:
            return None
        gs = enable(model, whole_step=options().step_graph)
        gs.auto, gs.generation = True, generation()
    if gs:
        gs.staged = None  # a new forward: its attention inputs are staged afresh
    return gs or None


def graph_set(model) -> GraphSet | None:
    """The model's GraphSet (counters), if graphs are on."""
    return model.__dict__.get("_graph_set") or None


def graph_layer(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layout, kv, state=None) -> torch.Tensor:
    """One layer of a step with graphs on (engine.executor's layer runner): a standard decoder
    layer on a pure decode step through its merged graphs (attention + route, the acquire,
    experts; or attention + MLP) where they can run, else the two halves (:func:`attention_residual`
    or, for a layer whose mixer never runs as a graph, its eager mixer; then :func:`mlp_residual`)."""
    graphs = layer.__dict__.get("_layer_graphs")
    if graphs is None:
        return layer(x, cos, sin, layout, kv, state)
    if not layer.graph_attention:
        return mlp_residual(layer, layer.mixer_residual(x, cos, sin, layout, kv, state))
    out = graphs.run_layer(x, cos, sin, layout, kv)
    if out is not None:
        return out
    return mlp_residual(layer, attention_residual(layer, x, cos, sin, layout, kv))


def attention_residual(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       layout, kv) -> torch.Tensor:
    """A decoder layer's first half, ``x + self_attn(input_layernorm(x), ...)``: through its
    attention graph on a pure decode step when graphs are on and can run, else eager (the
    reference)."""
    graphs = layer.__dict__.get("_layer_graphs")
    if graphs is not None:
        out = graphs.run_attention(x, cos, sin, layout, kv)
        if out is not None:
            return out
    return layer.mixer_residual(x, cos, sin, layout, kv)


def mlp_residual(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A decoder layer's second half, ``x + mlp(post_attention_layernorm(x))``: through its
    graphs when they are on and can run, else eager (the reference)."""
    graphs = layer.__dict__.get("_layer_graphs")
    if graphs is not None:
        out = graphs.run(x)
        if out is not None:
            return out
    return layer.ffn_residual(x)
