"""CUDA-only: the device expert cache in one captured CUDA graph per decode step
(torch.cuda.CUDAGraph) against the eager host cache on the same GPU: the checks of
tests/engine/test_step_graph.py (CPU seam, interpreter) with the kernels compiled, the bank in
pinned host memory read by the copy kernel through UVA, and the whole step captured. Skipped
without CUDA; bench/gpu_check.py runs this file."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from engine import cuda_graphs as CG  # noqa: E402
from tests.engine.test_step_graph import (eager_tokens, float_options, run_device, same_outputs,  # noqa: E402,F401
                                          store)


@pytest.mark.parametrize("slots,prefetch", [(12, 0), (8, 0), (12, 1)])
def test_one_captured_graph_per_step_gives_the_eager_tokens(store, monkeypatch, slots, prefetch):  # noqa: F811
    want = eager_tokens(store, "cuda")
    outputs, steps, seen, gs, counts = run_device(store, monkeypatch, prefetch=prefetch, slots=slots,
                                                  device="cuda", factory=CG.CudaGraph)
    assert same_outputs(outputs, want)
    assert len(steps) == 5 and all(syncs == 0 for syncs, _ in steps)
    assert counts["unserved"] == 0 and any(len(s) > 1 for s in seen.values())
