"""A sparse layer's routed experts in two Triton launches, read straight from the device slot pool.

The per-expert GPU path launches ~10 kernels per expert (three fused dequant-matmuls, their
split-K sums, silu, the product, the weighting) and ~149 per layer on the H200 (bench/gpu_check.py):
at decode sizes every launch costs more than the bytes it reads. Here a layer is two launches
whatever its top-k:

    gate_up   grid (I / BLOCK_N, P)   pair p = (token t, pick j): slot s = pair_slot[p];
              act[p, :] = silu(x[t] . gate_s) * (x[t] . up_s)            [P, I] float32
    down      grid (H / BLOCK_N, T)   out[t, :] = sum_j w[t, j] * (act[t*K + j] . down_{slot})

Each expert lives in one slot of the cache's pool (``ExpertCache.slots``, uint8 [S, slot_bytes]);
its parts (codes, fp16 scales, fp16 mins of gate, up and down) sit at the same byte offsets in
every slot of a layer (one blob layout, engine.quant.expert_blob.pack_expert), so a program finds
an expert from its slot number alone: the kernels take the pool twice, as bytes and as fp16
(the same memory), and the offsets. The slot of each (token, pick) comes from the cache's
device slot map (``ExpertCache.slot_map[layer]``, written when an expert is copied into a
slot), gathered on the device: no host round trip, no per-expert Python.

Every sum runs in a fixed order per row (no atomics, no split-K), so a row's result does not
depend on the batch. Formats: int4 (code * scale + min, the store's default) and int8 (code *
scale); others take the per-expert path. Without CUDA the kernels run in Triton's interpreter on
CPU tensors, which is how the tests compare them with the reference (tests/gpu and
tests/engine/quant/test_triton_moe.py).
"""

from dataclasses import dataclass
from typing import Any

import torch

from engine.quant import triton_kernels as TK

triton, tl, constexpr = TK.triton, TK.tl, TK.constexpr

GROUPED_FORMATS = {"int4": 0, "int8": 2}
BLOCK_N = 32
BLOCK_K = 64


@dataclass(frozen=True)
class PartOffsets:
    """Byte offsets, within a slot, of one weight's codes, scales and mins."""

    codes: int
    scales: int
    mins: int


@dataclass(frozen=True)
class SlotLayout:
    """How a layer's experts sit in the slot pool: format, group size, I, H and the three parts."""

    fmt: str
    group: int
    inter: int
    hidden: int
    gate: PartOffsets
    up: PartOffsets
    down: PartOffsets


def slot_layout(gate, up, down, slot: torch.Tensor) -> SlotLayout | None:
    """The SlotLayout of an expert whose QuantizedTensors view ``slot`` (a uint8 row of the pool),
    or None when its format is not one the grouped kernels decode or its fp16 parts are not
    2-byte aligned (they always are in a pack_expert blob: parts start at multiples of 64)."""
    if gate.fmt.name not in GROUPED_FORMATS or not (gate.fmt == up.fmt == down.fmt):
        return None
    base = slot.data_ptr()
    parts = []
    for q in (gate, up, down):
        p = q.parts
        codes, scales = p["codes"].data_ptr() - base, p["scales"].data_ptr() - base
        mins = p["mins"].data_ptr() - base if "mins" in p else scales
        if min(codes, scales, mins) < 0 or scales % 2 or mins % 2:
            return None
        parts.append(PartOffsets(codes, scales, mins))
    i, h = gate.shape
    return SlotLayout(gate.fmt.name, gate.fmt.group_size, i, h, *parts)


def _decode_rows(u8, f16, base, off_c, off_s, off_m, rows, ks, rmask, kmask, K,
                 FMT: constexpr, G: constexpr):
    """Weights [BLOCK_N, BLOCK_K] of rows x ks of a [N, K] weight stored at byte ``base``."""
    m2 = rmask[:, None] & kmask[None, :]
    sidx = (base + off_s) // 2 + rows[:, None] * (K // G) + (ks // G)[None, :]
    s = tl.load(f16 + sidx, mask=m2, other=0.0).to(tl.float32)
    if FMT == 2:  # int8 codes, read as bytes: sign-extend
        b = tl.load(u8 + base + off_c + rows[:, None] * K + ks[None, :], mask=m2, other=0).to(tl.int32)
        c = tl.where(b > 127, b - 256, b)
        w = c.to(tl.float32) * s
    else:  # int4: per block of 32 weights, byte j holds weight j (low) and j + 16 (high)
        byte = (ks // 32) * 16 + (ks % 16)
        shift = ((ks // 16) % 2) * 4
        b = tl.load(u8 + base + off_c + rows[:, None] * (K // 2) + byte[None, :], mask=m2, other=0)
        c = (b.to(tl.int32) >> shift[None, :]) & 0xF
        midx = (base + off_m) // 2 + rows[:, None] * (K // G) + (ks // G)[None, :]
        m = tl.load(f16 + midx, mask=m2, other=0.0).to(tl.float32)
        w = c.to(tl.float32) * s + m
    return w


def _gate_up_kernel(x_ptr, u8, f16, pair_slot, act_ptr, H, I, SLOT_BYTES,
                    GC, GS, GM, UC, US, UM,
                    TOPK: constexpr, FMT: constexpr, G: constexpr,
                    BLOCK_N: constexpr, BLOCK_K: constexpr):
    pid_n = tl.program_id(0)
    p = tl.program_id(1)
    tok = (p // TOPK).to(tl.int64)
    base = tl.load(pair_slot + p).to(tl.int64) * SLOT_BYTES
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < I
    rows64 = rows.to(tl.int64)
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < H
        xv = tl.load(x_ptr + tok * H + ks, mask=kmask, other=0.0)
        wg = _decode(u8, f16, base, GC, GS, GM, rows64, ks, rmask, kmask, H, FMT, G)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        wu = _decode(u8, f16, base, UC, US, UM, rows64, ks, rmask, kmask, H, FMT, G)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + p.to(tl.int64) * I + rows64, act, mask=rmask)


def _down_kernel(act_ptr, u8, f16, pair_slot, w_ptr, out_ptr, H, I, SLOT_BYTES, DC, DS, DM,
                 TOPK: constexpr, FMT: constexpr, G: constexpr,
                 BLOCK_N: constexpr, BLOCK_K: constexpr):
    pid_n = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < H
    rows64 = rows.to(tl.int64)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(TOPK):
        p = t * TOPK + j
        base = tl.load(pair_slot + p).to(tl.int64) * SLOT_BYTES
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < I
            av = tl.load(act_ptr + p * I + ks, mask=kmask, other=0.0)
            wd = _decode(u8, f16, base, DC, DS, DM, rows64, ks, rmask, kmask, I, FMT, G)
            acc += tl.sum(wd * av[None, :], axis=1)
        out += tl.load(w_ptr + p) * acc
    tl.store(out_ptr + t * H + rows64, out, mask=rmask)


_decode = triton.jit(_decode_rows) if triton is not None else None


def _kernels() -> tuple[Any, Any]:
    k = _kernels.__dict__.get("k")
    if k is None:
        k = _kernels.__dict__["k"] = (triton.jit(_gate_up_kernel), triton.jit(_down_kernel))
    return k


def supports(device: torch.device, layout: object | None) -> bool:
    """The grouped kernels can run for ``layout`` on tensors of ``device`` here."""
    return layout is not None and TK.supports(device)


def grouped_moe(x: torch.Tensor, weights: torch.Tensor, pair_slot: torch.Tensor, slots: torch.Tensor,
                layout: SlotLayout) -> torch.Tensor:
    """Routed experts of one layer: x [T, H], weights [T, K] (float32), pair_slot [T * K] int32
    (the slot of each token's j-th pick, row-major), slots the uint8 pool [S, slot_bytes].
    Returns sum_j weights[t, j] * expert_{slot}(x[t]) as [T, H] float32."""
    t, h = x.shape
    k = weights.shape[1]
    if h != layout.hidden or pair_slot.numel() != t * k:
        raise ValueError(f"grouped_moe: x {list(x.shape)}, weights {list(weights.shape)}, "
                         f"{pair_slot.numel()} pair slots for hidden {layout.hidden}")
    out = torch.empty(t, h, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    i = layout.inter
    slot_bytes = slots.shape[1]
    u8 = slots.reshape(-1)
    f16 = u8.view(torch.float16)
    act = torch.empty(t * k, i, dtype=torch.float32, device=x.device)
    fmt, g = GROUPED_FORMATS[layout.fmt], layout.group
    gate_up, down = _kernels()
    x = x.float().contiguous()
    ps = pair_slot.to(torch.int32).contiguous()
    gate_up[(-(-i // BLOCK_N), t * k)](
        x, u8, f16, ps, act, h, i, slot_bytes,
        layout.gate.codes, layout.gate.scales, layout.gate.mins,
        layout.up.codes, layout.up.scales, layout.up.mins,
        TOPK=k, FMT=fmt, G=g, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    down[(-(-h // BLOCK_N), t)](
        act, u8, f16, ps, weights.float().contiguous(), out, h, i, slot_bytes,
        layout.down.codes, layout.down.scales, layout.down.mins,
        TOPK=k, FMT=fmt, G=g, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
