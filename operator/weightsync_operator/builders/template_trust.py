"""What a user's pod template may not ask for: the ways its containers could obtain the agent's or the group's
credentials (docs/security.md, "Pod templates").

The builder already drops the agent's own volumes from the user's containers and turns off the automatic token
mount. A template can still ask for the same credentials by other routes, each of which a review used:

* a projected ``serviceAccountToken`` volume: every pod of the group runs as the agents' ServiceAccount, so the
  user's container would get an agent token bound to its pod, enough to rewrite that pod's ``weightsync.io/``
  annotations (the agents' URLs, the committed version);
* the group's Secret (``<group>-credentials``) by a ``secret`` volume, a projected ``secret`` source, a
  ``secretKeyRef`` or an ``envFrom`` ``secretRef``: the group's admin token;
* ``weightsync.io/`` annotations in the template's metadata: the keys agents and the operator publish state under.

Pure: :func:`template_refusals` reads the template and names every such request, the builder refuses the group
with them (``InvalidTemplate``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from weightsync.api import names

#: The annotation prefix the operator and the agents own.
RESERVED_PREFIX = "weightsync.io/"


def template_refusals(group: str, role: str, template: Mapping[str, Any]) -> list[str]:
    """Every credential route ``template`` (the ``role`` pods' template of group ``group``) asks for, one sentence
    each; empty when it asks for none."""
    secret = names.group_secret(group)
    found: list[str] = []
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    reserved = sorted(k for k in annotations if isinstance(k, str) and k.startswith(RESERVED_PREFIX))
    if reserved:
        found.append(f"{role} template sets annotations {reserved[:5]}: keys under {RESERVED_PREFIX} are the "
                     "operator's and the agents' (remove them)")  # fmt: skip
    spec = template.get("spec") or {}
    for volume in spec.get("volumes") or []:
        name = volume.get("name", "?") if isinstance(volume, Mapping) else "?"
        for kind in _volume_credentials(volume, secret):
            found.append(f"{role} template volume {name!r} mounts {kind}: only the weightsync agent holds it")
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or []:
            if not isinstance(container, Mapping):
                continue
            for where in _env_secret_refs(container, secret):
                found.append(f"{role} template container {container.get('name', '?')!r} reads the group's Secret "
                             f"{secret} ({where}): only the weightsync agent and the engine's token variable "
                             "may")  # fmt: skip
    return found


def _volume_credentials(volume: Any, secret: str) -> Iterator[str]:
    if not isinstance(volume, Mapping):
        return
    if (volume.get("secret") or {}).get("secretName") == secret:
        yield f"the group's Secret {secret}"
    for source in (volume.get("projected") or {}).get("sources") or []:
        if not isinstance(source, Mapping):
            continue
        if "serviceAccountToken" in source:
            yield "a ServiceAccount token (the pod runs as the agents' account)"
        if (source.get("secret") or {}).get("name") == secret:
            yield f"the group's Secret {secret}"


def _env_secret_refs(container: Mapping[str, Any], secret: str) -> Iterator[str]:
    for item in container.get("env") or []:
        ref = ((item.get("valueFrom") or {}).get("secretKeyRef") or {}) if isinstance(item, Mapping) else {}
        if ref.get("name") == secret:
            yield f"env {item.get('name', '?')}"
    for source in container.get("envFrom") or []:
        if isinstance(source, Mapping) and (source.get("secretRef") or {}).get("name") == secret:
            yield "envFrom"
