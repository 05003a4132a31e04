"""The agent's HTTP server: the routes listed in :mod:`weightsync_agent.rounds.remote`, plus /metrics.

Handlers are thin: they parse, hand the work to the runtime in a thread (publishing and rounds block on
the transport) and encode the answer. A malformed request is a 400 naming the field.

Every route but :data:`OPEN_ROUTES` (the probes) requires the group's credential as a bearer token
(``auth_middleware``; docs/security.md); :data:`TRAINER_ROUTES` also take the pod-local token the agent
hands trainer code through the replica folder.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from weightsync_agent.http.client import HttpCallError
from weightsync_agent.http.server import (
    BadRequestError,
    auth_middleware,
    error_middleware,
    error_response,
    int_field,
    json_object,
    seconds_field,
)
from weightsync_agent.layout.manifest import ManifestError
from weightsync_agent.rounds.wire import WireError, placements_from_json, round_result_to_json, source_report_to_json
from weightsync_agent.source.control import RoundScope
from weightsync_agent.targets.agent import MANIFEST_ROUTE

if TYPE_CHECKING:
    from weightsync_agent.sidecar.runtime import AgentRuntime


#: Open to anyone who reaches the port: liveness and Prometheus (no weights, nothing changes).
OPEN_ROUTES: tuple[str, ...] = ("/healthz", "/metrics")
#: Also accept the pod-local trainer token: what trainer code needs (publish its rank, wait for the sidecar).
TRAINER_ROUTES: tuple[str, ...] = ("/v1/publish", "/v1/state")
#: A round id is the coordinator's uuid4 hex (32 characters); anything much longer is not one.
MAX_ROUND_ID = 64


def build_app(runtime: AgentRuntime) -> web.Application:
    token = runtime.config.group_token
    if not token:
        raise ValueError("the agent serves its routes only with the group's credential (WEIGHTSYNC_GROUP_TOKEN)")

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def state(_: web.Request) -> web.Response:
        return web.json_response(runtime.state())

    async def publish(request: web.Request) -> web.Response:
        body = await json_object(request)
        version = int_field(body.get("version"), "version")
        rank = int_field(body.get("rank"), "rank")
        timeout = seconds_field(body.get("timeoutSeconds", runtime.round_timeout), "timeoutSeconds")
        result = await asyncio.to_thread(runtime.publish, rank, version, timeout)
        return web.json_response(round_result_to_json(result))

    async def round_result(request: web.Request) -> web.Response:
        try:
            version = int(request.match_info["version"])
            wait = float(request.query.get("wait", "0"))
            after = float(request.query.get("after", "0"))
        except ValueError as exc:
            raise BadRequestError(f"bad version, wait or after: {exc}") from exc
        coordinator = runtime.coordinator
        if coordinator is None:
            raise LookupError("this agent is not the coordinator (trainer rank 0's agent is)")
        result = await asyncio.to_thread(coordinator.wait, version, min(wait, 60.0), after)
        return web.json_response({"pending": True} if result is None else round_result_to_json(result))

    async def source_prepare(request: web.Request) -> web.Response:
        rank, version, timeout, scope = await source_call(request)
        sources = runtime.sources_or_fail()
        report = await asyncio.to_thread(sources.prepare, rank, version, time.monotonic() + timeout, scope)
        return web.json_response(source_report_to_json(report))

    async def source_publish(request: web.Request) -> web.Response:
        rank, version, timeout, scope = await source_call(request)
        sources = runtime.sources_or_fail()
        report = await asyncio.to_thread(sources.publish, rank, version, time.monotonic() + timeout, scope)
        return web.json_response(source_report_to_json(report))

    async def source_call(request: web.Request) -> tuple[int, int, float, RoundScope]:
        """A coordinator's call to one source (prepare or publish): rank, version, timeout and the round's scope."""
        rank = int_field(int(request.match_info["rank"]), "rank")
        body = await json_object(request)
        version = int_field(body.get("version"), "version")
        timeout = seconds_field(body.get("timeoutSeconds"), "timeoutSeconds")
        engines = body.get("engines")
        if engines is not None and (not isinstance(engines, list) or not all(isinstance(e, int) for e in engines)):
            raise BadRequestError(f"engines must be a list of engine indexes or null, got {engines!r}")
        plan_hash = body.get("planHash")
        round_id = body.get("roundId")
        if round_id is not None and (not isinstance(round_id, str) or not 0 < len(round_id) <= MAX_ROUND_ID):
            raise BadRequestError(f"roundId must be a string of 1 to {MAX_ROUND_ID} characters or null")
        try:
            placements = placements_from_json(body.get("placements"))
        except WireError as exc:
            raise BadRequestError(str(exc)) from exc
        scope = RoundScope.of(
            None if plan_hash is None else str(plan_hash),
            engines,
            catch_up=bool(body.get("catchUp", False)),
            placements=placements,
            round_id=round_id,
        )
        return rank, version, timeout, scope

    async def source_committed(request: web.Request) -> web.Response:
        rank = int(request.match_info["rank"])
        body = await json_object(request)
        version = int_field(body.get("version"), "version")
        runtime.sources_or_fail().committed(rank, version)
        return web.json_response({"ok": True})

    async def engine_manifest(request: web.Request) -> web.Response:
        engine = runtime.engine
        if engine is None:
            raise LookupError("this agent runs no engine")
        try:
            rank = int(request.query.get("rank", ""))
        except ValueError as exc:
            raise BadRequestError(f"rank must be an integer: {exc}") from exc
        try:
            manifest = await asyncio.to_thread(engine.manifest, rank)
        except HttpCallError as exc:
            return error_response(503, f"the engine did not answer: {exc}")
        except ManifestError as exc:
            return error_response(409, str(exc))
        return web.json_response(manifest.model_dump(mode="json", by_alias=True))

    trainer_token = runtime.trainer_token
    auth = auth_middleware(
        token, open_routes=OPEN_ROUTES, extra={route: (lambda: trainer_token) for route in TRAINER_ROUTES}
    )
    app = web.Application(middlewares=[auth, error_middleware])
    app.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/metrics", metrics),
            web.get("/v1/state", state),
            web.post("/v1/publish", publish),
            web.get("/v1/rounds/{version}", round_result),
            web.post(r"/v1/sources/{rank:\d+}/prepare", source_prepare),
            web.post(r"/v1/sources/{rank:\d+}/publish", source_publish),
            web.post(r"/v1/sources/{rank:\d+}/committed", source_committed),
            web.get(MANIFEST_ROUTE, engine_manifest),
        ]
    )
    return app
