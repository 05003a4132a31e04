"""The round protocol's logic, against fake engines and sources (its I/O is tested elsewhere)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, Target, plan_for
from weightsync_agent.rounds.driver import SOURCE_GRACE_SECONDS, RoundDriver, RoundError
from weightsync_agent.source.report import SourceReport
from weightsync_agent.targets.adapter import TargetVerdict

TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}


def make_plan(sources: int = 2, engines: int = 2, tp: int = 2) -> Plan:
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": sources, "template": TEMPLATE},
            "inference": {"engines": engines, "ranksPerEngine": tp, "template": TEMPLATE},
        }
    )
    return plan_for(spec, group="g", namespace="ns")


@dataclass
class Log:
    events: list[tuple[str, ...]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *event: str) -> None:
        with self.lock:
            self.events.append(event)

    def kinds(self, kind: str) -> list[tuple[str, ...]]:
        return [e for e in self.events if e[0] == kind]


@dataclass
class FakeEngine:
    index: int
    log: Log
    bad_buckets: dict[int, list[int]] = field(default_factory=dict)  # rank -> mismatching buckets
    fail_verify_times: int = 0
    fail: set[str] = field(default_factory=set)
    version: int = 0
    verified: dict[int, int] = field(default_factory=dict)  # rank -> version verified
    round_ids: list[tuple[str, str]] = field(default_factory=list)  # (call, round id) as the engine got them
    aborts: list[bool] = field(default_factory=list)  # each abort's ``written``

    @property
    def name(self) -> str:
        return f"engine-{self.index}"

    def pause(self, timeout: float, *, round_id: str) -> None:
        self.log.add("pause", self.name)
        self.round_ids.append(("pause", round_id))
        if "pause" in self.fail:
            raise RuntimeError("pause refused")

    def resume(self, timeout: float, *, round_id: str) -> None:
        self.log.add("resume", self.name)
        self.round_ids.append(("resume", round_id))
        if "resume" in self.fail:
            raise RuntimeError("continue_generation: HTTP 500")

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        self.log.add("begin", self.name)
        self.round_ids.append(("begin", round_id))
        if "begin" in self.fail:
            raise RuntimeError("begin refused")

    def verify(
        self, rank: int, version: int, checksums: Sequence[str], timeout: float, *, round_id: str
    ) -> TargetVerdict:
        self.log.add("verify", self.name, str(rank))
        self.round_ids.append(("verify", round_id))
        if self.fail_verify_times > 0 and rank in self.bad_buckets:
            self.fail_verify_times -= 1
            return TargetVerdict(ok=False, mismatched=self.bad_buckets[rank])
        self.verified[rank] = version
        return TargetVerdict(ok=True)

    def commit(self, version: int, timeout: float, *, round_id: str) -> None:
        self.log.add("commit", self.name)
        self.round_ids.append(("commit", round_id))
        self.version = version

    def abort(self, version: int, timeout: float, *, round_id: str, written: bool = True) -> None:
        self.log.add("abort", self.name)
        self.round_ids.append(("abort", round_id))
        self.aborts.append(written)


@dataclass
class FakeSource:
    source: int
    targets: tuple[Target, ...]
    log: Log
    fail_with: str | None = None
    hang: float = 0.0
    staged_after: float = 0.0  # the trainer stages this long after the round starts
    not_ready: str | None = None
    refuse: str | None = None  # refuses before its first write (a stale manifest)

    def prepare(self, version: int, deadline: float) -> SourceReport:
        self.log.add("prepare", str(self.source))
        if self.staged_after:
            time.sleep(min(self.staged_after, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                return SourceReport(self.source, False, error=f"trainer did not stage {version} before the deadline")
        if self.not_ready:
            return SourceReport(self.source, False, error=self.not_ready)
        return SourceReport(source=self.source, ok=True)

    def publish(self, version: int, deadline: float) -> SourceReport:
        self.log.add("publish", str(self.source))
        if self.hang:
            time.sleep(self.hang)
        if self.refuse:
            return SourceReport(self.source, False, error=self.refuse, failed_target=self.targets[0], wrote=False)
        if self.fail_with:
            return SourceReport(
                self.source, False, error=self.fail_with, failed_target=self.targets[0], failed_bucket=3
            )
        return SourceReport(self.source, True, {t: ["aa", "bb"] for t in self.targets}, bytes=1000, seconds=0.1)


def setup(plan: Plan, **engine_kw: object) -> tuple[Log, dict[int, FakeEngine], dict[int, FakeSource]]:
    log = Log()
    engines = {e: FakeEngine(e, log) for e in range(plan.layout.engines)}
    sources = {a.source: FakeSource(a.source, a.targets, log) for a in plan.sources}
    return log, engines, sources


def test_a_round_pauses_writes_verifies_commits_and_resumes_in_order() -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    result = RoundDriver(plan, engines, sources).run(7)
    assert result.result == "Succeeded" and result.attempts == 1 and result.bytes == 2000
    kinds = [e[0] for e in log.events]
    last_pause = max(i for i, k in enumerate(kinds) if k in ("pause", "begin"))
    first_publish = min(i for i, k in enumerate(kinds) if k == "publish")
    last_verify = max(i for i, k in enumerate(kinds) if k == "verify")
    first_commit = min(i for i, k in enumerate(kinds) if k == "commit")
    first_resume = min(i for i, k in enumerate(kinds) if k == "resume")
    assert (
        last_pause < first_publish
        and last_verify < first_commit
        and max(i for i, k in enumerate(kinds) if k == "commit") < first_resume
    )
    assert len(log.kinds("verify")) == 4  # every target
    assert all(e.version == 7 for e in engines.values())
    assert result.as_status()["result"] == "Succeeded"


def test_live_mode_retries_from_the_replicas_after_a_bad_bucket() -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    engines[1].bad_buckets = {0: [2]}
    engines[1].fail_verify_times = 1
    result = RoundDriver(plan, engines, sources, staging="live", retries=1).run(3)
    assert result.result == "Succeeded" and result.attempts == 2
    assert len(log.kinds("publish")) == 4  # both sources wrote twice


def test_live_mode_gives_up_paused_and_never_commits_unverified_data() -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    engines[1].bad_buckets = {1: [5, 6]}
    engines[1].fail_verify_times = 99
    result = RoundDriver(plan, engines, sources, staging="live", retries=2).run(4)
    assert result.result == "Failed" and result.attempts == 3 and result.engines_paused
    assert "engine 1 rank 1 failed verification of version 4: buckets [5, 6] differ" in (result.reason or "")
    assert log.kinds("commit") == [] and log.kinds("resume") == []
    assert all(e.version == 0 for e in engines.values())


@dataclass
class FailsOnRetry(FakeSource):
    """Writes the first time; every later publish fails (the engine it writes committed already and closed)."""

    calls: int = 0

    def publish(self, version: int, deadline: float) -> SourceReport:
        self.calls += 1
        self.fail_with = "target 127.0.0.1:1 refused the write" if self.calls > 1 else None
        return super().publish(version, deadline)


def test_a_failed_retry_keeps_the_cause_and_no_retry_starts_once_the_budget_is_spent() -> None:
    """The fault matrix (docs/faults.md): a retry's failure is often a consequence of the attempt's (writes refused by
    an engine that committed before another failed its commit): the reason says the cause first. And a retry once
    the budget is spent could only time out: none starts, and the reason is the attempt's."""
    plan = make_plan()
    _log, engines, sources = setup(plan)
    engines[1].bad_buckets, engines[1].fail_verify_times = {0: [2]}, 1
    sources[0] = FailsOnRetry(0, sources[0].targets, _log)
    result = RoundDriver(plan, engines, sources, staging="live", retries=1).run(3)
    assert result.result == "Failed" and result.attempts == 2
    assert (result.reason or "").startswith(
        "engine 1 rank 0 failed verification of version 3: buckets [2] differ; retried (1x), then: source 0 failed "
        "writing engine 0 rank 0, bucket 3: target 127.0.0.1:1 refused the write"
    ), result.reason

    plan = make_plan()
    _log, engines, sources = setup(plan)
    sources[0].hang = 0.6
    result = RoundDriver(plan, engines, sources, staging="live", timeout_seconds=0.5, retries=3).run(4)
    assert result.result == "Failed" and result.attempts == 1, result
    assert result.reason == "source 0 write did not finish before the round's deadline"


def test_staged_mode_aborts_and_keeps_serving_the_old_version() -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    sources[1].fail_with = "target 127.0.0.1:1 refused the write"
    result = RoundDriver(plan, engines, sources, staging="staged").run(9)
    assert result.result == "Aborted"
    assert "source 1 failed writing engine" in (result.reason or "") and "bucket 3" in (result.reason or "")
    assert len(log.kinds("abort")) == 2
    assert log.kinds("commit") == [] and log.kinds("pause") == [] and log.kinds("resume") == []


def test_a_hung_source_fails_the_round_within_its_timeout() -> None:
    plan = make_plan()
    _log, engines, sources = setup(plan)
    sources[0].hang = 5.0
    started = time.monotonic()
    result = RoundDriver(plan, engines, sources, staging="staged", timeout_seconds=0.5).run(2)
    # The deadline, then the grace in which a caught source may still name the engine it was writing.
    assert time.monotonic() - started < 0.5 + SOURCE_GRACE_SECONDS + 1.0
    assert result.result == "Aborted" and "source 0 write did not finish before the round's deadline" in (
        result.reason or ""
    )


def test_a_failed_pause_writes_nothing_and_resumes_the_others() -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    engines[0].fail.add("pause")
    result = RoundDriver(plan, engines, sources).run(1)
    assert result.result == "Failed" and "could not start the round" in (result.reason or "")
    assert log.kinds("publish") == [] and len(log.kinds("resume")) == 2


def test_a_refused_begin_aborts_saying_nothing_was_written_and_resumes_every_engine() -> None:
    """Engine 0 began (a reference engine then counts its live weights dirty), engine 1 refused: no source was
    asked to write, so the abort says so and every engine serves again."""
    plan = make_plan()
    log, engines, sources = setup(plan)
    engines[1].fail.add("begin")
    result = RoundDriver(plan, engines, sources).run(1)
    assert result.result == "Failed" and not result.committed and not result.engines_paused
    assert log.kinds("publish") == [] and len(log.kinds("resume")) == 2
    assert all(e.aborts == [False] for e in engines.values())


def test_an_engine_that_will_not_serve_after_a_round_that_wrote_nothing_is_reported_paused() -> None:
    """Engine 0's memory changed while it was open to writes (a foreign peer wrote in the window), so after the abort
    with nothing written it refuses to resume: the round says which engine stayed paused, never that all serve."""
    plan = make_plan()
    _log, engines, sources = setup(plan)
    engines[1].fail.add("begin")
    engines[0].fail.add("resume")
    result = RoundDriver(plan, engines, sources).run(1)
    assert result.result == "Failed" and not result.committed and result.engines_paused
    assert "engines [0] did not resume (their weights are not known to be clean)" in (result.reason or "")


def test_every_engine_call_of_a_round_names_the_round_and_each_round_has_its_own_id() -> None:
    plan = make_plan()
    _log, engines, sources = setup(plan)
    engines[1].bad_buckets = {0: [2]}
    engines[1].fail_verify_times = 1  # a retry inside the round keeps the round's id
    driver = RoundDriver(plan, engines, sources)
    first = driver.run(1, "round-a")
    second = driver.run(2)  # minted by the driver when the caller gives none
    assert first.round_id == "round-a" and second.result == "Succeeded"
    assert second.round_id and second.round_id != first.round_id
    for engine in engines.values():
        calls = {call for call, _ in engine.round_ids}
        assert calls == {"pause", "begin", "verify", "commit", "resume"}
        ids = [rid for _, rid in engine.round_ids]
        split = len(ids) - ids[::-1].index("round-a")
        assert set(ids[:split]) == {"round-a"} and set(ids[split:]) == {second.round_id}


def test_a_failed_resume_is_a_failed_round_that_still_committed() -> None:
    """Every engine verified and committed v, one does not serve: not Succeeded (resume is part of the round),
    but the committed version moved, so the coordinator goes on from v."""
    plan = make_plan()
    log, engines, sources = setup(plan)
    engines[0].fail.add("resume")
    result = RoundDriver(plan, engines, sources).run(4)
    assert result.result == "Failed" and result.committed and result.engines_paused
    assert (result.reason or "").startswith("committed version 4, but resume failed: engine 0 resume")
    assert all(e.version == 4 for e in engines.values()) and len(log.kinds("resume")) == 2


def test_nothing_is_paused_until_every_source_can_write_the_version() -> None:
    """A slow trainer rank: the engines are paused only once it staged, so they serve meanwhile."""
    plan = make_plan()
    log, engines, sources = setup(plan)
    sources[1].staged_after = 0.3
    result = RoundDriver(plan, engines, sources).run(5)
    assert result.result == "Succeeded"
    kinds = [e[0] for e in log.events]
    assert max(i for i, k in enumerate(kinds) if k == "prepare") < min(i for i, k in enumerate(kinds) if k == "pause")


@pytest.mark.parametrize("staging", ["live", "staged"])
def test_a_source_that_cannot_write_the_version_leaves_every_engine_untouched(staging: str) -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    sources[1].not_ready = "its replica holds version 3 (committed versions only)"
    result = RoundDriver(plan, engines, sources, staging=staging).run(4)  # type: ignore[arg-type]
    assert result.result == "Failed" and not result.started and result.attempts == 0
    assert (
        result.reason
        == "round not started: source 1 is not ready: its replica holds version 3 (committed versions only)"
    )
    assert [e[0] for e in log.events if e[0] != "prepare"] == []  # no pause, begin, publish, abort or resume
    assert not result.engines_paused


def test_a_source_that_never_stages_fails_the_round_at_its_budget_without_pausing() -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    sources[0].staged_after = 5.0
    started = time.monotonic()
    result = RoundDriver(plan, engines, sources, timeout_seconds=0.4).run(2)
    assert time.monotonic() - started < 2.0
    assert result.result == "Failed" and not result.started
    # The source's own answer or the driver's deadline, whichever comes first: both name it, neither paused.
    assert (result.reason or "").startswith("round not started: source 0 "), result.reason
    assert log.kinds("pause") == [] and log.kinds("publish") == []


def test_a_plan_naming_unreachable_peers_is_refused() -> None:
    plan = make_plan()
    _log, engines, sources = setup(plan)
    del engines[1]
    with pytest.raises(RoundError, match=r"engines \[1\]"):
        RoundDriver(plan, engines, sources)


@settings(max_examples=40, deadline=None)
@given(
    sources=st.integers(1, 4),
    engines=st.integers(1, 3),
    tp=st.sampled_from([1, 2]),
    bad=st.sets(st.integers(0, 5), max_size=3),
    staging=st.sampled_from(["live", "staged"]),
)
def test_no_engine_commits_a_version_unless_every_target_verified_it(
    sources: int, engines: int, tp: int, bad: set[int], staging: str
) -> None:
    plan = make_plan(sources, engines, tp)
    _log, fake_engines, fake_sources = setup(plan)
    for engine in fake_engines.values():
        if engine.index in bad:
            engine.bad_buckets = {0: [0]}
            engine.fail_verify_times = 99
    result = RoundDriver(plan, fake_engines, fake_sources, staging=staging, retries=1).run(5)  # type: ignore[arg-type]
    committed = [e for e in fake_engines.values() if e.version == 5]
    assert result.committed == (result.result == "Succeeded")  # these fakes always resume
    if result.result == "Succeeded":
        assert len(committed) == engines
    else:
        assert committed == []
    for engine in committed:
        assert engine.verified == dict.fromkeys(range(tp), 5)


@pytest.mark.parametrize("others_write", [False, True], ids=["all-refuse", "one-wrote"])
def test_a_live_round_where_every_source_refused_before_writing_resumes_the_engines(others_write: bool) -> None:
    """Sources refuse before their first write (an engine restarted: their manifests are stale). Nothing touched
    the live weights, so the engines serve v-1 again; if any source may have written, they stay paused."""
    plan = make_plan()
    log, engines, sources = setup(plan)
    for source in sources.values():
        source.refuse = "engine 0 rank 0 publishes its weights elsewhere than this source's manifest"
    if others_write:
        sources[1].refuse = None
        sources[1].fail_with = "target 127.0.0.1:1 stalled"
    result = RoundDriver(plan, engines, sources, retries=1).run(3)
    assert result.result == "Failed" and not result.committed and log.kinds("commit") == []
    if others_write:
        assert result.engines_paused and log.kinds("resume") == []
        assert all(e.aborts == [] for e in engines.values())
    else:
        assert not result.engines_paused and (result.reason or "").startswith("nothing written: source 0")
        assert len(log.kinds("resume")) == 2 and all(e.aborts == [False] for e in engines.values())


class HungEngine(FakeEngine):
    """An engine whose ``hang_at`` call blocks (SIGSTOP) until ``release``; it honours the call's timeout as an
    HTTP client does (the call fails at it, the engine may still run it later)."""

    def __init__(self, index: int, log: Log, hang_at: str) -> None:
        super().__init__(index, log)
        self.hang_at = hang_at
        self.released = threading.Event()
        self.timeouts: dict[str, float] = {}

    def _maybe_hang(self, call: str, timeout: float) -> None:
        self.timeouts[call] = timeout
        if call == self.hang_at and not self.released.wait(timeout):
            raise TimeoutError(f"{call}: no answer in {timeout:.1f} s")

    def healthy(self, timeout: float) -> bool:
        if self.hang_at == "write" and not self.released.wait(timeout):  # stopped: no health answer either
            raise TimeoutError(f"/health: no answer in {timeout:.1f} s")
        return True

    def pause(self, timeout: float, *, round_id: str) -> None:
        self._maybe_hang("pause", timeout)
        super().pause(timeout, round_id=round_id)

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        self._maybe_hang("begin", timeout)
        super().begin(version, timeout, round_id=round_id)

    def commit(self, version: int, timeout: float, *, round_id: str) -> None:
        self._maybe_hang("commit", timeout)
        super().commit(version, timeout, round_id=round_id)

    def resume(self, timeout: float, *, round_id: str) -> None:
        self._maybe_hang("resume", timeout)
        super().resume(timeout, round_id=round_id)


@pytest.mark.parametrize("phase", ["pause", "begin", "commit", "resume"])
def test_a_hung_engine_holds_a_round_no_longer_than_its_budget_whatever_the_call_timeout(phase: str) -> None:
    """The fault matrix's engine-hang and http-slow rows: each control call is bounded by the round's deadline, not
    by the per-call HTTP timeout (30 s here; it held rounds 90 s: the call, the abort, the resume)."""
    plan = make_plan()
    log, engines, sources = setup(plan)
    engines[1] = hung = HungEngine(1, log, phase)
    budget = 1.5
    started = time.monotonic()
    try:
        result = RoundDriver(plan, engines, sources, timeout_seconds=budget, call_timeout=30.0).run(1)
    finally:
        hung.released.set()
    took = time.monotonic() - started
    assert took < budget + 5.0 - 2.0, f"{phase}: the round took {took:.1f} s"  # well inside budget + 5 s
    assert result.result == "Failed" and "engine 1" in (result.reason or ""), result.reason
    assert max(hung.timeouts.values()) <= budget + 0.1


@pytest.mark.parametrize("phase", ["pause", "begin"])
def test_engines_a_failed_start_meant_to_resume_but_could_not_reach_are_named_for_a_later_resume(phase: str) -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    engines[1] = hung = HungEngine(1, log, "resume")
    engines[1].fail.add(phase)  # the round cannot start; the resume of engine 1 then hangs
    try:
        result = RoundDriver(plan, engines, sources, timeout_seconds=1.0, call_timeout=30.0).run(1)
    finally:
        hung.released.set()
    assert result.result == "Failed" and result.engines_paused and result.unresumed == (1,)


def test_a_hung_resume_after_the_commit_names_the_engine_to_resume_later() -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    engines[0] = hung = HungEngine(0, log, "resume")
    try:
        result = RoundDriver(plan, engines, sources, timeout_seconds=1.0, call_timeout=30.0).run(2)
    finally:
        hung.released.set()
    assert result.committed and result.engines_paused and result.unresumed == (0,)


def test_a_live_round_that_wrote_and_failed_leaves_nobody_to_resume() -> None:
    """Engines holding a mix of versions stay paused on purpose: nothing is to be resumed later."""
    plan = make_plan()
    _log, engines, sources = setup(plan)
    sources[1].fail_with = "target 127.0.0.1:1 stalled"
    result = RoundDriver(plan, engines, sources, retries=0).run(3)
    assert result.engines_paused and result.unresumed == ()


class HungWriter(FakeSource):
    """A source whose publish hangs (its target stopped taking writes), then reports naming it."""

    reports_after: float = 0.0

    def publish(self, version: int, deadline: float) -> SourceReport:
        self.log.add("publish", str(self.source))
        time.sleep(max(0.0, deadline - time.monotonic()) + self.reports_after)
        return SourceReport(self.source, False, error="peer 127.0.0.1:2 stalled for 1.0 s", failed_target=(1, 0))


def test_a_source_the_deadline_caught_writing_names_the_engine_it_was_writing() -> None:
    """The fault matrix's engine-hang at write: "source 0 write did not finish before the round's deadline" blamed the
    source; its own stall report, a moment later, names engine 1 rank 0."""
    plan = make_plan()
    log, engines, sources = setup(plan)
    writer = HungWriter(0, sources[0].targets, log)
    writer.reports_after = 0.3
    sources[0] = writer
    result = RoundDriver(plan, engines, sources, timeout_seconds=1.0, retries=0).run(1)
    assert "source 0 failed writing engine 1 rank 0" in (result.reason or ""), result.reason


def test_a_source_stuck_past_the_grace_names_an_engine_that_does_not_answer() -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    writer = HungWriter(0, sources[0].targets, log)
    writer.reports_after = 10.0
    sources[0] = writer
    engines[1] = hung = HungEngine(1, log, "write")
    try:
        result = RoundDriver(plan, engines, sources, timeout_seconds=1.0, retries=0).run(1)
    finally:
        hung.released.set()
    reason = result.reason or ""
    assert "source 0 write did not finish before the round's deadline; engine 1 does not answer" in reason, reason


def test_every_source_finishes_its_prepare_before_a_refused_round_returns() -> None:
    """A prepare is also how a source learns an engine moved (and refetches): one refusal must not cut the others'
    short (the fault matrix's first round after an engine restart failed so)."""
    plan = make_plan()
    log, engines, sources = setup(plan)
    sources[0].not_ready = "engine 1 rank 0 publishes its weights elsewhere than this source's manifest"
    sources[1].staged_after = 0.3
    result = RoundDriver(plan, engines, sources, timeout_seconds=5.0).run(1)
    assert not result.started and "source 0 is not ready" in (result.reason or "")
    assert len(log.kinds("prepare")) == 2
    assert result.duration_seconds >= 0.25, "the round returned before source 1's prepare ended"


class ClosingEngine(FakeEngine):
    """An engine that closes each verified rank to writes (the reference engine): a retry must reopen it."""

    def reopen(self, version: int, timeout: float, *, round_id: str) -> None:
        self.log.add("reopen", self.name)
        self.round_ids.append(("reopen", round_id))


def test_a_live_retry_reopens_engines_that_close_verified_ranks_before_the_sources_write_again() -> None:
    plan = make_plan()
    log, engines, sources = setup(plan)
    engines[1] = closing = ClosingEngine(1, log, bad_buckets={0: [2]}, fail_verify_times=1)
    result = RoundDriver(plan, engines, sources, retries=1).run(5, "round-r")
    assert result.result == "Succeeded" and result.attempts == 2
    kinds = [e[0] for e in log.events]
    reopened = kinds.index("reopen")
    assert kinds.count("reopen") == 1 and "verify" in kinds[:reopened] and "publish" in kinds[reopened:]
    assert ("reopen", "round-r") in closing.round_ids  # the same round, opened again
