"""The HTTP server: aiohttp on the event loop of a detached Ray actor, in front of the router.

    GET  /health                 no auth; 200 when the router reaches a live decode actor, else 503
    GET  /metrics                Prometheus text (services.http.metrics)
    GET  /v1/models[/{id}]       the one served model
    POST /v1/chat/completions    chat; SSE when "stream": true
    POST /v1/completions         text or token-id prompt; SSE when "stream": true
    POST /v1/messages            Anthropic's Messages API (services/http/anthropic_api.py)
    POST /v1/messages/count_tokens

Every endpoint but /health needs ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) when a
key is configured; errors on /v1/messages* come in Anthropic's shape, elsewhere in OpenAI's; only
the key's sha256 reaches the actor, and digests are compared with ``hmac.compare_digest``.
A request is wire frames to ``router.submit`` into this actor's one step stream from the router
(``router.steps``: one StepFrame per engine step for all its requests, services/step_mux.py);
the response starts only when the first message is back, so a refusal before the first token is a
proper HTTP status: BUSY (queue full) -> 429 with Retry-After, not ready -> 503, bad request
-> 400. A client that goes away (the handler is cancelled, or a write fails) gets its request
cancelled at the router, which aborts it in the engine: its KV blocks are freed and no further
token is computed for it.

The actor starts its server from ``__init__`` (a call to itself that runs right after), so a
restart by Ray serves again on the same address.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from protocol import ErrorCode, ErrorReply, GenerateRequest, GenerateResult, HealthReply, TokenChunk, decode, encode
from services import handles
from services.http.anthropic_api import ANTHROPIC_PREFIX, AnthropicEndpoints
from services.http.anthropic_schemas import error_body as anthropic_error
from services.http.metrics import CONTENT_TYPE, Metrics
from services.http.openai_format import (
    FINISH,
    SSE_DONE,
    Formatter,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
    sse,
    usage_block,
)
from services.http.schemas import ChatCompletionRequest, CompletionRequest, OpenAIError, parse_body
from services.step_mux import RequestStream, StepSubscription

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class HttpSettings(BaseModel):
    """How the HTTP actor listens and what it serves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Address to bind; loopback unless configured.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    namespace: str = Field(handles.NAMESPACE, description="Ray namespace of the router and decode actors.")
    model_name: str = Field(min_length=1, max_length=256, description="The id /v1/models lists "
                            "and requests must name.")
    api_key_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="sha256 hex "
                                       "of the bearer key; None: no authentication.")
    retry_after_s: int = Field(1, ge=1, le=3600, description="Retry-After of a 429.")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="Largest request body accepted.")
    stats_timeout_s: float = Field(5.0, gt=0, description="How long /metrics and /health wait "
                                   "for an actor.")


BIND_RETRY_S = 30.0  # how long a (re)started server retries a fixed port still in use


@dataclass
class _Run:
    """One submitted request while a handler answers it (HttpService._request)."""

    gen: RequestStream
    first: Any = None
    over: bool = False


class HttpService(AnthropicEndpoints):
    """Ray actor (async). ``router``/``decode`` default to the named actors of the namespace."""

    def __init__(self, settings_json: str, *, router=None, decode=None, autostart: bool = True) -> None:
        self.settings = HttpSettings.model_validate_json(settings_json)
        self._router, self._decode = router, decode
        self.metrics = Metrics()
        self.runner: web.AppRunner | None = None
        self.bound: tuple[str, int] | None = None
        self.error: str | None = None
        self._digest = bytes.fromhex(self.settings.api_key_sha256) if self.settings.api_key_sha256 else None
        self.started_at = time.time()
        self._steps: StepSubscription | None = None  # the router's step stream (services/step_mux)
        if autostart:
            import ray

            try:  # runs on the actor's event loop as soon as __init__ returns
                ray.get_runtime_context().current_actor.start.remote()
            except Exception as e:  # not inside an actor: the caller calls start()
                log.debug("no autostart: %s", e)

    # ---- handles -----------------------------------------------------------------------------
    @property
    def router(self):
        if self._router is None:
            self._router = handles.router(self.settings.namespace)
        return self._router

    @property
    def decode(self):
        if self._decode is None:
            self._decode = handles.decode(self.settings.namespace)
        return self._decode

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> list:
        """Bind and serve (idempotent); returns [host, port]."""
        if self.bound is not None:
            return list(self.bound)
        if self.runner is not None:  # another start() is binding
            while self.bound is None and self.error is None:
                await asyncio.sleep(0.01)
        else:
            try:
                app = web.Application(middlewares=[self._middleware],
                                      client_max_size=self.settings.max_body_bytes)
                app.router.add_get("/health", self.h_health)
                app.router.add_get("/metrics", self.h_metrics)
                app.router.add_get("/v1/models", self.h_models)
                app.router.add_get("/v1/models/{model_id:.+}", self.h_model)
                app.router.add_post("/v1/chat/completions", self.h_chat)
                app.router.add_post("/v1/completions", self.h_completions)
                app.router.add_post("/v1/messages", self.h_messages)
                app.router.add_post("/v1/messages/count_tokens", self.h_count_tokens)
                self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
                await self.runner.setup()
                site = await self._listen()
                sock = site._server.sockets[0].getsockname()  # the real port when port=0
                self.bound = (self.settings.host, int(sock[1]))
                log.info("serving the OpenAI API on http://%s:%d", *self.bound)
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
                raise
        if self.bound is None:
            raise RuntimeError(f"the HTTP server did not start: {self.error}")
        return list(self.bound)

    async def _listen(self) -> web.TCPSite:
        """Bind; a restart by Ray can come before the killed process's listening socket is gone,
        so "address in use" on a fixed port is retried for BIND_RETRY_S."""
        deadline = time.monotonic() + BIND_RETRY_S
        while True:
            site = web.TCPSite(self.runner, self.settings.host, self.settings.port)
            try:
                await site.start()
                return site
            except OSError as e:
                await site.stop()  # unregisters it from the runner
                if e.errno != errno.EADDRINUSE or not self.settings.port or time.monotonic() > deadline:
                    raise
                log.warning("port %d in use; retrying", self.settings.port)
                await asyncio.sleep(0.2)

    async def address(self, timeout_s: float = 60.0) -> list:
        """[host, port] once listening (waits for the autostart); raises its error."""
        deadline = time.monotonic() + timeout_s
        while self.bound is None:
            if self.error is not None:
                raise RuntimeError(f"the HTTP server did not start: {self.error}")
            if time.monotonic() > deadline:
                raise TimeoutError("the HTTP server did not start in time")
            await asyncio.sleep(0.02)
        return list(self.bound)

    async def check_health(self) -> None:
        if self.bound is None:
            raise RuntimeError(f"not listening ({self.error or 'starting'})")

    async def health(self) -> list[bytes]:
        ok = self.bound is not None
        detail: dict[str, Any] = {"address": f"{self.bound[0]}:{self.bound[1]}" if ok else "",
                                  "pid": os.getpid(), "model": self.settings.model_name[:64]}
        if self.error:
            detail["error"] = self.error[:1000]
        return encode(HealthReply(service="http", ok=ok, detail=detail))

    async def close(self) -> None:
        if self._steps is not None:
            self._steps.close()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner, self.bound = None, None

    # ---- middleware: auth, errors, counting --------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        try:
            try:
                if request.path != "/health":
                    self._authorize(request)
                resp = await handler(request)
            except web.HTTPException as e:  # 404 / 405 from routing
                raise OpenAIError(e.status, f"{request.method} {request.path}: {e.reason}",
                                  code="not_found" if e.status == 404 else "method_not_allowed") from None
            except (asyncio.CancelledError, ConnectionResetError, OpenAIError):
                raise
            except Exception as e:
                log.exception("unhandled error on %s", request.path)
                raise OpenAIError(500, f"internal error: {type(e).__name__}: {e}"[:2000],
                                  code="internal") from None
        except OpenAIError as e:  # in the shape of the API the path belongs to
            body = anthropic_error(e) if request.path.startswith(ANTHROPIC_PREFIX) else e.body()
            resp = web.json_response(body, status=e.status, headers=e.headers)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.requests.labels(endpoint, "499").inc()
            raise
        self.metrics.requests.labels(endpoint, str(resp.status)).inc()
        return resp

    def _authorize(self, request: web.Request) -> None:
        """``Authorization: Bearer KEY`` or (Anthropic's clients) ``x-api-key: KEY``."""
        if self._digest is None:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if "x-api-key" in request.headers:
            scheme, token = "bearer", request.headers["x-api-key"]
        given = hashlib.sha256(token.strip().encode("utf-8")).digest()
        # compare_digest on every request whatever the scheme, so timing says nothing
        ok = hmac.compare_digest(given, self._digest)
        if not ok or scheme.lower() != "bearer":
            raise OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' "
                              "(or 'x-api-key: KEY')", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})

    # ---- simple endpoints --------------------------------------------------------------------
    async def h_health(self, request: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(self.router.check_health.remote(), self.settings.stats_timeout_s)
        except Exception as e:
            return web.json_response({"status": "unavailable", "error": f"{type(e).__name__}: {e}"[:500]},
                                     status=503)
        return web.json_response({"status": "ok"})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.settings.model_name, "object": "model", "created": int(self.started_at),
                "owned_by": "moestream"}

    async def h_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def h_model(self, request: web.Request) -> web.Response:
        mid = request.match_info["model_id"]
        if mid != self.settings.model_name:
            raise OpenAIError(404, f"model {mid!r} does not exist; served: {self.settings.model_name!r}",
                              param="model", code="model_not_found")
        return web.json_response(self._model_card())

    async def h_metrics(self, request: web.Request) -> web.Response:
        body = self.metrics.render(await self._snapshot())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _snapshot(self) -> dict[str, Any]:
        t = self.settings.stats_timeout_s

        async def call(ref):
            try:
                return await asyncio.wait_for(ref, t)
            except Exception as e:
                log.debug("metrics: %s", e)
                return None

        dec, router = await asyncio.gather(call(self.decode.stats.remote()),
                                           call(self.router.stats.remote()))
        snap: dict[str, Any] = {"decode": dec, "router": router}
        names = ((dec or {}).get("source") or {}).get("loaders")
        if names is not None:
            async def alive(name: str) -> bool:
                try:
                    h = handles.actor(name, self.settings.namespace)
                    await asyncio.wait_for(h.check_health.remote(), min(t, 2.0))
                    return True
                except Exception:
                    return False

            oks = await asyncio.gather(*(alive(n) for n in names))
            snap["loaders"] = dict(zip(names, oks))
        return snap

    # ---- generation --------------------------------------------------------------------------
    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    def _check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise OpenAIError(400, f"model: {name!r} is not served here; available: "
                              f"[{self.settings.model_name!r}] (GET /v1/models)", param="model",
                              code="model_not_found")

    async def _next(self, gen: RequestStream) -> Any:
        return await gen.next()

    async def _open(self, greq: GenerateRequest) -> RequestStream:
        """Submit to the router into this actor's one step stream (a new one after a failure):
        one Ray item per engine step for all requests, not one per request per step."""
        if self._steps is None or not self._steps.alive:
            self._steps = StepSubscription(self.router, "http")
        stream = RequestStream(self._steps, greq.request_id)
        try:
            refused = await self.router.submit.remote(self._steps.name, encode(greq))
        except Exception as e:  # the router is gone (Ray restarts it)
            stream.close()
            return RequestStream.of(greq.request_id, ErrorReply.from_exception(e, greq.request_id))
        if refused is not None:
            stream.close()
            return RequestStream.of(greq.request_id, decode(refused)[0])
        return stream

    def _refusal(self, reply: ErrorReply) -> OpenAIError:
        code = ErrorCode(reply.code)
        if code is ErrorCode.BUSY:
            return OpenAIError(429, reply.message, code="queue_full",
                               headers={"Retry-After": str(self.settings.retry_after_s)})
        return OpenAIError(code.http_status, reply.message, code=code.value)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = parse_body(ChatCompletionRequest if kind == "chat" else CompletionRequest,
                          await request.read())
        self._check_model(body.model)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        greq = body.to_generate(rid)
        stream = greq.stream
        want_lp = greq.sampling.logprobs is not None
        if want_lp and not stream:  # logprobs ride on the token chunks: stream them internally
            greq = greq.model_copy(update={"stream": True})
        fmt = Formatter(kind, rid, self.settings.model_name, body.include_usage)
        async with self._request(greq) as run:
            if stream:
                resp, run.over = await self._stream(request, run.gen, run.first, fmt, kind, t0)
            else:
                resp, run.over = await self._collect(run.gen, run.first, fmt, kind, t0)
            return resp

    @contextlib.asynccontextmanager
    async def _request(self, greq: GenerateRequest):
        """Submit ``greq`` and wait for its first message; yields the run (``gen``: its stream,
        ``first``: that message). A refusal before any token raises its HTTP error. The body
        sets ``run.over`` once the request has ended; left False (the client went away, the
        handler was cancelled) the request is cancelled at the router, which aborts it in the
        engine and frees its KV blocks."""
        run = _Run(await self._open(greq))
        self.metrics.in_flight.inc()
        try:
            run.first = await self._next(run.gen)
            if run.first is None:
                run.over = True
                raise OpenAIError(503, "the pipeline ended the request without an answer",
                                  code=ErrorCode.ENGINE_DEAD.value)
            if isinstance(run.first, ErrorReply):
                run.over = True
                raise self._refusal(run.first)
            yield run
        finally:
            run.gen.close()
            self.metrics.in_flight.dec()
            if not run.over:
                self.metrics.aborted.inc()
                self.router.cancel.remote(greq.request_id)

    async def _texts(self, chunk: TokenChunk, cache: dict[int, str]) -> dict[int, str]:
        ids = list(chunk.token_ids)
        for alts in chunk.top_logprobs or ():
            ids += [a.token_id for a in alts]
        missing = [i for i in dict.fromkeys(ids) if i not in cache]
        if missing:
            cache.update(zip(missing, await self.router.token_strings.remote(missing)))
        return cache

    def _observe_tokens(self, n: int, t0: float, state: dict) -> None:
        now = time.perf_counter()
        if state["last"] is None:
            self.metrics.ttft.observe(now - t0)
        else:
            self.metrics.itl.observe(now - state["last"])
        for _ in range(n - 1):
            self.metrics.itl.observe(0.0)
        state["last"] = now

    def _bill(self, result: GenerateResult, sent: int) -> None:
        self.metrics.prompt_tokens.inc(result.usage.prompt_tokens)
        self.metrics.generation_tokens.inc(sent)

    async def _stream(self, request, gen, msg, fmt: Formatter, kind: str, t0: float):
        """SSE until the GenerateResult; returns (response, whether the request is over)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", "X-Request-Id": fmt.id})
        await resp.prepare(request)
        state: dict[str, Any] = {"last": None}
        texts: dict[int, str] = {}
        sent, offset, errored, called = 0, 0, False, False
        try:
            if kind == "chat":
                await resp.write(fmt.chunk(role=True))
            while True:
                if msg is None:
                    if not errored:
                        await resp.write(sse(OpenAIError(503, "the pipeline ended the stream "
                                                         "early", code="engine_dead").body()))
                    break
                if errored:  # after an error: drain what the router still sends, write nothing
                    if isinstance(msg, GenerateResult):
                        break
                elif isinstance(msg, TokenChunk):
                    self._observe_tokens(len(msg.token_ids), t0, state)
                    lp = None
                    if msg.logprobs is not None:
                        await self._texts(msg, texts)
                        lp = chat_logprobs(msg, texts) if kind == "chat" else \
                            completion_logprobs(msg, texts, offset)
                    sent += len(msg.token_ids)
                    offset += len(msg.text)
                    called = called or bool(msg.tool_calls)
                    if msg.text or lp is not None or msg.reasoning or msg.tool_calls:
                        await resp.write(fmt.chunk(msg.text, logprobs=lp, reasoning=msg.reasoning,
                                                   tool_calls=msg.tool_calls))
                elif isinstance(msg, ErrorReply):
                    errored = True
                    await resp.write(sse(self._refusal(msg).body()))
                elif isinstance(msg, GenerateResult):
                    finish = FINISH[msg.finish_reason]
                    await resp.write(fmt.chunk(final=True, finish="tool_calls" if called and finish == "stop"
                                               else finish))
                    if fmt.include_usage:
                        await resp.write(fmt.usage_chunk(usage_block(msg.usage, sent)))
                    self._bill(msg, sent)
                    break
                msg = await self._next(gen)
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            return resp, False  # the client is gone mid-stream
        self.metrics.e2e.observe(time.perf_counter() - t0)
        return resp, True

    async def _collect(self, gen, msg, fmt: Formatter, kind: str, t0: float):
        """A non-streaming answer (chunks arrive only when logprobs were asked for)."""
        texts: dict[int, str] = {}
        chat_lp: list[dict] = []
        text_lp: list[dict] = []
        offset = 0
        while True:
            if msg is None:
                raise OpenAIError(503, "the pipeline ended the request early", code="engine_dead")
            if isinstance(msg, ErrorReply):
                err = self._refusal(msg)
                # drain what may follow (a GenerateResult "error"), so the request is over
                while msg is not None and not isinstance(msg, GenerateResult):
                    msg = await self._next(gen)
                return web.json_response(err.body(), status=err.status, headers=err.headers), True
            if isinstance(msg, TokenChunk) and msg.logprobs is not None:
                await self._texts(msg, texts)
                if kind == "chat":
                    chat_lp += chat_logprobs(msg, texts)["content"]
                else:
                    text_lp.append(completion_logprobs(msg, texts, offset))
                offset += len(msg.text)
            elif isinstance(msg, GenerateResult):
                break
            msg = await self._next(gen)
        lp = None
        if msg.usage is not None and (chat_lp or text_lp):
            lp = {"content": chat_lp, "refusal": None} if kind == "chat" else merge_completion_logprobs(text_lp)
        self._bill(msg, len(msg.token_ids))
        self.metrics.e2e.observe(time.perf_counter() - t0)
        return web.Response(text=json.dumps(fmt.final(msg, lp), ensure_ascii=False),
                            content_type="application/json"), True
