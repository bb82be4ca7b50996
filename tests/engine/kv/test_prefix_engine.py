"""Prefix caching in the serving engine: a 4-turn conversation whose turn N computes only its new
tokens, greedy-identical with the cache on and off, on a dense-attention MoE (tiny Qwen3-MoE)
and on a hybrid DeltaNet model (tiny Qwen3-Next, state snapshots at block boundaries); under
preemption and under speculative decoding (rejected drafts never named); every block back in
the pool at the end."""

from __future__ import annotations

import pytest
import torch

from engine.kv.paged import PagedKVCache
from engine.kv.prefix import chain_hashes
from engine.kv.state import HybridKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.runner import Engine
from engine.scheduler import SchedulerConfig
from engine.speculative import SpeculativeConfig
from tests.engine.models.hf_tiny import make_checkpoint
from tests.engine.models.qwen3_next_tiny import make_qwen3_next

BS = 4  # tokens per block
FIRST, NEW, OUT = 23, (9, 6, 11), (7, 5, 9, 6)  # turn 1's prompt, each later turn's user tokens, outputs


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_prefix")
    make_checkpoint("qwen3_moe", path, seed=11, num_experts=8, num_experts_per_tok=2)
    files = open_model_files(path)
    return build_model(files.config, files.source)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_prefix")
    make_qwen3_next(path, seed=13, hidden_size=64, head_dim=16, moe_intermediate_size=32, num_experts=8,
                    num_experts_per_tok=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    shared_expert_intermediate_size=32)
    files = open_model_files(path)
    return build_model(files.config, files.source)


def engine_for(model, prefix_cache: bool, seqs: int = 2, speculative=None, batched: int = 512) -> Engine:
    return Engine.for_requests(model, tokens=160, seqs=seqs, block_size=BS, prefix_cache=prefix_cache,
                               speculative=speculative, max_batched_tokens=batched)


def user_tokens(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def conversation(engine: Engine, seed: int = 0) -> list[tuple[list[int], list[int], int, int]]:
    """Four turns, each prompt = the previous prompt + its answer + new user tokens; per turn
    (prompt, output, cached_tokens, tokens the engine computed)."""
    vocab = engine.model.config.vocab_size
    prompt = user_tokens(vocab, FIRST, seed)
    turns = []
    for t in range(4):
        before = engine.metrics().computed_tokens
        r = engine.generate([(prompt, SamplingConfig(max_tokens=OUT[t], ignore_eos=True))])[0]
        turns.append((prompt, r.output_ids, r.cached_tokens, engine.metrics().computed_tokens - before))
        if t < 3:
            prompt = prompt + r.output_ids + user_tokens(vocab, NEW[t], seed * 10 + t + 1)
    return turns


def assert_pool_clean(engine: Engine) -> None:
    kv = engine.kv
    paged = getattr(kv, "paged", kv)
    assert paged.tables == {} and paged.chains == {}
    assert paged.pool.refcounts == [0] * paged.num_blocks
    assert paged.pool.num_free == paged.num_blocks


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_four_turns_compute_only_new_tokens_and_match_cache_off(which, request):
    model = request.getfixturevalue(which)
    on, off = engine_for(model, True), engine_for(model, False)
    if which == "hybrid":
        assert on.kv.snapshots.capacity > 0 and off.kv.snapshots.capacity == 0
    got, want = conversation(on), conversation(off)
    assert [t[1] for t in got] == [t[1] for t in want]  # greedy tokens identical
    shared = 0  # tokens turn N shares with turn N-1's prompt + answer
    for (prompt, out, cached, computed), (_, _, cached_off, computed_off) in zip(got, want):
        # the last answer token was sampled, never fed: its K/V does not exist
        expect = max(0, shared - 1) // BS * BS
        assert cached == expect and cached_off == 0
        assert computed == len(prompt) - cached + len(out) - 1  # prefill of the new tokens only
        assert computed_off == len(prompt) + len(out) - 1
        shared = len(prompt) + len(out)
    assert expect > 0
    m = on.metrics()
    assert m.prefix_hit_tokens == sum(t[2] for t in got)
    assert m.prefix_query_tokens == sum(len(t[0]) for t in got)
    assert 0 < m.prefix_hit_rate < 1
    assert_pool_clean(on)
    assert on.kv.metrics().blocks_cached > 0  # the conversation stays cached for a 5th turn


def test_named_blocks_hold_exactly_the_committed_tokens(dense):
    """After a turn, the pool's names are the chain of the prompt + answer's full blocks."""
    engine = engine_for(dense, True)
    prompt = user_tokens(dense.config.vocab_size, 30, 5)
    out = engine.generate([(prompt, SamplingConfig(max_tokens=8, ignore_eos=True))])[0].output_ids
    computed = prompt + out[:-1]
    want = chain_hashes(computed, BS, len(computed) // BS)
    assert set(engine.kv.pool.by_hash) == set(want)


def test_cached_blocks_survive_until_the_budget_needs_them(dense):
    """Free named blocks are reused, not evicted, while unnamed free blocks remain; a request
    that needs the whole pool evicts them (LRU) and still gives the cache-off tokens."""
    on, off = engine_for(dense, True, seqs=1), engine_for(dense, False, seqs=1)
    vocab = dense.config.vocab_size
    a = user_tokens(vocab, 41, 1)
    for e in (on, off):
        e.generate([(a, SamplingConfig(max_tokens=4, ignore_eos=True))])
    assert on.kv.pool.evictions == 0 and on.kv.metrics().blocks_cached == 44 // BS
    big = user_tokens(vocab, on.kv.num_blocks * BS - 8, 2)  # needs (almost) every block
    got = on.generate([(big, SamplingConfig(max_tokens=6, ignore_eos=True))])[0]
    want = off.generate([(big, SamplingConfig(max_tokens=6, ignore_eos=True))])[0]
    assert got.output_ids == want.output_ids and got.cached_tokens == 0
    assert on.kv.pool.evictions > 0
    assert_pool_clean(on)


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_conversations_under_preemption_match_cache_off(which, request):
    """Three conversations at once in a pool too small for them: preempted sequences recompute
    from their cached prefix; tokens equal the cache-off run's, the pool ends clean."""
    model = request.getfixturevalue(which)
    results = {}
    for flag in (True, False):
        c = model.config
        if c.linear_attn is None:
            kv = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 20, BS, torch.float32,
                              prefix_cache=flag)
        else:
            kv = HybridKVCache(c, 20, 3, BS, torch.float32, num_snapshots=16, prefix_cache=flag)
        engine = Engine(model, kv=kv, config=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3))
        vocab = model.config.vocab_size
        prompts = [user_tokens(vocab, 20, 30 + i) for i in range(3)]
        outs = [[] for _ in prompts]
        for turn in range(3):
            res = engine.generate([(p, SamplingConfig(max_tokens=6, ignore_eos=True)) for p in prompts])
            for i, r in enumerate(res):
                outs[i].append(r.output_ids)
                prompts[i] = prompts[i] + r.output_ids + user_tokens(vocab, 3, 100 * i + turn)
        results[flag] = (outs, engine.metrics())
        assert_pool_clean(engine)
    assert results[True][0] == results[False][0]
    assert results[True][1].preemptions > 0 and results[True][1].prefix_hit_tokens > 0


class HalfRightDrafter:
    """Drafts [the reference's next token, a wrong one]: every verify accepts one draft and
    rejects the other, so rejected K/V (and state) lands in blocks that later get named."""

    def __init__(self, turns: list[tuple[list[int], list[int]]], vocab: int) -> None:
        self.turns, self.vocab = turns, vocab

    def begin(self, prompt_ids, ctx) -> None:
        pass

    def propose(self, history, k, ctx):
        for prompt, out in self.turns:
            i = len(history) - len(prompt)
            if list(history[:len(prompt)]) == prompt and 0 <= i < len(out):
                return [out[i], (out[i] + 1) % self.vocab][:k], None
        return [], None

    def end(self) -> None:
        pass


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_speculation_rejected_drafts_never_named(which, request):
    """Speculative decoding with accepted and rejected drafts over a conversation: tokens equal
    the plain cache-off run, every named block is the chain of committed tokens, and on the
    hybrid model the state snapshots are the rolled-back ones (else later turns would differ)."""
    model = request.getfixturevalue(which)
    want = conversation(engine_for(model, False), seed=3)
    ref = [(p, o) for p, o, _, _ in want]
    spec = SpeculativeConfig("oracle", max_draft=2, fixed=2,
                             make_drafter=lambda target, k: HalfRightDrafter(ref, model.config.vocab_size))
    on = engine_for(model, True, speculative=spec)
    got = conversation(on, seed=3)
    assert [t[1] for t in got] == [t[1] for t in want]
    m = on.metrics()
    assert m.draft_tokens > m.accepted_draft_tokens > 0  # both outcomes happened
    assert [t[2] for t in got][1:] == [max(0, len(p) + len(o) - 1) // BS * BS
                                       for p, o, _, _ in got[:-1]]
    committed = [set(chain_hashes(p + o[:-1], BS, (len(p) + len(o) - 1) // BS)) for p, o, _, _ in got]
    assert set(getattr(on.kv, "paged", on.kv).pool.by_hash) <= set().union(*committed)
    assert_pool_clean(on)
