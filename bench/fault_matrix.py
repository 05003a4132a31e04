"""The fault matrix (issue 26): every fault at every round phase it can hit, through real processes, with the invariants
checked per cell (a benchmark, not a test: about 8 minutes for its 70 cells on the 2-core machine; docs/faults.md).

One local group (``LoopbackGroup``: ``weightsync agent`` processes, one per trainer pod and one per engine pod,
reference engine processes, Mooncake TCP on loopback; 2 trainer ranks -> 2 engines x TP2, live rounds,
``timeoutSeconds`` from ``--timeout``) serves every cell; engine 1 is reached through a
:class:`~weightsync_testing.http_gate.Gate`, which places the fault exactly at a phase: before the engine's route of
that phase is forwarded (pause ``/pause_generation``, begin ``/weightsync/begin``, verify ``/weightsync/verify``, commit
``/weightsync/commit``, resume ``/continue_generation``), or, for write, once the engine answered its begin (open to
writes) and before the coordinator hears it. Faults:

- ``engine-kill``: engine 1's process SIGKILLed; restarted on its port after the round (initial weights, new addresses);
- ``engine-hang``: engine 1 SIGSTOPped; SIGCONT once the round gave up;
- ``engine-agent-kill``: engine 1's pod agent SIGKILLed; restarted after the round (as a kubelet restarts a sidecar);
- ``engine-agent-hang``: engine 1's pod agent SIGSTOPped; SIGCONT after the round (neither is on a round's path with
  the reference engine: the coordinator calls engines directly; the agent reports, and serves manifests to SGLang);
- ``source-kill``: trainer pod 1's agent (a source) SIGKILLed; restarted after the round;
- ``source-hang``: trainer pod 1's agent SIGSTOPped; SIGCONT once the round gave up;
- ``coordinator-kill``: trainer pod 0's agent (the coordinator) SIGKILLed; restarted after the round (it learns the
  committed version from the engines, and what its predecessor left open on them);
- ``coordinator-hang``: trainer pod 0's agent (the coordinator) SIGSTOPped for ``COORDINATOR_STOP`` seconds, within
  the round's budget (a coordinator stopped longer cannot end its round in time: it is the clock);
- ``link-down``: engine 1's data link (its Mooncake ports on loopback, both ways) passes nothing from the phase on,
  through the round's end (``tc``, ``weightsync_testing.link_fault``; root only);
- ``link-slow``: that link slowed to 1 % of a 1 Gbit/s link (``--link-rate``, default 10mbit) likewise;
- ``http-error``: engine 1's route of the phase answers 500;
- ``http-slow``: engine 1's route of the phase answers after ``--slow`` seconds;
- ``foreign-write``: a Mooncake peer outside the group writes garbage over a weight of engine 1 rank 0.

Per cell the faulted round runs (a new version), the fault is removed, one status period passes, the group is
observed (every engine's version, pause and bytes against the trainer's; the coordinator's committed version; the
status the operator folds from the agents' reports), then the next version is published (again until it lands, 3
times at most: the next cell needs a serving group; only the first counts as recovered) and the group observed again.
The checks are ``weightsync_testing.fault_matrix``'s. A progress line per cell goes to stderr, the table (or
``--json``) to stdout; the exit status is 1 when any invariant failed.

    python bench/fault_matrix.py [--faults engine-kill,http-error] [--phases verify,commit] [--timeout 10] [--json]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.client import WeightSyncClient
from weightsync_agent.rounds.remote import AgentClient
from weightsync_testing.agent_metrics import metric
from weightsync_testing.engine_harness import ReferenceEngines
from weightsync_testing.fault_matrix import PHASES, CellRun, EngineView, Snapshot, failed, judge, table, to_json
from weightsync_testing.foreign_write import ForeignWriter
from weightsync_testing.http_gate import Gate, GatedEngines
from weightsync_testing.link_fault import LinkFault, listening_ports
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.expected import rank_checksums
from weightsync_testing.reference_engine.model import full_state
from weightsync_testing.reported_status import EngineReport, ready_condition, reported_pods
from weightsync_testing.trainer_ranks import publish_all

TEMPLATE: dict[str, Any] = {"spec": {"containers": [{"name": "main", "image": "x"}]}}
GROUP = "faults"
ENGINE = 1  #: the faulted engine (engine 0 is the control)
SOURCE = 1  #: the faulted source (trainer rank 1; rank 0's agent coordinates)
TP = 2
BUCKET_MIB = 1
#: One status period: the agents' default tick (``WEIGHTSYNC_TICK_SECONDS``), within which an agent reports a change.
STATUS_PERIOD = 2.0
RECOVERY_ROUNDS = 3
#: How long ``coordinator-hang`` stops the coordinator (SIGSTOP, then SIGCONT).
COORDINATOR_STOP = 3.0
#: Where the gate places a fault per phase: (``before`` the route is forwarded | ``after`` the engine answered, route).
PLACES: Mapping[str, tuple[str, str]] = {
    "pause": ("before", "/pause_generation"),
    "begin": ("before", "/weightsync/begin"),
    "write": ("after", "/weightsync/begin"),
    "verify": ("before", "/weightsync/verify"),
    "commit": ("before", "/weightsync/commit"),
    "resume": ("before", "/continue_generation"),
}
#: The phases each fault applies to (an HTTP fault needs an engine call: the write phase makes none).
FAULTS: Mapping[str, tuple[str, ...]] = {
    "engine-kill": PHASES,
    "engine-hang": PHASES,
    "engine-agent-kill": PHASES,
    "engine-agent-hang": PHASES,
    "source-kill": PHASES,
    "source-hang": PHASES,
    "coordinator-kill": PHASES,
    "coordinator-hang": PHASES,
    # A link fault matters while sources write: struck later, it meets no transfer of the round.
    "link-down": ("pause", "begin", "write"),
    "link-slow": ("pause", "begin", "write"),
    "http-error": tuple(p for p in PHASES if p != "write"),
    "http-slow": tuple(p for p in PHASES if p != "write"),
    "foreign-write": PHASES,
}


@dataclass(frozen=True)
class Outcome:
    """A round as rank 0 heard it (``result`` ``error``: the publish itself failed)."""

    result: str
    reason: str | None
    seconds: float
    committed: bool = False
    engines_paused: bool = False
    attempts: int = 0
    status: dict[str, Any] | None = None

    @classmethod
    def heard(cls, outcome: object, started: float) -> Outcome:
        """What rank 0's publish returned (a round's outcome, or what it raised), ``started`` at ``time.monotonic``."""
        found = getattr(outcome, "round", None)
        if found is None:  # the publish itself failed (rank 0's agent gone, or no answer in time)
            return cls("error", str(outcome), time.monotonic() - started)
        return cls(found.result, found.reason, found.duration_seconds, found.committed, found.engines_paused,
                   found.attempts, found.as_status())  # fmt: skip


def held_label(labels: list[str], engine: int, sums: list[tuple[str, ...]]) -> str | None:
    """The newest of ``labels`` whose bytes every rank of ``engine`` holds (``sums``: its checksums per rank)."""
    for label in reversed(labels):
        if all(sums[rank] == expected(label, engine, rank) for rank in range(TP)):
            return label
    return None


class GatedReferenceEngines(GatedEngines, ReferenceEngines):
    """Reference engines, each behind a :class:`Gate` of its own (the same gate across restarts)."""


def spec(timeout: int) -> WeightSyncGroupSpec:
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {"engines": 2, "ranksPerEngine": TP, "ranksPerPod": TP, "adapter": "reference",
                          "template": TEMPLATE},
            "transfer": {"protocol": "tcp", "bucketSizeMiB": BUCKET_MIB, "timeoutSeconds": timeout,
                         "targetStaging": "live"},
        }
    )  # fmt: skip


def state(label: str, engine: int) -> dict[str, torch.Tensor]:
    """The trainer's full weights of version ``label``; ``default``: what engine ``engine`` starts with (its seed)."""
    return full_state(seed=engine if label == "default" else 1000 + int(label))


@cache
def expected(label: str, engine: int, rank: int) -> tuple[str, ...]:
    return tuple(rank_checksums(state(label, engine), rank, BUCKET_MIB << 20, TP))


class Once:
    """``action`` on the first call only (a route may be called once per rank, and again by a retry); a call made
    while it runs waits for it, so the fault is in place before any request of the route goes on (the other rank's
    verify included). ``fired``: it ran, so the cell knows what to restart."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action, self.fired, self.lock = action, False, threading.Lock()
        self.done = threading.Event()  # the action returned (or raised)

    def __call__(self) -> None:
        with self.lock:
            if not self.fired:
                self.fired = True
                try:
                    self.action()
                finally:
                    self.done.set()


class Matrix:
    def __init__(self, group: LoopbackGroup, harness: GatedReferenceEngines, *, slow: float, link_rate: str) -> None:
        self.group, self.harness, self.slow, self.link_rate = group, harness, slow, link_rate
        self.clients: list[WeightSyncClient] = [group.client(rank) for rank in range(2)]
        self.labels: list[str] = ["default"]  # every version published so far, for what an engine holds
        self.budget = float(group.spec.transfer.timeout_seconds)

    @property
    def gate(self) -> Gate:
        return self.harness.gates[ENGINE]

    def close(self) -> None:
        for client in self.clients:
            client.close()

    # --- Faults --------------------------------------------------------------------------------------

    def engine_pid(self) -> int:
        return self.harness.processes[ENGINE].process.pid

    @contextmanager
    def placed(self, fault: str, phase: str, notes: list[str]) -> Iterator[None]:
        """``fault`` armed at ``phase`` on engine 1's gate for the ``with`` block; removed (and what it broke
        restarted) on the way out."""
        when, route = PLACES[phase]
        arm = self.gate.before if when == "before" else self.gate.after
        writer: ForeignWriter | None = None
        link: LinkFault | None = None
        hook: Once | None = None
        if fault == "engine-kill":
            hook = Once(lambda: os.kill(self.engine_pid(), signal.SIGKILL))
        elif fault == "engine-hang":
            hook = Once(lambda: os.kill(self.engine_pid(), signal.SIGSTOP))
        elif fault == "engine-agent-kill":
            hook = Once(lambda: os.kill(self.group.engine_agents[ENGINE].process.pid, signal.SIGKILL))
        elif fault == "engine-agent-hang":
            hook = Once(lambda: os.kill(self.group.engine_agents[ENGINE].process.pid, signal.SIGSTOP))
        elif fault == "source-kill":
            hook = Once(lambda: os.kill(self.group.agents[SOURCE].process.pid, signal.SIGKILL))
        elif fault == "source-hang":
            source = self.group.agents[SOURCE].process.pid

            def stop_past_the_round() -> None:
                # Its trainer rank's own publish waits on it too: SIGCONT once the round must have ended (its
                # deadline, plus the grace a source caught writing gets), not after the publish returns.
                os.kill(source, signal.SIGSTOP)
                threading.Timer(self.budget + 3.0, os.kill, (source, signal.SIGCONT)).start()

            hook = Once(stop_past_the_round)
        elif fault == "coordinator-kill":
            hook = Once(lambda: os.kill(self.group.agents[0].process.pid, signal.SIGKILL))
        elif fault == "coordinator-hang":
            coordinator = self.group.agents[0].process.pid

            def stop_for_a_while() -> None:
                os.kill(coordinator, signal.SIGSTOP)
                threading.Timer(COORDINATOR_STOP, os.kill, (coordinator, signal.SIGCONT)).start()

            hook = Once(stop_for_a_while)
        elif fault in ("link-down", "link-slow"):
            ports = self.group.plan.transfer.mooncake_ports
            found = listening_ports(self.engine_pid(), range(ports.start, ports.end + 1))
            link = LinkFault(found, rate=None if fault == "link-down" else self.link_rate)
            hook = Once(link.install)
        elif fault == "http-error":
            self.gate.refuse(route, 500, f"injected by the fault matrix: {route} failed")
        elif fault == "http-slow":
            hook = Once(lambda: time.sleep(self.slow))
        elif fault == "foreign-write":
            manifest = self.group.engines[ENGINE].client().manifest(0)
            tensor = manifest.tensors[len(manifest.tensors) // 2]
            writer = ForeignWriter(manifest.session_id, tensor.address, tensor.nbytes)
            hook = Once(lambda: notes.append("foreign write " + ("landed" if writer.write() else "refused")))
        if hook is not None:
            arm(route, hook)
        try:
            yield
        finally:
            self.gate.before(route, None)
            self.gate.after(route, None)
            self.gate.refuse(route, None)
            if writer is not None:
                writer.close()
            if link is not None:
                link.remove()
            if hook is not None and hook.fired:
                self.repair(fault)
            elif hook is not None:
                notes.append("the fault never fired: the round did not reach its route")

    def repair(self, fault: str) -> None:
        if fault == "engine-hang":
            os.kill(self.engine_pid(), signal.SIGCONT)
        elif fault == "engine-agent-hang":
            os.kill(self.group.engine_agents[ENGINE].process.pid, signal.SIGCONT)
        elif fault == "engine-agent-kill":
            self.group.restart_engine_agent(ENGINE)
        elif fault == "source-hang":
            os.kill(self.group.agents[SOURCE].process.pid, signal.SIGCONT)
        elif fault == "coordinator-hang":
            os.kill(self.group.agents[0].process.pid, signal.SIGCONT)  # its timer's, once more (idempotent)
        elif fault == "engine-kill":
            self.group.restart_engine(ENGINE)
        elif fault in ("source-kill", "coordinator-kill"):
            pod = SOURCE if fault == "source-kill" else 0
            self.group.restart_agent(pod)
            self.clients[pod].close()
            self.clients[pod] = self.group.client(pod)  # a fresh trainer process: the old one's agent is gone

    # --- Rounds and observations ---------------------------------------------------------------------

    def publish(self, version: int) -> Outcome:
        """Round ``version`` from every rank, as rank 0 (the coordinator's own) hears it."""
        label = str(version)
        if label not in self.labels:
            self.labels.append(label)
        started = time.monotonic()
        wait = 3 * self.budget + 3 * self.slow + 60  # longer than any round that breaks its budget
        outcome = publish_all(self.clients, state(label, 0), version, timeout=wait + 30, publish_timeout=wait)[0]
        return Outcome.heard(outcome, started)

    def view(self, engine: int) -> EngineView:
        client = self.group.engines[engine].client(timeout=10)
        try:
            status = client.status()
            sums = [tuple(client.checksums(rank, BUCKET_MIB << 20)) for rank in range(TP)]
        except Exception:  # a dead engine: it answers nothing
            return EngineView(engine, answers=False)
        held = held_label(self.labels, engine, sums)
        return EngineView(engine, True, str(status["weight_version"]), bool(status["paused"]), held)

    def committed(self) -> int | None:
        value = AgentClient(self.group.agents[0].url, timeout=10, token=self.group.token).state()["committed"]
        return None if value is None else int(value)

    def reported_round(self) -> dict[str, Any] | None:
        state = AgentClient(self.group.agents[0].url, timeout=10, token=self.group.token).state()
        found = state.get("lastRound")
        return found if isinstance(found, dict) else None

    def snapshot(self, last_round: dict[str, Any] | None) -> Snapshot:
        engines = tuple(self.view(e) for e in sorted(self.group.engines))
        committed = self.committed()
        reports = {e.engine: EngineReport(e.answers, e.reported) for e in engines}
        alive = [agent.process.poll() is None for _, agent in sorted(self.group.agents.items())]
        pods = reported_pods(GROUP, self.group.spec, committed=committed, last_round=last_round, engines=reports,
                             trainers_ready=alive)  # fmt: skip
        ready, reason, _ = ready_condition(GROUP, self.group.spec, pods)
        return Snapshot(engines, committed, ready, reason)

    def catch_ups(self) -> dict[str, float]:
        url = self.group.agents[0].url
        return {r: metric(url, "weightsync_agent_rounds_total", kind="catch-up", result=r)
                for r in ("Succeeded", "Failed", "Aborted")}  # fmt: skip

    # --- One cell ------------------------------------------------------------------------------------

    def cell(self, fault: str, phase: str) -> CellRun:
        version = (self.committed() or 0) + 1
        notes: list[str] = []
        with self.placed(fault, phase, notes):
            faulted = self.publish(version)
        if faulted.attempts > 1:
            notes.append(f"{faulted.attempts} attempts")
        before = self.catch_ups()
        time.sleep(STATUS_PERIOD)
        caught = {r: n for r, n in self.catch_ups().items() if n > before[r]}
        if caught:
            notes.append(f"catch-up {next(iter(caught))}")
        # What the coordinator's pod shows now: its last report (a catch-up's since, or the faulted round's again
        # once the engines it could not resume serve).
        after = self.snapshot(self.reported_round() or faulted.status)
        # The next version, until it lands (what a stuck group needs to serve the next cell), counting the rounds.
        rounds, recovery = 1, self.publish(version + 1)
        while recovery.result != "Succeeded" and rounds < RECOVERY_ROUNDS:
            notes.append(f"recovery round {rounds}: {recovery.reason}")
            time.sleep(STATUS_PERIOD)  # what a failed round asks the agents to redo (refetch manifests) takes a tick
            rounds, recovery = rounds + 1, self.publish(version + 1)
        recovered = self.snapshot(recovery.status)
        run = CellRun(fault, phase, _peer(fault), version,
                      self.budget, faulted.result, faulted.reason, faulted.seconds, faulted.committed,
                      faulted.engines_paused, after, recovered, recovery.result, rounds, "; ".join(notes))  # fmt: skip
        return replace(run, verdicts=judge(run))


def _peer(fault: str) -> str:
    """Whom a failed round's reason must name: the faulted peer."""
    if fault.startswith("source-"):
        return f"source {SOURCE}"
    if fault == "coordinator-kill":  # the round died with it: its trainer can name only the agent that is gone
        return "weightsync agent"
    return "source 0" if fault.startswith("coordinator-") else f"engine {ENGINE}"


def cell_arguments(parser: argparse.ArgumentParser, faults: Mapping[str, tuple[str, ...]]) -> None:
    """The options every fault matrix takes: which cells, the group's budget, the output."""
    parser.add_argument("--faults", default=",".join(faults), help=f"comma-separated, of {', '.join(faults)}")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--timeout", type=int, default=10, help="the group's transfer.timeoutSeconds")
    parser.add_argument("--json", action="store_true", help="print the cells as JSON instead of the table")
    parser.add_argument("--json-out", type=Path, help="also write the cells as JSON to this file")


def chosen_cells(
    parser: argparse.ArgumentParser, args: argparse.Namespace, faults: Mapping[str, tuple[str, ...]]
) -> list[tuple[str, str]]:
    """The (fault, phase) cells ``args`` asks for, in matrix order; an unknown name is a usage error."""
    names, phases = args.faults.split(","), args.phases.split(",")
    unknown = [f for f in names if f not in faults] + [p for p in phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown faults or phases: {unknown}")
    return [(f, p) for f in names for p in faults[f] if p in phases]


def progress(index: int, total: int, started: float, run: CellRun) -> None:
    """One line per cell on stderr."""
    broken = [c for c, v in run.verdicts.items() if v != "ok"]
    print(f"[{index}/{total} {time.monotonic() - started:5.0f} s] {run.fault}@{run.phase}: {run.result} "
          f"in {run.seconds:.1f} s, {'ok' if not broken else 'FAILED ' + ','.join(broken)}"
          f"{' (' + run.note + ')' if run.note else ''}", file=sys.stderr, flush=True)  # fmt: skip


def finish(runs: list[CellRun], args: argparse.Namespace, started: float) -> int:
    """The table (or JSON) on stdout, every broken invariant on stderr; the exit status."""
    print(to_json(runs) if args.json else table(runs))
    if args.json_out is not None:
        args.json_out.write_text(to_json(runs))
    problems = failed(runs)
    for line in problems:
        print(line, file=sys.stderr)
    print(f"{len(runs)} cells, {len(problems)} broken invariants, {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    cell_arguments(parser, FAULTS)
    parser.add_argument("--slow", type=float, default=20.0, help="seconds an http-slow route is held")
    parser.add_argument("--link-rate", default="10mbit", help="a link-slow link's rate (tc's units)")
    parser.add_argument("--workdir", type=Path, help="keep the group's files (agents' logs) here")
    args = parser.parse_args(argv)
    cells = chosen_cells(parser, args, FAULTS)

    harness = GatedReferenceEngines()
    runs: list[CellRun] = []
    started = time.monotonic()
    try:
        if args.workdir is not None:
            args.workdir.mkdir(parents=True, exist_ok=True)
        with LoopbackGroup(spec(args.timeout), group=GROUP, engines=harness, workdir=args.workdir,
                           engine_agents=True) as group:  # fmt: skip
            group.start()
            matrix = Matrix(group, harness, slow=args.slow, link_rate=args.link_rate)
            try:
                outcome = matrix.publish(1)  # every engine holds a committed version before the first fault
                if outcome.result != "Succeeded":
                    raise RuntimeError(f"the first round did not land: {outcome.reason}")
                for index, (fault, phase) in enumerate(cells, 1):
                    runs.append(matrix.cell(fault, phase))
                    progress(index, len(cells), started, runs[-1])
            finally:
                matrix.close()
    finally:
        harness.close_gates()
    return finish(runs, args, started)


if __name__ == "__main__":
    sys.exit(main())
