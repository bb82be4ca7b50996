"""Serving benchmark: throughput and latency of engine.runner.Engine at 1, 4 and 16 concurrent
streams on a random Qwen3-MoE built in memory (no files), next to the single-sequence
reference loop (engine.generate.generate_ids) and the memory-bandwidth roofline.

    python bench/serving.py                       # hidden 512, 8 layers, 32 experts top-4
    python bench/serving.py --streams 1 4 16 --prompt-len 64 --new-tokens 32

Every stream's request arrives at t=0; TTFT is arrival -> first token, inter-token latency
(ITL) is the gap between a stream's consecutive tokens. Roofline: each step must read the
dense weights once plus every distinct expert the batch routes to (counted during the run),
so tokens/s <= tokens per step x bandwidth / bytes per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.config import ModelConfig, MoEConfig
from engine.generate import Request, generate_ids
from engine.kv.paged import PagedKVCache
from engine.layers.moe import ExpertProvider
from engine.layers.sampler import SamplingConfig
from engine.loading.source import TensorInfo, TensorSource, expert_name
from engine.models.base import CausalLM
from engine.models.load import build_model, resident_experts
from engine.runner import Engine
from engine.scheduler import SchedulerConfig


class RandomSource(TensorSource):
    """Random weights under canonical names, made on first ``get``."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        with torch.device("meta"):
            shapes = {n: tuple(t.shape) for n, t in CausalLM(cfg).state_dict().items()}
        m = cfg.moe
        for layer in cfg.moe_layers:
            for e in range(m.num_experts):
                shapes[expert_name(layer, e, "gate_proj")] = (m.expert_intermediate_size, cfg.hidden_size)
                shapes[expert_name(layer, e, "up_proj")] = (m.expert_intermediate_size, cfg.hidden_size)
                shapes[expert_name(layer, e, "down_proj")] = (cfg.hidden_size, m.expert_intermediate_size)
        self.shapes, self.path, self.gen = shapes, "<random>", torch.Generator().manual_seed(seed)

    def names(self):
        return sorted(self.shapes)

    def info(self, name):
        return TensorInfo(name, self.shapes[name], "f32")

    def get(self, name):
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return 1 + 0.1 * torch.randn(shape, generator=self.gen)
        return torch.randn(shape, generator=self.gen) * shape[-1] ** -0.5


class CountingExperts(ExpertProvider):
    """Counts the distinct experts each layer acquires (= expert weights read per step)."""

    def __init__(self, inner: ExpertProvider) -> None:
        self.inner, self.acquired = inner, 0

    def acquire(self, layer, expert_ids):
        self.acquired += len(expert_ids)
        return self.inner.acquire(layer, expert_ids)


def read_bandwidth(nbytes: int = 1 << 29) -> float:
    """Best-of-5 GB/s of summing a buffer far larger than the caches (random data: pages of
    one repeated value may be deduplicated by a VM host and then read from cache)."""
    x = torch.rand(nbytes // 4)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", choices=["bf16", "fp32", "fp8"], default="bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = ModelConfig(arch="qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 2, num_layers=args.layers,
                      num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256),
                      head_dim=64, max_position_embeddings=4096, qk_norm=True,
                      moe=MoEConfig(num_experts=args.experts, top_k=args.top_k,
                                    expert_intermediate_size=args.moe_intermediate,
                                    norm_topk_prob=True))
    source = RandomSource(cfg)
    experts = CountingExperts(resident_experts(cfg, source, torch.float32))
    model = build_model(cfg, source, provider=experts)
    kv_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}[args.kv_dtype]
    counts = cfg.parameter_counts()
    expert_bytes = 3 * args.hidden * args.moe_intermediate * 4
    dense_bytes = (counts["dense"] - cfg.vocab_size * cfg.hidden_size) * 4  # one embedding row read
    bw = read_bandwidth()
    g = torch.Generator().manual_seed(1)

    def workload(n: int) -> list[Request]:
        return [Request(torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=g).tolist(),
                        SamplingConfig(max_tokens=args.new_tokens, ignore_eos=True)) for _ in range(n)]

    print(f"model: random Qwen3-MoE, hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
          f"{cfg.num_heads}/{cfg.num_kv_heads} heads, {args.experts} experts top-{args.top_k}, moe "
          f"intermediate {args.moe_intermediate}, vocab {cfg.vocab_size}; {counts['total'] / 1e6:.0f}M "
          f"total / {counts['active'] / 1e6:.0f}M active params, fp32 weights")
    print(f"workload: each stream {args.prompt_len} prompt tokens + {args.new_tokens} new (greedy); "
          f"KV {args.kv_dtype} paged, block {args.block_size}; step budget {args.max_batched_tokens} "
          f"tokens; torch {torch.__version__}, {torch.get_num_threads()} threads; memory read {bw:.1f} GB/s")

    # peer: the single-sequence reference loop (same model, contiguous KV)
    req = workload(1)[0]
    list(generate_ids(model, req.prompt_ids, SamplingConfig(max_tokens=4, ignore_eos=True)))  # warm-up
    t = time.perf_counter()
    for _, _, stats in generate_ids(model, req.prompt_ids, req.sampling):
        pass
    ref_wall = time.perf_counter() - t
    print(f"peer: reference loop (engine.generate.generate_ids), 1 stream: "
          f"{stats.generated_tokens / ref_wall:.1f} gen tok/s end to end, TTFT "
          f"{stats.prefill_seconds * 1e3:.0f} ms, decode {stats.decode_tps:.1f} tok/s")

    rows = []
    for n in args.streams:
        reqs = workload(n)
        blocks = n * -(-(args.prompt_len + args.new_tokens) // args.block_size) + 1
        kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, blocks, args.block_size, kv_dtype)
        engine = Engine(model, None, kv, SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens,
                                                         max_num_seqs=max(n, 1)))
        warm = [Request(r.prompt_ids[:8], SamplingConfig(max_tokens=4, ignore_eos=True)) for r in reqs]
        Engine(model, None, kv, SchedulerConfig(max_num_seqs=max(n, 1))).generate(warm)  # batch shapes
        experts.acquired = 0
        t = time.perf_counter()
        results = engine.generate(reqs)
        wall = time.perf_counter() - t
        m = engine.metrics()
        gen = sum(len(r.output_ids) for r in results)
        ttft = [r.ttft for r in results]
        itl = [x for r in results for x in r.inter_token_latencies]
        bytes_read = experts.acquired * expert_bytes + m.steps * dense_bytes
        roof = (m.computed_tokens / (bytes_read / (bw * 1e9)))  # tokens/s if only bytes mattered
        rows.append((n, gen / wall, (m.computed_tokens) / wall, statistics.median(ttft) * 1e3,
                     max(ttft) * 1e3, pct(itl, 0.5) * 1e3, pct(itl, 0.99) * 1e3, m.steps,
                     bytes_read / wall / 1e9, roof, m.preemptions))

    head = ("streams", "gen tok/s", "all tok/s", "TTFT p50 ms", "TTFT max ms", "ITL p50 ms",
            "ITL p99 ms", "steps", "weights GB/s", "roofline tok/s", "preempt")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.1f} | {r[6]:.1f} "
              f"| {r[7]} | {r[8]:.1f} | {r[9]:.0f} | {r[10]} |")
    print("gen tok/s: generated tokens / wall; all tok/s: prompt + generated tokens through the model; "
          "weights GB/s: dense + distinct expert bytes per step, over wall time; roofline: all tok/s "
          f"if every step ran at the measured {bw:.1f} GB/s")


if __name__ == "__main__":
    main()
