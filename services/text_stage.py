"""Text for one request, made by the router from the token ids the decode actor streams.

The decode actor's engine thread only computes tokens (it runs without a tokenizer); turning
them into text and cutting at stop strings happens here, on the router, off the compute thread.
The rules are the engine's own (engine.runner.Engine._update, which the in-process CLI still
uses): an end-of-sequence or stop token ends the text and adds none; a stop string ends it and
is not returned; text is never half a UTF-8 character or a prefix of a possible stop string.

When a stop string ends a request, tokens the engine computed after it are dropped here and the
router aborts the request in the decode actor: the client is billed for the tokens it received.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from engine.agent.deltas import Delta
from engine.agent.harmony_calls import HarmonyAgentParser
from engine.harmony import HarmonyTokens
from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher


class TextStage:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Iterable[str] = (),
                 stop_ids: Iterable[int] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=list(prompt_ids)) if tokenizer else None
        self.stops = StopStringMatcher(list(stop))
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.stopped = False  # a stop string or stop/EOS token ended the text
        self.by_string = False  # ... and it was a stop string (the engine does not know)
        self.tokens = 0  # tokens the client gets

    def feed(self, token_ids: Sequence[int]) -> tuple[int, str]:
        """The next tokens from the engine -> (how many of them the client gets, their text)."""
        if self.stopped:
            return 0, ""
        text = ""
        for i, t in enumerate(token_ids):
            if int(t) in self.stop_ids:  # its text is not returned; the engine stops here too
                self.stopped = True
                self.tokens += i + 1
                return i + 1, text
            if self.detok is None:
                continue
            piece, stopped = self.stops.feed(self.detok.push(int(t)))
            text += piece
            if stopped:
                self.stopped = self.by_string = True
                self.tokens += i + 1
                return i + 1, text
        self.tokens += len(token_ids)
        return len(token_ids), text

    def finish(self) -> str:
        """Text held back at the end (an unfinished character, a possible stop string's prefix);
        after a stop token too, as the engine does; nothing after a stop string."""
        if self.detok is None or self.by_string:
            return ""
        text, stopped = self.stops.feed(self.detok.flush())
        if stopped:
            self.stopped = self.by_string = True
            return text
        return text + self.stops.flush()

    def matched(self) -> str | None:
        """The stop string that ended the text (None: none did)."""
        return self.stops.matched if self.by_string else None

    # ---- the text in parts (answer, reasoning): one part for plain models ---------------------
    def feed_parts(self, token_ids: Sequence[int]) -> tuple[int, str, str]:
        """As :meth:`feed`, with the reasoning text apart: (tokens, answer text, reasoning text)."""
        n, text = self.feed(token_ids)
        return n, text, ""

    def finish_parts(self) -> tuple[str, str]:
        return self.finish(), ""

    def take_calls(self) -> list[Delta]:
        """Tool-call deltas parsed since the last call (none for plain text)."""
        return []


class ParsedTextStage(TextStage):
    """The text stage of a chat whose output has reasoning or tool-call markup: the text (after
    stop strings, on the raw output) goes through the request's engine.agent parser chain;
    reasoning and answer come back apart, tool-call deltas are taken with :meth:`take_calls`."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], parser, stop: Iterable[str] = (),
                 stop_ids: Iterable[int] = ()) -> None:
        super().__init__(tokenizer, prompt_ids, stop, stop_ids)
        self.parser = parser
        self.calls: list[Delta] = []

    def _split(self, deltas: list[Delta]) -> tuple[str, str]:
        content = reasoning = ""
        for d in deltas:
            if d.kind == "content":
                content += d.text
            elif d.kind == "reasoning":
                reasoning += d.text
            else:
                self.calls.append(d)
        return content, reasoning

    def feed_parts(self, token_ids: Sequence[int]) -> tuple[int, str, str]:
        n, text = TextStage.feed(self, token_ids)
        return (n, *self._split(self.parser.feed(text) if text else []))

    def finish_parts(self) -> tuple[str, str]:
        text = TextStage.finish(self)
        return self._split((self.parser.feed(text) if text else []) + self.parser.finish())

    def take_calls(self) -> list[Delta]:
        out, self.calls = self.calls, []
        return out


class HarmonyTextStage(TextStage):
    """The text stage of a model that writes gpt-oss's harmony format (engine.harmony): the
    analysis channel becomes reasoning, messages to ``functions.NAME`` tool calls (requests with
    tools: engine.agent.harmony_calls), every other channel the answer, control tokens are never
    text. Messages of one part are joined by a newline. Stop strings are matched in each part on
    its own; a match in either ends the request (text after it is not returned), and the other
    part's withheld text, which came before the match, is released. Stop tokens (<|return|>,
    <|call|> and the model's end-of-sequence ids) end it as for any model."""

    PARTS = ("content", "reasoning")

    def __init__(self, tokenizer, tokens: HarmonyTokens, stop: Iterable[str] = (),
                 stop_ids: Iterable[int] = (), tools: dict[str, dict] | None = None,
                 parse_calls: bool = False) -> None:
        super().__init__(None, (), stop, stop_ids)
        self.parser = HarmonyAgentParser(tokenizer, tokens, tools, parse_calls)
        self.harmony_stops = tokens.stop_ids
        stops = list(stop)
        self.matchers = {part: StopStringMatcher(stops) for part in self.PARTS}
        self.calls: list[Delta] = []

    def _route(self, deltas: list[Delta]) -> tuple[dict[str, str], bool]:
        """Deltas -> text per part (cut at stop strings); whether a stop string hit."""
        out = {part: "" for part in self.PARTS}
        for d in deltas:
            if d.kind not in self.PARTS:
                self.calls.append(d)
                continue
            piece, stopped = self.matchers[d.kind].feed(d.text)
            out[d.kind] += piece
            if stopped:
                other = "reasoning" if d.kind == "content" else "content"
                out[other] += self.matchers[other].flush()
                return out, True
        return out, False

    def take_calls(self) -> list[Delta]:
        out, self.calls = self.calls, []
        return out

    def feed_parts(self, token_ids: Sequence[int]) -> tuple[int, str, str]:
        if self.stopped:
            return 0, "", ""
        content, reasoning = "", ""
        for i, t in enumerate(token_ids):
            t = int(t)
            is_stop = t in self.stop_ids  # the engine stops here too
            parts, stopped = {}, False
            if not is_stop or t in self.harmony_stops:  # <|return|>/<|call|> close the message
                parts, stopped = self._route(self.parser.push(t))
            content += parts.get("content", "")
            reasoning += parts.get("reasoning", "")
            if stopped or is_stop:
                self.stopped, self.by_string = True, stopped
                self.tokens += i + 1
                return i + 1, content, reasoning
        self.tokens += len(token_ids)
        return len(token_ids), content, reasoning

    def finish_parts(self) -> tuple[str, str]:
        if self.by_string:
            return "", ""
        parts, stopped = self._route(self.parser.finish())
        if stopped:
            self.stopped = self.by_string = True
            return parts["content"], parts["reasoning"]
        return (parts["content"] + self.matchers["content"].flush(),
                parts["reasoning"] + self.matchers["reasoning"].flush())

    def matched(self) -> str | None:
        if not self.by_string:
            return None
        return next((m.matched for m in self.matchers.values() if m.matched), None)

    def feed(self, token_ids: Sequence[int]) -> tuple[int, str]:
        """The answer only (use :meth:`feed_parts` for the reasoning)."""
        n, content, _ = self.feed_parts(token_ids)
        return n, content

    def finish(self) -> str:
        return self.finish_parts()[0]
