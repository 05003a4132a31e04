"""A coordinator killed mid-round (trainer rank 0's agent SIGKILLed; the fault matrix's ``coordinator-kill``), through
``weightsync agent`` processes and reference engine processes behind an HTTP gate that places the kill at a phase.

Checked: the other rank's publish ends with the round, not at its own timeout: answered by the coordinator that
starts next (it did not run that round: :meth:`Coordinator.ended_elsewhere`) or, while none answers, once the round's
budget is over; the new coordinator ends what its predecessor left on the engines (:mod:`weightsync_agent.rounds.
left_rounds`): engines the round wrote stay paused and it says so (``enginesPaused``: the status is not Ready), engines
it only paused serve again; and the next version lands on every engine.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from sync_helpers import engines_hold, group_spec, training_step

from weightsync_agent.client import WeightSyncClient
from weightsync_agent.client.trainer import RoundOutcome
from weightsync_agent.rounds.remote import AgentClient
from weightsync_agent.sidecar.main import STOP_SECONDS
from weightsync_agent.source.writer import PublishError
from weightsync_testing.engine_harness import ReferenceEngines
from weightsync_testing.http_gate import Gate, GatedEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.model import full_state
from weightsync_testing.trainer_ranks import publish_all

#: The round's budget: long enough for the killed coordinator to be restarted within it (the answer comes from the
#: new one), short enough for the unanswered case to end soon after it.
TIMEOUT = 12


class GatedReferenceEngines(GatedEngines, ReferenceEngines):
    pass


@pytest.fixture(scope="module")
def group() -> Iterator[LoopbackGroup]:
    harness = GatedReferenceEngines()
    spec = group_spec(protocol="tcp", bucketSizeMiB=1, timeoutSeconds=TIMEOUT, targetStaging="live")
    try:
        with LoopbackGroup(spec, group="t-coord-kill", engines=harness).start() as running:
            yield running
    finally:
        harness.close_gates()


def gate(group: LoopbackGroup, engine: int) -> Gate:
    harness = group.harness
    assert isinstance(harness, GatedReferenceEngines)
    return harness.gates[engine]


def kill_coordinator_at(group: LoopbackGroup, route: str) -> tuple[threading.Event, Callable[[], None]]:
    """Arm engine 1's gate: the first request for ``route`` SIGKILLs trainer pod 0's agent before it is forwarded.
    Returns the event set once it fired, and the disarm."""
    fired = threading.Event()
    pid = group.agents[0].process.pid

    def kill() -> None:
        if not fired.is_set():
            os.kill(pid, signal.SIGKILL)
            fired.set()

    gate(group, 1).before(route, kill)
    return fired, lambda: gate(group, 1).before(route, None)


def restart_coordinator(group: LoopbackGroup, clients: list[WeightSyncClient]) -> None:
    group.restart_agent(0)
    clients[0].close()
    clients[0] = group.client(0)  # its trainer process restarts with it


def coordinator_state(group: LoopbackGroup) -> dict[str, object]:
    return AgentClient(group.agents[0].url, timeout=10, token=group.token).state()


def engine_status(group: LoopbackGroup, engine: int) -> dict[str, object]:
    return group.engines[engine].client(timeout=10).status()


def test_a_coordinator_killed_mid_round_leaves_no_rank_waiting_and_no_engine_paused_for_nobody(
    group: LoopbackGroup,
) -> None:
    clients = [group.client(rank) for rank in range(2)]
    try:
        full = training_step(full_state(seed=4), 1)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, full, 1))

        # Killed as engine 1 is asked to verify: every source wrote both engines. The coordinator is restarted
        # while rank 1 still waits; the new one answers it and closes the round on the engines.
        full2 = training_step(full, 2)
        fired, disarm = kill_coordinator_at(group, "/weightsync/verify")
        outcomes: list[object] = []
        # Each rank would wait a minute (longer than the budget): what ends its wait must be the round's end.
        publishing = threading.Thread(
            target=lambda: outcomes.extend(publish_all(clients, full2, 2, publish_timeout=60))
        )
        started = time.monotonic()
        publishing.start()
        assert fired.wait(60), "the round never reached engine 1's verify"
        disarm()
        restart_coordinator(group, clients)
        publishing.join(60)
        waited = time.monotonic() - started
        answer = outcomes[1]
        assert isinstance(answer, RoundOutcome) and not answer.ok, answer
        reason = answer.round.reason or ""
        # The new coordinator's answer; on a machine so loaded that the restart outlasts the round's budget, rank 1
        # gave up on the silent coordinator first (both bound its wait; the status below is the new coordinator's).
        answered = "ended with its coordinator" in reason and "engines [0, 1] were written in it" in reason
        assert answered or "stopped answering during round" in reason, reason
        assert waited < TIMEOUT + 8, f"rank 1 heard after {waited:.1f} s"
        deadline = time.monotonic() + 30  # the new coordinator closes the round at its first tick
        while (last := coordinator_state(group)["lastRound"]) is None:
            assert time.monotonic() < deadline, "the new coordinator reported nothing of the round it found"
            time.sleep(0.2)
        assert isinstance(last, dict) and last["enginesPaused"] and last["result"] == "Failed", last
        for engine in (0, 1):  # written and not verified: they must not serve what they hold
            status = engine_status(group, engine)
            assert status["paused"] and status["weight_version"] == "1" and status["round"] is None, status

        full3 = training_step(full2, 3)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, full3, 3))
        engines_hold(group, full3, 3)

        # Killed as engine 1 is asked to pause, and not restarted: rank 1 hears once the round's budget is over;
        # engine 0 may be paused (its pause went out beside engine 1's), nothing was written. The coordinator that
        # starts then resumes what its predecessor paused.
        full4 = training_step(full3, 4)
        fired, disarm = kill_coordinator_at(group, "/pause_generation")
        started = time.monotonic()
        outcomes = publish_all(clients, full4, 4, publish_timeout=60)
        waited = time.monotonic() - started
        disarm()
        assert fired.is_set()
        answer = outcomes[1]
        assert isinstance(answer, RoundOutcome) and not answer.ok, answer
        assert "stopped answering during round" in (answer.round.reason or ""), answer.round.reason
        # Its wait ends at the budget + 3 s from its prepare, then at its next ask (a second apart); slack for a loaded
        # machine (the fault matrix holds it to the budget + 5 s on a quiet one: 13.1 s at a 10 s budget).
        assert TIMEOUT <= waited < TIMEOUT + 8, f"rank 1 heard after {waited:.1f} s"
        restart_coordinator(group, clients)
        deadline = time.monotonic() + 30
        while any(engine_status(group, e)["paused"] for e in (0, 1)):
            assert time.monotonic() < deadline, [engine_status(group, e) for e in (0, 1)]
            time.sleep(0.2)
        for engine in (0, 1):
            assert engine_status(group, engine)["weight_version"] == "3"
        full5 = training_step(full4, 5)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, full5, 5))
        engines_hold(group, full5, 5)
    finally:
        for client in clients:
            client.close()


def test_a_coordinator_that_starts_with_no_round_on_the_engines_touches_nothing_and_reports_nothing(
    group: LoopbackGroup,
) -> None:
    clients = [group.client(rank) for rank in range(2)]
    try:
        # A committed version of its own (the test may run alone), so the new coordinator has one to learn.
        version = (coordinator_state(group)["committed"] or 0) + 1
        assert all(getattr(o, "ok", False) for o in publish_all(clients, training_step(full_state(seed=6), version),
                                                                version))  # fmt: skip
        before = [engine_status(group, e)["pauses"] for e in (0, 1)]
        restart_coordinator(group, clients)
        deadline = time.monotonic() + 30
        while coordinator_state(group)["committed"] != version:  # it learnt the committed version from the engines
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert coordinator_state(group)["lastRound"] is None
        assert [engine_status(group, e)["pauses"] for e in (0, 1)] == before
        assert not any(engine_status(group, e)["paused"] for e in (0, 1))
    finally:
        for client in clients:
            client.close()


def test_an_agent_told_to_stop_exits_at_once_though_its_trainers_publish_waits(group: LoopbackGroup) -> None:
    """SIGTERM (its pod deleted) while its trainer's publish waits for a round: the agent does not wait with it (it
    took 10 s, the harness's grace, before ``STOP_SECONDS``; a cluster's would have taken the pod's grace period)."""
    clients = [group.client(rank) for rank in range(2)]
    try:
        committed = coordinator_state(group)["committed"] or 0
        assert isinstance(committed, int)
        clients[1].stage_many(training_step(full_state(seed=9), 1))
        heard: list[object] = []

        def publish() -> None:
            try:
                heard.append(clients[1].publish(committed + 1, check=False, timeout=60))
            except PublishError as exc:  # its agent went away under it
                heard.append(exc)

        waiting = threading.Thread(target=publish)
        waiting.start()  # rank 0 never publishes: the agent holds the request
        time.sleep(1.0)
        assert waiting.is_alive()
        agent = group.agents[1].process
        began = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        stopped = time.monotonic() - began
        assert stopped < STOP_SECONDS + 3, f"the agent took {stopped:.1f} s to stop"
        waiting.join(30)
        assert not waiting.is_alive() and heard, "the trainer's publish still waits"
        assert not getattr(heard[0], "ok", False), heard  # it saw the connection close: nothing was published
    finally:
        for client in clients:
            client.close()
        group.restart_agent(1)
