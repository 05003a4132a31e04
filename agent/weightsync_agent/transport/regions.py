"""Registered memory regions of one transport session, checked the way Mooncake's target checks them.

Mooncake validates every request against the target's *current* registrations: the whole range must
lie inside one registered buffer (a write spanning two adjacent registrations is refused), and a range
that overlaps an existing registration cannot be registered again. Both transports keep this table so
that the in-process one rejects exactly what the real one rejects.
"""

from __future__ import annotations

import bisect
import threading

from weightsync_agent.transport.base import TransportError


class RegionTable:
    """Non-overlapping ``[address, address + nbytes)`` ranges; thread-safe."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, address: int, nbytes: int) -> None:
        if address <= 0 or nbytes <= 0:
            raise TransportError(f"{self._owner}: cannot register [{address:#x}, +{nbytes}): empty or null range")
        with self._lock:
            at = bisect.bisect_left(self._starts, address)
            neighbours = self._starts[max(at - 1, 0) : at + 1]
            for start in neighbours:
                if start < address + nbytes and address < start + self._sizes[start]:
                    raise TransportError(
                        f"{self._owner}: [{address:#x}, +{nbytes}) overlaps the registered region "
                        f"[{start:#x}, +{self._sizes[start]}); register each buffer once"
                    )
            self._starts.insert(at, address)
            self._sizes[address] = nbytes

    def remove(self, address: int) -> int:
        """Forget the region that starts at ``address``; returns its size."""
        with self._lock:
            nbytes = self._sizes.pop(address, None)
            if nbytes is None:
                raise TransportError(f"{self._owner}: {address:#x} is not the start of a registered region")
            self._starts.remove(address)
            return nbytes

    def covers(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies inside one registered region."""
        with self._lock:
            at = bisect.bisect_right(self._starts, address) - 1
            if at < 0:
                return False
            start = self._starts[at]
            return address + nbytes <= start + self._sizes[start]

    def items(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(start, self._sizes[start]) for start in self._starts]
