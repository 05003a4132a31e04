"""What the CLI's cluster commands share: the user's kubeconfig, one bounded API call at a time, and one clear
line (then a non-zero exit) for every way that can fail."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

T = TypeVar("T")

err = Console(stderr=True, soft_wrap=True)
#: A Kubernetes object name (RFC 1123 label): what a group and a namespace are.
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
#: Each API call's bound: one clear line instead of a hang when the API server does not answer.
API_TIMEOUT_SECONDS = 30


def fail(message: str, code: int) -> NoReturn:
    err.print(f"[red]error:[/] {escape(message)}")
    raise typer.Exit(code)


def check_names(**values: str) -> None:
    """Exit 2 naming the first value that is not a Kubernetes name (``group="x"``, ``namespace="y"``)."""
    for what, value in values.items():
        if not NAME.fullmatch(value):
            fail(f"{what} {value!r} is not a Kubernetes name (lowercase letters, digits and '-', at most 63)", 2)


def load_kubeconfig(context: str | None) -> None:
    from kubernetes import config as kube_config

    try:
        kube_config.load_kube_config(context=context)  # type: ignore[no-untyped-call]
    except (kube_config.ConfigException, OSError, TypeError) as exc:
        fail(f"no usable kubeconfig: {exc}", 2)


def core_api(context: str | None) -> Any:
    from kubernetes import client

    load_kubeconfig(context)
    return client.CoreV1Api()


def custom_objects_api(context: str | None) -> Any:
    from kubernetes import client

    load_kubeconfig(context)
    return client.CustomObjectsApi()


def call(fn: Callable[[], T], what: str, *, missing: str | None = None, conflict: str | None = None) -> T:
    """``fn()``; an API error or no answer exits with one line: ``missing`` for a 404, ``conflict`` for a 409."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return fn()
    except ApiException as exc:
        if exc.status == 404 and missing:
            fail(missing, 2)
        if exc.status == 409 and conflict:
            fail(conflict, 1)
        fail(f"{what}: HTTP {exc.status} {exc.reason}", 1)
    except (HTTPError, OSError) as exc:
        fail(f"{what}: the API server did not answer: {exc}", 1)
