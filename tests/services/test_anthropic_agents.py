"""Tool calls and thinking through Anthropic's Messages API, with the official ``anthropic`` client,
on the tiny Qwen3-style model of tests/services/agent_tiny.py (its template lists tools, opens
``<think>`` unless thinking is disabled, and the model calls tools in Hermes ``<tool_call>`` JSON).

In process (the real router, parsers and HTTP server; a scripted decode actor writes the model's
text, as in tests/services/test_agents_api.py): a tool-use round trip (tool_use, tool_result,
final answer) streamed and not, thinking blocks from ``<think>``, ``thinking: disabled`` reaching
the template, a malformed call coming back as text, ``tool_choice`` reaching the sampler as a
grammar, count_tokens with tools.

On the session's Ray cluster (a real deployment of that model): ``tool_choice`` of one tool makes
the random model call it through the engine's masked sampler; the round trip, streamed and not."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.services.test_agents_api import ASK, CALL, END, MODEL, WEATHER, agent_store, real, script  # noqa: F401
from tests.services.local_handles import InProcessServer
from tests.services.test_harmony_api import ScriptedDecode

anthropic = pytest.importorskip("anthropic")
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def served(agent_store):  # noqa: F811
    dec = ScriptedDecode(eos=set())
    server = InProcessServer(agent_store, "anthropic-agents", MODEL, dec)
    with server as (url, router):
        yield url, router, dec, server.loop


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[0], api_key="none", max_retries=0, timeout=60)


def ask(client, stream: bool, **kw):
    """One message, streamed (assembled by the SDK's stream helper, events checked) or not."""
    if not stream:
        return client.messages.create(model=MODEL, **kw)
    kinds = []
    with client.messages.stream(model=MODEL, **kw) as s:
        for ev in s:
            kinds.append(ev.type)
        msg = s.get_final_message()
    # Anthropic's order: start, blocks (start, deltas, stop), delta, stop
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    return msg


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(served, client, stream):
    _, router, dec, _ = served
    dec.script = script(router, "The user wants the weather.</think>\n\n" + CALL + END)
    r = ask(client, stream, max_tokens=200, tools=TOOLS, messages=ASK)
    assert [b.type for b in r.content] == ["thinking", "tool_use"] and r.stop_reason == "tool_use"
    thinking, use = r.content
    assert thinking.thinking == "The user wants the weather."
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"}) and use.id
    prompt = router.tokenizer.decode(dec.calls[-1][0])
    assert '"name": "get_weather"' in prompt  # the tools, rendered by the model's template
    # the tool's result goes back as a tool_result block; the model answers
    dec.script = script(router, "It is sunny.</think>\n\nSunny and 21 degrees in Paris." + END)
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": '{"temperature": 21}'}]}]
    r = ask(client, stream, max_tokens=200, tools=TOOLS, messages=history)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == [
        ("thinking", "It is sunny."), ("text", "Sunny and 21 degrees in Paris.")]
    assert r.stop_reason == "end_turn"
    text = router.tokenizer.decode(dec.calls[-1][0])
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text


def test_streamed_tool_use_events(served):
    """The raw events of a call: a tool_use block opened with id and name and ``input: {}``,
    its arguments as input_json_delta pieces that join to the JSON text."""
    from tests.services.test_anthropic_scripted import events, post

    _, router, dec, _ = served
    dec.script = script(router, "Weather.</think>\n\n" + CALL + END)
    status, _, raw = post(f"{served[0]}/v1/messages", {
        "model": MODEL, "max_tokens": 200, "stream": True, "tools": TOOLS, "messages": ASK}, {})
    assert status == 200
    evs = events(raw)
    starts = [d["content_block"] for n, d in evs if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "tool_use"]
    assert starts[1]["name"] == "get_weather" and starts[1]["input"] == {} and starts[1]["id"]
    pieces = [d["delta"]["partial_json"] for n, d in evs
              if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(pieces)) == {"city": "Paris"}
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_call_comes_back_as_text(served, client, stream):
    _, router, dec, _ = served
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
    dec.script = script(router, "Hmm.</think>\n\n" + bad + END)
    r = ask(client, stream, max_tokens=200, tools=TOOLS, messages=ASK)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == [
        ("thinking", "Hmm."), ("text", bad)]
    assert r.stop_reason == "end_turn"


def test_thinking_disabled_reaches_the_template(served, client):
    _, router, dec, _ = served
    dec.script = script(router, "Paris." + END)
    r = client.messages.create(model=MODEL, max_tokens=50, messages=ASK, thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in r.content] == [("text", "Paris.")]
    assert router.tokenizer.decode(dec.calls[-1][0]).endswith("<think>\n\n</think>\n\n")
    dec.script = script(router, "Paris is in France.</think>\n\nParis." + END)
    r = client.messages.create(model=MODEL, max_tokens=50, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert router.tokenizer.decode(dec.calls[-1][0]).endswith("<think>\n")


def test_stop_sequence_in_the_answer(served, client):
    _, router, dec, _ = served
    dec.script = script(router, "Paris is in France.</think>\n\nParis, then more." + END)
    r = client.messages.create(model=MODEL, max_tokens=50, messages=ASK, stop_sequences=["then"])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == [
        ("thinking", "Paris is in France."), ("text", "Paris, ")]
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "then")


def test_tool_choice_reaches_the_sampler_and_count_tokens_counts_the_tools(served, client):
    _, router, dec, _ = served
    dec.script = script(router, CALL + END)
    client.messages.create(model=MODEL, max_tokens=20, tools=TOOLS, messages=ASK,
                           tool_choice={"type": "tool", "name": "get_weather"})
    prompt, sampling = dec.calls[-1]
    g = sampling["grammar"]
    assert g["kind"] == "structural_tag" and "<tool_call>" in g["text"] and "get_weather" in g["text"]
    client.messages.create(model=MODEL, max_tokens=20, tools=TOOLS, messages=ASK)
    assert dec.calls[-1][1]["grammar"] is None  # auto: free text, parsed
    n = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=ASK).input_tokens
    assert n == len(dec.calls[-1][0]) > client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    calls = len(dec.calls)
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model=MODEL, max_tokens=20, tools=TOOLS, messages=ASK,
                               tool_choice={"type": "tool", "name": "nope"})
    assert ei.value.body["error"]["type"] == "invalid_request_error" and "nope" in ei.value.body["error"]["message"]
    assert len(dec.calls) == calls


# --------------------------------------------------------------------------- the real pipeline


@pytest.mark.ray
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_round_trip_on_the_engine(real, stream):  # noqa: F811
    base = str(real.base_url).rstrip("/").removesuffix("/v1")
    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=300)
    r = ask(client, stream, max_tokens=80, tools=TOOLS, messages=ASK, thinking={"type": "disabled"},
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            extra_body={"temperature": 1.0, "seed": 7})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", r.content
    jsonschema.validate(uses[0].input, WEATHER)
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": [{"type": "text", "text": '{"temperature": 21}'}]}]}]
    r = ask(client, stream, max_tokens=6, tools=TOOLS, messages=history, thinking={"type": "disabled"},
            tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert r.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in r.content)
    assert r.usage.output_tokens >= 1
