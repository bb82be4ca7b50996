"""The native step (engine.step, engine/csrc/step.cpp) against the torch layers it replaces, on
random tiny models: logits of mixed prefill/decode batches over contiguous and paged KV caches,
greedy tokens through the expert cache (full, minimal with chunked prefill, misses computed on
the CPU), and the number of native calls per layer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.executor import executor_for
from engine.experts.runtime import load_from_store
from engine.experts.tiers import align_up
from engine.generate import generate_ids
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.kv.paged import FP8, PagedKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.options import configure, options
from engine.quant.kernels import load_extension
from engine.quant.linear import quantize_dense
from engine.store import ExpertStore, convert
from engine.quant.formats import QuantFormat
from tests.engine.models.hf_tiny import make_checkpoint

pytestmark = pytest.mark.skipif(load_extension() is None, reason="native kernels unavailable")

PROMPT = [5, 17, 33, 8, 61, 12, 40, 3, 27]
ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="module", params=ARCHS)
def store(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    kw = dict(hidden_size=64, num_hidden_layers=3, head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    if arch == "mixtral":
        kw.update(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    else:
        kw.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    if arch == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=64)
    make_checkpoint(arch, d / "hf", **kw)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


@pytest.fixture
def fused():
    """configure(fused_step=...) for the test, restored after."""
    prev = configure()

    def set_fused(on: bool) -> None:
        if options().fused_step != on:  # a change rebuilds the step (and drops a spy)
            configure(fused_step=on)
    yield set_fused
    configure(prev)


class Counting:
    """Counts the native step's calls (a proxy in front of the extension module)."""

    def __init__(self, ext) -> None:
        self.ext, self.calls = ext, Counter()

    def __getattr__(self, name):
        f = getattr(self.ext, name)
        if not callable(f) or name[:1].isupper():
            return f

        def counted(*a, **k):
            self.calls[name] += 1
            return f(*a, **k)
        return counted


def spy(model, fused) -> Counting:
    fused(True)
    step = executor_for(model).native()
    assert step is not None, "the native step should apply to this model"
    step.ext = Counting(step.ext)
    return step.ext


def steps(model, kv, fused_on: bool, fused, all_logits: bool = True) -> list[torch.Tensor]:
    """A mixed schedule over three sequences: a batched prefill, a decode step of all three, a
    step mixing 2 new tokens of one sequence with 1 of another. Logits of every step (of every
    row, or of each sequence's last: ``all_logits`` False)."""
    fused(fused_on)
    g = torch.Generator().manual_seed(3)
    v = model.config.vocab_size
    plan = [BatchLayout((0, 1, 2), (5, 9, 3), (0, 0, 0)),
            BatchLayout((0, 1, 2), (1, 1, 1), (5, 9, 3)),
            BatchLayout((0, 2), (2, 1), (6, 4))]
    out = []
    for layout in plan:
        tokens = torch.randint(0, v, (layout.num_tokens,), generator=g)
        out.append(executor_for(model)(tokens, layout, kv, all_logits=all_logits))
    return out


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= rel * (1 + scale), (a - b).abs().max().item()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


# Float activations: the same operations, only the float32 summation order differs. int8
# activations: a reordered sum may round one activation code differently (a step of absmax/127
# of its block), which moves a logit by up to ~1%.
BOUND = {False: 2e-4, True: 2e-2}


@pytest.mark.parametrize("dense,i8a", [("int8", False), ("bf16", False), ("int8", True)])
@pytest.mark.parametrize("kv_kind", ["paged-bf16", "paged-fp32"])
def test_native_step_matches_torch_layers_on_mixed_batches(store, dense, i8a, kv_kind, fused):
    configure(int8_activations=i8a)
    dtype = torch.bfloat16 if kv_kind == "paged-bf16" else torch.float32
    with load_from_store(store, prefetch_depth=0, dense=dense) as sm:
        cfg = sm.model.config

        def kv():
            return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4,
                                dtype=dtype)

        want = steps(sm.model, kv(), False, fused)
        calls = spy(sm.model, fused).calls
        got = steps(sm.model, kv(), True, fused)
        # every step ran natively, its layers in run_layers (resumed after each layer with a miss)
        assert calls["run_layers"] >= 3 and calls["attn_block"] == 0
        for a, b in zip(got, want):
            close(a, b, BOUND[i8a and executor_for(sm.model).native().ext.ext.has_int8_dots()])


@pytest.mark.parametrize("kv_kind", ["paged-bf16", "paged-fp32"])
def test_decode_attention_over_many_tiles_matches_torch_layers(store, kv_kind, fused):
    """Decode rows whose contexts (70, 33 and 100 positions) span several of the native decode
    attention's 32-position tiles (step.cpp attend_one: per-tile partials merged in tile order)."""
    configure(int8_activations=False)
    dtype = torch.bfloat16 if kv_kind == "paged-bf16" else torch.float32
    plan = [BatchLayout((0, 1, 2), (70, 33, 100), (0, 0, 0)),
            BatchLayout((0, 1, 2), (1, 1, 1), (70, 33, 100)),
            BatchLayout((0, 2), (1, 1), (71, 101))]
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        cfg = sm.model.config
        out = {}
        for on in (False, True):
            fused(on)
            kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=64, block_size=8, dtype=dtype)
            g = torch.Generator().manual_seed(5)
            out[on] = [executor_for(sm.model)(torch.randint(0, cfg.vocab_size, (lay.num_tokens,), generator=g),
                                              lay, kv, all_logits=True) for lay in plan]
        for a, b in zip(out[True][1:], out[False][1:]):  # the decode steps
            close(a, b, BOUND[False])


@pytest.mark.parametrize("i8a", [True, False])
@pytest.mark.parametrize("n", [70, 150])
def test_a_prefill_row_has_the_bits_of_the_same_position_decoded(store, fused, i8a, n):
    """Batch invariance (docs/native-step.md): an n-token prompt prefilled in one native step (its
    attention split over the pool by row, its experts reading shared quantized rows, the kernels'
    6-token tiles) gives each position the logits of that position decoded alone, bit for bit.
    150 tokens x top-2 routes 300 rows to a layer's experts: more than the 256 up to which the
    experts' buffers are the thread's reused ones (quant.cpp REUSE_MAX_ROWS), so the prefill runs
    on buffers of its own and the decode steps on the reused ones."""
    configure(int8_activations=i8a)
    fused(True)
    tokens = torch.randint(0, 90, (n,), generator=torch.Generator().manual_seed(9))
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        cfg = sm.model.config
        step = executor_for(sm.model)

        def kv():
            return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=32, block_size=8)

        whole = step(tokens, BatchLayout.single(0, n, 0), kv(), all_logits=True)
        cache = kv()
        alone = [step(tokens[i:i + 1], BatchLayout.single(0, 1, i), cache, all_logits=True) for i in range(n)]
    assert executor_for(sm.model).native() is not None
    assert torch.equal(whole, torch.cat(alone))


def greedy(model, n=16, kv=None):
    return [t for t, _, _ in generate_ids(model, PROMPT, SamplingConfig(max_tokens=n, ignore_eos=True), kv=kv)]


def check_minimal_caches(store, want, greedy, fused, native_call: str = "ffn_block") -> None:
    """``greedy(model)`` through a device cache of top_k slots equals ``want``: once with chunked
    prefill, misses and prefetch, once with misses computed on the CPU (the slot -1 path);
    ``native_call`` ran, experts missed, and every pin is released after."""
    with ExpertStore(store) as s:
        slot, top_k = align_up(s.expert_nbytes), s.config.moe.top_k
    for kw in (dict(device_budget=top_k * slot, prefetch_depth=1),  # chunked prefill, misses, prefetch
               dict(device_budget=top_k * slot, prefetch_depth=0, miss_compute="cpu")):  # slot -1 path
        with load_from_store(store, dense="int8", **kw) as sm:
            calls = spy(sm.model, fused).calls
            assert greedy(sm.model) == want, kw
            assert calls[native_call] > 0
            assert sm.cache.metrics.total().misses > 0
            sm.cache.drain()
            assert sm.cache.pins == {}, kw


def decode_calls(sm, fused) -> dict[str, int]:
    """The native calls of one decoded token after PROMPT (a contiguous KV cache)."""
    cfg = sm.model.config
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    executor_for(sm.model)(torch.tensor(PROMPT), BatchLayout.single(0, len(PROMPT), 0), kv)
    calls = spy(sm.model, fused).calls
    executor_for(sm.model)(torch.tensor([7]), BatchLayout.single(0, 1, len(PROMPT)), kv)
    return dict(calls)


def test_greedy_tokens_identical_through_the_expert_cache(store, fused):
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        fused(False)
        want = greedy(sm.model)
        fused(True)
        calls = spy(sm.model, fused).calls
        assert greedy(sm.model) == want
        assert calls["run_layers"] > 0 and calls["attn_block"] == 0
    check_minimal_caches(store, want, greedy, fused)


def test_all_resident_experts_skip_acquire_with_the_same_tokens_and_hits(store, fused, monkeypatch):
    """A cache with a slot for every expert and no prefetch: the step reads the slots without
    acquire / release (ExpertCache.resident_map for run_layers, resident_slots per layer), with the
    tokens and hit counts of the full path; a cache that may evict (fewer slots than experts) keeps
    acquire."""
    from engine.experts.cache import ExpertCache

    runs = {}
    for shortcut in (True, False):
        if not shortcut:
            monkeypatch.setattr(ExpertCache, "resident_slots", lambda self, layer, ids: None)
            monkeypatch.setattr(ExpertCache, "resident_map", lambda self: None)
        with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
            fused(True)
            greedy(sm.model, n=2)  # first use loads every routed expert through acquire
            acquired = []
            orig, orig_overlapped = sm.cache.acquire, sm.cache.acquire_overlapped
            monkeypatch.setattr(sm.cache, "acquire", lambda layer, ids: acquired.append(layer) or orig(layer, ids))
            monkeypatch.setattr(sm.cache, "acquire_overlapped",
                                lambda layer, ids, ready: acquired.append(layer) or orig_overlapped(layer, ids, ready))
            before = sm.cache.metrics.total().hits
            tokens = greedy(sm.model, n=6)
            runs[shortcut] = (tokens, sm.cache.metrics.total().hits - before, len(acquired))
            assert sm.cache.pins == {}
    (tok_fast, hits_fast, acq_fast), (tok_full, hits_full, acq_full) = runs[True], runs[False]
    assert tok_fast == tok_full and hits_fast == hits_full > 0
    assert acq_full > 0 and acq_fast < acq_full  # only first uses (misses) still acquire
    with ExpertStore(store) as s:
        slot, n = align_up(s.expert_nbytes), s.num_experts_total
    with load_from_store(store, prefetch_depth=0, dense="int8", device_budget=(n - 1) * slot) as sm:
        assert sm.cache.resident_slots(sm.model.config.moe_layers[0], [0]) is None
        assert sm.cache.resident_map() is None


def test_decode_is_one_native_call_layers_and_head(store, fused):
    """Every expert resident and the head on the kernels (int8): a decoded token is one native
    call, run_layers computing the head after the last layer (its bits are those of head_block
    called alone: test_layers_in_one_call_equal_the_loop_of_layers)."""
    fused(True)
    with load_from_store(store, prefetch_depth=0, dense="int8", warm=True) as sm:
        assert decode_calls(sm, fused) == {"run_layers": 1}


def test_layers_in_one_call_equal_the_loop_of_layers(store, fused, monkeypatch):
    """run_layers (engine/csrc/layers.cpp) against NativeStep's Python loop over the same calls per
    layer: the same logits bit for bit on a mixed schedule, from a cold cache (run_layers stops at
    each layer with a miss, the fetch path takes it, the next layers resume natively) and then a warm
    one; the same expert hits and misses. Then each sequence's last row only: run_layers computes
    the head in the call that finishes the layers, with the bits of head_block called alone."""
    from engine.step import NativeStep

    out = {}
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(NativeStep, "_resident_map", lambda self: None)
        with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
            cfg = sm.model.config
            calls = spy(sm.model, fused).calls

            def kv():
                return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4)

            logits = steps(sm.model, kv(), True, fused) + steps(sm.model, kv(), True, fused)
            m = sm.cache.metrics.total()
            out[one_call] = logits, (m.hits, m.misses), dict(calls)
            calls.clear()
            last_rows = steps(sm.model, kv(), True, fused, all_logits=False)
            out[one_call, "last"] = last_rows, dict(calls)
    (got, counts, calls), (want, want_counts, loop_calls) = out[True], out[False]
    assert calls["run_layers"] >= 6 and calls.get("attn_block", 0) == 0
    assert loop_calls.get("run_layers", 0) == 0 and loop_calls["attn_block"] == 6 * cfg.num_layers
    assert calls["ffn_block"] > 0  # layers with a miss went through the fetch path
    assert counts == want_counts and counts[1] > 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    (got, calls), (want, loop_calls) = out[True, "last"], out[False, "last"]
    assert calls.get("head_block", 0) == 0 and calls["run_layers"] >= 3  # the head inside run_layers
    assert loop_calls["head_block"] == 3
    for a, b in zip(got, want):
        assert a.shape[0] == 3 - (a is got[-1]) and torch.equal(a, b)


def test_fp8_kv_and_fp32_dense_run_the_torch_layers(store, fused):
    fused(True)
    with load_from_store(store, prefetch_depth=0, dense="fp32") as sm:
        assert executor_for(sm.model).native() is None  # fp32 dense: the exact reference path
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm:
        cfg = sm.model.config
        kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=8, block_size=4, dtype=FP8)
        calls = spy(sm.model, fused).calls
        want = greedy(sm.model, 6)
        native = dict(calls)
        fp8 = greedy(sm.model, 6, kv=kv)
        assert native["run_layers"] >= 6 and calls == native  # only the contiguous run was native
        assert len(fp8) == 6 and fp8[0] == want[0]


@pytest.mark.parametrize("head_dim", [16, 8])  # 8: heads narrower than an AVX-512 vector
def test_dense_llama_matches(tmp_path, fused, head_dim):
    make_checkpoint("llama", tmp_path, hidden_size=64, intermediate_size=128, head_dim=head_dim,
                    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    files = open_model_files(tmp_path)
    cfg = files.config
    model = quantize_dense(build_model(cfg, files.source), "int8")
    kv = lambda: PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4)
    want = steps(model, kv(), False, fused)
    calls = spy(model, fused).calls
    got = steps(model, kv(), True, fused)
    assert calls["run_layers"] == 3 and calls["route"] == 0  # a dense model: all layers in one call per step
    for a, b in zip(got, want):
        close(a, b, BOUND[True])


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 8, 2), (64, 8, 1), (128, 4, 4), (64, 6, 2), (32, 4, 2),
                                                     (32, 24, 2), (32, 16, 1), (16, 4, 2)])
def test_attention_on_16_bit_caches_matches_torch_layers(tmp_path, fused, isa, kv_dtype, head_dim, heads, kv_heads):
    """The native attention over a bf16 / fp16 cache (step.cpp attend_tiles: each K row, then each
    V row, read whole and in order, converted in registers, each chunk once for the query heads of
    its KV head) against the torch layers on the same cache: heads of 1-16 vectors (AVX-512's 16
    lanes or AVX2's 8), 1-16 query heads per KV head (the kernels with constants: 1, 2, 3, 4, 6, 8
    heads of 2-16 vectors; 12 or 16 query heads per KV head and heads of one vector: the run-time
    loops; on AVX2 more query heads per KV head than lanes, a block of 8 heads over two KV
    heads), prefill and decode rows whose contexts span several 32-position tiles."""
    configure(cpu_isa=isa)
    make_checkpoint("llama", tmp_path, hidden_size=96, intermediate_size=64, head_dim=head_dim,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=2)
    files = open_model_files(tmp_path)
    cfg = files.config
    configure(int8_activations=False)
    model = quantize_dense(build_model(cfg, files.source), "int8")
    plan = [BatchLayout((0, 1), (70, 33), (0, 0)),
            BatchLayout((0, 1), (1, 1), (70, 33)),
            BatchLayout((0, 1), (1, 2), (71, 34))]
    out = {}
    for on in (False, True):
        fused(on)
        kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=32, block_size=8, dtype=kv_dtype)
        g = torch.Generator().manual_seed(11)
        out[on] = [executor_for(model)(torch.randint(0, cfg.vocab_size, (lay.num_tokens,), generator=g),
                                       lay, kv, all_logits=True) for lay in plan]
    for a, b in zip(out[True], out[False]):
        close(a, b, BOUND[False])


@pytest.mark.parametrize("isa", ["auto", "avx2"])
def test_attention_with_every_score_far_below_zero_in_short_contexts(tmp_path, fused, isa):
    """Queries scaled so that a head's scores are hundreds below zero, over contexts of 1-7
    positions (a tile whose last block of positions is partial): the positions past the context
    must take no part in a head's max (scores_block keeps its maxima in vectors; a padding lane's
    score of 0 taken as the max turns every exp(score - max) into 0 and the row into NaN)."""
    configure(cpu_isa=isa)
    make_checkpoint("llama", tmp_path, hidden_size=96, intermediate_size=64, head_dim=64,
                    num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=1)
    files = open_model_files(tmp_path)
    cfg = files.config
    configure(int8_activations=False)
    model = build_model(cfg, files.source)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(400.0)
    model = quantize_dense(model, "int8")
    plan = [BatchLayout((0,), (3,), (0,))] + [BatchLayout((0,), (1,), (c,)) for c in range(3, 7)]
    out = {}
    for on in (False, True):
        fused(on)
        kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=4, block_size=8,
                          dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(5)
        out[on] = [executor_for(model)(torch.randint(0, cfg.vocab_size, (lay.num_tokens,), generator=g),
                                       lay, kv, all_logits=True) for lay in plan]
    for a, b in zip(out[True], out[False]):
        assert torch.isfinite(a).all()
        close(a, b, BOUND[False])


def test_a_kv_cache_beside_the_native_step_is_bf16(store, fused):
    """engine.executor.kv_dtype: bf16 where the steps run natively on the CPU, float32 for the
    torch layers (fp32 dense, the step off) or with MOESTREAM_KV_BF16=0; the serving engine's
    cache follows it."""
    from engine.executor import kv_dtype
    from engine.options import RuntimeOptions
    from engine.runner import Engine

    fused(True)
    with load_from_store(store, prefetch_depth=0, dense="int8") as sm, \
            load_from_store(store, prefetch_depth=0, dense="fp32") as ref:
        assert kv_dtype(sm.model) == torch.bfloat16 and kv_dtype(ref.model) == torch.float32
        assert Engine.for_requests(sm.model, tokens=64).kv.dtype == torch.bfloat16
        configure(kv_bf16=False)
        assert kv_dtype(sm.model) == torch.float32
        configure(kv_bf16=True)
        fused(False)
        assert kv_dtype(sm.model) == torch.float32
        # the torch layers read a bf16 contiguous cache beside float32 queries too (a step that
        # falls back to them), as the native step does
        configure(int8_activations=False)
        cfg = sm.model.config
        out = {}
        for on in (True, False):
            fused(on)
            kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
            out[on] = executor_for(sm.model)(torch.tensor(PROMPT), BatchLayout.single(0, len(PROMPT), 0), kv,
                                             all_logits=True)
        close(out[True], out[False], BOUND[False])
    assert RuntimeOptions.from_env({"MOESTREAM_KV_BF16": "0"}).kv_bf16 is False
    assert RuntimeOptions.from_env({}).kv_bf16 is True


def test_hits_computed_while_misses_load_give_the_bits_of_one_call(store, fused):
    """A layer with hits and NVMe misses computes its hits while the misses are read
    (ExpertCache.acquire_overlapped + expert_outputs), then combines every expert in order
    (ffn_block's ``pre``): the logits of the prefill and of every decode step equal, bit for bit,
    those of a cache holding every expert, and of the same small cache without the overlap."""
    with ExpertStore(store) as s:
        slot, n = align_up(s.expert_nbytes), s.num_experts_total

    def run(overlap: bool, **kw):
        with load_from_store(store, prefetch_depth=0, dense="int8", **kw) as sm:
            if not overlap:
                sm.cache.acquire_overlapped = lambda layer, ids, ready: sm.cache.acquire(layer, ids)
            fused(True)
            cfg = sm.model.config
            kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
            step = executor_for(sm.model)
            logits = [step(torch.tensor(PROMPT), BatchLayout.single(0, len(PROMPT), 0), kv)]
            for i, t in enumerate([7, 19, 3, 44, 2, 9, 30, 11]):
                logits.append(step(torch.tensor([t]), BatchLayout.single(0, 1, len(PROMPT) + i), kv))
            sm.cache.drain()
            assert sm.cache.pins == {}
            return torch.stack([x.flatten() for x in logits]), sm.cache.metrics.total()

    want, _ = run(True)
    small = dict(device_budget=(n // 2) * slot, ram_budget=slot)  # half the experts; misses read from disk
    got, m = run(True, **small)
    plain, m_plain = run(False, **small)
    assert m.misses > 0 and m.overlapped > 0 and m_plain.overlapped == 0
    assert torch.equal(got, want) and torch.equal(plain, want)
