"""The ``weightsync`` command line."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from weightsync import __version__

app = typer.Typer(
    name="weightsync",
    help="Declarative, verified RL weight synchronisation on Kubernetes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, soft_wrap=True)


def _register_subcommands() -> None:
    from weightsync_tools.cli.cluster_cmd import cluster_app
    from weightsync_tools.cli.group_view import rounds, status
    from weightsync_tools.cli.rotate_token import rotate_token

    app.add_typer(cluster_app, name="cluster")
    app.command("rotate-token")(rotate_token)
    app.command("status")(status)
    app.command("rounds")(rounds)


_register_subcommands()

GroupFile = Annotated[
    Path,
    typer.Option("-f", "--filename", help="YAML file with a WeightSyncGroup ('-' reads stdin).", show_default=False),
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"weightsync {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Declarative, verified RL weight synchronisation on Kubernetes."""


@app.command()
def crd(
    check: Annotated[
        list[Path] | None,
        typer.Option(help="Instead of printing, fail if these files differ from the generated CRD."),
    ] = None,
) -> None:
    """Print the WeightSyncGroup CustomResourceDefinition generated from the API models."""
    from weightsync.api.crd import render_crd

    text = render_crd()
    if not check:
        sys.stdout.write(text)
        return
    stale = [str(p) for p in check if not p.exists() or p.read_text() != text]
    if stale:
        err.print(f"[red]out of date:[/] {', '.join(stale)} (regenerate with `weightsync crd > FILE`)")
        raise typer.Exit(1)
    err.print(f"[green]up to date:[/] {', '.join(str(p) for p in check)}")


@app.command()
def reference() -> None:
    """Print the WeightSyncGroup field reference (Markdown), generated from the API models."""
    from weightsync.api.reference import render_reference

    sys.stdout.write(render_reference())


def _load_one(filename: Path) -> object:
    from weightsync.api.load import GroupFileError, SpecError, load_groups

    try:
        groups = load_groups(filename)
    except SpecError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    except GroupFileError as exc:
        err.print(f"[red]error:[/] cannot read {escape(str(filename))}: {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from exc
    if len(groups) > 1:
        err.print(f"[yellow]note:[/] {filename} holds {len(groups)} groups; using the first")
    return groups[0]


@app.command()
def validate(filename: GroupFile) -> None:
    """Check a WeightSyncGroup the way the API server (schema and CEL rules) and the operator (what its
    engine adapter can do) will, without a cluster."""
    from weightsync.api.engines import refusal
    from weightsync.api.load import GroupFileError, SpecError, load_groups

    try:
        groups = load_groups(filename)
    except SpecError as exc:
        err.print(f"[red]invalid:[/] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    except GroupFileError as exc:
        err.print(f"[red]error:[/] cannot read {escape(str(filename))}: {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from exc
    refused = False
    for group in groups:
        name = group.metadata.name or "<unnamed>"
        why = refusal(group.spec.inference.adapter, group.spec.transfer.request)
        if why is None:
            typer.echo(f"{name}: valid")
        else:
            refused = True
            err.print(f"[red]{escape(name)}: the operator will refuse it ({why.reason}):[/] {escape(why.message)}")
    if refused:
        raise typer.Exit(2)


@app.command()
def plan(
    filename: GroupFile,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the serialised plan, as stored in the ConfigMap.")
    ] = False,
) -> None:
    """Compute the transfer plan for a WeightSyncGroup and print it (no cluster needed)."""
    from weightsync.api.v1alpha1 import WeightSyncGroup
    from weightsync.plan import PlanError, plan_for
    from weightsync_tools.cli.plan_view import render_plan

    group = _load_one(filename)
    assert isinstance(group, WeightSyncGroup)
    try:
        result = plan_for(group.spec, group=group.metadata.name, namespace=group.metadata.namespace)
    except PlanError as exc:
        err.print(f"[red]cannot plan:[/] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    if as_json:
        sys.stdout.write(result.to_json() + "\n")
    else:
        render_plan(result, Console())


@app.command()
def render(
    filename: GroupFile,
    agent_image: Annotated[
        str, typer.Option(help="Agent image for groups that set no spec.agent.image.")
    ] = "ghcr.io/weightsync/weightsync-agent:" + __version__,
    output: Annotated[str, typer.Option("-o", "--output", help="yaml, or name (kind/name per line).")] = "yaml",
) -> None:
    """Print every object the operator would create for a WeightSyncGroup (YAML), without a cluster."""
    import yaml

    from weightsync.api.v1alpha1 import WeightSyncGroup
    from weightsync.plan import PlanError, plan_for
    from weightsync_operator.builders.common import BuildError, BuildOptions
    from weightsync_operator.builders.desired import desired_state

    group = _load_one(filename)
    assert isinstance(group, WeightSyncGroup)
    if not group.metadata.uid:
        # Owner references need the group's uid, which only the API server assigns.
        group = group.model_copy(update={"metadata": group.metadata.model_copy(update={"uid": "<group-uid>"})})
    try:
        result = plan_for(group.spec, group=group.metadata.name, namespace=group.metadata.namespace)
        state = desired_state(group, result, BuildOptions(agent_image=agent_image))
    except (PlanError, BuildError) as exc:
        err.print(f"[red]cannot render:[/] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    if output == "name":
        for obj in state.objects():
            typer.echo(f"{obj['kind'].lower()}/{obj['metadata']['name']}")
    else:
        sys.stdout.write(yaml.safe_dump_all(state.objects(), sort_keys=False, width=120))


DEMO_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tcp-group.yaml"  # --local's default
DEMO_DIR = Path(os.environ.get("WEIGHTSYNC_DEMO_DIR", Path.home() / ".cache" / "weightsync" / "demo-cluster"))


class DemoEngine(StrEnum):
    """``weightsync demo --engine``: what serves on the engine pods (``localcluster.demo_engines``)."""

    reference = "reference"
    sglang = "sglang"
    vllm = "vllm"


@app.command()
def demo(
    example: Annotated[
        Path | None,
        typer.Option(
            "-f", "--filename", help="The group to run (default: examples/tcp-group.yaml).", show_default=False
        ),
    ] = None,
    engine: Annotated[
        DemoEngine,
        typer.Option(
            help="The engine on the engine pods: the built-in reference engine, or stock SGLang 0.5.23 or vLLM 0.32.0 "
            "on CPU (their pinned venv is built the first time: ~2.5 min and 6.2 GB each, cached; the example "
            "group examples/<engine>-group.yaml runs shrunk to one CPU machine, without the scale step)."
        ),
    ] = DemoEngine.reference,
    scale_to: Annotated[int, typer.Option(min=1, max=8, help="Engines to scale to once the group is Ready.")] = 3,
    directory: Annotated[Path, typer.Option("--dir", help="Where the demo cluster keeps its state.")] = DEMO_DIR,
    keep: Annotated[bool, typer.Option(help="Leave the cluster, operator and agents running.")] = False,
    local: Annotated[
        bool, typer.Option("--local", help="No cluster: engines and agents as local processes, train and sync.")
    ] = False,
    steps: Annotated[int, typer.Option(min=1, max=100, help="--local: training steps, one sync each.")] = 4,
    join: Annotated[int, typer.Option(min=0, max=4, help="--local: engines that join at the end.")] = 1,
    staging: Annotated[
        str | None, typer.Option(help="--local: override transfer.targetStaging (live or staged).")
    ] = None,
) -> None:
    """Run the main job: on an embedded local cluster (chart, operator, group, agents, sync rounds, a replan),
    or with --local as plain processes (train the reference model, sync after every step, check outputs).
    A failure prints one line: the step, its cause and a log file with the details."""
    from weightsync_tools.cli.demo_steps import run_reporting, step

    stock = engine is not DemoEngine.reference
    if stock and (local or example is not None):
        raise typer.BadParameter(
            f"--engine {engine.value} runs examples/{engine.value}-group.yaml on the local cluster: "
            "-f and --local are for the reference engine"
        )
    if local:
        if staging not in (None, "live", "staged"):
            raise typer.BadParameter("--staging must be live or staged")
        group_file = (example or DEMO_EXAMPLE).resolve()

        def local_demo() -> int:
            with step("load the local demo"):
                from weightsync_tools.cli.demo_local import run_local_demo
            return run_local_demo(group_file, steps=steps, join=join, console=Console(), staging=staging)

        raise typer.Exit(run_reporting("weightsync demo --local", local_demo))

    def cluster_demo() -> int:
        with step("load the demo"):
            from weightsync_tools.localcluster.demo import run_demo
        return run_demo(
            directory,
            example=example.resolve() if example else None,
            scale_to=scale_to,
            keep=keep,
            console=Console(),
            engine=engine.value,
        )

    raise typer.Exit(run_reporting("weightsync demo", cluster_demo))


@app.command()
def operator(
    namespace: Annotated[
        list[str] | None,
        typer.Option("--namespace", "-n", help="Watch only these namespaces (default: all)."),
    ] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Serve Prometheus metrics on this port.")] = None,
    liveness: Annotated[str | None, typer.Option(help="Liveness endpoint, e.g. http://0.0.0.0:8080/healthz.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run the operator (kopf) against the current kubeconfig or in-cluster credentials."""
    from weightsync_operator.main import run

    run(namespaces=namespace or None, liveness=liveness, metrics_port=metrics_port, verbose=verbose)


@app.command()
def agent(
    plan_file: Annotated[
        Path | None, typer.Option(help="Read the plan from this file instead of the group's ConfigMap.")
    ] = None,
) -> None:
    """Run a weightsync agent (sidecar) configured from its environment."""
    if importlib.util.find_spec("torch") is None:
        # The agent image built with TORCH=node has no torch of its own (agent/Dockerfile): one line, not a traceback.
        typer.echo(
            "weightsync agent: torch is not installed (pip install 'weightsync[agent]'; an agent image built with "
            f"TORCH=node needs the node's Python {sys.version_info.major}.{sys.version_info.minor} site-packages "
            "mounted at /opt/weightsync/node-python)",
            err=True,
        )
        raise typer.Exit(2)
    from weightsync_agent.sidecar.main import run

    raise typer.Exit(run(plan_file=plan_file))


@app.command()
def bench(
    scenario: Annotated[
        str,
        typer.Option(
            help="A = 4 trainer nodes -> 2 engines x TP2 (p2p vs broadcast, and a sweep); "
            "B = 8 trainer nodes -> 4 engines x TP2 (broadcast vs Miles-style vs ours); "
            "scale = the control plane with 1,000+ pods on the local cluster (stand-in agents; docs/scale.md)."
        ),
    ] = "A",
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    no_caps: Annotated[
        bool, typer.Option("--no-caps", help="No namespaces or caps: every process on loopback (no root needed).")
    ] = False,
    rate: Annotated[
        str | None, typer.Option(help="Link rate per node and direction, tc units (default: A 1gbit, B 500mbit).")
    ] = None,
    rounds: Annotated[int | None, typer.Option(help="Rounds per mode (default 5, --quick 3).")] = None,
    repeat: Annotated[
        int,
        typer.Option(
            min=1,
            max=50,
            help="Runs of the scenario, each on a fresh testbed: every ratio's median and spread (min-max) over them; "
            "a run the CPU bound lowers the rate and starts the runs again (docs/testbed.md).",
        ),
    ] = 3,
    against: Annotated[
        Path | None,
        typer.Option(
            help="A previous run's --json output: say whether every median is within 10 % of its median there "
            "(the same command twice should agree).",
        ),
    ] = None,
    mib: Annotated[int | None, typer.Option(help="Model size in MiB (default: the scenario's, 512).")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="PNG of time vs engines (default weightsync-bench-<scenario>.png).")
    ] = None,
    sweep: Annotated[
        str | None, typer.Option(help="Engine counts of the plot's sweep, e.g. 1-8 or 1,2,4,8 ('' = no sweep).")
    ] = None,
    sweep_mib: Annotated[int | None, typer.Option(help="Model size of the sweep (default 128, --quick 64).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="3 rounds; sweep 1,2,4,8 with a 64 MiB model.")] = False,
    gather_shards: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Trainer shard-group size S: a rank receives (S-1)/S of every tensor over its node's link before "
            "staging it, the emulated all-gather (default: A 1 = none, B 2; docs/testbed.md).",
        ),
    ] = None,
    p2p_bucket_mib: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=1024,
            help="Bucket size of the p2p ways in MiB (default: A 64, B 8; a streamed round drains its last bucket "
            "after the trainer staged it; docs/testbed.md).",
        ),
    ] = None,
    mtu: Annotated[
        int,
        typer.Option(
            min=576,
            max=9000,
            help="MTU of every emulated link (tbf charges each segment's headers: 1500 leaves a TCP stream 0.956 of "
            "the rate; docs/testbed.md).",
        ),
    ] = 9000,
    pods: Annotated[
        str, typer.Option(help="scale: group sizes in pods, in order (multiples of 16); the last is scaled out.")
    ] = "256,1024",
    idle_seconds: Annotated[float, typer.Option(help="scale: the idle window the audit log is counted over.")] = 30.0,
    cluster_dir: Annotated[
        Path | None, typer.Option(help="scale: where the local cluster lives (removed first).")
    ] = None,
) -> None:
    """Emulated multi-node benchmark: p2p vs broadcast vs the link bound (namespaces + tc caps; needs root);
    ``--scenario scale``: the control plane at 1,000+ pods on the local cluster."""
    if scenario.lower() == "scale":
        from weightsync_tools.cli.bench_scale import parse_sizes, render, run_scale

        try:
            sizes = parse_sizes(pods)
            where = cluster_dir or Path.home() / ".cache" / "weightsync" / "bench-scale"
            report_scale = run_scale(where, sizes, err, idle_seconds=idle_seconds)
        except ValueError as exc:
            err.print(f"[red]error:[/] {escape(str(exc))}")
            raise typer.Exit(1) from exc
        if json_output:
            typer.echo(report_scale.to_json())
        else:
            render(report_scale, Console())
        return
    from weightsync_tools.testbed import runner
    from weightsync_tools.testbed.netns import NetnsUnavailableError
    from weightsync_tools.testbed.repeat import agreement, agreement_lines, run_repeated, summary_table
    from weightsync_tools.testbed.runner import Options
    from weightsync_tools.testbed.scenario import parse_points

    try:
        previous = None if against is None else json.loads(against.read_text())["summary"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        err.print(f"[red]error:[/] --against {escape(str(against))}: not a `weightsync bench --json` output ({exc})")
        raise typer.Exit(1) from exc
    try:
        points = parse_points(sweep if sweep is not None else ("1,2,4,8" if quick else "1-8")) if sweep != "" else []
        options = Options(
            scenario=scenario.upper(),
            caps=not no_caps,
            rate=rate,
            rounds=rounds or (3 if quick else 5),
            mib=mib,
            sweep=points,
            sweep_mib=sweep_mib or (64 if quick else 128),
            plot=(plot or Path(f"weightsync-bench-{scenario.upper()}.png")) if points else None,
            gather_shards=gather_shards,
            p2p_bucket_mib=p2p_bucket_mib,
            mtu=mtu,
        )

        def say(line: str) -> None:
            err.print(escape(line), highlight=False)

        if options.scenario == "B":
            from weightsync_tools.testbed import three_ways

            run_scenario, show, metrics = three_ways.run, three_ways.table, three_ways.METRICS
        else:
            run_scenario, show, metrics = runner.run, runner.table, runner.METRICS
        calls = 0

        def run_once(opts: Options) -> dict[str, Any]:
            nonlocal calls
            calls += 1  # scenario A's sweep and plot: with the first run only
            report = run_scenario(opts if calls == 1 else dataclasses.replace(opts, sweep=[], plot=None), say)
            if not json_output:
                typer.echo(show(report))
            return report

        reports, summary = run_repeated(run_once, options, repeat, metrics, say)
    except NetnsUnavailableError as exc:
        err.print(f"[yellow]skipped:[/] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    except ValueError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(1) from exc
    agreed = None if previous is None else agreement(summary["metrics"], previous.get("metrics") or {})
    if json_output:
        typer.echo(json.dumps({"runs": reports, "summary": summary, "against": agreed}, indent=1))
    else:
        typer.echo(summary_table(summary, metrics))
        if agreed is not None:
            typer.echo("\n".join(agreement_lines(agreed, metrics, str(against))))


@app.command()
def simulate(
    preset: Annotated[
        str, typer.Option(help="kimi-k2, glm-5, qwen3-235b, or all (the published configurations, notes §1.10).")
    ] = "all",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the result (with a per-phase breakdown) as JSON.")
    ] = False,
    scale: Annotated[
        int, typer.Option(min=1, max=64, help="Multiply trainer and inference nodes (same TP/PP/EP).")
    ] = 1,
    plot: Annotated[
        Path | None, typer.Option(help="Also write a PNG: broadcast vs Miles P2P vs ours at 1x, 2x, 4x.")
    ] = None,
    nics_per_node: Annotated[int | None, typer.Option(min=1, help="NICs per node [8].")] = None,
    nic_gbps: Annotated[float | None, typer.Option(min=0.001, help="Gb/s per NIC [400].")] = None,
    rdma_efficiency: Annotated[
        float | None, typer.Option(min=0.001, max=1, help="RDMA share of line rate [0.475].")
    ] = None,
    nccl_efficiency: Annotated[
        float | None, typer.Option(min=0.001, max=1, help="NCCL share of line rate [0.92].")
    ] = None,
    bucket_mib: Annotated[float | None, typer.Option(min=1, help="Bucket size in MiB [1024].")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Any other hardware constant, NAME=VALUE (see docs/simulator.md).")
    ] = None,
    testbed: Annotated[
        str | None,
        typer.Option(
            help="Model the emulated testbed instead (A, B, B-no-gather: docs/testbed.md), against its measurement."
        ),
    ] = None,
) -> None:
    """Model one weight sync at cluster scale with the real planner: NCCL broadcast, Miles P2P and ours."""
    import json
    from dataclasses import fields

    from weightsync_tools.simulate import H100_IB, PRESETS, SCENARIOS, simulate
    from weightsync_tools.simulate.view import breakdown_table, hardware_dict, summary_table

    if testbed is not None:
        _simulate_testbed(testbed, as_json)
        return

    names = list(PRESETS) if preset == "all" else [preset]
    if any(name not in SCENARIOS for name in names):
        raise typer.BadParameter(
            f"unknown preset {preset!r}; choose from {', '.join(PRESETS)} or all", param_hint="--preset"
        )
    overrides: dict[str, float | int | None] = {
        "nics_per_node": nics_per_node,
        "nic_gbps": nic_gbps,
        "rdma_efficiency": rdma_efficiency,
        "nccl_efficiency": nccl_efficiency,
        "bucket_bytes": None if bucket_mib is None else bucket_mib * 1024**2,
    }
    kinds = {f.name: f.type for f in fields(H100_IB)}
    for item in set_ or []:
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in kinds or not value:
            raise typer.BadParameter(
                f"{item!r}: expected NAME=VALUE, NAME one of {', '.join(kinds)}", param_hint="--set"
            )
        try:
            overrides[key] = int(value) if kinds[key] in (int, "int") else float(value)
        except ValueError as exc:
            raise typer.BadParameter(f"{item!r}: {value!r} is not a number", param_hint="--set") from exc
    try:
        hw = H100_IB.with_overrides(**overrides)
        sims = [simulate(SCENARIOS[name].scaled(scale), hw) for name in names]
    except ValueError as exc:
        err.print(f"[red]cannot simulate:[/] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    if as_json:
        payload: dict[str, object] = sims[0].to_dict() if len(sims) == 1 else {"results": [s.to_dict() for s in sims]}
        payload["hardware"] = hardware_dict(hw)
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
    else:
        console = Console()
        console.print(summary_table(sims))
        if len(sims) == 1:
            console.print(breakdown_table(sims[0]))
    if plot is not None:
        from weightsync_tools.simulate.plot import sweep, write_plot

        write_plot(plot, sweep(names, hw))
        err.print(f"wrote {plot}")


def _simulate_testbed(name: str, as_json: bool) -> None:
    """``weightsync simulate --testbed``: the model with the testbed's constants, next to what was measured."""
    from weightsync_tools.simulate.testbed import TESTBED, TESTBED_RUNS
    from weightsync_tools.simulate.view import hardware_dict, testbed_dict, testbed_table

    if name not in TESTBED_RUNS:
        raise typer.BadParameter(
            f"unknown testbed {name!r}; choose from {', '.join(TESTBED_RUNS)}", param_hint="--testbed"
        )
    run = TESTBED_RUNS[name]
    if as_json:
        payload = testbed_dict(run, TESTBED)
        payload["hardware"] = hardware_dict(TESTBED)
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
    else:
        Console().print(testbed_table(run, TESTBED))


if __name__ == "__main__":
    app()
