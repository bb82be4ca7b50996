"""One alternating run of moestream and llama.cpp on the same F32 GGUF written by llama.cpp's own
converter from a random transformers checkpoint: greedy tokens compared, prefill and decode
tokens/s of both beside the memory-bandwidth roofline. The frame of bench/qwen35_vs_llama_cpp.py
and bench/qwen4exp_vs_llama_cpp.py (each says its model, shape and bytes per token).

Prompt: ``--prompt`` random ids (torch.Generator seed 1234), then ``--new`` greedy tokens, batch
1, ``--threads`` threads each; rows alternate inside a round after one warm-up each; the table
holds the median of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_cpu import measure_bandwidth  # noqa: E402
from llama_cpp_converter import ConverterUnavailable  # noqa: E402
from llama_child import LlamaCppChild, LlamaCppDied  # noqa: E402
from vs_llama_cpp import INSTALL_HINT, have_llama_cpp, load_fp32, make_prompt, moestream_greedy  # noqa: E402


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny shape")
    ap.add_argument("--llama-lib", type=Path, default=None, metavar="DIR",
                    help="a native build of llama.cpp's libraries (bash bench/build_llama_cpp.sh DIR) instead of "
                         "the installed wheel's")


def run(args: argparse.Namespace, *, model: str, shape: dict, build: Callable[[Path, dict], None],
        to_gguf: Callable[[Path, Path], Path], read_bytes: Callable[[Path, object], tuple[float, str]],
        reference: Callable[[Path, list[int], int], list[int]] | None = None) -> None:
    """The run. ``build(dir, shape)`` writes the checkpoint, ``to_gguf(dir, out)`` converts it,
    ``read_bytes(gguf, config)`` gives the bytes one decoded token reads and what they are;
    ``reference(dir, prompt, new)``, if given, the transformers greedy tokens to check both against."""
    if not have_llama_cpp():
        print(INSTALL_HINT)
        return
    torch.set_num_threads(args.threads)
    if args.layers is not None:
        shape = dict(shape, num_hidden_layers=args.layers)
    bw = measure_bandwidth()
    print(f"threads {args.threads}, memory read bandwidth {bw / 1e9:.1f} GB/s, prompt {args.prompt} tokens, "
          f"{args.new} new tokens, batch 1, {args.rounds} alternating rounds (median)\n"
          f"model: {model}, F32 GGUF by llama.cpp's converter: " + ", ".join(f"{k}={v}" for k, v in shape.items()),
          flush=True)
    with tempfile.TemporaryDirectory(prefix="gguf_side_by_side_") as tmp_name:
        tmp = Path(tmp_name)
        t = time.perf_counter()
        build(tmp / "hf", shape)
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
        try:  # in a child: a wheel built for instructions this CPU lacks dies of SIGILL (AVX2-only EPYC)
            theirs = LlamaCppChild(path, args.threads, args.prompt + args.new + 16, min(args.prompt, 512),
                                   lib=args.llama_lib)
        except LlamaCppDied as e:
            print(f"stopped: llama.cpp does not run this model here: {e}")
            return
        try:
            rows = {"moestream": lambda: moestream_greedy(ours, prompt, args.new),
                    "llama.cpp": lambda: theirs.greedy(prompt, args.new)}
            tokens = {name: run_row()[0] for name, run_row in rows.items()}  # also the warm-up
            if reference is not None:
                tokens["transformers"] = reference(tmp / "hf", prompt, args.new)
            a = tokens["moestream"]
            for name, b in tokens.items():
                if name != "moestream":
                    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                    print(f"greedy tokens, moestream vs {name}: first {agree} of {args.new} agree "
                          f"({sum(x == y for x, y in zip(a, b))}/{args.new} positions equal)")
            print("\n".join(f"  {name:<12} {t}" for name, t in tokens.items()), flush=True)
            figures: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in rows}
            for k in range(args.rounds):
                for name, run_row in rows.items():
                    _, p, d = run_row()
                    figures[name][0].append(p)
                    figures[name][1].append(d)
                print(f"round {k + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {f[0][-1]:.0f}/{f[1][-1]:.1f}" for n, f in figures.items()), flush=True)
        finally:
            theirs.close()

        read, what = read_bytes(path, cfg)
        roofline = bw / read
        print(f"\nbytes read per decoded token: {read / 1e6:.1f} MB ({what})")
        print("\n| system | weights | prefill tok/s | decode tok/s | roofline decode tok/s | % of roofline |")
        print("|---|---|---|---|---|---|")
        for name, (p, d) in figures.items():
            pm, dm = statistics.median(p), statistics.median(d)
            print(f"| {name} | F32 GGUF | {pm:.0f} | {dm:.1f} | {roofline:.1f} | {100 * dm / roofline:.0f}% |")
        pm = {n: statistics.median(f[0]) for n, f in figures.items()}
        dm = {n: statistics.median(f[1]) for n, f in figures.items()}
        print(f"\nmoestream / llama.cpp: prefill {pm['moestream'] / pm['llama.cpp']:.2f}x, "
              f"decode {dm['moestream'] / dm['llama.cpp']:.2f}x")
