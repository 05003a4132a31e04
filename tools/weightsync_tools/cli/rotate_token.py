"""``weightsync rotate-token GROUP [-n NS] [--finish]``: rotate a group's credential without restarting the group.

Runs with the user's kubeconfig (it needs ``get``/``patch`` on the group's Secret and ``list`` on its pods; the
agents' own ServiceAccount has neither). The steps and their checks are pure (:mod:`weightsync_tools.cli.rotation`);
this module only reads, patches and prints (docs/security.md, "Rotating the token").
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.markup import escape

from weightsync.api import names
from weightsync_tools.cli.kube_access import API_TIMEOUT_SECONDS, call, check_names, core_api, err, fail
from weightsync_tools.cli.rotation import RotationError, engines_on_previous, finish_patch, rotated_at, start_patch


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
    check_names(group=group, namespace=namespace)
    if force and not finish:
        fail("--force applies to --finish only", 2)
    core = core_api(context)
    secret_name = names.group_secret(group)
    secret = call(
        lambda: core.read_namespaced_secret(secret_name, namespace, _request_timeout=API_TIMEOUT_SECONDS),
        f"Secret {namespace}/{secret_name}",
        missing=f"no Secret {secret_name} in namespace {namespace}: is {group} a WeightSyncGroup there?",
    )
    body = core.api_client.sanitize_for_serialization(secret)
    try:
        if finish:
            patch = finish_patch(body)
            pods = call(
                lambda: core.list_namespaced_pod(
                    namespace, label_selector=f"{names.LABEL_GROUP}={group}", _request_timeout=API_TIMEOUT_SECONDS
                ),
                f"pods of {namespace}/{group}",
            )
            stale = engines_on_previous(core.api_client.sanitize_for_serialization(pods)["items"], rotated_at(body))
            if stale and not force:
                fail(
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
        fail(str(exc), 1)
    call(
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
