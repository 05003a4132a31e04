"""Bad specs are rejected with a message a user understands — by the models, the CEL rules and the schema.

The fixtures in tests/fixtures/invalid/ are shared with the real-cluster tests, which apply them to a
real API server. Each one says what it expects: ``# expect:`` (everywhere), ``# expect-local:`` (from
weightsync's own parsing) or ``# expect-server:`` (from the API server's schema checks).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from weightsync.api import cel, crd
from weightsync.api.load import SpecError, defaulted_object, load_groups, parse_group
from weightsync.api.v1alpha1 import WeightSyncGroup
from weightsync_tools.cli.main import app

ROOT = Path(__file__).resolve().parents[3]
INVALID = sorted((ROOT / "tests" / "fixtures" / "invalid").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def expectations(path: Path) -> dict[str, str]:
    found = dict(re.findall(r"^# (expect(?:-local|-server)?): (.+)$", path.read_text(), flags=re.M))
    assert found, f"{path.name} states no expectation"
    return found


def test_there_are_at_least_fifteen_invalid_fixtures() -> None:
    assert len(INVALID) >= 15


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    for group in load_groups(path):
        assert group.metadata.name


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_fixture_is_rejected_locally(path: Path) -> None:
    wanted = expectations(path)
    message = wanted.get("expect-local") or wanted["expect"]
    with pytest.raises(SpecError) as caught:
        load_groups(path)
    assert message in str(caught.value), str(caught.value)


# --- The CRD itself (schema + CEL), not the models, must reject each fixture ----------------------


def _unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """What the API server's strict field validation reports: fields the schema doesn't declare."""
    if not isinstance(obj, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return (
            []
            if not isinstance(obj, dict)
            else [
                p
                for k, v in obj.items()
                if k in schema.get("properties", {})
                for p in _unknown_fields(v, schema["properties"][k], f"{path}.{k}")
            ]
        )
    props = schema.get("properties")
    if props is None:
        return []
    out = []
    for key, value in obj.items():
        if key not in props:
            out.append(f'unknown field "{(path + "." + key).lstrip(".")}"')
        else:
            out += _unknown_fields(value, props[key], f"{path}.{key}")
    return out


def crd_rejections(obj: dict[str, Any]) -> list[str]:
    """Approximate the API server: structural schema (as JSON Schema), unknown fields, then CEL."""
    schema = crd.openapi_schema()
    problems = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]
    problems += _unknown_fields(obj.get("spec", {}), schema["properties"]["spec"], "spec")
    if problems:
        return problems
    defaulted = defaulted_object(WeightSyncGroup.model_validate(obj))
    return [str(v) for v in cel.check(defaulted, crd.rule_sets())]


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_fixture_is_rejected_by_the_crd(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert crd_rejections(obj), f"the CRD would accept {path.name}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_the_crd(path: Path) -> None:
    for obj in yaml.safe_load_all(path.read_text()):
        assert crd_rejections(obj) == []


# --- CEL rules against an independent statement of what they mean ---------------------------------

TEMPLATE = {"spec": {"containers": [{"name": "main", "image": "x"}]}}


def spec_strategy() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "trainer": st.fixed_dictionaries(
                {
                    "replicas": st.integers(1, 4096),
                    "ranksPerPod": st.integers(1, 64),
                    "template": st.just(TEMPLATE),
                }
            ),
            "inference": st.fixed_dictionaries(
                {
                    "engines": st.integers(1, 4096),
                    "ranksPerEngine": st.sampled_from([1, 2, 3, 4, 6, 8, 16, 32, 256]),
                    "ranksPerPod": st.sampled_from([1, 2, 3, 4, 8]),
                    "template": st.just(TEMPLATE),
                }
            ),
            "transfer": st.fixed_dictionaries(
                {
                    "protocol": st.sampled_from(["auto", "rdma", "tcp"]),
                    "planner": st.sampled_from(["balanced", "miles"]),
                },
                optional={"maxReplicaShapesPerSource": st.integers(1, 8)},
            ),
            "rdma": st.fixed_dictionaries(
                {"hostNetwork": st.booleans(), "networks": st.lists(st.sampled_from(["a", "b"]), max_size=2)},
                optional={"resourceName": st.sampled_from(["rdma/ib", "rdma/hca_shared_devices_a"])},
            ),
        }
    )


def intended(spec: dict[str, Any]) -> bool:
    """What the spec-level CEL rules are meant to say, written independently in Python."""
    t, i, x, r = spec["trainer"], spec["inference"], spec["transfer"], spec["rdma"]
    return (
        i["ranksPerEngine"] % i["ranksPerPod"] == 0
        and (x["protocol"] != "rdma" or "resourceName" in r)
        and not (r["hostNetwork"] and r["networks"])
        and ("maxReplicaShapesPerSource" not in x or x["planner"] == "balanced")
        and t["replicas"] * t["ranksPerPod"] <= 16384
        and i["engines"] * i["ranksPerEngine"] <= 16384
    )


@settings(max_examples=150, deadline=None)
@given(spec=spec_strategy())
def test_cel_rules_mean_what_they_say(spec: dict[str, Any]) -> None:
    obj = {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSyncGroup",
        "metadata": {"name": "g"},
        "spec": spec,
    }
    try:
        parse_group(obj)
        accepted = True
    except SpecError:
        accepted = False
    assert accepted == intended(spec)


# --- Transition rules (immutability) --------------------------------------------------------------


def _obj(**changes: Any) -> dict[str, Any]:
    base = yaml.safe_load((ROOT / "examples" / "tcp-group.yaml").read_text())
    obj = copy.deepcopy(base)
    for dotted, value in changes.items():
        cursor = obj["spec"]
        *parents, leaf = dotted.split("__")
        for part in parents:
            cursor = cursor[part]
        cursor[leaf] = value
    return obj


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"inference__ranksPerEngine": 4}, "inference.ranksPerEngine is immutable"),
        ({"inference__ranksPerPod": 1}, "inference.ranksPerPod is immutable"),
        ({"trainer__ranksPerPod": 2}, "trainer.ranksPerPod is immutable"),
        ({"inference__adapter": "sglang"}, "inference.adapter is immutable"),
    ],
)
def test_immutable_fields(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_group(_obj(**change), old=_obj())


@pytest.mark.parametrize(
    "change",
    [
        {"inference__engines": 5},
        {"trainer__replicas": 7},
        {"transfer__mode": "broadcast"},
        {"transfer__bucketSizeMiB": 8},
    ],
)
def test_scaling_and_tuning_are_allowed(change: dict[str, Any]) -> None:
    parse_group(_obj(**change), old=_obj())


# --- CLI ----------------------------------------------------------------------------------------


def test_validate_command_reports_every_problem(tmp_path: Path) -> None:
    bad = _obj(transfer__protocol="rdma", inference__ranksPerPod=3)
    bad["spec"]["inference"]["ranksPerEngine"] = 4
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = CliRunner().invoke(app, ["validate", "-f", str(path)])
    assert result.exit_code == 2
    assert "rdma.resourceName is required" in result.output
    assert "multiple of inference.ranksPerPod" in result.output


def test_validate_command_accepts_examples() -> None:
    result = CliRunner().invoke(app, ["validate", "-f", str(EXAMPLES[0])])
    assert result.exit_code == 0 and "valid" in result.output
