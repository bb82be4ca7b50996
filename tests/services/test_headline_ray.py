"""bench/headline.py --ray at the tiny shape, on the session's Ray cluster: the same trace
through the Ray expert loaders as in process gives the same device hits and bytes, every figure
printed, and nothing left behind (the loaders' segments, the temporary store)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import headline  # noqa: E402


def test_headline_through_the_ray_loaders(ray_cluster, tmp_path, capsys):
    from services.shm import segments

    before = set(segments())
    d, out = tmp_path / "store", tmp_path / "ray.json"
    assert headline.main(["--shape", "tiny", "--device", "cpu", "--ray", "--loaders", "2", "--disk", str(d),
                          "--predict-tokens", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Ray: 2 loader actors filled with every expert" in text and "| Ray loaders x2" in text
    f = json.loads(out.read_text())
    main, disk, ray_ = f["variants"]
    assert ray_["label"].startswith("Ray loaders")
    assert ray_["hit_rate"] == main["hit_rate"] and ray_["to_device_per_token"] == main["to_device_per_token"] > 0
    assert ray_["disk_per_token"] == 0  # the loaders were filled: the measured run is RAM-resident
    assert ray_["tok_s"] > 0 and ray_["copy_gbs"] > 0 and 0 <= ray_["stall_fraction"] < 1
    assert disk["disk_per_token"] > 0
    assert set(segments()) <= before  # the loaders unlinked their segments
    assert not d.exists()
