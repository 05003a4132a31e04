"""Sync modes by ``transfer.mode`` name: a new mode is one folder and one line here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from weightsync_agent.modes.base import SyncMode
from weightsync_agent.modes.broadcast.mode import BroadcastMode
from weightsync_agent.modes.p2p.mode import P2PMode

MODES: Final[dict[str, Callable[[], SyncMode]]] = {
    P2PMode.name: P2PMode,
    BroadcastMode.name: BroadcastMode,
}


def make_mode(name: str) -> SyncMode:
    try:
        return MODES[name]()
    except KeyError:
        raise LookupError(f"transfer.mode {name!r} is not one of {', '.join(MODES)}") from None


def mode_for(current: SyncMode | None, name: str) -> SyncMode:
    """``current`` if it is the mode ``name``, else a new one (the old one is closed)."""
    if current is not None and current.name == name:
        return current
    if current is not None:
        current.close()
    return make_mode(name)
