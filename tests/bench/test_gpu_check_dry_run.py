"""``python bench/gpu_check.py --headline --dry-run`` on a machine without a GPU: exits 0, lists
the figures a GPU run measures, and prints the host synchronisations per decoded token of the
per-layer path and of one graph per step on the demo trace (the latter 0)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the no-GPU path")
def test_headline_dry_run_counts_syncs_without_a_gpu():
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--headline", "--dry-run", "--dry-run-tokens", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for figure in ("host synchronisations", "graph launches", "per-layer overhead", "decode tok/s"):
        assert figure in out
    m = re.search(r"per-layer path ([\d.]+), one graph per step ([\d.]+) \(every miss in the RAM tier: ([\d.]+)", out)
    assert m, out[-2000:]
    per_layer, one_graph, misses = map(float, m.groups())
    assert per_layer >= 30  # at least the routed ids of each of the 30 sparse layers
    assert one_graph == 0 and misses > 0
