"""An in-process transport: sessions of one process write into each other's registered memory.

For fast tests of the layers above and for single-process demos. It is honest about what the real
transport does, so code that passes here does not lean on luck:

* the *target* checks every request against its current registrations, like Mooncake's server: the
  range must lie inside one registered region, else the transfer is FAILED. Writes are cut into
  requests of ``chunk_bytes`` exactly as MooncakeTransport cuts them, so a write that overruns its
  region has its in-range chunks applied, there as here; a write within one chunk lands whole or not
  at all;
* the *source* range must be registered too (RDMA needs it; Mooncake over TCP happens not to check),
  and an unregistered source range is a programming error, raised as :class:`TransportError`;
* a write to an unknown or closed session is FAILED, not raised, as with a dead Mooncake peer;
* faults a real network has can be switched on per target session: :meth:`MemoryTransport.stall`
  (the peer accepts writes and sits on them: they stay PENDING, fail at the source's timeout, and still
  land if :meth:`MemoryTransport.release` comes later, as Mooncake's timed-out writes can),
  ``fault = Fault.DEAD`` (every write fails, nothing lands) and ``fault = Fault.PARTIAL`` (half of each
  write lands, then it fails: a failure never proves that nothing was written).

Writes that are not stalled are plain ``memmove`` calls done inside ``submit_write``.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
import time

from weightsync_agent.transport.base import DEFAULT_CHUNK_BYTES, TransferState, TransportError
from weightsync_agent.transport.regions import RegionTable

_SESSIONS: dict[str, MemoryTransport] = {}
_SESSIONS_LOCK = threading.Lock()
_IDS = itertools.count(1)


def session(session_id: str) -> MemoryTransport | None:
    """The open in-process session with this id, if any."""
    with _SESSIONS_LOCK:
        return _SESSIONS.get(session_id)


class Fault(enum.Enum):
    DEAD = "dead"
    PARTIAL = "partial"


class MemoryTransfer:
    def __init__(self, peer: str, nbytes: int, timeout_seconds: float) -> None:
        self.peer = peer
        self.nbytes = nbytes
        self._deadline = time.monotonic() + timeout_seconds
        self._timeout = timeout_seconds
        self._state = TransferState.PENDING
        self._error: str | None = None
        self._lock = threading.Lock()

    def poll(self) -> TransferState:
        with self._lock:
            if self._state is TransferState.PENDING and time.monotonic() >= self._deadline:
                # Like Mooncake: reporting the timeout does not cancel the write; it may still land.
                self._state = TransferState.FAILED
                self._error = f"no completion from {self.peer} within {self._timeout:g}s (the write may still land)"
            return self._state

    def error(self) -> str | None:
        with self._lock:
            return self._error

    def _finish(self, error: str | None) -> None:
        with self._lock:
            if self._state is TransferState.PENDING:
                self._state = TransferState.FAILED if error else TransferState.DONE
                self._error = error


class MemoryTransport:
    """One in-process session; ``session_id`` is what peers pass as ``peer``."""

    def __init__(
        self, name: str | None = None, *, timeout_seconds: float = 30.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> None:
        if timeout_seconds <= 0 or chunk_bytes <= 0:
            raise ValueError("timeout_seconds and chunk_bytes must be positive")
        self.chunk_bytes = chunk_bytes
        self._session_id = f"memory:{name if name is not None else next(_IDS)}"
        self.timeout_seconds = timeout_seconds
        self.fault: Fault | None = None
        self._regions = RegionTable(self._session_id)
        self._stalled = False
        self._held: list[tuple[MemoryTransport, MemoryTransfer, int, int, int]] = []
        self._lock = threading.Lock()
        self._closed = False
        with _SESSIONS_LOCK:
            if self._session_id in _SESSIONS:
                raise TransportError(f"session {self._session_id} already exists in this process")
            _SESSIONS[self._session_id] = self

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, address: int, nbytes: int) -> None:
        self._regions.add(address, nbytes)

    def unregister(self, address: int) -> None:
        self._regions.remove(address)

    def covers(self, address: int, nbytes: int) -> bool:
        return self._regions.covers(address, nbytes)

    def probe(self, peer: str, timeout: float) -> bool:
        target = session(peer)
        return target is not None and target.fault is not Fault.DEAD and not target._stalled

    def stall(self) -> None:
        """From now on, writes into this session are held, not applied (a hung peer)."""
        with self._lock:
            self._stalled = True

    def release(self) -> None:
        """Apply the held writes (late, as a resumed peer would) and stop holding new ones."""
        with self._lock:
            self._stalled = False
            held, self._held = self._held, []
        for source, transfer, local, remote, nbytes in held:
            if not source._closed:
                transfer._finish(self._apply(local, remote, nbytes, source.chunk_bytes))

    def submit_write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> MemoryTransfer:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self._closed:
            raise TransportError(f"{self._session_id} is closed")
        if nbytes and not self._regions.covers(local_address, nbytes):
            raise TransportError(
                f"{self._session_id}: local range [{local_address:#x}, +{nbytes}) is not inside one registered region"
            )
        transfer = MemoryTransfer(peer, nbytes, self.timeout_seconds)
        if nbytes == 0:
            transfer._finish(None)
            return transfer
        target = session(peer)
        if target is None:
            transfer._finish(f"no session {peer} in this process (closed or never opened)")
            return transfer
        with target._lock:
            if target._stalled:
                target._held.append((self, transfer, local_address, remote_address, nbytes))
                return transfer
        transfer._finish(target._apply(local_address, remote_address, nbytes, self.chunk_bytes))
        return transfer

    def _apply(self, local: int, remote: int, nbytes: int, chunk_bytes: int) -> str | None:
        """Apply one write into this (target) session, request by request; returns why it failed, or None."""
        if self._closed:
            return f"{self._session_id} was closed"
        if self.fault is Fault.DEAD:
            return f"{self._session_id} is dead (fault injected)"
        if self.fault is Fault.PARTIAL:
            half = nbytes // 2
            if self._regions.covers(remote, half):
                ctypes.memmove(remote, local, half)
            return f"{self._session_id} failed mid-write (fault injected; up to {half} of {nbytes} bytes landed)"
        refused: list[int] = []
        for offset in range(0, nbytes, chunk_bytes):
            length = min(chunk_bytes, nbytes - offset)
            if self._regions.covers(remote + offset, length):
                ctypes.memmove(remote + offset, local + offset, length)
            else:
                refused.append(offset)
        if not refused:
            return None
        where = f"chunk at +{refused[0]}: " if nbytes > chunk_bytes else ""
        return (
            f"{self._session_id} refused {where}[{remote + refused[0]:#x}, +{min(chunk_bytes, nbytes - refused[0])}): "
            "not inside any one registered region (other chunks may have landed)"
        )

    def close(self) -> None:
        """Leave the registry; held writes into or out of this session fail without landing."""
        if self._closed:
            return
        self._closed = True
        with _SESSIONS_LOCK:
            _SESSIONS.pop(self._session_id, None)
            others = list(_SESSIONS.values())
        with self._lock:
            held, self._held = self._held, []
        for _, transfer, _, _, _ in held:
            transfer._finish(f"{self._session_id} was closed")
        # Our source memory may be freed after close, so writes we left held elsewhere must never land.
        for other in others:
            with other._lock:
                mine = [h for h in other._held if h[0] is self]
                other._held = [h for h in other._held if h[0] is not self]
            for _, transfer, _, _, _ in mine:
                transfer._finish(f"{self._session_id} was closed before {other._session_id} resumed")

    def __enter__(self) -> MemoryTransport:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
