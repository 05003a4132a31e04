"""Adapters by ``inference.adapter`` name: a new engine kind is one folder and one line here."""

from __future__ import annotations

import contextlib
import importlib
from typing import TYPE_CHECKING, Final

from weightsync.api.engines import ENGINE_KINDS, unavailable_message
from weightsync.plan import Plan
from weightsync_agent.directory import Directory, DirectoryError
from weightsync_agent.http.credential import ApiKey
from weightsync_agent.targets.adapter import AdapterSettings, AdapterUnavailableError, EngineAdapter, EngineRound

#: ``"module:Class"`` per engine kind, imported on use (as vLLM's weight-transfer factory registers its engines): a
#: process imports the adapter it runs, not every engine kind's client code, and no kind's module imports another's.
ADAPTERS: Final[dict[str, str]] = {
    "reference": "weightsync_agent.targets.reference.adapter:ReferenceAdapter",
    "sglang": "weightsync_agent.targets.sglang.adapter:SglangAdapter",
    "vllm": "weightsync_agent.targets.vllm.adapter:VllmAdapter",
}
#: Where an engine takes one ``(transfer.mode, transfer.targetStaging)`` through another of its ways in, that
#: variant's adapter (stock vLLM: staged p2p into the plugin's receive buffer, the kind's default; live p2p into its
#: parameters through the same plugin; broadcast through vLLM's own nccl backend).
MODE_ADAPTERS: Final[dict[tuple[str, str, str], str]] = {
    ("vllm", "p2p", "live"): "weightsync_agent.targets.vllm.live_adapter:VllmLiveAdapter",
    ("vllm", "broadcast", "live"): "weightsync_agent.targets.vllm.nccl_adapter:VllmNcclAdapter",
}

if TYPE_CHECKING:  # the paths above hide the classes from mypy: here it still checks each one against the seam
    from weightsync_agent.targets.reference.adapter import ReferenceAdapter
    from weightsync_agent.targets.sglang.adapter import SglangAdapter
    from weightsync_agent.targets.vllm.adapter import VllmAdapter
    from weightsync_agent.targets.vllm.live_adapter import VllmLiveAdapter
    from weightsync_agent.targets.vllm.nccl_adapter import VllmNcclAdapter

    _CONFORM: tuple[type[EngineAdapter], ...] = (
        ReferenceAdapter, SglangAdapter, VllmAdapter, VllmLiveAdapter, VllmNcclAdapter,
    )  # fmt: skip


#: The methods of the seam (``EngineAdapter`` is a Protocol: adapters conform, they do not subclass it).
SEAM: Final = frozenset(
    name
    for klass in (EngineRound, EngineAdapter)
    for name, value in vars(klass).items()
    if callable(value) and not name.startswith("_")
)


def resolve(path: str) -> type[EngineAdapter]:
    """The adapter class at ``path`` (``"module:Class"``), imported now; TypeError unless it is a class with a
    ``kind`` and every method of the seam."""
    module, _, name = path.partition(":")
    found = getattr(importlib.import_module(module), name)
    lacks = sorted(m for m in SEAM if not callable(getattr(found, m, None)))
    if not isinstance(getattr(found, "kind", None), str):
        lacks.insert(0, "kind")
    if not isinstance(found, type) or lacks:
        raise TypeError(f"{path} is not an EngineAdapter (lacks {', '.join(lacks) or 'a class'})")
    adapter: type[EngineAdapter] = found
    return adapter


def adapter_class(kind: str, mode: str | None = None, staging: str | None = None) -> type[EngineAdapter] | None:
    """The adapter class of engine kind ``kind`` (for ``mode`` and ``staging`` where it has a variant for them);
    None for a kind without one."""
    path = MODE_ADAPTERS.get((kind, mode, staging)) if mode is not None and staging is not None else None
    path = path or ADAPTERS.get(kind)
    return resolve(path) if path is not None else None


def make_adapter(kind: str, settings: AdapterSettings) -> EngineAdapter:
    """The adapter of engine kind ``kind`` for ``settings.mode`` and ``settings.staging``; raises
    :class:`AdapterUnavailableError` naming why there is none."""
    factory = adapter_class(kind, settings.mode, settings.staging)
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
    adapter = adapter_class(plan.layout.adapter)
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
