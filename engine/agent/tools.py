"""Tool-call parsers: the model's call syntax in its text -> tool-call deltas.

Each syntax is a block: ``open`` ... ``close`` around one call (DeepSeek-V3 also wraps the
calls in an outer pair, dropped). Text outside blocks is answer text. A block is parsed when
its ``close`` arrives (or at the end of the output, for a last block left open): a call
becomes a ``tool_call`` delta and one ``arguments`` delta with its arguments as JSON text. A
block that does not parse (bad JSON, no name, a tool not offered) is returned as answer text,
markup included, never an error.

    Hermes / Qwen2.5 / Qwen3:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    Qwen3-Coder (XML):         <tool_call>\\n<function=f>\\n<parameter=p>\\nVALUE\\n</parameter>\\n
                               </function>\\n</tool_call>
    DeepSeek-V3:               <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n
                               ```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    DeepSeek-V3.1:             ... <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜> ...
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from engine.agent.deltas import Delta, new_call_id
from engine.agent.text import find_first, held_prefix

Parsed = tuple[str, str]  # (name, arguments as JSON text)


def _json_args(value: Any) -> str | None:
    """Arguments as JSON text: an object as is; a string holding an object is unwrapped."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def parse_hermes(body: str, schemas: dict[str, dict]) -> Parsed | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _json_args(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else (obj["name"], args)


_FUNCTION = re.compile(r"^\s*<function=([^>\s]+)>(.*?)(?:</function>\s*)?$", re.S)
_PARAM = re.compile(r"<parameter=([^>]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _xml_value(raw: str, schema: dict) -> Any:
    """A Qwen3-Coder parameter's text -> its value, by the declared type (strings stay text)."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (kind is None and not text.strip()):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text  # an untyped or mistyped value: keep the text


def parse_qwen_xml(body: str, schemas: dict[str, dict]) -> Parsed | None:
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name, inner = m.group(1), m.group(2)
    props = (schemas.get(name) or {}).get("properties") or {}
    args = {k.strip(): _xml_value(v, props.get(k.strip(), {})) for k, v in _PARAM.findall(inner)}
    if _PARAM.sub("", inner).strip():
        return None  # text that is not a parameter: not this syntax
    return name, json.dumps(args, ensure_ascii=False)


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_V3 = re.compile(r"^function\s*$", re.S)
_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def parse_deepseek(body: str, schemas: dict[str, dict]) -> Parsed | None:
    head, sep, rest = body.partition(DS_SEP)
    if not sep:
        return None
    if _DS_V3.match(head):  # V3: function<sep>NAME\n```json\n{...}\n```
        name, _, rest = rest.partition("\n")
        fence = _FENCE.match(rest)
        rest = fence.group(1) if fence else rest
    else:  # V3.1: NAME<sep>{...}
        name = head
    name = name.strip()
    if not name:
        return None
    args = _json_args(rest.strip() or "{}")
    return None if args is None else (name, args)


class BlockToolParser:
    """Streaming parser of one block syntax (see module doc). ``tools``: name -> parameters
    schema; a call of a name not in it is returned as text (when ``tools`` is given)."""

    def __init__(self, open_tag: str, close_tag: str, parse: Callable[[str, dict], Parsed | None],
                 tools: dict[str, dict] | None = None, dropped: tuple[str, ...] = ()) -> None:
        self.open_tag, self.close_tag, self.parse = open_tag, close_tag, parse
        self.tools = tools
        self.dropped = dropped  # outer markers removed from the text (DeepSeek's calls begin/end)
        self.buf = ""
        self.in_call = False
        self.calls = 0
        self._gap = False  # right after a call: whitespace before the next one is dropped

    def _call(self, body: str) -> list[Delta] | None:
        got = self.parse(body, self.tools or {})
        if got is None or (self.tools is not None and got[0] not in self.tools):
            return None
        name, args = got
        i = self.calls
        self.calls += 1
        return [Delta("tool_call", index=i, id=new_call_id(), name=name), Delta("arguments", args, i)]

    def _text(self, text: str) -> list[Delta]:
        for m in self.dropped:
            text = text.replace(m, "")
        if self._gap:
            text = text.lstrip()
            self._gap = not text
        return [Delta("content", text)] if text else []

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while True:
            if self.in_call:
                i = self.buf.find(self.close_tag)
                if i < 0:
                    return out
                body, self.buf = self.buf[:i], self.buf[i + len(self.close_tag):]
                self.in_call = False
                call = self._call(body)
                if call is None:
                    out += [Delta("content", self.open_tag + body + self.close_tag)]
                else:
                    out += call
                    self._gap = True
                continue
            i, _ = find_first(self.buf, (self.open_tag,))
            if i >= 0:
                out += self._text(self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(self.open_tag):], True
                continue
            keep = held_prefix(self.buf, (self.open_tag,) + self.dropped)
            if self._gap and not self.buf[:len(self.buf) - keep].strip():
                keep = len(self.buf)  # only whitespace so far after a call: wait and see
            out += self._text(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return out

    def finish(self) -> list[Delta]:
        buf, self.buf = self.buf, ""
        if self.in_call:  # the output ended inside a block: a call if it parses, else text
            self.in_call = False
            return self._call(buf) or [Delta("content", self.open_tag + buf)]
        return self._text(buf)  # after a call, trailing whitespace is dropped


def hermes_parser(tools: dict[str, dict] | None = None) -> BlockToolParser:
    return BlockToolParser("<tool_call>", "</tool_call>", parse_hermes, tools)


def qwen_xml_parser(tools: dict[str, dict] | None = None) -> BlockToolParser:
    return BlockToolParser("<tool_call>", "</tool_call>", parse_qwen_xml, tools)


def deepseek_parser(tools: dict[str, dict] | None = None) -> BlockToolParser:
    return BlockToolParser(DS_CALL_BEGIN, DS_CALL_END, parse_deepseek, tools,
                           dropped=(DS_CALLS_BEGIN, DS_CALLS_END))
