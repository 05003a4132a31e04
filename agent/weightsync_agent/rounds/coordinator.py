"""The coordinator: trainer rank 0's agent runs every sync round of the group.

A regular round starts when trainer rank 0 publishes a version: the coordinator builds a
:class:`~weightsync_agent.rounds.driver.RoundDriver` over every engine's HTTP API and every trainer rank (its
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
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from weightsync.api.engines import refusal
from weightsync.api.timeouts import HTTP_CALL_SECONDS
from weightsync.plan import Plan
from weightsync_agent import metrics
from weightsync_agent.directory import Directory, DirectoryError
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.modes.base import SyncMode
from weightsync_agent.modes.registry import mode_for
from weightsync_agent.rounds.driver import RoundDriver, RoundError, RoundResult
from weightsync_agent.rounds.remote import AgentClient, AgentError, HttpSourceControl
from weightsync_agent.source.agent import SourceAgent
from weightsync_agent.source.control import RoundScope, SourceControl
from weightsync_agent.source.report import SourceReport
from weightsync_agent.source.writer import SourceConfigError
from weightsync_agent.targets.adapter import AdapterUnavailableError, EngineAdapter
from weightsync_agent.targets.registry import make_adapter, settings_for
from weightsync_agent.transport.base import TransportError

log = logging.getLogger("weightsync.agent.coordinator")

Reporter = Callable[[RoundResult, int | None], None]  # (round, committed version)

#: Results of the last this many regular rounds are kept for ``GET /v1/rounds/{v}`` (trainer ranks that wait
#: for the round their rank 0 runs ask within seconds); older ones are forgotten, so a training run of a million
#: rounds holds 64 results, not a million.
HISTORY = 64

#: Why a round could not even start (nothing was paused or written).
NOT_STARTED = (
    AdapterUnavailableError,
    DirectoryError,
    LookupError,
    RoundError,
    SourceConfigError,
    TransportError,
)


@dataclass(frozen=True)
class Finished:
    result: RoundResult
    at: float  # time.time() when it finished, to tell a retry's result from an earlier one's


class InProcessRankSource:
    """One of this agent's own trainer ranks as a ``SourceControl``."""

    def __init__(self, agent: SourceAgent, source: int, scope: RoundScope) -> None:
        self.agent = agent
        self.source = source
        self.scope = scope

    def prepare(self, version: int, deadline: float) -> SourceReport:
        return self.agent.prepare(self.source, version, deadline, self.scope)

    def publish(self, version: int, deadline: float) -> SourceReport:
        return self.agent.publish(self.source, version, deadline, self.scope)


class Coordinator:
    """Runs the group's rounds; to its sync mode it is the :class:`~weightsync_agent.modes.base.RoundPeers`."""

    def __init__(
        self,
        group: str,
        own_sources: SourceAgent,
        directory: Directory,
        *,
        report: Reporter | None = None,
        call_timeout: float = HTTP_CALL_SECONDS,
        retries: int = 1,
        host: str = "127.0.0.1",
        token: str | None = None,
    ) -> None:
        self.group = group
        #: The group's credential, sent to every agent and engine of a round.
        self.token = token
        self.own_sources = own_sources
        self.directory = directory
        self.report = report
        self.call_timeout = call_timeout
        self.retries = retries
        self.host = host
        self.committed: int | None = None
        self.finished: OrderedDict[int, Finished] = OrderedDict()  # the last HISTORY regular rounds
        #: Called (from the round's thread) after every round: the HTTP routes wake their long polls with it.
        self.on_finish: list[Callable[[], None]] = []
        self.mode: SyncMode | None = None
        self._agents: dict[int, AgentClient] = {}  # trainer pod -> its agent, for the round in progress
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
            plan = self.own_sources.plan
            if plan is None:
                return self._finish(self._refused(version, "the sources are not built yet"), "regular")
            refused = refusal(plan.layout.adapter, plan.transfer.request)
            if refused is not None:
                return self._finish(self._refused(version, refused.message), "regular")
            mode = self._mode_for(plan)
            self._agents = {}
            try:
                engines = self.engines(plan, range(plan.layout.engines))
                sources = mode.round_sources(self, plan, engines, RoundScope.of(plan.hash))
                driver = self._driver(mode.round_plan(plan), engines, sources, None)
            except NOT_STARTED as exc:
                return self._finish(self._refused(version, str(exc)), "regular")
            try:
                result = driver.run(version)
            finally:
                driver.close()
            if result.result == "Succeeded":
                self.committed = version
                mode.committed(self, plan, version)
            else:
                mode.failed()
            return self._finish(result, "regular")

    def catch_up(self) -> RoundResult | None:
        """Bring engines that answer with another version than the committed one up to it."""
        with self._round:
            plan, version = self.own_sources.plan, self.committed
            if plan is None or version is None:
                return None
            mode = self._mode_for(plan)
            if not mode.catch_up:
                return None
            lagging = [e for e in range(plan.layout.engines) if self._lags(plan, e, version)]
            if not lagging:
                return None
            log.info("engines %s do not hold committed version %d: catching them up", lagging, version)
            self._agents = {}
            try:
                engines = self.engines(plan, lagging)
                sources = mode.round_sources(self, plan, engines, RoundScope.of(plan.hash, lagging, catch_up=True))
                driver = self._driver(mode.round_plan(plan), engines, sources, lagging)
            except NOT_STARTED as exc:
                log.warning("catch-up of engines %s not possible yet: %s", lagging, exc)
                return None
            try:
                result = driver.run(version)
            finally:
                driver.close()
            if not result.started:
                # A source cannot serve it (its replica holds no committed version yet, or the trainer has begun
                # staging the next one): nothing was paused; joiners get the next round.
                log.warning("catch-up of engines %s not possible yet: %s", lagging, result.reason)
                return None
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

    def close(self) -> None:
        if self.mode is not None:
            self.mode.close()

    # --- RoundPeers (what the sync mode may ask of the coordinator) --------------------------------

    def source(self, plan: Plan, rank: int, scope: RoundScope) -> SourceControl:
        if rank in self.own_sources.ranks:
            return InProcessRankSource(self.own_sources, rank, scope)
        return HttpSourceControl(self._agent_of(plan, rank), rank, scope)

    def tell_committed(self, plan: Plan, rank: int, version: int) -> None:
        try:
            if rank in self.own_sources.ranks:
                self.own_sources.committed(rank, version)
            else:
                self._agent_of(plan, rank).committed(rank, version)
        except (AgentError, DirectoryError) as exc:
            # Only costs that rank's catch-ups until the next round; the round itself committed.
            log.warning("could not tell source %d that version %d is committed: %s", rank, version, exc)

    def engines(self, plan: Plan, which: Collection[int]) -> dict[int, EngineAdapter]:
        return {e: self._adapter(plan, e) for e in which}

    # --- Pieces ----------------------------------------------------------------------------------

    def _mode_for(self, plan: Plan) -> SyncMode:
        self.mode = mode_for(self.mode, plan.transfer.mode)
        return self.mode

    def _adapter(self, plan: Plan, engine: int) -> EngineAdapter:
        settings = settings_for(plan, engine, self.directory, call_timeout=self.call_timeout, token=self.token)
        return make_adapter(plan.layout.adapter, settings)

    def _driver(
        self,
        plan: Plan,
        engines: dict[int, EngineAdapter],
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
            timeout_seconds=transfer.timeouts.round_budget,
            call_timeout=self.call_timeout,
            retries=self.retries,
            covering=covering,
        )

    def _agent_of(self, plan: Plan, rank: int) -> AgentClient:
        """The agent of the trainer pod running ``rank``; one directory lookup per pod and round."""
        pod = plan.layout.source_pod(rank)[0]
        if pod not in self._agents:
            self._agents[pod] = AgentClient(
                self.directory.trainer_url(pod), timeout=self.call_timeout, token=self.token
            )
        return self._agents[pod]

    def _lags(self, plan: Plan, engine: int, version: int) -> bool:
        try:
            held = self._adapter(plan, engine).held_version(timeout=min(self.call_timeout, 5.0))
        except (DirectoryError, HttpCallError, AdapterUnavailableError):
            return False  # not up yet: caught up once it answers
        return held != str(version)

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
                self.finished.move_to_end(result.version)
                while len(self.finished) > HISTORY:
                    self.finished.popitem(last=False)
            self._cond.notify_all()
        for hook in list(self.on_finish):
            hook()
        if self.report is not None:
            try:
                self.report(result, self.committed)
            except Exception as exc:  # reporting must not undo a round; the next report retries
                log.warning("could not report round v%d on the pod: %s", result.version, exc)
        return result
