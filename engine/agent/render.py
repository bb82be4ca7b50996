"""The request side: chat messages, tools and options -> prompt ids, through the model's own
chat template.

    ids, text = render_chat(tokenizer, messages, tools=[...], tool_choice="auto",
                            enable_thinking=None, reasoning_effort=None, syntax=syntax)

``messages`` are dicts in OpenAI's chat shape after validation (protocol.ChatMessage dumps:
role system/user/assistant/tool, content text, assistant ``tool_calls`` [{id, name,
arguments (JSON text)}], tool ``tool_call_id``/``name``, assistant ``reasoning``). Templates get
them in the shape Hugging Face chat templates read: ``tool_calls`` as
``{"id", "type": "function", "function": {"name", "arguments": <object>}}`` and
``reasoning_content``; tools as ``{"type": "function", "function": {name, description,
parameters}}``. ``tool_choice`` "none" leaves the tools out of the prompt.

A template that does not read ``tools`` (syntax.template_renders_tools False) gets them from
us, in the Hermes form the parser then reads: a system block listing the functions' schemas and
the ``<tool_call>`` JSON form; earlier calls and results it cannot render become text in that
same form (calls in the assistant's content, results as user turns in ``<tool_response>``).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from engine.agent.syntax import AgentSyntax
from engine.errors import RequestValidationError

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def _arguments(text: str) -> Any:
    """A call's arguments for a template: the object when the text is one, else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def tool_dicts(tools: Sequence[dict]) -> list[dict]:
    """protocol.ToolSpec dumps -> the OpenAI tool objects templates read."""
    out = []
    for t in tools:
        params = t.get("parameters")
        if isinstance(params, str):
            params = json.loads(params)
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                      "parameters": params}})
    return out


def _template_message(m: dict) -> dict:
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                             for c in m["tool_calls"]]
    if m["role"] == "tool":
        if m.get("tool_call_id"):
            out["tool_call_id"] = m["tool_call_id"]
        if m.get("name"):
            out["name"] = m["name"]
    if m.get("reasoning"):
        out["reasoning_content"] = m["reasoning"]
    return out


def _as_hermes_text(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template that renders neither tools nor calls: everything in Hermes text form."""
    out: list[dict] = []
    if tools:
        block = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].endswith("</tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
            continue
        text = m["content"]
        for c in m.get("tool_calls") or ():
            call = {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            text += f"\n<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
        out.append({"role": m["role"], "content": text.lstrip("\n") if not m["content"] else text})
    return out


def render_chat(tokenizer, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                tool_choice: str = "auto", enable_thinking: bool | None = None,
                reasoning_effort: str | None = None, syntax: AgentSyntax | None = None) -> tuple[list[int], str]:
    """-> (prompt ids, prompt text). ``tokenizer``: engine.tokenizer.Tokenizer. Template errors
    (a template that refuses a role order, ...) become RequestValidationError."""
    syntax = syntax or AgentSyntax()
    msgs = [_template_message(m) for m in messages]
    tdicts = tool_dicts(tools) if tools and tool_choice != "none" else None
    template_vars: dict[str, Any] = {}
    if enable_thinking is not None:
        template_vars["enable_thinking"] = enable_thinking
    if reasoning_effort is not None:
        template_vars["reasoning_effort"] = reasoning_effort
    uses_calls = any(m["role"] == "tool" or m.get("tool_calls") for m in msgs)
    if syntax.template_renders_tools:
        if tdicts:
            template_vars["tools"] = tdicts
    elif tdicts or uses_calls:
        msgs = _as_hermes_text(msgs, tdicts)
    try:
        text = tokenizer.render_chat_template(msgs, **template_vars)
    except RequestValidationError:
        raise
    except Exception as e:  # jinja's TemplateError (raise_exception in the template), ...
        raise RequestValidationError(f"the chat template refused these messages: {type(e).__name__}: "
                                     f"{str(e)[:300]}") from None
    return tokenizer.encode(text, add_special_tokens=False), text
