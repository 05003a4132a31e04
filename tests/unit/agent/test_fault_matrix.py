"""The fault matrix's invariants (``weightsync_testing.fault_matrix``) and the status a local group's reports fold to
(``weightsync_testing.reported_status``): each check passes a true cell and fails the lie it exists to catch."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_testing.fault_matrix import CellRun, EngineView, Snapshot, failed, judge, table, to_json
from weightsync_testing.reported_status import EngineReport, ready_condition, reported_pods

TEMPLATE = {"spec": {"containers": [{"name": "main", "image": "x"}]}}
SPEC = WeightSyncGroupSpec.model_validate(
    {
        "trainer": {"replicas": 2, "template": TEMPLATE},
        "inference": {"engines": 2, "ranksPerEngine": 2, "ranksPerPod": 2, "adapter": "reference",
                      "template": TEMPLATE},
    }
)  # fmt: skip


def serving(engine: int, version: str) -> EngineView:
    return EngineView(engine, True, version, False, version)


def paused(engine: int, reported: str, holds: str | None) -> EngineView:
    return EngineView(engine, True, reported, True, holds)


def healthy_failure(**changes: object) -> CellRun:
    """Engine 1 killed at verify of version 3: the round fails in budget naming it, engine 0 stays paused (dirty),
    engine 1 restarts on its initial weights, the status says EnginesPaused; version 4 lands everywhere."""
    run = CellRun(
        fault="engine-kill",
        phase="verify",
        peer="engine 1",
        version=3,
        budget=10.0,
        result="Failed",
        reason="engine 1 rank 0 verify: HTTP 502",
        seconds=1.2,
        committed=False,
        engines_paused=True,
        after=Snapshot((paused(0, "2", None), serving(1, "default")), 2, "False", "EnginesPaused"),
        recovered=Snapshot((serving(0, "4"), serving(1, "4")), 4, "True", "AllPodsReady"),
        recovery_result="Succeeded",
    )
    return replace(run, **changes)  # type: ignore[arg-type]


def test_a_true_cell_passes_every_check() -> None:
    assert judge(healthy_failure()) == dict.fromkeys(("budget", "holds", "truthful", "recovered", "names"), "ok")


def test_a_round_past_its_budget_and_slack_fails_budget() -> None:
    assert judge(healthy_failure(seconds=15.0))["budget"] == "ok"
    assert "took 15.1 s" in judge(healthy_failure(seconds=15.1))["budget"]


def test_an_engine_serving_bytes_of_another_version_than_it_reports_fails_holds() -> None:
    lying = Snapshot((serving(0, "2"), EngineView(1, True, "3", False, None)), 2, "False", "EnginesBehind")
    verdict = judge(healthy_failure(after=lying))["holds"]
    assert verdict == "engine 1 serves as version 3 bytes of no known version"
    # Paused, it serves nothing: a dirty engine still labelled with its old version is no false claim.
    assert judge(healthy_failure())["holds"] == "ok"


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"result": "Succeeded"}, "engines [0, 1] do not hold it"),
        (
            {"after": Snapshot((serving(0, "2"), serving(1, "2")), 2, "False", "EnginesPaused")},
            "the status says EnginesPaused, no engine is paused",
        ),
        (
            {"after": Snapshot((paused(0, "2", None), serving(1, "2")), 2, "True", "AllPodsReady")},
            "the status is Ready, engines [0] do not serve the committed version; engines [0] are paused and the "
            "status is Ready",
        ),
        (
            {"after": Snapshot((paused(0, "2", None), serving(1, "default")), 3, "False", "EnginesPaused")},
            "the round failed, the coordinator says 3 is committed",
        ),
    ],
)
def test_a_result_or_status_the_engines_contradict_fails_truthful(changes: dict[str, object], says: str) -> None:
    assert says in judge(healthy_failure(**changes))["truthful"]


def test_a_recovery_that_does_not_land_everywhere_fails_recovered() -> None:
    assert judge(healthy_failure(recovery_result="Failed"))["recovered"] == "the next round: Failed"
    behind = Snapshot((serving(0, "4"), serving(1, "default")), 4, "False", "EnginesBehind")
    assert judge(healthy_failure(recovered=behind))["recovered"] == "engine 1 reports default, holds default"
    assert judge(healthy_failure(recovery_rounds=2))["recovered"] == (
        "the next round failed; round 2 of that version landed"
    )


def test_a_failure_must_name_the_peer_and_the_phase() -> None:
    assert judge(healthy_failure(reason="source 0 failed: timed out"))["names"] == (
        "the reason does not name the peer (engine 1) nor a phase"
    )
    assert judge(healthy_failure(reason="engine 1 rank 0 failed verification of version 3"))["names"] == "ok"
    assert judge(healthy_failure(result="Succeeded", reason=None, after=healthy_failure().recovered,
                                 version=4))["names"] == "ok"  # fmt: skip


def test_a_killed_coordinators_round_need_name_only_the_agent_that_is_gone() -> None:
    """Its phase died with it: the trainer can say only that its agent could not run the round."""
    killed = healthy_failure(fault="coordinator-kill", peer="weightsync agent", result="error",
                             reason="the weightsync agent could not run the round: connection reset")  # fmt: skip
    assert judge(killed)["names"] == "ok"
    assert (
        judge(replace(killed, reason="connection reset"))["names"]
        == "the reason does not name the peer (weightsync agent)"
    )
    assert judge(replace(killed, fault="engine-kill"))["names"] == "the reason does not name a phase"


def test_the_table_and_json_carry_every_cell_and_failed_lists_each_broken_check() -> None:
    good = replace(healthy_failure(), verdicts=judge(healthy_failure()))
    slow = healthy_failure(phase="commit", seconds=40.0, reason="source 0 write did not finish before the deadline")
    slow = replace(slow, verdicts=judge(slow))
    text = table([good, slow]).splitlines()
    assert text[0].split()[:5] == ["fault", "phase", "outcome", "s", "budget"]
    assert text[1].split()[:5] == ["engine-kill", "verify", "Failed", "(paused)", "1.20"]
    assert "FAIL" in text[2] and "FAIL" not in text[1]
    assert failed([good, slow]) == [
        "engine-kill@commit budget: the round took 40.0 s, over timeoutSeconds 10 + 5 s",
        "engine-kill@commit names: the reason does not name the peer (engine 1)",
    ]
    assert [cell["phase"] for cell in json.loads(to_json([good, slow]))] == ["verify", "commit"]


def test_the_folded_status_is_ready_only_when_every_engine_reports_the_committed_version() -> None:
    def ready(engines: dict[int, EngineReport], last: dict[str, object] | None = None) -> tuple[str, str]:
        pods = reported_pods("g", SPEC, committed=2, last_round=last, engines=engines, trainers_ready=[True, True])
        status, reason, _ = ready_condition("g", SPEC, pods)
        return status, reason

    assert ready({0: EngineReport(True, "2"), 1: EngineReport(True, "2")}) == ("True", "AllPodsReady")
    # A restarted engine on its initial weights: its agent says CatchingUp, the pod is not ready.
    assert ready({0: EngineReport(True, "2"), 1: EngineReport(True, "default")}) == ("False", "PodsNotReady")
    failed_round = {"version": 3, "result": "Failed", "startedAt": "2026-01-01T00:00:00Z", "durationSeconds": 1.0,
                    "bytes": 0, "gbps": 0.0, "enginesPaused": True, "reason": "engine 1 commit: HTTP 500"}  # fmt: skip
    both = {0: EngineReport(True, "2"), 1: EngineReport(True, "2")}
    assert ready(both, failed_round) == ("False", "EnginesPaused")
