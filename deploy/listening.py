"""List the listening TCP sockets of a set of processes (no tools needed beyond /proc).

    python deploy/listening.py            # every listening socket of this account's processes
    python deploy/listening.py PID ...    # of those processes only

Prints one line per socket: address, port, pid, command. Used by tests/deploy to audit a running
deployment; loopback sockets are marked 'loopback'.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from dataclasses import dataclass

LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    pid: int
    command: str

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback


def _hex_ip(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    addr = ipaddress.IPv6Address(words)
    return str(addr.ipv4_mapped or addr)


def listening_inodes() -> dict[int, tuple[str, int]]:
    """inode -> (host, port) of every listening TCP socket of this network namespace."""
    out: dict[int, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != LISTEN:
                continue
            host, port = f[1].split(":")
            out[int(f[9])] = (_hex_ip(host), int(port, 16))
    return out


def _command(pid: int) -> str:
    try:
        raw = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:160]


def listeners(pids: list[int] | None = None, uid: int | None = None) -> list[Listener]:
    """Listening sockets held by ``pids`` (default: every process of ``uid``, default ours)."""
    inodes = listening_inodes()
    uid = os.getuid() if uid is None else uid
    if pids is None:
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.stat(f"/proc/{d}").st_uid == uid:
                        pids.append(int(d))
                except OSError:
                    pass
    found: set[Listener] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in inodes:
                    host, port = inodes[inode]
                    found.add(Listener(host, port, pid, _command(pid)))
    return sorted(found, key=lambda x: (x.port, x.pid))


if __name__ == "__main__":
    chosen = [int(a) for a in sys.argv[1:]] or None
    for s in listeners(chosen):
        print(f"{s.host:>15} {s.port:>5} {s.pid:>7} {'loopback' if s.loopback else 'EXPOSED ':8} {s.command}")
