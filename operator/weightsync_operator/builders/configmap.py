"""The plan ConfigMap ``<group>-plan``, and the choice of plan from what it held before.

The ConfigMap is the plan's only home: the operator reads the previous plan back from it and replans
from there, so targets keep their sources across restarts of the operator. The revision is bumped
only when the plan's hash changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.api import names
from weightsync.api.v1alpha1 import WeightSyncGroup, WeightSyncGroupSpec
from weightsync.plan import Plan, PlanError, plan_for, replan
from weightsync.plan.seal import seal, sealed_by
from weightsync_operator.builders.common import JsonDict, object_meta


@dataclass(frozen=True)
class PlanDecision:
    plan: Plan
    #: The plan the ConfigMap held, if it held a readable one.
    previous: Plan | None
    #: Why the previous plan was not used (absent, unreadable), or "" when it was.
    note: str = ""

    @property
    def changed(self) -> bool:
        """True when the plan differs from what the ConfigMap held (including when it held none)."""
        return self.previous is None or self.previous.hash != self.plan.hash


def read_plan(config_map: Mapping[str, Any] | None, token: str | None = None) -> tuple[Plan | None, str]:
    """The plan stored in ``config_map``, or ``None`` and why not. With the group's ``token``, only a plan sealed
    with it (``weightsync.plan.seal``): one written by anyone else is not replanned from."""
    if config_map is None:
        return None, "no plan ConfigMap yet"
    data = config_map.get("data") or {}
    text = data.get(names.PLAN_KEY)
    if not text:
        return None, f"plan ConfigMap has no {names.PLAN_KEY}"
    if token is not None and not sealed_by([token], text, data.get(names.PLAN_SEAL_KEY)):
        return None, "the stored plan is not sealed with the group's token (written by someone else): planned afresh"
    try:
        return Plan.from_json(text), ""
    except PlanError as exc:
        return None, f"previous plan unreadable ({exc})"


def stored_revision(config_map: Mapping[str, Any] | None) -> int:
    """The revision annotated on the ConfigMap (0 when absent or garbled)."""
    if config_map is None:
        return 0
    raw = ((config_map.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_PLAN_REVISION)
    try:
        return max(int(raw), 0) if raw is not None else 0
    except (TypeError, ValueError):
        return 0


def decide_plan(
    spec: WeightSyncGroupSpec,
    *,
    group: str,
    namespace: str,
    config_map: Mapping[str, Any] | None,
    token: str | None = None,
) -> PlanDecision:
    """Replan from the stored plan, or plan afresh when there is none (or, given the group's ``token``, none sealed
    with it). Raises :class:`PlanError`."""
    previous, note = read_plan(config_map, token)
    if previous is not None and (previous.group, previous.namespace) != (group, namespace):
        note = f"stored plan belongs to {previous.namespace}/{previous.group}"
        previous = None
    if previous is None:
        # A fresh plan; if an unreadable one was there, still move the revision forward so agents
        # watching the revision see a change.
        revision = stored_revision(config_map) + 1
        return PlanDecision(plan_for(spec, group=group, namespace=namespace, revision=revision), None, note)
    plan = replan(previous, spec)
    if plan.hash == previous.hash:
        # Nothing agents act on changed: keep the stored document as it is (revision, and the
        # moved-target count of the replan that made it).
        return PlanDecision(previous, previous, note)
    # The contract, enforced here whatever the planner does: a new hash means the next revision.
    if plan.revision != previous.revision + 1:
        plan = plan.model_copy(update={"revision": previous.revision + 1})  # the hash does not cover it
    return PlanDecision(plan, previous, note)


def build_plan_config_map(group: WeightSyncGroup, plan: Plan, token: str | None = None) -> JsonDict:
    """The ConfigMap holding ``plan``, sealed with the group's ``token`` (the operator always has it; a rendering
    without it, ``weightsync render``, carries no seal, and agents would refuse it)."""
    text = plan.to_json()
    data = {names.PLAN_KEY: text, **({names.PLAN_SEAL_KEY: seal(token, text)} if token is not None else {})}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(
            group,
            names.plan_config_map(group.metadata.name),
            annotations={
                names.ANNOTATION_PLAN_HASH: plan.hash,
                names.ANNOTATION_PLAN_REVISION: str(plan.revision),
            },
        ),
        "data": data,
    }
