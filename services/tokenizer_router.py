"""The tokenizer/router actor: the pipeline's front door.

    frames --codec.decode (size/depth/version limits)--> GenerateRequest (pydantic, strict)
           --chat template + tokenize (thread)--> admit (bounded: full -> BUSY)
           --decode.submit; decode.steps (ONE Ray stream per router: a StepFrame per engine
             step for all requests, services/step_mux.py)--> TokenChunk ... GenerateResult
           --the subscriber's step stream (only the result when stream=False)--> caller

Every failure becomes an ErrorReply (protocol.errors maps engine and Ray exceptions by name);
nothing a client sends can take the actor down. The decode engine computes tokens only; this
actor makes the text (services/text_stage.py: detokenizer, stop strings, harmony channels for
gpt-oss), aborts a request in the engine once a stop string ends it and bills the tokens the
client received.

One way in, one way out: a caller ``submit``s each request into a subscriber's step stream and
reads that stream, one StepFrame per batch of messages for all its requests
(services/step_mux.py). The HTTP actor holds one subscriber for all its requests; the Python
client (services/client.py, so the CLI and the demo) one per request, whose stream ends with it
(``steps(name, until_done=True)``). The Ray client cannot consume streaming generators ("not
currently supported when using Ray Client", Ray 2.60), so it reads the same stream by long poll
(``poll_steps``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from engine.agent.deltas import Collected, Delta, collect
from engine.agent.grammar import response_format_grammar
from engine.agent.syntax import detect_syntax
from engine.errors import RequestValidationError
from protocol import (
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    GenerateResult,
    GrammarSpec,
    HealthReply,
    ProtocolError,
    TokenChunk,
    ToolCall,
    ToolCallDelta,
    decode,
    encode,
)
from protocol.codec import DEFAULT_MAX_FRAME_BYTES
from protocol.messages import DEFAULT_MAX_TOKENS, MAX_STOP_TOKEN_IDS
from services.step_mux import Outbox, StepSubscription
from services.chat_agent import ChatPlan
from services.text_stage import TextStage

log = logging.getLogger(__name__)

TERMINAL = (GenerateResult, ErrorReply)


def call_deltas(deltas: list[Delta]) -> list[ToolCallDelta] | None:
    """engine.agent tool-call deltas -> the wire's (None when there are none)."""
    out = [ToolCallDelta(index=d.index, id=d.id, name=d.name) if d.kind == "tool_call"
           else ToolCallDelta(index=d.index, arguments=d.text) for d in deltas]
    return out or None
POLL_IDLE_S = 60.0  # a step stream read by long poll and not read for this long: its reader is gone


class TokenizerRouter:
    """Ray actor (async). ``decode`` is the decode actor's handle (default: the named one)."""

    def __init__(self, config_json: str, *, decode_handle=None, tokenizer=None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        from services.config import DeployConfig

        self.config = DeployConfig.model_validate_json(config_json)
        from engine.store.reader import ExpertStore

        with ExpertStore(self.config.store) as store:  # once: its tokenizer and model config
            if tokenizer is None:
                try:
                    tokenizer = store.tokenizer()
                except FileNotFoundError:
                    tokenizer = None  # token-id requests only
            eos_ids, arch = set(store.config.eos_token_ids), store.config.arch
            self.context: int | None = store.config.max_position_embeddings  # in tokens
        self.tokenizer = tokenizer
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", ())) | eos_ids
        # gpt-oss writes harmony (engine.harmony): chat answers are split into reasoning and
        # answer, and <|return|> / <|call|> end every request as end-of-sequence tokens do
        from engine.harmony import harmony_tokens_for

        self.harmony = harmony_tokens_for(arch, tokenizer)
        if self.harmony is not None:
            self.eos_ids |= self.harmony.stop_ids
        # the model's tool-call and reasoning syntax (engine.agent.syntax), from its template
        template = getattr(getattr(tokenizer, "hf", None), "chat_template", None)
        self.syntax = detect_syntax(template if isinstance(template, str) else None,
                                    harmony=self.harmony is not None,
                                    override=self.config.tool_call_parser)
        if decode_handle is None:
            from services.handles import decode as decode_actor

            decode_handle = decode_actor(self.config.namespace)
        self.decode = decode_handle
        self.subscription: StepSubscription | None = None  # the decode actor's step stream
        self.outboxes: dict[str, Outbox] = {}  # subscribers' step streams (steps/submit)
        self.max_frame_bytes = max_frame_bytes
        self.active: set[str] = set()
        # admission bounds (set_limits changes them at run time): queue_size requests in flight,
        # and at most max_waiting beyond the decode engine's max_num_seqs running ones
        self.queue_size, self.max_waiting = self.config.queue_size, self.config.max_waiting
        self.counts = {"admitted": 0, "busy": 0, "protocol_errors": 0, "invalid": 0,
                       "errors": 0, "timeouts": 0, "cancelled": 0, "completed": 0}

    # ---- entry points ------------------------------------------------------------------------
    def _request(self, frames: list) -> "GenerateRequest | list[bytes]":
        """The GenerateRequest in wire ``frames``, or the ErrorReply frames of unreadable ones
        (counted as invalid or as a protocol error)."""
        try:
            req, _ = decode(frames, expect=GenerateRequest, max_frame_bytes=self.max_frame_bytes)
        except ProtocolError as e:
            key = "invalid" if e.code is ErrorCode.INVALID_REQUEST else "protocol_errors"
            self.counts[key] += 1
            return encode(ErrorReply.for_code(e.code, e.message))
        return req

    async def steps(self, subscriber: str, until_done: bool = False) -> AsyncIterator[list[bytes]]:
        """The subscriber's step stream: one StepFrame per batch of messages (normally one per
        engine step) for every request submitted into it with ``submit``. With ``until_done``
        it ends once all of them have ended (a client's stream for its own request). When the
        stream ends early (the subscriber went away) its requests are cancelled and aborted in
        the engine."""
        box = self._outbox(subscriber)
        try:
            async for frame in box.frames(until_done):
                yield frame
        finally:
            if self.outboxes.get(subscriber) is box:
                del self.outboxes[subscriber]

    async def poll_steps(self, subscriber: str, max_wait_s: float = 1.0) -> tuple[list[list[bytes]], bool]:
        """The subscriber's step stream read by long poll (the Ray client): the StepFrames made
        since the last call (waiting up to ``max_wait_s`` for one) and whether every request
        submitted into it has ended (the subscriber is then dropped). An unknown subscriber
        gets ([], True). One left unread for POLL_IDLE_S is dropped and its requests
        cancelled, as a stream whose reader went away."""
        self._drop_idle()
        box = self.outboxes.get(subscriber)
        if box is None or box.streaming:
            return [], True
        frames = await box.take(max(0.0, min(max_wait_s, 30.0)))
        box.touched = time.monotonic()
        if box.done and self.outboxes.get(subscriber) is box:
            del self.outboxes[subscriber]
        return frames, box.done

    async def submit(self, subscriber: str, frames: list) -> list[bytes] | None:
        """Start the request in ``frames`` (a GenerateRequest); its messages go to the
        subscriber's step stream. Returns None, or the ErrorReply frames of a request refused
        before it started (unreadable frames, an id in use)."""
        self._drop_idle()
        box = self._outbox(subscriber)
        box.touched = time.monotonic()
        req = self._request(frames)
        if not isinstance(req, GenerateRequest):
            box.refused()
            return req
        rid = req.request_id
        if rid in box.tasks:
            self.counts["invalid"] += 1
            box.refused()
            return encode(ErrorReply.for_code(ErrorCode.INVALID_REQUEST,
                                              f"request id {rid!r} is already in use", rid))

        async def pump() -> None:
            try:
                async for msg in self._messages(req):
                    box.put(msg)
            finally:
                box.end(rid)

        box.add(rid, asyncio.get_running_loop().create_task(pump()))
        return None

    def _outbox(self, subscriber: str) -> Outbox:
        box = self.outboxes.get(subscriber)
        if box is None:
            box = self.outboxes[subscriber] = Outbox(subscriber)
        return box

    def _drop_idle(self) -> None:
        """Drop the step streams nobody streams and nobody polled for POLL_IDLE_S (a Ray client
        gone mid-request, a refused request's subscriber); their requests are cancelled."""
        now = time.monotonic()
        for name, box in list(self.outboxes.items()):
            if not box.streaming and now - box.touched > POLL_IDLE_S:
                del self.outboxes[name]
                box.cancel()

    async def cancel(self, request_id: str) -> bool:
        """Abort a request; its KV blocks are freed by the decode actor."""
        known = request_id in self.active or any(request_id in box.tasks
                                                 for box in self.outboxes.values())
        if known:
            self.counts["cancelled"] += 1
        await self.decode.abort.remote(request_id)
        return known

    # ---- the request path --------------------------------------------------------------------
    async def _messages(self, req: GenerateRequest) -> AsyncIterator[TokenChunk | GenerateResult | ErrorReply]:
        """The request's path: admission, prompt, the decode actor's step stream, text stage;
        TokenChunk ... GenerateResult, or an ErrorReply (+ GenerateResult "error" when streamed
        tokens came before it)."""
        rid = req.request_id
        if rid in self.active:
            self.counts["invalid"] += 1
            yield ErrorReply.for_code(ErrorCode.INVALID_REQUEST,
                                      f"request id {rid!r} is already in use", rid)
            return
        full = self._full()
        if full:
            self.counts["busy"] += 1
            yield ErrorReply.for_code(ErrorCode.BUSY, full, rid)
            return
        self.active.add(rid)
        self.counts["admitted"] += 1
        finished = False
        sub = None
        deadline = time.monotonic() + self.config.request_timeout_s
        try:
            try:
                prompt_ids, plan = await asyncio.to_thread(self._prompt_ids, req)
                engine_stop_ids = self._engine_stop_ids(req)
            except Exception as e:
                finished = True
                self.counts["invalid"] += 1
                yield ErrorReply.from_exception(e, rid)
                return
            # the engine computes tokens; text and stop strings are made here (text_stage)
            stop_ids = set(req.sampling.stop_token_ids) | self.eos_ids
            if plan is not None:  # a chat: reasoning and tool calls parsed (services/chat_agent)
                stage = plan.stage(req.sampling.stop, stop_ids)
            else:
                stage = TextStage(self.tokenizer, prompt_ids, req.sampling.stop, stop_ids)
            got_ids: list[int] = []
            got_text: list[str] = []
            reasons = plan is not None and (self.harmony is not None or plan.syntax.reasoning is not None)
            got_reasoning: list[str] | None = [] if reasons else None
            got_calls = Collected()
            stop_sent = errored = False
            grammar = plan.grammar if plan is not None else self._prompt_grammar(req)
            sampling = {**req.sampling.model_dump(), "stop": [],
                        "stop_token_ids": engine_stop_ids,
                        "grammar": grammar.model_dump() if grammar is not None else None}
            if sampling["max_tokens"] is None:  # the default never runs past the context
                room = self.context - len(prompt_ids) if self.context is not None else DEFAULT_MAX_TOKENS
                sampling["max_tokens"] = max(1, min(DEFAULT_MAX_TOKENS, room))
            sub = self._subscription()
            inbox = sub.register(rid)
            await self.decode.submit.remote(sub.name, rid, prompt_ids, sampling)
            while True:
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    msg = await asyncio.wait_for(inbox.get(), timeout=remaining)
                except asyncio.TimeoutError:
                    self.counts["timeouts"] += 1
                    finished = True
                    self.decode.abort.remote(rid)
                    yield ErrorReply.for_code(
                        ErrorCode.TIMEOUT, f"request took longer than request_timeout_s="
                        f"{self.config.request_timeout_s}; aborted", rid)
                    return
                if isinstance(msg, BaseException):  # the step stream failed (decode actor died)
                    raise msg
                if msg is None:  # the decode actor is done with it
                    finished = True
                    if not errored:  # never: a request ends with a result or an error
                        yield ErrorReply.for_code(ErrorCode.ENGINE_DEAD,
                                                  "decode stream ended early", rid)
                    return
                if isinstance(msg, TERMINAL):
                    finished = True
                if isinstance(msg, TokenChunk):
                    chunk = self._text_chunk(msg, stage, got_ids, got_text, got_reasoning, got_calls)
                    if stage.by_string and not stop_sent:
                        stop_sent = True
                        self.decode.abort.remote(rid)  # a stop string: no more tokens for it
                    if chunk is not None and req.stream:
                        yield chunk
                elif isinstance(msg, GenerateResult):
                    tail, tail_r = stage.finish_parts()
                    tail_calls = stage.take_calls()
                    collect(tail_calls, got_calls)
                    reasoning = None if got_reasoning is None else "".join(got_reasoning) + tail_r
                    if (tail or tail_r or tail_calls) and req.stream:
                        yield TokenChunk(request_id=rid, token_ids=[], text=tail,
                                         reasoning=tail_r if got_reasoning is not None else None,
                                         tool_calls=call_deltas(tail_calls))
                    self.counts["completed"] += 1
                    yield self._text_result(msg, stage, got_ids, "".join(got_text) + tail, reasoning,
                                            got_calls)
                    return
                else:  # ErrorReply; streamed: a GenerateResult("error") may follow, then the end
                    errored = True
                    self.counts["errors"] += 1
                    yield msg
                    if not req.stream:
                        return
        except Exception as e:  # Ray errors (decode actor died, ...) -> mapped by name
            finished = True
            self.counts["errors"] += 1
            yield ErrorReply.from_exception(e, rid)
        finally:
            self.active.discard(rid)
            if sub is not None:
                sub.unregister(rid)
            if not finished:  # our consumer went away mid-stream
                self.decode.abort.remote(rid)

    def _subscription(self) -> StepSubscription:
        """The live step stream from the decode actor (a new one after a failure)."""
        if self.subscription is None or not self.subscription.alive:
            self.subscription = StepSubscription(self.decode, "router")
        return self.subscription

    def _engine_stop_ids(self, req: GenerateRequest) -> list[int]:
        """The request's stop token ids, plus harmony's <|return|>/<|call|> for gpt-oss (so the
        engine stops there even when the checkpoint's generation_config does not list them)."""
        ids = list(req.sampling.stop_token_ids)
        if self.harmony is not None:
            ids = list(dict.fromkeys(ids + sorted(self.harmony.stop_ids)))
            if len(ids) > MAX_STOP_TOKEN_IDS:
                raise RequestValidationError(
                    f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS - len(self.harmony.stop_ids)} for "
                    f"this model (its harmony format adds <|return|> and <|call|>), got "
                    f"{len(req.sampling.stop_token_ids)}")
        return ids

    @staticmethod
    def _text_chunk(msg: TokenChunk, stage: TextStage, got_ids: list[int],
                    got_text: list[str], got_reasoning: list[str] | None = None,
                    got_calls: Collected | None = None) -> TokenChunk | None:
        """The engine's chunk with its text, cut after a stop string or stop token (None: the
        client gets none of it). ``got_reasoning`` (models with reasoning): reasoning apart;
        ``got_calls``: the tool calls parsed so far."""
        n, text, reasoning = stage.feed_parts(msg.token_ids)
        calls = stage.take_calls()
        if n == 0 and not text and not reasoning and not calls:
            return None
        got_ids += msg.token_ids[:n]
        got_text.append(text)
        cut = {"token_ids": msg.token_ids[:n], "text": text, "tool_calls": call_deltas(calls)}
        if got_calls is not None:
            collect(calls, got_calls)
        if got_reasoning is not None:
            got_reasoning.append(reasoning)
            cut["reasoning"] = reasoning
        if msg.logprobs is not None:
            cut["logprobs"] = msg.logprobs[:n]
        if getattr(msg, "top_logprobs", None) is not None:
            cut["top_logprobs"] = msg.top_logprobs[:n]
        return msg.model_copy(update=cut)

    @staticmethod
    def _text_result(msg: GenerateResult, stage: TextStage, got_ids: list[int], text: str,
                     reasoning: str | None = None, calls: Collected | None = None) -> GenerateResult:
        """The engine's result with the client's text and tokens: a stop string the router found
        makes it "stop" (the engine saw an abort); usage counts the tokens the client received."""
        reason = "stop" if stage.by_string else msg.finish_reason
        usage = msg.usage.model_copy(update={"completion_tokens": len(got_ids)})
        tool_calls = [ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                      for c in calls.tool_calls] if calls is not None and calls.tool_calls else None
        return msg.model_copy(update={"text": text, "token_ids": list(got_ids), "reasoning": reasoning,
                                      "finish_reason": reason, "usage": usage, "tool_calls": tool_calls,
                                      "stop_sequence": stage.matched()})

    def _full(self) -> str | None:
        """Why a new request cannot be admitted now (None: it can)."""
        n = len(self.active)
        if n >= self.queue_size:
            return f"{n} requests in flight, the queue holds {self.queue_size}; retry later"
        running = self.config.max_num_seqs
        if self.max_waiting is not None and n >= running + self.max_waiting:
            return (f"{n - min(n, running)} requests waiting behind {min(n, running)} running, "
                    f"max_waiting={self.max_waiting}; retry later")
        return None

    async def set_limits(self, queue_size: int | None = None,
                         max_waiting: int | None | str = "keep") -> dict[str, Any]:
        """Change the admission bounds at run time; returns the previous ones. ``max_waiting``
        None removes that bound ("keep" leaves it)."""
        old = {"queue_size": self.queue_size, "max_waiting": self.max_waiting}
        if queue_size is not None:
            if not (isinstance(queue_size, int) and 1 <= queue_size <= 100_000):
                raise ValueError(f"queue_size={queue_size!r}; allowed: 1..100000")
            self.queue_size = queue_size
        if max_waiting != "keep":
            if max_waiting is not None and not (isinstance(max_waiting, int) and max_waiting >= 0):
                raise ValueError(f"max_waiting={max_waiting!r}; allowed: None or >= 0")
            self.max_waiting = max_waiting
        return old

    async def count_tokens(self, frames: list) -> int | list[bytes]:
        """How many tokens the prompt of the GenerateRequest in ``frames`` renders to (chat
        template, tools and all: what a request would prefill); the ErrorReply's frames when it
        cannot be rendered. Nothing is generated (Anthropic's /v1/messages/count_tokens)."""
        req = self._request(frames)
        if not isinstance(req, GenerateRequest):
            return req
        try:
            prompt_ids, _ = await asyncio.to_thread(self._prompt_ids, req)
            return len(prompt_ids)
        except Exception as e:
            return encode(ErrorReply.from_exception(e, req.request_id))

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """The text of each token on its own (special tokens included), for logprobs."""
        if self.tokenizer is None:
            return [f"<{int(t)}>" for t in token_ids]
        return [self.tokenizer.decode([int(t)], skip_special_tokens=False) for t in token_ids]

    def _prompt_grammar(self, req: GenerateRequest) -> GrammarSpec | None:
        """A prompt (not a chat) with a response_format: its grammar."""
        rf = req.response_format
        g = None if rf is None else response_format_grammar(rf.type, rf.schema_text)
        return None if g is None else GrammarSpec(kind=g.kind, text=g.text)

    def _prompt_ids(self, req: GenerateRequest) -> tuple[list[int], ChatPlan | None]:
        """The prompt's ids; for a chat also its plan (template, grammar, parsing stage)."""
        if req.sampling.n != 1:
            raise RequestValidationError(f"n={req.sampling.n} is not supported by this "
                                         f"deployment; allowed: 1")
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids), None
        if self.tokenizer is None:
            raise RequestValidationError("this model's store has no tokenizer; send "
                                         "prompt_token_ids instead of text")
        if req.messages is not None:
            plan = ChatPlan.build(self.tokenizer, self.syntax, self.harmony, req)
            return plan.prompt_ids, plan
        return self.tokenizer.encode(req.prompt), None

    # ---- health and figures ------------------------------------------------------------------
    async def check_health(self) -> None:
        """Raises when the router cannot reach a live decode actor."""
        await asyncio.wait_for(self.decode.check_health.remote(), timeout=30)

    async def health(self) -> list[bytes]:
        detail: dict[str, Any] = {"active": len(self.active), "queue_size": self.queue_size}
        detail.update(self.counts)
        return encode(HealthReply(service="router", ok=True, detail=detail))

    async def stats(self) -> dict[str, Any]:
        sub = self.subscription
        return {"active": sorted(self.active), "subscribers": len(self.outboxes), **self.counts,
                "decode_frames": sub.frames if sub else 0, "decode_messages": sub.messages if sub else 0,
                "queue_size": self.queue_size, "max_waiting": self.max_waiting,
                "max_num_seqs": self.config.max_num_seqs}

    async def close(self) -> None:
        """Cancel every request in flight (shutdown)."""
        if self.subscription is not None:
            self.subscription.close()
        for box in self.outboxes.values():
            box.cancel()

    async def deploy_config(self) -> str:
        """The DeployConfig this deployment runs with, as JSON (scale/status read it)."""
        return self.config.model_dump_json()
