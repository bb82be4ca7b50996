"""Anthropic Messages API responses: the message object and the stream of server-sent events.

A message's ``content`` is a list of blocks in the order the model wrote them: ``thinking``
(the reasoning the shared parsers split off), ``text``, ``tool_use`` (``input``: the call's
arguments as an object). ``stop_reason``: ``tool_use`` when the answer has tool calls, else
``stop_sequence`` (with ``stop_sequence`` set), ``max_tokens`` or ``end_turn``.

Streaming (``event: NAME`` + ``data: JSON`` per event)::

    message_start {message: {..., content: [], usage: {input_tokens, output_tokens: 0}}}
    ping
    content_block_start {index, content_block: {type: thinking|text|tool_use, ...}}
    content_block_delta {index, delta: thinking_delta|text_delta|input_json_delta}   (repeated)
    content_block_stop {index}
    ... one start/deltas/stop per block, blocks never interleaved ...
    message_delta {delta: {stop_reason, stop_sequence}, usage: {input_tokens, output_tokens}}
    message_stop

A thinking block's ``signature`` is empty: this server signs nothing (a client sending the
block back gets it rendered as reasoning, signature ignored). An error after the stream started
is an ``error`` event with the error body, and the stream ends.
"""

from __future__ import annotations

import json
from typing import Any

from protocol import GenerateResult, TokenChunk

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn", "error": "end_turn"}


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: ``event: NAME\\ndata: <json>\\n\\n``."""
    return (f"event: {name}\ndata: ".encode()
            + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n")


def stop_reason(result: GenerateResult, tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if tool_calls:
        return "tool_use", None
    matched = getattr(result, "stop_sequence", None)
    if result.finish_reason == "stop" and matched:
        return "stop_sequence", matched
    return STOP_REASONS[result.finish_reason], None


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments text as the object ``input`` must be; None when it is not one."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def usage(result: GenerateResult, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": result.usage.prompt_tokens, "output_tokens": output_tokens}


class MessageFormatter:
    """One request's message object or event stream."""

    def __init__(self, message_id: str, model: str) -> None:
        self.id, self.model = message_id, model
        self.index = -1  # the open content block (-1: none yet)
        self.open: tuple[str, int] | None = None  # (block type, tool call index) of the open block
        self.tool_calls = 0

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    # ---- not streamed ------------------------------------------------------------------------
    def message(self, result: GenerateResult) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if result.reasoning:
            content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
        calls = list(getattr(result, "tool_calls", None) or ())
        text = result.text
        uses = []
        for call in calls:
            args = tool_input(call.arguments)
            if args is None:  # not an object: the model's call comes back as text, never a 500
                text += call.arguments
                continue
            uses.append({"type": "tool_use", "id": call.id, "name": call.name, "input": args})
        if text or not (content or uses):
            content.append({"type": "text", "text": text})
        content += uses
        reason, seq = stop_reason(result, bool(uses))
        return {**self._head(), "content": content, "stop_reason": reason, "stop_sequence": seq,
                "usage": usage(result, len(result.token_ids))}

    # ---- streamed ----------------------------------------------------------------------------
    def start(self) -> bytes:
        msg = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 0, "output_tokens": 0}}
        return event("message_start", {"type": "message_start", "message": msg}) + \
            event("ping", {"type": "ping"})

    def _block(self, kind: str, call: int = -1, **fields: Any) -> bytes:
        """Close the open block unless it is (kind, call); open that one."""
        if self.open == (kind, call):
            return b""
        out = self._stop_block()
        self.index += 1
        self.open = (kind, call)
        block = {"type": kind, **fields}
        return out + event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                   "content_block": block})

    def _stop_block(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                             "delta": delta})

    def chunk(self, chunk: TokenChunk) -> bytes:
        """The events one TokenChunk adds: reasoning, then text, then tool-call pieces."""
        out = b""
        if chunk.reasoning:
            out += self._block("thinking", thinking="", signature="")
            out += self._delta({"type": "thinking_delta", "thinking": chunk.reasoning})
        if chunk.text:
            out += self._block("text", text="")
            out += self._delta({"type": "text_delta", "text": chunk.text})
        for piece in getattr(chunk, "tool_calls", None) or ():
            if piece.name is not None:  # a call starts
                self.tool_calls += 1
                out += self._block("tool_use", piece.index, id=piece.id, name=piece.name, input={})
            if piece.arguments:
                out += self._block("tool_use", piece.index)  # (already open)
                out += self._delta({"type": "input_json_delta", "partial_json": piece.arguments})
        return out

    def finish(self, result: GenerateResult, output_tokens: int) -> bytes:
        reason, seq = stop_reason(result, self.tool_calls > 0)
        return self._stop_block() + event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": usage(result, output_tokens)}) + event("message_stop", {"type": "message_stop"})

    @staticmethod
    def error(body: dict[str, Any]) -> bytes:
        return event("error", body)
