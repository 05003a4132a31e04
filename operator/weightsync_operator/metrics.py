"""Prometheus metrics of the operator (served by :func:`weightsync_operator.main.run` on --metrics-port)."""

from __future__ import annotations

from collections import Counter as _Tally

from prometheus_client import Counter, Gauge, Histogram

PHASES = ("Pending", "Provisioning", "Ready", "Syncing", "Degraded", "Failed")

RECONCILES = Counter(
    "weightsync_operator_reconciles_total",
    "Group reconciles, by result (ok: no problem found; error: a problem was reported in the status).",
    ["result"],
)
ERRORS = Counter(
    "weightsync_operator_reconcile_errors_total",
    "Problems met while reconciling, by condition reason (InvalidSpec, PlanFailed, ApiError, ...).",
    ["reason"],
)
DURATION = Histogram(
    "weightsync_operator_reconcile_duration_seconds",
    "Wall time of one group reconcile.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
API_REQUESTS = Counter(
    "weightsync_operator_api_requests_total",
    "Requests the operator's own REST client made to the API server (kopf's watches not included), by verb.",
    ["verb"],
)
STATUS_WRITES = Counter(
    "weightsync_operator_status_writes_total",
    "Status patches of groups, by when (progress: during pod creation; final: at the end of a reconcile).",
    ["when"],
)
GROUPS = Gauge("weightsync_operator_groups", "WeightSyncGroups known to the operator, by phase.", ["phase"])

_phases: dict[str, str] = {}


def _publish() -> None:
    tally = _Tally(_phases.values())
    for phase in {*PHASES, *tally}:
        GROUPS.labels(phase=phase).set(tally.get(phase, 0))


def set_phase(group: str, phase: str) -> None:
    """Record the phase of ``group`` (``namespace/name``)."""
    _phases[group] = phase
    _publish()


def forget(group: str) -> None:
    _phases.pop(group, None)
    _publish()
