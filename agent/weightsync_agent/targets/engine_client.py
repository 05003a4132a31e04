"""A small typed HTTP client for an inference engine's weight-update routes.

Works against a real SGLang server and against the reference engine. The SGLang routes are used as SGLang
defines them (see docs/reference-engine.md for sources); where SGLang renamed a route, the client tries
the current name first and falls back to the older one on 404. The reference engine's ``/weightsync/``
routes are an optional capability: :meth:`EngineClient.supports_weightsync` tells whether they exist.

Calls go through :class:`~weightsync_agent.http.client.JsonHttpClient`: bounded by a timeout, failing
with :class:`~weightsync_agent.http.client.PeerUnreachableError` or
:class:`~weightsync_agent.http.client.HttpCallError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from weightsync_agent.http.client import HttpCallError, JsonHttpClient, PeerUnreachableError
from weightsync_agent.layout.manifest import Manifest, ManifestError

PauseMode = Literal["abort", "retract", "in_place"]


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
            raise HttpCallError(
                "/remote_instance_transfer_engine_info", 200, f"rank {self.rank}: weights info is not a manifest: {exc}"
            ) from exc


@dataclass(frozen=True)
class RankVerification:
    rank: int
    version: str
    ok: bool
    buckets: int
    mismatched: tuple[int, ...]
    error: str | None


class EngineClient(JsonHttpClient):
    """Client for one engine's HTTP server (all its ranks; per-rank routes take ``rank``)."""

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    # --------------------------------------------------------------------------------- SGLang routes

    def health(self, timeout: float | None = None) -> bool:
        """True on 200, False on 503 (starting, unhealthy, shutting down); unreachable raises."""
        try:
            self._get("/health", timeout=timeout)
        except PeerUnreachableError:
            raise
        except HttpCallError as exc:
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
            raise HttpCallError("/model_info", 200, "answer has no weight_version", info)
        version = info["weight_version"]
        return None if version is None else str(version)

    def transfer_engine_info(self, rank: int, timeout: float | None = None) -> TransferEngineInfo:
        routes = ("/remote_instance_transfer_engine_info", "/get_remote_instance_transfer_engine_info")
        info = _object(self._get_first(routes, {"rank": rank}, timeout), routes[0])
        pair = info.get("remote_instance_transfer_engine_info")
        if not isinstance(pair, list | tuple) or len(pair) != 2 or not isinstance(pair[0], str):
            raise HttpCallError(routes[0], 200, f"rank {rank}: expected [session_id, weights_info]", info)
        answered = info.get("rank", rank)
        if answered != rank:
            raise HttpCallError(routes[0], 200, f"asked for rank {rank}, got rank {answered}", info)
        return TransferEngineInfo(rank, pair[0], pair[1])

    def manifest(self, rank: int, timeout: float | None = None) -> Manifest:
        """Rank ``rank``'s manifest (reference engine), checked; its session id must match the info's."""
        info = self.transfer_engine_info(rank, timeout)
        manifest = info.manifest()
        if manifest.rank != rank or manifest.session_id != info.session_id:
            raise HttpCallError(
                "/remote_instance_transfer_engine_info",
                200,
                f"manifest is for rank {manifest.rank} / session {manifest.session_id}, "
                f"asked for rank {rank} / session {info.session_id}",
            )
        return manifest

    def pause_generation(
        self, mode: PauseMode = "abort", timeout: float | None = None, *, round_id: str | None = None
    ) -> dict[str, Any]:
        """``round_id``: the reference engine's extension field; never sent to stock SGLang (its adapter keeps
        the round id client-side)."""
        body = _with_round({"mode": mode}, round_id)
        return _object(self._post("/pause_generation", body, timeout), "/pause_generation")

    def continue_generation(self, timeout: float | None = None, *, round_id: str | None = None) -> dict[str, Any]:
        return _object(self._post("/continue_generation", _with_round({}, round_id), timeout), "/continue_generation")

    def update_weight_version(
        self, new_version: str | int, *, abort_all_requests: bool = False, timeout: float | None = None
    ) -> dict[str, Any]:
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        answer = _object(self._post("/update_weight_version", body, timeout), "/update_weight_version")
        if answer.get("success") is False:
            raise HttpCallError("/update_weight_version", 200, str(answer.get("message")), answer)
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
            raise HttpCallError("/generate", 200, "answer has no output_ids", answer)
        return [int(i) for i in ids]

    def prompt_logprobs(self, input_ids: Sequence[int], timeout: float | None = None) -> list[float | None]:
        """The logprob the engine gives each of ``input_ids`` after the first (SGLang's ``/generate`` with
        ``return_logprob`` from position 0, one new token that is not used)."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        answer = _object(self._post("/generate", body, timeout), "/generate")
        meta = answer.get("meta_info")
        entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(entries, list) or len(entries) != len(input_ids):
            raise HttpCallError("/generate", 200, f"no input_token_logprobs for the {len(input_ids)} input ids")
        scored: list[float | None] = []
        for position, (entry, want) in enumerate(zip(entries[1:], input_ids[1:], strict=True), start=1):
            if not isinstance(entry, list) or len(entry) < 2 or entry[1] != want:
                raise HttpCallError("/generate", 200, f"input_token_logprobs[{position}] is not for token {want}")
            scored.append(float(entry[0]) if isinstance(entry[0], int | float) else None)
        return scored

    # ---------------------------------------------------------------------- weightsync extension routes

    def supports_weightsync(self, timeout: float | None = None) -> bool:
        """Whether the engine serves the ``/weightsync/`` extension routes (the reference engine does)."""
        try:
            self._get("/weightsync/status", timeout=timeout)
        except PeerUnreachableError:
            raise
        except HttpCallError as exc:
            if exc.status in (404, 405):
                return False
            raise
        return True

    def status(self, timeout: float | None = None) -> dict[str, Any]:
        return _object(self._get("/weightsync/status", timeout=timeout), "/weightsync/status")

    def stage(self, enabled: bool, timeout: float | None = None) -> bool:
        answer = _object(self._post("/weightsync/stage", {"enabled": enabled}, timeout), "/weightsync/stage")
        return bool(answer.get("staged"))

    def begin(
        self, version: str | int, timeout: float | None = None, *, verify: bool = True, round_id: str | None = None
    ) -> dict[str, Any]:
        body = _with_round({"version": str(version), "verify": verify}, round_id)
        return _object(self._post("/weightsync/begin", body, timeout), "/weightsync/begin")

    def verify(
        self,
        rank: int,
        version: str | int,
        bucket_bytes: int,
        checksums: Sequence[str],
        timeout: float | None = None,
        *,
        round_id: str | None = None,
    ) -> RankVerification:
        body = {"rank": rank, "version": str(version), "bucket_bytes": bucket_bytes, "checksums": list(checksums)}
        body = _with_round(body, round_id)
        answer = _object(self._post("/weightsync/verify", body, timeout), "/weightsync/verify")
        return _rank_verification("/weightsync/verify", answer)

    def apply(self, version: str | int, timeout: float | None = None, *, round_id: str | None = None) -> dict[str, Any]:
        """The semantic gate's apply: the verified weights may serve; the label stays (docs/agent.md)."""
        body = _with_round({"version": str(version)}, round_id)
        return _object(self._post("/weightsync/apply", body, timeout), "/weightsync/apply")

    def commit(
        self, version: str | int, timeout: float | None = None, *, round_id: str | None = None
    ) -> dict[str, Any]:
        body = _with_round({"version": str(version)}, round_id)
        return _object(self._post("/weightsync/commit", body, timeout), "/weightsync/commit")

    def abort(
        self,
        version: str | int | None = None,
        timeout: float | None = None,
        *,
        round_id: str | None = None,
        written: bool = True,
    ) -> dict[str, Any]:
        """``written=False``: no source was asked to write in the round (the engine may serve again)."""
        body: dict[str, Any] = {} if version is None else {"version": str(version)}
        if not written:
            body["written"] = False
        return _object(self._post("/weightsync/abort", _with_round(body, round_id), timeout), "/weightsync/abort")

    def scrub(
        self, rank: int, version: str | int, bucket_bytes: int, checksums: Sequence[str], timeout: float | None = None
    ) -> RankVerification:
        """Scrubbing (reference engine): ``rank``'s live memory against the held ``version``'s ``checksums``, between
        rounds; a drift stops the engine serving until a round repairs it."""
        route = "/weightsync/scrub"
        body = {"rank": rank, "version": str(version), "bucket_bytes": bucket_bytes, "checksums": list(checksums)}
        answer = _object(self._post(route, body, timeout), route)
        return _rank_verification(route, answer)

    def checksums(self, rank: int, bucket_bytes: int, timeout: float | None = None) -> list[str]:
        """Per-bucket checksums of what ``rank``'s target memory holds now (reference engine)."""
        route = "/weightsync/checksums"
        answer = _object(self._get(route, {"rank": rank, "bucket_bytes": bucket_bytes}, timeout), route)
        sums = answer.get("checksums")
        if not isinstance(sums, list):
            raise HttpCallError(route, 200, "answer has no checksums list", answer)
        return [str(x) for x in sums]

    def forward(self, tokens: Sequence[int], timeout: float | None = None) -> list[list[float]]:
        """Logits [T][vocab] for one sequence (float32 values, exact through JSON)."""
        answer = _object(self._post("/weightsync/forward", {"tokens": list(tokens)}, timeout), "/weightsync/forward")
        logits = answer.get("logits")
        if not isinstance(logits, list):
            raise HttpCallError("/weightsync/forward", 200, "answer has no logits", answer)
        return logits


def _with_round(body: dict[str, Any], round_id: str | None) -> dict[str, Any]:
    """``body`` naming round ``round_id`` (the reference engine refuses a call naming another than its open one)."""
    return body if round_id is None else {**body, "round_id": round_id}


def _object(payload: Any, route: str) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise HttpCallError(route, 200, f"expected a JSON object, got {type(payload).__name__}", payload)
    return payload


def _rank_verification(route: str, answer: dict[str, Any]) -> RankVerification:
    """The reference engine's answer to a verify or a scrub of one rank."""
    try:
        return RankVerification(
            rank=int(answer["rank"]),
            version=str(answer["version"]),
            ok=bool(answer["ok"]),
            buckets=int(answer["buckets"]),
            mismatched=tuple(int(m["index"]) for m in answer["mismatched"]),
            error=answer.get("error"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise HttpCallError(route, 200, f"unexpected answer: {exc!r}", answer) from exc
