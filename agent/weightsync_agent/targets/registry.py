"""Adapters by ``inference.adapter`` name: a new engine kind is one folder and one line here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from weightsync.api.engines import ENGINE_KINDS, unavailable_message
from weightsync_agent.targets.adapter import AdapterSettings, AdapterUnavailableError, EngineAdapter
from weightsync_agent.targets.reference.adapter import ReferenceAdapter

AdapterFactory = Callable[[AdapterSettings], EngineAdapter]

ADAPTERS: Final[dict[str, AdapterFactory]] = {
    ReferenceAdapter.kind: ReferenceAdapter,
}


def make_adapter(kind: str, settings: AdapterSettings) -> EngineAdapter:
    """The adapter of engine kind ``kind``; raises :class:`AdapterUnavailableError` naming why there is none."""
    factory = ADAPTERS.get(kind)
    if factory is None:
        known = ENGINE_KINDS.get(kind)  # type: ignore[call-overload]
        if known is not None and known.capabilities is None:
            raise AdapterUnavailableError(unavailable_message(known))
        raise AdapterUnavailableError(f"inference.adapter {kind!r} is not a known engine kind")
    return factory(settings)
