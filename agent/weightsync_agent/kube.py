"""The Kubernetes API client agents use (in-cluster credentials, else the kubeconfig), every call bounded.

Agents never need the API server for a round: they talk to each other and to engines directly. They use it to
read the plan and their peers' advertised URLs, and to report on their own pod. A hung API server accepts
connections and never answers, and the client library waits forever by default; so every call here carries a
connect and a read timeout, and callers treat its failures as "not now" (``transport_errors``).
"""

from __future__ import annotations

import functools
from typing import Any, Final

#: Connecting to the API server: loopback or the cluster network, so seconds are plenty.
CONNECT_SECONDS: Final = 3.0
#: One read of one small object (a pod, the plan ConfigMap) or one patch.
READ_SECONDS: Final = 10.0


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


def kube_core_api() -> Any:
    """In-cluster credentials, or the kubeconfig (local runs bound to a pod); every call bounded."""
    from kubernetes import client
    from kubernetes import config as kube_config

    try:
        kube_config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kube_config.ConfigException:
        kube_config.load_kube_config()  # type: ignore[no-untyped-call]
    return BoundedCoreApi(client.CoreV1Api())
