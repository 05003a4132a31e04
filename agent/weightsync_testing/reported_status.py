"""The group status the operator would show for a local group: its pods as the agents would report them on a cluster
(docs/agent.md, "What agents report"), folded by the operator's own ``fold_status``. Pure.

Local groups have no pods: this is how a test or a benchmark asks "what would ``kubectl get wsg`` say now?" of
the same reports. An engine pod's agent reports the version its engine reports, and is ready when its engine answers
and holds the committed version (else ``CatchingUp``); the coordinator's pod carries the committed version and the
last round (``RoundResult.as_status()``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from weightsync.api import names
from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_operator.status import Observation, condition, fold_status


@dataclass(frozen=True)
class EngineReport:
    """What engine ``e``'s pod agent reports: whether its engine answers, and the version it says it holds."""

    answers: bool
    version: str | None


def pod(name: str, *, ready: bool, annotations: Mapping[str, str]) -> dict[str, Any]:
    status = "True" if ready else "False"
    conditions = [{"type": "Ready", "status": status}, {"type": names.CONDITION_AGENT_READY, "status": status}]
    return {"metadata": {"name": name, "annotations": dict(annotations)}, "status": {"conditions": conditions}}


def reported_pods(
    group: str,
    spec: WeightSyncGroupSpec,
    *,
    committed: int | None,
    last_round: Mapping[str, Any] | None,
    engines: Mapping[int, EngineReport],
    trainers_ready: Sequence[bool],
) -> list[dict[str, Any]]:
    """The group's pods as its agents would report them (one pod per engine: ``ranksPerPod`` = ``ranksPerEngine``)."""
    coordinator: dict[str, str] = {}
    if committed is not None:
        coordinator[names.ANNOTATION_WEIGHT_VERSION] = str(committed)
    if last_round is not None:
        coordinator[names.ANNOTATION_LAST_ROUND] = json.dumps(last_round)
    pods = [pod(names.trainer_pod(group, i), ready=ready, annotations=coordinator if i == 0 else {})
            for i, ready in enumerate(trainers_ready)]  # fmt: skip
    for engine in range(spec.inference.engines):
        report = engines.get(engine, EngineReport(False, None))
        held = committed is None or report.version == str(committed)  # else its agent says CatchingUp
        annotations = {names.ANNOTATION_WEIGHT_VERSION: report.version} if report.version is not None else {}
        pods.append(pod(names.engine_pod(group, engine, 0), ready=report.answers and held, annotations=annotations))
    return pods


def ready_condition(
    group: str, spec: WeightSyncGroupSpec, pods: Sequence[Mapping[str, Any]], now: datetime | None = None
) -> tuple[str, str, str]:
    """The folded ``Ready`` condition: (status, reason, message)."""
    folded = fold_status(Observation(name=group, generation=1, now=now or datetime.now(UTC), spec=spec, pods=pods))
    ready = condition(folded.status, "Ready") or {}
    return str(ready.get("status", "Unknown")), str(ready.get("reason", "")), str(ready.get("message", ""))
