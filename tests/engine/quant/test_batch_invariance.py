"""Batch invariance of the default kernel path, bit for bit.

Greedy speculative decoding is only lossless if a row's numbers do not depend on what else is in
the step: a verify forward feeds k+1 rows of one sequence (and rows of other sequences) through
the same expert, where plain decoding fed one. A tolerance is not enough: one ulp can flip an
argmax. Before the kernels took one integer path for every row count, T=1 ran AVX512-VNNI dot
products and T>1 a float kernel on the dequantized activations; these tests failed there and
`bench/speculative.py` printed "same tokens: NO" for two drafters."""

import pytest
import torch

from engine.quant import kernels as K
from engine.quant.formats import QuantFormat
from engine.quant.reference import quantize

needs_cpp = pytest.mark.skipif(K.load_extension() is None, reason="native kernels not built")

ROW_COUNTS = (2, 3, 4, 5, 9, 16, 17, 33)


def _alone_vs_batched(fn, x):
    alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
    for t in ROW_COUNTS:
        assert torch.equal(fn(x[:t]), alone[:t]), f"rows differ in a batch of {t}"
        for shift in (1, 3):  # the same row at another offset of the batch
            assert torch.equal(fn(x[shift:t + shift])[0], alone[shift]), (t, shift)


@needs_cpp
@pytest.mark.parametrize("fmt", [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 32)])
def test_linear_rows_do_not_depend_on_the_batch(fmt):
    gen = torch.Generator().manual_seed(11)
    q = quantize(torch.randn(96, 256, generator=gen) * 0.05, QuantFormat(*fmt))
    x = torch.randn(40, 256, generator=gen)
    _alone_vs_batched(lambda rows: K.qlinear(rows, q), x)


@needs_cpp
def test_expert_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(12)
    f = QuantFormat("int4", 32)
    gate, up = (quantize(torch.randn(128, 256, generator=gen) * 0.05, f) for _ in range(2))
    down = quantize(torch.randn(256, 128, generator=gen) * 0.05, f)
    x = torch.randn(40, 256, generator=gen)
    _alone_vs_batched(lambda rows: K.expert_forward(rows, gate, up, down), x)
