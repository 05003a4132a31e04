"""Calls to an engine pod's agent, for engine kinds whose manifests (and checks) only that agent can make.

SGLang publishes addresses but not its shard map, which the engine's own pod traces; vLLM's receive buffer is a
file that only the engine's pod can read. Everyone else (the sources, the coordinator) asks that pod's agent.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError

from weightsync_agent.http.client import HttpCallError, JsonHttpClient
from weightsync_agent.layout.manifest import Manifest, ManifestError
from weightsync_agent.targets.adapter import AdapterSettings, TargetVerdict

#: The engine pod agent's route serving manifests its adapter assembles (``?rank=r``).
MANIFEST_ROUTE = "/v1/engine/manifest"
#: The engine pod agent's route checking what landed in a rank against the sources' bucket checksums.
VERIFY_ROUTE = "/v1/engine/verify"
#: At most this many mismatched bucket indices travel back (the first ones; the count is in the error).
MAX_MISMATCHED = 64


def _agent(settings: AdapterSettings, who: str) -> JsonHttpClient:
    if not settings.agent_url:
        raise ManifestError(f"{who}: no agent URL for engine {settings.engine}'s pod")
    return JsonHttpClient(settings.agent_url, timeout=settings.call_timeout, api_key=settings.api_key)


def fetch_manifest(settings: AdapterSettings, rank: int, who: str, *, timeout: float | None = None) -> Manifest:
    """Rank ``rank``'s manifest from the engine pod's agent, checked to be that engine's and that rank's."""
    _, answer = _agent(settings, who).request("GET", MANIFEST_ROUTE, query={"rank": rank}, timeout=timeout)
    try:
        manifest = Manifest.model_validate(answer)
    except (ValidationError, ManifestError) as exc:
        raise ManifestError(f"{who}: rank {rank}'s manifest from its agent is not usable: {exc}") from exc
    if manifest.rank != rank or manifest.engine != settings.engine:
        got = f"engine {manifest.engine} rank {manifest.rank}"
        raise ManifestError(f"{who}: asked for rank {rank}, got {got}")
    return manifest


def remote_verify(
    settings: AdapterSettings,
    rank: int,
    version: int,
    checksums: Sequence[str],
    timeout: float,
    *,
    round_id: str,
    who: str,
) -> TargetVerdict:
    """The engine pod's agent checks rank ``rank`` against ``checksums`` (one per bucket)."""
    body = {"rank": rank, "version": version, "checksums": list(checksums), "roundId": round_id}
    try:
        _, answer = _agent(settings, who).request("POST", VERIFY_ROUTE, body=body, timeout=timeout)
    except ManifestError as exc:
        return TargetVerdict(ok=False, error=str(exc))
    if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
        raise HttpCallError(VERIFY_ROUTE, 200, f"not a verdict: {str(answer)[:200]}", answer)
    mismatched = [int(i) for i in answer.get("mismatched") or []][:MAX_MISMATCHED]
    error = answer.get("error")
    return TargetVerdict(ok=answer["ok"], mismatched=mismatched, error=str(error) if error else None)
