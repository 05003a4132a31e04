"""Adapters by ``inference.adapter`` name: a new engine kind is one folder and one line here."""

from __future__ import annotations

import contextlib
from typing import Final

from weightsync.api.engines import ENGINE_KINDS, unavailable_message
from weightsync.plan import Plan
from weightsync_agent.directory import Directory, DirectoryError
from weightsync_agent.http.credential import ApiKey
from weightsync_agent.targets.adapter import AdapterSettings, AdapterUnavailableError, EngineAdapter
from weightsync_agent.targets.reference.adapter import ReferenceAdapter
from weightsync_agent.targets.sglang.adapter import SglangAdapter
from weightsync_agent.targets.vllm.adapter import VllmAdapter
from weightsync_agent.targets.vllm.live_adapter import VllmLiveAdapter
from weightsync_agent.targets.vllm.nccl_adapter import VllmNcclAdapter

ADAPTERS: Final[dict[str, type[EngineAdapter]]] = {
    ReferenceAdapter.kind: ReferenceAdapter,
    SglangAdapter.kind: SglangAdapter,
    VllmAdapter.kind: VllmAdapter,
}
#: Where an engine takes one ``(transfer.mode, transfer.targetStaging)`` through another of its ways in, that
#: variant's adapter (stock vLLM: staged p2p into the plugin's receive buffer, the kind's default; live p2p into its
#: parameters through the same plugin; broadcast through vLLM's own nccl backend).
MODE_ADAPTERS: Final[dict[tuple[str, str, str], type[EngineAdapter]]] = {
    (VllmLiveAdapter.kind, "p2p", "live"): VllmLiveAdapter,
    (VllmNcclAdapter.kind, "broadcast", "live"): VllmNcclAdapter,
}


def make_adapter(kind: str, settings: AdapterSettings) -> EngineAdapter:
    """The adapter of engine kind ``kind`` for ``settings.mode`` and ``settings.staging``; raises
    :class:`AdapterUnavailableError` naming why there is none."""
    factory = MODE_ADAPTERS.get((kind, settings.mode, settings.staging)) or ADAPTERS.get(kind)
    if factory is None:
        known = ENGINE_KINDS.get(kind)  # type: ignore[call-overload]
        if known is not None and known.capabilities is None:
            raise AdapterUnavailableError(unavailable_message(known))
        raise AdapterUnavailableError(f"inference.adapter {kind!r} is not a known engine kind")
    return factory(settings)


def settings_for(
    plan: Plan,
    engine: int,
    directory: Directory,
    *,
    call_timeout: float,
    url: str | None = None,
    engine_side: bool = False,
    token: ApiKey = None,
) -> AdapterSettings:
    """Engine ``engine``'s adapter settings under ``plan`` (``url``: the engine's, when known without the directory).

    ``token``: the group's credential, the adapter's ``api_key`` for the engine (SGLang's ``--admin-api-key``)
    and for the engine's agent alike.
    """
    transfer = plan.transfer
    agent_url: str | None = None
    adapter = ADAPTERS.get(plan.layout.adapter)
    if adapter is not None and adapter.manifests_from_engine_agent and not engine_side:
        # Only such kinds pay for the lookup (a pod read under the operator); a missing agent is the fetch's error.
        with contextlib.suppress(DirectoryError):
            agent_url = directory.engine_agent_url(engine)
    return AdapterSettings(
        engine=engine,
        url=url or directory.engine_url(engine),
        ranks=plan.layout.ranks_per_engine,
        bucket_bytes=transfer.bucket_bytes,
        verify=transfer.verify,
        staging=transfer.target_staging,
        mode=transfer.mode,
        call_timeout=call_timeout,
        agent_url=agent_url,
        engine_side=engine_side,
        api_key=token,
    )
