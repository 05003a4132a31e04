"""Mooncake's process-wide settings (``MC_*`` environment variables) and its return codes.

Mooncake reads its ``MC_*`` variables from the environment once per process, lazily (measured: the
values present at the process's *first transfer* win, whatever was set when each engine was created).
So the first :class:`~weightsync_agent.transport.mooncake.MooncakeTransport` of a process sets them,
and a later one asking for different values only gets a warning: Mooncake keeps the first values, while
our own per-transfer deadline still applies each transport's ``timeout_seconds``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
from dataclasses import dataclass

from weightsync.api import names
from weightsync.api.v1alpha1 import EPHEMERAL_PORTS

log = logging.getLogger(__name__)

# Mooncake's floor for MC_TRANSFER_TIMEOUT (the sync-call timeout); lower values are raised to it.
MIN_TRANSFER_TIMEOUT_S = 5

# From Mooncake's error.h; the Python wrapper also uses -1 as its generic failure.
CODES = {
    -1: "failed",
    -2: "timed out",
    -3: "ADDRESS_NOT_REGISTERED",
    -7: "ADDRESS_OVERLAPPED",
    -101: "DNS",
    -102: "SOCKET",
    -104: "REJECT_HANDSHAKE",
    -200: "METADATA",
}


def describe(code: int) -> str:
    return f"{code} ({CODES.get(code, 'unknown code')})"


#: Mooncake's own range when none is set (config.cpp: ``rpc_min_port``/``rpc_max_port``).
DEFAULT_PORTS = (15000, 17000)
# EPHEMERAL_PORTS, Linux's ephemeral ports: Mooncake's ``ValidatePortRange`` refuses any range touching them and
# then silently binds in DEFAULT_PORTS instead (measured: 40000-40010 gave 15425 and 16726). We refuse it loudly.


def check_port_range(ports: tuple[int, int]) -> tuple[int, int]:
    """``ports`` if Mooncake would honour it, else ValueError saying why (Mooncake itself would only log)."""
    low, high = ports
    if not (1024 <= low <= high <= 65535):
        raise ValueError(f"Mooncake port range {low}-{high}: want 1024 <= start <= end <= 65535")
    if not (high < EPHEMERAL_PORTS[0] or low > EPHEMERAL_PORTS[1]):
        raise ValueError(
            f"Mooncake port range {low}-{high} touches Linux's ephemeral ports {EPHEMERAL_PORTS[0]}-"
            f"{EPHEMERAL_PORTS[1]}: Mooncake would ignore it and listen in {DEFAULT_PORTS[0]}-{DEFAULT_PORTS[1]}"
        )
    return low, high


def ports_in_effect() -> tuple[int, int]:
    """The range this process's Mooncake engines bind in: from MC_MIN_RPC_PORT/MC_MAX_RPC_PORT (ours, or the
    pod's environment, as the operator sets for engine containers), else Mooncake's default."""
    low, high = os.environ.get(names.ENV_MOONCAKE_MIN_PORT), os.environ.get(names.ENV_MOONCAKE_MAX_PORT)
    try:
        return check_port_range((int(low or DEFAULT_PORTS[0]), int(high or DEFAULT_PORTS[1])))
    except ValueError:
        return DEFAULT_PORTS  # what Mooncake falls back to


def free_ports(ports: tuple[int, int], limit: int = 1) -> int:
    """How many ports of ``ports`` (up to ``limit``) a new listening socket could bind on every interface now."""
    found = 0
    for port in range(ports[0], ports[1] + 1):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        found += 1
        if found >= limit:
            break
    return found


@dataclass(frozen=True)
class MooncakeSettings:
    timeout_seconds: float
    force_tcp: bool
    bind_address: str
    #: Where every Mooncake engine of the process listens (both its ports); None: as the environment says.
    ports: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.ports is not None:
            check_port_range(self.ports)

    def env(self) -> dict[str, str]:
        # Whole seconds only. The progress and status timeouts must not exceed ours, so that when we
        # report a hung peer Mooncake also drops the connection instead of finishing the write later.
        progress = str(max(1, math.floor(self.timeout_seconds)))
        env = {
            "MC_TRANSFER_TIMEOUT": str(max(MIN_TRANSFER_TIMEOUT_S, math.ceil(self.timeout_seconds))),
            "MC_TCP_PROGRESS_TIMEOUT_SEC": progress,
            "MC_TCP_STATUS_TIMEOUT_SEC": progress,
            "MC_TCP_BIND_ADDRESS": self.bind_address,
        }
        if self.force_tcp:
            env["MC_FORCE_TCP"] = "1"
        if self.ports is not None:
            env[names.ENV_MOONCAKE_MIN_PORT], env[names.ENV_MOONCAKE_MAX_PORT] = (str(p) for p in self.ports)
        return env


_applied: dict[str, str] = {}  # what this process's Mooncake runs with; empty until the first transport
_lock = threading.Lock()


def apply_once(settings: MooncakeSettings) -> dict[str, str]:
    """Export the settings before this process's first engine; returns what the process runs with."""
    wanted = settings.env()
    with _lock:
        if not _applied:
            os.environ.update(wanted)
            os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # INFO logs a line per peer and per batch
            _applied.update(wanted)
        elif wanted != _applied:
            differing = sorted(k for k in wanted.keys() | _applied.keys() if wanted.get(k) != _applied.get(k))
            log.warning(
                "Mooncake settings are process-wide and already set; keeping %s (asked: %s). "
                "Each transport's own timeout still applies to its transfers.",
                {k: _applied.get(k) for k in differing},
                {k: wanted.get(k) for k in differing},
            )
        return dict(_applied)
