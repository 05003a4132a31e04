"""p2p mode: every trainer rank holds a CPU replica per target layout and writes its planned targets."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

from weightsync.plan import Plan, Target
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.layout.manifest import Manifest, ManifestError
from weightsync_agent.modes.base import RoundPeers
from weightsync_agent.source.agent import ManifestFetcher, SourceAgent
from weightsync_agent.source.control import RoundScope, SourceControl
from weightsync_agent.source.writer import SourceConfigError, digest_grain
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
                grain = digest_grain(plan.transfer.verify, plan.transfer.bucket_bytes, manifests.values())
                replicas = agent.replica_set(rank, list(manifests.values()), digest_grain=grain)
                agent.install_source(rank, plan, manifests, replicas)
        agent.adopt(plan, {t: m for manifests in fetched.values() for t, m in manifests.items()})

    def round_plan(self, plan: Plan) -> Plan:
        return plan

    def round_sources(
        self, peers: RoundPeers, plan: Plan, engines: Mapping[int, EngineAdapter], scope: RoundScope
    ) -> dict[int, SourceControl]:
        # Sources write at the addresses of manifests fetched when they were built. Pin where every covered
        # engine publishes its weights now: a source holding another placement (the engine restarted) refuses.
        scope = dataclasses.replace(scope, placements=self._placements(plan, engines, scope))
        return {
            a.source: peers.source(plan, a.source, scope)
            for a in plan.sources
            if any(scope.covers(t[0]) for t in a.targets)
        }

    @staticmethod
    def _placements(plan: Plan, engines: Mapping[int, EngineAdapter], scope: RoundScope) -> dict[Target, str]:
        """Each covered target's current placement, from its engine's adapter (for SGLang: the manifest the
        engine's agent assembles from what SGLang publishes now; the adapter keeps it for the round's verify)."""
        targets = [t for a in plan.sources for t in a.targets if scope.covers(t[0]) and t[0] in engines]
        if not targets:
            return {}

        def placement(target: Target) -> str:
            try:
                return engines[target[0]].manifest(target[1]).placement
            except (HttpCallError, ManifestError) as exc:
                engine, rank = target
                raise SourceConfigError(f"engine {engine} rank {rank} serves no usable manifest: {exc}") from exc

        with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
            return dict(zip(targets, pool.map(placement, targets), strict=True))

    def committed(self, peers: RoundPeers, plan: Plan, version: int) -> None:
        for assignment in plan.sources:
            peers.tell_committed(plan, assignment.source, version)

    def failed(self) -> None:
        pass  # the replicas still hold the version: a retry writes it again

    def close(self) -> None:
        pass
