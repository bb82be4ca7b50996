"""Request bodies of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
and their translation to the engine's GenerateRequest: the same chat messages, tools and thinking
switch the OpenAI endpoint produces, so both APIs share one generation path (router, chat template,
reasoning and tool-call parsers).

    req = parse_body(MessagesRequest, raw)          # AnthropicError-compatible 400 naming the field
    greq = req.to_generate("msg_...")                # protocol.GenerateRequest

Translation (Anthropic -> chat messages):
  * ``system`` (a string or text blocks) -> one system message first;
  * a user turn's ``text`` blocks -> a user message; each ``tool_result`` block -> a ``tool``
    message answering ``tool_use_id`` (blocks keep their order, so results come before the text
    that follows them);
  * an assistant turn's ``text`` -> content, ``thinking`` -> reasoning (templates that render
    earlier reasoning get it), ``tool_use`` -> tool calls (``input`` as JSON text);
  * ``image`` / ``document`` blocks are refused by name (every model here is served text-only);
  * ``thinking: {"type": "enabled"}`` / ``"disabled"`` -> the chat template's ``enable_thinking``;
    absent: the template's default (Qwen3's templates think). ``budget_tokens`` is accepted and
    not enforced: ``max_tokens`` bounds reasoning and answer together;
  * ``tool_choice`` auto / any / tool / none -> auto / required / function / none;
  * ``output_config.effort`` -> the template's ``reasoning_effort`` (low / medium / high);
    ``output_config.format`` (a JSON schema) -> the answer constrained to it, as OpenAI's
    ``response_format: json_schema``;
  * ``temperature`` / ``top_p`` / ``top_k`` (older clients send them) are the sampler's;
    ``seed`` (an extra body field, as on the OpenAI endpoints) makes sampling repeat.

Validation is strict (unknown fields refused, no "5" for 5), as on the OpenAI endpoints.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol import ChatMessage, GenerateRequest, SamplingParams
from protocol.messages import MAX_CHAT_MESSAGES, MAX_PROMPT_CHARS
from services.http.errors import OpenAIError, invalid
from services.http.schemas import VISUAL_PART_TYPES

# Anthropic's error "type" by HTTP status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 502: "api_error",
               503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_body(err: OpenAIError) -> dict[str, Any]:
    """An error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"),
                                       "message": err.message}}


def _bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code=code)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Block(BaseModel):
    """One content block; its fields are checked by type when the request is translated."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class MessageIn(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolIn(BaseModel):
    """A client tool (``input_schema``); server tools (web search, ...) have a ``type`` and are
    refused when translated."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=256)
    description: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceIn(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, min_length=1, max_length=256)
    disable_parallel_tool_use: bool | None = None


class ThinkingIn(_Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1, le=1_000_000)
    display: Literal["summarized"] | None = None  # "omitted" (signed, redacted thinking): not here


class OutputFormatIn(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigIn(_Body):
    effort: Literal["low", "medium", "high"] | None = None  # the template's reasoning_effort
    format: OutputFormatIn | None = None


class MetadataIn(_Body):
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(_Body):
    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageIn] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    system: str | list[Block] | None = None
    tools: list[ToolIn] | None = Field(None, max_length=128)
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None
    output_config: OutputConfigIn | None = None
    cache_control: dict[str, Any] | None = None  # a caching hint: prefix caching needs none

    # ---- translation -------------------------------------------------------------------------
    def _text_of(self, blocks: str | list[Block], where: str) -> str:
        """Text blocks joined; anything else refused (images by name)."""
        if isinstance(blocks, str):
            return blocks
        texts = []
        for j, b in enumerate(blocks):
            if b.type != "text":
                raise self._refused(b, f"{where}[{j}]", "text blocks only")
            texts.append(_field(b, "text", str, f"{where}[{j}]"))
        return "".join(texts)

    def _refused(self, b: Block, param: str, allowed: str) -> OpenAIError:
        """A block this place does not take; images and documents by name."""
        if b.type in VISUAL_PART_TYPES or b.type == "document":
            return OpenAIError(400, f"{param}: model {self.model!r} does not accept images or "
                               f"documents (a content block of type {b.type!r}); it is served "
                               f"text-only, without a vision tower: send text blocks only",
                               param=param, code="unsupported_modality")
        return _bad(f"{param}.type", f"a block of type {b.type!r} is not supported here; "
                    f"allowed: {allowed}", "unsupported_parameter")

    def _messages(self) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        if self.system is not None:
            text = self._text_of(self.system, "system")
            if text:
                out.append(ChatMessage(role="system", content=_limit(text, "system")))
        for i, m in enumerate(self.messages):
            where = f"messages[{i}].content"
            if isinstance(m.content, str):
                out.append(ChatMessage(role=m.role, content=_limit(m.content, where)))
            elif m.role == "user":
                out += self._user_turn(m.content, where)
            else:
                out.append(self._assistant_turn(m.content, where))
        return out

    def _user_turn(self, blocks: list[Block], where: str) -> list[ChatMessage]:
        """Text blocks -> user messages, tool_result blocks -> tool messages, in block order."""
        out: list[ChatMessage] = []
        texts: list[str] = []

        def flush() -> None:
            if texts:
                out.append(ChatMessage(role="user", content=_limit("".join(texts), where)))
                texts.clear()

        for j, b in enumerate(blocks):
            param = f"{where}[{j}]"
            if b.type == "tool_result":
                flush()
                extra = b.model_extra or {}
                unknown = set(extra) - {"tool_use_id", "content", "is_error", "cache_control"}
                if unknown:
                    raise _bad(f"{param}.{sorted(unknown)[0]}", "unknown field; this server does not accept it")
                call_id = _field(b, "tool_use_id", str, param)
                content = extra.get("content", "")
                if not isinstance(content, (str, list)):
                    raise _bad(f"{param}.content", "a string or a list of text blocks")
                if isinstance(content, list):
                    try:
                        content = [Block.model_validate(c) for c in content]
                    except ValidationError as e:
                        raise _bad(f"{param}.content", invalid(e).message) from None
                text = self._text_of(content, f"{param}.content")
                if extra.get("is_error") is True:
                    text = f"Error: {text}"
                out.append(ChatMessage(role="tool", content=_limit(text, param), tool_call_id=call_id))
            elif b.type == "text":
                texts.append(_field(b, "text", str, param))
            else:
                raise self._refused(b, param, "text, tool_result")
        flush()
        return out

    def _assistant_turn(self, blocks: list[Block], where: str) -> ChatMessage:
        texts, thoughts, calls = [], [], []
        for j, b in enumerate(blocks):
            param = f"{where}[{j}]"
            if b.type == "text":
                texts.append(_field(b, "text", str, param))
            elif b.type == "thinking":
                thoughts.append(_field(b, "thinking", str, param))
            elif b.type == "redacted_thinking":
                continue  # opaque to this server: nothing to render
            elif b.type == "tool_use":
                args = _field(b, "input", dict, param)
                calls.append({"id": _field(b, "id", str, param), "name": _field(b, "name", str, param),
                              "arguments": json.dumps(args, ensure_ascii=False)})
            else:
                raise self._refused(b, param, "text, thinking, redacted_thinking, tool_use")
        kw: dict[str, Any] = {"role": "assistant", "content": _limit("".join(texts), where)}
        if thoughts:
            kw["reasoning"] = "".join(thoughts)
        if calls:
            kw["tool_calls"] = calls
        try:
            return ChatMessage(**kw)
        except ValidationError as e:
            raise _bad(where, invalid(e).message) from None

    def _tools(self) -> dict[str, Any]:
        """GenerateRequest's tools / tool_choice / tool_name / parallel_tool_calls fields."""
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice.type in ("any", "tool"):
                raise _bad("tool_choice", f"type {choice.type!r} needs tools")
            return {}
        specs = []
        for i, t in enumerate(self.tools):
            if t.type not in (None, "custom"):
                raise _bad(f"tools[{i}].type", f"server tool {t.type!r} is not supported by this "
                           f"server (client tools with an input_schema only)", "unsupported_parameter")
            if t.input_schema is None:
                raise _bad(f"tools[{i}].input_schema", "Field required", "missing_required_parameter")
            specs.append({"name": t.name, "description": t.description or "",
                          "parameters": json.dumps(t.input_schema, ensure_ascii=False)})
        kw: dict[str, Any] = {"tools": specs}
        if choice is not None:
            kw["tool_choice"] = {"auto": "auto", "any": "required", "tool": "function",
                                 "none": "none"}[choice.type]
            if choice.type == "tool":
                if not choice.name:
                    raise _bad("tool_choice.name", "Field required", "missing_required_parameter")
                kw["tool_name"] = choice.name
            if choice.disable_parallel_tool_use:
                kw["parallel_tool_calls"] = False
        return kw

    def _thinking(self) -> dict[str, Any]:
        """``thinking`` -> the template's enable_thinking; ``output_config`` -> its
        reasoning_effort and the answer's JSON schema."""
        kw: dict[str, Any] = {}
        if self.thinking is not None:
            kw["enable_thinking"] = self.thinking.type != "disabled"
        cfg = self.output_config
        if cfg is not None and cfg.effort is not None:
            kw["reasoning_effort"] = cfg.effort
        if cfg is not None and cfg.format is not None:
            kw["response_format"] = {"type": "json_schema", "name": "output",
                                     "schema_text": json.dumps(cfg.format.schema_, ensure_ascii=False)}
        return kw

    def generate_fields(self) -> dict[str, Any]:
        """What GenerateRequest gets from the conversation (messages, tools, thinking, format)."""
        return {"messages": self._messages(), **self._tools(), **self._thinking()}


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=1_000_000)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # our extra (extra_body), as on OpenAI's
    metadata: MetadataIn | None = None
    service_tier: str | None = None

    def to_generate(self, request_id: str) -> GenerateRequest:
        kw: dict[str, Any] = {"max_tokens": self.max_tokens, "stop": list(self.stop_sequences or [])}
        for i, s in enumerate(kw["stop"]):
            if not 1 <= len(s) <= 256:
                raise _bad(f"stop_sequences[{i}]", "a stop sequence must have 1..256 characters")
        for name in ("temperature", "top_p", "top_k", "seed"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = float(v) if name in ("temperature", "top_p") else v
        try:
            sampling = SamplingParams(**kw)
            return GenerateRequest(request_id=request_id, sampling=sampling, stream=bool(self.stream),
                                   **self.generate_fields())
        except ValidationError as e:
            raise invalid(e) from None


def _field(b: Block, name: str, kind: type, param: str) -> Any:
    value = (b.model_extra or {}).get(name)
    if not isinstance(value, kind):
        what = {str: "a string", dict: "an object"}[kind]
        raise _bad(f"{param}.{name}", f"a {b.type} block needs {what} {name!r}")
    return value


def _limit(text: str, param: str) -> str:
    if len(text) > MAX_PROMPT_CHARS:
        raise _bad(param, f"longer than {MAX_PROMPT_CHARS} characters")
    return text
