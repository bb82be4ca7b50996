"""Stop ONE Ray cluster of this account: the processes started with its temp dir, and their
descendants (workers, agents). Unlike `ray stop`, which terminates every Ray process the account
owns on the host (every cluster), other clusters are left running.

    python deploy/stop_cluster.py --temp-dir ~/.ray-moestream/tmp [--port 6379] [--grace 10]

A process belongs to the cluster when an argument names the temp dir (gcs_server, raylet,
dashboard, monitors) or the GCS address ``--address=HOST:PORT`` (the Ray client server), or when
it descends from one that does (workers, agents).

SIGTERM first; whatever is still alive after --grace seconds gets SIGKILL. Exit status 0 when
nothing of the cluster is left.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def _read(pid: int, what: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    stat = _read(pid, "stat")
    if not stat:
        return -1
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def cluster_pids(temp_dir: str, port: int | None = None, roots: tuple[int, ...] = ()) -> list[int]:
    """Processes of this account whose command line names ``temp_dir`` or the GCS ``port``
    (and ``roots``, e.g. the driver that started a local cluster), plus all their descendants."""
    uid, me = os.getuid(), os.getpid()
    key = os.path.realpath(os.path.expanduser(temp_dir)).encode()
    procs: dict[int, int] = {}
    roots = {p for p in roots if p != me}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        pid = int(d)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        procs[pid] = _ppid(pid)
        args = _read(pid, "cmdline").split(b"\0")
        if any(_ours(a, key, port) for a in args[1:]):
            roots.add(pid)
    found, changed = set(roots), True
    while changed:
        changed = False
        for pid, ppid in procs.items():
            if ppid in found and pid not in found:
                found.add(pid)
                changed = True
    return sorted(found)


def _ours(arg: bytes, temp_dir: bytes, port: int | None) -> bool:
    if not arg.startswith(b"--") or b"=" not in arg:
        return False
    name, value = arg.split(b"=", 1)
    if value == temp_dir or value.startswith(temp_dir + b"/"):
        return True
    return (port is not None and name in (b"--address", b"--gcs-address", b"--gcs_address")
            and value.rsplit(b":", 1)[-1] == str(port).encode())


def stop(temp_dir: str, port: int | None = None, grace: float = 10.0) -> list[int]:
    """SIGTERM the cluster's processes, SIGKILL what is left after ``grace`` s; returns the pids
    still alive at the end (empty on success)."""
    pids = cluster_pids(temp_dir, port)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _alive(p)]
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.2)
    return [p for p in alive if _alive(p)] + [p for p in cluster_pids(temp_dir, port) if p not in pids]


def _alive(pid: int) -> bool:
    stat = _read(pid, "stat")
    return bool(stat) and stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] != b"Z"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temp-dir", required=True)
    ap.add_argument("--port", type=int, default=None, help="GCS port of the cluster")
    ap.add_argument("--grace", type=float, default=10.0)
    a = ap.parse_args()
    n = len(cluster_pids(a.temp_dir, a.port))
    left = stop(a.temp_dir, a.port, a.grace)
    print(f"stopped {n - len(left)} process(es) of the Ray cluster in {a.temp_dir}"
          + (f"; still alive: {left}" if left else ""), file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
