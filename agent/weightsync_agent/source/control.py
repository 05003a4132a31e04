"""The coordinator's handle on one source (trainer rank), and the scope of what it asks the source to write."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from weightsync_agent.source.report import SourceReport


@dataclass(frozen=True)
class RoundScope:
    """Which round a source is asked to write.

    ``plan_hash``: the plan the coordinator runs (a source on another plan refuses, naming both);
    ``engines``: the engines the round covers (None: all of them); ``catch_up``: bring engines to the
    committed version the replica still holds, instead of writing a newly staged one.
    """

    plan_hash: str | None = None
    engines: frozenset[int] | None = None
    catch_up: bool = False

    @classmethod
    def of(cls, plan_hash: str | None, engines: Collection[int] | None = None, *, catch_up: bool = False) -> RoundScope:
        return cls(plan_hash, None if engines is None else frozenset(engines), catch_up)

    def covers(self, engine: int) -> bool:
        return self.engines is None or engine in self.engines


class SourceControl(Protocol):
    """One trainer rank, as the round driver sees it: writes its planned targets from its replicas."""

    source: int

    def publish(self, version: int, deadline: float) -> SourceReport: ...
