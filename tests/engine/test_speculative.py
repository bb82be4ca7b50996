"""Lossless speculative decoding: greedy output identical to plain decoding for every drafter
(SmolLM2 and a tiny MoE store behind a small expert cache), the sampled distribution unchanged
by the rejection rule, stop rules exact mid-draft, drafter and controller bookkeeping."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine.executor import executor_for
from engine.experts.runtime import load_from_store, store_expert_bytes
from engine.generate import generate_ids
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import load_model, open_model_files
from engine.models.load import build_model
from engine.quant.formats import QuantFormat
from engine.generate import Request
from engine.kv.paged import PagedKVCache
from engine.runner import Engine
from engine.speculative import (DraftLengthController, DraftModelDrafter, NgramDrafter,
                                SelfSpecDrafter, SpeculativeConfig, cache_counters,
                                layer_skip_draft, processed_probs)
from engine.store import convert
from tests.engine.models.hf_tiny import make_checkpoint


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the dev machines are 2 shared cores, where spinning OpenMP threads
    slow everything down many times over. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def plain(model, prompt, sampling, eos=()):
    return [t for t, _, _ in generate_ids(model, prompt, sampling, eos_ids=eos)]


def spec(model, prompt, sampling, drafter, eos=(), controller=None, cache=None):
    """One request through the Engine's speculative step with ``drafter``; returns (tokens,
    stats): the request's SpecStats plus generated_tokens and decode_expert_bytes."""
    c = controller or DraftLengthController()
    cfg = SpeculativeConfig("custom", max_draft=c.max_draft, fixed=c.fixed, cache=cache,
                            make_drafter=lambda target, k: drafter)
    m = model.config
    kv = PagedKVCache(m.num_layers, m.num_kv_heads, m.head_dim, num_blocks=64, block_size=8,
                      dtype=model.model.embed_tokens.weight.dtype)
    engine = Engine(model, None, kv, speculative=cfg)
    engine.eos_ids = frozenset(eos)
    b0 = cache_counters(cache)[0]
    res = engine.generate([Request(list(prompt), sampling)])[0]
    st = res.spec
    st.generated_tokens = len(res.output_ids)
    st.decode_expert_bytes = cache_counters(cache)[0] - b0
    st.tokens_per_step = (st.generated_tokens - 1) / st.steps if st.steps else 0.0
    assert kv.metrics().blocks_used == 0  # every block back
    return res.output_ids, st


def bf16_copy(model):
    """The same weights rounded to bf16: a cheap stand-in for a distinct draft model."""
    d = copy.deepcopy(model)
    for p in d.parameters():
        p.data = p.data.to(torch.bfloat16)
    return d


# ---- drafter and controller bookkeeping ---------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match():
    d = NgramDrafter(n=3, max_draft=8)
    d.begin([], None)
    # trailing 3-gram (1, 2, 3): latest earlier occurrence ends at index 7 -> copy 9, 1, 2, ...
    h = [1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3]
    assert d.propose(h, 3, None) == ([9, 1, 2], None)
    # periodic copy runs into its own output (period 2 < k)
    d.begin([], None)
    assert d.propose([7, 8, 7, 8, 7], 5, None) == ([8, 7, 8, 7, 8], None)
    # no 3-gram or 2-gram match: falls back to the 1-gram (5 -> 6)
    d.begin([], None)
    assert d.propose([5, 6, 1, 2, 5], 2, None) == ([6, 1], None)
    d.begin([], None)
    assert d.propose([1, 2, 3, 4], 4, None) == ([], None)  # nothing repeats
    # incremental index: extending the history keeps earlier occurrences
    d.begin([], None)
    h = [4, 5, 6, 1]
    assert d.propose(h, 2, None) == ([], None)
    assert d.propose(h + [4, 5], 2, None) == ([6, 1], None)


def test_controller_formula_and_choice():
    c = DraftLengthController(max_draft=6, probe_every=0)
    assert c.choose() == 0  # first step probes the plain-step cost
    c.observe(0, 0, 0.0, 0.010, 0.0, 0)
    assert DraftLengthController.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert DraftLengthController.expected_tokens(1.0, 3) == 4
    for _ in range(20):  # every draft accepted, verify costs like a plain step: draft the most
        c.observe(4, 4, 0.0, 0.010, 0.0, 0)
    assert c.alpha > 0.9 and c.choose() == 6
    # unseen k: extrapolated from the nearest seen one with the slope between seen ones
    c.observe(2, 2, 0.0, 0.006, 0.0, 0)
    assert c.verify_seconds(2) == pytest.approx(0.006)
    slope = (c.V[4] - c.V[2]) / 2
    assert c.verify_seconds(6) == pytest.approx(c.V[4] + 2 * slope)
    # two thirds of the drafts accepted: free drafts -> the longest; but when each draft token
    # pulls in 4 MB of expert bytes priced at 1 ns/byte, shorter drafts win
    free = DraftLengthController(max_draft=6, probe_every=0)
    b = DraftLengthController(max_draft=6, seconds_per_byte=1e-9, probe_every=0)
    free.observe(0, 0, 0.0, 0.010, 0.0, 0)
    b.observe(0, 0, 0.0, 0.011, 0.001, 1_000_000)  # plain step: 1 MB moved, 10 ms compute
    for k in (1, 3, 5):
        for _ in range(10):
            free.observe(k, 2 * k // 3, 0.0, 0.010, 0.0, 0)
            x = 1_000_000 + k * 4_000_000
            b.observe(k, 2 * k // 3, 0.0, 0.010 + x * 1e-9, x * 1e-9, x)
    assert b.verify_bytes(4) == pytest.approx(17e6, rel=0.01)  # interpolated from 3 and 5
    assert free.choose() == 6
    assert 1 <= b.choose() <= 2
    assert b.choose() == max(range(1, 7), key=lambda k: b.expected_tokens(b.alpha, k) / b.cost(k))
    # poor acceptance: short drafts
    p = DraftLengthController(max_draft=6, probe_every=0)
    p.observe(0, 0, 0.0, 0.010, 0.0, 0)
    for _ in range(20):
        p.observe(3, 0, 0.009, 0.013, 0.0, 0)
    assert p.choose() == 1
    assert DraftLengthController(fixed=3).choose() == 3
    # probes: plain every probe_every steps, one longer than the best half-way between
    q = DraftLengthController(max_draft=6, probe_every=4)
    ks = []
    for _ in range(9):
        k = q.choose()
        ks.append(k)
        q.observe(k, k, 0.0, 0.010, 0.0, 0)
    assert ks[0] == ks[4] == ks[8] == 0 and all(k > 0 for i, k in enumerate(ks) if i % 4)


# ---- SmolLM2: greedy identity --------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    torch.manual_seed(0)
    model, tok, _ = load_model(smollm2_path)
    return model, tok


def test_smollm2_greedy_identical_ngram_and_draft_model(smollm2):
    model, tok = smollm2
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 4)
    sc = SamplingConfig(max_tokens=40, ignore_eos=True)
    want = plain(model, prompt, sc)
    got, st = spec(model, prompt, sc, NgramDrafter(n=3, max_draft=8))
    assert got == want
    assert st.generated_tokens == 40 and st.accepted > 0 and st.tokens_per_step > 1.0
    # (b) draft model: the same SmolLM2 weights rounded to bf16 (own KV cache)
    got, st = spec(model, prompt, sc, DraftModelDrafter(bf16_copy(model)),
                   controller=DraftLengthController(fixed=4))
    assert got == want
    assert st.acceptance_rate > 0.5


# ---- a tiny MoE store behind a small device cache --------------------------------------------------

MOE_PROMPT = [5, 17, 33, 8, 61, 12, 40, 3, 27, 5, 17, 33, 8, 61, 12]


@pytest.fixture(scope="module")
def moe_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec_moe")
    make_checkpoint("mixtral", d / "hf", hidden_size=64, num_hidden_layers=3, head_dim=16,
                    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


def test_moe_store_all_drafters_greedy_identical_with_small_budget(moe_store):
    budget = store_expert_bytes(moe_store) // 4  # 6 of 24 experts: one token's working set
    sc = SamplingConfig(max_tokens=32, ignore_eos=True)
    ref = load_from_store(moe_store, device_budget=budget)
    want = plain(ref.model, MOE_PROMPT, sc)
    ref.close()

    full = load_from_store(moe_store)  # the draft model: its own all-resident cache
    drafters = {
        "ngram": lambda sm: NgramDrafter(n=3, max_draft=6),
        "draft_model": lambda sm: DraftModelDrafter(full.model, max_draft=6),
        "draft_model_layer_skip": lambda sm: DraftModelDrafter(layer_skip_draft(full.model, 2)),
        "self": lambda sm: SelfSpecDrafter(sm.model, sm.cache, max_draft=6),
        "self_no_prefetch": lambda sm: SelfSpecDrafter(sm.model, sm.cache, max_draft=6),
    }
    try:
        for name, make in drafters.items():
            sm = load_from_store(moe_store, device_budget=budget,
                                 prefetch_depth=0 if name == "self_no_prefetch" else 1)
            try:
                unrestricted = []  # draft-time layers with nothing resident: routed freely
                allowed = sm.cache.allowed_experts

                def spy(layer, allowed=allowed, cache=sm.cache):
                    out = allowed(layer)
                    if cache.restrict_to_resident and out is None:
                        unrestricted.append(layer)
                    return out
                sm.cache.allowed_experts = spy
                got, st = spec(sm.model, MOE_PROMPT, sc, make(sm), cache=sm.cache)
                assert got == want, name
                assert st.drafted > 0, name
                assert sm.cache.pins == {} and not sm.cache.restrict_to_resident, name
                assert st.decode_expert_bytes > 0, name  # the small cache re-fetches
                if name.startswith("self"):
                    # drafts route to resident experts only; a miss happens only in a layer whose
                    # experts were all evicted (the cache then routes freely: see allowed_experts)
                    assert st.draft_expert_misses <= 2 * len(unrestricted), name
                    assert st.accepted > 0
                if name == "self_no_prefetch" and not unrestricted:  # nothing in flight either
                    assert st.draft_expert_bytes == 0
                if name == "draft_model":
                    assert st.acceptance_rate > 0.8  # same weights: drafts are the target's tokens
                if name == "ngram":
                    assert st.accepted > 0
            finally:
                sm.close()
    finally:
        full.close()


# ---- sampling: the rejection rule keeps the distribution -------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec_tiny")
    make_checkpoint("llama", d / "target", seed=0, vocab=32, num_hidden_layers=1)
    make_checkpoint("llama", d / "other", seed=1, vocab=32, num_hidden_layers=1)
    def build(path):  # no tokenizer in these checkpoints: token ids only
        files = open_model_files(path)
        return build_model(files.config, files.source)

    return build(d / "target"), build(d / "other")


# every vocabulary id occurs in the prompt, so n-gram lookup always has something to propose
_PERM = torch.randperm(32, generator=torch.Generator().manual_seed(0)).tolist()
TINY_PROMPT = _PERM + _PERM[:6]
SAMPLE = dict(temperature=1.0, top_k=3, repetition_penalty=1.3, ignore_eos=True)


def exact_joint(model, prompt, n, cfg: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(first n tokens) computed position by position from fresh forwards, with the sampler's
    penalties/temperature/top-k written out independently of engine code."""
    def next_probs(prefix):
        kv = ContiguousKVCache(1, model.config.num_kv_heads, model.config.head_dim)
        ids = prompt + list(prefix)
        logits = executor_for(model)(torch.tensor(ids), BatchLayout.single(0, len(ids), 0), kv)[0].clone()
        seen = torch.tensor(sorted(set(prompt) | set(prefix)))
        v = logits[seen]
        logits[seen] = torch.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
        logits = logits / cfg.temperature
        kth = torch.topk(logits, cfg.top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1)

    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in out.items():
            p = next_probs(prefix)
            for t in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (t,)] = pr * float(p[t])
        out = nxt
    return out


def chi2_pvalue(samples: list[tuple[int, ...]], probs: dict) -> float:
    from scipy.stats import chisquare

    cells = sorted(probs)
    assert all(s in probs for s in samples), "a sample outside the support"
    obs = [sum(1 for s in samples if s == c) for c in cells]
    total = sum(probs.values())
    exp = [probs[c] / total * len(samples) for c in cells]
    return float(chisquare(obs, exp).pvalue)


def test_sampled_distribution_matches_plain_sampling(tiny):
    target, other = tiny
    n_tok, runs = 3, 1200
    probs = exact_joint(target, TINY_PROMPT, n_tok, SamplingConfig(max_tokens=n_tok, **SAMPLE))
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5)

    def collect(fn):
        # one token more than compared, so that a fixed k=2 applies to the first verify step
        # (k never exceeds the tokens still owed minus the bonus)
        return [tuple(fn(SamplingConfig(max_tokens=n_tok + 1, seed=s, **SAMPLE))[:n_tok])
                for s in range(runs)]

    p_plain = chi2_pvalue(collect(lambda sc: plain(target, TINY_PROMPT, sc)), probs)
    assert p_plain > 1e-3, p_plain  # the exact computation matches the plain sampler
    variants = {  # drafter, fixed k: k=2 drafts both tokens after the prefill one; k=1 adds a bonus
        "other_model_k2": (lambda: DraftModelDrafter(other), 2),   # q != p: residual max(0, p - q)
        "other_model_k1": (lambda: DraftModelDrafter(other), 1),
        "self_argmax_k2": (lambda: SelfSpecDrafter(target, sample_drafts=False), 2),  # point mass
        "ngram_k2": (lambda: NgramDrafter(n=2, max_draft=2), 2),    # point mass, mostly rejected
    }
    for name, (make, k) in variants.items():
        stats = []

        def run(sc):
            out, st = spec(target, TINY_PROMPT, sc, make(), controller=DraftLengthController(fixed=k))
            stats.append(st)
            return out

        pv = chi2_pvalue(collect(run), probs)
        assert pv > 1e-3, (name, pv)
        rate = sum(s.accepted for s in stats) / max(sum(s.drafted for s in stats), 1)
        assert rate < 1.0, (name, rate)  # rejections: the residual branch ran
        if name != "ngram_k2":
            assert rate > 0.0, (name, rate)  # and acceptances


def test_rejection_rule_is_biased_without_the_residual(tiny, monkeypatch):
    """The chi-square check has power: drawing the correction from p instead of
    normalize(max(0, p - q)) (a classic bug) is detected on the same seeds."""
    import engine.speculative as spec_mod

    target, other = tiny
    n_tok, runs = 3, 1200
    probs = exact_joint(target, TINY_PROMPT, n_tok, SamplingConfig(max_tokens=n_tok, **SAMPLE))
    monkeypatch.setattr(spec_mod, "_residual", lambda p, q, d: p.clone())
    samples = []
    for s in range(runs):
        out, _ = spec(target, TINY_PROMPT, SamplingConfig(max_tokens=n_tok + 1, seed=s, **SAMPLE),
                      DraftModelDrafter(other), controller=DraftLengthController(fixed=2))
        samples.append(tuple(out[:n_tok]))
    assert chi2_pvalue(samples, probs) < 1e-3


def test_exact_match_drafter_accepts_everything_when_sampling(tiny):
    target, _ = tiny
    for s in range(20):
        sc = SamplingConfig(max_tokens=12, seed=s, **SAMPLE)
        _, st = spec(target, TINY_PROMPT, sc, DraftModelDrafter(target), controller=DraftLengthController(fixed=4))
        assert st.drafted > 0 and st.acceptance_rate == 1.0
        _, st = spec(target, TINY_PROMPT, sc, SelfSpecDrafter(target), controller=DraftLengthController(fixed=4))
        assert st.drafted > 0 and st.acceptance_rate == 1.0


def _rules_by_hand(logits, sc, seen, counts):
    """The sampling rules as documented (penalties, temperature, top-k, softmax, min-p, top-p),
    in float64 numpy: an oracle that shares no code with engine.layers.sampler."""
    import numpy as np

    z = logits.double().numpy().copy()
    for t in seen | set(counts):
        z[t] = z[t] / sc.repetition_penalty if z[t] > 0 else z[t] * sc.repetition_penalty
    for t, c in counts.items():
        z[t] -= sc.frequency_penalty * c + sc.presence_penalty
    z = z / sc.temperature
    kth = np.sort(z)[::-1][sc.top_k - 1]
    z[z < kth] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    p[p < sc.min_p * p.max()] = 0.0
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]  # mass of the tokens ranked above each one
    p[order[before >= sc.top_p]] = 0.0
    return p / p.sum()


def test_processed_probs_matches_sampler(tiny):
    from engine.layers.sampler import SamplerState, sample

    logits = torch.randn(32, generator=torch.Generator().manual_seed(0)) * 3
    sc = SamplingConfig(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05, repetition_penalty=1.2,
                        presence_penalty=0.3, frequency_penalty=0.2, seed=1)
    top = torch.argsort(logits, descending=True).tolist()
    seen, counts = {top[2], top[20]}, {top[0]: 2, top[3]: 1}  # penalties hit the likely tokens
    st = SamplerState(sc)
    st.prompt_tokens, st.counts = set(seen), dict(counts)
    p = processed_probs(logits, st)
    want = _rules_by_hand(logits, sc, seen, counts)
    assert set(torch.nonzero(p).flatten().tolist()) == set(want.nonzero()[0].tolist())
    assert 2 <= len(want.nonzero()[0]) < 10  # top-p / min-p really cut inside the top-k
    torch.testing.assert_close(p.double(), torch.from_numpy(want), rtol=1e-5, atol=1e-6)
    # a penalty the rules must apply: without the counts the distribution differs
    bare = SamplerState(sc)
    assert float((processed_probs(logits, bare) - p).abs().sum()) > 0.01
    # and sample() draws from exactly this distribution
    draws = [sample(logits, st) for _ in range(3000)]
    emp = torch.bincount(torch.tensor(draws), minlength=32).double() / len(draws)
    assert set(torch.nonzero(emp).flatten().tolist()) <= set(want.nonzero()[0].tolist())
    assert 0.5 * float((emp - torch.from_numpy(want)).abs().sum()) < 0.05


# ---- stop rules mid-draft ------------------------------------------------------------------------

def test_max_tokens_and_eos_respected_mid_draft(tiny):
    target, _ = tiny
    greedy = SamplingConfig(max_tokens=20, ignore_eos=True)
    want = plain(target, TINY_PROMPT, greedy)
    for n in (1, 2, 5, 6, 7):  # drafts of 6 accepted in full would overshoot these
        sc = SamplingConfig(max_tokens=n, ignore_eos=True)
        got, st = spec(target, TINY_PROMPT, sc, DraftModelDrafter(target),
                       controller=DraftLengthController(max_draft=6, fixed=6))
        assert got == want[:n]
        assert st.generated_tokens == n
    # an EOS id that plain decoding emits at position i: spec stops right after it, although the
    # exact drafter's drafts beyond it were accepted
    i = next(j for j in range(2, 20) if want[j] not in want[:j])
    eos = want[i]
    sc = SamplingConfig(max_tokens=20)
    ref = plain(target, TINY_PROMPT, sc, eos=(eos,))
    assert ref == want[:i + 1]
    for drafter in (DraftModelDrafter(target), SelfSpecDrafter(target)):
        got, st = spec(target, TINY_PROMPT, sc, drafter, eos=(eos,),
                       controller=DraftLengthController(fixed=6))
        assert got == ref
    # stop_token_ids too (ignore_eos does not switch them off)
    sc = SamplingConfig(max_tokens=20, stop_token_ids=(eos,), ignore_eos=True)
    got, _ = spec(target, TINY_PROMPT, sc, DraftModelDrafter(target), controller=DraftLengthController(fixed=6))
    assert got == ref


def test_draft_model_rolls_back_rejected_drafts(tiny):
    """A different draft model is mostly wrong, so its KV must be cut back to the accepted
    history before each draft: every proposal equals a fresh drafter's on the same history."""
    target, other = tiny
    sc = SamplingConfig(max_tokens=24, ignore_eos=True)
    want = plain(target, TINY_PROMPT, sc)
    checks = []

    class Checked(DraftModelDrafter):
        def propose(self, history, k, ctx):
            got = super().propose(history, k, ctx)
            fresh = DraftModelDrafter(other, seq_id=7)
            fresh.begin(TINY_PROMPT + [0], ctx)  # prefill the prompt only
            assert fresh.propose(history, k, ctx) == got
            assert self.fed == list(history) + got[0][:-1]  # the last draft is never fed
            checks.append(k)
            return got

    got, st = spec(target, TINY_PROMPT, sc, Checked(other), controller=DraftLengthController(fixed=3))
    assert got == want
    assert st.drafted > st.accepted  # rejections happened
    assert len(checks) >= 5


def test_bad_inputs_are_clear_errors(tiny):
    from engine.errors import ConfigError, RequestValidationError

    target, _ = tiny
    m = target.config
    kv = PagedKVCache(m.num_layers, m.num_kv_heads, m.head_dim, num_blocks=8, dtype=torch.float32)
    engine = Engine(target, None, kv, speculative=SpeculativeConfig("ngram"))
    with pytest.raises(RequestValidationError):
        engine.add_request("a", [], SamplingConfig())
    with pytest.raises(RequestValidationError):  # asked for, but this engine has no drafter
        Engine(target, None, kv).add_request("b", [1, 2], SamplingConfig(speculative=True))
    with pytest.raises(RequestValidationError):
        SamplingConfig(num_speculative_tokens=0)
    with pytest.raises(ConfigError):
        SpeculativeConfig("self")  # no expert cache to draft on
    with pytest.raises(ConfigError):
        SpeculativeConfig("medusa")
    with pytest.raises(ConfigError):  # vocabularies differ
        small = copy.deepcopy(target)
        small.config = dataclasses.replace(m, vocab_size=m.vocab_size + 1)
        Engine(target, None, kv, speculative=SpeculativeConfig("draft", draft_model=small))
    with pytest.raises(ConfigError):
        DraftLengthController(max_draft=0)
    with pytest.raises(ConfigError):
        NgramDrafter(n=2, min_n=3)
