"""Qwen4-Exp / Qwen3.8-Flash-Next (llama.cpp arch ``qwen4exp``): moestream's GGUF load against
llama.cpp on the same F32 GGUF, in one run: greedy tokens compared (and transformers' own, the
reference), prefill and decode tokens/s of both beside the memory-bandwidth roofline.

    python bench/qwen4exp_vs_llama_cpp.py                      # the reduced shape below
    python bench/qwen4exp_vs_llama_cpp.py --tiny --prompt 64 --new 16 --rounds 1   # quick

Weights: a random Qwen4ExpForConditionalGeneration built by transformers with
``torch.manual_seed(0)``, every weight moved off its init by N(0, 0.05) noise (its hyper-connection
norms are zero-centred and its PLE convolution starts at zero), the VLM layout, SmolLM2's
49152-token tokenizer; written as F32 GGUF by llama.cpp's own converter (llama-cpp-python
0.3.36; bench/llama_cpp_converter.py says what it is run with). One file feeds both systems:
moestream loads it at fp32 (engine.models.qwen4_exp.gguf) and decodes greedily through the
serving engine; llama.cpp runs it through llama-cpp-python (its own qwen4exp graph).

The reduced shape keeps the published layer mix (3 DeltaNet layers to 1 QSA attention layer),
4 hyper-connection streams, top-k routing with a shared expert, one PLE layer of 16 hashed
n-gram heads (ngram 3) on a DeltaNet layer, and QSA selection that drops tokens (a budget of
128 tokens under 256 + 64). What llama.cpp's graph requires shapes it: DeltaNet key and value
heads of one width, the PLE embedding as wide as the hidden state, one PLE layer, the sigmoid
DeltaNet output gate. ``--ratio`` is the QSA compress ratio, 1 by default: llama.cpp keeps a
fixed budget + ratio - 1 tokens per query (the incomplete tail first, then the best blocks'
tokens, the last block cut), where the reference keeps budget / ratio whole blocks and the tail
only, so with a ratio above 1 their tokens part (tests/engine/loading/test_qwen4_exp_gguf.py).

Roofline decode tok/s = measured memory read bandwidth / bytes one decoded token reads: every
F32 weight once except top_k/E of the stacked experts, one embedding row and the 16 PLE rows of
the token (from the GGUF's own tensor sizes), plus the recurrent state (DeltaNet, PLE conv
window, n-gram context) read and rewritten. KV and QSA index-key reads are left out.

Prompt and rounds: bench/gguf_side_by_side.py. llama.cpp is optional: without llama_cpp
installed, or without the converter (no network), the bench says why and stops.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_side_by_side import add_args, run  # noqa: E402
from llama_cpp_converter import ConverterUnavailable, convert, fetch_converter  # noqa: E402,F401
from qwen35_vs_llama_cpp import CONVERTER_CACHE, build_checkpoint, state_bytes  # noqa: E402,F401
from vs_llama_cpp import LlamaCpp, gguf_active_bytes, load_fp32, make_prompt, moestream_greedy  # noqa: E402,F401

_LAYERS = dict(num_hidden_layers=8, full_attention_interval=4)
# hidden 2560 -> 512; 512 experts of 640 top-10 -> 32 of 256 top-4; QSA over 2 KV heads.
SHAPE = dict(_LAYERS, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
             num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
             max_position_embeddings=4096, output_gate_type="sigmoid", hc_count=4, hc_lowrank=64,
             ple_layer_ids=[2], ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000, split_ngram_parts=8,
             indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=128, indexer_compress_ratio=1)
TINY = dict(SHAPE, num_hidden_layers=4, hidden_size=64, num_attention_heads=4, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, hc_lowrank=16,
            heads_per_ngram=2, ngram_vocab_size_base=500, split_ngram_parts=2, indexer_n_heads=4,
            indexer_head_dim=16, indexer_budget=8)
PERTURB = 0.05


def build(out: Path, shape: dict) -> None:
    build_checkpoint(out, shape, family="Qwen4Exp", perturb=PERTURB)


def to_gguf(hf_dir: Path, out: Path, converter_root: Path = CONVERTER_CACHE) -> Path:
    """``hf_dir`` as an F32 ``qwen4exp`` GGUF written by llama.cpp's converter (which writes no
    MTP head for this architecture and refuses --no-mtp)."""
    return convert(fetch_converter(converter_root), hf_dir, out, "--outtype", "f32")


def read_bytes(path: Path, cfg) -> tuple[float, str]:
    """Bytes one decoded token reads (module doc) and what they are."""
    a = cfg.arch_params
    heads = a.ngram_heads if a.ple_layers else 0
    state = state_bytes(cfg)
    return gguf_active_bytes(path, cfg, {"per_layer_token_embd.weight": heads}) + 2 * state, (
        f"F32 weights, top-{cfg.moe.top_k} of {cfg.moe.num_experts} experts, {heads} PLE rows of "
        f"{a.ple_row_dim if heads else 0} floats, recurrent state {state / 1e6:.2f} MB read and rewritten")


def transformers_greedy(hf_dir: Path, prompt: list[int], new: int) -> list[int]:
    """The reference: transformers' fp32 greedy tokens on the checkpoint."""
    import transformers as T

    model = T.Qwen4ExpForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as the other rows: eos does not stop it
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--ratio", type=int, default=1, help="QSA compress ratio (divides the budget)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the reference's tokens")
    args = ap.parse_args(argv)
    shape = dict(TINY if args.tiny else SHAPE, indexer_compress_ratio=args.ratio)
    run(args, model="random Qwen4-Exp (qwen4exp)", shape=shape, build=build, to_gguf=to_gguf, read_bytes=read_bytes,
        reference=None if args.no_transformers else transformers_greedy)


if __name__ == "__main__":
    main()
