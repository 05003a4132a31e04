"""What a kubelet makes of a pod's container spec before it starts the process: its environment and its argv.

Used where the local cluster runs a pod's containers as local processes (kwok nodes have no runtime), so a test runs
exactly what the operator's pod says. Pure. Kubernetes' rules (``third_party/forked/golang/expansion`` in kubernetes):
``$(NAME)`` in a variable's value expands from the variables defined *before* it in ``env``; in ``command`` and ``args``
from all of them; ``$$`` is a literal ``$``; a reference to an undefined name stays as written. ``command`` replaces the
image's entrypoint and ``args`` its cmd; with neither, the image's own run (which a local process cannot know: refused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: ``(namespace, secret name, key) -> value`` (what a kubelet reads for ``secretKeyRef``).
SecretReader = Callable[[str, str, str], str]


class ContainerSpecError(ValueError):
    """A container this runner cannot start as its spec says (the message names the container and the field)."""


@dataclass(frozen=True)
class PodFacts:
    """The values a kubelet fills in for the downward API."""

    name: str
    namespace: str
    ip: str
    node: str = ""


def expand(text: str, variables: Mapping[str, str]) -> str:
    """``text`` with ``$(NAME)`` replaced from ``variables`` as Kubernetes does (``$$`` escapes, unknown names stay)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
            continue
        after = text[i + 1]
        if after == "$":
            out.append("$")
            i += 2
        elif after == "(":
            end = text.find(")", i + 2)
            if end == -1:  # no closing parenthesis: the rest is literal
                out.append(text[i:])
                break
            name = text[i + 2 : end]
            out.append(variables[name] if name in variables else text[i : end + 1])
            i = end + 1
        else:
            out.append("$")
            i += 1
    return "".join(out)


def container_env(container: Mapping[str, Any], pod: PodFacts, secrets: SecretReader | None) -> dict[str, str]:
    """The container's environment from its ``env`` list, in order (``envFrom`` is refused: the runner has no
    ConfigMaps; the operator's pods use none)."""
    if container.get("envFrom"):
        raise ContainerSpecError(f"container {container.get('name')}: envFrom is not supported by this runner")
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        name = str(item["name"])
        if "value" in item or "valueFrom" not in item:
            env[name] = expand(str(item.get("value", "")), env)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            env[name] = _field(source["fieldRef"]["fieldPath"], pod, container)
        elif "secretKeyRef" in source:
            if secrets is None:
                raise ContainerSpecError(f"container {container.get('name')}: {name} needs a secret reader")
            ref = source["secretKeyRef"]
            env[name] = secrets(pod.namespace, str(ref["name"]), str(ref["key"]))
        else:
            raise ContainerSpecError(
                f"container {container.get('name')}: {name} from {sorted(source)} is not supported"
            )
    return env


def container_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """``command`` + ``args``, each expanded from ``env``."""
    command = list(container.get("command") or [])
    if not command:
        raise ContainerSpecError(
            f"container {container.get('name')}: no command (the image's entrypoint is not known to a local runner)"
        )
    return [expand(str(part), env) for part in [*command, *(container.get("args") or [])]]


def _field(path: str, pod: PodFacts, container: Mapping[str, Any]) -> str:
    fields = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "status.podIP": pod.ip,
        "spec.nodeName": pod.node,
    }
    if path not in fields:
        raise ContainerSpecError(f"container {container.get('name')}: fieldRef {path} is not supported")
    return fields[path]
