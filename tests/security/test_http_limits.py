"""What one client's connections may cost an agent's HTTP server (issue 26): real sockets against the server the agent
runs (``BackgroundServer``: the agent's ``bounded_app`` middlewares behind its listener), with short bounds.

Before: a connection trickling its headers (slowloris) or sending nothing stayed open for aiohttp's hour-long
keep-alive, a body trickled forever held its handler, and connections were accepted without end. Now the headers get
``header_seconds``, the body ``BODY_READ_SECONDS`` (a 408), and each connection past ``max_connections`` is answered
503 and closed at once, while requests on the connections held go on being served.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
from collections.abc import Iterator

import pytest
from aiohttp import web

from weightsync_agent.http import server as http_server
from weightsync_agent.http.bounds import HEADER_READ_SECONDS, MAX_CONNECTIONS, MAX_WAITERS
from weightsync_agent.http.server import BackgroundServer, auth_middleware, bounded_app, error_middleware, json_object

TOKEN = "the-token"
HEADER_SECONDS = 0.5
CAP = 4


def app() -> web.Application:
    """The agent's middlewares (credential, error shape, body cap) around a probe and a route that reads a body."""
    made = bounded_app([auth_middleware(TOKEN, open_routes=("/healthz",)), error_middleware])

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await json_object(request))

    made.add_routes([web.get("/healthz", healthz), web.post("/echo", echo)])
    return made


@pytest.fixture
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer(app(), header_seconds=HEADER_SECONDS, max_connections=CAP) as running:
        yield running


def connect(server: BackgroundServer) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=5)


def closed_within(sock: socket.socket, seconds: float, *, trickle: bytes = b"") -> float | None:
    """Seconds until the server closed ``sock`` (sending ``trickle`` every 0.05 s meanwhile), or None if it did not."""
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        try:
            if trickle:
                sock.sendall(trickle)
            if select.select([sock], [], [], 0.05)[0] and sock.recv(65536) == b"":
                return elapsed
        except (ConnectionResetError, BrokenPipeError):
            return elapsed
    return None


def healthy(server: BackgroundServer) -> bool:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        connection.request("GET", "/healthz")
        return connection.getresponse().status == 200
    finally:
        connection.close()


def test_the_agent_listens_with_these_bounds_by_default() -> None:
    default = BackgroundServer(app())  # as sidecar/main.py makes it
    assert (default.header_seconds, default.max_connections) == (HEADER_READ_SECONDS, MAX_CONNECTIONS)
    assert MAX_CONNECTIONS > MAX_WAITERS  # every allowed long poll fits, with room for publishes and probes


def test_a_client_trickling_its_headers_is_cut_off(server: BackgroundServer) -> None:
    with connect(server) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n")
        seconds = closed_within(slow, 5, trickle=b"X-Slow: 1\r\n")
    assert seconds is not None, "a connection trickling its headers was never closed"
    assert HEADER_SECONDS - 0.1 <= seconds < HEADER_SECONDS + 1.0, seconds
    assert healthy(server)


def test_a_connection_that_never_sends_a_request_is_cut_off(server: BackgroundServer) -> None:
    with connect(server) as idle:
        seconds = closed_within(idle, 5)
    assert seconds is not None and seconds < HEADER_SECONDS + 1.0, seconds


def test_connections_past_the_cap_are_turned_away_at_once() -> None:
    with BackgroundServer(app(), header_seconds=30, max_connections=CAP) as capped:
        held = [http.client.HTTPConnection(capped.host, capped.port, timeout=5) for _ in range(CAP)]
        for connection in held:  # each served once and kept open (keep-alive): the server holds CAP connections
            connection.request("GET", "/healthz")
            assert connection.getresponse().read() == b'{"ok": true}'
        with connect(capped) as extra:
            start = time.monotonic()
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
            try:
                answer = extra.recv(65536)
            except ConnectionResetError:
                answer = b""
            assert time.monotonic() - start < 1.0, "the extra connection was queued, not turned away"
        assert answer == b"" or answer.startswith(b"HTTP/1.1 503"), answer[:80]
        if answer:
            assert "connections already" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        for connection in held:  # the connections held are still served
            connection.request("GET", "/healthz")
            assert connection.getresponse().read() == b'{"ok": true}'
        held.pop().close()
        deadline = time.monotonic() + 2
        while not served(capped):  # the server notices the close on its loop
            assert time.monotonic() < deadline, "a freed slot was never given to a new connection"
        for connection in held:
            connection.close()


def served(server: BackgroundServer) -> bool:
    """Whether a new connection is served now (not turned away); waits a little when it is not."""
    try:
        ok = healthy(server)
    except (ConnectionError, http.client.HTTPException):
        ok = False
    if not ok:
        time.sleep(0.02)
    return ok


def test_a_body_trickled_past_its_bound_is_a_408(server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_server, "BODY_READ_SECONDS", 0.3)
    with connect(server) as slow:
        head = f"POST /echo HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n"
        start = time.monotonic()
        slow.sendall(head.encode() + b'{"a": ')
        answer = slow.recv(65536)
        seconds = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    assert b"did not arrive within 0.3 s" in answer
    assert 0.2 <= seconds < 1.5, seconds
    connection = http.client.HTTPConnection(server.host, server.port, timeout=5)
    connection.request("POST", "/echo", body=b'{"a": 1}', headers={"Authorization": f"Bearer {TOKEN}"})
    assert json.loads(connection.getresponse().read()) == {"a": 1}  # a whole body is read as before
    connection.close()
