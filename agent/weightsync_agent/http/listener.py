"""How an agent (and the reference engine) listens: a bound on reading a request's headers, and a cap on connections.

Without them one client held the server with connections that never finish their headers (slowloris: aiohttp's
default keep-alive left such a connection open an hour), and connections were accepted without end. Both use aiohttp
where it has the setting:

* **headers**: aiohttp's ``keepalive_timeout`` closes a connection that has not sent a whole request that long after
  its opening (aiohttp 3.14.4 and later, which pyproject requires) or after its previous answer, however slowly it
  trickles bytes meanwhile; header sizes are aiohttp's own caps (8190-byte lines, 128 headers). A request's body has
  its own bound (``json_object``, :data:`~weightsync_agent.http.bounds.BODY_READ_SECONDS`).
* **connections**: aiohttp has no cap (a listen ``backlog`` bounds only connections not yet accepted), so
  :class:`CappedSite` hands each connection past :data:`~weightsync_agent.http.bounds.MAX_CONNECTIONS` to
  :class:`Turnaway`, which answers 503 and closes it at once. The count is the server's own
  (``web.Server.connections``); a burst accepted in one go may pass it by up to the listen backlog.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import cast

from aiohttp import web

from weightsync_agent.http.bounds import HEADER_READ_SECONDS, MAX_CONNECTIONS

log = logging.getLogger(__name__)


def bounded_runner(app: web.Application, *, header_seconds: float = HEADER_READ_SECONDS) -> web.AppRunner:
    """``app``'s runner, each connection given ``header_seconds`` to send a whole request (and no longer idle)."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=header_seconds)


class CappedSite(web.BaseSite):
    """A TCP site holding at most ``max_connections`` connections: each one more is turned away at once."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int = MAX_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        super().__init__(runner)
        self.host = host
        self.port = port
        self.max_connections = max_connections

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # BaseSite refuses a runner that was not set up
        self._server = await asyncio.get_running_loop().create_server(
            functools.partial(admit, server, self.max_connections), self.host, self.port, backlog=self._backlog
        )
        self.port = self._server.sockets[0].getsockname()[1]  # port 0 picked one


def admit(server: web.Server, cap: int) -> asyncio.BaseProtocol:
    """The protocol for a new connection: the server's own while it holds fewer than ``cap``, else a turnaway."""
    if len(server.connections) >= cap:
        return Turnaway(cap)
    return server()


class Turnaway(asyncio.Protocol):
    """A connection past the cap: a 503 in the one error shape (``Retry-After: 1``), then closed, reading nothing."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        log.debug("turned a connection away: %d connections held already", self.cap)
        body = json.dumps({"error": {"message": f"this server holds {self.cap} connections already; try again"}})
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        stream = cast(asyncio.Transport, transport)
        stream.write((head + body).encode())
        stream.close()
