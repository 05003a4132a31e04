"""``weightsync bench --scenario scale``: progress bar and table around
:mod:`weightsync_tools.localcluster.scale_bench`."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from weightsync_agent.plan_loader import WATCH_SECONDS
from weightsync_tools.localcluster.scale_bench import Bench, ScaleReport

#: The issue's targets (docs/scale.md), shown beside the measurements.
TARGETS = {
    "first_status_s": 2.0,
    "ready_s_1024": 30.0,
    "scale_out_ready_s": 10.0,
    "operator_peak_rss_mib": 300.0,
    "idle_agent_rps_per_100_pods": 1.0,
}


def parse_sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError("--pods names no group size")
    return sizes


def run_scale(directory: Path, sizes: list[int], console: Console, *, idle_seconds: float) -> ScaleReport:
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as bar:  # fmt: skip
        tasks: dict[str, TaskID] = {}

        def progress(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done, total=total)

        def say(line: str) -> None:
            bar.console.print(f"[dim]•[/] {line}")

        return Bench(directory, say, progress, idle_seconds=idle_seconds).run(sizes)


def _mark(value: float | None, target: float | None) -> str:
    if value is None:
        return "[red]—[/]"
    if target is None:
        return f"{value:g}"
    return f"{value:g} " + ("[green]✓[/]" if value <= target else f"[red]✗ (target ≤ {target:g})[/]")


def render(report: ScaleReport, console: Console) -> None:
    table = Table(title="weightsync bench --scenario scale (local cluster, 64 kwok nodes, stand-in agents)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for size in report.sizes:
        ready_target = TARGETS["ready_s_1024"] if size.pods >= 1024 else None
        table.add_row(f"{size.pods} pods: apply → first status (s)", _mark(size.first_status_s,
                                                                           TARGETS["first_status_s"]))  # fmt: skip
        table.add_row(f"{size.pods} pods: apply → Ready (s)", _mark(size.ready_s, ready_target))
        left = "nothing" if not size.left_behind else ", ".join(size.left_behind[:5])
        table.add_row(f"{size.pods} pods: delete → all gone (s)", f"{_mark(size.delete_s, None)} (left: {left})")
    if report.scale_out_to is not None:
        table.add_row(f"scale-out {report.scale_out_from} → {report.scale_out_to}: Ready (s)",
                      _mark(report.scale_out_ready_s, TARGETS["scale_out_ready_s"]))  # fmt: skip
        moved = report.moved_targets
        table.add_row("scale-out: existing targets moved", "[green]0 ✓[/]" if moved == 0 else f"[red]{moved}[/]")
    for who, rps in report.idle_rps.items():
        table.add_row(f"idle API requests/s: {who} ({report.idle_window_s:g} s window)", f"{rps:g}")
    table.add_row("idle agent requests/s per 100 pods",
                  _mark(report.idle_agent_rps_per_100_pods, TARGETS["idle_agent_rps_per_100_pods"]))  # fmt: skip
    table.add_row("operator CPU seconds (whole run)", _mark(report.operator_cpu_s, None))
    table.add_row("operator peak RSS (MiB)", _mark(report.operator_peak_rss_mib, TARGETS["operator_peak_rss_mib"]))
    gc = ", ".join(f"{k}={v}" for k, v in report.gc_settings.items())
    table.add_row("kube-controller-manager GC", gc)
    table.add_row("pod starts", ", ".join(f"{k}={v}" for k, v in report.start_settings.items()))
    console.print(table)
    console.print(f"[yellow]note:[/] {report.note}")
    if report.idle_window_s is not None and report.idle_window_s < WATCH_SECONDS * 1.25:
        console.print(
            f"[yellow]note:[/] the idle window ({report.idle_window_s:g} s) is shorter than the agents' watch period "
            f"({WATCH_SECONDS}-{WATCH_SECONDS * 1.25:g} s) and starts right after they connected: it does not see "
            "their periodic reconnects (about 0.37 requests/s per 100 pods); --idle-seconds 330 or more does"
        )
    for error in report.standin_errors:
        console.print(f"[red]stand-in error:[/] {error}")
