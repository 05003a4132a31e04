"""``weightsync rotate-token GROUP [-n NS] [--finish]``: rotate a group's credential without restarting the group.

Runs with the user's kubeconfig (it needs ``get``/``patch`` on the group's Secret and ``list`` on its pods; the
agents' own ServiceAccount has neither). The steps and their checks are pure (:mod:`weightsync.cli.rotation`);
this module only reads, patches and prints (docs/security.md, "Rotating the token").
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from weightsync.api import names
from weightsync.cli.rotation import RotationError, engines_on_previous, finish_patch, rotated_at, start_patch

err = Console(stderr=True, soft_wrap=True)
#: A Kubernetes object name (RFC 1123 label): what a group and a namespace are.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
#: Each API call's bound: one clear line instead of a hang when the API server does not answer.
API_TIMEOUT_SECONDS = 30


def _fail(message: str, code: int) -> NoReturn:
    err.print(f"[red]error:[/] {escape(message)}")
    raise typer.Exit(code)


def rotate_token(
    group: Annotated[str, typer.Argument(help="The WeightSyncGroup whose token to rotate.", show_default=False)],
    namespace: Annotated[str, typer.Option("--namespace", "-n", help="The group's namespace.")] = "default",
    finish: Annotated[
        bool,
        typer.Option(
            "--finish",
            help="Close the rotation window: drop the previous token (after every engine pod restarted).",
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="With --finish: drop the previous token even while engines may still use it."),
    ] = False,
    context: Annotated[str | None, typer.Option(help="The kubeconfig context to use.")] = None,
) -> None:
    """Rotate a group's token without restarting it: move `token` to `previous` and write a new `token` (agents
    accept both and follow the Secret within about a minute); restart the engine pods one at a time (engines read
    their admin key only at start); then `--finish` drops `previous`."""
    for what, value in (("group", group), ("namespace", namespace)):
        if not _NAME.fullmatch(value):
            _fail(f"{what} {value!r} is not a Kubernetes name (lowercase letters, digits and '-', at most 63)", 2)
    if force and not finish:
        _fail("--force applies to --finish only", 2)
    core = _core_api(context)
    secret_name = names.group_secret(group)
    secret = _call(
        lambda: core.read_namespaced_secret(secret_name, namespace, _request_timeout=API_TIMEOUT_SECONDS),
        f"Secret {namespace}/{secret_name}",
        missing=f"no Secret {secret_name} in namespace {namespace}: is {group} a WeightSyncGroup there?",
    )
    body = core.api_client.sanitize_for_serialization(secret)
    try:
        if finish:
            patch = finish_patch(body)
            pods = _call(
                lambda: core.list_namespaced_pod(
                    namespace, label_selector=f"{names.LABEL_GROUP}={group}", _request_timeout=API_TIMEOUT_SECONDS
                ),
                f"pods of {namespace}/{group}",
            )
            stale = engines_on_previous(core.api_client.sanitize_for_serialization(pods)["items"], rotated_at(body))
            if stale and not force:
                _fail(
                    f"engine pods started before the rotation may still use the previous token as their admin key: "
                    f"{', '.join(stale)}; restart them one at a time (kubectl -n {namespace} delete pod NAME, wait for "
                    "Ready) and run --finish again, or pass --force",
                    1,
                )
            if stale:
                err.print(f"[yellow]warning:[/] forced: {escape(', '.join(stale))} may still use the previous token")
        else:
            from weightsync_operator.builders.secret import new_token

            patch = start_patch(body, new_token(), datetime.now(UTC))
    except RotationError as exc:
        _fail(str(exc), 1)
    _call(
        lambda: core.patch_namespaced_secret(
            secret_name,
            namespace,
            patch,
            _content_type="application/merge-patch+json",
            _request_timeout=API_TIMEOUT_SECONDS,
        ),
        f"Secret {namespace}/{secret_name}",
        conflict=f"Secret {namespace}/{secret_name} changed while this ran (another rotation?): run again",
    )
    if finish:
        typer.echo(f"{group}: rotation finished; only the new token is accepted (agents follow within about a minute)")
    else:
        typer.echo(
            f"{group}: new token written; the previous one stays accepted until `weightsync rotate-token {group} "
            f"-n {namespace} --finish`.\nNext: wait about a minute (kubelets refresh the agents' credentials), then "
            "restart the engine pods one at a time (never the trainer pods): docs/security.md, 'Rotating the token'."
        )


def _core_api(context: str | None) -> Any:
    from kubernetes import client
    from kubernetes import config as kube_config

    try:
        kube_config.load_kube_config(context=context)  # type: ignore[no-untyped-call]
    except (kube_config.ConfigException, OSError, TypeError) as exc:
        _fail(f"no usable kubeconfig: {exc}", 2)
    return client.CoreV1Api()


def _call(fn: Any, what: str, *, missing: str | None = None, conflict: str | None = None) -> Any:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return fn()
    except ApiException as exc:
        if exc.status == 404 and missing:
            _fail(missing, 2)
        if exc.status == 409 and conflict:
            _fail(conflict, 1)
        _fail(f"{what}: HTTP {exc.status} {exc.reason}", 1)
    except (HTTPError, OSError) as exc:
        _fail(f"{what}: the API server did not answer: {exc}", 1)
