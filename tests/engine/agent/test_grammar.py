"""Structured output (engine.agent.grammar): the batched mask equals the one-token-at-a-time
reference on the rows it is given and leaves every other row bit-identical; in the engine, a
constrained request's sampled output follows its grammar while an unconstrained request in the
same batch gets exactly the tokens it gets alone; bad schemas are request errors."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine.agent.deltas import collect
from engine.agent.grammar import (Constraint, GrammarBackend, after_open_reasoning, apply_masks,
                                  apply_masks_reference, forced_calls_grammar, response_format_grammar)
from engine.agent.tools import hermes_parser
from engine.errors import RequestValidationError

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "n", "ok"],
          "properties": {"city": {"type": "string", "maxLength": 6},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
TOOLS = [{"name": "get_weather", "parameters": json.dumps(SCHEMA)},
         {"name": "noop", "parameters": json.dumps({"type": "object", "properties": {},
                                                     "additionalProperties": False})}]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from tests.services.agent_tiny import make_agent_store

    return make_agent_store(tmp_path_factory.mktemp("agent_store"))


@pytest.fixture(scope="module")
def sm(store):
    from engine.experts.runtime import load_from_store

    m = load_from_store(store, prefetch_depth=0)
    yield m
    m.close()


@pytest.fixture(scope="module")
def backend(sm):
    return GrammarBackend(sm.tokenizer, sm.model.config.vocab_size, sorted(sm.tokenizer.eos_token_ids))


def _advanced(backend, constraint, text):
    """A matcher for ``constraint`` that has accepted ``text``'s tokens."""
    m = backend.matcher(constraint)
    for t in backend_tokens(backend, text):
        assert m.accept_token(t), text
    return m


def backend_tokens(backend, text):
    return backend._tok.encode(text, add_special_tokens=False)


def test_batched_mask_equals_the_reference_and_leaves_other_rows_alone(sm, backend):
    backend._tok = sm.tokenizer
    js = response_format_grammar("json_schema", json.dumps(SCHEMA))
    calls = forced_calls_grammar("hermes", TOOLS, None)
    matchers = [backend.matcher(js), _advanced(backend, js, '{"city": "Pa'),
                backend.matcher(calls), _advanced(backend, calls, '<tool_call>\n{"name": "noop", "arguments": '),
                backend.matcher(response_format_grammar("json_object"))]
    V = sm.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, V, generator=g)
    rows = [1, 2, 4, 6, 8]
    fast, ref = logits.clone(), logits.clone()
    apply_masks(fast, rows, matchers)
    apply_masks_reference(ref, rows, matchers)
    assert torch.equal(fast, ref)
    for r in (0, 3, 5, 7):
        assert torch.equal(fast[r], logits[r])  # bit-identical: never written
    for r in rows:
        allowed = torch.isfinite(fast[r])
        assert 0 < int(allowed.sum()) < V
        assert torch.equal(fast[r][allowed], logits[r][allowed])


def test_bad_constraints_are_request_errors(backend):
    with pytest.raises(RequestValidationError, match="not valid JSON"):
        response_format_grammar("json_schema", "{nope")
    with pytest.raises(RequestValidationError, match="grammar kind 'yaml'"):
        Constraint("yaml", "")
    with pytest.raises(RequestValidationError, match="cannot build the output grammar"):
        backend.matcher(Constraint("json_schema", json.dumps({"type": "object", "minProperties": "x"})))
    with pytest.raises(RequestValidationError, match="not enforced for this model's tool-call syntax"):
        forced_calls_grammar("deepseek_v3", TOOLS, None)


def test_engine_constrained_rows_follow_the_grammar_and_others_are_untouched(sm):
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine

    tok = sm.tokenizer
    prompt = tok.encode("The weather in Paris", add_special_tokens=False)
    free = SamplingConfig(max_tokens=12, temperature=0.0)
    alone = Engine.for_requests(sm.model, tok, 256).generate([Request(prompt, free)])[0].output_ids
    js = response_format_grammar("json_schema", json.dumps(SCHEMA))
    named = forced_calls_grammar("hermes", TOOLS, "get_weather", parallel=False)
    engine = Engine.for_requests(sm.model, tok, 256, seqs=4)
    out = engine.generate([Request(prompt, SamplingConfig(max_tokens=80, temperature=1.0, seed=s, grammar=js))
                           for s in (1, 2)]
                          + [Request(prompt, free),
                             Request(prompt, SamplingConfig(max_tokens=90, temperature=1.0, seed=3, grammar=named))])
    assert out[2].output_ids == alone  # the unconstrained row: exactly its tokens alone
    for r in out[:2]:
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(tok.decode(r.output_ids)), SCHEMA)
    got = collect(hermes_parser({"get_weather": SCHEMA}).feed(tok.decode(out[3].output_ids)))
    assert out[3].finish_reason == "stop" and got.content == "" and len(got.tool_calls) == 1
    assert got.tool_calls[0].name == "get_weather"
    jsonschema.validate(json.loads(got.tool_calls[0].arguments), SCHEMA)


def test_a_prompt_that_opened_think_may_reason_first(backend, sm):
    backend._tok = sm.tokenizer
    c = after_open_reasoning(response_format_grammar("json_object"))
    m = _advanced(backend, c, 'some reasoning, {not json} </think>\n{"a": 1}')
    assert not m.is_terminated() and m.accept_token(sorted(sm.tokenizer.eos_token_ids)[0])
    m = backend.matcher(c)
    for t in backend_tokens(backend, "thinking"):
        assert m.accept_token(t)
    assert not m.accept_token(sorted(sm.tokenizer.eos_token_ids)[0])  # no end before the answer


def test_bounded_json_strings_refuse_raw_control_characters(backend, sm):
    """xgrammar 0.2.9 lets a maxLength string hold raw U+0000-U+001F (invalid JSON); the backend
    rewrites those rules, in a plain schema and inside a tool-call structural tag alike."""
    backend._tok = sm.tokenizer
    bell = sm.tokenizer.encode("\x07", add_special_tokens=False)
    for c, head in ((response_format_grammar("json_schema", json.dumps(SCHEMA)), '{"city": "P'),
                    (forced_calls_grammar("hermes", TOOLS, "get_weather"),
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P')):
        m = _advanced(backend, c, head)
        assert all(m.fork().accept_token(t) is False for t in bell[:1]), c.kind
        assert m.accept_token(backend_tokens(backend, "a")[0])
