"""Bigger than memory, side by side with llama.cpp: each system alone in a memory-limited cgroup.

    python bench/beyond_ram.py                       # ~8 GB Qwen3-MoE shape, limits 25/50/75%
    python bench/beyond_ram.py --size 1 --limits 50  # 1 GB of experts, one limit
    python bench/beyond_ram.py --shape issue --limits-mb 1200,1000,900,700   # issue 27's first look

The model (bench/beyond_ram_model.py): random 4-bit blocks written straight to a qwen3moe GGUF
(Q4_K everywhere 2-D), and moestream's expert store converted from it (int4 g64 experts, bf16
dense read as int8 at load): the same weights in both systems, 4.5 bits per expert weight. ``--shape qwen3`` (default):
Qwen3-30B-A3B's layer (hidden 2048, 128 experts top-8 of width 768, 32/4 heads of 128, vocab
32000), as many layers as ``--size`` GB of experts; ``--shape issue``: the 1.3B-A0.2B model.

Each run is a fresh child process in a fresh child memory cgroup (bench/cgroup_limit.py) whose
limit is a share of the store's bytes (``--limits``, percent) or ``--limits-mb``; the model's
pages are evicted (posix_fadvise DONTNEED) before each run. A run: ``--prompt`` random ids, then
``--new`` - 1 decode steps that feed one fixed random continuation in both systems (teacher
forcing: the same tokens, so the same routing up to quantization; ``--greedy``: each system's
own greedy tokens, which differ), ``--threads`` threads. Rounds alternate moestream, llama.cpp for every
limit; the table holds medians. llama.cpp runs twice per round: as it loads by default (its
weights repacked for the CPU's kernels into anonymous memory) and ``mmap`` (use_extra_bufts off:
weights used in place from the page cache, which the kernel can drop: its bigger-than-memory
mode); the summary line takes the faster that ran. Per run: prefill and decode tok/s, bytes read from storage per
decoded token (/proc/PID/io read_bytes, counted by the child around its decode), the cgroup's
peak (page cache included), major faults, OOM kills (the group's oom_kill count; a child killed
by a signal). moestream's budgets are its own: ``auto`` from the cgroup limit it finds itself in
(engine.experts.device_budget); a limit too small for its dense part is its refusal, stated.

The disk is measured first on the store's files with O_DIRECT: sequential 1 MiB reads, and 4 KiB
random reads at queue depth 1 and 16; then again (sequential, 1 s) before and after every run,
because the virtual disks we met drift between 0.5 and 2 GB/s within an hour: a run's disk use
(decode tok/s x bytes read per decoded token / bandwidth) and roofline take the mean of its own
two probes. The roofline: decode tok/s <= disk bandwidth / missed bytes per token, the missed
bytes predicted by engine.experts.simulate replaying the run's own routing through a cache of the
run's device slots (policy sweep).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from beyond_ram_model import EMBED_SCALE, ISSUE_SHAPE, TINY_SHAPE, qwen3_30b_like, write_gguf, write_store  # noqa: E402
from cgroup_limit import LimitedGroup, NoCgroup, evict  # noqa: E402
from llama_child import LlamaCppChild, LlamaCppDied, io_counters  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
BEYOND_TIERS_MB = 300  # what moestream may hold beyond its expert tiers, dense weights and KV


# ---- the disk ---------------------------------------------------------------------------------

def sequential_bandwidth(paths: list[Path], seconds: float = 1.0, start: int = 0) -> float:
    """Bytes/s of O_DIRECT sequential 1 MiB reads of ``paths``, from file ``start`` on (modulo
    their count) for ``seconds``. The virtual disks we met change speed minute to minute (0.5-2 GB/s
    within an hour), so each run's disk use is taken against probes made around that run."""
    import mmap

    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
    try:
        buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT needs
        t0, n, i = time.perf_counter(), 0, 0
        while time.perf_counter() - t0 < seconds and i < len(fds):
            fd = fds[(start + i) % len(fds)]
            size = os.fstat(fd).st_size // 4096 * 4096
            for off in range(0, size - (1 << 20) + 1, 1 << 20):
                n += os.preadv(fd, [buf], off)
                if time.perf_counter() - t0 >= seconds:
                    break
            i += 1
        return n / (time.perf_counter() - t0)
    finally:
        for fd in fds:
            os.close(fd)


def measure_disk(paths: list[Path], seconds: float = 2.0) -> dict[str, float]:
    """O_DIRECT reads of ``paths`` (evicted first): sequential 1 MiB (bytes/s), 4 KiB random at
    queue depth 1 and 16 (IOPS; QD16: 16 threads of pread)."""
    import mmap

    evict(paths)
    seq = sequential_bandwidth(paths, seconds)
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
    sizes = [os.path.getsize(p) // 4096 * 4096 for p in paths]
    try:

        def rand(count: list[int], stop: float, seed: int) -> None:
            r, b = random.Random(seed), mmap.mmap(-1, 4096)
            while time.perf_counter() < stop:
                k = r.randrange(len(fds))
                os.preadv(fds[k], [b], r.randrange(sizes[k] // 4096) * 4096)
                count[0] += 1

        out = {"seq_bytes_s": seq}
        for qd in (1, 16):
            counts = [[0] for _ in range(qd)]
            stop = time.perf_counter() + seconds
            ts = [threading.Thread(target=rand, args=(c, stop, j)) for j, c in enumerate(counts)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            out[f"rand4k_qd{qd}_iops"] = sum(c[0] for c in counts) / seconds
        return out
    finally:
        for fd in fds:
            os.close(fd)


def peak_rss() -> int:
    """This process's peak RSS so far, bytes (VmHWM); -1 when unreadable."""
    from engine.experts.host_memory import proc_status_bytes

    return proc_status_bytes("VmHWM") or -1


# ---- the moestream child ------------------------------------------------------------------------

def make_prompt(vocab: int, n: int) -> list[int]:
    return [random.Random(1234 + k).randrange(vocab) for k in range(n)]


def continuation(vocab: int, new: int) -> list[int]:
    """The tokens both systems' decode steps feed (teacher forcing): new - 1 fixed random ids.
    Greedy decoding of a random model is no common workload: llama.cpp's greedy tokens on the 8 GB
    model were one id 16 times (the same experts every step: no misses after the first), moestream's
    16 different ids (each step routes to experts it has not seen: compulsory misses)."""
    return [random.Random(4321 + k).randrange(vocab) for k in range(max(new - 1, 0))]


def moestream_child(store: str, prompt_len: int, new: int, threads: int, io_threads: int,
                    prefetch_depth: int = 0, warm: bool = True, greedy: bool = False) -> dict:
    """One run in this (limited) process: budgets auto from its cgroup, load (``warm``: the free
    slots filled at load, as `moestream generate` does by default), greedy; the io counters around
    the decode, and the simulator's prediction for its device slots (a warm run's simulation
    replays the load's fill first, as records of top_k experts in the fill's order)."""
    import resource

    import torch

    from engine.errors import HostMemoryError
    from engine.experts.runtime import dense_resident_bytes, load_from_store, store_budgets
    from engine.executor import executor_for, kv_dtype
    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.layers.sampler import SamplingConfig
    from engine.runner import stream_request
    from engine.store.reader import ExpertStore

    torch.set_num_threads(threads)
    io0 = io_counters()
    st = ExpertStore(store)
    cfg = st.config
    # at float32's 4 bytes an element: the bound of either dtype the run's cache may take (kv_dtype)
    kv_budget = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (prompt_len + new + 16) * 4
    try:
        # the margin for what the run adds: its one prompt step, no tokenizer (fed token ids)
        b = store_budgets(st, device="cpu", dense="int8", kv_bytes=kv_budget, step_tokens=prompt_len,
                          tokenizer=False)
    except HostMemoryError as e:
        st.close()
        return {"refused": str(e)}
    sm = load_from_store(st, device_budget=b.device, ram_budget=b.ram, dense="int8",
                         prefetch_depth=prefetch_depth, io_threads=io_threads, warm=warm,
                         tokenizer=False)  # fed token ids, as the llama.cpp child is
    warmed = len(sm.cache.slot_of)
    slot = sm.cache.slot_bytes
    ordinal = {l: i for i, l in enumerate(cfg.moe_layers)}
    pos = {"t": 0}
    routed: list[tuple[int, int, list[int]]] = []  # (token, layer ordinal, experts)

    def observe(layer, ids):
        for j, row in enumerate(ids.tolist()):
            routed.append((pos["t"] + j, ordinal[layer], row))

    for blk in sm.model.moe_blocks:
        blk.observers.append(observe)
    prompt = make_prompt(cfg.vocab_size, prompt_len)
    load_io = io_counters()
    hwm = [peak_rss()]  # the process's peak after load, prefill, decode
    if greedy:
        stats, io_pf = None, None
        with torch.inference_mode():
            for i, (o, stats) in enumerate(stream_request(sm.model, prompt, SamplingConfig(
                    max_tokens=new, temperature=0.0, ignore_eos=True))):
                pos["t"] = prompt_len + i  # the next step decodes token prompt_len + i
                if i == 0:
                    io_pf, m_pf = io_counters(), sm.cache.metrics.total()
        prefill_tps, decode_tps = stats.prefill_tps, stats.decode_tps
    else:  # the prompt, then the fixed continuation one token per step (as the llama.cpp child)
        ex = executor_for(sm.model)
        # sized to the KV budget the tiers were planned beside (not the cache's 256-token default)
        kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype(sm.model),
                               initial_capacity=prompt_len + new + 16)  # the dtype a user's run gets
        with torch.inference_mode():
            t = time.perf_counter()
            ex(torch.tensor(prompt), BatchLayout.single(0, prompt_len, 0), kv)
            prefill_tps = prompt_len / (time.perf_counter() - t)
            io_pf, m_pf = io_counters(), sm.cache.metrics.total()
            hwm.append(peak_rss())
            t = time.perf_counter()
            for i, tok in enumerate(continuation(cfg.vocab_size, new)):
                pos["t"] = prompt_len + i
                ex(torch.tensor([tok]), BatchLayout.single(0, 1, prompt_len + i), kv)
            decode_tps = (new - 1) / (time.perf_counter() - t) if new > 1 else 0.0
    io_end, m_end = io_counters(), sm.cache.metrics.total()
    hwm.append(peak_rss())
    # the run's own peak, before the simulator below (the bench's analysis, not moestream) allocates
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from engine.experts.simulate import simulate
    from engine.experts.trace import TraceRecorder

    # the accesses in the order the live cache saw them: the load's fill, the prefill as it ran
    # (one step, layer by layer, each layer's distinct experts acquired once, ascending), then
    # the decode token by token (replaying the prefill token by token instead counted an expert
    # once per prompt token that routed to it, which the cache never did: its frequencies, hence
    # its choices after the prefill, differed, and at 64 prompt tokens the decode read 1.33x
    # the prediction)
    rec = TraceRecorder(len(cfg.moe_layers), cfg.moe.num_experts, cfg.moe.top_k)
    k, nl = cfg.moe.top_k, len(cfg.moe_layers)
    fill = -(-warmed // (k * nl)) if warm else 0  # ExpertCache.warm's order: expert e of every layer, e = 0, 1, ...
    for c in range(fill):
        for layer in range(nl):
            rec.record(c, layer, [(c * k + j) % cfg.moe.num_experts for j in range(k)])
    prompt_rows = [(layer, row) for t, layer, row in routed if t < prompt_len]
    for layer, row in prefill_records(prompt_rows, nl, k):
        rec.record(fill, layer, row)
    n_pre = len(rec)
    for t, layer, row in sorted((r for r in routed if r[0] >= prompt_len), key=lambda r: (r[0], r[1])):
        rec.record(fill + t, layer, row)
    trace = rec.trace()
    cap = sm.cache.num_slots
    full = simulate(trace, "sweep", cap, expert_bytes=slot)
    pre = simulate(trace[:n_pre], "sweep", cap, expert_bytes=slot)
    counters = sm.cache.source.counters()
    out = {
        "prefill": prefill_tps, "decode": decode_tps, "budgets": b.line,
        "device": b.device, "ram": b.ram, "slot": slot, "slots": cap,
        # what the tiers hold: a RAM tier read around (HostTier.read_around: smaller than the
        # slots on a CPU) keeps one slot whatever its budget (at 1,200 MB on the 1.3B model the
        # budget is 140 MiB of never-touched pages, which were once subtracted from the RSS)
        "tiers": b.device + (sm.cache.source.slot_bytes if getattr(sm.cache.source, "read_around", False) else b.ram),
        "io": [io0, load_io, io_pf, io_end],
        "sim_decode_bytes": full.bytes_missed - pre.bytes_missed, "warmed": warmed,
        "nvme_bytes": counters["nvme"].bytes_in if "nvme" in counters else 0,
        "maxrss": maxrss, "peaks": hwm, "resident": dense_resident_bytes(st, dense="int8") + kv_budget,
        # where the decode's time went: waiting for expert reads (after the hits computed while
        # they ran) and the rest, over the decode steps after the prefill
        "wait": {f: getattr(m_end, f) - getattr(m_pf, f)
                 for f in ("stall_s", "misses", "hits", "overlapped", "late_prefetch")},
        "routing": routing_stats(routed, nl),
    }
    sm.close()
    return out


# ---- one run of each system ------------------------------------------------------------------------

def run_moestream(store: Path, limit: int, args) -> dict:
    with LimitedGroup(limit) as g:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(store), "--prompt", str(args.prompt),
               "--new", str(args.new), "--threads", str(args.threads), "--io-threads", str(args.io_threads),
               "--prefetch", str(args.prefetch)] + ([] if args.warm else ["--no-warm"]) + \
              (["--greedy"] if args.greedy else [])
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, preexec_fn=g.enter,
                               timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"dead": f"stalled, no answer in {args.timeout} s", "peak": g.peak(), "oom": g.oom_kills()}
        res = {"peak": g.peak(), "oom": g.oom_kills(), "wall": time.perf_counter() - t0}
        if r.returncode != 0:
            how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}"
            res["dead"] = how + ("" if r.returncode < 0 else f": {r.stderr.strip()[-400:]}")
            return res
        res.update(json.loads(r.stdout.strip().splitlines()[-1]))
        return res


def run_llama(gguf: Path, limit: int, args, repack: bool) -> dict:
    with LimitedGroup(limit) as g:
        prompt = make_prompt(args.vocab, args.prompt)
        t0 = time.perf_counter()
        lc = None
        try:
            lc = LlamaCppChild(gguf, args.threads, args.prompt + args.new + 16, min(args.prompt, 512),
                               preexec_fn=g.enter, timeout=args.timeout, repack=repack, lib=args.llama_lib)
            a = lc.greedy_io(prompt, args.new, None if args.greedy else continuation(args.vocab, args.new))
            res = {"prefill": a["prefill"], "decode": a["decode"], "io": a["io"]}
        except LlamaCppDied as e:
            res = {"dead": str(e)}
        finally:
            if lc is not None:
                lc.close()
        res.update(peak=g.peak(), oom=g.oom_kills(), wall=time.perf_counter() - t0)
        return res


# ---- the table ---------------------------------------------------------------------------------

def per_token(res: dict, new: int) -> tuple[float, float]:
    """(bytes read per decoded token, major faults per decoded token) from the child's counters."""
    io = res["io"]
    steps = max(new - 1, 1)
    return (io[-1][0] - io[-2][0]) / steps, (io[-1][1] - io[-2][1]) / steps


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(runs: list[dict], new: int) -> dict:
    ok = [r for r in runs if "decode" in r]
    out = {"runs": len(runs), "ok": len(ok), "oom": sum(r.get("oom", 0) for r in runs),
           "dead": [r["dead"] for r in runs if "dead" in r], "refused": [r["refused"] for r in runs if "refused" in r],
           "peak": median([r.get("peak") for r in runs if r.get("peak", -1) >= 0])}
    if ok:
        out["decode"] = median([r["decode"] for r in ok])
        # each run's bytes/s read while decoding against the disk's speed probed around it
        out["use"] = median([r["decode"] * per_token(r, new)[0] / r["disk_bw"] for r in ok if r.get("disk_bw")])
        out["disk_bw"] = median([r.get("disk_bw") for r in ok])
        out["prefill"] = median([r["prefill"] for r in ok])
        out["bytes_tok"] = median([per_token(r, new)[0] for r in ok])
        out["majflt_tok"] = median([per_token(r, new)[1] for r in ok])
        if "sim_decode_bytes" in ok[0]:
            out["sim_bytes_tok"] = median([r["sim_decode_bytes"] / max(new - 1, 1) for r in ok])
            out["budgets"] = ok[-1]["budgets"]
            out["tiers"] = ok[-1]["tiers"]
            out["maxrss"] = median([r["maxrss"] for r in ok])
            out["resident"] = ok[-1].get("resident")
    return out


def fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["qwen3", "issue", "tiny"], default="qwen3",
                    help="qwen3: Qwen3-30B-A3B's layer, --size GB of experts; issue: the 1.3B-A0.2B; tiny: a "
                         "2-layer smoke test that runs in seconds")
    ap.add_argument("--size", type=float, default=8.0, help="GB of 4.5-bit experts (--shape qwen3)")
    ap.add_argument("--limits", default="25,50,75", help="memory limits, percent of the store's bytes")
    ap.add_argument("--limits-mb", default=None, help="memory limits in MB (instead of --limits)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--embed-scale", type=int, default=EMBED_SCALE,
                    help="the token embedding's scale against the layers' weights (a power of two): how "
                         "much of the token's identity the hidden states keep, i.e. how local the routing "
                         "is (printed per run); higher: more experts per token change")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--io-threads", type=int, default=8, help="moestream's expert reads in flight (queue depth)")
    ap.add_argument("--prefetch", type=int, default=0,
                    help="moestream's prefetch depth: sparse layers ahead whose predicted experts are "
                    "read while this layer computes (0: off, the CPU default)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a run may take before it counts as stalled")
    ap.add_argument("--dir", default=None, help="where the model files go (kept, and reused when they match); "
                                                "default: a temporary directory removed at the end")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--llama-lib", type=Path, default=None, metavar="DIR",
                    help="a native build of llama.cpp's libraries (bash bench/build_llama_cpp.sh DIR) instead of "
                         "the installed wheel's (which dies of SIGILL on some CPUs: an AVX2-only EPYC)")
    ap.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                    help="moestream fills its free expert slots at load (generate's default), as llama.cpp's "
                         "load fills the page cache; --no-warm: slots start empty")
    ap.add_argument("--greedy", action="store_true",
                    help="decode greedy tokens instead of the fixed continuation both systems feed (their "
                         "greedy tokens differ, and so do the experts they route to)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        print(json.dumps(moestream_child(args.child, args.prompt, args.new, args.threads, args.io_threads,
                                         args.prefetch, args.warm, args.greedy)))
        return

    shape = {"issue": ISSUE_SHAPE, "tiny": TINY_SHAPE}.get(args.shape) or qwen3_30b_like(args.size * 1e9)
    args.vocab = shape.vocab
    from engine.quant.kernels import load_extension

    load_extension()  # built here if need be: a compiler in a child's memory-limited cgroup is OOM-killed
    tmp = None
    if args.dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="beyond_ram_", dir=os.environ.get("TMPDIR"))
        work = Path(tmp.name)
    else:
        work = Path(args.dir)
        work.mkdir(parents=True, exist_ok=True)
    try:
        run_bench(shape, work, args)
    finally:
        if tmp is not None:
            tmp.cleanup()


FILES_VERSION = 4  # bumped when the written files change for one shape (2: zero-mean Q4_K blocks; 3: xxh3 blob
# checks; 4: the store converted from the GGUF, the same weights, and the embedding's scale)


def run_bench(shape, work: Path, args) -> None:
    store, gguf = work / "store", work / "model.gguf"
    stamp = work / "shape.json"
    want = json.dumps({**vars(shape), "files": FILES_VERSION, "embed_scale": args.embed_scale}, sort_keys=True)
    if not (stamp.exists() and stamp.read_text() == want and (store / "manifest.json").exists() and gguf.exists()):
        t = time.perf_counter()
        for p in (gguf, stamp):
            p.unlink(missing_ok=True)
        if (store / "manifest.json").is_file():  # the bench's store of an earlier shape or version (its
            shutil.rmtree(store)  # files, an older writer's extra ones too, go): converted anew
        write_gguf(shape, gguf, embed_scale=args.embed_scale)
        write_store(gguf, store, progress=sys.stderr.isatty())
        stamp.write_text(want)
        print(f"model files written in {time.perf_counter() - t:.0f} s", flush=True)
    files = sorted(p for p in store.iterdir() if p.is_file())
    store_bytes = sum(p.stat().st_size for p in files)
    layer_files = [p for p in files if p.name.startswith("experts-")]
    expert_bytes = sum(p.stat().st_size for p in layer_files)
    print(f"model: {shape.name}: {shape.layers} layers, hidden {shape.hidden}, {shape.experts} experts top-"
          f"{shape.top_k} of width {shape.width}, {shape.heads}/{shape.kv_heads} heads of {shape.head_dim}, "
          f"vocab {shape.vocab}\n  moestream store {store_bytes / MB:.0f} MB ({expert_bytes / MB:.0f} MB experts, "
          f"int4 g64, converted from the GGUF: the same weights), llama.cpp GGUF {gguf.stat().st_size / MB:.0f} MB (Q4_K); "
          f"token embedding {args.embed_scale}x the layers' scale\n  {args.prompt} random prompt ids + "
          f"{args.new} {'greedy' if args.greedy else 'forced (the same fixed continuation)'} tokens, {args.threads} threads, moestream io threads {args.io_threads}, "
          f"{args.rounds} alternating rounds (medians), pages evicted before each run", flush=True)
    ra = readahead_kb(gguf)
    print(f"page-cache readahead of the model's filesystem: {fmt(ra, 'd', 'unknown')} KiB (llama.cpp's mmap mode "
          f"reads that much around a fault on a cold page; the kernel's default is 128, this figure decides much of "
          f"its row: docs/benchmarks.md)", flush=True)
    disk = measure_disk(layer_files)
    bw = disk["seq_bytes_s"]
    print(f"disk (O_DIRECT, store files): sequential 1 MiB {bw / MB:.0f} MB/s; 4 KiB random QD1 "
          f"{disk['rand4k_qd1_iops']:.0f} IOPS ({disk['rand4k_qd1_iops'] * 4096 / MB:.1f} MB/s), QD16 "
          f"{disk['rand4k_qd16_iops']:.0f} IOPS ({disk['rand4k_qd16_iops'] * 4096 / MB:.1f} MB/s)", flush=True)
    if args.limits_mb:
        limits = [(f"{mb} MB", int(float(mb) * MB)) for mb in args.limits_mb.split(",")]
    else:
        limits = [(f"{pc}%", int(float(pc) / 100 * store_bytes)) for pc in args.limits.split(",")]
    try:
        with LimitedGroup(1 << 30):
            pass
    except NoCgroup as e:
        sys.exit(f"beyond-ram: {e}")
    runs: dict[tuple[str, str], list[dict]] = {}
    systems = [("moestream", lambda lim: run_moestream(store, lim, args))]
    if not args.no_llama:
        print(f"llama.cpp: {f'the native build in {args.llama_lib}' if args.llama_lib else 'the installed wheel'}")
        systems.append(("llama.cpp", lambda lim: run_llama(gguf, lim, args, repack=True)))
        systems.append(("llama.cpp mmap", lambda lim: run_llama(gguf, lim, args, repack=False)))
    probes = 0
    for k in range(args.rounds):
        for label, lim in limits:
            for name, fn in systems:
                before = sequential_bandwidth(layer_files, 1.0, probes)  # the disk now: it drifts
                evict(files + [gguf])
                r = fn(lim)
                after = sequential_bandwidth(layer_files, 1.0, probes + 1)
                probes += 2
                r["disk_bw"] = (before + after) / 2
                runs.setdefault((label, name), []).append(r)
                what = (f"{r['decode']:.2f} tok/s decode, {r['prefill']:.1f} prefill, "
                        f"{per_token(r, args.new)[0] / MB:.1f} MB read/token, disk {before / MB:.0f} -> "
                        f"{after / MB:.0f} MB/s" if "decode" in r
                        else r.get("refused") or r.get("dead"))
                if "wait" in r:  # a moestream run (its child reports the split and the routing together)
                    what += (", a token: " + token_split(r, args.new) + f"; routing: {r['routing']['distinct']:.0f} "
                             f"experts per layer over the run, {r['routing']['new']:.0%} of a token's new against "
                             f"the previous token's")
                if "maxrss" in r:
                    tiers = r["tiers"]
                    what += (f", RSS beyond tiers {(r['maxrss'] - tiers) / MB:.0f} MB (after load, prefill, "
                             f"decode: {', '.join(f'{(p - tiers) / MB:.0f}' for p in r['peaks'])})")

                print(f"round {k + 1}/{args.rounds} limit {label} {name}: {what}; cgroup peak "
                      f"{r.get('peak', -1) / MB:.0f} MB, oom kills {r.get('oom', 0)}", flush=True)

    print(f"\n| limit | system | decode tok/s | prefill tok/s | MB read / token | simulator MB / token | "
          f"disk MB/s | roofline tok/s | disk use | cgroup peak MB | RSS peak beyond tiers MB | goal MB | major faults / token | "
          f"OOM kills | notes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    last = None
    for label, lim in limits:
        row = {}
        for name, _ in systems:
            s = summarise(runs[(label, name)], args.new)
            row[name] = s
            sim = s.get("sim_bytes_tok")
            run_bw = s.get("disk_bw") or bw  # the disk around these runs
            # no disk roofline for a run that reads (next to) nothing per token: a few KiB of
            # metadata reads gave llama.cpp "2,578,096 tok/s" with everything resident
            roof = run_bw / sim if sim else (run_bw / s["bytes_tok"] if (s.get("bytes_tok") or 0) >= 0.1 * MB else None)
            use = s.get("use")
            # the child's own peak RSS less its tiers (the cgroup's peak counts page cache, which
            # fills any limit under file I/O)
            beyond = (s["maxrss"] - s["tiers"]) / MB if s.get("tiers") and s.get("maxrss") else None
            # the issue's bound on it: the dense weights + the KV budget + 300 MB
            goal = (s["resident"] / MB + BEYOND_TIERS_MB) if s.get("resident") else None
            notes = "; ".join(filter(None, [
                f"refused: {s['refused'][0]}" if s["refused"] else "",
                f"{len(s['dead'])} of {s['runs']} died: {s['dead'][0]}" if s["dead"] else "",
                s.get("budgets", "")]))
            print(f"| {label} ({lim / MB:.0f} MB) | {name} | {fmt(s.get('decode'), '.2f')} | {fmt(s.get('prefill'))} | "
                  f"{fmt(s['bytes_tok'] / MB if s.get('bytes_tok') is not None else None)} | "
                  f"{fmt(sim / MB if sim is not None else None)} | {fmt(s.get('disk_bw') and s['disk_bw'] / MB, '.0f')} | "
                  f"{fmt(roof)} | "
                  f"{fmt(use * 100 if use is not None else None, '.0f')}{'%' if use is not None else ''} | "
                  f"{fmt(s['peak'] / MB if s['peak'] else None, '.0f')} | {fmt(beyond, '.0f')} | {fmt(goal, '.0f')} | "
                  f"{fmt(s.get('majflt_tok'), '.0f')} | {s['oom']} | {notes} |")
        last = (label, row)
    print(summary_line(*last))


def readahead_kb(path: Path) -> int | None:
    """The page cache's readahead (KiB) of the filesystem holding ``path``
    (/sys/class/bdi/MAJ:MIN/read_ahead_kb), None where it cannot be read. llama.cpp's mmap mode
    reads this much around every page fault of a cold page; moestream reads with O_DIRECT."""
    try:
        dev = path.stat().st_dev
        return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text())
    except (OSError, ValueError):
        return None


def prefill_records(rows: list[tuple[int, list[int]]], layers: int, top_k: int) -> list[tuple[int, list[int]]]:
    """A prefill's routing as the expert cache sees it, for the simulator: layer by layer, the
    distinct experts its rows routed to, ascending, in records of ``top_k`` (a trace's record
    width; the last one topped up with the layer's first experts, which are resident by then:
    hits). ``rows``: (layer ordinal, experts) of every prompt row."""
    out = []
    for layer in range(layers):
        ids = sorted({e for l, row in rows if l == layer for e in row})
        for i in range(0, len(ids), top_k):
            part = ids[i:i + top_k]
            part += [e for e in ids if e not in part][:top_k - len(part)]
            out.append((layer, part))
    return out


def routing_stats(routed: list[tuple[int, int, list[int]]], layers: int) -> dict:
    """How hard the run's routing is on a cache: ``distinct``, the experts each sparse layer routed
    to over the run (mean over layers); ``new``, the share of a token's experts its previous
    token did not route to in the same layer (mean). ``routed``: (token, layer ordinal, experts)."""
    per: dict[tuple[int, int], set[int]] = {}
    for t, layer, row in routed:
        per.setdefault((t, layer), set()).update(row)
    seen = [set() for _ in range(layers)]
    fresh, pairs = 0.0, 0
    for (t, layer), ids in per.items():
        seen[layer] |= ids
        prev = per.get((t - 1, layer))
        if prev is not None and ids:
            fresh += len(ids - prev) / len(ids)
            pairs += 1
    return {"distinct": sum(len(s) for s in seen) / max(layers, 1), "new": fresh / pairs if pairs else 0.0}


def token_split(r: dict, new: int) -> str:
    """A moestream run's decoded token split into waiting for expert reads (after computing the
    hits that were resident while they ran) and everything else, with the misses behind it."""
    w, n = r["wait"], max(new - 1, 1)
    token = 1e3 / r["decode"] if r.get("decode") else 0.0
    stall = w["stall_s"] / n * 1e3
    late = f" ({w['late_prefetch'] / n:.1f} of them prefetches still landing)" if w["late_prefetch"] else ""
    return (f"{token:.0f} ms = {stall:.0f} ms waiting for reads + {token - stall:.0f} ms computing; "
            f"{w['misses'] / n:.1f} misses{late}, {w['overlapped'] / n:.1f} hits computed while reads ran")


def summary_line(label: str, row: dict) -> str:
    """The run's last line: the last limit's moestream and fastest llama.cpp decode, their ratio
    and moestream's disk use (``row``: system name -> summarise's dict)."""
    ours = row["moestream"]
    d_o = ours.get("decode")
    d_t = max((row[n]["decode"] for n in row if n.startswith("llama") and row[n].get("decode")), default=None)
    ratio = f"{d_o / d_t:.1f}x" if d_o and d_t else "n/a"
    use = ours.get("use")
    if d_o:
        mine = f"{d_o:.2f} tok/s"
    elif ours["refused"]:  # the typed error's minimum, not its path-long opening
        need = re.search(r"needs at least ([0-9.]+ \w+)", ours["refused"][0])
        mine = f"refused (needs at least {need.group(1)})" if need else f"refused ({ours['refused'][0][:60]})"
    else:
        mine = f"none ({(ours['dead'] or ['?'])[0][:60]})"
    disk = f"{use:.0%} of bandwidth" if use is not None else "n/a"
    return (f"beyond-ram {label}: moestream {mine}, llama.cpp {fmt(d_t, '.2f', 'none')} tok/s ({ratio}), disk use {disk}")


if __name__ == "__main__":
    main()
