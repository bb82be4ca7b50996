"""bench/headline.py on the CPU: the small shape runs and prints every figure (its speed is the
bench's to report, not a timed test's); the plan alone (--dry-run) gives the full shape's
predictions; the VRAM cap is enforced with a typed error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import headline  # noqa: E402


def test_small_shape_runs_on_cpu_and_prints_every_figure(tmp_path, capsys):
    out = tmp_path / "small.json"
    assert headline.main(["--shape", "small", "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for figure in ("decode tok/s", "device expert hit rate", "expert bytes per token from RAM",
                   "expert bytes per token from disk", "host-to-device GB/s", "stall fraction",
                   "native calls per token", "dense / KV / state / expert slots", "cost model for this run",
                   "PREDICTION for the full shape", "RTX 4090 + PCIe 4.0 x16"):
        assert figure in text, figure
    f = json.loads(out.read_text())
    assert f["decode_tps"] > 0 and 0 < f["hit_rate"] < 1
    assert abs(f["hit_rate"] - f["sim_hit_rate"]) < 0.02  # the live cache replays like the simulator
    assert f["ram_bytes_per_token"] > 0 and f["disk_bytes_per_token"] == 0
    assert f["calls_per_token"] >= 2 * 8  # the native step: a few calls per layer
    assert f["peak"] <= f["budget"]
    assert {p["target"] for p in f["predictions"]} >= {"RTX 4090 + PCIe 4.0 x16", "H200, 24 GiB cap"}


def test_dry_run_plans_the_full_shape(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert headline.main(["--shape", "full", "--dry-run", "--layers", "4", "--device", "cpu",
                          "--predict-tokens", "24", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "reduced-layer run of the full shape, scaled per layer" in text
    f = json.loads(out.read_text())
    assert f["scaled_from"] == 48 and f["slots"] > 0
    preds = {p["target"]: p["tok_s"] for p in f["predictions"]}
    # the step as built (3.2 ms a layer) vs one launch a layer: the overhead dominates
    assert preds["RTX 4090 + PCIe 4.0 x16, one launch/layer"] > 3 * preds["RTX 4090 + PCIe 4.0 x16"]


def test_vram_budget_is_enforced(capsys):
    assert headline.main(["--shape", "small", "--device", "cpu", "--vram-budget", "40MiB"]) == 2
    err = capsys.readouterr().err
    assert "DeviceBudgetError" in err and "fewer than top_k" in err


def test_host_ram_check_names_the_fix(monkeypatch, capsys):
    monkeypatch.setattr(headline, "host_available", lambda: 1 << 20)
    assert headline.main(["--shape", "small", "--dry-run"]) == 2
    assert "--layers" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--layers", "0"], ["--vram-budget", "lots"]])
def test_bad_arguments_are_typed_errors(bad, capsys):
    assert headline.main(["--shape", "small", "--dry-run", *bad]) == 2
    assert "error:" in capsys.readouterr().err


def test_disk_run_reads_misses_from_a_store_it_removes(tmp_path, capsys):
    d, out = tmp_path / "store", tmp_path / "disk.json"
    assert headline.main(["--shape", "tiny", "--device", "cpu", "--disk", str(d), "--ram-tier", "0.25",
                          "--predict-tokens", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "EXPERT SOURCES" in text and "disk run:" in text
    f = json.loads(out.read_text())
    main, disk = f["variants"]
    assert disk["label"].startswith("disk (RAM tier: 25%")
    # same trace, slots and policy: the same device hits; a RAM tier of a quarter of the
    # experts sends some of the misses to the store, at a measured rate
    assert disk["hit_rate"] == main["hit_rate"] and disk["to_device_per_token"] == main["to_device_per_token"]
    assert 0 < disk["disk_per_token"] <= disk["to_device_per_token"] and disk["disk_gbs"] > 0
    assert main["disk_per_token"] == 0 and f["disk_bytes_per_token"] == 0
    assert not d.exists()  # written, used, removed


def test_disk_run_refuses_a_directory_not_its_own(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert headline.main(["--shape", "tiny", "--device", "cpu", "--disk", str(tmp_path), "--predict-tokens", "8"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
