"""The reference engine closes a rank's write window at its verification (docs/faults.md, finding 4).

A rank's memory takes Mooncake writes from ``begin`` until its check: ``verify`` unregisters it *before* hashing,
so a foreign write after the check is refused and the commit labels exactly the bytes that were checked; a failed
check registers it again (same addresses) for the sources' rewrite. Over real Mooncake (TCP loopback, in this
process): the engine's ranks, a source and a foreign peer are three sessions.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from refsync import write_version

from weightsync_agent.targets.engine_client import EngineClient
from weightsync_agent.transport.base import Transport
from weightsync_agent.transport.mooncake import MooncakeTransport
from weightsync_testing.foreign_write import ForeignWriter
from weightsync_testing.reference_engine.model import full_state
from weightsync_testing.reference_engine.server import ReferenceEngine, serve_in_thread

TP = 2
BUCKET = 8192


def mooncake() -> Transport:
    return MooncakeTransport("127.0.0.1", "tcp", force_tcp=True, timeout_seconds=5)


class Rig:
    """One engine, a source and a foreign peer, shared by the tests of a mode (Mooncake sessions take seconds to
    close); each test runs its own round, of the next version."""

    def __init__(self, engine: ReferenceEngine, client: EngineClient) -> None:
        self.engine = engine
        self.client = client
        self.source = mooncake()
        manifest = client.manifest(0)
        tensor = manifest.tensors[len(manifest.tensors) // 2]  # a weight in the middle of rank 0 (as the fault matrix)
        self.foreign = ForeignWriter(manifest.session_id, tensor.address, tensor.nbytes, timeout_seconds=5)
        self.version, self.round_id = "", ""

    def begin_next(self) -> None:
        held = self.engine.weight_version
        self.version = str(int(held) + 1 if held.isdigit() else 1)
        self.round_id = f"r{self.version}"
        if not self.engine.staged:
            self.client.pause_generation(round_id=self.round_id)
        self.client.begin(self.version, round_id=self.round_id)

    def write(self, rank: int) -> list[str]:
        """This round's version into ``rank``, as a source writes it; the checksums it reports."""
        written = write_version(self.source, self.client.manifest(rank), full_state(int(self.version)), BUCKET)
        assert not written.failed, "the source's writes were refused"
        return written.checksums

    def verify(self, rank: int, sums: list[str]) -> bool:
        return self.client.verify(rank, self.version, BUCKET, sums, round_id=self.round_id).ok

    def commit(self) -> None:
        assert self.client.commit(self.version, round_id=self.round_id)["weight_version"] == self.version
        if not self.engine.staged:
            self.client.continue_generation(round_id=self.round_id)

    def writable(self) -> list[bool]:
        return list(self.client.status()["writable"])

    def serves(self, rank: int, sums: list[str]) -> bool:
        """Whether the weights ``rank`` computes with (live, also in staged mode) hash to ``sums``."""
        return self.engine.memory[rank].verify(BUCKET, sums, served=True).ok

    def close(self) -> None:
        self.foreign.close()
        self.source.close()


@pytest.fixture(scope="module", params=[False, True], ids=["live", "staged"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    engine = ReferenceEngine(engine=1, tp=TP, seed=0, transports=[mooncake() for _ in range(TP)])
    with serve_in_thread(engine) as server:
        client = EngineClient(server.url, timeout=10)
        client.stage(request.param)
        r = Rig(engine, client)
        yield r
        r.close()
    engine.close()


def test_a_foreign_write_after_a_ranks_verification_is_refused_and_the_commit_serves_the_verified_bytes(
    rig: Rig,
) -> None:
    rig.begin_next()
    sums = {rank: rig.write(rank) for rank in range(TP)}
    assert rig.verify(0, sums[0])

    assert not rig.foreign.write(), "a write after rank 0's verification landed"
    assert rig.client.checksums(0, BUCKET) == sums[0]
    assert rig.writable() == [False, True]  # rank 1 is not verified yet: its sources may still write

    assert rig.verify(1, sums[1])
    rig.commit()
    assert rig.writable() == [False, False]
    assert all(rig.serves(rank, sums[rank]) for rank in range(TP)), "the commit serves other bytes than it verified"


def test_a_failed_verification_opens_the_rank_again_for_the_rewrite(rig: Rig) -> None:
    """The sources' writes land, a foreign write lands over them before the check (the window is open): the check
    fails, and the retry's writes, to the addresses the sources' manifests name, must land again."""
    rig.begin_next()
    sums = {rank: rig.write(rank) for rank in range(TP)}
    assert rig.verify(1, sums[1])
    assert rig.foreign.write(), "rank 0 is not verified yet: the write must land"
    assert not rig.verify(0, sums[0])
    assert rig.writable() == [True, False]

    assert rig.write(0) == sums[0]  # the retry: rank 0 takes the sources' writes again
    assert rig.verify(0, sums[0])
    assert rig.writable() == [False, False]
    rig.commit()
    assert all(rig.serves(rank, sums[rank]) for rank in range(TP))
