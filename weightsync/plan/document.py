"""The plan document: the contract between the operator (which writes it) and the agents (which read it).

It is stored as JSON under ``plan.json`` in the ConfigMap ``<group>-plan``. A plan is *self-checking*:
constructing or parsing one verifies that every target has exactly one source, that every rank is in
range and that the hash matches, so an agent never acts on a malformed plan.

Sources are trainer ranks (global index ``pod * ranksPerPod + localRank``). Targets are
``(engine, engineRank)`` pairs. A source holds one CPU replica per distinct engine rank it serves
(its *shapes*) and writes that replica to every engine that holds that rank.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from functools import cached_property
from typing import Any, Final, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from weightsync.api.engines import Adapter
from weightsync.api.v1alpha1 import ApiModel, Planner, TransferSpec

SCHEMA_VERSION: Final = "weightsync.io/plan/v1"

Target = tuple[int, int]
"""``(engine, engine_rank)``."""


class PlanError(ValueError):
    """A plan that cannot be built, or a document that is not a valid plan."""


class Layout(ApiModel):
    """Both sides' shape, copied from the spec so agents need nothing else."""

    model_config = ConfigDict(frozen=True)

    trainer_pods: int = Field(ge=1)
    trainer_ranks_per_pod: int = Field(ge=1)
    engines: int = Field(ge=1)
    ranks_per_engine: int = Field(ge=1)
    engine_ranks_per_pod: int = Field(ge=1)
    adapter: Adapter = "sglang"
    engine_port: int = 30000
    agent_port: int = 9470

    @property
    def sources(self) -> int:
        return self.trainer_pods * self.trainer_ranks_per_pod

    @property
    def targets(self) -> int:
        return self.engines * self.ranks_per_engine

    def source_pod(self, source: int) -> tuple[int, int]:
        """``(trainer pod index, local rank)`` of a global trainer rank."""
        return divmod(source, self.trainer_ranks_per_pod)

    def target_pod(self, target: Target) -> tuple[int, int, int]:
        """``(engine, pod index within the engine, local rank)`` of an engine rank."""
        engine, rank = target
        pod, local = divmod(rank, self.engine_ranks_per_pod)
        return engine, pod, local

    def all_targets(self) -> Iterator[Target]:
        """Engine-major, as the published round-robin rule lists them."""
        for engine in range(self.engines):
            for rank in range(self.ranks_per_engine):
                yield (engine, rank)


class SourceAssignment(ApiModel):
    """What one trainer rank does in a sync."""

    model_config = ConfigDict(frozen=True)

    source: int = Field(ge=0)
    targets: tuple[Target, ...] = ()

    @property
    def shapes(self) -> tuple[int, ...]:
        """Engine ranks whose replica this source must hold in CPU memory."""
        return tuple(sorted({rank for _, rank in self.targets}))


class Balance(ApiModel):
    """How even the plan is; the busiest source sets the sync time."""

    model_config = ConfigDict(frozen=True)

    max_targets_per_source: int = Field(ge=0)
    min_targets_per_source: int = Field(ge=0)
    max_shapes_per_source: int = Field(ge=0)
    total_shapes: int = Field(ge=0)
    perfect: bool = Field(description="max - min targets per source <= 1")
    note: str = ""


class Plan(ApiModel):
    """A complete, verified assignment of every target to one source."""

    model_config = ConfigDict(frozen=True)

    schema_version: Literal["weightsync.io/plan/v1"] = SCHEMA_VERSION
    group: str = ""
    namespace: str = ""
    revision: int = Field(default=1, ge=1, description="Bumped by the operator whenever the hash changes.")
    policy: Planner
    layout: Layout
    transfer: TransferSpec = Field(default_factory=TransferSpec)
    sources: tuple[SourceAssignment, ...]
    balance: Balance
    moved_targets: int = Field(default=0, ge=0, description="Targets that changed source at the last replan.")
    hash: str = ""

    @model_validator(mode="after")
    def _check(self) -> Self:
        layout = self.layout
        if len(self.sources) != layout.sources:
            raise PlanError(f"plan lists {len(self.sources)} sources, layout has {layout.sources}")
        seen: Counter[Target] = Counter()
        for index, assignment in enumerate(self.sources):
            if assignment.source != index:
                raise PlanError(f"sources must be listed in rank order: entry {index} is source {assignment.source}")
            for engine, rank in assignment.targets:
                if not (0 <= engine < layout.engines and 0 <= rank < layout.ranks_per_engine):
                    raise PlanError(
                        f"source {index} names target engine {engine} rank {rank}, outside "
                        f"{layout.engines} engines x {layout.ranks_per_engine} ranks"
                    )
            seen.update(assignment.targets)
        duplicated = sorted(t for t, n in seen.items() if n > 1)
        if duplicated:
            raise PlanError(f"targets assigned to more than one source: {duplicated[:8]}")
        missing = layout.targets - len(seen)
        if missing:
            unassigned = [t for t in layout.all_targets() if t not in seen][:8]
            raise PlanError(f"{missing} targets have no source, e.g. {unassigned}")
        if self.hash and self.hash != self.compute_hash():
            raise PlanError("plan hash does not match its content: the document was altered or truncated")
        return self

    # --- Queries ---------------------------------------------------------------------------------

    @cached_property
    def source_of(self) -> dict[Target, int]:
        return {t: a.source for a in self.sources for t in a.targets}

    def loads(self) -> list[int]:
        return [len(a.targets) for a in self.sources]

    # --- Serialisation ---------------------------------------------------------------------------

    def _content(self) -> dict[str, Any]:
        # The hash covers what agents act on, not the revision counter or the bookkeeping of the last
        # replan, so re-planning the same spec yields the same hash.
        data = self.model_dump(mode="json", by_alias=True, exclude={"hash", "revision", "moved_targets"})
        return data

    def compute_hash(self) -> str:
        canonical = json.dumps(self._content(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def sealed(self, **changes: Any) -> Plan:
        """A copy with ``changes`` applied and the hash recomputed."""
        data = self.model_dump(by_alias=False)
        data.update(changes)
        data["hash"] = ""
        draft = Plan.model_validate(data)
        return draft.model_copy(update={"hash": draft.compute_hash()})

    def to_json(self) -> str:
        if not self.hash:
            return self.sealed().to_json()
        return json.dumps(self.model_dump(mode="json", by_alias=True), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise PlanError("plan must be a JSON object")
        version = data.get("schemaVersion")
        if version != SCHEMA_VERSION:
            raise PlanError(f"unsupported plan schemaVersion {version!r}; this agent reads {SCHEMA_VERSION}")
        if not data.get("hash"):
            raise PlanError("plan has no hash; refusing an unsealed document")
        try:
            return cls.model_validate(data)
        except PlanError:
            raise
        except ValueError as exc:  # pydantic.ValidationError
            raise PlanError(f"malformed plan: {exc}") from exc


def summarise(sources: tuple[SourceAssignment, ...], *, note: str = "") -> Balance:
    """Balance figures of an assignment (pure helper shared by the planners)."""
    loads = [len(a.targets) for a in sources] or [0]
    shapes = [len(a.shapes) for a in sources] or [0]
    return Balance(
        max_targets_per_source=max(loads),
        min_targets_per_source=min(loads),
        max_shapes_per_source=max(shapes),
        total_shapes=sum(shapes),
        perfect=max(loads) - min(loads) <= 1,
        note=note,
    )
