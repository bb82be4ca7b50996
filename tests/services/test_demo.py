"""`moestream demo` end to end, in a smaller configuration: SmolLM2 split into 4 experts (top-2,
shared expert of half the neurons), calibrated on 512 tokens, int4 store, served through the Ray
pipeline with a device budget below the store, answer streamed, figures printed; the second run
reuses the cache."""

from __future__ import annotations

import io

import pytest

from services.demo import DemoConfig, run_demo

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # whole processes end to end: `pytest -m slow`


def test_demo_builds_serves_and_reuses_its_cache(ray_cluster, tmp_path):
    cfg = DemoConfig(experts=4, top_k=2, shared_fraction=0.5, calib_tokens=512)
    out, err = io.StringIO(), io.StringIO()
    figures = run_demo("What is the capital of France?", cfg, device_budget="50%", ram_budget="75%",
                       loaders=2, max_tokens=8, root=tmp_path, progress=False, out=out, err=err)
    log = err.getvalue()
    assert "first run" in log and "pipeline up" in log
    assert figures["completion_tokens"] == 8 or "stop" in log
    assert out.getvalue().strip() == figures["text"].strip() and figures["text"]
    assert figures["hit_rate"] is not None and 0.0 <= figures["hit_rate"] <= 1.0
    assert figures["bytes_per_token"] is not None and figures["bytes_per_token"] > 0  # budget < store
    assert "expert hit rate" in log and "tok/s" in log
    # second run: nothing rebuilt, same greedy answer
    out2, err2 = io.StringIO(), io.StringIO()
    again = run_demo("What is the capital of France?", cfg, device_budget="50%", ram_budget="75%",
                     loaders=1, max_tokens=8, root=tmp_path, progress=False, out=out2, err=err2)
    assert "first run" not in err2.getvalue() and "converting" not in err2.getvalue()
    assert again["text"] == figures["text"]
