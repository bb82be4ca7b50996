"""Anthropic's Messages API on the HTTP actor (mixed into services.http.server.HttpService):

    POST /v1/messages               a message, or its events when "stream": true
    POST /v1/messages/count_tokens  {"input_tokens": N}: what the prompt renders to

The request becomes the same GenerateRequest the OpenAI chat endpoint makes
(services/http/anthropic_schemas.py), goes through the same router, chat template and
reasoning / tool-call parsers, and comes back as Anthropic's content blocks and events
(services/http/anthropic_format.py). Keys (``x-api-key`` or ``Authorization: Bearer``), limits
(a full queue is a 429 with Retry-After) and refusals are the server's; errors are in
Anthropic's shape (the server's middleware picks it by path).
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web
from pydantic import ValidationError

from protocol import ErrorReply, GenerateRequest, GenerateResult, SamplingParams, TokenChunk, decode, encode
from services.http.anthropic_format import MessageFormatter
from services.http.anthropic_schemas import CountTokensRequest, MessagesRequest, error_body
from services.http.errors import OpenAIError, invalid
from services.http.schemas import parse_body

ANTHROPIC_PREFIX = "/v1/messages"


class AnthropicEndpoints:
    """Handlers of /v1/messages*; use HttpService's settings, router, metrics and _request."""

    async def h_messages(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = parse_body(MessagesRequest, await request.read())
        self._check_model(body.model)
        rid = "msg_" + uuid.uuid4().hex
        greq = body.to_generate(rid)
        fmt = MessageFormatter(rid, self.settings.model_name)
        async with self._request(greq) as run:
            if greq.stream:
                resp, run.over = await self._message_events(request, run, fmt, t0)
            else:
                resp, run.over = await self._message(run, fmt, t0)
            return resp

    async def h_count_tokens(self, request: web.Request) -> web.Response:
        body = parse_body(CountTokensRequest, await request.read())
        self._check_model(body.model)
        try:
            greq = GenerateRequest(request_id="count-" + uuid.uuid4().hex,
                                   sampling=SamplingParams(max_tokens=1), **body.generate_fields())
        except ValidationError as e:
            raise invalid(e) from None
        n = await self.router.count_tokens.remote(encode(greq))
        if not isinstance(n, int):
            raise self._refusal(decode(n)[0])
        return web.json_response({"input_tokens": n})

    async def _message(self, run, fmt: MessageFormatter, t0: float):
        """The whole message (a request that is not streamed sends only its result)."""
        msg = run.first
        while not isinstance(msg, GenerateResult):
            if msg is None:
                raise OpenAIError(503, "the pipeline ended the request early", code="engine_dead")
            if isinstance(msg, ErrorReply):
                err = self._refusal(msg)
                while msg is not None and not isinstance(msg, GenerateResult):  # drain
                    msg = await self._next(run.gen)
                run.over = True
                raise err
            msg = await self._next(run.gen)
        self._bill(msg, len(msg.token_ids))
        self.metrics.e2e.observe(time.perf_counter() - t0)
        return web.Response(text=json.dumps(fmt.message(msg), ensure_ascii=False),
                            content_type="application/json", headers={"request-id": fmt.id}), True

    async def _message_events(self, request: web.Request, run, fmt: MessageFormatter, t0: float):
        """Server-sent events until the result; returns (response, whether the request is over)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", "request-id": fmt.id})
        await resp.prepare(request)
        state = {"last": None}
        msg, sent, errored = run.first, 0, False
        try:
            await resp.write(fmt.start())
            while True:
                if msg is None:
                    if not errored:
                        await resp.write(fmt.error(error_body(OpenAIError(
                            503, "the pipeline ended the stream early", code="engine_dead"))))
                    break
                if errored:  # after an error: drain what the router still sends, write nothing
                    if isinstance(msg, GenerateResult):
                        break
                elif isinstance(msg, TokenChunk):
                    self._observe_tokens(len(msg.token_ids), t0, state)
                    sent += len(msg.token_ids)
                    out = fmt.chunk(msg)
                    if out:
                        await resp.write(out)
                elif isinstance(msg, ErrorReply):
                    errored = True
                    await resp.write(fmt.error(error_body(self._refusal(msg))))
                elif isinstance(msg, GenerateResult):
                    await resp.write(fmt.finish(msg, sent))
                    self._bill(msg, sent)
                    break
                msg = await self._next(run.gen)
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            return resp, False  # the client is gone mid-stream
        self.metrics.e2e.observe(time.perf_counter() - t0)
        return resp, True
