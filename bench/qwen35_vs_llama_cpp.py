"""Qwen3.5-MoE (llama.cpp arch ``qwen35moe``): moestream's GGUF load against llama.cpp on the same
F32 GGUF, in one run: greedy tokens compared, prefill and decode tokens/s of both beside the
memory-bandwidth roofline.

    python bench/qwen35_vs_llama_cpp.py                      # the default shape below
    python bench/qwen35_vs_llama_cpp.py --layers 4 --prompt 64 --new 16 --rounds 1   # quick

Weights: a random Qwen3_5MoeForConditionalGeneration built by transformers with
``torch.manual_seed(0)`` (the VLM layout with its vision tower, SmolLM2's 49152-token tokenizer,
see bench/llama_cpp_converter.py), written as F32 GGUF by llama.cpp's own converter
(convert_hf_to_gguf.py of llama-cpp-python 0.3.36, ``--outtype f32 --no-mtp``). One file feeds
both systems:

* moestream: the GGUF loaded at fp32 (engine.loading: qwen35moe names and metadata), greedy
  decoding through the serving engine (engine.runner.stream_request).
* llama.cpp: the same file through llama-cpp-python (its own qwen35moe graph), greedy over ids.

Prompt and rounds: bench/gguf_side_by_side.py (the frame this bench and qwen4exp_vs_llama_cpp.py
share).

Roofline decode tok/s = measured memory read bandwidth / bytes one decoded token reads: every
F32 weight once except top_k/E of the stacked experts and one embedding row (from the GGUF's own
tensor sizes), plus the recurrent state of the DeltaNet layers read and rewritten (2 x its fp32
bytes). KV reads are left out (at most a few hundred tokens of 1 layer in 4).

llama.cpp is optional: without llama_cpp installed, or without the converter (no network), the
bench says why and stops.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_side_by_side import add_args, run  # noqa: E402
from llama_cpp_converter import ConverterUnavailable, convert, fetch_converter  # noqa: E402,F401
from vs_llama_cpp import LlamaCpp, gguf_active_bytes, load_fp32, make_prompt, moestream_greedy  # noqa: E402,F401

# A small Qwen3.5-MoE: 8 layers (attention every 4th), 32 experts top-4 + a shared expert,
# DeltaNet 4 key / 8 value heads of 64 (llama.cpp needs equal key and value head dims).
SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
             num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
             shared_expert_intermediate_size=256, max_position_embeddings=4096)
TINY = dict(SHAPE, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=2, spatial_merge_size=1,
              temporal_patch_size=1, num_position_embeddings=16)
WEIGHT_SEED = 0
CONVERTER_CACHE = Path.home() / ".cache" / "moestream" / "llama_cpp_converter"


def build_checkpoint(out: Path, shape: dict, seed: int = WEIGHT_SEED, family: str = "Qwen3_5Moe",
                     perturb: float = 0.0) -> None:
    """A random VLM checkpoint of transformers' ``{family}ForConditionalGeneration`` (Qwen3.5-MoE
    here; Qwen4-Exp for bench/qwen4exp_vs_llama_cpp.py) with SmolLM2's tokenizer (what the
    converter needs). perturb: every weight moves by that much Gaussian noise off its init (whose
    zero-centred norms and zero convolutions would leave parts of a model unexercised)."""
    import transformers as T
    from transformers import AutoTokenizer

    from engine.assets import smollm2_gguf

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    rot = int(shape["head_dim"] * 0.25) // 2  # rotary frequencies: the mrope sections sum to them
    text = dict(shape, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                     mrope_section=[rot - 2 * (rot // 3), rot // 3, rot // 3],
                                     mrope_interleaved=True))
    cfg = getattr(T, f"{family}Config")(text_config=text,
                                        vision_config=dict(VISION, out_hidden_size=shape["hidden_size"]))
    torch.manual_seed(seed)
    model = getattr(T, f"{family}ForConditionalGeneration")(cfg)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype.is_floating_point:
                    p.add_(torch.randn_like(p) * perturb)
    model.save_pretrained(out)
    tok.save_pretrained(str(out))


def to_gguf(hf_dir: Path, out: Path, converter_root: Path = CONVERTER_CACHE) -> Path:
    """``hf_dir`` as an F32 ``qwen35moe`` GGUF written by llama.cpp's converter (no MTP blocks)."""
    return convert(fetch_converter(converter_root), hf_dir, out, "--outtype", "f32", "--no-mtp")


def state_bytes(cfg) -> int:
    from engine.kv.state import slot_bytes

    return slot_bytes(cfg)


def read_bytes(path: Path, cfg) -> tuple[float, str]:
    """Bytes one decoded token reads (module doc) and what they are."""
    state = state_bytes(cfg)
    return gguf_active_bytes(path, cfg) + 2 * state, (
        f"F32 weights, top-{cfg.moe.top_k} of {cfg.moe.num_experts} experts, recurrent state "
        f"{state / 1e6:.2f} MB read and rewritten")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    args = ap.parse_args(argv)
    run(args, model="random Qwen3.5-MoE (qwen35moe)", shape=TINY if args.tiny else SHAPE,
        build=build_checkpoint, to_gguf=to_gguf, read_bytes=read_bytes)


if __name__ == "__main__":
    main()
