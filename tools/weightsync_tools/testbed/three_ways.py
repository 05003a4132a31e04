"""Scenario B: broadcast, Miles-style and ours on the same engines and links, in one run.

8 trainer nodes -> 4 engines x TP2 (one node per engine rank, 16 capped links), three ways:

* **broadcast**: trainer rank 0 broadcasts every full tensor (gloo, one member per engine process), as in
  scenario A;
* **Miles-style**: p2p with the published round-robin planner (``transfer.planner: miles``), every rank
  stages everything, then publishes: staging and writing follow each other;
* **ours**: p2p with the balanced planner, each rank streaming its staging into the round (a bucket is
  written as soon as it is staged), when the client offers streaming; otherwise stage-then-publish, and the
  report says so. Three rows (``transfer.pause``, ``weightsync.api.pause``): ``overlap`` into live engines
  (paused from the first write, through the staging: the shortest stage-to-commit), ``minimal`` into live engines
  (they serve while the trainer stages and pause for the write alone), and ``minimal`` into staged engines (the
  reference engine's staging area: written while they serve, paused only to apply).

Staging includes the trainer's gather (``gather.py``): with shard groups of ``gather_shards`` nodes (2 by
default) a rank receives half of every tensor over its own node's inbound link before it stages it, as an
FSDP/HSDP rank all-gathers its parameters; broadcast's sender is credited with full tensors and no gather.

A p2p way's time is the trainer's: from the first staged byte to the last rank's commit. Broadcast's is the
sender's round (it sends from the full tensors it holds; a real trainer's rank 0 sends from the GPU and
stages nothing). The engines' pause window (the longest time an engine did not serve) is read from the
reference engines after every live round; a staged round's is its commit (the reference engine applies the
staging area under the lock every forward takes: what the coordinator records as the round's ``pausedSeconds``).
Broadcast rounds alternate with Miles-style rounds (one agent set per plan); each row of ours runs after them with
the balanced plan's agents for its policy and staging. Each of these windows records the CPU time of every process
of the run against its wall time (``cpu.py``): the report says whether the CPU or the links bound the run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from weightsync_tools.testbed import cpu
from weightsync_tools.testbed.repeat import Metric
from weightsync_tools.testbed.runner import (
    BROADCAST_SEED,
    P2P_SEED,
    Group,
    Net,
    Options,
    Say,
    TimedRound,
    _exit_on_sigterm,
    _model_bytes,
    bounds,
    new_workdir,
    open_testbed,
    report_header,
    tear_down,
)
from weightsync_tools.testbed.scenario import Layout, MiB, Stats, format_rate, model_shape, parse_rate

LAYOUT = Layout(trainers=8, engines=4, tp=2)
DEFAULT_MIB = 512
#: 8 links at 500 Mbit/s move what scenario A's 4 links at 1 Gbit/s move: the 2 cores keep up, so the
#: links stay the bottleneck.
DEFAULT_RATE = "500mbit"
#: Each trainer node gathers half of every tensor over its own link before staging it (HSDP shard groups
#: of two nodes; ``gather.py``): the staging a real trainer does, scaled like the links.
DEFAULT_GATHER_SHARDS = 2
#: The p2p ways' bucket: a streamed round writes a target's bucket once all of it is staged, so after the last
#: gather one bucket is still to be written: 1.07 s at 64 MiB on a 500 Mbit/s link, 0.27 s at 16 MiB, 0.13 s at
#: 8 MiB (measured: ours 6.30, 5.42, 5.32 s; 4 MiB gained nothing more, 5.35 s; docs/testbed.md). Stage-then-write
#: does not care. Broadcast keeps the scenario's 64 MiB.
P2P_BUCKET_MIB = 8

OURS_OVER_MILES_MAX = 0.85
BROADCAST_OVER_OURS_MIN = 5.0
OURS_OVER_BOUND_MAX = 1.15
STREAMING_OVER_SLOWER_HALF_MAX = 1.15
#: ``pause: minimal``: the engines' pause against Miles-style's (whose engines also pause for the write alone) and
#: against the link bound of the write alone.
MINIMAL_PAUSE_OVER_MILES_MAX = 1.05
MINIMAL_PAUSE_OVER_BOUND_MAX = 1.10
#: Staged targets: the most a round may keep an engine from serving (its apply).
STAGED_PAUSE_MAX_S = 0.2

#: ``ours`` is the overlap row (the stage-to-commit targets, and what the simulator predicts); the other two rows of
#: ours differ in ``transfer.pause`` and ``targetStaging``.
OURS = {"ours": ("overlap", "live"), "ours_minimal": ("minimal", "live"), "ours_staged": ("minimal", "staged")}
WAYS = ("broadcast", "miles", *OURS)
LABELS = {
    "broadcast": "broadcast (rank 0, gloo)",
    "miles": "Miles-style (miles plan, stage, write)",
    "ours": "ours (balanced plan)",
    "ours_minimal": "ours (balanced plan, pause: minimal)",
    "ours_staged": "ours (balanced plan, staged targets)",
}
#: What ``--repeat`` summarizes for scenario B (top-level keys of a run's report), with the issue's targets.
METRICS: tuple[Metric, ...] = (
    Metric("ours_over_miles", "ours (overlap) / Miles-style, stage-to-commit", ("<=", OURS_OVER_MILES_MAX)),
    Metric("broadcast_over_ours", "broadcast / ours (overlap)", (">=", BROADCAST_OVER_OURS_MIN)),
    Metric("ours_over_bound", "ours (overlap) / link bound", ("<=", OURS_OVER_BOUND_MAX)),
    Metric("streaming_over_slower_half", "ours (overlap) / max(staging, writing) alone",
           ("<=", STREAMING_OVER_SLOWER_HALF_MAX)),
    Metric("overlap_pause_over_miles_pause", "pause: ours (overlap) / Miles-style"),
    Metric("minimal_pause_over_miles_pause", "pause: ours (minimal) / Miles-style",
           ("<=", MINIMAL_PAUSE_OVER_MILES_MAX)),
    Metric("minimal_pause_over_bound", "pause: ours (minimal) / link bound of the write",
           ("<=", MINIMAL_PAUSE_OVER_BOUND_MAX)),
    Metric("minimal_over_miles", "ours (minimal) / Miles-style, stage-to-commit"),
    Metric("staged_pause_s", "pause: ours (staged targets), s", ("<=", STAGED_PAUSE_MAX_S)),
)  # fmt: skip


def _streams(group: Group) -> bool:
    """Whether the trainer client can stream its staging into a round."""
    return all(hasattr(client, "stream") for client in group.clients)


def run(options: Options, say: Say) -> dict[str, Any]:
    if options.rounds < 1:
        raise ValueError("--rounds must be at least 1")
    options = dataclasses.replace(
        options,
        gather_shards=options.gather_shards or DEFAULT_GATHER_SHARDS,
        p2p_bucket_mib=options.p2p_bucket_mib or P2P_BUCKET_MIB,
    )
    layout = options.layout or LAYOUT
    mib = options.mib or DEFAULT_MIB
    rate_bits = parse_rate(options.rate or DEFAULT_RATE) if options.caps else None
    started = time.monotonic()
    testbed = open_testbed(options, layout, rate_bits, say)
    workdir = new_workdir()
    report = report_header("B", layout, options, rate_bits)
    report["gather_shards"] = options.gather_shards
    group: Group | None = None
    previous = _exit_on_sigterm()
    try:
        if testbed is not None:
            testbed.create()
            say(f"testbed {testbed.tag}: {len(testbed.links)} node links at {format_rate(rate_bits or 0)}")
        net = Net(testbed)
        model = model_shape(mib)
        say(f"scenario B: {layout.trainers} trainer nodes -> {layout.engines} engines x TP{layout.tp}, "
            f"{_model_bytes(model) / MiB:.0f} MiB model, {options.rounds} rounds per way")  # fmt: skip
        group = Group(net, layout, model, options, workdir, say)
        group.start_engines(layout.engines)
        group.planner = "miles"
        group.start_agents(layout.engines)
        group.start_broadcaster(layout.engines)
        assert group.p2p_plan is not None and group.broadcast_plan is not None
        analytic = {"miles": bounds(layout, group, group.p2p_plan, rate_bits)}
        rounds: dict[str, list[TimedRound]] = {way: [] for way in WAYS}
        wrong: list[str] = []
        version = 0
        cpus = report["machine"]["cpus"]
        window = cpu.Window()
        windows: dict[str, cpu.Usage] = {}
        for rep in range(options.rounds):
            version += 1
            b = group.broadcast_round(version)
            b.check()
            rounds["broadcast"].append(TimedRound(b, 0.0, b.seconds, group.pause_seconds()))
            if rep == 0 and options.check:
                wrong += [f"{w} after broadcast" for w in group.check_targets(group.broadcast_plan, BROADCAST_SEED)]
            version += 1
            m = group.staged_p2p_round(version)
            m.round.check()
            rounds["miles"].append(m)
            say(f"  round {rep + 1}/{options.rounds}: broadcast {b.seconds:.2f} s, Miles-style {m.total_s:.2f} s "
                f"(staging {m.stage_s:.2f} s, round {m.round.seconds:.2f} s)")  # fmt: skip
        windows["broadcast+miles"] = window.close(cpus, caps=options.caps)
        if options.check:
            wrong += [f"{w} after Miles-style" for w in group.check_targets(group.p2p_plan, P2P_SEED)]
        group.stop_broadcaster()
        group.planner = "balanced"
        streaming = True
        for way, (pause, staging) in OURS.items():
            _stage_engines(group, staged=staging == "staged")
            group.pause, group.staging = pause, staging
            group.start_agents(layout.engines)
            analytic[way] = bounds(layout, group, group.p2p_plan, rate_bits)
            streaming = streaming and _streams(group)
            window = cpu.Window()
            for rep in range(options.rounds):
                version += 1
                o = group.streamed_p2p_round(version) if streaming else group.staged_p2p_round(version)
                o.round.check()
                if staging == "staged":
                    # The engines did not pause: a staged round keeps them from serving in its commit (the apply).
                    o = dataclasses.replace(o, pause_s=o.round.phases.get("commit", 0.0))
                rounds[way].append(o)
                phases = " ".join(f"{p} {s:.2f}" for p, s in o.round.phases.items())
                say(f"  round {rep + 1}/{options.rounds}: {LABELS[way]} {o.total_s:.2f} s (staging {o.stage_s:.2f} s;"
                    f" engines paused {o.pause_s:.2f} s; coordinator's phases: {phases})")  # fmt: skip
            windows[way] = window.close(cpus, caps=options.caps)
            if options.check:
                wrong += [f"{w} after {LABELS[way]}" for w in group.check_targets(group.p2p_plan, P2P_SEED)]
        _stage_engines(group, staged=False)
        report["ours_streams"] = streaming
        report["cpu"] = {name: w.as_json() for name, w in windows.items()}
        report["bottleneck"] = cpu.worst(windows)
        for name, w in windows.items():
            say(f"  {name}: {w.describe()}")
        report["model_bytes"] = analytic["ours"]["model_bytes"]
        report["bit_exact"] = not wrong if options.check else None
        if wrong:
            report["not_bit_exact"] = wrong
        bound_of = {
            "broadcast": analytic["ours"]["broadcast"]["bound_s"],
            **{way: analytic[way]["p2p"]["bound_s"] for way in ("miles", *OURS)},
        }
        for way in WAYS:
            report[way] = _way(rounds[way], bound_of[way])
        report.update(_ratios(report))
        report["model"] = _modelled(report, layout, analytic["ours"], rate_bits, options)
    finally:
        tear_down(group, testbed, workdir, previous)
    report["runtime_s"] = round(time.monotonic() - started, 1)
    return report


def _stage_engines(group: Group, *, staged: bool) -> None:
    """Switch every reference engine between live and staged mode (its ``/weightsync/stage``), between rounds."""
    from weightsync_agent.targets.engine_client import EngineClient

    for url in group.engine_urls.values():
        EngineClient(url, timeout=30, api_key=group.token).stage(staged)


def _way(rounds: list[TimedRound], bound_s: float | None) -> dict[str, Any]:
    total = Stats.of(r.total_s for r in rounds)
    return {
        **total.as_json(),
        # The policy the coordinator recorded (None: broadcast's sender records none).
        "pause_policy": rounds[-1].round.pause_policy,
        "round_s": Stats.of(r.round.seconds for r in rounds).median,
        "stage_s": Stats.of(r.stage_s for r in rounds).median,
        "pause_s": Stats.of(r.pause_s for r in rounds).median,
        "wire_bytes": rounds[-1].round.bytes,
        # The busiest trainer node's inbound bytes in the last round (the link counters): the emulated gather.
        "trainer_in_bytes": _trainer_in(rounds[-1].round.links),
        "bound_s": bound_s,
        "rounds_s": [round(r.total_s, 4) for r in rounds],
        # The coordinator's seconds per phase, median over rounds (p2p ways): where a round's time goes.
        "phases_s": {
            phase: round(Stats.of(r.round.phases[phase] for r in rounds).median, 4)
            for phase in rounds[0].round.phases
            if all(phase in r.round.phases for r in rounds)
        },
    }


def _modelled(
    report: Mapping[str, Any], layout: Any, analytic: Mapping[str, Any], rate_bits: int | None, options: Options
) -> dict[str, Any] | None:
    """The simulator's prediction of this run (docs/simulator.md, "Checked against the testbed"), beside it."""
    if rate_bits is None:
        return None  # no caps: the model has no link to model
    from weightsync_tools.simulate.testbed import predict, replicated_from_shard

    shard = max(analytic["target_bytes"].values())
    model_bytes = report["model_bytes"]
    predicted = predict(
        layout=(layout.trainers, layout.engines, layout.tp),
        model_bytes=model_bytes,
        replicated_bytes=replicated_from_shard(model_bytes, shard, layout.tp),
        rate_bits=rate_bits,
        bucket_bytes=options.bucket_mib * MiB,
        p2p_bucket_bytes=options.p2p_bucket * MiB,
        gather_shards=options.shards,
    )
    prediction, pauses = predicted.by_bench_way(), predicted.pauses_by_bench_way()
    modelled: dict[str, Any] = {
        way: {"modelled_s": round(prediction[way], 3), "error": round(prediction[way] / report[way]["median"] - 1, 3)}
        for way in WAYS
        if way in prediction  # the simulator models broadcast, Miles-style and ours (overlap)
    }
    for way, seconds in pauses.items():  # how long each way paused the engines (transfer.pause)
        measured = (report.get(way) or {}).get("pause_s")
        if measured:
            modelled[f"{way}_pause"] = {"modelled_s": round(seconds, 3), "error": round(seconds / measured - 1, 3)}
    return modelled


def _trainer_in(links: Mapping[tuple[str, str], int] | None) -> int | None:
    if links is None:
        return None
    return max((n for (node, way), n in links.items() if way == "in" and node.startswith("t")), default=0)


def _ratios(report: Mapping[str, Any]) -> dict[str, Any]:
    """The issue's targets, from the medians of one run (pure; ``report`` holds the three ways)."""
    ours, miles, broadcast = report["ours"], report["miles"], report["broadcast"]
    out: dict[str, Any] = {
        "ours_over_miles": ours["median"] / miles["median"],
        "broadcast_over_ours": broadcast["median"] / ours["median"],
        "ours_over_bound": None if ours["bound_s"] is None else ours["median"] / ours["bound_s"],
        # Staging alone and writing alone, as the Miles-style rounds measured them one after the other.
        "streaming_over_slower_half": ours["median"] / max(miles["stage_s"], miles["round_s"]),
        "overlap_pause_over_miles_pause": _over(ours.get("pause_s"), miles.get("pause_s")),
    }
    over = out["ours_over_bound"]
    out["targets"] = {
        "ours_over_miles_met": out["ours_over_miles"] <= OURS_OVER_MILES_MAX,
        "broadcast_over_ours_met": out["broadcast_over_ours"] >= BROADCAST_OVER_OURS_MIN,
        "ours_over_bound_met": None if over is None else over <= OURS_OVER_BOUND_MAX,
        "streaming_over_slower_half_met": out["streaming_over_slower_half"] <= STREAMING_OVER_SLOWER_HALF_MAX,
    }
    minimal, staged = report.get("ours_minimal"), report.get("ours_staged")
    if minimal is not None:  # pause: minimal, live engines: the pause of the write alone
        out["minimal_over_miles"] = minimal["median"] / miles["median"]
        out["minimal_pause_over_miles_pause"] = _over(minimal["pause_s"], miles.get("pause_s"))
        out["minimal_pause_over_bound"] = _over(minimal["pause_s"], minimal["bound_s"])
        out["targets"]["minimal_pause_over_miles_met"] = _at_most(out["minimal_pause_over_miles_pause"],
                                                                  MINIMAL_PAUSE_OVER_MILES_MAX)  # fmt: skip
        out["targets"]["minimal_pause_over_bound_met"] = _at_most(out["minimal_pause_over_bound"],
                                                                  MINIMAL_PAUSE_OVER_BOUND_MAX)  # fmt: skip
    if staged is not None:
        out["staged_pause_s"] = staged["pause_s"]
        out["targets"]["staged_pause_met"] = staged["pause_s"] <= STAGED_PAUSE_MAX_S
    return out


def _over(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def _at_most(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _staging_line(shards: int) -> str:
    if shards <= 1:
        return "# staging: a copy of the full tensors into the replicas (no gather)"
    return (
        f"# staging: each rank gathers {shards - 1}/{shards} of every tensor over its node's link (shard groups of"
        f" {shards}), then copies it into its replicas; broadcast's sender holds full tensors (no gather)"
    )


def _met(flag: bool | None) -> str:
    return "-" if flag is None else ("met" if flag else "NOT met")


def table(report: Mapping[str, Any]) -> str:
    lay = report["layout"]
    how = "streaming" if report.get("ours_streams") else "stage, write"
    label = {
        **LABELS,
        "ours": f"ours (balanced, {how})",
        "ours_minimal": f"ours (balanced, {how})",
        "ours_staged": f"ours (balanced, {how}, staged)",
    }
    lines = [
        f"# scenario B: {lay['trainers']} trainer nodes -> {lay['engines']} engines x TP{lay['tp']} (one node per"
        f" engine rank); {report['model_bytes'] / MiB:.0f} MiB model (float32); bucket {report['bucket_mib']} MiB"
        f" (p2p ways {report.get('p2p_bucket_mib', report['bucket_mib'])} MiB);"
        " live rounds (the staged row: the engines' staging area)",
        f"# network: {report['network']}" + (f", {report['rate']} per link and direction" if report["rate"] else "")
        + (f", MTU {report['mtu']}" if report.get("mtu") else "")
        + f"; {report['machine']['cpus']} CPUs ({report['machine']['cpu']}), load {report['machine']['load']}",
        "# time: stage-to-commit (p2p ways) or the sender's round (broadcast); pause: longest engine pause (staged:"
        " the commit); policy: the pause policy the coordinator recorded",
        _staging_line(report.get("gather_shards") or 1),
        f"{'way':<40}{'policy':>8}{'rounds':>7}{'median s':>10}{'staging s':>10}{'round s':>9}{'pause s':>9}"
        f"{'bound s':>9}",
    ]  # fmt: skip
    for way in WAYS:
        row = report.get(way)
        if row is None:
            continue
        bound = "-" if row["bound_s"] is None else f"{row['bound_s']:.3f}"
        policy = row.get("pause_policy") or "-"
        lines.append(
            f"{label[way]:<40}{policy:>8}{row['n']:>7}{row['median']:>10.3f}{row['stage_s']:>10.3f}"
            f"{row['round_s']:>9.3f}{row['pause_s']:>9.3f}{bound:>9}"
        )
    t = report["targets"]
    lines.append(
        f"# ours / Miles-style = {report['ours_over_miles']:.2f} (<= {OURS_OVER_MILES_MAX}: "
        f"{_met(t['ours_over_miles_met'])}); broadcast / ours = {report['broadcast_over_ours']:.2f} "
        f"(>= {BROADCAST_OVER_OURS_MIN}: {_met(t['broadcast_over_ours_met'])})"
    )
    over = report["ours_over_bound"]
    lines.append(
        f"# ours / link bound = {'-' if over is None else f'{over:.2f}'} (<= {OURS_OVER_BOUND_MAX}: "
        f"{_met(t['ours_over_bound_met'])}); ours / max(staging alone, writing alone) = "
        f"{report['streaming_over_slower_half']:.2f} (<= {STREAMING_OVER_SLOWER_HALF_MAX}: "
        f"{_met(t['streaming_over_slower_half_met'])})"
    )
    if report.get("minimal_pause_over_miles_pause") is not None:
        lines.append(
            f"# pause: minimal / Miles-style = {report['minimal_pause_over_miles_pause']:.2f} (<= "
            f"{MINIMAL_PAUSE_OVER_MILES_MAX}: {_met(t.get('minimal_pause_over_miles_met'))}); minimal / link bound = "
            + ("-" if report.get("minimal_pause_over_bound") is None else f"{report['minimal_pause_over_bound']:.2f}")
            + f" (<= {MINIMAL_PAUSE_OVER_BOUND_MAX}: {_met(t.get('minimal_pause_over_bound_met'))}); overlap / "
            f"Miles-style = {report['overlap_pause_over_miles_pause'] or 0:.2f}"
        )
    if report.get("staged_pause_s") is not None:
        lines.append(f"# pause: staged targets {report['staged_pause_s']:.3f} s per round (<= {STAGED_PAUSE_MAX_S} s: "
                     f"{_met(t.get('staged_pause_met'))})")  # fmt: skip
    lines += cpu.table_lines(report.get("cpu") or {})
    if report.get("bit_exact") is not None:
        lines.append(f"# bit-exact on every target after every way: {report['bit_exact']}")
    model = report.get("model")
    if model:
        lines.append(
            "# the simulator's prediction (docs/simulator.md): "
            + ", ".join(f"{way} {m['modelled_s']:.2f} s ({m['error']:+.0%})" for way, m in model.items())
        )
    lines.append(f"# runtime {report['runtime_s']:.0f} s")
    return "\n".join(lines)
