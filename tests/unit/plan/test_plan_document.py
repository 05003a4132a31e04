"""The plan document: self-checking, deterministic, round-trips, stays small."""

from __future__ import annotations

import json
from typing import Any

import pytest
from plan_builders import SpecBuilder, spec

from weightsync.plan import Plan, PlanError, plan_for

ONE_MIB = 1 << 20


def _doc(plan: Plan) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(plan.to_json())
    return data


@pytest.fixture
def plan() -> Plan:
    return plan_for(SpecBuilder().trainers(3).engines(3, tp=2).build(), group="g", namespace="ns")


def test_round_trip(plan: Plan) -> None:
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.hash == plan.hash
    assert again.to_json() == plan.to_json()


def test_same_spec_same_hash() -> None:
    first = plan_for(spec(7, 5, 4), group="g", namespace="ns")
    second = plan_for(spec(7, 5, 4), group="g", namespace="ns")
    assert first.hash == second.hash
    assert first.to_json() == second.to_json()


def test_hash_ignores_revision_and_moves(plan: Plan) -> None:
    assert plan.sealed(revision=9, moved_targets=4).hash == plan.hash


def test_hash_covers_transfer_settings() -> None:
    base = plan_for(SpecBuilder().trainers(2).engines(2, tp=2).build())
    other = plan_for(SpecBuilder().trainers(2).engines(2, tp=2).bucket_mib(64).build())
    assert base.sources == other.sources
    assert base.hash != other.hash


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["sources"][1]["targets"].append(d["sources"][0]["targets"][0]), "more than one source"),
        (lambda d: d["sources"][2]["targets"].pop(), "have no source"),
        (lambda d: d["sources"][0]["targets"].append([0, 2]), "outside"),
        (lambda d: d["sources"][0]["targets"].append([3, 0]), "outside"),
        (lambda d: d["sources"].reverse(), "rank order"),
        (lambda d: d["sources"].pop(), "lists 2 sources"),
    ],
    ids=["duplicated", "missing", "rank-out-of-range", "engine-out-of-range", "unordered", "source-missing"],
)
def test_malformed_assignment_is_refused(plan: Plan, edit: Any, message: str) -> None:
    # The structural checks run before the hash check, so the message tells which one refused it.
    data = _doc(plan)
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_json(json.dumps(data))


def test_wrong_hash_is_refused(plan: Plan) -> None:
    data = _doc(plan)
    data["hash"] = "0" * 16
    with pytest.raises(PlanError, match="hash does not match"):
        Plan.from_json(json.dumps(data))


def test_altered_content_under_old_hash_is_refused(plan: Plan) -> None:
    data = _doc(plan)
    first, second = data["sources"][0]["targets"], data["sources"][1]["targets"]
    first.append(second.pop())
    with pytest.raises(PlanError, match="hash does not match"):
        Plan.from_json(json.dumps(data))


def test_unsealed_is_refused(plan: Plan) -> None:
    data = _doc(plan)
    data["hash"] = ""
    with pytest.raises(PlanError, match="no hash"):
        Plan.from_json(json.dumps(data))


@pytest.mark.parametrize("version", ["weightsync.io/plan/v2", None, 1])
def test_wrong_schema_version_is_refused(plan: Plan, version: Any) -> None:
    data = _doc(plan)
    if version is None:
        del data["schemaVersion"]
    else:
        data["schemaVersion"] = version
    with pytest.raises(PlanError, match="schemaVersion"):
        Plan.from_json(json.dumps(data))


@pytest.mark.parametrize("text", ["", "{", "not json", b"\xff\xfe"])
def test_not_json_is_refused(text: str | bytes) -> None:
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json(text)


@pytest.mark.parametrize("text", ["[]", "1", '"plan"', "null"])
def test_not_an_object_is_refused(text: str) -> None:
    with pytest.raises(PlanError, match="JSON object"):
        Plan.from_json(text)


def test_wrong_field_type_is_refused(plan: Plan) -> None:
    data = _doc(plan)
    data["sources"][0]["targets"] = "everything"
    with pytest.raises(PlanError, match="malformed plan"):
        Plan.from_json(json.dumps(data))


def test_4096_rank_plan_is_under_one_mib() -> None:
    plan = plan_for(SpecBuilder().trainers(512, ranks_per_pod=8).engines(512, tp=8).build(), group="g" * 40)
    assert plan.layout.sources == plan.layout.targets == 4096
    assert len(plan.to_json().encode()) < ONE_MIB


def test_largest_allowed_plan_is_under_one_mib() -> None:
    build = SpecBuilder().trainers(256, ranks_per_pod=64).engines(64, tp=256, ranks_per_pod=8)
    plan = plan_for(build.build())
    assert plan.layout.sources == plan.layout.targets == 16384
    assert len(plan.to_json().encode()) < ONE_MIB
