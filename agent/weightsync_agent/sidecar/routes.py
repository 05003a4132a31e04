"""The agent's HTTP server: the routes listed in :mod:`weightsync_agent.rounds.remote`, plus /metrics.

Handlers are thin: they parse, hand the work to the runtime in a thread (publishing and rounds block on
the transport) and encode the answer. Every body and query is parsed into a bounded model
(:mod:`weightsync_agent.sidecar.requests`): a malformed or oversized request is a 400 (413 for a body over the
cap) in the one error shape, naming the field. Long polls wait on the loop, capped (:mod:`.waiters`).

Every route but :data:`OPEN_ROUTES` (the probes) requires the group's credential as a bearer token
(``auth_middleware``; docs/security.md); :data:`TRAINER_ROUTES` also take the pod-local token the agent
hands trainer code through the replica folder.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from weightsync_agent.http.bounds import MAX_WAITERS, parse_body
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.http.server import auth_middleware, bounded_app, error_middleware, error_response, json_object
from weightsync_agent.layout.manifest import ManifestError
from weightsync_agent.rounds.coordinator import RETRY_GRACE_SECONDS
from weightsync_agent.rounds.driver import RoundResult
from weightsync_agent.rounds.wire import WireError, placements_from_json, round_result_to_json, source_report_to_json
from weightsync_agent.sidecar.requests import (
    CommittedRequest,
    PublishRequest,
    RankQuery,
    RoundQuery,
    SourceCallRequest,
    VerifyRequest,
)
from weightsync_agent.sidecar.waiters import TooManyWaitersError, Waiters
from weightsync_agent.source.control import RoundScope
from weightsync_agent.targets.engine_agent_calls import MANIFEST_ROUTE, MAX_MISMATCHED, VERIFY_ROUTE

if TYPE_CHECKING:
    from weightsync_agent.sidecar.runtime import AgentRuntime


#: Open to anyone who reaches the port: liveness and Prometheus (no weights, nothing changes).
OPEN_ROUTES: tuple[str, ...] = ("/healthz", "/metrics")
#: Also accept the pod-local trainer token: what trainer code needs (publish its rank, wait for the sidecar).
TRAINER_ROUTES: tuple[str, ...] = ("/v1/publish", "/v1/state")

#: The agent's own threads for blocking work (publishes, source calls, manifests), apart from the loop's default
#: executor: on trainer rank 0's pod every other rank's publish waits in one for the round rank 0's runs, and
#: with more ranks than the default executor's threads (min(32, cores + 4)) rank 0's publish would queue behind
#: them until they timed out.
WORK = web.AppKey("work", ThreadPoolExecutor)
T = TypeVar("T")


def work_threads(ranks: int) -> int:
    """Enough for each rank's trainer publish and its coordinator's source call at once, plus manifests."""
    return 2 * ranks + 8


def build_app(runtime: AgentRuntime) -> web.Application:
    app = bounded_app([_auth(runtime), error_middleware])
    waiters = Waiters(MAX_WAITERS)
    _add_work_threads(app, runtime, waiters)
    app.add_routes(_probe_routes())
    app.add_routes(_trainer_routes(runtime))
    app.add_routes(_round_routes(runtime, waiters))
    app.add_routes(_source_routes(runtime))
    app.add_routes(_engine_routes(runtime))
    return app


def _auth(runtime: AgentRuntime) -> Any:
    """The group's credential on every route but :data:`OPEN_ROUTES`; :data:`TRAINER_ROUTES` also take the
    pod-local trainer token."""
    trainer_token = runtime.trainer_token
    return auth_middleware(
        runtime.token, open_routes=OPEN_ROUTES, extra={route: (lambda: trainer_token) for route in TRAINER_ROUTES}
    )


def _add_work_threads(app: web.Application, runtime: AgentRuntime, waiters: Waiters) -> None:
    """:data:`WORK` for the app's lifetime; a finished round wakes the long polls of ``waiters``."""

    async def start_work(app: web.Application) -> None:
        app[WORK] = ThreadPoolExecutor(work_threads(len(runtime.config.ranks)), thread_name_prefix="agent-work")
        if runtime.coordinator is not None:
            runtime.coordinator.on_finish.append(waiters.pulse_threadsafe)

    async def stop_work(app: web.Application) -> None:
        app[WORK].shutdown(wait=False, cancel_futures=True)

    app.on_startup.append(start_work)
    app.on_cleanup.append(stop_work)


async def _blocking(request: web.Request, work: Callable[..., T], *args: object) -> T:
    """``work(*args)`` on the agent's own threads (:data:`WORK`)."""
    call = functools.partial(work, *args)
    return await asyncio.get_running_loop().run_in_executor(request.app[WORK], call)


def _probe_routes() -> list[web.RouteDef]:
    """:data:`OPEN_ROUTES`: liveness and Prometheus."""

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return [web.get("/healthz", healthz), web.get("/metrics", metrics)]


def _trainer_routes(runtime: AgentRuntime) -> list[web.RouteDef]:
    """:data:`TRAINER_ROUTES`: the agent's state, and a trainer rank's publish (which runs rank 0's round)."""

    async def state(request: web.Request) -> web.Response:
        engine = request.query.get("engine", "")
        if engine.isdigit() and len(engine) < 8 and runtime.coordinator is not None:
            # An engine pod's agent reporting what its engine holds (a hint; the coordinator asks the engine itself).
            held = request.query.get("held", "")[:64]
            runtime.coordinator.heard(int(engine), held or None)
        return web.json_response(runtime.state())

    async def publish(request: web.Request) -> web.Response:
        asked = parse_body(PublishRequest, await json_object(request))
        timeout = runtime.round_timeout if asked.timeout_seconds is None else asked.timeout_seconds
        result = await _blocking(request, runtime.publish, asked.rank, asked.version, timeout, asked.canary)
        return web.json_response(round_result_to_json(result))

    return [web.get("/v1/state", state), web.post("/v1/publish", publish)]


def _round_routes(runtime: AgentRuntime, waiters: Waiters) -> list[web.RouteDef]:
    """The coordinator's answer about a round: a long poll, capped by ``waiters``."""

    async def round_result(request: web.Request) -> web.Response:
        asked = parse_body(RoundQuery, {**request.query, "version": request.match_info["version"]})
        coordinator = runtime.coordinator
        if coordinator is None:
            raise LookupError("this agent is not the coordinator (trainer rank 0's agent is)")

        if asked.round_id is not None:
            ended = coordinator.ended_elsewhere(asked.version, asked.round_id)
            if ended is not None:
                return web.json_response(round_result_to_json(ended))
        asked_at = time.time()

        def poll() -> RoundResult | None:
            return coordinator.wait(asked.version, 0.0, seen=asked.seen, asked_at=asked_at)

        try:
            # No pulse marks the end of the retry grace: ask again once it is over (a little after: the event loop's
            # clock is not time.time()).
            grace = RETRY_GRACE_SECONDS + 0.1
            result = await waiters.wait(poll, min(asked.poll_seconds, grace))
            if result is None and asked.poll_seconds > grace:
                result = await waiters.wait(poll, asked.poll_seconds - grace)
        except TooManyWaitersError as exc:
            return error_response(429, str(exc))
        return web.json_response({"pending": True} if result is None else round_result_to_json(result))

    return [web.get("/v1/rounds/{version}", round_result)]


def _source_routes(runtime: AgentRuntime) -> list[web.RouteDef]:
    """A coordinator's calls to this agent's sources: prepare, publish, and the committed version."""

    async def source_prepare(request: web.Request) -> web.Response:
        rank, version, timeout, scope = await source_call(request)
        sources = runtime.sources_or_fail()
        report = await _blocking(request, sources.prepare, rank, version, time.monotonic() + timeout, scope)
        return web.json_response(source_report_to_json(report))

    async def source_publish(request: web.Request) -> web.Response:
        rank, version, timeout, scope = await source_call(request)
        sources = runtime.sources_or_fail()
        report = await _blocking(request, sources.publish, rank, version, time.monotonic() + timeout, scope)
        return web.json_response(source_report_to_json(report))

    async def source_call(request: web.Request) -> tuple[int, int, float, RoundScope]:
        """A coordinator's call to one source (prepare or publish): rank, version, timeout and the round's scope.

        The timeout is cut to the plan's round budget: no call may hold a rank longer than a round may last."""
        rank = parse_body(RankQuery, {"rank": request.match_info["rank"]}).rank
        asked = parse_body(SourceCallRequest, await json_object(request))
        try:
            placements = placements_from_json(asked.placements)
        except WireError as exc:
            raise ValueError(str(exc)) from exc
        scope = RoundScope.of(
            asked.plan_hash, asked.engines, catch_up=asked.catch_up, placements=placements, round_id=asked.round_id
        )
        return rank, asked.version, min(asked.timeout_seconds, runtime.round_timeout), scope

    async def source_committed(request: web.Request) -> web.Response:
        rank = parse_body(RankQuery, {"rank": request.match_info["rank"]}).rank
        asked = parse_body(CommittedRequest, await json_object(request))
        runtime.sources_or_fail().committed(rank, asked.version)
        return web.json_response({"ok": True})

    return [
        web.post(r"/v1/sources/{rank:\d+}/prepare", source_prepare),
        web.post(r"/v1/sources/{rank:\d+}/publish", source_publish),
        web.post(r"/v1/sources/{rank:\d+}/committed", source_committed),
    ]


def _engine_routes(runtime: AgentRuntime) -> list[web.RouteDef]:
    """On an engine pod's agent: the engine's manifest and a round's verification, for the coordinator."""

    async def engine_manifest(request: web.Request) -> web.Response:
        rank = parse_body(RankQuery, {"rank": request.query.get("rank")}).rank
        engine = runtime.engine
        if engine is None:
            raise LookupError("this agent runs no engine")
        try:
            manifest = await _blocking(request, engine.manifest, rank)
        except HttpCallError as exc:
            return error_response(503, f"the engine did not answer: {exc}")
        except ManifestError as exc:
            return error_response(409, str(exc))
        return web.json_response(manifest.model_dump(mode="json", by_alias=True))

    async def engine_verify(request: web.Request) -> web.Response:
        asked = parse_body(VerifyRequest, await json_object(request))
        engine = runtime.engine
        if engine is None:
            raise LookupError("this agent runs no engine")
        try:
            verdict = await _blocking(request, engine.verify, asked.rank, asked.version, asked.checksums,
                                      runtime.round_timeout, asked.round_id)  # fmt: skip
        except ManifestError as exc:
            return error_response(409, str(exc))
        except HttpCallError as exc:
            return error_response(503, f"the engine did not answer: {exc}")
        return web.json_response(
            {"ok": verdict.ok, "mismatched": list(verdict.mismatched)[:MAX_MISMATCHED], "error": verdict.error}
        )

    return [web.get(MANIFEST_ROUTE, engine_manifest), web.post(VERIFY_ROUTE, engine_verify)]
