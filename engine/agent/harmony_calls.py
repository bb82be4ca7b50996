"""gpt-oss's harmony output as deltas: the analysis channel is reasoning, a message addressed to
``functions.NAME`` (``<|start|>assistant to=functions.f<|channel|>commentary json<|message|>
{...}<|call|>``) is a tool call, every other message is answer text.

Works on token ids (the control tokens are single ids), over engine.harmony's parser. A call's
arguments are held until its message closes; arguments that are not a JSON object make the
message answer text (never an error).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from engine.agent.deltas import Delta, new_call_id
from engine.harmony import HarmonyDelta, HarmonyStreamParser, HarmonyTokens

FUNCTIONS = "functions."


class HarmonyAgentParser:
    def __init__(self, tokenizer: Any, tokens: HarmonyTokens, tools: dict[str, dict] | None = None,
                 parse_calls: bool = True) -> None:
        """``parse_calls`` False (a request without tools): messages to functions are text."""
        self.parser = HarmonyStreamParser(tokenizer, tokens)
        self.tools = tools
        self.parse_calls = parse_calls
        self.calls = 0
        self._args: dict[int, str] = {}  # message index -> arguments text so far
        self._last: dict[str, int] = {}  # part -> index of the message that last added to it

    @property
    def messages(self):
        """The harmony messages parsed so far (engine.harmony.HarmonyMessage)."""
        return self.parser.messages

    def _recipient(self, index: int) -> str | None:
        r = self.parser.messages[index].recipient
        if not self.parse_calls:
            return None
        return r[len(FUNCTIONS):] if r and r.startswith(FUNCTIONS) else None

    def _route(self, deltas: list[HarmonyDelta]) -> list[Delta]:
        out: list[Delta] = []
        for d in deltas:
            if self._recipient(d.index) is not None:
                self._args[d.index] = self._args.get(d.index, "") + d.text
                continue
            kind = "reasoning" if self.parser.messages[d.index].is_reasoning else "content"
            text = d.text
            if self._last.get(kind, d.index) != d.index:
                text = "\n" + text  # a new message in a part that already has text
            self._last[kind] = d.index
            out.append(Delta(kind, text))
        return out

    def _closed_calls(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        for idx in sorted(self._args):
            msg = self.parser.messages[idx]
            if not (final or msg.complete or idx < len(self.parser.messages) - 1):
                continue  # still open
            text = self._args.pop(idx)
            name = self._recipient(idx)
            try:
                ok = isinstance(json.loads(text or "{}"), dict)
            except ValueError:
                ok = False
            if ok and (self.tools is None or name in self.tools):
                i = self.calls
                self.calls += 1
                out += [Delta("tool_call", index=i, id=new_call_id(), name=name),
                        Delta("arguments", text or "{}", i)]
            else:
                out.append(Delta("content", text))
        return out

    def push(self, token_id: int) -> list[Delta]:
        out = self._route(self.parser.push(token_id))
        return out + self._closed_calls(False)

    def push_many(self, token_ids: Sequence[int]) -> list[Delta]:
        out: list[Delta] = []
        for t in token_ids:
            out += self.push(t)
        return out

    def finish(self) -> list[Delta]:
        return self._route(self.parser.finish()) + self._closed_calls(True)
