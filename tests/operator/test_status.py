"""Folding observed pods and the plan into the group's status (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from builders import GroupBuilder, PodState
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.api import names
from weightsync.api.v1alpha1 import RECENT_REASON_CHARS, RECENT_SYNCS, WeightSyncGroupStatus
from weightsync.plan import plan_for
from weightsync_operator.builders import desired_state
from weightsync_operator.status import (
    Observation,
    Problem,
    condition,
    fold_status,
    pod_failure,
    set_conditions,
    strip_none,
)

T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def group_and_pods(builder: GroupBuilder) -> tuple[Any, Any, list[dict[str, Any]]]:
    group = builder.model()
    plan = plan_for(group.spec, group=group.metadata.name, namespace="default")
    return group, plan, list(desired_state(group, plan).pods)


def observe(builder: GroupBuilder, pods: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    group = builder.model()
    obs = Observation(
        name=group.metadata.name,
        generation=group.metadata.generation,
        now=kw.pop("now", T0),
        spec=kw.pop("spec", group.spec),
        plan=kw.pop("plan", plan_for(group.spec, group=group.metadata.name, namespace="default")),
        pods=pods,
        **kw,
    )
    return fold_status(obs).status


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    found = condition(status, type_)
    assert found is not None, type_
    return dict(found)


BUILDER = GroupBuilder("g").trainers(2).engines(2, tp=2, ranks_per_pod=1)


def test_all_ready() -> None:
    _, _, pods = group_and_pods(BUILDER)
    status = observe(BUILDER, [PodState(p).ready().build() for p in pods])
    WeightSyncGroupStatus.model_validate(status)  # the CRD's shape
    assert status["phase"] == "Ready"
    assert status["observedGeneration"] == 1
    assert status["trainers"] == {"desired": 2, "ready": 2}
    assert status["engines"] == {"desired": 4, "ready": 4}
    assert cond(status, "Ready")["status"] == "True"
    assert cond(status, "Progressing")["status"] == "False"
    assert cond(status, "Degraded") | {"lastTransitionTime": None} == {
        "type": "Degraded",
        "status": "False",
        "reason": "AsExpected",
        "message": "",
        "lastTransitionTime": None,
        "observedGeneration": 1,
    }
    assert cond(status, "PlanReady")["status"] == "True"
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded", "PlanReady"]


def test_a_pod_counts_as_ready_only_when_its_agent_said_so() -> None:
    """Node agents that ignore readiness gates (kwok, virtual kubelets) report Ready without the agent."""
    _, _, pods = group_and_pods(BUILDER)
    states = [PodState(p).ready().build() for p in pods]
    for pod in states[:2]:
        pod["status"]["conditions"] = [
            c for c in pod["status"]["conditions"] if c["type"] != names.CONDITION_AGENT_READY
        ]
    status = observe(BUILDER, states)
    assert status["trainers"] == {"desired": 2, "ready": 0}
    assert status["engines"] == {"desired": 4, "ready": 4}
    assert cond(status, "Ready")["status"] == "False"


def test_counts_and_phases_while_starting() -> None:
    _, _, pods = group_and_pods(BUILDER)
    assert observe(BUILDER, [])["phase"] == "Pending"
    assert observe(BUILDER, [PodState(p).build() for p in pods])["phase"] == "Pending"
    partly = [PodState(p).ready().build() for p in pods[:3]] + [PodState(p).running().build() for p in pods[3:5]]
    status = observe(BUILDER, partly)
    assert status["phase"] == "Provisioning"
    assert status["trainers"] == {"desired": 2, "ready": 2}
    assert status["engines"] == {"desired": 4, "ready": 1}
    progressing = cond(status, "Progressing")
    assert progressing["status"] == "True" and progressing["reason"] == "PodsStarting"
    assert "creating g-engine-1-1" in progressing["message"]
    assert "waiting for g-engine-0-1, g-engine-1-0" in progressing["message"]
    assert cond(status, "Ready")["reason"] == "PodsNotReady"


def test_unschedulable_pods_explain_why() -> None:
    _, _, pods = group_and_pods(BUILDER)
    msg = "0/4 nodes are available: 4 Insufficient rdma/hca_shared_devices_a."
    status = observe(BUILDER, [PodState(p).unschedulable(msg).build() for p in pods])
    assert status["phase"] == "Pending"
    assert msg in cond(status, "Progressing")["message"]


def test_terminating_and_foreign_pods_do_not_count() -> None:
    _, _, pods = group_and_pods(BUILDER)
    observed = [PodState(p).ready().build() for p in pods]
    observed[0] = PodState(pods[0]).ready().terminating().build()
    stray = PodState(pods[1]).ready().build()
    stray["metadata"]["name"] = "g-trainer-7"  # not in the spec (e.g. a surplus pod on its way out)
    status = observe(BUILDER, [*observed, stray])
    assert status["trainers"] == {"desired": 2, "ready": 1}
    assert status["phase"] == "Provisioning"


def test_conditions_keep_their_transition_time_until_status_flips() -> None:
    _, _, pods = group_and_pods(BUILDER)
    starting = observe(BUILDER, [PodState(p).running().build() for p in pods], now=T0)
    assert cond(starting, "Ready")["lastTransitionTime"] == "2030-01-01T12:00:00Z"
    # Same status (False), different message: the time stays.
    half = [PodState(p).ready().build() for p in pods[:3]] + [PodState(p).running().build() for p in pods[3:]]
    later = observe(BUILDER, half, now=T1, previous=starting)
    assert cond(later, "Ready")["message"] != cond(starting, "Ready")["message"]
    assert cond(later, "Ready")["lastTransitionTime"] == "2030-01-01T12:00:00Z"
    # Flip to True: the time moves.
    ready = observe(BUILDER, [PodState(p).ready().build() for p in pods], now=T1, previous=later)
    assert cond(ready, "Ready")["lastTransitionTime"] == "2030-01-01T12:05:00Z"
    assert cond(ready, "Degraded")["lastTransitionTime"] == "2030-01-01T12:00:00Z"
    # Nothing changes: the status is identical (so the operator writes nothing).
    again = observe(BUILDER, [PodState(p).ready().build() for p in pods], now=T1 + timedelta(hours=1), previous=ready)
    assert strip_none(again) == strip_none(ready)


def test_set_conditions_keeps_unknown_types_and_stamps_generation() -> None:
    previous = [{"type": "Custom", "status": "True", "reason": "X", "message": "", "lastTransitionTime": "t"}]
    out = set_conditions(previous, [("Ready", "True", "AllPodsReady", "ok")], now=T0, generation=4)
    assert out[0]["observedGeneration"] == 4 and out[0]["lastTransitionTime"] == "2030-01-01T12:00:00Z"
    assert out[1] == previous[0]


def test_weight_version_is_the_minimum_over_engines_each_reported_by_its_first_pod() -> None:
    """Engines split over several pods: only each engine's first pod hosts its server and reports a version (issue
    11: these groups showed no weightVersion and Syncing forever); annotations elsewhere are not the engine's."""
    _, _, pods = group_and_pods(BUILDER)
    trainers, engines = pods[:2], pods[2:]  # engine-major: g-engine-0-0, g-engine-0-1, g-engine-1-0, g-engine-1-1
    observed = [PodState(p).ready().weight_version(9).build() for p in trainers] + [
        PodState(engines[0]).ready().weight_version(7).build(),
        PodState(engines[1]).ready().build(),  # no version: it hosts no server
        PodState(engines[2]).ready().weight_version(6).build(),
        PodState(engines[3]).ready().weight_version(1).build(),  # not the engine's reporter: ignored
    ]
    status = observe(BUILDER, observed)
    assert status["weightVersion"] == 6
    assert status["phase"] == "Syncing"  # trainers published 9, the engines hold 6 and 7


def test_engine_ranks_are_counted_by_the_path_their_agents_reported_and_garbled_reports_count_as_none() -> None:
    _, _, pods = group_and_pods(BUILDER)
    trainers, engines = pods[:2], pods[2:]
    paths = names.ANNOTATION_SYNC_PATHS
    observed = [PodState(p).ready().build() for p in trainers] + [
        PodState(engines[0]).ready().annotate(paths, '{"engine-replica": 2, "trace": 0}').build(),
        PodState(engines[1]).ready().annotate(paths, "not json").build(),
        PodState(engines[2]).ready().annotate(paths, '{"trace": 2, "engine-replica": 1}').build(),
        PodState(engines[3]).ready().annotate(paths, '{"trace": -4}').build(),
    ]
    assert observe(BUILDER, observed)["engines"]["syncPaths"] == {"trace": 2, "engineReplica": 3}
    silent = [PodState(p).ready().build() for p in pods]
    assert (
        "syncPaths" not in observe(BUILDER, silent)["engines"]
        or observe(BUILDER, silent)["engines"]["syncPaths"] is None
    )


def test_weight_version_needs_every_engine() -> None:
    _, _, pods = group_and_pods(BUILDER)
    observed = [PodState(p).ready().weight_version(3).build() for p in pods]
    head_of_engine_1 = 4
    observed[head_of_engine_1] = PodState(pods[head_of_engine_1]).ready().build()  # no annotation yet
    assert observe(BUILDER, observed)["weightVersion"] is None
    observed[head_of_engine_1] = (
        PodState(pods[head_of_engine_1]).ready().annotate(names.ANNOTATION_WEIGHT_VERSION, "default").build()
    )
    assert observe(BUILDER, observed)["weightVersion"] is None  # initial weights: no version
    missing = [p for i, p in enumerate(observed) if i != head_of_engine_1]
    assert observe(BUILDER, missing)["weightVersion"] is None  # a missing pod
    observed[head_of_engine_1] = PodState(pods[head_of_engine_1]).ready().weight_version(3).build()
    status = observe(BUILDER, observed)
    assert status["weightVersion"] == 3 and status["phase"] == "Ready"  # all hold what was published
    assert cond(status, "Ready")["reason"] == "AllPodsReady"


def test_a_restarted_engine_serving_its_initial_weights_is_not_ready_until_it_holds_the_committed_version() -> None:
    _, _, pods = group_and_pods(BUILDER)
    observed = [PodState(p).ready().weight_version(4).build() for p in pods]
    observed[4] = PodState(pods[4]).ready().annotate(names.ANNOTATION_WEIGHT_VERSION, "default").build()
    status = observe(BUILDER, observed)
    ready = cond(status, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "EnginesBehind"
    assert "engines [1] do not hold committed version 4 (engine 1 holds its initial weights)" in ready["message"]
    assert status["phase"] == "Syncing" and status["weightVersion"] is None
    observed[4] = PodState(pods[4]).ready().weight_version(3).build()  # an older version: behind as well
    assert "engine 1 holds 3" in cond(observe(BUILDER, observed), "Ready")["message"]
    observed[4] = PodState(pods[4]).ready().weight_version(4).build()  # caught up
    status = observe(BUILDER, observed)
    assert cond(status, "Ready")["status"] == "True" and status["phase"] == "Ready" and status["weightVersion"] == 4


@pytest.mark.parametrize(
    ("fields", "reason_part"),
    [
        ({"result": "Failed", "reason": "engine 1 rank 0 failed verification", "enginesPaused": True}, "verification"),
        (
            {"result": "Failed", "reason": "committed version 5, but resume failed: engine 0", "enginesPaused": True},
            "resume failed",
        ),
    ],
    ids=["failed-live-round", "failed-resume"],
)
def test_engines_left_paused_by_the_last_round_are_not_ready(fields: dict[str, Any], reason_part: str) -> None:
    _, _, pods = group_and_pods(BUILDER)
    observed = [PodState(p).ready().weight_version(4).build() for p in pods]
    observed[0] = PodState(pods[0]).ready().weight_version(4).last_round(version=5, **fields).build()
    status = observe(BUILDER, observed)
    ready = cond(status, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "EnginesPaused" and reason_part in ready["message"]
    assert cond(status, "Degraded")["reason"] == "EnginesPaused" and status["phase"] == "Degraded"
    assert status["lastSync"]["result"] == "Failed" and status["lastSync"]["enginesPaused"] is True
    # The next round succeeds: ready again.
    observed = [PodState(p).ready().weight_version(6).build() for p in pods]
    observed[0] = PodState(pods[0]).ready().weight_version(6).last_round(version=6, result="Succeeded").build()
    status = observe(BUILDER, observed)
    assert cond(status, "Ready")["status"] == "True" and status["phase"] == "Ready"


def test_last_sync_comes_from_the_coordinator() -> None:
    _, _, pods = group_and_pods(BUILDER)
    observed = [PodState(p).ready().build() for p in pods]
    observed[0] = (
        PodState(pods[0]).ready().last_round(version=4, result="Succeeded", durationSeconds=1.5, gbps=180.0).build()
    )
    folded = fold_status(Observation(name="g", generation=1, now=T0, spec=BUILDER.model().spec, pods=observed))
    # None entries make the merge patch remove what the previous round had.
    assert strip_none(folded.status["lastSync"]) == {
        "version": 4,
        "result": "Succeeded",
        "durationSeconds": 1.5,
        "gbps": 180.0,
    }
    assert folded.warnings == ()


def fold_with_round(previous: dict[str, Any] | None, **round_fields: Any) -> dict[str, Any]:
    _, _, pods = group_and_pods(BUILDER)
    observed = [PodState(p).ready().build() for p in pods]
    observed[0] = PodState(pods[0]).ready().last_round(**round_fields).build()
    obs = Observation(name="g", generation=1, now=T0, spec=BUILDER.model().spec, pods=observed, previous=previous)
    return fold_status(obs).status


def test_recent_syncs_keep_each_round_once_oldest_first() -> None:
    first = fold_with_round(None, version=1, result="Succeeded", startedAt="2030-01-01T12:00:00Z")
    assert [r["version"] for r in first["recentSyncs"]] == [1]
    again = fold_with_round(first, version=1, result="Succeeded", startedAt="2030-01-01T12:00:00Z")
    assert again["recentSyncs"] == first["recentSyncs"]  # the same round seen again is not a new one
    second = fold_with_round(again, version=2, result="Failed", startedAt="2030-01-01T12:01:00Z", reason="x" * 5000)
    assert [(r["version"], r["result"]) for r in second["recentSyncs"]] == [(1, "Succeeded"), (2, "Failed")]
    assert len(second["recentSyncs"][-1]["reason"]) == RECENT_REASON_CHARS
    assert len(second["lastSync"]["reason"]) == 5000  # lastSync keeps the whole reason
    WeightSyncGroupStatus.model_validate(second)


def test_recent_syncs_are_bounded_and_drop_what_no_longer_fits_the_schema() -> None:
    status: dict[str, Any] | None = {"recentSyncs": [{"version": -1, "result": "Succeeded"}, "junk"]}
    for version in range(1, RECENT_SYNCS + 5):
        status = fold_with_round(
            status, version=version, result="Succeeded", startedAt=f"2030-01-01T12:{version:02}:00Z"
        )
    assert status is not None
    assert [r["version"] for r in status["recentSyncs"]] == list(range(5, RECENT_SYNCS + 5))


def test_a_rounds_phases_pause_window_and_slowest_peers_reach_the_status() -> None:
    slowest = {"peer": "engine 1 rank 0", "bytes": 4096, "seconds": 0.5, "gbps": 0.0655}
    status = fold_with_round(
        None, version=3, result="Succeeded", phases={"write": 0.5, "verify": 0.1, "commit": 0.05},
        pausedSeconds=0.7, pausePolicy="overlap", slowestTarget=slowest, slowestSource={**slowest, "peer": "source 0"},
    )  # fmt: skip
    assert status["lastSync"]["phases"]["write"] == 0.5 and status["lastSync"]["pausedSeconds"] == 0.7
    assert status["recentSyncs"][-1]["slowestTarget"] == slowest
    # which pause policy ran, per round (what `weightsync rounds` shows)
    assert status["lastSync"]["pausePolicy"] == status["recentSyncs"][-1]["pausePolicy"] == "overlap"


def fold_warnings(previous: dict[str, Any] | None, **round_fields: Any) -> tuple[tuple[str, str], ...]:
    _, _, pods = group_and_pods(BUILDER)
    observed = [PodState(p).ready().build() for p in pods]
    observed[0] = PodState(pods[0]).ready().last_round(**round_fields).build()
    obs = Observation(name="g", generation=1, now=T0, spec=BUILDER.model().spec, pods=observed, previous=previous)
    return fold_status(obs).warnings


def test_a_failed_round_is_a_warning_event_naming_the_peer_and_the_cause_once() -> None:
    failed = {"version": 4, "result": "Aborted", "startedAt": "2030-01-01T12:00:00Z",
              "reason": "engine 1 commit: /start_weight_update: HTTP 502: connection reset"}  # fmt: skip
    ((reason, message),) = fold_warnings(None, **failed)
    assert reason == "SyncFailed"
    assert message == (
        "round v4 started 2030-01-01T12:00:00Z: Aborted: engine 1 commit: /start_weight_update: HTTP 502: "
        "connection reset"
    )
    seen = fold_with_round(None, **failed)
    assert fold_warnings(seen, **failed) == ()  # the status already holds that round: no second event


def test_a_round_over_its_slow_percentage_is_a_warning_naming_its_slowest_phase_and_peers() -> None:
    budget = BUILDER.model().spec.transfer.timeout_seconds  # 300 s; slowRoundPercent 50 by default
    slow = {"peer": "engine 1 rank 0", "bytes": 4096, "seconds": 151.0, "gbps": 0.0002}
    fields = {"version": 5, "result": "Succeeded", "startedAt": "2030-01-01T12:00:00Z",
              "phases": {"write": 151.0, "verify": 0.1}, "slowestTarget": slow,
              "slowestSource": {**slow, "peer": "source 1"}}  # fmt: skip
    ((reason, message),) = fold_warnings(None, durationSeconds=budget * 0.5 + 1, **fields)
    assert reason == "SyncSlow"
    assert "took 151.000 s, over 50% of its 300 s budget" in message
    assert "slowest phase write 151.000 s" in message
    assert "slowest source source 1 (151.000 s" in message and "slowest target engine 1 rank 0" in message
    assert fold_warnings(None, durationSeconds=budget * 0.5, **fields) == ()  # at the line: not slow


def test_a_scrubs_repair_is_a_weights_drifted_warning_naming_the_engine_rank_and_parameter() -> None:
    drift = f"{names.DRIFT_FOUND} in committed version 3: engine 0 rank 0: parameters ['model.norm.weight'] differ"
    fields = {"version": 3, "startedAt": "2030-01-01T12:00:00Z", "durationSeconds": 0.2}
    ((reason, message),) = fold_warnings(None, result="Succeeded", reason=f"{drift}; repaired", **fields)
    assert reason == "WeightsDrifted" and "engine 0 rank 0: parameters ['model.norm.weight'] differ" in message
    failed = fold_warnings(None, result="Failed", reason=f"{drift}; repair failed: catch-up: x", **fields)
    assert [r for r, _ in failed] == ["WeightsDrifted", "SyncFailed"]


def test_an_unrepaired_drift_is_not_ready_and_degraded_until_a_round_lands() -> None:
    drift = f"{names.DRIFT_FOUND} in committed version 3: engine 1 rank 0: buckets [2] differ"
    fields = {"version": 3, "startedAt": "2030-01-01T12:00:00Z", "durationSeconds": 0.0}
    status = fold_with_round(None, result="Failed", reason=f"{drift}; not repaired yet: round not started: x", **fields)
    ready = cond(status, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "WeightsDrifted" and "engine 1 rank 0" in ready["message"]
    assert cond(status, "Degraded")["reason"] == "WeightsDrifted" and status["phase"] == "Degraded"
    repaired = fold_with_round(status, result="Succeeded", reason=f"{drift}; repaired", **fields)
    assert cond(repaired, "Ready")["status"] == "True" and repaired["phase"] == "Ready"


@pytest.mark.parametrize(
    "annotation",
    ["{not json", '{"version": -1, "result": "Succeeded"}', '{"version": 1, "result": "Maybe"}', "[1, 2]"],
)
def test_a_bad_last_round_annotation_is_ignored_with_a_warning(annotation: str) -> None:
    _, _, pods = group_and_pods(BUILDER)
    observed = [PodState(p).ready().build() for p in pods]
    observed[0] = PodState(pods[0]).ready().annotate(names.ANNOTATION_LAST_ROUND, annotation).build()
    previous = {"lastSync": {"version": 2, "result": "Succeeded"}}
    folded = fold_status(
        Observation(name="g", generation=1, now=T0, spec=BUILDER.model().spec, pods=observed, previous=previous)
    )
    assert strip_none(folded.status["lastSync"]) == {
        "version": 2,
        "result": "Succeeded",
    }  # the last good stays
    ((reason, message),) = folded.warnings
    assert reason == "BadLastRound" and "g-trainer-0" in message


def test_a_failed_round_is_not_syncing_forever() -> None:
    """A staged round of v6 aborted (the engines kept serving v5, unpaused; the committed version stays 5)."""
    _, _, pods = group_and_pods(BUILDER)
    observed = [PodState(p).ready().weight_version(5).build() for p in pods[2:]]
    observed = [
        PodState(pods[0]).ready().weight_version(5).last_round(version=6, result="Aborted", reason="peer lost").build(),
        PodState(pods[1]).ready().weight_version(6).build(),
        *observed,
    ]
    status = observe(BUILDER, observed)
    assert status["phase"] == "Ready" and status["weightVersion"] == 5
    assert status["lastSync"]["result"] == "Aborted" and cond(status, "Ready")["status"] == "True"


def test_plan_status() -> None:
    _, plan, _ = group_and_pods(BUILDER)
    status = observe(BUILDER, [], plan=plan.model_copy(update={"revision": 3, "moved_targets": 2}))
    assert status["plan"] == {
        "hash": plan.hash,
        "revision": 3,
        "policy": plan.policy,
        "sources": 2,
        "targets": 4,
        "maxTargetsPerSource": plan.balance.max_targets_per_source,
        "maxShapesPerSource": plan.balance.max_shapes_per_source,
        "balanced": plan.balance.perfect,
        "movedTargets": 2,
        "configMap": "g-plan",
    }
    assert f"revision 3 ({plan.hash}" in cond(status, "PlanReady")["message"]


def test_a_spec_problem_fails_the_group_but_keeps_what_is_known() -> None:
    _, _, pods = group_and_pods(BUILDER)
    good = observe(BUILDER, [PodState(p).ready().build() for p in pods], now=T0)
    problem = Problem("InvalidSpec", "spec rejected: inference.adapter: Input should be 'sglang' or 'reference'")
    bad = observe(
        BUILDER,
        [PodState(p).ready().build() for p in pods],
        now=T1,
        previous=good,
        spec=None,
        plan=None,
        problem=problem,
    )
    assert bad["phase"] == "Failed"
    assert bad["plan"] == good["plan"]  # the published plan still stands
    assert bad["trainers"] == {"desired": 2, "ready": 2}
    degraded = cond(bad, "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True",
        "InvalidSpec",
        problem.message,
    )
    assert degraded["lastTransitionTime"] == "2030-01-01T12:05:00Z"
    assert cond(bad, "Ready")["status"] == "False" and cond(bad, "Ready")["reason"] == "InvalidSpec"
    assert cond(bad, "PlanReady")["status"] == "False"


def test_a_transient_problem_degrades() -> None:
    _, _, pods = group_and_pods(BUILDER)
    status = observe(
        BUILDER, [PodState(p).ready().build() for p in pods], problem=Problem("ApiError", "boom", fatal=False)
    )
    assert status["phase"] == "Degraded"
    assert cond(status, "Degraded")["reason"] == "ApiError"
    assert cond(status, "Ready")["status"] == "True"


def test_failing_pods_degrade_the_group() -> None:
    _, _, pods = group_and_pods(BUILDER)
    observed = [PodState(p).ready().build() for p in pods]
    observed[2] = PodState(pods[2]).crash_looping("engine", restarts=4).build()
    observed[3] = PodState(pods[3]).failed().build()
    folded = fold_status(Observation(name="g", generation=1, now=T0, spec=BUILDER.model().spec, pods=observed))
    assert folded.status["phase"] == "Degraded"
    assert [f.pod for f in folded.failures] == ["g-engine-0-0", "g-engine-0-1"]
    assert [f.reason for f in folded.failures] == ["CrashLoopBackOff", "Evicted"]
    degraded = cond(folded.status, "Degraded")
    assert degraded["reason"] == "PodFailures" and "CrashLoopBackOff" in degraded["message"]


def test_pod_failure_keys_change_with_each_restart() -> None:
    _, _, pods = group_and_pods(BUILDER)
    one = pod_failure(PodState(pods[0]).crash_looping(restarts=1).build())
    two = pod_failure(PodState(pods[0]).crash_looping(restarts=2).build())
    assert one is not None and two is not None and one.key != two.key
    assert pod_failure(PodState(pods[0]).ready().build()) is None
    assert pod_failure(PodState(pods[0]).failed().terminating().build()) is None


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["missing", "pending", "running", "ready", "crash"]), min_size=6, max_size=6))
def test_status_always_fits_the_crd(states: list[str]) -> None:
    _, _, pods = group_and_pods(BUILDER)
    observed = []
    for pod, state in zip(pods, states, strict=True):
        if state == "missing":
            continue
        dress = {
            "pending": lambda s: s,
            "running": PodState.running,
            "ready": PodState.ready,
            "crash": PodState.crash_looping,
        }[state]
        observed.append(dress(PodState(pod)).build())
    status = observe(BUILDER, observed)
    WeightSyncGroupStatus.model_validate(status)
    ready = sum(s == "ready" for s in states)
    assert status["trainers"]["ready"] + status["engines"]["ready"] == ready
    assert (status["phase"] == "Ready") == (ready == 6)


def test_outdated_pods_are_reported_not_hidden() -> None:
    _, _, pods = group_and_pods(BUILDER)
    status = observe(BUILDER, [PodState(p).ready().build() for p in pods], outdated=("g-trainer-0", "g-engine-1-1"))
    assert status["phase"] == "Ready"
    progressing = cond(status, "Progressing")
    assert progressing["status"] == "True" and progressing["reason"] == "PodsOutdated"
    assert "g-trainer-0, g-engine-1-1" in progressing["message"]


def test_garbage_in_the_previous_status_does_not_wedge_the_fold() -> None:
    previous = {
        "plan": {"hash": "x", "someFieldFromTheFuture": 1},
        "lastSync": {"version": "not a number"},
        "conditions": [{"type": "Custom"}, {"type": "Ready", "status": "True"}],
    }
    status = observe(BUILDER, [], previous=previous, plan=None)
    WeightSyncGroupStatus.model_validate(status)
    assert status["plan"] is None and status["lastSync"] is None
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded", "PlanReady"]


ENGINE_VERSION = st.one_of(st.none(), st.just("default"), st.integers(0, 6))
LAST_ROUND = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {
            "version": st.integers(0, 7),
            "result": st.sampled_from(["Succeeded", "Failed", "Aborted"]),
            "enginesPaused": st.booleans(),
        }
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    engines=st.integers(1, 3),
    pods_per_engine=st.integers(1, 3),
    heads=st.lists(ENGINE_VERSION, min_size=3, max_size=3),
    others=st.lists(st.integers(0, 6), min_size=9, max_size=9),
    committed=st.one_of(st.none(), st.integers(0, 6)),
    last=LAST_ROUND,
)
def test_the_version_fold_over_any_engines_and_pods(
    engines: int,
    pods_per_engine: int,
    heads: list[object],
    others: list[int],
    committed: int | None,
    last: dict[str, Any] | None,
) -> None:
    """Every pod ready; each engine's first pod reports ``heads[e]`` (None: no annotation), other pods carry noise.
    weightVersion, Ready (and its reason) and the phase follow from the engines' first pods, the committed version
    and the last round alone."""
    builder = GroupBuilder("g").trainers(1).engines(engines, tp=pods_per_engine, ranks_per_pod=1)
    _, _, pods = group_and_pods(builder)
    coordinator = PodState(pods[0]).ready()
    if committed is not None:
        coordinator = coordinator.weight_version(committed)
    if last is not None:
        coordinator = coordinator.last_round(**last)
    observed = [coordinator.build()]
    for index, pod in enumerate(pods[1:]):
        engine, slot = divmod(index, pods_per_engine)
        state = PodState(pod).ready()
        version = heads[engine] if slot == 0 else others[index]
        if version is not None:
            state = state.annotate(names.ANNOTATION_WEIGHT_VERSION, str(version))
        observed.append(state.build())
    status = observe(builder, observed)
    WeightSyncGroupStatus.model_validate(status)

    held = [v if isinstance(v, int) else None for v in heads[:engines]]
    assert status["weightVersion"] == (None if None in held else min(v for v in held if v is not None))
    paused = last is not None and last["result"] != "Succeeded" and last["enginesPaused"]
    behind = committed is not None and any(v is None or v < committed for v in held)
    ready = cond(status, "Ready")
    assert (ready["status"] == "True") == (not paused and not behind)
    if paused:
        assert ready["reason"] == "EnginesPaused" and status["phase"] == "Degraded"
    elif behind:
        assert ready["reason"] == "EnginesBehind" and status["phase"] == "Syncing"
        assert f"committed version {committed}" in ready["message"]
    else:
        assert ready["reason"] == "AllPodsReady" and status["phase"] in ("Ready", "Syncing")
