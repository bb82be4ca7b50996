"""Paged decode attention in Triton: one query row per sequence, K/V read through block tables.

The CUDA shape of a decode step's attention with static shapes, so a decoder layer's attention
half can be captured in a CUDA graph (engine.cuda_graphs): every per-step quantity is a device
tensor the kernel reads when it runs, never a Python value baked into the launch.

    cache     k_cache, v_cache [NB, BS, Nkv, D] (one layer of engine.kv.paged's storage),
              float32 / bfloat16 / float16
    tables    [N, W] int32: row n's block ids; token position p of row n lives at
              (tables[n, p // BS], p % BS)
    lens      [N] int32: row n's context length, its new token included (>= 1, <= W * BS)
    q         [N, Nh, D]; query head h reads KV head h // (Nh / Nkv) (GQA)
    out       [N, Nh, D] in q's dtype

Grid (Nkv, N): each program owns the G = Nh / Nkv query heads of one KV head of one row and
walks that row's blocks in order, keeping an online softmax in float32 (running max, running
sum, rescaled accumulator). The order of every sum is fixed by the row's own blocks, so a row's
result does not depend on the batch it is in or on the table width W (only a stride).

:func:`write_kv` stores the new token's k/v at flat slot ``slots[n]`` = block * BS + offset with
one ``index_copy_`` per cache (capturable; the slots are a device tensor as well).
:func:`slots_for` computes those slots from tables and positions on the device.

The torch reference is engine.layers.attention.attend (what the eager Attention layer runs);
tests/engine/layers/test_paged_attention_triton.py compares them in Triton's interpreter on CPU
tensors, tests/gpu compiled.
"""

import torch

from engine.errors import ConfigError
from engine.quant import triton_kernels as TK

triton, tl, constexpr = TK.triton, TK.tl, TK.constexpr

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, W, scale,
                   NH: constexpr, NKV: constexpr, G: constexpr, D: constexpr, BS: constexpr,
                   GP: constexpr, DP: constexpr, BSP: constexpr):
    kh = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    t = tl.arange(0, BSP)
    gmask = g < G
    dmask = d < D
    heads = kh * G + g
    qo = (n * NH + heads)[:, None] * D + d[None, :]
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + qo, mask=qmask, other=0.0).to(tl.float32)
    ctx = tl.load(lens_ptr + n)
    m = tl.full((GP,), -1.0e30, dtype=tl.float32)
    l = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, DP), dtype=tl.float32)
    for b in range(0, (ctx + BS - 1) // BS):
        blk = tl.load(tables_ptr + n * W + b).to(tl.int64)
        tmask = (t < BS) & (b * BS + t < ctx)
        kv = ((blk * BS + t) * NKV + kh)[:, None] * D + d[None, :]
        kvmask = tmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv, mask=kvmask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BSP]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv, mask=kvmask, other=0.0).to(tl.float32)
        # p @ v reduced over axis 0, not written sum(p[:, :, None] * v[None, :, :], axis=1): Triton's
        # combine pass turns that form into a dot, in TF32 on NVIDIA in the Triton of torch 2.11
        # (errors of 4e-4 on an H200 once a KV head serves 16 query heads)
        acc = acc * alpha[:, None] + tl.sum(tl.trans(p)[:, :, None] * v[:, None, :], axis=0)
        m = m_new
    o = acc / l[:, None]
    tl.store(out_ptr + qo, o.to(out_ptr.dtype.element_ty), mask=qmask)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel():
    k = _kernel.__dict__.get("k")
    if k is None:
        k = _kernel.__dict__["k"] = triton.jit(_decode_kernel)
    return k


def supports(device: torch.device) -> bool:
    """The kernel can run on tensors of ``device`` here (compiled on CUDA, interpreted on CPU)."""
    return TK.supports(device)


def _fail(msg: str) -> None:
    raise ConfigError(f"paged_attention_triton: {msg}")


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
           lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of one new query row per sequence over its paged context (shapes above).
    ``scale`` defaults to D^-1/2. Rows must have lens >= 1; the caller guarantees lens <= W * BS
    and that every table entry a row reads names a block of the cache (not checked on the device)."""
    dev = q.device
    if not supports(dev):
        raise RuntimeError(f"the Triton kernels cannot run on {dev} tensors here: {TK.why_not(dev)}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        _fail(f"q must be [N, Nh, D] and the caches [NB, BS, Nkv, D] alike; got q {list(q.shape)}, "
              f"k {list(k_cache.shape)}, v {list(v_cache.shape)}")
    n, nh, d = q.shape
    _, bs, nkv, dc = k_cache.shape
    if dc != d or nh % nkv:
        _fail(f"q {list(q.shape)} does not fit caches [NB, BS, Nkv, D] = {list(k_cache.shape)}: "
              f"head dims must agree and Nh must be a multiple of Nkv")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        _fail(f"cache dtype {k_cache.dtype} / {v_cache.dtype} is not supported; allowed: "
              f"{', '.join(str(t) for t in CACHE_DTYPES)}")
    if q.dtype not in CACHE_DTYPES:
        _fail(f"q dtype {q.dtype} is not supported; allowed: {', '.join(str(t) for t in CACHE_DTYPES)}")
    if tables.dim() != 2 or tables.shape[0] != n or lens.shape != (n,):
        _fail(f"tables must be [N, W] and lens [N] for N = {n} rows; got {list(tables.shape)}, {list(lens.shape)}")
    if tables.dtype != torch.int32 or lens.dtype != torch.int32:
        _fail(f"tables and lens must be int32; got {tables.dtype}, {lens.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("tables", tables), ("lens", lens)):
        if t.device != dev or not t.is_contiguous():
            _fail(f"{name} must be contiguous on {dev}; got {t.device}, contiguous={t.is_contiguous()}")
    out = torch.empty_like(q)
    if n == 0:
        return out
    g = nh // nkv
    _kernel()[(nkv, n)](q, k_cache, v_cache, tables, lens, out, tables.shape[1],
                        float(d ** -0.5 if scale is None else scale),
                        NH=nh, NKV=nkv, G=g, D=d, BS=bs, GP=_pow2_at_least(g), DP=_pow2_at_least(d),
                        BSP=_pow2_at_least(bs))
    return out


def slots_for(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N] int64 flat slots (block * BS + offset) of position ``positions[n]`` of row n, on the
    device (no host read): tables [N, W] int32, positions [N] int."""
    pos = positions.to(torch.int64)
    blk = torch.gather(tables, 1, (pos // block_size)[:, None]).to(torch.int64)[:, 0]
    return blk * block_size + pos % block_size


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [N, Nkv, D] into the caches [NB, BS, Nkv, D] at flat slots [N] (int64, device),
    converted to the cache dtype. Rows sharing a slot (padding aimed at a scratch block) leave
    one of their values there."""
    nb, bs, nkv, d = k_cache.shape
    k_cache.view(nb * bs, nkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(nb * bs, nkv, d).index_copy_(0, slots, v.to(v_cache.dtype))
