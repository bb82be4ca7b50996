"""Dense linears on the quantized kernels: the quant layer swaps them into a built model.

Decode reads every dense weight once per token, so their bytes bound tokens/s as much as the
experts' do. ``quantize_dense(model, "bf16")`` halves them (and ``int8`` quarters them) by
replacing each attention / dense-MLP / shared-expert / LM-head ``nn.Linear`` with a
:class:`QuantLinear` computed by ``engine.quant.kernels.qlinear`` (fp32 activations, fp32
accumulation). Embeddings, norms and routers stay as they are: routers decide which experts
run, and their cost is negligible. The model code never knows (docs/design.md §7, rule 2).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.errors import ConfigError
from engine.hugepages import huge_empty, return_freed_heap
from engine.quant.formats import QuantFormat, QuantizedTensor, bytes_for, layout_for

DENSE_FORMATS = ("fp32", "bf16", "int8")
DENSE_CHOICES = ("auto",) + DENSE_FORMATS  # what a user may ask for: auto is resolve_dense's pick
# the LM head may go lower: at vocab 32000 x hidden 1024 it is 33 MB a token at int8 (a quarter of
# what a token of the 1.3B test MoE reads), 18 MB at int4 g64 (4.5 bits)
HEAD_FORMATS = ("fp32", "bf16", "int8", "int4")
# what a model gets unless told (generate, serve, demo, a deployment, load_from_store): "auto", int8
# where the kernels multiply int8 weights by int16 activations (a CPU with AVX512-VNNI or AVX2:
# 1.4-2.5x bf16's decode, within the perplexity/KL bound and the same chat answers), bf16
# elsewhere (the GPU path). An int4 head fails the
# bound. bench/dense_formats.py, docs/quantization.md#the-default-dense-format
DEFAULT_DENSE = "auto"
DENSE_GROUP = 64  # quantize_dense's group size: one fp16 scale (and min, int4) per 64 weights


class QuantLinear(nn.Module):
    """y = x @ dequantize(q).T (+ bias), on the fastest kernel for ``q``."""

    def __init__(self, q: QuantizedTensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.q = q
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: QuantFormat,
                    release: Callable[[torch.Tensor], object] | None = None,
                    out: QuantizedTensor | None = None) -> "QuantLinear":
        """``release``: handed each block of the weight's rows once quantized (quantize_by_rows);
        ``out``: where the quantized weight goes (views of a DenseArena), None: its own memory."""
        from engine.quant.reference import quantize_by_rows

        # by blocks of rows from the weight as it is (a bf16 view of the store's file when the
        # model was built with as_stored): no float32 copy of the whole weight
        return cls(quantize_by_rows(linear.weight.detach(), fmt, release=release, out=out), linear.bias)

    def _apply(self, fn, recurse=True):
        """``module.to(device)`` / ``.cuda()`` move the quantized weight too (it is neither a
        parameter nor a buffer: a dtype cast must never touch its codes, only a move may)."""
        super()._apply(fn, recurse)
        target = fn(torch.empty(0)).device
        if target != self.q.device:
            self.q = self.q.to(target)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.quant.kernels import qlinear

        y = qlinear(x.float(), self.q)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.q.fmt.name}"


class DenseArena:
    """One buffer for every converted dense weight, in the order a decode step reads them, on
    2 MiB pages where the CPU's kernel allows (engine.hugepages): decode streams all of them
    every token (the 1.3B test MoE's int8 attention and head: 64 of its 166 MB a token), and as
    separate allocations of 0.25-1 MB they sat on 4 KiB pages, a TLB miss and a stop for the
    hardware prefetcher every 4 KiB. Each weight is quantized straight into its place, block of
    rows by block (quantize_by_rows' ``out``): no second copy, and the arena's pages are faulted in
    as they are written."""

    def __init__(self, shapes: list[tuple[int, int]], fmts: list[QuantFormat]) -> None:
        self.shapes, self.fmts, self.offsets = shapes, fmts, [0]
        for shape, fmt in zip(shapes, fmts):
            self.offsets.append(self.offsets[-1] + bytes_for(shape, fmt))
        self.buf = huge_empty(self.offsets[-1]) if self.offsets[-1] else None

    def view(self, i: int) -> QuantizedTensor | None:
        """Weight ``i``'s place (of the shapes and formats given): a QuantizedTensor of views of
        the arena, its contents unwritten; None without an arena."""
        if self.buf is None:
            return None
        return QuantizedTensor.from_buffer(self.buf, layout_for(self.shapes[i], self.fmts[i]),
                                           offset=self.offsets[i], source="dense arena")


def dense_linears(model) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of every dense linear that quantize_dense may swap."""
    from engine.layers.mlp import SwiGLU
    from engine.layers.moe import SparseMoE

    own = getattr(model, "dense_linear_slots", None)
    if own is not None:  # architectures with their own layers name their linears
        return own()
    out: list[tuple[nn.Module, str]] = []
    for layer in model.model.layers:
        out += [(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        mlps = [layer.mlp] if isinstance(layer.mlp, SwiGLU) else []
        if isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert is not None:
            mlps.append(layer.mlp.shared_expert)
        for mlp in mlps:
            out += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
    out.append((model, "lm_head"))
    return out


def resolve_dense(fmt_name: str, device: str | torch.device = "cpu") -> str:
    """The dense format ``fmt_name`` names on ``device``: itself, or for "auto" int8 on a CPU whose
    kernels take integer activations (engine.quant.kernels.int8_activations: AVX512-VNNI or AVX2 and the
    option on), else bf16. A ConfigError names the allowed values."""
    if fmt_name not in DENSE_CHOICES:
        raise ConfigError(f"dense format {fmt_name!r}; allowed: {', '.join(DENSE_CHOICES)}")
    if fmt_name != "auto":
        return fmt_name
    if torch.device(device).type != "cpu":
        return "bf16"
    from engine.quant.kernels import int8_activations

    return "int8" if int8_activations() else "bf16"


def quantize_dense(model, fmt_name: str, group_size: int = DENSE_GROUP, head: str | None = None,
                   release: Callable[[torch.Tensor], object] | None = None):
    """Swap the model's dense linears for ``fmt_name`` ("fp32" = leave them; "bf16"; "int8"
    with ``group_size``, falling back to bf16 for a weight whose in-dim the group does not
    divide; "auto": :func:`resolve_dense` on the CPU); the LM head for ``head`` (one of
    HEAD_FORMATS; None: as the others). ``release(weight)``: called with each replaced weight
    once converted (a store's mapped file drops its pages: the peak holds one weight as stored,
    not all of them). Returns the model."""
    fmt_name = resolve_dense(fmt_name)
    if head is not None and head not in HEAD_FORMATS:
        raise ConfigError(f"LM head format {head!r}; allowed: {', '.join(HEAD_FORMATS)}")
    fallback = QuantFormat("bf16", group_size)
    plan = []  # (parent, name, format) of every linear converted, in model order; shapes for the arena
    shapes = []
    for parent, name in dense_linears(model):
        linear = getattr(parent, name)
        want = head if (parent is model and head is not None) else fmt_name
        if not isinstance(linear, nn.Linear) or want == "fp32":
            continue
        fmt = QuantFormat(want, group_size)
        plan.append((parent, name, fmt if not fmt.grouped or linear.in_features % group_size == 0 else fallback))
        shapes.append(tuple(linear.weight.shape))
    arena = DenseArena(shapes, [fmt for *_, fmt in plan])
    for i, (parent, name, fmt) in enumerate(plan):
        linear = getattr(parent, name)
        setattr(parent, name, QuantLinear.from_linear(linear, fmt, release, out=arena.view(i)))
        if release is not None:  # the pages the blocks' releases left (those across their boundaries)
            release(linear.weight.data)
        del linear
        return_freed_heap()  # the conversion's temporaries, before the next weight's (a peak otherwise)
    model.modules_changed()
    return model
