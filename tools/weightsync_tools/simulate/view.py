"""Tables for ``weightsync simulate`` (rich renderables; printing is the caller's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from rich.table import Table

from weightsync_tools.simulate.hardware import Hardware
from weightsync_tools.simulate.model import Simulation
from weightsync_tools.simulate.testbed import BenchRun, compare


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


_WAY_LABELS = {
    "broadcast_s": "broadcast (gloo, one member per engine)",
    "p2p_s": "p2p round over staged replicas",
    "miles_style_staging_s": "Miles-style: staging (gather, copy)",
    "miles_style_s": "Miles-style: staging, then the round",
    "ours_s": "ours: gather, copy and write pipelined",
    "miles_pause_s": "paused: Miles-style (its round)",
    "minimal_pause_s": "paused: ours, minimal (the writes)",
    "overlap_pause_s": "paused: ours, overlap (1st write on)",
    "staged_pause_s": "paused: staged targets (commit)",
}


def testbed_table(run: BenchRun, hw: Hardware) -> Table:
    kind = "constants fitted here" if run.fitted else "prediction: constants fitted to scenario A and the sweep"
    shape = f"{run.trainers} trainers -> {run.engines} engines x TP{run.tp}, {run.model_bytes / 2**20:.0f} MiB"
    link = f"{run.rate_bits / 1e6:g} Mbit/s, gather shards {run.gather_shards}"
    table = Table(title=f"testbed {run.name}: {shape}, {link}\n({kind})")
    for column in ("way", "modelled s", "measured s", "error"):
        table.add_column(column, justify="left" if column == "way" else "right", no_wrap=True)
    for row in compare(run, hw):
        measured = "" if row.measured is None else f"{row.measured:.3f}"
        table.add_row(_WAY_LABELS[row.way], f"{row.modelled:.3f}", measured, _err(row.error))
    return table


def testbed_dict(run: BenchRun, hw: Hardware) -> dict[str, Any]:
    rows = compare(run, hw)
    return {
        "testbed": run.name,
        "layout": {"trainers": run.trainers, "engines": run.engines, "tp": run.tp},
        "model_bytes": run.model_bytes,
        "replicated_bytes": run.replicated_bytes,
        "rate_bits": run.rate_bits,
        "bucket_bytes": run.bucket_bytes,
        "gather_shards": run.gather_shards,
        "fitted": run.fitted,
        "modelled": run.predict(hw).to_dict(),
        "measured": {row.way: row.measured for row in rows if row.measured is not None},
        "relative_error": {row.way: round(row.error, 4) for row in rows if row.error is not None},
        "measured_source": None if run.measured is None else run.measured.source,
    }
