"""Both ends of a step stream between actors, in the shape the decode actor's has
(services/decode_stream.py): a consumer subscribes once and submits its requests into it; the
producer sends ONE StepFrame per batch of outputs for all of them (normally one engine step);
the consumer demultiplexes the frames into one asyncio.Queue per request. So Ray carries one
item per step whatever the number of streams, and each request's messages arrive in order.

    decode  --StepFrame per step-->  router (StepSubscription)
    router (Outbox, after the text stage)  --StepFrame per step-->  HTTP actor (StepSubscription)
                                           --StepFrame per step-->  a client's request (its own
                                              subscriber; streamed, or long-polled: Ray client)

A request's queue receives its messages, then ``None`` once the frame lists it as ended. Frames
are decoded with the codec's limits and must be StepFrames numbered without gaps. When the
stream fails (the producer actor died: a Ray error), ends, or sends a bad frame, every request
registered on it gets the exception and then ``None``, and the subscription is dead; the next
request opens a new one, which Ray sends to the restarted actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

from protocol import ErrorCode, ErrorReply, GenerateResult, ProtocolError, StepFrame, TokenChunk, decode, encode
from protocol.steps import step_frames

log = logging.getLogger(__name__)


class StepSubscription:
    """The consumer's end: ``handle.steps.remote(name)`` read by one task."""

    def __init__(self, handle: Any, prefix: str) -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:16]}"
        self.queues: dict[str, asyncio.Queue] = {}
        self.frames = 0  # StepFrames received
        self.messages = 0  # messages they carried
        self.error: BaseException | None = None
        # the stream is asked for before any submit of this subscription (same caller, so Ray
        # sends it first; a producer also accepts a submit that arrives first)
        self._stream = handle.steps.remote(self.name)
        self.task = asyncio.get_running_loop().create_task(self._pump())

    @property
    def alive(self) -> bool:
        return self.error is None and not self.task.done()

    def register(self, request_id: str) -> asyncio.Queue:
        """The queue ``request_id``'s messages (then None; or the stream's failure) arrive on."""
        q: asyncio.Queue = asyncio.Queue()
        if self.error is not None:
            q.put_nowait(self.error)
            q.put_nowait(None)
        self.queues[request_id] = q
        return q

    def unregister(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    async def _pump(self) -> None:
        try:
            async for ref in self._stream:
                frame, _ = decode(await ref, expect=StepFrame)
                if frame.seq != self.frames:
                    raise ProtocolError(f"step frame {frame.seq} after {self.frames - 1}: frames "
                                        f"were lost or reordered")
                self.frames += 1
                self.messages += len(frame.messages)
                for msg in frame.messages:
                    q = self.queues.get(msg.request_id)
                    if q is not None:  # None: its request ended here already (timeout, stop)
                        q.put_nowait(msg)
                for rid in frame.ended:
                    q = self.queues.pop(rid, None)
                    if q is not None:
                        q.put_nowait(None)
            # never while the producer lives
            raise ProtocolError(f"the step stream {self.name} ended early", ErrorCode.ENGINE_DEAD)
        except asyncio.CancelledError:
            self._fail(ProtocolError("the step stream was closed", ErrorCode.CANCELLED))
            raise
        except Exception as e:  # Ray errors (the producer died), a bad frame, the end
            log.warning("step stream %s failed: %s: %s", self.name, type(e).__name__, e)
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        for q in self.queues.values():
            q.put_nowait(error)
            q.put_nowait(None)
        self.queues.clear()

    def close(self) -> None:
        self.task.cancel()


class Outbox:
    """The producer's end for one subscriber whose messages are made on the actor's loop (the
    router's, after the text stage): messages and ended ids wait here until the subscriber takes
    them, all that is ready at once in one frame, either as a stream (:meth:`frames`) or by long
    poll (:meth:`take`, for the Ray client, which cannot consume streaming generators)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: list[TokenChunk | GenerateResult | ErrorReply] = []
        self.ended: list[str] = []
        self.wake = asyncio.Event()
        self.tasks: dict[str, asyncio.Task] = {}  # its requests in flight
        self.seq = 0
        self.submitted = 0  # requests submitted into it, refused ones included
        self.streaming = False  # a frames() stream is reading it
        self.touched = time.monotonic()  # last submit or take (a polled outbox's liveness)

    @property
    def done(self) -> bool:
        """Every request submitted into it has ended and the subscriber has taken everything."""
        return self.submitted > 0 and not self.tasks and not self.pending and not self.ended

    def put(self, msg: TokenChunk | GenerateResult | ErrorReply) -> None:
        self.pending.append(msg)
        self.wake.set()

    def end(self, request_id: str) -> None:
        self.tasks.pop(request_id, None)
        self.ended.append(request_id)
        self.wake.set()

    def add(self, request_id: str, task: asyncio.Task) -> None:
        """A request submitted into it, its messages made by ``task``."""
        self.tasks[request_id] = task
        self.submitted += 1

    def refused(self) -> None:
        """A request submitted into it was refused before it started (its reply went back to
        the submitter): a stream waiting for its requests to end looks again."""
        self.submitted += 1
        self.wake.set()

    async def take(self, timeout: float | None = None) -> list[list[bytes]]:
        """The encoded StepFrames of everything ready (waiting for something up to ``timeout``
        seconds, None: without limit); [] when nothing came."""
        self.touched = time.monotonic()
        if timeout is None:
            await self.wake.wait()
        else:
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except asyncio.TimeoutError:
                return []
        # let every request woken by the same step add its output (each takes a few loop turns
        # from the decode frame to here): wait until two turns add nothing
        idle = 0
        for _ in range(16):
            n = len(self.pending) + len(self.ended)
            await asyncio.sleep(0)
            idle = idle + 1 if len(self.pending) + len(self.ended) == n else 0
            if idle == 2:
                break
        self.wake.clear()
        msgs, self.pending = self.pending, []
        ended, self.ended = self.ended, []
        if not msgs and not ended:  # woken by a refusal
            return []
        out = []
        for frame in step_frames(msgs, self.seq, ended):
            self.seq = frame.seq + 1
            out.append(encode(frame))
        return out

    async def frames(self, until_done: bool = False) -> AsyncIterator[list[bytes]]:
        """The encoded StepFrames as a stream; with ``until_done`` it ends once every request
        submitted into it has ended (a client's stream for its own requests). When the consumer
        goes away first, its requests are cancelled."""
        self.streaming = True
        try:
            while not (until_done and self.done):
                for frame in await self.take():
                    yield frame
        finally:
            self.streaming = False
            self.cancel()

    def cancel(self) -> None:
        """Cancel every request in flight (the subscriber is gone)."""
        for task in list(self.tasks.values()):
            task.cancel()


class RequestStream:
    """One request's messages on a StepSubscription: ``next()`` gives each message in order,
    then None; a failed stream gives its exception as an ErrorReply, then None."""

    def __init__(self, sub: StepSubscription | None, request_id: str,
                 queue: asyncio.Queue | None = None) -> None:
        self.sub, self.request_id = sub, request_id
        self.queue = queue if queue is not None else sub.register(request_id)

    @classmethod
    def of(cls, request_id: str, *msgs: ErrorReply) -> "RequestStream":
        """A stream that only holds ``msgs`` (a request refused before it started)."""
        q: asyncio.Queue = asyncio.Queue()
        for m in (*msgs, None):
            q.put_nowait(m)
        return cls(None, request_id, q)

    async def next(self) -> TokenChunk | GenerateResult | ErrorReply | None:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            return ErrorReply.from_exception(item, self.request_id)
        return item

    def close(self) -> None:
        if self.sub is not None:
            self.sub.unregister(self.request_id)
