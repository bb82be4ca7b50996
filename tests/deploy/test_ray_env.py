"""services/ray_env.py: the client environment our commands set and `moestream env` prints, the
token file made before `ray up`, the per-account temp dir; deploy/stop_cluster.py picks only
its cluster's processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from engine.errors import ConfigError
from services import ray_env
from tests.deploy.helpers import alive, stop_cluster


@pytest.fixture()
def clean_env(monkeypatch, tmp_path):
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_TMPDIR", "RAY_ADDRESS",
              "RAY_API_SERVER_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok" / "auth_token"))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "raytmp"))
    return tmp_path


def test_token_mode_only_when_a_token_exists_and_token_file_is_private(clean_env):
    env = ray_env.client_env()
    assert "RAY_AUTH_MODE" not in env and env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    path = ray_env.ensure_token()
    assert path == clean_env / "tok" / "auth_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) == 64
    token = path.read_text()
    assert ray_env.ensure_token() == path and path.read_text() == token  # kept, not replaced
    assert ray_env.client_env()["RAY_AUTH_MODE"] == "token"


def test_caller_settings_win_and_env_command_prints_exports(clean_env, monkeypatch):
    ray_env.ensure_token()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    applied = ray_env.apply_client_env()
    assert applied["RAY_AUTH_MODE"] == "disabled"
    assert applied["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    monkeypatch.delenv("RAY_AUTH_MODE")
    lines, note = _env_command()
    assert lines["RAY_AUTH_MODE"] == "token"
    assert lines["RAY_TMPDIR"] == str(clean_env / "raytmp")
    # no cluster runs: no address (before, 127.0.0.1:6379 whatever was running) and a note
    assert "RAY_ADDRESS" not in lines and "RAY_API_SERVER_ADDRESS" not in lines
    assert "no Ray cluster of this account is running" in note
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # the caller's own setting still wins
    assert _env_command()[0]["RAY_ADDRESS"] == "10.0.0.5:6379"


def _env_command() -> tuple[dict[str, str], str]:
    from services.cli_serve import env_cmd

    res = CliRunner().invoke(env_cmd, [])
    assert res.exit_code == 0, res.output
    return dict(line.removeprefix("export ").split("=", 1) for line in res.stdout.splitlines()), res.stderr


@pytest.fixture()
def listener():
    """A TCP socket on loopback that accepts: a stand-in for a live GCS / Jobs API port."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


def test_env_prints_the_cluster_that_is_running(clean_env, listener):
    """A plain `moestream serve` records its own cluster (any free GCS port) while it runs; that
    one wins over a `ray start` record; a record whose process or port is gone counts as none."""
    import json

    tmp = ray_env.account_temp_dir()
    assert ray_env.running_cluster() is None
    # `ray start` (deploy/start-head.sh) writes Ray's own record: found when its GCS answers
    from ray._common.utils import get_ray_address_file

    ray_file = get_ray_address_file(None)
    assert ray_file == os.path.join(tmp, "ray", "ray_current_cluster")  # where we look
    os.makedirs(os.path.dirname(ray_file), exist_ok=True)
    with open(ray_file, "w") as f:
        f.write(listener)
    assert ray_env.running_cluster()["gcs"] == listener
    assert _env_command()[0]["RAY_ADDRESS"] == listener
    # serve's record wins while its process lives and its GCS answers
    path = ray_env.record_serve("127.0.0.1:1", None, "ns")  # port 1: nothing listens
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ray_env.running_cluster()["gcs"] == listener  # dead port: the ray start one
    path = ray_env.record_serve(listener, f"http://{listener}", "ns")
    found = ray_env.running_cluster()
    assert found["gcs"] == listener and found["jobs"] == f"http://{listener}" and "serve" in found["by"]
    lines, note = _env_command()
    assert lines["RAY_ADDRESS"] == listener and lines["RAY_API_SERVER_ADDRESS"] == f"http://{listener}"
    assert "moestream serve" in note
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**rec, "pid": 2**22 + 1}))  # a process that is gone
    assert ray_env.running_cluster()["by"] == "ray start"
    path.write_text(json.dumps(rec))
    ray_env.forget_serve(path)
    assert not path.exists()
    os.unlink(ray_file)
    assert ray_env.running_cluster() is None


@pytest.mark.skipif(os.getuid() != 0, reason="a directory of another account needs root (chown)")
def test_temp_dir_of_another_account_is_refused(clean_env):
    d = clean_env / "raytmp"
    d.mkdir()
    os.chown(d, 4242, 4242)
    with pytest.raises(ConfigError, match="not a directory owned by"):
        ray_env.account_temp_dir()


def test_stop_cluster_stops_its_cluster_and_descendants_only(tmp_path):
    """Two fake 'clusters' (a root process naming its temp dir, with a child): stopping one
    leaves the other running."""
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    a = subprocess.Popen([sys.executable, "-c", code, f"--temp-dir={tmp_path}/a"])
    b = subprocess.Popen([sys.executable, "-c", code, f"--temp-dir={tmp_path}/b"])
    try:
        deadline = time.monotonic() + 10
        while len(stop_cluster.cluster_pids(f"{tmp_path}/a")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pa, pb = stop_cluster.cluster_pids(f"{tmp_path}/a"), stop_cluster.cluster_pids(f"{tmp_path}/b")
        assert a.pid in pa and len(pa) == 2 and b.pid in pb and not set(pa) & set(pb)
        assert stop_cluster.stop(f"{tmp_path}/a", grace=5) == []
        a.wait(timeout=10)
        assert not any(alive(p) for p in pa) and all(alive(p) for p in pb)
    finally:
        for p in stop_cluster.cluster_pids(f"{tmp_path}/b") + [a.pid, b.pid]:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        a.wait()
        b.wait()
