"""Two settings of the runtime options on one decode, A/B in one process: rounds alternate A, B, B, A,
..., each round a fresh request of ``--tokens`` decoded tokens after the same prompt, and the verdict
pairs the rounds. On a machine whose memory bus drifts (a 2-core EPYC VM read 52.8 GB/s and 32.7 GB/s
within one hour on 2026-12-05) two separate runs of a bench cannot resolve a 5% change; paired
rounds seconds apart can: a stream-order change of the expert kernels read gate_up 2.09 -> 1.81 ms
a token, faster in 16 of 16 rounds, where two single runs had disagreed on its sign.

    python bench/decode_ab.py --b native_threads=1                # every core against one
    python bench/decode_ab.py --b cpu_isa=avx2 --rounds 8          # the AVX2 kernels on this CPU
    python bench/decode_ab.py --store DIR --a kv_bf16=0 --b kv_bf16=1

A and B are comma-separated ``option=value`` changes to the options in force
(engine.options.RuntimeOptions: ``int8_activations``, ``kv_bf16``, ``native_threads``, ``cpu_isa``,
``amx``, ``fused_step``, ...; ``0``/``1`` for switches); an empty one is the options as they are.
The model: ``--store DIR`` (an expert store; default: the random Qwen3-MoE 1.3B-A0.2B of
bench/vs_llama_cpp.py, int4 g64 experts, converted into a temporary directory), loaded once, every
expert in its slot, the default dense format. Per setting: the median wall time of a decoded token
and of each phase of the native step (engine/csrc/phases.h); then, per round pair, B's time against
A's, and the last line ``decode A/B: B x.xx% faster (median of n paired rounds), faster in k of n``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from engine.errors import ConfigError  # noqa: E402
from engine.options import RuntimeOptions, configure, options  # noqa: E402


def parse_changes(text: str) -> dict:
    """``"a=1,b=avx2"`` -> the RuntimeOptions changes it names, each value converted to its field's
    type (switches: 0/1); ConfigError for an unknown option or a value of the wrong kind."""
    fields = {f.name: f for f in dataclasses.fields(RuntimeOptions)}
    changes: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or name not in fields:
            raise ConfigError(f"{item!r}: expected option=value with option one of {', '.join(fields)}")
        kind = type(fields[name].default)
        if kind is bool:
            if raw not in ("0", "1"):
                raise ConfigError(f"{name}={raw!r}; allowed: 0 or 1")
            changes[name] = raw == "1"
        elif kind is int:
            try:
                changes[name] = int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r}; allowed: an integer") from None
        else:
            changes[name] = raw
    RuntimeOptions(**{**dataclasses.asdict(options()), **changes})  # the options' own checks
    return changes


def paired(a: list[float], b: list[float]) -> tuple[float, int]:
    """(median of 1 - b_k / a_k over the rounds, rounds where b_k < a_k): B's lead on A, pair by pair."""
    return statistics.median(1 - y / x for x, y in zip(a, b)), sum(y < x for x, y in zip(a, b))


def one_round(model, prompt: list[int], tokens: int) -> dict:
    """A fresh request: wall ms per decoded token and each native phase's (bench/vs_llama_cpp.py)."""
    from vs_llama_cpp import phase_breakdown

    b = phase_breakdown(model, prompt, tokens)
    return {"wall": b["wall"], **b["phases"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="", help="option changes of A (default: none)")
    ap.add_argument("--b", default="", help="option changes of B")
    ap.add_argument("--store", type=Path, default=None, help="an expert store (default: the 1.3B random one)")
    ap.add_argument("--shape", choices=["issue", "tiny"], default="issue", help="the default model's shape")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens a round")
    ap.add_argument("--rounds", type=int, default=16, help="rounds of each setting")
    args = ap.parse_args(argv)
    try:
        a, b = parse_changes(args.a), parse_changes(args.b)
    except ConfigError as e:
        raise SystemExit(f"decode_ab: {e}") from None
    if args.rounds < 1 or args.tokens < 1:
        raise SystemExit("decode_ab: --rounds and --tokens must be >= 1")

    from engine.experts.runtime import load_from_store
    from vs_llama_cpp import ISSUE_SHAPE, TINY_SHAPE, build_hf, make_prompt, moestream_greedy

    base = options()
    with contextlib.ExitStack() as stack:
        store = args.store
        if store is None:
            from engine.quant.formats import QuantFormat
            from engine.store import convert

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="decode_ab_")))
            hf, _ = build_hf(dict(TINY_SHAPE if args.shape == "tiny" else ISSUE_SHAPE))
            hf.save_pretrained(tmp / "hf")
            convert(tmp / "hf", tmp / "store", fmt=QuantFormat("int4", 64), progress=False)
            store = tmp / "store"
        sm = load_from_store(store, prefetch_depth=0, warm=True)
        stack.callback(sm.close)
        stack.callback(configure, base)
        prompt = make_prompt(args.prompt, sm.model.config.vocab_size)
        settings = {"A": a, "B": b}
        for name in ("A", "B"):  # warm-up: each setting's kernels built and touched once
            configure(base, **settings[name])
            moestream_greedy(sm.model, prompt, 4)
        print(f"A: {args.a or '(as in force)'}; B: {args.b or '(as in force)'}; {args.rounds} rounds of "
              f"{args.tokens} tokens each after a {args.prompt}-token prompt, alternating A B B A ...", flush=True)
        got: dict[str, list[dict]] = {"A": [], "B": []}
        t0 = time.perf_counter()
        for k in range(args.rounds):
            for name in ("A", "B") if k % 2 == 0 else ("B", "A"):
                configure(base, **settings[name])
                got[name].append(one_round(sm.model, prompt, args.tokens))
        print(f"{2 * args.rounds} rounds in {time.perf_counter() - t0:.0f} s")
    keys = ["wall"] + [k for k in got["A"][0] if k != "wall" and statistics.median(r[k] for r in got["A"]) >= 0.005]
    print("\n| setting | " + " | ".join(f"{k} ms" for k in keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name in ("A", "B"):
        print(f"| {name} | " + " | ".join(f"{statistics.median(r[k] for r in got[name]):.3f}" for k in keys) + " |")
    print("\nB against A, pair by pair (median lead, rounds B was faster):")
    for k in keys[1:]:
        lead, n = paired([r[k] for r in got["A"]], [r[k] for r in got["B"]])
        print(f"  {k}: {100 * lead:+.1f}%, {n} of {args.rounds}")
    lead, n = paired([r["wall"] for r in got["A"]], [r["wall"] for r in got["B"]])
    print(f"decode A/B: B {100 * lead:.2f}% faster (median of {args.rounds} paired rounds), faster in {n} of {args.rounds}")


if __name__ == "__main__":
    main()
