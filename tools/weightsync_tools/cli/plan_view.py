"""Human-readable rendering of a plan (rich tables)."""

from __future__ import annotations

from itertools import groupby

from rich.console import Console
from rich.table import Table

from weightsync.api import names
from weightsync.plan import Plan, Target


def _compress(targets: tuple[Target, ...]) -> str:
    """``(0,1),(1,1),(2,1)`` reads as ``r1@e0-2``: engine rank r on a run of engines."""
    by_rank = sorted(targets, key=lambda t: (t[1], t[0]))
    parts = []
    for rank, items in groupby(by_rank, key=lambda t: t[1]):
        engines = [e for e, _ in items]
        runs = []
        start = prev = engines[0]
        for e in [*engines[1:], None]:
            if e is not None and e == prev + 1:
                prev = e
                continue
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            if e is not None:
                start = prev = e
        parts.append(f"r{rank}@e{','.join(runs)}")
    return " ".join(parts) or "-"


def render_plan(plan: Plan, console: Console) -> None:
    layout = plan.layout
    title = (
        f"{plan.group or 'plan'}: {layout.sources} sources → {layout.engines} engines × TP{layout.ranks_per_engine}"
        f"  ({plan.policy}, {plan.transfer.mode}, hash {plan.hash})"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("source", justify="right")
    table.add_column("trainer pod")
    table.add_column("local", justify="right")
    table.add_column("targets", justify="right")
    table.add_column("replica shapes")
    table.add_column("writes (engine rank @ engines)")
    busiest = plan.balance.max_targets_per_source
    for assignment in plan.sources:
        pod, local = layout.source_pod(assignment.source)
        load = len(assignment.targets)
        style = "bold" if load == busiest and busiest else ("dim" if load == 0 else "")
        table.add_row(
            str(assignment.source),
            names.trainer_pod(plan.group or "group", pod),
            str(local),
            str(load),
            ",".join(f"r{r}" for r in assignment.shapes) or "-",
            _compress(assignment.targets),
            style=style,
        )
    console.print(table)
    balance = plan.balance
    verdict = "[green]balanced[/]" if balance.perfect else "[yellow]unbalanced[/]"
    console.print(
        f"targets per source: max {balance.max_targets_per_source}, min {balance.min_targets_per_source} ({verdict}); "
        f"replica shapes per source: max {balance.max_shapes_per_source}, total {balance.total_shapes}"
    )
    if balance.note:
        console.print(f"[yellow]note:[/] {balance.note}")
