"""p2p mode: every trainer rank holds a CPU replica per target layout and writes its planned targets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from weightsync.plan import Plan, Target
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.modes.base import RoundPeers
from weightsync_agent.source.agent import ManifestFetcher, SourceAgent
from weightsync_agent.source.control import RoundScope, SourceControl
from weightsync_agent.source.writer import SourceConfigError
from weightsync_agent.targets.adapter import EngineAdapter


class P2PMode:
    name: ClassVar[str] = "p2p"
    catch_up: ClassVar[bool] = True
    each_rank_writes: ClassVar[bool] = True

    def build_sources(self, agent: SourceAgent, plan: Plan, fetch: ManifestFetcher) -> None:
        fetched: dict[int, dict[Target, Manifest]] = {}
        for rank in agent.ranks:  # everything is fetched before anything changes
            if not 0 <= rank < plan.layout.sources:
                raise SourceConfigError(f"plan has {plan.layout.sources} trainer ranks; this agent runs rank {rank}")
            fetched[rank] = {t: fetch(*t) for t in plan.sources[rank].targets}
        for rank, manifests in fetched.items():
            with agent.rank_lock(rank):
                if not manifests:  # more trainer ranks than targets: this one has nothing to write
                    agent.drop_rank(rank)
                    continue
                replicas = agent.replica_set(rank, list(manifests.values()))
                agent.install_source(rank, plan, manifests, replicas)
        agent.adopt(plan, {t: m for manifests in fetched.values() for t, m in manifests.items()})

    def round_plan(self, plan: Plan) -> Plan:
        return plan

    def round_sources(
        self, peers: RoundPeers, plan: Plan, engines: Mapping[int, EngineAdapter], scope: RoundScope
    ) -> dict[int, SourceControl]:
        return {
            a.source: peers.source(plan, a.source, scope)
            for a in plan.sources
            if any(scope.covers(t[0]) for t in a.targets)
        }

    def committed(self, peers: RoundPeers, plan: Plan, version: int) -> None:
        for assignment in plan.sources:
            peers.tell_committed(plan, assignment.source, version)

    def failed(self) -> None:
        pass  # the replicas still hold the version: a retry writes it again

    def close(self) -> None:
        pass
