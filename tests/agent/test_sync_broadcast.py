"""Broadcast mode through the round protocol: 2 trainer ranks (rank 0 sends) -> 2 engines x TP2.

Real engine processes, real gloo over TCP loopback, the same RoundDriver as p2p. After each training
step and round, every engine rank holds the trainer's shards bit for bit (the sender's checksums, which
the engines verified, equal an independent resharding with the model's own ``shard()``), and the
engines' logits match the trainer's full model. Live and staged. A fault test kills an engine while the
buckets are on the wire: the round fails, and the survivor does not claim the version.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from sync_helpers import ENGINES, TOKENS, TP, expected_checksums, group_spec, training_step

from weightsync.plan import Plan, plan_for
from weightsync.ports import free_port
from weightsync_agent.modes.broadcast.layout import broadcast_round_plan
from weightsync_agent.modes.broadcast.sender import BroadcastSource
from weightsync_agent.rounds.driver import RoundDriver
from weightsync_agent.source.control import SourceControl
from weightsync_agent.source.report import SourceReport
from weightsync_agent.targets.reference.adapter import reference_adapter
from weightsync_testing.reference_engine.launch import EngineProcess, launch_engine
from weightsync_testing.reference_engine.model import ModelConfig, forward_full, full_state

LAYERS = 12  # about 1.8 MB of full tensors: two 1 MiB broadcast buckets, so a kill can land mid-broadcast
CONFIG = ModelConfig(num_layers=LAYERS)

Rig = tuple[Plan, list[EngineProcess], BroadcastSource]


def group_plan(staging: str) -> Plan:
    spec = group_spec(mode="broadcast", bucketSizeMiB=1, timeoutSeconds=20, targetStaging=staging)
    return plan_for(spec, group="g", namespace="ns")


class IdleTrainerRank:
    """Trainer rank 1: in broadcast mode it has nothing to send, so the driver must never ask it."""

    source = 1

    def prepare(self, version: int, deadline: float) -> SourceReport:
        raise AssertionError("trainer rank 1 was asked to prepare in broadcast mode")

    def publish(self, version: int, deadline: float) -> SourceReport:
        raise AssertionError("trainer rank 1 was asked to publish in broadcast mode")


class RecordingSource:
    """Rank 0's SourceControl, keeping its last report (the checksums the engines verified against)."""

    def __init__(self, inner: BroadcastSource) -> None:
        self.inner = inner
        self.source = inner.source
        self.reports: list[SourceReport] = []

    def prepare(self, version: int, deadline: float) -> SourceReport:
        return self.inner.prepare(version, deadline)

    def publish(self, version: int, deadline: float) -> SourceReport:
        report = self.inner.publish(version, deadline)
        self.reports.append(report)
        return report


@pytest.fixture(params=["live", "staged"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    staging = request.param
    plan = group_plan(staging)
    extra = ("--layers", str(LAYERS))
    engines: list[EngineProcess] = []
    source: BroadcastSource | None = None
    try:
        for e in range(ENGINES):
            engines.append(launch_engine(e, TP, seed=7 + e, staged=staging == "staged", extra=extra))
        clients = {e: engines[e].client() for e in range(ENGINES)}
        manifests = {t: clients[t[0]].manifest(t[1]) for t in plan.layout.all_targets()}
        bucket_bytes = plan.transfer.bucket_bytes
        adapters = {e: reference_adapter(e, c.base_url, bucket_bytes=bucket_bytes) for e, c in clients.items()}
        source = BroadcastSource(plan, manifests, adapters, call_timeout=10)
        source.connect(f"tcp://127.0.0.1:{free_port()}", backend="gloo")
        yield plan, engines, source
    finally:
        if source is not None:
            source.close()
        for engine in engines:
            engine.stop()


def driver_for(plan: Plan, engines: list[EngineProcess], sources: dict[int, SourceControl], **kw: float) -> RoundDriver:
    bucket_bytes = plan.transfer.bucket_bytes
    controls = {e: reference_adapter(e, engines[e].url, bucket_bytes=bucket_bytes) for e in range(ENGINES)}
    return RoundDriver(
        broadcast_round_plan(plan), controls, sources, staging=plan.transfer.target_staging,
        timeout_seconds=kw.get("timeout_seconds", 20), call_timeout=kw.get("call_timeout", 10),
        retries=int(kw.get("retries", 1)),
    )  # fmt: skip


def test_rank0_broadcast_syncs_two_tp2_engines_bit_exactly(rig: Rig) -> None:
    plan, engines, broadcast = rig
    bucket_bytes = plan.transfer.bucket_bytes
    sender = RecordingSource(broadcast)
    driver = driver_for(plan, engines, {0: sender, 1: IdleTrainerRank()})
    full = full_state(seed=1, config=CONFIG)
    try:
        for version in (1, 2):
            full = training_step(full, version)
            broadcast.stage_many(full)
            result = driver.run(version)
            assert result.result == "Succeeded", result.reason
            assert result.attempts == 1 and result.bytes > 0
            # The engines verified their bytes against the sender's checksums; those must in turn equal an
            # independent resharding of the trainer's tensors: so every engine rank holds exactly it.
            report = sender.reports[-1]
            assert sorted(report.checksums) == sorted(plan.layout.all_targets())
            for (engine, rank), sums in report.checksums.items():
                assert list(sums) == expected_checksums(full, rank, bucket_bytes, config=CONFIG), (engine, rank)
            reference_logits = forward_full(full, TOKENS, CONFIG)
            for process in engines:
                client = process.client()
                assert client.weight_version() == str(version)
                logits = torch.tensor(client.forward(TOKENS))
                torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5)
                last = client.status()["broadcast"]["last"]
                assert last["version"] == version and last["errors"] == {} and not last["running"]
            broadcast.reset()
    finally:
        driver.close()


def test_an_engine_killed_mid_broadcast_fails_the_round_and_no_engine_claims_it(rig: Rig) -> None:
    plan, engines, broadcast = rig
    victim, survivor = engines[1], engines[0].client()
    staged = plan.transfer.target_staging == "staged"
    before_version = survivor.weight_version()
    before_logits = survivor.forward(TOKENS) if staged else None
    buckets_sent: list[int] = []

    def kill_after_first_bucket(index: int, nbytes: int) -> None:
        buckets_sent.append(index)
        if index == 0:
            victim.process.kill()
            victim.process.wait()

    broadcast.progress = kill_after_first_bucket
    broadcast.stage_many(training_step(full_state(seed=1, config=CONFIG), 1))
    driver = driver_for(plan, engines, {0: broadcast}, timeout_seconds=20, call_timeout=5, retries=1)
    try:
        result = driver.run(5)
    finally:
        driver.close()
    assert buckets_sent and buckets_sent[0] == 0  # the kill happened with the round on the wire
    assert result.result == ("Aborted" if staged else "Failed")
    assert "engine 1" in (result.reason or ""), result.reason
    # The survivor may have received every byte it was sent, yet it must not claim v5.
    assert survivor.weight_version() == before_version
    status = survivor.status()
    assert status["weight_version"] == before_version
    if staged:
        assert status["round"] is None  # aborted
        assert survivor.forward(TOKENS) == before_logits  # still serving v-1, untouched
    else:
        assert result.engines_paused and status["paused"] and status["live_dirty"]
    assert broadcast.group is None  # torn down: the next round needs connect() again
