"""Request bodies before any model sees them (issue 28, point 7): a JSON body nested 100,000
arrays deep is a 400 on every POST endpoint, not a 500 (Python's decoder raised RecursionError);
the depth scan (services/http/schemas.json_depth) agrees with a recursive reference on random
JSON. The server runs here without Ray: nothing of these requests reaches the router."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from services.http import schemas

POST_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens")


def reference_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    return 0


def random_json(rng: random.Random, depth: int):
    kind = rng.randrange(6) if depth > 0 else rng.randrange(3)
    if kind == 0:  # strings full of brackets, quotes and escapes: none of them nests
        return "".join(rng.choice('[]{}"\\ab\n\u00e9') for _ in range(rng.randrange(8)))
    if kind == 1:
        return rng.randrange(-1000, 1000)
    if kind == 2:
        return rng.choice([None, True, False, 1.5])
    if kind in (3, 4):
        return [random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    # keys with brackets and quotes in them too
    return {f"k{i}{random_json(rng, 0)}": random_json(rng, depth - 1) for i in range(rng.randrange(4))}


def test_depth_scan_matches_the_recursive_reference_on_random_json():
    rng = random.Random(28)
    for _ in range(400):
        value = random_json(rng, rng.randrange(12))
        for indent in (None, 1):
            raw = json.dumps(value, indent=indent, ensure_ascii=rng.random() < 0.5).encode()
            assert schemas.json_depth(raw) == reference_depth(value), raw


@pytest.mark.parametrize("model", ["ChatCompletionRequest", "CompletionRequest"])
def test_parse_body_refuses_deep_nesting_with_a_400(model):
    cls = getattr(schemas, model)
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(schemas.OpenAIError) as ei:
        schemas.parse_body(cls, deep)
    assert ei.value.status == 400 and ei.value.code == "invalid_json"
    assert str(schemas.MAX_JSON_DEPTH) in ei.value.message
    # at the limit the scan lets it through; the model then judges the content
    ok = b'{"model": "m", "prompt": "x", "metadata": ' + b"[" * (schemas.MAX_JSON_DEPTH - 1) + \
        b"]" * (schemas.MAX_JSON_DEPTH - 1) + b"}"
    assert schemas.json_depth(ok) == schemas.MAX_JSON_DEPTH
    with pytest.raises(schemas.OpenAIError) as ei:
        schemas.parse_body(cls, ok)
    assert "nests" not in ei.value.message


def _serve_and_post(paths, body: bytes, headers: dict[str, str]) -> list[tuple[int, dict]]:
    import aiohttp

    from services.http.server import HttpService, HttpSettings

    async def run():
        svc = HttpService(HttpSettings(host="127.0.0.1", port=0, model_name="m").model_dump_json(),
                          router=object(), decode=object(), autostart=False)
        host, port = await svc.start()
        try:
            out = []
            async with aiohttp.ClientSession() as s:
                for path in paths:
                    async with s.post(f"http://{host}:{port}{path}", data=body, headers=headers) as r:
                        out.append((r.status, await r.json()))
            return out
        finally:
            await svc.close()

    return asyncio.run(run())


def test_every_post_endpoint_answers_a_100000_deep_body_with_a_400():
    body = b"[" * 100_000 + b"]" * 100_000
    answers = _serve_and_post(POST_PATHS, body, {"Content-Type": "application/json"})
    for path, (status, err) in zip(POST_PATHS, answers):
        assert status == 400, (path, status, err)
        if path.startswith("/v1/messages"):  # Anthropic's error shape
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
            assert str(schemas.MAX_JSON_DEPTH) in err["error"]["message"]
        else:
            assert err["error"]["code"] == "invalid_json" and str(schemas.MAX_JSON_DEPTH) in err["error"]["message"]
