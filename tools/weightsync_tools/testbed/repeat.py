"""``weightsync bench --repeat N``: a scenario run N times, every metric's median and spread over the runs.

One run on a shared machine is one sample: its ratios move with whatever else the cores did meanwhile. So the bench
runs the scenario N times (3 by default), each on a fresh testbed, and reports per metric the median over the runs
and the spread as **min-max** (with 3 runs an interquartile range would be the median itself). Each run says whether
the CPU or the links bound it (:mod:`weightsync_tools.testbed.cpu`); a run the CPU bound is not a sample of the links,
so the bench drops the runs so far, lowers the link rate (``RATE_STEP_DOWN``) and starts again, until the links
bound every run or the rate reaches ``MIN_RATE_BITS`` (then the summary says the CPU bound it).

:func:`summarize` and :func:`summary_table` are pure; :func:`run_repeated` runs the scenario.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync_tools.testbed import cpu
from weightsync_tools.testbed.scenario import Stats, format_rate

Report = dict[str, Any]


@dataclass(frozen=True)
class Metric:
    """One number each run reports (a top-level key of its report), how to print it, and its target if any."""

    key: str
    label: str
    #: ("<=" or ">=", bound): the issue's target for the median; None: reported, not judged.
    target: tuple[str, float] | None = None

    def met(self, value: float) -> bool | None:
        if self.target is None:
            return None
        op, bound = self.target
        return value <= bound if op == "<=" else value >= bound


def summarize(reports: Sequence[Mapping[str, Any]], metrics: Sequence[Metric]) -> dict[str, Any]:
    """Per metric, the median and min-max over the runs that report it (a run with no value, e.g. no link bound
    without caps, is left out; a metric no run reports is absent), and whether the median meets its target."""
    out: dict[str, Any] = {}
    for metric in metrics:
        values = [float(r[metric.key]) for r in reports if r.get(metric.key) is not None]
        if not values:
            continue
        stats = Stats.of(values)
        out[metric.key] = {
            **stats.as_json(),
            "spread": round((stats.max - stats.min) / stats.median, 4) if stats.median else None,
            "runs": [round(v, 4) for v in values],
            "met": metric.met(stats.median),
        }
    return out


def _met(flag: bool | None) -> str:
    return "" if flag is None else ("met" if flag else "NOT met")


def summary_table(summary: Mapping[str, Any], metrics: Sequence[Metric]) -> str:
    """The summary of :func:`run_repeated` as text: the runs' machine and bottleneck, then one row per metric."""
    runs = summary["runs"]
    lines = [
        f"# {len(runs)} run(s) of scenario {summary['scenario']} at {summary['rate'] or 'no caps'}; median and spread "
        "(min-max) over the runs",
        f"# machine: {summary['cpus']} CPUs; load average before each run: " + "  ".join(str(r["load"]) for r in runs),
        "# bottleneck per run (per-process CPU time against wall time): "
        + "; ".join(f"run {i + 1} {r['bottleneck']} ({r['busiest']})" for i, r in enumerate(runs)),
    ]
    for dropped in summary.get("rescaled", []):
        lines.append(f"# the CPU bound a run at {dropped['rate']} ({dropped['busiest']}): {dropped['runs']} run(s) "
                     f"dropped, the rate lowered to {dropped['next_rate']}")  # fmt: skip
    lines.append(f"{'metric':<58}{'median':>9}{'min':>9}{'max':>9}{'spread':>8}  target")
    for metric in metrics:
        row = summary["metrics"].get(metric.key)
        if row is None:
            continue
        target = "" if metric.target is None else f"{metric.target[0]} {metric.target[1]:g} {_met(row['met'])}"
        spread = "-" if row["spread"] is None else f"{row['spread']:.1%}"
        lines.append(
            f"{metric.label:<58}{row['median']:>9.3f}{row['min']:>9.3f}{row['max']:>9.3f}{spread:>8}  {target}"
        )
    return "\n".join(lines)


def next_rate(rate_bits: int) -> int | None:
    """The link rate to try after the CPU bound a run at ``rate_bits``; None: none left worth measuring."""
    lower = round(rate_bits * cpu.RATE_STEP_DOWN / 1e6) * 1_000_000  # whole Mbit/s, as tc prints them
    return lower if lower >= cpu.MIN_RATE_BITS else None


def run_repeated(
    run_once: Callable[[Any], Report],
    options: Any,
    repeat: int,
    metrics: Sequence[Metric],
    say: Callable[[str], None],
) -> tuple[list[Report], dict[str, Any]]:
    """Run ``run_once(options)`` ``repeat`` times (a dataclass ``options`` with ``rate``); returns the runs kept and
    their summary. A CPU-bound run with caps lowers the rate and starts the count again."""
    if repeat < 1:
        raise ValueError("--repeat must be at least 1")
    runs: list[Report] = []
    rescaled: list[dict[str, Any]] = []
    while len(runs) < repeat:
        say(f"run {len(runs) + 1}/{repeat}" + (f" at {options.rate}" if options.rate else ""))
        report = run_once(options)
        runs.append(report)
        rate_bits = report.get("rate_bits")
        if report.get("bottleneck") != "cpu" or rate_bits is None:
            continue
        lower = next_rate(int(rate_bits))
        if lower is None:
            say(f"the CPU bound the run at {report['rate']} and no lower rate is left: reporting it as CPU-bound")
            continue
        rescaled.append({"rate": report["rate"], "busiest": _busiest(report), "runs": len(runs),
                         "next_rate": format_rate(lower)})  # fmt: skip
        say(f"the CPU bound the run at {report['rate']} ({_busiest(report)}): lowering the rate to "
            f"{format_rate(lower)} and starting the runs again")  # fmt: skip
        options = dataclasses.replace(options, rate=format_rate(lower))
        runs = []
    last = runs[-1]
    summary = {
        "scenario": last["scenario"],
        "rate": last.get("rate"),
        "cpus": last["machine"]["cpus"],
        "runs": [
            {"load": r["machine"]["load"], "bottleneck": r.get("bottleneck"), "busiest": _busiest(r)} for r in runs
        ],
        "rescaled": rescaled,
        "metrics": summarize(runs, metrics),
    }
    return runs, summary


def _busiest(report: Mapping[str, Any]) -> str:
    """The window of a run nearest to saturating the CPU (among those the CPU bound, if any): its busiest process
    and the machine's load."""
    windows = report.get("cpu") or {}
    if not windows:
        return "not measured"
    name, window = max(
        windows.items(),
        key=lambda item: (item[1]["verdict"] == "cpu", max(item[1]["busiest_cores"], item[1]["machine"])),
    )
    return f"{window['busiest']} {window['busiest_cores']:.2f} core in {name}, machine {window['machine']:.0%}"


#: Two invocations of the same command agree when every median is within this share of the other's.
SAME_RUN_TOLERANCE = 0.10


def agreement(
    these: Mapping[str, Any], those: Mapping[str, Any], tolerance: float = SAME_RUN_TOLERANCE
) -> dict[str, Any]:
    """Each metric both summaries hold (``summary["metrics"]``): this median, that one, the change relative to that
    one, and whether it is within ``tolerance`` (the issue's check: the same run twice gives medians within 10 %)."""
    out: dict[str, Any] = {}
    for key in these.keys() & those.keys():
        this, that = float(these[key]["median"]), float(those[key]["median"])
        change = (this - that) / that if that else None
        within = change is not None and abs(change) <= tolerance
        out[key] = {
            "this": this,
            "that": that,
            "change": None if change is None else round(change, 4),
            "within": within,
        }
    return out


def agreement_lines(agreed: Mapping[str, Any], metrics: Sequence[Metric], against: str) -> list[str]:
    """:func:`agreement` as the lines the summary ends with."""
    lines = [f"# against {against} (medians within {SAME_RUN_TOLERANCE:.0%}: "
             f"{'yes' if all(a['within'] for a in agreed.values()) else 'NO'})"]  # fmt: skip
    for metric in metrics:
        row = agreed.get(metric.key)
        if row is not None:
            change = "-" if row["change"] is None else f"{row['change']:+.1%}"
            lines.append(f"#   {metric.label}: {row['this']:.3f} against {row['that']:.3f} ({change})"
                         + ("" if row["within"] else "  NOT within"))  # fmt: skip
    return lines
