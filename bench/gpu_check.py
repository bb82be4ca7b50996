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
2. The CUDA tests (tests/gpu, and the kernel tests compiled instead of interpreted).
3. Kernel launches per decoded token (torch profiler, CUDA activity) of a random Qwen3-MoE store
   (8 layers, hidden 1024, 64 experts top-8) with every expert resident on the device: the count
   the step contract's per-layer grouped launch and CUDA graphs are meant to cut (on CPU with
   --smoke: dispatcher ops instead).
4. With ``--e2e``: ``bench/expert_cache.py --device cuda`` on an 8-layer random Qwen3-MoE store
   (tok/s, hit rates and bytes per token at 25% and 100% device budgets; builds the store first).

Nothing is installed or downloaded; the output is a short table.

On this workplace's lent H200 machine (python3 3.12 with torch, triton and transformers, but no
pydantic, which the store manifest needs), carry pydantic's wheels: here, once, ``echo /.whl/ >>
.git/info/exclude`` and ``python3 -m pip download --no-deps --only-binary=:all: --python-version
3.12 --implementation cp --platform manylinux_2_17_x86_64 -d .whl pydantic==2.13.4
pydantic-core==2.46.4 annotated-types typing-inspection`` (pydantic pins its core); then one
``run`` with ``carry=[".whl"]``: ``python3 -m pip install -q --no-index --no-deps --target
/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. && PYTHONUNBUFFERED=1 python3
bench/gpu_check.py --e2e``. (The download command was checked here.)
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


def launches_per_token(device: torch.device, smoke: bool) -> None:
    """Build a small random Qwen3-MoE store, decode a few tokens with every expert resident, and
    print kernel launches (CUDA) or dispatcher ops (CPU) per decoded token and per layer."""
    import tempfile

    import transformers as T
    from torch.profiler import ProfilerActivity, profile

    from engine.experts.runtime import load_from_store
    from engine.generate import generate_ids
    from engine.layers.sampler import SamplingConfig
    from engine.quant.formats import QuantFormat
    from engine.store import convert

    layers, hidden, inter, experts = (2, 128, 64, 8) if smoke else (8, 1024, 512, 64)
    cfg = T.Qwen3MoeConfig(vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=hidden // 8, num_experts=experts,
                           num_experts_per_tok=min(8, experts // 2), moe_intermediate_size=inter,
                           intermediate_size=2 * inter, norm_topk_prob=True)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        T.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp + "/hf")
        convert(Path(tmp) / "hf", Path(tmp) / "store", fmt=QuantFormat("int4", 64), progress=False)
        sm = load_from_store(Path(tmp) / "store", device=device.type, dense="bf16", prefetch_depth=0)
        try:
            prompt, steps = list(range(3, 19)), 4 if smoke else 8
            gen = generate_ids(sm.model, prompt, SamplingConfig(max_tokens=steps + 3, ignore_eos=True))
            next(gen), next(gen)  # prefill and one step: experts resident, kernels compiled
            act = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=act) as prof:
                for _ in range(steps):
                    next(gen)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            events = prof.events()
            gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            kind = "kernel launches" if device.type == "cuda" else "dispatcher ops"
            n = len(gpu) if device.type == "cuda" else len(events)
            print(f"{kind} per decoded token: {n / steps:.0f} ({n / steps / layers:.1f} per layer), "
                  f"{layers} layers, top-{cfg.num_experts_per_tok} of {experts} experts, bf16 dense, "
                  f"every expert resident")
        finally:
            sm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU in Triton's interpreter")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-tests", action="store_true", help="skip the pytest part")
    ap.add_argument("--e2e", action="store_true", help="also run bench/expert_cache.py on the device")
    args = ap.parse_args()
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
    if not args.no_tests:
        files = ["tests/gpu", "tests/engine/quant/test_triton_kernels.py",
                 "tests/engine/experts/test_cache.py"]
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                           cwd=ROOT, capture_output=True, text=True)
        tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-500:]
        print(f"pytest {' '.join(files)}: {tail}")
        if r.returncode:
            print(r.stdout[-3000:])
        ok &= r.returncode == 0
    launches_per_token(device, args.smoke)
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
