"""Per-layer CUDA graphs of a decoder layer's halves, for decode batch buckets.

A decode step on a GPU is launch-bound: a sparse layer's MoE half is ~20 kernel launches
(norm, router, softmax, top-k, renormalisation, slot-map gather, two grouped expert launches,
the shared expert's linears and gate, adds) of a few microseconds of work each, its attention
half another ~20. Here the static parts are captured once per (layer, bucket) and replayed as
graph launches. A whole-step graph is not the goal: it would replay only when every one of a
step's ~480 expert lookups were resident.

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

Routing injected per step (an instance ``forward`` on the router: trace replay in
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
what the seam replays is what a CUDA graph would. Opt-in on CUDA (``cuda_graphs`` option,
``MOESTREAM_CUDA_GRAPHS=1``) until a GPU run of bench/gpu_check.py has verified the capture; off
elsewhere unless :func:`enable` says otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch

from engine.errors import ConfigError

log = logging.getLogger(__name__)

MAX_ROWS = 64
VERIFY_DRAFTS = (4, 8)  # draft lengths whose verify shapes n * (k + 1) get their own bucket


def decode_buckets(max_rows: int = MAX_ROWS, drafts: Iterable[int] = VERIFY_DRAFTS) -> tuple[int, ...]:
    """Row counts that get a graph: powers of two up to ``max_rows`` and, for each draft length k,
    n * (k + 1) for n = 1, 2, 4, ... (a verify step of n sequences) up to ``max_rows``."""
    if max_rows < 1:
        raise ConfigError(f"max_rows must be >= 1, got {max_rows}")
    out = {1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows}
    for k in drafts:
        if k < 1:
            raise ConfigError(f"draft length must be >= 1, got {k}")
        n = 1
        while n * (k + 1) <= max_rows:
            out.add(n * (k + 1))
            n *= 2
    return tuple(sorted(out))


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= rows, or None (more rows than the largest: run eager)."""
    if rows < 1:
        raise ConfigError(f"a step has at least one row, got {rows}")
    for b in buckets:
        if b >= rows:
            return b
    return None


class Graph(Protocol):
    def capture(self, fn: Callable[[], None]) -> None:
        """Record ``fn`` (which reads and writes static buffers only); does not produce outputs."""

    def replay(self) -> None: ...


class RecordedGraph:
    """The CPU seam: capture keeps the callable (after one warm-up call, as CUDA capture does),
    replay re-runs it on whatever the static buffers hold."""

    def __init__(self, pool: object = None) -> None:
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        fn()  # warm-up, like CudaGraph's (compiles kernels there)
        self.fn = fn

    def replay(self) -> None:
        assert self.fn is not None, "replay before capture"
        self.fn()


class CudaGraph:
    """``torch.cuda.CUDAGraph`` over a warm-up on a side stream (Triton compiles, cuBLAS picks
    its workspace) and a capture into the model's shared memory pool."""

    def __init__(self, pool: object = None) -> None:
        self.pool = pool
        self.graph = None

    def capture(self, fn: Callable[[], None]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        # thread_local: the expert cache's I/O threads may copy on their stream meanwhile
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            fn()
        self.graph = g

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class GraphCounters:
    captures: int = 0
    replays: int = 0  # graph launches (a sparse layer's step: two)
    eager: int = 0  # feed-forward halves that ran eager (no bucket, restricted routing, ...)
    capture_failures: int = 0
    attention_eager: int = 0  # attention halves of standard layers that ran eager (not pure decode, ...)


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


@dataclass
class _AttnEntry:
    """Static buffers and graph of one layer's attention half for (bucket, dtype, table width),
    bound to one KV cache's storage."""

    x: torch.Tensor  # [B, H] the layer's input rows, padded
    out: torch.Tensor  # [B, H] x + o_proj(attention)
    storage: torch.Tensor  # the paged KV storage the graph writes and reads
    graphs: dict[str, Graph] = field(default_factory=dict)
    broken: bool = False


@dataclass
class StepInputs:
    """A decode step's per-row attention inputs for (bucket, table width, device), shared by every
    layer's attention graph and staged once per step (host -> device copies before the first
    layer replays). Padding rows (rows .. bucket-1) attend over the KV cache's scratch block
    (lens 1) and write their k/v there, so they never touch a sequence's KV."""

    cos: torch.Tensor  # [B, D] float32: the RoPE rows of each row's position (padding: row 0's)
    sin: torch.Tensor  # [B, D]
    tables: torch.Tensor  # [B, W] int32 block tables (padding rows: the scratch block)
    lens: torch.Tensor  # [B] int32 context length with the new token
    slots: torch.Tensor  # [B] int64 flat KV slot of the new token (block * BS + offset)
    pad: torch.Tensor  # [B] int64: 0 .. rows-1, then 0 (the output's padding rows copy row 0)


class LayerGraphs:
    """The graphs of one decoder layer's feed-forward half (``layer.post_attention_layernorm``,
    ``layer.mlp``), captured lazily per bucket on first use (when the step's experts are
    resident, so the warm-up computes on real slots)."""

    def __init__(self, layer: torch.nn.Module, owner: "GraphSet") -> None:
        self.layer, self.owner = layer, owner
        self.entries: dict[tuple[int, torch.dtype], _Entry] = {}
        self.attn_entries: dict[tuple[int, torch.dtype, int], _AttnEntry] = {}

    # ---- the step -------------------------------------------------------------------------
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

    def run_layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, kv) -> torch.Tensor | None:
        """The whole layer on a pure decode step as one graph per layer half that needs no host
        in between: attention + route (then the host's acquire, then the experts graph) for a
        sparse layer, attention + MLP for a dense one; None: the caller runs the halves apart
        (:func:`attention_residual`, :func:`mlp_residual`)."""
        from engine.layers.mlp import SwiGLU
        from engine.layers.moe import SparseMoE

        a = self._attention_entry(x, cos, sin, layout, kv, count=False)
        if a is None:
            return None
        ae, step, bucket = a
        rows, mlp = x.shape[0], self.layer.mlp
        if isinstance(mlp, SparseMoE):
            grouped = self._sparse_layout(mlp, x)
            if grouped is None or "forward" in vars(mlp.gate):
                return None  # the halves apart: the feed-forward half decides how it runs
            e, name = self._entry(x, bucket, mlp.gate.top_k), "attention+route"
            tail = self._route_fn(mlp, e)
        elif type(mlp) is SwiGLU:
            e, name = self._entry(x, bucket, None), "attention+mlp"
            tail = self._dense_fn(e)
        else:
            return None
        if e.broken:
            return None
        attention = self._attention_fn(ae, step, bucket, e.x)

        def block() -> None:
            attention()
            tail()

        self._stage_into(ae.x, x, rows)
        if not self._replay(ae, name, block):
            return None  # ae is broken now: the halves apart run attention eager
        if name == "attention+mlp":
            return e.out[:rows]
        return self._experts(mlp, e, e.x[:rows], rows, grouped)

    def run_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, kv) -> torch.Tensor | None:
        """x + attention(input_layernorm(x)) through the layer's attention graph, or None: the
        caller runs the eager layer."""
        a = self._attention_entry(x, cos, sin, layout, kv, count=True)
        if a is None:
            return None
        ae, step, bucket = a
        self._stage_into(ae.x, x, x.shape[0])
        if not self._replay(ae, "attention", self._attention_fn(ae, step, bucket, ae.out)):
            self.owner.counters.attention_eager += 1
            return None
        return ae.out[:x.shape[0]]

    def _attention_entry(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, kv,
                         count: bool) -> "tuple[_AttnEntry, StepInputs, int] | None":
        """The attention entry and staged step inputs when this step's attention half can run as
        a graph: a pure decode step (one new token per sequence) of a standard attention layer
        on a paged KV cache the Triton kernel can read; else None (counted if ``count``)."""
        from engine.layers import paged_attention_triton as PA
        from engine.layers.attention import Attention

        attn = self.layer.self_attn
        rows = x.shape[0]
        bucket = bucket_for(rows, self.owner.buckets) if rows else None
        ok = (bucket is not None and self.owner.attention and type(attn) is Attention
              and len(layout.query_lens) == rows and all(n == 1 for n in layout.query_lens)
              and PA.supports(x.device))
        step = self.owner.step_inputs(layout, kv, cos, sin, bucket, x.device) if ok else None
        e = None
        if step is not None:
            key = (bucket, x.dtype, step.tables.shape[1])
            e = self.attn_entries.get(key)
            if e is None or e.storage is not kv.storage:  # a new cache: its storage is another tensor
                z = lambda: torch.zeros(bucket, x.shape[1], dtype=x.dtype, device=x.device)  # noqa: E731
                e = self.attn_entries[key] = _AttnEntry(x=z(), out=z(), storage=kv.storage)
        if e is None or e.broken:
            if count:
                self.owner.counters.attention_eager += 1
            return None
        return e, step, bucket

    def _attention_fn(self, e: _AttnEntry, step: StepInputs, bucket: int, dst: torch.Tensor) -> Callable[[], None]:
        """dst = e.x + o_proj(paged attention of input_layernorm(e.x)), the new k/v written; the
        padding rows of dst copy row 0, so a feed-forward half replayed on dst routes them like
        row 0 (no expert beyond the real rows')."""
        from engine.layers import paged_attention_triton as PA
        from engine.layers.rope import apply_rotary

        attn, norm, storage = self.layer.self_attn, self.layer.input_layernorm, e.storage
        li, nh, nkv, d = attn.layer, attn.nh, attn.nkv, attn.d

        def block() -> None:
            h = norm(e.x)
            q = attn.q_proj(h).view(bucket, nh, d)
            k = attn.k_proj(h).view(bucket, nkv, d)
            v = attn.v_proj(h).view(bucket, nkv, d)
            if attn.q_norm is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
            PA.write_kv(storage[li, 0], storage[li, 1], step.slots, k, v)
            o = PA.decode(q.contiguous(), storage[li, 0], storage[li, 1], step.tables, step.lens)
            torch.index_select(e.x + attn.o_proj(o.view(bucket, nh * d)), 0, step.pad, out=dst)

        return block

    def _entry(self, x: torch.Tensor, bucket: int, top_k: int | None) -> _Entry:
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

    def _stage(self, e: _Entry, x: torch.Tensor, rows: int) -> None:
        """x into the static input; padding rows copy row 0."""
        self._stage_into(e.x, x, rows)

    def _stage_into(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        if rows == dst.shape[0]:
            dst.copy_(src)
        else:
            torch.index_select(src.to(dst.dtype), 0, self.owner.pad_index(dst.shape[0], rows, src.device), out=dst)

    def _replay(self, e: "_Entry | _AttnEntry", name: str, fn: Callable[[], None]) -> bool:
        """Replay graph ``name`` of ``e``, capturing it from ``fn`` first; False: capture failed
        (this entry runs eager from now on)."""
        g = e.graphs.get(name)
        if g is None:
            g = self.owner.factory(self.owner.pool())
            try:
                g.capture(fn)
            except Exception as err:  # an op that cannot be captured: eager for this entry
                if self.owner.factory is RecordedGraph:
                    raise
                log.warning("CUDA graph capture of layer %s (%s) failed, running eager: %s: %s",
                            getattr(self.layer.self_attn, "layer", "?"), name, type(err).__name__, err)
                e.broken = True
                self.owner.counters.capture_failures += 1
                return False
            e.graphs[name] = g
            self.owner.counters.captures += 1
        g.replay()
        self.owner.counters.replays += 1
        return True

    def _dense(self, x: torch.Tensor, rows: int, bucket: int) -> torch.Tensor | None:
        e = self._entry(x, bucket, None)
        if e.broken:
            return None
        self._stage(e, x, rows)
        return e.out[:rows] if self._replay(e, "dense", self._dense_fn(e)) else None

    def _dense_fn(self, e: _Entry) -> Callable[[], None]:
        norm, mlp = self.layer.post_attention_layernorm, self.layer.mlp

        def block() -> None:
            e.out.copy_(e.x + mlp(norm(e.x)))

        return block

    @staticmethod
    def _sparse_layout(mlp, x: torch.Tensor):
        """The grouped kernels' layout when this MoE half can run through the graphs, else None."""
        from engine.layers.moe import SparseMoE

        provider, top_k = mlp.provider, getattr(mlp.gate, "top_k", None)
        if type(mlp).forward is not SparseMoE.forward or top_k is None:
            return None  # an architecture with its own MoE forward
        if provider is None or provider.allowed_experts(mlp.layer) is not None:
            return None  # no experts attached, or drafting on resident experts only
        return mlp._grouped_layout(provider, x)  # None: no slot pool here, or a format the kernels lack

    def _route_fn(self, mlp, e: _Entry) -> Callable[[], None]:
        norm = self.layer.post_attention_layernorm

        def route() -> None:
            h = norm(e.x)
            r = mlp.gate(h)
            e.h.copy_(h)
            e.weights.copy_(r.weights)
            e.ids.copy_(r.ids)

        return route

    def _sparse(self, mlp, x: torch.Tensor, rows: int, bucket: int) -> torch.Tensor | None:
        layout = self._sparse_layout(mlp, x)
        if layout is None:
            return None
        e = self._entry(x, bucket, mlp.gate.top_k)
        if e.broken:
            return None
        norm = self.layer.post_attention_layernorm
        if "forward" in vars(mlp.gate):
            # routing injected per step (a trace replay: engine.experts.synthetic_store) keeps
            # Python state a graph would freeze: route eagerly on the real rows, pad into the
            # static buffers, graph the rest
            h = norm(x)
            r = mlp.gate(h)
            for dst, src in ((e.x, x), (e.h, h), (e.weights, r.weights), (e.ids, r.ids)):
                self._stage_into(dst, src, rows)
        else:
            self._stage(e, x, rows)
            if not self._replay(e, "route", self._route_fn(mlp, e)):
                return None
        return self._experts(mlp, e, x, rows, layout)

    def _experts(self, mlp, e: _Entry, x: torch.Tensor, rows: int, layout) -> torch.Tensor:
        """After routing (e.h, e.weights, e.ids hold the bucket's rows): the cache's acquire, then
        the experts graph (or the eager combine where it cannot run); x: the half's input rows."""
        from engine.layers.moe import Routing

        provider = mlp.provider
        h, ids = e.h[:rows], e.ids[:rows]
        for observe in mlp.observers:
            observe(mlp.layer, ids)
        # every bucket row's experts (padding copies row 0: the same ones), so no replayed read
        # of the slot map can name a slot this acquire did not pin
        uniq = torch.unique(e.ids).tolist()
        limit = provider.max_experts_per_acquire
        if limit is not None and len(uniq) > limit:  # acquired in chunks: the eager combine
            routing = Routing(e.weights[:rows].clone(), ids.clone())
            return x + mlp.experts_and_shared(h.clone(), routing, provider)
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

            if not self._replay(e, "experts", combine):
                routing = Routing(e.weights[:rows], ids)
                return x + mlp.experts_and_shared(h.clone(), routing, _Acquired(provider, experts))
        finally:
            provider.release(mlp.layer, uniq)
        return e.out[:rows]


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


class GraphSet:
    """A model's per-layer graphs: the factory, the buckets, the shared pool and counters."""

    def __init__(self, factory: Callable[[object], Graph], buckets: tuple[int, ...],
                 attention: bool = True) -> None:
        self.factory, self.buckets = factory, buckets
        self.attention = attention  # graph the attention halves of pure decode steps too
        self._pool: object = None
        self.counters = GraphCounters()
        self.auto, self.generation = False, -1  # made by prepare() from the option (and when)
        self._pad: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self._inputs: dict[tuple[int, int, torch.device], StepInputs] = {}
        self._staged: tuple | None = None  # (layout, kv, bucket, StepInputs) of the step staged last

    def pool(self) -> object:
        """The memory pool every CUDA graph of the model captures into (made on first use)."""
        if self._pool is None and self.factory is CudaGraph:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def pad_index(self, bucket: int, rows: int, device: torch.device) -> torch.Tensor:
        """[bucket] int64 on ``device``: 0..rows-1, then 0 for every padding row."""
        key = (bucket, rows, device)
        t = self._pad.get(key)
        if t is None:
            idx = torch.arange(bucket)
            idx[rows:] = 0
            t = self._pad[key] = idx.to(device)
        return t


    def step_inputs(self, layout, kv, cos: torch.Tensor, sin: torch.Tensor, bucket: int,
                    device: torch.device) -> StepInputs | None:
        """The static attention inputs of this decode step (``layout``: one new token per row),
        staged on the first layer's call and reused by the others; None when the KV cache cannot
        be read by the paged kernel (not paged, FP8, elsewhere) or has no scratch block for the
        padding rows (the layers then run eager)."""
        from engine.kv.paged import PagedKVCache
        from engine.layers.paged_attention_triton import CACHE_DTYPES

        st = self._staged
        if st is not None and st[0] is layout and st[1] is kv and st[2] == bucket:
            return st[3]
        self._staged = None
        if not isinstance(kv, PagedKVCache) or kv.dtype not in CACHE_DTYPES or kv.storage.device != device:
            return None
        rows = len(layout.seq_ids)
        scratch = kv.scratch_block() if rows < bucket else 0
        view = kv.native_view(layout, device) if scratch is not None else None
        if view is None:
            return None
        tables, bs = view[1], kv.block_size
        width = max(8, 1 << (tables.shape[1] - 1).bit_length())  # a graph per power of two of blocks
        key = (bucket, width, device)
        s = self._inputs.get(key)
        if s is None:
            i32 = dict(dtype=torch.int32, device=device)
            s = self._inputs[key] = StepInputs(
                cos=torch.zeros(bucket, cos.shape[1], dtype=cos.dtype, device=device),
                sin=torch.zeros(bucket, sin.shape[1], dtype=sin.dtype, device=device),
                tables=torch.zeros(bucket, width, **i32), lens=torch.zeros(bucket, **i32),
                slots=torch.zeros(bucket, dtype=torch.int64, device=device),
                pad=torch.zeros(bucket, dtype=torch.int64, device=device))
        host_tables = torch.zeros(bucket, width, dtype=torch.int32)
        host_tables[:rows, :tables.shape[1]] = tables
        host_tables[rows:, 0] = scratch
        pos = torch.tensor(layout.context_lens, dtype=torch.int64)
        lens = torch.ones(bucket, dtype=torch.int32)
        lens[:rows] = (pos + 1).to(torch.int32)
        slots = torch.full((bucket,), scratch * bs, dtype=torch.int64)
        slots[:rows] = host_tables[:rows].gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs
        s.tables.copy_(host_tables)
        s.lens.copy_(lens)
        s.slots.copy_(slots)
        pad = self.pad_index(bucket, rows, device)
        s.pad.copy_(pad)
        torch.index_select(cos, 0, pad, out=s.cos)
        torch.index_select(sin, 0, pad, out=s.sin)
        self._staged = (layout, kv, bucket, s)
        return s


def _layers(model) -> list[torch.nn.Module]:
    return [l for l in model.model.layers if hasattr(l, "post_attention_layernorm") and hasattr(l, "mlp")]


def enable(model, factory: Callable[[object], Graph] | None = None,
           buckets: tuple[int, ...] | None = None, attention: bool = True) -> GraphSet:
    """Run ``model``'s feed-forward halves (and, with ``attention``, the attention halves of pure
    decode steps) through per-layer graphs from ``factory`` (default :class:`CudaGraph`) for
    ``buckets`` (default :func:`decode_buckets`), on any device (the tests pass
    :class:`RecordedGraph` on the CPU). Replaces graphs captured before."""
    gs = GraphSet(factory or CudaGraph, tuple(sorted(buckets or decode_buckets())), attention)
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
    """Called by the model's forward: the graphs in force (enable / disable win; otherwise on for
    CUDA when the ``cuda_graphs`` option is on (opt-in), and off elsewhere)."""
    from engine.options import generation, options

    gs = model.__dict__.get("_graph_set")
    if gs is not None and gs is not False and gs.auto and gs.generation != generation():
        reset(model)  # chosen by the option, which changed since: decide again
        gs = None
    if gs is None:
        if device.type != "cuda" or not options().cuda_graphs:
            return None
        gs = enable(model)
        gs.auto, gs.generation = True, generation()
    if gs:
        gs._staged = None  # a new forward: its attention inputs are staged afresh
    return gs or None


def graph_set(model) -> GraphSet | None:
    """The model's GraphSet (counters), if graphs are on."""
    return model.__dict__.get("_graph_set") or None


def decoder_layer(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  layout, kv) -> torch.Tensor:
    """A standard decoder layer's step: on a pure decode step through its merged graphs
    (attention + route, the acquire, experts; or attention + MLP) when graphs are on and can run,
    else the two halves (:func:`attention_residual`, :func:`mlp_residual`)."""
    graphs = layer.__dict__.get("_layer_graphs")
    if graphs is not None:
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
    return x + layer.self_attn(layer.input_layernorm(x), cos, sin, layout, kv)


def mlp_residual(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A decoder layer's second half, ``x + mlp(post_attention_layernorm(x))``: through its
    graphs when they are on and can run, else eager (the reference)."""
    graphs = layer.__dict__.get("_layer_graphs")
    if graphs is not None:
        out = graphs.run(x)
        if out is not None:
            return out
    return x + layer.mlp(layer.post_attention_layernorm(x))
