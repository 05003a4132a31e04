"""What a coordinator's predecessor left on the engines, closed by the coordinator that starts after it.

A coordinator killed during a round (trainer rank 0's agent: its pod deleted, the process OOM-killed) leaves its
engines as the round had them: paused, or with the round open to writes, possibly half-written. Nobody else would
ever resume them, and the group's status, which learns of paused engines only from the coordinator's round reports,
would call the group Ready while they serve nothing. So a coordinator, once it learnt the committed version at its
start, asks every engine that can say (:class:`~weightsync_agent.targets.adapter.LeftRoundProbe`) which round holds
it; a round it did not run is ended there without committing, "not knowing what was written": the engine
re-verifies its live memory and serves again only if it still holds what it last verified. What stays paused is
reported as a failed round that left engines paused (the status's ``EnginesPaused``) until the next round lands.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Container, Mapping
from dataclasses import dataclass

from weightsync_agent.http.client import HttpCallError
from weightsync_agent.rounds.driver import RoundResult
from weightsync_agent.targets.adapter import LeftRound, LeftRoundProbe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClosedLeftRounds:
    """What :func:`close_left_rounds` found and did, per engine."""

    #: Engine -> the round that held it (only rounds this coordinator did not run).
    left: Mapping[int, LeftRound]
    #: Engines that serve again (nothing of the round changed their weights).
    serving: tuple[int, ...] = ()
    #: Engines the round wrote: paused until a round lands.
    paused: tuple[int, ...] = ()
    #: Engine -> why it could not be closed (it did not answer): it may still be paused.
    failed: Mapping[int, str] | None = None

    def report(self, committed: int | None) -> RoundResult | None:
        """The left round as a failed round (what the coordinator's pod shows), or None when nothing was left."""
        if not self.left:
            return None
        round_id, _ = Counter(left.round_id for left in self.left.values()).most_common(1)[0]
        versions = [left.version for left in self.left.values() if left.version is not None]
        # A round that held the engines only paused (no begin yet) has no version of its own to report: the engines'
        # committed version is what they are labelled with.
        version = max(versions) if versions else (committed or 0)
        failed = dict(self.failed or {})
        gone = "(trainer rank 0's agent stopped during it and was restarted)"
        if versions:
            said = [f"round {round_id} of version {version} ended with its coordinator {gone}: it does not commit"]
        else:
            said = [f"round {round_id} left engines paused when its coordinator stopped {gone}"]
        if self.serving:
            said.append(f"engines {list(self.serving)} serve again (their weights are as last verified)")
        if self.paused:
            said.append(f"engines {list(self.paused)} were written in it and stay paused until a round lands")
        if failed:
            said.append("; ".join(f"engine {e} could not be closed: {why}" for e, why in sorted(failed.items())))
        # Not known to serve: an engine that did not answer may be paused still, and the status must not say Ready.
        return RoundResult.not_run(version, "; ".join(said), round_id, engines_paused=bool(self.paused or failed))


def close_left_rounds(engines: Mapping[int, object], ran: Container[str], timeout: float) -> ClosedLeftRounds:
    """Close, on every engine of ``engines`` (adapters) that can say, a round that holds it and is not one of ``ran``
    (the rounds this coordinator ran)."""
    left: dict[int, LeftRound] = {}
    serving: list[int] = []
    paused: list[int] = []
    failed: dict[int, str] = {}
    for index, engine in sorted(engines.items()):
        if not isinstance(engine, LeftRoundProbe):
            continue
        try:
            found = engine.left_round(timeout)
            if found is None or found.round_id in ran:
                continue
            left[index] = found
            (serving if engine.close_left(found, timeout) else paused).append(index)
        except HttpCallError as exc:
            failed[index] = str(exc)
    if left:
        log.warning(
            "engines %s were held by rounds this coordinator did not run (%s): %s serve again, %s stay paused%s",
            sorted(left),
            sorted({f.round_id for f in left.values()}),
            serving,
            paused,
            f", {sorted(failed)} did not answer" if failed else "",
        )
    return ClosedLeftRounds(left, tuple(serving), tuple(paused), failed)
