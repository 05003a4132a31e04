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
import threading
from dataclasses import dataclass

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


@dataclass(frozen=True)
class MooncakeSettings:
    timeout_seconds: float
    force_tcp: bool
    bind_address: str

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
