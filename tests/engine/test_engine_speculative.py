"""Speculative decoding inside the serving engine's batched step, on the default kernel path.

An int4 MoE store run the way `moestream serve` runs it (native step, bf16 or int8 dense
linears, int4 experts with int8 activations where the CPU has VNNI, a small device expert
cache): 8 concurrent requests of different lengths, each speculating with one mode (and two
requests that do not), give exactly the tokens each gives alone with plain decoding. This is the
test that caught the kernels' batch dependence (tests/engine/quant/test_batch_invariance.py)."""

from __future__ import annotations

import pytest
import torch

from engine.executor import executor_for
from engine.experts.runtime import load_from_store, store_expert_bytes
from engine.generate import Request
from engine.kv.paged import PagedKVCache
from engine.layers.sampler import SamplingConfig
from engine.quant import kernels as K
from engine.quant.formats import QuantFormat
from engine.runner import Engine
from engine.scheduler import SchedulerConfig
from engine.speculative import SpeculativeConfig, layer_skip_draft
from engine.store import convert
from tests.engine.models.hf_tiny import make_checkpoint

pytestmark = pytest.mark.skipif(K.load_extension() is None, reason="native kernels not built")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_spec")
    make_checkpoint("qwen3_moe", d / "hf", hidden_size=64, num_hidden_layers=3, head_dim=16,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


def _requests() -> list[Request]:
    """8 prompts of different lengths with repeats in them (so prompt lookup finds matches),
    different max_tokens; the last two never speculate."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(8):
        motif = torch.randint(3, 96, (4 + i,), generator=gen).tolist()
        prompt = (motif * (2 + i % 3))[: 6 + 5 * i]
        out.append(Request(prompt, SamplingConfig(max_tokens=10 + 2 * i, ignore_eos=True,
                                                  speculative=False if i >= 6 else None)))
    return out


def _engine(sm, speculative=None, max_batched=64) -> Engine:
    m = sm.model.config
    kv = PagedKVCache(m.num_layers, m.num_kv_heads, m.head_dim, num_blocks=96, block_size=8,
                      dtype=torch.float32)
    return Engine(sm.model, None, kv, SchedulerConfig(max_num_batched_tokens=max_batched),
                  speculative=speculative)


@pytest.mark.parametrize("dense", ["bf16", "int8"])
@pytest.mark.parametrize("mode", ["ngram", "self", "draft"])
def test_batched_speculation_is_greedy_identical_on_the_default_path(store, mode, dense):
    budget = store_expert_bytes(store) // 4  # 6 of 24 experts: misses every step
    reqs = _requests()
    with load_from_store(store, device_budget=budget, dense=dense) as sm:
        assert executor_for(sm.model).native() is not None  # the fused native step, not the torch layers
        if K.load_extension().has_int8_dots():  # the default on such a CPU: int8 activations
            assert K.int8_activations()
        plain = _engine(sm)
        want = [plain.generate([r])[0].output_ids for r in reqs]  # each alone, no speculation

    with load_from_store(store, dense=dense) as full, \
            load_from_store(store, device_budget=budget, dense=dense) as sm:
        cfg = SpeculativeConfig(mode, max_draft=4, cache=sm.cache,
                                draft_model=layer_skip_draft(full.model, 2) if mode == "draft" else None)
        engine = _engine(sm, cfg)
        results = engine.generate(reqs)  # all 8 in one batch
        assert [r.output_ids for r in results] == want
        drafted = sum(r.spec.drafted for r in results if r.spec is not None)
        accepted = sum(r.spec.accepted for r in results if r.spec is not None)
        assert drafted > 0 and 0 < accepted <= drafted, (drafted, accepted)
        assert all(r.spec is None for r in results[6:])  # speculative=False was honoured
        m = engine.metrics()
        assert (m.draft_tokens, m.accepted_draft_tokens) == (drafted, accepted)
        assert m.kv.blocks_used == 0 and sm.cache.pins == {}


def test_rejected_drafts_are_not_recomputed(store):
    """Rollback is a length cut, not a re-prefill: tokens fed = prompt + emitted + rejected
    drafts (no preemption here), and a request alone equals itself in the batch."""
    reqs = _requests()[:6]
    with load_from_store(store, dense="int8") as sm:
        engine = _engine(sm, SpeculativeConfig("ngram", max_draft=4), max_batched=512)
        results = engine.generate(reqs)
        m = engine.metrics()
        rejected = m.draft_tokens - m.accepted_draft_tokens
        assert rejected > 0 and m.preemptions == 0
        fed = sum(len(r.prompt_ids) + len(r.output_ids) - 1 for r in results) + rejected
        assert m.computed_tokens == fed


def test_speculation_survives_preemption(store):
    """A KV cache too small for every request at once: sequences are preempted (their drafts
    dropped, prompt + output recomputed) and the tokens are still plain decoding's."""
    reqs = _requests()
    with load_from_store(store, dense="int8") as sm:
        want = [_engine(sm).generate([r])[0].output_ids for r in reqs]
        m = sm.model.config
        kv = PagedKVCache(m.num_layers, m.num_kv_heads, m.head_dim, num_blocks=12, block_size=8,
                          dtype=torch.float32)
        engine = Engine(sm.model, None, kv, SchedulerConfig(max_num_batched_tokens=32),
                        speculative=SpeculativeConfig("ngram", max_draft=4))
        results = engine.generate(reqs)
        assert [r.output_ids for r in results] == want
        assert engine.metrics().preemptions > 0
        assert kv.metrics().blocks_used == 0
