"""Serving an aiohttp app from a thread, and the pieces every handler shares: body parsing, the error shape.

What a connection may cost (how long its headers and body may take, how many connections at once) is bounded where
the server listens (:mod:`.listener`) and where a body is read (:func:`json_object`)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from aiohttp import web

from weightsync_agent.http.bounds import (
    BODY_READ_SECONDS,
    HEADER_READ_SECONDS,
    MAX_BODY_BYTES,
    MAX_CONNECTIONS,
    BadRequestError,
)
from weightsync_agent.http.credential import Credential
from weightsync_agent.http.listener import CappedSite, bounded_runner

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, text: str, /, **extra: Any) -> web.Response:
    """The one error shape of every route: ``{"error": {"message": text}, **extra}``."""
    return web.json_response({"error": {"message": text}, **extra}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """400 for a bad request (or a refused value), 404 for something that is not here; aiohttp's own refusals
    (an unknown route, a wrong method, a body over the cap) in the one error shape too."""
    try:
        return await handler(request)
    except ValueError as exc:  # BadRequestError, or a refused rank or version
        return error_response(400, str(exc))
    except LookupError as exc:
        return error_response(404, str(exc))
    except web.HTTPException as exc:
        return http_exception_response(exc)


def http_exception_response(exc: web.HTTPException) -> web.StreamResponse:
    """aiohttp's ``HTTPException`` (raised, not returned) as the one error shape; a success or a redirect as is."""
    if exc.status < 400:
        return exc
    return error_response(exc.status, exc.text or exc.reason)


@web.middleware
async def last_resort_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The outermost middleware: a bug in a handler is a 500 in the one error shape, logged here with its
    traceback; the peer gets the exception's type only (no traceback, no internals)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        return http_exception_response(exc)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"internal error ({type(exc).__name__}); see the server's log")


def bounded_app(middlewares: list[Any]) -> web.Application:
    """An application whose bodies are capped at :data:`MAX_BODY_BYTES` (413 beyond, before parsing), with
    :func:`last_resort_middleware` outermost."""
    return web.Application(middlewares=[last_resort_middleware, *middlewares], client_max_size=MAX_BODY_BYTES)


def bearer_token(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``, or None."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def token_matches(given: str | None, expected: str | None) -> bool:
    """Constant-time comparison; an absent expected token matches nothing."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def route_key(request: web.Request) -> str | None:
    """The route's pattern as registered (``/v1/sources/{rank}/publish``), or None when no route matched."""
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else None


def auth_middleware(
    token: str | Credential,
    *,
    open_routes: Collection[str],
    extra: Mapping[str, Callable[[], str | None]] | None = None,
) -> Any:
    """Every route but ``open_routes`` (patterns as registered) requires ``Authorization: Bearer <token>``.

    ``token``: a fixed token, or the group's :class:`Credential`, which accepts its current and, during a
    rotation window, its previous token (and re-reads its files before refusing one).

    ``extra`` names routes that also accept another token (read on each request): the agent's pod-local token
    for trainer code. A missing or wrong token is a 401 in the one error shape; an unknown route asks for the
    token too (so a 404 tells nothing to someone without it).
    """
    if not token:
        raise ValueError("auth_middleware needs a non-empty token")
    credential = token if isinstance(token, Credential) else Credential.fixed(token)
    opened = frozenset(open_routes)
    also = dict(extra or {})

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        key = route_key(request)
        if key is not None and key in opened:
            return await handler(request)
        given = bearer_token(request)
        if credential.accepts(given):
            return await handler(request)
        other = also.get(key) if key is not None else None
        if other is not None and token_matches(given, other()):
            return await handler(request)
        what = "no bearer token" if given is None else "a wrong bearer token"
        return error_response(
            401, f"{request.method} {request.path} needs the group's credential; the request carried {what}"
        )

    return authenticate


async def json_object(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body; over :data:`MAX_BODY_BYTES` a 413 before a byte is parsed, not all there
    within :data:`BODY_READ_SECONDS` a 408 (a client trickling its body holds a handler no longer)."""
    refuse_oversized(request)
    try:
        async with asyncio.timeout(BODY_READ_SECONDS):
            body = await request.json()
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {BODY_READ_SECONDS:g} s") from None
    except ValueError as exc:
        raise BadRequestError(f"body is not JSON: {exc}") from exc
    except RecursionError:  # "[[[[...": json's recursion limit, not our stack
        raise BadRequestError("body is not JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequestError("body must be a JSON object")
    return body


def refuse_oversized(request: web.Request) -> None:
    """A declared Content-Length over the cap is refused before reading (aiohttp also stops reading at it)."""
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=length)


class BackgroundServer:
    """Serve an aiohttp app from a thread of this process (the agent's routes, an engine in tests).

    A context manager; ``url`` is valid once started (port 0 picks a free port). ``header_seconds`` and
    ``max_connections``: the listener's bounds (:mod:`.listener`), the agent's own by default.
    """

    def __init__(
        self,
        app: web.Application,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "http",
        header_seconds: float = HEADER_READ_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
        also_loopback: bool = False,
    ) -> None:
        self.app = app
        self.host = host
        #: Listen on 127.0.0.1 too, at the same port (each listener with its own connection cap): an agent listens on
        #: its pod's IP for peers and on the pod's loopback for its own trainer containers, which reach it there.
        self.also_loopback = also_loopback and host != "127.0.0.1"
        self.port = port
        self.name = name
        self.header_seconds = header_seconds
        self.max_connections = max_connections
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"{name}-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError(f"{self.name} server did not start within 10 s")
        if self._error is not None:
            raise RuntimeError(f"{self.name} server failed to start: {self._error}") from self._error
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = bounded_runner(self.app, header_seconds=self.header_seconds)
            self._loop.run_until_complete(self._runner.setup())
            site = CappedSite(self._runner, self.host, self.port, max_connections=self.max_connections)
            self._loop.run_until_complete(site.start())
            self.port = site.port
            if self.also_loopback:
                local = CappedSite(self._runner, "127.0.0.1", self.port, max_connections=self.max_connections)
                self._loop.run_until_complete(local.start())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
