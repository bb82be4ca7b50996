"""Qwen3-Next through the Ray pipeline: an int4 store of a tiny random Qwen3-Next, served with a
minimal device expert cache and n-gram speculation on by default (so the recurrent state's
checkpoint rollback runs in the decode actor), gives the greedy tokens of the in-process engine
with the same minimal cache and no speculation; state slots and KV blocks are freed after.
Its own deployment in its own namespace on the session's cluster, shut down at the end."""

from __future__ import annotations

import pytest

from protocol import ErrorReply, GenerateResult

pytestmark = pytest.mark.ray

NAMESPACE = "moestream-qwen3next-test"
SHAPE = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=32)


@pytest.fixture(scope="module")
def qn_store(tmp_path_factory):
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.qwen3_next_tiny import make_qwen3_next
    from tests.services.conftest import _add_tokenizer

    d = tmp_path_factory.mktemp("qwen3next_svc")
    make_qwen3_next(d / "hf", seed=5, **SHAPE)
    _add_tokenizer(d / "hf", 96)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


@pytest.fixture(scope="module")
def minimal_budget(qn_store):
    return top_k_budget(qn_store)


def top_k_budget(store) -> int:
    """Device bytes for top-k experts of ``store``: the minimal expert cache."""
    from engine.experts.tiers import align_up
    from engine.store import ExpertStore

    with ExpertStore(store) as s:
        return s.config.moe.top_k * align_up(s.expert_nbytes)


@pytest.fixture(scope="module")
def qn_app(ray_cluster, qn_store, minimal_budget):
    app = deploy_minimal(qn_store, NAMESPACE, minimal_budget)
    yield app
    app.shutdown()


def deploy_minimal(store, namespace: str, budget: int):
    """One loader, ``budget`` device bytes, bf16 dense, n-gram speculation on by default."""
    from services.app import deploy
    from services.config import DeployConfig

    return deploy(DeployConfig(store=store, namespace=namespace, loaders=1, device_budget=budget,
                               kv_budget="4MiB", prefetch_depth=0, dense_format="bf16", request_timeout_s=120,
                               speculative="ngram", max_draft=4))


def prompts() -> list[list[int]]:
    """Three prompts, one longer than a DeltaNet chunk (64), with repeats for prompt lookup."""
    motif = [5, 17, 33, 8, 61, 12, 40]
    return [[9, 4, 71], (motif * 3)[:20], (motif * 12)[:80]]


def test_pipeline_matches_the_in_process_engine(qn_app, qn_store, minimal_budget):
    max_tokens = 48  # long enough for this random model to repeat itself (prompt lookup hits)
    want = in_process_tokens(qn_store, minimal_budget, max_tokens)
    drafted, accepted = check_pipeline(qn_app, NAMESPACE, want, max_tokens)
    assert drafted > accepted > 0  # drafts verified in the decode actor, some rejected, rolled back


def check_pipeline(app, namespace: str, want: list[list[int]], max_tokens: int) -> tuple[int, int]:
    """Each of prompts() through the pipeline, with the deployment's default speculation and
    without, gives its tokens in ``want``; nothing left allocated after. -> (drafted, accepted)."""
    import ray

    from services.client import MoestreamClient

    client = MoestreamClient(namespace=namespace)
    drafted = accepted = 0
    for prompt, tokens in zip(prompts(), want):
        for speculative in (None, False):  # the deployment's default (ngram), and plain decoding
            msgs = list(client.generate(prompt_token_ids=prompt, sampling={
                "temperature": 0.0, "max_tokens": max_tokens, "speculative": speculative}))
            assert not [m for m in msgs if isinstance(m, ErrorReply)], msgs
            assert isinstance(msgs[-1], GenerateResult) and msgs[-1].token_ids == tokens
            u = msgs[-1].usage
            drafted += u.draft_tokens or 0
            accepted += u.accepted_draft_tokens or 0
    stats = ray.get(app.decode.stats.remote())
    assert (stats["kv_blocks_used"], stats["kv_sequences"], stats["running"], stats["waiting"]) == (0, 0, 0, 0), stats
    return drafted, accepted


def in_process_tokens(store, budget: int, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each of prompts() from the in-process engine on ``store`` with the
    same minimal cache, bf16 dense and no speculation (at least 24 each: no early end)."""
    from engine.experts.runtime import load_from_store
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine

    with load_from_store(store, device_budget=budget, prefetch_depth=0, dense="bf16") as sm:
        want = [Engine.for_requests(sm.model, sm.tokenizer, len(p) + max_tokens)
                .generate([Request(p, SamplingConfig(max_tokens=max_tokens))])[0].output_ids
                for p in prompts()]
        assert sm.cache.metrics.total().misses > 0
    assert min(len(t) for t in want) >= 24  # no early end-of-sequence
    return want
