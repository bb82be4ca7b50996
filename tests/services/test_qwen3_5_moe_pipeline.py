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

from protocol import ErrorReply, GenerateResult

pytestmark = pytest.mark.ray

NAMESPACE = "moestream-qwen35moe-test"
MODEL = "qwen3.5-tiny"
SHAPE = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=32)


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
def minimal_budget(q35_store):
    from engine.experts.tiers import align_up
    from engine.store import ExpertStore

    with ExpertStore(q35_store) as s:
        assert s.config.arch == "qwen3_5_moe"
        return s.config.moe.top_k * align_up(s.expert_nbytes)


@pytest.fixture(scope="module")
def q35_app(ray_cluster, q35_store, minimal_budget):
    from services.app import deploy
    from services.config import DeployConfig

    cfg = DeployConfig(store=q35_store, namespace=NAMESPACE, loaders=1, device_budget=minimal_budget,
                       kv_budget="4MiB", prefetch_depth=0, dense_format="bf16", request_timeout_s=120,
                       speculative="ngram", max_draft=4)
    app = deploy(cfg)
    yield app
    app.shutdown()


def _prompts() -> list[list[int]]:
    """Three prompts, one longer than a DeltaNet chunk (64), with repeats for prompt lookup."""
    motif = [5, 17, 33, 8, 61, 12, 40]
    return [[9, 4, 71], (motif * 3)[:20], (motif * 12)[:80]]


def test_pipeline_matches_the_in_process_engine(q35_app, q35_store, minimal_budget):
    import ray

    from engine.experts.runtime import load_from_store
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine
    from services.client import MoestreamClient

    max_tokens = 40
    with load_from_store(q35_store, device_budget=minimal_budget, prefetch_depth=0, dense="bf16") as sm:
        want = [Engine.for_requests(sm.model, sm.tokenizer, len(p) + max_tokens)
                .generate([Request(p, SamplingConfig(max_tokens=max_tokens))])[0].output_ids
                for p in _prompts()]
        assert sm.cache.metrics.total().misses > 0

    assert min(len(t) for t in want) >= 24  # no early end-of-sequence
    client = MoestreamClient(namespace=NAMESPACE)
    for prompt, tokens in zip(_prompts(), want):
        for speculative in (None, False):  # the deployment's default (ngram), and plain decoding
            msgs = list(client.generate(prompt_token_ids=prompt, sampling={
                "temperature": 0.0, "max_tokens": max_tokens, "speculative": speculative}))
            assert not [m for m in msgs if isinstance(m, ErrorReply)], msgs
            assert isinstance(msgs[-1], GenerateResult) and msgs[-1].token_ids == tokens
    stats = ray.get(q35_app.decode.stats.remote())
    assert (stats["kv_blocks_used"], stats["kv_sequences"], stats["running"], stats["waiting"]) == (0, 0, 0, 0), stats


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
