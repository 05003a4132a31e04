"""Generate the ``WeightSyncGroup`` CustomResourceDefinition from the pydantic models.

Pydantic emits JSON Schema; a CRD needs a *structural* OpenAPI v3 schema: no ``$ref``, no ``title``,
no ``anyOf`` with ``null``, a ``type`` on every node. :func:`to_structural` does that conversion,
:func:`build_crd` wraps the result in the CRD object. Pure: no I/O.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any

import yaml

from weightsync.api import v1alpha1 as api
from weightsync.api.cel import CelRule, RuleSet

_DROP_KEYS = {"title"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS or key == "$defs":
            continue
        if key == "additionalProperties" and value is False:
            # extra="forbid" in pydantic; structural schemas can't say it, and the API server's strict
            # field validation already rejects unknown fields.
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: _resolve(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _resolve(value, defs)
    return _ordered(_collapse_optional(out))


_FIRST_KEYS = ("type", "description", "default")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Put type and description first, so the generated YAML reads top-down."""
    head = {k: node[k] for k in _FIRST_KEYS if k in node}
    return {**head, **{k: v for k, v in node.items() if k not in head}}


def _collapse_optional(node: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, {type: null}]`` (pydantic's ``X | None``) becomes X: absence already means None."""
    variants = node.get("anyOf")
    if not isinstance(variants, list):
        return node
    non_null = [v for v in variants if v != {"type": "null"}]
    if len(non_null) == len(variants) or len(non_null) != 1:
        return node
    merged = {**non_null[0], **{k: v for k, v in node.items() if k != "anyOf"}}
    if merged.get("default", "absent") is None:
        del merged["default"]
    return _ordered(merged)


def to_structural(json_schema: dict[str, Any]) -> dict[str, Any]:
    """Turn a pydantic JSON schema into a structural OpenAPI v3 schema."""
    defs = json_schema.get("$defs", {})
    result = _resolve(json_schema, defs)
    assert isinstance(result, dict)
    return result


def spec_schema() -> dict[str, Any]:
    return to_structural(api.WeightSyncGroupSpec.model_json_schema(by_alias=True, mode="validation"))


def status_schema() -> dict[str, Any]:
    return to_structural(api.WeightSyncGroupStatus.model_json_schema(by_alias=True, mode="serialization"))


def openapi_schema() -> dict[str, Any]:
    """The whole object's schema, as it goes into the CRD."""
    return {
        "type": "object",
        "description": "A group of trainer and inference pods whose weights weightsync keeps in sync.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        **api.ROOT_RULES,
    }


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Ready')].status"},
    {
        "name": "Trainers",
        "type": "string",
        "jsonPath": ".status.trainers.ready",
        "description": "Trainer pods whose agent is ready",
    },
    {
        "name": "Engines",
        "type": "string",
        "jsonPath": ".status.engines.ready",
        "description": "Engine pods whose agent is ready",
    },
    {"name": "Mode", "type": "string", "jsonPath": ".spec.transfer.mode"},
    {"name": "Version", "type": "integer", "jsonPath": ".status.weightVersion"},
    {"name": "Last-Sync", "type": "string", "jsonPath": ".status.lastSync.result"},
    {"name": "Duration", "type": "number", "jsonPath": ".status.lastSync.durationSeconds", "priority": 1},
    {"name": "Paused", "type": "number", "jsonPath": ".status.lastSync.pausedSeconds", "priority": 1},
    {"name": "Plan", "type": "string", "jsonPath": ".status.plan.hash", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "weightsync"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": list(api.CATEGORIES),
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def render_crd() -> str:
    header = "# Generated by `weightsync crd` from weightsync/api/v1alpha1.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def _walk_rules(schema: dict[str, Any], path: str) -> Iterator[RuleSet]:
    entries = schema.get("x-kubernetes-validations")
    if entries:
        yield RuleSet(
            path,
            tuple(CelRule(e["rule"], e["message"], e.get("fieldPath"), e.get("reason")) for e in entries),
        )
    for name, sub in schema.get("properties", {}).items():
        yield from _walk_rules(sub, f"{path}.{name}" if path else name)


@functools.cache
def rule_sets() -> tuple[RuleSet, ...]:
    """Every CEL rule in the CRD, by the object path it applies to (arrays are not descended); computed once."""
    return tuple(_walk_rules(openapi_schema(), ""))
