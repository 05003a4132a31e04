"""The steps of the status fold, one rule each (test_status.py covers the fold as a whole)."""

from __future__ import annotations

import pytest
from builders import GroupBuilder

from weightsync.api.v1alpha1 import SyncStatus
from weightsync.plan import plan_for
from weightsync_operator.status import (
    PodFailure,
    Problem,
    Versions,
    degraded_condition,
    engines_behind,
    fold_phase,
    is_syncing,
    lowest_version,
    paused_round,
    plan_ready_condition,
)

FATAL = Problem("BadSpec", "fix it")
TRANSIENT = Problem("ApiError", "try again", fatal=False)
FAILURE = PodFailure("g-trainer-0", "uid/CrashLoopBackOff/3", "CrashLoopBackOff", "pod g-trainer-0: crash")


def sync(version: int, result: str = "Succeeded", *, paused: bool = False) -> SyncStatus:
    return SyncStatus.model_validate({"version": version, "result": result, "enginesPaused": paused})


def versions(weight: int | None, newest: int | None, behind: dict[int, int | None] | None = None) -> Versions:
    return Versions(engines={}, weight_version=weight, newest_published=newest, committed=None, behind=behind or {})


def test_the_weight_version_is_the_lowest_and_absent_while_an_engine_serves_its_initial_weights() -> None:
    assert lowest_version({0: 3, 1: 2, 2: 5}) == 2
    assert lowest_version({0: 3, 1: None}) is None
    assert lowest_version({0: 0}) == 0
    assert lowest_version({}) is None


def test_engines_behind_the_committed_version() -> None:
    assert engines_behind({0: 3, 1: 2, 2: None}, committed=3) == {1: 2, 2: None}
    assert engines_behind({0: None}, committed=0) == {0: None}  # initial weights are behind any committed version
    assert engines_behind({0: None, 1: 1}, committed=None) == {}  # nothing committed yet: nobody is behind


def test_only_a_round_that_failed_and_left_the_engines_paused_pauses_them() -> None:
    assert paused_round(None) is None
    assert paused_round(sync(3, "Succeeded", paused=True)) is None
    assert paused_round(sync(3, "Failed")) is None
    failed = sync(3, "Aborted", paused=True)
    assert paused_round(failed) is failed


@pytest.mark.parametrize(
    ("state", "last", "expected"),
    [
        (versions(weight=2, newest=3), None, True),
        (versions(weight=None, newest=0), None, True),
        (versions(weight=3, newest=3), None, False),
        (versions(weight=4, newest=3), None, False),
        (versions(weight=None, newest=None), None, False),
        # The newest version's round already failed: nothing is on its way until the trainers publish again.
        (versions(weight=2, newest=3), sync(3, "Failed"), False),
        (versions(weight=2, newest=3), sync(4, "Aborted"), False),
        (versions(weight=2, newest=3), sync(2, "Failed"), True),
        (versions(weight=2, newest=3), sync(3, "Succeeded"), True),
        # An engine behind the committed version is caught up whatever the trainers published.
        (versions(weight=3, newest=3, behind={1: None}), sync(3, "Failed"), True),
    ],
)
def test_syncing(state: Versions, last: SyncStatus | None, expected: bool) -> None:
    assert is_syncing(state, last) is expected


@pytest.mark.parametrize(
    ("problem", "failures", "flags", "phase"),
    [
        (FATAL, [FAILURE], {"all_ready": True, "paused": True, "syncing": True, "scheduled": True}, "Failed"),
        (TRANSIENT, [], {"all_ready": True, "paused": False, "syncing": True, "scheduled": True}, "Degraded"),
        (None, [FAILURE], {"all_ready": True, "paused": False, "syncing": False, "scheduled": True}, "Degraded"),
        (None, [], {"all_ready": True, "paused": True, "syncing": True, "scheduled": True}, "Degraded"),
        (None, [], {"all_ready": True, "paused": False, "syncing": True, "scheduled": True}, "Syncing"),
        (None, [], {"all_ready": True, "paused": False, "syncing": False, "scheduled": True}, "Ready"),
        # Paused engines degrade the group only once its pods are ready; before, the pods are what is reported.
        (None, [], {"all_ready": False, "paused": True, "syncing": False, "scheduled": True}, "Provisioning"),
        (None, [], {"all_ready": False, "paused": False, "syncing": False, "scheduled": False}, "Pending"),
    ],
)
def test_the_phase_first_match_wins(
    problem: Problem | None, failures: list[PodFailure], flags: dict[str, bool], phase: str
) -> None:
    assert fold_phase(problem, failures, **flags) == phase


def test_degraded_names_the_problem_then_the_pod_failures_then_paused_engines() -> None:
    paused = sync(5, "Failed", paused=True)
    assert degraded_condition(TRANSIENT, [FAILURE], paused)[1:3] == ("True", "ApiError")
    assert degraded_condition(None, [FAILURE], paused)[1:3] == ("True", "PodFailures")
    assert degraded_condition(None, [], paused) == ("Degraded", "True", "EnginesPaused", "engines paused since round 5")
    assert degraded_condition(None, [], None) == ("Degraded", "False", "AsExpected", "")


def test_degraded_lists_three_pod_failures_and_counts_the_rest() -> None:
    failures = [PodFailure(f"p{i}", f"k{i}", "Evicted", f"pod p{i}: Evicted") for i in range(5)]
    message = degraded_condition(None, failures, None)[3]
    assert message == "pod p0: Evicted; pod p1: Evicted; pod p2: Evicted (and 2 more)"


def test_a_published_plan_is_ready_even_beside_a_fatal_problem() -> None:
    spec = GroupBuilder("g").trainers(1).engines(1).model().spec
    plan = plan_for(spec, group="g", namespace="default")
    assert plan_ready_condition(plan, FATAL)[:3] == ("PlanReady", "True", "PlanPublished")
    assert plan_ready_condition(None, FATAL) == ("PlanReady", "False", "BadSpec", "fix it")
    assert plan_ready_condition(None, TRANSIENT) == ("PlanReady", "Unknown", "NotPlanned", "no plan computed yet")
