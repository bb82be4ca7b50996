"""The headline run: a 125B-A6B-shaped MoE under a device memory cap, measured, beside the cost
model's prediction for the full shape on an RTX 4090 and on an H200 capped at 24 GiB.

    python bench/headline.py --shape small                  # CPU: a reduced shape, < 2 minutes
    python bench/headline.py --dry-run                      # the plan and the predictions only
    python bench/headline.py --shape full --device cuda --vram-budget 24GiB --layers 12
                                                            # GPU: 12 of the 48 layers, scaled

Shapes (engine.costmodel.SHAPES): ``full`` is qwen4_exp (Qwen3.8-Flash-Next, 125B-A6B): 48
layers, hidden 2560, 512 experts of width 640 (int4 g64: 2.76 MB each, 68 GB in all), top-10,
one shared expert, 36 Gated DeltaNet + 12 QSA layers, hyper-connections, a 51.2B-parameter PLE
n-gram table in the PLE tier on disk (engine.store.ple_disk); it runs as Qwen2-MoE-style layers
(attention sized so a layer's dense bytes are within 1% of the qwen4_exp mix's average; the cost
model counts the DeltaNet, QSA, hyper-connection and PLE parts by their byte counts, and the PLE
rows as 4 KiB NVMe reads). ``--layers N`` runs N layers of
it and scales per layer (labelled as such): the whole 65 GB may not fit the host or pin in time.
``small`` (8 layers, 64 experts, top-4) runs on a CPU.

Nothing touches the disk: random int4 experts are generated straight into one (pinned) RAM
block (engine.experts.synthetic_store), the dense weights are random at the model's size, and
routing is injected from a trace (synthetic with skew ``--zipf`` and locality ``--locality``,
or ``--trace FILE``) while the routers still compute. Every step is one decoded token.

Other expert sources, measured beside it on the same model, trace and slots (blocks interleaved;
bench/headline_variants.py): ``--disk DIR`` writes the experts once to a real store in DIR (new,
empty, or a leftover of its own; removed after) and serves them through an in-process RAM tier
of ``--ram-tier`` of the experts, so misses are O_DIRECT reads; ``--ray`` serves that store (or
one in a temporary directory) through ``--loaders`` Ray expert loader actors.

Steps: (1) plan: the memory split of ``--vram-budget`` (dense, KV, state, workspace, expert
slots; ``--slots`` caps the slots at a share of the experts; with ``--admission`` top-k of them
are the cache's staging slots), the host RAM check; (2) build;
(3) calibrate: every layer routed to its first top-k experts (all hits after the first token),
which measures the step's fixed per-layer overhead; (4) warm up on the trace, then measure
decode tok/s, the device hit rate, expert bytes per token from RAM and from disk, the achieved
host-to-device GB/s, the stall fraction, launches (GPU) or native calls (CPU) per token and the
device memory split; (5) the cost model's prediction for this run (device bandwidth and link
measured here, hit rate from the simulator at this run's slot count) and its error, then its
predictions for the full shape on the targets. ``--vram-budget`` is enforced: an allocation past
it fails with DeviceBudgetError (engine.experts.device_budget).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from engine.costmodel import (DENSE_BYTES_PER_PARAM, SHAPES, TARGETS, ModelShape, Target,  # noqa: E402
                              memory_split, predict)
from engine.executor import executor_for  # noqa: E402
from engine.errors import CacheCapacityError, ConfigError, DeviceBudgetError, MoestreamError  # noqa: E402
from engine.experts.policy import can_decline, make_policy  # noqa: E402
from engine.units import format_bytes, parse_bytes  # noqa: E402
from headline_variants import RayLoaders, Variant, disk_tier, print_table  # noqa: E402

DEFAULTS = {  # shape -> (runnable shape, warm-up tokens, measured tokens, slot share, workspace)
    "small": ("small", 16, 48, 0.25, 64 << 20),
    "tiny": ("tiny", 4, 8, 0.5, 16 << 20),
    "full": ("full-runnable", 8, 32, None, int(1.5 * 2**30)),
}


def host_available() -> int:
    """Available host RAM in bytes (engine.experts.device_budget.available_host_memory)."""
    from engine.experts.device_budget import available_host_memory

    return available_host_memory()


def memory_bandwidth(device: torch.device) -> float:
    """Read bytes/s of a large reduction on the device."""
    n = (1 << 27) if device.type == "cuda" else (1 << 26)  # 512 MiB: inside the workspace
    x = torch.ones(n, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x.sum()
    sync()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t)
    return n * 4 / best


def link_bandwidth(source, device: torch.device, count: int = 64) -> float:
    """Bytes/s of copying expert blobs from the RAM tier into a device slot (memcpy on CPU)."""
    n = source.store.num_experts_total
    slot = torch.empty(source.slot_bytes, dtype=torch.uint8, device=device)
    keys = [divmod((i * 7919) % n, source.store.shape.experts) for i in range(count)]
    nbytes = source.store.expert_nbytes
    src = [source.blob(k) for k in keys]
    best = float("inf")
    for _ in range(4):  # best of 4 rounds: the first pays page faults and thread start-up
        t = time.perf_counter()
        for s in src:
            slot[:nbytes].copy_(s, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return count * nbytes / best


class CallCounter:
    """Counts calls through a native extension module (the CPU step's native calls)."""

    def __init__(self, ext) -> None:
        self._ext, self.calls = ext, 0

    def __getattr__(self, name):
        attr = getattr(self._ext, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def counted(*a, **k):
            self.calls += 1
            return attr(*a, **k)
        return counted


def decode(model, first: int, tokens: int):
    """Generate ``tokens`` tokens from a one-token prompt (every step is one token's decode).
    Returns the GenerationStats and each step's seconds (the one-token prefill included)."""
    from engine.layers.sampler import SamplingConfig
    from engine.runner import stream_request

    stats, times = None, []
    t = time.perf_counter()
    for _, stats in stream_request(model, [first], SamplingConfig(max_tokens=tokens, ignore_eos=True)):
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return stats, times


def median_tps(times) -> float:
    """Tokens/s from the median step time: robust to other processes taking the cores for a
    while (the machine may be shared), unlike the mean."""
    return 1.0 / statistics.median(times)


def rotating_trace(tokens: int, shape: ModelShape, span: int):
    """Token t routes every layer to experts t*K .. t*K+K-1 (mod ``span``): with ``span`` =
    the experts per layer that fit the slots, all hits once warm (and as many distinct experts
    read as a real run, not a cache-resident handful); with ``span`` = all experts, reuse only
    every E/K tokens, so a cache below that working set misses nearly every access."""
    from engine.experts.trace import RoutingTrace

    L, K = shape.layers, shape.top_k
    ex = [[(t * K + j) % span for j in range(K)] for t in range(tokens) for _ in range(L)]
    return RoutingTrace(L, shape.experts, K, [t for t in range(tokens) for _ in range(L)], list(range(L)) * tokens, ex)


def simulated_hit_rate(trace, slots: int, skip_tokens: int, policy: str, bypass: bool = False) -> float:
    """Hit rate of ``policy`` at ``slots`` on the trace after its first ``skip_tokens`` tokens
    (the replay is causal, so the hits of the prefix are the prefix's own); ``bypass``: with
    admission control (the live cache's staging slots). Each record is replayed in the order the
    MoE layer acquires its experts (ascending ids), which admission decisions depend on."""
    from engine.experts.simulate import in_acquire_order, simulate

    trace = in_acquire_order(trace)

    per_token = trace.num_layers
    full = simulate(trace, policy, slots, bypass=bypass)
    if not skip_tokens:
        return full.hit_rate
    head = simulate(trace[:skip_tokens * per_token], policy, slots, bypass=bypass)
    return (full.hits - head.hits) / (full.accesses - head.accesses)


def make_trace(args, shape: ModelShape, tokens: int):
    from engine.experts.synthetic import synthetic_trace
    from engine.experts.trace import RoutingTrace

    if args.trace:
        tr = RoutingTrace.load(args.trace)
        if (tr.num_layers, tr.num_experts, tr.top_k) != (shape.layers, shape.experts, shape.top_k):
            raise CacheCapacityError(
                f"--trace {args.trace} has {tr.num_layers} layers x {tr.num_experts} experts top-{tr.top_k}; "
                f"shape {shape.name} needs {shape.layers} x {shape.experts} top-{shape.top_k}")
        if tr.num_tokens < tokens:
            raise CacheCapacityError(f"--trace {args.trace} has {tr.num_tokens} tokens, the run needs {tokens}")
        return tr[:tokens * shape.layers]
    return synthetic_trace(tokens, shape.layers, shape.experts, shape.top_k, zipf=args.zipf,
                           locality=args.locality, seed=args.seed)


def full_shape_predictions(args, overhead_s: float | None, out: list) -> None:
    """The cost model for the full shape at 24 GiB on each target (hit rate from the simulator
    on a synthetic trace of the full shape at that target's slot count; the PLE row cache's hit
    rate taken as 0: every row a 4 KiB NVMe read)."""
    from engine.experts.synthetic import synthetic_trace

    full = SHAPES["full"]
    split = memory_split(full, 24 * 2**30, dense_format="bf16", context=4096, workspace=int(1.5 * 2**30))
    tr = synthetic_trace(args.predict_tokens, full.layers, full.experts, full.top_k, zipf=args.zipf,
                         locality=args.locality, seed=args.seed)
    hit = simulated_hit_rate(tr, split.num_slots, args.predict_tokens // 4, args.policy)
    targets = [TARGETS["rtx4090"], TARGETS["rtx4090-graphs"], TARGETS["h200-24g"]]
    step = getattr(args, "step_overhead_ms", None)
    if step is not None:  # one graph per decode step, its per-layer overhead measured (bench/step_syncs.py)
        r = TARGETS["rtx4090-graphs"]
        targets.append(Target("RTX 4090 + PCIe 4.0 x16, one graph per step", r.device_bw, r.link_bw, r.vram,
                              step / 1e3, r.overlap, note="per-layer overhead of the one-graph step, measured",
                              page_read_s=r.page_read_s))
    if overhead_s is not None:
        h = TARGETS["h200-24g"]
        targets.append(Target(h.name + ", overhead measured here", h.device_bw, h.link_bw, h.vram,
                              overhead_s, h.overlap, note="per-layer overhead measured by this run",
                              page_read_s=h.page_read_s))
    print(f"\nPREDICTION for the full shape (qwen4_exp: {full.layers} layers, {full.experts} x "
          f"{format_bytes(full.expert_bytes)} experts, top-{full.top_k}, {full.layers - full.attention_layers} "
          f"DeltaNet + {full.attention_layers} QSA layers, hyper-connections x{full.hc_count}; PLE "
          f"{full.ple_rows_per_token} rows/token from a {full.ple_params / 1e9:.1f}B-parameter table on disk, "
          f"0% row-cache hits; bf16 dense): 24 GiB = dense {format_bytes(split.dense)} + KV(4k) {format_bytes(split.kv)} + state "
          f"{format_bytes(split.state)} + workspace {format_bytes(split.workspace)} + {split.num_slots} expert slots "
          f"({split.num_slots / full.num_experts_total:.1%} of the experts); simulated hit rate ({args.policy}, "
          f"zipf {args.zipf}, locality {args.locality}): {hit:.1%}")
    print("| target | device GB/s | link GB/s | overhead/layer | overlap | tok/s (prediction) | compute ms | transfer ms "
          "| PLE reads ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in targets:
        p = predict(full, t, hit, dense_format="bf16", split=split)
        print(f"| {t.name} | {t.device_bw / 1e9:.0f} | {t.link_bw / 1e9:.0f} | {t.layer_overhead_s * 1e3:.2f} ms | "
              f"{t.overlap:.0%} | {p.tok_s:.1f} | {p.compute_s * 1e3:.1f} | {p.transfer_s * 1e3:.1f} | "
              f"{p.ple_s * 1e3:.2f} |")
        out.append(dict(target=t.name, tok_s=p.tok_s, hit_rate=hit, slots=split.num_slots, note=t.note))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(DEFAULTS), default="small")
    ap.add_argument("--layers", type=int, default=None, help="run this many layers of the shape (scaled per layer)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vram-budget", default="24GiB", help="device memory cap, enforced (bytes: 24GiB)")
    ap.add_argument("--slots", type=float, default=None,
                    help="cap the expert slots at this share of the experts (default: small 0.25, full: all that fit)")
    ap.add_argument("--dense", choices=sorted(DENSE_BYTES_PER_PARAM), default=None,
                    help="dense format (default: int8 on CPU, bf16 on a GPU)")
    ap.add_argument("--policy", default="sweep")
    ap.add_argument("--admission", action="store_true",
                    help="admission control: top-k of the expert slots become staging slots for misses the policy "
                         "declines to cache (default: every miss cached)")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--locality", type=float, default=0.3)
    ap.add_argument("--trace", default=None, help="routing trace (.npz) of the run's shape instead of a synthetic one")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="measured decode tokens")
    ap.add_argument("--ram-headroom", default="4GiB", help="host RAM kept free beside the RAM tier")
    ap.add_argument("--predict-tokens", type=int, default=96, help="tokens of the full-shape simulation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disk", default=None, metavar="DIR",
                    help="also run with the experts written to a real store in DIR (new or empty; removed after) "
                         "behind an in-process RAM tier smaller than the experts: misses come from disk")
    ap.add_argument("--ram-tier", type=float, default=0.5, help="the --disk run's RAM tier, a share of the experts")
    ap.add_argument("--ray", action="store_true",
                    help="also run through the Ray pipeline's expert loader actors (on --disk DIR, else a temp dir)")
    ap.add_argument("--loaders", type=int, default=2, help="loader actors of the --ray run")
    ap.add_argument("--dry-run", action="store_true", help="plan and predictions only; build nothing")
    ap.add_argument("--step-overhead-ms", type=float, default=None,
                    help="per-layer overhead of the one-graph decode step (bench/step_syncs.py's ms / layer "
                         "on a GPU): adds a prediction row with it")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    try:
        return run(args)
    except MoestreamError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    name, warmup, tokens, share, workspace = DEFAULTS[args.shape]
    shape = SHAPES[name]
    scaled = args.layers is not None and args.layers != shape.layers
    if args.layers is not None:
        if args.layers < 1:
            raise CacheCapacityError(f"--layers must be >= 1, got {args.layers}")
        shape = shape.with_layers(args.layers)
    warmup = args.warmup if args.warmup is not None else warmup
    tokens = args.tokens if args.tokens is not None else tokens
    share = args.slots if args.slots is not None else share
    device = torch.device(args.device)
    dense = args.dense or ("bf16" if device.type == "cuda" else "int8")
    budget = parse_bytes(args.vram_budget, name="--vram-budget")
    figures: dict = dict(shape=shape.name, device=str(device), scaled_from=SHAPES[name].layers if scaled else None)

    # ---- 1. plan ------------------------------------------------------------------------------
    from engine.experts.device_budget import DeviceBudget

    context = warmup + tokens + 8
    calib_slots = 4 * SHAPES[name].top_k * shape.layers  # the calibration cache (see step 3)
    workspace += calib_slots * shape.slot_bytes
    # on a GPU the CUDA context counts against the budget too: measured before planning
    ledger = None if args.dry_run else DeviceBudget(budget, device)
    workspace += ledger.context if ledger is not None else 0
    split = memory_split(shape, budget, dense_format=dense, context=context, workspace=workspace)
    # admission control: top_k staging slots (one token's misses) out of the expert slots
    staging = shape.top_k if args.admission else 0
    if staging and not can_decline(make_policy(args.policy)):
        raise ConfigError(f"--admission: policy {args.policy!r} never declines a miss (use sweep)")
    if split.num_slots - staging < shape.top_k:
        raise DeviceBudgetError(f"--admission: {split.num_slots} expert slots leave fewer than top_k={shape.top_k} "
                                f"beside {staging} staging slots; raise --vram-budget or drop --admission")
    room = split.num_slots - staging
    slots = room if share is None else min(room, max(shape.top_k, int(share * shape.num_experts_total)))
    if scaled and share is None:  # the full model's share of experts resident, per layer
        whole = memory_split(SHAPES[name], budget, dense_format=dense, context=context, workspace=workspace)
        slots = min(room, max(shape.top_k, (whole.num_slots - staging) * shape.layers // SHAPES[name].layers))
    slot_note = (", the full model's share per layer" if scaled and share is None
                 else ", capped by --slots" if slots < room else "")
    staging_note = (f" + staging slots {staging} x {format_bytes(shape.slot_bytes)} = "
                    f"{format_bytes(staging * shape.slot_bytes)} (admission control)" if staging else
                    " (no staging: every miss cached)")
    ram_need = shape.num_experts_total * shape.slot_bytes
    headroom = parse_bytes(args.ram_headroom, name="--ram-headroom")
    avail = host_available()
    print(f"shape {shape.name}{' (a reduced-layer run of the full shape, scaled per layer)' if scaled else ''}: "
          f"{shape.layers} layers, hidden {shape.hidden}, {shape.experts} experts x {format_bytes(shape.expert_bytes)} "
          f"(int4 g64), top-{shape.top_k}, shared expert {shape.shared_width}; device {device}, dense {dense}")
    print(f"budgets: device {format_bytes(budget)} = dense {format_bytes(split.dense)} + KV({context} tok) "
          f"{format_bytes(split.kv)} + state {format_bytes(split.state)} + workspace {format_bytes(workspace)} + "
          f"expert slots {slots} x {format_bytes(shape.slot_bytes)} = {format_bytes(slots * shape.slot_bytes)} "
          f"({slots / shape.num_experts_total:.1%} of the experts{slot_note}){staging_note}; "
          f"host RAM: available {format_bytes(avail)}, headroom {format_bytes(headroom)}, RAM tier (every expert) "
          f"{format_bytes(ram_need)}")
    if ram_need + headroom > avail:
        raise CacheCapacityError(
            f"the RAM tier needs {format_bytes(ram_need)} + {format_bytes(headroom)} headroom but the host has "
            f"{format_bytes(avail)} available; run fewer layers (--layers) and scale per layer")
    figures.update(slots=slots, budget=budget, staging_slots=staging, admission=bool(staging))
    predictions: list = []
    if args.dry_run:
        full_shape_predictions(args, None, predictions)
        figures["predictions"] = predictions
        _write(args.json, figures)
        return 0

    # ---- 2. build -----------------------------------------------------------------------------
    from engine.experts.synthetic_store import SyntheticExpertStore, TraceRouting, build_synthetic_model

    trace = make_trace(args, shape, warmup + tokens + 8)  # + the profiled tokens on a GPU
    t0 = time.perf_counter()
    store = SyntheticExpertStore(shape, seed=args.seed)
    source = store.ram_source()
    print(f"RAM tier: {format_bytes(source.nbytes)} generated in {source.fill_seconds:.1f} s "
          f"({'pinned' if source.pinned else 'pageable'})")
    ledger.charge("expert slots", slots * shape.slot_bytes)
    if staging:
        ledger.charge("staging slots", staging * shape.slot_bytes)
    ledger.charge("KV cache", split.kv)
    ledger.charge("calibration slots", calib_slots * shape.slot_bytes)
    ledger.charge("workspace", workspace - ledger.context - calib_slots * shape.slot_bytes)
    with ledger.guard("building the model"):
        sm = build_synthetic_model(shape, device_budget=(slots + staging) * shape.slot_bytes, device=args.device,
                                   dense=dense, policy=args.policy, seed=args.seed, trace=trace, source=source,
                                   admission=bool(staging))
        assert (sm.cache.num_slots, sm.cache.num_staging) == (slots, staging)
    extras = contextlib.ExitStack()
    try:
        model, cache = sm.model, sm.cache
        dense_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
                          if t.device.type == device.type)
        dense_bytes = max(dense_bytes, split.dense)  # QuantLinear may keep packed weights outside parameters
        ledger.charge("dense weights", dense_bytes)
        print(f"built in {time.perf_counter() - t0:.1f} s; device ledger: "
              + ", ".join(f"{k} {format_bytes(v)}" for k, v in ledger.rows()) + f"; free {format_bytes(ledger.free)}")

        # ---- 3. calibrate (every expert a hit: the step's fixed per-layer overhead; every expert
        # a miss: the fixed cost of a miss beside its bytes), interleaved with 4. the measured
        # decode on the trace after its warm-up ---------------------------------------------------
        with ledger.guard("bandwidth tests (workspace)"):
            mem_bw = memory_bandwidth(device)
            link_bw = link_bandwidth(source, device)
        # A second, small cache serves the calibration blocks, which run interleaved with the
        # measured blocks (a shared machine's load changes over seconds; medians over blocks
        # spread through the run see the same load), without touching the measured cache.
        main_cache = sm.cache
        calib_cache = make_cache(sm, calib_slots, admission=False)  # no staging: its bytes are the workspace's
        span = max(shape.top_k, min(shape.experts, 3 * calib_slots // (4 * shape.layers)))
        warm = 2 * -(-span // shape.top_k) + 1  # tokens until the hit rotation is resident
        rounds, hit_block, miss_block = 4, 6, 6
        all_hit = TraceRouting(rotating_trace(warm + rounds * hit_block + 8, shape, span), store.config.moe_layers)
        all_miss = TraceRouting(rotating_trace(rounds * miss_block + 8, shape, shape.experts), store.config.moe_layers)
        routing = TraceRouting(trace, store.config.moe_layers)
        use(sm, calib_cache, all_hit)
        with ledger.guard("calibration"):
            decode(model, 1, warm)  # compile, fill the rotation
        main = Variant("in process (RAM tier: every expert)", main_cache, routing, source)
        variants = [main] + other_sources(args, sm, store, source, trace, slots, ledger, extras)
        for v in variants:
            use(sm, v.cache, v.routing)
            with ledger.guard(f"warm-up ({v.label})"):
                decode(model, 1, warmup)
            v.start()
        counter = None
        native = executor_for(model).native()  # None on CUDA and on the torch path
        if native is not None:
            counter = native.ext = CallCounter(native.ext)
        hit_times, miss_times, times = [], [], []
        calls = copies = copy_s = misses_calib = miss_steps = 0
        stats = []
        for r in range(rounds):
            # the link test again each round, its best kept: one short burst can be spoiled
            # entirely by a loaded machine (0.01 GB/s once, the model then -94%)
            with ledger.guard("bandwidth tests (workspace)"):
                link_bw = max(link_bw, link_bandwidth(source, device))
            use(sm, calib_cache, all_hit)
            with ledger.guard("calibration"):
                hit_times += decode(model, 1, hit_block)[1]
            use(sm, calib_cache, all_miss)
            before = calib_cache.metrics.total().misses
            with ledger.guard("calibration"):
                st_m, t_m = decode(model, 1, miss_block)
            miss_times += t_m
            misses_calib += calib_cache.metrics.total().misses - before
            miss_steps += st_m.generated_tokens
            n = tokens // rounds + (1 if r < tokens % rounds else 0)
            for v in variants[1:]:
                use(sm, v.cache, v.routing)
                with ledger.guard(f"decode ({v.label})"):
                    v.times += decode(model, 1, n)[1]
            use(sm, main_cache, routing)
            c0, k0, s0 = (counter.calls if counter else 0), source.copies, source.copy_seconds
            with ledger.guard("decode"):
                st, t_tr = decode(model, 1, n)
            times += t_tr
            main.times += t_tr
            stats.append(st)
            calls += (counter.calls if counter else 0) - c0
            copies += source.copies - k0
            copy_s += source.copy_seconds - s0
        cache = main_cache
        calib_cache.close()
        tps = median_tps(times)
        steps = len(times)  # every step is one token (each block's one-token prefill included)
        wall = sum(times)
        m = cache.metrics.total()
        acc = m.hits + m.misses
        live_hit = m.hits / acc if acc else 0.0
        to_device = m.bytes_to_device / steps
        stall = m.stall_s / wall if wall else 0.0
        calls = calls / steps if counter is not None else None
        achieved_link = copies * store.expert_nbytes / copy_s if copy_s else float("nan")
        mean_tps = (steps - len(stats)) / sum(s.decode_seconds for s in stats)
        launches = cuda_launches(model, routing) if device.type == "cuda" else None
        peak = ledger.check_peak()
        miss_per_token = misses_calib / miss_steps
        t_res, t_miss = 1.0 / median_tps(hit_times), 1.0 / median_tps(miss_times)
        base = predict(shape, Target("this device", mem_bw, link_bw, budget, 0.0), 1.0, dense_format=dense)
        overhead = (t_res - base.token_s) / shape.layers
        if overhead < 0:
            print(f"note: the step read faster than the measured bandwidth ({-overhead * 1e6:.0f} µs/layer below); "
                  f"overhead taken as 0")
        overhead = max(overhead, 0.0)
        miss_overhead = max(0.0, (t_miss - t_res) / max(miss_per_token, 1e-9) - shape.expert_bytes / link_bw)
        sim_hit = simulated_hit_rate(trace[:(warmup + tokens) * shape.layers], slots, warmup, args.policy,
                                     bypass=bool(staging))
        target = Target("this device", mem_bw, link_bw, budget, overhead, miss_overhead_s=miss_overhead)
        pred = predict(shape, target, sim_hit, dense_format=dense)
        err = pred.tok_s / tps - 1
        scale = f" x{SHAPES[name].layers / shape.layers:.0f} layers" if scaled else ""
        print(f"\nMEASURED ({shape.name}{', reduced-layer run' if scaled else ''}; routing: "
              f"{args.trace or f'synthetic zipf {args.zipf} locality {args.locality}'}; {tokens} tokens after {warmup} warm-up)")
        print("| figure | value |")
        print("|---|---|")
        rows_v = [v.figures() for v in variants]
        rows = [
            ("decode tok/s (median step / mean)", f"{tps:.2f} / {mean_tps:.2f}"
             + (f" (per-layer scaled to {SHAPES[name].layers} layers: {tps * shape.layers / SHAPES[name].layers:.2f})"
                if scaled else "")),
            ("device expert hit rate (live / simulated)", f"{live_hit:.1%} / {sim_hit:.1%}"
             + (f" (admission control: {m.bypassed} of {m.misses} misses served from staging)" if staging
                else " (every miss cached)")),
            ("expert bytes per token from RAM", format_bytes(to_device)),
            ("expert bytes per token from disk", "0 B (the RAM tier holds every expert)" + disk_note(rows_v)),
            ("host-to-device GB/s achieved (copies) / measured link", f"{achieved_link / 1e9:.2f} / {link_bw / 1e9:.2f}"),
            ("stall fraction (waiting for experts)", f"{stall:.1%}"),
            ("kernel launches per token" if device.type == "cuda" else "native calls per token",
             f"{launches:.0f}" if launches is not None else (f"{calls:.0f}" if calls is not None else "n/a (torch path)")),
            ("device memory: dense / KV / state / expert slots / staging slots",
             f"{format_bytes(dense_bytes)} / {format_bytes(split.kv)} / {format_bytes(split.state)} / "
             f"{format_bytes(slots * shape.slot_bytes)} / {format_bytes(staging * shape.slot_bytes)} "
             f"(peak {format_bytes(peak)} of {format_bytes(budget)})"),
            ("calibration: device read GB/s / overhead per layer / per miss",
             f"{mem_bw / 1e9:.1f} / {overhead * 1e6:.0f} µs / {miss_overhead * 1e6:.0f} µs "
             f"(all-hit {1 / t_res:.1f} tok/s, all-miss {1 / t_miss:.1f} tok/s at {miss_per_token:.1f} misses/token)"),
            ("cost model for this run (tok/s, error)", f"{pred.tok_s:.2f} ({err:+.1%}){scale}"),
        ]
        for k, v in rows:
            print(f"| {k} | {v} |")
        if len(variants) > 1:
            print(f"\nEXPERT SOURCES (same model, trace, {slots} device slots and policy; blocks interleaved; "
                  f"the CPU is the device on a CPU run: copies are the link)")
            print_table(rows_v)
        figures["variants"] = rows_v
        figures.update(decode_tps=tps, decode_tps_mean=mean_tps, hit_rate=live_hit, sim_hit_rate=sim_hit, ram_bytes_per_token=to_device,
                       disk_bytes_per_token=0, link_gbs=achieved_link / 1e9, stall_fraction=stall,
                       calls_per_token=calls, launches_per_token=launches, dense_bytes=dense_bytes, kv_bytes=split.kv,
                       state_bytes=split.state, slot_bytes=slots * shape.slot_bytes,
                       staging_bytes=staging * shape.slot_bytes, bypassed=m.bypassed, peak=peak,
                       overhead_s=overhead, miss_overhead_s=miss_overhead, mem_bw=mem_bw, link_bw=link_bw, predicted_tps=pred.tok_s, model_error=err)
    finally:
        extras.close()
        sm.close()
    full_shape_predictions(args, overhead if device.type == "cuda" else None, predictions)
    figures["predictions"] = predictions
    _write(args.json, figures)
    return 0


def make_cache(sm, slots: int, store=None, source=None, admission: bool | None = None):
    """Another expert cache like the model's, with ``slots`` cache slots and its staging slots
    (over another store and source when given; ``admission`` False: none)."""
    from dataclasses import replace

    from engine.experts.cache import ExpertCache

    c = sm.cache
    on = c.admission if admission is None else admission
    staging = c.num_staging if on else 0
    cfg = replace(c.config, device_budget=(slots + staging) * c.slot_bytes, admission=on,
                  staging_slots=staging or None)
    return ExpertCache(store or sm.store, source or sm.source, cfg, routers=c.routers, device=c.device)


def other_sources(args, sm, store, source, trace, slots, ledger, extras) -> list:
    """The --disk and --ray variants (bench/headline_variants.py), their clean-up on ``extras``."""
    if not (args.disk or args.ray):
        return []
    import tempfile

    from engine.experts.synthetic_disk import SyntheticDiskStore
    from engine.experts.synthetic_store import TraceRouting
    from engine.store.reader import ExpertStore

    where = args.disk or str(Path(extras.enter_context(tempfile.TemporaryDirectory(prefix="headline-"))) / "store")
    disk = SyntheticDiskStore(source, where)
    path = extras.enter_context(disk)
    es = ExpertStore(path)
    extras.callback(es.close)
    print(f"disk store: {format_bytes(disk.bytes_written)} written to {path} in {disk.write_seconds:.1f} s; reads "
          f"{'O_DIRECT (page cache bypassed)' if es.direct_io else 'buffered (the page cache may serve them)'}")
    out = []

    def add(label, src):
        ledger.charge(f"expert slots ({label})", (slots + sm.cache.num_staging) * store.shape.slot_bytes)
        cache = make_cache(sm, slots, store=es, source=src)
        extras.callback(cache.close)
        out.append(Variant(label, cache, TraceRouting(trace, store.config.moe_layers), src))

    if args.disk:
        tier = disk_tier(es, args.ram_tier)
        add(f"disk (RAM tier: {args.ram_tier:.0%} of the experts, O_DIRECT reads)" if es.direct_io
            else f"disk (RAM tier: {args.ram_tier:.0%} of the experts, buffered reads)", tier)
    if args.ray:
        loaders = RayLoaders(path, es, args.loaders)
        extras.callback(loaders.close)
        print(f"Ray: {args.loaders} loader actors filled with every expert in {loaders.fill():.1f} s")
        add(f"Ray loaders x{args.loaders} (shared memory: every expert)", loaders.source)
    return out


def disk_note(rows) -> str:
    d = [r for r in rows if r["label"].startswith("disk")]
    return f"; disk run: {format_bytes(d[0]['disk_per_token'])} at {d[0]['disk_gbs']:.3g} GB/s" if d else ""


def use(sm, cache, routing) -> None:
    """Route the model by ``routing`` through ``cache``."""
    for block in sm.model.moe_blocks:
        block.provider = cache
    routing.install(sm.model)


def cuda_launches(model, routing, steps: int = 3) -> float:
    """CUDA kernels per decoded token (torch profiler) over a few more trace tokens."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode(model, 1, steps)
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(gpu) / steps


def _write(path, figures) -> None:
    if path:
        Path(path).write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
