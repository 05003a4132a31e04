"""Who is who in broadcast mode (``transfer.mode: broadcast``): pure functions of the plan.

Trainer rank 0 is group rank 0 and the only sender. Every engine joins with one or more **members**,
each a group rank that receives every byte and fills some of the engine's tensor-parallel ranks:

- ``receivers="engine"`` (default): one member per engine process, filling all its ranks. The reference
  engine serves every rank from one process, so the bytes cross the wire once per engine.
- ``receivers="rank"``: one member per engine rank, as SGLang's ``update_weights_from_distributed`` does
  (every inference rank is in the group and receives full tensors).

Each engine kind's adapter says which it needs (``EngineAdapter.broadcast``).

Engines take consecutive group ranks in engine order. The plan's p2p assignment (which trainer rank
writes which target) means nothing here: :func:`broadcast_round_plan` gives the round driver a view of
the plan in which rank 0 serves every target, so it expects (and verifies) rank 0's checksums for all.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.plan import Layout, Plan, SourceAssignment
from weightsync.plan.document import summarise
from weightsync_agent.targets.adapter import Receivers

__all__ = ["SENDER", "BroadcastLayout", "Member", "Receivers", "broadcast_round_plan"]

SENDER = 0


@dataclass(frozen=True)
class Member:
    """One receiving group rank and the engine ranks it fills from what it receives."""

    group_rank: int
    ranks: tuple[int, ...]

    def as_json(self) -> dict[str, object]:
        return {"group_rank": self.group_rank, "ranks": list(self.ranks)}


@dataclass(frozen=True)
class BroadcastLayout:
    world_size: int
    members: dict[int, tuple[Member, ...]]  # engine -> its members

    @classmethod
    def of(cls, layout: Layout, receivers: Receivers = "engine") -> BroadcastLayout:
        members: dict[int, tuple[Member, ...]] = {}
        next_rank = SENDER + 1
        tp = layout.ranks_per_engine
        for engine in range(layout.engines):
            groups = [tuple(range(tp))] if receivers == "engine" else [(rank,) for rank in range(tp)]
            members[engine] = tuple(Member(next_rank + i, ranks) for i, ranks in enumerate(groups))
            next_rank += len(groups)
        return cls(world_size=next_rank, members=members)

    @property
    def receivers(self) -> int:
        return self.world_size - 1

    def engine_of(self, group_rank: int) -> int | None:
        for engine, members in self.members.items():
            if any(m.group_rank == group_rank for m in members):
                return engine
        return None


def broadcast_round_plan(plan: Plan) -> Plan:
    """``plan`` as the round driver must see it in broadcast mode: rank 0 writes every target."""
    if plan.transfer.mode != "broadcast":
        raise ValueError(f"plan {plan.group or '(unnamed)'} is in {plan.transfer.mode} mode, not broadcast")
    everything = tuple(plan.layout.all_targets())
    sources = tuple(
        SourceAssignment(source=s, targets=everything if s == SENDER else ()) for s in range(plan.layout.sources)
    )
    balance = summarise(sources, note="broadcast: trainer rank 0 sends every full tensor to every engine")
    return plan.sealed(sources=sources, balance=balance)
