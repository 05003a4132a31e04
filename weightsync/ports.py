"""A free TCP port, for the local cluster's components, local agents and broadcast groups."""

from __future__ import annotations

import socket
import threading

#: Ports this process handed out already. Nothing listens on a port between its pick and its server's start, so
#: without this two picks in a row (a server's HTTP and bootstrap ports) can get the same port from the OS: SGLang
#: then binds its bootstrap server there and fails to bind its HTTP server ("address already in use").
_handed_out: set[int] = set()
_lock = threading.Lock()
ATTEMPTS = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now on ``host`` (the OS picks it; it may be taken again later), and never
    one this process handed out before."""
    with _lock:
        for _ in range(ATTEMPTS):
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free port on {host} in {ATTEMPTS} tries that this process had not handed out already")
