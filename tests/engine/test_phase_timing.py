"""The native step's phase timers (engine/csrc/phases.h): off by default, and when on each
native block adds its own wall time to its own phase only."""

from __future__ import annotations

import pytest
import torch

from engine.quant.kernels import load_extension

PHASES = ["norm_qkv", "rope_kv", "attend", "o_proj", "route", "gather", "gate_up", "down", "combine", "head"]


@pytest.fixture(scope="module")
def ext():
    e = load_extension()
    if e is None:
        pytest.skip("native kernels not built on this machine")
    yield e
    e.set_phase_timing(False)
    e.phase_times(True)


def test_phases_are_timed_only_when_asked(ext):
    gen = torch.Generator().manual_seed(5)
    h, w = torch.randn(4, 256, generator=gen), torch.randn(32, 256, generator=gen)
    ext.set_phase_timing(False)
    ext.phase_times(True)
    ext.route(h, w, 4, True)
    off = ext.phase_times(True)
    assert list(off) == PHASES and all(v == 0.0 for v in off.values())

    ext.set_phase_timing(True)
    for _ in range(20):
        ext.route(h, w, 4, True)
    on = ext.phase_times(False)
    assert on["route"] > 0.0
    assert all(v == 0.0 for k, v in on.items() if k != "route")  # routing is no other phase's time
    assert ext.phase_times(True)["route"] == on["route"]  # read without reset: kept; then reset
    assert ext.phase_times()["route"] == 0.0
    ext.set_phase_timing(False)
