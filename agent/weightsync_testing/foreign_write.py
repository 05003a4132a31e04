"""A Mooncake peer with no part in the group, writing garbage into an engine's memory: the data-plane fault that fault
tests and the fault matrix place exactly in a round (Mooncake's data ports carry no credential, docs/security.md).
Test-only."""

from __future__ import annotations

import time

import torch

from weightsync_agent.transport.base import TransferState, TransportError
from weightsync_agent.transport.mooncake import MooncakeTransport

#: The byte written: far from any float a model holds, so a landed write never hashes like the right bytes.
GARBAGE = 0x5A


class ForeignWriter:
    """Writes :data:`GARBAGE` over ``nbytes`` at ``address`` of the Mooncake session ``session`` (where an engine
    publishes a weight), one whole, acknowledged write per :meth:`write`, so a caller places it exactly."""

    def __init__(self, session: str, address: int, nbytes: int, *, timeout_seconds: float = 10.0) -> None:
        self.session, self.address = session, address
        self.garbage = torch.full((nbytes,), GARBAGE, dtype=torch.uint8)
        self.transport = MooncakeTransport("127.0.0.1", "tcp", force_tcp=True, timeout_seconds=timeout_seconds)
        self.transport.register(self.garbage.data_ptr(), self.garbage.numel())
        #: Writes that landed (the target's memory was registered: an engine open to writes).
        self.writes = 0

    def write(self) -> bool:
        """One write; whether it landed (False: refused, e.g. memory the engine keeps unregistered between rounds)."""
        try:
            transfer = self.transport.submit_write(
                self.session, self.garbage.data_ptr(), self.address, self.garbage.numel()
            )
            while (state := transfer.poll()) is TransferState.PENDING:
                time.sleep(0.0005)
        except TransportError:
            return False
        if state is TransferState.DONE:
            self.writes += 1
        return state is TransferState.DONE

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> ForeignWriter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
