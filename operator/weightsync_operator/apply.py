"""One idempotent reconcile of one group: the only module that changes the cluster.

``Reconciler.reconcile(body)`` reads the group, decides the plan (from the stored ConfigMap),
builds every object with the pure builders, applies them (create what is missing, merge-patch what
drifted, delete surplus or dead pods), folds the observed pods into the status, writes the status if
it changed, and posts Events. It never raises for a bad spec, a planner error or an API error: those
become conditions (and Events); the caller decides whether to retry sooner than the next resync.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from weightsync.api import names
from weightsync.api.load import SpecError, parse_group
from weightsync.api.v1alpha1 import API_VERSION, KIND, WeightSyncGroup
from weightsync.plan import PlanError
from weightsync.plan.seal import seal
from weightsync_operator import metrics
from weightsync_operator.builders import (
    BuildError,
    BuildOptions,
    DesiredState,
    PlanDecision,
    build_group_secret,
    decide_plan,
    desired_state,
    new_token,
    secret_token,
)
from weightsync_operator.builders.network_policy import MESH_ROLES
from weightsync_operator.capabilities import capability_problem
from weightsync_operator.config import DEFAULT_CREATE_CONCURRENCY, DEFAULT_STATUS_INTERVAL
from weightsync_operator.kube import KINDS, ApiError, KubeApi, path_of
from weightsync_operator.podindex import PodIndex, resource_version
from weightsync_operator.status import (
    Folded,
    Observation,
    Problem,
    condition,
    fold_status,
    strip_none,
    timestamp,
)

logger = logging.getLogger(__name__)

COMPONENT = "weightsync-operator"

GROUP_KIND = KINDS["WeightSyncGroup"]
POD_KIND = KINDS["Pod"]


# --- Events --------------------------------------------------------------------------------------


class EventRecorder:
    """Posts core/v1 Events about a group. Failures are logged, never raised."""

    def __init__(self, api: KubeApi, *, clock: Callable[[], datetime] | None = None) -> None:
        self.api = api
        self.clock = clock or (lambda: datetime.now(UTC))
        self.instance = os.environ.get("HOSTNAME") or socket.gethostname()
        self._counter = 0

    async def post(self, group: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        meta = group.get("metadata") or {}
        namespace = str(meta.get("namespace") or "default")
        now = timestamp(self.clock())
        self._counter += 1
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta.get('name')}.{time.time_ns():x}{self._counter:x}",
                "namespace": namespace,
                "labels": {names.LABEL_GROUP: str(meta.get("name"))},
            },
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta.get("name"),
                "namespace": namespace,
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        log = logger.warning if type_ == "Warning" else logger.info
        log("[%s/%s] %s: %s", namespace, meta.get("name"), reason, message)
        try:
            await self.api.create(event)
        except (ApiError, OSError) as exc:
            logger.warning("could not post event %s for %s/%s: %s", reason, namespace, meta.get("name"), exc)


# --- Results and memory --------------------------------------------------------------------------


@dataclass
class GroupMemory:
    """What the operator remembers about a group between reconciles (lost on restart; harmless)."""

    #: The status last written: the operator is the only writer, so this is the truth even when
    #: the watch has not delivered it back yet.
    status: dict[str, Any] | None = None
    #: Event keys already reported (pod failures, bad annotations), so each is posted once.
    reported: set[str] = field(default_factory=set)
    #: The last validation and desired state, by what they are built from: a resync of an unchanged 1,024-pod
    #: group would otherwise spend ~0.25 CPU-s re-validating (CEL) and rebuilding every pod.
    validated: tuple[str, WeightSyncGroup | None, Problem | None] | None = None
    built: tuple[tuple[str, str, int, str], DesiredState] | None = None


@dataclass(frozen=True)
class Result:
    phase: str | None
    problem: Problem | None = None
    #: Set when the problem is transient (API errors): worth retrying before the next resync.
    retry: bool = False
    skipped: str = ""
    status: dict[str, Any] | None = None


def validate(body: Mapping[str, Any]) -> tuple[WeightSyncGroup | None, Problem | None]:
    """The group, or why its spec is unusable: the one validator (``weightsync.api.load.parse_group``:
    the pydantic schema, then the CRD's CEL rules), as ``weightsync validate`` and the API server check it."""
    try:
        return parse_group({**body, "status": None}), None
    except SpecError as exc:
        return None, Problem("InvalidSpec", "spec rejected: " + "; ".join(exc.problems[:5]))


# --- The reconciler ------------------------------------------------------------------------------


class Reconciler:
    def __init__(
        self,
        api: KubeApi,
        *,
        options: BuildOptions | None = None,
        recorder: EventRecorder | None = None,
        clock: Callable[[], datetime] | None = None,
        pods: PodIndex | None = None,
        create_concurrency: int = DEFAULT_CREATE_CONCURRENCY,
        status_interval: float = DEFAULT_STATUS_INTERVAL,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``pods``: the watch-fed pod index (the operator's); without one, every read of pods is a LIST (as
        for a reconciler used on its own, which no watch feeds). ``create_concurrency``: pod creates in flight at
        once (creates are latency-bound: one at a time, a 1,024-pod group took 20-29 s). ``status_interval``: while
        pods are being created, the status is written at most this often with the progress so far."""
        self.api = api
        self.index = pods
        self.create_concurrency = max(1, create_concurrency)
        self.status_interval = status_interval
        self.monotonic = monotonic
        self.options = options or BuildOptions()
        self.clock = clock or (lambda: datetime.now(UTC))
        self.recorder = recorder or EventRecorder(api, clock=self.clock)
        self.memory: dict[str, GroupMemory] = {}

    def forget(self, uid: str) -> None:
        self.memory.pop(uid, None)

    async def reconcile(self, body: Mapping[str, Any]) -> Result:
        """Bring one group's objects and status in line with its spec. Never raises (but on cancel)."""
        started = time.monotonic()
        meta = body.get("metadata") or {}
        name, namespace = str(meta.get("name", "")), str(meta.get("namespace") or "default")
        if meta.get("deletionTimestamp"):
            # The garbage collector is removing the group's objects: recreating them would fight it.
            return Result(phase=None, skipped="group is being deleted")
        try:
            result = await self._reconcile(body)
        except Exception as exc:  # a bug: report it, keep the operator alive, retry on the next resync
            logger.exception("reconcile of %s/%s failed unexpectedly", namespace, name)
            metrics.ERRORS.labels(reason="InternalError").inc()
            result = Result(phase=None, problem=Problem("InternalError", repr(exc), fatal=False), retry=True)
        metrics.RECONCILES.labels(result="error" if result.problem else "ok").inc()
        metrics.DURATION.observe(time.monotonic() - started)
        if result.phase is not None:
            metrics.set_phase(f"{namespace}/{name}", result.phase)
        return result

    async def _reconcile(self, body: Mapping[str, Any]) -> Result:
        meta = body.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        memory = self.memory.setdefault(uid or f"{meta.get('namespace')}/{meta.get('name')}", GroupMemory())
        name, namespace = str(meta.get("name", "")), str(meta.get("namespace") or "default")

        group, problem = self._validated(body, memory)
        if group is not None and (problem := capability_problem(group.spec)) is not None:
            # Refused like an invalid spec: nothing is built, existing pods are left alone.
            group = None
        decision: PlanDecision | None = None
        outdated: list[str] = []
        retry = False
        if group is not None:
            try:
                config_map = await self.api.get(KINDS["ConfigMap"].item(namespace, names.plan_config_map(name)))
                # The Secret first: its token seals the plan (and tells a plan someone else wrote from ours).
                token = await self._ensure_secret(group, build_group_secret(group))
                decision = decide_plan(group.spec, group=name, namespace=namespace, config_map=config_map, token=token)
                desired = self._desired(group, decision, memory, token)
            except PlanError as exc:
                problem, decision = Problem("PlanFailed", f"the planner rejected the spec: {exc}"), None
            except BuildError as exc:
                problem, decision = Problem(exc.reason, exc.message), None
            except ApiError as exc:
                problem, decision, retry = _api_problem(exc), None, True
            else:

                async def progress(pods: Sequence[Mapping[str, Any]]) -> None:
                    """The status so far, while pods are being created: a user sees counts from the start."""
                    assert group is not None and decision is not None
                    folded = self._fold(body, memory, group.spec, decision, pods, None, ())
                    await self._write_status(body, memory, folded.status, "progress")

                try:
                    if self._previous(body, memory) is None:
                        # A new group: its counts go on its status before the supporting objects are made (a
                        # dozen sequential calls that a busy API server stretches to seconds).
                        await progress(await self._pods(namespace, name, uid))
                    outdated = await self._apply(body, group, desired, decision, memory, progress)
                except ApiError as exc:
                    problem, retry = _api_problem(exc), True

        try:
            pods = await self._pods(namespace, name, uid)
        except ApiError as exc:
            pods, retry = [], True
            problem = problem or _api_problem(exc)

        previous = self._previous(body, memory)
        spec = group.spec if group is not None and (problem is None or not problem.fatal) else None
        folded = self._fold(body, memory, spec, decision, pods, problem, outdated)
        await self._report(body, previous, folded, problem, memory)
        if problem is not None:
            metrics.ERRORS.labels(reason=problem.reason).inc()

        try:
            await self._write_status(body, memory, folded.status, "final")
        except ApiError as exc:
            if exc.not_found:
                return Result(phase=None, skipped="group is gone")
            logger.warning("could not write the status of %s/%s: %s", namespace, name, exc)
            return Result(phase=folded.status.get("phase"), problem=problem, retry=True, status=folded.status)
        return Result(phase=folded.status.get("phase"), problem=problem, retry=retry, status=folded.status)

    # --- Building (memoised) ------------------------------------------------------------------------

    @staticmethod
    def _source_key(body: Mapping[str, Any]) -> str:
        """What validation and the builders read: the spec, and the group's name, namespace and uid."""
        meta = body.get("metadata") or {}
        return json.dumps(
            [meta.get("name"), meta.get("namespace"), meta.get("uid"), body.get("spec")], sort_keys=True, default=str
        )

    def _validated(self, body: Mapping[str, Any], memory: GroupMemory) -> tuple[WeightSyncGroup | None, Problem | None]:
        key = self._source_key(body)
        if memory.validated is None or memory.validated[0] != key:
            memory.validated = (key, *validate(body))
            memory.built = None
        return memory.validated[1], memory.validated[2]

    def _desired(self, group: WeightSyncGroup, decision: PlanDecision, memory: GroupMemory, token: str) -> DesiredState:
        assert memory.validated is not None
        key = (memory.validated[0], decision.plan.hash, decision.plan.revision, seal(token, ""))  # a rotation reseals
        if memory.built is None or memory.built[0] != key:
            memory.built = (key, desired_state(group, decision.plan, self.options, token))
        return memory.built[1]

    # --- Status ------------------------------------------------------------------------------------

    @staticmethod
    def _previous(body: Mapping[str, Any], memory: GroupMemory) -> Mapping[str, Any] | None:
        previous = memory.status if memory.status is not None else body.get("status")
        return previous if isinstance(previous, Mapping) else None

    def _fold(
        self,
        body: Mapping[str, Any],
        memory: GroupMemory,
        spec: Any,
        decision: PlanDecision | None,
        pods: Sequence[Mapping[str, Any]],
        problem: Problem | None,
        outdated: Sequence[str],
    ) -> Folded:
        meta = body.get("metadata") or {}
        return fold_status(
            Observation(
                name=str(meta.get("name", "")),
                generation=int(meta.get("generation") or 0),
                now=self.clock(),
                previous=self._previous(body, memory),
                spec=spec,
                plan=decision.plan if decision is not None else None,
                pods=pods,
                problem=problem,
                outdated=tuple(outdated),
            )
        )

    async def _write_status(
        self, body: Mapping[str, Any], memory: GroupMemory, status: dict[str, Any], when: str
    ) -> None:
        """Patch the status only when it differs from the last one written (an idle group writes nothing)."""
        previous = self._previous(body, memory)
        if previous is not None and strip_none(status) == strip_none(dict(previous)):
            return
        meta = body.get("metadata") or {}
        path = GROUP_KIND.item(str(meta.get("namespace") or "default"), str(meta.get("name", ""))) + "/status"
        await self.api.merge_patch(path, {"status": status})
        metrics.STATUS_WRITES.labels(when=when).inc()
        memory.status = strip_none(status)

    # --- Applying ----------------------------------------------------------------------------------

    async def _pods(self, namespace: str, group: str, uid: str) -> list[dict[str, Any]]:
        """The group's pods: labelled for the group and controlled by it (by uid, when known).

        From the watch-fed index once it is warm for the group; otherwise one LIST (which warms it)."""
        key = (namespace, group)
        pods = self.index.pods(key, self.monotonic()) if self.index is not None else None
        if pods is None:
            listed, version = await self.api.list_versioned(
                POD_KIND.collection(namespace), label_selector=f"{names.LABEL_GROUP}={group}"
            )
            pods = listed
            if self.index is not None:
                self.index.seed(key, listed, _int_or_none(version), self.monotonic())
                pods = self.index.pods(key, self.monotonic()) or []
        return [
            p
            for p in pods
            if ((p.get("metadata") or {}).get("labels") or {}).get(names.LABEL_GROUP) == group
            and (p.get("metadata") or {}).get("namespace", namespace) == namespace
            and _controlled_by(p, uid)
        ]

    async def _apply(
        self,
        body: Mapping[str, Any],
        group: WeightSyncGroup,
        desired: DesiredState,
        decision: PlanDecision,
        memory: GroupMemory,
        progress: Callable[[Sequence[Mapping[str, Any]]], Awaitable[None]],
    ) -> list[str]:
        """Apply ``desired``; returns the pods that run an outdated spec (left running)."""
        uid = group.metadata.uid
        for obj in desired.supporting_objects():
            await self._ensure(obj, uid)
        if desired.network_policy is None:
            await self._remove_network_policy(group, names.network_policy(group.metadata.name))
        for role in MESH_ROLES:
            if role not in desired.mesh_policies:  # its job fits one pod now, or the fence is off
                await self._remove_network_policy(group, names.mesh_policy(group.metadata.name, role))
        if decision.changed:
            await self._plan_event(body, decision)

        namespace, name = group.metadata.namespace, group.metadata.name
        existing = {str(p["metadata"]["name"]): p for p in await self._pods(namespace, name, uid)}
        wanted = set(desired.pod_names)
        missing = [pod for pod in desired.pods if str(pod["metadata"]["name"]) not in existing]
        if missing:
            await progress(list(existing.values()))  # desired counts are known: show them before creating
            await self._create_pods(body, uid, missing, progress)
        outdated: list[str] = []
        for pod in desired.pods:
            pod_name = str(pod["metadata"]["name"])
            current = existing.get(pod_name)
            if current is None:
                continue
            current_meta = current.get("metadata") or {}
            if current_meta.get("deletionTimestamp"):
                continue  # recreated once it is gone (its deletion event triggers a reconcile)
            phase = (current.get("status") or {}).get("phase")
            if phase in ("Failed", "Succeeded"):
                reason = (current.get("status") or {}).get("reason") or phase
                message = (current.get("status") or {}).get("message") or f"pod phase is {phase}"
                await self.recorder.post(
                    body,
                    "Warning",
                    "PodFailed",
                    f"pod {pod_name} {phase.lower()} ({reason}: {message}); recreating",
                )
                memory.reported.add(f"{current_meta.get('uid') or pod_name}/{phase}")
                await self.api.delete(path_of(current), uid=current_meta.get("uid"))
                continue
            current_hash = (current_meta.get("annotations") or {}).get(names.ANNOTATION_SPEC_HASH)
            if current_hash != pod["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]:
                # Not recreated: a running trainer or engine is never killed behind the user's back
                # (an operator upgrade that changes the default agent image would otherwise restart
                # every job). Reported instead; deleting the pod applies the current spec.
                outdated.append(pod_name)
        surplus = sorted(set(existing) - wanted)
        for pod_name in surplus:
            current = existing[pod_name]
            if (current.get("metadata") or {}).get("deletionTimestamp"):
                continue
            await self.api.delete(path_of(current), uid=(current.get("metadata") or {}).get("uid"))
        if surplus:
            await self.recorder.post(
                body,
                "Normal",
                "PodsRemoved",
                f"removed {len(surplus)} surplus pods: {', '.join(surplus[:10])}",
            )
        key = "outdated/" + ",".join(outdated)
        if outdated and key not in memory.reported:
            memory.reported.add(key)
            await self.recorder.post(
                body,
                "Normal",
                "PodsOutdated",
                f"{len(outdated)} pods run an older pod spec; delete them to apply the current one: "
                + ", ".join(outdated[:10]),
            )
        return outdated

    async def _create_pods(
        self,
        body: Mapping[str, Any],
        uid: str,
        pods: Sequence[Mapping[str, Any]],
        progress: Callable[[Sequence[Mapping[str, Any]]], Awaitable[None]],
    ) -> None:
        """Create ``pods``, at most ``create_concurrency`` at a time, writing progress to the status at most every
        ``status_interval`` seconds. Every create is attempted; a failure is raised after all have finished (the
        first, counting the others), as one failed create was before."""
        gate = asyncio.Semaphore(self.create_concurrency)

        async def create(pod: Mapping[str, Any]) -> None:
            async with gate:
                await self._create_pod(uid, pod)

        tasks = [asyncio.create_task(create(pod)) for pod in pods]
        try:
            pending: set[asyncio.Task[None]] = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=self.status_interval)
                if pending and self.index is not None:
                    meta = body.get("metadata") or {}
                    namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name", ""))
                    try:
                        await progress(await self._pods(namespace, name, uid))
                    except ApiError as exc:  # progress is best effort: the final status is written anyway
                        logger.info("could not write the progress of %s/%s: %s", namespace, name, exc)
        finally:
            for task in tasks:
                task.cancel()  # only matters when this reconcile is cancelled itself
        failures = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
        for failure in failures:
            if not isinstance(failure, ApiError):
                raise failure
        if failures:
            first = failures[0]
            assert isinstance(first, ApiError)
            more = f" (and {len(failures) - 1} more of {len(pods)} pod creates failed)" if len(failures) > 1 else ""
            raise ApiError(first.status, first.reason, first.message + more) from first

    async def _create_pod(self, uid: str, pod: Mapping[str, Any]) -> None:
        try:
            created = await self.api.create(pod)
        except ApiError as exc:
            if not exc.conflict:
                raise
            # Exists already: ours (the index had not seen it yet, e.g. right after a start) counts as created;
            # anyone else's (another owner, or no owner) is never touched.
            current = await self.api.get(path_of(pod))
            if current is not None and _controlled_by(current, uid):
                created = current
            else:
                raise ApiError(
                    409,
                    "NameConflict",
                    f"pod {pod['metadata']['name']} exists and is not controlled by this group; delete or rename it",
                ) from exc
        if self.index is not None:
            self.index.observe("ADDED", created)

    async def _ensure(self, obj: Mapping[str, Any], uid: str) -> None:
        """Create ``obj``, or merge-patch the fields the operator owns when they drifted."""
        path = path_of(obj)
        current = await self.api.get(path)
        if current is None:
            try:
                await self.api.create(obj)
            except ApiError as exc:
                if not exc.conflict:
                    raise
                current = await self.api.get(path)  # created meanwhile; fall through and compare
                if current is None:
                    raise
            else:
                return
        owners = [dict(r) for r in (current.get("metadata") or {}).get("ownerReferences") or []]
        foreign = [r for r in owners if r.get("controller") and r.get("uid") != uid]
        if foreign:
            raise ApiError(
                409,
                "NameConflict",
                f"{obj['kind']} {obj['metadata']['name']} is controlled by "
                f"{foreign[0].get('kind')}/{foreign[0].get('name')}, not by this group",
            )
        patch = _owned_fields(obj)
        ours = obj["metadata"]["ownerReferences"]
        patch["metadata"]["ownerReferences"] = [r for r in owners if r.get("uid") != uid] + ours
        if not _is_subset(patch, current):
            await self.api.merge_patch(path, patch)

    async def _remove_network_policy(self, group: WeightSyncGroup, name: str) -> None:
        """A policy the group no longer wants (``networkPolicy.enabled: false``, or a mesh whose job fits one pod
        now): delete the one this group made, never one it does not control (the users' own, under the same name,
        is theirs)."""
        meta = group.metadata
        path = KINDS["NetworkPolicy"].item(meta.namespace, name)
        current = await self.api.get(path)
        if current is not None and _controlled_by(current, meta.uid):
            await self.api.delete(path, uid=(current.get("metadata") or {}).get("uid"))

    async def _ensure_secret(self, group: WeightSyncGroup, secret: Mapping[str, Any]) -> str:
        """The group's credential: created with a fresh token when missing; afterwards only its metadata (owner,
        labels) is kept in line, and its token is never rewritten (running pods hold it in their env). A Secret
        whose token was removed gets a new one: its pods could not start without it anyway. Returns the token."""
        path = path_of(secret)
        current = await self.api.get(path)
        if current is None:
            token = new_token()
            try:
                await self.api.create(build_group_secret(group, token))
                return token
            except ApiError as exc:
                if not exc.conflict:
                    raise
                current = await self.api.get(path)  # created meanwhile: keep its token
                if current is None:
                    raise
        await self._ensure(secret, group.metadata.uid)  # metadata only: no "data" in the built object
        held = secret_token(current)
        if held is None:
            held = new_token()
            await self.api.merge_patch(path, {"data": build_group_secret(group, held)["data"]})
        return held

    async def _plan_event(self, body: Mapping[str, Any], decision: PlanDecision) -> None:
        plan = decision.plan
        summary = (
            f"plan revision {plan.revision} ({plan.hash}): {plan.layout.sources} sources -> "
            f"{plan.layout.targets} targets, at most {plan.balance.max_targets_per_source} targets per source"
        )
        if decision.previous is None:
            note = f" ({decision.note})" if decision.note else ""
            await self.recorder.post(body, "Normal", "PlanCreated", summary + note)
        else:
            await self.recorder.post(
                body,
                "Normal",
                "PlanUpdated",
                f"{summary}; {plan.moved_targets} targets moved to another source "
                f"(was revision {decision.previous.revision}, {decision.previous.hash})",
            )

    # --- Reporting ---------------------------------------------------------------------------------

    async def _report(
        self,
        body: Mapping[str, Any],
        previous: Mapping[str, Any] | None,
        folded: Folded,
        problem: Problem | None,
        memory: GroupMemory,
    ) -> None:
        if problem is not None:
            before = condition(previous, "Degraded")
            if before is None or before.get("reason") != problem.reason or before.get("message") != problem.message:
                await self.recorder.post(body, "Warning", problem.reason, problem.message)
        for failure in folded.failures:
            if failure.key not in memory.reported:
                memory.reported.add(failure.key)
                await self.recorder.post(body, "Warning", "PodFailed", failure.message)
        for reason, message in folded.warnings:
            key = f"{reason}/{message}"
            if key not in memory.reported:
                memory.reported.add(key)
                await self.recorder.post(body, "Warning", reason, message)
        if len(memory.reported) > 4096:  # bounded: forgetting only risks a repeated event
            memory.reported.clear()


def _int_or_none(value: str | None) -> int | None:
    return resource_version({"metadata": {"resourceVersion": value}})


def _api_problem(exc: ApiError) -> Problem:
    reason = exc.reason if exc.reason == "NameConflict" else "ApiError"
    return Problem(reason, exc.message if reason == "NameConflict" else str(exc), fatal=False)


def _controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs if isinstance(r, Mapping))


def _owned_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a built object the operator owns (and so may overwrite)."""
    meta = obj["metadata"]
    patch: dict[str, Any] = {"metadata": {"labels": dict(meta.get("labels") or {})}}
    if meta.get("annotations"):
        patch["metadata"]["annotations"] = dict(meta["annotations"])
    for key in ("spec", "data", "rules", "subjects"):
        if key in obj:
            patch[key] = obj[key]
    return patch


def _is_subset(want: Any, have: Any) -> bool:
    """Every field in ``want`` has that value in ``have`` (server-added fields are ignored)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(k in have and _is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, Sequence) and not isinstance(want, str):
        return (
            isinstance(have, Sequence)
            and not isinstance(have, str)
            and len(want) == len(have)
            and all(_is_subset(w, h) for w, h in zip(want, have, strict=True))
        )
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have
    return bool(want == have)


__all__ = ["EventRecorder", "GroupMemory", "Reconciler", "Result", "validate"]
