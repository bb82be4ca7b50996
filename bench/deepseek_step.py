"""DeepSeek-V3 decode on the CPU: the torch layers against the native step (engine.models.deepseek_v3.step:
MLA, the group-limited router and the expert FFN as three native calls per layer), the native step
twice: kv_b read as float32 copies (the reference path, the code before kv_b was read in its dense
format) and in the dense format (int8 / bf16, engine/csrc/mla_kvb.cpp). Same weights, same process,
alternating rounds, median; greedy tokens checked equal on the exact path (float activations: int8
activations round differently in the paths' summation orders). Weight bytes read per decoded token
of each native row (every dense linear, kv_b as that row reads it, the LM head, the routers, top-k
routed experts per sparse layer), and kv_b's bytes per layer at DeepSeek-V3's published shape
(computed: engine.models.deepseek_v3.step.kv_b_bytes).

    python bench/deepseek_step.py                         # the default shape below
    python bench/deepseek_step.py --layers 2 --prompt 32 --new 16 --rounds 1   # a quick run
    python bench/deepseek_step.py --real-mla-layer    # one MLA layer at DeepSeek-V3's shape (below)

Weights: a random DeepSeek-V3 built by transformers with ``torch.manual_seed(0)`` (SHAPE: hidden
1024, 12 layers, the first dense, 16 heads, q LoRA 384, latent 256 + 32 RoPE dims, 32 experts
top-4 in 4 groups (2 kept) of width 512, one shared expert, vocab 32000), converted to an expert
store (int4 g64 experts), dense linears int8 (``--dense``), every expert resident. Both rows
run the same loaded model; only the ``fused_step`` option differs (off: the torch layers).
Prompt: ``--prompt`` random ids (seed 1234), then ``--new`` greedy tokens, batch 1.

``--real-mla-layer``: one decode ``mla_block`` call of one layer at DeepSeek-V3's published
attention shape (hidden 7168, 128 heads, q LoRA 1536, latent 512 + 64 RoPE dims, nope / v 128;
random weights, seed 0, every linear int8 g64, ~190 MB), over ``--ctx`` random cached latents
(bf16 paged cache): kv_b as float32 copies against kv_b int8, alternating calls, median of
``--calls``; weight bytes per call and the rate they are read at.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llama_cpp import make_prompt, moestream_greedy, op_counts  # noqa: E402

PATHS = (("torch layers", False, False), ("native step, float32 kv_b", True, True),
         ("native step", True, False))  # (row, fused_step, float_kv_b)
MIB = 2**20


def weight_bytes_per_token(model, float_kv_b: bool, expert_fmt) -> int:
    """Weight bytes one decoded token reads on the native step: every dense linear (kv_b as float32
    copies or in its format), the LM head, the routers and top-k routed experts per sparse layer."""
    from engine.quant.formats import payload_bytes
    from engine.quant.linear import dense_linears
    from engine.models.deepseek_v3.step import kv_b_bytes

    total = 0
    for parent, name in dense_linears(model):
        m = getattr(parent, name)
        if name == "kv_b_proj" and float_kv_b:
            total += kv_b_bytes(parent.nh, parent.nope, parent.vd, parent.rank)
        else:
            total += m.q.nbytes if hasattr(m, "q") else m.weight.numel() * m.weight.element_size()
    for mlp in model.moe_blocks:
        g = mlp.gate
        total += g.weight.numel() * 4
        i, h = model.config.moe.expert_intermediate_size, model.config.hidden_size
        total += g.top_k * (2 * payload_bytes((i, h), expert_fmt) + payload_bytes((h, i), expert_fmt))
    return total

SHAPE = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=16, intermediate_size=2816, moe_intermediate_size=512, n_routed_experts=32,
             num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
             q_lora_rank=384, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
             routed_scaling_factor=2.5, max_position_embeddings=4096, tie_word_embeddings=False)


def real_mla_layer(ctx: int, calls: int) -> None:
    """One decode mla_block at DeepSeek-V3's attention shape: float32 kv_b copies vs int8 kv_b."""
    import time
    from types import SimpleNamespace

    from engine.kv.base import BatchLayout
    from engine.kv.paged import PagedKVCache
    from engine.models.deepseek_v3.mla import MLAttention
    from engine.layers.norm import RMSNorm
    from engine.quant.formats import QuantFormat
    from engine.quant.kernels import DIRECT_MAX_T, int8_activations, load_extension
    from engine.quant.linear import QuantLinear
    from engine.models.deepseek_v3.step import kv_b_bytes, mla_handle

    H, nh, q_lora, R, r, dn, dv = 7168, 128, 1536, 512, 64, 128, 128
    torch.manual_seed(0)
    a = MLAttention(H, nh, q_lora, R, dn, r, dv, False, (dn + r) ** -0.5, True, 0)
    weight = 0
    for name in a.linear_names():  # one at a time: the float32 copies are ~750 MB together
        lin = getattr(a, name)
        torch.nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
        q = QuantLinear.from_linear(lin, QuantFormat("int8", 64))
        setattr(a, name, q)
        weight += q.q.nbytes
        del lin
    layer = SimpleNamespace(self_attn=a, input_layernorm=RMSNorm(H, 1e-6), post_attention_layernorm=RMSNorm(H, 1e-6))
    ext = load_extension()
    handles = {"float32 kv_b": mla_handle(ext, layer, 1e-6, float_kv_b=True), "int8 kv_b": mla_handle(ext, layer, 1e-6)}
    kvb = {"float32 kv_b": kv_b_bytes(nh, dn, dv, R), "int8 kv_b": kv_b_bytes(nh, dn, dv, R, "int8")}
    int8_kvb = a.kv_b_proj.q.nbytes
    kv = PagedKVCache(1, 1, a.half, num_blocks=ctx // 16 + 2, block_size=16, dtype=torch.bfloat16)
    storage, tables = kv.native_view(BatchLayout((0,), (1,), (ctx,)), torch.device("cpu"))
    storage.normal_()
    inv = 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float32) / r)
    ang = torch.arange(ctx + 1, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], 1).contiguous(), torch.cat([ang.sin(), ang.sin()], 1).contiguous()
    x0 = torch.randn(1, H)
    times: dict[str, list[float]] = {k: [] for k in handles}
    outs = {}
    for i in range(calls + 2):  # two warm-up calls each
        for name, h in handles.items():
            x = x0.clone()
            t = time.perf_counter()
            ext.mla_block(h, x, cos, sin, [ctx], storage, 0, tables, [1], [ctx], DIRECT_MAX_T, int8_activations())
            if i >= 2:
                times[name].append(time.perf_counter() - t)
            outs[name] = x - x0
    diff = ((outs["int8 kv_b"] - outs["float32 kv_b"]).norm() / outs["float32 kv_b"].norm()).item()
    print(f"one MLA layer at DeepSeek-V3's shape (hidden {H}, {nh} heads, q LoRA {q_lora}, latent {R} + {r}, "
          f"nope/v {dn}/{dv}), int8 g64 linears, decode over {ctx} cached latents, {ext.num_threads()} threads, "
          f"median of {calls}")
    print("| kv_b | ms per call (median, best) | weight MiB per call (kv_b) | GB/s of weights (median) |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        b = weight - int8_kvb + kvb[name]
        print(f"| {name} | {med * 1e3:.2f}, {min(ts) * 1e3:.2f} | {b / MIB:.1f} ({kvb[name] / MIB:.1f}) | "
              f"{b / med / 1e9:.1f} |")
    print(f"attention output: int8 kv_b vs float32 copies of the same int8 weights, relative RMS {diff:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dense", default="int8", help="dense linears' format (int8 or bf16: the native step)")
    ap.add_argument("--real-mla-layer", action="store_true", help="time one MLA layer at DeepSeek-V3's shape")
    ap.add_argument("--ctx", type=int, default=512, help="cached latents (--real-mla-layer)")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per kv_b form (--real-mla-layer)")
    args = ap.parse_args()
    if args.real_mla_layer:
        real_mla_layer(args.ctx, args.calls)
        return

    import transformers as T

    from engine.executor import executor_for
    from engine.experts.runtime import load_from_store
    from engine.options import configure
    from engine.quant.formats import QuantFormat
    from engine.quant.kernels import int8_activations
    from engine.models.deepseek_v3.step import DeepseekNativeStep, kv_b_bytes
    from engine.store import convert

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        hf = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(**{**SHAPE, "num_hidden_layers": args.layers})).eval()
        hf.save_pretrained(Path(tmp) / "hf")
        del hf
        convert(Path(tmp) / "hf", Path(tmp) / "store", fmt=QuantFormat("int4", 64), progress=False)
        prompt = make_prompt(args.prompt, SHAPE["vocab_size"])
        prev = configure()
        i8a = int8_activations()
        rows: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in PATHS}
        tokens, ops, nbytes = {}, {}, {}

        def use(on: bool, float_kv_b: bool, **opts) -> None:
            DeepseekNativeStep.float_kv_b = float_kv_b
            configure(fused_step=on, **opts)  # an option change rebuilds the step (with float_kv_b)

        try:
            with load_from_store(Path(tmp) / "store", prefetch_depth=0, dense=args.dense) as sm:
                for name, on, fk in PATHS:  # warm-up, exact path
                    use(on, fk, int8_activations=False)
                    tokens[name] = moestream_greedy(sm.model, prompt, args.new)[0]
                    nbytes[name] = weight_bytes_per_token(sm.model, fk, QuantFormat("int4", 64)) if on else None
                configure(prev)
                for _ in range(args.rounds):
                    for name, on, fk in PATHS:
                        use(on, fk)
                        executor_for(sm.model).native()  # built on an option change: not inside the timing
                        _, pre, dec = moestream_greedy(sm.model, prompt, args.new)
                        rows[name].append((pre, dec))
                for name, on, fk in PATHS:
                    use(on, fk)
                    ops[name] = op_counts(sm.model, prompt[:16], 4)
                cfg = sm.model.config
                kvb_fmt = sm.model.model.layers[0].self_attn.kv_b_proj.q.fmt.name  # int8, or bf16 (fall-back)
        finally:
            DeepseekNativeStep.float_kv_b = False
            configure(prev)
    print(f"DeepSeek-V3 random, {args.layers} layers, int4 g64 experts, {args.dense} dense, prompt {args.prompt}, "
          f"{args.new} greedy tokens, batch 1, {torch.get_num_threads()} torch threads, median of {args.rounds}")
    print("| path | prefill tok/s | decode tok/s | weight MiB read per decoded token | "
          "dispatcher ops + native calls per decoded token |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        c, b = ops[name], nbytes[name]
        print(f"| {name} | {statistics.median(p for p, _ in r):.1f} | {statistics.median(d for _, d in r):.1f} | "
              f"{'-' if b is None else f'{b / MIB:.2f}'} | "
              f"{c['ops']:.0f} + {c['native']:.0f} ({(c['ops'] + c['native']) / args.layers:.1f} per layer) |")
    same = all(t == tokens["torch layers"] for t in tokens.values())
    print(f"greedy tokens identical with float activations: {'yes' if same else 'NO'} ({args.new} tokens, "
          f"all three rows); timed with int8 activations {'on' if i8a else 'off'} (every row)")
    a = cfg.arch_params
    here = (cfg.num_heads, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank)
    v3 = (128, 128, 128, 512)
    print(f"kv_b per layer, this shape: {kv_b_bytes(*here) / MIB:.2f} MiB float32 -> "
          f"{kv_b_bytes(*here, kvb_fmt) / MIB:.2f} MiB {kvb_fmt}; DeepSeek-V3 (128 heads x (128 + 128) x 512, "
          f"61 layers): {kv_b_bytes(*v3) / MIB:.1f} -> {kv_b_bytes(*v3, kvb_fmt) / MIB:.1f} MiB per layer, "
          f"{61 * kv_b_bytes(*v3) / 2**30:.2f} -> {61 * kv_b_bytes(*v3, kvb_fmt) / 2**30:.2f} GiB per decoded token")

if __name__ == "__main__":
    main()
