"""The heart of it: 2 sources -> 2 engines x TP2, real engine processes, real Mooncake over TCP loopback.

After a training step and a sync, every engine rank holds the trainer's shards bit for bit (checked
against an independent resharding, not just the round's own checksums), and the engines' forward
outputs match the trainer's full model. Both live and staged target modes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from sync_helpers import ENGINES, TOKENS, TP, expected_checksums, group_spec, training_step

from weightsync.plan import Plan, plan_for
from weightsync_agent.rounds.driver import RoundDriver
from weightsync_agent.source.control import SourceControl
from weightsync_agent.source.report import SourceReport
from weightsync_agent.source.writer import InProcessSourceControl, Source
from weightsync_agent.targets.reference.adapter import reference_adapter
from weightsync_agent.transport.mooncake import MooncakeTransport
from weightsync_testing.reference_engine.launch import EngineProcess, launch_engine
from weightsync_testing.reference_engine.model import forward_full, full_state


def group_plan(staging: str) -> Plan:
    spec = group_spec(protocol="tcp", bucketSizeMiB=1, timeoutSeconds=30, targetStaging=staging)
    return plan_for(spec, group="g", namespace="ns")


@pytest.fixture(params=["live", "staged"])
def rig(request: pytest.FixtureRequest) -> Iterator[tuple[Plan, list[EngineProcess], list[Source]]]:
    staging = request.param
    plan = group_plan(staging)
    engines = [launch_engine(e, TP, seed=7 + e, staged=staging == "staged") for e in range(ENGINES)]
    sources: list[Source] = []
    try:
        clients = [e.client() for e in engines]
        for assignment in plan.sources:
            manifests = {t: clients[t[0]].manifest(t[1]) for t in assignment.targets}
            transport = MooncakeTransport("127.0.0.1", "tcp", force_tcp=True, timeout_seconds=10)
            sources.append(Source(transport, plan, assignment.source, manifests, pin=False))
        yield plan, engines, sources
    finally:
        for source in sources:
            source.close()
            source.transport.close()
        for engine in engines:
            engine.stop()


def test_two_sources_sync_two_tp2_engines_bit_exactly(rig: tuple[Plan, list[EngineProcess], list[Source]]) -> None:
    plan, engines, sources = rig
    bucket_bytes = plan.transfer.bucket_bytes
    controls = {e: reference_adapter(e, engines[e].url, bucket_bytes=bucket_bytes) for e in range(ENGINES)}
    driver = RoundDriver(
        plan, controls, {s.source: InProcessSourceControl(s) for s in sources},
        staging=plan.transfer.target_staging, timeout_seconds=30, call_timeout=15,
    )  # fmt: skip
    full = full_state(seed=1)
    try:
        for version in (1, 2):
            full = training_step(full, version)
            for source in sources:
                source.replicas.stage_many(full)
            result = driver.run(version)
            assert result.result == "Succeeded", result.reason
            assert result.bytes > 0 and result.attempts == 1
            reference_logits = forward_full(full, TOKENS)
            # The engines verified their bytes against the sources' checksums; the sources' checksums must
            # in turn equal an independent resharding of the trainer's tensors: so engines hold exactly it.
            for source in sources:
                assert source.last_result is not None
                for (engine, rank), report in source.last_result.targets.items():
                    assert list(report.checksums) == expected_checksums(full, rank, bucket_bytes), (engine, rank)
            for engine in engines:
                client = engine.client()
                assert client.weight_version() == str(version)
                logits = torch.tensor(client.forward(TOKENS))
                torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5)
    finally:
        driver.close()


class KillingSource:
    """A source whose publish first kills one engine process: a target dies mid-round."""

    def __init__(self, inner: InProcessSourceControl, victim: EngineProcess) -> None:
        self.inner = inner
        self.source = inner.source
        self.victim = victim

    def prepare(self, version: int, deadline: float) -> SourceReport:
        return self.inner.prepare(version, deadline)

    def publish(self, version: int, deadline: float) -> SourceReport:
        self.victim.process.kill()
        self.victim.process.wait()
        return self.inner.publish(version, deadline)


def test_a_target_killed_mid_round_leaves_no_engine_claiming_the_version(
    rig: tuple[Plan, list[EngineProcess], list[Source]],
) -> None:
    plan, engines, sources = rig
    bucket_bytes = plan.transfer.bucket_bytes
    controls = {e: reference_adapter(e, engines[e].url, bucket_bytes=bucket_bytes) for e in range(ENGINES)}
    controls_sources: dict[int, SourceControl] = {s.source: InProcessSourceControl(s) for s in sources}
    controls_sources[0] = KillingSource(InProcessSourceControl(sources[0]), engines[1])
    survivor = engines[0].client()
    before_version = survivor.weight_version()
    staged = plan.transfer.target_staging == "staged"
    before_logits = survivor.forward(TOKENS) if staged else None
    full = training_step(full_state(seed=1), 1)
    for source in sources:
        source.replicas.stage_many(full)
    driver = RoundDriver(
        plan, controls, controls_sources, staging=plan.transfer.target_staging,
        timeout_seconds=20, call_timeout=5, retries=1,
    )  # fmt: skip
    try:
        result = driver.run(5)
    finally:
        driver.close()
    assert result.result == ("Aborted" if staged else "Failed")
    assert "engine 1" in (result.reason or ""), result.reason
    # The survivor got every byte of v5 it was sent, yet it must not claim v5: engine 1 never verified.
    assert survivor.weight_version() == before_version
    if staged:
        assert survivor.forward(TOKENS) == before_logits  # still serving v-1, untouched
    else:
        assert result.engines_paused  # live: stays paused until a later round succeeds
