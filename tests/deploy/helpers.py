"""Shared by the deployment tests: the deploy/ scripts as modules, a `moestream serve` child
with its own Ray temp dir and token, the socket audit and the shared-memory count."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def deploy_module(name: str):
    """deploy/<name>.py imported as a module (deploy/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", DEPLOY / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


listening = deploy_module("listening")
stop_cluster = deploy_module("stop_cluster")


def short_tmpdir(prefix: str) -> str:
    """A short directory under /tmp: Ray's unix sockets live below it (108-byte path limit)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def http_status(host: str, port: int, path: str = "/", timeout: float = 3.0) -> int | None:
    """HTTP status of GET without credentials; None when it does not speak HTTP."""
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return None


def audit(pids: list[int]) -> tuple[list, list[str]]:
    """(every listening socket of ``pids``, the problems). A problem is a socket beyond loopback
    that does not prove it needs the token: it must answer HTTP 401/403 without one (a gRPC or
    other port that cannot be probed that way counts as a problem: it should not be exposed)."""
    socks = listening.listeners(pids)
    problems = []
    for s in socks:
        if s.loopback:
            continue
        host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
        code = http_status(host, s.port)
        if code not in (401, 403):
            problems.append(f"{s.host}:{s.port} (pid {s.pid}, {s.command[:80]}) answers "
                            f"{'HTTP ' + str(code) if code else 'a non-HTTP protocol'} "
                            f"without the token")
    return socks, problems


def shm_of(namespace: str) -> dict[str, int]:
    """This account's segments of deployment ``namespace`` on any cluster: name -> bytes."""
    from services.shm import _digest, segments

    tag = f".{_digest(namespace)}."
    return {n: b for n, b in segments().items() if tag in n}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return False
    return raw[raw.rindex(b")") + 2:raw.rindex(b")") + 3] != b"Z"


@dataclass
class Serve:
    """``moestream serve STORE`` on a local cluster of its own (temp dir, token file)."""

    store: Path
    namespace: str
    tmp: str = field(default_factory=lambda: short_tmpdir("ms"))
    proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN",
                            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
        return {**env, "RAY_TMPDIR": self.tmp, "RAY_AUTH_TOKEN_PATH": f"{self.tmp}/token"}

    @property
    def token(self) -> str:
        return Path(f"{self.tmp}/token").read_text().strip()

    def start(self, *extra: str, timeout_s: float = 300.0) -> "Serve":
        self.err_path = Path(self.tmp) / "serve.err"
        # this checkout's code (the console script imports whichever checkout was installed)
        env = {**self.env, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), self.env.get("PYTHONPATH"))))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", str(self.store), "--namespace",
             self.namespace, "--loaders", "2", "--num-cpus", "2", "--object-store-memory", "100MiB",
             *extra],
            stdout=open(Path(self.tmp) / "serve.out", "w"), stderr=open(self.err_path, "w"),
            env=env, start_new_session=True, cwd=self.tmp)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "Ctrl-C stops it" in self.err_path.read_text():
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.5)
        self.kill()
        raise AssertionError(f"serve not ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.err_path.read_text()[-4000:]

    def pids(self) -> list[int]:
        """Every process of the deployment: serve, its cluster, workers, reapers."""
        return stop_cluster.cluster_pids(self.tmp, roots=(self.proc.pid,))

    def signal_and_wait(self, sig: int, group: bool, timeout_s: float) -> tuple[int, float]:
        """Send ``sig`` to serve (or its whole process group, as a terminal's Ctrl-C does);
        returns (exit status, seconds until it exited)."""
        t0 = time.monotonic()
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout_s)
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL every process of the deployment at once (stopped first, so none of them gets
        to clean up after another)."""
        pids = self.pids()
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if self.proc is not None:
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        stop_cluster.stop(self.tmp, grace=2.0)
        shutil.rmtree(self.tmp, ignore_errors=True)
