"""One agent process: its identity and plan, its role's objects, and the loops that keep them current.

* trainer pods: a :class:`~weightsync_agent.source.agent.SourceAgent` for the pod's ranks; the pod that
  holds trainer rank 0 also runs the :class:`~weightsync_agent.rounds.coordinator.Coordinator`;
* inference pods: an :class:`~weightsync_agent.targets.agent.EngineAgent` watching the local engine.

A background loop takes the newest plan from its source (a watch of the ConfigMap the operator rewrites when the
group scales, or a plan file: ``plan_loader``; a tick costs the API server nothing), rebuilds
the sources when it changed, lets the coordinator catch up engines that do not hold the committed
version, and refreshes what the agent reports on its pod. Every step is bounded and failures are logged
and retried on the next tick: a peer that is not up yet is the normal state during a scale-out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightsync.api import names
from weightsync.api.engines import Refusal, refusal
from weightsync.api.token import new_token
from weightsync.plan import Plan, PlanError
from weightsync_agent import metrics
from weightsync_agent.config import AgentConfig, trainer_token_file
from weightsync_agent.directory import Directory, DirectoryError
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.http.credential import Credential
from weightsync_agent.layout.manifest import Manifest, ManifestError
from weightsync_agent.modes.base import SyncMode
from weightsync_agent.modes.registry import mode_for
from weightsync_agent.rounds.canary import Canary
from weightsync_agent.rounds.coordinator import Coordinator
from weightsync_agent.rounds.driver import RoundResult
from weightsync_agent.rounds.remote import AgentClient, AgentError
from weightsync_agent.shared_files import write_shared
from weightsync_agent.sidecar.report import PodReporter
from weightsync_agent.source.agent import SourceAgent
from weightsync_agent.source.replica import ReplicaError
from weightsync_agent.source.writer import SourceConfigError
from weightsync_agent.targets.adapter import AdapterUnavailableError, EngineAdapter
from weightsync_agent.targets.agent import EngineAgent
from weightsync_agent.targets.registry import make_adapter, settings_for
from weightsync_agent.transport.base import Transport, TransportError

#: How many (rank, version) round ids a trainer pod's agent remembers (a rank retries only its latest versions).
HEARD_ROUNDS = 64
#: How long past ``timeoutSeconds`` (from the prepare call) a trainer rank waits on a coordinator that does not answer:
#: a round may end a little past its budget (its last calls each get a floor of time), but not by more than this
#: (the fault matrix holds every round to the budget + 5 s).
COORDINATOR_GRACE_SECONDS = 3.0

log = logging.getLogger("weightsync.agent")

PlanLoader = Callable[[], Plan]


class AgentRuntime:
    def __init__(
        self,
        config: AgentConfig,
        load_plan: PlanLoader,
        directory: Directory,
        *,
        make_transport: Callable[[Plan], Transport],
        replica_root: Callable[[int], Path],
        reporter: PodReporter | None = None,
        engine_url: str | None = None,
        agent_url: str | None = None,
        tick_seconds: float = 2.0,
        call_timeout: float | None = None,
    ) -> None:
        self.config = config
        self.load_plan = load_plan
        self.directory = directory
        self.reporter = reporter
        self.agent_url = agent_url
        self.tick_seconds = tick_seconds
        self.plan = load_plan()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a tick now, not at the next period (stale manifests)
        self.last_round: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        #: Every HTTP call of this agent (to engines, other agents, the coordinator): the plan's
        #: ``timeouts.http_call`` unless a test sets one ("One value, one channel", docs/architecture.md).
        self.call_timeout = self.plan.transfer.timeouts.http_call if call_timeout is None else call_timeout
        self.sources: SourceAgent | None = None
        #: The sync mode that builds this pod's sources (the coordinator keeps its own for rounds).
        self.mode: SyncMode | None = None
        self.coordinator: Coordinator | None = None
        self.engine: EngineAgent | None = None
        self._ready_reported: bool | None = None
        self._coordinator_client: AgentClient | None = None
        #: (rank, version) -> the id of the last round of ``version`` whose result rank ``rank`` was given: a retry of
        #: the version waits for a later round. Bounded: only the latest :data:`HEARD_ROUNDS` are kept.
        self._heard: OrderedDict[tuple[int, int], str | None] = OrderedDict()
        self._heard_lock = threading.Lock()
        #: The group's credential: sent on every call to another agent or an engine, required on every route but
        #: the probes; follows a rotation of the mounted Secret (re-read on each tick and on a 401).
        self.token = Credential.from_sources(config.credentials_dir, config.group_token)
        #: Trainer pods: a pod-local token, accepted from trainer code on /v1/publish and /v1/state only.
        self.trainer_token: str | None = None
        if config.role == "trainer":
            self.trainer_token = new_token()
            for rank in config.ranks:
                write_shared(trainer_token_file(replica_root(rank)), self.trainer_token)  # the trainer reads it
            self.sources = SourceAgent(config.group, config.ranks, lambda: make_transport(self.plan), replica_root)
            self.sources.on_stale = self._wake.set
            if 0 in config.ranks:
                self.coordinator = Coordinator(
                    config.group,
                    self.sources,
                    directory,
                    report=self._report_round,
                    call_timeout=self.call_timeout,
                    host=config.host,
                    token=self.token,
                    recall=self._recall_committed if reporter is not None else None,
                )
        else:
            if engine_url is None:
                raise ValueError("an engine agent needs the engine's URL")
            adapter: EngineAdapter | Refusal | None = self._refusal()
            if adapter is None:
                settings = settings_for(self.plan, config.engine_index or 0, directory, call_timeout=self.call_timeout,
                                        url=engine_url, engine_side=True, token=self.token)  # fmt: skip
                adapter = make_adapter(self.plan.layout.adapter, settings)
            self.engine = EngineAgent(
                config.group,
                engine_url,
                adapter,
                advertise=config.pod_index == 0,
                set_ready=self._set_ready if reporter else None,
                annotate=reporter.annotate if reporter else None,
                committed=self._group_committed,
            )
        metrics.PLAN_REVISION.labels(config.group).set(self.plan.revision)

    def _group_committed(self) -> int | None:
        """The committed version trainer rank 0's coordinator holds (engine pods: whether theirs is behind), telling
        it the version this pod's engine holds (the coordinator learns engine versions from these reports).

        The coordinator's address is looked up once and kept until a call to it fails: a lookup reads a pod from
        the API server, and every engine pod asking every few seconds would be most of the group's idle API load."""
        timeout = min(self.call_timeout, 5.0)
        try:
            if self._coordinator_client is None:
                self._coordinator_client = AgentClient(self.directory.trainer_url(0), timeout=timeout,
                                                       token=self.token)  # fmt: skip
            held = self.engine.held_now if self.engine is not None else None
            engine = self.config.engine_index or 0
            state = self._coordinator_client.state(timeout=timeout, engine=engine, held=held)
        except (AgentError, DirectoryError, HttpCallError) as exc:
            self._coordinator_client = None
            raise LookupError(str(exc)) from exc
        committed = state.get("committed")
        return committed if isinstance(committed, int) and not isinstance(committed, bool) else None

    def _refusal(self) -> Refusal | None:
        """Why this group's engines cannot be synced by their adapter, if they cannot (weightsync.api.engines)."""
        return refusal(self.plan.layout.adapter, self.plan.transfer.request)

    def _fetch_manifest(self, engine: int, rank: int) -> Manifest:
        settings = settings_for(self.plan, engine, self.directory, call_timeout=self.call_timeout, token=self.token)
        return make_adapter(self.plan.layout.adapter, settings).manifest(rank)

    @property
    def round_timeout(self) -> float:
        return self.plan.transfer.timeouts.round_budget

    # --- Background loop ---------------------------------------------------------------------------

    def start(self) -> None:
        advertises = self.sources is not None or (self.engine is not None and self.engine.advertise)
        if self.reporter is not None and self.agent_url and advertises:
            self.reporter.annotate({names.ANNOTATION_AGENT_URL: self.agent_url})
        self.tick()
        self._thread = threading.Thread(target=self._loop, name="weightsync-agent-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.coordinator is not None:
            self.coordinator.close()
        if self.sources is not None:
            self.sources.close()
        if self.reporter is not None:
            self.reporter.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.tick_seconds)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.tick()
            except Exception:  # the loop must survive anything one tick meets
                log.exception("agent tick failed")

    def tick(self) -> None:
        self.token.refresh()  # a stat of the Secret's files: picks up a rotation within a tick of the kubelet's
        self._reload_plan()
        refused = self._refusal() if self.sources is not None else None
        if refused is not None:
            self._set_ready(False, refused.reason, refused.message)
        elif self.sources is not None:
            if not self.sources.built or self.sources.plan is None or self.sources.plan.hash != self.plan.hash:
                self._build_sources()
            elif self.sources.stale:
                log.info("an engine publishes its weights elsewhere than its manifest here: refetching manifests")
                self._build_sources()
            self._set_ready(
                self.sources.built,
                "SourcesBuilt" if self.sources.built else "WaitingForTargets",
                f"plan revision {self.plan.revision} ({self.plan.hash})",
            )
        if self.engine is not None:
            self.engine.check()
        if self.coordinator is not None and self.sources is not None and self.sources.built:
            self.coordinator.settle()  # engines a failed round left paused by a resume that did not answer
            self.coordinator.scrub()  # when due: drifted engines are then repaired by this tick's catch-up
            self.coordinator.catch_up()

    def _reload_plan(self) -> None:
        try:
            plan = self.load_plan()
        except (PlanError, OSError) as exc:
            log.warning("keeping plan revision %d: %s", self.plan.revision, exc)
            return
        if plan.hash != self.plan.hash:
            log.info("plan changed: revision %d (%s) -> %d (%s)", self.plan.revision, self.plan.hash, plan.revision,
                     plan.hash)  # fmt: skip
            self.plan = plan
            metrics.PLAN_REVISION.labels(self.config.group).set(plan.revision)

    def _build_sources(self) -> None:
        assert self.sources is not None
        try:
            self.mode = mode_for(self.mode, self.plan.transfer.mode)
            self.mode.build_sources(self.sources, self.plan, self._fetch_manifest)
        except (
            AdapterUnavailableError,
            DirectoryError,
            HttpCallError,
            ManifestError,
            SourceConfigError,
            ReplicaError,
            TransportError,
        ) as exc:
            log.warning("sources not built yet: %s", exc)

    # --- Reporting ---------------------------------------------------------------------------------

    def _set_ready(self, ready: bool, reason: str, message: str) -> None:
        if self.reporter is None or self._ready_reported == ready:
            return
        self.reporter.set_ready(ready, reason, message)
        self._ready_reported = ready

    def _recall_committed(self) -> int | None:
        """The committed version this pod reported before the agent (re)started, if it reported one."""
        assert self.reporter is not None
        value = self.reporter.annotation(names.ANNOTATION_WEIGHT_VERSION)
        return int(value) if value is not None and value.isdigit() else None

    def _report_round(self, result: RoundResult, committed: int | None) -> None:
        self.last_round = result.as_status()  # also in state(): a local group has no pod to carry it
        if self.reporter is None:
            return
        values: dict[str, str | dict[str, Any] | int | None] = {names.ANNOTATION_LAST_ROUND: result.as_status()}
        if committed is not None:
            values[names.ANNOTATION_WEIGHT_VERSION] = committed
        self.reporter.annotate(values)

    # --- Trainer process requests ------------------------------------------------------------------

    def sources_or_fail(self) -> SourceAgent:
        if self.sources is None:
            raise LookupError("this agent runs no trainer ranks")
        return self.sources

    def publish(self, rank: int, version: int, timeout: float, canary: Canary | None = None) -> RoundResult:
        """Trainer rank ``rank`` staged ``version``: rank 0 runs the round (gated on ``canary`` when given); the
        others wait for it."""
        if canary is not None and rank != 0:
            raise ValueError(f"a canary goes with trainer rank 0's publish (the coordinator's), not rank {rank}'s")
        sources = self.sources_or_fail()
        since = time.monotonic()
        sources.mark_ready(rank, version)
        committed = False
        try:
            if self.coordinator is not None and rank == 0:
                result = self.coordinator.run_round(version, canary)
            else:
                with self._heard_lock:
                    seen = self._heard.get((rank, version))
                result = self._wait_for_round(version, timeout, seen=seen, taking_part=(rank, since))
                with self._heard_lock:
                    self._heard[(rank, version)] = result.round_id
                    self._heard.move_to_end((rank, version))
                    while len(self._heard) > HEARD_ROUNDS:
                        self._heard.popitem(last=False)
            committed = result.committed
            return result
        finally:
            if not committed:  # the trainer's call ends here: what it staged is offered again only by its next publish
                sources.withdraw(rank, version)

    def _wait_for_round(
        self, version: int, timeout: float, *, seen: str | None, taking_part: tuple[int, float]
    ) -> RoundResult:
        """The coordinator's result of round ``version`` for a rank that published it (``taking_part``: the rank and
        when it published). Once a round asked the rank's source to prepare, the wait is bounded by that round's
        budget as well: a coordinator that stops answering past it (killed, or its pod gone) ran a round nobody will
        finish, and one that answers but did not run it (restarted since) says so at once."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LookupError(f"no result for round {version} within {timeout:.0f} s from the coordinator")
            if self.coordinator is not None:
                result = self.coordinator.wait(version, left, seen=seen)
            else:
                taken = self.sources_or_fail().taken_part(taking_part[0], version, taking_part[1])
                poll = min(left, 30.0)
                if taken is not None:  # ask again by the round's end, when a coordinator that does not answer is gone
                    poll = min(poll, max(1.0, taken[1] + self._round_budget() - time.monotonic()))
                url = None
                try:
                    url = self.directory.trainer_url(0)
                    coordinator = AgentClient(url, timeout=self.call_timeout, token=self.token)
                    result = coordinator.round(version, poll, seen=seen, round_id=None if taken is None else taken[0])
                except (AgentError, DirectoryError) as exc:
                    if taken is not None and time.monotonic() >= taken[1] + self._round_budget():
                        return self._coordinator_gone(version, taken[0], url, exc)
                    log.warning("waiting for round %d: %s", version, exc)
                    time.sleep(min(1.0, max(left, 0.0)))
                    continue
            if result is not None:
                return result

    def _round_budget(self) -> float:
        """How long after a round asked a source to prepare its coordinator must have ended it: the plan's
        ``timeoutSeconds``, plus :data:`COORDINATOR_GRACE_SECONDS` for the calls a round may make past it."""
        return self.plan.transfer.timeout_seconds + COORDINATOR_GRACE_SECONDS

    def _coordinator_gone(self, version: int, round_id: str, url: str | None, error: Exception) -> RoundResult:
        where = f" at {url}" if url else ""
        reason = (
            f"trainer rank 0's agent (the coordinator{where}) stopped answering during round {round_id} of version "
            f"{version} and has not answered by the end of the round's budget "
            f"({self.plan.transfer.timeout_seconds:g} s): {error}. Whether the engines committed it is not known "
            "here: the coordinator that starts next learns it from the engines"
        )
        log.warning("round %d: %s", version, reason)
        return RoundResult.not_run(version, reason, round_id)

    def state(self) -> dict[str, object]:
        return {
            "group": self.config.group,
            "role": self.config.role,
            "podIndex": self.config.pod_index,
            "ranks": list(self.config.ranks),
            "plan": {"revision": self.plan.revision, "hash": self.plan.hash},
            "coordinator": self.coordinator is not None,
            "committed": None if self.coordinator is None else self.coordinator.committed,
            #: The last round as the coordinator's pod shows it (a catch-up's, or one re-reported once its engines
            #: serve again), None before the first round or on other agents.
            "lastRound": self.last_round,
            "sources": None if self.sources is None else self.sources.state(),
            "engine": None
            if self.engine is None
            else {"ready": self.engine.state.ready, "version": self.engine.state.version},
        }
