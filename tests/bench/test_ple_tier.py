"""bench/ple_tier.py: a >= 2 GiB PLE table read token by token from disk, host RSS far below it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("ple_tier_bench", ROOT / "bench" / "ple_tier.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_small_table_figures(tmp_path, capsys):
    """The figures are consistent on a small table (fast; the RSS claim is the slow test's)."""
    assert _bench().main(["--table-gib", "0.01", "--tokens", "200", "--heads", "4", "--layers", "2",
                          "--budget", "256KiB", "--dir", str(tmp_path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["tokens"] == 200 and r["ple_lookups"] <= 200 * 2 * 4
    assert r["ple_rows_read"] + r["ple_cache_hits"] == r["ple_lookups"]
    assert r["ple_bytes_read"] == r["ple_pages_read"] * 4096
    assert 0 < r["ple_hit_rate"] < 1
    assert not (tmp_path / "ple.rows").exists()  # removed after the run


@pytest.mark.slow
def test_rss_below_a_tenth_of_a_2gib_table(tmp_path, capsys):
    """Reads 3,000 tokens' rows from a 2 GiB table under a 64 MiB row cache: the reading process
    grows by far less than table / 10 (its absolute RSS is torch's ~230 MiB plus that)."""
    assert _bench().main(["--table-gib", "2", "--tokens", "3000", "--budget", "64MiB",
                          "--dir", str(tmp_path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["table_bytes"] >= 2 * 2**30
    grown = (r["rss_peak_kib"] - r["rss_before_kib"]) * 1024
    assert grown < r["table_bytes"] / 10, r
    assert r["ple_rows_read"] > 3000  # really read from disk, not one cached page
