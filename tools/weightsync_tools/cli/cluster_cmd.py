"""``weightsync cluster up|down|status``: the embedded local cluster."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

cluster_app = typer.Typer(
    help="A local Kubernetes cluster from real components (etcd, apiserver, kwok nodes).",
    no_args_is_help=True,
)
console = Console(stderr=True, soft_wrap=True)

DEFAULT_DIR = Path(os.environ.get("WEIGHTSYNC_CLUSTER_DIR", Path.home() / ".cache" / "weightsync" / "cluster"))
DirOption = Annotated[Path, typer.Option("--dir", help="Where the cluster keeps its state, PKI, etcd data and logs.")]


@cluster_app.command("up")
def up(
    directory: DirOption = DEFAULT_DIR,
    nodes: Annotated[int, typer.Option(min=1, max=64, help="Fake (kwok) nodes, each with 8 GPUs and RDMA.")] = 4,
    real_node: Annotated[
        bool,
        typer.Option(
            "--real-node",
            help="Also start a real node (kubelet, containerd, runc, CNI bridge; root only; docs/local-cluster.md).",
        ),
    ] = False,
) -> None:
    """Build (first time) or reuse the binaries and start the cluster; prints the kubeconfig path."""
    from weightsync_tools.localcluster import binaries
    from weightsync_tools.localcluster.cluster import ClusterError, LocalCluster

    console.print("[bold]control plane binaries[/] (built from Go modules on first use; cached afterwards)")
    found = binaries.ensure()
    node = None
    if real_node:
        from weightsync_tools.localcluster.realnode import build_node_binaries

        console.print("[bold]real node binaries[/] (kubelet, containerd, runc, CNI; built on first use)")
        node = build_node_binaries()
    try:
        state = LocalCluster(directory, found).up(nodes=nodes, real_node=node)
    except ClusterError as exc:
        console.print(f"[red]cluster did not start:[/] {exc}")
        raise typer.Exit(1) from exc
    extra = " and real-node-0" if state.real_node else ""
    console.print(f"[green]cluster up[/] in {state.startup_seconds} s at {state.server} with {nodes} kwok nodes{extra}")
    console.print(f"export KUBECONFIG={state.kubeconfig}")
    typer.echo(str(state.kubeconfig))


@cluster_app.command("down")
def down(directory: DirOption = DEFAULT_DIR) -> None:
    """Stop every process of the cluster (by PID)."""
    from weightsync_tools.localcluster import binaries
    from weightsync_tools.localcluster.cluster import LocalCluster

    stopped = LocalCluster(directory, binaries.ensure(quiet=True)).down()
    console.print(f"stopped: {', '.join(stopped) or 'nothing was running'}")


@cluster_app.command("status")
def status(directory: DirOption = DEFAULT_DIR) -> None:
    """Say whether the cluster in DIR is running."""
    from weightsync_tools.localcluster.cluster import ClusterState, _alive

    try:
        state = ClusterState.load(directory)
    except (OSError, ValueError):
        console.print(f"no cluster in {directory}")
        raise typer.Exit(1) from None
    for process in state.processes:
        console.print(f"{process.name:<24} pid {process.pid:<8} {'running' if _alive(process) else 'stopped'}")
    running = bool(state.processes) and all(_alive(p) for p in state.processes)
    if running:
        console.print(f"export KUBECONFIG={state.kubeconfig}")
    raise typer.Exit(0 if running else 1)
