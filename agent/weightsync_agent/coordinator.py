"""The coordinator: trainer rank 0's agent runs every sync round of the group.

A regular round starts when trainer rank 0 publishes a version: the coordinator builds a
:class:`~weightsync_agent.rounds.RoundDriver` over every engine's HTTP API and every trainer rank (its
own ranks in this process, the others through their agents), runs it, and on success tells every
source the version is committed. The result goes on the coordinator's own pod (the operator folds it
into the group's ``status.lastSync``) and into its metrics.

A catch-up round brings engines that hold another version than the last committed one (a joining
engine, one that was restarted) to that version from the replicas, covering only them: the other
engines are neither paused nor touched.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from weightsync.plan import Plan
from weightsync.ports import free_port
from weightsync_agent import metrics
from weightsync_agent.broadcast_layout import broadcast_round_plan
from weightsync_agent.broadcast_source import BroadcastSource, BroadcastStageError
from weightsync_agent.directory import Directory, DirectoryError
from weightsync_agent.engines.api import EngineAPIError, EngineClient
from weightsync_agent.engines.control import HttpEngineControl
from weightsync_agent.remote import AgentClient, AgentError, HttpSourceControl
from weightsync_agent.replica import ReplicaError
from weightsync_agent.rounds import EngineControl, RoundDriver, RoundError, RoundResult, SourceControl, SourceReport
from weightsync_agent.source import MiB, SourceConfigError
from weightsync_agent.source_agent import SourceAgent
from weightsync_agent.transport.base import TransportError

log = logging.getLogger("weightsync.agent.coordinator")

#: Engines that speak the round's verify/commit extension routes (docs/agent.md, "Engines").
SUPPORTED_ADAPTERS = frozenset({"reference"})
UNSUPPORTED_ADAPTER = (
    "inference.adapter {0!r} has no weightsync adapter yet: the engine lacks the verify/commit routes and a "
    "shard map from trainer tensors to its parameters (see docs/agent.md)"
)

Reporter = Callable[[RoundResult, int | None], None]  # (round, committed version)


@dataclass(frozen=True)
class Finished:
    result: RoundResult
    at: float  # time.time() when it finished, to tell a retry's result from an earlier one's


class LocalRankSource:
    """One of this agent's own trainer ranks as a ``SourceControl``."""

    def __init__(
        self,
        agent: SourceAgent,
        source: int,
        *,
        plan_hash: str,
        engines: Collection[int] | None = None,
        catch_up: bool = False,
    ) -> None:
        self.agent = agent
        self.source = source
        self.plan_hash = plan_hash
        self.engines = engines
        self.catch_up = catch_up

    def publish(self, version: int, deadline: float) -> SourceReport:
        return self.agent.publish(
            self.source, version, deadline, plan_hash=self.plan_hash, engines=self.engines, catch_up=self.catch_up
        )


class SidecarBroadcast:
    """Broadcast mode's sender in the coordinator: rank 0's full-tensor replica, sent by a BroadcastSource.

    The group is formed on first use and re-formed after a failure or a plan change (joining engines
    get the next version: a catch-up would have to go through the whole group).
    """

    source = 0

    def __init__(self, agent: SourceAgent, host: str, call_timeout: float) -> None:
        self.agent = agent
        self.host = host
        self.call_timeout = call_timeout
        self.sender: BroadcastSource | None = None
        self.plan_hash: str | None = None

    def prepare(self, plan: Plan, engines: Mapping[int, str]) -> None:
        if self.sender is not None and self.plan_hash == plan.hash and self.sender.group is not None:
            return
        self.close()
        clients = {e: EngineClient(url, timeout=self.call_timeout) for e, url in engines.items()}
        sender = BroadcastSource(plan, self.agent.broadcast_manifests, clients, call_timeout=self.call_timeout)
        try:
            sender.connect(f"tcp://{self.host}:{free_port(self.host)}")
        except BaseException:
            sender.close()
            raise
        self.sender, self.plan_hash = sender, plan.hash

    def publish(self, version: int, deadline: float) -> SourceReport:
        sender = self.sender
        replicas = self.agent.replicas.get(0)
        if sender is None or replicas is None:
            return SourceReport(source=0, ok=False, error="the broadcast group is not formed")
        try:
            self.agent.wait_ready(0, version, deadline)
            missing = replicas.missing()
            if missing:
                return SourceReport(
                    source=0, ok=False, error=f"{len(missing)} full tensor(s) not staged, e.g. {missing[0]}"
                )
            replica = next(iter(replicas))
            sender.reset()
            sender.stage_many({name: replica.tensor(name) for name in sender.expected})
        except (TimeoutError, ReplicaError, BroadcastStageError) as exc:
            return SourceReport(source=0, ok=False, error=str(exc))
        with replicas.publishing():  # the trainer cannot restage while the bytes are on the wire
            return sender.publish(version, deadline)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender = None


class Coordinator:
    def __init__(
        self,
        group: str,
        local: SourceAgent,
        directory: Directory,
        *,
        report: Reporter | None = None,
        call_timeout: float = 30.0,
        retries: int = 1,
        host: str = "127.0.0.1",
    ) -> None:
        self.group = group
        self.broadcast = SidecarBroadcast(local, host, call_timeout)
        self.local = local
        self.directory = directory
        self.report = report
        self.call_timeout = call_timeout
        self.retries = retries
        self.committed: int | None = None
        self.finished: dict[int, Finished] = {}
        self._round = threading.Lock()
        self._cond = threading.Condition()

    # --- Rounds ----------------------------------------------------------------------------------

    def run_round(self, version: int) -> RoundResult:
        """Sync ``version`` to every engine (trainer rank 0 calls this through its publish)."""
        with self._round:
            if self.committed is not None and version <= self.committed:
                return self._finish(
                    self._refused(version, f"version {version} is not newer than committed {self.committed}"),
                    "regular",
                )
            plan = self.local.plan
            if plan is None:
                return self._finish(self._refused(version, "the sources are not built yet"), "regular")
            if plan.layout.adapter not in SUPPORTED_ADAPTERS:
                return self._finish(self._refused(version, UNSUPPORTED_ADAPTER.format(plan.layout.adapter)), "regular")
            try:
                engines = self._engines(plan, range(plan.layout.engines))
                if plan.transfer.mode == "broadcast":
                    urls = {e: self.directory.engine_url(e) for e in range(plan.layout.engines)}
                    self.broadcast.prepare(plan, urls)
                    driver = self._driver(broadcast_round_plan(plan), engines, {0: self.broadcast}, None)
                else:
                    driver = self._driver(plan, engines, self._sources(plan, None, catch_up=False), None)
            except (DirectoryError, RoundError, TransportError, SourceConfigError) as exc:
                return self._finish(self._refused(version, str(exc)), "regular")
            try:
                result = driver.run(version)
            finally:
                driver.close()
            if result.result == "Succeeded":
                self.committed = version
                self._tell_committed(plan, version)
            elif plan.transfer.mode == "broadcast":
                self.broadcast.close()  # out of step after a failure: re-form before the next round
            return self._finish(result, "regular")

    def catch_up(self) -> RoundResult | None:
        """Bring engines that answer with another version than the committed one up to it."""
        with self._round:
            plan, version = self.local.plan, self.committed
            if plan is None or version is None or plan.transfer.mode == "broadcast":
                return None
            lagging = [e for e in range(plan.layout.engines) if self._lags(e, version)]
            if not lagging:
                return None
            log.info("engines %s do not hold committed version %d: catching them up", lagging, version)
            try:
                driver = self._driver(
                    plan, self._engines(plan, lagging), self._sources(plan, lagging, catch_up=True), lagging
                )
            except (DirectoryError, RoundError) as exc:
                log.warning("catch-up of engines %s not possible yet: %s", lagging, exc)
                return None
            try:
                result = driver.run(version)
            finally:
                driver.close()
            if result.result != "Succeeded":
                reason = f"catch-up of engines {lagging}: {result.reason}"
                result = dataclasses.replace(result, reason=reason)
            return self._finish(result, "catch-up")

    def wait(self, version: int, timeout: float, after: float = 0.0) -> RoundResult | None:
        """The result of round ``version`` finished after ``after`` (``time.time()``), waiting up to ``timeout``."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                done = self.finished.get(version)
                if done is not None and done.at >= after:
                    return done.result
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    # --- Pieces ----------------------------------------------------------------------------------

    def _driver(
        self,
        plan: Plan,
        engines: dict[int, EngineControl],
        sources: dict[int, SourceControl],
        covering: Collection[int] | None,
    ) -> RoundDriver:
        transfer = plan.transfer
        return RoundDriver(
            plan,
            engines,
            sources,
            staging=transfer.target_staging,
            verify=transfer.verify,
            timeout_seconds=float(transfer.timeout_seconds),
            call_timeout=self.call_timeout,
            retries=self.retries,
            covering=covering,
        )

    def _engines(self, plan: Plan, which: Collection[int]) -> dict[int, EngineControl]:
        bucket_bytes = plan.transfer.bucket_size_mi_b * MiB
        return {
            e: HttpEngineControl(
                e,
                EngineClient(self.directory.engine_url(e), timeout=self.call_timeout),
                bucket_bytes=bucket_bytes,
                verify=plan.transfer.verify,
            )
            for e in which
        }

    def _sources(self, plan: Plan, engines: Collection[int] | None, *, catch_up: bool) -> dict[int, SourceControl]:
        out: dict[int, SourceControl] = {}
        clients: dict[int, AgentClient] = {}
        for assignment in plan.sources:
            rank = assignment.source
            if not any(engines is None or t[0] in engines for t in assignment.targets):
                continue
            if rank in self.local.ranks:
                out[rank] = LocalRankSource(self.local, rank, plan_hash=plan.hash, engines=engines, catch_up=catch_up)
                continue
            agent = self._agent_of(plan, rank, clients)
            out[rank] = HttpSourceControl(agent, rank, plan_hash=plan.hash, engines=engines, catch_up=catch_up)
        return out

    def _agent_of(self, plan: Plan, rank: int, clients: dict[int, AgentClient]) -> AgentClient:
        """The agent of the trainer pod running ``rank``; one directory lookup per pod (``clients`` caches)."""
        pod = plan.layout.source_pod(rank)[0]
        if pod not in clients:
            clients[pod] = AgentClient(self.directory.trainer_url(pod), timeout=self.call_timeout)
        return clients[pod]

    def _lags(self, engine: int, version: int) -> bool:
        try:
            held = EngineClient(self.directory.engine_url(engine), timeout=min(self.call_timeout, 5.0)).weight_version()
        except (DirectoryError, EngineAPIError):
            return False  # not up yet: caught up once it answers
        return held != str(version)

    def _tell_committed(self, plan: Plan, version: int) -> None:
        if plan.transfer.mode == "broadcast":
            if 0 in self.local.replicas:
                self.local.committed(0, version)
            return
        clients: dict[int, AgentClient] = {}
        for assignment in plan.sources:
            rank = assignment.source
            try:
                if rank in self.local.ranks:
                    self.local.committed(rank, version)
                else:
                    self._agent_of(plan, rank, clients).committed(rank, version)
            except (AgentError, DirectoryError) as exc:
                # Only costs that rank's catch-ups until the next round; the round itself committed.
                log.warning("could not tell source %d that version %d is committed: %s", rank, version, exc)

    def _refused(self, version: int, reason: str) -> RoundResult:
        return RoundResult(
            version=version,
            result="Failed",
            started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            duration_seconds=0.0,
            bytes=0,
            gbps=0.0,
            attempts=0,
            reason=f"round not started: {reason}",
        )

    def _finish(self, result: RoundResult, kind: str) -> RoundResult:
        metrics.ROUNDS.labels(self.group, kind, result.result).inc()
        metrics.ROUND_SECONDS.labels(self.group, kind).observe(result.duration_seconds)
        if result.result == "Succeeded":
            metrics.ROUND_BYTES.labels(self.group, kind).inc(result.bytes)
            metrics.WEIGHT_VERSION.labels(self.group).set(result.version)
        (log.info if result.result == "Succeeded" else log.warning)(
            "%s round v%d: %s in %.3f s, %d B%s",
            kind,
            result.version,
            result.result,
            result.duration_seconds,
            result.bytes,
            f" ({result.reason})" if result.reason else "",
        )
        with self._cond:
            if kind == "regular":
                self.finished[result.version] = Finished(result, time.time())
            self._cond.notify_all()
        if self.report is not None:
            try:
                self.report(result, self.committed)
            except Exception as exc:  # reporting must not undo a round; the next report retries
                log.warning("could not report round v%d on the pod: %s", result.version, exc)
        return result
