"""Requests through the model's own chat template (engine.agent.render): tools, earlier calls
and tool results, enable_thinking; a template that knows no tools gets them in Hermes form; a
template error is a typed error. Harmony tool calls parse from token ids."""

from __future__ import annotations

import json

import pytest

from engine.agent.deltas import collect
from engine.agent.render import render_chat
from engine.agent.syntax import detect_syntax
from engine.errors import RequestValidationError
from engine.tokenizer import Tokenizer

TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "parameters": json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning": "Call the tool.",
     "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]},
    {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1", "name": "get_weather"},
]


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    from tests.services.agent_tiny import make_agent_tokenizer

    d = tmp_path_factory.mktemp("agent_tok")
    make_agent_tokenizer(d)
    return Tokenizer.from_hf_dir(d)


def test_tools_calls_and_results_through_the_template(qwen_like):
    syntax = detect_syntax(qwen_like.hf.chat_template)
    assert (syntax.tools, syntax.reasoning, syntax.template_renders_tools) == ("hermes", "think", True)
    ids, text = render_chat(qwen_like, HISTORY, tools=TOOLS, syntax=syntax)
    assert ids == qwen_like.encode(text, add_special_tokens=False)
    assert '"name": "get_weather"' in text.split("</tools>")[0]  # the tool list, from the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    _, off = render_chat(qwen_like, HISTORY, tools=TOOLS, enable_thinking=False, syntax=syntax)
    assert off.endswith("<think>\n\n</think>\n\n")
    _, none = render_chat(qwen_like, HISTORY, tools=TOOLS, tool_choice="none", syntax=syntax)
    assert "<tools>" not in none and "<tools>" in text


def test_a_template_without_tools_gets_them_in_hermes_form(tmp_path):
    from transformers import AutoTokenizer

    from tests.services.agent_tiny import make_agent_tokenizer

    make_agent_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    hf.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok = Tokenizer(hf)
    syntax = detect_syntax(hf.chat_template)
    assert (syntax.tools, syntax.template_renders_tools) == ("hermes", False)
    _, text = render_chat(tok, HISTORY, tools=TOOLS, syntax=syntax)
    system = text.split("\n[user]")[0]
    assert system.startswith("[system] Be brief.\n\n# Tools") and '"name": "get_weather"' in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '[user] <tool_response>\n{"temperature": 21}\n</tool_response>' in text


def test_a_template_that_refuses_is_a_request_error(qwen_like, tmp_path):
    from transformers import AutoTokenizer

    from tests.services.agent_tiny import make_agent_tokenizer

    make_agent_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(RequestValidationError, match="roles must alternate"):
        render_chat(Tokenizer(hf), HISTORY[:2])


def test_harmony_tool_calls_from_token_ids(tmp_path):
    from engine.agent.harmony_calls import HarmonyAgentParser
    from engine.harmony import HarmonyTokens
    from tests.services.harmony_tiny import make_harmony_tokenizer

    make_harmony_tokenizer(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    T = HarmonyTokens.from_tokenizer(tok)
    out = ("<|channel|>analysis<|message|>Need weather.<|end|>"
           "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
           '{"location": "Tokyo"}<|call|>')
    ids = tok.encode(out, add_special_tokens=False)
    for step in (1, 3, len(ids)):
        p = HarmonyAgentParser(tok, T, {"get_weather": {}})
        deltas = []
        for k in range(0, len(ids), step):
            deltas += p.push_many(ids[k:k + step])
        got = collect(deltas + p.finish())
        assert got.reasoning == "Need weather." and got.content == ""
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("get_weather", {"location": "Tokyo"})]
    # without tools in the request, or with bad JSON, the message is text
    got = collect(HarmonyAgentParser(tok, T, None, parse_calls=False).push_many(ids))
    assert got.tool_calls == [] and got.content == '{"location": "Tokyo"}'
    bad = tok.encode(out.replace('{"location": "Tokyo"}', "location=Tokyo"), add_special_tokens=False)
    p = HarmonyAgentParser(tok, T, {"get_weather": {}})
    got = collect(p.push_many(bad) + p.finish())
    assert got.tool_calls == [] and got.content == "location=Tokyo"
