"""Budgets ``auto`` of ``moestream serve`` (issue 15 item 5): the deployer resolves the RAM tier
(and on a CPU decode node both tiers, from one reading of its memory), the decode actor a GPU's
slots after the dense weights and the deployment's KV budget; given budgets stay as they are; a
budget that cannot be met is a typed error before any actor is left running. Unit tests inject
the memory figures; one deployment with the defaults on the tiny store reports them in status."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from engine.errors import ConfigError, DeviceBudgetError
from engine.experts.device_budget import DEVICE_WORKSPACE, HOST_HEADROOM, GiB
from tests.services.conftest import DENSE

MiB = 2**20


@pytest.fixture(scope="module")
def figures(store_path):
    """(every expert's bytes, the resident bytes auto counts: dense weights + the KV budget)."""
    import torch

    from engine.experts.runtime import dense_resident_bytes, store_expert_bytes
    from engine.store.reader import ExpertStore

    with ExpertStore(store_path) as store:
        dense = dense_resident_bytes(store, dense=DENSE, dtype=torch.float32)
    return store_expert_bytes(store_path), dense + 4 * MiB


def _config(store_path, **kw):
    from services.config import DeployConfig

    return DeployConfig(store=store_path, **{"kv_budget": "4MiB", "dense_format": DENSE, **kw})


def test_config_budgets_default_to_auto_and_keep_bytes(store_path):
    from services.config import DeployConfig

    cfg = DeployConfig(store=store_path)
    assert (cfg.device_budget, cfg.ram_budget) == ("auto", "auto")
    cfg = DeployConfig(store=store_path, device_budget="AUTO", ram_budget="8MiB")
    assert (cfg.device_budget, cfg.ram_budget) == ("auto", 8 * MiB)
    assert DeployConfig(store=store_path, device_budget=None).device_budget is None  # every expert
    assert DeployConfig.model_validate_json(cfg.model_dump_json()) == cfg
    with pytest.raises(ConfigError, match="resolved by the deployer"):
        DeployConfig(store=store_path).loader_ram_budget(4096, 10)


def test_serve_takes_a_share_of_the_experts_as_bytes(store_path, figures):
    from services.cli_serve import share_of_experts

    total, _ = figures
    assert share_of_experts(store_path, "50%", "--device-budget") == total // 2
    assert [share_of_experts(store_path, t, "--ram-budget") for t in ("auto", "8MiB", None)] == ["auto", "8MiB", None]
    with pytest.raises(ConfigError, match="--ram-budget"):
        share_of_experts(store_path, "x%", "--ram-budget")


def test_dense_resident_bytes_match_the_model_as_built(store_path):
    """The estimate from tensor headers is the bytes of the dense model load_from_store builds
    (linears in the dense or head format, norms and routers in fp32, the embedding in fp32 unless
    it stays the store's file pages: engine.layers.embedding)."""
    import torch

    from engine.experts.runtime import dense_resident_bytes, load_from_store
    from engine.layers.embedding import StoredEmbedding
    from engine.quant.linear import QuantLinear
    from engine.store.reader import ExpertStore

    with ExpertStore(store_path) as store:
        for dense, head in (("bf16", None), ("int8", "int4"), ("fp32", None)):
            est = dense_resident_bytes(store, dense=dense, head=head, dtype=torch.float32)
            with load_from_store(store_path, dense=dense, head=head, prefetch_depth=0) as sm:
                mapped = {id(m.weight) for m in sm.model.modules() if isinstance(m, StoredEmbedding)}
                built = sum(t.numel() * t.element_size() for t in [*sm.model.parameters(), *sm.model.buffers()]
                            if id(t) not in mapped)
                built += sum(m.q.nbytes for m in sm.model.modules() if isinstance(m, QuantLinear))
            assert abs(est - built) <= 0.02 * built, (dense, head, est, built)


def test_cpu_node_splits_one_reading_between_the_tiers(store_path, figures):
    from services.budgets import decode_budgets, deployer_budgets

    total, resident = figures
    avail = HOST_HEADROOM + resident + total + total // 2  # room for every slot, half of them again in RAM
    cfg, told = deployer_budgets(_config(store_path), gpu=False, host_available=avail)
    assert (cfg.ram_budget, cfg.device_budget) == (total // 2, total)
    b = decode_budgets(cfg, "cpu", told)  # the decode actor takes them as resolved: nothing read twice
    assert (b.device, b.ram) == (total, total // 2) and b.auto
    assert b.line.startswith("budgets auto: device") and "headroom 4.00 GiB" in b.line
    assert "KV budget 4.00 MiB counted as resident" in b.line and "RAM tier" in b.line
    # a given RAM tier is taken out of the same memory before the device tier is resolved
    cfg, _ = deployer_budgets(_config(store_path, ram_budget=total // 4), gpu=False, host_available=avail)
    assert (cfg.ram_budget, cfg.device_budget) == (total // 4, total)


def test_under_a_cgroup_limit_the_deployer_counts_the_actors_it_will_start(store_path, tmp_path, monkeypatch):
    """On a CPU node in a memory-limited group the margin is what the group holds, what the decode
    actor's run adds (a step of max_batched_tokens, its tokenizer) and the processes the deployment
    starts there (each loader, the decode actor, the router), each about this process's own
    anonymous memory (Python, torch, the engine): without them a container's limit was divided as
    if the ~150 MiB each of those processes holds were free (issue 27)."""
    from engine.experts import host_memory as hm
    from engine.experts import runtime
    from engine.experts.host_memory import growth_allowance
    from engine.store.reader import ExpertStore
    from engine.units import format_bytes
    from services.budgets import deployer_budgets

    held, each = 300 * MiB, 150 * MiB
    g = tmp_path / "g"
    g.mkdir()
    (g / "memory.max").write_text(str(4 * GiB))
    (g / "memory.current").write_text(str(held))
    (g / "memory.stat").write_text("inactive_file 0\n")
    monkeypatch.setattr(hm, "host_memory", lambda available=False: 20 * GiB)
    monkeypatch.setattr(hm, "cgroup_memory_limit", lambda: (4 * GiB, str(g / "memory.max")))
    monkeypatch.setattr(runtime, "process_footprint", lambda: each)
    with ExpertStore(store_path) as st:
        hidden = st.config.hidden_size
    for loaders in (1, 3):
        cfg, told = deployer_budgets(_config(store_path, loaders=loaders, max_batched_tokens=256), gpu=False)
        margin = held + growth_allowance(hidden, 256, tokenizer=True) + (loaders + 2) * each
        assert f"headroom {format_bytes(margin)} " in told["device_from"], told["device_from"]


def test_gpu_ram_tier_in_the_deployer_slots_in_the_decode_actor(store_path, figures):
    from services.budgets import decode_budgets, deployer_budgets

    total, resident = figures
    cfg, told = deployer_budgets(_config(store_path), gpu=True, host_available=HOST_HEADROOM + total // 3)
    assert cfg.ram_budget == total // 3 and cfg.device_budget == "auto"  # the GPU's is the decode actor's
    free = resident + DEVICE_WORKSPACE + total // 5
    b = decode_budgets(cfg, "cuda", told, device_free=free)
    assert (b.device, b.ram) == (total // 5, total // 3)
    assert "free device memory" in b.line and "available host RAM" in b.line  # both resolutions told
    big = decode_budgets(cfg, "cuda", told, device_free=80 * GiB)
    assert big.device == total  # capped at every expert


def test_given_budgets_stay_as_they_are(store_path):
    from services.budgets import decode_budgets, deployer_budgets

    cfg0 = _config(store_path, device_budget=3 * MiB, ram_budget=None)
    cfg, told = deployer_budgets(cfg0, gpu=False, host_available=1)  # no memory read is used
    assert cfg == cfg0 and told == {}
    b = decode_budgets(cfg, "cpu", told)
    from engine.experts.runtime import store_expert_bytes

    assert (b.device, b.ram, b.auto) == (3 * MiB, store_expert_bytes(store_path), False)


@pytest.mark.parametrize("gpu,avail,free,fix", [
    (False, 3 * GiB, None, "needs at least 4.00 GiB"),  # a CPU node: HostMemoryError naming the minimum
    (True, 3 * GiB, None, "--device-budget and --ram-budget"),
    (True, 64 * GiB, 100 * MiB, "--device-budget and --ram-budget")])
def test_a_budget_that_cannot_be_met_is_a_typed_error_with_the_figures(store_path, gpu, avail, free, fix):
    from services.budgets import decode_budgets, deployer_budgets

    with pytest.raises(DeviceBudgetError, match=fix) as e:
        cfg, told = deployer_budgets(_config(store_path), gpu=gpu, host_available=avail)
        decode_budgets(cfg, "cuda", told, device_free=free)
    assert "4.00 GiB" in str(e.value) if free is None else "free device memory 100.00 MiB" in str(e.value)


def test_startup_error_is_the_typed_error_of_the_constructor():
    from ray.exceptions import RayActorError

    from services.app import startup_error

    text = ("The actor died because of an error raised in its creation task, ray::DecodeService.__init__()\n"
            "  File \"x.py\", line 1, in f\nengine.errors.DeviceBudgetError: budgets auto leave no memory: x")
    err = startup_error(RayActorError("00", text, actor_init_failed=True))
    assert isinstance(err, DeviceBudgetError) and str(err) == "budgets auto leave no memory: x"
    assert startup_error(RayActorError("00", text, actor_init_failed=False)) is None
    other = startup_error(RayActorError("00", "x\nengine.errors.ModelFormatError: store/x: bad", actor_init_failed=True))
    assert type(other).__name__ == "MoestreamError" and str(other) == "ModelFormatError: store/x: bad"
    assert startup_error(RuntimeError(text)) is None


# ---- on the session cluster ---------------------------------------------------------------------

def _actors(namespace: str) -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == namespace]


@pytest.mark.ray
def test_serve_defaults_to_auto_prints_it_and_status_reports_it(ray_cluster, store_path, figures):
    from services.app import connect
    from services.cli_serve import main

    total, _ = figures
    ns = "moestream-budgets-auto"
    r = CliRunner().invoke(main, ["serve", str(store_path), "--address", ray_cluster["gcs"], "--namespace", ns,
                                  "--loaders", "1", "--kv-budget", "4MiB", "--prefetch-depth", "0"])
    try:
        assert r.exit_code == 0, r.output
        assert "budgets auto: device" in r.stderr and "headroom 4.00 GiB" in r.stderr
        shown = json.loads(r.stdout)["budgets"]
        assert (shown["device"], shown["ram"]) == (total, total)  # the tiny store fits this machine whole
        app = connect(namespace=ns)
        status = app.status()  # what `moestream status` prints
        assert status["budgets"] == shown and status["budgets"]["line"] in r.stderr
        assert app.config.ram_budget == total  # the resolved tier, which a scale-up shares out
        assert app.scale(2) == ["loader-0", "loader-1"]
    finally:
        connect(namespace=ns).shutdown()
    assert _actors(ns) == []


@pytest.mark.ray
def test_given_budgets_are_deployed_as_given(app, deploy_config):
    b = app.status()["budgets"]
    assert (b["device"], b["ram"]) == (deploy_config.device_budget, deploy_config.ram_budget)
    assert b["line"].startswith("budgets given: device")


@pytest.mark.ray
def test_serve_with_budgets_that_cannot_be_met_fails_in_one_line_before_any_actor(ray_cluster, store_path):
    from services.cli_serve import main

    ns = "moestream-budgets-unmet"
    r = CliRunner().invoke(main, ["serve", str(store_path), "--address", ray_cluster["gcs"], "--namespace", ns,
                                  "--loaders", "1", "--kv-budget", "64TiB"])
    assert r.exit_code == 2, r.output
    # the KV budget alone exceeds the host: HostMemoryError naming the minimum, in one line
    assert r.stderr.startswith("error: available RAM") and r.stderr.count("\n") == 1
    assert "needs at least 64.00 TiB" in r.stderr and "dense/KV/state" in r.stderr and "margin 4.00 GiB" in r.stderr
    assert _actors(ns) == []


@pytest.mark.ray
def test_an_actor_that_fails_to_start_is_a_typed_error_and_nothing_keeps_running(ray_cluster, store_path):
    from services.app import deploy

    ns = "moestream-budgets-deadinit"
    with pytest.raises(ConfigError, match="holds no block"):  # the decode actor's KV cache
        deploy(_config(store_path, namespace=ns, loaders=1, kv_budget=1, prefetch_depth=0), timeout_s=240)
    deadline = time.monotonic() + 20
    while _actors(ns) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _actors(ns) == []
