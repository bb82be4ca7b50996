"""Anthropic's Messages API on the session's deployment (the HTTP actor `serve --http` starts, the
tiny random MoE) through the official ``anthropic`` client: greedy text equals the in-process
engine's for the same rendered chat, streamed and not; usage and count_tokens are the prompt's
tokens; a client that goes away mid-stream leaves no KV block behind; a wrong key is a 401."""

from __future__ import annotations

import pytest

from tests.services.test_http_api import KEY, MODEL, http, wait_idle  # noqa: F401 (http: fixture)

pytestmark = pytest.mark.ray

anthropic = pytest.importorskip("anthropic")


@pytest.fixture(scope="module")
def client(http):
    return anthropic.Anthropic(base_url=http, api_key=KEY, max_retries=0, timeout=120)


def test_text_streamed_and_not_equals_the_in_process_engine(client, reference):
    system, turns = "say yes", [{"role": "user", "content": "hello world"},
                                {"role": "assistant", "content": "yes"},
                                {"role": "user", "content": "who are you"}]
    ids = reference.tokenizer.apply_chat_template([{"role": "system", "content": system}, *turns])
    want_ids, want = reference(ids, 12), reference.text(ids, 12)
    r = client.messages.create(model=MODEL, max_tokens=12, system=system, messages=turns,
                               extra_body={"temperature": 0})
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ids), len(want_ids))
    assert r.stop_reason == ("max_tokens" if len(want_ids) == 12 else "end_turn")
    assert client.messages.count_tokens(model=MODEL, system=system, messages=turns).input_tokens == len(ids)
    with client.messages.stream(model=MODEL, max_tokens=12, system=system, messages=turns,
                               extra_body={"temperature": 0}) as s:
        pieces = list(s.text_stream)
        got = s.get_final_message()
    assert "".join(pieces) == want and len(pieces) > 1
    assert got.content[0].text == want and got.stop_reason == r.stop_reason
    assert (got.usage.input_tokens, got.usage.output_tokens) == (len(ids), len(want_ids))


def test_a_stream_the_client_leaves_frees_its_blocks(app, client, reference):
    with client.messages.stream(model=MODEL, max_tokens=100, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": " ".join(["hello"] * 8)}]) as s:
        for _ in s.text_stream:
            break  # leave after the first piece: the connection closes
    s = wait_idle(app)
    assert (s["kv_blocks_used"], s["running"], s["waiting"]) == (0, 0, 0)


def test_wrong_key_is_a_401(http):
    with pytest.raises(anthropic.AuthenticationError) as ei:
        anthropic.Anthropic(base_url=http, api_key="nope", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "authentication_error"
