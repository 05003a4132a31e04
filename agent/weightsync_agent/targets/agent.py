"""An inference pod's agent: advertises its engine, checks it serves a usable manifest, reports its version.

The engine (SGLang or the reference engine) does the receiving itself: sources write into the memory it
registered and the coordinator drives its pause/verify/commit routes. The agent's part is what the
operator and the other agents need to know about this pod: the engine's URL (annotation
``weightsync.io/engine-url``, so sources and the coordinator find it), whether it is up with a manifest
that parses (the ``weightsync.io/agent-ready`` condition), and the version it fully holds (annotation
``weightsync.io/weight-version``, which the engine changes only on a verified commit).

An engine that holds less than the group's committed version (restarted on its initial weights, or left behind)
is **not ready** (reason ``CatchingUp``) until the coordinator's catch-up lands: its pod then drops out of the
Services rollout clients use, instead of serving stale weights. The committed version comes from the coordinator
(its ``/v1/state``), asked at most every ``committed_every`` seconds; while it cannot be asked the last answer
holds, and before any answer (or in a group that never committed) nothing is held back. That same call tells the
coordinator what this engine holds (:attr:`EngineAgent.held_now`), and it is made on the next check as soon as the
engine's version or readiness changed (a restarted engine): so the coordinator learns of an engine that fell
behind from its agent, and need not ask every engine every tick.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.api import names
from weightsync.api.engines import Refusal
from weightsync_agent import metrics
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.targets.adapter import EngineAdapter, Readiness, TargetVerdict

log = logging.getLogger("weightsync.agent.engine")


SetReady = Callable[[bool, str, str], None]
Annotate = Callable[[dict[str, Any]], None]
#: The group's committed version as its coordinator knows it (None: nothing committed, or not learnt yet);
#: raises LookupError when the coordinator cannot be asked.
GroupCommitted = Callable[[], int | None]

#: How often an engine pod asks the coordinator for the committed version.
COMMITTED_EVERY_SECONDS = 10.0


def holds(version: str | None, committed: int) -> bool:
    """Whether an engine reporting ``version`` holds ``committed`` or newer (initial weights hold nothing)."""
    return version is not None and version.isdigit() and int(version) >= committed


@dataclass
class EngineState:
    ready: bool = False
    reason: str = ""
    version: str | None = None


class EngineAgent:
    """``adapter`` a :class:`Refusal`: the group asks what this engine kind's adapter cannot do; the pod stays
    unready, saying why."""

    def __init__(
        self,
        group: str,
        engine_url: str,
        adapter: EngineAdapter | Refusal,
        *,
        advertise: bool,
        set_ready: SetReady | None = None,
        annotate: Annotate | None = None,
        timeout: float = 5.0,
        committed: GroupCommitted | None = None,
        committed_every: float = COMMITTED_EVERY_SECONDS,
    ) -> None:
        self.group = group
        self.engine_url = engine_url
        self.adapter = adapter
        self.advertise = advertise  # only the engine's first pod hosts its HTTP server
        self.set_ready = set_ready
        self.annotate = annotate
        self.timeout = timeout
        self.state = EngineState()
        self._advertised = False
        self.committed = committed
        self.committed_every = committed_every
        self._group_committed: int | None = None
        self._asked_at: float | None = None
        #: The version the engine answered on the last check (None: it did not answer, or holds none): what the
        #: call for the committed version reports to the coordinator.
        self.held_now: str | None = None

    def check(self) -> EngineState:
        """One look at the engine; report what changed."""
        if self.advertise and not self._advertised and self.annotate is not None:
            self.annotate({names.ANNOTATION_ENGINE_URL: self.engine_url})
            self._advertised = True
        version = self.state.version
        if isinstance(self.adapter, Refusal):
            ready, reason, message = False, self.adapter.reason, self.adapter.message
        else:
            # Asked before the engine's own version: the coordinator moves ``committed`` only after every engine
            # committed, so an engine taking part in a round never reads as behind.
            committed = self._committed() if self.advertise else None
            try:
                if self.advertise and not self.state.ready:
                    # Each rank's manifest, once per (re)start: a bad one keeps the pod unready.
                    readiness = self.adapter.readiness()
                else:
                    readiness = Readiness(True, "EngineServing", f"engine at {self.engine_url} answers")
                if readiness.ready and self.advertise:
                    version = self.adapter.held_version(timeout=self.timeout)
                    if readiness.paths is not None and self.annotate is not None:
                        self.annotate({names.ANNOTATION_SYNC_PATHS: json.dumps(dict(readiness.paths), sort_keys=True)})
                ready, reason, message = readiness.ready, readiness.reason, readiness.message
            except HttpCallError as exc:
                ready, reason, message = False, "EngineUnavailable", str(exc)
            if ready and committed is not None and not holds(version, committed):
                ready, reason = False, "CatchingUp"
                message = (
                    f"engine holds weight version {version}, the group committed {committed}: "
                    "not ready until the catch-up lands"
                )
        if self.advertise and not isinstance(self.adapter, Refusal):
            read = version if ready or reason == "CatchingUp" else None
            if read != self.held_now or (ready, reason) != (self.state.ready, self.state.reason):
                self._asked_at = None  # tell the coordinator on the next check, not in up to committed_every
            self.held_now = read
        if (ready, reason) != (self.state.ready, self.state.reason) and self.set_ready is not None:
            self.set_ready(ready, reason, message)
            (log.info if ready else log.warning)("engine %s: %s", reason, message)
        if version != self.state.version and version is not None:
            if self.annotate is not None:
                self.annotate({names.ANNOTATION_WEIGHT_VERSION: version})
            if version.isdigit():
                metrics.WEIGHT_VERSION.labels(self.group).set(int(version))
            log.info("engine holds weight version %s", version)
        self.state = EngineState(ready, reason, version if version is not None else self.state.version)
        return self.state

    def _committed(self) -> int | None:
        """The group's committed version, asked at most every ``committed_every`` s; the last answer otherwise."""
        if self.committed is None:
            return None
        now = time.monotonic()
        if self._asked_at is None or now - self._asked_at >= self.committed_every:
            self._asked_at = now
            try:
                learned = self.committed()
            except LookupError as exc:
                log.debug("committed version not learnt this time: %s", exc)
            else:
                if learned is not None:
                    self._group_committed = learned
        return self._group_committed

    def manifest(self, rank: int) -> Manifest:
        """Rank ``rank``'s manifest as this pod's adapter assembles it (served to sources by the agent)."""
        if isinstance(self.adapter, Refusal):
            raise LookupError(self.adapter.message)
        if not 0 <= rank < self.adapter.settings.ranks:
            raise ValueError(f"rank must be in [0, {self.adapter.settings.ranks}), got {rank}")
        return self.adapter.manifest(rank)

    def verify(self, rank: int, version: int, checksums: Sequence[str], timeout: float, round_id: str) -> TargetVerdict:
        """Rank ``rank`` checked against the sources' per-bucket checksums by this pod's adapter (for kinds whose
        landed bytes only the engine's pod can read: vLLM's receive buffer)."""
        if isinstance(self.adapter, Refusal):
            raise LookupError(self.adapter.message)
        if not 0 <= rank < self.adapter.settings.ranks:
            raise ValueError(f"rank must be in [0, {self.adapter.settings.ranks}), got {rank}")
        return self.adapter.verify(rank, version, checksums, timeout, round_id=round_id)
