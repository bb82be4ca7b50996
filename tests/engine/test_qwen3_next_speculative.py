"""Speculative decoding on Qwen3-Next: every mode greedy-identical to plain decoding, with the
recurrent state rolled back from per-position checkpoints (never re-prefilled).

A verify forward feeds [last, d_1..d_k] and samples every row; the DeltaNet layers run it token
by token in the decode form and keep the state after each position, and the engine's
``kv.keep(seq_id, n)`` puts back the one at the accepted length. Self-speculation snapshots the
target's state around its draft forwards; a draft model with recurrent state (a layer-skip
Qwen3-Next) restores its own snapshots on rollback."""

from __future__ import annotations

import pytest
import torch

from engine.errors import MoestreamError
from engine.executor import executor_for
from engine.generate import Request, generate_ids
from engine.kv.base import BatchLayout
from engine.kv.state import HybridKVCache, RecurrentStateError
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.runner import Engine
from engine.scheduler import SchedulerConfig
from engine.speculative import SpeculativeConfig, layer_skip_draft
from tests.engine.models.qwen3_next_tiny import make_qwen3_next

# full_attention_interval 2: layers [DeltaNet, attention, DeltaNet, attention], so the 2-layer
# layer-skip draft model has both kinds (its own recurrent state and KV)
SHAPE = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=32,
             full_attention_interval=2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_spec")
    make_qwen3_next(path, seed=11, **SHAPE)
    return path


@pytest.fixture(scope="module")
def model(hf_dir):
    files = open_model_files(hf_dir)
    return build_model(files.config, files.source)


def requests(vocab: int = 96) -> list[Request]:
    """8 prompts of different lengths (two longer than a DeltaNet chunk) with repeats in them, so
    prompt lookup finds matches; the last one never speculates."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for i, n in enumerate((3, 8, 13, 21, 30, 47, 70, 90)):
        motif = torch.randint(3, vocab, (3 + i,), generator=gen).tolist()
        prompt = (motif * (n // len(motif) + 1))[:n]
        out.append(Request(prompt, SamplingConfig(max_tokens=30 + 3 * i, ignore_eos=True,
                                                  speculative=False if i == 7 else None)))
    return out


def hybrid(model, blocks: int = 256, slots: int = 8) -> HybridKVCache:
    return HybridKVCache(model.config, blocks, slots, 8, torch.float32)


def check_speculation(engine: Engine, reqs: list[Request], want: list[list[int]], preempt: bool = False):
    results = engine.generate(reqs)
    assert [r.output_ids for r in results] == want
    m = engine.metrics()
    drafted = sum(r.spec.drafted for r in results if r.spec is not None)
    accepted = sum(r.spec.accepted for r in results if r.spec is not None)
    assert results[-1].spec is None
    assert (m.draft_tokens, m.accepted_draft_tokens) == (drafted, accepted)
    rejected = drafted - accepted
    assert accepted > 0 and rejected > 0, (drafted, accepted)  # both paths of the rollback ran
    if not preempt:
        # the rollback rolls back: tokens fed = prompt + emitted (the last one never fed) + the
        # rejected drafts; nothing recomputed
        assert m.preemptions == 0 and m.recomputed_tokens == 0
        assert m.computed_tokens == sum(len(r.prompt_ids) + len(r.output_ids) - 1 for r in results) + rejected
    kv = engine.kv
    assert (m.kv.blocks_used, m.kv.state_slots_used, m.kv.bytes_used) == (0, 0, 0)
    assert kv.state._checkpoints == {} and kv.state.tokens == {}
    return m


@pytest.fixture(scope="module")
def plain(model):
    reqs = requests()
    return reqs, [[t for t, _, _ in generate_ids(model, r.prompt_ids, r.sampling)] for r in reqs]


def test_verify_checkpoints_are_the_plain_decoding_states(model):
    """The state after each verify position equals (bit for bit) the state plain decoding
    reaches there, the verify logits equal the decode logits, and keep puts one back."""
    cfg = model.config
    prompt = torch.randint(3, 96, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    feed = [17, 40, 41, 5, 88]  # [last, d_1..d_4]
    plain_kv, verify_kv = hybrid(model), hybrid(model)
    for kv in (plain_kv, verify_kv):
        executor_for(model)(torch.tensor(prompt), BatchLayout.single(0, 70, 0), kv)
    plain_states, plain_logits = [], []
    for i, t in enumerate(feed):
        plain_logits.append(executor_for(model)(torch.tensor([t]), BatchLayout.single(0, 1, 70 + i), plain_kv)[0])
        plain_states.append(plain_kv.snapshot(0))
    st = verify_kv.state
    logits = executor_for(model)(torch.tensor(feed), BatchLayout.single(0, 5, 70), verify_kv, rows=list(range(5)))
    assert logits.shape == (5, cfg.vocab_size)
    torch.testing.assert_close(logits, torch.stack(plain_logits), rtol=1e-4, atol=1e-4)
    base, conv, matrix = st._checkpoints[0]
    assert base == 70 and conv.shape[1] == matrix.shape[1] == 5
    for i, snap in enumerate(plain_states):  # (the projections see 5 rows, not 1: not bitwise)
        torch.testing.assert_close(conv[:, i], snap.conv, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(matrix[:, i], snap.matrix, rtol=1e-5, atol=1e-6)
    assert st.tokens[0] == 75
    verify_kv.keep(0, 72)  # accepted d_1: continue from position 72
    assert st.tokens[0] == 72 and st._checkpoints == {}
    now = verify_kv.snapshot(0)
    assert torch.equal(now.conv, conv[:, 1]) and torch.equal(now.matrix, matrix[:, 1])
    torch.testing.assert_close(now.matrix, plain_states[1].matrix, rtol=1e-5, atol=1e-6)
    assert float((now.matrix - plain_states[4].matrix).abs().max()) > 1e-2  # the drafts had moved it
    # and decoding continues from there as plain decoding did
    again = executor_for(model)(torch.tensor([feed[2]]), BatchLayout.single(0, 1, 72), verify_kv)[0]
    torch.testing.assert_close(again, plain_logits[2], rtol=1e-4, atol=1e-4)


def test_keep_needs_a_verify_forward(model):
    kv = hybrid(model)
    prompt = list(range(3, 23))
    executor_for(model)(torch.tensor(prompt), BatchLayout.single(0, 20, 0), kv)
    kv.keep(0, 20)  # where it stands: nothing to do
    with pytest.raises(RecurrentStateError, match="only a verify forward"):
        kv.keep(0, 18)
    # a prefill chunk asks for its last row only: no checkpoints, so no rollback into it
    executor_for(model)(torch.tensor(prompt[:5]), BatchLayout.single(0, 5, 20), kv, rows=[4])
    with pytest.raises(RecurrentStateError, match="none kept"):
        kv.keep(0, 22)
    executor_for(model)(torch.tensor(prompt[:3]), BatchLayout.single(0, 3, 25), kv, rows=[0, 1, 2])
    with pytest.raises(RecurrentStateError, match="positions 26..28 kept"):
        kv.keep(0, 25)  # before the verify forward's first token
    assert isinstance(RecurrentStateError("x"), MoestreamError)
    kv.keep(0, 26)
    assert kv.state.tokens[0] == 26


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_speculation_is_greedy_identical(model, plain, mode):
    reqs, want = plain
    draft = layer_skip_draft(model, 2) if mode == "draft" else None  # recurrent state of its own
    engine = Engine(model, kv=hybrid(model), config=SchedulerConfig(max_num_batched_tokens=512),
                    speculative=SpeculativeConfig(mode, max_draft=4, draft_model=draft))
    check_speculation(engine, reqs, want)


def test_speculation_survives_preemption_and_chunked_prefill(model, plain):
    reqs, want = plain
    engine = Engine(model, kv=hybrid(model, blocks=40, slots=4),
                    config=SchedulerConfig(max_num_batched_tokens=24),
                    speculative=SpeculativeConfig("ngram", max_draft=4))
    m = check_speculation(engine, reqs, want, preempt=True)
    assert m.preemptions > 0


@pytest.fixture(scope="module")
def store(hf_dir, tmp_path_factory):
    from engine.quant.formats import QuantFormat
    from engine.store import convert

    out = tmp_path_factory.mktemp("qwen3_next_spec_store") / "store"
    convert(hf_dir, out, fmt=QuantFormat("int4", 32), progress=False)
    return out


def _small_budget(store) -> int:
    from engine.experts.runtime import store_expert_bytes

    # 8 of 32 experts: misses every step, and self-speculation's resident-only routing differs
    # from the full routing (rejections)
    return store_expert_bytes(store) // 4


@pytest.fixture(scope="module")
def store_plain(store):
    """Each request alone, plain decoding, on the store with the small cache."""
    from engine.experts.runtime import load_from_store

    with load_from_store(store, device_budget=_small_budget(store), prefetch_depth=1) as small:
        return [Engine(small.model, kv=hybrid(small.model)).generate([r])[0].output_ids for r in requests()]


@pytest.mark.parametrize("mode", ["ngram", "self", "draft"])
def test_int4_store_speculation_is_greedy_identical_with_a_minimal_cache(store, store_plain, mode):
    from engine.experts.runtime import load_from_store

    reqs, want = requests(), store_plain
    with load_from_store(store, prefetch_depth=0) as full:
        with load_from_store(store, device_budget=_small_budget(store), prefetch_depth=1) as small:
            cfg = SpeculativeConfig(mode, max_draft=4, cache=small.cache,
                                    draft_model=layer_skip_draft(full.model, 2) if mode == "draft" else None)
            engine = Engine(small.model, kv=hybrid(small.model),
                            config=SchedulerConfig(max_num_batched_tokens=512), speculative=cfg)
            check_speculation(engine, reqs, want)
            assert small.cache.metrics.total().misses > 0 and small.cache.pins == {}


def test_recurrent_draft_model_rolls_back_its_own_state(model):
    """DraftModelDrafter over a layer-skip Qwen3-Next: after drafts beyond the history, a
    history that keeps some of them and diverges restores the draft's state snapshot there (or,
    diverging before any snapshot, prefills again); its next drafts equal a fresh drafter's."""
    from engine.kv.base import ContiguousKVCache
    from engine.layers.sampler import SamplerState
    from engine.speculative import DraftContext, DraftModelDrafter

    draft = layer_skip_draft(model, 2)
    ctx = DraftContext(ContiguousKVCache(1, 1, 1), 0, SamplerState(SamplingConfig()), model.config.vocab_size)
    history = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(8)).tolist()

    def fresh(h: list[int]) -> list[int]:
        d = DraftModelDrafter(draft, max_draft=4)
        d.begin(h, ctx)
        return d.propose(h, 4, ctx)[0]

    d = DraftModelDrafter(draft, max_draft=4)
    d.begin(history, ctx)
    drafts = d.propose(history, 4, ctx)[0]
    assert len(d.fed) == 33 and sorted(d._snaps) == [30, 31, 32]  # d_1..d_3 fed, state kept before each
    fed = []

    def counting(tokens, layout, kv):
        fed.append(tokens.numel())
        return executor_for(draft)(tokens, layout, kv)

    d.forward = counting
    kept = history + drafts[:2] + [(drafts[2] + 1) % 96]  # d_1, d_2 accepted, then a correction
    assert d.propose(kept, 4, ctx)[0] == fresh(kept)
    assert fed == [1, 1, 1, 1]  # the correction, then 3 drafts: the state came back from position 32
    assert d.fed == kept + d.fed[33:] and len(d.fed) == 36
    earlier = history[:20] + [(history[20] + 1) % 96]  # diverges before any snapshot: prefill again
    assert d.propose(earlier, 4, ctx)[0] == fresh(earlier)


def test_all_rows_of_a_long_span_are_computed_without_checkpoints(model):
    """Every row of a span longer than a verify row can hold (e.g. prompt logprobs): the logits
    come back and nothing is checkpointed; a rollback into it is refused."""
    from engine.kv.state import MAX_CHECKPOINTS

    kv = hybrid(model)
    n = MAX_CHECKPOINTS + 5
    prompt = torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(3))
    logits = executor_for(model)(prompt, BatchLayout.single(0, n, 0), kv, rows=list(range(n)))
    assert logits.shape == (n, model.config.vocab_size) and kv.state._checkpoints == {}
    with pytest.raises(RecurrentStateError, match="none kept"):
        kv.keep(0, n - 1)
    short = executor_for(model)(prompt[:MAX_CHECKPOINTS], BatchLayout.single(1, MAX_CHECKPOINTS, 0), kv,
                                rows=list(range(MAX_CHECKPOINTS)))
    assert short.shape[0] == MAX_CHECKPOINTS and kv.state._checkpoints[1][1].shape[1] == MAX_CHECKPOINTS


@pytest.mark.skipif(not __import__("engine.quant.kernels", fromlist=["x"]).load_extension(),
                    reason="native kernels unavailable")
def test_native_step_speculation_is_greedy_identical(hf_dir):
    """bf16 dense linears: the native step (engine.models.qwen3_next.step) runs every DeltaNet row, verify
    rows and their checkpoints included (the torch DeltaNet module never runs). n-gram
    speculation gives plain decoding's greedy tokens, with drafts accepted and rejected and
    nothing recomputed, alone and with chunked prefill beside decode and verify rows."""
    from engine.options import configure, options
    from engine.quant.linear import quantize_dense
    from tests.engine.test_step import Counting

    prev = configure()
    try:
        configure(fused_step=True, int8_activations=False)
        files = open_model_files(hf_dir)
        native = quantize_dense(build_model(files.config, files.source), "bf16")
        step = executor_for(native).native()
        assert step is not None and options().fused_step
        step.ext = spy = Counting(step.ext)
        torch_rows = []
        for layer in native.model.layers:
            if layer.linear:
                layer.linear_attn.register_forward_hook(lambda m, a, out: torch_rows.append(out.shape[0]))
        reqs = requests()
        want = [[t for t, _, _ in generate_ids(native, r.prompt_ids, r.sampling)] for r in reqs]
        for budget in (512, 24):  # everything in one step; chunked prefill beside decode and verify rows
            engine = Engine(native, kv=hybrid(native), config=SchedulerConfig(max_num_batched_tokens=budget),
                            speculative=SpeculativeConfig("ngram", max_draft=4))
            check_speculation(engine, requests(), want)
        assert torch_rows == [] and spy.calls["deltanet_block"] > 0
    finally:
        configure(prev)
