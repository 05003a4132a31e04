"""Where the group's peers answer: each engine's HTTP API and each trainer pod's agent.

Under the operator, agents advertise themselves on their own pods (annotations
``weightsync.io/engine-url`` and ``weightsync.io/agent-url``), which every agent of the group may read by
pod name; a pod that has not advertised yet falls back to its DNS name through the group's headless
Service. Local runs without a cluster name every URL in a small JSON file instead.

An advertised URL is believed only when it names the advertising pod's own address (``status.podIP(s)``, which the
kubelet sets and no annotation can change): callers send the group's credential to it, so an annotation pointing
elsewhere (written by anyone who may patch the pod) must not redirect them. Such a URL is ignored, with a warning, for
the pod's DNS name. The local cluster, whose agents are local processes on loopback, allows loopback as well.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from weightsync.api import names
from weightsync.plan import Layout
from weightsync_agent.kube import api_exception, transport_errors

log = logging.getLogger("weightsync.agent")

#: After the API server failed to answer, how long lookups use the last known answers without asking.
API_HOLD_SECONDS = 15.0


class DirectoryError(LookupError):
    """A peer's address is unknown."""


def points_at_pod(url: str, pod_ips: Collection[str], *, loopback: bool = False) -> bool:
    """Whether ``url``'s host is one of ``pod_ips`` (or, where ``loopback`` is allowed, a loopback address).

    A host name is never believed (the pod's DNS name is what the caller falls back to anyway)."""
    try:
        host = urlsplit(url).hostname
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    if loopback and address.is_loopback:
        return True
    for ip in pod_ips:
        try:
            if ipaddress.ip_address(ip) == address:
                return True
        except ValueError:
            continue
    return False


def pod_ips(pod: Any) -> set[str]:
    """The pod's own addresses as the kubelet reported them (``status.podIP`` and ``status.podIPs``)."""
    status = getattr(pod, "status", None)
    listed = getattr(status, "pod_ips", None) or []
    ips = {getattr(status, "pod_ip", None), *(getattr(each, "ip", None) for each in listed)}
    return {ip for ip in ips if ip}


class Directory(Protocol):
    def engine_url(self, engine: int) -> str:
        """The HTTP base URL of engine ``engine`` (its rank-0 server, as for SGLang)."""
        ...

    def trainer_url(self, pod: int) -> str:
        """The agent URL of trainer pod ``pod``."""
        ...

    def engine_agent_url(self, engine: int) -> str:
        """The agent URL of engine ``engine``'s first pod (adapters whose manifests the agent assembles)."""
        ...


class StaticDirectory:
    """Fixed URLs, e.g. from ``WEIGHTSYNC_DIRECTORY_FILE``:
    ``{"engines": {...}, "trainers": {...}, "engineAgents": {...}}``."""

    def __init__(
        self, engines: Mapping[int, str], trainers: Mapping[int, str], engine_agents: Mapping[int, str] | None = None
    ) -> None:
        self.engines = dict(engines)
        self.trainers = dict(trainers)
        self.engine_agents = dict(engine_agents or {})

    @classmethod
    def from_file(cls, path: str | Path) -> StaticDirectory:
        try:
            data = json.loads(Path(path).read_text())
            return cls(
                {int(k): str(v) for k, v in data.get("engines", {}).items()},
                {int(k): str(v) for k, v in data.get("trainers", {}).items()},
                {int(k): str(v) for k, v in data.get("engineAgents", {}).items()},
            )
        except (OSError, ValueError, AttributeError) as exc:
            raise DirectoryError(f"cannot read the directory file {path}: {exc}") from exc

    def to_json(self) -> dict[str, dict[str, str]]:
        out = {
            "engines": {str(k): v for k, v in sorted(self.engines.items())},
            "trainers": {str(k): v for k, v in sorted(self.trainers.items())},
        }
        if self.engine_agents:
            out["engineAgents"] = {str(k): v for k, v in sorted(self.engine_agents.items())}
        return out

    def engine_url(self, engine: int) -> str:
        try:
            return self.engines[engine]
        except KeyError:
            raise DirectoryError(f"no URL for engine {engine} in the directory") from None

    def trainer_url(self, pod: int) -> str:
        try:
            return self.trainers[pod]
        except KeyError:
            raise DirectoryError(f"no URL for trainer pod {pod} in the directory") from None

    def engine_agent_url(self, engine: int) -> str:
        try:
            return self.engine_agents[engine]
        except KeyError:
            raise DirectoryError(f"no agent URL for engine {engine} in the directory") from None


class FileDirectory:
    """A :class:`StaticDirectory` read from a file, re-read when the file changes (peers join)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._current = StaticDirectory({}, {})
        self._refresh()

    def _refresh(self) -> StaticDirectory:
        try:
            stat = self.path.stat()
        except OSError as exc:
            raise DirectoryError(f"cannot read the directory file {self.path}: {exc}") from exc
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self._current = StaticDirectory.from_file(self.path)
            self._stamp = stamp
        return self._current

    def engine_url(self, engine: int) -> str:
        return self._refresh().engine_url(engine)

    def trainer_url(self, pod: int) -> str:
        return self._refresh().trainer_url(pod)

    def engine_agent_url(self, engine: int) -> str:
        return self._refresh().engine_agent_url(engine)


class PodDirectory:
    """Reads the URLs the agents advertised on their pods; DNS names when none is there yet.

    The API server is not on a round's critical path: each answer is remembered, and while the API server
    does not answer (hung, down, restarting) the last answer serves, without asking again for ``hold_seconds``
    (so a round during an outage does not pay a timeout per lookup). A peer that moved meanwhile fails its
    call, and the round with it, which is the honest outcome; the next lookup after the outage is fresh.
    """

    def __init__(
        self,
        core_api: Any,
        namespace: str,
        group: str,
        layout: Layout,
        *,
        hold_seconds: float = API_HOLD_SECONDS,
        loopback: bool = False,
    ) -> None:
        """``loopback``: believe advertised loopback URLs too (the local cluster's agents; never in a cluster)."""
        self.api = core_api
        self.namespace = namespace
        self.group = group
        self.layout = layout
        self.hold_seconds = hold_seconds
        self.loopback = loopback
        self._known: dict[tuple[str, str], str | None] = {}
        self._unavailable_until = 0.0
        self._ignored: set[tuple[str, str]] = set()  # (pod, URL) already warned about

    def _advertised(self, pod: str, annotation: str) -> str | None:
        api_error = api_exception()

        key = (pod, annotation)
        if key in self._known and time.monotonic() < self._unavailable_until:
            return self._known[key]
        try:
            found = self.api.read_namespaced_pod(pod, self.namespace)
        except api_error as exc:
            if exc.status == 404:
                raise DirectoryError(f"pod {pod} does not exist (yet)") from exc
            if exc.status is not None and exc.status < 500 and exc.status not in (408, 429):
                raise DirectoryError(f"cannot read pod {pod}: {exc.status} {exc.reason}") from exc
            return self._remembered(key, f"{exc.status} {exc.reason}")
        except transport_errors() as exc:
            return self._remembered(key, f"the API server did not answer ({exc})")
        value = (found.metadata.annotations or {}).get(annotation)
        self._known[key] = str(value) if value else None
        if value and not points_at_pod(str(value), ips := pod_ips(found), loopback=self.loopback):
            if (pod, str(value)) not in self._ignored:
                self._ignored.add((pod, str(value)))
                log.warning("pod %s advertises %s=%s, not an address of its own (%s): using its DNS name instead",
                            pod, annotation, value, ", ".join(sorted(ips)) or "no IP yet")  # fmt: skip
            self._known[key] = None
        return self._known[key]

    def _remembered(self, key: tuple[str, str], cause: str) -> str | None:
        self._unavailable_until = time.monotonic() + self.hold_seconds
        if key not in self._known:
            raise DirectoryError(f"cannot read pod {key[0]}: {cause}")
        log.warning("cannot read pod %s (%s): using its last known address for %.0f s", key[0], cause,
                    self.hold_seconds)  # fmt: skip
        return self._known[key]

    def _dns(self, pod: str, port: int) -> str:
        return f"http://{names.pod_address(self.group, self.namespace, pod)}:{port}"

    def engine_url(self, engine: int) -> str:
        pod = names.engine_pod(self.group, engine, 0)
        return self._advertised(pod, names.ANNOTATION_ENGINE_URL) or self._dns(pod, self.layout.engine_port)

    def trainer_url(self, pod: int) -> str:
        name = names.trainer_pod(self.group, pod)
        return self._advertised(name, names.ANNOTATION_AGENT_URL) or self._dns(name, self.layout.agent_port)

    def engine_agent_url(self, engine: int) -> str:
        pod = names.engine_pod(self.group, engine, 0)
        return self._advertised(pod, names.ANNOTATION_AGENT_URL) or self._dns(pod, self.layout.agent_port)
