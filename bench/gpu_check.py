"""The one prepared GPU check: correctness against the CPU reference, then timings, in one call.

    python bench/gpu_check.py            # on a CUDA machine (a few minutes)
    python bench/gpu_check.py --smoke    # anywhere: tiny shapes, Triton's interpreter on CPU

1. Fused Triton kernels (engine.quant.triton_kernels) on expert-shaped weights (default: a
   Qwen3-30B-A3B expert, H=2048, I=768) for every format and T in {1, 4, 8}: the largest error
   against ``reference.linear_ref`` computed on the CPU (must be within the float32 reordering
   bound), and the time per call beside two baselines that materialise the weight: dequantize to
   fp32 + matmul on the device (the torch backend) and a bf16 matmul on an already-dequantized
   weight (what an engine keeping fp16/bf16 experts resident pays). GB/s counts the stored
   weight bytes; the roofline is those bytes at the device's memory bandwidth (measured here
   with a device-to-device copy).
2. The Triton Gated DeltaNet decode step (engine.layers.deltanet_triton) at Qwen3-Next's
   layer shape (16 key / 32 value heads of 128) for 1 and 8 sequences: error against the torch
   reference on the CPU, time beside the torch reference on the device.
3. The CUDA tests (tests/gpu: per-layer CUDA graphs captured for real against eager, with the
   cache moving experts between slots; the compiled DeltaNet step; the kernel tests compiled
   instead of interpreted).
4. Per-layer CUDA graphs (engine.cuda_graphs) on a random Qwen3-MoE store (8 layers, hidden
   1024, 64 experts top-8, int4 experts, bf16 dense, bf16 paged KV cache) with every expert
   resident: greedy tokens and logits eager vs graphed (must agree), then per decoded token the
   host kernel launches (CUDA launch and graph-launch API calls, torch profiler) and the kernels
   executed, and decode tok/s: eager, feed-forward halves graphed, and feed-forward + attention
   halves graphed (on CPU with --smoke: dispatcher ops, the CPU seam).
5. With ``--e2e``: ``bench/expert_cache.py --device cuda`` on an 8-layer random Qwen3-MoE store
   (tok/s, hit rates and bytes per token at 25% and 100% device budgets; builds the store first).

``--headline --dry-run`` needs no GPU (about a minute here): it lists every figure the GPU run
measures and prints the host synchronisations per decoded token that the CPU seam
(engine.cuda_graphs.syncs) counts for the per-layer path and for one graph per step with the
device expert cache, on the demo model's routing (bench/step_syncs.py); it exits 1 if the
one-graph path synchronised at all.

``--headline`` instead runs the headline check (issue 15) and nothing else: first correctness,
a tiny synthetic MoE (engine.experts.synthetic_store) decoded through the expert cache on the
GPU against the same model on the CPU (fp32 dense, int4 experts: the logits must agree); then
``bench/headline.py --shape full --device cuda --vram-budget 24GiB --layers N`` (default 12 of
the 48 layers, scaled per layer and labelled so; ``--layers 48`` for the whole 65 GB if the host
can pin it), and one table of the measured figures beside the cost model's predictions. Between
the two, the decode step paths of bench/step_syncs.py on the GPU (eager / per-layer CUDA graphs /
one CUDA graph per step with the device cache, 32 tokens each): host syncs, graph and cache
launches, misses, ms per token and per layer.
It needs no checkpoint, no disk space and no package beyond torch and triton (no pydantic,
transformers or ray): carry nothing but the working tree, e.g. one ``run`` of
``PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --headline`` (``--headline-layers 24`` for
more; on an H200, 2026-12-04: 46-51 s at 8-12 layers without the step paths at the headline's
shape, 165 s with them at 8 layers). ``--headline --smoke``
runs the same logic on the CPU with the tiny shape (CI, and this machine).

Nothing is installed or downloaded; the output is a short table.

On this workplace's lent H200 machine (python3 3.12 with torch, triton and transformers, but no
pydantic, which the store manifest needs), carry pydantic's wheels: here, once, ``echo /.whl/ >>
.git/info/exclude`` and ``python3 -m pip download --no-deps --only-binary=:all: --python-version
3.12 --implementation cp --platform manylinux_2_17_x86_64 -d .whl pydantic==2.13.4
pydantic-core==2.46.4 annotated-types typing-inspection`` (pydantic pins its core); then one
``run`` with ``carry=[".whl"]``: ``python3 -m pip install -q --no-index --no-deps --target
/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. && PYTHONUNBUFFERED=1 python3
bench/gpu_check.py --e2e``. (The download command was checked here.) The plain check (items
1-4, no ``--e2e``) needs the same carry and install. Measured on the H200 (2026-12-04):
``python3 -m pytest tests/gpu`` 41-55 s, ``--no-tests --e2e --iters 20`` 62 s; a machine starts in
about 30 s, so all of it fits one call with room for a rerun in the 15 minutes a task is lent.
``CXX=/bin/false`` in the call's environment skips the build of the native CPU kernels there (the
CPU references then run on the torch kernels).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMATS = ("int4", "nf4", "int8", "bf16")


def timer(device: torch.device):
    """fn, iters -> median seconds per call (CUDA events on a GPU, perf_counter on CPU)."""
    def run(fn, iters: int) -> float:
        fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)
    return run


def device_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (reads + writes)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sec = timer(device)(lambda: dst.copy_(src), 10)
    return 2 * n / sec


def kernel_table(device: torch.device, hidden: int, inter: int, iters: int) -> bool:
    import torch.nn.functional as F

    from engine.quant import QuantFormat, dequantize, linear_ref, quantize
    from engine.quant.kernels import qlinear_torch
    from engine.quant.triton_kernels import qlinear_triton

    bw = device_bandwidth(device)
    run = timer(device)
    print(f"device memory bandwidth (copy) {bw / 1e9:.0f} GB/s")
    print("| format | weight [N, K] | T | max err / bound | fused µs | GB/s | % roofline | "
          "dequant+fp32 mm µs | bf16 mm (resident) µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    ok = True
    g = torch.Generator().manual_seed(0)
    for fmt in FORMATS:
        for n, k in ((inter, hidden), (hidden, inter)):
            q_cpu = quantize(torch.randn(n, k, generator=g) * 0.02, QuantFormat(fmt, 64))
            q = q_cpu.to(device)
            w_bf16 = dequantize(q).to(torch.bfloat16)
            for t in (1, 4, 8):
                x_cpu = torch.randn(t, k, generator=g)
                x = x_cpu.to(device)
                got = qlinear_triton(x, q).cpu()
                want = linear_ref(x_cpu, q_cpu)
                bound = 1e-4 * (x_cpu.abs() @ dequantize(q_cpu).abs().T) + 1e-5
                ratio = float(((got - want).abs() / bound).max())
                ok &= ratio <= 1.0
                fused = run(lambda: qlinear_triton(x, q), iters)
                deq = run(lambda: qlinear_torch(x, q), iters)
                xb = x.to(torch.bfloat16)
                mm = run(lambda: F.linear(xb, w_bf16), iters)
                nbytes = q.nbytes
                print(f"| {fmt} | [{n}, {k}] | {t} | {ratio:.2f} {'ok' if ratio <= 1 else 'FAIL'} | "
                      f"{fused * 1e6:.1f} | {nbytes / fused / 1e9:.0f} | {nbytes / fused / bw:.0%} | "
                      f"{deq * 1e6:.1f} | {mm * 1e6:.1f} |")
    return ok


def deltanet_table(device: torch.device, smoke: bool, iters: int) -> bool:
    """The Triton Gated DeltaNet decode step (engine.layers.deltanet_triton) for N sequences of
    one layer: the largest error against the torch reference computed on the CPU, and the time
    per call beside the torch reference on the device (one sequence at a time, as
    GatedDeltaNet's torch path runs); GB/s counts the state read and written."""
    from engine.layers.deltanet import reference_step
    from engine.layers.deltanet_triton import decode_rows

    nk, nv, dk, dv, kw = (2, 4, 16, 16, 4) if smoke else (16, 32, 128, 128, 4)  # Qwen3-Next 80B
    run = timer(device)
    print(f"Gated DeltaNet decode step, {nk} key / {nv} value heads, Dk {dk}, Dv {dv}, conv {kw}:")
    print("| sequences | max err / bound | Triton µs | state GB/s | torch reference µs |")
    print("|---|---|---|---|---|")
    ok = True
    g = torch.Generator().manual_seed(1)
    c = 2 * nk * dk + nv * dv
    for n in (1, 8):
        window = torch.randn(n, c, kw - 1, generator=g)
        state = torch.randn(n, nv, dk, dv, generator=g) * 0.3
        weight = torch.randn(c, kw, generator=g) * 0.5
        x = torch.randn(n, c, generator=g)
        gd = -torch.rand(n, nv, generator=g) * 2
        beta = torch.rand(n, nv, generator=g)
        slots = torch.arange(n)
        ref_w, ref_s = window.clone(), state.clone()
        want = torch.stack([reference_step(ref_w[i], weight, x[i], ref_s[i], gd[i], beta[i], nk, dk, dv)
                            for i in range(n)])
        dev = [t.to(device) for t in (window, weight, x, state, gd, beta, slots)]
        got = decode_rows(*dev[:6], dev[6], nk, dk, dv).cpu()
        ratio = max(float(((got - want).abs() / (1e-4 * want.abs() + 1e-4)).max()),
                    float(((dev[3].cpu() - ref_s).abs() / (1e-4 * ref_s.abs() + 1e-4)).max()))
        ok &= ratio <= 1.0
        fused = run(lambda: decode_rows(*dev[:6], dev[6], nk, dk, dv), iters)
        torch_ref = run(lambda: [reference_step(dev[0][i], dev[1], dev[2][i], dev[3][i], dev[4][i], dev[5][i],
                                                nk, dk, dv) for i in range(n)], max(3, iters // 5))
        nbytes = 2 * state.numel() * 4
        print(f"| {n} | {ratio:.2f} {'ok' if ratio <= 1 else 'FAIL'} | {fused * 1e6:.1f} | "
              f"{nbytes / fused / 1e9:.0f} | {torch_ref * 1e6:.1f} |")
    return ok


MODES = ("eager", "graphs (feed-forward)", "graphs (feed-forward + attention)")
LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
               "cudaGraphLaunch", "cuGraphLaunch")


def decode_profile(device: torch.device, smoke: bool) -> bool:
    """Build a small random Qwen3-MoE store, then decode with every expert resident, eager and
    through the per-layer graphs (engine.cuda_graphs): the greedy tokens and logits must agree;
    print host kernel launches (CUDA launch and graph-launch API calls) and kernels executed
    per decoded token (torch profiler; on CPU with --smoke: dispatcher ops, the graphs through
    the RecordedGraph seam), and decode tok/s of each."""
    import tempfile

    import transformers as T
    from torch.profiler import ProfilerActivity, profile

    from engine import cuda_graphs as CG
    from engine.experts.runtime import load_from_store
    from engine.generate import generate_ids
    from engine.kv.paged import PagedKVCache
    from engine.layers.sampler import SamplingConfig
    from engine.options import configure
    from engine.quant.formats import QuantFormat
    from engine.store import convert

    layers, hidden, inter, experts = (2, 128, 64, 8) if smoke else (8, 1024, 512, 64)
    cfg = T.Qwen3MoeConfig(vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=hidden // 8, num_experts=experts,
                           num_experts_per_tok=min(8, experts // 2), moe_intermediate_size=inter,
                           intermediate_size=2 * inter, norm_topk_prob=True)
    torch.manual_seed(0)
    prompt, steps, timed = list(range(3, 19)), (4 if smoke else 8), (4 if smoke else 64)
    cuda = device.type == "cuda"
    prev = configure(fused_step=False) if not cuda else None  # CPU: the torch layers, like CUDA
    rows, ok, tokens = [], True, {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            T.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp + "/hf")
            convert(Path(tmp) / "hf", Path(tmp) / "store", fmt=QuantFormat("int4", 64), progress=False)
            for mode in MODES:
                sm = load_from_store(Path(tmp) / "store", device=device.type, dense="bf16", prefetch_depth=0)
                try:
                    sm.cache.grouped = True  # CUDA: already; CPU: the same launches, interpreted
                    if mode == "eager":
                        CG.disable(sm.model)
                    else:
                        CG.enable(sm.model, CG.CudaGraph if cuda else CG.RecordedGraph,
                                  attention=mode == MODES[2])
                    # a paged KV cache (blocks of 16) at the model's dtype: the attention graphs read it
                    kv = PagedKVCache(layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks=64,
                                      dtype=sm.model.model.embed_tokens.weight.dtype, device=device)
                    sampling = SamplingConfig(max_tokens=timed + 1, ignore_eos=True)
                    out = [(t, l.float().cpu()) for t, l, _ in generate_ids(sm.model, prompt, sampling, kv=kv)]
                    tokens[mode] = out  # also the warm-up: experts resident, graphs captured
                    gen = generate_ids(sm.model, prompt, SamplingConfig(max_tokens=steps + 2, ignore_eos=True), kv=kv)
                    next(gen)
                    act = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                    with profile(activities=act) as prof:
                        for _ in range(steps):
                            next(gen)
                        if cuda:
                            torch.cuda.synchronize()
                    gen.close()
                    events = prof.events()
                    if cuda:
                        launches = sum(1 for e in events if e.name in LAUNCH_APIS)
                        kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
                    else:
                        launches = kernels = len(events)
                    gen = generate_ids(sm.model, prompt, sampling, kv=kv)
                    next(gen)
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(timed):
                        next(gen)
                    if cuda:
                        torch.cuda.synchronize()
                    tps = timed / (time.perf_counter() - t0)
                    gen.close()
                    gs = CG.graph_set(sm.model)
                    note = (f"{gs.counters.captures} graphs captured, {gs.counters.capture_failures} failed, "
                            f"{gs.counters.attention_eager} attention halves eager" if gs else "")
                    ok &= not gs or gs.counters.capture_failures == 0
                    rows.append((mode, launches / steps, kernels / steps, tps, note))
                finally:
                    sm.close()
    finally:
        if prev is not None:
            configure(prev)
    for mode in MODES[1:]:
        same = [a for a, _ in tokens["eager"]] == [b for b, _ in tokens[mode]]
        worst = max(float((a - b).abs().max() / a.abs().max()) for (_, a), (_, b) in zip(tokens["eager"], tokens[mode]))
        ok &= same and worst <= 1e-2
        print(f"per-layer {mode} vs eager: {len(tokens['eager'])} greedy tokens {'identical' if same else 'DIFFER'}, "
              f"max |logit diff| / max |logit| = {worst:.1e} {'ok' if same and worst <= 1e-2 else 'FAIL'}")
    what = "host launches" if cuda else "dispatcher ops"
    print(f"decode of a random Qwen3-MoE store: {layers} layers, hidden {hidden}, top-{cfg.num_experts_per_tok} "
          f"of {experts} experts (int4 g64), bf16 dense, every expert resident, batch 1")
    print(f"| mode | {what} per token (per layer) | kernels executed per token | decode tok/s | |")
    print("|---|---|---|---|---|")
    for mode, launches, kernels, tps, note in rows:
        print(f"| {mode} | {launches:.0f} ({launches / layers:.1f}) | {kernels:.0f} | {tps:.1f} | {note} |")
    return ok


def headline_correctness(device: torch.device) -> bool:
    """The tiny synthetic MoE through the expert cache (a quarter of the experts resident) on
    ``device`` against the same model on the CPU: same weights, same routing, fp32 dense."""
    from engine.costmodel import SHAPES
    from engine.experts.synthetic import synthetic_trace
    from engine.experts.synthetic_store import SyntheticExpertStore, build_synthetic_model
    from engine.generate import generate_ids
    from engine.layers.sampler import SamplingConfig

    shape = SHAPES["tiny"]
    source = SyntheticExpertStore(shape, seed=0).ram_source()
    tr = synthetic_trace(16, shape.layers, shape.experts, shape.top_k, zipf=1.0, locality=0.3, seed=0)
    logits = {}
    for dev in ("cpu", device.type):
        with build_synthetic_model(shape, device_budget=shape.num_experts_total * shape.slot_bytes // 4,
                                   device=dev, dense="fp32", trace=tr, source=source) as sm:
            # prefills of fixed prompts (no sampled token feeds back, so a near-tie cannot fork
            # the two runs); the trace routes them alike on both devices
            logits[dev] = [next(generate_ids(sm.model, list(range(3, 3 + n)),
                                             SamplingConfig(max_tokens=1, ignore_eos=True)))[1].float().cpu()
                           for n in (1, 2, 3, 4, 5)]
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits[device.type], logits["cpu"]))
    ok = worst <= 2e-3
    print(f"headline correctness: tiny synthetic MoE through the expert cache on {device.type} vs CPU: "
          f"max |logit diff| / max |logit| = {worst:.2e} {'ok' if ok else 'FAIL'}")
    return ok


HEADLINE_FIGURES = """On a GPU, --headline measures (first run on an H200, 2026-12-04: docs/gpu.md):
  decode step paths (bench/step_syncs.py: the demo trace's shape, 30 sparse layers, 12 experts
  top-6, a third of the experts in device slots, all of them in pinned RAM), per decoded token:
    - host synchronisations, by reason            eager / per-layer graphs / one graph per step
    - graph launches and device-cache kernel launches
    - ms per token and per layer (the per-layer overhead: the layers' arithmetic is negligible)
    - the one-graph step's tokens equal to eager's (tests/engine/test_step_graph.py on CUDA)
  headline (bench/headline.py --shape full --vram-budget 24GiB --layers N):
    - decode tok/s, measured and predicted by the cost model on this device
    - expert hit rate, live and simulated; expert MB per token from RAM
    - host-to-device GB/s (achieved and copy test); stall fraction
    - kernel launches per token; device GiB of dense / KV / state / slots / peak
    - the cost model's full-shape predictions with the measured per-layer overhead
  decode step paths at the headline's shape, slot share and routing: ms per token and tok/s
  scaled to the whole shape (eager / per-layer graphs / one graph per step), and the one-graph
  step's device time per token by CUDA kernel (torch's profiler, kernels inside graphs included)"""


def step_table(device: str, tokens: int, paths=None) -> list[dict]:
    """The decode step paths of bench/step_syncs.py, measured on ``device``, as a table."""
    import step_syncs

    rows = [step_syncs.measure(p, tokens, device) for p in (paths or step_syncs.PATHS)]
    print(step_syncs.table(rows))
    return rows


def shape_step_table(device: str, shape, whole: int, share: float, dense: str, warmup: int,
                     tokens: int) -> list[dict]:
    """The decode step paths of bench/step_syncs.py at the headline's shape (``shape``: a
    reduced-layer run of it, its routing the headline's synthetic one, ``share`` of its experts in
    device slots, every expert in pinned RAM), with tok/s scaled per layer to ``whole`` layers."""
    import step_syncs

    from engine.experts.synthetic import synthetic_trace

    kt = 4  # tokens of the one-graph step's kernel profile
    trace = synthetic_trace(warmup + tokens + kt + 2, shape.layers, shape.experts, shape.top_k, zipf=1.0,
                            locality=0.3, seed=0)
    rows = [step_syncs.measure(p, tokens, device, share, shape=shape, trace=trace, dense=dense, warmup=warmup,
                               kernel_tokens=kt if p == "one graph per step" else 0)
            for p in step_syncs.PATHS]
    print(step_syncs.table(rows))
    one = next(r for r in rows if r["path"] == "one graph per step")
    print(f"one graph per step, where a token's device time goes ({kt} tokens under torch's profiler; "
          f"{'CUDA kernels' if device == 'cuda' else 'CPU operators, interpreter: the logic only'}):")
    print(step_syncs.kernel_table(one["kernels"], shape.layers))
    print(f"| path | decode tok/s ({shape.layers} layers) | scaled to {whole} layers |")
    print("|---|---|---|")
    for r in rows:
        tps = 1e3 / r["ms"]
        print(f"| {r['path']} | {tps:.1f} | {tps * shape.layers / whole:.2f} |")
    return rows


def headline_dry_run(args) -> int:
    """No GPU needed: the list of figures a GPU run measures, and the host synchronisations per
    decoded token the CPU seam counts for the per-layer path and the one-graph path."""
    print(HEADLINE_FIGURES)
    print("\nCPU seam (Triton's interpreter; times are the interpreter's and mean nothing), "
          f"{args.dry_run_tokens} decoded tokens of the demo trace:")
    rows = step_table("cpu", args.dry_run_tokens, ("per-layer graphs", "one graph per step"))
    one = next(r for r in rows if r["path"] == "one graph per step")
    print(f"host syncs per decoded token: per-layer path {rows[0]['syncs']:.1f}, one graph per step "
          f"{one['syncs']:.1f} (every miss in the RAM tier: {one['misses']:.1f} misses per token)")
    return 0 if one["syncs"] == 0 else 1


def headline_check(args) -> int:
    import json
    import tempfile

    if args.dry_run:
        return headline_dry_run(args)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA device: run with --headline --smoke for the CPU check of the same logic", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU'}")
    if not headline_correctness(device):
        print("FAILURES above: not timing a step that computes wrong numbers")
        return 1
    print("\nDECODE STEP PATHS (per decoded token)")
    steps = step_table(device.type, 32 if cuda else 2)
    one = next(r for r in steps if r["path"] == "one graph per step")
    out = Path(tempfile.mkdtemp()) / "headline.json"
    cmd = [sys.executable, "bench/headline.py", "--device", device.type, "--json", str(out)]
    if cuda:  # the cost model with the one-graph step's measured per-layer overhead
        cmd += ["--step-overhead-ms", f"{one['ms_per_layer']:.4f}"]
    cmd += (["--shape", "full", "--vram-budget", "24GiB", "--layers", str(args.headline_layers)] if cuda
            else ["--shape", "tiny"])
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    print(r.stdout[-6000:])
    if r.returncode:
        print(r.stderr[-3000:])
        return 1
    f = json.loads(out.read_text())
    scale = (f["scaled_from"] or 0) and f["scaled_from"]
    layers_note = f" ({args.headline_layers} of {scale} layers, tok/s scaled per layer)" if scale else ""
    print(f"\nHEADLINE ({time.perf_counter() - t:.0f} s){layers_note}")
    print("| figure | measured | predicted |")
    print("|---|---|---|")
    tps = f["decode_tps"] * (args.headline_layers / scale if scale else 1)
    print(f"| decode tok/s | {tps:.2f} | {f['predicted_tps'] * (args.headline_layers / scale if scale else 1):.2f} "
          f"(cost model, this device) |")
    print(f"| expert hit rate (live / simulated) | {f['hit_rate']:.1%} | {f['sim_hit_rate']:.1%} |")
    print(f"| expert MB per token from RAM / disk | {f['ram_bytes_per_token'] / 1e6:.1f} / 0 | |")
    print(f"| host-to-device GB/s (achieved / copy test) | {f['link_gbs']:.1f} / {f['link_bw'] / 1e9:.1f} | |")
    print(f"| stall fraction | {f['stall_fraction']:.1%} | |")
    launches = f["launches_per_token"] if cuda else f["calls_per_token"]
    print(f"| {'kernel launches' if cuda else 'native calls'} per token | {launches or 0:.0f} | |")
    print(f"| device GiB: dense / KV / state / slots / peak of budget | "
          f"{f['dense_bytes'] / 2**30:.2f} / {f['kv_bytes'] / 2**30:.3f} / {f['state_bytes'] / 2**30:.3f} / "
          f"{f['slot_bytes'] / 2**30:.2f} / {f['peak'] / 2**30:.2f} of {f['budget'] / 2**30:.0f} | |")
    for p in f["predictions"]:
        print(f"| full shape on {p['target']} | | {p['tok_s']:.1f} tok/s ({p['note']}) |")
    from engine.costmodel import SHAPES

    full = SHAPES["full-runnable"] if cuda else SHAPES["tiny"]
    shape = full.with_layers(args.headline_layers) if cuda else full
    share = f["slot_bytes"] / (shape.num_experts_total * shape.slot_bytes)
    warmup, tokens = (8, 32) if cuda else (1, 2)
    print(f"\nDECODE STEP PATHS AT THE HEADLINE'S SHAPE ({shape.name}, {share:.1%} of the experts in "
          f"device slots, the headline's routing, {tokens} tokens after {warmup} warm-up)")
    shape_step_table(device.type, shape, full.layers, share, "bf16" if cuda else "fp32", warmup, tokens)
    print("ALL OK")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU in Triton's interpreter")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-tests", action="store_true", help="skip the pytest part")
    ap.add_argument("--e2e", action="store_true", help="also run bench/expert_cache.py on the device")
    ap.add_argument("--headline", action="store_true", help="only the headline check (see above)")
    ap.add_argument("--headline-layers", type=int, default=12, help="layers of the full shape to run")
    ap.add_argument("--dry-run", action="store_true",
                    help="with --headline: no GPU; list the figures and count host syncs on the CPU seam")
    ap.add_argument("--dry-run-tokens", type=int, default=3, help="decoded tokens of the --dry-run count")
    args = ap.parse_args()
    if args.headline:
        return headline_check(args)
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            print("no CUDA device: run with --smoke for the CPU interpreter check", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.hidden, args.inter, args.iters = 128, 64, 3
    import triton

    name = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {name}")
    ok = kernel_table(device, args.hidden, args.inter, args.iters)
    ok &= deltanet_table(device, args.smoke, args.iters)
    if not args.no_tests:
        files = ["tests/gpu", "tests/engine/quant/test_triton_kernels.py",
                 "tests/engine/experts/test_cache.py", "tests/engine/test_cuda_graphs.py",
                 "tests/engine/test_attention_graphs.py", "tests/engine/layers/test_paged_attention_triton.py"]
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                           cwd=ROOT, capture_output=True, text=True)
        tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-500:]
        print(f"pytest {' '.join(files)}: {tail}")
        if r.returncode:
            print(r.stdout[-3000:])
        ok &= r.returncode == 0
    ok &= decode_profile(device, args.smoke)
    if args.e2e:
        cmd = [sys.executable, "bench/expert_cache.py", "--device", device.type, "--layers", "8",
               "--tokens", "32", "--budgets", "0.25,1.0"]
        if args.smoke:
            cmd += ["--experts", "16", "--top-k", "4", "--hidden", "256", "--inter", "128", "--tokens", "8"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        print(r.stdout[-4000:] if r.returncode == 0 else r.stderr[-3000:])
        ok &= r.returncode == 0
    print("ALL OK" if ok else "FAILURES above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
