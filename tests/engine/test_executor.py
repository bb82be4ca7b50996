"""engine.executor: the one place that picks how a step runs. The model's forward is the torch
reference and never calls the native step; the executor runs the native step where it can and
equals the reference within float32 summation order; one executor per model, its native step
rebuilt after the model's modules change; a declared router override (trace replay) routes the
torch layers and the native step alike."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.executor import executor_for
from engine.experts.runtime import load_from_store
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.layers.moe import Routing
from engine.options import configure
from engine.quant.formats import QuantFormat
from engine.quant.kernels import load_extension
from engine.store import convert
from tests.engine.models.hf_tiny import make_checkpoint
from tests.engine.test_step import Counting, close

pytestmark = pytest.mark.skipif(load_extension() is None, reason="native kernels unavailable")

PROMPT = [5, 17, 33, 8, 61, 12, 40, 3, 27]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("executor")
    make_checkpoint("qwen3_moe", d / "hf", hidden_size=64, num_hidden_layers=3, head_dim=16, num_attention_heads=4,
                    num_key_value_heads=2, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=True)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


@pytest.fixture
def fused_on():
    prev = configure()
    configure(fused_step=True, int8_activations=False)
    yield
    configure(prev)


def _prefill_and_decode(run, cfg) -> list[torch.Tensor]:
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    return [run(torch.tensor(PROMPT), BatchLayout.single(0, len(PROMPT), 0), kv, all_logits=True),
            run(torch.tensor([7]), BatchLayout.single(0, 1, len(PROMPT)), kv, all_logits=True)]


def _spy(model) -> Counting:
    step = executor_for(model).native()
    assert step is not None, "the native step should apply to an int8-dense model on the CPU"
    step.ext = Counting(step.ext)
    return step.ext


def test_model_forward_is_the_torch_reference_and_the_executor_runs_native(store, fused_on):
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        cfg = sm.model.config
        calls = _spy(sm.model).calls
        want = _prefill_and_decode(sm.model, cfg)
        assert sum(calls.values()) == 0  # the model's forward never reaches the native step
        got = _prefill_and_decode(executor_for(sm.model), cfg)
        assert calls["run_layers"] >= 2 and calls["attn_block"] == 0  # the layers of both steps, natively
        for a, b in zip(got, want):
            close(a, b, 2e-4)
        configure(fused_step=False)  # the executor's torch path is the model's forward itself
        for a, b in zip(_prefill_and_decode(executor_for(sm.model), cfg), want):
            assert torch.equal(a, b)


def test_one_executor_per_model_and_its_native_step_follows_the_modules(store, fused_on):
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        ex = executor_for(sm.model)
        assert executor_for(sm.model) is ex and ex.model is sm.model
        step = ex.native()
        assert step is not None and ex.native() is step  # built once
        sm.model.modules_changed()
        rebuilt = ex.native()
        assert rebuilt is not None and rebuilt is not step
        twin = copy.copy(sm.model)  # carries the executor in its __dict__: not reused
        assert executor_for(twin) is not ex and executor_for(twin).model is twin


def test_a_declared_router_override_routes_the_torch_layers_and_the_native_step(store, fused_on):
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        cfg = sm.model.config
        k = cfg.moe.top_k

        def fixed(layer):
            def route(x, allowed=None):  # experts (layer + t) % 8 and (layer + t + 3) % 8 for row t
                t = torch.arange(x.shape[0]).unsqueeze(1)
                ids = (layer + t + torch.tensor([[0, 3]])) % 8
                return Routing(torch.full((x.shape[0], k), 1.0 / k), ids)
            return route

        seen: dict[str, list] = {"torch": [], "native": []}
        path = ["torch"]
        for block in sm.model.moe_blocks:
            block.router_override = fixed(block.layer)
            block.observers.append(lambda layer, ids: seen[path[0]].append((layer, ids.tolist())))
        calls = _spy(sm.model).calls
        want = _prefill_and_decode(sm.model, cfg)
        path[0] = "native"
        got = _prefill_and_decode(executor_for(sm.model), cfg)
        assert calls["route"] == 0 and calls["ffn_block"] == 2 * cfg.num_layers  # routed by the override
        assert seen["native"] == seen["torch"]
        n = len(PROMPT)
        assert seen["torch"][0] == (0, [[t % 8, (t + 3) % 8] for t in range(n)])
        for a, b in zip(got, want):
            close(a, b, 2e-4)
        for block in sm.model.moe_blocks:
            block.router_override = None
        _prefill_and_decode(executor_for(sm.model), cfg)
        assert calls["route"] == 2 * cfg.num_layers  # the native router again
