"""Per-layer graphs (engine.cuda_graphs) through the CPU seam: RecordedGraph records each layer's
callable at capture and re-runs it at replay on the static buffers, with the grouped MoE kernels
in Triton's interpreter. The eager layers are the reference. The CUDA capture itself: tests/gpu."""

from __future__ import annotations

import pytest
import torch

from engine import cuda_graphs as CG
from engine.errors import ConfigError
from engine.executor import executor_for
from engine.quant import triton_kernels as TK

needs_triton = pytest.mark.skipif(not TK.supports(torch.device("cpu")),
                                  reason="Triton's interpreter is not available in this process")


def test_buckets_cover_decode_and_verify_shapes():
    b = CG.decode_buckets(64, drafts=(4,))
    assert b == (1, 2, 4, 5, 8, 10, 16, 20, 32, 40, 64)
    assert CG.bucket_for(1, b) == 1 and CG.bucket_for(3, b) == 4 and CG.bucket_for(5, b) == 5
    assert CG.bucket_for(11, b) == 16 and CG.bucket_for(64, b) == 64 and CG.bucket_for(65, b) is None
    assert CG.decode_buckets(9, drafts=(8,)) == (1, 2, 4, 8, 9)
    with pytest.raises(ConfigError):
        CG.bucket_for(0, b)
    with pytest.raises(ConfigError):
        CG.decode_buckets(0)
    with pytest.raises(ConfigError):
        CG.decode_buckets(8, drafts=(0,))


def test_graphs_are_on_by_default_for_cuda():
    """Verified against the eager layers on an H200 (docs/gpu.md): the per-layer graphs and, with
    the device cache, one graph per decode step are the default; 0 turns each off."""
    from engine.options import RuntimeOptions

    assert RuntimeOptions.from_env({}).cuda_graphs and RuntimeOptions.from_env({}).step_graph
    assert RuntimeOptions() == RuntimeOptions.from_env({})
    off = RuntimeOptions.from_env({"MOESTREAM_CUDA_GRAPHS": "0", "MOESTREAM_STEP_GRAPH": "0"})
    assert not off.cuda_graphs and not off.step_graph


def test_graphs_are_off_on_the_cpu_unless_enabled():
    from engine.options import configure

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList()

    m = M()
    assert CG.prepare(m, torch.device("cpu")) is None
    gs = CG.enable(m, CG.RecordedGraph)
    assert CG.prepare(m, torch.device("cpu")) is gs
    CG.disable(m)
    prev = configure(cuda_graphs=True)
    try:
        assert CG.prepare(m, torch.device("cuda")) is None  # disabled explicitly wins
        CG.reset(m)
        auto = CG.prepare(m, torch.device("cuda"))  # the option on: graphs for CUDA (no tensor made)
        assert auto is not None and auto.factory is CG.CudaGraph
        assert CG.prepare(m, torch.device("cuda")) is auto
        configure(cuda_graphs=False)
        assert CG.prepare(m, torch.device("cuda")) is None  # the option changed: off
    finally:
        configure(prev)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.hf_tiny import make_checkpoint

    d = tmp_path_factory.mktemp("graphs")
    make_checkpoint("qwen3_moe", d / "hf", hidden_size=64, num_hidden_layers=2, head_dim=16,
                    num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


def _load(store, slots: int, device: str = "cpu", prefetch: int = 0, device_cache: bool = False):
    from engine.experts.runtime import load_from_store

    probe = load_from_store(store, dense="fp32", prefetch_depth=0)
    slot_bytes = probe.cache.slot_bytes
    probe.close()
    sm = load_from_store(store, device_budget=slots * slot_bytes, dense="fp32", prefetch_depth=prefetch,
                         device=device, device_cache=device_cache)
    sm.cache.grouped = True  # the CUDA path's grouped launches (interpreted on the CPU)
    return sm


@pytest.fixture
def float_options():
    from engine.options import configure

    prev = configure(int8_activations=False, fused_step=False)
    yield
    configure(prev)


@needs_triton
def test_graphed_model_gives_the_eager_logits_and_tokens(store, float_options):
    check_model(store, CG.RecordedGraph, "cpu")


def check_model(store, factory, device: str) -> None:
    """A prefill of 10 rows (bucket 10, a verify shape), the engine's batched prefill of three
    prompts (19 rows: bucket 20, padded) and batched greedy decode (3 rows -> bucket 4, padded;
    then 2, then 1) through a cache holding 12 of 32 experts:
    the same logits and tokens as the eager layers; each (layer, bucket) captured once."""
    from engine.generate import Request
    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine

    prompt = [5, 17, 33, 8, 61, 12, 40, 3, 27, 9]
    reqs = [(prompt, 6), (prompt[:4], 4), ([7, 7, 2, 50, 11], 2)]

    def run(graphs: bool):
        sm = _load(store, slots=12, device=device)
        try:
            gs = CG.enable(sm.model, factory) if graphs else CG.disable(sm.model)
            c = sm.model.config
            kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim)
            logits = executor_for(sm.model)(torch.tensor(prompt, device=device), BatchLayout.single(0, len(prompt), 0), kv,
                                            all_logits=True)
            engine = Engine.for_requests(sm.model, None, len(prompt) + 8, seqs=3)
            out = engine.generate([Request(p, SamplingConfig(max_tokens=n, ignore_eos=True)) for p, n in reqs])
            return logits, [r.output_ids for r in out], gs, sm.model
        finally:
            sm.close()

    ref_logits, ref_tokens, _, _ = run(False)
    logits, tokens, gs, model = run(True)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens
    per_layer = [sorted(b for b, _ in l._layer_graphs.entries) for l in model.model.layers]
    assert per_layer[0] == per_layer[1] and {1, 2, 4, 10} <= set(per_layer[0])
    # prefills (buckets 10 and 20): route + experts graphs; the engine's pure decode steps (3, 2
    # and 1 sequences on its paged KV cache: buckets 4, 2, 1): attention + route, then experts
    for l in model.model.layers:
        names = {b: sorted(e.graphs) for (b, _), e in l._layer_graphs.entries.items()}
        assert names == {10: ["experts", "route"], 20: ["experts", "route"], 1: ["experts"],
                         2: ["experts"], 4: ["experts"]}
        attn = {b: sorted(e.graphs) for (b, _, _), e in l._layer_graphs.attn_entries.items()}
        assert attn == {1: ["attention+route"], 2: ["attention+route"], 4: ["attention+route"]}
    assert gs.counters.captures == 2 * (4 + 3 + 3)
    assert gs.counters.replays > gs.counters.captures and gs.counters.capture_failures == 0


@needs_triton
def test_replay_follows_the_slot_map_padding_and_fresh_inputs(store, float_options):
    check_slot_moves(store, CG.RecordedGraph, "cpu")


def check_slot_moves(store, factory, device: str) -> None:
    """One layer's graphs, 3 rows in bucket 4: (1) the first replay equals eager and the padding
    row routes like row 0 (no expert beyond the real rows' is acquired); (2) the cache then moves
    every routed expert to another slot and puts other experts in their old slots: the replay,
    not recaptured, still equals eager (a graph with the capture-time slots would read the other
    experts: checked to differ); (3) new inputs through the same static buffers give their own
    eager result."""
    from engine.quant.triton_moe import grouped_moe

    sm = _load(store, slots=12, device=device)
    try:
        cache, layer = sm.cache, sm.model.model.layers[0]
        mlp, norm = layer.mlp, layer.post_attention_layernorm
        gs = CG.enable(sm.model, factory, buckets=(1, 4))
        acquired: list[list[int]] = []
        real_acquire = cache.acquire
        cache.acquire = lambda l, ids: acquired.append(sorted(ids)) or real_acquire(l, ids)
        gen = torch.Generator().manual_seed(11)
        x = torch.randn(3, 64, generator=gen).to(device)

        def eager(x):
            with torch.inference_mode():
                return x + mlp(norm(x))

        with torch.inference_mode():
            got = CG.mlp_residual(layer, x).clone()
        want = eager(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        entry = layer._layer_graphs.entries[(4, torch.float32)]
        assert torch.equal(entry.ids[3], entry.ids[0])  # padding routes like row 0
        routed = sorted(set(entry.ids[:3].reshape(-1).tolist()))
        assert acquired[0] == routed  # the eager call acquired the same below
        assert acquired[1] == routed
        captures = gs.counters.captures

        # (2) move: pin 12 other experts (every slot), then unpin those outside the routed
        # experts' old slots: the routed ones must come back elsewhere
        old = {e: cache.slot_of[(0, e)] for e in routed}
        others = [(l, e) for l in (0, 1) for e in range(16) if (l, e) not in {(0, r) for r in routed}][:12]
        by_layer = {l: [e for ll, e in others if ll == l] for l in (0, 1)}
        for l, ids in by_layer.items():
            real_acquire(l, ids)
        keep = {k for k in others if cache.slot_of[k] in old.values()}
        for l, ids in by_layer.items():
            cache.release(l, [e for e in ids if (l, e) not in keep])
        with torch.inference_mode():
            stale_pairs = torch.tensor([old[int(i)] for i in entry.ids.reshape(-1)], dtype=torch.int32,
                                       device=device)
            got2 = CG.mlp_residual(layer, x).clone()
            new = {e: cache.slot_of[(0, e)] for e in routed}
            assert all(new[e] != old[e] for e in routed)
            stale = x + grouped_moe(entry.h, entry.weights, stale_pairs, cache.slots, mlp._grouped_layout(cache, x))[:3]
        for l, ids in by_layer.items():
            cache.release(l, [e for e in ids if (l, e) in keep])
        torch.testing.assert_close(got2, want, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(stale, want, rtol=1e-3, atol=1e-3)
        assert gs.counters.captures == captures

        # (3) the same static buffers, new rows
        x_ptr = entry.x.data_ptr()
        x3 = torch.randn(3, 64, generator=gen).to(device)
        with torch.inference_mode():
            got3 = CG.mlp_residual(layer, x3).clone()
        torch.testing.assert_close(got3, eager(x3), rtol=1e-4, atol=1e-4)
        assert entry.x.data_ptr() == x_ptr and gs.counters.captures == captures
        assert cache.pins == {}
    finally:
        sm.cache.__dict__.pop("acquire", None)
        sm.close()


@needs_triton
def test_steps_the_graphs_cannot_take_run_eager(store, float_options):
    """More rows than the largest bucket, and drafting restricted to resident experts: eager."""
    sm = _load(store, slots=32)
    try:
        layer = sm.model.model.layers[0]
        gs = CG.enable(sm.model, CG.RecordedGraph, buckets=(1, 2))
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            want = x + layer.mlp(layer.post_attention_layernorm(x))
            got = CG.mlp_residual(layer, x)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert gs.counters.eager == 1 and gs.counters.captures == 0
            sm.cache.restrict_to_resident = True
            CG.mlp_residual(layer, x[:1])
            assert gs.counters.eager == 2 and gs.counters.captures == 0
    finally:
        sm.cache.restrict_to_resident = False
        sm.close()


@needs_triton
def test_a_failed_capture_runs_eager_from_then_on(store, float_options):
    """A capture that raises (an op CUDA cannot capture) is logged and counted; the step's
    result is still the eager one, inside the same acquire (no pin left), and that (layer,
    bucket) runs eager afterwards."""

    class ExpertsCaptureFails(CG.RecordedGraph):
        made = 0

        def capture(self, fn):
            ExpertsCaptureFails.made += 1
            if ExpertsCaptureFails.made == 2:  # the first layer's experts graph
                raise RuntimeError("operation not permitted when stream is capturing")
            super().capture(fn)

    sm = _load(store, slots=32)
    try:
        layer = sm.model.model.layers[0]
        gs = CG.enable(sm.model, ExpertsCaptureFails, buckets=(4,))
        gen = torch.Generator().manual_seed(4)
        for _ in range(2):
            x = torch.randn(3, 64, generator=gen)
            with torch.inference_mode():
                want = x + layer.mlp(layer.post_attention_layernorm(x))
                got = CG.mlp_residual(layer, x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert sm.cache.pins == {}
        assert gs.counters.capture_failures == 1 and gs.counters.captures == 1 and gs.counters.eager == 1
        assert layer._layer_graphs.entries[(4, torch.float32)].broken
    finally:
        sm.close()


@needs_triton
def test_injected_routing_runs_eager_and_the_experts_graph_follows_it(store, float_options):
    """A declared router override (trace replay keeps Python state: here a shift of the ids set
    between steps) is not captured: each step routes eagerly, the experts graph replays on that
    step's routing and equals eager (a captured route would replay the first step's ids)."""
    from engine.layers.moe import Routing

    sm = _load(store, slots=32)
    try:
        layer = sm.model.model.layers[0]
        mlp = layer.mlp
        shift = {"n": 0}
        mlp.router_override = lambda x, allowed=None: (lambda r: Routing(r.weights, (r.ids + shift["n"]) % 16))(
            mlp.gate(x, allowed))
        gs = CG.enable(sm.model, CG.RecordedGraph, buckets=(4,))
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
        for n in (0, 5, 11):
            shift["n"] = n
            with torch.inference_mode():
                want = x + mlp(layer.post_attention_layernorm(x))
                got = CG.mlp_residual(layer, x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert gs.counters.captures == 1 and gs.counters.replays == 3  # the experts graph only
    finally:
        sm.close()
