"""Tool calls, reasoning and structured output through the OpenAI API, with the official
``openai`` client.

In process (router + HTTP server + a scripted decode actor, as tests/services/test_harmony_api.py
does): the model's text is scripted, so the exact parse is checked through the real router,
the real parsers and the real server: a tool-call round trip (call, tool result, final answer)
streamed and not, reasoning apart from the answer, a malformed call returned as text.

On the session's Ray cluster (a real deployment of a tiny random Qwen3-style MoE, its own
namespace): the grammar is what makes a random model call tools and write JSON, so these are
end to end through the engine's masked sampler: json_schema answers of 20 seeded requests at
temperature 1 validate against their schema; a named / required tool call round trip, streamed
and not."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.services.local_handles import InProcessServer
from tests.services.test_harmony_api import ScriptedDecode

openai = pytest.importorskip("openai")
MODEL = "tiny-agent"
# string lengths bounded by a pattern: a random byte-level model can write bytes that are not
# UTF-8 inside a string, which xgrammar 0.2.9 lets through (docs/agents.md); a pattern of ASCII
# letters keeps the tests about the schema, not about that
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
END = "<|im_end|>"


@pytest.fixture(scope="module")
def agent_store(tmp_path_factory):
    from tests.services.agent_tiny import make_agent_store

    return make_agent_store(tmp_path_factory.mktemp("agent_api"))


@pytest.fixture(scope="module")
def served(agent_store):
    """(base url, router, scripted decode): router + HTTP server on a private event loop."""
    dec = ScriptedDecode(eos=set())
    with InProcessServer(agent_store, "agents-inproc", MODEL, dec) as (url, router):
        yield url, router, dec


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0, timeout=60)


def script(router, text):
    return router.tokenizer.encode(text, add_special_tokens=False) + \
        router.tokenizer.encode(" never sent", add_special_tokens=False)


def streamed(client, **kw):
    """One streamed chat -> (content, reasoning, {index: [id, name, arguments]}, finish reason)."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or ():
            if tc.id is not None:
                assert tc.index not in calls and tc.type == "function"
                calls[tc.index] = [tc.id, tc.function.name, ""]
            calls[tc.index][2] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, reasoning, calls, finish


def whole(client, **kw):
    """One chat, not streamed -> the shape of :func:`streamed`."""
    r = client.chat.completions.create(model=MODEL, **kw)
    m = r.choices[0].message
    calls = {i: [c.id, c.function.name, c.function.arguments] for i, c in enumerate(m.tool_calls or ())}
    return m.content, m.model_extra.get("reasoning_content"), calls, r.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(served, client, stream):
    _, router, dec = served
    dec.script = script(router, "The user wants the weather.</think>\n\n" + CALL + END)
    chat = streamed if stream else whole
    content, reasoning, calls, finish = chat(client, messages=ASK, tools=TOOLS, max_tokens=200)
    (call_id, name, args), = calls.values()
    assert (finish, name, json.loads(args)) == ("tool_calls", "get_weather", {"city": "Paris"})
    assert not content and reasoning == "The user wants the weather."
    prompt = dec.calls[-1][0]
    assert '"name": "get_weather"' in router.tokenizer.decode(prompt)  # tools rendered by the template
    # the tool's result, then the final answer
    dec.script = script(router, "It is sunny.</think>\n\nSunny and 21 degrees in Paris." + END)
    history = ASK + [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": call_id, "type": "function",
                                      "function": {"name": name, "arguments": args}}]},
                     {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'}]
    content, reasoning, calls, finish = chat(client, messages=history, tools=TOOLS, max_tokens=200)
    assert (content, reasoning, calls, finish) == ("Sunny and 21 degrees in Paris.", "It is sunny.", {}, "stop")
    text = router.tokenizer.decode(dec.calls[-1][0])
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_call_comes_back_as_text(served, client, stream):
    _, router, dec = served
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
    dec.script = script(router, "Hmm.</think>\n\n" + bad + END)
    chat = streamed if stream else whole
    content, reasoning, calls, finish = chat(client, messages=ASK, tools=TOOLS, max_tokens=200)
    assert (content, reasoning, calls, finish) == (bad, "Hmm.", {}, "stop")


def test_reasoning_split_and_enable_thinking(served, client):
    _, router, dec = served
    dec.script = script(router, "Paris is in France.\n</think>\n\nParis." + END)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200)
    m = r.choices[0].message
    assert (m.content, m.model_extra["reasoning_content"]) == ("Paris.", "Paris is in France.\n")
    assert router.tokenizer.decode(dec.calls[-1][0]).endswith("<think>\n")  # the template opened it
    # thinking off: the template closes the block, the whole output is the answer
    dec.script = script(router, "Paris." + END)
    for extra in ({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, extra_body=extra)
        m = r.choices[0].message
        assert (m.content, m.model_extra["reasoning_content"]) == ("Paris.", "")
        assert router.tokenizer.decode(dec.calls[-1][0]).endswith("<think>\n\n</think>\n\n")


def test_grammar_reaches_the_sampler_and_bad_requests_are_400(served, client):
    _, router, dec = served
    dec.script = script(router, "{}" + END)
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, extra_body={"enable_thinking": False},
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "w", "schema": WEATHER}})
    assert dec.calls[-1][1]["grammar"] == {"kind": "json_schema", "text": json.dumps(WEATHER)}
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    g = dec.calls[-1][1]["grammar"]
    assert g["kind"] == "structural_tag" and "<tool_call>" in g["text"] and "</think>" in g["text"]
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, tools=TOOLS)
    assert dec.calls[-1][1]["grammar"] is None  # auto: free text, parsed
    n = len(dec.calls)
    for kw, param in [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "retrieval"}]), "tools[0].type"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": []}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "yaml"}), "response_format.type"),
    ]:
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **kw)
        assert ei.value.body["param"] == param, kw
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model=MODEL, max_tokens=8, messages=ASK + [{"role": "tool", "content": "x"}])
    assert len(dec.calls) == n  # refused before the engine


# --------------------------------------------------------------------------- the real pipeline


@pytest.fixture(scope="module")
def real(ray_cluster, agent_store):
    from services.app import deploy
    from services.config import DeployConfig
    from services.http.server import HttpSettings

    ns = "moestream-agents-test"
    app = deploy(DeployConfig(store=agent_store, namespace=ns, loaders=1, kv_budget="8MiB",
                              prefetch_depth=0, request_timeout_s=300, max_num_seqs=8))
    try:
        host, port = app.start_http(HttpSettings(host="127.0.0.1", port=0, namespace=ns, model_name=MODEL))
        yield openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=300)
    finally:
        app.shutdown()


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "ok", "tags"],
          "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["sun", "rain"]}}}}


@pytest.mark.ray
def test_json_schema_answers_validate_at_temperature_1(real):
    async def one(c, seed):
        r = await c.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=120, temperature=1.0, seed=seed,
            extra_body={"enable_thinking": False},
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}})
        return r.choices[0]

    async def all_of():
        c = openai.AsyncOpenAI(base_url=str(real.base_url), api_key="none", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(c, seed) for seed in range(20)))

    answers = asyncio.run(all_of())
    for ch in answers:
        assert ch.finish_reason == "stop", ch.message.content
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    assert len({ch.message.content for ch in answers}) > 10  # sampled, not one forced answer


@pytest.mark.ray
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_round_trip_on_the_engine(real, stream):
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=80, temperature=1.0, seed=7,
              parallel_tool_calls=False, extra_body={"enable_thinking": False})
    choice = {"type": "function", "function": {"name": "get_weather"}} if stream else "required"
    content, _, calls, finish = (streamed if stream else whole)(real, tool_choice=choice, **kw)
    (call_id, name, args), = calls.values()
    assert (finish, name, content or "") == ("tool_calls", "get_weather", "")
    jsonschema.validate(json.loads(args), WEATHER)
    history = ASK + [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": call_id, "type": "function",
                                      "function": {"name": name, "arguments": args}}]},
                     {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'}]
    r = real.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                     max_tokens=6, temperature=0, extra_body={"enable_thinking": False})
    m = r.choices[0].message
    assert m.tool_calls is None and isinstance(m.content, str) and r.choices[0].finish_reason in ("stop", "length")
