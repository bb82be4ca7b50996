"""The greedy fast path (sampler.greedy_token) against the distribution it shortcuts."""

from __future__ import annotations

import pytest
import torch

from engine.layers.sampler import SamplerState, SamplingConfig, distribution, sample


@pytest.mark.parametrize("penalties", [{}, {"repetition_penalty": 1.3},
                                       {"presence_penalty": 0.8, "frequency_penalty": 0.5}])
def test_greedy_is_the_argmax_of_the_distribution(penalties):
    gen = torch.Generator().manual_seed(7)
    for trial in range(40):
        logits = torch.randn(1000, generator=gen) * 2
        top = torch.argsort(logits, descending=True)
        if trial % 4 == 0:  # a tie at the top: the first index wins in both
            logits[top[1]] = logits[top[0]]
        st = SamplerState(SamplingConfig(temperature=0.0, **penalties))
        st.prompt_tokens = {int(top[0])} if trial % 2 else set()  # penalties that move the argmax
        st.counts = {int(top[1]): 2} if trial % 3 else {}
        want = int(torch.argmax(distribution(logits, st)))
        before = logits.clone()
        assert sample(logits, st) == want
        assert torch.equal(logits, before)  # the caller's logits are never penalised in place


def test_greedy_penalty_changes_the_token():
    logits = torch.tensor([0.0, 2.0, 1.9, -1.0])
    st = SamplerState(SamplingConfig(temperature=0.0, repetition_penalty=2.0))
    assert sample(logits, st) == 1
    st.prompt_tokens = {1}
    assert sample(logits, st) == 2


def test_greedy_on_a_strided_and_bf16_row():
    rows = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    st = SamplerState(SamplingConfig(temperature=0.0))
    col = rows.t()[7]  # not contiguous
    assert not col.is_contiguous() and sample(col, st) == int(torch.argmax(col))
    assert sample(rows[1].bfloat16(), st) == int(torch.argmax(rows[1].bfloat16().float()))
