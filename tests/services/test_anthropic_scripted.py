"""Anthropic's Messages API (services/http/anthropic_*) through the official ``anthropic`` client,
on the real router and HTTP server with a scripted decode actor (tests/services/test_harmony_api):
a random model writes no reasoning, stop sequence or tool call of its own, so the decode actor
plays a script and everything after the tokens is the real path (router text stage, reasoning
split, HTTP server, Anthropic formatting). The model is a tiny gpt-oss whose template thinks
(harmony's analysis channel): thinking blocks, streamed and not, in Anthropic's event order;
count_tokens equals the prompt the decode actor got; stop_sequences; max_tokens; keys by
x-api-key and bearer; images refused by name; a full queue is a 429; errors in Anthropic's shape.
No Ray: one process, one event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest

from tests.services.test_harmony import ANALYSIS, FINAL, SCRIPT
from tests.services.local_handles import InProcessServer
from tests.services.test_harmony_api import ScriptedDecode, _script, gpt_oss_store  # noqa: F401 (fixture)

anthropic = pytest.importorskip("anthropic")
MODEL = "tiny-gpt-oss"
KEY = "anthropic-test-key"
SYSTEM = "Answer briefly."
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


class GatedDecode(ScriptedDecode):
    """ScriptedDecode whose requests wait for ``gate`` (set: they play at once)."""

    def __init__(self, eos: set[int]) -> None:
        super().__init__(eos)
        self.gate = asyncio.Event()
        self.gate.set()

    async def _play(self, sink, n_prompt, sampling):
        await self.gate.wait()
        await super()._play(sink, n_prompt, sampling)


@pytest.fixture(scope="module")
def served(gpt_oss_store):  # noqa: F811
    """(base url, router, decode, loop): router + keyed HTTP server on a private event loop."""
    from services.http.server import key_digest

    dec = GatedDecode(eos=set())
    server = InProcessServer(gpt_oss_store, "anthropic-inproc", MODEL, dec, api_key_sha256=key_digest(KEY))
    with server as (url, router):
        yield url, router, dec, server.loop


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0, timeout=60)


def post(url: str, body: dict, headers: dict[str, str]) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def events(raw: bytes) -> list[tuple[str, dict]]:
    """Server-sent events -> [(event name, data)]; every event has both lines."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == name_line[len("event: "):]
        out.append((data["type"], data))
    return out


def test_thinking_and_text_blocks_not_streamed(served, client):
    _, router, dec, _ = served
    dec.script = _script(router, SCRIPT)
    r = client.messages.create(model=MODEL, max_tokens=200, system=SYSTEM,
                               messages=[{"role": "user", "content": QUESTION}])
    assert dec.calls[-1][0] == router.tokenizer.apply_chat_template(MESSAGES)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert (r.content[0].thinking, r.content[1].text) == (ANALYSIS, FINAL)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)
    n = dec.script.index(router.harmony.ret) + 1
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(dec.calls[-1][0]), n)


def test_streamed_events_in_anthropic_order_and_the_sdk_assembles_them(served, client):
    _, router, dec, _ = served
    dec.script = _script(router, SCRIPT)
    status, headers, raw = post(f"{served[0]}/v1/messages", {
        "model": MODEL, "max_tokens": 200, "stream": True, "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}]}, {"x-api-key": KEY})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    evs = events(raw)
    names = [n for n, _ in evs]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    body = names[2:-2]
    # two blocks, each start, deltas, stop; never interleaved
    t_start, t_stop = body.index("content_block_start"), body.index("content_block_stop")
    assert set(body[t_start + 1:t_stop]) == {"content_block_delta"} and t_stop - t_start > 3
    assert body[t_stop + 1] == "content_block_start" and body[-1] == "content_block_stop"
    blocks = [d["content_block"] for n, d in evs if n == "content_block_start"]
    assert blocks == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]
    deltas = [d for n, d in evs if n == "content_block_delta"]
    thinking = "".join(d["delta"]["thinking"] for d in deltas if d["index"] == 0)
    text = "".join(d["delta"]["text"] for d in deltas if d["index"] == 1)
    assert {d["delta"]["type"] for d in deltas} == {"thinking_delta", "text_delta"}
    assert (thinking, text) == (ANALYSIS, FINAL)
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    delta = evs[-2][1]
    n = dec.script.index(router.harmony.ret) + 1
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": len(dec.calls[-1][0]), "output_tokens": n}
    # the official client's stream helper assembles the same message as the plain call
    with client.messages.stream(model=MODEL, max_tokens=200, system=SYSTEM,
                                messages=[{"role": "user", "content": QUESTION}]) as s:
        got = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in got.content] == [
        ("thinking", ANALYSIS), ("text", FINAL)]
    assert got.stop_reason == "end_turn" and got.usage.output_tokens == n


def test_count_tokens_is_the_prompt_the_engine_gets(served, client):
    _, router, dec, _ = served
    dec.script = _script(router, SCRIPT)
    msgs = [{"role": "user", "content": QUESTION}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=msgs).input_tokens
    r = client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=msgs)
    assert counted == len(dec.calls[-1][0]) == r.usage.input_tokens
    assert counted == len(router.tokenizer.apply_chat_template(MESSAGES))


def test_blocks_system_list_and_multi_turn_render_as_the_plain_form(served, client):
    """Content blocks and a system block list are the same prompt as plain strings; an earlier
    assistant turn with a thinking block renders as the template renders reasoning."""
    _, router, dec, _ = served
    dec.script = _script(router, SCRIPT)
    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": QUESTION}]
    client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=turns)
    plain = dec.calls[-1][0]
    assert plain == router.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, *turns])
    blocks = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]},
              {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    client.messages.create(model=MODEL, max_tokens=4, system=[{"type": "text", "text": SYSTEM}],
                           messages=blocks)
    assert dec.calls[-1][0] == plain


def test_effort_reaches_the_template(served, client):
    _, router, dec, _ = served
    dec.script = _script(router, SCRIPT)
    client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM,
                           messages=[{"role": "user", "content": QUESTION}],
                           extra_body={"output_config": {"effort": "high"}})
    prompt = dec.calls[-1][0]
    assert prompt == router.tokenizer.apply_chat_template(MESSAGES, reasoning_effort="high")
    assert "Reasoning: high" in router.tokenizer.decode(prompt)


def test_stop_sequences_and_max_tokens(served, client):
    _, router, dec, _ = served
    dec.script = _script(router, "<|channel|>final<|message|>one two three four five six<|return|>")
    r = client.messages.create(model=MODEL, max_tokens=200, stop_sequences=["zzz", "four"],
                               messages=[{"role": "user", "content": QUESTION}])
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("stop_sequence", "four", "one two three ")
    with client.messages.stream(model=MODEL, max_tokens=200, stop_sequences=["four"],
                                messages=[{"role": "user", "content": QUESTION}]) as s:
        got = s.get_final_message()
    assert (got.stop_reason, got.stop_sequence, got.content[0].text) == ("stop_sequence", "four", "one two three ")
    r = client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": QUESTION}],
                               extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11})
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 5
    sampling = dec.calls[-1][1]
    assert (sampling["max_tokens"], sampling["temperature"], sampling["top_p"], sampling["top_k"],
            sampling["seed"]) == (5, 0.5, 0.9, 7, 11)


def test_keys_by_x_api_key_and_bearer_and_errors_in_anthropic_shape(served):
    url = served[0]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    count = {"model": MODEL, "messages": body["messages"]}  # count_tokens takes no max_tokens
    assert post(f"{url}/v1/messages/count_tokens", count, {"x-api-key": KEY})[0] == 200
    assert post(f"{url}/v1/messages/count_tokens", count, {"Authorization": f"Bearer {KEY}"})[0] == 200
    status, _, raw = post(f"{url}/v1/messages/count_tokens", body, {"x-api-key": KEY})
    assert status == 400 and json.loads(raw)["error"]["message"].startswith("max_tokens: unknown field")
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=body["messages"]).input_tokens > 0
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        status, _, raw = post(f"{url}/v1/messages", body, headers)
        assert status == 401 and json.loads(raw) == {"type": "error", "error": {
            "type": "authentication_error", "message": json.loads(raw)["error"]["message"]}}
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**body)
    # 404 of an unknown path under the prefix, in Anthropic's shape too
    status, _, raw = post(f"{url}/v1/messages/nothing", body, {"x-api-key": KEY})
    assert status in (404, 405) and json.loads(raw)["type"] == "error"


@pytest.mark.parametrize("change,param,words", [
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "messages[0].content[1]", ["image", "text-only"]),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]},
     "messages[0].content[0]", ["document"]),
    ({"max_tokens": 0}, "max_tokens", ["greater than or equal to 1"]),
    ({"temperature": 1.5}, "temperature", ["less than or equal to 1"]),
    ({"output_config": {"effort": "max"}}, "output_config.effort", ["low", "high"]),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048, "display": "omitted"}},
     "thinking.display", ["summarized"]),
    ({"top_q": 1}, "top_q", ["unknown field"]),
    ({"model": "claude-x"}, "model", ["not served here"]),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", ["user", "assistant"]),
    ({"tool_choice": {"type": "any"}}, "tool_choice", ["needs tools"]),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", ["server tool"]),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                       "input": "not an object"}]}]},
     "messages[0].content[0].input", ["object"]),
])
def test_bad_requests_are_400s_naming_the_field(served, client, change, param, words):
    _, _, dec, _ = served
    n = len(dec.calls)
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **change}
    status, _, raw = post(f"{served[0]}/v1/messages", body, {"x-api-key": KEY})
    err = json.loads(raw)
    assert status == 400 and set(err) == {"type", "error"} and set(err["error"]) == {"type", "message"}
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["message"].startswith(param + ":"), err
    assert all(w in err["error"]["message"] for w in words), err
    assert len(dec.calls) == n  # nothing reached the engine


def test_the_client_raises_bad_request_for_an_image(served, client):
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert ei.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in ei.value.body["error"]["message"]


def test_full_queue_is_a_429_in_anthropic_shape(served, client):
    _, router, dec, loop = served
    dec.script = _script(router, SCRIPT)
    old = asyncio.run_coroutine_threadsafe(router.set_limits(queue_size=1), loop).result(10)
    loop.call_soon_threadsafe(dec.gate.clear)
    try:
        held = threading.Thread(target=lambda: client.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": QUESTION}]))
        held.start()
        for _ in range(200):
            if router.active:
                break
            threading.Event().wait(0.02)
        assert router.active
        with pytest.raises(anthropic.RateLimitError) as ei:
            client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
        assert ei.value.body["error"]["type"] == "rate_limit_error"
        assert int(ei.value.response.headers["retry-after"]) >= 1
    finally:
        loop.call_soon_threadsafe(dec.gate.set)
        asyncio.run_coroutine_threadsafe(router.set_limits(queue_size=old["queue_size"]), loop).result(10)
    held.join(30)
    assert not held.is_alive()
