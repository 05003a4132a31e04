"""The transport interface: how a source's bytes reach a target's memory.

Small on purpose. A target registers the memory it exposes and advertises ``session_id``; a source
registers its replica and submits one-sided writes ``(local address -> peer's remote address)``, then
polls them. Nothing here blocks without a deadline: :meth:`Transfer.wait` takes one, and a transport
must return FAILED (never hang) when a peer dies or stops answering.
"""

from __future__ import annotations

import enum
import time
from typing import Protocol

# Transports split a write larger than this into requests of this size (docs/transport.md has the
# measurements). The target checks each request on its own, so a write that overruns its region has
# its in-range chunks applied before the failure is reported.
DEFAULT_CHUNK_BYTES = 64 << 20


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransportError(RuntimeError):
    """A transport operation failed; the message names the peer and what was attempted."""


class Transfer(Protocol):
    """One submitted write."""

    peer: str
    nbytes: int

    def poll(self) -> TransferState:
        """Non-blocking."""
        ...

    def error(self) -> str | None:
        """Why it failed, once FAILED."""
        ...


class Transport(Protocol):
    @property
    def session_id(self) -> str:
        """What peers pass as ``peer`` to write into this process's registered memory."""
        ...

    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...

    def probe(self, peer: str, timeout: float) -> bool:
        """Whether ``peer`` answers, within ``timeout`` seconds."""
        ...

    def submit_write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> Transfer: ...

    def close(self) -> None: ...


def wait_all(transfers: list[Transfer], deadline: float, poll_interval: float = 0.0005) -> list[Transfer]:
    """Poll until every transfer is DONE or FAILED, or ``deadline`` (time.monotonic) passes.

    Returns the transfers that did not complete (failed or still pending at the deadline). Sleeping
    between polls matters: spinning steals the core the transport's own I/O thread needs.
    """
    pending = list(transfers)
    failed: list[Transfer] = []
    while pending:
        still = []
        for transfer in pending:
            state = transfer.poll()
            if state is TransferState.FAILED:
                failed.append(transfer)
            elif state is TransferState.PENDING:
                still.append(transfer)
        pending = still
        if not pending:
            break
        if time.monotonic() >= deadline:
            return failed + pending
        time.sleep(poll_interval)
    return failed
