"""A free TCP port, for the local cluster's components, local agents and broadcast groups."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now on ``host`` (the OS picks it; it may be taken again later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
