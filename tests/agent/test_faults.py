"""Round-level faults against real engine processes and real Mooncake sources (TCP loopback).

Each fault is followed by the same checks: no engine reports a version it does not fully hold (a serving
engine's forward equals the trainer's model of the version it reports; a dirty one refuses to serve), and
a later round completes with every engine holding the new weights bit for bit. ``test_sync_p2p`` covers a
target killed mid-round; the source process killed mid-round is tested with the source agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from fault_rig import (
    BUCKET_BYTES,
    ENGINES,
    TRANSFER_TIMEOUT,
    PassThroughTransport,
    TriggeredTransport,
    assert_engines_hold_bit_exactly,
    assert_no_engine_claims_what_it_does_not_hold,
    build_sources,
    close_sources,
    engine_seed,
    group_plan,
    make_driver,
    version_state,
)

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync_agent.source.writer import Source
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_agent.transport.base import Transfer
from weightsync_agent.transport.memory import MemoryTransport
from weightsync_agent.transport.mooncake import MooncakeTransport
from weightsync_testing.reference_engine.launch import EngineProcess, launch_engine
from weightsync_testing.reference_engine.model import full_state
from weightsync_testing.reference_engine.server import ReferenceEngine

HERE = Path(__file__).parent
TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}
TP = 2
ROUND_TIMEOUT = 8.0
CALL_TIMEOUT = 2.0
MARGIN = 2.0  # scheduling slack on a shared 2-core machine

States = dict[str, Callable[[int], dict[str, torch.Tensor]]]


def initial_states() -> States:
    return {"default": lambda engine: full_state(seed=engine_seed(engine))}


def committed(states: States, version: int) -> States:
    return {**states, str(version): lambda _engine: version_state(version)}


@pytest.fixture(params=["live", "staged"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[EngineProcess]]]:
    staging = str(request.param)
    started: list[EngineProcess] = []
    try:
        for e in range(ENGINES):
            started.append(launch_engine(e, TP, seed=engine_seed(e), staged=staging == "staged"))
        yield staging, started
    finally:
        for process in started:
            if process.process.poll() is None:
                os.kill(process.process.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            process.stop()


def wait_answering(client: EngineClient, within: float = 10.0) -> None:
    """Until the engine answers again (after SIGCONT it first works off the requests queued meanwhile)."""
    end = time.monotonic() + within
    while True:
        try:
            client.status(timeout=1.0)
            return
        except Exception:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def wait_until(condition: Callable[[], bool], within: float) -> bool:
    end = time.monotonic() + within
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_a_hung_target_fails_the_round_in_time_without_blocking_the_healthy_one(
    engines: tuple[str, list[EngineProcess]],
) -> None:
    staging, processes = engines
    plan = group_plan(staging)
    clients = [p.client(timeout=CALL_TIMEOUT) for p in processes]
    victim = processes[1]
    counter: dict[str, int] = {}
    stopped_at: list[float] = []

    def stop_victim() -> None:
        os.kill(victim.process.pid, signal.SIGSTOP)
        stopped_at.append(time.monotonic())

    def wrap(transport: MooncakeTransport) -> TriggeredTransport:
        return TriggeredTransport(transport, set(victim.ready["sessions"]), counter, 3, stop_victim)

    sources = build_sources(plan, clients, wrap)
    states = initial_states()
    try:
        for source in sources:
            source.replicas.stage_many(version_state(1))
        driver = make_driver(plan, clients, sources, timeout=ROUND_TIMEOUT, call_timeout=CALL_TIMEOUT, retries=0)
        try:
            began = time.monotonic()
            result = driver.run(1)
            took = time.monotonic() - began
            assert stopped_at, "the fault never struck"
            assert result.result == ("Aborted" if staging == "staged" else "Failed"), result
            assert took <= ROUND_TIMEOUT + MARGIN, took
            assert "engine 1" in (result.reason or ""), result.reason
            healthy_done, hung_failed = [], []
            for source in sources:
                report = source.last_result
                assert report is not None
                healthy, hung = report.targets[(0, source.source)], report.targets[(1, source.source)]
                assert healthy.ok and not hung.ok, report.summary()
                assert healthy.seconds is not None and hung.seconds is not None
                healthy_done.append(healthy.seconds)
                hung_failed.append(hung.seconds)
                assert report.unsettled == 0  # every write to the hung target settled before it reported
            # The healthy engine's writes went on while the hung one's waited: each finished before the hung
            # target could even time out.
            assert max(healthy_done) < TRANSFER_TIMEOUT <= min(hung_failed) + 0.1, (healthy_done, hung_failed)
            print(
                f"\n[{staging}] round failed after {took:.2f} s (timeout {ROUND_TIMEOUT:g} s, transfer timeout "
                f"{TRANSFER_TIMEOUT:g} s); healthy targets done after {[round(s, 3) for s in healthy_done]} s, "
                f"hung targets failed after {[round(s, 3) for s in hung_failed]} s"
            )
            assert_no_engine_claims_what_it_does_not_hold(clients[:1], states)  # the hung one cannot answer

            os.kill(victim.process.pid, signal.SIGCONT)
            wait_answering(clients[1])
            if staging == "staged":
                # The coordinator's abort reached the stopped engine's socket; let it be handled before the
                # retry's begin, or it would abort the retry (versions are not round ids).
                wait_until(lambda: clients[1].status()["round"] is None, within=3.0)
            assert_no_engine_claims_what_it_does_not_hold(clients, states)
            retry = driver.run(1)
            assert retry.result == "Succeeded", retry.reason
        finally:
            driver.close()
        assert_engines_hold_bit_exactly(clients, sources, 1)
        assert_no_engine_claims_what_it_does_not_hold(clients, committed(states, 1))
    finally:
        close_sources(sources)


def run_coordinator_until_it_holds(processes: list[EngineProcess], staging: str, version: int) -> subprocess.Popen[str]:
    command = [
        sys.executable, str(HERE / "fault_coordinator.py"), "--engines", ",".join(p.url for p in processes),
        "--version", str(version), "--staging", staging, "--hold-after", "3",
    ]  # fmt: skip
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=HERE)
    assert child.stdout is not None
    for line in child.stdout:  # Mooncake may log to stdout too: wait for our line
        if line.startswith("{") and json.loads(line).get("event") == "holding":
            return child
    child.wait()
    raise AssertionError(f"the coordinator exited ({child.returncode}) before it began writing")


@pytest.mark.parametrize(
    ("engines", "next_version"), [("live", True), ("staged", False)], ids=["live-next-version", "staged-same-version"],
    indirect=["engines"],
)  # fmt: skip
def test_a_coordinator_killed_mid_round_leaves_no_claim_and_a_fresh_one_completes(
    engines: tuple[str, list[EngineProcess]], next_version: bool
) -> None:
    staging, processes = engines
    plan = group_plan(staging)
    clients = [p.client(timeout=CALL_TIMEOUT * 2) for p in processes]
    states = initial_states()
    child = run_coordinator_until_it_holds(processes, staging, 1)
    try:
        for client in clients:  # the round is under way: begun everywhere, bytes landing
            assert client.status()["round"]["version"] == "1"
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
    for client in clients:
        status = client.status()
        assert status["weight_version"] == "default" and status["round"]["verified"] == {}, status
        assert status["live_dirty"] == (staging == "live")
    assert_no_engine_claims_what_it_does_not_hold(clients, states)

    version = 2 if next_version else 1  # a new version must supersede the dead round; the same one resumes it
    sources: list[Source] = build_sources(plan, clients)
    try:
        for source in sources:
            source.replicas.stage_many(version_state(version))
        driver = make_driver(plan, clients, sources, timeout=ROUND_TIMEOUT, call_timeout=CALL_TIMEOUT * 2, retries=0)
        try:
            result = driver.run(version)
        finally:
            driver.close()
        assert result.result == "Succeeded", result.reason
        assert_engines_hold_bit_exactly(clients, sources, version)
        assert_no_engine_claims_what_it_does_not_hold(clients, committed(states, version))
    finally:
        close_sources(sources)


# --- Fencing: no write of a failed publish lands after the failure is reported -----------------------


def one_source_two_engines() -> Plan:
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 1, "template": TEMPLATE},
            "inference": {"engines": 2, "ranksPerEngine": 1, "adapter": "reference", "template": TEMPLATE},
            "transfer": {"bucketSizeMiB": 1, "timeoutSeconds": 30},
        }
    )
    return plan_for(spec, group="fence", namespace="ns")


class RecordingTransport(PassThroughTransport):
    """A MemoryTransport that records when each write was submitted."""

    def __init__(self, inner: MemoryTransport) -> None:
        super().__init__(inner)
        self.submitted: list[float] = []

    def submit_write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> Transfer:
        self.submitted.append(time.monotonic())
        return self.inner.submit_write(peer, local_address, remote_address, nbytes)


@pytest.fixture
def fence_rig() -> Iterator[tuple[list[ReferenceEngine], Source, RecordingTransport]]:
    """Two in-process reference engines (TP1, memory transport) and one source writing both."""
    plan = one_source_two_engines()
    engines = [ReferenceEngine(engine=e, tp=1, seed=engine_seed(e), transports=[MemoryTransport()]) for e in range(2)]
    for engine in engines:  # round 1 open, as the driver opens it before any write: only then is memory writable
        engine.pause("abort")
        engine.begin("1")
    transport = RecordingTransport(MemoryTransport(timeout_seconds=10))
    manifests = {(e.engine, 0): e.memory[0].manifest() for e in engines}
    source = Source(transport, plan, 0, manifests, BUCKET_BYTES, pin=False, max_inflight=2)
    source.replicas.stage_many(version_state(1))
    try:
        yield engines, source, transport
    finally:
        for engine in engines:
            stalled = engine.memory[0].transport
            if isinstance(stalled, MemoryTransport):
                stalled.release()
        source.close()
        transport.close()
        for engine in engines:
            engine.close()


def stall(engine: ReferenceEngine) -> MemoryTransport:
    transport = engine.memory[0].transport
    assert isinstance(transport, MemoryTransport)
    transport.stall()
    return transport


def test_a_failed_publish_reports_only_after_its_writes_settled(
    fence_rig: tuple[list[ReferenceEngine], Source, RecordingTransport],
) -> None:
    engines, source, _ = fence_rig
    hung = stall(engines[1])
    before = engines[1].weights[0].buffer.clone()
    wake = threading.Timer(1.0, hung.release)  # the peer resumes after the deadline, like a SIGCONT
    began = time.monotonic()
    wake.start()
    result = source.publish(1, deadline=began + 0.3)
    reported = engines[1].weights[0].buffer.clone()
    wake.join()
    assert result.aborted and not result.targets[(1, 0)].ok and result.targets[(0, 0)].ok
    # The window's writes were in flight at the deadline and landed on release: before the failure was
    # reported, so nothing of this publish can land after a caller acted on the failure.
    assert not torch.equal(reported, before)
    assert torch.equal(engines[1].weights[0].buffer, reported)
    assert result.settle_seconds > 0 and result.unsettled == 0


def test_the_next_publish_waits_until_the_failed_ones_writes_settled(
    fence_rig: tuple[list[ReferenceEngine], Source, RecordingTransport],
) -> None:
    engines, source, transport = fence_rig
    hung = stall(engines[1])
    released: list[float] = []

    def resume() -> None:
        hung.release()  # the held writes of the first publish land now
        released.append(time.monotonic())

    wake = threading.Timer(1.0, resume)
    first_returned: list[float] = []

    def first() -> None:
        source.publish(1, deadline=time.monotonic() + 0.3)
        first_returned.append(time.monotonic())

    wake.start()
    worker = threading.Thread(target=first)
    worker.start()
    time.sleep(0.5)  # past the first publish's deadline, while its writes to engine 1 are held
    submitted_before = len(transport.submitted)
    retry = source.publish(1, timeout=10)  # a retry of the attempt, as the round driver makes
    worker.join()
    wake.join()
    assert retry.ok, retry.summary()
    assert first_returned and released
    later = transport.submitted[submitted_before:]
    assert later and min(later) >= released[0]  # not one write of the retry before the first one's settled
    for engine in engines:
        verify = engine.memory[0].verify(BUCKET_BYTES, list(retry.targets[(engine.engine, 0)].checksums))
        assert verify.ok, verify
