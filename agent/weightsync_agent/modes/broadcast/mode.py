"""broadcast mode: trainer rank 0 holds the full tensors and broadcasts them; every engine rank cuts its shards.

The group is formed on first use and re-formed after a failure or a plan change. Joining engines get
the next version: a catch-up would have to go through the whole group.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import ClassVar

from weightsync.plan import Plan
from weightsync.ports import free_port
from weightsync_agent.modes.base import RoundPeers
from weightsync_agent.modes.broadcast.full_replica import full_layout_manifest
from weightsync_agent.modes.broadcast.layout import SENDER, broadcast_round_plan
from weightsync_agent.modes.broadcast.sender import BroadcastSource, BroadcastStageError
from weightsync_agent.source.agent import ManifestFetcher, SourceAgent
from weightsync_agent.source.control import RoundScope, SourceControl
from weightsync_agent.source.replica import ReplicaError
from weightsync_agent.source.report import SourceReport
from weightsync_agent.source.writer import SourceConfigError
from weightsync_agent.targets.adapter import EngineAdapter


class SidecarBroadcast:
    """Rank 0's full-tensor replica (in the coordinator's own pod), sent by a :class:`BroadcastSource`."""

    source = SENDER

    def __init__(self, agent: SourceAgent, sender: BroadcastSource, round_id: str | None = None) -> None:
        self.agent = agent
        self.sender = sender
        self.round_id = round_id

    def prepare(self, version: int, deadline: float) -> SourceReport:
        if self.agent.replicas.get(SENDER) is None:
            return SourceReport(source=SENDER, ok=False, error="trainer rank 0 holds no full-tensor replica")
        try:
            self.agent.wait_ready(SENDER, version, deadline)
        except TimeoutError as exc:
            return SourceReport(source=SENDER, ok=False, error=str(exc))
        return self._streamed(version, deadline)

    def _streamed(self, version: int, deadline: float) -> SourceReport:
        """Broadcast sends whole tensors from a complete replica: a streamed version is taken as stage-then-publish
        (no overlap yet), so the round starts once the trainer closed its stream."""
        replicas = self.agent.replicas[SENDER]
        while replicas.stream_state(version) == "open":
            if time.monotonic() >= deadline:
                return SourceReport(source=SENDER, ok=False, error=f"trainer rank 0 still streams {version}")
            time.sleep(0.01)
        if replicas.stream_state(version) == "aborted":
            return SourceReport(source=SENDER, ok=False, error=f"the trainer aborted the stream of {version}")
        return SourceReport(source=SENDER, ok=True)

    def publish(self, version: int, deadline: float) -> SourceReport:
        replicas = self.agent.replicas.get(SENDER)
        if replicas is None:
            return SourceReport(source=SENDER, ok=False, error="trainer rank 0 holds no full-tensor replica")
        try:
            self.agent.wait_ready(SENDER, version, deadline)
            missing = replicas.missing()
            if missing:
                return SourceReport(
                    source=SENDER, ok=False, error=f"{len(missing)} full tensor(s) not staged, e.g. {missing[0]}"
                )
            replica = next(iter(replicas))
            self.sender.reset()
            self.sender.stage_many({name: replica.tensor(name) for name in self.sender.expected})
        except (TimeoutError, ReplicaError, BroadcastStageError) as exc:
            return SourceReport(source=SENDER, ok=False, error=str(exc))
        with replicas.publishing():  # the trainer cannot restage while the bytes are on the wire
            return self.sender.publish(version, deadline, round_id=self.round_id)


class BroadcastMode:
    name: ClassVar[str] = "broadcast"
    catch_up: ClassVar[bool] = False
    each_rank_writes: ClassVar[bool] = False

    def __init__(self) -> None:
        self.sender: BroadcastSource | None = None
        self.plan_hash: str | None = None

    def build_sources(self, agent: SourceAgent, plan: Plan, fetch: ManifestFetcher) -> None:
        agent.drop_sources()  # only rank 0 sends, and from its full tensors, not per-target replicas
        manifests = {}
        if SENDER in agent.ranks:
            manifests = {target: fetch(*target) for target in plan.layout.all_targets()}
            with agent.rank_lock(SENDER):
                agent.replica_set(SENDER, [full_layout_manifest(manifests.values())])
        agent.adopt(plan, manifests)

    def round_plan(self, plan: Plan) -> Plan:
        return broadcast_round_plan(plan)

    def round_sources(
        self, peers: RoundPeers, plan: Plan, engines: Mapping[int, EngineAdapter], scope: RoundScope
    ) -> dict[int, SourceControl]:
        if scope.catch_up or scope.engines is not None:
            raise SourceConfigError("broadcast rounds cover every engine; joining engines get the next version")
        if self.sender is None or self.plan_hash != plan.hash or self.sender.group is None:
            self._form(peers, plan, engines)
        assert self.sender is not None
        return {SENDER: SidecarBroadcast(peers.own_sources, self.sender, scope.round_id)}

    def _form(self, peers: RoundPeers, plan: Plan, engines: Mapping[int, EngineAdapter]) -> None:
        self.close()
        sender = BroadcastSource(plan, peers.own_sources.manifests, engines, call_timeout=peers.call_timeout)
        try:
            sender.connect(f"tcp://{peers.host}:{free_port(peers.host)}")
        except BaseException:
            sender.close()
            raise
        self.sender, self.plan_hash = sender, plan.hash

    def committed(self, peers: RoundPeers, plan: Plan, version: int) -> None:
        if SENDER in peers.own_sources.replicas:
            peers.own_sources.committed(SENDER, version)

    def failed(self) -> None:
        self.close()  # out of step after a failure: re-form before the next round

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender = None
