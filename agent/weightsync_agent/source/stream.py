"""A streamed version: the trainer stages while its source already sends the buckets it completed.

The trainer holds a :class:`StreamGate` for one version. While it is ``open`` the source's publish
(:meth:`weightsync_agent.source.writer.Source.publish` with ``stream=``) submits a target's next bucket
as soon as every part of every tensor that bucket overlaps is staged, and otherwise waits. ``close``
says the trainer staged everything it will: a bucket still incomplete then fails the publish at once,
naming a missing part. ``abort`` (the trainer's code raised) fails it at once too. Memory stays
bounded by construction: the replica is the only copy, and at most ``max_inflight`` buckets per target
are on the wire.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from weightsync_agent.source.replica import ReplicaSet

StreamState = Literal["open", "closed", "aborted"]


class Gate(Protocol):
    """What a streaming publish reads: the version, whether the trainer still stages it, and why it gave up."""

    @property
    def version(self) -> int: ...

    @property
    def state(self) -> StreamState: ...

    @property
    def reason(self) -> str | None: ...


class StreamGate:
    """The trainer's side of one streamed version; thread-safe, shared with the source that sends it."""

    def __init__(self, version: int) -> None:
        self._version = version
        self._state: StreamState = "open"
        self._reason: str | None = None
        self._cond = threading.Condition()

    @property
    def version(self) -> int:
        return self._version

    @property
    def reason(self) -> str | None:
        return self._reason

    @property
    def state(self) -> StreamState:
        return self._state

    def close(self) -> None:
        """The trainer staged everything for this version."""
        self._settle("closed", None)

    def abort(self, reason: str) -> None:
        """The trainer gave up on this version: nothing more is staged, the publish fails."""
        self._settle("aborted", reason)

    def _settle(self, state: StreamState, reason: str | None) -> None:
        with self._cond:
            if self._state == "open":
                self._state, self._reason = state, reason
            self._cond.notify_all()

    def wait(self, timeout: float) -> StreamState:
        """Block until the gate leaves ``open`` or ``timeout`` passes; returns the state."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._state == "open":
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._state


class ReplicaGate:
    """The sidecar's view of a trainer process's stream: the mark the client files in the shared replica files
    (:meth:`~weightsync_agent.source.replica.ReplicaSet.mark_stream`). A mark that disappears (the trainer
    restaged without streaming) reads as aborted."""

    def __init__(self, replicas: ReplicaSet, version: int) -> None:
        self._replicas = replicas
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    @property
    def state(self) -> StreamState:
        return self._replicas.stream_state(self._version) or "aborted"

    @property
    def reason(self) -> str | None:
        return "the trainer process aborted the stream (its code raised, or it stopped streaming this version)"
