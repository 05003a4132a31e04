"""The Kubernetes API client agents use (in-cluster credentials, else the kubeconfig), every call bounded.

Agents never need the API server for a round: they talk to each other and to engines directly. They use it to
read the plan and their peers' advertised URLs, and to report on their own pod. A hung API server accepts
connections and never answers, and the client library waits forever by default; so every call here carries a
connect and a read timeout, and callers treat its failures as "not now" (``transport_errors``).
"""

from __future__ import annotations

import functools
import random
from typing import Any, Final

#: Connecting to the API server: loopback or the cluster network, so seconds are plenty.
CONNECT_SECONDS: Final = 3.0
#: One read of one small object (a pod, the plan ConfigMap) or one patch.
READ_SECONDS: Final = 10.0
#: The longest ``Retry-After`` honoured (a larger one is the API server's business, not a hint to wait minutes).
MAX_RETRY_AFTER_SECONDS: Final = 10.0


class BoundedCoreApi:
    """``CoreV1Api`` whose every call carries ``_request_timeout`` (the library's default is none)."""

    def __init__(self, api: Any, connect: float = CONNECT_SECONDS, read: float = READ_SECONDS) -> None:
        self._api = api
        self.timeout = (connect, read)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._api, name)
        if not callable(method):
            return method
        return functools.partial(method, _request_timeout=self.timeout)


def transport_errors() -> tuple[type[BaseException], ...]:
    """What the client raises when the API server cannot be reached or does not answer in time."""
    import urllib3.exceptions

    return (urllib3.exceptions.HTTPError, OSError)


def api_exception() -> Any:
    """The client's ``ApiException`` class, to catch: the ``kubernetes`` package is imported in this module only."""
    from kubernetes.client.exceptions import ApiException

    return ApiException


def kube_core_api() -> Any:
    """In-cluster credentials, or the kubeconfig (local runs bound to a pod); every call bounded."""
    from kubernetes import client
    from kubernetes import config as kube_config

    try:
        kube_config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kube_config.ConfigException:
        kube_config.load_kube_config()  # type: ignore[no-untyped-call]
    return BoundedCoreApi(client.CoreV1Api())


def throttled_wait(exc: BaseException) -> float | None:
    """How long to wait before asking again after ``exc``, when the API server said so: a 429 (priority and
    fairness shedding load, or a cache still filling) with ``Retry-After``; None for any other failure.

    Why not the caller's exponential backoff: 1,000 agents starting at once are shed by the API server's
    ``workload-low`` priority level, each with ``Retry-After: 1``; a doubling backoff took some of them to 8-30 s
    waits and the group's Ready to the slowest (docs/scale.md). A throttled agent comes back after the hint,
    jittered up to twice it so that the shed requests do not return together, and its backoff does not grow."""
    if getattr(exc, "status", None) != 429:
        return None
    headers = getattr(exc, "headers", None) or {}
    try:
        hint = float(headers.get("Retry-After", "1"))
    except (TypeError, ValueError):
        hint = 1.0
    hint = min(max(hint, 0.1), MAX_RETRY_AFTER_SECONDS)
    return hint * (1 + random.random())
