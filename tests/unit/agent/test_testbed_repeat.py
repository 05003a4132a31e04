"""``weightsync bench --repeat``: the medians and spreads over runs, the CPU-or-links verdict, and the rate scaling
that keeps a CPU-bound machine from measuring itself (pure parts; the runs themselves: tests/agent/test_testbed.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync_tools.testbed import cpu
from weightsync_tools.testbed.repeat import (
    Metric,
    agreement,
    agreement_lines,
    next_rate,
    run_repeated,
    summarize,
    summary_table,
)
from weightsync_tools.testbed.scenario import parse_rate

RATIO = Metric("ours_over_miles", "ours / Miles-style", ("<=", 0.85))
INFO = Metric("minimal_over_miles", "ours (minimal) / Miles-style")


def sample(processes: dict[int, tuple[str, float]], busy: float, total: float) -> cpu.Sample:
    return cpu.Sample(processes, busy, total)


# --- The verdict --------------------------------------------------------------------------------------------------


def test_a_saturated_process_or_a_busy_machine_is_a_cpu_bound_run_and_otherwise_the_links_bound_it() -> None:
    assert cpu.verdict(0.5, 0.6, caps=True) == "links"
    assert cpu.verdict(cpu.PROCESS_SATURATED, 0.2, caps=True) == "cpu"  # one Python process at its core's limit
    assert cpu.verdict(0.3, cpu.MACHINE_SATURATED, caps=True) == "cpu"  # no core to spare (others' load included)
    assert cpu.verdict(0.1, 0.1, caps=False) == "cpu"  # no caps: nothing but the cores bounds loopback


def test_usage_charges_each_process_its_cpu_time_in_the_window_against_the_wall() -> None:
    before = sample({1: ("bench", 10.0), 2: ("agent (pid 2)", 5.0)}, busy=100.0, total=400.0)
    after = sample({1: ("bench", 11.0), 2: ("agent (pid 2)", 8.8), 3: ("engine 0 (pid 3)", 0.5)}, 130.0, 440.0)
    use = cpu.usage(before, after, wall_s=4.0, cpus=2, caps=True)
    assert use.busiest == "agent (pid 2)" and use.busiest_cores == pytest.approx(0.95)  # 3.8 s of 4 s
    assert use.ours == pytest.approx((1.0 + 3.8 + 0.5) / 8.0)  # a process started in the window counts from zero
    assert use.machine == pytest.approx(30.0 / 40.0)
    assert use.verdict == "cpu" and "agent (pid 2) 0.95 core" in use.describe()
    assert cpu.worst({"a": dataclasses.replace(use, verdict="links"), "b": use}) == "cpu"
    assert cpu.worst({"a": dataclasses.replace(use, verdict="links")}) == "links"
    (line,) = cpu.table_lines({"ours": use.as_json()})
    assert line == (
        "# cpu, ours: cpu bound (busiest process agent (pid 2) 0.95 core; the run 66%, the machine 75% of 2 CPUs "
        "over 4.0 s)"
    )


def test_processes_are_named_by_what_they_run() -> None:
    python = ["/usr/bin/python3", "-m"]
    assert cpu.label([*python, "weightsync_tools.cli.main", "agent", ""]) == "agent"
    assert (
        cpu.label([*python, "weightsync_testing.reference_engine.server", "--engine", "3", "--tp", "2"]) == "engine 3"
    )
    assert cpu.label([*python, "weightsync_tools.testbed.gather", "sink"]) == "gather"
    assert cpu.label(["/usr/sbin/tc", "qdisc"]) == "tc"


def test_a_snapshot_of_this_process_sees_its_own_cpu_time_and_the_machines() -> None:
    burned = sum(i * i for i in range(200_000))  # some CPU time of our own
    taken = cpu.snapshot()
    assert burned > 0 and taken.processes[os.getpid()][0] == "bench" and taken.processes[os.getpid()][1] > 0
    assert 0 < taken.machine_busy_s < taken.machine_total_s


# --- Medians and spreads -------------------------------------------------------------------------------------------


@given(st.lists(st.floats(min_value=0.01, max_value=100), min_size=1, max_size=9))
def test_the_median_lies_within_the_spread_and_no_order_of_the_runs_changes_it(values: list[float]) -> None:
    reports = [{"ours_over_miles": v} for v in values]
    row = summarize(reports, [RATIO])["ours_over_miles"]
    assert row["min"] <= row["median"] <= row["max"] and row["spread"] >= 0 and row["n"] == len(values)
    assert summarize(list(reversed(reports)), [RATIO])["ours_over_miles"]["median"] == row["median"]


def test_the_summary_judges_the_median_against_its_target_and_skips_what_no_run_reports() -> None:
    reports = [{"ours_over_miles": v, "minimal_over_miles": None} for v in (0.80, 0.90, 0.84)]
    out = summarize(reports, [RATIO, INFO])
    assert out["ours_over_miles"]["median"] == 0.84 and out["ours_over_miles"]["met"] is True
    assert out["ours_over_miles"]["spread"] == pytest.approx((0.90 - 0.80) / 0.84, abs=1e-4)
    assert "minimal_over_miles" not in out  # no run had it (e.g. no caps: no bound)
    assert summarize([{"ours_over_miles": 0.9}], [RATIO])["ours_over_miles"]["met"] is False


# --- Runs, and the rate scaled down while the CPU bounds them --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeOptions:
    rate: str | None = "500mbit"


def fake_run(cpu_bound_above: int, seen: list[str]) -> Any:
    """A scenario whose CPU is the bottleneck above ``cpu_bound_above`` bits/s; records the rates it ran at."""

    def run(options: FakeOptions) -> dict[str, Any]:
        assert options.rate is not None
        bits = parse_rate(options.rate)
        seen.append(options.rate)
        bound = "cpu" if bits > cpu_bound_above else "links"
        # CPU-bound through the machine's load, a calmer window with the busier process: the summary names the former
        window = {
            "busiest": "agent (pid 7)",
            "busiest_cores": 0.3,
            "machine": 0.95 if bound == "cpu" else 0.5,
            "verdict": bound,
        }
        calm = {"busiest": "bench", "busiest_cores": 0.85, "machine": 0.5, "verdict": "links"}
        return {"scenario": "B", "rate": options.rate, "rate_bits": bits, "machine": {"cpus": 2, "load": [1.0]},
                "bottleneck": bound, "cpu": {"miles": calm, "ours": window},
                "ours_over_miles": 0.5 + len(seen) / 100}  # fmt: skip

    return run


def test_a_cpu_bound_run_lowers_the_rate_and_starts_the_runs_again_until_the_links_bound_them() -> None:
    seen: list[str] = []
    runs, summary = run_repeated(fake_run(300_000_000, seen), FakeOptions(), 3, [RATIO], lambda _: None)
    assert seen == ["500mbit", "350mbit", "245mbit", "245mbit", "245mbit"]
    assert [r["rate"] for r in runs] == ["245mbit"] * 3 and all(r["bottleneck"] == "links" for r in runs)
    assert [d["next_rate"] for d in summary["rescaled"]] == ["350mbit", "245mbit"]
    assert summary["metrics"]["ours_over_miles"]["n"] == 3
    text = summary_table(summary, [RATIO])
    assert "3 run(s) of scenario B at 245mbit" in text and "min-max" in text and "<= 0.85 met" in text
    assert "the CPU bound a run at 500mbit (agent (pid 7) 0.30 core in ours, machine 95%)" in text


def test_a_machine_too_slow_for_any_rate_worth_measuring_reports_its_runs_as_cpu_bound() -> None:
    seen: list[str] = []
    runs, summary = run_repeated(fake_run(0, seen), FakeOptions("60mbit"), 2, [RATIO], lambda _: None)
    assert seen == ["60mbit", "60mbit"] and [r["bottleneck"] for r in runs] == ["cpu", "cpu"]
    assert [r["bottleneck"] for r in summary["runs"]] == ["cpu", "cpu"] and not summary["rescaled"]
    assert next_rate(parse_rate("60mbit")) is None and next_rate(parse_rate("1gbit")) == parse_rate("700mbit")
    with pytest.raises(ValueError, match="--repeat"):
        run_repeated(fake_run(0, seen), FakeOptions(), 0, [RATIO], lambda _: None)


def test_two_invocations_agree_when_every_median_is_within_ten_percent_of_the_others() -> None:
    this = {"ours_over_miles": {"median": 0.60}, "minimal_over_miles": {"median": 1.00}, "only_here": {"median": 1}}
    that = {"ours_over_miles": {"median": 0.56}, "minimal_over_miles": {"median": 0.80}}
    agreed = agreement(this, that)
    assert set(agreed) == {"ours_over_miles", "minimal_over_miles"}  # only what both measured
    assert agreed["ours_over_miles"]["within"] and agreed["ours_over_miles"]["change"] == pytest.approx(
        0.0714, abs=1e-4
    )
    assert not agreed["minimal_over_miles"]["within"]  # +25 %
    lines = agreement_lines(agreed, [RATIO, INFO], "run1.json")
    assert lines[0] == "# against run1.json (medians within 10%: NO)"
    assert "ours / Miles-style: 0.600 against 0.560 (+7.1%)" in lines[1] and lines[2].endswith("NOT within")
    assert agreement_lines(agreement(that, that), [RATIO], "x")[0].endswith("yes)")


def test_the_cli_refuses_an_against_file_that_is_no_bench_json_before_touching_the_network(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from weightsync_tools.cli.main import app

    bad = tmp_path / "not-a-report.json"
    bad.write_text('{"p2p_s": 1.0}')
    result = CliRunner().invoke(app, ["bench", "--against", str(bad), "--sweep", ""])
    assert result.exit_code == 1 and "not a `weightsync bench --json` output" in result.output
