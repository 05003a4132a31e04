"""The group's credential: one Secret per group holding a random token (docs/security.md).

The token is made once, when the Secret is created, and never rewritten by a later reconcile: engines read it
from their environment at start, so only a rotation (``weightsync rotate-token``) changes it, and that keeps the
old one as ``previous`` for a window. The operator never writes ``previous``; reconciles patch only the
Secret's metadata, so both keys survive them. The builder is pure; the token comes from :func:`new_token`, which
the reconciler calls only to create.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from weightsync.api import names
from weightsync.api.token import TOKEN_BYTES, new_token
from weightsync.api.v1alpha1 import WeightSyncGroup
from weightsync_operator.builders.common import JsonDict, object_meta

__all__ = ["TOKEN_BYTES", "build_group_secret", "new_token", "secret_token"]


def build_group_secret(group: WeightSyncGroup, token: str | None = None) -> JsonDict:
    """The group's Secret ``<group>-credentials``, owned by the group; ``token`` None: the metadata only (what
    a reconcile may patch on an existing Secret), never its data."""
    secret: JsonDict = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(group, names.group_secret(group.metadata.name)),
        "type": "Opaque",
    }
    if token is not None:
        if not token:
            raise ValueError("the group token must not be empty")
        secret["data"] = {names.SECRET_TOKEN_KEY: base64.b64encode(token.encode()).decode()}
    return secret


def secret_token(secret: Mapping[str, Any]) -> str | None:
    """The token an existing Secret holds, or None when it holds none (or an unusable one)."""
    raw = (secret.get("data") or {}).get(names.SECRET_TOKEN_KEY)
    if not raw:
        return None
    try:
        token = base64.b64decode(raw, validate=True).decode()
    except ValueError:
        return None
    return token or None


def credentials_volume(group: WeightSyncGroup, name: str) -> JsonDict:
    """The group's Secret as files, for the agent container only: ``token`` and, during a rotation, ``previous``
    (``optional: false``: a pod without its Secret waits for it). Kubelets refresh the files in place."""
    return {
        "name": name,
        "secret": {"secretName": names.group_secret(group.metadata.name), "defaultMode": 0o444, "optional": False},
    }


def token_env(group: WeightSyncGroup) -> JsonDict:
    """``WEIGHTSYNC_GROUP_TOKEN`` from the group's Secret: what the engine container gets (an engine reads its
    admin key once, at start, so the env is enough; the agent reads the mounted files instead)."""
    return {
        "name": names.ENV_GROUP_TOKEN,
        "valueFrom": {"secretKeyRef": {"name": names.group_secret(group.metadata.name), "key": names.SECRET_TOKEN_KEY}},
    }
