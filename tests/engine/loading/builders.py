"""Byte-level builders for small model files, shared by the loader tests and tests/reliability.

GGUF: ``build()`` assembles a file from raw key/value and tensor-info records (``kv``, ``ti``),
so a test can write any count, length or offset, valid or not. The default is a valid 1-layer
llama header with two tensors (BASE_*). HF: ``write_hf_dir`` writes a config.json and a
model.safetensors (via the reference safetensors writer) into a directory.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

U32, U64 = (lambda v: struct.pack("<I", v)), (lambda v: struct.pack("<Q", v))
T_U32, T_I32, T_STR, T_ARR = 4, 5, 8, 9
F32, Q8_0 = 0, 8


def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return U64(len(b)) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + U32(vtype) + payload


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, T_U32, U32(v))


def kv_str(key: str, v: str) -> bytes:
    return kv(key, T_STR, s(v))


BASE_KVS = [
    kv_str("general.architecture", "llama"),
    kv_u32("llama.block_count", 1),
    kv_u32("llama.embedding_length", 64),
    kv_u32("llama.attention.head_count", 2),
    kv_u32("llama.vocab_size", 32),
    kv_u32("llama.feed_forward_length", 128),
]


def ti(name: str | bytes, ne: list[int], gtype: int, offset: int, n_dims: int | None = None) -> bytes:
    n = len(ne) if n_dims is None else n_dims
    return s(name) + U32(n) + b"".join(U64(d) for d in ne) + U32(gtype) + U64(offset)


# output_norm: f32 [64] = 256 bytes at 0; token_embd: q8_0 ne [64, 32] = 64 blocks x 34 = 2176 at 256
BASE_TENSORS = [ti("output_norm.weight", [64], F32, 0), ti("token_embd.weight", [64, 32], Q8_0, 256)]
BASE_DATA = (np.arange(64, dtype=np.float32).tobytes()
             + (np.float16(0.25).tobytes() + bytes(range(32))) * 64)


def build(*, magic=b"GGUF", version=3, kvs=None, tensors=None, data=None, n_kv=None,
          n_tensors=None, alignment=32, pad=True) -> bytes:
    kvs = BASE_KVS if kvs is None else kvs
    tensors = BASE_TENSORS if tensors is None else tensors
    data = BASE_DATA if data is None else data
    head = (magic + U32(version) + U64(len(tensors) if n_tensors is None else n_tensors)
            + U64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tensors))
    if pad:
        head += bytes(-len(head) % alignment)
    return head + data


def write(tmp_path: Path, blob: bytes, name: str = "bad.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(blob)
    return p



def kv_str_array(key: str, items: list[str]) -> bytes:
    return kv(key, T_ARR, U32(T_STR) + U64(len(items)) + b"".join(s(i) for i in items))


def tokens_kv(n: int) -> bytes:
    """tokenizer.ggml.tokens with ``n`` distinct tokens."""
    return kv_str_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(n)])


def with_kv(key: str, record: bytes, kvs: list[bytes] | None = None) -> list[bytes]:
    """``kvs`` (default BASE_KVS) with the record of ``key`` replaced by ``record`` (or added)."""
    kvs = BASE_KVS if kvs is None else kvs
    prefix = s(key)
    return [r for r in kvs if not r.startswith(prefix)] + [record]


# ---- Hugging Face directories -------------------------------------------------------------------
HF_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 4,
    "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8,
}
HF_QWEN2_MOE_CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 8, "hidden_size": 4,
    "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8,
    "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 4,
}
HF_TENSORS = {"model.embed_tokens.weight": np.zeros((8, 4), np.float32),
              "model.norm.weight": np.ones(4, np.float32)}


def write_hf_dir(root: Path, config: dict | None = None, tensors: dict | None = None,
                 **changes) -> Path:
    """A checkpoint directory: config.json (``config`` or HF_LLAMA_CONFIG, updated with
    ``changes``) and model.safetensors (``tensors`` or HF_TENSORS: too few for a full model,
    enough for every check that runs before the per-tensor comparison)."""
    from safetensors.numpy import save_file  # reference writer (tests only)

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**(config or HF_LLAMA_CONFIG), **changes}))
    save_file(HF_TENSORS if tensors is None else tensors, str(root / "model.safetensors"))
    return root
