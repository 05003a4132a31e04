"""Reporting through the agent's own pod: the readiness-gate condition and annotations.

Agents never write the group's status (the operator is its only writer); they touch only their own
pod, which their Role allows and nothing more.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from weightsync.api import names

#: Bound on reading the agent's own pod (a hung API server must not hold the coordinator's start).
READ_TIMEOUT_SECONDS = 10.0


def ready_condition(ready: bool, reason: str, message: str = "") -> dict[str, Any]:
    return {
        "type": names.CONDITION_AGENT_READY,
        "status": "True" if ready else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


class PodReporter:
    """Patches one pod (the agent's own) through the Kubernetes API."""

    def __init__(self, core_api: Any, namespace: str, pod: str) -> None:
        self.api = core_api
        self.namespace = namespace
        self.pod = pod

    def set_ready(self, ready: bool, reason: str, message: str = "") -> None:
        # Pod status conditions merge by type under a strategic-merge patch, so this leaves the
        # kubelet's (or kwok's) own conditions alone.
        body = {"status": {"conditions": [ready_condition(ready, reason, message)]}}
        self.api.patch_namespaced_pod_status(self.pod, self.namespace, body)

    def annotation(self, key: str) -> str | None:
        """One annotation of the agent's own pod, as the API server has it now."""
        found = self.api.read_namespaced_pod(self.pod, self.namespace, _request_timeout=READ_TIMEOUT_SECONDS)
        value = (found.metadata.annotations or {}).get(key)
        return None if value is None else str(value)

    def annotate(self, values: dict[str, str | dict[str, Any] | int | None]) -> None:
        encoded = {
            key: (json.dumps(v, separators=(",", ":")) if isinstance(v, dict) else (None if v is None else str(v)))
            for key, v in values.items()
        }
        self.api.patch_namespaced_pod(self.pod, self.namespace, {"metadata": {"annotations": encoded}})
