"""Benchmark the quantized CPU linear kernels against the alternatives and the memory roofline.

    PYTHONPATH=. python bench/quant_kernels.py                 # all formats, default shapes, T 1/16/64
    PYTHONPATH=. python bench/quant_kernels.py --compile       # also torch.compile(dequant + matmul)
    PYTHONPATH=. python bench/quant_kernels.py --formats int4 --tokens 1 4 16

Each row: format, shape [out x in], T tokens, candidate, median µs per call, achieved GB/s =
quantized bytes read / time (the weight's payload, what decode must stream), % of the roofline
(--roofline, default 25 GB/s; the measured single-stream read bandwidth is printed too), the
max error vs reference.linear_ref as max|y - ref| / max|ref|, and GFLOP/s (large T is
compute-bound: ~90-100 GFLOP/s fp32 per core here).

Weights are cold: every call uses the next of a pool of distinct copies larger than the L3
cache (--pool-mb), as in decode, where each expert's bytes come from RAM. Candidates:

- cpp: engine.quant.kernels C++ AVX-512 kernels (the production path)
- torch_int4pack: aten._weight_int4pack_mm_for_cpu on a load-time repack (int4 only), fp32
  activations and scales (exact, but torch has only a slow generic path for fp32)
- torch_int4_bf16: the same kernel in its fast mode: bf16 activations, bf16 scales/zeros
- dequant_f32 / dequant_bf16: reference dequantize, then F.linear in fp32 / bf16
- compile: torch.compile (inductor) of unpack + dequantize + matmul (int4 only, --compile)
- expert rows: the fused C++ SwiGLU expert vs three cpp qlinear calls vs the torch path.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.quant import kernels as K  # noqa: E402
from engine.quant.formats import QuantFormat, QuantizedTensor  # noqa: E402
from engine.quant.reference import expert_ref, linear_ref, quantize  # noqa: E402

SHAPES = [(512, 1024), (1024, 512), (1536, 576), (576, 1536)]


def timeit(fn, target_s: float = 0.02, repeats: int = 5) -> float:
    """Median µs per call over ``repeats`` runs of about ``target_s`` each."""
    fn()
    t = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t, 1e-6)
    reps = max(3, min(2000, int(target_s / one)))
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - t) / reps * 1e6)
    return statistics.median(runs)


def read_bandwidth() -> float:
    big = torch.ones(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB
    us = timeit(lambda: big.sum(), target_s=0.1, repeats=3)
    return big.numel() * 4 / us / 1e3


def make_pool(q: QuantizedTensor, pool_bytes: int) -> list[QuantizedTensor]:
    blob, layout = q.to_bytes(), q.layout()
    n = max(2, pool_bytes // len(blob))
    return [QuantizedTensor.from_buffer(bytearray(blob), layout) for _ in range(n)]


def compiled_int4(q: QuantizedTensor):
    def f(x, codes, s, m):
        n = codes.shape[0]
        b = codes.view(n, -1, 16)
        c = torch.stack([b & 15, b >> 4], 2).view(n, s.shape[1], -1).float()
        w = (c * s.float()[..., None] + m.float()[..., None]).view(n, -1)
        return x @ w.T
    torch._dynamo.reset()  # one compiled graph per (shape, T); don't run into the recompile limit
    torch._dynamo.config.recompile_limit = 64
    cf = torch.compile(f, dynamic=False)
    return lambda x, q: cf(x, q.parts["codes"], q.parts["scales"], q.parts["mins"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["int4", "nf4", "int8", "bf16"])
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="OUTxIN")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--pool-mb", type=int, default=128)
    ap.add_argument("--roofline", type=float, default=25.0, help="GB/s")
    ap.add_argument("--compile", action="store_true", help="add the torch.compile candidate (int4)")
    ap.add_argument("--no-expert", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    t = time.time()
    ext = K.load_extension()
    build_s = time.time() - t
    bw = read_bandwidth()
    print(f"# torch {torch.__version__}  threads {torch.get_num_threads()}  cpu {torch.backends.cpu.get_cpu_capability()}"
          f"  {platform.processor() or platform.machine()}  cores {os.cpu_count()}  load avg {os.getloadavg()[0]:.2f}")
    print(f"# C++ kernels: {'built/loaded in %.1f s' % build_s if ext else 'UNAVAILABLE: ' + str(K.extension_error())}")
    print(f"# roofline {args.roofline:.1f} GB/s (measured single-stream read now: {bw:.1f} GB/s); "
          f"weights cold (pool {args.pool_mb} MiB > L3); group size {args.group}")
    print(f"{'format':6} {'shape':>10} {'T':>3} {'candidate':15} {'us':>9} {'GB/s':>6} {'%roof':>6} {'max_err':>9}"
          f" {'GFLOP/s':>8}")

    def row(fmt, shape, T, cand, us, nbytes, err, flops):
        gbs = nbytes / us / 1e3
        print(f"{fmt:6} {shape:>10} {T:>3} {cand:15} {us:9.1f} {gbs:6.1f} {100 * gbs / args.roofline:5.0f}% {err:9.2e}"
              f" {flops / us / 1e3:8.1f}", flush=True)

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    for name in args.formats:
        fmt = QuantFormat(name, args.group)
        for n, k in shapes:
            q0 = quantize(torch.randn(n, k) * 0.02, fmt)
            pool = make_pool(q0, args.pool_mb << 20)
            cands = dict(K.CANDIDATES) if ext else {c: f for c, f in K.CANDIDATES.items() if c != "cpp"}
            if name != "int4":
                cands.pop("torch_int4pack", None)
                cands.pop("torch_int4_bf16", None)
            else:
                for q in pool:
                    K._int4pack_bf16(q)  # load-time repack, cached per tensor
                if args.compile:
                    t = time.time()
                    cands["compile"] = compiled_int4(q0)
                    cands["compile"](torch.randn(1, k), q0)
                    print(f"# torch.compile first call {time.time() - t:.1f} s", flush=True)
            for T in args.tokens:
                x = torch.randn(T, k)
                ref = linear_ref(x, q0)
                for cname, fn in cands.items():
                    try:
                        err = float((fn(x, q0) - ref).abs().max() / ref.abs().max())
                    except Exception as e:  # a candidate that does not support this case
                        print(f"{name:6} {n}x{k:>5} {T:>3} {cname:15} failed: {str(e).splitlines()[0][:80]}")
                        continue
                    i = [0]

                    def call():
                        i[0] += 1
                        fn(x, pool[i[0] % len(pool)])
                    if cname == "compile":
                        call = lambda: fn(x, q0)  # noqa: E731 - one compiled shape, hot
                    row(name, f"{n}x{k}", T, cname, timeit(call), q0.nbytes, err, 2 * T * n * k)

        if args.no_expert or not ext:
            continue
        # SwiGLU experts: (I, H) = gate/up [I, H], down [H, I]
        for i_dim, h in [(512, 1024), (1536, 576)]:
            g0, u0, d0 = (quantize(torch.randn(*s) * 0.02, fmt) for s in ((i_dim, h), (i_dim, h), (h, i_dim)))
            nb = g0.nbytes + u0.nbytes + d0.nbytes
            pools = [make_pool(q, (args.pool_mb << 20) // 3) for q in (g0, u0, d0)]
            m = min(len(p) for p in pools)
            for T in args.tokens:
                x = torch.randn(T, h)
                ref = expert_ref(x, g0, u0, d0)
                variants = {
                    "expert_fused": lambda x, g, u, d: K.expert_forward(x, g, u, d),
                    "expert_3calls": lambda x, g, u, d: K.qlinear_cpp(
                        F.silu(K.qlinear_cpp(x, g)) * K.qlinear_cpp(x, u), d),
                    "expert_torch": lambda x, g, u, d: K.qlinear_torch(
                        F.silu(K.qlinear_torch(x, g)) * K.qlinear_torch(x, u), d),
                }
                for vname, fn in variants.items():
                    if vname == "expert_torch" and name == "int4":
                        for p in pools:
                            for q in p[:m]:
                                K._int4pack(q)
                    err = float((fn(x, g0, u0, d0) - ref).abs().max() / ref.abs().max())
                    j = [0]

                    def call():
                        j[0] = (j[0] + 1) % m
                        fn(x, pools[0][j[0]], pools[1][j[0]], pools[2][j[0]])
                    row(name, f"E{i_dim}x{h}", T, vname, timeit(call), nb, err, 6 * T * i_dim * h)
                for p in pools:
                    for q in p:
                        q.cache.pop("int4pack", None)


if __name__ == "__main__":
    main()
