"""The generated CRD: committed copies, structural-schema rules, defaults that match the models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from weightsync.api import crd
from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_tools.cli.main import app

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = [
    ROOT / "crds" / "weightsync.io_weightsyncgroups.yaml",
    ROOT / "charts" / "weightsync" / "crds" / "weightsync.io_weightsyncgroups.yaml",
]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_crd_is_generated(path: Path) -> None:
    assert path.read_text() == crd.render_crd(), f"{path} is stale: run `weightsync crd > {path}`"


def test_cli_prints_and_checks_the_crd() -> None:
    runner = CliRunner()
    printed = runner.invoke(app, ["crd"])
    assert printed.exit_code == 0
    assert printed.stdout == crd.render_crd()
    checked = runner.invoke(app, ["crd", *[arg for p in COMMITTED for arg in ("--check", str(p))]])
    assert checked.exit_code == 0, checked.output


def test_cli_check_fails_on_a_stale_copy(tmp_path: Path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text(crd.render_crd().replace("wsg", "xyz"))
    result = CliRunner().invoke(app, ["crd", "--check", str(stale)])
    assert result.exit_code == 1


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, sub in node.get("properties", {}).items():
        out += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural() -> None:
    schema = crd.openapi_schema()
    for path, node in _walk(schema):
        assert "$ref" not in node, path
        assert "title" not in node, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"
            assert all("properties" not in v and "items" not in v for v in node["anyOf"]), path


def test_crd_names_and_columns() -> None:
    obj = crd.build_crd()
    names = obj["spec"]["names"]
    assert (names["plural"], names["shortNames"], names["categories"]) == (
        "weightsyncgroups",
        ["wsg"],
        ["weightsync"],
    )
    version = obj["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    default_columns = [c["name"].upper() for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert default_columns == ["PHASE", "READY", "TRAINERS", "ENGINES", "MODE", "VERSION", "LAST-SYNC", "AGE"]


def _schema_defaults(node: dict[str, Any]) -> dict[str, Any]:
    """Apply schema defaults to an empty object, the way the API server's defaulting does."""
    out: dict[str, Any] = {}
    for name, sub in node.get("properties", {}).items():
        if "default" in sub:
            value = sub["default"]
            if sub.get("type") == "object" and isinstance(value, dict):
                value = {**_schema_defaults(sub), **value}
            out[name] = value
    return out


def test_schema_defaults_equal_model_defaults() -> None:
    """The API server fills defaults from the schema, the operator from the models: they must agree."""
    spec_schema = crd.spec_schema()
    template = {"spec": {"containers": [{"name": "main"}]}}
    minimal = {
        "trainer": {"replicas": 1, "template": template},
        "inference": {"engines": 1, "template": template},
    }
    from_models = WeightSyncGroupSpec.model_validate(minimal).model_dump(mode="json", by_alias=True, exclude_none=True)
    for section in ("trainer", "inference"):
        expected = {**minimal[section], **_schema_defaults(spec_schema["properties"][section])}
        assert from_models[section] == expected, section
    for section in ("transfer", "rdma", "agent"):
        assert from_models[section] == _schema_defaults(spec_schema["properties"][section]), section


def test_crd_yaml_parses_back() -> None:
    text = crd.render_crd()
    assert yaml.safe_load(text) == crd.build_crd()


def test_api_reference_doc_is_generated() -> None:
    from weightsync.api.reference import render_reference

    path = ROOT / "docs" / "api-reference.md"
    assert path.read_text() == render_reference(), "docs/api-reference.md is stale: run `weightsync reference`"
