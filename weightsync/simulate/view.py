"""Tables for ``weightsync simulate`` (rich renderables; printing is the caller's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from rich.table import Table

from weightsync.simulate.hardware import Hardware
from weightsync.simulate.model import Simulation


def _err(value: float | None) -> str:
    return "" if value is None else f"{value:+.1%}"


def summary_table(sims: Sequence[Simulation]) -> Table:
    table = Table(title="One sync, modelled (published: Miles docs, notes §1.10)")
    for column in ("preset", "nodes", "bcast", "pub", "err", "p2p", "pub", "err"):
        table.add_column(column, justify="left" if column == "preset" else "right", no_wrap=True)
    table.add_column("ours", justify="right", style="green", no_wrap=True)
    for sim in sims:
        published, errors = sim.scenario.published, sim.errors()
        table.add_row(
            sim.scenario.preset,
            f"{sim.scenario.trainer_nodes}+{sim.scenario.inference_nodes}",
            f"{sim.broadcast.seconds:.2f}",
            "" if published is None else f"{published.broadcast_s:.2f}",
            _err(None if errors is None else errors["broadcast"]),
            f"{sim.p2p.seconds:.2f}",
            "" if published is None else f"{published.p2p_s:.2f}",
            _err(None if errors is None else errors["p2p"]),
            f"{sim.ours.seconds:.2f}",
        )
    return table


def breakdown_table(sim: Simulation) -> Table:
    table = Table(title=f"{sim.scenario.model.name}, {sim.scenario.scale}x\n{sim.scenario.label()}")
    table.add_column("mode")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for label, result in (("broadcast", sim.broadcast), ("miles p2p", sim.p2p), ("ours", sim.ours)):
        for i, (name, seconds) in enumerate(result.phases):
            table.add_row(label if i == 0 else "", name, f"{seconds:.3f}")
        table.add_row("", "[b]total[/b]", f"[b]{result.seconds:.3f}[/b]", end_section=True)
    return table


def hardware_dict(hw: Hardware) -> dict[str, Any]:
    return asdict(hw)
