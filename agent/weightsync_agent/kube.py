"""The Kubernetes API client agents use (in-cluster credentials, else the kubeconfig)."""

from __future__ import annotations

from typing import Any


def kube_core_api() -> Any:
    """In-cluster credentials, or the kubeconfig (local runs bound to a pod)."""
    from kubernetes import client
    from kubernetes import config as kube_config

    try:
        kube_config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kube_config.ConfigException:
        kube_config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.CoreV1Api()
