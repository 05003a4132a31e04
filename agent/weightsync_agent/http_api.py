"""The agent's HTTP server: the routes listed in :mod:`weightsync_agent.remote`, plus /metrics.

Handlers are thin: they parse, hand the work to the runtime in a thread (publishing and rounds block on
the transport) and encode the answer. A malformed request is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from weightsync_agent.wire import round_result_to_json, source_report_to_json

if TYPE_CHECKING:
    from weightsync_agent.runtime import AgentRuntime

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BadRequestError(Exception):
    pass


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequestError(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequestError("body must be a JSON object")
    return body


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"{what} must be an integer, got {value!r}")
    return value


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise BadRequestError(f"{what} must be a non-negative number of seconds, got {value!r}")
    return float(value)


def build_app(runtime: AgentRuntime) -> web.Application:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (BadRequestError, ValueError) as exc:  # ValueError: a refused rank or version
            return web.json_response({"error": str(exc)}, status=400)
        except LookupError as exc:
            return web.json_response({"error": str(exc)}, status=404)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def state(_: web.Request) -> web.Response:
        return web.json_response(runtime.state())

    async def publish(request: web.Request) -> web.Response:
        body = await _body(request)
        version = _int(body.get("version"), "version")
        rank = _int(body.get("rank"), "rank")
        timeout = _seconds(body.get("timeoutSeconds", runtime.round_timeout), "timeoutSeconds")
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

    async def source_publish(request: web.Request) -> web.Response:
        rank = _int(int(request.match_info["rank"]), "rank")
        body = await _body(request)
        version = _int(body.get("version"), "version")
        timeout = _seconds(body.get("timeoutSeconds"), "timeoutSeconds")
        engines = body.get("engines")
        if engines is not None and (not isinstance(engines, list) or not all(isinstance(e, int) for e in engines)):
            raise BadRequestError(f"engines must be a list of engine indexes or null, got {engines!r}")
        plan_hash = body.get("planHash")
        sources = runtime.sources_or_fail()
        report = await asyncio.to_thread(
            sources.publish,
            rank,
            version,
            time.monotonic() + timeout,
            plan_hash=None if plan_hash is None else str(plan_hash),
            engines=engines,
            catch_up=bool(body.get("catchUp", False)),
        )
        return web.json_response(source_report_to_json(report))

    async def source_committed(request: web.Request) -> web.Response:
        rank = int(request.match_info["rank"])
        body = await _body(request)
        version = _int(body.get("version"), "version")
        runtime.sources_or_fail().committed(rank, version)
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[errors])
    app.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/metrics", metrics),
            web.get("/v1/state", state),
            web.post("/v1/publish", publish),
            web.get("/v1/rounds/{version}", round_result),
            web.post(r"/v1/sources/{rank:\d+}/publish", source_publish),
            web.post(r"/v1/sources/{rank:\d+}/committed", source_committed),
        ]
    )
    return app
