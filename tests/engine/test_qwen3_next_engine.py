"""Qwen3-Next in the serving engine and through the store: concurrent requests equal each alone
(also under forced preemption, too few state slots and chunked prefill), state accounting back to
zero after random aborts, an int4 store greedy-identical between a minimal expert cache and full
residency, and `generate --model` against transformers."""

from __future__ import annotations

import random

import pytest
import torch
from click.testing import CliRunner

from engine.executor import executor_for
from engine.generate import Request, generate_ids
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.kv.state import HybridKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import load_model, open_model_files
from engine.models.load import build_model
from engine.runner import Engine
from engine.scheduler import SchedulerConfig
from tests.engine.models.hf_tiny import add_mixtral_tokenizer
from tests.engine.models.qwen3_next_tiny import make_qwen3_next

PROMPT_LENS = [1, 3, 9, 17, 40, 66, 70, 130]  # three of them longer than one DeltaNet chunk
MAX_TOKENS = [1, 4, 7, 10, 12, 3, 9, 6]
SHAPE = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=32)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next")
    make_qwen3_next(path, seed=7, **SHAPE)
    return path


@pytest.fixture(scope="module")
def model(hf_dir):
    files = open_model_files(hf_dir)
    return build_model(files.config, files.source)


def requests(vocab: int, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(3, vocab, (n,), generator=g).tolist(),
                    SamplingConfig(max_tokens=m, ignore_eos=True))
            for n, m in zip(PROMPT_LENS, MAX_TOKENS)]


def alone(model, req: Request) -> list[int]:
    return [t for t, _, _ in generate_ids(model, req.prompt_ids, req.sampling)]


def hybrid(model, blocks: int, slots: int, block_size: int = 4) -> HybridKVCache:
    return HybridKVCache(model.config, blocks, slots, block_size, torch.float32)


@pytest.fixture(scope="module")
def reference(model):
    reqs = requests(model.config.vocab_size)
    return reqs, [alone(model, r) for r in reqs]


@pytest.mark.parametrize("blocks,slots,budget", [
    (256, 8, 512),  # plenty of everything
    (256, 8, 16),  # chunked prefill: the 130-token prompt takes 9 steps, state carried across
    (40, 8, 24),  # forced preemption: recomputed from 0, state rebuilt
    (256, 3, 32),  # fewer state slots than requests: the rest wait for a slot
])
def test_concurrent_requests_equal_each_alone(model, reference, blocks, slots, budget):
    check_concurrent(model, reference, blocks, slots, budget)


def check_concurrent(model, reference, blocks: int, slots: int, budget: int) -> None:
    """The reference requests in one engine (``blocks`` KV blocks, ``slots`` state slots, a
    token budget per step) give each one's tokens alone; nothing is left allocated after."""
    reqs, want = reference
    engine = Engine(model, kv=hybrid(model, blocks, slots), config=SchedulerConfig(max_num_batched_tokens=budget))
    results = engine.generate(reqs)
    assert [r.output_ids for r in results] == want
    m = engine.metrics()
    if blocks == 40:
        assert m.preemptions > 0 and m.recomputed_tokens > 0
    assert (m.kv.blocks_used, m.kv.state_slots_used, m.kv.bytes_used) == (0, 0, 0)


def test_state_accounting_returns_to_zero_after_random_aborts(model):
    kv = hybrid(model, 24, 4)
    engine = Engine(model, kv=kv, config=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6))
    rng = random.Random(2)
    peak = 0
    for i in range(200):
        n = rng.choice((1, 2, 5, 30, 70))
        engine.add_request(f"r{i}", [rng.randrange(3, 96) for _ in range(n)],
                           SamplingConfig(max_tokens=rng.randint(1, 6), ignore_eos=True))
        if rng.random() < 0.4:
            engine.abort(f"r{rng.randrange(i + 1)}")
        engine.step()
        peak = max(peak, kv.metrics().state_slots_used)
        assert kv.state.num_used + kv.state.num_free == kv.state.capacity
        assert set(kv.state.slot) <= {s.seq_id for s in engine.scheduler.running}
    while engine.has_unfinished():
        engine.step()
    m = engine.metrics()
    assert peak == 4 and m.preemptions > 0  # slots and blocks were really contended
    assert (m.kv.state_slots_used, m.kv.blocks_used, m.kv.num_sequences, m.kv.bytes_used) == (0, 0, 0, 0)
    assert kv.state.slot == {} and kv.state.tokens == {} and kv.state.num_free == 4


def test_int4_store_minimal_cache_equals_full_residency(hf_dir, model, tmp_path):
    check_int4_store(hf_dir, model, tmp_path / "store")


def check_int4_store(hf_dir, model, store) -> None:
    """``hf_dir`` converted to an int4 g32 store: logits near the fp32 ``model``'s, and the same
    greedy tokens with a minimal expert cache (top-k experts) as fully resident, alone and in a
    batch."""
    from engine.experts.runtime import load_from_store
    from engine.experts.tiers import align_up
    from engine.quant.formats import QuantFormat
    from engine.store import convert

    convert(hf_dir, store, fmt=QuantFormat("int4", 32), progress=False)
    full = load_from_store(store, prefetch_depth=0)
    top_k = full.model.config.moe.top_k
    small = load_from_store(store, device_budget=top_k * align_up(full.store.expert_nbytes),
                            prefetch_depth=1)
    try:
        assert full.model.config == model.config  # the manifest's round trip
        prompt = torch.randint(3, 96, (100,), generator=torch.Generator().manual_seed(4))
        cfg = model.config
        kv = lambda: ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)  # noqa: E731
        want = executor_for(model)(prompt, BatchLayout.single(0, 100, 0), kv(), all_logits=True)
        got = executor_for(full.model)(prompt, BatchLayout.single(0, 100, 0), kv(), all_logits=True)
        # int4 g32 experts, fp32 dense, against the fp32 model over 100 positions (measured: mean
        # cosine 0.986, mean |error| 14% of mean |logit|; a near-tie routing flip moves single rows)
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert float(cos.mean()) > 0.98 and float(cos.min()) > 0.8
        assert float((got - want).abs().mean()) < 0.2 * float(want.abs().mean())
        sampling = SamplingConfig(max_tokens=32, ignore_eos=True)
        tokens_full = [t for t, _, _ in generate_ids(full.model, prompt.tolist(), sampling)]
        tokens_small = [t for t, _, _ in generate_ids(small.model, prompt.tolist(), sampling)]
        assert tokens_small == tokens_full
        assert small.cache.metrics.total().misses > 0  # the minimal cache really evicted
        engine = Engine(small.model, kv=hybrid(small.model, 128, 4), config=SchedulerConfig(max_num_batched_tokens=32))
        reqs = requests(96, seed=9)[:5]
        assert [r.output_ids for r in engine.generate(reqs)] == [alone(full.model, r) for r in reqs]
    finally:
        full.close()
        small.close()


def test_generate_cli_matches_transformers(tmp_path):
    d = tmp_path / "hf"
    ref = make_qwen3_next(d, seed=3, vocab=32000, **SHAPE)
    check_generate_cli(ref, d)


def check_generate_cli(ref, d) -> int:
    """`generate --model d` (greedy, fp32 dense) prints the text of transformers' ``ref``'s
    greedy tokens up to the end of sequence (at least 9 of them); returns how many."""
    from services.cli import main

    add_mixtral_tokenizer(d)
    _, tok, _ = load_model(d)
    ids = tok.encode("Hello there, tell me about recurrent state")
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    r = CliRunner().invoke(main, ["generate", "--model", str(d), "--dense", "fp32", "--max-tokens", "32",
                                  "Hello there, tell me about recurrent state"])
    assert r.exit_code == 0, r.output
    eos = set(tok.eos_token_ids)
    hf = hf[:next((i for i, t in enumerate(hf) if t in eos), len(hf))]
    assert len(hf) > 8
    assert r.stdout.rstrip("\n") == tok.decode(hf)
    return len(hf)
