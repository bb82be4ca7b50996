"""Which dense format should be the default: quality and decode speed of each (dense, head) pair.

    python bench/dense_formats.py                  # the demo store (run `moestream demo` once first)
    python bench/dense_formats.py --store STORE --tokens 400 --new 64

The same int4 expert store is loaded with each pair of formats for the dense linears (attention,
shared expert, router inputs) and the LM head: fp32 (the exact reference), bf16, int8, int8 with a bf16 head, and an int4
head. Held-out English text (pydoc of ``str`` and ``dict``) is fed one token at a time, as decoding
does; each row prints its perplexity, the ratio to fp32's, the mean KL(fp32 || row) per token, top-1
agreement with fp32, the dense bytes a decoded token reads, greedy decode tok/s (median of
``--rounds`` alternating rounds, every expert resident), and the greedy answer to a chat question
(``--question``, through the model's chat template). The last line names the fastest pair within
the perplexity/KL bound (perplexity <= 1.02x fp32's and mean KL <= 0.03 nats/token) whose answer
is fp32's: held-out text alone missed that int8 activations break SmolLM2's chat answer
(docs/quantization.md#the-default-dense-format).
"""

from __future__ import annotations

import argparse
import math
import pydoc
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from int8_activations import demo_store  # noqa: E402  (the demo store's path: one place)

PAIRS = (("fp32", "fp32"), ("bf16", "bf16"), ("int8", "bf16"), ("int8", "int8"), ("bf16", "int4"),
         ("int8", "int4"))
PPL_BOUND, KL_BOUND = 1.02, 0.03


def held_out_ids(tokenizer, n: int) -> list[int]:
    text = "\n".join(pydoc.render_doc(t, renderer=pydoc.plaintext) for t in (str, dict))
    ids = tokenizer.encode(text)
    if len(ids) < n + 1:
        raise SystemExit(f"the held-out text has {len(ids)} tokens; ask for fewer (--tokens)")
    return ids[: n + 1]


def dense_bytes(model) -> int:
    """Bytes of the dense linears a decoded token reads: every nn.Linear's weight (a tied LM head
    counted as the head it is) and every quantized linear's codes and scales."""
    from torch import nn

    from engine.quant.linear import QuantLinear

    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.q.nbytes
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=400, help="held-out tokens fed one at a time")
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per decode round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--question", default="What is the capital of France?")
    args = ap.parse_args()
    store = args.store or demo_store()
    if store is None:
        print("no store: pass --store, or run `moestream demo` once to build the demo store", file=sys.stderr)
        return 2

    from engine.executor import executor_for
    from engine.experts.runtime import load_from_store
    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.layers.sampler import SamplingConfig
    from engine.runner import stream_request

    models = {pair: load_from_store(store, dense=pair[0], head=pair[1]) for pair in PAIRS}
    ids = held_out_ids(models[PAIRS[0]].tokenizer, args.tokens)
    target = torch.tensor(ids[1:])

    def teacher_forced(sm) -> torch.Tensor:
        cfg = sm.model.config
        kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        step = executor_for(sm.model)
        with torch.no_grad():
            return F.log_softmax(torch.stack([step(torch.tensor([t]), BatchLayout.single(0, 1, i), kv)[0].float()
                                              for i, t in enumerate(ids[:-1])]), -1)

    def decode_tps(sm) -> float:
        stats = None
        for _, stats in stream_request(sm.model, ids[:32], SamplingConfig(max_tokens=args.new, ignore_eos=True)):
            pass
        return stats.decode_tps

    def answer(sm) -> str:
        tok = sm.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": args.question}]) if tok.has_chat_template \
            else tok.encode(args.question)
        out: list[int] = []
        for o, _ in stream_request(sm.model, ids, SamplingConfig(max_tokens=12, temperature=0.0), tokenizer=tok):
            out += o.new_token_ids
        return tok.decode(out).strip().replace("\n", " ").replace("|", "/")

    logp = {pair: teacher_forced(sm) for pair, sm in models.items()}
    answers = {pair: answer(sm) for pair, sm in models.items()}
    for sm in models.values():
        decode_tps(sm)  # warm-up: every expert resident
    speeds: dict[tuple, list[float]] = {pair: [] for pair in PAIRS}
    for _ in range(args.rounds):  # alternating rounds: the machine's load falls on every row alike
        for pair, sm in models.items():
            speeds[pair].append(decode_tps(sm))

    def ppl(lp: torch.Tensor) -> float:
        return math.exp(float(-lp.gather(1, target[:, None]).mean()))

    ref = logp[PAIRS[0]]
    print(f"store {store}: {len(target)} held-out tokens fed one at a time; decode {args.new} greedy tokens, "
          f"median of {args.rounds} alternating rounds, {torch.get_num_threads()} threads")
    print(f"question: {args.question!r}")
    print("| dense | head | perplexity | vs fp32 | KL vs fp32 (nats/token) | top-1 agreement | dense MiB/token | "
          "decode tok/s | greedy answer |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for pair in PAIRS:
        lp = logp[pair]
        p, kl = ppl(lp), float((ref.exp() * (ref - lp)).sum(-1).mean())
        agree = float((ref.argmax(-1) == lp.argmax(-1)).float().mean())
        tps = statistics.median(speeds[pair])
        rows.append((pair, p / ppl(ref), kl, tps, answers[pair] == answers[PAIRS[0]]))
        print(f"| {pair[0]} | {pair[1]} | {p:.3f} | {p / ppl(ref):.4f}x | {kl:.4f} | {agree:.1%} | "
              f"{dense_bytes(models[pair].model) / 2**20:.1f} | {tps:.1f} | {answers[pair]} |")
    within = [r for r in rows if r[1] <= PPL_BOUND and r[2] <= KL_BOUND and r[4]]
    best = max(within, key=lambda r: r[3])
    print(f"fastest within perplexity <= {PPL_BOUND}x, KL <= {KL_BOUND} and fp32's answer: dense {best[0][0]}, head {best[0][1]} "
          f"({best[3]:.1f} tok/s)")
    for sm in models.values():
        sm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
