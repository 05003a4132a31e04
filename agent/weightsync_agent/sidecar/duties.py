"""What this agent must do under a plan: pure, so it can be checked before any byte moves."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.plan import Plan, PlanError, Target
from weightsync_agent.config import AgentConfig


@dataclass(frozen=True)
class SourceDuty:
    source: int
    shapes: tuple[int, ...]
    targets: tuple[Target, ...]


@dataclass(frozen=True)
class TargetDuty:
    target: Target
    source: int


def duties(config: AgentConfig, plan: Plan) -> list[SourceDuty] | list[TargetDuty]:
    """This agent's part of the plan; PlanError if the plan does not know its ranks."""
    layout = plan.layout
    if config.role == "trainer":
        out_s: list[SourceDuty] = []
        for rank in config.ranks:
            if not 0 <= rank < layout.sources:
                raise PlanError(f"plan has {layout.sources} trainer ranks; this agent is rank {rank}")
            assignment = plan.sources[rank]
            out_s.append(SourceDuty(rank, assignment.shapes, assignment.targets))
        return out_s
    if config.engine_index is None or not 0 <= config.engine_index < layout.engines:
        raise PlanError(f"plan has {layout.engines} engines; this agent is engine {config.engine_index}")
    out_t: list[TargetDuty] = []
    for rank in config.ranks:
        if not 0 <= rank < layout.ranks_per_engine:
            raise PlanError(f"plan has {layout.ranks_per_engine} ranks per engine; this agent has rank {rank}")
        target = (config.engine_index, rank)
        out_t.append(TargetDuty(target, plan.source_of[target]))
    return out_t
