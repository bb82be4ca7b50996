"""Names, sweeps and the reaper of the loaders' POSIX shared-memory segments (/dev/shm).

Only the standard library is imported here: this file also runs as the reaper script.

A segment's name says whose it is and who made it:

    moestream.u<uid>.<cluster>.<namespace>.<loader>.<pid>.<start>.<random>

``uid`` is the account, ``cluster`` a digest of the Ray cluster's GCS address (two clusters of
one account never share a name), ``namespace`` a digest of the deployment's namespace, ``loader``
the actor's name, ``pid``/``start`` the creating process and its start time (clock ticks since
boot, so a reused pid is not mistaken for the creator), ``random`` keeps names unique.

Three things remove segments, so none outlives its cluster by more than the next start:
  * the loader unlinks its own on close (scale-down, ``moestream shutdown``, SIGTERM of serve);
  * a reaper process per loader unlinks it when the loader dies in any other way (SIGKILL,
    ``ray stop``/``ray down``, a crash): it waits for EOF on a pipe only the loader holds;
  * every loader start sweeps (a) its own predecessor's segment and (b) every segment of this
    account whose creating process is gone (a deployment killed with its reapers).
Sweeps touch only regular files owned by this account; what cannot be removed (another
account's file, a read-only directory) is skipped with one warning, never raised.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import signal
import stat
import subprocess
import sys

try:  # the reaper runs this file as a bare script (python -S), without the package
    from engine.errors import ExpertLoadError as _NameErrorBase
except ImportError:  # pragma: no cover - reaper mode
    _NameErrorBase = ValueError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_TAG = "moestream"


class SegmentNameError(_NameErrorBase):
    """A loader name or prefix that cannot be part of a segment name."""


def _user_prefix() -> str:
    return f"{SEGMENT_TAG}.u{os.getuid()}."


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def cluster_id() -> str:
    """A digest of the GCS address of the Ray cluster this process is connected to; "local"
    when it is not connected (tests building loaders without Ray)."""
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            addr = ray.get_runtime_context().gcs_address
            if addr:
                return _digest(addr)
    except Exception:  # the Ray client has no GCS address: nothing of ours lives on its host
        pass
    return "local"


def segment_prefix(namespace: str, loader: str = "", cluster: str | None = None) -> str:
    """Name prefix of the segments of ``loader`` of deployment ``namespace`` on ``cluster``
    (default: this process's cluster) for this account; all its loaders when ``loader`` is
    empty. Every part ends with a dot, so loader-1 never matches loader-10."""
    if "." in loader or "/" in loader:
        raise SegmentNameError(f"loader name {loader!r} may not contain '.' or '/'")
    cluster = cluster_id() if cluster is None else cluster
    if not cluster or "." in cluster or "/" in cluster:
        raise SegmentNameError(f"cluster id {cluster!r} must be non-empty, without '.' or '/'")
    return f"{_user_prefix()}{cluster}.{_digest(namespace)}." + (f"{loader}." if loader else "")


def _start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return int(raw[raw.rindex(b")") + 2:].split()[19])


def segment_name(prefix: str) -> str:
    """A fresh segment name under ``prefix``: this process, its start time, a random part."""
    pid = os.getpid()
    return f"{prefix}{pid}.{_start_ticks(pid) or 0}.{secrets.token_hex(4)}"


def creator_alive(name: str) -> bool | None:
    """Whether the process that made segment ``name`` still runs (same pid and start time);
    None when the name carries no creator."""
    parts = name.split(".")
    if len(parts) < 4 or not parts[-3].isdigit() or not parts[-2].isdigit():
        return None
    pid, start = int(parts[-3]), int(parts[-2])
    return _start_ticks(pid) == start


def _sweep(keep, reason: str) -> list[str]:
    uid = os.getuid()
    gone, skipped = [], []
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError as e:
        log.warning("shared-memory sweep (%s): cannot list %s: %s", reason, SHM_DIR, e)
        return gone
    for name in names:
        if not name.startswith(_user_prefix()) or keep(name):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                continue  # another account's, or not a segment: never touched
            os.unlink(path)
            gone.append(name)
        except FileNotFoundError:
            pass  # removed meanwhile by its owner
        except OSError as e:  # PermissionError (sticky /dev/shm), read-only, ...
            skipped.append(f"{name} ({e.strerror or type(e).__name__})")
    if skipped:
        log.warning("shared-memory sweep (%s): left %d segment(s) it cannot remove: %s",
                    reason, len(skipped), ", ".join(skipped[:8]))
    return gone


def sweep_segments(prefix: str) -> list[str]:
    """Unlink this account's segments under ``prefix`` (segment_prefix). Returns the names
    removed; foreign or unremovable files are skipped (one warning)."""
    if not prefix.startswith(_user_prefix()):
        raise SegmentNameError(f"{prefix!r} is not a segment prefix of this user; "
                               f"build it with segment_prefix()")
    return _sweep(lambda n: not n.startswith(prefix), f"{SHM_DIR}/{prefix}*")


def sweep_dead_segments() -> list[str]:
    """Unlink this account's segments (any cluster, any deployment) whose creating process is
    gone: what a deployment killed together with its reapers left behind."""
    return _sweep(lambda n: creator_alive(n) is not False, "creators gone")


def segments(prefix: str = "") -> dict[str, int]:
    """This account's segments under ``prefix`` (default: all of them): name -> bytes."""
    out = {}
    for name in os.listdir(SHM_DIR):
        if name.startswith(_user_prefix() + prefix.removeprefix(_user_prefix())):
            try:
                st = os.lstat(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                continue
            if st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode):
                out[name] = st.st_size
    return out


class Reaper:
    """A small child process that unlinks ``path`` once this process is gone, however it went
    (SIGKILL included): it blocks reading a pipe whose write end only this process holds."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.proc = subprocess.Popen(
            [sys.executable, "-S", os.path.abspath(__file__), "reap", path],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True, cwd="/")

    def close(self) -> None:
        """The segment is gone already (or about to be): let the reaper exit."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _reap(path: str) -> int:
    """The reaper: wait for EOF on stdin (the loader exited or closed), then unlink ``path``
    if it is still this account's regular file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of a terminal is for the loader
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os.close(0))  # being stopped: clean up now
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    try:
        st = os.lstat(path)
        if st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode):
            os.unlink(path)
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "reap":
        sys.exit(_reap(sys.argv[2]))
    print("usage: shm.py reap PATH", file=sys.stderr)
    sys.exit(2)
