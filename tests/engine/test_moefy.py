"""moefy: a dense Llama turned into a Mixtral / Qwen2-MoE checkpoint.

Tiny random Llama (hidden 32, intermediate 64, 2 layers) with a character-level tokenizer.
Tolerances: with K = E every expert is selected and the only error is the ~1/K weight
approximation, bounded by ``max_weight_deviation`` (d). Logits are compared with
``max |diff| <= tol * max |dense logit|``: tol = 1e-5 for d = 1e-7, and 5 * d for the default
d = 1e-3 (two layers, each MLP output off by at most a factor 1 +- d).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import ConfigError, UnsupportedArchitectureError
from engine.executor import executor_for
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.loading import load_model
from engine.moefy import (
    balanced_kmeans,
    fit_moe,
    moe_model,
    moefy,
    split_sizes,
    topk_recall,
    write_checkpoint,
)
from tests.engine.models.hf_tiny import make_checkpoint

VOCAB = 128
SENTENCE = "The quick brown fox jumps over the lazy dog; def f(x): return x ** 2"


def save_char_tokenizer(path: Path) -> int:
    """A character-level tokenizer (printable ASCII + newline, ids < 100) saved with
    save_pretrained, so tiny checkpoints load with a tokenizer like real ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    vocab["\n"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    return len(vocab)


def make_dense(path: Path, **overrides):
    """Tiny random Llama + char tokenizer; returns the transformers model."""
    kw = dict(intermediate_size=64, vocab=VOCAB)
    kw.update(overrides)
    ref = make_checkpoint("llama", path, **kw)
    save_char_tokenizer(path)
    return ref


def calib_windows(n: int = 6, length: int = 48, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(4, 100, (length - 1,), generator=g).tolist() for _ in range(n)]


def our_logits(model, ids) -> torch.Tensor:
    cfg = model.config
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    return executor_for(model)(torch.tensor(ids), BatchLayout.single(0, len(ids), 0), kv, all_logits=True)


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    ref = make_dense(d)
    ids = load_model(d)[1].encode(SENTENCE)
    return d, ref, ids


@pytest.fixture(scope="module")
def fit_plain(dense):
    return fit_moe(dense[0], experts=4, shared_fraction=0.0, calib_windows=calib_windows(), progress=False)


@pytest.fixture(scope="module")
def fit_shared(dense):
    return fit_moe(dense[0], experts=4, shared_fraction=0.5, calib_windows=calib_windows(), progress=False)


# ---- K = E reproduces the dense model ---------------------------------------------------------


@pytest.mark.parametrize("which", ["plain", "shared"])
def test_k_equals_e_reproduces_dense_logits(which, dense, fit_plain, fit_shared, tmp_path):
    import transformers as T

    d, ref, ids = dense
    fit = fit_plain if which == "plain" else fit_shared
    dense_ours = our_logits(load_model(d)[0], ids)
    dense_hf = hf_logits(ref, ids)
    for dev, tol in ((1e-7, 1e-5), (1e-3, 5e-3)):
        out = tmp_path / f"moe-{dev}"
        s = write_checkpoint(fit, out, top_k=4, max_weight_deviation=dev)
        assert s.max_weight_deviation <= 1.5 * dev  # measured on calibration probe tokens
        arch = "MixtralForCausalLM" if which == "plain" else "Qwen2MoeForCausalLM"
        assert s.architecture == arch
        model, tok, cfg = load_model(out)
        assert cfg.moe.num_experts == 4 and cfg.moe.top_k == 4
        assert cfg.moe.shared_expert_intermediate_size == (32 if which == "shared" else 0)
        assert rel_err(our_logits(model, ids), dense_ours) <= tol
        hf = T.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(hf).__name__ == arch
        assert rel_err(hf_logits(hf, ids), dense_hf) <= tol


def test_k_less_than_e_matches_between_loaders_and_sums_with_weight_one(dense, fit_shared, fit_plain, tmp_path):
    """K < E: our loader and transformers agree on the written checkpoint, and each sparse layer
    computes shared(x) + sum of the selected groups' dense contributions (weight 1)."""
    import transformers as T

    d, _, ids = dense
    for name, fit in (("plain", fit_plain), ("shared", fit_shared)):
        out = tmp_path / name
        write_checkpoint(fit, out, top_k=2)
        ours = our_logits(load_model(out)[0], ids)
        hf = hf_logits(T.AutoModelForCausalLM.from_pretrained(out).eval(), ids)
        assert rel_err(ours, hf) <= 1e-4, name
        # the MLP of layer 0 on random inputs, against the weight-1 sum over the dense neurons
        model = moe_model(fit, 2)
        block = model.model.layers[0].mlp
        st = fit.dense_state
        gate, up, down = (st[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up", "down"))
        x = torch.randn(16, 32)
        h = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)  # [T, I]
        lf = fit.layers[0]
        chosen = torch.topk(x @ lf.router.T, 2, dim=-1).indices
        want = torch.zeros(16, 32)
        for t in range(16):
            neurons = list(lf.shared) + [n for g in chosen[t].tolist() for n in lf.groups[g]]
            want[t] = h[t, neurons] @ down[:, neurons].T
        with torch.inference_mode():
            got = block(x)
        assert rel_err(got, want) <= 5e-3, name


def test_one_fit_writes_any_k(fit_plain, tmp_path):
    from safetensors.torch import load_file

    a = write_checkpoint(fit_plain, tmp_path / "k1", top_k=1)
    b = write_checkpoint(fit_plain, tmp_path / "k3", top_k=3)
    ta, tb = load_file(str(tmp_path / "k1" / "model.safetensors")), load_file(str(tmp_path / "k3" / "model.safetensors"))
    assert set(ta) == set(tb)
    w2 = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    torch.testing.assert_close(tb[w2], 3 * ta[w2])
    w1 = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    assert torch.equal(ta[w1], tb[w1])
    assert a.router_recall != b.router_recall or a.top_k != b.top_k
    for k in (0, 5):
        with pytest.raises(ConfigError, match="top_k"):
            write_checkpoint(fit_plain, tmp_path / f"bad{k}", top_k=k)


# ---- metadata ---------------------------------------------------------------------------------


def test_moefy_from_text_records_metadata(dense, tmp_path):
    d, _, _ = dense
    out = tmp_path / "moe"
    s = moefy(d, out, experts=4, top_k=2, shared_fraction=0.5, calib_tokens=512, seed=3,
              progress=False, window=64)
    cfg = json.loads((out / "config.json").read_text())
    meta = cfg["moestream_moefy"]
    assert meta["calibration"]["source"] == "pydoc_data.topics.topics"
    assert meta["calibration"]["split"] == "calibration"
    assert meta["calibration"]["tokens"] == 512 and meta["calibration"]["windows"] == 8
    assert len(meta["calibration"]["sha256"]) == 64
    assert meta["seed"] == 3 and meta["experts"] == 4 and meta["top_k"] == 2
    assert meta["shared_intermediate_size"] == 32 and meta["expert_intermediate_size"] == 8
    rec = meta["router_recall"]["per_layer"]
    # the fitted router beats a random one (top-2 of 4: recall 0.5); measured 0.84 and 0.77
    assert len(rec) == 2 and all(0.65 <= r <= 1.0 for r in rec)
    by_k = meta["router_recall_by_k"]
    assert len(by_k) == 4 and by_k[-1] == 1.0  # K = E: every expert is in both sets
    assert by_k[1] == pytest.approx(sum(rec) / 2) == meta["router_recall"]["mean"]
    assert cfg["qkv_bias"] is False and cfg["norm_topk_prob"] is True
    assert cfg["num_experts_per_tok"] == 2 and cfg["moe_intermediate_size"] == 8
    detail = json.loads((out / "moefy.json").read_text())
    assert detail["seed"] == 3 and len(detail["layers"]) == 2
    for layer in range(2):
        neurons = sorted(detail["shared"][layer] + [n for g in detail["groups"][layer] for n in g])
        assert neurons == list(range(64))  # a partition of the dense MLP's neurons
        assert all(len(g) == 8 for g in detail["groups"][layer])
        f = detail["layers"][layer]
        assert f["router_scale"] > 0 and f["weight_deviation_max"] <= 2e-3
    assert s.calib_tokens == 512 and (out / "tokenizer.json").is_file()
    # the tokenizer travelled: the MoE tokenizes like the dense model
    assert load_model(out)[1].encode(SENTENCE) == load_model(d)[1].encode(SENTENCE)


def test_deterministic_by_seed(dense):
    d = dense[0]
    a = fit_moe(d, experts=4, shared_fraction=0.0, calib_windows=calib_windows(), seed=5, progress=False)
    b = fit_moe(d, experts=4, shared_fraction=0.0, calib_windows=calib_windows(), seed=5, progress=False)
    for la, lb in zip(a.layers, b.layers):
        assert np.array_equal(la.groups, lb.groups)
        assert torch.equal(la.router, lb.router)


# ---- errors and building blocks ---------------------------------------------------------------


def test_sizes_must_divide():
    assert split_sizes(1536, 16, 0.5) == (768, 48)
    assert split_sizes(1536, 16, 0.0) == (0, 96)
    with pytest.raises(ConfigError, match=r"1075 routed neurons, not divisible into 16") as e:
        split_sizes(1536, 16, 0.3)
    assert "25" in str(e.value)  # names expert counts that would divide
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ConfigError, match="shared_fraction"):
            split_sizes(1536, 16, bad)
    with pytest.raises(ConfigError, match="experts"):
        split_sizes(1536, 0, 0.5)


def test_bad_sources(dense, tmp_path):
    with pytest.raises(ConfigError, match="not divisible"):
        fit_moe(dense[0], experts=5, shared_fraction=0.0, calib_windows=calib_windows(), progress=False)
    moe_dir = tmp_path / "mixtral"
    make_checkpoint("mixtral", moe_dir)
    with pytest.raises(UnsupportedArchitectureError, match="dense Llama"):
        fit_moe(moe_dir, experts=4, calib_windows=calib_windows(), progress=False)


def test_balanced_kmeans_equal_sizes_and_recovers_clusters():
    g = torch.Generator().manual_seed(0)
    centers = torch.rand(4, 200, generator=g) ** 8
    rows = torch.cat([centers[i] + 0.01 * torch.rand(10, 200, generator=g) for i in range(4)])
    perm = torch.randperm(40, generator=g)
    labels = balanced_kmeans(rows[perm], 4, seed=1)
    assert np.bincount(labels, minlength=4).tolist() == [10, 10, 10, 10]
    truth = (perm // 10).numpy()
    for c in range(4):  # every recovered cluster is one true cluster
        assert len(set(truth[labels == c])) == 1
    assert np.array_equal(labels, balanced_kmeans(rows[perm], 4, seed=1))


def test_topk_recall():
    pred = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    target = torch.tensor([[3.0, 1.0, 2.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    r = topk_recall(pred, target)
    # K=1: token 0 hit, token 1 miss; K=2: {0,1} vs {0,2} -> 1/2, {3,2} vs {0,1} -> 0;
    # K=3: {0,1,2} vs {0,2,1} -> 1, {3,2,1} vs {0,1,2} -> 2/3
    assert r == pytest.approx([0.5, 0.25, (1 + 2 / 3) / 2, 1.0])
