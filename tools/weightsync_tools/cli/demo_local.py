"""``weightsync demo --local``: the data plane on one machine, no cluster.

Starts the example group as local processes (reference engines, one ``weightsync agent`` per trainer
pod; :class:`~weightsync_testing.loopback_group.LoopbackGroup`), then trains the reference model for a few
steps (real gradient steps on a toy next-token task) and syncs after each: every trainer rank stages
the full tensors into its replica and publishes, rank 0's agent runs the round. After each round the
engines' outputs are compared with the trainer's own forward pass. Optionally engines join at the end
and get the committed version from the replicas.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from weightsync.api.load import parse_group
from weightsync_tools.cli.demo_steps import StepError, check_data_plane, cleanup, step
from weightsync_tools.cli.plan_view import render_plan

PROMPT = [3, 14, 15, 92, 65, 35, 7, 8, 41, 59]


@dataclass
class StepRow:
    version: int
    loss: float
    result: str
    seconds: float
    bytes: int
    gbps: float
    attempts: int
    max_diff: float
    note: str = ""


def train_step(full: dict[str, Any], step: int, lr: float = 0.05) -> tuple[dict[str, Any], float]:
    """One SGD step of the reference model on a fixed toy sequence (next-token cross-entropy)."""
    import torch

    from weightsync_testing.reference_engine.model import forward_full

    params = {name: t.detach().clone().requires_grad_(True) for name, t in full.items()}
    tokens = PROMPT[step % 3 :] + PROMPT[: step % 3]
    logits = forward_full(params, tokens[:-1])
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:]))
    loss.backward()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        updated = {n: (p - lr * p.grad).detach() for n, p in params.items() if p.grad is not None}
    return updated, float(loss.detach())


def run_local_demo(example: Path, *, steps: int, join: int, console: Console, staging: str | None = None) -> int:
    """The demo; a failure raises :class:`~weightsync_tools.cli.demo_steps.StepError` naming its step."""
    with step(f"read {example}"):
        obj = yaml.safe_load(example.read_text())
        obj.setdefault("metadata", {}).setdefault("namespace", "local")
        if staging:
            obj["spec"].setdefault("transfer", {})["targetStaging"] = staging
        group = parse_group(obj)
    check_data_plane()
    spec = group.spec
    name = group.metadata.name
    inference = spec.inference
    layout = f"{spec.trainer.replicas} trainer ranks → {inference.engines} engines × TP{inference.ranks_per_engine}"
    starting = f"starting {layout}: reference engines and agents as local processes"
    with step(starting), console.status(f"[bold]{starting}[/]…"):
        from weightsync_testing.loopback_group import LoopbackGroup
        from weightsync_testing.reference_engine.model import full_state

        started = time.monotonic()
        local = LoopbackGroup(spec, group=name).start()
    console.print(f"[green]✓[/] {layout} up [dim]({time.monotonic() - started:.1f} s; logs in {local.workdir})[/]")
    rows: list[StepRow] = []
    failure: BaseException | None = None
    try:
        with step("show the plan"):
            render_plan(local.plan, console)
        training = f"train the reference model {steps} steps, sync after each"
        with step(training):
            clients = [local.client(rank) for rank in range(local.plan.layout.sources)]
            full = full_state(seed=0)
            with Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=console,
            ) as progress:
                task = progress.add_task("train + sync", total=steps)
                for version in range(1, steps + 1):
                    full, loss = train_step(full, version)
                    outcomes = publish_all(clients, full, version)
                    first = outcomes[0]
                    result = getattr(first, "round", None)
                    succeeded = result is not None and result.result == "Succeeded"
                    diff = max_logit_diff(local.engines.values(), full) if succeeded else float("nan")
                    rows.append(
                        StepRow(
                            version,
                            loss,
                            result.result if result else "Error",
                            result.duration_seconds if result else 0.0,
                            result.bytes if result else 0,
                            result.gbps if result else 0.0,
                            result.attempts if result else 0,
                            diff,
                            (result.reason or "") if result else str(first),
                        )
                    )
                    progress.advance(task)
            console.print(_table(rows))
        bad = next((r for r in rows if r.result != "Succeeded" or not r.max_diff <= MAX_DIFF), None)
        if bad is not None:
            raise StepError(training, _row_failure(bad))
        if join:
            total = spec.inference.engines + join
            joining = f"{join} engine(s) join: replan, catch up from the replicas"
            with step(joining), console.status(f"[bold]{joining}[/]…"):
                started = time.monotonic()
                plan = local.scale_engines(total)
                local.wait_built(120, plan_hash=plan.hash)
                joined = {e: local.engines[e].client() for e in range(spec.inference.engines, total)}
                deadline = time.monotonic() + 120
                while any(c.weight_version() != str(steps) for c in joined.values()):
                    if time.monotonic() > deadline:
                        raise TimeoutError("joining engines did not catch up within 120 s")
                    time.sleep(0.2)
                diff = max_logit_diff(local.engines.values(), full)
            console.print(
                f"[green]✓[/] engines {sorted(joined)} hold version {steps} "
                f"[dim]({time.monotonic() - started:.1f} s, max |logit diff| {diff:.2e})[/]"
            )
            if not diff <= MAX_DIFF:
                raise StepError(joining, f"engine outputs differ from the trainer's (max |logit diff| {diff:.2e})")
        for client in clients:
            client.close()
    except BaseException as exc:
        failure = exc
        raise
    finally:
        with cleanup("stop the local processes", failure):
            local.stop()
    console.print("[green]engine outputs match the trainer after every sync[/]")
    return 0


#: Largest |logit| difference between an engine and the trainer that still counts as the same weights.
MAX_DIFF = 1e-4


def _row_failure(row: StepRow) -> str:
    if row.result != "Succeeded":
        return f"sync of version {row.version}: {row.result}" + (f": {row.note}" if row.note else "")
    return f"after version {row.version} engine outputs differ from the trainer's (max |logit diff| {row.max_diff:.2e})"


def publish_all(clients: list[Any], full: dict[str, Any], version: int) -> list[Any]:
    """Every trainer rank stages and publishes concurrently (publish is a collective over the ranks)."""
    outcomes: list[Any] = [None] * len(clients)

    def rank(i: int) -> None:
        try:
            clients[i].stage_many(full)
            outcomes[i] = clients[i].publish(version, check=False)
        except Exception as exc:  # shown in the table
            outcomes[i] = exc

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def max_logit_diff(engines: Iterable[Any], full: dict[str, Any]) -> float:
    """Largest |logit| difference between each engine's forward pass and the trainer's own, on PROMPT."""
    import torch

    from weightsync_testing.reference_engine.model import forward_full

    reference = forward_full(full, PROMPT)
    return max(
        (float((torch.tensor(engine.client().forward(PROMPT)) - reference).abs().max()) for engine in engines),
        default=0.0,
    )


def _table(rows: list[StepRow]) -> Table:
    table = Table(title="sync rounds (one per training step)")
    for column in ("version", "loss", "result", "seconds", "bytes", "Gbit/s", "attempts", "max |logit diff|"):
        table.add_column(column, justify="right")
    for r in rows:
        colour = "green" if r.result == "Succeeded" else "red"
        table.add_row(
            str(r.version),
            f"{r.loss:.4f}",
            f"[{colour}]{r.result}[/]" + (f" {r.note}" if r.note and r.result != "Succeeded" else ""),
            f"{r.seconds:.3f}",
            f"{r.bytes:,}",
            f"{r.gbps:.2f}",
            str(r.attempts),
            f"{r.max_diff:.2e}",
        )
    return table
