"""Entry points: spec -> plan, and old plan + new spec -> plan. Pure."""

from __future__ import annotations

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan.document import Layout, Plan, SourceAssignment, Target, summarise
from weightsync.plan.policies import balanced, miles
from weightsync.plan.replan import moved_targets, rebalance


def layout_of(spec: WeightSyncGroupSpec) -> Layout:
    return Layout(
        trainer_pods=spec.trainer.replicas,
        trainer_ranks_per_pod=spec.trainer.ranks_per_pod,
        engines=spec.inference.engines,
        ranks_per_engine=spec.inference.ranks_per_engine,
        engine_ranks_per_pod=spec.inference.ranks_per_pod,
        adapter=spec.inference.adapter,
        engine_port=spec.inference.port,
        agent_port=spec.agent.port,
    )


def _assemble(assignment: list[list[Target]]) -> tuple[SourceAssignment, ...]:
    return tuple(SourceAssignment(source=i, targets=tuple(sorted(ts))) for i, ts in enumerate(assignment))


def _build(
    spec: WeightSyncGroupSpec,
    layout: Layout,
    assignment: list[list[Target]],
    note: str,
    *,
    group: str,
    namespace: str,
    revision: int,
    moved: int = 0,
) -> Plan:
    sources = _assemble(assignment)
    draft = Plan(
        group=group,
        namespace=namespace,
        revision=revision,
        policy=spec.transfer.planner,
        layout=layout,
        transfer=spec.transfer,
        sources=sources,
        balance=summarise(sources, note=note),
        moved_targets=moved,
    )
    # The draft was validated on construction; hashing it needs no second validation pass.
    return draft.model_copy(update={"hash": draft.compute_hash()})


def _fresh(spec: WeightSyncGroupSpec, layout: Layout) -> tuple[list[list[Target]], str]:
    if spec.transfer.planner == "miles":
        return miles(layout), ""
    return balanced(layout, max_shapes=spec.transfer.max_replica_shapes_per_source)


def plan_for(spec: WeightSyncGroupSpec, *, group: str = "", namespace: str = "", revision: int = 1) -> Plan:
    """A fresh plan for ``spec`` under its chosen policy."""
    layout = layout_of(spec)
    assignment, note = _fresh(spec, layout)
    return _build(spec, layout, assignment, note, group=group, namespace=namespace, revision=revision)


def replan(old: Plan, spec: WeightSyncGroupSpec) -> Plan:
    """A plan for ``spec`` that keeps ``old``'s assignments where it can.

    balanced: each surviving source keeps its targets up to its new quota and only orphans move (see
    :mod:`weightsync.plan.replan`); if that breaks ``maxReplicaShapesPerSource``, or the policy
    changed, it is a fresh plan. miles: the rule is recomputed; it assigns targets one at a time in
    engine-major order, so appending engines leaves every earlier assignment alone.

    The revision stays when the content hash does, and is bumped otherwise.
    """
    layout = layout_of(spec)
    cap = spec.transfer.max_replica_shapes_per_source
    assignment: list[list[Target]] | None = None
    if spec.transfer.planner == "balanced" and old.policy == "balanced":
        assignment = rebalance(old, layout)
        if cap is not None and any(len({r for _, r in ts}) > cap for ts in assignment):
            assignment = None
    note = ""
    if assignment is None:
        assignment, note = _fresh(spec, layout)
    draft = _build(spec, layout, assignment, note, group=old.group, namespace=old.namespace, revision=old.revision)
    revision = old.revision if draft.hash == old.hash else old.revision + 1
    return draft.sealed(revision=revision, moved_targets=moved_targets(old, draft))
