"""The coordinator's handle on one source (trainer rank), and the scope of what it asks the source to write."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from weightsync.plan import Target
from weightsync_agent.source.report import SourceReport


@dataclass(frozen=True)
class RoundScope:
    """Which round a source is asked to write.

    ``plan_hash``: the plan the coordinator runs (a source on another plan refuses, naming both);
    ``engines``: the engines the round covers (None: all of them); ``catch_up``: bring engines to the
    committed version the replica still holds, instead of writing a newly staged one; ``placements``: per
    target, the :attr:`~weightsync_agent.layout.manifest.Manifest.placement` its engine publishes at the
    round's start (a source whose manifest says otherwise refuses to write it, and refetches: docs/architecture.md);
    ``round_id``: the id the coordinator minted for this round (a publish naming another round than the one the
    source last prepared is refused: a dead round's late call writes nothing).
    """

    plan_hash: str | None = None
    engines: frozenset[int] | None = None
    catch_up: bool = False
    placements: Mapping[Target, str] | None = field(default=None, hash=False)
    round_id: str | None = None

    @classmethod
    def of(
        cls,
        plan_hash: str | None,
        engines: Collection[int] | None = None,
        *,
        catch_up: bool = False,
        placements: Mapping[Target, str] | None = None,
        round_id: str | None = None,
    ) -> RoundScope:
        return cls(plan_hash, None if engines is None else frozenset(engines), catch_up, placements, round_id)

    def covers(self, engine: int) -> bool:
        return self.engines is None or engine in self.engines

    def placement(self, target: Target) -> str | None:
        """Where ``target``'s engine publishes its weights now, if the round pinned it."""
        return None if self.placements is None else self.placements.get(target)


class SourceControl(Protocol):
    """One trainer rank, as the round driver sees it: writes its planned targets from its replicas."""

    source: int

    def prepare(self, version: int, deadline: float) -> SourceReport:
        """Whether :meth:`publish` of ``version`` can run, before anything is paused or written: the source is
        built for the round's plan and its replicas hold ``version`` (staged by the trainer, waiting for it until
        ``deadline``; or, catching up, still the committed one). Writes nothing."""
        ...

    def publish(self, version: int, deadline: float) -> SourceReport: ...
