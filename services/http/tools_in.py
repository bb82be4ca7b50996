"""OpenAI's tool and structured-output fields -> the wire's (protocol.ToolSpec, ChatMessage
with tool calls, tool_choice, ResponseFormat), each refusal a 400 naming the field.

    tools        [{"type": "function", "function": {"name", "description", "parameters", "strict"}}]
    tool_choice  "auto" | "none" | "required" | {"type": "function", "function": {"name": N}}
    messages     assistant {"tool_calls": [{"id", "type": "function", "function": {"name",
                 "arguments": JSON text}}]}; tool {"tool_call_id", "content"}
    response_format {"type": "text" | "json_object"} | {"type": "json_schema", "json_schema":
                 {"name", "schema", "strict"}}
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from protocol import ChatMessage, ResponseFormat, ToolCall, ToolSpec
from services.http.errors import OpenAIError, invalid


def _bad(param: str, what: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {what}", param=param, code="invalid_value")


def _object(value: Any, param: str) -> dict:
    if not isinstance(value, dict):
        raise _bad(param, f"must be an object, got {type(value).__name__}")
    return value


def tool_specs(tools: list[Any] | None) -> list[ToolSpec] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        t = _object(t, where)
        if t.get("type") != "function":
            raise OpenAIError(400, f"{where}.type: only 'function' tools are supported, got "
                              f"{t.get('type')!r}", param=f"{where}.type", code="unsupported_parameter")
        f = _object(t.get("function"), f"{where}.function")
        params = f.get("parameters", {"type": "object", "properties": {}})
        _object(params, f"{where}.function.parameters")
        try:
            out.append(ToolSpec(name=f.get("name"), description=f.get("description") or "",
                                parameters=json.dumps(params, ensure_ascii=False),
                                strict=bool(f.get("strict", False))))
        except ValidationError as e:
            err = invalid(e)
            err.param = f"{where}.function.{err.param}" if err.param else where
            err.message = f"{err.param}: {e.errors(include_url=False)[0]['msg']}"
            raise err from None
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise _bad("tools", "two tools share a name")
    return out


def tool_choice(choice: Any, tools: list[ToolSpec] | None) -> tuple[str, str | None]:
    """-> (the wire's tool_choice, the named tool)."""
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise _bad("tool_choice", "'required' needs tools")
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if name not in [t.name for t in tools or ()]:
            raise _bad("tool_choice", f"names function {name!r}, which is not among the tools")
        return "function", name
    raise _bad("tool_choice", "must be 'auto', 'none', 'required' or {'type': 'function', "
               "'function': {'name': ...}}")


def _calls(calls: list[Any], where: str) -> list[ToolCall]:
    out = []
    for j, c in enumerate(calls):
        p = f"{where}.tool_calls[{j}]"
        c = _object(c, p)
        f = _object(c.get("function"), f"{p}.function")
        args = f.get("arguments", "{}")
        if not isinstance(args, str):  # some clients send the object itself
            args = json.dumps(args, ensure_ascii=False)
        try:
            out.append(ToolCall(id=str(c.get("id") or f"call_{j}"), name=f.get("name"), arguments=args))
        except ValidationError as e:
            err = invalid(e)
            raise _bad(f"{p}.function", err.message) from None
    return out


def chat_message(where: str, role: str, content: str, m: Any) -> ChatMessage:
    """One validated message (services.http.schemas.ChatMessageIn) -> the wire's."""
    calls = _calls(m.tool_calls, where) if m.tool_calls else None
    if calls and role != "assistant":
        raise _bad(f"{where}.tool_calls", "only assistant messages carry tool calls")
    if role == "tool" and not m.tool_call_id:
        raise _bad(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
    return ChatMessage(role=role, content=content, tool_calls=calls,
                       tool_call_id=m.tool_call_id if role == "tool" else None,
                       name=m.name if role == "tool" else None,
                       reasoning=m.reasoning_content if role == "assistant" else None)


def response_format(rf: dict[str, Any] | None) -> ResponseFormat | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind in ("text", "json_object"):
        return None if kind == "text" else ResponseFormat(type="json_object")
    if kind == "json_schema":
        js = _object(rf.get("json_schema"), "response_format.json_schema")
        schema = _object(js.get("schema", {}), "response_format.json_schema.schema")
        return ResponseFormat(type="json_schema", schema_text=json.dumps(schema, ensure_ascii=False),
                              name=js.get("name") if isinstance(js.get("name"), str) else None,
                              strict=js.get("strict") is not False)
    raise OpenAIError(400, f"response_format.type: {kind!r} is not supported; allowed: text, "
                      f"json_object, json_schema", param="response_format.type",
                      code="unsupported_parameter")
