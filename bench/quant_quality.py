"""Quantization error of each expert format, on real weights and through whole models.

    python bench/quant_quality.py

1. Real weights: SmolLM2-135M's feed-forward matrices (gate/up/down of 6 layers spread over the
   30), quantized in every format and group size; relative error of W (||W - Q(W)|| / ||W||) and
   of W x (same, for y = W x) with x the real activations those matrices see on held-out text.
   These weights come from a Q4_1 GGUF (asymmetric 4-bit, groups of 32, fp16 scale and min),
   so int4 g32 reproduces them exactly; the other rows are honest requantization errors.
2. Whole models: tiny random Mixtral and Qwen3-MoE checkpoints converted to int4 / nf4 / int8
   / bf16 stores, against the same checkpoint unquantized: max |logit error| on a prompt
   (relative to the largest logit) and greedy agreement over 32 tokens.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMATS = [("int4", 32), ("int4", 64), ("int4", 128), ("nf4", 64), ("int8", 64), ("bf16", 64)]


def real_weights() -> None:
    import torch.nn.functional as F

    from engine.assets import smollm2_gguf
    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.loading import load_model
    from engine.quant.reference import dequantize, quantize
    from engine.quant.formats import QuantFormat
    from engine.text import heldout_text

    model, tok, cfg = load_model(smollm2_gguf())
    layers = [0, 6, 12, 18, 24, 29]
    inputs: dict[int, torch.Tensor] = {}

    def hook(i):
        def f(module, args):
            inputs[i] = args[0].detach().clone()
        return f

    handles = [model.model.layers[i].mlp.register_forward_pre_hook(hook(i)) for i in layers]
    ids = torch.tensor(tok.encode(heldout_text()[:4000])[:256])
    model(ids, BatchLayout.single(0, len(ids), 0),
          ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    for h in handles:
        h.remove()
    print(f"SmolLM2-135M feed-forward weights of layers {layers}, activations of {len(ids)} held-out tokens")
    print("| format | group | bits/weight | rel. error of W | rel. error of W x |")
    print("|---|---|---|---|---|")
    for name, g in FORMATS:
        fmt = QuantFormat(name, g)
        if cfg.hidden_size % g:
            print(f"| {name} | {g} | {fmt.bits_per_weight:.2f} | n/a: hidden {cfg.hidden_size} is not a multiple of {g} | |")
            continue
        ew = ewx = nw = nwx = 0.0
        for i in layers:
            mlp = model.model.layers[i].mlp
            x = inputs[i]
            h = F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight)
            for w, a in ((mlp.gate_proj.weight, x), (mlp.up_proj.weight, x), (mlp.down_proj.weight, h)):
                dq = dequantize(quantize(w.float(), fmt))
                ew += float((w - dq).pow(2).sum())
                nw += float(w.pow(2).sum())
                y, yq = a @ w.T, a @ dq.T
                ewx += float((y - yq).pow(2).sum())
                nwx += float(y.pow(2).sum())
        print(f"| {name} | {g} | {fmt.bits_per_weight:.2f} | {(ew / nw) ** 0.5:.4f} | {(ewx / nwx) ** 0.5:.4f} |")


def whole_models() -> None:
    from engine.executor import executor_for
    from engine.experts.runtime import load_from_store
    from engine.generate import generate_ids
    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.layers.sampler import SamplingConfig
    from engine.loading import open_model_files
    from engine.models.load import build_model
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.hf_tiny import make_checkpoint

    print("\ntiny random models (hidden 128, 4 layers, 8 experts top-2, expert width 128), "
          "stores vs the unquantized checkpoint")
    print("| model | format | max logit error / max logit | greedy tokens before the first difference (of 32) |")
    print("|---|---|---|---|")
    prompt = list(range(5, 25))
    sampling = SamplingConfig(max_tokens=32, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("mixtral", "qwen3_moe"):
            kw = dict(hidden_size=128, num_hidden_layers=4, head_dim=32, num_attention_heads=4)
            if arch == "mixtral":
                kw.update(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)
            else:
                kw.update(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
            hf = Path(tmp) / arch
            make_checkpoint(arch, hf, vocab=512, **kw)
            files = open_model_files(hf)
            cfg = files.config
            ref = build_model(cfg, files.source)

            def logits(m):
                kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
                return executor_for(m)(torch.tensor(prompt), BatchLayout.single(0, len(prompt), 0), kv,
                                       all_logits=True)

            want = logits(ref)
            want_tokens = [t for t, _, _ in generate_ids(ref, prompt, sampling)]
            for name, g in (("int4", 32), ("nf4", 32), ("int8", 32), ("bf16", 32)):
                store = Path(tmp) / f"{arch}-{name}"
                convert(hf, store, fmt=QuantFormat(name, g), progress=False)
                sm = load_from_store(store, prefetch_depth=0)
                got = logits(sm.model)
                tokens = [t for t, _, _ in generate_ids(sm.model, prompt, sampling)]
                same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
                err = float((got - want).abs().max() / want.abs().max())
                print(f"| {arch} | {name} g{g} | {err:.4f} | {same} |")
                sm.close()


if __name__ == "__main__":
    with torch.inference_mode():
        real_weights()
        whole_models()
