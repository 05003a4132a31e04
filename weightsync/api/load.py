"""Read WeightSyncGroup objects from YAML/dicts and validate them as the API server would.

The API server checks the CRD's schema and CEL rules; outside a cluster we check the same things with
the pydantic models (schema) and cel-python (the very same CEL expressions), so `weightsync plan -f`
and the operator reject what the API server rejects, with the same messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from weightsync.api import cel, crd
from weightsync.api.v1alpha1 import API_VERSION, KIND, WeightSyncGroup


class SpecError(ValueError):
    """An invalid WeightSyncGroup; ``problems`` lists every mistake, each as 'path: message'."""

    def __init__(self, name: str, problems: list[str]) -> None:
        self.name = name
        self.problems = problems
        listing = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"WeightSyncGroup {name or '<unnamed>'} is invalid:\n{listing}")


def _pydantic_problems(exc: ValidationError, prefix: str) -> list[str]:
    problems = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"] if not str(part).startswith("function-"))
        problems.append(f"{prefix}{location}: {error['msg']}")
    return problems


def parse_group(obj: Mapping[str, Any], *, old: Mapping[str, Any] | None = None) -> WeightSyncGroup:
    """Validate one object (schema, then CEL; transition rules too when ``old`` is given)."""
    name = str(obj.get("metadata", {}).get("name", ""))
    if obj.get("kind", KIND) != KIND or obj.get("apiVersion", API_VERSION) != API_VERSION:
        raise SpecError(name, [f"expected apiVersion {API_VERSION}, kind {KIND}"])
    try:
        group = WeightSyncGroup.model_validate(obj)
    except ValidationError as exc:
        raise SpecError(name, _pydantic_problems(exc, "")) from exc
    defaulted = defaulted_object(group)
    rule_sets = crd.rule_sets()
    violations = cel.check(defaulted, rule_sets)
    if old is not None:
        old_group = WeightSyncGroup.model_validate(old)
        violations += cel.check_transition(defaulted_object(old_group), defaulted, rule_sets)
    if violations:
        raise SpecError(name, [str(v) for v in violations])
    return group


def defaulted_object(group: WeightSyncGroup) -> dict[str, Any]:
    """The object as the API server stores it: defaults filled in, absent optionals left out."""
    return {
        "apiVersion": group.api_version,
        "kind": group.kind,
        "metadata": group.metadata.model_dump(exclude_defaults=False),
        "spec": group.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def iter_documents(text: str) -> Iterable[dict[str, Any]]:
    for doc in yaml.safe_load_all(text):
        if isinstance(doc, dict):
            if doc.get("kind") == "List":
                yield from (item for item in doc.get("items", []) if isinstance(item, dict))
            else:
                yield doc


def load_groups(path: str | Path) -> list[WeightSyncGroup]:
    """Every WeightSyncGroup in a YAML file (other kinds are skipped), validated."""
    text = Path(path).read_text() if str(path) != "-" else _stdin()
    groups = [parse_group(doc) for doc in iter_documents(text) if doc.get("kind") == KIND]
    if not groups:
        raise SpecError("", [f"{path}: no {KIND} found"])
    return groups


def _stdin() -> str:
    import sys

    return sys.stdin.read()
