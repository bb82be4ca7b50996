"""The output parsers (engine.agent): reasoning split, tool calls of every text syntax, and
their streaming invariant: any chunking of an output gives the same deltas, assembled, as the
whole output at once; malformed calls come back as text."""

from __future__ import annotations

import json
import random

import pytest

from engine.agent.deltas import Chain, collect
from engine.agent.reasoning import ThinkParser
from engine.agent.syntax import AgentSyntax, detect_syntax, make_parser, opens_reasoning
from engine.agent.tools import (DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP,
                                deepseek_parser, hermes_parser, qwen_xml_parser)
from engine.errors import ConfigError

WEATHER = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "days": {"type": "integer"},
                                                             "metric": {"type": "boolean"}}}}


def run(make, text, cuts=None):
    """Feed ``text`` cut at ``cuts`` (None: whole) to a fresh parser -> Collected."""
    p = make()
    cuts = sorted(cuts or [])
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    deltas = []
    for piece in pieces:
        deltas += p.feed(piece)
    deltas += p.finish()
    return collect(deltas), deltas


def chunkings(text, n=60, seed=0):
    rng = random.Random(seed)
    yield []
    if len(text) < 2:
        return
    yield list(range(1, len(text)))  # one character at a time
    for _ in range(n):
        yield rng.sample(range(1, len(text)), rng.randint(1, min(8, len(text) - 1)))


def same_everywhere(make, text):
    whole, _ = run(make, text)
    for cuts in chunkings(text):
        got, _ = run(make, text, cuts)
        assert (got.content, got.reasoning) == (whole.content, whole.reasoning), cuts
        assert [(c.name, c.arguments) for c in got.tool_calls] == \
            [(c.name, c.arguments) for c in whole.tool_calls], cuts
    return whole


# ---- reasoning ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text,opened,reasoning,content", [
    ("<think>\nLet me see.</think>\n\nParis.", False, "Let me see.", "Paris."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Let me see.</think>\n\nParis.", True, "Let me see.", "Paris."),
    ("\n\nParis.", False, "", "\n\nParis."),
    ("Paris <think>not reasoning</think>", False, "", "Paris <think>not reasoning</think>"),
    ("<think>cut off before the end", False, "cut off before the end", ""),
    ("still thinking <thi", True, "still thinking <thi", ""),
    ("<thi", False, "", "<thi"),
    ("", True, "", ""),
])
def test_think_split(text, opened, reasoning, content):
    got = same_everywhere(lambda: ThinkParser(opened=opened), text)
    assert (got.reasoning, got.content) == (reasoning, content)


def test_a_prompt_that_opened_think_is_detected():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")


# ---- tool calls --------------------------------------------------------------------------------

HERMES = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
          '\n</tool_call>\n')


def test_hermes_calls_at_every_chunking():
    got = same_everywhere(lambda: hermes_parser(WEATHER), HERMES)
    assert got.content == "I will check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert len({c.id for c in got.tool_calls}) == 2 and all(c.id.startswith("call_") for c in got.tool_calls)


@pytest.mark.parametrize("body", [
    '{"name": "get_weather", "arguments": {"city": "Par',  # JSON cut
    '{"arguments": {"city": "Paris"}}',  # no name
    '{"name": "launch_rockets", "arguments": {}}',  # not an offered tool
    '{"name": "get_weather", "arguments": [1, 2]}',  # arguments not an object
    'get_weather(city="Paris")',  # not JSON at all
])
def test_a_malformed_hermes_call_is_text(body):
    text = f"Sure. <tool_call>\n{body}\n</tool_call> done"
    got = same_everywhere(lambda: hermes_parser(WEATHER), text)
    assert got.tool_calls == [] and got.content == text


def test_a_call_left_open_at_the_end_is_parsed_if_it_is_whole():
    got = same_everywhere(lambda: hermes_parser(WEATHER),
                          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n')
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("get_weather", {"city": "Rome"})]
    got = same_everywhere(lambda: hermes_parser(WEATHER), '<tool_call>\n{"name": "get_wea')
    assert got.tool_calls == [] and got.content == '<tool_call>\n{"name": "get_wea'


def test_arguments_as_a_json_string_are_unwrapped():
    got, _ = run(lambda: hermes_parser(None),
                 '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("f", {"x": 1})]


QWEN_XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n"
            "</tool_call>")


def test_qwen3_coder_xml_with_typed_parameters():
    got = same_everywhere(lambda: qwen_xml_parser(WEATHER), "Checking. " + QWEN_XML)
    assert got.content == "Checking. "
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        ("get_weather", {"city": "San Francisco", "days": 3, "metric": True})]
    bad = "<tool_call>\n<function=get_weather>\nnot a parameter\n</function>\n</tool_call>"
    got = same_everywhere(lambda: qwen_xml_parser(WEATHER), bad)
    assert got.tool_calls == [] and got.content == bad


def test_deepseek_v3_and_v31_calls():
    v3 = (f"Let me look.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
          f'{{"city": "Lima"}}\n```{DS_CALL_END}{DS_CALLS_END}')
    got = same_everywhere(lambda: deepseek_parser(WEATHER), v3)
    assert got.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("get_weather", {"city": "Lima"})]
    v31 = (f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}{{\"city\": \"Kyiv\"}}{DS_CALL_END}"
           f"{DS_CALL_BEGIN}get_weather{DS_SEP}{{\"city\": \"Bern\"}}{DS_CALL_END}{DS_CALLS_END}")
    got = same_everywhere(lambda: deepseek_parser(WEATHER), v31)
    assert [json.loads(c.arguments)["city"] for c in got.tool_calls] == ["Kyiv", "Bern"]
    assert got.content == ""


def test_reasoning_then_calls_through_one_chain():
    text = "<think>\nThe user wants weather.</think>\n\n" + HERMES
    got = same_everywhere(lambda: Chain(ThinkParser(), hermes_parser(WEATHER)), text)
    assert got.reasoning == "The user wants weather."
    assert got.content == "I will check.\n" and len(got.tool_calls) == 2
    # a <tool_call> inside the reasoning is reasoning, not a call
    got, _ = run(lambda: Chain(ThinkParser(opened=True), hermes_parser(WEATHER)),
                 'maybe <tool_call>{"name": "get_weather", "arguments": {}}</tool_call></think>ok')
    assert got.tool_calls == [] and got.content == "ok" and "<tool_call>" in got.reasoning


# ---- syntax detection --------------------------------------------------------------------------

@pytest.mark.parametrize("template,harmony,override,want", [
    ("{{ '<tool_call>' }}{% if tools %}{% endif %}", False, None, ("hermes", None, True)),
    ("<tool_call><function={{ name }}>{{ tools }}", False, None, ("qwen3_coder", None, True)),
    ("<think>{{ '<tool_call>' }}", False, None, ("hermes", "think", False)),
    ("<｜tool▁calls▁begin｜>{{ tools }}</think>", False, None, ("deepseek_v3", "think", True)),
    ("{{ messages }}", False, None, ("hermes", None, False)),
    (None, False, None, ("hermes", None, False)),
    ("{{ messages }}", True, None, ("harmony", "harmony", False)),
    ("<tool_call>", False, "qwen3_coder", ("qwen3_coder", None, False)),
])
def test_syntax_from_the_template(template, harmony, override, want):
    s = detect_syntax(template, harmony=harmony, override=override)
    assert (s.tools, s.reasoning, s.template_renders_tools) == want


def test_unknown_parser_names_are_refused():
    with pytest.raises(ConfigError, match="tool-call parser 'llama9'"):
        detect_syntax("", override="llama9")
    with pytest.raises(ConfigError, match="token ids"):
        make_parser(AgentSyntax("harmony", "harmony"), None, "")
