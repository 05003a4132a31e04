"""Rotating a group's token as pure steps (tools/weightsync_tools/cli/rotation.py) and the command's bad input
(``weightsync rotate-token``: one line, exit 2). The steps against the real API server: tests/e2e/test_rotation.py."""

from __future__ import annotations

import base64
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.api import names
from weightsync_tools.cli.rotation import (
    ROTATED_AT,
    RotationError,
    decoded,
    engines_on_previous,
    finish_patch,
    rotated_at,
    start_patch,
)

NOW = datetime(2026, 11, 26, 12, 0, 0, tzinfo=UTC)
tokens = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=60)


def secret(token: str | None, previous: str | None = None, **annotations: str) -> dict[str, Any]:
    data = {k: base64.b64encode(v.encode()).decode() for k, v in (("token", token), ("previous", previous)) if v}
    return {"metadata": {"name": "g-credentials", "resourceVersion": "7", "annotations": annotations}, "data": data}


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies it."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


@given(old=tokens, new=tokens)
def test_a_rotation_window_opens_and_closes(old: str, new: str) -> None:
    before = secret(old)
    if new == old:
        with pytest.raises(RotationError):
            start_patch(before, new, NOW)
        return
    patch = start_patch(before, new, NOW)
    assert patch["metadata"]["resourceVersion"] == "7"  # the API server refuses it if the Secret changed meanwhile
    during = merge(before, patch)
    assert (decoded(during, "token"), decoded(during, "previous")) == (new, old)
    assert rotated_at(during) == NOW
    with pytest.raises(RotationError, match="already holds a previous token"):
        start_patch(during, "third", NOW)  # a second rotation would lock out engines still on `old`
    after = merge(during, finish_patch(during))
    assert decoded(after, "token") == new and decoded(after, "previous") is None
    assert ROTATED_AT not in after["metadata"]["annotations"]
    with pytest.raises(RotationError, match="no rotation to finish"):
        finish_patch(after)


def test_nothing_to_rotate_without_a_token() -> None:
    with pytest.raises(RotationError, match="holds no token"):
        start_patch(secret(None), "new", NOW)
    with pytest.raises(RotationError, match="holds no token"):
        start_patch({"metadata": {"name": "x"}, "data": {"token": "%%%"}}, "new", NOW)  # not base64


def pod(name: str, role: str, started: datetime | None, *, deleting: bool = False) -> dict[str, Any]:
    state = {"running": {"startedAt": started.strftime("%Y-%m-%dT%H:%M:%SZ")}} if started else {"waiting": {}}
    meta: dict[str, Any] = {"name": name, "labels": {names.LABEL_ROLE: role}}
    if deleting:
        meta["deletionTimestamp"] = "x"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "engine"}, {"name": "metrics"}]},
        "status": {
            "containerStatuses": [
                {"name": "metrics", "state": {"running": {"startedAt": "2099-01-01T00:00:00Z"}}},
                {"name": "engine", "state": state},
            ]
        },
    }


def test_engines_started_before_the_rotation_are_named() -> None:
    pods = [
        pod("g-engine-0-0", "engine", NOW - timedelta(hours=1)),  # old admin key
        pod("g-engine-1-0", "engine", NOW + timedelta(minutes=2)),  # restarted after the rotation
        pod("g-engine-2-0", "engine", None),  # not running: cannot tell
        pod("g-engine-3-0", "engine", NOW - timedelta(hours=1), deleting=True),  # on its way out
        pod("g-trainer-0", "trainer", NOW - timedelta(hours=1)),  # trainers hold no engine key
    ]
    assert engines_on_previous(pods, NOW) == ["g-engine-0-0", "g-engine-2-0"]
    assert engines_on_previous(pods, NOW - timedelta(days=1)) == ["g-engine-2-0"]
    # The rotation's start unknown (annotation removed by hand): every live engine pod counts.
    assert engines_on_previous(pods, None) == ["g-engine-0-0", "g-engine-1-0", "g-engine-2-0"]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightsync_tools.cli.main", "rotate-token", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["UPPER_case!"], "is not a Kubernetes name"),
        (["g", "-n", "a/b"], "namespace 'a/b' is not a Kubernetes name"),
        (["g", "--force"], "--force applies to --finish only"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = run_cli(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_no_kubeconfig_is_one_line_and_exit_2(tmp_path: Any) -> None:
    import os

    env = {**os.environ, "KUBECONFIG": str(tmp_path / "missing"), "HOME": str(tmp_path)}
    done = run_cli("g", env=env)
    assert done.returncode == 2 and "no usable kubeconfig" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""
