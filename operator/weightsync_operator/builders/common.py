"""What every built object shares: owner reference, labels, metadata, content hashes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.api import names
from weightsync.api.v1alpha1 import API_VERSION, KIND, WeightSyncGroup

JsonDict = dict[str, Any]


class BuildError(ValueError):
    """The group cannot be turned into objects (a configuration problem, not a bug)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class BuildOptions:
    """Operator-wide inputs to the builders (from the operator's environment, read elsewhere)."""

    #: Agent image for groups that set no ``spec.agent.image``.
    agent_image: str | None = None


def owner_reference(group: WeightSyncGroup) -> JsonDict:
    """The group as controller of everything built for it: the garbage collector does the cleanup."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": group.metadata.name,
        "uid": group.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def group_labels(group: WeightSyncGroup) -> dict[str, str]:
    return {names.LABEL_GROUP: group.metadata.name, names.LABEL_MANAGED_BY: names.MANAGED_BY}


def object_meta(
    group: WeightSyncGroup,
    name: str,
    *,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> JsonDict:
    meta: JsonDict = {
        "name": name,
        "namespace": group.metadata.namespace,
        "labels": {**group_labels(group), **(labels or {})},
        "ownerReferences": [owner_reference(group)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def content_hash(obj: Any) -> str:
    """A short, stable hash of a JSON-able value (key order does not matter)."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
