"""Which transport the source tests run on: the project's MemoryTransport (transport/local.py) by
default, the in-test FakeTransport (same Protocol, same target-side checks, writes on a worker thread
per peer) where a test asks for it or MemoryTransport is absent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from source_helpers import FakeTransport


def memory_transport_class() -> Any:
    try:
        from weightsync_agent.transport.memory import MemoryTransport  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return MemoryTransport


class Counting:
    """Wraps a transport and counts submitted writes (so tests can prove nothing was sent)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.submitted = 0

    @property
    def session_id(self) -> str:
        return str(self.inner.session_id)

    def register(self, address: int, nbytes: int) -> None:
        self.inner.register(address, nbytes)

    def unregister(self, address: int) -> None:
        self.inner.unregister(address)

    def probe(self, peer: str, timeout: float) -> bool:
        return bool(self.inner.probe(peer, timeout))

    def submit_write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> Any:
        self.submitted += 1
        return self.inner.submit_write(peer, local_address, remote_address, nbytes)

    def close(self) -> None:
        self.inner.close()


@dataclass
class Party:
    """One process's transport, plus the test-only knobs the tests need."""

    transport: Any

    def submitted(self) -> int:
        return int(getattr(self.transport, "submitted", 0))

    def stall(self) -> bool:
        """Make this peer accept writes and never complete them; False if the transport can't."""
        if hasattr(self.transport, "stall"):
            self.transport.stall()
            return True
        return False

    def release(self) -> None:
        if hasattr(self.transport, "release"):
            self.transport.release()

    def close(self) -> None:
        self.release()
        self.transport.close()


def new_transport(kind: str = "", *, counting: bool = False) -> Party:
    """``""``: MemoryTransport when present, else FakeTransport; ``"memory"`` or ``"fake"`` to insist."""
    transport: Any = None
    if kind in ("", "memory"):
        cls = memory_transport_class()
        if cls is not None:
            transport = cls()
        elif kind == "memory":
            raise RuntimeError("MemoryTransport is not available")
    if transport is None:
        transport = FakeTransport()
    return Party(Counting(transport) if counting else transport)


def kind_in_use() -> str:
    return "memory" if memory_transport_class() is not None else "fake"
