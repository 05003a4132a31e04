"""Which TCP ports a process listens on, from /proc (no ``ss`` needed), and a block of free ports to pin into."""

from __future__ import annotations

import os
import socket
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def _listening_inodes() -> dict[str, int]:
    """inode -> port of every listening TCP socket of this network namespace (IPv4 and IPv6)."""
    found: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        lines = Path(table).read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN:
                found[inode] = int(local.rsplit(":", 1)[1], 16)
    return found


def listening_ports(pid: int) -> set[int]:
    """The ports ``pid`` holds a listening socket on."""
    inodes = _listening_inodes()
    ports: set[int] = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inode = target[len("socket:[") : -1]
            if inode in inodes:
                ports.add(inodes[inode])
    return ports


def free_block(size: int, start: int = 21000, stop: int = 32000) -> tuple[int, int]:
    """``size`` consecutive ports nothing listens on now (outside Linux's ephemeral range, as Mooncake wants)."""
    taken = set(_listening_inodes().values())
    for low in range(start, stop - size, size):
        block = range(low, low + size)
        if taken.isdisjoint(block) and all(_bindable(p) for p in block):
            return low, low + size - 1
    raise RuntimeError(f"no {size} free consecutive ports in {start}-{stop}")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
