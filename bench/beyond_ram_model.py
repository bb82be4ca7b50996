"""The model bench/beyond_ram.py runs: a Qwen3-MoE shape whose weights are random 4-bit blocks
written straight to a GGUF (no fp32 model ever exists, so an 8 GB model needs no 8 GB of RAM to
make), and moestream's store converted from that GGUF by ``moestream convert`` (what a user with a
GGUF does): **both systems run the same weights**.

- llama.cpp: a qwen3moe GGUF whose every 2-D weight is Q4_K (144-byte blocks of 256 weights:
  fp16 d and dmin, twelve 6-bit scale/min bytes, 128 bytes of 4-bit codes: 4.5 bits/weight);
  norms and the router F32. The prebuilt llama-cpp-python 0.3.36 wheel runs Q4_K on this CPU,
  while its Q4_0 and Q8_0 paths die of SIGILL, so Q4_K is the format both the wheel and a native
  build run.
- moestream: the GGUF converted to an expert store (int4 g64 experts: fp16 scale + fp16 min per
  64 weights, 4.5 bits/weight; the dense tensors bf16). The blocks are written so that the
  conversion loses nothing: every 64 weights of an expert share one scale and one min that fp16
  holds exactly and contain codes 0 and 15, so int4 g64 gives back the same codes; the dense Q4_K
  values and the router are bf16 numbers. moestream then quantizes its dense weights to int8 at
  load (its default), llama.cpp reads them as Q4_K.

Until 2026-12-04 the store was written from random blobs of its own while the GGUF held other
random numbers: two different models. Their routing differed as much as their bytes per token
(the GGUF's hidden states lost the token's identity with depth: ~30 of 128 experts per layer
over 200 tokens and 20% of a token's experts new against the previous token's, the store's ~120 and
85%), so llama.cpp ran a far easier workload. The token embedding's scale (EMBED_SCALE) now keeps
the token's identity through the layers, as a trained model's hidden states do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

Q4K_BLOCK, Q4K_BYTES = 256, 144  # weights per block, bytes per block


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    experts: int
    top_k: int
    width: int  # expert intermediate size
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 32000

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.width

    def expert_bytes(self) -> int:  # at 4.5 bits/weight (both formats)
        return self.expert_params * 9 // 16

    def experts_bytes(self) -> int:
        return self.layers * self.experts * self.expert_bytes()


def qwen3_30b_like(size_bytes: float) -> Shape:
    """Qwen3-30B-A3B's layer (hidden 2048, 128 experts top-8 of width 768, 32/4 heads of 128),
    as many layers as make ``size_bytes`` of 4.5-bit experts (48 layers: ~16 GB; 8 GB: 24)."""
    s = Shape("qwen3-moe", 1, 2048, 128, 8, 768, 32, 4, 128)
    layers = max(2, round(size_bytes / (s.experts * s.expert_bytes())))
    return Shape(f"qwen3-moe {layers}L", layers, 2048, 128, 8, 768, 32, 4, 128)


# The issue's first look: Qwen3-MoE 1.3B-A0.2B (bench/vs_llama_cpp.py's ISSUE_SHAPE)
ISSUE_SHAPE = Shape("qwen3-moe 1.3B-A0.2B", 12, 1024, 64, 8, 512, 16, 4, 64)


# A smoke-test shape (tests/bench/test_beyond_ram.py runs the whole bench on it in seconds)
TINY_SHAPE = Shape("tiny", 2, 256, 8, 2, 256, 4, 2, 64, vocab=512)


def model_config(shape: Shape):
    from engine.config import ModelConfig, MoEConfig

    return ModelConfig(
        arch="qwen3_moe", vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=4 * shape.hidden,
        num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=4096, qk_norm=True,
        moe=MoEConfig(num_experts=shape.experts, top_k=shape.top_k, expert_intermediate_size=shape.width,
                      norm_topk_prob=True))


# ---- llama.cpp: the GGUF --------------------------------------------------------------------

# Q4_K sub-block of 32: w = D * sc * q - DMIN * m, q = 0..15 uniform. sc = 4 and m = 15 in every
# sub-block put its mean at exactly 0 (D * 4 * 7.5 = DMIN * 15) and its step at 2^-8: zero-mean
# weights of std ~0.018, near the normal(0, 0.02) of a random dense layer. One scale and min for the
# whole block: every 64 weights are codes times 2^-8 from -30 * 2^-10, which int4 g64 (fp16 scale
# and min) holds exactly once the group spans codes 0..15 (_q4k puts a 0 and a 15 in each). Random
# bytes as scales (the first version) gave every block a positive mean: hidden states all leaning
# one way.
Q4K_D, Q4K_DMIN = 2.0 ** -10, 2.0 ** -9
Q4K_SC, Q4K_M = 4, 15
# The token embedding's blocks are scaled by this (std ~1.2): at the layers' own scale the residual
# stream forgets which token it started from within a few layers, and every token routes to the
# same few experts (the 1.3B shape over 200 tokens: ~30 of 64 experts per layer, 20% of a token's
# experts new against the previous token's). On the 8 GB shape over a 64 + 64-token run: 32x routes
# to 48 of 128 experts per layer, 37% new per token; 64x to 76 of 128, 61% new: the default, the
# harder of the two for a cache and nearer our reading of published analyses of trained fine-grained
# MoEs (most experts used over a sequence, about half of a token's experts kept from the previous
# token; no trained model's trace is at hand offline to check it).
# bench/beyond_ram.py prints both figures for every moestream run; --embed-scale picks another.
EMBED_SCALE = 64


def q4k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 packed bytes of Q4_K's eight 6-bit scales and mins per block ([n, 8] each ->
    [n, 12]; ggml's get_scale_min_k4 reads them back)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _q4k(rng: np.random.Generator, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
    """``rows`` x ``cols`` weights as random Q4_K blocks (uint8, rows x cols/256*144): random
    codes, zero-mean sub-blocks (Q4K_D, Q4K_DMIN above, times ``scale``: a power of two), and in
    every 64 weights one random position whose pair of codes is (0, 15): a code 0 in the first
    sub-block of 32, a 15 in the second, at a position drawn per group (a fixed position would be
    one column pattern shared by every row)."""
    if cols % Q4K_BLOCK:
        raise ValueError(f"Q4_K needs rows of a multiple of {Q4K_BLOCK} weights, got {cols}")
    nb = rows * cols // Q4K_BLOCK
    blocks = np.frombuffer(rng.bytes(nb * Q4K_BYTES), dtype=np.uint8).reshape(nb, Q4K_BYTES).copy()
    blocks[:, 0:4] = np.array([Q4K_D * scale, Q4K_DMIN * scale], dtype=np.float16).view(np.uint8)
    blocks[:, 4:16] = q4k_scales(np.full((nb, 8), Q4K_SC), np.full((nb, 8), Q4K_M))
    # qs: 4 runs of 32 bytes, run j = weights 64j..64j+63 (low nibbles the first 32, high the rest)
    at = 16 + 32 * np.arange(4)[None, :] + rng.integers(0, 32, (nb, 4))
    blocks[np.arange(nb)[:, None], at] = 0xF0
    return blocks.reshape(rows, cols // Q4K_BLOCK * Q4K_BYTES)


def gguf_tensors(shape: Shape):
    """(name, numpy shape of the weights, kind) in file order; kind "q4k", "ones" (F32 norms) or
    "router" (F32, random normal(0, 0.02) rounded to bf16)."""
    h, s = shape.hidden, shape
    yield "token_embd.weight", (s.vocab, h), "q4k"
    for l in range(s.layers):
        b = f"blk.{l}."
        yield b + "attn_norm.weight", (h,), "ones"
        yield b + "attn_q.weight", (s.heads * s.head_dim, h), "q4k"
        yield b + "attn_k.weight", (s.kv_heads * s.head_dim, h), "q4k"
        yield b + "attn_v.weight", (s.kv_heads * s.head_dim, h), "q4k"
        yield b + "attn_output.weight", (h, s.heads * s.head_dim), "q4k"
        yield b + "attn_q_norm.weight", (s.head_dim,), "ones"
        yield b + "attn_k_norm.weight", (s.head_dim,), "ones"
        yield b + "ffn_norm.weight", (h,), "ones"
        yield b + "ffn_gate_inp.weight", (s.experts, h), "router"
        yield b + "ffn_gate_exps.weight", (s.experts, s.width, h), "q4k"
        yield b + "ffn_up_exps.weight", (s.experts, s.width, h), "q4k"
        yield b + "ffn_down_exps.weight", (s.experts, h, s.width), "q4k"
    yield "output_norm.weight", (h,), "ones"
    yield "output.weight", (s.vocab, h), "q4k"


def write_gguf(shape: Shape, path: Path, seed: int = 0, embed_scale: int = EMBED_SCALE) -> Path:
    """The qwen3moe GGUF at ``path``, written one tensor at a time; ``embed_scale``: the token
    embedding's scale against the layers' (a power of two; EMBED_SCALE)."""
    if embed_scale < 1 or embed_scale & (embed_scale - 1):
        raise ValueError(f"embed_scale must be a power of two >= 1 (exact in fp16 and bf16), got {embed_scale}")
    import gguf

    from vs_llama_cpp import gguf_writer

    cfg = model_config(shape)
    w = gguf_writer(path, cfg, gguf.LlamaFileType.MOSTLY_Q4_K_M)
    specs = list(gguf_tensors(shape))
    for name, shp, kind in specs:
        if kind == "q4k":
            rows = math.prod(shp[:-1])
            byte_shape = (*shp[:-1], shp[-1] // Q4K_BLOCK * Q4K_BYTES)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), rows * byte_shape[-1],
                              raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        else:
            w.add_tensor_info(name, shp, np.dtype(np.float32), math.prod(shp) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed + 7)
    for name, shp, kind in specs:
        if kind == "q4k":
            scale = embed_scale if name == "token_embd.weight" else 1.0
            data = _q4k(rng, math.prod(shp[:-1]), shp[-1], scale).reshape(*shp[:-1], -1)
        elif kind == "ones":
            data = np.ones(shp, dtype=np.float32)
        else:
            # bf16 numbers stored as F32: the store's bf16 dense file holds the same router
            data = (torch.from_numpy(rng.standard_normal(shp, dtype=np.float32) * 0.02)
                    .to(torch.bfloat16).float().numpy())
        w.write_tensor_data(data)
    w.close()
    return path


# ---- moestream: the store, converted from the GGUF -------------------------------------------

def write_store(gguf_path: Path, out: Path, progress: bool = False) -> Path:
    """The expert store at ``out`` converted from the GGUF at ``gguf_path`` (engine.store.convert,
    as ``moestream convert GGUF --out OUT --dense-dtype bf16``): int4 g64 experts, bf16 dense."""
    from engine.quant.formats import QuantFormat
    from engine.store import convert

    convert(gguf_path, out, fmt=QuantFormat("int4", 64), dense_dtype="bf16", progress=progress,
            overwrite=True)
    return out
