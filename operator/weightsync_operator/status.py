"""Fold what the operator observed into the group's status. Pure: no I/O, the clock is an argument.

The operator is the only writer of ``WeightSyncGroup.status``. Agents report on their own pods (the
``weightsync.io/agent-ready`` condition, which gates pod readiness, and two annotations); this module
turns those pods, the plan and any configuration problem into counters, conditions and a phase.

Conditions (``metav1.Condition``; ``lastTransitionTime`` moves only when ``status`` flips):

- ``Ready``: every desired pod is Ready (so every agent reported ready), the spec is usable, and the engines
  serve the committed version: not while the last round left them paused (reason ``EnginesPaused``, after a
  failed live round or a failed resume), nor while an engine holds less than the committed version (reason
  ``EnginesBehind``: a restarted engine serving its initial weights, until a catch-up or the next round).
- ``Progressing``: pods are being created, scheduled or started, or run an outdated pod spec (the
  operator never kills a running pod to apply a template change: deleting it does).
- ``Degraded``: a configuration problem, an API error, or pods that failed or crash-loop.
- ``PlanReady``: a plan for the current spec exists and is published.

Phase, first match wins: ``Failed`` (configuration problem the user must fix), ``Degraded`` (also: engines
left paused), ``Syncing`` (all ready and trainers published a version the engines do not hold yet, or an engine
is behind the committed version), ``Ready``, ``Provisioning`` (some pod is scheduled), ``Pending``.

Versions: an engine's version is what its **first pod**'s agent reports (only that pod hosts the engine's HTTP
server and annotates ``weightsync.io/weight-version``; an engine split over several pods has no version on the
others). ``weightVersion`` is the lowest over engines, and absent while any engine reports none (initial
weights). The committed version is what the coordinator (trainer pod 0) reports.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal, get_args

from pydantic import ValidationError

from weightsync.api import names
from weightsync.api.v1alpha1 import (
    MAX_RANKS,
    RECENT_REASON_CHARS,
    RECENT_SYNCS,
    Condition,
    ConditionType,
    Phase,
    PlanStatus,
    SyncStatus,
    WeightSyncGroupSpec,
    WeightSyncGroupStatus,
)
from weightsync.plan import Plan
from weightsync_operator.builders.desired import expected_pods

ConditionStatus = Literal["True", "False", "Unknown"]

# The condition types are the API's closed set (v1alpha1.ConditionType); typed, so a typo fails mypy.
READY: Final[ConditionType] = "Ready"
PROGRESSING: Final[ConditionType] = "Progressing"
DEGRADED: Final[ConditionType] = "Degraded"
PLAN_READY: Final[ConditionType] = "PlanReady"
CONDITION_ORDER: Final[tuple[ConditionType, ...]] = get_args(ConditionType)

MAX_MESSAGE = 1024

#: Container waiting reasons that mean "this will not get better by itself".
BAD_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


@dataclass(frozen=True)
class Problem:
    """Why the group cannot be (fully) reconciled."""

    reason: str
    message: str
    #: True: configuration the user must fix (phase Failed). False: transient (phase Degraded).
    fatal: bool = True


@dataclass(frozen=True)
class PodFailure:
    pod: str
    #: Identifies this failure occurrence, so it is reported once (pod uid, reason, restart count).
    key: str
    reason: str
    message: str


@dataclass(frozen=True)
class Observation:
    """Everything the status is folded from."""

    name: str
    generation: int
    now: datetime
    previous: Mapping[str, Any] | None = None
    spec: WeightSyncGroupSpec | None = None
    plan: Plan | None = None
    pods: Sequence[Mapping[str, Any]] = ()
    problem: Problem | None = None
    #: Pods whose spec hash differs from what the current spec builds (left running).
    outdated: Sequence[str] = ()


@dataclass(frozen=True)
class Folded:
    #: ``WeightSyncGroupStatus``-shaped, camelCase; cleared optional fields are ``None`` (a merge
    #: patch then removes them).
    status: dict[str, Any]
    failures: tuple[PodFailure, ...] = ()
    #: ``(reason, message)`` pairs worth a Warning event (e.g. a garbled last-round annotation).
    warnings: tuple[tuple[str, str], ...] = field(default_factory=tuple)


# --- Pods ----------------------------------------------------------------------------------------


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = pod.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    status = pod.get("status")
    return status if isinstance(status, Mapping) else {}


def pod_name(pod: Mapping[str, Any]) -> str:
    return str(_meta(pod).get("name", ""))


def is_terminating(pod: Mapping[str, Any]) -> bool:
    return bool(_meta(pod).get("deletionTimestamp"))


def _condition_true(pod: Mapping[str, Any], condition: str) -> bool:
    return any(c.get("type") == condition and c.get("status") == "True" for c in _status(pod).get("conditions") or [])


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    """Ready, and its agent said so itself.

    A kubelet never reports Ready while the ``weightsync.io/agent-ready`` gate is unmet, but not every
    node agent honours readiness gates (virtual kubelets, kwok), so the gate is checked explicitly.
    """
    if is_terminating(pod):
        return False
    return _condition_true(pod, "Ready") and _condition_true(pod, names.CONDITION_AGENT_READY)


def is_scheduled(pod: Mapping[str, Any]) -> bool:
    if (pod.get("spec") or {}).get("nodeName"):
        return True
    return any(
        c.get("type") == "PodScheduled" and c.get("status") == "True" for c in _status(pod).get("conditions") or []
    )


def pod_failure(pod: Mapping[str, Any]) -> PodFailure | None:
    """What is wrong with a pod that will not recover by itself, if anything."""
    if is_terminating(pod):
        return None
    name = pod_name(pod)
    uid = str(_meta(pod).get("uid") or name)
    status = _status(pod)
    phase = status.get("phase")
    if phase in ("Failed", "Succeeded"):
        reason = str(status.get("reason") or ("PodFailed" if phase == "Failed" else "PodExited"))
        detail = status.get("message") or f"pod phase is {phase}"
        return PodFailure(name, f"{uid}/{phase}", reason, _clip(f"pod {name}: {reason}: {detail}"))
    statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for container in statuses:
        waiting = (container.get("state") or {}).get("waiting") or {}
        waiting_reason = waiting.get("reason")
        if waiting_reason in BAD_WAITING_REASONS:
            restarts = container.get("restartCount", 0)
            detail = waiting.get("message") or ""
            text = f"pod {name}, container {container.get('name')}: {waiting_reason}"
            return PodFailure(
                name,
                f"{uid}/{container.get('name')}/{waiting_reason}/{restarts}",
                str(waiting_reason),
                _clip(f"{text}: {detail}" if detail else text),
            )
    return None


def pending_reason(pod: Mapping[str, Any]) -> str | None:
    """Why a pod is not scheduled yet (e.g. not enough RDMA devices), if the scheduler said so."""
    for c in _status(pod).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return f"{c.get('reason') or 'Unschedulable'}: {c.get('message') or ''}".strip(": ")
    return None


def sync_paths(pods: Iterable[Mapping[str, Any]]) -> dict[str, int] | None:
    """The ranks each path syncs, summed over the engine pods that reported (``weightsync.io/sync-paths``); None when
    none did. A garbled annotation counts as no report: the status never says more than the pods did."""
    totals, reported = {"trace": 0, "engineReplica": 0}, False
    for pod in pods:
        raw = (_meta(pod).get("annotations") or {}).get(names.ANNOTATION_SYNC_PATHS)
        try:
            paths = json.loads(raw) if isinstance(raw, str) and len(raw) <= 256 else None
        except ValueError:
            continue
        if not isinstance(paths, dict):
            continue
        counts = [paths.get("trace", 0), paths.get("engine-replica", 0)]
        if not all(type(c) is int and 0 <= c <= MAX_RANKS for c in counts):
            continue
        totals["trace"] += counts[0]
        totals["engineReplica"] += counts[1]
        reported = True
    return totals if reported else None


def parse_version(pod: Mapping[str, Any]) -> int | None:
    raw = (_meta(pod).get("annotations") or {}).get(names.ANNOTATION_WEIGHT_VERSION)
    if raw is None:
        return None
    try:
        value = int(str(raw).strip())
    except ValueError:
        return None
    return value if value >= 0 else None


def parse_last_round(text: str) -> SyncStatus:
    """The coordinator's last-round annotation. Raises ``ValueError`` when it is not a SyncStatus."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    try:
        return SyncStatus.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors())
        raise ValueError(problems) from exc


# --- Conditions ----------------------------------------------------------------------------------


def timestamp(now: datetime) -> str:
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_conditions(
    previous: Iterable[Mapping[str, Any]],
    updates: Iterable[tuple[str, ConditionStatus, str, str]],
    *,
    now: datetime,
    generation: int,
) -> list[dict[str, Any]]:
    """New conditions from ``(type, status, reason, message)``; ``lastTransitionTime`` is kept unless
    ``status`` changed. Conditions of other types in ``previous`` are kept as they are."""
    before = {str(c.get("type")): c for c in previous if isinstance(c, Mapping)}
    out: dict[str, dict[str, Any]] = {}
    for type_, status, reason, message in updates:
        old = before.get(type_)
        changed = old is None or old.get("status") != status or not old.get("lastTransitionTime")
        out[type_] = {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": _clip(message),
            "lastTransitionTime": timestamp(now) if changed or old is None else str(old["lastTransitionTime"]),
            "observedGeneration": generation,
        }
    others = [c for c in (_valid(Condition, c) for t, c in before.items() if t not in out) if c is not None]
    ordered = [out[t] for t in CONDITION_ORDER if t in out] + [c for t, c in out.items() if t not in CONDITION_ORDER]
    return ordered + others


def condition(status: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    for c in (status or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == type_:
            return c
    return None


# --- The fold ------------------------------------------------------------------------------------


def plan_status(plan: Plan, group: str) -> dict[str, Any]:
    return {
        "hash": plan.hash,
        "revision": plan.revision,
        "policy": plan.policy,
        "sources": plan.layout.sources,
        "targets": plan.layout.targets,
        "maxTargetsPerSource": plan.balance.max_targets_per_source,
        "maxShapesPerSource": plan.balance.max_shapes_per_source,
        "balanced": plan.balance.perfect,
        "movedTargets": plan.moved_targets,
        "configMap": names.plan_config_map(group),
    }


#: ``(type, status, reason, message)``: one condition as :func:`set_conditions` takes it.
ConditionUpdate = tuple[str, ConditionStatus, str, str]


@dataclass(frozen=True)
class Roster:
    """The pods the group should have, and which of them are there and ready."""

    trainers: tuple[str, ...]
    engines: tuple[str, ...]
    trainers_desired: int
    engines_desired: int
    ready_trainers: int
    ready_engines: int
    #: The expected pods that exist, trainers first.
    present: tuple[Mapping[str, Any], ...]
    #: The expected pods that are missing or not ready, trainers first.
    not_ready: tuple[str, ...]
    #: The spec is usable and every pod it asks for is ready.
    all_ready: bool

    @property
    def counts(self) -> str:
        return (
            f"{self.ready_trainers}/{self.trainers_desired} trainer pods and "
            f"{self.ready_engines}/{self.engines_desired} engine pods ready"
        )


@dataclass(frozen=True)
class Versions:
    """The weight versions the pods report."""

    #: Per engine, what its first pod reports (``None``: initial weights, or the pod is not there).
    engines: dict[int, int | None]
    #: ``status.weightVersion``: see :func:`lowest_version`.
    weight_version: int | None
    #: The newest version any trainer pod published.
    newest_published: int | None
    #: What the coordinator (trainer pod 0) reports committed.
    committed: int | None
    #: The engines (whose first pod is there) that hold less than ``committed``, with what they hold.
    behind: dict[int, int | None]


@dataclass(frozen=True)
class Rounds:
    """The coordinator's rounds as the status reports them."""

    #: ``status.lastSync``: the coordinator's last round, else the previous status's (while it fits the schema).
    last_sync: dict[str, Any] | None
    last_round: SyncStatus | None
    #: ``status.recentSyncs``.
    recent: list[dict[str, Any]]
    warnings: tuple[tuple[str, str], ...]


def fold_status(obs: Observation) -> Folded:
    previous: Mapping[str, Any] = obs.previous or {}
    by_name = {pod_name(p): p for p in obs.pods if pod_name(p)}
    roster = pod_roster(obs, by_name, previous)
    failures = tuple(f for f in (pod_failure(p) for p in roster.present) if f is not None)
    versions = fold_versions(obs, roster, by_name)
    rounds = fold_rounds(obs, previous, by_name)
    paused = paused_round(rounds.last_round)
    phase = fold_phase(
        obs.problem,
        failures,
        all_ready=roster.all_ready,
        paused=paused is not None,
        syncing=roster.all_ready and is_syncing(versions, rounds.last_round),
        scheduled=any(is_scheduled(p) for p in roster.present),
    )
    updates = [
        ready_condition(obs.problem, roster, versions, paused),
        progressing_condition(obs.problem, roster, obs.outdated, by_name),
        degraded_condition(obs.problem, failures, paused if roster.all_ready else None),
        plan_ready_condition(obs.plan, obs.problem),
    ]
    conditions = set_conditions(previous.get("conditions") or [], updates, now=obs.now, generation=obs.generation)

    # What the previous status held is kept only if it still fits the schema (an older operator, or
    # a hand edit, must not wedge every later reconcile).
    plan = plan_status(obs.plan, obs.name) if obs.plan is not None else _valid(PlanStatus, previous.get("plan"))
    status = WeightSyncGroupStatus.model_validate(
        {
            "observedGeneration": obs.generation,
            "phase": phase,
            "conditions": conditions,
            "trainers": {"desired": roster.trainers_desired, "ready": roster.ready_trainers},
            "engines": {
                "desired": roster.engines_desired,
                "ready": roster.ready_engines,
                "syncPaths": sync_paths(by_name[n] for n in roster.engines if n in by_name),
            },
            "plan": plan,
            "weightVersion": versions.weight_version,
            "lastSync": rounds.last_sync,
            "recentSyncs": rounds.recent,
        }
    )
    folded = status.model_dump(mode="json", by_alias=True)
    if folded["engines"].get("syncPaths") is None:
        del folded["engines"]["syncPaths"]  # no engine reported yet: say nothing rather than null
    return Folded(status=folded, failures=failures, warnings=rounds.warnings)


# --- The fold's steps ----------------------------------------------------------------------------


def pod_roster(obs: Observation, by_name: Mapping[str, Mapping[str, Any]], previous: Mapping[str, Any]) -> Roster:
    if obs.spec is not None:
        trainers, engines = expected_pods(obs.spec, obs.name)
        trainers_desired, engines_desired = len(trainers), len(engines)
    else:  # an unusable spec: report what is there, keep the last known desired counts
        trainers = sorted(n for n, p in by_name.items() if _role(p) == "trainer")
        engines = sorted(n for n, p in by_name.items() if _role(p) == "engine")
        trainers_desired = _previous_count(previous, "trainers")
        engines_desired = _previous_count(previous, "engines")
    expected = [*trainers, *engines]
    not_ready = tuple(n for n in expected if n not in by_name or not is_pod_ready(by_name[n]))
    return Roster(
        trainers=tuple(trainers),
        engines=tuple(engines),
        trainers_desired=trainers_desired,
        engines_desired=engines_desired,
        ready_trainers=sum(1 for n in trainers if n in by_name and is_pod_ready(by_name[n])),
        ready_engines=sum(1 for n in engines if n in by_name and is_pod_ready(by_name[n])),
        present=tuple(by_name[n] for n in expected if n in by_name),
        not_ready=not_ready,
        all_ready=obs.spec is not None and not not_ready,
    )


def fold_versions(obs: Observation, roster: Roster, by_name: Mapping[str, Mapping[str, Any]]) -> Versions:
    heads = _engine_heads(obs, roster.engines, by_name)
    engines = {e: parse_version(by_name[n]) if n in by_name else None for e, n in heads.items()}
    published = [v for v in (parse_version(by_name[n]) for n in roster.trainers if n in by_name) if v is not None]
    coordinator = by_name.get(names.trainer_pod(obs.name, 0))
    committed = parse_version(coordinator) if coordinator is not None else None
    reporting = {e: v for e, v in engines.items() if heads[e] in by_name}
    return Versions(
        engines=engines,
        weight_version=lowest_version(engines),
        newest_published=max(published) if published else None,
        committed=committed,
        behind=engines_behind(reporting, committed),
    )


def lowest_version(engines: Mapping[int, int | None]) -> int | None:
    """``status.weightVersion``: the lowest version over engines; none while any engine reports none (it serves its
    initial weights), nor without engines."""
    if engines and all(v is not None for v in engines.values()):
        return min(v for v in engines.values() if v is not None)
    return None


def engines_behind(engines: Mapping[int, int | None], committed: int | None) -> dict[int, int | None]:
    """The engines holding less than ``committed`` (``None``, initial weights, is less than any); none while nothing
    is committed."""
    if committed is None:
        return {}
    return {e: v for e, v in engines.items() if v is None or v < committed}


def fold_rounds(obs: Observation, previous: Mapping[str, Any], by_name: Mapping[str, Mapping[str, Any]]) -> Rounds:
    last_round, warnings = coordinator_round(by_name.get(names.trainer_pod(obs.name, 0)))
    recent, new_round = recent_syncs(previous.get("recentSyncs"), last_round)
    if new_round is not None:
        warnings.extend(round_warnings(new_round, obs.spec))
    if last_round is not None:
        last_sync = last_round.model_dump(mode="json", by_alias=True, exclude_none=True)
        return Rounds(last_sync=last_sync, last_round=last_round, recent=recent, warnings=tuple(warnings))
    # No round on the coordinator's pod (none yet, or the pod was replaced): the previous status's, while it fits
    # the schema, so a new coordinator pod does not make the status forget the last round (engines left paused).
    kept = previous.get("lastSync")
    if isinstance(kept, dict):
        try:
            last_round = SyncStatus.model_validate(kept)
            return Rounds(last_sync=kept, last_round=last_round, recent=recent, warnings=tuple(warnings))
        except ValidationError:
            pass
    return Rounds(last_sync=None, last_round=None, recent=recent, warnings=tuple(warnings))


def coordinator_round(coordinator: Mapping[str, Any] | None) -> tuple[SyncStatus | None, list[tuple[str, str]]]:
    """The round in the coordinator's last-round annotation, if any; one that does not parse is ignored, with a
    ``BadLastRound`` warning."""
    if coordinator is None:
        return None, []
    text = (_meta(coordinator).get("annotations") or {}).get(names.ANNOTATION_LAST_ROUND)
    if not text:
        return None, []
    try:
        return parse_last_round(str(text)), []
    except ValueError as exc:
        where = f"annotation {names.ANNOTATION_LAST_ROUND} on pod {pod_name(coordinator)}"
        return None, [("BadLastRound", _clip(f"ignored {where}: {exc}"))]


def paused_round(last_round: SyncStatus | None) -> SyncStatus | None:
    """The last round, if it did not succeed and left the engines paused (they serve again after a successful one),
    or was a repair of drifted engines that did not succeed (they serve bytes a scrub found wrong, or none)."""
    if last_round is None or last_round.result == "Succeeded":
        return None
    if last_round.engines_paused or drifted(last_round):
        return last_round
    return None


def drifted(last_round: SyncStatus) -> bool:
    """A catch-up a scrub started (its reason says so: agent ``rounds/coordinator.py`` ``drift_reason``)."""
    return (last_round.reason or "").startswith(names.DRIFT_FOUND)


def is_syncing(versions: Versions, last_round: SyncStatus | None) -> bool:
    """Whether a round is due (the group's pods all being ready): an engine is behind the committed version, or a
    trainer published a version newer than the engines hold, unless the last round already tried that version (or a
    newer one) and did not succeed (nothing is on its way until the trainers publish again)."""
    if versions.behind:
        return True
    newest = versions.newest_published
    if newest is None or (versions.weight_version is not None and newest <= versions.weight_version):
        return False
    return not (last_round is not None and last_round.version >= newest and last_round.result != "Succeeded")


def fold_phase(
    problem: Problem | None,
    failures: Sequence[PodFailure],
    *,
    all_ready: bool,
    paused: bool,
    syncing: bool,
    scheduled: bool,
) -> Phase:
    """The phase, first match wins (see the module's docstring)."""
    if problem is not None and problem.fatal:
        return "Failed"
    if problem is not None or failures or (all_ready and paused):
        return "Degraded"
    if all_ready:
        return "Syncing" if syncing else "Ready"
    return "Provisioning" if scheduled else "Pending"


def ready_condition(
    problem: Problem | None, roster: Roster, versions: Versions, paused: SyncStatus | None
) -> ConditionUpdate:
    if problem is not None and problem.fatal:
        return (READY, "False", problem.reason, problem.message)
    if not roster.all_ready:
        return (READY, "False", "PodsNotReady", roster.counts)
    if paused is not None and drifted(paused):
        message = (
            f"engines serve other bytes than committed version {paused.version} (found by a scrub) and are not "
            f"repaired yet; the next successful round or catch-up repairs them: {paused.reason}"
        )
        return (READY, "False", "WeightsDrifted", message)
    if paused is not None:
        message = (
            f"round of version {paused.version} {paused.result.lower()} and left the engines paused "
            f"(they serve again after the next successful round): {paused.reason or 'no reason given'}"
        )
        return (READY, "False", "EnginesPaused", message)
    if versions.behind:
        behind = versions.behind
        held = ", ".join(f"engine {e} holds {'its initial weights' if v is None else v}" for e, v in behind.items())
        message = (
            f"engines {sorted(behind)} do not hold committed version {versions.committed} ({held}); a catch-up or the "
            "next round brings them up"
        )
        return (READY, "False", "EnginesBehind", message)
    return (READY, "True", "AllPodsReady", roster.counts)


def progressing_condition(
    problem: Problem | None,
    roster: Roster,
    outdated: Sequence[str],
    by_name: Mapping[str, Mapping[str, Any]],
) -> ConditionUpdate:
    if problem is not None and problem.fatal:
        return (PROGRESSING, "False", problem.reason, "waiting for the spec to be fixed")
    if not roster.all_ready:
        return (PROGRESSING, "True", "PodsStarting", _waiting_message(roster.not_ready, by_name, roster.counts))
    if outdated:
        message = f"{len(outdated)} pods run an older pod spec; delete them to apply the current one: "
        return (PROGRESSING, "True", "PodsOutdated", message + _names(list(outdated)))
    return (PROGRESSING, "False", "Stable", roster.counts)


def degraded_condition(
    problem: Problem | None, failures: Sequence[PodFailure], paused: SyncStatus | None
) -> ConditionUpdate:
    """``paused``: the round that left the engines paused, once every pod is ready (before, the pods are the news)."""
    if problem is not None:
        return (DEGRADED, "True", problem.reason, problem.message)
    if failures:
        more = f" (and {len(failures) - 3} more)" if len(failures) > 3 else ""
        return (DEGRADED, "True", "PodFailures", "; ".join(f.message for f in failures[:3]) + more)
    if paused is not None and drifted(paused):
        return (DEGRADED, "True", "WeightsDrifted", f"drifted engines not repaired since version {paused.version}")
    if paused is not None:
        return (DEGRADED, "True", "EnginesPaused", f"engines paused since round {paused.version}")
    return (DEGRADED, "False", "AsExpected", "")


def plan_ready_condition(plan: Plan | None, problem: Problem | None) -> ConditionUpdate:
    if plan is not None:
        return (PLAN_READY, "True", "PlanPublished", _plan_message(plan))
    if problem is not None and problem.fatal:
        return (PLAN_READY, "False", problem.reason, problem.message)
    return (PLAN_READY, "Unknown", "NotPlanned", "no plan computed yet")


def recent_syncs(previous: Any, latest: SyncStatus | None) -> tuple[list[dict[str, Any]], SyncStatus | None]:
    """``status.recentSyncs``: the rounds the status held (those that still fit the schema), then ``latest`` (the
    coordinator's last round) unless it is the newest already; the last :data:`RECENT_SYNCS`, reasons clipped.
    Also ``latest`` when it is a round the list did not hold (so each round is announced once, across operator
    restarts too: the list is in the status)."""
    kept: list[SyncStatus] = []
    for item in previous if isinstance(previous, list) else []:
        try:
            kept.append(SyncStatus.model_validate(item))
        except ValidationError:
            continue
    appended: SyncStatus | None = None
    if latest is not None:
        clipped = latest.model_copy(
            update={"reason": None if latest.reason is None else _clip(latest.reason, RECENT_REASON_CHARS)}
        )
        newest = kept[-1] if kept else None
        if newest is None or (newest.version, newest.started_at, newest.result) != (
            clipped.version,
            clipped.started_at,
            clipped.result,
        ):
            kept.append(clipped)
            appended = latest
    return [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in kept[-RECENT_SYNCS:]], appended


def round_warnings(sync: SyncStatus, spec: WeightSyncGroupSpec | None) -> list[tuple[str, str]]:
    """Warning Events a new round is worth: ``WeightsDrifted`` for a catch-up a scrub started (naming the engine,
    rank and parameters, and whether it repaired them), ``SyncFailed`` (naming the peer and the cause, from its
    reason), and ``SyncSlow`` for a round over ``events.slowRoundPercent`` of its budget (naming its slowest phase,
    source and target)."""
    when = f"round v{sync.version} started {sync.started_at or '?'}"
    found = [("WeightsDrifted", f"{when}: {sync.reason}")] if drifted(sync) else []
    if sync.result != "Succeeded":
        return [*found, ("SyncFailed", f"{when}: {sync.result}: {sync.reason or 'no reason given'}")]
    if found:
        return found
    if spec is None or sync.duration_seconds is None:
        return []
    budget = spec.transfer.timeout_seconds
    percent = spec.events.slow_round_percent
    if sync.duration_seconds * 100 <= budget * percent:
        return []
    details = []
    if sync.phases is not None:
        phases = {k: v for k, v in sync.phases.model_dump().items() if v is not None}
        if phases:
            slowest = max(phases, key=lambda k: phases[k])
            details.append(f"slowest phase {slowest} {phases[slowest]:.3f} s")
    for label, peer in (("slowest source", sync.slowest_source), ("slowest target", sync.slowest_target)):
        if peer is not None:
            details.append(f"{label} {peer.peer} ({peer.seconds:.3f} s, {peer.gbps:g} Gb/s)")
    more = f"; {', '.join(details)}" if details else ""
    return [
        (
            "SyncSlow",
            f"{when}: took {sync.duration_seconds:.3f} s, over {percent}% of its {budget} s budget "
            f"(events.slowRoundPercent){more}",
        )
    ]


def _engine_heads(obs: Observation, engine_names: Sequence[str], by_name: Mapping[str, Any]) -> dict[int, str]:
    """Per engine, the pod whose agent reports its version: the engine's first pod (pod 0)."""
    if obs.spec is not None:
        return {e: names.engine_pod(obs.name, e, 0) for e in range(obs.spec.inference.engines)}
    heads: dict[int, str] = {}
    for name in engine_names:  # an unusable spec: the engines whose first pod is there
        rank = str((_meta(by_name[name]).get("labels") or {}).get(names.LABEL_RANK, ""))
        engine, _, pod = rank.partition("-")
        if engine.isdigit() and pod == "0":
            heads[int(engine)] = name
    return dict(sorted(heads.items()))


def _valid(model: type[Condition] | type[PlanStatus], value: Any) -> dict[str, Any] | None:
    if not isinstance(value, Mapping):
        return None
    try:
        return model.model_validate(value).model_dump(mode="json", by_alias=True, exclude_none=True)
    except ValidationError:
        return None


def _role(pod: Mapping[str, Any]) -> str | None:
    role = (_meta(pod).get("labels") or {}).get(names.LABEL_ROLE)
    return str(role) if role is not None else None


def _previous_count(previous: Mapping[str, Any], key: str) -> int:
    counts = previous.get(key)
    if isinstance(counts, Mapping):
        try:
            return max(int(counts.get("desired", 0)), 0)
        except (TypeError, ValueError):
            return 0
    return 0


def _waiting_message(not_ready: Sequence[str], pods: Mapping[str, Mapping[str, Any]], counts: str) -> str:
    missing = [n for n in not_ready if n not in pods]
    parts = [counts]
    if missing:
        parts.append(f"creating {_names(missing)}")
    starting = [n for n in not_ready if n in pods]
    if starting:
        parts.append(f"waiting for {_names(starting)}")
    reasons = {r for r in (pending_reason(pods[n]) for n in starting) if r}
    if reasons:
        parts.append("unschedulable: " + " | ".join(sorted(reasons)[:2]))
    return "; ".join(parts)


def _names(items: Sequence[str], limit: int = 5) -> str:
    head = ", ".join(items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _plan_message(plan: Plan) -> str:
    balance = plan.balance
    text = (
        f"revision {plan.revision} ({plan.hash}, {plan.policy}): {plan.layout.sources} sources -> "
        f"{plan.layout.targets} targets, at most {balance.max_targets_per_source} targets and "
        f"{balance.max_shapes_per_source} replica shapes per source, "
        f"{'balanced' if balance.perfect else 'unbalanced'}"
    )
    if balance.note:
        text += f" ({balance.note})"
    return text


def _clip(text: str, limit: int = MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def strip_none(value: Any) -> Any:
    """``value`` without ``None`` entries (how the API server stores what a merge patch sent)."""
    if isinstance(value, Mapping):
        return {k: strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_none(v) for v in value]
    return value
