"""The coordinator: trainer rank 0's agent runs every sync round of the group.

A regular round starts when trainer rank 0 publishes a version: the coordinator builds a
:class:`~weightsync_agent.rounds.driver.RoundDriver` over every engine's HTTP API and every trainer rank (its
own ranks in this process, the others through their agents), runs it, and on success tells every
source the version is committed. The result goes on the coordinator's own pod (the operator folds it
into the group's ``status.lastSync``) and into its metrics.

A catch-up round brings engines that hold another version than the last committed one (a joining
engine, one that was restarted) to that version from the replicas, covering only them: the other
engines are neither paused nor touched.

Every round gets a fresh id (:func:`~weightsync_agent.rounds.driver.new_round_id`), carried by every message
of the round to sources and engines; a call naming another round is refused there (docs/agent.md, "Round ids").

Which engines are behind is *learnt*, not polled (docs/agent.md, "Engine versions"): the coordinator knows what
every round it ran committed where, so it asks an engine for its version only when it has reason to think the
engine is behind: an engine it never heard from (its start, a scale-out), one whose last round failed, one whose
pod agent reported another version than the one the coordinator believes (:meth:`Coordinator.heard`: engine
agents report on the call they already make for the committed version), and, as a safety net for engines run
without an agent or a report that was lost, one engine per tick in turn (:data:`SWEEP_PER_TICK`). So the engines'
load is bounded by a constant, not engines x ticks.

The committed version is kept in memory, so a coordinator that starts (trainer rank 0's agent restarted) learns
it from the engines before its first round: the newest integer version any engine holds (an engine changes its
version only on a verified commit, so that version was committed; versions never go back below it). Engines
that hold less are behind: a catch-up brings them up when the replicas still hold it, else the next round
writes every engine. Until every engine answered, no round starts. What the coordinator's pod reported before
(its weight-version annotation, when it runs in a cluster) is a floor: if every engine restarted as well, the
version still does not go back.

A version is adopted only within ``transfer.maxVersionStep`` of the committed one (:mod:`.versions`): one huge
version must not lock the group out of every later one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Mapping

from weightsync.api import names
from weightsync.api.engines import refusal
from weightsync.api.timeouts import HTTP_CALL_SECONDS
from weightsync.plan import Plan
from weightsync.plan.document import Target
from weightsync_agent import metrics
from weightsync_agent.directory import Directory, DirectoryError
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.http.credential import ApiKey
from weightsync_agent.layout.manifest import ManifestError
from weightsync_agent.modes.base import SyncMode
from weightsync_agent.modes.registry import mode_for
from weightsync_agent.rounds.canary import Canary
from weightsync_agent.rounds.driver import RoundDriver, RoundError, RoundResult, new_round_id
from weightsync_agent.rounds.left_rounds import close_left_rounds
from weightsync_agent.rounds.remote import AgentClient, AgentError, HttpSourceControl
from weightsync_agent.rounds.versions import credible_floor, version_refusal
from weightsync_agent.source.agent import SourceAgent
from weightsync_agent.source.control import RoundScope, SourceControl
from weightsync_agent.source.report import SourceReport
from weightsync_agent.source.writer import SourceConfigError
from weightsync_agent.targets.adapter import AdapterUnavailableError, EngineAdapter, ScrubbedEngine
from weightsync_agent.targets.registry import make_adapter, settings_for
from weightsync_agent.transport.base import TransportError

log = logging.getLogger("weightsync.agent.coordinator")

Reporter = Callable[[RoundResult, int | None], None]  # (round, committed version)
Recall = Callable[[], int | None]  # the committed version this coordinator's pod last reported, if any

#: Results of the last this many regular rounds are kept for ``GET /v1/rounds/{v}`` (trainer ranks that wait
#: for the round their rank 0 runs ask within seconds); older ones are forgotten, so a training run of a million
#: rounds holds 64 results, not a million.
HISTORY = 64
#: How long a trainer rank's ask waits for a retry of its version before a failed round that finished before the ask
#: is its answer (``Coordinator.wait``): every rank asks at about the same time, rank 0's among them.
RETRY_GRACE_SECONDS = 5.0

#: Engines asked for their version per catch-up tick although nothing says they are behind (in turn, so each is
#: asked every ``engines / SWEEP_PER_TICK`` ticks): catches an engine restarted with no agent to report it.
SWEEP_PER_TICK = 1

#: Round ids this coordinator remembers having run (every round, refusals and catch-ups too): a rank asks about one
#: within a round's budget of its start, so the last few hundred are plenty.
RAN_ROUNDS_KEPT = 256

#: The timeout of each resume :meth:`Coordinator.settle` sends between rounds (a tick's work must stay short).
SETTLE_CALL_SECONDS = 2.0

#: Why a round could not even start (nothing was paused or written).
NOT_STARTED = (
    AdapterUnavailableError,
    DirectoryError,
    LookupError,
    RoundError,
    SourceConfigError,
    TransportError,
)


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
        token: ApiKey = None,
        recall: Recall | None = None,
    ) -> None:
        """``recall``: the committed version the coordinator's pod reported before a restart (its
        ``weightsync.io/weight-version`` annotation), a floor under what the engines say (they may all have
        restarted too)."""
        self.group = group
        self.recall = recall
        #: The group's credential, sent to every agent and engine of a round.
        self.token = token
        self.own_sources = own_sources
        self.directory = directory
        self.report = report
        self.call_timeout = call_timeout
        self.retries = retries
        self.host = host
        self.committed: int | None = None
        self.finished: OrderedDict[int, RoundResult] = OrderedDict()  # the last HISTORY regular rounds
        #: Called (from the round's thread) after every round: the HTTP routes wake their long polls with it.
        self.on_finish: list[Callable[[], None]] = []
        #: Whether ``committed`` was learnt from the engines (a fresh coordinator knows nothing until it asked).
        self.recovered = False
        self.mode: SyncMode | None = None
        self._agents: dict[int, AgentClient] = {}  # trainer pod -> its agent, for the round in progress
        #: The version each engine holds as far as this coordinator knows (what it last answered, or what the last
        #: round covering it committed); engines in ``_suspects`` are asked on the next catch-up tick.
        self._held: dict[int, str | None] = {}
        self._suspects: set[int] = set()
        self._sweep = 0
        #: The canary of the committed version (None: it had none): a catch-up to it passes the same gate.
        self._canary: Canary | None = None
        #: Engine version asks (``held_version`` calls) since start: what catching up costs the engines.
        self.asked = 0
        #: Held by each round. The agent tick's work between rounds (settle, scrub, catch-up) takes it only when free
        #: (:meth:`_between_rounds`).
        self._round = threading.Lock()
        #: The version of the regular round in progress (None: none), and when each kept result finished (this
        #: process's clock): what tells a rank's ask that a retry of its version is coming.
        self._running: int | None = None
        self._finished_at: dict[int, float] = {}
        self._cond = threading.Condition()
        #: Scrubbing (``transfer.scrubSeconds``): what each target verified for the committed version, the engines a
        #: scrub found drifted (engine -> what differs) until a round repairs them, and when the next scrub is due.
        self._committed_sums: dict[Target, tuple[str, ...]] = {}
        self._drifted: dict[int, str] = {}
        #: Drifted engines whose repair could not start yet, already reported (the catch-up retries every tick).
        self._drift_reported: set[int] = set()
        self._next_scrub = 0.0
        #: The last round that touched engines, if it meant to leave some of them serving whose resume did not answer
        #: in time, with the plan it ran under: :meth:`settle` resumes them between rounds.
        self._unresumed: tuple[RoundResult, str] | None = None
        #: The ids of the rounds this coordinator ran (the last :data:`RAN_ROUNDS_KEPT`): a rank that asks about a round
        #: of another id took part in a round of a predecessor (:meth:`ended_elsewhere`).
        self._ran: deque[str] = deque(maxlen=RAN_ROUNDS_KEPT)
        #: Rounds a predecessor left on the engines, closed at this coordinator's start (round id -> the report).
        self._left: dict[str, RoundResult] = {}

    # --- Rounds ----------------------------------------------------------------------------------

    def run_round(self, version: int, canary: Canary | None = None) -> RoundResult:
        """Sync ``version`` to every engine (trainer rank 0 calls this through its publish); ``canary``: the
        semantic gate's, kept for the catch-ups of that version."""
        with self._round:
            with self._cond:
                self._running = version
            try:
                return self._run_round(version, canary)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _run_round(self, version: int, canary: Canary | None) -> RoundResult:
        """:meth:`run_round`'s round, under its lock."""
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
        unknown = self._recover(plan)
        if unknown is not None:
            return self._finish(self._refused(version, unknown), "regular")
        # The committed version is known now (learnt from the engines if this coordinator just started).
        refused_version = version_refusal(version, self.committed, plan.transfer.max_version_step)
        if refused_version is not None:
            return self._finish(self._refused(version, refused_version), "regular")
        mode = self._mode_for(plan)
        self._agents = {}
        round_id = self._mint()
        try:
            engines = self.engines(plan, range(plan.layout.engines))
            scope = RoundScope.of(plan.hash, round_id=round_id)
            sources = mode.round_sources(self, plan, engines, scope)
            driver = self._driver(mode.round_plan(plan), engines, sources, None)
        except NOT_STARTED as exc:
            return self._finish(self._refused(version, str(exc)), "regular")
        try:
            result = driver.run(version, round_id, canary)
        finally:
            driver.close()
        if result.committed:  # also a round whose resume failed: every engine holds v
            self.committed = version
            self._canary = canary
            self._committed_sums = dict(driver.verified)
            self._drifted.clear()  # every engine was written and verified again
            self._drift_reported.clear()
            mode.committed(self, plan, version)
            self._learnt(range(plan.layout.engines), str(version))
        else:
            mode.failed()
            self._doubt(range(plan.layout.engines))
        return self._finish(result, "regular")

    @contextlib.contextmanager
    def _between_rounds(self) -> Iterator[bool]:
        """The round lock for the agent tick's work, if no round holds it (whether it does). The tick never queues
        behind a round: a round's prepare may be waiting for this very tick to refetch the manifests of an engine
        that restarted (``SourceAgent._refetched``), and a tick waiting for that round would leave it waiting out
        its refetch and failing (CI saw the round fail after 5 s)."""
        if not self._round.acquire(blocking=False):
            yield False
            return
        try:
            yield True
        finally:
            self._round.release()

    def catch_up(self) -> RoundResult | None:
        """Bring engines that answer with another version than the committed one up to it (between rounds: while a
        round runs, nothing; the next tick looks again)."""
        with self._between_rounds() as free:
            if not free:
                return None
            if self._recover(self.own_sources.plan) is not None:
                return None
            plan, version = self.own_sources.plan, self.committed
            if plan is None or version is None:
                return None
            mode = self._mode_for(plan)
            if not mode.catch_up:
                return None
            lagging = [e for e in self._to_ask(plan) if e in self._drifted or self._lags(plan, e, version)]
            if not lagging:
                return None
            drifted = {e: self._drifted[e] for e in lagging if e in self._drifted}
            log.info("engines %s do not hold committed version %d: catching them up", lagging, version)
            self._agents = {}
            round_id = self._mint()
            try:
                engines = self.engines(plan, lagging)
                scope = RoundScope.of(plan.hash, lagging, catch_up=True, round_id=round_id)
                sources = mode.round_sources(self, plan, engines, scope)
                driver = self._driver(mode.round_plan(plan), engines, sources, lagging)
            except NOT_STARTED as exc:
                log.warning("catch-up of engines %s not possible yet: %s", lagging, exc)
                return None
            try:
                result = driver.run(version, round_id, self._canary)  # the committed version's canary
            finally:
                driver.close()
            if not result.started:
                # A source cannot serve it (its replica holds no committed version yet, or the trainer has begun
                # staging the next one): nothing was paused; joiners get the next round.
                log.warning("catch-up of engines %s not possible yet: %s", lagging, result.reason)
                if set(drifted) - self._drift_reported:  # said once per drift: the status must not show them as fine
                    self._drift_reported.update(drifted)
                    return self._finish(dataclasses.replace(result, reason=f"{drift_reason(version, drifted)}; not "
                                                            f"repaired yet: {result.reason}"), "catch-up")  # fmt: skip
                return None
            if result.result == "Succeeded":
                self._learnt(lagging, str(version))
                self._committed_sums.update(driver.verified)
                for engine in drifted:
                    del self._drifted[engine]
                    self._drift_reported.discard(engine)
                if drifted:
                    result = dataclasses.replace(result, reason=f"{drift_reason(version, drifted)}; repaired")
            else:
                self._doubt(lagging)
                reason = f"catch-up of engines {lagging}: {result.reason}"
                if drifted:
                    reason = f"{drift_reason(version, drifted)}; repair failed: {reason}"
                result = dataclasses.replace(result, reason=reason)
            return self._finish(result, "catch-up")

    def settle(self) -> list[int]:
        """Resume, between rounds, the engines the last round meant to leave serving whose resume did not answer in
        time (an engine hung through the round's end, then back: it may have run the late calls or not), naming that
        round; once every one answered, report the round again without ``enginesPaused``, so the status stops
        saying engines are paused when they serve. An engine that refuses (its weights are not known clean) stays
        paused, as reported. Returns the engines resumed now (none while a round runs: the next tick settles)."""
        with self._between_rounds() as free:
            if not free:
                return []
            pending, plan = self._unresumed, self.own_sources.plan
            if pending is None or plan is None:
                return []
            result, plan_hash = pending
            if plan.hash != plan_hash or result.round_id is None:  # replanned: the next round settles every engine
                self._unresumed = None
                return []
            left: list[int] = []
            resumed: list[int] = []
            refused: list[int] = []
            try:
                engines = self.engines(plan, [e for e in result.unresumed if e < plan.layout.engines])
            except NOT_STARTED as exc:  # the tick's scrub and catch-up must still run: try again next tick
                log.info("engines %s not resumed yet: %s", list(result.unresumed), exc)
                return []
            for index, engine in engines.items():
                try:
                    engine.resume(SETTLE_CALL_SECONDS, round_id=result.round_id)
                except (RoundError, HttpCallError) as exc:
                    unanswered = isinstance(exc, HttpCallError) and (exc.status is None or exc.status >= 500)
                    (left if unanswered else refused).append(index)
                    log.info("engine %d still not resumed after round v%d: %s", index, result.version, exc)
                else:
                    resumed.append(index)
            if left:
                self._unresumed = (dataclasses.replace(result, unresumed=tuple(left)), plan_hash)
                return resumed
            self._unresumed = None
            if refused:  # they stay paused, and the status keeps saying so
                return resumed
            log.info("engines %s serve again after round v%d", resumed, result.version)
            if self.report is not None:
                said = f"{result.reason}; engines {resumed} serve again" if result.reason else None
                try:
                    self.report(dataclasses.replace(result, engines_paused=False, reason=said, unresumed=()),
                                self.committed)  # fmt: skip
                except Exception as exc:  # as in _finish: the next report retries
                    log.warning("could not report round v%d on the pod: %s", result.version, exc)
            return resumed

    def scrub(self) -> dict[int, str]:
        """Scrubbing, every ``transfer.scrubSeconds`` between rounds: each engine's own checker hashes the weights it
        serves, against what verified the committed version there. Drifted engines (engine -> what differs) are
        repaired by the next catch-up (the sidecar's tick runs one right after) without a new version."""
        plan, version = self.own_sources.plan, self.committed
        if plan is None or version is None or not plan.transfer.scrub_seconds:
            return {}
        now = time.monotonic()
        if now < self._next_scrub:
            return {}
        self._next_scrub = now + plan.transfer.scrub_seconds
        found: dict[int, str] = {}
        for (engine, rank), checksums in sorted(self._committed_sums.items()):
            if engine >= plan.layout.engines or engine in self._drifted or engine in found:
                continue
            # One rank at a time under the round lock: never while a round writes, and a round that is due waits
            # for one checker call at most, not for the whole pass. A round running now ends the pass: it writes and
            # verifies every engine; the next tick starts a pass again.
            with self._between_rounds() as free:
                if not free:
                    self._next_scrub = time.monotonic()
                    break
                if self.committed != version or (engine, rank) not in self._committed_sums:
                    break  # a round committed meanwhile: its checksums are the next pass's
                try:
                    adapter = self._adapter(plan, engine)
                    if not isinstance(adapter, ScrubbedEngine):
                        continue
                    began = time.monotonic()
                    verdict = adapter.scrub(rank, version, checksums, self.call_timeout)
                    metrics.SCRUB_SECONDS.labels(self.group).observe(time.monotonic() - began)
                except (DirectoryError, HttpCallError, AdapterUnavailableError, ManifestError) as exc:
                    log.warning("scrub of engine %d rank %d skipped: %s", engine, rank, exc)
                    continue
                metrics.SCRUBS.labels(self.group, "drift" if not verdict.ok else "clean").inc()
                if not verdict.ok:
                    found[engine] = f"engine {engine} rank {rank}: {verdict.error or 'its weights differ'}"
                    with self._cond:
                        self._drifted[engine] = found[engine]
        if found:
            log.warning("scrub: %s", drift_reason(version, found))
            self._doubt(found)
        return found

    def heard(self, engine: int, held: str | None) -> None:
        """An engine's pod agent reports the version its engine holds (a hint: it is asked before a catch-up)."""
        with self._cond:
            if engine not in self._held or self._held[engine] != held:
                self._suspects.add(engine)

    def wait(
        self, version: int, timeout: float, *, seen: str | None = None, asked_at: float | None = None
    ) -> RoundResult | None:
        """The result of round ``version`` for a trainer rank that asks now, waiting up to ``timeout``; ``seen``: the
        id of a round of ``version`` the rank heard about already (a failed round it retries), which is no answer;
        ``asked_at`` (``time.time()`` here, when the ask arrived; default now).

        A failed round that finished before the ask is the answer only if no round of ``version`` runs or starts
        within :data:`RETRY_GRACE_SECONDS` of it: rank 0's round can fail before another rank even staged (a refusal
        waits for no rank), and then that failure is the rank's answer; but when every rank retries a failed
        version, rank 0's new round may start just after another rank asked, and that round is the answer."""
        asked_at = time.time() if asked_at is None else asked_at
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                done = self.finished.get(version)
                if done is not None and (done.round_id != seen or self._final_refusal(version, done)):
                    fresh = self._finished_at.get(version, 0.0) >= asked_at
                    settled = done.committed or self._final_refusal(version, done)
                    idle = self._running != version and time.time() >= asked_at + RETRY_GRACE_SECONDS
                    if fresh or settled or idle:
                        return done
                left = end - time.monotonic()
                if left <= 0:
                    return None
                grace = asked_at + RETRY_GRACE_SECONDS - time.time()
                self._cond.wait(min(left, grace) if grace > 0 else left)

    def _final_refusal(self, version: int, result: RoundResult) -> bool:
        """A refused round of a version the committed one refuses (not newer, or too far ahead) is final: no round of
        it runs now, so a rank that heard it already and asks again gets it again instead of waiting out its timeout."""
        if result.started:
            return False
        if self.committed is not None and version <= self.committed:
            return True
        plan = self.own_sources.plan
        if not self.recovered or plan is None:
            return False
        return version_refusal(version, self.committed, plan.transfer.max_version_step) is not None

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
            pause_policy=transfer.pause,
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

    def _recover(self, plan: Plan | None) -> str | None:
        """Learn the committed version from the engines once, before this coordinator's first round; why it cannot
        yet (an engine that does not answer might hold a newer version than the others), else None."""
        if self.recovered or plan is None:
            return None
        held: dict[int, str | None] = {}
        adapters: dict[int, EngineAdapter] = {}
        for engine in range(plan.layout.engines):
            try:
                adapters[engine] = self._adapter(plan, engine)
                held[engine] = adapters[engine].held_version(timeout=min(self.call_timeout, 5.0))
            except (DirectoryError, HttpCallError, AdapterUnavailableError) as exc:
                return (
                    f"this coordinator has not learnt the committed version yet (it asks every engine what it holds "
                    f"once, at its start) and engine {engine} did not answer: {exc}"
                )
        self.asked += len(held)
        with self._cond:
            self._held.update(held)
        versions = {e: int(v) for e, v in held.items() if v is not None and v.isdigit()}
        newest_held = max(versions.values(), default=None)
        floor = self._recalled()
        if floor is not None and not credible_floor(floor, newest_held, plan.transfer.max_version_step):
            log.warning(
                "ignoring the committed version %d this coordinator's pod reported: it is more than "
                "transfer.maxVersionStep (%d) past the newest version any engine holds (%d)",
                floor,
                plan.transfer.max_version_step,
                newest_held,
            )
            floor = None
        newest = max([*versions.values(), *([] if floor is None else [floor])], default=None)
        if newest is not None and (self.committed is None or newest > self.committed):
            self.committed = newest
        self.recovered = True
        behind = sorted(e for e in held if versions.get(e) != self.committed)
        self._doubt(behind)
        log.info(
            "committed version %s (learnt from the engines, which hold %s)%s",
            self.committed,
            {e: held[e] for e in sorted(held)},
            f"; engines {behind} are behind and are caught up" if behind and self.committed is not None else "",
        )
        if self.committed is not None:
            metrics.WEIGHT_VERSION.labels(self.group).set(self.committed)
        self._close_left_rounds(adapters)
        return None

    def _close_left_rounds(self, engines: Mapping[int, EngineAdapter]) -> None:
        """End what a predecessor left open or paused on ``engines`` (adapters: :mod:`.left_rounds`), and report it."""
        closed = close_left_rounds(engines, self._ran, min(self.call_timeout, 5.0))
        report = closed.report(self.committed)
        if report is None or report.round_id is None:
            return
        self._left[report.round_id] = report
        self._doubt(closed.left)  # what they hold now is asked again: a catch-up brings up those that serve behind
        # A round that only paused them has no version of its own: its report must not stand as another's answer.
        self._finish(report, "regular", answers=any(left.version is not None for left in closed.left.values()))

    def _recalled(self) -> int | None:
        if self.recall is None:
            return None
        try:
            return self.recall()
        except Exception as exc:  # the engines remain the authority; the pod's word is only a floor
            log.warning("could not read the committed version this coordinator's pod reported: %s", exc)
            return None

    def _to_ask(self, plan: Plan) -> list[int]:
        """The engines to ask this tick: never heard from, suspected behind, and the next in turn."""
        engines = plan.layout.engines
        with self._cond:
            for gone in [e for e in self._held if e >= engines]:  # scaled in
                del self._held[gone]
            self._suspects = {e for e in self._suspects if e < engines}
            ask = {e for e in range(engines) if e not in self._held} | self._suspects
            for _ in range(min(SWEEP_PER_TICK, engines)):
                self._sweep = (self._sweep + 1) % engines
                ask.add(self._sweep)
        return sorted(ask)

    def _learnt(self, engines: Collection[int], held: str | None) -> None:
        with self._cond:
            for engine in engines:
                self._held[engine] = held
                self._suspects.discard(engine)

    def _doubt(self, engines: Collection[int]) -> None:
        with self._cond:
            self._suspects.update(engines)

    def _lags(self, plan: Plan, engine: int, version: int) -> bool:
        self.asked += 1
        try:
            held = self._adapter(plan, engine).held_version(timeout=min(self.call_timeout, 5.0))
        except (DirectoryError, HttpCallError, AdapterUnavailableError):
            self._doubt([engine])  # not up yet: asked again next tick, caught up once it answers
            return False
        self._learnt([engine], held)
        if held != str(version):
            self._doubt([engine])  # stays suspect until a catch-up lands on it
            return True
        return False

    def _mint(self) -> str:
        round_id = new_round_id()
        self._ran.append(round_id)
        return round_id

    def ended_elsewhere(self, version: int, round_id: str) -> RoundResult | None:
        """The answer for a trainer rank that took part in round ``round_id`` of ``version`` and asks for its result,
        when this coordinator did not run that round: its predecessor did and is gone (trainer rank 0's agent
        restarted during it), so nothing will ever finish it. None: a round of this coordinator's (the rank waits for
        it as usual), or this coordinator has not learnt the committed version from the engines yet (ask again)."""
        if round_id in self._ran or not self.recovered:
            return None
        left = self._left.get(round_id)
        # The engines are the authority on what committed: a coordinator killed after every commit but before its
        # report leaves them holding the version, and this coordinator learnt it from them.
        committed = self.committed == version
        if left is not None and left.reason and not committed:
            reason = left.reason
        else:
            reason = (
                f"round {round_id} of version {version} ended with its coordinator (trainer rank 0's agent stopped "
                "during it and was restarted): "
                + (f"every engine holds version {version} committed (learnt from the engines at this start)"
                   if committed else "it did not commit")
            )  # fmt: skip
        return RoundResult.not_run(version, reason, round_id, committed=committed,
                                   engines_paused=left is not None and left.engines_paused)  # fmt: skip

    def _refused(self, version: int, reason: str) -> RoundResult:
        # A fresh id: a rank waiting on the version tells this answer from a retry's.
        return RoundResult.not_run(version, f"round not started: {reason}", self._mint())

    def _finish(self, result: RoundResult, kind: str, *, answers: bool = True) -> RoundResult:
        """Count, log and report ``result``; a regular round's is also the answer ranks that wait on its version get
        (``answers``: unless it is not that version's round at all)."""
        metrics.ROUNDS.labels(self.group, kind, result.result).inc()
        metrics.ROUND_SECONDS.labels(self.group, kind).observe(result.duration_seconds)
        for phase, seconds in result.phases.items():
            metrics.ROUND_PHASE_SECONDS.labels(self.group, kind, phase).observe(seconds)
        if result.paused_seconds is not None:
            metrics.ROUND_PAUSED_SECONDS.labels(self.group, kind).observe(result.paused_seconds)
        for role, slowest in (("source", result.slowest_source), ("target", result.slowest_target)):
            if slowest is not None:
                metrics.ROUND_SLOWEST_SECONDS.labels(self.group, role).set(slowest[1].seconds)
        if kind == "regular" and (result.sources or result.targets):
            peers = [("source", f"source {s}", stat) for s, stat in result.sources.items()]
            peers += [("target", f"engine {e} rank {r}", stat) for (e, r), stat in result.targets.items()]
            for gauge in (metrics.ROUND_PEER_SECONDS, metrics.ROUND_PEER_BYTES):
                gauge.clear()  # peers a replan removed go away
            for role, peer, stat in peers:
                metrics.ROUND_PEER_SECONDS.labels(self.group, role, peer).set(stat.seconds)
                metrics.ROUND_PEER_BYTES.labels(self.group, role, peer).set(stat.bytes)
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
        if result.unresumed and self.own_sources.plan is not None:
            self._unresumed = (result, self.own_sources.plan.hash)
        elif result.started:  # a round that reached the engines again settles them itself
            self._unresumed = None
        with self._cond:
            if kind == "regular" and answers:
                self.finished[result.version] = result
                self._finished_at[result.version] = time.time()
                self.finished.move_to_end(result.version)
                while len(self.finished) > HISTORY:
                    gone, _ = self.finished.popitem(last=False)
                    self._finished_at.pop(gone, None)
            self._cond.notify_all()
        for hook in list(self.on_finish):
            hook()
        if self.report is not None:
            try:
                self.report(result, self.committed)
            except Exception as exc:  # reporting must not undo a round; the next report retries
                log.warning("could not report round v%d on the pod: %s", result.version, exc)
        return result


def drift_reason(version: int, drifted: Mapping[int, str]) -> str:
    """What a round's status says of engines a scrub found drifted (the operator's ``WeightsDrifted`` event)."""
    return f"{names.DRIFT_FOUND} in committed version {version}: {'; '.join(drifted[e] for e in sorted(drifted))}"
