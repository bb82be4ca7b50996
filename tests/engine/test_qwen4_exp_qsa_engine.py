"""Qwen4-Exp served over the paged KV cache, where QSA runs the paged path (engine.layers.qsa:
index keys and pooled keys in the KV blocks, batched selection, attention over the gathered
selection): logits within 1e-4 of transformers over 120 positions and 32 greedy tokens
identical on every tiny case (contexts far past the budgets: selection drops blocks); random
aborts and speculative verify rows with rollback give the tokens of each request alone through
the reference (engine.models.qwen4_exp.qsa_reference over engine.generate's contiguous cache);
index bytes in the KV budget. (Chunked prefill, forced preemption and `generate --model`, which
serve over the same paged cache: tests/engine/test_qwen4_exp_engine.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from engine.generate import Request, generate_ids
from engine.kv.base import BatchLayout
from engine.kv.state import HybridKVCache
from engine.layers import qsa
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.runner import Engine
from engine.scheduler import SchedulerConfig
from engine.speculative import SpeculativeConfig
from tests.engine.models.qwen4_exp_tiny import CASES, make_qwen4_exp, prompt


def _load(path):
    files = open_model_files(path)
    return build_model(files.config, files.source)


def _hybrid(model, blocks: int = 256, slots: int = 8, block_size: int = 4) -> HybridKVCache:
    return HybridKVCache(model.config, blocks, slots, block_size, torch.float32)


class _Spy:
    """Counts the paged path's selections and the rows whose selection dropped tokens."""

    def __init__(self, monkeypatch) -> None:
        self.calls = self.dropped = 0
        real = qsa.select_tokens

        def spy(store, layer, plan, iq):
            pos, ok = real(store, layer, plan, iq)
            self.calls += 1
            self.dropped += int((ok.sum(1) < plan.row_pos + 1).sum())
            return pos, ok

        monkeypatch.setattr(qsa, "select_tokens", spy)


@pytest.mark.parametrize("case", list(CASES))
def test_paged_qsa_matches_transformers(tmp_path, case, monkeypatch):
    ref = make_qwen4_exp(tmp_path, seed=len(case), case=case)
    ours = _load(tmp_path)
    spy = _Spy(monkeypatch)
    ids = prompt(ours.config.vocab_size, 120)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = ours(torch.tensor(ids), BatchLayout.single(0, 120, 0), _hybrid(ours), all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert spy.calls == len(ours.config.attention_layers) and spy.dropped > 0

    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, 120, dtype=torch.long),
                          max_new_tokens=32, do_sample=False)[0, 120:].tolist()
    engine = Engine(ours, kv=_hybrid(ours), config=SchedulerConfig(max_num_batched_tokens=48))
    [result] = engine.generate([Request(ids, SamplingConfig(max_tokens=32, ignore_eos=True))])
    assert result.output_ids == hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_exp_qsa")
    make_qwen4_exp(path, seed=5, case="ple1_ng2_hc4")
    return _load(path)


def _requests(vocab: int, motif: bool = False) -> list[Request]:
    out = []
    for i, (n, m) in enumerate(zip((5, 40, 130, 70, 17), (20, 12, 8, 16, 24))):
        ids = prompt(vocab, n, seed=i + 2)
        if motif:  # repeats, so prompt lookup drafts (and some drafts get rejected)
            ids = (ids[:3 + i] * n)[:n]
        out.append(Request(ids, SamplingConfig(max_tokens=m, ignore_eos=True)))
    return out


def _alone(model, reqs: list[Request]) -> list[list[int]]:
    return [[t for t, _, _ in generate_ids(model, r.prompt_ids, r.sampling)] for r in reqs]


def test_aborts_leave_the_rest_exact(model):
    """Random aborts free blocks holding index keys that new requests then reuse; the requests
    that run to the end give their tokens alone."""
    kv = _hybrid(model, 40, 4)
    engine = Engine(model, kv=kv, config=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4))
    rng = random.Random(3)
    reqs, aborted, tokens, finished = {}, set(), {}, set()

    def step():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)

    for i in range(40):
        n = rng.choice((1, 9, 30, 50))
        reqs[f"r{i}"] = Request(prompt(model.config.vocab_size, n, seed=100 + i),
                                SamplingConfig(max_tokens=rng.randint(1, 8), ignore_eos=True))
        engine.add_request(f"r{i}", reqs[f"r{i}"].prompt_ids, reqs[f"r{i}"].sampling)
        if rng.random() < 0.35:
            victim = f"r{rng.randrange(i + 1)}"
            aborted.add(victim)
            engine.abort(victim)
        step()
    while engine.scheduler.has_unfinished():
        step()
    kept = sorted(finished - aborted)
    assert len(kept) >= 6 and aborted
    for rid in kept[:6]:
        assert tokens[rid] == _alone(model, [reqs[rid]])[0], rid
    assert kv.metrics().blocks_used == 0


def test_speculative_verify_rows_roll_back_index_keys(model):
    """Prompt-lookup drafts verified in one forward per step; accepted and rejected drafts both
    occur, and the tokens are plain decoding's (the reference alone)."""
    reqs = _requests(model.config.vocab_size, motif=True)
    want = _alone(model, reqs)
    engine = Engine(model, kv=_hybrid(model), config=SchedulerConfig(max_num_batched_tokens=64),
                    speculative=SpeculativeConfig("ngram", max_draft=4))
    results = engine.generate(reqs)
    assert [r.output_ids for r in results] == want
    drafted = sum(r.spec.drafted for r in results if r.spec is not None)
    accepted = sum(r.spec.accepted for r in results if r.spec is not None)
    assert accepted > 0 and drafted - accepted > 0, (drafted, accepted)


def test_index_bytes_are_counted_in_the_kv_budget(model):
    """Each KV block carries its index keys and pooled keys (float32, every QSA layer): counted
    in block_bytes (so from_budget carves fewer blocks) and in the metrics."""
    cfg, a = model.config, model.config.arch_params
    la, di, r = len(cfg.attention_layers), a.indexer_head_dim, a.indexer_ratio
    kv_only = la * 2 * 8 * cfg.num_kv_heads * cfg.head_dim * 4
    index = la * (8 + (8 - 1) // r + 1) * di * 4
    assert HybridKVCache.block_bytes(cfg, 8, torch.float32) == kv_only + index
    kv = HybridKVCache.from_budget(cfg, 1 << 20, 8, torch.float32, max_seqs=2)
    m = kv.metrics()
    assert m.bytes_total <= 1 << 20
    slots = m.state_slots_total + m.state_snapshots_total  # prefix caching's state snapshots too
    assert m.bytes_total == m.blocks_total * (kv_only + index) + slots * m.state_bytes_per_sequence
    # under a bf16 (or FP8) KV cache the index is bf16
    assert HybridKVCache.block_bytes(cfg, 8, torch.bfloat16) == (kv_only + index) // 2
    assert HybridKVCache.block_bytes(cfg, 8, torch.float8_e4m3fn) == kv_only // 4 + la * 2 * 4 + index // 2

