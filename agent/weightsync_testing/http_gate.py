"""A pass-through HTTP proxy in front of one engine server that can hold one route, for fault tests: the test
knows the round reached that step (and faults the engine there) before letting the request through. Test-only."""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Gate:
    """A pass-through proxy to ``upstream`` (an engine's URL; its ``Content-Type`` and ``Authorization`` headers
    pass); :meth:`hold` makes the next request for a route wait until :meth:`release`. A dead upstream answers 502,
    as a client of a dead server sees it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.route: str | None = None
        self.arrived = threading.Event()
        self.released = threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_GET(self) -> None:
                gate._forward(self)

            def do_POST(self) -> None:
                gate._forward(self)

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hold(self, route: str) -> None:
        self.route, self.arrived, self.released = route, threading.Event(), threading.Event()

    def release(self) -> None:
        self.route = None
        self.released.set()

    def _forward(self, handler: BaseHTTPRequestHandler) -> None:
        if self.route is not None and handler.path.split("?")[0] == self.route:
            self.arrived.set()
            self.released.wait(120)
        size = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(size) if size else None
        request = urllib.request.Request(self.upstream + handler.path, data=body, method=handler.command)
        for header in ("Content-Type", "Authorization"):
            if handler.headers.get(header):
                request.add_header(header, handler.headers[header])
        try:
            with urllib.request.urlopen(request, timeout=300) as answer:
                status, raw, kind = answer.status, answer.read(), answer.headers.get("Content-Type")
        except urllib.error.HTTPError as error:
            status, raw, kind = error.code, error.read(), error.headers.get("Content-Type")
        except OSError as error:  # the engine is gone: what a client of a dead server sees, as an answer
            status, raw, kind = 502, json.dumps({"error": {"message": f"gate: {error}"}}).encode(), "application/json"
        handler.send_response(status)
        handler.send_header("Content-Type", kind or "application/json")
        handler.send_header("Content-Length", str(len(raw)))
        handler.end_headers()
        handler.wfile.write(raw)

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # A client that gave up on a held request (its timeout) closed the socket the answer goes to: expected here.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]
