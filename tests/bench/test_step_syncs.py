"""bench/step_syncs.py's kernel profile (the one-graph step's device time by kernel, printed by
``bench/gpu_check.py --headline``): aggregation per token and the table, on CPU operators."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import step_syncs  # noqa: E402


def test_kernel_times_count_calls_per_token_and_sort_by_time():
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step(i):
        for _ in range(3):
            a @ b
        torch.relu(a)

    rows = step_syncs.kernel_times(step, 4, "cpu", top=50)
    by = {name: (calls, us) for name, calls, us in rows}
    assert by["aten::mm"][0] == 3.0 and by["aten::relu"][0] == 1.0  # per token, over 4 tokens
    assert [us for _, _, us in rows] == sorted((us for _, _, us in rows), reverse=True)
    assert by["aten::mm"][1] > 0
    table = step_syncs.kernel_table(rows, layers=2)
    line = next(l for l in table.splitlines() if l.startswith("| aten::mm |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "3.0" and abs(float(cells[3]) - float(cells[2]) / 2) <= 0.1  # µs per layer
