"""Qwen3.5-MoE through the Ray pipeline: an int4 store converted from a tiny random
vision-language checkpoint (vision tower included on disk), served with a minimal device expert
cache and n-gram speculation on by default, gives the greedy tokens of the in-process engine with
the same minimal cache; over HTTP a chat request carrying an image is refused with a 400 naming
the model, a text one answered. Its own deployment in its own namespace, shut down at the end."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.services.test_qwen3_next_pipeline import (SHAPE, check_pipeline, deploy_minimal, in_process_tokens,
                                                    top_k_budget)

pytestmark = pytest.mark.ray

NAMESPACE = "moestream-qwen35moe-test"
MODEL = "qwen3.5-tiny"


@pytest.fixture(scope="module")
def q35_store(tmp_path_factory):
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.qwen3_5_moe_tiny import make_qwen3_5_moe
    from tests.services.conftest import _add_tokenizer

    d = tmp_path_factory.mktemp("qwen35moe_svc")
    make_qwen3_5_moe(d / "hf", seed=9, full_attention_interval=2, **SHAPE)
    _add_tokenizer(d / "hf", 96)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


@pytest.fixture(scope="module")
def q35_app(ray_cluster, q35_store):
    app = deploy_minimal(q35_store, NAMESPACE, top_k_budget(q35_store))
    yield app
    app.shutdown()


def test_pipeline_matches_the_in_process_engine(q35_app, q35_store):
    from engine.store import ExpertStore

    with ExpertStore(q35_store) as s:
        assert s.config.arch == "qwen3_5_moe"
    max_tokens = 40
    want = in_process_tokens(q35_store, top_k_budget(q35_store), max_tokens)
    check_pipeline(q35_app, NAMESPACE, want, max_tokens)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_image", "image_url": "https://example.com/cat.png"},
])
def test_http_chat_with_an_image_is_refused_naming_the_model(q35_app, part):
    from services.http.server import HttpSettings

    q35_app.stop_http()
    host, port = q35_app.start_http(HttpSettings(host="127.0.0.1", port=0, namespace=NAMESPACE,
                                                 model_name=MODEL))
    try:
        url = f"http://{host}:{port}/v1/chat/completions"
        content = [{"type": "text", "text": "what is in this picture"}, part]
        status, body = _post(url, {"model": MODEL, "max_tokens": 4,
                                   "messages": [{"role": "user", "content": content}]})
        assert status == 400, body
        err = body["error"]
        assert err["code"] == "unsupported_modality" and err["param"] == "messages[0].content[1]"
        assert f"model {MODEL!r} does not accept images" in err["message"]
        status, body = _post(url, {"model": MODEL, "max_tokens": 4, "temperature": 0,
                                   "messages": [{"role": "user", "content": content[:1]}]})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
    finally:
        q35_app.stop_http()
