"""Streaming rounds and digests filed at staging: in-process rounds against real torch replicas.

A stream publishes a version while the trainer stages it: a bucket goes out once every part it overlaps
is staged. Staging files each completed bucket's digest next to the staged flags, and a publish reuses it
instead of a second pass over the replica. The Mooncake tier (real processes) is test_source_streaming_mooncake.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mooncake_peer import bench_model
from source_helpers import MODEL, TargetMemory, as_bytes, expected_local, full_state, make_plan, tp_layout
from transports import Party, new_transport

from weightsync.plan import Target
from weightsync_agent.client.trainer import ClientError, RoundOutcome, WeightSyncClient
from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import source_checksum, target_checksum
from weightsync_agent.source.replica import Replica, ReplicaBusyError, ReplicaSet
from weightsync_agent.source.stream import StreamGate
from weightsync_agent.source.writer import InProcessSourceControl, PublishError, PublishResult, Source, streamed_ready
from weightsync_agent.targets.adapter import TargetVerdict

MIB = 1 << 20
MODEL_MIB = 4  # four 1 MiB tensors: with 1 MiB buckets, bucket i is tensor w{i}


def big_fulls(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f.name: torch.randn(f.shape, generator=gen).to(torch.bfloat16)
        for _, group in bench_model(MODEL_MIB)
        for f in group
    }


class StreamRig:
    """``sources`` trainer ranks (one Source each, this process) writing ``engines`` engines at TP1."""

    def __init__(
        self, engines: int = 1, sources: int = 1, *, timeout: int = 10, staging: str = "live", pause: str = "overlap"
    ) -> None:
        """``pause``: the plan's ``transfer.pause`` (overlap: a streamed round writes while the trainer stages)."""
        self.plan = make_plan(sources, engines, 1, timeout=timeout, pause=pause)
        self.parties: list[Party] = [new_transport() for _ in range(sources)]
        self.memory: dict[Target, TargetMemory] = {}
        for assignment in self.plan.sources:
            for target in assignment.targets:
                party = new_transport()
                self.parties.append(party)
                mem = TargetMemory(
                    tp_layout(bench_model(MODEL_MIB), 1, 0),
                    engine=target[0],
                    rank=0,
                    session_id=party.transport.session_id,
                )
                party.transport.register(mem.address, mem.buffer.numel())
                self.memory[target] = mem

    def manifests(self, source: int) -> dict[Target, object]:
        return {t: self.memory[t].manifest for t in self.plan.sources[source].targets}

    def holds(self, target: Target, fulls: dict[str, torch.Tensor], names: Sequence[str] | None = None) -> bool:
        mem = self.memory[target]
        return all(
            torch.equal(mem.raw(e.name), as_bytes(expected_local(e, fulls)))
            for e in mem.manifest.tensors
            if names is None or any(p.source in names for p in e.parts)
        )

    def close(self) -> None:
        for party in reversed(self.parties):
            party.close()


@pytest.fixture
def rig() -> Iterator[StreamRig]:
    made = StreamRig()
    yield made
    made.close()


class VerifyingEngine:
    """An engine for the round driver: verifies by hashing its own memory, and logs when each step came."""

    def __init__(self, index: int, rig: StreamRig) -> None:
        self.index = index
        self.rig = rig
        self.version = 0
        self.events: list[tuple[str, float]] = []

    def names(self) -> list[str]:
        return [e for e, _ in self.events]

    def at(self, step: str) -> float:
        return next(t for e, t in self.events if e == step)

    def _log(self, step: str) -> None:
        self.events.append((step, time.monotonic()))

    def pause(self, timeout: float, *, round_id: str) -> None:
        self._log("pause")

    def resume(self, timeout: float, *, round_id: str) -> None:
        self._log("resume")

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        self._log("begin")

    def verify(
        self, rank: int, version: int, checksums: Sequence[str], timeout: float, *, round_id: str
    ) -> TargetVerdict:
        self._log("verify")
        mem = self.rig.memory[(self.index, rank)]
        buckets = plan_buckets(mem.manifest, self.rig.plan.transfer.bucket_bytes)
        bad = [b.index for b, want in zip(buckets, checksums, strict=True) if target_checksum(b) != want]
        return TargetVerdict(ok=not bad and len(buckets) == len(checksums), mismatched=bad)

    def commit(self, version: int, timeout: float, *, round_id: str) -> None:
        self._log("commit")
        self.version = version

    def abort(self, version: int, timeout: float, *, round_id: str, written: bool = True) -> None:
        self._log("abort")


# --- Digests filed at staging -------------------------------------------------------------------------


def test_staging_files_each_buckets_digest_and_the_publish_reuses_them(rig: StreamRig) -> None:
    target: Target = (0, 0)
    with Source(rig.parties[0].transport, rig.plan, 0, rig.manifests(0), pin=False) as source:  # type: ignore[arg-type]
        replica = source.replica_for(target)
        buckets = source.buckets[target]
        assert replica.digest_grain == rig.plan.transfer.bucket_bytes and replica.chunks == len(buckets) == 4
        fulls = big_fulls(1)
        source.replicas.stage("w0", fulls["w0"])
        assert replica.digest(0) == source_checksum(buckets[0], replica.address)  # complete: hashed as staged
        assert [replica.digest(i) for i in (1, 2, 3)] == [None, None, None]
        source.replicas.stage_many({k: v for k, v in fulls.items() if k != "w0"})
        result = source.publish(1, timeout=10)
        assert result.ok, result.summary()
        assert (result.digests_reused, result.digests_hashed) == (4, 0)  # no second pass over the replica
        assert result.targets[target].checksums == [
            target_checksum(b) for b in plan_buckets(rig.memory[target].manifest, source.bucket_bytes)
        ]
        # Restaging a tensor replaces its bucket's digest: the filed one always describes the bytes held now.
        source.replicas.reset()
        changed = big_fulls(2)
        source.replicas.stage("w2", changed["w2"])
        assert replica.digest(2) == source_checksum(buckets[2], replica.address) != result.targets[target].checksums[2]
        assert replica.digest(1) == result.targets[target].checksums[1]  # untouched bytes keep theirs
        for seed in range(3, 8):  # restaged back to back, while the previous hash may still run: the last wins
            source.replicas.stage("w3", big_fulls(seed)["w3"])
        assert replica.digest(3) == source_checksum(buckets[3], replica.address)
        assert replica.digest(3) == source_checksum(buckets[3], replica.address)  # and stays so


@settings(max_examples=40, deadline=None)
@given(
    tp=st.sampled_from([1, 2]),
    rank=st.integers(0, 1),
    grain=st.integers(3, 700),
    order=st.permutations([f.name for _, group in MODEL for f in group]),
)
def test_a_chunk_is_hashed_once_every_part_it_overlaps_is_staged_and_its_digest_is_the_bucket_checksum(
    tp: int, rank: int, grain: int, order: list[str]
) -> None:
    # MODEL's tensors are cut TP ways; row-parallel parts are strided inside their tensor, fused ones share it, so
    # a chunk is final only when every part of every tensor it overlaps is staged, whatever the staging order.
    mem = TargetMemory(tp_layout(MODEL, tp, rank % tp), engine=0, rank=rank % tp, session_id="memory:0")
    replica = Replica(mem.manifest, pin=False, digest_grain=grain)
    try:
        buckets = plan_buckets(mem.manifest, grain)
        assert replica.chunks == len(buckets)
        fulls = full_state(3)
        for name in order:
            replica.stage(name, fulls[name])
            for chunk, bucket in enumerate(buckets):
                digest = replica.digest(chunk)
                if replica.staged(replica.layout.slots_in(chunk * grain, chunk * grain + bucket.nbytes)):
                    assert digest == source_checksum(bucket, replica.address), (name, chunk)
                else:
                    assert digest is None, (name, chunk)
        assert all(replica.digest(c) is not None for c in range(replica.chunks))
    finally:
        replica.close()


def test_digests_live_in_the_shared_file_another_mapping_reads(tmp_path: Path, rig: StreamRig) -> None:
    manifest = rig.memory[(0, 0)].manifest
    made = ReplicaSet.for_manifests([manifest], shm_dir=tmp_path, pin=False, digest_grain=MIB)
    other = ReplicaSet.attach(tmp_path, pin=False)  # as the sidecar maps the trainer's file
    try:
        made.stage_many(big_fulls(4))
        made.flush_digests()  # the trainer's client does this before it asks the sidecar to publish
        mine, theirs = next(iter(made)), next(iter(other))
        assert theirs.digest_grain == MIB
        assert [theirs.digest(c) for c in range(4)] == [mine.digest(c) for c in range(4)]
        assert all(d is not None for d in (theirs.digest(c) for c in range(4)))
    finally:
        other.close()
        made.close(unlink=True)


def test_a_digest_another_process_is_still_computing_is_waited_for_then_left_to_the_reader(
    tmp_path: Path, rig: StreamRig
) -> None:
    manifest = rig.memory[(0, 0)].manifest
    made = ReplicaSet.for_manifests([manifest], shm_dir=tmp_path, pin=False, digest_grain=MIB)
    other = ReplicaSet.attach(tmp_path, pin=False)  # the sidecar's mapping
    try:
        made.stage_many(big_fulls(11))
        made.flush_digests()
        mine, theirs = next(iter(made)), next(iter(other))
        want = mine.digest(0)
        mine._valid[0] = 2  # as while the trainer's digest thread hashes chunk 0
        threading.Timer(0.1, lambda: mine._valid.__setitem__(0, 1)).start()
        began = time.monotonic()
        assert theirs.digest(0, until=began + 5) == want  # waited for the trainer's hash, not recomputed
        assert 0.05 < time.monotonic() - began < 5
        mine._valid[0] = 2  # a trainer that died mid-hash: the reader gives up at ``until`` and hashes itself
        began = time.monotonic()
        assert theirs.digest(0, until=began + 0.2) is None
        assert theirs.digest(0) is None  # without a wait: at once
        assert time.monotonic() - began < 1
    finally:
        other.close()
        made.close(unlink=True)


def test_an_unverified_source_hashes_nothing_at_staging(rig: StreamRig) -> None:
    plan = make_plan(1, 1, 1)
    unverified = plan.model_copy(update={"transfer": plan.transfer.model_copy(update={"verify": False})})
    with Source(rig.parties[0].transport, unverified, 0, rig.manifests(0), pin=False) as source:  # type: ignore[arg-type]
        assert source.replica_for((0, 0)).digest_grain == 0
        source.replicas.stage_many(big_fulls(5))
        result = source.publish(1, timeout=10)
        assert result.ok and (result.digests_reused, result.digests_hashed) == (0, 0)


# --- Streaming -----------------------------------------------------------------------------------------


def test_a_stream_sends_each_bucket_once_staged_while_the_rest_is_still_staging(rig: StreamRig) -> None:
    target: Target = (0, 0)
    client = WeightSyncClient.in_process(rig.parties[0].transport, rig.plan, 0, rig.manifests(0), pin=False)  # type: ignore[arg-type]
    fulls = big_fulls(6)
    with client:
        with client.stream(1) as stream:
            stream.stage("w0", fulls["w0"])
            deadline = time.monotonic() + 10
            while not rig.holds(target, fulls, ["w0"]) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert rig.holds(target, fulls, ["w0"])  # bucket 0 landed while w1..w3 are not even staged
            assert not rig.holds(target, fulls, ["w1"])
            with pytest.raises(ReplicaBusyError, match="already staged in this stream"):
                stream.stage("w0", fulls["w0"])  # its bucket may be on the wire: never overwritten in a stream
            for name in ("w1", "w2", "w3"):
                stream.stage(name, fulls[name])
        result = stream.outcome
        assert isinstance(result, PublishResult) and result.ok, result
        assert rig.holds(target, fulls) and client.committed == 1 and client.missing()
        buckets = plan_buckets(rig.memory[target].manifest, MIB)
        assert result.targets[target].checksums == [target_checksum(b) for b in buckets]
        assert result.digests_reused == 4


def test_a_streamed_source_is_ready_at_its_first_bucket_to_overlap_and_at_its_last_for_a_minimal_pause(
    rig: StreamRig,
) -> None:
    """What a streamed source's prepare waits for (``weightsync.api.pause``), asked with a deadline already passed so
    that each answer is what is staged now."""
    source = Source(rig.parties[0].transport, rig.plan, 0, rig.manifests(0), pin=False)  # type: ignore[arg-type]
    gate, fulls = StreamGate(1), big_fulls(12)

    def ready(write_while_staging: bool) -> str | None:
        return streamed_ready(source, gate, time.monotonic(), write_while_staging=write_while_staging)

    try:
        assert "staged no complete bucket of 1" in (ready(True) or "")
        source.replicas.stage("w0", fulls["w0"])
        assert ready(True) is None  # overlap: bucket 0 can be written
        for name in ("w1", "w2"):
            source.replicas.stage(name, fulls[name])
            assert "staged not every bucket of 1" in (ready(False) or "")  # minimal: not yet
        source.replicas.stage("w3", fulls["w3"])
        assert ready(False) is None
        source.replicas.reset()
        source.replicas.stage("w0", fulls["w0"])
        gate.close()  # the trainer says it is done with w1..w3 missing: no wait can help
        assert "closed with 3 part(s) not staged" in (ready(False) or "")
    finally:
        source.close()


def test_a_stream_closed_right_after_its_last_part_is_ready_not_missing_parts(rig: StreamRig) -> None:
    """The trainer stages its last part and closes the stream while ``prepare`` looks (scenario B's second run
    failed a round so, ``pause: minimal``): here the close lands just as the stream's state is read."""
    source = Source(rig.parties[0].transport, rig.plan, 0, rig.manifests(0), pin=False)  # type: ignore[arg-type]
    fulls = big_fulls(13)

    class ClosingAsRead(StreamGate):
        @property
        def state(self) -> str:
            if source.replicas.missing():
                source.replicas.stage("w3", fulls["w3"])
                self.close()
            return super().state

    gate = ClosingAsRead(1)
    try:
        for name in ("w0", "w1", "w2"):
            source.replicas.stage(name, fulls[name])
        assert streamed_ready(source, gate, time.monotonic() + 5, write_while_staging=False) is None
    finally:
        source.close()


def test_a_stream_closed_with_parts_missing_fails_naming_one(rig: StreamRig) -> None:
    client = WeightSyncClient.in_process(rig.parties[0].transport, rig.plan, 0, rig.manifests(0), pin=False)  # type: ignore[arg-type]
    fulls = big_fulls(7)
    with client:
        with (
            pytest.raises(
                PublishError,
                match=r"bucket 2 of 4: stream: the stream closed with 1 part\(s\) not staged \(e\.g\. t2\.w2",
            ),
            client.stream(1) as stream,
        ):
            for name in ("w0", "w1", "w3"):
                stream.stage(name, fulls[name])
        assert client.committed is None
        with client.stream(1) as stream:  # the same version again: a new stream stages everything anew
            stream.stage_many(fulls)
        assert stream.outcome is not None and stream.outcome.ok and rig.holds((0, 0), fulls)


@pytest.mark.parametrize("pause", ["overlap", "minimal"])
def test_streaming_round_pauses_at_the_first_complete_bucket_or_the_last_and_commits_after_the_last(pause: str) -> None:
    """overlap: the engines pause once the first bucket can be written; minimal: once every bucket is staged."""
    rig = StreamRig(engines=2, pause=pause)
    engines = {e: VerifyingEngine(e, rig) for e in range(2)}
    client = WeightSyncClient.coordinating(
        rig.parties[0].transport,
        rig.plan,
        0,
        rig.manifests(0),
        engines,
        pin=False,  # type: ignore[arg-type]
    )
    fulls = big_fulls(8)
    staged_at: dict[str, float] = {}
    try:
        with client, client.stream(3) as stream:
            time.sleep(0.3)  # the trainer is slow to gather its first layer: nothing is paused meanwhile
            assert all(not e.events for e in engines.values())
            for name, tensor in fulls.items():
                stream.stage(name, tensor)
                staged_at[name] = time.monotonic()
                time.sleep(0.05)
        outcome = stream.outcome
        assert isinstance(outcome, RoundOutcome) and outcome.ok, outcome and outcome.summary()
        for engine in engines.values():
            assert engine.names() == ["pause", "begin", "verify", "commit", "resume"]
            assert engine.at("pause") >= staged_at["w0"]  # not before the first write needs it
            if pause == "minimal":  # the engines served through the whole staging
                assert engine.at("pause") >= staged_at["w3"]
            assert engine.at("verify") >= staged_at["w3"]
            assert engine.version == 3
        assert all(rig.holds(t, fulls) for t in rig.memory)
    finally:
        rig.close()


def test_an_exception_mid_stream_aborts_the_version_and_no_engine_claims_it() -> None:
    rig = StreamRig(engines=1)
    engines = {0: VerifyingEngine(0, rig)}
    client = WeightSyncClient.coordinating(
        rig.parties[0].transport,
        rig.plan,
        0,
        rig.manifests(0),
        engines,
        pin=False,  # type: ignore[arg-type]
    )
    fulls = big_fulls(9)
    try:
        with client:
            with pytest.raises(RuntimeError, match="all-gather failed"), client.stream(4) as stream:
                stream.stage("w0", fulls["w0"])
                stream.stage("w1", fulls["w1"])
                deadline = time.monotonic() + 10
                while not rig.holds((0, 0), fulls, ["w1"]) and time.monotonic() < deadline:
                    time.sleep(0.005)
                raise RuntimeError("all-gather failed")
            outcome = stream.outcome
            assert isinstance(outcome, RoundOutcome) and not outcome.ok
            assert "aborted the stream" in (outcome.round.reason or "")
            assert engines[0].version == 0 and "commit" not in engines[0].names()
            # Live weights were written: the engine stays paused (reporting v0) until a later round succeeds.
            assert outcome.round.engines_paused and "resume" not in engines[0].names()
            assert client.committed is None
            with client.stream(4) as stream:  # the trainer retries the version from scratch
                stream.stage_many(fulls)
            assert stream.outcome is not None and stream.outcome.ok
            assert engines[0].version == 4 and rig.holds((0, 0), fulls)
    finally:
        rig.close()


def test_a_rank_that_never_finishes_staging_times_the_round_out_and_nothing_commits() -> None:
    rig = StreamRig(engines=2, sources=2, timeout=2)
    engines = {e: VerifyingEngine(e, rig) for e in range(2)}
    other = Source(rig.parties[1].transport, rig.plan, 1, rig.manifests(1), pin=False)  # type: ignore[arg-type]
    other_control = InProcessSourceControl(other)
    other_gate = StreamGate(5)
    other_control.stream(other_gate)  # rank 1 streams too, and stalls after its first tensor
    client = WeightSyncClient.coordinating(
        rig.parties[0].transport,
        rig.plan,
        0,
        rig.manifests(0),  # type: ignore[arg-type]
        engines,
        other_sources={1: other_control},
        pin=False,
        retries=0,
    )
    fulls = big_fulls(10)
    try:
        with client:
            other.replicas.stage("w0", fulls["w0"])
            began = time.monotonic()
            with (
                # Either side of the race names the stalled rank: the driver's wait for source 1 ends, or source 1's
                # writer reports the bucket its trainer never finished staging.
                pytest.raises(
                    PublishError,
                    match=r"source 1 (write did not finish before the round's deadline"
                    r"|failed writing .* not staged by the trainer before the round's deadline)",
                ),
                client.stream(5) as stream,
            ):
                stream.stage_many(fulls)  # rank 0 finishes; rank 1 never does
            assert time.monotonic() - began < 2 + 5  # the round's budget, plus settling
            assert all(e.version == 0 and "commit" not in e.names() for e in engines.values())
            assert rig.holds(rig.plan.sources[0].targets[0], fulls)  # rank 0's target got all of its buckets
    finally:
        other_gate.abort("test over")
        other.close()
        rig.close()


def test_streaming_needs_an_in_process_publisher(tmp_path: Path) -> None:
    class Plain:
        def publish(self, version: int, deadline: float) -> PublishResult:
            raise AssertionError("not called")

        def close(self) -> None:
            pass

    client = WeightSyncClient(ReplicaSet([]), Plain())  # type: ignore[arg-type]
    with pytest.raises(ClientError, match="cannot stream: stage everything"), client.stream(1):
        pass
    assert threading.active_count() >= 1
