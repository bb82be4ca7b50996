"""`moestream serve` as an operator runs it (issue 16): every socket of a running deployment on
loopback (or proven to need the token), a clean stop on SIGTERM and on Ctrl-C within
STOP_LIMIT_S (actors, processes and shared memory gone), and no segment surviving a deployment
SIGKILLed whole beyond the next start. Each test starts its own local cluster (own temp dir and
token), not the session cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.deploy.helpers import Serve, alive, audit, http_status, shm_of

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # whole processes end to end: `pytest -m slow`

STOP_LIMIT_S = 30.0  # what docs/serving.md promises for SIGTERM / Ctrl-C of `moestream serve`


@pytest.fixture()
def serve(store_path, request):
    s = Serve(store_path, namespace=f"life-{request.node.name[-12:]}-{os.getpid()}")
    yield s
    s.cleanup()


def _stopped_cleanly(s: Serve, pids: list[int], sig: int, group: bool) -> float:
    rc, took = s.signal_and_wait(sig, group=group, timeout_s=STOP_LIMIT_S + 30)
    assert rc == 0, s.log()
    assert took < STOP_LIMIT_S, f"serve took {took:.1f} s to stop"
    print(f"[lifecycle] {signal.Signals(sig).name}{' to the group' if group else ''}: "
          f"serve stopped in {took:.1f} s")
    assert "stopped: actors, shared memory and the local cluster" in s.log()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in pids if alive(p)] == [], "processes of the deployment outlived serve"
    assert shm_of(s.namespace) == {}
    return took


def test_sockets_loopback_or_token_and_sigterm_stops_everything(serve):
    serve.start("--dashboard")
    pids = serve.pids()
    socks, problems = audit(pids)
    assert problems == []
    # the audit saw the deployment (GCS, raylet, the dashboard and every worker listen)
    dash = [s.port for s in socks if "dashboard.py" in s.command and f"--port={s.port}" in s.command]
    assert len(socks) >= 8 and len(dash) == 1, socks
    assert all(s.loopback for s in socks), [s for s in socks if not s.loopback]
    # the Jobs API on loopback still wants the token
    assert http_status("127.0.0.1", dash[0], "/api/jobs/") == 401
    segs = shm_of(serve.namespace)
    assert len(segs) == 2 and all(b > 0 for b in segs.values())
    _stopped_cleanly(serve, pids, signal.SIGTERM, group=False)


def _env_command(s: Serve) -> tuple[dict[str, str], str]:
    """`moestream env` in a second terminal of the same account: (exports, note)."""
    from tests.deploy.helpers import ROOT

    p = subprocess.run([sys.executable, "-m", "services.cli", "env"], capture_output=True, text=True,
                       env={**s.env, "PYTHONPATH": str(ROOT)}, timeout=120, cwd=s.tmp)
    assert p.returncode == 0, p.stderr
    return dict(line.removeprefix("export ").split("=", 1) for line in p.stdout.splitlines()), p.stderr


def _gcs_address(pids: list[int]) -> str:
    """The GCS of this deployment, from the command lines of its processes (the raylet and the
    agents are started with ``--gcs-address=HOST:PORT``; the GCS itself with port 0)."""
    found = set()
    for pid in pids:
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        found |= {a.split("=", 1)[1] for a in args if a.startswith(("--gcs-address=", "--gcs_address="))}
    assert len(found) == 1, found
    return found.pop()


def test_ctrl_c_of_the_terminal_stops_everything(serve):
    serve.start()
    pids = serve.pids()
    assert len(shm_of(serve.namespace)) == 2
    # a second terminal finds this cluster: `moestream env` prints its GCS (issue 28; before,
    # the address deploy/start-head.sh's cluster would have, 127.0.0.1:6379)
    exports, note = _env_command(serve)
    assert exports["RAY_ADDRESS"] == _gcs_address(pids), (exports, note)
    assert f"namespace {serve.namespace}" in note
    # a terminal's Ctrl-C: SIGINT to the whole foreground group (gcs_server, raylet, ... too)
    _stopped_cleanly(serve, pids, signal.SIGINT, group=True)
    exports, note = _env_command(serve)  # stopped: none is running, and it says so
    assert "RAY_ADDRESS" not in exports and "no Ray cluster" in note


def test_sigterm_to_the_group_finishes_the_request_in_flight_and_stops_everything(serve):
    """What `kill -TERM -PGID` (and a terminal's hangup) do: SIGTERM to serve and every process
    of its group at once. Before the fix the local cluster's GCS and raylet died with it, serve
    waited 60 s for the dead GCS, exited 1 and left processes running. A streamed request in
    flight when the signal comes finishes within the grace period."""
    import json
    import re
    import threading
    import urllib.request

    serve.start("--http", "127.0.0.1:0", "--stop-grace", "20")
    pids = serve.pids()
    assert len(shm_of(serve.namespace)) == 2
    base = re.search(r"http://127\.0\.0\.1:\d+/v1", serve.log()).group(0)
    req = urllib.request.Request(f"{base}/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": serve.store.name, "prompt": [5, 6, 7, 8],
                                                  "max_tokens": 64, "temperature": 0, "stream": True}).encode())
    lines: list[str] = []
    first = threading.Event()

    def read():
        with urllib.request.urlopen(req, timeout=STOP_LIMIT_S + 60) as r:
            for raw in r:
                if raw.strip():  # SSE: "data: ..." lines, each followed by a blank one
                    lines.append(raw.decode().strip())
                    first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(120), serve.log()  # streaming: the request is in flight
    _stopped_cleanly(serve, pids, signal.SIGTERM, group=True)
    reader.join(30)
    events = [json.loads(x[len("data: "):]) for x in lines if x.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and "error" not in events[-1], lines[-3:]
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")  # finished, not aborted


def test_sigkill_of_everything_then_start_again_leaves_one_deployment_of_segments(serve, store_path):
    serve.start()
    first = shm_of(serve.namespace)
    assert len(first) == 2
    serve.kill()
    leaked = shm_of(serve.namespace)
    assert leaked == first  # reapers died with the rest: the segments are left behind ...
    again = Serve(store_path, namespace=serve.namespace)
    try:
        again.start()
        now = shm_of(serve.namespace)
        # ... and the next start removes them: one deployment's worth, none of the old names
        assert len(now) == 2 and not set(now) & set(first)
        assert sum(now.values()) == sum(first.values())
        _stopped_cleanly(again, again.pids(), signal.SIGTERM, group=False)
    finally:
        again.cleanup()


def test_reaper_unlinks_the_segment_of_a_killed_process(tmp_path):
    """A process holding a segment is SIGKILLed: its reaper removes the segment at once."""
    code = ("import os, sys, time\n"
            "from services.shm import Reaper, segment_name, segment_prefix, SHM_DIR\n"
            "p = os.path.join(SHM_DIR, segment_name(segment_prefix('reaper-test', 'loader-0')))\n"
            "open(p, 'wb').write(b'x' * 4096)\n"
            "r = Reaper(p)\n"
            "print(p, r.proc.pid, flush=True)\n"
            "time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    path, reaper_pid = child.stdout.readline().split()
    try:
        assert os.path.isfile(path) and alive(int(reaper_pid))
        time.sleep(0.5)
        assert os.path.isfile(path)  # the reaper waits while its process lives
        child.kill()
        child.wait()
        deadline = time.monotonic() + 5
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path)
        while alive(int(reaper_pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(int(reaper_pid))
    finally:
        child.kill()
        if os.path.exists(path):
            os.unlink(path)
