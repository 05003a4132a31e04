"""CEL validation rules, written once and used twice.

Each rule lands in the CRD as an ``x-kubernetes-validations`` entry, so the API server rejects a bad
object with ``message``; the same expression is evaluated here (with cel-python) when a spec is read
outside a cluster (``weightsync plan -f``), so both paths give the same words for the same mistake.
Transition rules (those that use ``oldSelf``) only make sense on update and are checked by
:func:`check_transition`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import celpy
from celpy.adapter import json_to_cel


@dataclass(frozen=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry."""

    rule: str
    message: str
    field_path: str | None = None
    reason: str | None = None

    @property
    def is_transition(self) -> bool:
        return "oldSelf" in self.rule

    def to_schema(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"rule": self.rule, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        if self.reason:
            entry["reason"] = self.reason
        return entry


@dataclass(frozen=True)
class CelViolation:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


@dataclass
class RuleSet:
    """Rules attached to one schema location (a dotted path from the object root, '' = root)."""

    path: str
    rules: Sequence[CelRule] = field(default_factory=tuple)


@cache
def _program(expression: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression))


def evaluate(rule: CelRule, self_value: Any, old_value: Any = None) -> bool:
    """Evaluate one rule; an evaluation error counts as a violation, as it does on the API server."""
    activation: dict[str, Any] = {"self": json_to_cel(self_value)}
    if rule.is_transition:
        activation["oldSelf"] = json_to_cel(old_value)
    try:
        result = _program(rule.rule).evaluate(activation)
    except Exception:  # celpy raises its own error types, all of which mean "did not hold"
        return False
    return bool(result) if not isinstance(result, Exception) else False


def _lookup(obj: Any, path: str) -> tuple[bool, Any]:
    current = obj
    for part in [p for p in path.split(".") if p]:
        if not isinstance(current, Mapping) or part not in current:
            return False, None
        current = current[part]
    return True, current


def check(obj: Mapping[str, Any], rule_sets: Sequence[RuleSet]) -> list[CelViolation]:
    """Check the non-transition rules against ``obj`` (already defaulted)."""
    violations: list[CelViolation] = []
    for rule_set in rule_sets:
        present, value = _lookup(obj, rule_set.path)
        if not present:
            continue
        for rule in rule_set.rules:
            if rule.is_transition:
                continue
            if not evaluate(rule, value):
                violations.append(CelViolation(_join(rule_set.path, rule.field_path), rule.message))
    return violations


def check_transition(
    old: Mapping[str, Any], new: Mapping[str, Any], rule_sets: Sequence[RuleSet]
) -> list[CelViolation]:
    """Check the transition rules (``oldSelf``), as the API server does on update."""
    violations: list[CelViolation] = []
    for rule_set in rule_sets:
        old_present, old_value = _lookup(old, rule_set.path)
        new_present, new_value = _lookup(new, rule_set.path)
        if not (old_present and new_present):
            continue
        for rule in rule_set.rules:
            if rule.is_transition and not evaluate(rule, new_value, old_value):
                violations.append(CelViolation(_join(rule_set.path, rule.field_path), rule.message))
    return violations


def _join(path: str, field_path: str | None) -> str:
    suffix = (field_path or "").lstrip(".")
    return ".".join(p for p in (path, suffix) if p)
