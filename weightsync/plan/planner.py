"""Entry points: spec -> plan, and old plan + new spec -> plan. Pure."""

from __future__ import annotations

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan.document import Layout, Plan, SourceAssignment, Target, summarise
from weightsync.plan.policies import balanced, miles


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


def _assemble(layout: Layout, assignment: list[list[Target]]) -> tuple[SourceAssignment, ...]:
    return tuple(SourceAssignment(source=i, targets=tuple(sorted(ts))) for i, ts in enumerate(assignment))


def plan_for(spec: WeightSyncGroupSpec, *, group: str = "", namespace: str = "", revision: int = 1) -> Plan:
    """A fresh plan for ``spec`` under its chosen policy."""
    layout = layout_of(spec)
    policy = spec.transfer.planner
    if policy == "miles":
        assignment, note = miles(layout), ""
    else:
        assignment, note = balanced(layout, max_shapes=spec.transfer.max_replica_shapes_per_source)
    sources = _assemble(layout, assignment)
    draft = Plan(
        group=group,
        namespace=namespace,
        revision=revision,
        policy=policy,
        layout=layout,
        transfer=spec.transfer,
        sources=sources,
        balance=summarise(sources, note=note),
    )
    return draft.sealed()


def replan(old: Plan, spec: WeightSyncGroupSpec) -> Plan:
    """A plan for ``spec`` that keeps ``old``'s assignments where it can. (Placeholder: recomputes.)"""
    fresh = plan_for(spec, group=old.group, namespace=old.namespace, revision=old.revision)
    moved = sum(1 for t, s in fresh.source_of.items() if old.source_of.get(t, s) != s)
    revision = old.revision if fresh.hash == old.hash else old.revision + 1
    return fresh.sealed(revision=revision, moved_targets=moved)
