"""A sync round, as the coordinator (trainer rank 0's agent) runs it.

    (live: pause engines) -> begin v -> every source writes its targets -> targets verify -> commit v
    -> (live: resume)

With a canary (the semantic gate, ``rounds/canary.py``; engines whose adapter gates the round's staging: SGLang
and vLLM live, vLLM staged, the reference engine), the commit is split around it:

    ... -> targets verify -> apply v (no label) -> resume -> every engine scores the canary -> label v

The invariant: **no engine reports version v unless it fully holds verified v.** Engines commit only
after their own verification passed, and a target's commit is what changes the version it reports. Any
failure or timeout aborts the round with a reason that names the peer and the bucket:

- ``targetStaging: live`` — sources wrote into the engines' live weights, so the engines stay paused and
  the round is retried from the replicas (which still hold v) up to ``retries`` times;
- ``targetStaging: staged`` — sources write into a staging area while the engines keep serving v-1 (no
  pause); on failure the engines abort the staging area and simply go on serving v-1.

The driver does no I/O itself: it talks to engines and sources through the two small interfaces below,
so the same logic runs against HTTP agents, in-process objects, or test fakes. Every call gets a
deadline; calls run concurrently, so one slow peer costs time, never a hang.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from weightsync.api.engines import Staging
from weightsync.api.pause import PausePolicy, round_schedule
from weightsync.api.timeouts import HTTP_CALL_SECONDS
from weightsync.plan import Plan, Target
from weightsync_agent.rounds.canary import Canary, gaps, judge
from weightsync_agent.source.control import SourceControl
from weightsync_agent.source.report import SourceReport, Throughput
from weightsync_agent.targets.adapter import ClosesAtVerify, EngineRound, GatedRound, HealthProbe, TargetVerdict

T = TypeVar("T")

#: The least an engine control call gets, even past the round's deadline: a round that wrote and verified can still
#: commit and resume, and a failed one abort and resume, within the 5 s over its budget a round may take.
CALL_FLOOR_SECONDS = 1.0
#: How long a source the round's deadline caught writing is waited for still: its own stall detection (the
#: transport's, from its write's start) fires just after the deadline and names the engine that stopped taking writes.
SOURCE_GRACE_SECONDS = 2.0

#: A round's phases, in the order they run (``pause`` and ``resume`` only in live rounds, ``gate`` only with a
#: canary, where it runs after the resume and before the label, which adds to ``commit``).
PHASES = ("prepare", "pause", "begin", "write", "verify", "commit", "resume", "gate")


class RoundError(RuntimeError):
    """A step failed; ``peer`` and ``bucket`` say where, when known."""

    def __init__(self, message: str, *, peer: str | None = None, bucket: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.bucket = bucket


class GateError(RoundError):
    """The semantic gate failed, or a step after the gate's resume did: not retried (writing the same bytes again
    reads the same way, and the engines served meanwhile); the engines are paused again, their label unmoved."""


@dataclass(frozen=True)
class RoundResult:
    """Shaped like the group's ``status.lastSync`` (the coordinator writes it on its own pod)."""

    version: int
    result: Literal["Succeeded", "Failed", "Aborted"]
    started_at: str
    duration_seconds: float
    bytes: int
    gbps: float
    attempts: int
    reason: str | None = None
    engines_paused: bool = False
    #: The id the coordinator minted for the round; every message of the round carries it.
    round_id: str | None = None
    #: Every engine committed ``version`` (true for Succeeded; also for a round whose resume then failed,
    #: which is Failed, since an engine does not serve, but still moves the committed version).
    committed: bool = False
    #: Seconds spent in each phase that ran (:data:`PHASES`; a live round's retries add up in write, verify, commit).
    phases: Mapping[str, float] = field(default_factory=dict)
    #: How long the round kept engines from serving: a live round from its pause to the end of its resume (to the
    #: end of the round if they stay paused); a staged round its commit, the most an engine that applies staged
    #: weights inside a pause (vLLM) can have been paused; None for a round that never reached an engine.
    paused_seconds: float | None = None
    #: What each source wrote in the last attempt that finished writing, and what each target received (bytes
    #: summed over its sources, seconds until its last source finished it).
    sources: Mapping[int, Throughput] = field(default_factory=dict)
    targets: Mapping[Target, Throughput] = field(default_factory=dict)
    #: A round whose semantic gate passed: the largest difference any engine showed between its logprob of a canary
    #: token and the trainer's (nats; within the canary's tolerance, else the round failed). None: no gate passed.
    gate_gap: float | None = None
    #: When the round paused its engines (``weightsync.api.pause``): ``overlap`` only for a live round of a version a
    #: source streamed under ``transfer.pause: overlap`` (paused from its first write on, through the staging);
    #: ``minimal`` otherwise (for the writes only; staged rounds, to apply). None: a round that never reached an engine.
    pause_policy: PausePolicy | None = None
    #: Engines this round meant to leave serving whose resume did not answer in time (hung, or slow to answer): the
    #: coordinator resumes them again between rounds and says so once they serve. Not reported on the wire.
    unresumed: tuple[int, ...] = ()

    @classmethod
    def not_run(
        cls,
        version: int,
        reason: str,
        round_id: str,
        *,
        committed: bool = False,
        engines_paused: bool = False,
    ) -> RoundResult:
        """A failed round that no driver here ran: refused before it started, or one that ended elsewhere (with a
        coordinator that is gone), as this process can tell it."""
        return cls(
            version=version,
            result="Failed",
            started_at=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            duration_seconds=0.0,
            bytes=0,
            gbps=0.0,
            attempts=0,
            reason=reason,
            engines_paused=engines_paused,
            round_id=round_id,
            committed=committed,
        )

    @property
    def slowest_source(self) -> tuple[int, Throughput] | None:
        return max(self.sources.items(), key=lambda item: item[1].seconds, default=None)

    @property
    def slowest_target(self) -> tuple[Target, Throughput] | None:
        return max(self.targets.items(), key=lambda item: item[1].seconds, default=None)

    @property
    def started(self) -> bool:
        """Whether the round touched an engine (paused, began or wrote); one refused or not prepared did not."""
        return self.attempts > 0

    def as_status(self) -> dict[str, object]:
        status: dict[str, object] = {
            "version": self.version,
            "result": self.result,
            "startedAt": self.started_at,
            "durationSeconds": round(self.duration_seconds, 4),
            "bytes": self.bytes,
            "gbps": round(self.gbps, 4),
        }
        if self.reason:
            status["reason"] = self.reason
        if self.engines_paused:
            status["enginesPaused"] = True
        if self.phases:
            status["phases"] = {phase: round(seconds, 4) for phase, seconds in self.phases.items()}
        if self.paused_seconds is not None:
            status["pausedSeconds"] = round(self.paused_seconds, 4)
        if self.gate_gap is not None:
            status["gateGap"] = round(self.gate_gap, 6)
        if self.pause_policy is not None:
            status["pausePolicy"] = self.pause_policy
        if (slowest := self.slowest_source) is not None:
            status["slowestSource"] = _peer_status(f"source {slowest[0]}", slowest[1])
        if (target := self.slowest_target) is not None:
            status["slowestTarget"] = _peer_status(f"engine {target[0][0]} rank {target[0][1]}", target[1])
        return status


def _peer_status(peer: str, stat: Throughput) -> dict[str, object]:
    return {"peer": peer, "bytes": stat.bytes, "seconds": round(stat.seconds, 4), "gbps": round(stat.gbps, 4)}


class RoundDriver:
    def __init__(
        self,
        plan: Plan,
        engines: Mapping[int, EngineRound],
        sources: Mapping[int, SourceControl],
        *,
        staging: Staging = "live",
        pause_policy: PausePolicy = "minimal",
        verify: bool = True,
        timeout_seconds: float = 300.0,
        call_timeout: float = HTTP_CALL_SECONDS,
        retries: int = 1,
        clock: Callable[[], float] = time.monotonic,
        covering: Collection[int] | None = None,
        settle_seconds: float = 10.0,
    ) -> None:
        """``covering``: the engines this driver's rounds write (default: all). A catch-up round for
        joining engines covers only them; the others are not paused, begun or committed. ``pause_policy``: the
        plan's ``transfer.pause``; the sources apply it (when a streamed one says it can write), the round records
        it."""
        strangers = sorted({e for e in (*engines, *(covering or ())) if not 0 <= e < plan.layout.engines})
        unknown_sources = sorted(s for s in sources if not 0 <= s < len(plan.sources))
        if strangers or unknown_sources:
            raise RoundError(
                f"the plan has {plan.layout.engines} engines and {len(plan.sources)} trainer ranks; it does not know "
                f"engines {strangers} or sources {unknown_sources} given to the coordinator"
            )
        self.settle_seconds = settle_seconds
        self.covering = frozenset(range(plan.layout.engines) if covering is None else covering)
        missing_engines = self.covering - set(engines)
        needed = {a.source for a in plan.sources if any(t[0] in self.covering for t in a.targets)}
        missing_sources = needed - set(sources)
        if missing_engines or missing_sources:
            raise RoundError(
                f"the plan needs engines {sorted(missing_engines)} and sources {sorted(missing_sources)}, "
                "which the coordinator cannot reach"
            )
        self.plan = plan
        self.engines = {e: engines[e] for e in sorted(self.covering)}
        self.sources = {s: sources[s] for s in sorted(needed)}
        self.staging = staging
        self.schedule = round_schedule(staging, pause_policy)
        self.verify = verify
        self.timeout = timeout_seconds
        self.call_timeout = call_timeout
        self.retries = retries
        self.clock = clock
        self.pool = ThreadPoolExecutor(max_workers=max(4, len(self.engines) + len(self.sources)))
        self.round_id: str | None = None
        self._deadline = 0.0  # the running round's: started + timeout
        self._unanswered: list[int] = []  # the engines whose last control call failed or did not finish in time
        self._written = False
        self._phases: dict[str, float] = {}
        self._paused: tuple[float, float | None] | None = None  # (pause began, resume ended) of a live round
        self._reports: dict[int, SourceReport] = {}
        self._streamed = False  # some source of this round answered its prepare for a streamed version
        #: The checksums each target verified in the last verify pass (what the coordinator's scrubs compare with
        #: once the round commits).
        self.verified: dict[Target, tuple[str, ...]] = {}
        self._gate_resumed = False  # the gate resumed the engines before the label (the run must not again)
        #: Per engine, its largest canary gap in this round's gate, for the engines whose scores passed.
        self.gate_gaps: dict[int, float] = {}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # --- The round -----------------------------------------------------------------------------------

    def run(self, version: int, round_id: str | None = None, canary: Canary | None = None) -> RoundResult:
        """Run round ``version``; ``round_id`` (minted here when not given) goes with every engine call, so an
        engine refuses a call from another round, such as a late abort of an earlier round of the same version.
        ``canary``: gate the label on it (every engine must score it within its tolerance)."""
        self.round_id = round_id or new_round_id()
        self._written = False  # whether any source may have written in this round
        self._phases, self._paused, self._reports, self._streamed = {}, None, {}, False
        self._gate_resumed, self.gate_gaps = False, {}
        started = self.clock()
        self._deadline = started + self.timeout
        started_at = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        attempts = 0
        moved = 0
        reason: str | None = None
        pausing = self.schedule.pause_engines
        ungated = self._ungated(canary)
        if ungated is not None:
            return self._result(version, "Failed", started, started_at, 0, 0, f"round not started: {ungated}")
        with self._timed("prepare"):
            not_ready = self._prepare(version, started + self.timeout)
        if not_ready is not None:  # nothing is paused until every source can write v
            return self._result(version, "Failed", started, started_at, 0, 0, f"round not started: {not_ready}")
        try:
            if pausing:
                self._paused = (self.clock(), None)
                with self._timed("pause"):
                    self._each_engine("pause", lambda e, t: e.pause(t, round_id=self._rid))
            with self._timed("begin"):
                self._each_engine("begin", lambda e, t: e.begin(version, t, round_id=self._rid))
        except RoundError as exc:
            # Nothing was written; whichever engines did pause must serve again (an engine that began tracks
            # its live weights as dirty until told no source was asked to write).
            self._abort_quietly(version, written=False)
            stuck = self._resume_quietly() if pausing else []
            reason = f"could not start the round: {exc}{_still_paused(stuck)}"
            return self._result(version, "Failed", started, started_at, 0, 1, reason, paused=bool(stuck),
                                unresumed=stuck)  # fmt: skip
        failures: list[str] = []
        # A retry once the budget is spent could only time out, and its reason would hide the attempt's cause.
        while attempts <= self.retries and (attempts == 0 or self.clock() < started + self.timeout):
            attempts += 1
            try:
                if attempts > 1:  # engines that closed verified ranks to writes take the retry's writes again
                    self._each_engine("reopen", _reopen(version, self._rid))
                moved = self._attempt(version, started, canary)
            except GateError as exc:
                return self._result(version, "Failed", started, started_at, self._moved(), attempts, str(exc),
                                    paused=True)  # fmt: skip
            except RoundError as exc:
                failures.append(str(exc))
                reason = attempts_reason(failures)
                if self.staging == "staged":
                    self._abort_quietly(version)
                    break
                continue  # live: the replicas still hold v; write again
            try:
                if pausing and not self._gate_resumed:
                    with self._timed("resume"):
                        self._each_engine("resume", lambda e, t: e.resume(t, round_id=self._rid))
                    self._resumed()
            except RoundError as exc:
                # Every engine holds and reports verified v (the committed version moves), but one does not
                # serve: the round did not fully complete, and says so.
                reason = f"committed version {version}, but resume failed: {exc}"
                return self._result(version, "Failed", started, started_at, moved, attempts, reason, paused=True,
                                    committed=True, unresumed=self._unanswered)  # fmt: skip
            return self._result(version, "Succeeded", started, started_at, moved, attempts, None, committed=True)
        if self.staging == "staged":
            return self._result(version, "Aborted", started, started_at, moved, attempts, reason)
        if not self._written:
            # Every source refused before its first write (a stale manifest, another plan): the live weights are
            # untouched, so the engines serve v-1 again rather than wait paused for the next round.
            self._abort_quietly(version, written=False)
            stuck = self._resume_quietly()
            return self._result(version, "Failed", started, started_at, 0, attempts,
                                f"nothing written: {reason}{_still_paused(stuck)}", paused=bool(stuck),
                                unresumed=stuck)  # fmt: skip
        # Live: some engines may hold a mix of v-1 and v. They stay paused (still reporting v-1, which
        # they no longer fully hold for serving) until a later round succeeds.
        return self._result(version, "Failed", started, started_at, moved, attempts, reason, paused=True)

    def _prepare(self, version: int, deadline: float) -> str | None:
        """Why some source cannot write ``version`` (each asked at once, waiting for its trainer to stage up to
        ``deadline``), or None when every one can."""
        futures = {s: self.pool.submit(src.prepare, version, deadline) for s, src in self.sources.items()}
        # Every source's answer is awaited, not just the first refusal: a prepare is also how a source learns that an
        # engine moved its weights (it refetches its manifests then), and one cut short would refuse the next round.
        first: str | None = None
        for source, future in futures.items():
            try:
                report = self._result_by(future, deadline, f"source {source}")
            except RoundError as exc:
                first = first or str(exc)
                continue
            if not report.ok:
                first = first or f"source {source} is not ready: {report.error}"
            self._streamed = self._streamed or report.streamed
        return first

    def _ungated(self, canary: Canary | None) -> str | None:
        """Why this round cannot take ``canary``'s gate, or None (also when there is no canary)."""
        if canary is None:
            return None
        unable = [index for index, engine in self.engines.items() if not isinstance(engine, GatedRound)]
        if unable:
            return f"engines {unable} cannot score a canary (their adapter has no semantic gate)"
        staged = [index for index, engine in self.engines.items()
                  if self.staging not in _gated(engine).gate_stagings]  # fmt: skip
        if staged:
            return f"engines {staged} cannot take the semantic gate (a canary) with targetStaging: {self.staging}"
        return None

    def _attempt(self, version: int, started: float, canary: Canary | None = None) -> int:
        deadline = started + self.timeout
        with self._timed("write"):
            reports = self._publish(version, deadline)
        self._reports = reports
        if self.verify:
            with self._timed("verify"):
                self._verify(version, reports, deadline)
        if canary is not None:
            self._gate(version, canary)
        with self._timed("commit"):
            self._each_engine("commit", lambda e, t: e.commit(version, t, round_id=self._rid))
        return self._moved()

    def _moved(self) -> int:
        return sum(r.bytes for r in self._reports.values())

    def _gate(self, version: int, canary: Canary) -> None:
        """Apply ``version`` unlabelled, resume, and have every engine score ``canary``; on any failure from the
        resume on, pause the engines again and raise :class:`GateError` (the commit that follows only labels)."""
        with self._timed("commit"):
            self._each_engine("apply", lambda e, t: _gated(e).apply(version, t, round_id=self._rid))
        try:
            with self._timed("resume"):
                self._each_engine("resume", lambda e, t: e.resume(t, round_id=self._rid))
            self._gate_resumed = True
            self._resumed()
            with self._timed("gate"):
                failures = self._scores_off(canary)
            if failures:
                raise GateError(f"the semantic gate failed for version {version}: {'; '.join(failures)}")
        except RoundError as exc:
            # Paused again, and the round closed as written: the applied weights are no version's (an engine that
            # tracks dirty weights, as the reference engine does, serves none until a round lands).
            self._pause_quietly()
            self._abort_quietly(version)
            raise GateError(str(exc), peer=exc.peer) from exc

    def _scores_off(self, canary: Canary) -> list[str]:
        """Each engine's failure to score ``canary`` within its tolerance (none: the gate passes)."""
        budget = self._call_budget()
        futures = {
            index: self.pool.submit(_gated(engine).score, canary.input_ids, budget, round_id=self._rid)
            for index, engine in self.engines.items()
        }
        deadline = self.clock() + budget
        failures = []
        for index, future in futures.items():
            scored = self._result_by(future, deadline, f"engine {index} canary")
            why = judge(canary, scored)
            if why is not None:
                failures.append(f"engine {index}: {why}")
            else:
                self.gate_gaps[index] = max(gaps(canary, scored), default=0.0)
        return failures

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        began = self.clock()
        try:
            yield
        finally:
            self._phases[phase] = self._phases.get(phase, 0.0) + self.clock() - began

    def _resumed(self) -> None:
        if self._paused is not None:
            self._paused = (self._paused[0], self.clock())

    def _paused_seconds(self, attempts: int) -> float | None:
        if attempts == 0:
            return None
        if self.staging == "staged":
            return self._phases.get("commit", 0.0)
        if self._paused is None:
            return None
        began, ended = self._paused
        return (self.clock() if ended is None else ended) - began

    def _publish(self, version: int, deadline: float) -> dict[int, SourceReport]:
        futures = {s: self.pool.submit(src.publish, version, deadline) for s, src in self.sources.items()}
        reports: dict[int, SourceReport] = {}
        current = -1
        try:
            for current, future in futures.items():
                source = current
                try:
                    report = self._result_by(future, deadline, f"source {source} write")
                except RoundError as exc:
                    report = self._late_failure(future, exc)
                if not report.ok:
                    target = report.failed_target
                    where = f" writing engine {target[0]} rank {target[1]}" if target else " to write"
                    bucket = f", bucket {report.failed_bucket}" if report.failed_bucket is not None else ""
                    raise RoundError(
                        f"source {source} failed{where}{bucket}: {report.error}",
                        peer=f"source {source}",
                        bucket=report.failed_bucket,
                    )
                reports[source] = report
        except RoundError:
            # The round-level fence: the other sources settle (their writes done or failed) before the
            # attempt is reported, so nothing from them lands during a retry or the next round. Sources
            # bound their own publish by the deadline plus their transport's timeout; a source that did
            # not answer by the deadline is not waited for (it may never answer: docs/replica.md).
            others = [f for s, f in futures.items() if s != current and not f.done()]
            wait(others, timeout=max(0.0, deadline - self.clock()) + self.settle_seconds)
            self._written = self._written or any(_may_have_written(f) for f in futures.values())
            raise
        self._written = True
        return reports

    def _verify(self, version: int, reports: Mapping[int, SourceReport], deadline: float) -> None:
        jobs: dict[Target, Future[TargetVerdict]] = {}
        wanted: dict[Target, tuple[str, ...]] = {}
        for assignment in self.plan.sources:
            report = reports.get(assignment.source)
            for target in assignment.targets:
                if target[0] not in self.covering:
                    continue
                if report is None or target not in report.checksums:
                    raise RoundError(
                        f"source {assignment.source} reported nothing for engine {target[0]} rank {target[1]}",
                        peer=f"engine {target[0]}",
                    )
                engine = self.engines[target[0]]
                sums = report.checksums[target]
                wanted[target] = tuple(sums)
                jobs[target] = self.pool.submit(
                    engine.verify, target[1], version, sums, self._call_budget(), round_id=self._rid
                )
        self.verified = {}
        for target, future in sorted(jobs.items()):
            result = self._result_by(future, deadline, f"engine {target[0]} rank {target[1]} verify")
            if result.ok:
                self.verified[target] = wanted[target]
            else:
                detail = result.error or f"buckets {list(result.mismatched)[:8]} differ"
                raise RoundError(
                    f"engine {target[0]} rank {target[1]} failed verification of version {version}: {detail}",
                    peer=f"engine {target[0]}",
                    bucket=result.mismatched[0] if result.mismatched else None,
                )

    # --- Helpers -------------------------------------------------------------------------------------

    def _result_by(self, future: Future[T], deadline: float, what: str) -> T:
        try:
            return future.result(timeout=max(0.0, deadline - self.clock()))
        except FutureTimeout as exc:
            raise RoundError(f"{what} did not finish before the round's deadline", peer=what) from exc
        except RoundError:
            raise
        except Exception as exc:  # an engine or source client error: name the peer
            raise RoundError(f"{what}: {exc}", peer=what) from exc

    def _call_budget(self) -> float:
        """An engine call's timeout: the round's time left, at most ``call_timeout``, at least
        :data:`CALL_FLOOR_SECONDS` (a hung engine must not hold a round for a call's 30 s past its budget)."""
        return max(CALL_FLOOR_SECONDS, min(self.call_timeout, self._deadline - self.clock()))

    def _each_engine(self, step: str, action: Callable[[EngineRound, float], None]) -> None:
        """``action(engine, timeout)`` on every engine at once; the first failure is raised once every call ended or
        timed out, and the engines whose call did not succeed are kept (``_unanswered``)."""
        budget = self._call_budget()
        futures = {index: self.pool.submit(action, engine, budget) for index, engine in self.engines.items()}
        deadline = self.clock() + budget
        self._unanswered = []
        first: RoundError | None = None
        for index, future in futures.items():
            try:
                self._result_by(future, deadline, f"engine {index} {step}")
            except RoundError as exc:
                self._unanswered.append(index)
                first = first or exc
        if first is not None:
            raise first

    def _late_failure(self, future: Future[SourceReport], caught: RoundError) -> SourceReport:
        """A source the deadline caught writing: its own failure if it reports one within
        :data:`SOURCE_GRACE_SECONDS` (naming the engine it was writing); else ``caught``, naming an engine that
        does not answer a health check, if one does not (a hung engine stalls its writers without a word)."""
        if future.done():  # it failed (raised) rather than ran out of time: that failure is the reason
            raise caught
        done, _ = wait([future], timeout=SOURCE_GRACE_SECONDS)
        if done and future.exception() is None and not future.result().ok:
            return future.result()
        silent = self._silent_engines()
        if silent:
            raise RoundError(f"{caught}; engine {silent[0]} does not answer", peer=f"engine {silent[0]}") from caught
        raise caught

    def _silent_engines(self) -> list[int]:
        """The engines of this round that do not answer a health check within :data:`CALL_FLOOR_SECONDS`."""
        probed = {index: self.pool.submit(engine.healthy, CALL_FLOOR_SECONDS)
                  for index, engine in self.engines.items() if isinstance(engine, HealthProbe)}  # fmt: skip
        wait(probed.values(), timeout=CALL_FLOOR_SECONDS + 0.5)
        return [i for i, f in probed.items() if not f.done() or f.exception() is not None or not f.result()]

    @property
    def _rid(self) -> str:
        assert self.round_id is not None, "engine calls happen only inside run()"
        return self.round_id

    def _pause_quietly(self) -> None:
        rid = self._rid  # bound now, as below
        with self._timed("pause"):
            self._each_engine_quietly(lambda e, t: e.pause(t, round_id=rid))
        self._paused = (self.clock() if self._paused is None else self._paused[0], None)

    def _resume_quietly(self) -> list[int]:
        """Resume every engine, best effort; the engines that did not (an engine whose memory changed while open to
        writes refuses until a round lands), which the round's result then reports as paused."""
        rid = self._rid  # bound now: a late call must name its own round, not whichever runs when it lands
        with self._timed("resume"):
            stuck = self._each_engine_quietly(lambda e, t: e.resume(t, round_id=rid))
        if not stuck:
            self._resumed()
        return stuck

    def _abort_quietly(self, version: int, *, written: bool = True) -> None:
        rid = self._rid  # bound now, as above
        self._each_engine_quietly(lambda e, t: e.abort(version, t, round_id=rid, written=written))

    def _each_engine_quietly(self, action: Callable[[EngineRound, float], None]) -> list[int]:
        """Best effort, every engine at once, so a hung engine costs one call's budget (:meth:`_call_budget`), not one
        each; returns the engines whose call failed or did not finish in time.

        Errors are dropped: the failure already being reported matters more, and an engine that missed an
        abort has its round superseded by the next begin. One that arrives late, after a newer round began, names
        this round's id and is refused by the engine (it never cancels the newer round).
        """
        with contextlib.suppress(RoundError):
            self._each_engine("cleanup", action)
        return list(self._unanswered)

    def _result(
        self,
        version: int,
        result: Literal["Succeeded", "Failed", "Aborted"],
        started: float,
        started_at: str,
        nbytes: int,
        attempts: int,
        reason: str | None,
        *,
        paused: bool = False,
        committed: bool = False,
        unresumed: Collection[int] = (),
    ) -> RoundResult:
        seconds = max(self.clock() - started, 1e-9)
        return RoundResult(
            version=version,
            result=result,
            started_at=started_at,
            duration_seconds=seconds,
            bytes=nbytes,
            gbps=nbytes * 8 / seconds / 1e9,
            attempts=attempts,
            reason=reason,
            engines_paused=paused,
            round_id=self.round_id,
            committed=committed,
            phases={phase: self._phases[phase] for phase in PHASES if phase in self._phases},
            paused_seconds=self._paused_seconds(attempts),
            sources={source: Throughput(r.bytes, r.seconds) for source, r in self._reports.items()},
            targets=_target_throughputs(self._reports.values()),
            gate_gap=max(self.gate_gaps.values())
            if self.gate_gaps and len(self.gate_gaps) == len(self.engines)
            else None,
            pause_policy=None if not attempts else self.schedule.policy if self._streamed else "minimal",
            unresumed=tuple(sorted(unresumed)),
        )


def _target_throughputs(reports: Collection[SourceReport]) -> dict[Target, Throughput]:
    """Per target: bytes summed over the sources that wrote it, seconds until the last of them finished it."""
    totals: dict[Target, Throughput] = {}
    for report in reports:
        for target, stat in report.targets.items():
            seen = totals.get(target, Throughput(0, 0.0))
            totals[target] = Throughput(seen.bytes + stat.bytes, max(seen.seconds, stat.seconds))
    return dict(sorted(totals.items()))


def _may_have_written(future: Future[SourceReport]) -> bool:
    """Unless the source answered that it refused before its first write, it may have written."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return True
    return future.result().wrote


def attempts_reason(failures: Sequence[str]) -> str:
    """A round's reason from its attempts' failures: the first (the cause: a retry's failure is often its consequence,
    such as writes refused by an engine that committed before another failed its commit), then the last if it
    differs."""
    first, last = failures[0], failures[-1]
    return first if last == first else f"{first}; retried ({len(failures) - 1}x), then: {last}"


def _still_paused(engines: list[int]) -> str:
    """The reason's tail when engines stayed paused after a round that wrote nothing."""
    return f"; engines {engines} did not resume (their weights are not known to be clean)" if engines else ""


def _reopen(version: int, round_id: str) -> Callable[[EngineRound, float], None]:
    def call(engine: EngineRound, timeout: float) -> None:
        if isinstance(engine, ClosesAtVerify):
            engine.reopen(version, timeout, round_id=round_id)

    return call


def _gated(engine: EngineRound) -> GatedRound:
    assert isinstance(engine, GatedRound), "checked before the round started (_ungated)"
    return engine


def new_round_id() -> str:
    """A round id: unique per round (uuid4), opaque to every peer, which only compares it."""
    return uuid.uuid4().hex
