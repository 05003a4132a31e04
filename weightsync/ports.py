"""A free TCP port, for the local cluster's components, local agents and broadcast groups."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

#: Ports this process handed out already. Nothing listens on a port between its pick and its server's start, so
#: without this two picks in a row (a server's HTTP and bootstrap ports) can get the same port from the OS: SGLang
#: then binds its bootstrap server there and fails to bind its HTTP server ("address already in use").
_handed_out: set[int] = set()
_lock = threading.Lock()
ATTEMPTS = 64

#: A file shared by processes that pick ports side by side (the test suite's parallel workers and what they
#: spawn): a port any of them handed out is never handed out again by another, which the per-process set above
#: cannot see. Unset, picks are only unique within a process.
ENV_LEDGER = "WEIGHTSYNC_PORTS_LEDGER"

#: Where the kernel takes the local ports of outgoing connections (Linux).
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: How many ports below the ephemeral range picks come from, and the lowest port ever picked.
WINDOW = 12768
LOWEST = 10000


def pick_window(ephemeral: tuple[int, int] | None) -> tuple[int, int] | None:
    """The ports ``[low, high)`` to pick from: just below the kernel's ephemeral range. A port the OS hands out for
    ``bind(0)`` comes from that range, which every outgoing connection on the host draws from too: between the
    pick and the server's bind, a client socket (Mooncake, HTTP, gloo) can take it ("address already in use";
    it broke a CI run). Below the range only an explicit bind takes a port. ``None``: no usable window (the
    range unknown or too low), so the OS picks."""
    if ephemeral is None or ephemeral[0] - LOWEST < 1024:
        return None
    return max(LOWEST, ephemeral[0] - WINDOW), ephemeral[0]


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now on ``host`` (below the ephemeral range where there is room:
    :func:`pick_window`), and never one this process (or, with ``$WEIGHTSYNC_PORTS_LEDGER``, any process sharing
    that ledger) handed out before."""
    window = pick_window(_ephemeral_range())
    with _lock, _ledger(os.environ.get(ENV_LEDGER)) as shared:
        for _ in range(ATTEMPTS):
            with socket.socket() as sock:
                try:
                    sock.bind((host, random.randrange(*window) if window else 0))
                except OSError:  # taken: try another
                    continue
                port = int(sock.getsockname()[1])
            if port not in _handed_out and port not in shared:
                _handed_out.add(port)
                shared.add(port)
                return port
    raise OSError(f"no free port on {host} in {ATTEMPTS} tries that this process had not handed out already")


@contextlib.contextmanager
def _ledger(path: str | None) -> Iterator[set[int]]:
    """The ports recorded in the ledger at ``path``, held under an exclusive lock; ports added to the set are
    appended when the block ends. No path: an empty set that goes nowhere."""
    if not path:
        yield set()
        return
    with Path(path).open("a+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        file.seek(0)
        before = {int(line) for line in file.read().split() if line.isdigit()}
        ports = set(before)
        yield ports
        file.write("".join(f"{port}\n" for port in sorted(ports - before)))
        file.flush()
