"""Talking to another agent over HTTP: the client, and a remote trainer rank as a ``SourceControl``.

Routes (served by :mod:`weightsync_agent.sidecar.routes`):

* ``POST /v1/publish {"version", "rank", "timeoutSeconds"}`` — a trainer process says it staged
  ``version`` into ``rank``'s replica and waits for the round's result (the coordinator runs it).
* ``GET /v1/rounds/{version}?wait=S&seen=ID`` — the coordinator's latest result of round ``version`` unless its
  round id is ID (one the caller heard already), waiting up to S s.
* ``POST /v1/sources/{rank}/publish {"version", "timeoutSeconds", "planHash", "engines", "catchUp",
  "placements", "roundId"}`` —
  the coordinator asks rank ``rank`` to write its targets; answers a source report.
* ``POST /v1/sources/{rank}/prepare`` (the same body) — whether rank ``rank`` can publish ``version`` (it
  waits for the trainer to stage it); answers a source report, writes nothing.
* ``POST /v1/sources/{rank}/committed {"version"}`` — every engine committed ``version``.
* ``GET /v1/state``, ``GET /healthz``, ``GET /metrics``.

Every route but ``/healthz`` and ``/metrics`` requires the group's credential: the client sends ``token`` as
``Authorization: Bearer`` (docs/security.md).
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

from weightsync_agent.http.client import HttpCallError, JsonHttpClient
from weightsync_agent.http.credential import ApiKey
from weightsync_agent.rounds.canary import Canary
from weightsync_agent.rounds.driver import RoundResult
from weightsync_agent.rounds.wire import (
    WireError,
    placements_to_json,
    round_result_from_json,
    source_report_from_json,
)
from weightsync_agent.source.control import RoundScope
from weightsync_agent.source.report import SourceReport

#: Added to a call's own timeout so the server's answer (even "timed out") gets back to us.
SLACK_SECONDS = 5.0


class AgentError(RuntimeError):
    """Another agent could not be reached or refused the request."""


class AgentClient:
    def __init__(self, base_url: str, *, timeout: float = 30.0, token: ApiKey = None) -> None:
        self.http = JsonHttpClient(base_url, timeout=timeout, api_key=token)
        self.base_url = self.http.base_url

    def __repr__(self) -> str:
        return f"AgentClient({self.base_url!r})"

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        try:
            return self.http.request(method, route, body=body, timeout=timeout)[1]
        except HttpCallError as exc:
            raise AgentError(f"agent {self.base_url}: {exc}") from exc

    def state(
        self, timeout: float | None = None, *, engine: int | None = None, held: str | None = None
    ) -> dict[str, Any]:
        """The agent's state; ``engine``: an engine pod's agent asking, which reports the version ``held`` by its
        engine (None: none, or it does not answer) to the coordinator on the way."""
        route = "/v1/state"
        if engine is not None:
            route += f"?{urllib.parse.urlencode({'engine': engine, 'held': '' if held is None else held})}"
        state = self._call("GET", route, timeout=timeout)
        if not isinstance(state, dict):
            raise AgentError(f"agent {self.base_url}: /v1/state answered {state!r}")
        return state

    def publish(self, version: int, rank: int, timeout: float, *, canary: Canary | None = None) -> RoundResult:
        body: dict[str, object] = {"version": version, "rank": rank, "timeoutSeconds": timeout}
        if canary is not None:
            body["canary"] = canary.to_json()
        data = self._call("POST", "/v1/publish", body, timeout=timeout + 2 * SLACK_SECONDS)
        try:
            return round_result_from_json(data)
        except WireError as exc:
            raise AgentError(f"agent {self.base_url}: {exc}") from exc

    def round(
        self, version: int, wait: float, *, seen: str | None = None, round_id: str | None = None
    ) -> RoundResult | None:
        """The latest result of round ``version`` unless it is round ``seen`` (one heard already), else None;
        ``round_id``: the round the caller took part in (answered at once if that coordinator did not run it)."""
        query = {"wait": f"{wait:.3f}", **({} if seen is None else {"seen": seen})}
        if round_id is not None:
            query["round"] = round_id
        route = f"/v1/rounds/{version}?{urllib.parse.urlencode(query)}"
        data = self._call("GET", route, timeout=wait + SLACK_SECONDS)
        if data is None or (isinstance(data, dict) and data.get("pending")):
            return None
        try:
            return round_result_from_json(data)
        except WireError as exc:
            raise AgentError(f"agent {self.base_url}: {exc}") from exc

    def prepare_source(self, rank: int, version: int, timeout: float, scope: RoundScope) -> SourceReport:
        return self._source_call("prepare", rank, version, timeout, scope)

    def publish_source(self, rank: int, version: int, timeout: float, scope: RoundScope) -> SourceReport:
        return self._source_call("publish", rank, version, timeout, scope)

    def _source_call(self, step: str, rank: int, version: int, timeout: float, scope: RoundScope) -> SourceReport:
        body = {
            "version": version,
            "timeoutSeconds": timeout,
            "planHash": scope.plan_hash,
            "engines": None if scope.engines is None else sorted(scope.engines),
            "catchUp": scope.catch_up,
            "placements": placements_to_json(scope.placements),
            "roundId": scope.round_id,
        }
        data = self._call("POST", f"/v1/sources/{rank}/{step}", body, timeout=timeout + SLACK_SECONDS)
        try:
            return source_report_from_json(data)
        except WireError as exc:
            raise AgentError(f"agent {self.base_url}: {exc}") from exc

    def committed(self, rank: int, version: int, timeout: float | None = None) -> None:
        self._call("POST", f"/v1/sources/{rank}/committed", {"version": version}, timeout=timeout)


class HttpSourceControl:
    """Trainer rank ``source`` in another pod, as the round driver's ``SourceControl``.

    An unreachable agent is a failed report naming it, not an exception: the driver then reports the
    round as failed at that source.
    """

    def __init__(self, client: AgentClient, source: int, scope: RoundScope) -> None:
        self.client = client
        self.source = source
        self.scope = scope

    def prepare(self, version: int, deadline: float) -> SourceReport:
        left = max(0.0, deadline - time.monotonic())
        try:
            return self.client.prepare_source(self.source, version, left, self.scope)
        except AgentError as exc:
            return SourceReport(source=self.source, ok=False, error=str(exc))

    def publish(self, version: int, deadline: float) -> SourceReport:
        left = max(0.0, deadline - time.monotonic())
        try:
            return self.client.publish_source(self.source, version, left, self.scope)
        except AgentError as exc:
            return SourceReport(source=self.source, ok=False, error=str(exc))
