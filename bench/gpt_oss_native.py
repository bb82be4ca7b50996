"""Decode tok/s of a small random gpt-oss: the torch layers against the native step
(engine.models.gpt_oss.step), from an int4 and an MXFP4 expert store, every expert resident.

    python bench/gpt_oss_native.py                 # hidden 512, 6 layers, 16 experts top-4
    python bench/gpt_oss_native.py --prompt 64 --new 32 --rounds 3

Both paths use the same store and int8 dense linears (``dense="int8"``); rounds alternate
torch / native and the median is printed. Prompt of random ids (seed 1234), greedy decode. The
last column: how many greedy tokens agree before the first difference (a random model's logits
are nearly tied, so summation order alone can flip one; the tests check equality on models whose
logits are not: tests/engine/test_step_gpt_oss.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

SHAPE = dict(vocab_size=8000, hidden_size=512, intermediate_size=512, num_hidden_layers=6, head_dim=64,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
             num_local_experts=16, num_experts_per_tok=4, sliding_window=128,
             bos_token_id=1, eos_token_id=2, pad_token_id=0,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})


def build(out: Path) -> None:
    import transformers as T

    torch.manual_seed(0)
    model = T.GptOssForCausalLM(T.GptOssConfig(**SHAPE)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if "sinks" in name else 0.02))
    model.save_pretrained(out)


def decode_tps(model, prompt: list[int], new: int) -> tuple[float, list[int]]:
    from engine.layers.sampler import SamplingConfig
    from engine.runner import stream_request

    stats, toks = None, []
    for out, stats in stream_request(model, prompt, SamplingConfig(max_tokens=new, ignore_eos=True)):
        toks += out.new_token_ids
    return stats.decode_tps, toks


def main() -> None:
    from engine.experts.runtime import load_from_store
    from engine.options import configure
    from engine.quant.formats import QuantFormat
    from engine.store import convert

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--int8-activations", type=int, choices=(0, 1), default=1,
                    help="1: int8 activations where the CPU has VNNI (the default runtime option); 0: float")
    args = ap.parse_args()
    configure(int8_activations=bool(args.int8_activations))
    prompt = torch.randint(3, SHAPE["vocab_size"], (args.prompt,),
                           generator=torch.Generator().manual_seed(1234)).tolist()
    print(f"gpt-oss hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, "
          f"{SHAPE['num_local_experts']} experts top-{SHAPE['num_experts_per_tok']}, expert width "
          f"{SHAPE['intermediate_size']}, window {SHAPE['sliding_window']}; prompt {args.prompt}, "
          f"{args.new} new tokens, batch 1, median of {args.rounds} alternating rounds, int8 dense, "
          f"int8 activations {'on' if args.int8_activations else 'off'}, {torch.get_num_threads()} threads")
    print("| experts | torch layers decode tok/s | native step decode tok/s | speed-up | greedy tokens equal (prefix) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build(tmp / "hf")
        for fmt in ("int4", "mxfp4"):
            convert(tmp / "hf", tmp / fmt, fmt=QuantFormat(fmt, 32), progress=False)
            runs: dict[bool, list[float]] = {False: [], True: []}
            toks = {}
            with load_from_store(tmp / fmt, prefetch_depth=0, dense="int8") as sm:
                for _ in range(args.rounds):
                    for on in (False, True):
                        prev = configure(fused_step=on)
                        try:
                            tps, toks[on] = decode_tps(sm.model, prompt, args.new)
                        finally:
                            configure(prev)
                        runs[on].append(tps)
            t, n = statistics.median(runs[False]), statistics.median(runs[True])
            same = next((i for i, (a, b) in enumerate(zip(toks[False], toks[True])) if a != b), len(toks[True]))
            print(f"| {fmt} | {t:.1f} | {n:.1f} | {n / t:.2f}x | {same}/{len(toks[True])} |", flush=True)


if __name__ == "__main__":
    main()
