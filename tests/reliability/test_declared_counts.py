"""Issue #14 class 2: no allocation sized by a count a model file declares.

Each input declares a count (layers, experts, tensors, array elements) far beyond what its few
bytes can hold. Loading it must raise ModelFormatError naming the file and the field, and the
load must not grow the process by more than 512 MiB: the inputs are loaded in one child process
that records its peak RSS (``ru_maxrss``) after its imports and again after every refused
input. The child also caps its address space, so a regression fails with MemoryError in the
child instead of swapping the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.config import ModelConfig, MoEConfig
from tests.engine.loading.builders import (
    BASE_DATA, BASE_KVS, F32, HF_LLAMA_CONFIG, HF_QWEN2_MOE_CONFIG, T_ARR, T_STR, U32, U64, build,
    kv, kv_u32, ti, with_kv, write, write_hf_dir,
)

REPO = Path(__file__).resolve().parents[2]
RSS_BUDGET_MIB = 512
T_U64 = 10

# Runs in the child: load every case, report (error type, path, message) and peak RSS.
CHILD = r"""
import json, resource, sys
from engine.loading import open_model_files
from engine.errors import MoestreamError

def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

cases = json.loads(sys.argv[1])
base = peak_mib()
# 2 GiB of address space beyond what the imports mapped: far above the 512 MiB budget, far
# below what a list sized by 10^9 entries needs.
limit = vm_bytes() + (2 << 30)
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
out = {"baseline_mib": base, "cases": {}}
for name, path in cases.items():
    try:
        open_model_files(path)
        result = {"error": None}
    except MoestreamError as e:
        result = {"error": type(e).__name__, "path": getattr(e, "path", None), "message": str(e)}
    except BaseException as e:  # what the test must never see
        result = {"error": type(e).__name__, "path": None, "message": repr(e)[:300]}
    result["peak_mib"] = peak_mib()
    out["cases"][name] = result
print(json.dumps(out))
"""


def _layer_file(kvs: list[bytes], n_extra: int = 10) -> bytes:
    """BASE tensors plus ``n_extra`` f32 [32] layer tensors (blk.0.*): enough tensors for the
    declared single layer, so only the expert count is out of proportion."""
    names = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp",
             "ffn_gate.0", "ffn_up.0", "ffn_down.0"][:n_extra]
    start = len(BASE_DATA)  # 2432, a multiple of the 32-byte alignment
    tensors = [ti("output_norm.weight", [64], F32, 0), ti("token_embd.weight", [64, 32], 8, 256)]
    tensors += [ti(f"blk.0.{n}.weight", [32], F32, start + 128 * k) for k, n in enumerate(names)]
    return build(kvs=kvs, tensors=tensors, data=BASE_DATA + bytes(128 * len(names)))


def _dummy_tensors(n: int) -> dict[str, np.ndarray]:
    return {f"model.layers.0.extra{i}.weight": np.zeros(1, np.float32) for i in range(n)}


def gguf_cases(d: Path) -> dict[str, tuple[Path, Path, str]]:
    """name -> (input, the file the error must name, a fragment its message must contain)."""
    experts = with_kv("llama.expert_count", kv_u32("llama.expert_count", 10**9))
    experts = with_kv("llama.expert_used_count", kv_u32("llama.expert_used_count", 2), experts)
    stacked = [ti("output_norm.weight", [64], F32, 0),
               ti("blk.0.ffn_gate_exps.weight", [32, 1, 1 << 31], F32, 256)]
    blobs = {
        "gguf_block_count_2e31": (
            build(kvs=with_kv("llama.block_count", kv_u32("llama.block_count", 1 << 31))),
            "llama.block_count declares 2147483648 layers"),
        "gguf_block_count_u64_2e63": (
            build(kvs=with_kv("llama.block_count", kv("llama.block_count", T_U64, U64(1 << 63)))),
            f"llama.block_count declares {1 << 63} layers"),
        "gguf_expert_count_1e9": (_layer_file(experts), "llama.expert_count declares 1000000000 experts"),
        "gguf_n_tensors_2e31": (build(n_tensors=1 << 31), "2147483648 tensors"),
        "gguf_n_kv_1e9": (build(n_kv=10**9), "1000000000 metadata entries"),
        "gguf_token_array_2e29": (  # under ggml's 2^30 element cap: only the file size refuses it
            build(kvs=BASE_KVS + [kv("tokenizer.ggml.tokens", T_ARR, U32(T_STR) + U64(1 << 29))]),
            "declares 536870912 strings"),
        "gguf_stacked_2e31_experts": (build(tensors=stacked, data=bytes(512)), "past the end"),
    }
    paths = {name: write(d, blob, f"{name}.gguf") for name, (blob, _) in blobs.items()}
    return {name: (paths[name], paths[name], frag) for name, (_, frag) in blobs.items()}


def hf_cases(d: Path) -> dict[str, tuple[Path, Path, str]]:
    mixtral = {**HF_LLAMA_CONFIG, "architectures": ["MixtralForCausalLM"], "num_local_experts": 10**9,
               "num_experts_per_tok": 2}
    fused = {"model.layers.0.mlp.experts.gate_up_proj": np.zeros((10**9, 0, 0), np.float32)}
    dirs = {
        "hf_layers_1e9": (write_hf_dir(d / "layers", num_hidden_layers=10**9), "config.json",
                          "num_hidden_layers declares 1000000000 layers"),
        "hf_qwen_experts_1e9": (
            write_hf_dir(d / "qwen", HF_QWEN2_MOE_CONFIG, _dummy_tensors(12), num_experts=10**9),
            "config.json", "num_experts declares 1000000000 experts"),
        "hf_mixtral_experts_1e9": (write_hf_dir(d / "mixtral", mixtral, _dummy_tensors(12)),
                                   "config.json", "num_local_experts declares 1000000000 experts"),
        "hf_fused_1e9_zero_size_experts": (write_hf_dir(d / "fused", HF_QWEN2_MOE_CONFIG, fused),
                                           "model.safetensors", "no dimension may be zero"),
    }
    return {name: (root, root / file, frag) for name, (root, file, frag) in dirs.items()}


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every case loaded in one child: (cases, child report)."""
    d = tmp_path_factory.mktemp("declared")
    cases = {**gguf_cases(d), **hf_cases(d)}
    arg = json.dumps({name: str(path) for name, (path, _, _) in cases.items()})
    proc = subprocess.run([sys.executable, "-c", CHILD, arg], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return cases, json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_declared_count_is_refused_with_file_and_field(refused):
    cases, report = refused
    for name, (_, blamed, fragment) in cases.items():
        got = report["cases"][name]
        assert got["error"] == "ModelFormatError", (name, got)
        assert got["path"] == str(blamed), (name, got)
        assert fragment in got["message"], (name, got["message"])


def test_peak_rss_of_refused_inputs_stays_within_budget(refused):
    _, report = refused
    base = report["baseline_mib"]
    for name, got in report["cases"].items():
        assert got["peak_mib"] - base < RSS_BUDGET_MIB, (name, got["peak_mib"], base)


@pytest.mark.parametrize("layers,step,only", [
    (1, 1, ()), (7, 1, ()), (7, 2, ()), (8, 3, (2, 5)), (10, 1, (0, 3, 3, 99, -1)), (4, 4, (3,)),
])
def test_num_moe_layers_matches_moe_layers(layers, step, only):
    moe = MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=8, norm_topk_prob=True,
                    decoder_sparse_step=step, mlp_only_layers=only)
    cfg = ModelConfig(arch="qwen2_moe", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=layers, num_heads=2, num_kv_heads=2, head_dim=4,
                      max_position_embeddings=16, moe=moe)
    assert cfg.num_moe_layers == len(cfg.moe_layers)


def test_num_moe_layers_of_a_huge_declared_count_is_instant():
    moe = MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=8, norm_topk_prob=True,
                    decoder_sparse_step=2, mlp_only_layers=(1, 2))
    cfg = ModelConfig(arch="qwen2_moe", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=10**12, num_heads=2, num_kv_heads=2, head_dim=4,
                      max_position_embeddings=16, moe=moe)
    assert cfg.num_moe_layers == 10**12 // 2 - 1  # layer 1 is sparse by the step, excluded


def test_a_checkpoint_with_every_tensor_is_not_refused(tmp_path):
    """The bound is a necessary condition only: a complete 1-layer checkpoint passes it."""
    from engine.loading import open_model_files

    H, V, I = 4, 8, 8
    tensors = {"model.embed_tokens.weight": np.zeros((V, H), np.float32),
               "model.norm.weight": np.ones(H, np.float32), "lm_head.weight": np.zeros((V, H), np.float32)}
    p = "model.layers.0."
    for n, shape in (("input_layernorm", (H,)), ("post_attention_layernorm", (H,)),
                     ("self_attn.q_proj", (H, H)), ("self_attn.k_proj", (H, H)),
                     ("self_attn.v_proj", (H, H)), ("self_attn.o_proj", (H, H)),
                     ("mlp.gate_proj", (I, H)), ("mlp.up_proj", (I, H)), ("mlp.down_proj", (H, I))):
        tensors[p + n + ".weight"] = np.zeros(shape, np.float32)
    files = open_model_files(write_hf_dir(tmp_path / "ok", tensors=tensors, num_key_value_heads=2))
    assert files.config.num_layers == 1 and len(files.source.names()) == 12
