"""Qwen3-Next against transformers' Qwen3NextForCausalLM on tiny random checkpoints: logits within
fp32 tolerance over a prompt longer than two DeltaNet chunks, 32 greedy tokens identical; the
chunked and recurrent delta rule against each other; partial RoPE; the config of the layers."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.configio.hf import config_from_hf_dict
from engine.configio.plain import config_from_dict
from engine.generate import generate_ids
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.kv.state import RecurrentStateError
from engine.layers.deltanet import causal_conv, chunked_delta_rule, recurrent_delta_rule
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model
from tests.engine.models.qwen3_next_tiny import make_qwen3_next

CASES = [
    {},  # full attention every 4th layer, 2 value heads per key head, top-2 of 4, shared expert
    dict(full_attention_interval=2, linear_num_value_heads=2, num_key_value_heads=1,
         num_experts_per_tok=1, shared_expert_intermediate_size=0),
    dict(num_hidden_layers=3, full_attention_interval=3, linear_num_key_heads=1, linear_num_value_heads=4,
         linear_key_head_dim=16, num_experts=8, num_experts_per_tok=4, mlp_only_layers=[0],
         partial_rotary_factor=0.5, norm_topk_prob=False),
    dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
         decoder_sparse_step=2, linear_conv_kernel_dim=3),
]


def _kv(cfg: ModelConfig) -> ContiguousKVCache:
    return ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


@pytest.mark.parametrize("overrides", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_logits_and_greedy_tokens_match_transformers(tmp_path, overrides):
    ref = make_qwen3_next(tmp_path, seed=len(overrides), **overrides)
    files = open_model_files(tmp_path)
    cfg = files.config
    assert cfg.arch == "qwen3_next"
    assert [cfg.is_linear_attention_layer(i) for i in range(cfg.num_layers)] == [
        t == "linear_attention" for t in ref.config.layer_types]
    ours = build_model(cfg, files.source)
    prompt = torch.randint(3, ref.config.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    check_against_transformers(ref, ours, prompt, atol=2e-5)


def check_against_transformers(ref, ours, prompt: torch.Tensor, atol: float) -> None:
    """Logits of every prompt position within ``atol`` (rtol 1e-4) of transformers' ``ref``,
    then 32 greedy tokens identical to its generate (end of sequence ignored)."""
    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    got = ours(prompt, BatchLayout.single(0, len(prompt), 0), _kv(ours.config), all_logits=True)
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)

    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        hf = ref.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=32, do_sample=False)[0, len(prompt):]
    assert len(hf) == 32
    mine = [t for t, _, _ in generate_ids(ours, prompt.tolist(), SamplingConfig(max_tokens=32, ignore_eos=True))]
    assert mine == hf.tolist()


def test_chunked_prefill_and_batches_equal_one_forward(tmp_path):
    """Prefill in pieces (carrying conv window and delta state across them), one token at a time,
    and three sequences in one batch all give the logits of one full forward."""
    make_qwen3_next(tmp_path)
    files = open_model_files(tmp_path)
    model, cfg = build_model(files.config, files.source), files.config
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (90,), generator=g)
    full = model(tokens, BatchLayout.single(0, 90, 0), _kv(cfg), all_logits=True)
    kv = _kv(cfg)
    parts = []
    for start, n in ((0, 2), (2, 1), (3, 70), (73, 1), (74, 16)):
        parts.append(model(tokens[start:start + n], BatchLayout.single(0, n, start), kv, all_logits=True))
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)

    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 70, 1)]
    alone = [model(s, BatchLayout.single(0, len(s), 0), _kv(cfg))[0] for s in seqs]
    layout = BatchLayout((10, 11, 12), tuple(len(s) for s in seqs), (0, 0, 0))
    torch.testing.assert_close(model(torch.cat(seqs), layout, _kv(cfg)), torch.stack(alone),
                               atol=1e-5, rtol=1e-5)


def test_forward_from_a_position_the_state_does_not_hold_is_refused(tmp_path):
    make_qwen3_next(tmp_path)
    files = open_model_files(tmp_path)
    model, cfg = build_model(files.config, files.source), files.config
    kv = _kv(cfg)
    model(torch.arange(3, 13), BatchLayout.single(0, 10, 0), kv)
    with pytest.raises(RecurrentStateError, match="stands at position 10"):
        model(torch.tensor([5]), BatchLayout.single(0, 1, 8), kv)  # a rollback without restore
    with pytest.raises(RecurrentStateError, match="does not exist"):
        model(torch.tensor([5]), BatchLayout.single(7, 1, 4), kv)


@pytest.mark.parametrize("n", [1, 7, 64, 65, 150])
def test_chunked_delta_rule_equals_recurrent(n):
    g = torch.Generator().manual_seed(n)
    h, dk, dv = 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=g), dim=-1)
    v = torch.randn(n, h, dv, generator=g)
    decay = -torch.rand(n, h, generator=g) * 2  # log decays <= 0, some strong
    beta = torch.rand(n, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    s_rec, s_chunk = s0.clone(), s0.clone()
    o_rec = recurrent_delta_rule(q, k, v, decay, beta, s_rec)
    o_chunk = chunked_delta_rule(q, k, v, decay, beta, s_chunk)
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s_chunk, s_rec, atol=1e-5, rtol=1e-4)
    # and the recurrence by its definition, one outer product at a time, for one head
    s = s0[0].clone()
    for t in range(n):
        s = s * decay[t, 0].exp()
        s = s + beta[t, 0] * torch.outer(k[t, 0], v[t, 0] - s.t() @ k[t, 0])
        torch.testing.assert_close(o_rec[t, 0], s.t() @ q[t, 0], atol=1e-5, rtol=1e-4)


def test_causal_conv_window_carries_across_calls():
    g = torch.Generator().manual_seed(0)
    c, kk, n = 6, 4, 11
    x, w = torch.randn(n, c, generator=g), torch.randn(c, kk, generator=g)
    want = torch.nn.functional.silu(torch.nn.functional.conv1d(
        x.t()[None], w[:, None, :], padding=kk - 1, groups=c)[0, :, :n]).t()
    window = torch.zeros(c, kk - 1)
    got = torch.cat([causal_conv(x[a:b], window, w) for a, b in ((0, 2), (2, 3), (3, 11))])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(window, x[-(kk - 1):].t())


def test_config_of_the_published_shape():
    raw = {"architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "num_attention_heads": 16,
           "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 48, "vocab_size": 151936,
           "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
           "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "full_attention_interval": 4,
           "partial_rotary_factor": 0.25, "rope_theta": 10000000, "intermediate_size": 5120}
    cfg = config_from_hf_dict(raw)
    assert cfg.attention_layers == tuple(range(3, 48, 4))
    assert cfg.rotary_dim == 64 and cfg.linear_attn.num_value_heads == 32
    assert cfg.moe.shared_expert_gate and cfg.moe.top_k == 10
    assert config_from_dict(cfg.to_dict()) == cfg  # the store manifest's round trip


def test_parameter_counts_equal_the_reference_model(tmp_path):
    ref = make_qwen3_next(tmp_path, num_hidden_layers=3, full_attention_interval=3, mlp_only_layers=[1])
    cfg = open_model_files(tmp_path).config
    assert cfg.parameter_counts()["total"] == sum(p.numel() for p in ref.parameters())


def test_info_on_the_published_80b_a3b_config(tmp_path):
    """transformers' Qwen3NextConfig defaults are the 80B-A3B: 48 layers, hidden 2048, 512
    experts of width 512 top-10 + shared 512, 16/2 heads of 256, DeltaNet 16 k / 32 v heads of 128."""
    import json

    import transformers as T
    from click.testing import CliRunner

    from services.cli import main

    raw = T.Qwen3NextConfig().to_dict()
    raw["architectures"] = ["Qwen3NextForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = config_from_hf_dict(raw)
    counts = cfg.parameter_counts()
    assert 79e9 < counts["total"] < 81e9 and 3e9 < counts["active"] < 4e9
    r = CliRunner().invoke(main, ["info", str(tmp_path / "config.json")])
    assert r.exit_code == 0, r.output
    print(r.output)
    assert "total 79.67G, active per token 3.56G" in r.output
    # 36 DeltaNet layers x (conv 8192 ch x 3 + 32 heads x 128 x 128) x 4 bytes
    assert f"state         {36 * (8192 * 3 + 32 * 128 * 128) * 4 / 1e6:.2f}MB per sequence" in r.output
    assert "36 Gated DeltaNet" in r.output and "12 gated attention" in r.output


@pytest.mark.parametrize("nk,nv,dk,dv,kernel", [(2, 4, 8, 8, 4), (1, 1, 16, 8, 3), (4, 8, 32, 16, 4)])
def test_native_decode_step_equals_the_torch_reference(nk, nv, dk, dv, kernel):
    from engine.layers import deltanet_native
    from engine.layers.deltanet import l2norm

    if deltanet_native.extension() is None:
        pytest.skip("no C++ compiler here: the torch reference runs")
    g = torch.Generator().manual_seed(nk * 100 + dk)
    c = 2 * nk * dk + nv * dv
    window, weight = torch.randn(c, kernel - 1, generator=g), torch.randn(c, kernel, generator=g)
    state = torch.randn(nv, dk, dv, generator=g)
    decay, beta = -torch.rand(nv, generator=g) * 3, torch.rand(nv, generator=g)
    w_ref, s_ref, w_nat, s_nat = window.clone(), state.clone(), window.clone(), state.clone()
    for step in range(3):  # three tokens: the window really rolls
        x = torch.randn(c, generator=g)
        y = causal_conv(x[None], w_ref, weight)[0]
        q, k, v = y.split([nk * dk, nk * dk, nv * dv])
        r = nv // nk
        q = l2norm(q.view(1, nk, dk)).repeat_interleave(r, 1) * dk ** -0.5
        k = l2norm(k.view(1, nk, dk)).repeat_interleave(r, 1)
        want = recurrent_delta_rule(q, k, v.view(1, nv, dv), decay[None], beta[None], s_ref)[0]
        got = deltanet_native.decode_step(w_nat, weight, x, s_nat, decay, beta, nk, dk, dv)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s_nat, s_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w_nat, w_ref, atol=0, rtol=0)


def test_model_decode_native_and_reference_agree(tmp_path):
    from engine.options import configure, options

    make_qwen3_next(tmp_path)
    files = open_model_files(tmp_path)
    model, cfg = build_model(files.config, files.source), files.config
    prompt = torch.randint(3, 96, (20,), generator=torch.Generator().manual_seed(8)).tolist()
    sampling = SamplingConfig(max_tokens=16, ignore_eos=True)
    before = options().fused_step
    runs = []
    try:
        for flag in (True, False):
            configure(fused_step=flag)
            runs.append([(t, lg) for t, lg, _ in generate_ids(model, prompt, sampling)])
    finally:
        configure(fused_step=before)
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    torch.testing.assert_close(torch.stack([lg for _, lg in runs[0]]), torch.stack([lg for _, lg in runs[1]]),
                               atol=1e-5, rtol=1e-5)
