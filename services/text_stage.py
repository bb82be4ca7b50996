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
