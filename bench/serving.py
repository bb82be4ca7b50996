"""Serving benchmark: throughput and latency of engine.runner.Engine at 1, 4 and 16 concurrent
streams on a random Qwen3-MoE built in memory (no files), next to the single-sequence
reference loop (engine.generate.generate_ids) and the memory-bandwidth roofline.

    python bench/serving.py                       # hidden 512, 8 layers, 32 experts top-4
    python bench/serving.py --streams 1 4 16 --prompt-len 64 --new-tokens 32
    python bench/serving.py --multi-turn          # 4 conversations x 4 turns, prefix cache on/off
    python bench/serving.py --paths               # the same engine in process, through the Ray
                                                  # client and through the HTTP API (below)

--paths builds a small int4 store (or takes --store), deploys the Ray pipeline on a local
cluster and measures TTFT and inter-token latency p50/p99 at 1, 4, 16 and 64 streams on three
paths: the in-process Engine (same store, budgets and batch limit), the Ray driver client
(decode -> router: one step stream, a StepFrame per engine step for all requests; router ->
driver: a step stream per request) and the OpenAI-compatible HTTP API (aiohttp
client, SSE; router -> HTTP actor: one step stream too, plus HTTP). Greedy, so every path
produces the same tokens. It also prints engine steps and decode -> router frames per run.

Every stream's request arrives at t=0; TTFT is arrival -> first token, inter-token latency
(ITL) is the gap between a stream's consecutive tokens. Roofline: each step must read the
dense weights once plus every distinct expert the batch routes to (counted during the run),
so tokens/s <= tokens per step x bandwidth / bytes per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.config import ModelConfig, MoEConfig
from engine.generate import Request, generate_ids
from engine.kv.paged import PagedKVCache
from engine.layers.moe import ExpertProvider
from engine.layers.sampler import SamplingConfig
from engine.loading.source import TensorInfo, TensorSource, expert_name
from engine.models.base import CausalLM
from engine.models.load import build_model, resident_experts
from engine.runner import Engine
from engine.scheduler import SchedulerConfig


class RandomSource(TensorSource):
    """Random weights under canonical names, made on first ``get``."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        with torch.device("meta"):
            shapes = {n: tuple(t.shape) for n, t in CausalLM(cfg).state_dict().items()}
        m = cfg.moe
        for layer in cfg.moe_layers:
            for e in range(m.num_experts):
                shapes[expert_name(layer, e, "gate_proj")] = (m.expert_intermediate_size, cfg.hidden_size)
                shapes[expert_name(layer, e, "up_proj")] = (m.expert_intermediate_size, cfg.hidden_size)
                shapes[expert_name(layer, e, "down_proj")] = (cfg.hidden_size, m.expert_intermediate_size)
        self.shapes, self.path, self.gen = shapes, "<random>", torch.Generator().manual_seed(seed)

    def names(self):
        return sorted(self.shapes)

    def info(self, name):
        return TensorInfo(name, self.shapes[name], "f32")

    def get(self, name):
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return 1 + 0.1 * torch.randn(shape, generator=self.gen)
        return torch.randn(shape, generator=self.gen) * shape[-1] ** -0.5


class CountingExperts(ExpertProvider):
    """Counts the distinct experts each layer acquires (= expert weights read per step)."""

    def __init__(self, inner: ExpertProvider) -> None:
        self.inner, self.acquired = inner, 0

    def acquire(self, layer, expert_ids):
        self.acquired += len(expert_ids)
        return self.inner.acquire(layer, expert_ids)


def read_bandwidth(nbytes: int = 1 << 29) -> float:
    """Best-of-5 GB/s of summing a buffer far larger than the caches (random data: pages of
    one repeated value may be deduplicated by a VM host and then read from cache)."""
    x = torch.rand(nbytes // 4)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def _pct_row(name: str, n: int, ttft: list[float], itl: list[float], tokens: int, wall: float) -> str:
    return (f"| {name} | {n} | {pct(ttft, 0.5) * 1e3:.1f} | {pct(ttft, 0.99) * 1e3:.1f} | "
            f"{pct(itl, 0.5) * 1e3:.2f} | {pct(itl, 0.99) * 1e3:.2f} | {tokens / wall:.1f} |")


def _ray_serve_ingress(namespace: str) -> str:
    """A Ray Serve deployment doing what the HTTP actor does for /v1/completions (parse, frames
    to the router, SSE out); returns its URL. Needs ``pip install "ray[serve]"``."""
    import socket

    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    class Ingress:
        def __init__(self, ns: str) -> None:
            from services.handles import router

            self.router = router(ns)

        async def __call__(self, request: Request):
            import uuid

            from protocol import GenerateResult, StepFrame, TokenChunk, decode, encode
            from services.http.openai_format import SSE_DONE, Formatter
            from services.http.schemas import CompletionRequest, OpenAIError, parse_body

            try:
                body = parse_body(CompletionRequest, await request.body())
                rid = "cmpl-" + uuid.uuid4().hex
                greq = body.to_generate(rid)
            except OpenAIError as e:
                return JSONResponse(e.body(), status_code=e.status)
            fmt = Formatter("completion", rid, body.model, body.include_usage)
            # the router's one intake: the request into a step stream of its own, ending with it
            steps = self.router.steps.remote(rid, True)
            refused = await self.router.submit.remote(rid, encode(greq))
            if refused is not None:
                return JSONResponse({"error": decode(refused)[0].message}, status_code=500)

            async def messages():
                async for ref in steps:
                    for msg in decode(await ref, expect=StepFrame)[0].messages:
                        yield msg

            async def events():
                sent = 0
                async for msg in messages():
                    if isinstance(msg, TokenChunk):
                        sent += len(msg.token_ids)
                        if msg.text:
                            yield fmt.chunk(msg.text)
                    elif isinstance(msg, GenerateResult):
                        yield fmt.chunk(final=True, finish=msg.finish_reason)
                        if fmt.include_usage:
                            yield fmt.usage_chunk({"prompt_tokens": msg.usage.prompt_tokens,
                                                   "completion_tokens": sent})
                        break
                yield SSE_DONE

            return StreamingResponse(events(), media_type="text/event-stream")

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Ingress.bind(namespace), route_prefix="/v1/completions", name="bench-ingress")
    return f"http://127.0.0.1:{port}/v1/completions"


def paths_main(args) -> None:
    """In-process Engine vs Ray client vs HTTP API on one store (see the module docstring)."""
    import asyncio
    import os
    import sys
    import tempfile
    import threading
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from engine.experts.runtime import load_from_store
    from engine.experts.tiers import align_up
    from engine.store import ExpertStore
    from protocol import GenerateResult, TokenChunk
    from services.app import deploy
    from services.client import MoestreamClient
    from services.config import DeployConfig
    from services.http.server import HttpSettings
    from tests.services.conftest import _add_tokenizer

    tmp = tempfile.TemporaryDirectory(prefix="moestream-serving-")
    store = args.store
    if store is None:  # a random Qwen3-MoE with a word-level tokenizer (as the service tests)
        from engine.quant.formats import QuantFormat
        from engine.store import convert
        from tests.engine.models.hf_tiny import make_checkpoint

        root = Path(tmp.name)
        make_checkpoint("qwen3_moe", root / "hf", seed=1, hidden_size=args.hidden,
                        num_hidden_layers=args.layers, head_dim=64,
                        num_attention_heads=args.hidden // 64, num_key_value_heads=2,
                        moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
                        num_experts_per_tok=2, norm_topk_prob=True,
                        intermediate_size=args.moe_intermediate)
        _add_tokenizer(root / "hf", 96)
        store = root / "store"
        convert(root / "hf", store, fmt=QuantFormat("int4", 32), progress=False)
    st = ExpertStore(store)  # opened once: sizes here, then the in-process model (sm owns it)
    slot, total, vocab = align_up(st.expert_nbytes), st.num_experts_total, st.config.vocab_size
    dev = max(2, int(total * args.device_fraction)) * slot
    seqs = max(args.streams)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(seqs)]
    print(f"store {store}: {total} int4 experts, device cache {dev // slot} slots "
          f"({args.device_fraction:.0%}), RAM tier: all; {args.prompt_len} prompt + up to "
          f"{args.new_tokens} new tokens per stream (greedy, EOS ends a stream early on every "
          f"path alike); max_num_seqs {seqs}; {os.cpu_count()} CPUs")
    head = "| path | streams | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | gen tok/s |"
    rows = []

    # ---- in process: the decode actor's engine, built the same way
    from engine.kv.paged import PagedKVCache
    from engine.layers.sampler import SamplingConfig
    from engine.executor import executor_for
    from engine.options import configure

    sm = load_from_store(st, device_budget=dev, prefetch_depth=0, dense="bf16")
    configure(native_threads=0)
    executor_for(sm.model).native()
    kv = PagedKVCache.from_budget(sm.store.config, 64 << 20, 16, dtype=torch.float32)
    engine = Engine(sm.model, sm.tokenizer, kv, SchedulerConfig(max_num_batched_tokens=512,
                                                                max_num_seqs=seqs))
    sampling = SamplingConfig(max_tokens=args.new_tokens)
    engine.generate([(prompts[0], SamplingConfig(max_tokens=4))])  # warm-up
    for n in args.streams:
        engine.generate([(p, sampling) for p in prompts[:n]])  # warm: this batch's shapes
        t = time.perf_counter()
        res = engine.generate([(p, sampling) for p in prompts[:n]])
        wall = time.perf_counter() - t
        rows.append(_pct_row("in-process Engine", n, [r.ttft for r in res],
                             [x for r in res for x in r.inter_token_latencies],
                             sum(len(r.output_ids) for r in res), wall))
    sm.close()

    cfg = DeployConfig(store=store, namespace="moestream-serving-bench", loaders=2,
                       device_budget=dev, prefetch_depth=0, kv_budget="64MiB", max_num_seqs=seqs,
                       queue_size=max(64, seqs), num_cpus=os.cpu_count(),
                       object_store_memory=256 << 20)
    app = deploy(cfg)
    try:
        client = MoestreamClient(namespace=cfg.namespace)

        def ray_stream(p, t0, out):
            last, ttft, itl, n_tok = None, None, [], 0
            for m in client.generate(prompt_token_ids=p, sampling={"temperature": 0,
                                                                   "max_tokens": args.new_tokens}):
                if isinstance(m, TokenChunk) and m.token_ids:
                    now = time.perf_counter()
                    if last is None:
                        ttft = now - t0
                    else:
                        itl.append(now - last)
                    itl += [0.0] * (len(m.token_ids) - 1)
                    last, n_tok = now, n_tok + len(m.token_ids)
                elif not isinstance(m, (TokenChunk, GenerateResult)):
                    raise RuntimeError(m)
            out.append((ttft, itl, n_tok))

        def frame_counts():
            r, d = ray.get([app.router.stats.remote(), app.decode.stats.remote()])
            return r.get("decode_frames", 0), d["steps"]

        def frames_note(name, n, before):
            (f0, s0), (f1, s1) = before, frame_counts()
            notes.append(f"{name}, {n} streams: {s1 - s0} engine steps, {f1 - f0} decode -> router "
                         f"frames")

        notes: list[str] = []
        ray_stream(prompts[0], time.perf_counter(), [])  # warm: experts enter the RAM tier
        for n in args.streams:
            before = frame_counts()
            out: list = []
            t0 = time.perf_counter()
            ths = [threading.Thread(target=ray_stream, args=(p, t0, out)) for p in prompts[:n]]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            wall = time.perf_counter() - t0
            rows.append(_pct_row("Ray client (driver)", n, [o[0] for o in out],
                                 [x for o in out for x in o[1]], sum(o[2] for o in out), wall))
            frames_note("Ray client", n, before)

        host, port = app.start_http(HttpSettings(port=0, namespace=cfg.namespace, model_name="bench"))
        urls = [("HTTP API (SSE)", f"http://{host}:{port}/v1/completions")]
        if args.ray_serve:  # the alternative ingress, measured the same way
            urls.append(("Ray Serve ingress (SSE)", _ray_serve_ingress(cfg.namespace)))

        async def http_streams(url, n):
            import aiohttp

            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as s:
                async def one(p, t0):
                    body = {"model": "bench", "prompt": p, "max_tokens": args.new_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                    last, ttft, itl, n_tok = None, None, [], 0
                    async with s.post(url, json=body) as r:
                        assert r.status == 200, await r.text()
                        async for line in r.content:
                            if not line.startswith(b"data: {"):
                                continue
                            now = time.perf_counter()
                            obj = json.loads(line[6:])
                            if obj.get("usage"):
                                n_tok = obj["usage"]["completion_tokens"]
                            if not obj["choices"] or not obj["choices"][0]["text"]:
                                continue
                            if last is None:
                                ttft = now - t0
                            else:
                                itl.append(now - last)
                            last = now
                    return ttft, itl, n_tok

                t0 = time.perf_counter()
                out = await asyncio.gather(*(one(p, t0) for p in prompts[:n]))
                return out, time.perf_counter() - t0

        for name, url in urls:
            asyncio.run(http_streams(url, 1))  # warm
            for n in args.streams:
                before = frame_counts()
                out, wall = asyncio.run(http_streams(url, n))
                frames_note(name, n, before)
                rows.append(_pct_row(name, n, [o[0] for o in out if o[0] is not None],
                                     [x for o in out for x in o[1]], sum(o[2] for o in out), wall))
    finally:
        if args.ray_serve:
            from ray import serve

            serve.shutdown()
        app.shutdown()
        ray.shutdown()
        tmp.cleanup()
    print(head)
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(7)) + "|")
    for r in sorted(rows, key=lambda r: int(r.split("|")[2])):
        print(r)
    print("\n".join(notes))
    print("TTFT: all streams arrive at t=0, to each stream's first token; ITL: gaps between a "
          "stream's consecutive tokens (HTTP: between SSE chunks with text); gen tok/s: all "
          "streams' generated tokens over the wall time")


def multi_turn(args, model: CausalLM, kv_dtype: torch.dtype) -> None:
    """``--multi-turn``: C conversations at once, T turns each; turn 1 = a shared system prompt
    + a user message, turn t+1 = turn t's prompt + its answer + a new user message (a chat
    app's or a coding agent's traffic). The same engine runs it with the prefix cache on and
    off; per turn: TTFT p50/max, prompt tokens computed (prefill work) and reused."""
    cfg, bs, c = model.config, args.block_size, args.conversations
    g = torch.Generator().manual_seed(2)

    def rand(n: int) -> list[int]:
        return torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()

    system = rand(args.system_len)
    users = [[rand(args.user_len) for _ in range(args.turns)] for _ in range(c)]
    longest = args.system_len + args.turns * (args.user_len + args.new_tokens)
    print(f"workload: {c} conversations x {args.turns} turns; shared system prompt {args.system_len} "
          f"tokens, user messages {args.user_len}, answers {args.new_tokens} (greedy); KV "
          f"{args.kv_dtype}, block {bs}, room for every conversation; step budget "
          f"{args.max_batched_tokens}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    outputs, rows = {}, []
    for on in (False, True):
        kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, c * -(-longest // bs) + 1, bs,
                          kv_dtype, prefix_cache=on)
        engine = Engine(model, None, kv, SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens,
                                                         max_num_seqs=c))
        Engine(model, None, PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, bs, kv_dtype),
               SchedulerConfig(max_num_seqs=c)).generate(  # warm-up: batch shapes
            [Request(rand(8), SamplingConfig(max_tokens=2, ignore_eos=True)) for _ in range(c)])
        prompts = [system + users[i][0] for i in range(c)]
        outs = []
        for t in range(args.turns):
            t0 = time.perf_counter()
            res = engine.generate([Request(p, SamplingConfig(max_tokens=args.new_tokens, ignore_eos=True))
                                   for p in prompts])
            wall = time.perf_counter() - t0
            ttft = [r.ttft for r in res]
            total = sum(len(p) for p in prompts)
            cached = sum(r.cached_tokens for r in res)
            rows.append(("on" if on else "off", t + 1, total, total - cached, cached,
                         statistics.median(ttft) * 1e3, max(ttft) * 1e3, wall))
            outs.append([r.output_ids for r in res])
            if t + 1 < args.turns:
                prompts = [p + r.output_ids + users[i][t + 1] for i, (p, r) in enumerate(zip(prompts, res))]
        outputs[on] = outs
    head = ("cache", "turn", "prompt tokens", "computed", "reused", "TTFT p50 ms", "TTFT max ms", "turn wall s")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.0f} | {r[6]:.0f} | {r[7]:.2f} |")
    for on in ("off", "on"):
        sel = [r for r in rows if r[0] == on]
        print(f"cache {on}: prompt tokens computed {sum(r[3] for r in sel)} of {sum(r[2] for r in sel)}, "
              f"TTFT p50 over turns 2..{args.turns} {statistics.median([r[5] for r in sel[1:]]):.0f} ms, "
              f"wall {sum(r[7] for r in sel):.1f} s")
    print("greedy outputs identical with the cache on and off:", outputs[True] == outputs[False])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", choices=["bf16", "fp32", "fp8"], default="bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--paths", action="store_true", help="in process vs Ray client vs HTTP API "
                    "on a store (module docstring); defaults become: 1 4 16 64 streams, hidden 256, "
                    "2 layers, 8 experts, 16 prompt + 32 new tokens")
    ap.add_argument("--store", type=Path, default=None, help="--paths: an existing store")
    ap.add_argument("--multi-turn", action="store_true", help="conversations with the prefix "
                    "cache on and off (multi_turn's docstring)")
    ap.add_argument("--conversations", type=int, default=4, help="--multi-turn: concurrent conversations")
    ap.add_argument("--turns", type=int, default=4, help="--multi-turn: turns per conversation")
    ap.add_argument("--system-len", type=int, default=512, help="--multi-turn: shared system prompt tokens")
    ap.add_argument("--user-len", type=int, default=64, help="--multi-turn: tokens per user message")
    ap.add_argument("--ray-serve", action="store_true", help="--paths: also measure a Ray Serve "
                    "ingress doing the same (needs `pip install \"ray[serve]\"`)")
    ap.add_argument("--device-fraction", type=float, default=0.5, help="--paths: device cache "
                    "as a share of the experts")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.paths:
        given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in sys.argv[1:] if a.startswith("--")}
        for name, value in (("streams", [1, 4, 16, 64]), ("hidden", 256), ("layers", 2),
                            ("experts", 8), ("prompt_len", 16), ("new_tokens", 32),
                            ("moe_intermediate", 128)):
            if name not in given:
                setattr(args, name, value)
        return paths_main(args)

    cfg = ModelConfig(arch="qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 2, num_layers=args.layers,
                      num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256),
                      head_dim=64, max_position_embeddings=4096, qk_norm=True,
                      moe=MoEConfig(num_experts=args.experts, top_k=args.top_k,
                                    expert_intermediate_size=args.moe_intermediate,
                                    norm_topk_prob=True))
    source = RandomSource(cfg)
    experts = CountingExperts(resident_experts(cfg, source, torch.float32))
    model = build_model(cfg, source, provider=experts)
    kv_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}[args.kv_dtype]
    if args.multi_turn:
        print(f"model: random Qwen3-MoE, hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
              f"{args.experts} experts top-{args.top_k}, fp32 weights")
        return multi_turn(args, model, kv_dtype)
    counts = cfg.parameter_counts()
    expert_bytes = 3 * args.hidden * args.moe_intermediate * 4
    dense_bytes = (counts["dense"] - cfg.vocab_size * cfg.hidden_size) * 4  # one embedding row read
    bw = read_bandwidth()
    g = torch.Generator().manual_seed(1)

    def workload(n: int) -> list[Request]:
        return [Request(torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=g).tolist(),
                        SamplingConfig(max_tokens=args.new_tokens, ignore_eos=True)) for _ in range(n)]

    print(f"model: random Qwen3-MoE, hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
          f"{cfg.num_heads}/{cfg.num_kv_heads} heads, {args.experts} experts top-{args.top_k}, moe "
          f"intermediate {args.moe_intermediate}, vocab {cfg.vocab_size}; {counts['total'] / 1e6:.0f}M "
          f"total / {counts['active'] / 1e6:.0f}M active params, fp32 weights")
    print(f"workload: each stream {args.prompt_len} prompt tokens + {args.new_tokens} new (greedy); "
          f"KV {args.kv_dtype} paged, block {args.block_size}; step budget {args.max_batched_tokens} "
          f"tokens; torch {torch.__version__}, {torch.get_num_threads()} threads; memory read {bw:.1f} GB/s")

    # peer: the single-sequence reference loop (same model, contiguous KV)
    req = workload(1)[0]
    list(generate_ids(model, req.prompt_ids, SamplingConfig(max_tokens=4, ignore_eos=True)))  # warm-up
    t = time.perf_counter()
    for _, _, stats in generate_ids(model, req.prompt_ids, req.sampling):
        pass
    ref_wall = time.perf_counter() - t
    print(f"peer: reference loop (engine.generate.generate_ids), 1 stream: "
          f"{stats.generated_tokens / ref_wall:.1f} gen tok/s end to end, TTFT "
          f"{stats.prefill_seconds * 1e3:.0f} ms, decode {stats.decode_tps:.1f} tok/s")

    rows = []
    for n in args.streams:
        reqs = workload(n)
        blocks = n * -(-(args.prompt_len + args.new_tokens) // args.block_size) + 1
        kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, blocks, args.block_size, kv_dtype)
        engine = Engine(model, None, kv, SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens,
                                                         max_num_seqs=max(n, 1)))
        warm = [Request(r.prompt_ids[:8], SamplingConfig(max_tokens=4, ignore_eos=True)) for r in reqs]
        Engine(model, None, kv, SchedulerConfig(max_num_seqs=max(n, 1))).generate(warm)  # batch shapes
        experts.acquired = 0
        t = time.perf_counter()
        results = engine.generate(reqs)
        wall = time.perf_counter() - t
        m = engine.metrics()
        gen = sum(len(r.output_ids) for r in results)
        ttft = [r.ttft for r in results]
        itl = [x for r in results for x in r.inter_token_latencies]
        bytes_read = experts.acquired * expert_bytes + m.steps * dense_bytes
        roof = (m.computed_tokens / (bytes_read / (bw * 1e9)))  # tokens/s if only bytes mattered
        rows.append((n, gen / wall, (m.computed_tokens) / wall, statistics.median(ttft) * 1e3,
                     max(ttft) * 1e3, pct(itl, 0.5) * 1e3, pct(itl, 0.99) * 1e3, m.steps,
                     bytes_read / wall / 1e9, roof, m.preemptions))

    head = ("streams", "gen tok/s", "all tok/s", "TTFT p50 ms", "TTFT max ms", "ITL p50 ms",
            "ITL p99 ms", "steps", "weights GB/s", "roofline tok/s", "preempt")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.1f} | {r[6]:.1f} "
              f"| {r[7]} | {r[8]:.1f} | {r[9]:.0f} | {r[10]} |")
    print("gen tok/s: generated tokens / wall; all tok/s: prompt + generated tokens through the model; "
          "weights GB/s: dense + distinct expert bytes per step, over wall time; roofline: all tok/s "
          f"if every step ran at the measured {bw:.1f} GB/s")


if __name__ == "__main__":
    main()
