"""Response objects and SSE chunks in OpenAI's format.

Streaming (both endpoints): one id for every chunk; chat's first chunk carries
``delta: {"role": "assistant", "content": ""}``; ``finish_reason`` is null on every chunk but
the last choice chunk; with ``stream_options.include_usage`` every chunk has ``"usage": null``
and one more chunk with ``"choices": []`` carries the usage; then ``data: [DONE]``.

Reasoning (gpt-oss's analysis channel, ``<think>...</think>`` of Qwen3/DeepSeek): chat answers
carry it as ``message.reasoning_content`` (streaming: ``delta.reasoning_content``, in chunks of
their own or beside ``content``), vLLM's field name; ``content`` is the answer only. Models
without reasoning have no such field.

Tool calls: ``message.tool_calls`` [{"id", "type": "function", "function": {"name",
"arguments"}}] with ``finish_reason`` "tool_calls" (``content`` null when the answer is only
calls); streamed as ``delta.tool_calls`` [{"index", "id", "type", "function": {"name",
"arguments": ""}}] when a call starts, then [{"index", "function": {"arguments": piece}}].

Usage: ``prompt_tokens``, ``completion_tokens`` (the tokens the client was sent),
``total_tokens``; when the request ran speculative decoding, also
``"speculative": {"draft_tokens": N, "accepted_tokens": M}``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from protocol import GenerateResult, TokenChunk, ToolCallDelta, Usage

FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


def sse(obj: Any) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def call_delta(d: ToolCallDelta) -> dict[str, Any]:
    """One streamed tool-call piece in OpenAI's shape."""
    if d.name is not None:
        return {"index": d.index, "id": d.id, "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


def usage_block(u: Usage | None, completion_tokens: int | None = None) -> dict[str, Any]:
    prompt = u.prompt_tokens if u else 0
    completion = completion_tokens if completion_tokens is not None else (u.completion_tokens if u else 0)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if u is not None and u.draft_tokens is not None:
        out["speculative"] = {"draft_tokens": u.draft_tokens,
                              "accepted_tokens": u.accepted_draft_tokens or 0}
    return out


def chat_logprobs(chunk: TokenChunk, texts: dict[int, str]) -> dict[str, Any] | None:
    if chunk.logprobs is None:
        return None

    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = texts.get(tid, "")
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for k, (tid, lp) in enumerate(zip(chunk.token_ids, chunk.logprobs)):
        e = entry(tid, lp)
        tops = chunk.top_logprobs[k] if chunk.top_logprobs is not None else []
        e["top_logprobs"] = [entry(t.token_id, t.logprob) for t in tops]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_logprobs(chunk: TokenChunk, texts: dict[int, str], offset: int) -> dict[str, Any] | None:
    if chunk.logprobs is None:
        return None
    tokens, offsets = [], []
    for tid in chunk.token_ids:
        s = texts.get(tid, "")
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    tops = None
    if chunk.top_logprobs is not None:
        tops = [{texts.get(t.token_id, ""): t.logprob for t in alts} for alts in chunk.top_logprobs]
    return {"tokens": tokens, "token_logprobs": list(chunk.logprobs), "top_logprobs": tops,
            "text_offset": offsets}


def merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not parts:
        return None
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": None, "text_offset": []}
    for p in parts:
        out["tokens"] += p["tokens"]
        out["token_logprobs"] += p["token_logprobs"]
        out["text_offset"] += p["text_offset"]
        if p["top_logprobs"] is not None:
            out["top_logprobs"] = (out["top_logprobs"] or []) + p["top_logprobs"]
    return out


class Formatter:
    """Builds one request's chunks and final object. ``kind``: "chat" or "completion"."""

    def __init__(self, kind: str, request_id: str, model: str, include_usage: bool = False) -> None:
        self.kind, self.id, self.model = kind, request_id, model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def chunk(self, text: str = "", *, role: bool = False, finish: str | None = None,
              logprobs: dict[str, Any] | None = None, final: bool = False,
              reasoning: str | None = None, tool_calls: list[ToolCallDelta] | None = None) -> bytes:
        out = self._head(self.chunk_object)
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif tool_calls and not text and not reasoning:
                delta = {"tool_calls": [call_delta(d) for d in tool_calls]}
            elif reasoning and not text:
                delta = {"reasoning_content": reasoning}
            elif text or not final:
                delta = {"content": text}
                if reasoning:
                    delta["reasoning_content"] = reasoning
            if tool_calls and "tool_calls" not in delta:
                delta["tool_calls"] = [call_delta(d) for d in tool_calls]
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        out = self._head(self.chunk_object)
        out["choices"] = []
        out["usage"] = usage
        return sse(out)

    def final(self, result: GenerateResult, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        out = self._head(self.object)
        reason = FINISH[result.finish_reason]
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": result.text, "refusal": None}
            if result.reasoning is not None:  # a model with reasoning
                message["reasoning_content"] = result.reasoning
            if result.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in result.tool_calls]
                if not result.text.strip():
                    message["content"] = None
                if reason == "stop":
                    reason = "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": reason}
        out["choices"] = [choice]
        out["usage"] = usage_block(result.usage, len(result.token_ids))
        return out
