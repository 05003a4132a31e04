"""The coordinator settles engines a failed round meant to leave serving but could not reach in time (the fault
matrix's engine-hang at pause, begin and resume: after SIGCONT the engine served, and the status said
``EnginesPaused`` until the next round). Pure logic: fake engines stand for the adapters."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync_agent.http.client import HttpCallError, PeerUnreachableError
from weightsync_agent.rounds.coordinator import Coordinator
from weightsync_agent.rounds.driver import RoundResult

TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}


def make_plan(engines: int = 2, scrub_seconds: int = 0) -> Plan:
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 1, "template": TEMPLATE},
            "inference": {"engines": engines, "ranksPerEngine": 1, "template": TEMPLATE},
            "transfer": {"scrubSeconds": scrub_seconds},
        }
    )
    return plan_for(spec, group="g", namespace="ns")


class Engine:
    def __init__(self) -> None:
        self.answer: BaseException | None = None
        self.resumes: list[str] = []

    def resume(self, timeout: float, *, round_id: str) -> None:
        self.resumes.append(round_id)
        if self.answer is not None:
            raise self.answer


def failed_round(unresumed: tuple[int, ...], *, started: bool = True) -> RoundResult:
    return RoundResult(version=3, result="Failed", started_at="2026-11-28T00:00:00Z", duration_seconds=10.0, bytes=0,
                       gbps=0.0, attempts=1 if started else 0, engines_paused=bool(unresumed), round_id="r3",
                       reason="could not start the round: engine 1 pause did not finish before the round's deadline; "
                              "engines [1] did not resume (their weights are not known to be clean)",
                       unresumed=unresumed)  # fmt: skip


@pytest.fixture
def rig() -> tuple[Coordinator, dict[int, Engine], list[RoundResult]]:
    plan = make_plan()
    reported: list[RoundResult] = []
    coordinator = Coordinator("g", SimpleNamespace(plan=plan), None,  # type: ignore[arg-type]
                              report=lambda result, committed: reported.append(result))  # fmt: skip
    engines = {0: Engine(), 1: Engine()}
    coordinator.engines = lambda plan, which: {e: engines[e] for e in which}  # type: ignore[assignment,method-assign,misc]
    return coordinator, engines, reported


def test_an_engine_back_after_a_hang_is_resumed_and_the_round_reported_again_without_engines_paused(rig: Any) -> None:
    coordinator, engines, reported = rig
    coordinator._finish(failed_round((1,)), "regular")
    assert reported[-1].engines_paused
    engines[1].answer = PeerUnreachableError("/continue_generation", None, "timed out")  # still hung
    assert coordinator.settle() == [] and len(reported) == 1
    engines[1].answer = None  # SIGCONT
    assert coordinator.settle() == [1]
    again = reported[-1]
    assert not again.engines_paused and again.version == 3 and again.result == "Failed"
    assert (again.reason or "").endswith("; engines [1] serve again")
    assert engines[1].resumes == ["r3", "r3"] and engines[0].resumes == []  # named the round; only engine 1
    assert coordinator.settle() == [] and len(reported) == 2  # settled: nothing more to do


def test_an_engine_that_refuses_to_serve_stays_paused_as_reported(rig: Any) -> None:
    coordinator, engines, reported = rig
    coordinator._finish(failed_round((1,)), "regular")
    engines[1].answer = HttpCallError("/continue_generation", 409, "live weights were written by an aborted round")
    assert coordinator.settle() == []
    assert len(reported) == 1 and reported[-1].engines_paused
    engines[1].answer = None
    assert coordinator.settle() == [] and engines[1].resumes == ["r3"]  # not asked again


def test_a_later_round_that_reached_the_engines_settles_them_itself(rig: Any) -> None:
    coordinator, engines, _reported = rig
    coordinator._finish(failed_round((1,)), "regular")
    coordinator._finish(failed_round((), started=False), "regular")  # refused before any engine: changes nothing
    coordinator._finish(failed_round(()), "regular")  # this one reached the engines
    assert coordinator.settle() == [] and engines[1].resumes == []


def test_engines_it_cannot_reach_yet_are_tried_again_without_failing_the_tick(rig: Any) -> None:
    coordinator, _engines, reported = rig
    coordinator._finish(failed_round((1,)), "regular")

    def unreachable(plan: Any, which: Any) -> Any:
        raise LookupError("no address for engine 1 in the directory yet")

    found = coordinator.engines
    coordinator.engines = unreachable
    assert coordinator.settle() == []  # no exception: the tick goes on to scrub and catch up
    coordinator.engines = found
    assert coordinator.settle() == [1] and not reported[-1].engines_paused


def test_the_ticks_work_between_rounds_never_waits_for_a_running_round(rig: Any) -> None:
    """settle, scrub and catch-up run on the agent's tick, which also refetches the manifests of a restarted engine
    that a round's prepare waits for: queued behind that round, the tick left it waiting out its refetch and failing
    (CI: a round after an engine restart failed in prepare after 5 s). While a round runs they do nothing and return;
    once it ended they do their work."""
    coordinator, engines, _reported = rig
    coordinator.own_sources = SimpleNamespace(plan=make_plan(scrub_seconds=60))
    coordinator._finish(failed_round((1,)), "regular")  # something for settle to do
    coordinator.recovered = True
    coordinator.committed = 2
    coordinator._committed_sums = {(0, 0): ["0" * 16]}  # and for scrub: one engine rank's verified checksums
    in_round, release = threading.Event(), threading.Event()
    found = coordinator.engines

    def engines_of_a_round_that_waits(plan: Any, which: Any) -> Any:
        if list(which) == [0, 1]:  # the regular round's
            in_round.set()
            release.wait(30)
            raise LookupError("the round ends here")
        return found(plan, which)

    coordinator.engines = engines_of_a_round_that_waits
    round_thread = threading.Thread(target=coordinator.run_round, args=(3,))
    round_thread.start()
    try:
        assert in_round.wait(10)
        began = time.monotonic()
        assert coordinator.settle() == [] and engines[1].resumes == []
        assert coordinator.catch_up() is None
        assert coordinator.scrub() == {}
        assert time.monotonic() - began < 1.0
    finally:
        release.set()
        round_thread.join(10)
    assert coordinator.settle() == [1]  # the round ended (refused): the tick's work runs again
