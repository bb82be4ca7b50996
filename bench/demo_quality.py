"""Quality and routing of the demo model (moestream demo's moefied SmolLM2) against the dense one.

    python bench/demo_quality.py                  # ~5 min on 2 cores after `moestream demo` built it
    python bench/demo_quality.py --write-traces tests/data

Prints: perplexity / KL vs dense SmolLM2 on held-out Python documentation for the unquantized
demo checkpoint and its int4, nf4 and int8 stores; the demo's greedy answers beside the dense
model's; per-layer routing statistics on held-out text; and LRU / LFU / Belady hit rates at
10/25/50% of the experts on a real decode trace and on synthetic traces of two skews.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.assets import smollm2_gguf  # noqa: E402
from engine.evaluate import (  # noqa: E402
    evaluate, generation_trace, open_model, reference_run, routing_stats, routing_trace, save_trace,
)
from engine.experts.simulate import budgets_from_fractions, sweep  # noqa: E402
from engine.experts.synthetic import synthetic_trace  # noqa: E402
from engine.quant.formats import QuantFormat  # noqa: E402
from engine.store import convert  # noqa: E402
from engine.text import heldout_text  # noqa: E402
from services.demo import DemoConfig, build, cache_root  # noqa: E402

QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "What is 2+2?",
             "Write a Python function that returns the square of a number.")


def answer(loaded, question: str, max_tokens: int) -> str:
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine

    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    engine = Engine.for_requests(loaded.model, loaded.tokenizer, len(ids) + max_tokens)
    return engine.generate([Request(ids, SamplingConfig(max_tokens=max_tokens))])[0].text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 256 tokens")
    ap.add_argument("--max-answer-tokens", type=int, default=40)
    ap.add_argument("--write-traces", type=Path, default=None)
    args = ap.parse_args()

    cfg = DemoConfig()
    store = build(cfg, progress=False, log=lambda m: print(m, file=sys.stderr))
    hf = store.parent / "hf"
    dense = smollm2_gguf()
    text = heldout_text()
    ref = reference_run(dense, text, max_windows=args.windows, progress=False)
    print(f"demo configuration: E={cfg.experts} K={cfg.top_k} shared fraction {cfg.shared_fraction}, "
          f"calibration {cfg.calib_tokens} tokens; held-out: {args.windows} windows of 256 tokens")
    print("\n| model | weights | ppl | ppl / dense | mean KL | top-1 agreement |")
    print("|---|---|---|---|---|---|")
    ref_ppl = evaluate(dense, ref, text, progress=False).ppl
    print(f"| dense SmolLM2-135M | GGUF Q4_1 dequantized | {ref_ppl:.3f} | 1.000 | 0 | 100% |")
    with tempfile.TemporaryDirectory() as tmp:
        targets = [("moefied, unquantized experts", hf)]
        for quant in ("int8", "nf4", "int4"):
            out = Path(tmp) / quant
            convert(hf, out, fmt=QuantFormat(quant, 32), progress=False)
            targets.append((f"moefied, {quant} g32 experts", out))
        for label, path in targets:
            r = evaluate(path, ref, text, progress=False)
            print(f"| demo | {label} | {r.ppl:.3f} | {r.ppl / ref_ppl:.3f} | {r.mean_kl:.4f} | "
                  f"{r.top1_agreement:.1%} |")

    print("\nanswers (greedy, chat template):")
    d, m = open_model(dense), open_model(store)
    for q in QUESTIONS:
        print(f"\nQ: {q}\n  dense: {answer(d, q, args.max_answer_tokens)!r}\n  demo (int4 store): "
              f"{answer(m, q, args.max_answer_tokens)!r}")

    trace = routing_trace(m.model, m.tokenizer, text, windows=4)
    stats = routing_stats(trace)
    print("\nrouting on held-out text (4 windows x 256 tokens), per layer: usage entropy (normalised) "
          "/ share of picks taken by the top 10% of experts")
    ent, top = stats["entropy"], stats["top10_share"]
    print("  " + "  ".join(f"L{i}:{e:.2f}/{t:.0%}" for i, (e, t) in enumerate(zip(ent, top))))
    print(f"  mean entropy {sum(ent) / len(ent):.3f}, mean top-10% share {sum(top) / len(top):.1%}")

    prompts = [m.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    gen, _ = generation_trace(m.model, prompts, 64, eos_ids=sorted(m.tokenizer.eos_token_ids))
    if args.write_traces:
        save_trace(trace, args.write_traces / "smollm2_demo_heldout_prefill.npz")
        save_trace(gen, args.write_traces / "smollm2_demo_generate.npz")
    fr = [0.10, 0.25, 0.50]
    print(f"\nsimulated hit rates, decode trace of the demo model ({gen.num_tokens} tokens):")
    print(sweep(gen, ["lru", "lfu", "belady"], budgets_from_fractions(gen, fr)).format())
    for zipf in (0.6, 1.2):
        syn = synthetic_trace(400, gen.num_layers, gen.num_experts, gen.top_k, zipf=zipf, locality=0.3, seed=0)
        print(f"\nsynthetic trace, same shape, zipf {zipf}, locality 0.3:")
        print(sweep(syn, ["lru", "lfu", "belady"], budgets_from_fractions(syn, fr)).format())
    m.close()
    d.close()


if __name__ == "__main__":
    main()
