"""Quality of moefied SmolLM2-135M-Instruct: perplexity and KL vs the dense model on held-out
text, for plain and shared-expert splits at several top-K, plus the demo configuration's greedy
chat answers beside the dense model's.

    python bench/moefy_quality.py                       # ~10-15 min on 2 cores
    python bench/moefy_quality.py --write-traces tests/data   # also refresh the shipped traces

Calibrates once (the MLP traffic is shared by every fit), fits once per (E, shared fraction)
and varies K without refitting (K only changes how many groups are selected). The K tables
use in-memory models built from the same tensors that write_checkpoint writes; the demo
configuration is written to disk and loaded back through the ordinary loader.

Peer figures ("study"): a feasibility study of the same method on SmolLM2 (5k held-out tokens
of different text, dense ppl 10.93). The physical limit is the dense model itself: ratio 1.0,
KL 0.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.assets import smollm2_gguf  # noqa: E402
from engine.evaluate import (  # noqa: E402
    Loaded, evaluate, expert_nbytes, generation_trace, reference_run, routing_stats, routing_trace,
    save_trace,
)
from engine.moefy import calibrate, fit_moe, moe_model, routing_facts, write_checkpoint  # noqa: E402
from engine.text import heldout_text, text_info  # noqa: E402

QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "What is 2+2?")
STUDY = {("plain", 14): 1.13, ("plain", 12): 1.37, ("shared", 8): 1.23, ("shared", 4): 1.55}
CONFIGS = (("plain", 0.0, (8, 12, 14, 16)), ("shared", 0.5, (4, 8)))
DEMO = ("shared", 0.5, 8)


def answer(model, tok, question: str, max_tokens: int) -> str:
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine

    ids = tok.apply_chat_template([{"role": "user", "content": question}])
    engine = Engine.for_requests(model, tok, len(ids) + max_tokens)
    return engine.generate([Request(ids, SamplingConfig(max_tokens=max_tokens, temperature=0.0))])[0].text.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 256 tokens")
    ap.add_argument("--calib-tokens", type=int, default=6144)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--max-answer-tokens", type=int, default=40)
    ap.add_argument("--write-traces", type=Path, default=None, help="directory for the small real traces")
    ap.add_argument("--keep", type=Path, default=None, help="keep the demo checkpoint here")
    args = ap.parse_args()
    torch.manual_seed(0)
    t_all = time.perf_counter()
    src = smollm2_gguf()
    held = text_info("heldout")
    print(f"config: model {src.name}; E={args.experts}; calibration {args.calib_tokens} tokens "
          f"(pydoc calibration split); held-out {args.windows} x 256-token windows "
          f"({held['characters']} chars, python {held['python']}); torch threads {torch.get_num_threads()}, "
          f"cpus {os.cpu_count()}", flush=True)

    t = time.perf_counter()
    cal = calibrate(src, calib_tokens=args.calib_tokens, progress=False)
    t_cal = time.perf_counter() - t
    tok = cal.tokenizer
    print(f"calibrate: {cal.info['tokens']} tokens in {t_cal:.0f}s", flush=True)
    t = time.perf_counter()
    ref = reference_run((cal.model, tok), heldout_text(), window=256, max_windows=args.windows, progress=False)
    t_ref = time.perf_counter() - t
    print(f"reference: dense on {len(ref.windows)} windows in {t_ref:.0f}s", flush=True)

    rows, timings = [], {"calibrate": t_cal, "reference": t_ref}
    demo_fit = None
    for name, shared, ks in CONFIGS:
        t = time.perf_counter()
        fit = fit_moe(cal, experts=args.experts, shared_fraction=shared, progress=False)
        timings[f"fit {name}"] = time.perf_counter() - t
        print(f"fit {name}: {timings[f'fit {name}']:.0f}s", flush=True)
        for k in ks:
            t = time.perf_counter()
            model = moe_model(fit, k)
            r = evaluate((model, tok), ref, None, progress=False)
            facts = routing_facts(fit, k)  # the 1/K approximation, as written
            dev = max(f["weight_deviation_max"] for f in facts)
            recall = sum(fit.recall(k)) / len(fit.layers)
            rows.append((name, shared, k, r, recall, dev, time.perf_counter() - t))
            print(f"  {name} K={k}: {r}", flush=True)
            del model
            gc.collect()
        if (name, shared) == DEMO[:2]:
            demo_fit = fit
        else:
            del fit
            gc.collect()

    print()
    print(f"dense SmolLM2 held-out ppl {ref_ppl(rows):.3f} on {rows[0][3].tokens} tokens "
          f"({rows[0][3].windows} windows); limit: ratio 1.000, KL 0")
    head = (f"{'split':<7} {'E':>3} {'K':>3} {'shared':>6} {'active MLP':>10} {'ppl':>8} {'ratio':>7} "
            f"{'study':>6} {'mean KL':>8} {'top1 agree':>10} {'recall@K':>8} {'max|Kw-1|':>9} {'sec':>5}")
    print(head)
    print("-" * len(head))
    for name, shared, k, r, recall, dev, sec in rows:
        active = shared + (1 - shared) * k / args.experts
        study = STUDY.get((name, k))
        print(f"{name:<7} {args.experts:>3} {k:>3} {shared:>6.2f} {100 * active:>9.1f}% {r.ppl:>8.3f} "
              f"{r.ratio:>6.3f}x {(f'{study:.2f}x' if study else '-'):>6} {r.mean_kl:>8.4f} "
              f"{100 * r.top1_agreement:>9.1f}% {recall:>8.3f} {dev:>9.1e} {sec:>5.0f}")

    # ---- demo configuration: written to disk, loaded back, chat answers beside the dense model
    from engine.loading import load_model

    name, shared, k = DEMO
    tmp = None
    out = args.keep
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="moefy-demo-")
        out = Path(tmp.name) / "ckpt"
    t = time.perf_counter()
    summary = write_checkpoint(demo_fit, out, k)
    demo, demo_tok, _ = load_model(out)
    t_write = time.perf_counter() - t
    print()
    print(f"demo: {summary}")
    print(f"demo checkpoint written and reloaded through engine.loading in {t_write:.0f}s")
    t = time.perf_counter()
    for q in QUESTIONS:
        print(f"Q: {q}")
        print(f"   dense : {answer(cal.model, tok, q, args.max_answer_tokens)!r}")
        print(f"   moe   : {answer(demo, demo_tok, q, args.max_answer_tokens)!r}")
    timings["answers"] = time.perf_counter() - t

    if args.write_traces is not None:
        t = time.perf_counter()
        args.write_traces.mkdir(parents=True, exist_ok=True)
        loaded = Loaded(demo, demo_tok, str(out))
        base = {"model": f"SmolLM2-135M-Instruct moefied: E={args.experts} K={k} shared {shared}, seed 0",
                "expert_bytes": expert_nbytes(loaded),
                "expert_params": 3 * demo.config.hidden_size * demo.config.moe.expert_intermediate_size,
                "text": "pydoc_data.topics held-out split", "python": held["python"]}
        tr = routing_trace(demo, demo_tok, heldout_text(), 2, window=128)
        p1 = save_trace(tr, args.write_traces / "smollm2_moe16_top8_heldout_prefill.npz",
                        {**base, "mode": "prefill", "windows": 2, "window": 128})
        from engine.text import windows

        prompts = windows(demo_tok, heldout_text(), 32, 2)
        tr2, outs = generation_trace(demo, prompts, 160)  # no EOS: full-length decode streams
        p2 = save_trace(tr2, args.write_traces / "smollm2_moe16_top8_heldout_generate.npz",
                        {**base, "mode": "generate", "prompts": 2, "prompt_tokens": 32, "max_tokens": 160,
                         "generated": [demo_tok.decode(o) for o in outs]})
        for p, tr_ in ((p1, tr), (p2, tr2)):
            st = routing_stats(tr_)
            print(f"trace {p} ({p.stat().st_size / 1e3:.0f} KB): {tr_!r}; usage entropy "
                  f"{st['mean_entropy']:.3f}, top-10% share {100 * st['mean_top10_share']:.1f}%")
        timings["traces"] = time.perf_counter() - t
    if tmp is not None:
        tmp.cleanup()
    timings["total"] = time.perf_counter() - t_all
    print("timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))


def ref_ppl(rows) -> float:
    return rows[0][3].ref_ppl


if __name__ == "__main__":
    main()
