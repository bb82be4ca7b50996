"""deploy/: cluster.yaml passes Ray's own config preparation and validation; the env file and
start script keep every bind on loopback with token auth."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _validate(cfg: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    return prepared


def test_cluster_yaml_passes_ray_validation():
    cfg = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    prepared = _validate(cfg)
    assert prepared["provider"]["type"] == "local"
    assert prepared["provider"]["head_ip"] == "127.0.0.1"
    assert prepared["provider"]["worker_ips"] == []
    head = " ".join(prepared["head_start_ray_commands"])
    assert "deploy/start-head.sh" in head and "deploy/stop-head.sh" in head
    # `ray stop` would stop every Ray cluster of the account
    assert "ray stop" not in head and "ray stop" not in " ".join(prepared["worker_start_ray_commands"])
    assert any("deploy/setup.sh" in c for c in prepared["setup_commands"])
    # nothing large shipped: .gitignore'd paths (.venv, build outputs) stay behind
    assert prepared["rsync_filter"] == [".gitignore"] and ".venv" in prepared["rsync_exclude"]
    assert prepared["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_validation_is_real():
    cfg = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    cfg["provider"]["surprise"] = 1
    cfg["max_workers"] = "many"
    with pytest.raises(Exception):
        _validate(cfg)


def test_env_and_start_script_bind_loopback_with_token_auth():
    env = dict(line.split("=", 1) for line in (DEPLOY / "ray.env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # Ray's single-node mode: loopback
    assert "127.0.0.1" in env["RAY_API_SERVER_ADDRESS"]
    assert "$(id -u)" in env["RAY_TMPDIR"]  # per-account temp dir
    script = (DEPLOY / "start-head.sh").read_text()
    for flag in ("--head", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
                 "deploy/ray.env", "--object-store-memory"):
        assert flag in script
