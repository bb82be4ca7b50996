"""The attention half of a standard decoder layer as a graph on a pure decode step: the step's
per-row inputs staged once into static buffers every layer shares (:class:`StepInputs`), paged
decode attention through them (engine.layers.paged_attention_triton), padding rows on the KV
cache's scratch block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from engine.cuda_graphs.core import bucket_for, layer_label

if TYPE_CHECKING:
    from engine.cuda_graphs.core import Graph, GraphSet


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


def step_inputs(gs: "GraphSet", layout, kv, cos: torch.Tensor, sin: torch.Tensor, bucket: int,
                device: torch.device) -> StepInputs | None:
    """The static attention inputs of this decode step (``layout``: one new token per row),
    staged on the first layer's call and reused by the others; None when the KV cache cannot
    be read by the paged kernel (not paged, FP8, elsewhere) or has no scratch block for the
    padding rows (the layers then run eager)."""
    from engine.kv.paged import PagedKVCache
    from engine.layers.paged_attention_triton import CACHE_DTYPES

    st = gs.staged
    if st is not None and st[0] is layout and st[1] is kv and st[2] == bucket:
        return st[3]
    gs.staged = None
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
    s = gs.inputs.get(key)
    if s is None:
        i32 = dict(dtype=torch.int32, device=device)
        s = gs.inputs[key] = StepInputs(
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
    pad = gs.pad_index(bucket, rows, device)
    s.pad.copy_(pad)
    torch.index_select(cos, 0, pad, out=s.cos)
    torch.index_select(sin, 0, pad, out=s.sin)
    gs.staged = (layout, kv, bucket, s)
    return s


class AttentionGraphs:
    """The graphs of one decoder layer's attention half (``layer.input_layernorm``,
    ``layer.self_attn``) on pure decode steps, per (bucket, dtype, table width) and bound to one
    KV cache's storage."""

    def __init__(self, layer: torch.nn.Module, owner: "GraphSet") -> None:
        self.layer, self.owner = layer, owner
        self.entries: dict[tuple[int, torch.dtype, int], _AttnEntry] = {}

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, kv) -> torch.Tensor | None:
        """x + attention(input_layernorm(x)) through the layer's attention graph, or None: the
        caller runs the eager layer."""
        a = self.entry(x, cos, sin, layout, kv, count=True)
        if a is None:
            return None
        ae, step, bucket = a
        self.owner.stage_into(ae.x, x, x.shape[0])
        if not self.owner.replay(ae, "attention", self.fn(ae, step, bucket, ae.out), layer_label(self.layer)):
            self.owner.counters.attention_eager += 1
            return None
        return ae.out[:x.shape[0]]

    def entry(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, kv,
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
        step = step_inputs(self.owner, layout, kv, cos, sin, bucket, x.device) if ok else None
        e = None
        if step is not None:
            key = (bucket, x.dtype, step.tables.shape[1])
            e = self.entries.get(key)
            if e is None or e.storage is not kv.storage:  # a new cache: its storage is another tensor
                z = lambda: torch.zeros(bucket, x.shape[1], dtype=x.dtype, device=x.device)  # noqa: E731
                e = self.entries[key] = _AttnEntry(x=z(), out=z(), storage=kv.storage)
        if e is None or e.broken:
            if count:
                self.owner.counters.attention_eager += 1
            return None
        return e, step, bucket

    def fn(self, e: _AttnEntry, step: StepInputs, bucket: int, dst: torch.Tensor) -> Callable[[], None]:
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
