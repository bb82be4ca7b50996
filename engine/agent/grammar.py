"""Structured output: a grammar per constrained request, a token mask per step, in the sampler.

Specs (pure, no library): ``response_format_grammar`` (json_object / json_schema),
``forced_calls_grammar`` (tool_choice required / named, in the model's call syntax), and
``after_open_reasoning`` (a prompt that opened ``<think>``: free reasoning up to ``</think>``,
then the constraint). Every spec is a Constraint (protocol.GrammarSpec on the wire); forced calls and reasoning prefixes
are xgrammar structural tags (JSON).

Masks (xgrammar, chosen over llguidance and outlines-core by measured mask time per token on a
248k-token vocabulary: docs/agents.md): ``GrammarBackend`` compiles a spec once per distinct text
(LRU) against the model's vocabulary; each constrained sequence holds a ``GrammarMatcher``.
``apply_masks(logits [R, V], rows, matchers)`` fills one bitmask [R, ceil(V/32)] int32 at those
rows and applies it to exactly them in one call; rows not listed are not read or written.
``apply_masks_reference`` does the same one token at a time (the test oracle).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engine.errors import RequestValidationError

CACHE_SIZE = 64  # compiled grammars kept (distinct schemas)
KINDS = ("json_object", "json_schema", "ebnf", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """What the output must follow (protocol.GrammarSpec on the wire): ``kind`` one of KINDS,
    ``text`` the JSON schema, EBNF grammar or structural tag (JSON)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestValidationError(f"grammar kind {self.kind!r} is unknown; allowed: {list(KINDS)}")
        if not isinstance(self.text, str):
            raise RequestValidationError("grammar text must be a str")


# ---- specs ------------------------------------------------------------------------------------

def _schema(text: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise RequestValidationError(f"{what}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise RequestValidationError(f"{what}: a JSON schema must be an object")
    return value


def response_format_grammar(kind: str, schema_text: str | None = None) -> Constraint | None:
    """``response_format`` -> its grammar (None for "text")."""
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(kind="json_object")
    if schema_text is None:
        raise RequestValidationError("response_format json_schema: needs a schema")
    _schema(schema_text, "response_format.json_schema.schema")
    return Constraint(kind="json_schema", text=schema_text)


def _call_tag(syntax: str, name: str, params: dict) -> dict:
    """One call of ``name`` in the model's syntax, its arguments following ``params``."""
    if syntax == "hermes":
        # at most one whitespace character in a row: the arguments cannot run on as blank space
        return {"type": "tag", "begin": '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ',
                "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": 1},
                "end": "}\n</tool_call>"}
    if syntax == "qwen3_coder":
        return {"type": "tag", "begin": f"<tool_call>\n<function={name}>\n",
                "content": {"type": "json_schema", "json_schema": params, "style": "qwen_xml"},
                "end": "\n</function>\n</tool_call>"}
    raise RequestValidationError(
        f"tool_choice required/named is not enforced for this model's tool-call syntax ({syntax}); "
        f"use tool_choice auto")


def forced_calls_grammar(syntax: str, tools: Sequence[dict], name: str | None,
                         parallel: bool = True) -> Constraint:
    """tool_choice required (``name`` None: any offered tool, one or more calls) or a named
    tool (``name``: calls of it only): the whole output is calls, in ``syntax``."""
    tags = []
    for t in tools:
        if name is not None and t["name"] != name:
            continue
        params = t.get("parameters") or "{}"
        params = _schema(params, f"tools[{t['name']}].parameters") if isinstance(params, str) else params
        tags.append(_call_tag(syntax, t["name"], params))
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": not parallel}
    return Constraint(kind="structural_tag", text=json.dumps({"type": "structural_tag", "format": fmt}))


def _format_of(spec: Constraint) -> dict:
    if spec.kind == "structural_tag":
        return json.loads(spec.text)["format"]
    if spec.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.kind == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(spec.text)}
    return {"type": "grammar", "grammar": spec.text}


def after_open_reasoning(spec: Constraint, close_tag: str = "</think>") -> Constraint:
    """The prompt opened the reasoning: any text up to ``close_tag``, then ``spec``."""
    # models write a blank line or two after the tag: allowed before the constrained part
    think = {"type": "tag", "begin": "", "content": {"type": "any_text"},
             "end": [close_tag + "\n\n", close_tag + "\n", close_tag]}
    fmt = {"type": "sequence", "elements": [think, _format_of(spec)]}
    return Constraint(kind="structural_tag", text=json.dumps({"type": "structural_tag", "format": fmt}))


# ---- compile and match (xgrammar) --------------------------------------------------------------

# xgrammar 0.2.9 writes the characters of a length-bounded JSON string (maxLength/minLength) as
# [^"\\\r\n], which admits raw control characters (U+0000-U+001F) that JSON forbids unescaped:
# a sampled answer then fails json.loads. Its unbounded strings exclude them; bounded ones are
# rewritten to do the same (escapes stay unavailable there, as before).
_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\]'


def json_strings_without_controls(grammar):
    """``grammar`` (an xgrammar Grammar) with length-bounded JSON strings that exclude control
    characters (see above); unchanged when it has none."""
    text = str(grammar)
    if _LOOSE_CHARS not in text:
        return grammar
    return type(grammar).from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS))


class GrammarBackend:
    """Compiles specs for one vocabulary. ``tokenizer``: engine.tokenizer.Tokenizer;
    ``vocab_size``: the model's logits width (>= the tokenizer's; padded ids are never allowed);
    ``stop_ids``: the tokens that end the output once the grammar is complete."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        hf = getattr(tokenizer, "hf", tokenizer)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(set(int(t) for t in stop_ids)))
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: Constraint) -> Any:
        key = (spec.kind, spec.text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        G = self._xgr.Grammar
        try:
            if spec.kind == "json_object":
                grammar = G.builtin_json_grammar()
            elif spec.kind == "json_schema":
                grammar = G.from_json_schema(spec.text, any_whitespace=False)
            elif spec.kind == "structural_tag":
                grammar = G.from_structural_tag(spec.text)
            else:
                grammar = G.from_ebnf(spec.text)
            compiled = self.compiler.compile_grammar(json_strings_without_controls(grammar))
        except Exception as e:  # xgrammar: bad schema / grammar / tag
            raise RequestValidationError(f"cannot build the output grammar ({spec.kind}): "
                                         f"{type(e).__name__}: {str(e)[:300]}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: Constraint) -> Any:
        return self._xgr.GrammarMatcher(self.compile(spec))


def apply_masks(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> None:
    """logits [R, V] float on the CPU: rows ``rows[i]`` get ``matchers[i]``'s next-token mask
    (disallowed -> -inf), all in one bitmask and one kernel call; other rows are untouched."""
    if not rows:
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    # one bitmask row per logits row (xgrammar indexes both by the same row number); only the
    # listed rows are filled and applied
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    for r, m in zip(rows, matchers):
        m.fill_next_token_bitmask(bitmask, r)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=list(rows))


def allowed_reference(matcher: Any, vocab: int) -> torch.Tensor:
    """bool [V]: the tokens ``matcher`` accepts next, tried one by one on a fork (slow: tests)."""
    ok = torch.zeros(vocab, dtype=torch.bool)
    for t in range(vocab):
        f = matcher.fork()
        ok[t] = bool(f.accept_token(t))
    return ok


def apply_masks_reference(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> None:
    for r, m in zip(rows, matchers):
        logits[r] = logits[r].masked_fill(~allowed_reference(m, logits.shape[-1]), -torch.inf)
