"""Qwen3-Next on the native step (engine.models.qwen3_next.step, engine/csrc/deltanet_block.cpp, the gated
Attn of engine/csrc/step.cpp) against its torch layers, on random tiny checkpoints in several
shapes (attention interval, key/value head ratios, partial RoPE): logits of mixed prefill/decode
batches over a paged HybridKVCache, greedy tokens alone and in concurrent batches, the DeltaNet
block against the torch layer on random states, and the calls a decoded token costs per layer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.executor import executor_for
from engine.experts.runtime import load_from_store
from engine.generate import Request, generate_ids
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.kv.state import HybridKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.options import configure
from engine.quant.formats import QuantFormat
from engine.quant.kernels import load_extension
from engine.quant.linear import quantize_dense
from engine.runner import Engine
from engine.scheduler import SchedulerConfig
from engine.store import convert
from tests.engine.models.qwen3_next_tiny import make_qwen3_next
from tests.engine import test_step
from tests.engine.test_step import BOUND, close, spy

pytestmark = pytest.mark.skipif(load_extension() is None, reason="native kernels unavailable")
fused = test_step.fused  # the fixture: configure(fused_step=...) for the test, restored after

BASE = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=32)
SHAPES = {
    # attention every 4th layer, 2 query heads per KV head, 2 value heads per key head, RoPE on 1/4
    "interval4": dict(partial_rotary_factor=0.25),
    # attention every 2nd layer, 4 query heads per KV head, 4 value heads per key head, full RoPE
    "interval2-mqa": dict(full_attention_interval=2, num_key_value_heads=1, linear_num_key_heads=1,
                          partial_rotary_factor=1.0),
    # attention first and last, as many value as key heads, RoPE on half, no shared expert, a dense layer
    "mixed-types": dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                        linear_num_value_heads=2, partial_rotary_factor=0.5, shared_expert_intermediate_size=0,
                        mlp_only_layers=[1], intermediate_size=64, linear_conv_kernel_dim=3),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def hf_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_qwen3_next(path, seed=11, **{**BASE, **SHAPES[request.param]})
    return path


def quantized(hf_dir, dense: str):
    files = open_model_files(hf_dir)
    return quantize_dense(build_model(files.config, files.source), dense)


def hybrid(model, dtype=torch.float32) -> HybridKVCache:
    return HybridKVCache(model.config, num_blocks=64, num_state_slots=4, block_size=4, dtype=dtype)


def schedule(model, kv, fused_on: bool, fused) -> list[torch.Tensor]:
    """Three sequences: a batched prefill, decode steps of all three, a step mixing 2 new tokens of
    one with 1 of another, more decode steps, one sequence finished and a new one started beside
    decode rows. Logits of every step."""
    fused(fused_on)
    g = torch.Generator().manual_seed(5)
    plan = [BatchLayout((0, 1, 2), (5, 9, 3), (0, 0, 0)),
            BatchLayout((0, 1, 2), (1, 1, 1), (5, 9, 3)),
            BatchLayout((0, 2), (2, 1), (6, 4)),
            BatchLayout((2, 0, 1), (1, 1, 1), (5, 8, 10)),
            BatchLayout((1, 3), (1, 6), (11, 0)),
            BatchLayout((3, 1, 2), (1, 1, 1), (6, 12, 6))]
    out = []
    for layout in plan:
        if layout.seq_ids == (1, 3):
            kv.free(0)
        tokens = torch.randint(0, model.config.vocab_size, (layout.num_tokens,), generator=g)
        out.append(executor_for(model)(tokens, layout, kv, all_logits=True))
    return out


@pytest.mark.parametrize("dense,kv_dtype", [("int8", torch.float32), ("bf16", torch.bfloat16)])
def test_native_step_matches_torch_layers_on_mixed_batches(hf_dir, dense, kv_dtype, fused):
    configure(int8_activations=False)
    model = quantized(hf_dir, dense)
    cfg = model.config
    want = schedule(model, hybrid(model, kv_dtype), False, fused)
    calls = spy(model, fused).calls
    kv = hybrid(model, kv_dtype)
    got = schedule(model, kv, True, fused)
    n_lin = cfg.num_layers - len(cfg.attention_layers)
    assert calls["attn_block"] == 6 * len(cfg.attention_layers)
    assert calls["deltanet_block"] == 6 * n_lin  # every step, prefill chunks included
    # fp32 KV: only the float32 summation order differs (measured ~1e-6). bf16 KV: a key whose
    # float32 value differs in its last bits may round to the neighbouring bf16 value (0.4% of
    # that element), which moves a logit by up to ~1e-3 here
    bound = BOUND[False] if kv_dtype == torch.float32 else 3e-3
    for a, b in zip(got, want):
        close(a, b, bound)
    assert kv.state.num_used == 3


# Steps of four sequences over one DeltaNet layer: (query length, verify row?) per sequence, None
# where a sequence sits the step out. Prefill chunks of 1..64 rows, decode rows and verify rows
# (state checkpointed per position) side by side, each sequence's state carried from step to step.
BLOCK_STEPS = [
    [(64, False), (1, False), (5, True), (17, False)],
    [(33, False), (4, True), (1, False), (1, False)],
    [(1, False), (1, False), (2, True), (64, False)],
    [(2, True), None, (7, False), (1, False)],
    [(1, False), (65, True), (1, False), (3, True)],  # 65 rows: the most a verify row checkpoints
]


@torch.inference_mode()
def test_deltanet_block_equals_the_torch_layer_on_mixed_rows(hf_dir, fused):
    """One DeltaNet layer, BLOCK_STEPS on random states in scattered slots: x, h, every state and
    every verify checkpoint the native block leaves against the torch layer's (its reference path:
    the chunked rule for a prefill chunk, the recurrent one in torch for decode and verify rows).
    Tolerance: float32 sums in another order (chunked vs sequential, einsum vs the native loops;
    measured max 7e-7 over the three shapes, values of magnitude ~1), so 1e-5."""
    configure(int8_activations=False)  # the torch layer's linears as the native call's (i8a False)
    model = quantized(hf_dir, "int8")
    fused(True)
    step = executor_for(model).native()
    fused(False)  # the reference: the torch layer throughout (no deltanet_step inside it)
    i = next(j for j, layer in enumerate(model.model.layers) if layer.linear)
    layer, li = model.model.layers[i], model.model.layers[i].linear_attn.state_layer
    g = torch.Generator().manual_seed(9)
    caches = [HybridKVCache(model.config, num_blocks=8, num_state_slots=8, block_size=4) for _ in range(2)]
    for kv in caches:
        st = kv.state
        for s in (4, 0, 2, 9):  # slots 0..3, then sequence 2 moved to slot 6
            st.acquire(s)
        st.free(2)
        st.acquire(7), st.acquire(8), st.acquire(2)
    ref, nat = caches[0].state, caches[1].state
    ref.conv.copy_(torch.randn(ref.conv.shape, generator=g))
    ref.matrix.copy_(torch.randn(ref.matrix.shape, generator=g) * 0.3)
    nat.conv.copy_(ref.conv), nat.matrix.copy_(ref.matrix)
    mat0 = ref.matrix.clone()
    ctx = {4: 9, 0: 3, 2: 5, 9: 1}  # the random states stand at these positions
    for st in (ref, nat):
        st.tokens.update(ctx)
    for plan in BLOCK_STEPS:
        seqs = [(s, n, v) for s, e in zip((4, 0, 2, 9), plan) if e is not None for n, v in [e]]
        layout = BatchLayout(tuple(s for s, _, _ in seqs), tuple(n for _, n, _ in seqs),
                             tuple(ctx[s] for s, _, _ in seqs))
        verify = frozenset(s for s, _, v in seqs if v)
        x = torch.randn(layout.num_tokens, model.config.hidden_size, generator=g)
        for st in (ref, nat):
            st.begin(layout, verify)
        x_ref = x + layer.linear_attn(layer.input_layernorm(x), layout, ref)
        h_ref = layer.post_attention_layernorm(x_ref)
        x_nat = x.clone()
        ck_conv, ck_matrix = step._checkpoints(nat, li, layout, sorted(verify))
        h = step.ext.deltanet_block(step.attn[i], x_nat, nat.conv, nat.matrix, li,
                                    [nat.slot[s] for s in layout.seq_ids], list(layout.query_lens),
                                    ck_conv, ck_matrix, 3, False)
        torch.testing.assert_close(x_nat, x_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(nat.conv, ref.conv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(nat.matrix, ref.matrix, atol=1e-5, rtol=1e-5)
        assert sorted(nat._checkpoints) == sorted(ref._checkpoints) == sorted(verify)
        for s in verify:
            for a, b in zip(nat._checkpoints[s][1:], ref._checkpoints[s][1:]):
                torch.testing.assert_close(a[li], b[li], atol=1e-5, rtol=1e-5)
            n = layout.query_lens[layout.seq_ids.index(s)]  # the last checkpoint is the state now
            assert torch.equal(nat._checkpoints[s][2][li, n - 1], nat.matrix[li, nat.slot[s]])
        for st in (ref, nat):
            st.advance(layout)
        ctx.update((s, ctx[s] + n) for s, n, _ in seqs)
    assert not torch.equal(nat.matrix, mat0)  # it really advanced
    for st in (ref, nat):  # a checkpoint comes back through keep as the torch layer's does
        st.keep(9, ctx[9] - 2)
        st.keep(0, ctx[0] - 40)
    torch.testing.assert_close(nat.conv[li], ref.conv[li], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nat.matrix[li], ref.matrix[li], atol=1e-5, rtol=1e-5)
    x = torch.randn(3, model.config.hidden_size, generator=g)
    with pytest.raises(RuntimeError, match="given twice"):
        step.ext.deltanet_block(step.attn[i], x, nat.conv, nat.matrix, 0, [1, 1, 2], [1, 1, 1], [], [], 3, False)
    with pytest.raises(RuntimeError, match="one state slot per sequence"):
        step.ext.deltanet_block(step.attn[i], x, nat.conv, nat.matrix, 0, [1], [1, 2], [], [], 3, False)
    with pytest.raises(RuntimeError, match="add up to 2 rows, x has 3"):
        step.ext.deltanet_block(step.attn[i], x, nat.conv, nat.matrix, 0, [1], [2], [], [], 3, False)
    with pytest.raises(RuntimeError, match="matrix checkpoint must be"):
        step.ext.deltanet_block(step.attn[i], x, nat.conv, nat.matrix, 0, [1], [3],
                                [torch.zeros(3, *nat.conv_shape)], [torch.zeros(2, *nat.matrix_shape)], 3, False)


def greedy(model, prompt, n=32, kv=None):
    return [t for t, _, _ in generate_ids(model, prompt, SamplingConfig(max_tokens=n, ignore_eos=True), kv=kv)]


def batched(model, prompts) -> list[list[int]]:
    """Greedy tokens of the prompts as concurrent requests (chunked prefill beside decode rows);
    state slots and KV blocks back to zero after."""
    reqs = [Request(p, SamplingConfig(max_tokens=32, ignore_eos=True)) for p in prompts]
    kv = HybridKVCache(model.config, num_blocks=128, num_state_slots=4, block_size=4)
    engine = Engine(model, kv=kv, config=SchedulerConfig(max_num_batched_tokens=24))
    out = [r.output_ids for r in engine.generate(reqs)]
    assert (kv.state.num_used, kv.paged.metrics().blocks_used) == (0, 0)
    return out


@pytest.mark.parametrize("dense", ["int8", "bf16"])
def test_greedy_tokens_identical_alone_and_batched(hf_dir, dense, fused):
    """32 greedy tokens of four prompts (one longer than a DeltaNet chunk), alone and as concurrent
    requests, the native step against the torch layers on the same schedule."""
    configure(int8_activations=False, kv_bf16=False)  # both paths on a float32 cache: the same K/V
    model = quantized(hf_dir, dense)
    v = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, v, (n,), generator=g).tolist() for n in (7, 70, 1, 20)]
    fused(False)
    want_alone, want_batched = [greedy(model, p) for p in prompts], batched(model, prompts)
    calls = spy(model, fused).calls
    assert [greedy(model, p) for p in prompts] == want_alone
    assert calls["deltanet_block"] > 0
    calls.clear()
    assert batched(model, prompts) == want_batched
    assert calls["deltanet_block"] > 0


def decode_token(model, spy_calls=None, profile_it=False):
    """Prefill 9 tokens, decode one outside any count (first use), then one more counted: the
    native calls by name and, with ``profile_it``, every torch dispatcher op by name."""
    from torch.profiler import ProfilerActivity, profile

    cfg = model.config
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    prompt = list(range(3, 12))
    executor_for(model)(torch.tensor(prompt), BatchLayout.single(0, len(prompt), 0), kv)
    executor_for(model)(torch.tensor([7]), BatchLayout.single(0, 1, len(prompt)), kv)
    spy_calls.clear()
    token = torch.tensor([8])
    ops = Counter()
    if profile_it:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            executor_for(model)(token, BatchLayout.single(0, 1, len(prompt) + 1), kv)
        for e in prof.key_averages():
            ops[e.key] += e.count
    else:
        executor_for(model)(token, BatchLayout.single(0, 1, len(prompt) + 1), kv)
    return ops


def test_decode_is_three_native_calls_per_layer(hf_dir, fused):
    model = quantized(hf_dir, "int8")
    cfg = model.config
    calls = spy(model, fused).calls
    decode_token(model, calls)
    n_lin, n_moe = cfg.num_layers - len(cfg.attention_layers), len(model.moe_blocks)
    assert dict(calls) == {"attn_block": len(cfg.attention_layers), "deltanet_block": n_lin,
                           "route": n_moe, "ffn_block": cfg.num_layers, "head_block": 1}


def test_decoded_token_costs_at_most_ten_ops_per_layer(tmp_path, fused):
    """An 8-layer model from an int4 store (every expert read from its cache slot): every torch
    dispatcher op (torch's profiler, nested ones included) and native call of one decoded token,
    the embedding and LM head included, divided by the layers."""
    make_qwen3_next(tmp_path / "hf", seed=3, **{**BASE, "num_hidden_layers": 8})
    convert(tmp_path / "hf", tmp_path / "store", fmt=QuantFormat("int4", 32), progress=False)
    fused(True)
    with load_from_store(tmp_path / "store", prefetch_depth=0, dense="int8") as sm:
        every = list(range(sm.model.config.moe.num_experts))
        for mlp in sm.model.moe_blocks:  # all resident: the count is the step's, not the misses'
            sm.cache.acquire(mlp.layer, every)
            sm.cache.release(mlp.layer, every)
        calls = spy(sm.model, fused).calls
        ops = decode_token(sm.model, calls, profile_it=True)
    layers = sm.model.config.num_layers
    assert sum(calls.values()) == 3 * layers + 1
    per_layer = (sum(ops.values()) + sum(calls.values())) / layers
    print(f"decoded token: {sum(ops.values())} dispatcher ops {dict(ops.most_common(6))} + "
          f"{sum(calls.values())} native calls = {per_layer:.1f} per layer")
    assert per_layer <= 10
