"""Serving an aiohttp app from a thread, and the pieces every handler shares: body parsing, the error shape."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BadRequestError(ValueError):
    """A request field is missing or malformed: answered 400, naming the field."""


def error_response(status: int, text: str, /, **extra: Any) -> web.Response:
    """The one error shape of every route: ``{"error": {"message": text}, **extra}``."""
    return web.json_response({"error": {"message": text}, **extra}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """400 for a bad request (or a refused value), 404 for something that is not here."""
    try:
        return await handler(request)
    except ValueError as exc:  # BadRequestError, or a refused rank or version
        return error_response(400, str(exc))
    except LookupError as exc:
        return error_response(404, str(exc))


async def json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequestError(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequestError("body must be a JSON object")
    return body


def int_field(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"{what} must be an integer, got {value!r}")
    return value


def seconds_field(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise BadRequestError(f"{what} must be a non-negative number of seconds, got {value!r}")
    return float(value)


class BackgroundServer:
    """Serve an aiohttp app from a thread of this process (the agent's routes, an engine in tests).

    A context manager; ``url`` is valid once started (port 0 picks a free port).
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0, *, name: str = "http") -> None:
        self.app = app
        self.host = host
        self.port = port
        self.name = name
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
            self._runner = web.AppRunner(self.app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = bound_port(self._runner, self.port)
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


def bound_port(runner: web.AppRunner, requested: int) -> int:
    """The port a runner actually listens on (``requested`` 0 picks one)."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return requested
