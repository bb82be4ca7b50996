"""The decode actor: owns the device expert cache, the paged KV cache and the engine loop.

One per GPU (num_gpus=1 where CUDA exists; num_cpus=0 otherwise so a 2-core node is not
exhausted by service actors). The engine (engine.runner.Engine) runs on one thread that only
this module touches; the actor's asyncio loop takes requests in and streams protocol frames out
(services/decode_stream.py): a subscriber (the router) holds one ``steps`` stream and
``submit``s its requests into it; each engine step becomes ONE StepFrame carrying every one of
its requests' TokenChunk / GenerateResult / ErrorReply, so Ray carries one item per step, not
one per request per step:

    actor loop:  submit(sub, rid) --add--> EngineLoop.cmds        EngineLoop thread:
                 steps(sub) <--one wake per step-- sinks + flush    drain cmds; step(); dispatch

Cancellation (client gone, router timeout, explicit abort) becomes Engine.abort: the request
finishes "abort" and its KV blocks are freed. Expert pins are taken and released inside each
MoE layer's forward, so nothing stays pinned between steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import torch

from engine.errors import MoestreamError
from engine.agent.grammar import Constraint
from engine.layers.sampler import SamplingConfig
from protocol import HealthReply, SamplingParams, Usage, encode
from protocol.messages import DEFAULT_MAX_TOKENS
from services.decode_stream import Finished, StepStreams, Subscriber

log = logging.getLogger(__name__)

class EngineDeadError(MoestreamError):
    """The engine loop is gone (its thread died); protocol code ENGINE_DEAD."""


def sampling_config(p: SamplingParams | dict) -> SamplingConfig:
    """Wire sampling parameters -> the engine's SamplingConfig (validated again there)."""
    p = p if isinstance(p, SamplingParams) else SamplingParams.model_validate(p)
    return SamplingConfig(max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS, temperature=p.temperature, top_k=p.top_k,
                          top_p=p.top_p, min_p=p.min_p, repetition_penalty=p.repetition_penalty,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          seed=p.seed, stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids),
                          logprobs=p.logprobs, speculative=p.speculative,
                          num_speculative_tokens=p.num_speculative_tokens,
                          grammar=None if p.grammar is None else Constraint(p.grammar.kind, p.grammar.text))


def speculative_config(mode: str | None, max_draft: int, sm, dtype: torch.dtype, device: str):
    """``--speculative`` (ngram | self | draft:PATH) -> the engine's SpeculativeConfig (None: off).
    Requests speculate by default when a mode is set; ``speculative: false`` opts one out."""
    if mode is None:
        return None
    from engine.speculative import SpeculativeConfig

    if mode.startswith("draft:"):
        from engine.loading import load_model

        draft = load_model(mode[len("draft:"):], dtype=dtype)[0].to(device)
        return SpeculativeConfig("draft", max_draft=max_draft, draft_model=draft)
    return SpeculativeConfig(mode, max_draft=max_draft, cache=sm.cache)


@dataclass
class _Tracked:
    """Per-request figures the loop keeps to build Usage."""

    sink: Callable[[Any], None]
    prompt_tokens: int
    t_add: float
    hits0: int
    misses0: int
    bytes0: int
    gen0: int
    t_first: float | None = None
    t_last: float | None = None
    tokens: int = 0


class EngineLoop:
    """Runs ``Engine.step()`` on one thread. Everything that touches the engine happens here;
    callers talk to it through ``add``/``abort`` and get outputs through their sink."""

    def __init__(self, engine, cache=None, flush: Callable[[], None] | None = None) -> None:
        self.engine, self.cache = engine, cache
        self.flush = flush  # called after each round of commands and each step: sinks batch
        self.cmds: queue.SimpleQueue = queue.SimpleQueue()
        self.tracked: dict[str, _Tracked] = {}
        self.steps = 0
        self.error: BaseException | None = None
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stop

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingConfig,
            sink: Callable[[Any], None]) -> None:
        if not self.alive:
            raise EngineDeadError(f"the engine loop is not running ({self.error!r})")
        self.cmds.put(("add", request_id, prompt_ids, sampling, sink))

    def abort(self, request_id: str) -> None:
        self.cmds.put(("abort", request_id))

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the engine thread (for consistent stats); returns its result."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        self.cmds.put(("call", fn, done))
        ok, value = done.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._stop = True
        self.cmds.put(("stop",))
        self.thread.join(timeout=10)

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                block = not self.engine.has_unfinished()
                try:
                    cmd = self.cmds.get(timeout=0.5) if block else self.cmds.get_nowait()
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    self._command(cmd)
                    try:
                        cmd = self.cmds.get_nowait()
                    except queue.Empty:
                        cmd = None
                self._flush()
                if self.engine.has_unfinished():
                    self._step()
                    self._flush()
        except BaseException as e:  # a bug in the loop itself: fail everyone, stay dead
            self.error = e
            log.exception("engine loop died")
            for rid, t in list(self.tracked.items()):
                t.sink(EngineDeadError(f"engine loop died: {type(e).__name__}: {e}"))
            self.tracked.clear()
            self._flush()
            raise

    def _flush(self) -> None:
        if self.flush is not None:
            self.flush()

    def _command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, sampling, sink = cmd
            try:
                self.engine.add_request(rid, prompt, sampling)
            except Exception as e:  # validation / capacity: this request only
                sink(e)
                return
            hits, misses, nbytes = self._cache_totals()
            self.tracked[rid] = _Tracked(sink, len(prompt), time.perf_counter(), hits, misses,
                                         nbytes, self.engine._generated_tokens)
        elif kind == "abort":
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._deliver(out)
        elif kind == "call":
            _, fn, done = cmd
            try:
                done.put((True, fn()))
            except Exception as e:
                done.put((False, e))
        elif kind == "stop":
            self._stop = True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a failed forward (expert load error, ...): its requests fail
            log.warning("engine step failed: %s: %s", type(e).__name__, e)
            for rid in list(self.tracked):
                self.engine.abort(rid)  # frees their KV blocks
                self.tracked.pop(rid).sink(e)
            return
        self.steps += 1
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out) -> None:
        t = self.tracked.get(out.request_id)
        if t is None:
            return
        now = time.perf_counter()
        if out.new_token_ids:
            t.tokens += len(out.new_token_ids)
            t.t_first = t.t_first or now
            t.t_last = now
        if not out.finished:
            t.sink(out)
            return
        del self.tracked[out.request_id]
        t.sink(Finished(out, self._usage(t, out.spec, out.cached_tokens)))

    def _cache_totals(self) -> tuple[int, int, int]:
        if self.cache is None:
            return 0, 0, 0
        with self.cache.lock:
            m = self.cache.metrics.total()
        return m.hits, m.misses, m.bytes_to_device

    def _usage(self, t: _Tracked, spec=None, cached_tokens: int = 0) -> Usage:
        hits, misses, nbytes = self._cache_totals()
        dh, dm = hits - t.hits0, misses - t.misses0
        generated = self.engine._generated_tokens - t.gen0  # all sequences: bytes are shared
        prefill_s = (t.t_first - t.t_add) if t.t_first else 0.0
        decode_s = (t.t_last - t.t_first) if t.t_first and t.t_last else 0.0
        return Usage(
            prompt_tokens=t.prompt_tokens, completion_tokens=t.tokens,
            prefill_tokens_per_s=t.prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
            decode_tokens_per_s=(t.tokens - 1) / decode_s if decode_s > 0 and t.tokens > 1 else 0.0,
            expert_hit_rate=dh / (dh + dm) if self.cache is not None and dh + dm else None,
            expert_bytes_per_token=(nbytes - t.bytes0) / generated
            if self.cache is not None and generated else None,
            draft_tokens=spec.drafted if spec is not None else None,
            accepted_draft_tokens=spec.accepted if spec is not None else None,
            cached_tokens=cached_tokens)


class DecodeService:
    """Ray actor (async): thin shell over Engine + ExpertCache + PagedKVCache.

    ``source`` injects the ExpertSource (tests without Ray pass a HostTier); by default it is a
    LoaderPoolSource over the named loader actors of the namespace.
    """

    def __init__(self, config_json: str, loader_names: list[str] | None = None, *,
                 source=None, told: dict[str, Any] | None = None) -> None:
        from engine.experts.runtime import load_from_store
        from engine.kv.state import kv_cache_from_budget
        from engine.runner import Engine
        from engine.scheduler import SchedulerConfig
        from engine.store.reader import ExpertStore
        from services.budgets import decode_budgets
        from services.config import DeployConfig

        self.config = cfg = DeployConfig.model_validate_json(config_json)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # Ray starts a num_cpus=0 actor with OMP_NUM_THREADS=1; this actor is the node's compute
        # process, so it takes the cores for prefill (decode steps narrow it: engine/threads.py).
        torch.set_num_threads(cfg.compute_threads or os.cpu_count() or 1)
        # the store, opened once in this process: the loaders' source reads its manifest, the
        # budgets its tensor headers, the model its dense weights (self.sm owns and closes it)
        store = ExpertStore(cfg.store)
        if source is None:
            from services.expert_loader import LoaderPoolSource

            source = LoaderPoolSource(store, self._resolve(loader_names),
                                      fetch_timeout_s=cfg.fetch_timeout_s,
                                      fetch_attempts=cfg.fetch_attempts,
                                      direct_reads=cfg.direct_reads)
        self.source = source
        dtype = cfg.torch_dtype
        # budgets "auto": a device budget still auto is this device's (services/budgets.py);
        # ``told`` is the deployer's account of what it resolved
        self.budgets = decode_budgets(cfg, self.device, told, store=store)
        log.info("%s", self.budgets.line)
        self.sm = load_from_store(store, device_budget=self.budgets.device, policy=cfg.policy,
                                  admission=cfg.admission,
                                  prefetch_depth=cfg.prefetch_depth, source=source,
                                  device=self.device, dtype=dtype, dense=cfg.dense_format, head=cfg.head_format,
                                  io_threads=cfg.io_threads, ple_budget=cfg.ple_budget)
        from engine.executor import executor_for, kv_dtype

        if self.device == "cpu":
            # native kernels and the per-layer step handles before this actor reports healthy,
            # never inside the first request (a cache hit after `deploy/setup.sh`)
            from engine.options import configure

            configure(native_threads=cfg.compute_threads or 0)
            from engine.quant.kernels import load_extension

            load_extension()  # every native kernel (DeltaNet's decode step included), even for fp32 dense
            executor_for(self.sm.model).native()
        model_cfg = self.sm.store.config
        self.kv = kv_cache_from_budget(model_cfg, cfg.kv_budget, cfg.kv_block_size, dtype=kv_dtype(self.sm.model),
                                       device=self.device, max_seqs=cfg.max_num_seqs,
                                       prefix_cache=cfg.prefix_cache)
        self.engine = Engine(self.sm.model, self.sm.tokenizer, self.kv,
                             SchedulerConfig(max_num_batched_tokens=cfg.max_batched_tokens,
                                             max_num_seqs=cfg.max_num_seqs),
                             speculative=speculative_config(cfg.speculative, cfg.max_draft,
                                                            self.sm, dtype, self.device),
                             detokenize=False)  # text and stop strings: the router (text_stage)
        self.streams = StepStreams()  # outputs leave as one StepFrame per step (decode_stream)
        self.loop = EngineLoop(self.engine, self.sm.cache, flush=self.streams.flush).start()
        self.started = time.time()

    def _resolve(self, names: list[str] | None) -> dict[str, Any]:
        from services.handles import loader_handles

        return loader_handles(self.config.namespace, names)

    # ---- requests ----------------------------------------------------------------------------
    async def steps(self, subscriber: str) -> AsyncIterator[list[bytes]]:
        """The subscriber's stream: one StepFrame per engine step that produced output for any
        of its requests (TokenChunk per request that got tokens, GenerateResult or ErrorReply
        per request that ended), numbered from 0. Open it before submitting; when it ends
        (the consumer went away) its running requests are aborted and their KV freed."""
        async for frame in self.streams.frames(self.streams.subscriber(subscriber), self.loop.abort):
            yield frame

    async def submit(self, subscriber: str, request_id: str, prompt_ids: list[int],
                     sampling: dict) -> None:
        """Start a request whose output goes to ``subscriber``'s step stream; a refusal (bad
        sampling, id in use, engine dead) arrives there as its ErrorReply. Never raises."""
        self._submit(self.streams.subscriber(subscriber), request_id, prompt_ids, sampling)

    def _submit(self, sub: Subscriber, request_id: str, prompt_ids: list[int], sampling: dict) -> None:
        try:
            params = SamplingParams.model_validate(sampling)
            sink = self.streams.open(sub, request_id, len(prompt_ids), bool(params.logprobs))
            try:
                self.loop.add(request_id, list(prompt_ids), sampling_config(params), sink)
            except Exception:
                self.streams.forget(request_id)
                raise
        except Exception as e:
            self.streams.refuse(sub, request_id, e)

    async def abort(self, request_id: str) -> None:
        """Finish ``request_id`` with reason "abort" and free its KV blocks (no-op if unknown)."""
        self.loop.abort(request_id)

    # ---- membership and knobs ----------------------------------------------------------------
    async def set_loaders(self, names: list[str]) -> list[str]:
        """Route expert fetches to exactly these loader actors from now on."""
        handles = self._resolve(names)
        self.source.set_loaders(handles)
        return sorted(handles)

    async def set_direct_reads(self, enabled: bool) -> None:
        self.source.direct_reads = bool(enabled)

    # ---- health and figures ------------------------------------------------------------------
    async def check_health(self) -> None:
        """Raises when the engine cannot serve; Ray's health checks call this."""
        if not self.loop.alive:
            raise EngineDeadError(f"engine loop is dead: {self.loop.error!r}")

    async def stats(self) -> dict[str, Any]:
        def snapshot() -> dict[str, Any]:
            kv = self.kv.metrics()
            cache = self.sm.cache
            with cache.lock:
                pins, loading = dict(cache.pins), len(cache.loading)
            summary = cache.metrics.summary(self.source.counters())
            sched = self.engine.scheduler
            return {"kv_blocks_used": kv.blocks_used, "kv_blocks_total": kv.blocks_total,
                    "kv_sequences": kv.num_sequences, "expert_pins": sum(pins.values()),
                    "experts_loading": loading, "running": len(sched.running),
                    "waiting": len(sched.waiting), "steps": self.loop.steps,
                    "step_frames": self.streams.frames_sent,
                    "device_hit_rate": summary["device_hit_rate"],
                    "device_misses": summary["device_misses"],
                    "bytes_to_device_per_token": summary["bytes_to_device_per_token"],
                    "source": self.source.stats() if hasattr(self.source, "stats") else {},
                    "device": self.device, "compute_threads": torch.get_num_threads(),
                    "io_threads": self.sm.cache.pool._max_workers,
                    "device_budget": self.budgets.device, "ram_budget": self.budgets.ram,
                    "budgets": self.budgets.line,
                    # additive: what the HTTP front end's /metrics exports (services/http)
                    "cache": summary, "engine": self._engine_totals()}

        return await asyncio.to_thread(self.loop.call, snapshot)

    def _engine_totals(self) -> dict[str, int]:
        """Token totals of the engine (engine thread only): computed counts recomputation."""
        m = self.engine.metrics()
        return {"prompt_tokens": m.prompt_tokens, "generated_tokens": m.generated_tokens,
                "computed_tokens": m.computed_tokens, "preemptions": m.preemptions,
                "steps": m.steps, "prefix_query_tokens": m.prefix_query_tokens,
                "prefix_hit_tokens": m.prefix_hit_tokens}

    async def health(self) -> list[bytes]:
        ok = self.loop.alive
        detail: dict[str, Any] = {"device": self.device, "uptime_s": round(time.time() - self.started, 1)}
        if ok:
            s = await self.stats()
            detail.update({k: v for k, v in s.items() if isinstance(v, (int, float, str))})
        else:
            detail["error"] = repr(self.loop.error)[:1000]
        return encode(HealthReply(service="decode", ok=ok, detail=detail))

    async def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def close(self) -> None:
        self.loop.stop()
        self.sm.close()
