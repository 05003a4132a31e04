"""A small blocking JSON-over-HTTP client with one error shape: every peer call in the agent goes through it.

Every call has a timeout (``timeout`` per client, overridable per call) and raises
:class:`PeerUnreachableError` (connection refused, reset or timed out) or :class:`HttpCallError` (an HTTP
error status or an unusable answer) instead of hanging or returning half a result. stdlib only, blocking:
call from a thread if the caller is asynchronous.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any


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
    def __init__(self, base_url: str, *, timeout: float = 10.0, api_key: str | None = None) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key

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
        """One HTTP call; returns ``(status, decoded JSON or text)`` for 2xx, raises otherwise."""
        url = self.base_url + route
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return resp.status, decode_body(resp.read())
        except urllib.error.HTTPError as exc:
            payload = decode_body(exc.read())
            raise HttpCallError(route, exc.code, error_message(payload) or exc.reason, payload) from exc
        except urllib.error.URLError as exc:
            raise PeerUnreachableError(route, None, f"{self.base_url} unreachable: {exc.reason}") from exc
        except (TimeoutError, ConnectionError) as exc:
            raise PeerUnreachableError(route, None, f"{self.base_url}: {exc!r}") from exc

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
