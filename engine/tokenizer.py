"""Tokenizer layer: a thin wrapper over a transformers tokenizer, streaming detokenization, and
stop-string matching.

* :class:`Tokenizer` loads from a Hugging Face directory (``tokenizer.json``, or a sentencepiece
  ``tokenizer.model`` that transformers 5 converts) or from the vocabulary inside a GGUF file.
  Never fetches from a hub (``local_files_only``) and never runs repository code
  (``trust_remote_code=False``).
* :class:`IncrementalDetokenizer` turns a token stream into text deltas whose concatenation
  equals ``tokenizer.decode(all ids)``.
* :class:`StopStringMatcher` cuts a text stream at the first stop string without ever emitting
  text that might turn out to be the start of one.

transformers is imported lazily so importing this module stays cheap.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from engine.configio.fields import token_ids
from engine.errors import ModelFormatError, RequestValidationError, TokenizerNotFoundError, quote

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete/invalid UTF-8 byte sequence
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")  # sentencepiece byte-fallback pieces


# Files transformers may read from a tokenizer directory: each must resolve inside it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")
# What a broken tokenizer file can raise inside transformers/tokenizers (Rust panics surface as
# pyo3's PanicException, a BaseException subclass caught separately by name).
_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError, ImportError, IndexError,
                AttributeError, AssertionError, RecursionError)


def _check_text(text: Any, what: str = "text to encode") -> None:
    """A str that can be encoded as UTF-8: lone surrogates (from bytes decoded with
    ``surrogateescape``, i.e. input that was not valid UTF-8) make tokenizers raise TypeError."""
    if not isinstance(text, str):
        raise RequestValidationError(f"{what} must be a str, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestValidationError(
                f"{what} is not valid UTF-8 (an undecodable byte or lone surrogate at character "
                f"{e.start})") from None


def _load_hf(blame: Path, kwargs: dict[str, Any], what: str = "the tokenizer", cls: Any = None) -> Any:
    """transformers' AutoTokenizer (or ``cls``), offline and without remote code; its failures
    become one ModelFormatError naming ``blame`` (the message excerpt is bounded: it may quote
    the file)."""
    from transformers import AutoTokenizer

    try:
        return (cls or AutoTokenizer).from_pretrained(**kwargs, local_files_only=True, trust_remote_code=False)
    except _LOAD_ERRORS as e:
        problem = f"cannot load {what} ({type(e).__name__}): {quote(str(e), 120)}"
    except BaseException as e:  # a Rust panic in tokenizers (pyo3 PanicException)
        if type(e).__name__ != "PanicException":
            raise
        problem = f"cannot load {what}: the tokenizers library rejected it"
    raise ModelFormatError(blame, problem)


def _generation_eos_ids(root: Path) -> set[int]:
    """Extra end-of-sequence ids from generation_config.json (null, an int or a list of ints)."""
    gen = root / "generation_config.json"
    if not gen.is_file():
        return set()
    try:
        raw = json.loads(gen.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ModelFormatError(gen, "not valid UTF-8 JSON") from None
    value = raw.get("eos_token_id") if isinstance(raw, dict) else None
    return set(token_ids(value, "eos_token_id", gen, allow_list=True))


class Tokenizer:
    """The model's tokenizer. ``special_ids`` are the ids ``decode`` skips by default."""

    def __init__(self, hf_tokenizer: Any, *, source: str = "", extra_eos_ids: Iterable[int] = ()) -> None:
        self._tok = hf_tokenizer
        self.source = source
        eos = set(extra_eos_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # Ids that decode(skip_special_tokens=True) drops: the backend's added tokens marked
        # special (which is what tokenizers itself filters on), plus transformers' own list.
        special = {int(i) for i, tok in getattr(hf_tokenizer, "added_tokens_decoder", {}).items()
                   if getattr(tok, "special", False)}
        special.update(int(i) for i in hf_tokenizer.all_special_ids)
        self.special_ids: frozenset[int] = frozenset(special)
        # Byte-fallback pieces ("<0xE6>"), when the decoder has a ByteFallback step. That step
        # decodes each *run* of consecutive byte pieces as a unit: valid UTF-8 -> the text,
        # otherwise one U+FFFD per byte. So a run's text is not final until the run ends.
        self.byte_fallback_ids: frozenset[int] = frozenset()
        decoder = getattr(getattr(hf_tokenizer, "backend_tokenizer", None), "decoder", None)
        if decoder is not None and "ByteFallback" in str(decoder):
            self.byte_fallback_ids = frozenset(
                int(i) for piece, i in hf_tokenizer.get_vocab().items() if _BYTE_PIECE.match(piece))

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        root = Path(path)
        if not root.is_dir():
            raise TokenizerNotFoundError(f"tokenizer directory {root} does not exist")
        if not ((root / "tokenizer.json").is_file() or (root / "tokenizer.model").is_file()):
            raise TokenizerNotFoundError(
                f"no tokenizer in {root}: expected tokenizer.json, or tokenizer.model with a "
                f"tokenizer_config.json naming its class (e.g. LlamaTokenizer)"
            )
        from engine.loading.paths import confine_existing

        confine_existing(root, TOKENIZER_FILES)
        tok = _load_hf(root, dict(pretrained_model_name_or_path=str(root)))
        return cls(tok, source=str(root), extra_eos_ids=_generation_eos_ids(root))

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """The vocabulary, merges and chat template stored in a GGUF file's metadata."""
        file = Path(path)
        if not file.is_file():
            raise TokenizerNotFoundError(f"no GGUF file {file.name} in {file.parent}")
        kw = dict(pretrained_model_name_or_path=str(file.parent), gguf_file=file.name)
        try:
            tok = _load_hf(file, kw, what="a tokenizer from the GGUF metadata")
        except ModelFormatError as first:
            # AutoTokenizer parses the model config first and refuses architectures transformers
            # lacks (qwen3next); the fast tokenizer itself is built from tokenizer.ggml.* alone
            from transformers import PreTrainedTokenizerFast

            try:
                tok = _load_hf(file, kw, what="a tokenizer from the GGUF metadata", cls=PreTrainedTokenizerFast)
            except ModelFormatError:
                raise first from None
        return cls(tok, source=str(file))

    # ---- basic API -------------------------------------------------------------------------
    @property
    def hf(self) -> Any:
        """The underlying transformers tokenizer."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (the model's embedding
        table may be larger: padded rows decode to nothing)."""
        return len(self._tok)

    @property
    def bos_token_id(self) -> int | None:
        b = self._tok.bos_token_id
        return None if b is None else int(b)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _check_text(text)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. No "clean up tokenization spaces" post-processing: it would make
        the text of a sequence differ from the concatenation of its parts (streaming)."""
        try:
            return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=False)
        except OverflowError:
            raise RequestValidationError(f"token ids must be non-negative, got {list(ids)[:16]}") from None

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id (e.g. ``'▁h'``, ``'<0xE6>'``, ``'Ġw'``)."""
        piece = self._tok.convert_ids_to_tokens(int(token_id))
        if piece is None:
            raise RequestValidationError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return piece

    # ---- chat ------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat_template(self, messages: list[dict], **template_vars: Any) -> str:
        """The chat prompt as text, ending with the assistant's generation prompt.
        ``template_vars`` (e.g. ``reasoning_effort``) are variables the template may read."""
        if not self.has_chat_template:
            raise RequestValidationError(
                f"the tokenizer of {self.source or 'this model'} has no chat template; "
                f"send a plain prompt instead of chat messages"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RequestValidationError("messages must be a list of {'role': ..., 'content': ...} objects")
        return self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **template_vars)

    def apply_chat_template(self, messages: list[dict], **template_vars: Any) -> list[int]:
        """Token ids of the rendered chat prompt. The template writes any BOS itself, so the
        text is encoded without adding special tokens (as transformers does)."""
        return self.encode(self.render_chat_template(messages, **template_vars), add_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"


class IncrementalDetokenizer:
    """Streaming detokenization: ``push`` returns the new, complete text after each token.

    Decoding a token alone is wrong twice over: sentencepiece strips the leading space of the
    first piece it decodes (``'▁w'`` -> ``'w'``), and a byte-level or byte-fallback token may
    carry only part of a multi-byte UTF-8 character. So each step decodes a small window
    ``ids[prefix:]`` and emits what it adds beyond ``decode(ids[prefix:read])`` (the window's
    already-emitted part, whose first piece loses its space the same way), and holds the step
    back while the text ends in U+FFFD (an incomplete character) or adds nothing. With a
    sentencepiece byte-fallback vocabulary it also holds back while the last token is a byte
    piece: the decoder turns a whole run of byte pieces into U+FFFDs if any later byte of the
    run makes it invalid, so text from a run is final only once the run has ended.

    Invariant: ``''.join(pushes) + flush() == tokenizer.decode(all pushed ids)`` (and, with
    ``prompt_ids``, the text the generated ids add after the prompt), unless more than
    MAX_PENDING tokens were ever held back at once. Only ``ids[prefix:]`` is kept. Special ids are dropped
    before they enter the window when ``skip_special_tokens`` is set: a window holding only a
    skipped id would otherwise make the next piece "first" and lose its space.
    """

    PROMPT_CONTEXT = 6  # prompt tokens kept as left context for the first generated token
    # Held-back tokens beyond which text is emitted anyway. Valid text never gets near this
    # (a character is <= 4 bytes; byte-piece runs end at the next word piece); it bounds the
    # quadratic re-decoding of a model emitting an endless run of invalid bytes, at the cost of
    # the invariant below for such garbage only.
    MAX_PENDING = 64

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = [int(i) for i in (prompt_ids or ()) if int(i) not in self._skipped]
        self._bytes = tokenizer.byte_fallback_ids
        self._read = len(self._ids)  # ids[:read] have been emitted (or are prompt)
        prefix = max(0, self._read - self.PROMPT_CONTEXT)  # window start, <= read
        while prefix > 0 and self._ids[prefix - 1] in self._bytes:
            prefix -= 1  # never start the window inside a run of byte pieces
        del self._ids[:prefix]  # keep only the window: offsets below are relative to it
        self._read -= prefix
        self._prefix = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def _step(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        if len(self._ids) - self._read > self.MAX_PENDING:
            final = True  # see MAX_PENDING
        if not final and self._ids[-1] in self._bytes:
            return ""  # inside a run of byte pieces (see class docstring)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # nothing yet, or an incomplete character: wait for more tokens
        # new_text starts with prefix_text for every decoder we know (pieces only append;
        # Strip only touches the window's first piece, which both decodes share).
        delta = new_text[len(prefix_text):]
        # The emitted tokens become the next window's prefix; older ids are no longer needed.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        return delta

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id in self._skipped:
            return ""
        self._ids.append(token_id)
        return self._step(final=False)

    def flush(self) -> str:
        """Whatever is still held back (e.g. a byte sequence that never completed -> U+FFFD)."""
        return self._step(final=True)


class StopStringMatcher:
    """Cut a streamed text at the first occurrence of any stop string.

    ``feed`` returns ``(emit, stopped)``: ``emit`` is text certainly before any stop string;
    a suffix that could still grow into a stop string is withheld until it can't (or until
    :meth:`flush`). Once a stop string is seen, the text before it is emitted, the stop string
    itself is not, and every later feed returns ``("", True)``.
    """

    def __init__(self, stop_strings: Iterable[str]) -> None:
        stops = list(dict.fromkeys(stop_strings))  # dedupe, keep order
        for s in stops:
            if not isinstance(s, str) or not s:
                raise RequestValidationError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop_strings: tuple[str, ...] = tuple(stops)
        self._buf = ""  # withheld text: a suffix that is a proper prefix of some stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def _held_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._buf + text
        hit_at, hit = -1, None
        for s in self.stop_strings:
            i = buf.find(s)
            if i != -1 and (hit_at == -1 or i < hit_at):
                hit_at, hit = i, s
        if hit is not None:
            self._buf, self.stopped, self.matched = "", True, hit
            return buf[:hit_at], True
        held = self._held_len(buf)
        self._buf = buf[len(buf) - held:] if held else ""
        return buf[:len(buf) - held], False

    def flush(self) -> str:
        """End of stream without a stop string: release the withheld suffix."""
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out
