"""Budgets ``auto``: free device memory after dense weights, KV and state; host RAM less a stated
headroom; capped at every expert; printed; a clear error when nothing is left. Then the CLI's
default on a real store."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from engine.errors import DeviceBudgetError
from engine.experts.device_budget import GiB, resolve_budgets

MiB = 2**20


def auto_budgets(*args, **kw):
    b = resolve_budgets(*args, **kw)
    return b.device, b.ram, b.line


def test_gpu_budget_is_free_memory_after_resident_and_workspace():
    d, r, line = auto_budgets(200 * GiB, device="cuda", resident=6 * GiB, headroom=4 * GiB, workspace=GiB // 2,
                              device_free=23 * GiB, host_available=120 * GiB)
    assert d == 23 * GiB - 6 * GiB - GiB // 2
    assert r == 116 * GiB
    assert "budgets auto" in line and "headroom" in line and "16.50 GiB" in line


def test_budgets_are_capped_at_every_expert():
    d, r, _ = auto_budgets(2 * GiB, device="cuda", resident=GiB, device_free=80 * GiB, host_available=64 * GiB)
    assert (d, r) == (2 * GiB, 2 * GiB)


def test_cpu_gives_the_device_slots_first_then_the_ram_tier():
    # 10 GiB available, 4 headroom, 1 resident: 5 GiB usable host memory for both tiers; the
    # slots experts are computed from come first (a RAM-tier copy of one is a second copy)
    d, r, _ = auto_budgets(3 * GiB, device="cpu", resident=GiB, headroom=4 * GiB, host_available=10 * GiB)
    assert (d, r) == (3 * GiB, 2 * GiB)
    # less than every expert: the RAM tier keeps the staging bytes for reads in flight
    d, r, _ = auto_budgets(8 * GiB, device="cpu", resident=GiB, headroom=4 * GiB, host_available=10 * GiB,
                           staging=GiB // 4)
    assert (d, r) == (5 * GiB - GiB // 4, GiB // 4)
    d, r, _ = auto_budgets(3 * GiB, device="cpu", resident=GiB, headroom=4 * GiB, host_available=20 * GiB)
    assert (r, d) == (3 * GiB, 3 * GiB)


@pytest.mark.parametrize("device,free,avail,fix", [
    ("cuda", 5 * GiB, 64 * GiB, "--device-budget and --ram-budget"),
    ("cuda", 80 * GiB, 3 * GiB, "--device-budget and --ram-budget"),
    ("cpu", None, 6 * GiB, "needs at least 9.00 GiB"),  # the dense part alone does not fit: HostMemoryError
    ("cpu", None, 9 * GiB + 2**20, "--device-budget and --ram-budget")])
def test_no_memory_left_is_a_typed_error_naming_the_fix(device, free, avail, fix):
    with pytest.raises(DeviceBudgetError, match=fix):
        auto_budgets(10 * GiB, device=device, resident=5 * GiB, headroom=4 * GiB, device_free=free,
                     host_available=avail)


def test_generate_from_a_store_defaults_to_auto_and_prints_it(tmp_path):
    from services.cli import main
    from tests.engine.models.hf_tiny import add_mixtral_tokenizer, make_checkpoint

    hf, store = tmp_path / "hf", tmp_path / "store"
    make_checkpoint("mixtral", hf, vocab=32000, hidden_size=64, intermediate_size=64, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2)
    add_mixtral_tokenizer(hf)
    run = CliRunner().invoke
    assert run(main, ["convert", str(hf), "--out", str(store), "--quant", "bf16", "--no-progress"]).exit_code == 0
    r = run(main, ["generate", "--store", str(store), "--max-tokens", "4", "Hello"])
    assert r.exit_code == 0, r.output
    assert "budgets auto: device" in r.stderr and "headroom 4.00 GiB" in r.stderr
    assert "100% of the experts" in r.stderr  # a tiny store fits this machine whole
