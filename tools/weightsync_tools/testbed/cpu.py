"""Was a run bound by the CPU or by the links? Each process's CPU time against the wall time.

The testbed caps every link so that the network, not the machine, limits a round: the ratios it reports are about
links. That holds only while no process of the run saturates a core and the machine has cores to spare; on a loaded
or small machine the same command measures the CPU instead, and its ratios mean something else. So every timed
window of a run records the CPU time of the bench process and each of its descendants (engines, agents, the
broadcast sender, the gather processes; ``/proc/<pid>/stat``, all threads) and of the whole machine (``/proc/stat``,
other users' processes included), and the verdict says which bound it.

:func:`usage` and :func:`verdict` are pure; :func:`snapshot` reads ``/proc``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Verdict = Literal["cpu", "links"]

#: A process using this much of one core over a window is saturated: it is single-threaded where it matters (the
#: Python of an agent, an engine's event loop, the bench's staging), so it could not have gone faster.
PROCESS_SATURATED = 0.9
#: The whole machine this busy over a window (every process's, others' included) leaves the run no core to spare.
MACHINE_SATURATED = 0.9
#: When the CPU bound a run, the next tries this fraction of its link rate.
RATE_STEP_DOWN = 0.7
#: Below this link rate (bits/s) the bench stops scaling down and reports the CPU as the bottleneck.
MIN_RATE_BITS = 50_000_000


@dataclass(frozen=True)
class Sample:
    """CPU seconds so far: per process of the run (pid -> (label, seconds)), and the machine's busy and total."""

    processes: Mapping[int, tuple[str, float]]
    machine_busy_s: float
    machine_total_s: float


@dataclass(frozen=True)
class Usage:
    """One timed window: its wall time, the busiest process (in cores), ours and the machine's share of all cores."""

    wall_s: float
    cpus: int
    busiest: str
    busiest_cores: float
    ours: float
    machine: float
    verdict: Verdict

    def as_json(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "cpus": self.cpus,
            "busiest": self.busiest,
            "busiest_cores": round(self.busiest_cores, 3),
            "ours": round(self.ours, 3),
            "machine": round(self.machine, 3),
            "verdict": self.verdict,
        }

    def describe(self) -> str:
        return (
            f"{self.verdict}: busiest process {self.busiest} {self.busiest_cores:.2f} core, the run's processes "
            f"{self.ours:.0%} and the machine {self.machine:.0%} of {self.cpus} CPUs over {self.wall_s:.1f} s"
        )


def verdict(busiest_cores: float, machine: float, *, caps: bool) -> Verdict:
    """``cpu`` when a process saturated its core or the machine had none to spare, or when nothing else can bound
    the run (no link caps: every byte is a copy on the same cores); otherwise ``links``."""
    if not caps or busiest_cores >= PROCESS_SATURATED or machine >= MACHINE_SATURATED:
        return "cpu"
    return "links"


def usage(before: Sample, after: Sample, wall_s: float, cpus: int, *, caps: bool) -> Usage:
    """What the run's processes and the machine did between two samples ``wall_s`` apart. A process that started
    in between counts from zero; one that ended in between is not seen (windows are chosen where the processes stay)."""
    wall = max(wall_s, 1e-9)
    used = {
        pid: (label, seconds - (before.processes[pid][1] if pid in before.processes else 0.0))
        for pid, (label, seconds) in after.processes.items()
    }
    label, seconds = max(used.values(), key=lambda item: item[1], default=("none", 0.0))
    ours = sum(s for _, s in used.values()) / (wall * cpus)
    total = after.machine_total_s - before.machine_total_s
    machine = (after.machine_busy_s - before.machine_busy_s) / total if total > 0 else 0.0
    busiest_cores = seconds / wall
    return Usage(wall, cpus, label, busiest_cores, ours, machine, verdict(busiest_cores, machine, caps=caps))


def worst(windows: Mapping[str, Usage]) -> Verdict:
    """A run is CPU-bound when any of its timed windows was."""
    return "cpu" if any(w.verdict == "cpu" for w in windows.values()) else "links"


def label(cmdline: list[str]) -> str:
    """A short name for a process of the run, from its command line."""
    args = [a for a in cmdline if a]
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            module = args[i + 1].rsplit(".", 1)[-1]
            rest = args[i + 2 : i + 3]
            if module == "main" and rest:  # weightsync_tools.cli.main agent
                return rest[0]
            if module == "server" and "--engine" in args:  # the reference engine
                return f"engine {args[args.index('--engine') + 1]}"
            return module
    return Path(args[0]).name if args else "?"


def table_lines(windows: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A report's windows (:meth:`Usage.as_json`) as the lines its table ends with."""
    return [
        f"# cpu, {name}: {w['verdict']} bound (busiest process {w['busiest']} {w['busiest_cores']:.2f} core; the run "
        f"{w['ours']:.0%}, the machine {w['machine']:.0%} of {w['cpus']} CPUs over {w['wall_s']:.1f} s)"
        for name, w in windows.items()
    ]


class Window:
    """One timed window of a run: opened where its processes are up, closed after its rounds."""

    def __init__(self) -> None:
        self.before = snapshot()
        self.started = time.monotonic()

    def close(self, cpus: int, *, caps: bool) -> Usage:
        return usage(self.before, snapshot(), time.monotonic() - self.started, cpus, caps=caps)


# --- Reading /proc ----------------------------------------------------------------------------------------------


def snapshot(root: int | None = None) -> Sample:
    """CPU seconds of ``root`` (this process by default) and every descendant, and of the machine."""
    root = os.getpid() if root is None else root
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        seconds[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime, every thread
    tree = {root}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    processes = {}
    for pid in tree:
        if pid in seconds:
            try:
                cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            processes[pid] = ("bench" if pid == root else f"{label(cmdline)} (pid {pid})", seconds[pid])
    busy, total = _machine_seconds(ticks)
    return Sample(processes, busy, total)


def _machine_seconds(ticks: int) -> tuple[float, float]:
    """Busy and total CPU seconds of the whole machine since boot (``/proc/stat``'s first line)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return (total - idle) / ticks, total / ticks
