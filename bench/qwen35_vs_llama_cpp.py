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

Prompt: ``--prompt`` random ids (torch.Generator seed 1234), then ``--new`` greedy tokens, batch
1, ``--threads`` threads each; rows alternate inside a round after one warm-up each; the table
holds the median of ``--rounds`` rounds.

Roofline decode tok/s = measured memory read bandwidth / bytes one decoded token reads: every
F32 weight once except top_k/E of the stacked experts and one embedding row (from the GGUF's own
tensor sizes), plus the recurrent state of the DeltaNet layers read and rewritten (2 x its fp32
bytes). KV reads are left out (at most a few hundred tokens of 1 layer in 4).

llama.cpp is optional: without llama_cpp installed, or without the converter (no network), the
bench says why and stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_cpu import measure_bandwidth  # noqa: E402
from llama_cpp_converter import ConverterUnavailable, convert, fetch_converter  # noqa: E402
from vs_llama_cpp import (INSTALL_HINT, LlamaCpp, gguf_active_bytes, have_llama_cpp,  # noqa: E402
                          load_fp32, make_prompt, moestream_greedy)

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


def build_checkpoint(out: Path, shape: dict, seed: int = WEIGHT_SEED) -> None:
    """A random Qwen3.5-MoE VLM checkpoint with SmolLM2's tokenizer (what the converter needs)."""
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
    cfg = T.Qwen3_5MoeConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=shape["hidden_size"]))
    torch.manual_seed(seed)
    T.Qwen3_5MoeForConditionalGeneration(cfg).save_pretrained(out)
    tok.save_pretrained(str(out))


def to_gguf(hf_dir: Path, out: Path, converter_root: Path = CONVERTER_CACHE) -> Path:
    """``hf_dir`` as an F32 ``qwen35moe`` GGUF written by llama.cpp's converter (no MTP blocks)."""
    return convert(fetch_converter(converter_root), hf_dir, out, "--outtype", "f32", "--no-mtp")


def state_bytes(cfg) -> int:
    from engine.kv.state import slot_bytes

    return slot_bytes(cfg)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny shape")
    args = ap.parse_args(argv)

    if not have_llama_cpp():
        print(INSTALL_HINT)
        return
    torch.set_num_threads(args.threads)
    shape = dict(TINY if args.tiny else SHAPE)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    bw = measure_bandwidth()
    print(f"threads {args.threads}, memory read bandwidth {bw / 1e9:.1f} GB/s, prompt {args.prompt} tokens, "
          f"{args.new} new tokens, batch 1, {args.rounds} alternating rounds (median)\n"
          f"model: random Qwen3.5-MoE (qwen35moe), F32 GGUF by llama.cpp's converter: "
          + ", ".join(f"{k}={v}" for k, v in shape.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="qwen35_vs_llama_cpp_") as tmp_name:
        tmp = Path(tmp_name)
        t = time.perf_counter()
        build_checkpoint(tmp / "hf", shape)
        try:
            path = to_gguf(tmp / "hf", tmp / "f32.gguf")
        except ConverterUnavailable as e:
            print(f"stopped: llama.cpp's converter is not available here: {e}")
            return
        print(f"checkpoint and GGUF ({path.stat().st_size / 1e6:.0f} MB) written in "
              f"{time.perf_counter() - t:.0f} s", flush=True)

        ours = load_fp32(path)
        cfg = ours.config
        prompt = make_prompt(args.prompt, cfg.vocab_size)
        theirs = LlamaCpp(path, args.threads, args.prompt + args.new + 16, min(args.prompt, 512))
        try:
            rows = {"moestream": lambda: moestream_greedy(ours, prompt, args.new),
                    "llama.cpp": lambda: theirs.greedy(prompt, args.new)}
            tokens = {name: run()[0] for name, run in rows.items()}  # also the warm-up
            a, b = tokens["moestream"], tokens["llama.cpp"]
            agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            print(f"greedy tokens: first {agree} of {args.new} agree "
                  f"({sum(x == y for x, y in zip(a, b))}/{args.new} positions equal)\n"
                  f"  moestream  {a}\n  llama.cpp  {b}", flush=True)
            figures: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in rows}
            for k in range(args.rounds):
                for name, run in rows.items():
                    _, p, d = run()
                    figures[name][0].append(p)
                    figures[name][1].append(d)
                print(f"round {k + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {f[0][-1]:.0f}/{f[1][-1]:.1f}" for n, f in figures.items()), flush=True)
        finally:
            theirs.close()

        read = gguf_active_bytes(path, cfg) + 2 * state_bytes(cfg)
        roofline = bw / read
        print(f"\nbytes read per decoded token: {read / 1e6:.1f} MB (F32 weights, top-{cfg.moe.top_k} of "
              f"{cfg.moe.num_experts} experts, recurrent state {state_bytes(cfg) / 1e6:.2f} MB read and rewritten)")
        print("\n| system | weights | prefill tok/s | decode tok/s | roofline decode tok/s | % of roofline |")
        print("|---|---|---|---|---|---|")
        for name, (p, d) in figures.items():
            pm, dm = statistics.median(p), statistics.median(d)
            print(f"| {name} | F32 GGUF | {pm:.0f} | {dm:.1f} | {roofline:.1f} | {100 * dm / roofline:.0f}% |")
        pm = {n: statistics.median(f[0]) for n, f in figures.items()}
        dm = {n: statistics.median(f[1]) for n, f in figures.items()}
        print(f"\nmoestream / llama.cpp: prefill {pm['moestream'] / pm['llama.cpp']:.2f}x, "
              f"decode {dm['moestream'] / dm['llama.cpp']:.2f}x")


if __name__ == "__main__":
    main()
