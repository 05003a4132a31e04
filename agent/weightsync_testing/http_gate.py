"""A pass-through HTTP proxy in front of one engine server that can hold one route, for fault tests: the test
knows the round reached that step (and faults the engine there) before letting the request through. Test-only."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from weightsync_testing.engine_harness import StartedEngine


class Gate:
    """A pass-through proxy to ``upstream`` (an engine's URL; its ``Content-Type`` and ``Authorization`` headers
    pass); :meth:`hold` makes the next request for a route wait until :meth:`release`; :meth:`before` runs a hook
    before every request for a route is forwarded, :meth:`after` once the engine answered it and before its caller
    hears the answer; :meth:`refuse` answers a route with an error instead of forwarding it. A dead upstream answers
    502, as a client of a dead server sees it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.route: str | None = None
        self.arrived = threading.Event()
        self.released = threading.Event()
        self.hooks: dict[str, Callable[[], object]] = {}
        self.after_hooks: dict[str, Callable[[], object]] = {}
        self.refusals: dict[str, tuple[int, str]] = {}
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

    def before(self, route: str, hook: Callable[[], object] | None) -> None:
        """Run ``hook`` before every request for ``route`` is forwarded (after a hold's release); None: stop."""
        if hook is None:
            self.hooks.pop(route, None)
        else:
            self.hooks[route] = hook

    def after(self, route: str, hook: Callable[[], object] | None) -> None:
        """Run ``hook`` once the engine answered a request for ``route``, before the answer goes back: the engine
        has taken the step, its caller does not know yet. None: stop."""
        if hook is None:
            self.after_hooks.pop(route, None)
        else:
            self.after_hooks[route] = hook

    def refuse(self, route: str, status: int | None, message: str = "refused by the gate") -> None:
        """Answer every request for ``route`` with ``status`` and ``message`` in the one error shape, without
        forwarding it (an engine whose route fails); None: forward again."""
        if status is None:
            self.refusals.pop(route, None)
        else:
            self.refusals[route] = (status, message)

    def _forward(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?")[0]
        if self.route is not None and path == self.route:
            self.arrived.set()
            self.released.wait(120)
        hook = self.hooks.get(path)
        if hook is not None:
            hook()
        size = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(size) if size else None
        refusal = self.refusals.get(path)
        if refusal is not None:
            status, message = refusal
            _answer(handler, status, json.dumps({"error": {"message": message}}).encode(), "application/json")
            return
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
        after = self.after_hooks.get(path)
        if after is not None:
            after()
        _answer(handler, status, raw, kind)

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


def _answer(handler: BaseHTTPRequestHandler, status: int, raw: bytes, kind: str | None) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", kind or "application/json")
    handler.send_header("Content-Length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # A client that gave up on a held request (its timeout) closed the socket the answer goes to: expected here.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


def publish_with_fault(
    clients: Sequence[Any],
    full: Mapping[str, Any],
    version: int,
    *,
    gate: Gate,
    route: str,
    fault: Callable[[], None],
    wait: float,
) -> tuple[object, float]:
    """Every trainer rank (``clients``: ``WeightSyncClient``s) stages ``full`` and publishes ``version``; when the
    round's call to ``route`` reaches ``gate`` (the engine is at that step), ``fault()`` runs (a signal to the
    engine), then the call goes on. Returns the round's outcome (every rank's is the same, checked) and the seconds
    from the fault to the outcome."""
    gate.hold(route)
    outcomes: list[object] = [None] * len(clients)

    def rank(index: int) -> None:
        clients[index].stage_many(full)
        outcomes[index] = clients[index].publish(version, check=False, timeout=wait)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    try:
        assert gate.arrived.wait(120), f"the round never reached {route}"
        fault()
        faulted = time.monotonic()
    finally:
        gate.release()
    for thread in threads:
        thread.join(wait + 30)
    rounds = [getattr(o, "round", o) for o in outcomes]
    assert all(r == rounds[0] for r in rounds), rounds
    return outcomes[0], time.monotonic() - faulted


class GatedEngines:
    """Mixin for an engine harness (``class GatedX(GatedEngines, XEngines)``): every engine is reached through a
    :class:`Gate` of its own, the same gate across restarts (a harness's ``restart`` calls its ``start``)."""

    @property
    def gates(self) -> dict[int, Gate]:
        found: dict[int, Gate] = self.__dict__.setdefault("_gates", {})
        return found

    def start(self, engine: int, spec: Any, seed: int, **options: Any) -> StartedEngine:
        started: StartedEngine = super().start(engine, spec, seed, **options)  # type: ignore[misc]
        gate = self.gates.setdefault(engine, Gate(started.url))
        gate.upstream = started.url  # a new engine of the same index (a recreated pod) may listen elsewhere
        return dataclasses.replace(started, url=gate.url)

    def close_gates(self) -> None:
        for gate in self.gates.values():
            gate.close()
