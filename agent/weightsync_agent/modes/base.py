"""The sync-mode seam: how one ``transfer.mode`` builds its sources and takes part in rounds.

A mode is one folder under ``modes/`` with one class, registered in :mod:`weightsync_agent.modes.registry`
under its ``transfer.mode`` name. The coordinator picks the mode once per plan and never asks which one
it runs; the trainer pod's agent asks the same mode to build its sources. A mode decides:

- **sources**: what a trainer pod holds for a plan (:meth:`SyncMode.build_sources`): p2p, one replica per
  target layout on every rank; broadcast, rank 0's full tensors;
- **the round's sources** (:meth:`SyncMode.round_sources`): who writes which target, as the driver's
  ``SourceControl``s, and the view of the plan the driver verifies against (:meth:`SyncMode.round_plan`);
- **commit and failure**: whom to tell a version is committed, what to reset after a failed round;
- **catch-up**: whether a joining engine can be brought to the committed version from the replicas.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import ClassVar, Protocol

from weightsync.plan import Plan
from weightsync_agent.source.agent import ManifestFetcher, SourceAgent
from weightsync_agent.source.control import RoundScope, SourceControl
from weightsync_agent.targets.adapter import EngineAdapter


class RoundPeers(Protocol):
    """What the coordinator offers a mode: this pod's sources (``own_sources``), the group's agents and engines."""

    own_sources: SourceAgent
    #: The address this process binds group sockets on (broadcast's rendezvous).
    host: str
    call_timeout: float

    def source(self, plan: Plan, rank: int, scope: RoundScope) -> SourceControl:
        """Trainer rank ``rank`` (in this pod or another) as a ``SourceControl`` bound to ``scope``."""
        ...

    def tell_committed(self, plan: Plan, rank: int, version: int) -> None:
        """Tell trainer rank ``rank``'s agent that ``version`` is committed (best effort)."""
        ...

    def engines(self, plan: Plan, which: Collection[int]) -> dict[int, EngineAdapter]: ...


class SyncMode(Protocol):
    name: ClassVar[str]
    #: Whether joining engines can catch up from the replicas (else they get the next version).
    catch_up: ClassVar[bool]
    #: Whether every trainer rank writes its own targets from its own replica (so one rank can write and
    #: coordinate in-process, ``WeightSyncClient.coordinating``).
    each_rank_writes: ClassVar[bool]

    # --- trainer pods ----------------------------------------------------------------------------------

    def build_sources(self, agent: SourceAgent, plan: Plan, fetch: ManifestFetcher) -> None:
        """(Re)build ``agent``'s sources for ``plan``; on an error the previous ones stay as they were."""
        ...

    # --- the coordinator -------------------------------------------------------------------------------

    def round_plan(self, plan: Plan) -> Plan:
        """The plan as the round driver sees it (which source writes, and so reports checksums for, which target)."""
        ...

    def round_sources(
        self, peers: RoundPeers, plan: Plan, engines: Mapping[int, EngineAdapter], scope: RoundScope
    ) -> dict[int, SourceControl]:
        """The sources of one round over ``engines`` (raises TransportError, SourceConfigError, LookupError)."""
        ...

    def committed(self, peers: RoundPeers, plan: Plan, version: int) -> None:
        """Every engine committed ``version``: the replicas hold it; the next version must be restaged."""
        ...

    def failed(self) -> None:
        """A round failed: drop whatever state is out of step with the engines."""
        ...

    def close(self) -> None: ...
