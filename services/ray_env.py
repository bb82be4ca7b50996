"""The Ray environment of a single-workstation moestream cluster, for our processes and, printed
by ``moestream env``, for Ray's own CLI (``ray job submit``, ``ray status``).

    eval "$(moestream env)"      # then: ray job submit -- moestream generate --address auto "Hi"

``moestream env`` points Ray's CLI at the cluster that is running: the one a plain ``moestream
serve`` started (recorded in the temp dir while it runs), else the one ``ray start`` /
deploy/start-head.sh started; with none running it says so and sets no address.

What it sets (never overriding what the caller already set):
  * ``RAY_AUTH_MODE=token`` when a token exists (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``): a token cluster refuses clients without it, and the Ray client then
    fails with a misleading connection timeout;
  * ``RAY_TMPDIR=/tmp/ray-<uid>``: a per-account Ray temp dir (``/tmp/ray`` is shared by every
    account of the host, so the first account to start Ray owns it and the next cannot);
  * ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's single-node mode. Without it Ray replaces a
    loopback node address (``--node-ip-address=127.0.0.1``, ``ray.init(_node_ip_address=...)``,
    ``--address auto``) with the host's address, so GCS, raylet, workers, agents and the metrics
    ports listen on the network. With it every socket binds 127.0.0.1 (tests/deploy audits
    this). A cluster spanning machines needs ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` and a real
    ``--node-ip-address``; token authentication then guards the sockets.
  * ``RAY_USAGE_STATS_ENABLED=0``.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from pathlib import Path

from engine.errors import ConfigError

SINGLE_NODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
JOBS_API = "http://127.0.0.1:8265"


def token_path() -> Path:
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def has_token() -> bool:
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or token_path().is_file()


def ensure_token() -> Path | None:
    """Create the token file (``RAY_AUTH_TOKEN_PATH`` or ~/.ray/auth_token, mode 0600, 256
    random bits) unless a token exists; returns its path (None when ``RAY_AUTH_TOKEN`` holds
    it). ``ray up`` copies this file to every node, so it must exist before ``ray up``."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = token_path()
    if path.is_file() and path.stat().st_size:
        return path
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def account_temp_dir(create: bool = True) -> str:
    """``RAY_TMPDIR`` if set, else /tmp/ray-<uid>, created 0700 and refused when another
    account owns it (a squatter could otherwise read our sockets and logs)."""
    path = os.environ.get("RAY_TMPDIR") or f"/tmp/ray-{os.getuid()}"
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"Ray temp dir {path}: {e.strerror}; set RAY_TMPDIR to a "
                              f"directory of yours") from None
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ConfigError(f"Ray temp dir {path} is not a directory owned by uid "
                              f"{os.getuid()}; remove it or set RAY_TMPDIR")
    return path


def client_env() -> dict[str, str]:
    """The variables our processes set for themselves (setdefault semantics)."""
    env = {"RAY_TMPDIR": account_temp_dir(), SINGLE_NODE: "0", "RAY_USAGE_STATS_ENABLED": "0"}
    if has_token():
        env["RAY_AUTH_MODE"] = "token"
    return env


def cli_env(cluster: dict[str, str | None] | None = None) -> dict[str, str]:
    """``client_env`` plus where Ray's CLI finds ``cluster`` (``running_cluster()``: its GCS and
    Jobs API; None: no address is set). What the caller set wins."""
    env = {k: os.environ.get(k, v) for k, v in client_env().items()}
    env["RAY_AUTH_MODE"] = os.environ.get("RAY_AUTH_MODE", "token")
    for var, key in (("RAY_ADDRESS", "gcs"), ("RAY_API_SERVER_ADDRESS", "jobs")):
        value = os.environ.get(var) or (cluster or {}).get(key)
        if value:
            env[var] = value
    return env


# ---- which cluster is running -----------------------------------------------------------------
# `moestream serve` without --address starts a cluster of its own on a free GCS port that Ray
# records nowhere (`ray start` writes $RAY_TMPDIR/ray/ray_current_cluster; ray.init does not), so
# serve records it here while it runs; `moestream env` prints the cluster that answers.
SERVE_RECORD = "moestream-serve.json"


def serve_record_path() -> Path:
    return Path(account_temp_dir(create=False)) / SERVE_RECORD


def record_serve(gcs: str, jobs: str | None, namespace: str) -> Path:
    """Write this process's local cluster (mode 0600, replaced atomically); returns the path."""
    import json

    path = serve_record_path()
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"gcs": gcs, "jobs": jobs, "namespace": namespace, "pid": os.getpid()}, f)
    os.replace(tmp, path)
    return path


def forget_serve(path: Path) -> None:
    """Remove the record if it is still this process's (a later serve may have replaced it)."""
    import json

    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def listening(address: str, timeout_s: float = 0.5) -> bool:
    """Whether HOST:PORT (or http://HOST:PORT) accepts a TCP connection."""
    import socket

    host, _, port = address.removeprefix("http://").rstrip("/").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _alive(pid: object) -> bool:
    try:
        os.kill(int(pid), 0)  # type: ignore[arg-type]
        return True
    except (OSError, TypeError, ValueError):
        return False


def running_cluster() -> dict[str, str | None] | None:
    """The cluster of this account that is running: the one a `moestream serve` (without
    --address) started, else the one `ray start` (deploy/start-head.sh) recorded; each only when
    its GCS accepts connections. {"gcs", "jobs" (Jobs API URL or None), "by"}; None: none is."""
    import json

    try:
        rec = json.loads(serve_record_path().read_text())
        if _alive(rec.get("pid")) and listening(rec["gcs"]):
            return {"gcs": rec["gcs"], "jobs": rec.get("jobs"),
                    "by": f"moestream serve (pid {rec['pid']}, namespace {rec.get('namespace')})"}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:  # where `ray start` records its GCS (Ray uses $RAY_TMPDIR/ray)
        gcs = (Path(account_temp_dir(create=False)) / "ray" / "ray_current_cluster").read_text().strip()
    except OSError:
        return None
    if gcs and listening(gcs):
        return {"gcs": gcs, "jobs": JOBS_API if listening(JOBS_API) else None, "by": "ray start"}
    return None


def apply_client_env(create_token: bool = False) -> dict[str, str]:
    """Set ``client_env`` in this process (what the caller set wins) and make an already
    imported Ray see it; returns the variables now in effect. ``create_token``: about to start
    a local cluster, which gets token authentication (ensure_token) unless RAY_AUTH_MODE says
    otherwise."""
    if create_token and os.environ.get("RAY_AUTH_MODE", "token") == "token":
        ensure_token()
    for k, v in client_env().items():
        os.environ.setdefault(k, v)
    if os.environ.get(SINGLE_NODE) == "0" and "ray._private.ray_constants" in sys.modules:
        sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER = False
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None and os.environ.get("RAY_AUTH_MODE") == "token":
        raylet.Config.initialize("")  # re-read RAY_AUTH_MODE (what Ray itself does)
    return {k: os.environ[k] for k in client_env()}


def shell_exports(env: dict[str, str]) -> str:
    import shlex

    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
