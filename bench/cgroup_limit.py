"""A child process under a memory limit: a child cgroup of this process's own memory group.

v1 (``memory`` controller line in /proc/self/cgroup): ``memory.limit_in_bytes``,
``memory.max_usage_in_bytes`` (peak, page cache included), ``memory.oom_control``'s
``oom_kill``. v2 (``0::/path``): ``memory.max``, ``memory.peak``, ``memory.events``'s
``oom_kill``. Where neither group can be written, :func:`memory_group_dir` says what it needs.
Page eviction: ``posix_fadvise(DONTNEED)`` on the model's files (clean pages leave the page
cache; nothing needs root).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class NoCgroup(RuntimeError):
    """No memory cgroup this user may create children in."""


def memory_group_dir() -> tuple[Path, int]:
    """(this process's memory cgroup directory, cgroup version)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, ctrl, path = line.split(":", 2)
        if "memory" in ctrl.split(","):
            return ROOT / "memory" / path.lstrip("/"), 1
    for line in lines:
        _, ctrl, path = line.split(":", 2)
        if ctrl == "":
            return ROOT / path.lstrip("/"), 2
    raise NoCgroup("no memory cgroup in /proc/self/cgroup")


class LimitedGroup:
    """``with LimitedGroup(nbytes) as g:`` start a child with ``preexec_fn=g.enter``; after it
    exits, ``g.peak()`` and ``g.oom_kills()``. The group is removed on exit."""

    def __init__(self, limit: int) -> None:
        base, self.version = memory_group_dir()
        self.dir = base / f"beyond-ram-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        try:
            self.dir.mkdir()
            (self.dir / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")).write_text(str(limit))
        except OSError as e:
            self._remove()
            raise NoCgroup(
                f"cannot create a limited child of {base} ({e.strerror}): run as a user who may write "
                f"there (cgroup v1: the memory group; v2: a delegated group, e.g. `systemd-run --user --scope "
                f"-p Delegate=yes python bench/beyond_ram.py`)") from None
        self.limit = limit
        self._procs = str(self.dir / "cgroup.procs")

    def enter(self) -> None:
        """preexec_fn: the child joins the group before exec."""
        with open(self._procs, "w") as f:
            f.write(str(os.getpid()))

    def _read(self, name: str) -> str:
        try:
            return (self.dir / name).read_text()
        except OSError:
            return ""

    def peak(self) -> int:
        text = self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak").strip()
        return int(text) if text.isdigit() else -1

    def oom_kills(self) -> int:
        for line in self._read("memory.oom_control" if self.version == 1 else "memory.events").splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def _remove(self) -> None:
        try:
            self.dir.rmdir()
        except OSError:
            pass

    def __enter__(self) -> "LimitedGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()


def evict(paths) -> None:
    """Drop the files' clean pages from the page cache (posix_fadvise DONTNEED)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
