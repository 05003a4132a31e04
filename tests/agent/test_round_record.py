"""What a round records about itself: seconds per phase, the engines' pause window, bytes and seconds per source
and per target with the slowest of each named; and that the group's status schema takes that record."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import pytest
from test_rounds import FakeEngine, FakeSource, Log, make_plan

from weightsync.api.v1alpha1 import SyncStatus
from weightsync.plan import Plan
from weightsync_agent.client.trainer import RoundOutcome
from weightsync_agent.rounds.driver import PHASES, RoundDriver
from weightsync_agent.rounds.wire import (
    WireError,
    round_result_from_json,
    round_result_to_json,
    source_report_from_json,
    source_report_to_json,
)
from weightsync_agent.source.report import SourceReport, Throughput

STEP = 0.03  # what each slow engine call takes


@dataclass
class SlowEngine(FakeEngine):
    """Every call it gets takes :data:`STEP` (so each phase takes at least that)."""

    def pause(self, timeout: float, *, round_id: str) -> None:
        time.sleep(STEP)
        super().pause(timeout, round_id=round_id)

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        time.sleep(STEP)
        super().begin(version, timeout, round_id=round_id)

    def commit(self, version: int, timeout: float, *, round_id: str) -> None:
        time.sleep(STEP)
        super().commit(version, timeout, round_id=round_id)

    def resume(self, timeout: float, *, round_id: str) -> None:
        time.sleep(STEP)
        super().resume(timeout, round_id=round_id)


@dataclass
class MeasuredSource(FakeSource):
    """Reports per-target bytes and seconds: target ``(e, r)`` took ``0.1 * (e + 1) + 0.01 * source`` s."""

    def publish(self, version: int, deadline: float) -> SourceReport:
        report = super().publish(version, deadline)
        per = {t: Throughput(500, 0.1 * (t[0] + 1) + 0.01 * self.source) for t in self.targets}
        seconds = max(s.seconds for s in per.values())
        return SourceReport(report.source, report.ok, report.checksums, report.bytes, seconds, targets=per)


def rig(plan: Plan) -> tuple[dict[int, SlowEngine], dict[int, MeasuredSource]]:
    log = Log()
    engines = {e: SlowEngine(e, log) for e in range(plan.layout.engines)}
    sources = {a.source: MeasuredSource(a.source, a.targets, log) for a in plan.sources}
    return engines, sources


def test_a_live_round_records_every_phase_in_order_and_its_pause_window() -> None:
    plan = make_plan()
    engines, sources = rig(plan)
    result = RoundDriver(plan, engines, sources, staging="live").run(1)
    assert result.result == "Succeeded"
    assert list(result.phases) == [p for p in PHASES if p != "gate"]  # the gate runs only with a canary
    for phase in ("pause", "begin", "commit", "resume"):
        assert result.phases[phase] >= STEP, (phase, result.phases)
    assert sum(result.phases.values()) <= result.duration_seconds + 1e-6
    # Paused from the pause's start to the resume's end: everything but prepare.
    assert result.paused_seconds is not None
    assert result.paused_seconds == pytest.approx(result.duration_seconds - result.phases["prepare"], abs=0.02)


def test_a_staged_round_has_no_pause_phase_and_its_pause_window_is_its_commit() -> None:
    plan = make_plan()
    engines, sources = rig(plan)
    result = RoundDriver(plan, engines, sources, staging="staged").run(1)
    assert result.result == "Succeeded"
    assert list(result.phases) == ["prepare", "begin", "write", "verify", "commit"]
    assert result.paused_seconds == result.phases["commit"] >= STEP


def test_a_round_names_its_slowest_source_and_target_with_their_bytes_and_throughput() -> None:
    plan = make_plan(sources=2, engines=2, tp=2)
    engines, sources = rig(plan)
    result = RoundDriver(plan, engines, sources).run(1)
    assert set(result.sources) == {0, 1}
    assert result.sources[1].seconds == pytest.approx(0.21)  # its engine 1 target: 0.1 * 2 + 0.01
    # Each target gets bytes from every source that writes it; its seconds are its last source's.
    writers = {t: [a.source for a in plan.sources if t in a.targets] for a in plan.sources for t in a.targets}
    for target, stat in result.targets.items():
        assert stat.bytes == 500 * len(writers[target])
        assert stat.seconds == pytest.approx(max(0.1 * (target[0] + 1) + 0.01 * s for s in writers[target]))
    slowest_source, slowest_target = result.slowest_source, result.slowest_target
    assert slowest_source is not None and slowest_target is not None
    assert slowest_source[0] == max(result.sources, key=lambda s: result.sources[s].seconds)
    assert slowest_target[0][0] == 1  # engine 1's targets take longest
    status = result.as_status()
    assert status["slowestSource"] == {
        "peer": f"source {slowest_source[0]}",
        "bytes": slowest_source[1].bytes,
        "seconds": round(slowest_source[1].seconds, 4),
        "gbps": round(slowest_source[1].gbps, 4),
    }
    assert str(status["slowestTarget"]["peer"]).startswith("engine 1 rank ")  # type: ignore[index]


def test_a_round_that_never_started_records_no_pause_and_no_peers() -> None:
    plan = make_plan()
    engines, sources = rig(plan)
    sources[0].not_ready = "nothing staged"
    result = RoundDriver(plan, engines, sources).run(1)
    assert result.result == "Failed" and result.paused_seconds is None
    assert list(result.phases) == ["prepare"] and not result.sources and not result.targets
    assert "pausedSeconds" not in result.as_status()
    assert result.pause_policy is None and "pausePolicy" not in result.as_status()


def test_a_live_round_left_paused_counts_its_pause_window_to_its_end() -> None:
    plan = make_plan()
    engines, sources = rig(plan)
    engines[1].bad_buckets = {0: [2]}
    engines[1].fail_verify_times = 99
    result = RoundDriver(plan, engines, sources, staging="live", retries=0).run(1)
    assert result.result == "Failed" and result.engines_paused
    assert "resume" not in result.phases and "commit" not in result.phases
    assert result.paused_seconds == pytest.approx(result.duration_seconds - result.phases["prepare"], abs=0.02)


@pytest.mark.parametrize("staging", ["live", "staged"])
def test_the_status_schema_takes_a_rounds_record(staging: str) -> None:
    plan = make_plan()
    engines, sources = rig(plan)
    result = RoundDriver(plan, engines, sources, staging=staging).run(3)  # type: ignore[arg-type]
    status = SyncStatus.model_validate(result.as_status())
    assert status.phases is not None and status.phases.commit == round(result.phases["commit"], 4)
    assert status.paused_seconds == round(result.paused_seconds or 0.0, 4)
    assert status.slowest_source is not None and status.slowest_source.peer.startswith("source ")
    assert status.slowest_target is not None and status.slowest_target.peer.startswith("engine ")


def test_the_record_travels_between_agents() -> None:
    plan = make_plan()
    engines, sources = rig(plan)
    result = RoundDriver(plan, engines, sources).run(2)
    back = round_result_from_json(round_result_to_json(result))
    assert back.phases == {p: round(s, 4) for p, s in result.phases.items()}
    assert back.paused_seconds == round(result.paused_seconds or 0.0, 4)
    # Trainer ranks get every peer's throughput back, so their code can log which link was slow.
    assert back.sources == result.sources and back.targets == result.targets
    assert back.slowest_target == result.slowest_target
    gated = dataclasses.replace(result, gate_gap=0.0042)  # a gated round's gap travels, and the status schema takes it
    assert round_result_from_json(round_result_to_json(gated)).gate_gap == 0.0042 and back.gate_gap is None
    assert SyncStatus.model_validate(gated.as_status()).gate_gap == 0.0042
    with pytest.raises(WireError, match="targets must map"):
        round_result_from_json({**round_result_to_json(result), "targets": {"0/1": "fast"}})
    with pytest.raises(WireError, match="phases must map"):
        round_result_from_json({**round_result_to_json(result), "phases": {"nap": 1.0}})
    with pytest.raises(WireError, match="pausePolicy must be one of minimal, overlap"):
        round_result_from_json({**round_result_to_json(result), "pausePolicy": "sometimes"})


@dataclass
class StreamedSource(MeasuredSource):
    """Answers its prepare for a version its trainer streams."""

    def prepare(self, version: int, deadline: float) -> SourceReport:
        return dataclasses.replace(super().prepare(version, deadline), streamed=True)


@pytest.mark.parametrize(
    ("staging", "policy", "streamed", "recorded"),
    [
        ("live", "minimal", True, "minimal"),
        ("live", "overlap", True, "overlap"),
        ("live", "overlap", False, "minimal"),  # staged, then published: paused for the writes alone
        ("staged", "overlap", True, "minimal"),  # a staging area: paused only to apply
    ],
)
def test_a_round_records_which_pause_policy_ran_in_its_status_and_on_the_wire(
    staging: str, policy: str, streamed: bool, recorded: str
) -> None:
    plan = make_plan()
    engines, sources = rig(plan)
    if streamed:
        sources = {s: StreamedSource(m.source, m.targets, m.log) for s, m in sources.items()}
    result = RoundDriver(plan, engines, sources, staging=staging, pause_policy=policy).run(4)  # type: ignore[arg-type]
    assert result.pause_policy == recorded
    assert SyncStatus.model_validate(result.as_status()).pause_policy == recorded
    assert round_result_from_json(round_result_to_json(result)).pause_policy == recorded
    assert f"(pause: {recorded})" in RoundOutcome(result).summary()  # the trainer's log line says it too
    report = SourceReport(0, True, streamed=streamed)
    assert source_report_from_json(source_report_to_json(report)).streamed is streamed
