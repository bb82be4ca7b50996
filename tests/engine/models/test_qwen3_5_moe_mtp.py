"""Qwen3.5-MoE's MTP head (engine/models/qwen3_5_moe/mtp.py) and ``--speculative mtp``.

- The head's logits equal a second implementation written here straight from llama.cpp's
  ``llama_model_qwen35moe::graph_mtp`` (llama-cpp-python 0.3.36's vendored source) on the raw
  checkpoint tensors, with the target hidden states taken from transformers' own text model:
  fed in one forward and slot by slot through the head's KV cache.
- Inside the serving engine (batched, one request not speculating, chunked prefill and
  preemption) every draft the MTP drafter proposes is the reference's chained prediction from
  the accepted history, and the greedy tokens equal plain decoding's.
- Sampling keeps plain sampling's distribution (chi-square against the exact joint).
- A checkpoint without an MTP head, a GGUF file, a misshapen or missing tensor: one
  ModelFormatError each; `generate --speculative mtp` with --store: a usage error.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelFormatError
from engine.generate import Request, generate_ids
from engine.kv.state import HybridKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.models.qwen3_5_moe.mtp import load_mtp_head
from engine.models.qwen3_5_moe.mtp_draft import MTPDrafter, mtp_speculative_config
from engine.runner import Engine
from engine.scheduler import SchedulerConfig
from engine.speculative import SpeculativeConfig
from tests.engine.models.qwen3_5_moe_tiny import add_mtp, make_qwen3_5_moe

SHAPES = {
    "untied": dict(),
    "tied_interval2": dict(tied=True, full_attention_interval=2),
}


def _checkpoint(path, seed, vocab=96, **shape):
    ref = make_qwen3_5_moe(path, seed=seed, vocab=vocab, vision=False, **shape)
    add_mtp(path, seed + 100)
    return ref


@pytest.fixture(scope="module", params=sorted(SHAPES))
def tiny(request, tmp_path_factory):
    """(transformers model, HF dir, moestream model, raw tensors)"""
    d = tmp_path_factory.mktemp(f"q35_mtp_{request.param}")
    ref = _checkpoint(d, seed=7, **SHAPES[request.param])
    files = open_model_files(d)
    return ref, d, build_model(files.config, files.source), load_file(d / "model.safetensors")


# ---- the reference: llama.cpp's graph_mtp written out on raw tensors -----------------------------

def _rms(x, w, eps):
    """llama.cpp build_norm(LLM_NORM_RMS) with the converter's stored weight 1 + w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope_neox(x, pos, rd, theta):
    """ggml_rope_multi (imrope) for text positions (all sections equal): NeoX rotation of the
    first rd dims of each head. x [T, n, d]."""
    inv = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = pos[:, None].double() * inv
    c, s = ang.cos().float()[:, None], ang.sin().float()[:, None]
    a, b = x[..., : rd // 2], x[..., rd // 2: rd]
    return torch.cat((a * c - b * s, b * c + a * s, x[..., rd:]), -1)


def reference_mtp(w, tc, next_tokens, hidden):
    """graph_mtp over slots 0..T-1: next_tokens [T] (x_{p+1}), hidden [T, H] (h_p, the target's
    normed hidden; the previous row's returned g for a chained draft). Returns (logits [T, V], g)."""
    eps, d, nh, nkv = tc["rms_norm_eps"], tc["head_dim"], tc["num_attention_heads"], tc["num_key_value_heads"]
    rp = tc["rope_parameters"]
    rd, theta = int(d * rp["partial_rotary_factor"]), rp["rope_theta"]
    m = lambda n: w["mtp." + n]  # noqa: E731
    lay = lambda n: w["mtp.layers.0." + n]  # noqa: E731
    t = len(next_tokens)
    emb = w["model.language_model.embed_tokens.weight"]
    head = w.get("lm_head.weight", emb)
    x = torch.cat((_rms(emb[next_tokens], m("pre_fc_norm_embedding.weight"), eps),
                   _rms(hidden, m("pre_fc_norm_hidden.weight"), eps)), -1) @ m("fc.weight").T
    resid = x
    a = _rms(x, lay("input_layernorm.weight"), eps)
    qf = (a @ lay("self_attn.q_proj.weight").T).view(t, nh, 2 * d)
    q, gate = qf[..., :d], qf[..., d:]
    q = _rms(q, lay("self_attn.q_norm.weight"), eps)
    k = _rms((a @ lay("self_attn.k_proj.weight").T).view(t, nkv, d), lay("self_attn.k_norm.weight"), eps)
    v = (a @ lay("self_attn.v_proj.weight").T).view(t, nkv, d)
    pos = torch.arange(t) + 1  # slot p is the token at position p + 1
    q, k = _rope_neox(q, pos, rd, theta), _rope_neox(k, pos, rd, theta)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    x = resid + (att * torch.sigmoid(gate)).reshape(t, nh * d) @ lay("self_attn.o_proj.weight").T
    f = _rms(x, lay("post_attention_layernorm.weight"), eps)
    probs = (f @ lay("mlp.gate.weight").T).softmax(-1)
    top_w, top_i = probs.topk(tc["num_experts_per_tok"], -1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    moe = torch.zeros_like(x)
    silu = torch.nn.functional.silu
    for r in range(t):
        for j in range(top_i.shape[1]):
            e = f"mlp.experts.{int(top_i[r, j])}."
            y = silu(f[r] @ lay(e + "gate_proj.weight").T) * (f[r] @ lay(e + "up_proj.weight").T)
            moe[r] += top_w[r, j] * (y @ lay(e + "down_proj.weight").T)
    sh = (silu(f @ lay("mlp.shared_expert.gate_proj.weight").T) * (f @ lay("mlp.shared_expert.up_proj.weight").T)
          ) @ lay("mlp.shared_expert.down_proj.weight").T
    x = x + moe + torch.sigmoid(f @ lay("mlp.shared_expert_gate.weight").T) * sh
    g = _rms(x, m("norm.weight"), eps)
    return g @ head.T, g


def _text_config(hf_dir):
    return json.loads((hf_dir / "config.json").read_text())["text_config"]


def _target_hidden(ref, ids):
    """transformers' text model's last hidden state (after its final norm): [T, H]."""
    with torch.no_grad():
        return ref.model.language_model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def test_mtp_head_matches_the_llama_cpp_graph_written_out(tiny):
    ref, hf_dir, model, w = tiny
    tc = _text_config(hf_dir)
    head = load_mtp_head(model, open_model_files(hf_dir).source)
    ids = torch.randint(3, 96, (41,), generator=torch.Generator().manual_seed(2)).tolist()
    h = _target_hidden(ref, ids)
    nxt, hid = torch.tensor(ids[1:]), h[:-1]
    want, want_g = reference_mtp(w, tc, nxt, hid)
    from engine.kv.base import BatchLayout

    kv = head.new_cache()
    got, got_g = head(nxt, hid, BatchLayout.single(0, 40, 0), kv)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-4)
    # through the head's own KV cache, in uneven chunks
    kv2, rows, start = head.new_cache(), [], 0
    for n in (17, 1, 9, 1, 12):
        rows.append(head(nxt[start:start + n], hid[start:start + n], BatchLayout.single(5, n, start), kv2)[0])
        start += n
    torch.testing.assert_close(torch.cat(rows), want, rtol=1e-4, atol=1e-4)
    assert float((want - (hid @ w.get("lm_head.weight", w["model.language_model.embed_tokens.weight"]).T)
                  ).abs().max()) > 1e-2  # the head changes what the target's head alone says


def _chained(w, tc, ref, history, k):
    """The reference's k chained drafts after ``history`` (its last token not yet fed)."""
    h = _target_hidden(ref, history[:-1])
    nxt, hid, drafts = list(history[1:]), h, []
    for _ in range(k):
        logits, g = reference_mtp(w, tc, torch.tensor(nxt), hid)
        drafts.append(int(logits[-1].argmax()))
        nxt, hid = nxt + [drafts[-1]], torch.cat((hid, g[-1:]))
    return drafts


class _Recording(MTPDrafter):
    def __init__(self, *a, log, **kw):
        super().__init__(*a, **kw)
        self.log = log

    def propose(self, history, k, ctx):
        drafts, qs = super().propose(history, k, ctx)
        self.log.append((list(history), list(drafts)))
        return drafts, qs


def _requests():
    gen = torch.Generator().manual_seed(5)
    out = []
    for i, n in enumerate((5, 23, 70, 12)):  # 70: longer than a DeltaNet chunk
        motif = torch.randint(3, 96, (3 + i,), generator=gen).tolist()
        out.append(Request((motif * n)[:n], SamplingConfig(max_tokens=14 + 3 * i, ignore_eos=True,
                                                          speculative=False if i == 3 else None)))
    return out


@pytest.mark.parametrize("preempt", [False, True])
def test_engine_mtp_drafts_are_the_reference_and_greedy_identical(tiny, preempt):
    ref, hf_dir, model, w = tiny
    tc = _text_config(hf_dir)
    reqs = _requests()
    want = [[t for t, _, _ in generate_ids(model, r.prompt_ids, r.sampling)] for r in reqs]
    head = load_mtp_head(model, open_model_files(hf_dir).source)
    log: list = []
    spec = SpeculativeConfig("mtp", max_draft=3, fixed=3,
                             make_drafter=lambda t, k: _Recording(head, max_draft=k, log=log))
    kv = HybridKVCache(model.config, 16 if preempt else 256, 4 if preempt else 8, 8, torch.float32)
    engine = Engine(model, kv=kv, speculative=spec,
                    config=SchedulerConfig(max_num_batched_tokens=24 if preempt else 512))
    results = engine.generate(reqs)
    assert [r.output_ids for r in results] == want
    assert results[-1].spec is None
    m = engine.metrics()
    drafted = sum(r.spec.drafted for r in results[:-1])
    assert drafted > 0 and m.draft_tokens == drafted
    if preempt:
        assert m.preemptions > 0
    assert model.__dict__.get("hidden_taps") == []  # every drafter detached at its end
    assert (m.kv.blocks_used, m.kv.state_slots_used) == (0, 0)
    # every logged proposal is the reference's chained prediction from the accepted history
    # (checked on a sample: the reference is slow)
    assert log and all(d for _, d in log)  # the drafter saw every target row it needed
    checked = [(hist, d) for hist, d in log][:: 4 if not preempt else 6]
    assert len(checked) >= 5
    for hist, drafts in checked:
        assert drafts == _chained(w, tc, ref, hist, len(drafts)), hist


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    d = tmp_path_factory.mktemp("q35_mtp_v32")
    _checkpoint(d, seed=3, vocab=32, num_hidden_layers=2, full_attention_interval=2)
    files = open_model_files(d)
    return d, build_model(files.config, files.source)


def test_sampled_distribution_matches_plain_sampling(small_vocab):
    """Sampled MTP drafts (q = the head's processed distribution), fixed k: the first 2 tokens'
    joint distribution over 300 seeds matches the exact one (chi-square, 9 cells), with
    acceptances and rejections both seen."""
    from tests.engine.test_speculative import SAMPLE, TINY_PROMPT, chi2_pvalue, exact_joint

    d, model = small_vocab
    n_tok, runs = 2, 300
    probs = exact_joint(model, TINY_PROMPT, n_tok, SamplingConfig(max_tokens=n_tok, **SAMPLE))
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5)
    head = load_mtp_head(model, open_model_files(d).source)
    stats, samples = [], []
    for s in range(runs):
        cfg = SpeculativeConfig("mtp", max_draft=2, fixed=2, make_drafter=lambda t, k: MTPDrafter(head, k))
        kv = HybridKVCache(model.config, 64, 2, 8, torch.float32)
        res = Engine(model, kv=kv, speculative=cfg).generate(
            [Request(list(TINY_PROMPT), SamplingConfig(max_tokens=n_tok + 1, seed=s, **SAMPLE))])[0]
        samples.append(tuple(res.output_ids[:n_tok]))
        stats.append(res.spec)
    pv = chi2_pvalue(samples, probs)
    assert pv > 1e-3, pv
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    assert 0 < accepted < drafted, (drafted, accepted)


# ---- bad inputs -------------------------------------------------------------------------------

def test_bad_mtp_inputs_are_typed_errors(tmp_path):
    d = tmp_path / "hf"
    _checkpoint(d, seed=1, vocab=64)
    files = open_model_files(d)
    model = build_model(files.config, files.source)
    tensors = load_file(d / "model.safetensors")

    def rewrite(change):
        t = dict(tensors)
        change(t)
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
        return open_model_files(d).source

    with pytest.raises(ModelFormatError, match="no MTP head"):
        load_mtp_head(model, rewrite(lambda t: [t.pop(k) for k in list(t) if k.startswith("mtp.")]))
    with pytest.raises(ModelFormatError, match="missing 'mtp.layers.0.self_attn.k_norm.weight'"):
        load_mtp_head(model, rewrite(lambda t: t.pop("mtp.layers.0.self_attn.k_norm.weight")))
    with pytest.raises(ModelFormatError, match=r"'fc.weight' has shape \[32, 63\]"):
        load_mtp_head(model, rewrite(lambda t: t.__setitem__("mtp.fc.weight", t["mtp.fc.weight"][:, :63].contiguous())))
    with pytest.raises(ModelFormatError, match=r"MTP layers \[0, 1\]"):
        load_mtp_head(model, rewrite(lambda t: t.__setitem__("mtp.layers.1.input_layernorm.weight",
                                                             t["mtp.norm.weight"].clone())))
    with pytest.raises(ModelFormatError, match="experts 0..3"):
        load_mtp_head(model, rewrite(lambda t: t.pop("mtp.layers.0.mlp.experts.2.up_proj.weight")))
    rewrite(lambda t: None)
    assert mtp_speculative_config(model, d).mode == "mtp"


def test_cli_mtp_needs_a_checkpoint_not_a_store():
    import click

    from services.cli import _draft_path, _speculative_config

    assert _draft_path("mtp") is None
    with pytest.raises(click.UsageError, match="--speculative mtp reads the MTP head"):
        _speculative_config("mtp", None, object(), object(), torch.float32, "cpu", None)
    with pytest.raises(click.BadParameter, match="ngram, self, mtp, draft:PATH"):
        _draft_path("mtpx")
