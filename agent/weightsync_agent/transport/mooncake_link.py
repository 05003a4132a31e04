"""One peer of a :class:`~weightsync_agent.transport.mooncake.MooncakeTransport`: its own engine, its
handshake on a helper thread, and the bookkeeping of the writes in flight to it.

Why a whole ``TransferEngine`` per peer: the Python wrapper holds one mutex per engine while it
handshakes with a new peer, and a peer that accepts the TCP connection but never answers (hung, or not
a Mooncake peer) holds it for 60 s; other calls on that engine wait (measured: a write to a healthy,
already connected peer returned after 61.7 s). A separate engine per peer confines that to the bad peer. The
handshake itself (a zero-length write, see ``_open_segment``) runs on a daemon thread, and writes to a
peer whose handshake has not answered within the timeout fail.

Writes are split into chunks submitted with ``transfer_submit_write`` and polled with the non-blocking
``transfer_check_status`` (the sync calls spin a core). A transfer fails when its peer has completed
no chunk for ``timeout_seconds``, so the deadline scales with the queue, not with one request's size.
"""

from __future__ import annotations

import ctypes
import enum
import threading
import time
from collections.abc import Callable
from typing import Any

from weightsync_agent.transport.base import TransferState
from weightsync_agent.transport.mooncake_config import describe


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


class MooncakeTransfer:
    """One ``submit_write``: its chunks, submitted together, tracked together."""

    def __init__(
        self, link: PeerLink | None, peer: str, local_address: int, remote_address: int, nbytes: int, chunk_bytes: int
    ) -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.local_address = local_address
        self.remote_address = remote_address
        self._link = link
        self._pieces = [(offset, min(chunk_bytes, nbytes - offset)) for offset in range(0, nbytes, chunk_bytes)]
        self._pending: dict[int, int] = {}  # Mooncake batch id -> chunk offset
        self._cause: str | None = None  # the first chunk failure, reported once the others settle
        self._state = TransferState.PENDING if nbytes else TransferState.DONE
        self._error: str | None = None
        self.created = time.monotonic()
        self.started: float | None = None

    @property
    def chunks(self) -> int:
        return len(self._pieces)

    def poll(self) -> TransferState:
        # A final state never changes again, so only pending transfers need the link's lock.
        if self._state is TransferState.PENDING and self._link is not None:
            self._link.advance(self)
        return self._state

    def error(self) -> str | None:
        return self._error

    def _fail(self, message: str) -> None:
        if self._state is TransferState.PENDING:
            self._state = TransferState.FAILED
            self._error = message

    def _describe(self, offset: int | None = None) -> str:
        span = f"[{self.remote_address:#x}, +{self.nbytes})"
        if offset is not None and len(self._pieces) > 1:
            span += f", chunk at +{offset}"
        return f"write of {self.nbytes} bytes to {self.peer} {span}"


class PeerLink:
    """The engine, handshake state and in-flight writes for one peer; every engine call happens under
    ``_lock`` except the handshake, which runs on the link's own thread."""

    def __init__(
        self, peer: str, new_engine: Callable[[], Any], timeout_seconds: float, retry_after: float | None = None
    ) -> None:
        self.peer = peer
        self.timeout_seconds = timeout_seconds
        self.retry_after = timeout_seconds if retry_after is None else retry_after
        self.state = LinkState.CONNECTING
        self.error: str | None = None
        self.last_progress = time.monotonic()
        self._new_engine = new_engine
        self._engine: Any = None
        self._lock = threading.Lock()
        self._answered = threading.Event()
        self._failed_at = 0.0
        self._deferred: list[MooncakeTransfer] = []
        self._active: set[MooncakeTransfer] = set()
        self._orphans: list[int] = []  # batch ids of abandoned chunks, polled until Mooncake frees them
        self._scratch = ctypes.create_string_buffer(8)  # the local side of the zero-length handshake write
        self.handshakes = 0
        self._start_handshake()

    # ------------------------------------------------------------------------------------ handshake

    def _start_handshake(self) -> None:
        self.state = LinkState.CONNECTING
        self.error = None
        self._answered.clear()
        self.handshakes += 1
        threading.Thread(target=self._handshake, daemon=True, name=f"mooncake-handshake-{self.peer}").start()

    def _handshake(self) -> None:
        error: str | None = None
        started = time.monotonic()
        try:
            engine = self._engine if self._engine is not None else self._new_engine()
            with self._lock:
                if self.state is LinkState.CLOSED:
                    return
                self._engine = engine
            error = self._open_segment(engine)
            if error is not None:
                error = f"handshake with {self.peer} failed after {time.monotonic() - started:.1f}s: {error}"
        except Exception as exc:  # a crash here must fail the link, not leave it connecting forever
            error = f"handshake with {self.peer} failed: {exc}"
        with self._lock:
            if self.state is LinkState.CLOSED:
                return
            if error is None:
                self.state = LinkState.READY
                self.last_progress = time.monotonic()
                deferred, self._deferred = self._deferred, []
                for transfer in deferred:
                    if transfer._state is TransferState.PENDING:
                        self._start(transfer)
            else:
                self.state = LinkState.FAILED
                self.error = error
                self._failed_at = time.monotonic()
                for transfer in self._deferred:
                    transfer._fail(f"{transfer._describe()} not started: {error}")
                self._deferred = []
            self._answered.set()

    def _open_segment(self, engine: Any) -> str | None:
        """Handshake through a zero-length write; returns why it failed, or None.

        It opens and caches the peer's segment and releases the GIL while it waits (up to 60 s for a
        silent peer). Measured: ``get_first_buffer_address`` holds the GIL through that wait, freezing
        every thread of the process, and ``send_probe`` does not cache the segment.
        """
        batch = engine.transfer_submit_write(self.peer, ctypes.addressof(self._scratch), 0, 0)
        if batch <= 0:
            return f"unreachable or not a Mooncake peer (transfer_submit_write returned {describe(batch)})"
        deadline = time.monotonic() + 5.0
        while (status := engine.transfer_check_status(batch)) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        return None if status == 1 else f"the empty handshake write ended with {describe(status)}"

    def wait_ready(self, timeout: float) -> bool:
        with self._lock:
            self._maybe_retry()
        self._answered.wait(max(timeout, 0.0))
        return self.state is LinkState.READY

    def _maybe_retry(self) -> None:
        if self.state is LinkState.FAILED and time.monotonic() - self._failed_at >= self.retry_after:
            self._start_handshake()

    # -------------------------------------------------------------------------------------- writes

    def submit(self, transfer: MooncakeTransfer) -> None:
        with self._lock:
            self._maybe_retry()
            if self.state is LinkState.READY:
                self._start(transfer)
            elif self.state is LinkState.CONNECTING:
                self._deferred.append(transfer)
            elif self.state is LinkState.FAILED:
                transfer._fail(f"{transfer._describe()} not started: {self.error}")
            else:
                transfer._fail(f"{transfer._describe()} not started: the transport is closed")

    def _start(self, transfer: MooncakeTransfer) -> None:
        transfer.started = time.monotonic()
        for offset, length in transfer._pieces:
            batch = self._engine.transfer_submit_write(
                self.peer, transfer.local_address + offset, transfer.remote_address + offset, length
            )
            # 0 is a failure too (measured: and transfer_check_status(0) crashes the process).
            if batch <= 0:
                transfer._cause = f"{transfer._describe(offset)}: transfer_submit_write returned {describe(batch)}"
                break
            transfer._pending[batch] = offset
        self._active.add(transfer)
        self._settle(transfer)

    def advance(self, transfer: MooncakeTransfer) -> None:
        with self._lock:
            self._reap_orphans()
            if transfer._state is not TransferState.PENDING:
                return
            now = time.monotonic()
            if transfer.started is None:
                if self.state is LinkState.CONNECTING and now - transfer.created > self.timeout_seconds:
                    transfer._fail(
                        f"{transfer._describe()} not started: {self.peer} did not answer the handshake "
                        f"within {self.timeout_seconds:g}s"
                    )
                    self._deferred.remove(transfer)
                return
            self._check(transfer)
            if transfer._state is not TransferState.PENDING:
                return
            if now - max(self.last_progress, transfer.started) > self.timeout_seconds:
                for other in list(self._active):  # progress elsewhere on this peer counts too
                    self._check(other)
                if transfer._state is TransferState.PENDING and (
                    time.monotonic() - max(self.last_progress, transfer.started) > self.timeout_seconds
                ):
                    transfer._fail(
                        f"{transfer._describe()}: no progress from {self.peer} within {self.timeout_seconds:g}s "
                        "(hung or overloaded peer; Mooncake does not cancel, so part or all of it may still land)"
                    )
                    self._abandon(transfer)

    def _check(self, transfer: MooncakeTransfer) -> None:
        for batch, offset in list(transfer._pending.items()):
            status = self._engine.transfer_check_status(batch)  # frees the id once final
            if status == 0:
                continue
            del transfer._pending[batch]
            if status == 1:
                self.last_progress = time.monotonic()
            elif transfer._cause is None:
                transfer._cause = (
                    f"{transfer._describe(offset)}: Mooncake reported {describe(status)}; the target refused the "
                    "range (not inside one registered region) or the connection broke; other chunks may have landed"
                )
        self._settle(transfer)

    def _settle(self, transfer: MooncakeTransfer) -> None:
        # A failed transfer is reported once none of its chunks is still moving, so that FAILED means
        # "settled" (except after a timeout, where Mooncake cannot cancel what it has in flight).
        if not transfer._pending:
            self._active.discard(transfer)
            if transfer._cause is None:
                transfer._state = TransferState.DONE
            else:
                transfer._fail(transfer._cause)

    def _abandon(self, transfer: MooncakeTransfer) -> None:
        self._orphans.extend(transfer._pending)
        transfer._pending.clear()
        self._active.discard(transfer)

    def _reap_orphans(self) -> None:
        # Only once READY: during a handshake the engine's mutex may be held for up to 60 s.
        if self._orphans and self.state is LinkState.READY:
            self._orphans = [b for b in self._orphans if self._engine.transfer_check_status(b) == 0]

    # -------------------------------------------------------------------------------------- close

    def close(self) -> Any:
        """Fail whatever is still pending; returns the engine for the caller to drop."""
        with self._lock:
            self.state = LinkState.CLOSED
            for transfer in [*self._deferred, *self._active]:
                transfer._fail(f"{transfer._describe()}: the transport was closed (part of it may have landed)")
            self._deferred, self._active, self._orphans = [], set(), []
            engine, self._engine = self._engine, None
            self._answered.set()
            return engine
