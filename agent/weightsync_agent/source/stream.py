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
from typing import Literal

StreamState = Literal["open", "closed", "aborted"]


class StreamGate:
    """The trainer's side of one streamed version; thread-safe, shared with the source that sends it."""

    def __init__(self, version: int) -> None:
        self.version = version
        self._state: StreamState = "open"
        self.reason: str | None = None
        self._cond = threading.Condition()

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
                self._state, self.reason = state, reason
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
