"""The decode actor's way out: one StepFrame per engine step per subscriber, not one Ray
streaming item per request per step.

A subscriber (the router) opens one long-lived stream (``DecodeService.steps``) and submits its
requests into it (``DecodeService.submit``). The engine thread hands each output to the request's
sink, which only appends it to the subscriber's pending list; once per step (EngineLoop's flush)
every subscriber with pending outputs is woken with one ``call_soon_threadsafe``. Its stream then
turns everything pending into protocol messages (TokenChunk, GenerateResult, ErrorReply) and
sends them as StepFrames (protocol.steps: one frame unless the codec's bounds need more):

    engine thread:  step() -> sink(out) x N requests -> flush(): wake each subscriber once
    actor loop:     steps(sub): wait -> take pending -> messages -> StepFrame -> one Ray item

A subscriber's stream ending (the router went away, or was cancelled) aborts every request it
still had running, as a per-request stream's consumer going away did.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from engine.errors import RequestValidationError
from protocol import ErrorReply, GenerateResult, TokenChunk, Usage, encode
from protocol.steps import step_frames

log = logging.getLogger(__name__)


@dataclass
class Finished:
    """The last output of a request, with its usage figures."""

    output: Any  # engine.runner.RequestOutput
    usage: Usage


@dataclass(eq=False)
class Subscriber:
    """One consumer of step frames and the requests it submitted."""

    name: str
    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    pending: list[tuple[str, Any]] = field(default_factory=list)  # (request id, engine output)
    requests: set[str] = field(default_factory=set)
    seq: int = 0  # the next frame's number
    frames: int = 0  # frames sent


@dataclass
class _Request:
    sub: Subscriber
    prompt_tokens: int
    top_logprobs: bool
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


class StepStreams:
    """Every subscriber of one decode actor and every request in flight, by id. The engine
    thread calls the sinks and :meth:`flush`; everything else runs on the actor's loop."""

    def __init__(self) -> None:
        self.subscribers: dict[str, Subscriber] = {}
        self.requests: dict[str, _Request] = {}
        self._lock = threading.Lock()  # pending lists and the dirty set: both threads
        self._dirty: set[Subscriber] = set()
        self.frames_sent = 0  # StepFrames sent, every subscriber

    def subscriber(self, name: str) -> Subscriber:
        """The subscriber ``name``, made on first use (by its stream or its first submit,
        whichever the actor runs first)."""
        sub = self.subscribers.get(name)
        if sub is None:
            sub = self.subscribers[name] = Subscriber(name, asyncio.get_running_loop())
        return sub

    # ---- requests in ---------------------------------------------------------------------------
    def open(self, sub: Subscriber, request_id: str, prompt_tokens: int, top_logprobs: bool
             ) -> Callable[[Any], None]:
        """Register a request of ``sub``; returns the sink the engine thread feeds."""
        if request_id in self.requests:
            raise RequestValidationError(f"request id {request_id!r} is already in use")
        self.requests[request_id] = _Request(sub, prompt_tokens, top_logprobs)
        sub.requests.add(request_id)
        return lambda item: self._put(sub, request_id, item)

    def forget(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.sub.requests.discard(request_id)

    def refuse(self, sub: Subscriber, request_id: str, error: BaseException) -> None:
        """A request that never reached the engine: its ErrorReply goes out with the next frame
        (actor loop only)."""
        self._put(sub, request_id, error)
        sub.wake.set()

    def _put(self, sub: Subscriber, request_id: str, item: Any) -> None:
        with self._lock:
            sub.pending.append((request_id, item))
            self._dirty.add(sub)

    def flush(self) -> None:
        """Wake every subscriber that got outputs since the last flush (engine thread, once per
        step and once per round of commands)."""
        with self._lock:
            if not self._dirty:
                return
            dirty, self._dirty = self._dirty, set()
        for sub in dirty:
            try:
                sub.loop.call_soon_threadsafe(sub.wake.set)
            except RuntimeError:  # the actor's loop is closed (shutdown)
                pass

    # ---- messages out --------------------------------------------------------------------------
    async def batches(self, sub: Subscriber, abort: Callable[[str], None]
                      ) -> AsyncIterator[tuple[list[TokenChunk | GenerateResult | ErrorReply], list[str]]]:
        """The messages for ``sub``'s requests and the ids of those that ended, one batch per
        wake-up (normally one step). An output that cannot become a message fails its own
        request only (aborted, ErrorReply)."""
        while True:
            await sub.wake.wait()
            sub.wake.clear()
            with self._lock:
                items, sub.pending = sub.pending, []
            out: list = []
            ended: list[str] = []
            for request_id, item in items:
                try:
                    msgs, over = self._messages(sub, request_id, item)
                except Exception as e:
                    log.exception("request %s: output not sendable", request_id)
                    if request_id not in sub.requests:
                        continue
                    self.forget(request_id)
                    abort(request_id)
                    msgs, over = [ErrorReply.from_exception(e, request_id)], True
                out += msgs
                if over:
                    ended.append(request_id)
            if out or ended:
                yield out, ended

    async def frames(self, sub: Subscriber, abort: Callable[[str], None]) -> AsyncIterator[list[bytes]]:
        """``sub``'s stream: its messages as encoded StepFrames numbered from 0, one per wake-up
        unless the codec's bounds need more. When the stream ends (its consumer went away) the
        subscriber is dropped and ``abort`` is called for each of its requests still running."""
        try:
            async for messages, ended in self.batches(sub, abort):
                for frame in step_frames(messages, sub.seq, ended):
                    sub.seq, sub.frames = frame.seq + 1, sub.frames + 1
                    self.frames_sent += 1
                    yield encode(frame)
        finally:
            for request_id in self.close(sub):
                abort(request_id)

    def close(self, sub: Subscriber) -> list[str]:
        """Drop ``sub``; returns the ids of its requests still running (to abort)."""
        if self.subscribers.get(sub.name) is sub:
            del self.subscribers[sub.name]
        running = sorted(sub.requests)
        for request_id in running:
            self.forget(request_id)
        return running

    def _messages(self, sub: Subscriber, request_id: str, item: Any) -> tuple[list, bool]:
        """One engine output (RequestOutput, Finished or an exception) -> its messages and
        whether the request is over: a TokenChunk when tokens came; the GenerateResult when it
        finished; an ErrorReply on failure, followed by a GenerateResult with finish_reason
        "error" if tokens had been streamed."""
        req = self.requests.get(request_id)
        if req is None or req.sub is not sub:  # refused before it was registered
            if isinstance(item, BaseException):
                return [ErrorReply.from_exception(item, request_id)], True
            return [], False  # a late output of a request whose subscriber went away
        if isinstance(item, BaseException):
            self.forget(request_id)
            out: list = [ErrorReply.from_exception(item, request_id)]
            if req.ids:
                out.append(self._result(request_id, req, "error", None))
            return out, True
        out = []
        o = item.output if isinstance(item, Finished) else item
        if o.new_token_ids or o.new_text:
            req.ids += o.new_token_ids
            req.text.append(o.new_text)
            lps = [float(lp["logprob"]) for lp in o.logprobs] if o.logprobs else None
            tops = ([[{"token_id": i, "logprob": v} for i, v in lp.get("top", ())]
                     for lp in o.logprobs] if o.logprobs and req.top_logprobs else None)
            out.append(TokenChunk(request_id=request_id, token_ids=o.new_token_ids, text=o.new_text,
                                  logprobs=lps, top_logprobs=tops))
        if isinstance(item, Finished):
            self.forget(request_id)
            out.append(self._result(request_id, req, o.finish_reason or "stop", item.usage))
            return out, True
        return out, False

    @staticmethod
    def _result(rid: str, req: _Request, reason: str, usage: Usage | None) -> GenerateResult:
        usage = usage or Usage(prompt_tokens=req.prompt_tokens, completion_tokens=len(req.ids),
                               prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0)
        return GenerateResult(request_id=rid, text="".join(req.text), token_ids=req.ids,
                              finish_reason=reason, usage=usage)
