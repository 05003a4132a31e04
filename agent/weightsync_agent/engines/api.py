"""A small typed HTTP client for an inference engine's weight-update routes.

Works against a real SGLang server and against the reference engine. The SGLang routes are used as SGLang
defines them (see docs/reference-engine.md for sources); where SGLang renamed a route, the client tries
the current name first and falls back to the older one on 404. The reference engine's ``/weightsync/``
routes are an optional capability: :meth:`EngineClient.supports_weightsync` tells whether they exist.

Every call has a timeout (``timeout`` per client, overridable per call) and raises
:class:`EngineUnreachableError` (connection refused, reset or timed out) or :class:`EngineAPIError` (an HTTP
error status or an unusable answer) instead of hanging or returning half a result. stdlib only, blocking:
call from a thread if the caller is asynchronous.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from weightsync_agent.manifest import Manifest, ManifestError

PauseMode = Literal["abort", "retract", "in_place"]


class EngineAPIError(RuntimeError):
    """The engine answered with an error status, or with something this client cannot use."""

    def __init__(self, route: str, status: int | None, message: str, body: Any = None) -> None:
        super().__init__(f"{route}: {f'HTTP {status}: ' if status is not None else ''}{message}")
        self.route = route
        self.status = status
        self.message = message
        self.body = body


class EngineUnreachableError(EngineAPIError):
    """No answer: connection refused or reset, or no response within the timeout."""


@dataclass(frozen=True)
class TransferEngineInfo:
    """One rank's ``/remote_instance_transfer_engine_info``: session id and weights info.

    ``weights_info`` is SGLang's ``{name: [data_ptr, numel, element_size]}`` on SGLang, and a
    weightsync :class:`Manifest` (JSON) on the reference engine.
    """

    rank: int
    session_id: str
    weights_info: Any

    def manifest(self) -> Manifest:
        try:
            return Manifest.model_validate(self.weights_info)
        except (ValidationError, ManifestError) as exc:
            raise EngineAPIError(
                "/remote_instance_transfer_engine_info", 200, f"rank {self.rank}: weights info is not a manifest: {exc}"
            ) from exc


@dataclass(frozen=True)
class VerifyReport:
    rank: int
    version: str
    ok: bool
    buckets: int
    mismatched: tuple[int, ...]
    error: str | None


class EngineClient:
    """Client for one engine's HTTP server (all its ranks; per-rank routes take ``rank``)."""

    def __init__(self, base_url: str, *, timeout: float = 10.0, api_key: str | None = None) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    # ------------------------------------------------------------------------------------ transport

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
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as exc:
            payload = _decode(exc.read())
            raise EngineAPIError(route, exc.code, _message(payload) or exc.reason, payload) from exc
        except urllib.error.URLError as exc:
            raise EngineUnreachableError(route, None, f"{self.base_url} unreachable: {exc.reason}") from exc
        except (TimeoutError, ConnectionError) as exc:
            raise EngineUnreachableError(route, None, f"{self.base_url}: {exc!r}") from exc

    def _get(self, route: str, query: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        return self.request("GET", route, query=query, timeout=timeout)[1]

    def _post(self, route: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        return self.request("POST", route, body=body if body is not None else {}, timeout=timeout)[1]

    def _get_first(
        self, routes: Sequence[str], query: dict[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """GET the first of ``routes`` that exists (SGLang renamed several; older names answer 404)."""
        last: EngineAPIError | None = None
        for route in routes:
            try:
                return self._get(route, query, timeout)
            except EngineAPIError as exc:
                if exc.status != 404:
                    raise
                last = exc
        assert last is not None
        raise last

    # --------------------------------------------------------------------------------- SGLang routes

    def health(self, timeout: float | None = None) -> bool:
        """True on 200, False on 503 (starting, unhealthy, shutting down); unreachable raises."""
        try:
            self._get("/health", timeout=timeout)
        except EngineUnreachableError:
            raise
        except EngineAPIError as exc:
            if exc.status == 503:
                return False
            raise
        return True

    def model_info(self, timeout: float | None = None) -> dict[str, Any]:
        return _object(self._get_first(("/model_info", "/get_model_info"), timeout=timeout), "/model_info")

    def server_info(self, timeout: float | None = None) -> dict[str, Any]:
        return _object(self._get_first(("/server_info", "/get_server_info"), timeout=timeout), "/server_info")

    def weight_version(self, timeout: float | None = None) -> str | None:
        """The engine's current weight version (SGLang: ``/model_info``; older: ``/get_weight_version``)."""
        info = self._get_first(("/model_info", "/weight_version", "/get_weight_version"), timeout=timeout)
        info = _object(info, "/model_info")
        if "weight_version" not in info:
            raise EngineAPIError("/model_info", 200, "answer has no weight_version", info)
        version = info["weight_version"]
        return None if version is None else str(version)

    def transfer_engine_info(self, rank: int, timeout: float | None = None) -> TransferEngineInfo:
        routes = ("/remote_instance_transfer_engine_info", "/get_remote_instance_transfer_engine_info")
        info = _object(self._get_first(routes, {"rank": rank}, timeout), routes[0])
        pair = info.get("remote_instance_transfer_engine_info")
        if not isinstance(pair, list | tuple) or len(pair) != 2 or not isinstance(pair[0], str):
            raise EngineAPIError(routes[0], 200, f"rank {rank}: expected [session_id, weights_info]", info)
        answered = info.get("rank", rank)
        if answered != rank:
            raise EngineAPIError(routes[0], 200, f"asked for rank {rank}, got rank {answered}", info)
        return TransferEngineInfo(rank, pair[0], pair[1])

    def manifest(self, rank: int, timeout: float | None = None) -> Manifest:
        """Rank ``rank``'s manifest (reference engine), checked; its session id must match the info's."""
        info = self.transfer_engine_info(rank, timeout)
        manifest = info.manifest()
        if manifest.rank != rank or manifest.session_id != info.session_id:
            raise EngineAPIError(
                "/remote_instance_transfer_engine_info",
                200,
                f"manifest is for rank {manifest.rank} / session {manifest.session_id}, "
                f"asked for rank {rank} / session {info.session_id}",
            )
        return manifest

    def pause_generation(self, mode: PauseMode = "abort", timeout: float | None = None) -> dict[str, Any]:
        return _object(self._post("/pause_generation", {"mode": mode}, timeout), "/pause_generation")

    def continue_generation(self, timeout: float | None = None) -> dict[str, Any]:
        return _object(self._post("/continue_generation", {}, timeout), "/continue_generation")

    def update_weight_version(
        self, new_version: str | int, *, abort_all_requests: bool = False, timeout: float | None = None
    ) -> dict[str, Any]:
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        answer = _object(self._post("/update_weight_version", body, timeout), "/update_weight_version")
        if answer.get("success") is False:
            raise EngineAPIError("/update_weight_version", 200, str(answer.get("message")), answer)
        return answer

    def flush_cache(self, timeout: float | None = None) -> None:
        self.request("POST", "/flush_cache", body={}, timeout=timeout)

    def generate(self, input_ids: Sequence[int], max_new_tokens: int, timeout: float | None = None) -> list[int]:
        """Greedy continuation of ``input_ids`` (token ids; no tokenizer involved)."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        }
        answer = _object(self._post("/generate", body, timeout), "/generate")
        ids = answer.get("output_ids")
        if not isinstance(ids, list):
            raise EngineAPIError("/generate", 200, "answer has no output_ids", answer)
        return [int(i) for i in ids]

    # ---------------------------------------------------------------------- weightsync extension routes

    def supports_weightsync(self, timeout: float | None = None) -> bool:
        """Whether the engine serves the ``/weightsync/`` extension routes (the reference engine does)."""
        try:
            self._get("/weightsync/status", timeout=timeout)
        except EngineUnreachableError:
            raise
        except EngineAPIError as exc:
            if exc.status in (404, 405):
                return False
            raise
        return True

    def status(self, timeout: float | None = None) -> dict[str, Any]:
        return _object(self._get("/weightsync/status", timeout=timeout), "/weightsync/status")

    def stage(self, enabled: bool, timeout: float | None = None) -> bool:
        answer = _object(self._post("/weightsync/stage", {"enabled": enabled}, timeout), "/weightsync/stage")
        return bool(answer.get("staged"))

    def begin(self, version: str | int, timeout: float | None = None, *, verify: bool = True) -> dict[str, Any]:
        body = {"version": str(version), "verify": verify}
        return _object(self._post("/weightsync/begin", body, timeout), "/weightsync/begin")

    def verify(
        self,
        rank: int,
        version: str | int,
        bucket_bytes: int,
        checksums: Sequence[str],
        timeout: float | None = None,
    ) -> VerifyReport:
        body = {"rank": rank, "version": str(version), "bucket_bytes": bucket_bytes, "checksums": list(checksums)}
        answer = _object(self._post("/weightsync/verify", body, timeout), "/weightsync/verify")
        try:
            return VerifyReport(
                rank=int(answer["rank"]),
                version=str(answer["version"]),
                ok=bool(answer["ok"]),
                buckets=int(answer["buckets"]),
                mismatched=tuple(int(m["index"]) for m in answer["mismatched"]),
                error=answer.get("error"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineAPIError("/weightsync/verify", 200, f"unexpected answer: {exc!r}", answer) from exc

    def commit(self, version: str | int, timeout: float | None = None) -> dict[str, Any]:
        return _object(self._post("/weightsync/commit", {"version": str(version)}, timeout), "/weightsync/commit")

    def abort(self, version: str | int | None = None, timeout: float | None = None) -> dict[str, Any]:
        body = {} if version is None else {"version": str(version)}
        return _object(self._post("/weightsync/abort", body, timeout), "/weightsync/abort")

    def checksums(self, rank: int, bucket_bytes: int, timeout: float | None = None) -> list[str]:
        """Per-bucket checksums of what ``rank``'s target memory holds now (reference engine)."""
        route = "/weightsync/checksums"
        answer = _object(self._get(route, {"rank": rank, "bucket_bytes": bucket_bytes}, timeout), route)
        sums = answer.get("checksums")
        if not isinstance(sums, list):
            raise EngineAPIError(route, 200, "answer has no checksums list", answer)
        return [str(x) for x in sums]

    def forward(self, tokens: Sequence[int], timeout: float | None = None) -> list[list[float]]:
        """Logits [T][vocab] for one sequence (float32 values, exact through JSON)."""
        answer = _object(self._post("/weightsync/forward", {"tokens": list(tokens)}, timeout), "/weightsync/forward")
        logits = answer.get("logits")
        if not isinstance(logits, list):
            raise EngineAPIError("/weightsync/forward", 200, "answer has no logits", answer)
        return logits


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _message(payload: Any) -> str | None:
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail"):
            if payload.get(key):
                return str(payload[key])
    if isinstance(payload, str) and payload:
        return payload[:500]
    return None


def _object(payload: Any, route: str) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise EngineAPIError(route, 200, f"expected a JSON object, got {type(payload).__name__}", payload)
    return payload
