"""The model bench/beyond_ram.py runs: a Qwen3-MoE shape whose weights are random 4-bit blocks
written straight to both systems' files (no fp32 model ever exists, so an 8 GB model needs no
8 GB of RAM to make).

- moestream: an expert store (engine.store format, int4 g64 experts: fp16 scale + fp16 min per 64
  weights, 4.5 bits/weight; bf16 dense) written by engine.experts.synthetic_disk from one layer of
  random blobs at a time.
- llama.cpp: a qwen3moe GGUF whose every 2-D weight is Q4_K (144-byte blocks of 256 weights:
  fp16 d and dmin, twelve 6-bit scale/min bytes, 128 bytes of 4-bit codes: 4.5 bits/weight);
  norms and the router F32. The prebuilt llama-cpp-python 0.3.36 wheel runs Q4_K on this CPU,
  while its Q4_0 and Q8_0 paths die of SIGILL, so Q4_K is the format both the wheel and a native
  build run.

The two files hold the same shapes at the same 4.5 bits per expert weight, not the same
numbers (the formats' blocks differ). The dense parts differ as each system runs them:
moestream quantizes its bf16 dense weights to int8 at load, llama.cpp reads Q4_K.
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


def model_config(shape: Shape):
    from engine.config import ModelConfig, MoEConfig

    return ModelConfig(
        arch="qwen3_moe", vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=4 * shape.hidden,
        num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=4096, qk_norm=True,
        moe=MoEConfig(num_experts=shape.experts, top_k=shape.top_k, expert_intermediate_size=shape.width,
                      norm_topk_prob=True))


# ---- moestream: the expert store ------------------------------------------------------------

class LayerBlobs:
    """The blobs of a random int4 g64 store, one layer in RAM at a time (the source
    engine.experts.synthetic_disk.SyntheticDiskStore writes from): a real quantized expert
    gives the layout, fp16 scales and mins; every expert's codes are random bytes."""

    def __init__(self, shape: Shape, seed: int = 0) -> None:
        from engine.costmodel import ModelShape
        from engine.experts.synthetic_store import SyntheticExpertStore

        ms = ModelShape(name=shape.name, layers=shape.layers, hidden=shape.hidden, experts=shape.experts,
                        expert_width=shape.width, top_k=shape.top_k, shared_width=0, vocab=shape.vocab,
                        heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim)
        self.store = SyntheticExpertStore(ms, seed=seed, group_size=64)
        self.store.config = model_config(shape)  # Qwen3-MoE (q/k norms, no shared expert)
        self.seed = seed
        self._layer, self._buf = -1, None

    def blob(self, key) -> torch.Tensor:
        layer, expert = key
        if layer != self._layer:
            s = self.store
            buf = s.prototype.repeat(s.shape.experts, 1)
            rng = np.random.default_rng(self.seed * 100_003 + layer)
            for off, nb in s.code_spans:
                codes = np.frombuffer(rng.bytes(s.shape.experts * nb), dtype=np.uint8)
                buf[:, off:off + nb] = torch.from_numpy(codes.reshape(s.shape.experts, nb).copy())
            self._layer, self._buf = layer, buf
        return self._buf[expert]


def write_store(shape: Shape, out: Path, seed: int = 0) -> Path:
    """The store at ``out`` (a new or empty directory), kept after this returns."""
    from engine.experts.synthetic_disk import SyntheticDiskStore

    return SyntheticDiskStore(LayerBlobs(shape, seed), out).write()


# ---- llama.cpp: the GGUF --------------------------------------------------------------------

# Q4_K sub-block of 32: w = D * sc * q - DMIN * m, q = 0..15 uniform. sc in {4, 8} with
# m = 3.75 * sc (15, 30) puts every sub-block's mean at exactly 0 and its step at 0.0039 or
# 0.0078: zero-mean weights of std ~0.027, as the store's random int4 experts (step ~0.0063,
# min ~ -7.5 steps) and its normal(0, 0.02) dense weights. Random bytes as scales (the first
# version) gave every block a positive mean: hidden states all leaning one way, so the GGUF routed
# far fewer distinct experts than the store and read ~3x fewer bytes per token for that reason.
Q4K_D, Q4K_DMIN = 2.0 ** -10, 2.0 ** -9


def q4k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 packed bytes of Q4_K's eight 6-bit scales and mins per block ([n, 8] each ->
    [n, 12]; ggml's get_scale_min_k4 reads them back)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _q4k(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """``rows`` x ``cols`` weights as random Q4_K blocks (uint8, rows x cols/256*144): random
    codes, zero-mean sub-blocks (Q4K_D, Q4K_DMIN above)."""
    if cols % Q4K_BLOCK:
        raise ValueError(f"Q4_K needs rows of a multiple of {Q4K_BLOCK} weights, got {cols}")
    nb = rows * cols // Q4K_BLOCK
    blocks = np.frombuffer(rng.bytes(nb * Q4K_BYTES), dtype=np.uint8).reshape(nb, Q4K_BYTES).copy()
    blocks[:, 0:4] = np.array([Q4K_D, Q4K_DMIN], dtype=np.float16).view(np.uint8)
    sc = np.where(rng.random((nb, 8)) < 0.5, 4, 8)
    blocks[:, 4:16] = q4k_scales(sc, sc * 15 // 4)
    return blocks.reshape(rows, cols // Q4K_BLOCK * Q4K_BYTES)


def gguf_tensors(shape: Shape):
    """(name, numpy shape of the weights, kind) in file order; kind "q4k" or "f32" (F32 vectors
    of ones for norms, random normal(0, 0.02) for the router, as the store's dense weights)."""
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


def write_gguf(shape: Shape, path: Path, seed: int = 0) -> Path:
    """The qwen3moe GGUF at ``path``, written one tensor at a time."""
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
            data = _q4k(rng, math.prod(shp[:-1]), shp[-1]).reshape(*shp[:-1], -1)
        elif kind == "ones":
            data = np.ones(shp, dtype=np.float32)
        else:
            data = (rng.standard_normal(shp, dtype=np.float32) * 0.02).astype(np.float32)
        w.write_tensor_data(data)
    w.close()
    return path
