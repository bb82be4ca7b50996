"""Reasoning in ``<think>...</think>`` (Qwen3, DeepSeek-R1/V3.1, QwQ): split from the answer.

The reasoning opens at the very start of the output (after whitespace) with ``<think>``, or was
already opened by the prompt (templates that end the generation prompt with ``<think>``:
``opened=True``). It ends at the first ``</think>``; everything after is the answer. A
``<think>`` later in the answer is answer text. Whitespace right after either tag is dropped.
Output that ends inside the reasoning leaves it all reasoning (streamed or not, the same split).
"""

from __future__ import annotations

from engine.agent.deltas import Delta
from engine.agent.text import held_prefix

OPEN, CLOSE = "<think>", "</think>"


class ThinkParser:
    def __init__(self, opened: bool = False, open_tag: str = OPEN, close_tag: str = CLOSE) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        # start: nothing decided yet; reasoning; content; the *_lead states drop leading space
        self.state = "reasoning_lead" if opened else "start"
        self.buf = ""

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while self.buf:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(self.open_tag):
                    self.buf, self.state = s[len(self.open_tag):], "reasoning_lead"
                elif s and not self.open_tag.startswith(s):
                    self.state = "content"
                else:
                    break  # whitespace or a prefix of <think>: wait
            elif self.state.endswith("_lead"):
                s = self.buf.lstrip()
                if not s:
                    self.buf = ""
                    break
                self.buf, self.state = s, self.state[:-5]
            elif self.state == "reasoning":
                i = self.buf.find(self.close_tag)
                if i >= 0:
                    out.append(Delta("reasoning", self.buf[:i]))
                    self.buf, self.state = self.buf[i + len(self.close_tag):], "content_lead"
                    continue
                keep = held_prefix(self.buf, (self.close_tag,))
                out.append(Delta("reasoning", self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:  # content
                out.append(Delta("content", self.buf))
                self.buf = ""
        return [d for d in out if d.text]

    def finish(self) -> list[Delta]:
        buf, self.buf = self.buf, ""
        if not buf or self.state.endswith("_lead"):
            return []
        return [Delta("reasoning" if self.state == "reasoning" else "content", buf)]
