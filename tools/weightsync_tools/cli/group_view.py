"""``weightsync status GROUP`` and ``weightsync rounds GROUP``: a group's state and its last rounds, read from the
cluster with the user's kubeconfig (``get`` on the WeightSyncGroup is all they need).

What they show is the group's ``status`` as the operator wrote it (``lastSync`` and ``recentSyncs``: per-phase
seconds, the engines' pause window, the slowest source and target), so it is what ``kubectl get wsg -o yaml``
holds, laid out for reading. The rendering is pure (:func:`status_view`, :func:`rounds_view`); the commands only
fetch and print.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import typer
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from weightsync.api.v1alpha1 import GROUP, PLURAL, VERSION
from weightsync_tools.cli.kube_access import API_TIMEOUT_SECONDS, call, check_names, custom_objects_api

PHASE_ORDER = ("prepare", "pause", "begin", "write", "verify", "commit", "resume")
RESULT_STYLE = {"Succeeded": "green", "Failed": "red", "Aborted": "yellow"}

GroupArg = Annotated[str, typer.Argument(help="The WeightSyncGroup.", show_default=False)]
NamespaceOpt = Annotated[str, typer.Option("--namespace", "-n", help="The group's namespace.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
ContextOpt = Annotated[str | None, typer.Option(help="The kubeconfig context to use.")]


# --- Pure rendering -------------------------------------------------------------------------------------


def size(nbytes: Any) -> str:
    if not isinstance(nbytes, int | float):
        return "-"
    value = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def seconds(value: Any) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def peer_line(peer: Mapping[str, Any] | None) -> str:
    if not peer:
        return "-"
    return f"{peer.get('peer')}: {size(peer.get('bytes'))} in {seconds(peer.get('seconds'))} ({peer.get('gbps')} Gb/s)"


def phases_line(phases: Mapping[str, Any] | None) -> str:
    if not phases:
        return "-"
    return " · ".join(f"{p} {seconds(phases[p])}" for p in PHASE_ORDER if p in phases)


def round_lines(sync: Mapping[str, Any]) -> list[Text]:
    """A round (a ``lastSync`` or ``recentSyncs`` item) as a few labelled lines."""
    result = str(sync.get("result", "?"))
    head = Text.assemble(
        f"v{sync.get('version')} ",
        (result, RESULT_STYLE.get(result, "")),
        f" at {sync.get('startedAt', '?')} in {seconds(sync.get('durationSeconds'))}, {size(sync.get('bytes'))}",
        f" ({sync.get('gbps', '-')} Gb/s)",
    )
    lines = [head]
    if sync.get("pausedSeconds") is not None:
        paused = seconds(sync["pausedSeconds"])
        policy = f" (pause: {sync['pausePolicy']})" if sync.get("pausePolicy") else ""
        still = ", still paused" if sync.get("enginesPaused") else ""
        lines.append(Text(f"  engines paused {paused}{policy}{still}"))
    lines.append(Text(f"  phases: {phases_line(sync.get('phases'))}"))
    lines.append(Text(f"  slowest source: {peer_line(sync.get('slowestSource'))}"))
    lines.append(Text(f"  slowest target: {peer_line(sync.get('slowestTarget'))}"))
    if sync.get("reason"):
        lines.append(Text(f"  reason: {sync['reason']}", style="red" if result != "Succeeded" else ""))
    return lines


def status_view(obj: Mapping[str, Any]) -> RenderableType:
    """A WeightSyncGroup's state: phase, pods, how engine ranks are synced, plan, conditions and its last round."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    trainers, engines = status.get("trainers") or {}, status.get("engines") or {}
    plan = status.get("plan") or {}
    mode = (spec.get("transfer") or {}).get("mode", "p2p")
    parts: list[RenderableType] = [
        Text.assemble(
            (f"{meta.get('namespace', '?')}/{meta.get('name', '?')}", "bold"),
            f"  phase {status.get('phase') or '-'}  version {status.get('weightVersion', '-')}  mode {mode}",
        ),
        Text(
            f"trainers {trainers.get('ready', 0)}/{trainers.get('desired', 0)} ready, "
            f"engines {engines.get('ready', 0)}/{engines.get('desired', 0)} ready, plan {plan.get('hash', '-')}"
        ),
    ]
    paths = engines.get("syncPaths")
    if paths:
        traced, replicated = paths.get("trace", 0), paths.get("engineReplica", 0)
        parts.append(
            Text(
                f"engine ranks synced: {traced} by the trace (cut from the trainer's tensors), {replicated} through "
                "an engine replica (the engine's own loader on the sources)"
            )
        )
    conditions = status.get("conditions") or []
    if conditions:
        table = Table("condition", "status", "reason", "message", box=None, pad_edge=False)
        for c in conditions:
            table.add_row(str(c.get("type")), str(c.get("status")), str(c.get("reason", "")), str(c.get("message", "")))
        parts.append(table)
    last = status.get("lastSync")
    parts.append(Text("last round:", style="bold"))
    parts.extend(round_lines(last) if last else [Text("  none yet")])
    return Group(*parts)


def rounds_view(syncs: Sequence[Mapping[str, Any]]) -> RenderableType:
    """The group's recent rounds, newest first, one row each."""
    if not syncs:
        return Text("no rounds yet")
    table = Table("version", "result", "started", "seconds", "bytes", "Gb/s", "paused", "pause", *PHASE_ORDER[3:6],
                  "slowest target", "reason")  # fmt: skip
    for sync in reversed(syncs):
        phases = sync.get("phases") or {}
        result = str(sync.get("result", "?"))
        table.add_row(
            str(sync.get("version")),
            Text(result, style=RESULT_STYLE.get(result, "")),
            str(sync.get("startedAt", "-")),
            seconds(sync.get("durationSeconds")),
            size(sync.get("bytes")),
            str(sync.get("gbps", "-")),
            seconds(sync.get("pausedSeconds")),
            str(sync.get("pausePolicy") or "-"),
            *(seconds(phases.get(p)) for p in PHASE_ORDER[3:6]),
            peer_line(sync.get("slowestTarget")),
            str(sync.get("reason") or ""),
        )
    return table


# --- Commands -------------------------------------------------------------------------------------------


def fetch_group(group: str, namespace: str, context: str | None) -> dict[str, Any]:
    check_names(group=group, namespace=namespace)
    api = custom_objects_api(context)
    found: dict[str, Any] = call(
        lambda: api.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, group, _request_timeout=API_TIMEOUT_SECONDS
        ),
        f"WeightSyncGroup {namespace}/{group}",
        missing=f"no WeightSyncGroup {group} in namespace {namespace}",
    )
    return found


def status(group: GroupArg, namespace: NamespaceOpt = "default", as_json: JsonOpt = False,
           context: ContextOpt = None) -> None:  # fmt: skip
    """Show a group's phase, pods, plan, conditions and last round (per-phase seconds, the engines' pause window,
    the slowest source and target)."""
    obj = fetch_group(group, namespace, context)
    if as_json:
        typer.echo(json.dumps(obj.get("status") or {}, indent=2))
        return
    Console(soft_wrap=True).print(status_view(obj))


def rounds(group: GroupArg, namespace: NamespaceOpt = "default", as_json: JsonOpt = False,
           context: ContextOpt = None) -> None:  # fmt: skip
    """Show a group's last rounds (the status keeps ten), newest first: per-phase seconds, the engines' pause
    window, the slowest target, and why a round failed."""
    syncs = list((fetch_group(group, namespace, context).get("status") or {}).get("recentSyncs") or [])
    if as_json:
        typer.echo(json.dumps(list(reversed(syncs)), indent=2))
        return
    Console(width=200).print(rounds_view(syncs))
