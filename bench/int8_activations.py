"""int4 weights with int8 activations (the AVX512-VNNI or AVX2 integer decode path) against float activations.

    python bench/int8_activations.py                  # the demo store (run `moestream demo` once first)
    python bench/int8_activations.py --store STORE --tokens 200

Feeds held-out text (pydoc of ``str``) through the store model one token at a time, as decoding
does, once with ``MOESTREAM_INT8_ACTIVATIONS=0`` (exact float activations) and once with the
int8 path, and prints both perplexities, KL(float || int8) per token, top-1 agreement, and the
decode speed of each (greedy, 48 tokens).
"""

from __future__ import annotations

import argparse
import math
import os
import pydoc
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def demo_store() -> Path | None:
    root = Path(os.environ.get("MOESTREAM_CACHE", Path.home() / ".cache" / "moestream")) / "demo"
    stores = sorted(root.glob("*/store/manifest.json"))
    return stores[0].parent if stores else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--dense", default="bf16")
    args = ap.parse_args()
    store = args.store or demo_store()
    if store is None:
        print("no store: pass --store, or run `moestream demo` once to build the demo store", file=sys.stderr)
        return 2

    from engine.executor import executor_for
    from engine.experts.runtime import load_from_store
    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.layers.sampler import SamplingConfig
    from engine.options import configure
    from engine.quant.kernels import int8_activations
    from engine.runner import stream_request

    sm = load_from_store(store, dense=args.dense)
    ids = sm.tokenizer.encode(pydoc.render_doc(str, renderer=pydoc.plaintext))[: args.tokens + 1]
    cfg = sm.model.config

    def teacher_forced() -> torch.Tensor:
        kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        step = executor_for(sm.model)
        return torch.stack([step(torch.tensor([t]), BatchLayout.single(0, 1, i), kv)[0].float()
                            for i, t in enumerate(ids[:-1])])

    def decode_speed() -> float:
        stats = None
        for _, stats in stream_request(sm.model, ids[:32], SamplingConfig(max_tokens=48, ignore_eos=True)):
            pass
        return stats.decode_tps

    runs = {}
    for flag in ("0", "1"):
        configure(int8_activations=flag == "1")
        if flag == "1" and not int8_activations():
            print("no integer-activation kernels here (AVX512-VNNI or AVX2, or the C++ kernels unavailable): "
                  "nothing to compare")
            return 0
        decode_speed()  # warm-up: experts resident
        runs[flag] = (F.log_softmax(teacher_forced(), -1), decode_speed())
    target = torch.tensor(ids[1:])
    (lf, sf), (lq, sq) = runs["0"], runs["1"]

    def ppl(lp: torch.Tensor) -> float:
        return math.exp(float(-lp.gather(1, target[:, None]).mean()))

    kl = float((lf.exp() * (lf - lq)).sum(-1).mean())
    agree = float((lf.argmax(-1) == lq.argmax(-1)).float().mean())
    print(f"store {store}, {len(target)} tokens fed one at a time, dense {args.dense}, threads {torch.get_num_threads()}")
    print("| activations | perplexity | decode tok/s |")
    print("|---|---|---|")
    print(f"| float (exact) | {ppl(lf):.3f} | {sf:.1f} |")
    print(f"| int8 (VNNI) | {ppl(lq):.3f} | {sq:.1f} |")
    print(f"KL(float || int8) per token {kl:.4f}, top-1 agreement {agree:.1%}")
    sm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
