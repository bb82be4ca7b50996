"""The router's side of the decode actor's step stream (services/decode_stream.py).

One ``DecodeSubscription`` per router holds one ``decode.steps`` stream and demultiplexes its
StepFrames into one asyncio.Queue per request: Ray carries one item per engine step whatever
the number of streams, and each request's messages arrive in their order.

Frames are decoded with the codec's limits and must be StepFrames numbered without gaps. When
the stream fails (the decode actor died: a Ray error), ends, or sends a bad frame, every request
registered on it gets the exception (mapped to its ErrorReply by name) and the subscription is
dead; the router's next request opens a new one, which Ray sends to the restarted actor.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from protocol import ErrorCode, ProtocolError, StepFrame, decode

log = logging.getLogger(__name__)


class DecodeSubscription:
    def __init__(self, decode_handle: Any, max_frame_bytes: int | None = None) -> None:
        self.name = f"router-{uuid.uuid4().hex[:16]}"
        self.queues: dict[str, asyncio.Queue] = {}
        self.frames = 0  # StepFrames received
        self.messages = 0  # messages they carried
        self.error: BaseException | None = None
        self._decode_kw = {} if max_frame_bytes is None else {"max_frame_bytes": max_frame_bytes}
        # the stream is asked for before any submit of this subscription (same caller, so Ray
        # sends it first; the decode actor also accepts a submit that arrives first)
        self._stream = decode_handle.steps.remote(self.name)
        self.task = asyncio.get_running_loop().create_task(self._pump())

    @property
    def alive(self) -> bool:
        return self.error is None and not self.task.done()

    def register(self, request_id: str) -> asyncio.Queue:
        """The queue ``request_id``'s messages (or the stream's failure) will arrive on."""
        q: asyncio.Queue = asyncio.Queue()
        if self.error is not None:
            q.put_nowait(self.error)
        self.queues[request_id] = q
        return q

    def unregister(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    async def _pump(self) -> None:
        try:
            async for ref in self._stream:
                frame, _ = decode(await ref, expect=StepFrame, **self._decode_kw)
                if frame.seq != self.frames:
                    raise ProtocolError(f"step frame {frame.seq} after {self.frames - 1}: frames "
                                        f"were lost or reordered")
                self.frames += 1
                self.messages += len(frame.messages)
                for msg in frame.messages:
                    q = self.queues.get(msg.request_id)
                    if q is not None:  # None: its request ended here already (timeout, stop)
                        q.put_nowait(msg)
            # never while the actor lives
            raise ProtocolError("the decode actor's step stream ended early", ErrorCode.ENGINE_DEAD)
        except asyncio.CancelledError:
            self._fail(ProtocolError("the router closed its decode stream", ErrorCode.CANCELLED))
            raise
        except Exception as e:  # Ray errors (decode actor died), a bad frame, the end
            log.warning("decode step stream %s failed: %s: %s", self.name, type(e).__name__, e)
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        for q in self.queues.values():
            q.put_nowait(error)

    def close(self) -> None:
        self.task.cancel()
