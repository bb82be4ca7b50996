"""gpt-oss's harmony output format: the model's output split into messages and channels.

A gpt-oss chat prompt ends with the generation prompt ``<|start|>assistant`` (the checkpoint's
chat template writes it); the model then writes one or more messages:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

A message is a header (role, ``<|channel|>NAME``, an optional recipient ``to=...`` and content
type ``<|constrain|>json``), ``<|message|>``, its content, and an end: ``<|end|>`` (another
message may follow), ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call is done).
``analysis`` is the chain of thought, ``final`` the answer, ``commentary`` preambles and tool
calls. The control tokens are special tokens of the vocabulary (single ids).

:class:`HarmonyStreamParser` is fed output token ids one at a time and returns the text each adds
to the current message, never showing a control token, never half a UTF-8 character (each
message's content goes through its own :class:`IncrementalDetokenizer`).
:func:`parse_reference` parses a whole output at once by list splitting and bulk decoding; it is
the reference the streaming parser is tested against on random streams, chunkings and cuts.

The grammar both implement (ids, after the generation prompt):

* outside a message (a header is being read): ``<|message|>`` opens a message with that header;
  ``<|start|>`` or ``<|end|>`` drops the header read so far (a new one begins); text,
  ``<|channel|>`` and ``<|constrain|>`` extend the header.
* inside a message: text is content; ``<|end|>`` closes it; ``<|start|>`` closes it and begins a
  header (a missing ``<|end|>``); ``<|message|>``, ``<|channel|>``, ``<|constrain|>`` are dropped.
* ``<|return|>`` or ``<|call|>`` anywhere ends the output; later ids are ignored.
* output that does not follow the format is not lost: a header longer than MAX_HEADER_TOKENS, or
  one pending at the end of an output in which no message was opened and that holds no control
  token, is returned as text on channel None, with everything after it (control tokens dropped).
  A header cut off by the end of the output otherwise says nothing and is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.tokenizer import IncrementalDetokenizer

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
CONTROL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
REASONING_CHANNELS = frozenset({"analysis"})  # returned as reasoning; every other channel is answer
MAX_HEADER_TOKENS = 64  # a real header is a handful of tokens; longer: the output is not harmony


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of the harmony control tokens in one vocabulary."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    ret: int
    call: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "HarmonyTokens | None":
        """The ids from the tokenizer's vocabulary; None when any control token is missing or
        two share an id (the vocabulary is not a harmony one)."""
        hf = getattr(tokenizer, "hf", tokenizer)
        vocab = hf.get_vocab()
        ids = [vocab.get(name) for name in CONTROL_TOKENS]
        if any(i is None for i in ids) or len(set(ids)) != len(ids):
            return None
        return cls(*(int(i) for i in ids))

    @property
    def names(self) -> dict[int, str]:
        return dict(zip((self.start, self.end, self.message, self.channel, self.constrain,
                         self.ret, self.call), CONTROL_TOKENS))

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end an assistant turn (end-of-sequence for gpt-oss)."""
        return frozenset((self.ret, self.call))


def harmony_tokens_for(arch: str | None, tokenizer: Any) -> HarmonyTokens | None:
    """The harmony control ids when the model writes harmony: a ``gpt_oss`` model whose
    tokenizer has every control token. None for every other model (its output is plain text)."""
    if arch != "gpt_oss" or tokenizer is None:
        return None
    return HarmonyTokens.from_tokenizer(tokenizer)


@dataclass
class HarmonyMessage:
    """One message of the output. ``channel`` None: text outside the format (see module doc)."""

    channel: str | None
    role: str = "assistant"
    recipient: str | None = None
    content_type: str | None = None
    text: str = ""
    complete: bool = False  # closed by <|end|>, <|return|> or <|call|> (not cut off)

    @property
    def is_reasoning(self) -> bool:
        return self.channel in REASONING_CHANNELS


@dataclass(frozen=True)
class HarmonyDelta:
    """Text added to message number ``index`` (0-based, in output order)."""

    index: int
    channel: str | None
    text: str


def parse_header(text: str) -> dict[str, str | None]:
    """``assistant to=functions.f<|channel|>commentary json`` -> role, channel, recipient,
    content type. The header's control tokens appear by name in ``text``."""
    head, has_channel, rest = text.partition(CHANNEL)
    rest, _, constrain = rest.partition(CONSTRAIN)
    out: dict[str, str | None] = {"role": "assistant", "channel": None, "recipient": None,
                                  "content_type": (constrain.replace(CHANNEL, " ").split() or [None])[0]}
    words = head.replace(CONSTRAIN, " ").split()
    roles = [w for w in words if not w.startswith("to=")]
    if roles:
        out["role"] = roles[0]
    for w in words + rest.split():
        if w.startswith("to=") and len(w) > 3 and out["recipient"] is None:
            out["recipient"] = w[3:]
    if has_channel:
        names = [w for w in rest.split() if not w.startswith("to=")]
        if names:
            out["channel"] = names[0]
            if out["content_type"] is None and len(names) > 1:
                out["content_type"] = names[1]  # "commentary json" (no <|constrain|>)
    return out


def _header_text(tokenizer: Any, names: dict[int, str], ids: Sequence[int]) -> str:
    """A header's ids as text: control tokens by name, text runs decoded."""
    out, run = [], []
    for t in ids:
        if t in names:
            if run:
                out.append(tokenizer.decode(run))
                run = []
            out.append(names[t])
        else:
            run.append(t)
    if run:
        out.append(tokenizer.decode(run))
    return "".join(out)


class HarmonyStreamParser:
    """Incremental harmony parser; ``push(id)`` -> the deltas it adds, ``finish()`` -> the rest.

    Invariant (tested): for any output ids, the deltas of ``push`` over them plus ``finish``,
    grouped by message, equal :func:`parse_reference` of the same ids.
    """

    def __init__(self, tokenizer: Any, tokens: HarmonyTokens) -> None:
        self._tok = tokenizer
        self._t = tokens
        self._names = tokens.names
        self.messages: list[HarmonyMessage] = []
        self._header: list[int] = []
        self._detok: IncrementalDetokenizer | None = None  # set while inside a message
        self._raw = False  # the output left the format (MAX_HEADER_TOKENS)
        self.done = False  # <|return|> or <|call|> seen
        self.stop_token: int | None = None

    @property
    def in_message(self) -> bool:
        return self._detok is not None

    def _open(self, msg: HarmonyMessage) -> None:
        self.messages.append(msg)
        self._detok = IncrementalDetokenizer(self._tok)

    def _delta(self, text: str) -> list[HarmonyDelta]:
        if not text:
            return []
        msg = self.messages[-1]
        msg.text += text
        return [HarmonyDelta(len(self.messages) - 1, msg.channel, text)]

    def _close(self, complete: bool) -> list[HarmonyDelta]:
        out = self._delta(self._detok.flush())
        self.messages[-1].complete = complete
        self._detok = None
        return out

    def _go_raw(self) -> list[HarmonyDelta]:
        """Leave the format: the pending header's text and everything after is channel None."""
        ids, self._header = [t for t in self._header if t not in self._names], []
        self._raw = True
        self._open(HarmonyMessage(channel=None))
        out: list[HarmonyDelta] = []
        for t in ids:
            out += self._delta(self._detok.push(t))
        return out

    def push(self, token_id: int) -> list[HarmonyDelta]:
        t = int(token_id)
        if self.done:
            return []
        if t in (self._t.ret, self._t.call):
            self.done, self.stop_token = True, t
            return self._close(True) if self.in_message else self._end_header()
        if self._raw:
            return [] if t in self._names else self._delta(self._detok.push(t))
        if self.in_message:
            if t == self._t.end:
                return self._close(True)
            if t == self._t.start:
                return self._close(False)
            if t in self._names:  # <|message|>, <|channel|>, <|constrain|> inside content
                return []
            return self._delta(self._detok.push(t))
        # reading a header
        if t in (self._t.start, self._t.end):
            self._header = []
            return []
        if t == self._t.message:
            head = parse_header(_header_text(self._tok, self._names, self._header))
            self._header = []
            self._open(HarmonyMessage(**head))
            return []
        self._header.append(t)
        if len(self._header) > MAX_HEADER_TOKENS:
            return self._go_raw()
        return []

    def push_many(self, token_ids: Sequence[int]) -> list[HarmonyDelta]:
        out: list[HarmonyDelta] = []
        for t in token_ids:
            out += self.push(t)
        return out

    def _end_header(self) -> list[HarmonyDelta]:
        """The output ends while a header is pending: it is text outside the format when no
        message was opened and it holds no control token (see module doc), else dropped."""
        if self._header and not self.messages and not any(t in self._names for t in self._header):
            return self._go_raw() + self._close(self.done)
        self._header = []
        return []

    def finish(self) -> list[HarmonyDelta]:
        """End of output (a stop, max_tokens, an abort): close what is open."""
        if self.in_message:
            return self._close(self.done)
        return self._end_header()


def parse_reference(tokenizer: Any, tokens: HarmonyTokens, ids: Sequence[int]) -> list[HarmonyMessage]:
    """The reference parse of a whole output: cut at the first stop, split at the boundaries,
    decode each message's content at once. Same grammar as :class:`HarmonyStreamParser`."""
    names = tokens.names
    ids = [int(t) for t in ids]
    stops = [k for k, t in enumerate(ids) if t in (tokens.ret, tokens.call)]
    complete_end = bool(stops)
    if stops:
        ids = ids[:stops[0]]
    msgs: list[HarmonyMessage] = []

    def text_of(part: Sequence[int]) -> str:
        return tokenizer.decode([t for t in part if t not in names])

    k = 0
    while k < len(ids):
        # a header: from k to the next <|message|>, restarted after each <|start|>/<|end|>
        j, head_from = k, k
        while j < len(ids) and ids[j] != tokens.message:
            if ids[j] in (tokens.start, tokens.end):
                head_from = j + 1
            elif j - head_from + 1 > MAX_HEADER_TOKENS:
                msgs.append(HarmonyMessage(channel=None, text=text_of(ids[head_from:]),
                                           complete=complete_end))
                return msgs
            j += 1
        if j == len(ids):  # a header cut off by the end of the output
            pending = ids[head_from:]
            if pending and not msgs and not any(t in names for t in pending):
                msgs.append(HarmonyMessage(channel=None, text=text_of(pending), complete=complete_end))
            return msgs
        head = parse_header(_header_text(tokenizer, names, ids[head_from:j]))
        # its content: to the next <|end|> or <|start|>
        e = j + 1
        while e < len(ids) and ids[e] not in (tokens.end, tokens.start):
            e += 1
        closed = e < len(ids) and ids[e] == tokens.end
        msgs.append(HarmonyMessage(**head, text=text_of(ids[j + 1:e]),
                                   complete=closed or (e == len(ids) and complete_end)))
        k = e + 1 if closed else e  # <|start|> begins the next header (and is dropped there)
    return msgs


@dataclass
class SplitText:
    """An output's text in two parts: reasoning (analysis channel) and answer (the rest);
    messages of one part are joined by a newline."""

    content: str = ""
    reasoning: str = ""
    messages: list[HarmonyMessage] = field(default_factory=list)


def split_reference(tokenizer: Any, tokens: HarmonyTokens, ids: Sequence[int]) -> SplitText:
    msgs = parse_reference(tokenizer, tokens, ids)
    return SplitText(content="\n".join(m.text for m in msgs if not m.is_reasoning and m.text),
                     reasoning="\n".join(m.text for m in msgs if m.is_reasoning and m.text),
                     messages=msgs)
