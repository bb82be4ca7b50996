"""The value types every output parser speaks, and the parser protocol.

    parser.feed("<think>a</think>Hi")  -> [Delta("reasoning", "a"), Delta("content", "Hi")]
    parser.feed('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
        -> [Delta("tool_call", index=0, id="call_...", name="f"),
            Delta("arguments", '{"x": 1}', index=0)]
    parser.finish()                     -> what was held back (an unfinished tag is text)

Invariants (tested for every parser on random chunkings): concatenating the deltas of any
chunking of the same text gives the same result as feeding it whole (``collect``); text is
never lost (a malformed tool call comes back as content).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Iterable, Literal, Protocol

DeltaKind = Literal["content", "reasoning", "tool_call", "arguments"]


@dataclass(frozen=True)
class Delta:
    """``content``/``reasoning``: ``text`` added to that part. ``tool_call``: call number ``index``
    starts (``id``, ``name``). ``arguments``: ``text`` appended to call ``index``'s arguments."""

    kind: DeltaKind
    text: str = ""
    index: int = 0
    id: str | None = None
    name: str | None = None


class OutputParser(Protocol):
    def feed(self, text: str) -> list[Delta]:
        """The next piece of the model's output text -> the deltas it completes."""

    def finish(self) -> list[Delta]:
        """End of output: what was held back (unfinished markup comes back as text)."""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCallOut:
    """A finished tool call (what a non-streamed answer carries)."""

    id: str
    name: str
    arguments: str = ""


@dataclass
class Collected:
    """A whole answer assembled from deltas."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallOut] = field(default_factory=list)


def collect(deltas: Iterable[Delta], into: Collected | None = None) -> Collected:
    out = into or Collected()
    for d in deltas:
        if d.kind == "content":
            out.content += d.text
        elif d.kind == "reasoning":
            out.reasoning += d.text
        elif d.kind == "tool_call":
            out.tool_calls.append(ToolCallOut(d.id or new_call_id(), d.name or "", ""))
        else:
            out.tool_calls[d.index].arguments += d.text
    return out


def merge(deltas: list[Delta]) -> list[Delta]:
    """Adjacent deltas of one kind (and call) joined: fewer, larger pieces on the wire."""
    out: list[Delta] = []
    for d in deltas:
        if not d.text and d.kind != "tool_call":
            continue
        last = out[-1] if out else None
        if last is not None and d.kind == last.kind and d.kind != "tool_call" and d.index == last.index:
            out[-1] = Delta(d.kind, last.text + d.text, d.index)
        else:
            out.append(d)
    return out


class Chain:
    """Parsers in sequence: the reasoning parser first, its content goes through the tool-call
    parser; reasoning and tool-call deltas pass straight through."""

    def __init__(self, *parsers: OutputParser) -> None:
        self.parsers = parsers

    def _through(self, k: int, deltas: list[Delta]) -> list[Delta]:
        if k == len(self.parsers):
            return deltas
        out: list[Delta] = []
        for d in deltas:
            if d.kind == "content":
                out += self._through(k + 1, self.parsers[k].feed(d.text))
            else:
                out.append(d)
        return out

    def feed(self, text: str) -> list[Delta]:
        return merge(self._through(0, [Delta("content", text)]))

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        for k, p in enumerate(self.parsers):
            out += self._through(k + 1, p.finish())
        return merge(out)
