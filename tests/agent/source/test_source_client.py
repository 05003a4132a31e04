"""The trainer-facing client: environment, staging, publish/retry semantics, the publisher seam."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from source_helpers import MODEL, TargetMemory, as_bytes, expected_local, full_state, make_plan, tp_layout
from transports import Party, new_transport

from weightsync.api import names
from weightsync.plan import Target
from weightsync_agent.client.trainer import (
    ENV_REPLICA_PATH,
    ENV_SOURCE_RANK,
    ClientError,
    RoundOutcome,
    WeightSyncClient,
    replica_dir,
)
from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import target_checksum
from weightsync_agent.source.replica import IncompleteReplicaError, ReplicaSet
from weightsync_agent.source.writer import PublishError, PublishResult
from weightsync_agent.targets.adapter import TargetVerdict


def trainer_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        names.ENV_GROUP: "demo",
        names.ENV_ROLE: "trainer",
        names.ENV_POD_INDEX: "0",
        names.ENV_RANKS: "0",
        names.ENV_PLAN_FILE: str(tmp_path / "plan.json"),
        ENV_REPLICA_PATH: str(tmp_path / "replica"),
        **extra,
    }


class Rig:
    def __init__(self, tmp_path: Path, engines: int = 2) -> None:
        self.plan = make_plan(1, engines, 1, timeout=10)
        (tmp_path / "plan.json").write_text(self.plan.to_json())
        self.parties: list[Party] = [new_transport()]
        self.memory: dict[Target, TargetMemory] = {}
        for target in self.plan.sources[0].targets:
            party = new_transport()
            self.parties.append(party)
            mem = TargetMemory(tp_layout(MODEL, 1, 0), engine=target[0], rank=0, session_id=party.transport.session_id)
            party.transport.register(mem.address, mem.buffer.numel())
            self.memory[target] = mem
        self.target_party = dict(zip(self.memory, self.parties[1:], strict=True))

    @property
    def transport(self) -> object:
        return self.parties[0].transport

    @property
    def manifests(self) -> dict[Target, object]:
        return {t: m.manifest for t, m in self.memory.items()}

    def holds(self, target: Target, fulls: dict[str, torch.Tensor]) -> bool:
        mem = self.memory[target]
        return all(torch.equal(mem.raw(e.name), as_bytes(expected_local(e, fulls))) for e in mem.manifest.tensors)

    def close(self) -> None:
        for party in reversed(self.parties):
            party.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    made = Rig(tmp_path)
    yield made
    made.close()


def test_in_process_publish_resets_and_versions_move_forward(tmp_path: Path, rig: Rig) -> None:
    client = WeightSyncClient.from_env(
        trainer_env(tmp_path),
        transport=rig.transport,  # type: ignore[arg-type]
        manifests=rig.manifests,  # type: ignore[arg-type]
    )
    with client:
        assert client.expected() == set(full_state())
        assert sorted(p.name for p in (tmp_path / "replica").iterdir()) == [
            f"{r.fingerprint}.replica" for r in client.replicas
        ]
        fulls = full_state(11)
        for name, tensor in fulls.items():
            client.stage(name, tensor)
        result = client.publish(1)
        assert result.ok and client.committed == 1
        assert all(rig.holds(t, fulls) for t in rig.memory)
        assert len(client.missing()) == sum(len(e.parts) for e in rig.memory[(0, 0)].manifest.tensors)
        with pytest.raises(IncompleteReplicaError, match="missing from the replica"):
            client.publish(2)
        with pytest.raises(ClientError, match="version 1 is not newer than the last published version 1"):
            client.publish(1)
    assert len(list((tmp_path / "replica").iterdir())) == len(client.replicas)  # kept for an attaching peer
    client.close(unlink=True)  # closing again is fine; unlink removes the files
    assert not list((tmp_path / "replica").iterdir())


def test_failed_publish_raises_keeps_the_replica_and_retries_the_same_version(tmp_path: Path, rig: Rig) -> None:
    bad: Target = (1, 0)
    mem = rig.memory[bad]
    rig.target_party[bad].transport.unregister(mem.address)
    client = WeightSyncClient.in_process(
        rig.transport,  # type: ignore[arg-type]
        rig.plan,
        0,
        rig.manifests,  # type: ignore[arg-type]
        bucket_bytes=256,
        pin=False,
    )
    with client:
        fulls = full_state(12)
        client.stage_many(fulls)
        with pytest.raises(PublishError, match=r"target engine 1 rank 0 .*bucket 0 of") as caught:
            client.publish(5)
        failed = caught.value.result
        assert isinstance(failed, PublishResult) and failed.targets[(0, 0)].ok
        assert client.missing() == [] and client.committed is None
        rig.target_party[bad].transport.register(mem.address, mem.buffer.numel())
        assert client.publish(5).ok  # same version, no restaging
        assert rig.holds(bad, fulls)


def test_sidecar_mode_attaches_the_replica_and_publishes_through_the_seam(tmp_path: Path, rig: Rig) -> None:
    folder = tmp_path / "sidecar"
    sidecar = ReplicaSet.for_manifests(list(rig.manifests.values()), shm_dir=folder, pin=False)  # type: ignore[arg-type]

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[int] = []

        def publish(self, version: int, deadline: float) -> PublishResult:
            self.calls.append(version)
            return PublishResult(version=version, source=0, bucket_bytes=1, targets={})

        def close(self) -> None:
            pass

    try:
        env = trainer_env(tmp_path, **{ENV_REPLICA_PATH: str(folder), names.ENV_AGENT_PORT: "1"})
        # No sidecar answers on the agent port: a clear error, not a hang.
        with pytest.raises(ClientError, match=r"sidecar .* is not ready"):
            WeightSyncClient.from_env(env, sidecar_timeout=0.3)
        with pytest.raises(ClientError, match="no publisher"):
            WeightSyncClient(ReplicaSet.attach(folder)).publish(1)
        seam = Recorder()
        client = WeightSyncClient.from_env(env, publisher=seam)
        fulls = full_state(13)
        client.stage_many(fulls)
        assert sidecar.missing() == []  # the sidecar sees the trainer's staging
        replica = next(iter(sidecar))
        entry = rig.memory[(0, 0)].manifest.tensors[1]
        assert torch.equal(as_bytes(replica.tensor(entry.name)), as_bytes(expected_local(entry, fulls)))
        assert client.publish(3).ok and seam.calls == [3]
        assert len(sidecar.missing()) > 0  # ok means committed: the next version restages
        client.close()
    finally:
        sidecar.close(unlink=True)


def test_environment_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ClientError, match="runs in trainer pods"):
        WeightSyncClient.from_env(trainer_env(tmp_path, **{names.ENV_ROLE: "engine", names.ENV_ENGINE_INDEX: "0"}))
    with pytest.raises(ClientError, match="agent environment is incomplete"):
        WeightSyncClient.from_env({})
    two = {names.ENV_RANKS: "4,5"}
    with pytest.raises(ClientError, match=r"runs trainer ranks \[4, 5\]; set WEIGHTSYNC_SOURCE_RANK"):
        WeightSyncClient.from_env(trainer_env(tmp_path, **two))
    with pytest.raises(ClientError, match="WEIGHTSYNC_SOURCE_RANK=3 is not one of"):
        WeightSyncClient.from_env(trainer_env(tmp_path, **two, **{ENV_SOURCE_RANK: "3"}))
    with pytest.raises(ClientError, match="needs both transport and manifests"):
        WeightSyncClient.from_env(trainer_env(tmp_path), transport=object())  # type: ignore[arg-type]
    assert replica_dir("g", 3) == Path("/dev/shm/weightsync/g/source-3")


# --- Through the round driver ----------------------------------------------------------------------


class ChecksumEngine:
    """An engine for the round driver: verifies by hashing its own memory, as a real target does."""

    def __init__(self, index: int, rig: Rig, bucket_bytes: int) -> None:
        self.index = index
        self.name = f"engine-{index}"
        self.rig = rig
        self.bucket_bytes = bucket_bytes
        self.version = 0
        self.flip_once = False
        self.events: list[str] = []

    def pause(self, timeout: float, *, round_id: str) -> None:
        self.events.append("pause")

    def resume(self, timeout: float, *, round_id: str) -> None:
        self.events.append("resume")

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        self.events.append("begin")

    def verify(
        self, rank: int, version: int, checksums: Sequence[str], timeout: float, *, round_id: str
    ) -> TargetVerdict:
        self.events.append("verify")
        mem = self.rig.memory[(self.index, rank)]
        if self.flip_once:  # a bit flips in flight, once
            self.flip_once = False
            mem.buffer[0] ^= 1
        buckets = plan_buckets(mem.manifest, self.bucket_bytes)
        bad = [b.index for b, want in zip(buckets, checksums, strict=True) if target_checksum(b) != want]
        return TargetVerdict(ok=not bad and len(buckets) == len(checksums), mismatched=bad)

    def commit(self, version: int, timeout: float, *, round_id: str) -> None:
        self.events.append("commit")
        self.version = version

    def abort(self, version: int, timeout: float, *, round_id: str, written: bool = True) -> None:
        self.events.append("abort")


def test_coordinating_client_runs_a_verified_round_and_retries_from_the_replica(rig: Rig) -> None:
    bucket_bytes = rig.plan.transfer.bucket_bytes
    engines = {e: ChecksumEngine(e, rig, bucket_bytes) for e in range(rig.plan.layout.engines)}
    client = WeightSyncClient.coordinating(
        rig.transport,  # type: ignore[arg-type]
        rig.plan,
        0,
        rig.manifests,  # type: ignore[arg-type]
        engines,
        pin=False,
    )
    with client:
        fulls = full_state(21)
        client.stage_many(fulls)
        engines[1].flip_once = True  # attempt 1 fails verification on engine 1; live mode rewrites
        outcome = client.publish(4)
        assert outcome.ok, outcome.summary()
        assert isinstance(outcome, RoundOutcome) and outcome.round.attempts == 2
        assert all(e.version == 4 for e in engines.values())
        assert all(rig.holds(t, fulls) for t in rig.memory)
        assert engines[0].events[0] == "pause" and engines[0].events[-2:] == ["commit", "resume"]
        assert client.missing()  # committed: v5 must restage
        client.stage_many(full_state(22))
        engines[0].flip_once = True
        client.publisher.driver.retries = 0  # type: ignore[union-attr]
        with pytest.raises(PublishError, match=r"engine 0 rank 0 failed verification of version 5: buckets \[0\]"):
            client.publish(5)
        assert client.missing() == []  # not committed: the replica is kept for a retry
        assert engines[0].version == 4
