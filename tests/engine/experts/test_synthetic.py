"""Synthetic routing traces: determinism, skew, locality, per-layer popularity."""

from __future__ import annotations

import numpy as np
import pytest

from engine.experts.synthetic import cyclic_trace, synthetic_trace
from engine.experts.trace import expert_counts, reuse_fraction, top_share, usage_entropy


def test_shape_and_execution_order():
    tr = synthetic_trace(5, 3, 16, 4, zipf=1.0, locality=0.5, seed=0)
    assert (tr.num_layers, tr.num_experts, tr.top_k, len(tr), tr.num_tokens) == (3, 16, 4, 15, 5)
    assert tr.token_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert tr.layer.tolist() == [0, 1, 2] * 5
    # experts distinct within each record
    assert all(len(set(row)) == 4 for row in tr.experts.tolist())


def test_deterministic_given_seed():
    a = synthetic_trace(50, 4, 32, 4, zipf=0.8, locality=0.4, seed=7)
    b = synthetic_trace(50, 4, 32, 4, zipf=0.8, locality=0.4, seed=7)
    c = synthetic_trace(50, 4, 32, 4, zipf=0.8, locality=0.4, seed=8)
    assert a == b
    assert not np.array_equal(a.experts, c.experts)


def test_uniform_without_skew_or_locality():
    tr = synthetic_trace(2000, 4, 64, 8, zipf=0.0, locality=0.0, seed=0)
    ent = usage_entropy(tr)
    assert ent.shape == (4,)
    assert ent.min() > 0.97
    np.testing.assert_allclose(top_share(tr, 0.1), 7 / 64, atol=0.02)  # ceil(6.4) = 7 experts


def test_higher_zipf_lowers_entropy():
    ents = [
        usage_entropy(synthetic_trace(1000, 2, 64, 8, zipf=z, locality=0.0, seed=1)).mean()
        for z in (0.0, 0.5, 1.0, 1.5, 2.0)
    ]
    assert ents == sorted(ents, reverse=True)
    assert ents[0] - ents[-1] > 0.2
    shares = [top_share(synthetic_trace(1000, 2, 64, 8, zipf=z, seed=1)).mean() for z in (0.0, 1.0, 2.0)]
    assert shares == sorted(shares)


def test_top1_frequencies_follow_zipf_weights():
    E = 16
    tr = synthetic_trace(20000, 1, E, 1, zipf=1.0, locality=0.0, seed=2)
    freq = np.sort(expert_counts(tr)[0])[::-1] / 20000
    w = 1.0 / np.arange(1, E + 1)
    np.testing.assert_allclose(freq, w / w.sum(), atol=0.01)


def test_locality_gives_reuse():
    hi = reuse_fraction(synthetic_trace(400, 4, 64, 8, zipf=0.0, locality=0.9, seed=3))
    lo = reuse_fraction(synthetic_trace(400, 4, 64, 8, zipf=0.0, locality=0.0, seed=3))
    assert hi > 0.9  # 0.9 kept + chance re-picks of the rest
    assert lo < 0.2  # chance only: about top_k / num_experts
    assert reuse_fraction(synthetic_trace(50, 2, 16, 4, zipf=1.0, locality=1.0, seed=0)) == 1.0


def test_hot_experts_differ_per_layer():
    tr = synthetic_trace(500, 8, 64, 4, zipf=1.5, locality=0.0, seed=4)
    hottest = expert_counts(tr).argmax(axis=1)
    assert len(set(hottest.tolist())) >= 6


def test_per_layer_zipf():
    tr = synthetic_trace(1000, 2, 64, 8, zipf=[0.0, 2.0], locality=0.0, seed=5)
    ent = usage_entropy(tr)
    assert ent[0] > 0.97 and ent[1] < 0.8


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_layers=3"):
        synthetic_trace(10, 3, 8, 2, zipf=[1.0, 1.0])
    with pytest.raises(ValueError, match="top_k=9 exceeds"):
        synthetic_trace(10, 1, 8, 9)
    with pytest.raises(ValueError, match="locality"):
        synthetic_trace(10, 1, 8, 2, locality=1.5)
    with pytest.raises(ValueError, match="zipf"):
        synthetic_trace(10, 1, 8, 2, zipf=-1.0)


def test_full_topk_and_cyclic():
    tr = synthetic_trace(3, 1, 4, 4, zipf=1.0, locality=0.5, seed=0)
    assert all(sorted(r) == [0, 1, 2, 3] for r in tr.experts.tolist())
    cyc = cyclic_trace(2, 2, 8, 3)
    assert list(cyc.accesses())[:6] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
