"""Closing what a killed coordinator left on the engines, and answering a rank about a round this coordinator did not
run. Pure logic: fake engines stand for the adapters (the real processes: tests/agent/test_coordinator_killed.py)."""

from __future__ import annotations

from types import SimpleNamespace

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import plan_for
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.rounds.coordinator import Coordinator
from weightsync_agent.rounds.left_rounds import close_left_rounds
from weightsync_agent.targets.adapter import LeftRound

TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}


class Engine:
    """Holds ``left`` (None: nothing); ``written``: closing it finds its memory changed, so it stays paused."""

    def __init__(self, left: LeftRound | None, *, written: bool = False) -> None:
        self.left, self.written = left, written
        self.closed: list[LeftRound] = []

    def left_round(self, timeout: float) -> LeftRound | None:
        return self.left

    def close_left(self, left: LeftRound, timeout: float) -> bool:
        self.closed.append(left)
        return not self.written


class Blind:
    """An engine that cannot say which round holds it (stock SGLang, vLLM)."""


def test_rounds_of_others_are_closed_and_only_engines_they_wrote_stay_paused() -> None:
    open_round, paused_only = LeftRound("r7", 7, paused=True), LeftRound("r7", None, paused=True)
    engines = {0: Engine(open_round, written=True), 1: Engine(paused_only), 2: Engine(None), 3: Blind()}
    closed = close_left_rounds(engines, ran=(), timeout=1.0)
    assert closed.left == {0: open_round, 1: paused_only}
    assert closed.paused == (0,) and closed.serving == (1,)
    assert engines[0].closed == [open_round] and engines[2].closed == []
    report = closed.report(committed=6)
    assert report is not None and report.version == 7 and report.round_id == "r7" and report.result == "Failed"
    assert report.engines_paused and not report.committed
    assert "engines [0] were written in it and stay paused" in (report.reason or "")
    assert "engines [1] serve again" in (report.reason or "")


def test_a_round_this_coordinator_ran_is_left_alone_and_nothing_is_reported() -> None:
    engine = Engine(LeftRound("mine", 3, paused=True))
    closed = close_left_rounds({0: engine}, ran={"mine"}, timeout=1.0)
    assert engine.closed == [] and closed.report(committed=2) is None


def test_a_round_that_only_paused_reports_the_committed_version_and_serving_engines_are_not_paused() -> None:
    closed = close_left_rounds({0: Engine(LeftRound("r", None, paused=True))}, ran=(), timeout=1.0)
    report = closed.report(committed=4)
    assert report is not None and report.version == 4 and not report.engines_paused


def test_an_engine_that_does_not_answer_when_closing_counts_as_paused() -> None:
    class Refuses(Engine):
        def close_left(self, left: LeftRound, timeout: float) -> bool:
            raise HttpCallError("/weightsync/abort", 503, "unavailable")

    closed = close_left_rounds({0: Refuses(LeftRound("r", 2, paused=True))}, ran=(), timeout=1.0)
    report = closed.report(committed=1)
    assert report is not None and report.engines_paused and "engine 0 could not be closed" in (report.reason or "")


def coordinator(committed: int | None, *, recovered: bool = True) -> Coordinator:
    spec = WeightSyncGroupSpec.model_validate(
        {"trainer": {"replicas": 2, "template": TEMPLATE}, "inference": {"engines": 1, "template": TEMPLATE}}
    )
    found = Coordinator("g", SimpleNamespace(plan=plan_for(spec, group="g", namespace="ns")), None)  # type: ignore[arg-type]
    found.committed, found.recovered = committed, recovered
    return found


def test_a_rank_asking_about_a_round_of_a_predecessor_hears_it_ended_and_whether_it_committed() -> None:
    fresh = coordinator(4)
    ended = fresh.ended_elsewhere(5, "gone")
    assert ended is not None and ended.result == "Failed" and not ended.committed and ended.round_id == "gone"
    assert "ended with its coordinator" in (ended.reason or "")
    committed = fresh.ended_elsewhere(4, "gone")  # killed after every engine committed 4, before reporting it
    assert committed is not None and committed.committed and "holds version 4 committed" in (committed.reason or "")


def test_a_round_of_its_own_or_before_it_learnt_the_committed_version_is_waited_for() -> None:
    fresh = coordinator(4)
    mine = fresh._mint()
    assert fresh.ended_elsewhere(5, mine) is None
    assert coordinator(None, recovered=False).ended_elsewhere(5, "gone") is None
