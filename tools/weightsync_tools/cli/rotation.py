"""Rotating a group's token, as pure steps on the Secret and the group's pods (``weightsync rotate-token``).

A rotation has a window: ``start`` moves ``token`` to ``previous`` and writes a new ``token``; agents accept both
and send the new one, falling back to ``previous`` for an engine that still runs with it (an engine reads its
admin key once, at start). ``finish`` drops ``previous``: every agent and engine must hold the new token by
then, so it refuses while an engine container started before the rotation (docs/security.md).

Every patch carries the Secret's ``resourceVersion``: the API server refuses it (409) if the Secret changed since
it was read, so two rotations cannot interleave.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from weightsync.api import names

#: On the Secret: when the current rotation started (RFC 3339, UTC); engine containers started before it still run
#: with the previous token. Written with the rotation, dropped by ``finish``; the operator never touches it.
ROTATED_AT = "weightsync.io/rotated-at"


class RotationError(ValueError):
    """The Secret is not in a state this step can start from (one line, for the CLI)."""


def decoded(secret: Mapping[str, Any], key: str) -> str | None:
    raw = (secret.get("data") or {}).get(key)
    if not raw:
        return None
    try:
        return base64.b64decode(raw, validate=True).decode() or None
    except (binascii.Error, UnicodeDecodeError):
        return None


def _b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


def start_patch(secret: Mapping[str, Any], new_token: str, now: datetime) -> dict[str, Any]:
    """The merge patch that opens a rotation window: ``previous`` := ``token``, ``token`` := ``new_token``."""
    name = (secret.get("metadata") or {}).get("name", "the Secret")
    current = decoded(secret, names.SECRET_TOKEN_KEY)
    if current is None:
        raise RotationError(f"{name} holds no token: the operator makes one; nothing to rotate")
    if decoded(secret, names.SECRET_PREVIOUS_KEY) is not None:
        raise RotationError(
            f"{name} already holds a previous token (a rotation is open): restart the engine pods and run "
            "`weightsync rotate-token --finish` first; rotating again now would lock out engines still on it"
        )
    if not new_token or new_token == current:
        raise RotationError("the new token must be non-empty and differ from the current one")
    return {
        "metadata": {
            "resourceVersion": (secret.get("metadata") or {}).get("resourceVersion"),
            "annotations": {ROTATED_AT: now.strftime("%Y-%m-%dT%H:%M:%SZ")},
        },
        "data": {names.SECRET_TOKEN_KEY: _b64(new_token), names.SECRET_PREVIOUS_KEY: _b64(current)},
    }


def finish_patch(secret: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that closes the window: ``previous`` dropped (only the new token is accepted after it)."""
    name = (secret.get("metadata") or {}).get("name", "the Secret")
    if decoded(secret, names.SECRET_PREVIOUS_KEY) is None:
        raise RotationError(f"{name} holds no previous token: no rotation to finish")
    if decoded(secret, names.SECRET_TOKEN_KEY) is None:
        raise RotationError(f"{name} holds no token: finishing would leave the group without a credential")
    return {
        "metadata": {
            "resourceVersion": (secret.get("metadata") or {}).get("resourceVersion"),
            "annotations": {ROTATED_AT: None},
        },
        "data": {names.SECRET_PREVIOUS_KEY: None},
    }


def rotated_at(secret: Mapping[str, Any]) -> datetime | None:
    value = ((secret.get("metadata") or {}).get("annotations") or {}).get(ROTATED_AT)
    return _time(value)


def engines_on_previous(pods: Iterable[Mapping[str, Any]], since: datetime | None) -> list[str]:
    """Engine pods whose engine container (the first container, which holds the token as its env) started before
    ``since`` or has not been seen running: they may still run with the previous token. ``since`` unknown (the
    annotation was removed): every engine pod counts, so ``--finish`` asks for ``--force``."""
    stale = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if (meta.get("labels") or {}).get(names.LABEL_ROLE) != "engine" or meta.get("deletionTimestamp"):
            continue
        containers = (pod.get("spec") or {}).get("containers") or [{}]
        engine = containers[0].get("name")
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        status: Mapping[str, Any] = next((s for s in statuses if s.get("name") == engine), {})
        started = _time(((status.get("state") or {}).get("running") or {}).get("startedAt"))
        if since is None or started is None or started <= since:
            stale.append(str(meta.get("name")))
    return sorted(stale)


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
