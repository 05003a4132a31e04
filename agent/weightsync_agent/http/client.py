"""A small blocking JSON-over-HTTP client with one error shape: every peer call in the agent goes through it.

Every call has a timeout (``timeout`` per client, overridable per call) and raises
:class:`PeerUnreachableError` (connection refused, reset or timed out) or :class:`HttpCallError` (an HTTP
error status or an unusable answer) instead of hanging or returning half a result. The timeout bounds the
whole call, reading the answer included (a peer that trickles bytes is cut off at it), and an answer is read
up to ``max_answer_bytes`` (:data:`~weightsync_agent.http.bounds.MAX_ANSWER_BYTES`): a peer answering 100 MB
or never ending its answer is an error, not a process out of memory. stdlib only, blocking: call from a
thread if the caller is asynchronous.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from weightsync_agent.http.bounds import MAX_ANSWER_BYTES
from weightsync_agent.http.credential import ApiKey, as_credential

log = logging.getLogger("weightsync.http")

#: Bytes read per step of an answer: the deadline is checked between steps.
READ_STEP = 1 << 16


class HttpCallError(RuntimeError):
    """The peer answered with an error status, or with something the caller cannot use."""

    def __init__(self, route: str, status: int | None, message: str, body: Any = None) -> None:
        super().__init__(f"{route}: {f'HTTP {status}: ' if status is not None else ''}{message}")
        self.route = route
        self.status = status
        self.message = message
        self.body = body


class PeerUnreachableError(HttpCallError):
    """No answer: connection refused or reset, or no response within the timeout."""


class JsonHttpClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 10.0,
        api_key: ApiKey = None,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        """``api_key``: sent as a bearer token; a :class:`~weightsync_agent.http.credential.Credential` also lets a
        call refused with 401 be retried once with the group's other token (a rotation window)."""
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.credential = as_credential(api_key)
        #: The token this peer last accepted after a 401 (it still runs with the previous one): tried first.
        self._accepted: str | None = None
        self.max_answer_bytes = max_answer_bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def request(
        self,
        method: str,
        route: str,
        *,
        body: dict[str, Any] | None = None,
        query: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, Any]:
        """One HTTP call; returns ``(status, decoded JSON or text)`` for 2xx, raises otherwise.

        With a credential, a 401 re-reads it and retries once with the token not tried yet (if any): a 401 comes
        from the peer's authentication, before any handler, so the retry repeats nothing."""
        url = self.base_url + route
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        if self.credential is None:
            return self._send(method, url, route, data, None, timeout)
        candidates = self.credential.tokens().candidates()
        first = self._accepted if self._accepted in candidates else candidates[0]
        try:
            answer = self._send(method, url, route, data, first, timeout)
            self._accepted = first if first != candidates[0] else None
            return answer
        except HttpCallError as exc:
            if exc.status != 401:
                raise
            self.credential.refresh()
            tokens = self.credential.tokens()
            other = next((t for t in tokens.candidates() if t != first), None)
            if other is None:
                raise
            answer = self._send(method, url, route, data, other, timeout)
        if self._accepted != other:
            if other == tokens.previous:
                log.warning(
                    "%s refused the group's current token and accepted the previous one: it still runs with the "
                    "token from before the rotation (restart it before finishing the rotation)",
                    self.base_url,
                )
            else:
                log.info("%s refused the previous token and accepted the current one", self.base_url)
        self._accepted = other
        return answer

    def _send(
        self, method: str, url: str, route: str, data: bytes | None, token: str | None, timeout: float | None
    ) -> tuple[int, Any]:
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        seconds = timeout or self.timeout
        deadline = time.monotonic() + seconds
        try:
            with urllib.request.urlopen(req, timeout=seconds) as resp:
                return resp.status, decode_body(self._read(resp, route, deadline, seconds))
        except urllib.error.HTTPError as exc:
            payload = decode_body(self._read(exc, route, deadline, seconds, quiet=True))
            raise HttpCallError(route, exc.code, error_message(payload) or exc.reason, payload) from exc
        except urllib.error.URLError as exc:
            raise PeerUnreachableError(route, None, f"{self.base_url} unreachable: {exc.reason}") from exc
        except (TimeoutError, ConnectionError, http.client.HTTPException) as exc:
            raise PeerUnreachableError(route, None, f"{self.base_url}: {exc!r}") from exc

    def _read(self, resp: Any, route: str, deadline: float, seconds: float, *, quiet: bool = False) -> bytes:
        """The answer's body, at most ``max_answer_bytes``, by ``deadline``. ``quiet`` (an error answer, whose
        body only words the error): cut it off instead of raising."""
        declared = resp.headers.get("Content-Length") if resp.headers is not None else None
        if not quiet and declared is not None and declared.isdigit() and int(declared) > self.max_answer_bytes:
            raise HttpCallError(route, None, f"answer of {declared} bytes is over the cap of {self.max_answer_bytes}")
        chunks: list[bytes] = []
        size = 0
        late = PeerUnreachableError(route, None, f"{self.base_url}: answer not complete within {seconds:g} s")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if quiet:
                    break
                raise late
            set_read_timeout(resp, left)
            try:
                chunk = resp.read1(READ_STEP) if hasattr(resp, "read1") else resp.read(READ_STEP)
            except TimeoutError:  # the read waited out the rest of the deadline
                if quiet:
                    break
                raise late from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_answer_bytes:
                if quiet:
                    break
                raise HttpCallError(route, None, f"answer over the cap of {self.max_answer_bytes} bytes")
        return b"".join(chunks)

    def _get(self, route: str, query: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        return self.request("GET", route, query=query, timeout=timeout)[1]

    def _post(self, route: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        return self.request("POST", route, body=body if body is not None else {}, timeout=timeout)[1]

    def _get_first(
        self, routes: Sequence[str], query: dict[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """GET the first of ``routes`` that exists (engines renamed several; older names answer 404)."""
        last: HttpCallError | None = None
        for route in routes:
            try:
                return self._get(route, query, timeout)
            except HttpCallError as exc:
                if exc.status != 404:
                    raise
                last = exc
        assert last is not None
        raise last


def set_read_timeout(resp: Any, seconds: float) -> None:
    """Make the answer's next socket read wait at most ``seconds`` (the rest of the call's deadline).

    urllib gives the socket one timeout per operation; a peer sending a byte just inside it forever would keep
    a call alive without end. urllib does not expose the socket, so this reaches it where CPython keeps it and
    does nothing where it is not (the per-read timeout then still bounds each step)."""
    raw = getattr(getattr(resp, "fp", None), "raw", None)
    sock = getattr(raw, "_sock", None)
    if isinstance(sock, socket.socket):
        sock.settimeout(max(seconds, 0.001))


def decode_body(raw: bytes) -> Any:
    if not raw:
        return None
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def error_message(payload: Any) -> str | None:
    """The message of an error answer: our shape ``{"error": {"message"}}``, or an engine's own."""
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
        for key in ("message", "detail"):
            if payload.get(key):
                return str(payload[key])
    if isinstance(payload, str) and payload:
        return payload[:500]
    return None
