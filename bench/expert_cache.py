"""The tiered expert cache on a store larger than its RAM budget.

    python bench/expert_cache.py                       # 24 layers x 64 experts, top-8, int4 g64
    python bench/expert_cache.py --layers 8 --tokens 16   # quick look
    python bench/expert_cache.py --device cuda            # device slots on the GPU, experts on
                                                          # the fused Triton kernels
    python bench/expert_cache.py --policy-table           # the simulator's policy table only
    python bench/expert_cache.py --admission-table        # live cache with/without admission control
    python bench/expert_cache.py --admission-decode STORE --tokens 48   # decode a store, admission off/on

Builds (once, cached under ~/.cache/moestream/bench) a random Qwen3-MoE checkpoint written
layer by layer as a sharded safetensors directory, converts it to an int4 store, then generates
greedily at device budgets of 10/25/50/100% of the experts with a RAM tier smaller than the
store, printing per budget: tok/s, device hit rate, RAM-tier hit rate, bytes per token from NVMe
and into the device tier, stall time, and two rooflines: the compute roofline (all weights
resident: memory bandwidth / active bytes per token) and the transfer-bound roofline for the
bytes this run actually moved. Routing here is a random model's (near uniform): trained MoEs
route with more skew and locality (see the simulator rows on skewed synthetic traces).
Then replays the routing trace recorded at the 100% budget through the simulator (LRU, LFU,
sweep, Belady; each with its ratio to Belady) at the same budgets, and synthetic traces with skew for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def build_checkpoint(out: Path, layers: int, experts: int, top_k: int, hidden: int, inter: int,
                     vocab: int, seed: int = 0) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    heads, kv_heads, head_dim = hidden // 64, max(hidden // 256, 1), 64
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=vocab,
               hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=experts,
               num_experts_per_tok=top_k, moe_intermediate_size=inter, intermediate_size=4 * hidden,
               norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
               rope_theta=10000.0, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    weight_map = {}
    shards = {"model-dense.safetensors": {
        "model.embed_tokens.weight": rnd(vocab, hidden), "lm_head.weight": rnd(vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}}
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": rnd(heads * head_dim, hidden),
             p + "self_attn.k_proj.weight": rnd(kv_heads * head_dim, hidden),
             p + "self_attn.v_proj.weight": rnd(kv_heads * head_dim, hidden),
             p + "self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
             p + "self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
             p + "mlp.gate.weight": rnd(experts, hidden, scale=0.5)}
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = rnd(inter, hidden)
            t[q + "up_proj.weight"] = rnd(inter, hidden)
            t[q + "down_proj.weight"] = rnd(hidden, inter)
        shards[f"model-layer{i:03d}.safetensors"] = t
    for name, tensors in shards.items():
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def ensure_store(args) -> Path:
    from engine.quant.formats import QuantFormat
    from engine.store import convert

    root = Path(os.environ.get("MOESTREAM_CACHE", Path.home() / ".cache" / "moestream")) / "bench"
    tag = f"qwen3moe-L{args.layers}-E{args.experts}-k{args.top_k}-h{args.hidden}-i{args.inter}"
    hf, store = root / (tag + "-hf"), root / (tag + "-int4")
    if not (store / "manifest.json").exists():
        if not (hf / "config.json").exists():
            print(f"building random checkpoint {hf} ...", flush=True)
            build_checkpoint(hf, args.layers, args.experts, args.top_k, args.hidden, args.inter, args.vocab)
        print(f"converting to {store} ...", flush=True)
        print(convert(hf, store, fmt=QuantFormat("int4", 64), progress=True))
    return store


def disk_read_bandwidth(store: Path) -> float:
    """O_DIRECT read rate of the store's expert files (bypasses the page cache)."""
    from engine.store import ExpertStore

    with ExpertStore(store) as s:
        buf = s.empty_buffer()
        keys = [(e.layer, e.expert) for e in s.manifest.experts][::7][:200]
        t = time.perf_counter()
        n = 0
        for l, e in keys:
            n += len(s.read_expert(l, e, out=buf, verify=False))
        return n / (time.perf_counter() - t)


def memory_bandwidth(device: str = "cpu") -> float:
    """Read bandwidth of the device the model runs on (a large reduction)."""
    x = torch.ones(2**28, dtype=torch.float32, device=device)
    x.sum()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(3):
        x.sum()
    sync()
    return 3 * x.numel() * 4 / (time.perf_counter() - t)


def link_bandwidth(device: str, mem_bw: float) -> float:
    """Bytes/s into the device tier: a pinned host-to-device copy on a GPU; on CPU the device
    tier is host memory, so a memcpy (about the read bandwidth)."""
    if device != "cuda":
        return mem_bw
    src = torch.empty(2**28, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(2**28, dtype=torch.uint8, device=device)
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * src.numel() / (time.perf_counter() - t)


class ReplayRouting:
    """Routes every sparse layer from a routing trace instead of the router (bench only): a
    random model's routers send almost every token to the same experts, which says nothing about
    a trained MoE; a synthetic trace with chosen skew and locality does. Weights are 1/K."""

    def __init__(self, trace, layers: list[int]) -> None:
        import numpy as np

        self.k = trace.top_k
        self.table = {}  # (token, layer ordinal) -> experts
        for t, l, e in trace.records():
            self.table[(int(t), int(l))] = list(e)
        self.ordinal = {layer: i for i, layer in enumerate(layers)}
        self.first = layers[0]
        self.pos = 0
        self.np = np

    def install(self, model) -> None:
        from engine.layers.moe import Routing

        def make(block):
            def route(x, allowed=None):
                t = x.shape[0]
                if block.layer == self.first:
                    self.pos += t
                start = self.pos - t
                ids = torch.tensor([self.table[(start + i, self.ordinal[block.layer])] for i in range(t)],
                                   device=x.device)
                return Routing(torch.full(ids.shape, 1.0 / self.k, device=x.device), ids)
            return route

        for block in model.moe_blocks:
            block.router_override = make(block)


DENSE_BYTES = {"fp32": 4, "bf16": 2, "int8": 8.25 / 8}  # per dense weight (int8 g64: fp16 scales)


def run_budget(store: Path, frac: float, ram_budget: int, prompt: list[int], tokens: int, recorder=None,
               replay=None, device: str = "cpu", dense: str = "int8"):
    from engine.experts.runtime import load_from_store, store_expert_bytes
    from engine.layers.sampler import SamplingConfig
    from engine.runner import stream_request

    total = store_expert_bytes(store)
    # Replayed routing is not what the routers would predict, so prefetch is off for it.
    sm = load_from_store(store, device_budget=int(total * frac), ram_budget=ram_budget, policy="sweep",
                         prefetch_depth=0 if replay is not None else 1, device=device, dense=dense)
    if replay is not None:
        ReplayRouting(replay, sorted(sm.store.config.moe_layers)).install(sm.model)
    if recorder is not None:
        for block in sm.model.moe_blocks:
            block.observers.append(recorder)
    try:
        t = time.perf_counter()
        stats = None
        for _, stats in stream_request(sm.model, prompt, SamplingConfig(max_tokens=tokens, ignore_eos=True)):
            pass
        wall = time.perf_counter() - t
        m = sm.cache.metrics
        m.tokens = len(prompt) + tokens
        s = m.summary(sm.cache.source.counters())
        return dict(frac=frac, slots=sm.cache.num_slots, decode_tps=stats.decode_tps, wall=wall, **s)
    finally:
        sm.close()


def print_rows(rows, dense_active, expert_active, mem_bw, disk_bw, link_bw, compute_roof) -> None:
    from engine.units import format_bytes

    print("| device budget | slots | decode tok/s | device hit | RAM hit | NVMe B/token | to-device B/token | "
          "stall s | prefetch P/R | transfer-bound roofline tok/s | compute roofline tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ram_acc = r["ram_hits"] + r["ram_misses"]
        moved = (dense_active + expert_active) / mem_bw + r["nvme_bytes_per_token"] / disk_bw + \
            r["bytes_to_device_per_token"] / link_bw
        print(f"| {r['frac']:.0%} | {r['slots']} | {r['decode_tps']:.2f} | {r['device_hit_rate']:.1%} | "
              f"{(r['ram_hits'] / ram_acc if ram_acc else 0):.1%} | {format_bytes(r['nvme_bytes_per_token'])} | "
              f"{format_bytes(r['bytes_to_device_per_token'])} | {r['stall_s']:.2f} | "
              f"{r['prefetch_precision']:.2f}/{r['prefetch_recall']:.2f} | {1 / moved:.1f} | {compute_roof:.1f} |")


def policy_traces(tokens: int = 144) -> list[tuple[str, object, tuple | None]]:
    """The traces the policy tables replay, as (label, RoutingTrace, (zipf, locality, seed) of a
    synthetic trace's generator or None): the demo model's and the moe16 model's real decode
    traces (tests/data) and two synthetic traces of the demo's shape."""
    from engine.experts.synthetic import synthetic_trace
    from engine.experts.trace import RoutingTrace

    data = Path(__file__).resolve().parents[1] / "tests" / "data"
    rows = [("demo model, decode (144 tokens; tuned on)", RoutingTrace.load(data / "smollm2_demo_generate.npz"), None),
            ("moe16 top-8 model, decode (318 tokens; held out)",
             RoutingTrace.load(data / "smollm2_moe16_top8_heldout_generate.npz"), None)]
    for zipf, seed in ((0.6, 1), (1.2, 2)):
        rows.append((f"synthetic, zipf {zipf}, locality 0.3 (seed {seed})",
                     synthetic_trace(tokens, 30, 12, 6, zipf=zipf, locality=0.3, seed=seed), (zipf, 0.3, seed)))
    return rows


def policy_table(tokens: int = 144, samples: int = 1000) -> None:
    """docs/expert-cache.md's policy table: LRU, LFU, sweep (the default) and Belady at 10/25/50% of the
    experts on the demo model's decode trace, the moe16 model's (held out: never tuned on) and
    synthetic traces of the demo's shape, each cell with its ratio to Belady; for the synthetic
    traces also the online ceiling (engine.experts.synthetic.online_ceiling)."""
    from engine.experts.simulate import budgets_from_fractions, frequency_oracle, sweep
    from engine.experts.synthetic import online_ceiling, pick_probabilities

    rows = policy_traces(tokens)
    pols = ["lru", "lfu", "sweep", "belady"]
    print("| trace | budget | " + " | ".join({"sweep": "sweep (default)", "belady": "Belady"}.get(p, p.upper()) for p in pols)
          + " | sweep + bypass | Belady with bypass | frequency oracle | online ceiling |")
    print("|---|---|" + "---|" * (len(pols) + 4))
    for label, tr, model in rows:
        caps = budgets_from_fractions(tr, [0.1, 0.25, 0.5])
        table = sweep(tr, pols, caps)
        # admission control (a policy may decline to cache a miss): judged against Belady with bypass
        admit = sweep(tr, ["sweep"], caps, bypass=True)
        probs = pick_probabilities(tr, model[0], model[1], model[2], samples=samples) if model else None
        for c in caps:
            cells = [f"{table.hit_rate(p, c):.1%} ({table.ratio(p, c):.2f})" if p != "belady"
                     else f"{table.hit_rate(p, c):.1%}" for p in pols]
            cells += [f"{admit.hit_rate('sweep', c):.1%} ({admit.ratio('sweep', c):.2f})",
                      f"{admit.bounds[c].hit_rate:.1%}", f"{frequency_oracle(tr, c):.1%}"]
            ceiling = (f"{online_ceiling(probs, c, tr.num_layers, tr.top_k):.1%}" if probs is not None else "-")
            print(f"| {label} | {c / tr.num_keys:.0%} | " + " | ".join(cells) + f" | {ceiling} |")


def admission_table(tokens: int = 144) -> None:
    """docs/expert-cache.md's admission-control table: the live expert cache (engine.experts.cache, a
    disk-free store of small random experts of each trace's shape) replaying the policy table's
    traces with ``sweep`` at 10/25/50% of the experts: every miss cached; admission control with
    top_k staging slots beside the same cache slots; and within the same device budget (top_k
    fewer cache slots); beside the simulator's figures for the same three access streams."""
    from engine.costmodel import ModelShape
    from engine.experts.cache import CacheConfig, ExpertCache
    from engine.experts.simulate import budgets_from_fractions, simulate
    from engine.experts.synthetic_store import SyntheticExpertStore

    print("| trace | budget | slots | every miss cached | admission, same cache slots (+ top-k staging) "
          "| admission, same device budget (top-k of the slots staging) | declined misses | simulated |")
    print("|---|---|---|---|---|---|---|---|")
    for label, tr, _ in policy_traces(tokens):
        shape = ModelShape("replay", layers=tr.num_layers, hidden=64, experts=tr.num_experts, expert_width=64,
                           top_k=tr.top_k, shared_width=0, vocab=64, heads=1, kv_heads=1, head_dim=64)
        store = SyntheticExpertStore(shape, seed=0)
        source = store.ram_source(pin_memory=False)
        k = tr.top_k
        for cap in budgets_from_fractions(tr, [0.1, 0.25, 0.5]):
            live = {}
            for name, cache_slots, admission in (("plain", cap, False), ("more", cap, True), ("same", cap - k, True)):
                budget = (cache_slots + (k if admission else 0)) * source.slot_bytes
                cache = ExpertCache(store, source, CacheConfig(device_budget=budget, prefetch_depth=0,
                                                               admission=admission))
                try:
                    live[name] = cache.replay(tr)
                finally:
                    cache.close()
            sim = [simulate(tr, "sweep", c, bypass=b).hit_rate for c, b in ((cap, False), (cap, True), (cap - k, True))]
            rate = {n: m.hits / (m.hits + m.misses) for n, m in live.items()}
            print(f"| {label} | {cap / tr.num_keys:.0%} | {cap} | {rate['plain']:.1%} | {rate['more']:.1%} | "
                  f"{rate['same']:.1%} | {live['more'].bypassed} of {live['more'].misses} | "
                  f"{sim[0]:.1%} / {sim[1]:.1%} / {sim[2]:.1%} |")


def admission_decode(store, tokens: int = 48, fractions=(0.1, 0.25, 0.5), dense: str = "int8") -> None:
    """Greedy decode of a real store through the live cache at each budget (a share of the
    experts' bytes), admission control off and on at the same device budget (on: top_k of its
    slots are staging slots), blocks interleaved; tok/s from the median step, the device hit
    rate, declined misses. The tokens must be identical."""
    import statistics

    from engine.experts.runtime import load_from_store, store_expert_bytes
    from engine.layers.sampler import SamplingConfig
    from engine.runner import stream_request

    total = store_expert_bytes(store)
    prompt = list(range(100, 116))
    print("| budget | admission | cache + staging slots | tok/s (median step) | hit rate | declined misses |")
    print("|---|---|---|---|---|---|")
    for frac in fractions:
        with load_from_store(store, device_budget=int(frac * total), dense=dense, prefetch_depth=0) as sm:
            caches = {False: sm.cache, True: sm.cache.reconfigured(admission=True)}
            rows, outs = {}, {}
            try:
                for on in (False, True):
                    cache = caches[on]
                    cache.attach(sm.model)
                    ids, times, t = [], [], time.perf_counter()
                    for out, _ in stream_request(sm.model, prompt, SamplingConfig(max_tokens=tokens, ignore_eos=True)):
                        now = time.perf_counter()
                        ids += out.new_token_ids
                        times.append(now - t)
                        t = now
                    m = cache.metrics.total()
                    outs[on] = ids
                    rows[on] = (f"{cache.num_slots} + {cache.num_staging}", 1 / statistics.median(times[1:]),
                                m.hits / max(m.hits + m.misses, 1), f"{m.bypassed} of {m.misses}")
            finally:
                caches[True].close()
            if outs[True] != outs[False]:
                raise AssertionError(f"budget {frac:.0%}: tokens differ with admission control")
            for on in (False, True):
                slots, tps, hit, declined = rows[on]
                print(f"| {frac:.0%} | {'on' if on else 'off'} | {slots} | {tps:.1f} | {hit:.1%} | {declined} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per budget")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--ram", default="25%", help="RAM tier: bytes or a share of the store's experts")
    ap.add_argument("--budgets", default="0.1,0.25,0.5,1.0")
    ap.add_argument("--dense", choices=sorted(DENSE_BYTES), default="int8",
                    help="format of the dense weights (int8/bf16 run the native step on a CPU; fp32 the "
                         "torch layers, as before 2026-11-30)")
    ap.add_argument("--zipf", type=float, default=1.0, help="skew of the synthetic routing rows")
    ap.add_argument("--locality", type=float, default=0.3, help="reuse of the previous token's experts")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model and the device expert slots live")
    ap.add_argument("--policy-table", action="store_true",
                    help="only print the simulator's policy table (docs/expert-cache.md) and exit")
    ap.add_argument("--admission-decode", default=None, metavar="STORE",
                    help="only decode STORE at 10/25/50%% budgets with admission control off and on, and exit")
    ap.add_argument("--admission-table", action="store_true",
                    help="only print the live cache's hit rates with and without admission control (docs/expert-cache.md) and exit")
    args = ap.parse_args()
    if args.policy_table:
        policy_table()
        return
    if args.admission_table:
        admission_table()
        return
    if args.admission_decode:
        admission_decode(args.admission_decode, tokens=args.tokens, dense=args.dense)
        return

    from engine.experts.runtime import store_expert_bytes
    from engine.experts.simulate import sweep
    from engine.experts.synthetic import synthetic_trace
    from engine.experts.trace import TraceRecorder
    from engine.store import ExpertStore
    from engine.units import format_bytes, parse_bytes

    store = ensure_store(args)
    with ExpertStore(store) as s:
        cfg, expert_nbytes = s.config, s.expert_nbytes
        store_bytes = sum(e.nbytes for e in s.manifest.experts)
    total = store_expert_bytes(store)
    ram = parse_bytes(args.ram, total=total, name="--ram")
    mem_bw, disk_bw = memory_bandwidth(args.device), disk_read_bandwidth(store)
    link_bw = link_bandwidth(args.device, mem_bw)
    counts = cfg.parameter_counts()
    dense_active = (counts["active"] - counts["routed_active"]) * DENSE_BYTES[args.dense]
    expert_active = cfg.moe.top_k * len(cfg.moe_layers) * expert_nbytes
    compute_roof = mem_bw / (dense_active + expert_active)
    print(f"store {store}: {len(cfg.moe_layers)} layers x {cfg.moe.num_experts} experts, top-{cfg.moe.top_k}, "
          f"int4 g64, {format_bytes(expert_nbytes)} per expert, {format_bytes(store_bytes)} of experts; "
          f"RAM tier {format_bytes(ram)} ({ram / total:.0%} of the experts)")
    print(f"device {args.device}, dense {args.dense}, threads {torch.get_num_threads()}, memory read {mem_bw / 1e9:.1f} GB/s, "
          f"into the device tier {link_bw / 1e9:.1f} GB/s, store O_DIRECT read "
          f"{disk_bw / 1e9:.2f} GB/s, active bytes/token {format_bytes(dense_active + expert_active)} "
          f"(experts {format_bytes(expert_active)}) -> compute roofline {compute_roof:.1f} tok/s")
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    rec = TraceRecorder(cfg.num_layers, cfg.moe.num_experts, cfg.moe.top_k)
    token_index = {"n": 0}

    def record(layer, ids):
        first = min(cfg.moe_layers)
        if layer == first:
            base = token_index["n"]
            token_index["n"] += ids.shape[0]
        else:
            base = token_index["n"] - ids.shape[0]
        for t in range(ids.shape[0]):
            rec.record(base + t, layer, ids[t].tolist())

    budgets = [float(b) for b in args.budgets.split(",")]
    synthetic = synthetic_trace(args.prompt + args.tokens, len(cfg.moe_layers), cfg.moe.num_experts,
                                cfg.moe.top_k, zipf=args.zipf, locality=args.locality, seed=0)
    for label, replay in (("the random model's own routing", None),
                          (f"synthetic routing replayed (zipf {args.zipf}, locality {args.locality})", synthetic)):
        rows = [run_budget(store, frac, ram, prompt, args.tokens,
                           recorder=record if (frac == 1.0 and replay is None) else None, replay=replay,
                           device=args.device, dense=args.dense)
                for frac in budgets]
        print(f"\nrouting: {label}")
        print_rows(rows, dense_active, expert_active, mem_bw, disk_bw, link_bw, compute_roof)
    print("(live hit rates count one access per distinct expert per layer per step, so a prefill of "
          "T tokens is one access per expert it routes to; the simulator counts every token's picks.)")
    slots = [r["slots"] for r in rows]
    print("\nsimulator on the trace recorded at the 100% budget (hit rate):")
    if 1.0 in budgets:
        print(sweep(rec.trace(), ["lru", "lfu", "sweep", "belady"], slots).format())
    for zipf in (0.0, 1.2):
        tr = synthetic_trace(400, len(cfg.moe_layers), cfg.moe.num_experts, cfg.moe.top_k, zipf=zipf,
                             locality=0.3, seed=0)
        print(f"\nsimulator on a synthetic trace, zipf {zipf}, locality 0.3 (hit rate):")
        print(sweep(tr, ["lru", "lfu", "sweep", "belady"], slots).format())


if __name__ == "__main__":
    main()
