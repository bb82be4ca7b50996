"""Python client of a running deployment.

    from services.client import MoestreamClient
    c = MoestreamClient("auto")                       # a driver on the cluster (ray start head)
    c = MoestreamClient("ray://127.0.0.1:10001")      # the Ray client (remote, interactive)
    for msg in c.generate("The capital of France is", SamplingParams(temperature=0)):
        ...                                           # TokenChunk ..., then GenerateResult

Which path when:
  * batch work and deployments: ``ray job submit -- moestream generate --address auto ...``
    (the Jobs API, which Ray's maintainers recommend over the Ray client; HTTP on 8265);
  * an interactive program on the cluster machine: ``MoestreamClient("auto")`` (a driver:
    ~1 ms per actor call, streaming generators);
  * an interactive program elsewhere: ``MoestreamClient("ray://HOST:10001")`` (works, no
    further development upstream, versions of Ray and Python must match, ~8 ms per call;
    streaming generators are unsupported there, so this client long-polls the router).

Every request goes into the router by ``router.submit``, into a step stream of its own that this
client reads (services/tokenizer_router.py).
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

from protocol import (
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    GenerateResult,
    ProtocolError,
    SamplingParams,
    StepFrame,
    TokenChunk,
    WireMessage,
    decode,
    encode,
)
from services.handles import DECODE, NAMESPACE, ROUTER, actor
from services.handles import ray_module as _ray

Message = TokenChunk | GenerateResult | ErrorReply


def _is_ray_client() -> bool:
    try:
        from ray.util.client import ray as client_ray

        return client_ray.is_connected()
    except Exception:
        return False


class MoestreamClient:
    """``address``: None (already connected, else "auto"), "auto", "HOST:6379" or
    "ray://HOST:10001"."""

    def __init__(self, address: str | None = None, namespace: str = NAMESPACE,
                 poll_s: float = 0.5) -> None:
        ray = _ray()
        if not ray.is_initialized():
            from services.ray_env import apply_client_env

            apply_client_env()  # token mode and temp dir of the cluster (services/ray_env.py)
            ray.init(address=address or "auto", namespace=namespace, log_to_driver=False)
        self.namespace = namespace
        self.router = actor(ROUTER, namespace)
        self.polling = _is_ray_client()
        self.poll_s = poll_s

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompt: str | None = None, sampling: SamplingParams | dict | None = None, *,
                 messages: list[dict] | None = None, prompt_token_ids: list[int] | None = None,
                 request_id: str | None = None, stream: bool = True) -> Iterator[Message]:
        """Yield TokenChunk messages as tokens arrive (when ``stream``), then one GenerateResult;
        or an ErrorReply. Closing the iterator early cancels the request."""
        req = GenerateRequest(
            request_id=request_id or f"req-{uuid.uuid4().hex[:16]}", prompt=prompt,
            messages=messages, prompt_token_ids=prompt_token_ids, stream=stream,
            sampling=sampling if isinstance(sampling, SamplingParams)
            else SamplingParams.model_validate(sampling or {}))
        return self.submit_frames(encode(req), request_id=req.request_id)

    def submit_frames(self, frames: list, request_id: str | None = None) -> Iterator[Message]:
        """Send raw wire frames (a GenerateRequest) and yield the decoded replies: the request
        goes into a step stream of the router's of its own (``router.submit``), read as a Ray
        stream (``router.steps``) or, through the Ray client, by long poll."""
        subscriber = f"client-{uuid.uuid4().hex[:16]}"
        it = self._poll(subscriber, frames) if self.polling else self._stream(subscriber, frames)
        finished = False
        try:
            for msg in it:
                if isinstance(msg, (GenerateResult, ErrorReply)):
                    finished = True
                yield msg
            finished = True
        finally:
            if not finished and request_id:
                self.cancel(request_id)

    def _stream(self, subscriber: str, frames: list) -> Iterator[Message]:
        ray = _ray()
        steps = self.router.steps.remote(subscriber, True)  # ends when the request has ended
        refused = ray.get(self.router.submit.remote(subscriber, frames))
        if refused is not None:
            yield decode(refused)[0]
            return
        seq = _Seq()
        for ref in steps:
            yield from seq.messages(ray.get(ref))

    def _poll(self, subscriber: str, frames: list) -> Iterator[Message]:
        ray = _ray()
        refused = ray.get(self.router.submit.remote(subscriber, frames))
        if refused is not None:
            yield decode(refused)[0]
            return
        seq, done = _Seq(), False
        while not done:
            batch, done = ray.get(self.router.poll_steps.remote(subscriber, self.poll_s))
            for f in batch:
                yield from seq.messages(f)

    def complete(self, prompt: str | None = None, sampling: SamplingParams | dict | None = None,
                 **kw: Any) -> GenerateResult:
        """The final GenerateResult; an ErrorReply raises ProtocolError with its code."""
        result = None
        for msg in self.generate(prompt, sampling, stream=False, **kw):
            if isinstance(msg, ErrorReply):
                raise ProtocolError(msg.message, msg.code)
            if isinstance(msg, GenerateResult):
                result = msg
        if result is None:
            raise ProtocolError("the stream ended without a result", "engine_dead")
        return result

    def cancel(self, request_id: str) -> bool:
        return bool(_ray().get(self.router.cancel.remote(request_id)))

    def health(self) -> dict[str, WireMessage]:
        ray = _ray()
        out = {}
        for name in (ROUTER, DECODE):
            h = actor(name, self.namespace)
            out[name], _ = decode(ray.get(h.health.remote(), timeout=60))
        return out


class _Seq:
    """The messages of one step stream's encoded StepFrames, which must come numbered from 0
    without gaps (decoded with the codec's limits)."""

    def __init__(self) -> None:
        self.next = 0

    def messages(self, frames: list[bytes]) -> list[Message]:
        frame, _ = decode(frames, expect=StepFrame)
        if frame.seq != self.next:
            raise ProtocolError(f"step frame {frame.seq} after {self.next - 1}: frames were lost "
                                f"or reordered", ErrorCode.ENGINE_DEAD)
        self.next += 1
        return list(frame.messages)
