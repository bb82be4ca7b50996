"""Host synchronisations, graph launches and time per decoded token of the GPU step's paths, on
the demo model's routing (issue 29): a synthetic model of the demo trace's shape (30 sparse
layers, 12 experts top-6, tiny hidden size: the step is all overhead, no bandwidth) routed by
``tests/data/smollm2_demo_generate.npz``, a third of its experts in device slots and all of them
in the RAM tier (every miss is in RAM).

    python bench/step_syncs.py                  # CPU: the counting seam (Triton's interpreter)
    python bench/step_syncs.py --device cuda    # GPU: the same, timed, with CUDA graphs

Paths:
    eager               the host cache, no graphs
    per-layer graphs    the host cache: per layer an attention+route graph, the host's acquire,
                        an experts graph (engine.cuda_graphs)
    one graph per step  the device cache (engine.experts.device_cache) in one graph per decode
                        step (engine.cuda_graphs.step_graph)

Per decoded token: host synchronisations (engine.cuda_graphs.syncs: counted where a GPU waits,
on any device), graph launches, the device cache's kernel launches, misses, and ms per token
with the per-layer overhead (ms per token / layers: at this hidden size the layers' arithmetic
is negligible). On the CPU the time is the interpreter's and means nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is first imported: its interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMO = ROOT / "tests" / "data" / "smollm2_demo_generate.npz"
PATHS = ("eager", "per-layer graphs", "one graph per step")


def measure(path: str, tokens: int = 8, device: str = "cpu", slots_share: float = 1 / 3, *,
            shape=None, trace=None, dense: str = "fp32", warmup: int = 0, kernel_tokens: int = 0) -> dict:
    """Decode ``tokens`` tokens of one sequence through ``path`` (module docstring); per token:
    host syncs (total and by reason), graph launches, device-cache launches, misses, ms.
    ``shape`` and ``trace`` (both or neither): another synthetic shape (engine.costmodel) routed
    by that trace (at least ``warmup + tokens + kernel_tokens + 1`` tokens), dense weights in ``dense``; the
    first ``warmup`` tokens after the first fill the cache and are not timed. Default: the demo
    trace's shape, fp32. ``kernel_tokens``: that many more tokens decoded under torch's profiler,
    their kernels' time per token by name under "kernels" (on a GPU: CUDA kernels, those replayed
    inside graphs included; on the CPU: operators' own time)."""
    from engine import cuda_graphs as CG
    from engine.costmodel import ModelShape
    from engine.cuda_graphs.syncs import counting
    from engine.executor import executor_for
    from engine.experts.synthetic_store import SyntheticExpertStore, build_synthetic_model
    from engine.experts.trace import RoutingTrace
    from engine.kv.base import BatchLayout
    from engine.kv.paged import PagedKVCache
    from engine.options import configure

    if path not in PATHS:
        raise ValueError(f"path {path!r}; allowed: {', '.join(PATHS)}")
    if (shape is None) != (trace is None):
        raise ValueError("measure: give both shape and trace, or neither")
    if shape is None:
        trace = RoutingTrace.load(DEMO)
        shape = ModelShape(name="demo-trace", layers=trace.num_layers, hidden=64, experts=trace.num_experts,
                           expert_width=64, top_k=trace.top_k, shared_width=0, vocab=64, heads=2, kv_heads=1,
                           head_dim=32)
    if trace.num_tokens < warmup + tokens + kernel_tokens + 1:
        raise ValueError(f"measure: the trace has {trace.num_tokens} tokens, the run decodes "
                         f"{warmup + tokens + kernel_tokens + 1}")
    store = SyntheticExpertStore(shape)
    slot_bytes = store.read_nbytes
    budget = max(int(shape.layers * shape.experts * slots_share), shape.top_k) * slot_bytes
    device_cache = path == "one graph per step"
    prev = configure(int8_activations=False, fused_step=False)
    sm = build_synthetic_model(shape, device_budget=budget, device=device, dense=dense, trace=trace,
                               source=store.ram_source(), device_cache=device_cache, trace_on_device=True)
    try:
        model, cache = sm.model, sm.cache
        cache.grouped = True
        factory = CG.CudaGraph if device == "cuda" else CG.RecordedGraph
        gs = (CG.disable(model) if path == "eager" else
              CG.enable(model, factory, buckets=(1,), whole_step=device_cache))
        c = model.config
        n = warmup + tokens + kernel_tokens + 2
        kv = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=-(-n // 16), block_size=16,
                          dtype=model.model.embed_tokens.weight.dtype, device=device)
        kv.allocate(0, n)
        run = executor_for(model)
        tok = torch.tensor([1])
        for i in range(1 + warmup):  # the first token (and the captures), then the cache's warm-up
            logits = run(tok, BatchLayout.single(0, 1, i), kv)
            tok = logits.argmax(-1).cpu()
        launches0 = _cache_launches(cache)
        replays0 = gs.counters.replays if gs else 0
        misses0 = _misses(cache)
        sync = None
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with counting() as sync:
            for i in range(tokens):
                logits = run(tok, BatchLayout.single(0, 1, warmup + i + 1), kv)
                tok = logits.argmax(-1).cpu()  # the sampler's read: after the step, not counted in it
        dt = time.perf_counter() - t0
        out = {
            "path": path, "tokens": tokens, "layers": shape.layers,
            "syncs": sync.total / tokens, "by_reason": {k: v / tokens for k, v in sync.by_reason.items()},
            "graph_launches": ((gs.counters.replays - replays0) / tokens) if gs else 0.0,
            "cache_launches": (_cache_launches(cache) - launches0) / tokens,
            "misses": (_misses(cache) - misses0) / tokens,
            "ms": dt / tokens * 1e3, "ms_per_layer": dt / tokens / shape.layers * 1e3,
        }
        out["kernels"] = []  # after the counts above: the profiled tokens are not in them
        if kernel_tokens:
            def step(i):
                return run(tok, BatchLayout.single(0, 1, warmup + tokens + i + 1), kv)
            out["kernels"] = kernel_times(step, kernel_tokens, device)
        return out
    finally:
        sm.close()
        configure(prev)


def kernel_times(step, tokens: int, device: str, top: int = 10) -> list[tuple[str, float, float]]:
    """Run ``step(i)`` for i < ``tokens`` under torch's profiler: (name, calls per token, µs per
    token) of the ``top`` kernels by time (CUDA kernels on a GPU, graph replays' included;
    operators' own CPU time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for i in range(tokens):
            step(i)
        if cuda:
            torch.cuda.synchronize()
    agg: dict[str, list[float]] = {}
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
        a = agg.setdefault(e.name, [0, 0.0])
        a[0] += 1
        a[1] += us
    rows = sorted(((n, c / tokens, us / tokens) for n, (c, us) in agg.items()), key=lambda r: -r[2])
    return rows[:top]


def kernel_table(rows: list[tuple[str, float, float]], layers: int) -> str:
    total = sum(us for _, _, us in rows)
    out = ["| kernel | calls / token | µs / token | µs / layer | share of these |", "|---|---|---|---|---|"]
    for name, calls, us in rows:
        out.append(f"| {name[:60]} | {calls:.1f} | {us:.1f} | {us / layers:.1f} | {us / max(total, 1e-9):.0%} |")
    return "\n".join(out)


def _cache_launches(cache) -> int:
    """The device cache's kernel launches so far (assign and copy); 0 for the host cache."""
    dp = getattr(cache, "dpolicy", None)
    return dp.launches + cache.copy_launches if dp is not None else 0


def _misses(cache) -> int:
    counts = getattr(cache, "device_counts", None)
    return counts()["misses"] if counts is not None else cache.metrics.total().misses


def table(rows: list[dict]) -> str:
    out = ["| path | host syncs / token | by reason | graph launches / token | cache kernel launches / token "
           "| misses / token | ms / token | ms / layer |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        why = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["by_reason"].items())) or "-"
        out.append(f"| {r['path']} | {r['syncs']:.1f} | {why} | {r['graph_launches']:.0f} | "
                   f"{r['cache_launches']:.0f} | {r['misses']:.1f} | {r['ms']:.1f} | {r['ms_per_layer']:.2f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--paths", default=",".join(PATHS))
    args = ap.parse_args()
    rows = [measure(p, args.tokens, args.device) for p in args.paths.split(",")]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
