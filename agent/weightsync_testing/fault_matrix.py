"""The fault matrix's cells and their invariants (issue 26; ``bench/fault_matrix.py`` runs them). Pure: what a cell
observed goes in, verdicts and the table come out.

A cell is one fault placed at one phase of a round. What it must show:

- ``budget``: the faulted round ends within ``timeoutSeconds`` + :data:`BUDGET_SLACK_SECONDS`;
- ``holds``: after the fault, every engine that serves holds, byte for byte, the version it reports;
- ``truthful``: what the coordinator and the status say is true: a round called Succeeded (or committed) reached every
  engine, ``enginesPaused`` says whether engines are paused, and the group's status (the operator's fold of what the
  agents report, one status period after the fault) is not Ready while an engine does not serve the committed bytes;
- ``recovered``: the next round (the fault removed, a killed process restarted) lands on every engine, the first
  time;
- ``names``: a failed round's reason names the faulted peer and the phase it failed in (:data:`PHASE_WORDS`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Final

#: How far past its budget a faulted round may end (the Done-when of issue 26).
BUDGET_SLACK_SECONDS: Final = 5.0

#: The round phases a fault can be placed at, in round order.
PHASES: Final = ("pause", "begin", "write", "verify", "commit", "resume")

#: What a reason says to name each phase it can fail in: the driver's own step names ("engine 1 pause", "failed
#: verification", "source 0 write", "resume failed"). A fault is named in the phase where the round meets it, which
#: need not be the phase it struck in: a source killed while the engines pause is met when the round asks it to write.
PHASE_WORDS: Final[Mapping[str, tuple[str, ...]]] = {
    "prepare": ("round not started",),
    "pause": ("pause",),
    "begin": ("begin", "could not start the round"),
    "write": ("writ",),
    "verify": ("verif",),
    "commit": ("commit",),
    "resume": ("resume",),
}

CHECKS: Final = ("budget", "holds", "truthful", "recovered", "names")

#: Faults whose round dies with the process that knew its phase (the coordinator runs the round): the trainer's error
#: names the agent that is gone, and what the round left behind is for the restarted coordinator's report to say.
PHASE_DIES_WITH: Final = frozenset({"coordinator-kill"})


@dataclass(frozen=True)
class EngineView:
    """One engine as observed: what it says, and what its memory holds."""

    engine: int
    #: Whether it answered at all (a killed engine not yet restarted does not).
    answers: bool
    #: The version it reports (``default``: its initial weights); None when it does not answer.
    reported: str | None = None
    paused: bool = False
    #: The version whose bytes every rank of it holds (compared with the trainer's), None: no known version's.
    holds: str | None = None

    @property
    def serves(self) -> bool:
        return self.answers and not self.paused


@dataclass(frozen=True)
class Snapshot:
    """The group at one moment: its engines, the coordinator's committed version, the status the operator folds."""

    engines: tuple[EngineView, ...]
    committed: int | None
    #: The folded ``Ready`` condition: its status ("True"/"False") and reason.
    ready: str = "Unknown"
    ready_reason: str = ""


@dataclass(frozen=True)
class CellRun:
    """What one cell observed."""

    fault: str
    phase: str
    #: The faulted peer as the round's reasons name it ("engine 1", "source 1").
    peer: str
    version: int
    #: ``timeoutSeconds`` of the group.
    budget: float
    #: The faulted round: its result (Succeeded/Failed/Aborted, or ``error`` when the publish itself failed), reason,
    #: seconds (the coordinator's measure), whether it committed and whether it says it left the engines paused.
    result: str
    reason: str | None
    seconds: float
    committed: bool
    engines_paused: bool
    #: The group after the fault was removed (and a status period passed), and after the recovery.
    after: Snapshot
    recovered: Snapshot
    recovery_result: str
    #: Rounds the recovery took (1: the first next round landed).
    recovery_rounds: int = 1
    #: What else the cell saw (a foreign write landed or was refused).
    note: str = ""
    verdicts: dict[str, str] = field(default_factory=dict)


def within_budget(run: CellRun) -> str | None:
    """Why the faulted round broke its budget, or None."""
    limit = run.budget + BUDGET_SLACK_SECONDS
    if run.seconds > limit:
        return f"the round took {run.seconds:.1f} s, over timeoutSeconds {run.budget:g} + {BUDGET_SLACK_SECONDS:g} s"
    return None


def false_claims(snapshot: Snapshot) -> list[str]:
    """Every engine that serves a version it does not hold, byte for byte."""
    return [
        f"engine {e.engine} serves as version {e.reported} bytes of {e.holds or 'no known version'}"
        for e in snapshot.engines
        if e.serves and e.holds != e.reported
    ]


def untrue_reports(run: CellRun) -> list[str]:
    """What the round's result and the folded status say that the engines (after the fault) contradict."""
    found: list[str] = []
    after, version = run.after, str(run.version)
    answering = [e for e in after.engines if e.answers]
    if run.result == "Succeeded" or run.committed:
        missing = [e.engine for e in after.engines if e.reported != version or e.holds != version]
        if missing:
            found.append(f"the round says version {version} committed, engines {missing} do not hold it")
        if after.committed != run.version:
            found.append(f"the round committed {version}, the coordinator says {after.committed}")
    elif after.committed == run.version and run.result != "error":  # "error": the trainer could not hear the result
        found.append(f"the round failed, the coordinator says {version} is committed")
    # The round's own enginesPaused is history (true when it ended: a killed engine is restarted since); what must
    # stay true is the status the operator folds from it and from the engines' reports.
    paused = [e.engine for e in answering if e.paused]
    committed = None if after.committed is None else str(after.committed)
    if after.ready == "True":
        wrong = [e.engine for e in after.engines if not e.serves or e.holds != e.reported or
                 (committed is not None and e.reported != committed)]  # fmt: skip
        if wrong:
            found.append(f"the status is Ready, engines {wrong} do not serve the committed version")
    elif after.ready_reason == "EnginesPaused" and not paused:
        found.append("the status says EnginesPaused, no engine is paused")
    if paused and after.ready == "True":
        found.append(f"engines {paused} are paused and the status is Ready")
    return found


def not_recovered(run: CellRun) -> list[str]:
    """Why the next round (the fault removed) did not bring every engine to its version (serving, holding it)."""
    version = str(run.version + 1)
    if run.recovery_result != "Succeeded":
        return [f"the next round: {run.recovery_result}"]
    if run.recovery_rounds > 1:
        return [f"the next round failed; round {run.recovery_rounds} of that version landed"]
    return [
        f"engine {e.engine} reports {e.reported}, holds {e.holds}{', paused' if e.paused else ''}"
        for e in run.recovered.engines
        if not e.serves or e.reported != version or e.holds != version
    ]


def named_phases(reason: str) -> list[str]:
    """The phases ``reason`` names."""
    reason = reason.lower()
    return [phase for phase, words in PHASE_WORDS.items() if any(word in reason for word in words)]


def unnamed(run: CellRun) -> str | None:
    """Why a failed round's reason does not name the faulted peer and a phase (None: it does, or it succeeded)."""
    if run.result == "Succeeded":
        return None
    reason = run.reason or ""
    missing = []
    if run.peer not in reason:
        missing.append(f"the peer ({run.peer})")
    if not named_phases(reason) and run.fault not in PHASE_DIES_WITH:
        missing.append("a phase")
    return f"the reason does not name {' nor '.join(missing)}" if missing else None


def judge(run: CellRun) -> dict[str, str]:
    """Each check's verdict: ``ok``, or what broke it."""
    problems: dict[str, list[str]] = {
        "budget": [p for p in [within_budget(run)] if p],
        "holds": false_claims(run.after) + false_claims(run.recovered),
        "truthful": untrue_reports(run),
        "recovered": not_recovered(run),
        "names": [p for p in [unnamed(run)] if p],
    }
    return {check: "; ".join(problems[check]) or "ok" for check in CHECKS}


def failed(runs: Sequence[CellRun]) -> list[str]:
    """Every broken invariant, one line each ("fault@phase check: why")."""
    return [
        f"{run.fault}@{run.phase} {check}: {verdict}"
        for run in runs
        for check, verdict in run.verdicts.items()
        if verdict != "ok"
    ]


def shorten(text: str | None, limit: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def table(runs: Sequence[CellRun], *, reason_chars: int = 90) -> str:
    """The matrix as text: one line per cell."""
    head = ("fault", "phase", "outcome", "s", *CHECKS, "reason / note")
    rows = [
        (
            run.fault,
            run.phase,
            run.result + (" (paused)" if run.engines_paused else ""),
            f"{run.seconds:.2f}",
            *("ok" if run.verdicts.get(c) == "ok" else "FAIL" for c in CHECKS),
            shorten("; ".join(t for t in (run.reason, run.note) if t), reason_chars),
        )
        for run in runs
    ]
    widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in [head, *rows]]  # fmt: skip
    return "\n".join(lines)


def to_json(runs: Sequence[CellRun]) -> str:
    return json.dumps([asdict(run) for run in runs], indent=2)
