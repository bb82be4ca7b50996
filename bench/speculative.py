"""Speculative decoding against plain decoding, greedy, on this CPU.

    python bench/speculative.py                         # SmolLM2 (a, b) + random MoE store (a, b, c)
    python bench/speculative.py --models moe --new 48 --budget 0.25
    python bench/speculative.py --models mtp               # Qwen3.5-MoE's MTP head (random)

For each mode: acceptance rate, tokens per target forward (verify step), decode tok/s, speed-up
over plain decoding of the same model in the same run, expert bytes moved to the device per
generated token, and whether the tokens equal plain decoding's (they must: greedy is lossless).
Everything runs through the serving engine (engine.runner.Engine), one request alone and, for
the MoE store, 8 concurrent requests in one batch; the MoE store runs `moestream serve`'s default
kernel path (--dense bf16: the native step, int4 experts with int8 activations on VNNI CPUs).

Modes
    plain  the engine without speculation
    a      NgramDrafter (prompt lookup, n=3)
    b      DraftModelDrafter: SmolLM2 -> the same weights re-quantized to int4 (g32) through the
           fast 4-bit kernels (a cheaper model sharing the tokenizer); MoE store -> the first half
           of the layers of the same store loaded with every expert resident (layer-skip draft)
    c      SelfSpecDrafter: the target routed to device-resident experts only (MoE store only)
    mtp    the checkpoint's own MTP head (``--speculative mtp``; --models mtp): a random
           Qwen3.5-MoE (DeltaNet + gated attention, h256 L4 E16) with a random MTP head, fp32,
           every expert resident. Random weights: the head has learnt nothing, so its acceptance
           is near chance and the row measures the drafting cost, not a trained head's gain.

Physical limit: plain decode reads every active weight once per token, so tok/s <= bandwidth /
active bytes (the roofline printed); a verify step reads them once for several tokens, which is
how speculation can beat that figure. Every speculative mode uses the adaptive draft length
(engine.speculative.DraftLengthController).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch
from torch import nn


def measure_bandwidth(mib: int = 512) -> float:
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(3))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Int4Linear(nn.Module):
    """A Linear re-quantized to int4 (group 32), run by engine.quant.kernels.qlinear (bench-only
    helper to build a cheaper draft model)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from engine.quant.formats import QuantFormat
        from engine.quant.reference import quantize

        self.q = quantize(linear.weight.detach(), QuantFormat("int4", 32))
        self.bias = linear.bias

    def forward(self, x):
        from engine.quant.kernels import qlinear

        y = qlinear(x, self.q)
        return y if self.bias is None else y + self.bias


class EmulatedLink:
    """Wraps the cache's ExpertSource: every host->device copy also occupies one shared link for
    nbytes / bytes_per_s (a sleep, so prefetch threads overlap it with compute as DMA would).
    On a CPU-only machine the "device" is host memory and a copy costs a memcpy; the link puts
    back the price a PCIe transfer has on a GPU machine."""

    def __init__(self, inner, bytes_per_s: float) -> None:
        import threading

        self.inner, self.bytes_per_s = inner, bytes_per_s
        self.lock = threading.Lock()

    def read_into(self, key, out):
        tier = self.inner.read_into(key, out)
        n = self.inner.store.entry(*key).nbytes
        with self.lock:
            time.sleep(n / self.bytes_per_s)
        return tier

    def __getattr__(self, name):
        return getattr(self.inner, name)


def int4_copy(model):
    d = copy.deepcopy(model)
    for mod in list(d.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                setattr(mod, name, Int4Linear(child))
    return d


def run_engine(model, prompts, new, spec=None, cache=None) -> dict:
    """Greedy requests (one per prompt, all in one batch) through the serving engine; decode
    tok/s counts tokens after each request's first over the time after the first token."""
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine

    engine = Engine.for_requests(model, None, max(len(p) for p in prompts) + new, seqs=len(prompts),
                                 speculative=spec, max_batched_tokens=max(512, sum(map(len, prompts))))
    b0 = _bytes(cache)
    reqs = [Request(list(p), SamplingConfig(max_tokens=new, ignore_eos=True)) for p in prompts]
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    t1 = time.perf_counter()
    first = min(r.ttft for r in res) + t0
    generated = sum(len(r.output_ids) for r in res)
    st = [r.spec for r in res if r.spec is not None]
    drafted, accepted = sum(s.drafted for s in st), sum(s.accepted for s in st)
    steps = sum(s.steps for s in st)
    ks = [k for s in st for k in s.k_history if k]
    return dict(tokens=[r.output_ids for r in res], tps=(generated - len(res)) / (t1 - first),
                acc=accepted / drafted if spec is not None and drafted else (0.0 if spec else None),
                tps_step=(generated - len(res)) / steps if steps else 1.0,
                bytes_tok=(_bytes(cache) - b0) / generated, k=f"{sum(ks) / len(ks):.1f}" if ks else "-")


def _bytes(cache) -> int:
    return sum(m.bytes_to_device for m in cache.metrics.layers.values()) if cache is not None else 0


def best_of(fn, repeats: int) -> dict:
    """Best decode tok/s of ``repeats`` runs (the machine is shared: the best is the least
    disturbed); the other figures are from that run."""
    runs = [fn() for _ in range(repeats)]
    return max(runs, key=lambda r: r["tps"])


def roofline(cfg, dense_bytes_per_weight: float, expert_bytes_per_weight: float, bw: float) -> float:
    """Plain decode's limit: tok/s <= bandwidth / active weight bytes per token."""
    c = cfg.parameter_counts()
    active = (c["active"] - c["routed_active"]) * dense_bytes_per_weight + \
        c["routed_active"] * expert_bytes_per_weight
    return bw / active


def smollm2_rows(args, bw: float) -> list[tuple[str, str, dict]]:
    from engine.assets import smollm2_gguf
    from engine.loading import load_model
    from engine.speculative import SpeculativeConfig

    model, tok, cfg = load_model(smollm2_gguf())
    prompt = tok.encode(
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n\n\n"
        "Rewrite the four functions above with type hints:\n\n")
    draft = int4_copy(model)
    name = f"SmolLM2-135M fp32 ({len(prompt)}-token prompt)"
    print(f"{name}: plain-decode roofline {roofline(cfg, 4, 4, bw):.1f} tok/s")
    md = args.max_draft
    rows = [(name, "plain", best_of(lambda: run_engine(model, [prompt], args.new), args.repeats))]
    rows.append((name, "a ngram n=3", best_of(
        lambda: run_engine(model, [prompt], args.new, SpeculativeConfig("ngram", max_draft=md)), args.repeats)))
    rows.append((name, "b draft: int4 copy", best_of(
        lambda: run_engine(model, [prompt], args.new, SpeculativeConfig("draft", max_draft=md, draft_model=draft)),
        args.repeats)))
    return rows


def moe_rows(args, bw: float) -> list[tuple[str, str, dict]]:
    import transformers as T

    from engine.experts.runtime import load_from_store, store_expert_bytes
    from engine.quant.formats import QuantFormat
    from engine.speculative import SpeculativeConfig, layer_skip_draft
    from engine.store import convert

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        hf_cfg = T.Qwen3MoeConfig(vocab_size=4096, hidden_size=512, num_hidden_layers=6,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                  num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
                                  intermediate_size=1024, norm_topk_prob=True,
                                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        hf = T.Qwen3MoeForCausalLM(hf_cfg).eval()
        with torch.no_grad():  # random init leaves weights tiny: make routing and logits matter
            for prm in hf.parameters():
                prm.add_(torch.randn_like(prm) * 0.05)
        hf.save_pretrained(d / "hf")
        del hf
        convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
        total = store_expert_bytes(d / "store")
        budget = int(total * args.budget)
        g = torch.Generator().manual_seed(1)
        base = torch.randint(3, 4096, (24,), generator=g).tolist()
        prompt = base * 4  # repetitive: random weights then tend to loop, which n-grams catch
        from engine.store import ExpertStore

        with ExpertStore(d / "store") as st:
            cfg = st.config
        dense_bytes = {"fp32": 4, "bf16": 2, "int8": 1}[args.dense]
        print(f"MoE store: plain-decode roofline {roofline(cfg, dense_bytes, QuantFormat('int4', 32).bits_per_weight / 8, bw):.1f} tok/s "
              f"({args.dense} dense, int4 g32 experts; device budget {budget / 2**20:.1f} of "
              f"{total / 2**20:.1f} MiB, LFU, emulated host->device link {args.link_gbps:.2f} GB/s)")
        full = load_from_store(d / "store", dense=args.dense)  # the draft's own all-resident cache
        draft = layer_skip_draft(full.model, 3)
        name = (f"random Qwen3-MoE h512 L6 E32 top4 int4 ({total / 2**20:.0f} MiB experts), "
                f"device budget {args.budget:.0%}")
        # 8 concurrent requests: the prompt rotated, so each has its own history
        batch = [prompt[i * 3:] + prompt[:i * 3] for i in range(8)]

        def with_store(fn):
            def go():
                sm = load_from_store(d / "store", device_budget=budget, dense=args.dense)
                if args.link_gbps > 0:
                    sm.cache.source = EmulatedLink(sm.cache.source, args.link_gbps * 1e9)
                try:
                    return fn(sm)
                finally:
                    sm.close()
            return best_of(go, args.repeats)

        md = args.max_draft
        modes = {
            "a ngram n=3": lambda sm: SpeculativeConfig("ngram", max_draft=md, cache=sm.cache),
            "b draft: layers 0-2, resident": lambda sm: SpeculativeConfig(
                "draft", max_draft=md, draft_model=draft, cache=sm.cache),
            "c self-spec (resident experts)": lambda sm: SpeculativeConfig("self", max_draft=md, cache=sm.cache),
        }
        for prompts, label in (([prompt], name), (batch, name + ", 8 concurrent requests")):
            rows.append((label, "plain", with_store(lambda sm: run_engine(sm.model, prompts, args.new,
                                                                         cache=sm.cache))))
            for mode, make in modes.items():
                rows.append((label, mode, with_store(
                    lambda sm, make=make: run_engine(sm.model, prompts, args.new, make(sm), sm.cache))))
        full.close()
    return rows


def mtp_rows(args, bw: float) -> list[tuple[str, str, dict]]:
    from engine.loading import open_model_files
    from engine.models.load import build_model
    from engine.models.qwen3_5_moe.mtp_draft import mtp_speculative_config
    from tests.engine.models.qwen3_5_moe_tiny import add_mtp, make_qwen3_5_moe

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        make_qwen3_5_moe(d, seed=0, vocab=4096, vision=False, hidden_size=256, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                         linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                         num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                         shared_expert_intermediate_size=256,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                              mrope_section=[6, 5, 5], mrope_interleaved=True))
        add_mtp(d, 1)
        files = open_model_files(d)
        model = build_model(files.config, files.source)
        cfg = files.config
        prompt = torch.randint(3, 4096, (24,), generator=torch.Generator().manual_seed(1)).tolist() * 4
        name = f"random Qwen3.5-MoE h256 L4 E16 top4 fp32 + MTP head ({len(prompt)}-token prompt)"
        print(f"{name}: plain-decode roofline {roofline(cfg, 4, 4, bw):.1f} tok/s")
        md = args.max_draft
        run_engine(model, [prompt], 4, mtp_speculative_config(model, d, fixed=2))  # warm-up (first-call costs)
        rows.append((name, "plain", best_of(lambda: run_engine(model, [prompt], args.new), args.repeats)))
        rows.append((name, "mtp (adaptive k)", best_of(
            lambda: run_engine(model, [prompt], args.new, mtp_speculative_config(model, d, max_draft=md)),
            args.repeats)))
        rows.append((name, "mtp (k=1)", best_of(
            lambda: run_engine(model, [prompt], args.new, mtp_speculative_config(model, d, max_draft=md, fixed=1)),
            args.repeats)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,moe")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.25, help="device budget, fraction of all experts")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dense", choices=["fp32", "bf16", "int8"], default="bf16",
                    help="dense format of the MoE store (bf16: `moestream serve`'s default, the "
                         "native step with int8 activations for the int4 experts)")
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="emulated host->device link for the MoE store, GB/s; default: this CPU's "
                         "memory bandwidth x 25/1008 (PCIe 4.0 : 4090 VRAM); 0 = none (memcpy)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bw = measure_bandwidth()
    if args.link_gbps is None:
        args.link_gbps = bw * 25 / 1008 / 1e9
    print(f"threads {torch.get_num_threads()}, memory read bandwidth {bw / 1e9:.1f} GB/s, greedy, "
          f"{args.new} new tokens, max_draft {args.max_draft} (adaptive k), best of {args.repeats}")
    rows = []
    if "smollm2" in args.models:
        rows += smollm2_rows(args, bw)
    if "moe" in args.models:
        rows += moe_rows(args, bw)
    if "mtp" in args.models:
        rows += mtp_rows(args, bw)
    print("\n| model | mode | acceptance | tok/verify step | mean k | decode tok/s | speed-up | "
          "expert bytes/tok | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    plain = {}
    for model, mode, r in rows:
        if mode == "plain":
            plain[model] = r
        p = plain[model]
        acc = "-" if r["acc"] is None else f"{r['acc']:.0%}"
        print(f"| {model} | {mode} | {acc} | {r['tps_step']:.2f} | {r['k']} | {r['tps']:.1f} | "
              f"{r['tps'] / p['tps']:.2f}x | {r['bytes_tok'] / 1e3:.0f} kB | "
              f"{'yes' if r['tokens'] == p['tokens'] else 'NO'} |")


if __name__ == "__main__":
    main()
