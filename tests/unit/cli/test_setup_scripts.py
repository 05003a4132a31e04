"""hack/system-packages.sh (run by hack/setup.sh): a missing Debian package is one line with the command to run.

The check runs as a user who is not root (as root: `runuser -u nobody`), so it never installs anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "hack" / "system-packages.sh"

pytestmark = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not Debian: no dpkg-query")


def check_as_user(**env: str) -> subprocess.CompletedProcess[str]:
    """Run the check as a user who is not root, with only ``env`` (and a plain PATH) in its environment."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.skip("root without runuser: cannot run the check as another user")
        prefix = ["runuser", "-u", "nobody", "--"]
    assignments = [f"{k}={v}" for k, v in {"PATH": "/usr/local/bin:/usr/bin:/bin", **env}.items()]
    return subprocess.run(
        [*prefix, "env", "-i", *assignments, "bash", "-s"],
        input=SCRIPT.read_text(),  # on stdin: the user need not be able to read the checkout
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
        check=False,
    )


def test_a_missing_package_is_one_line_naming_it_and_the_command() -> None:
    result = check_as_user(WEIGHTSYNC_SYSTEM_PACKAGES="bash weightsync-no-such-package")
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "missing Debian packages: weightsync-no-such-package;" in lines[0]
    assert "sudo apt-get install -y weightsync-no-such-package " in lines[0]


def test_nothing_missing_is_silent() -> None:
    result = check_as_user(WEIGHTSYNC_SYSTEM_PACKAGES="bash")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_the_check_can_be_skipped() -> None:
    result = check_as_user(WEIGHTSYNC_SYSTEM_PACKAGES="weightsync-no-such-package", WEIGHTSYNC_SKIP_SYSTEM_PACKAGES="1")
    assert (result.returncode, result.stderr) == (0, "")


def test_a_missing_interpreter_names_python3_and_its_venv() -> None:
    result = check_as_user(WEIGHTSYNC_SYSTEM_PACKAGES="python3 python3-venv", PYTHON="weightsync-no-such-python")
    assert result.returncode != 0
    assert "sudo apt-get install -y python3 python3-venv " in result.stderr


def test_every_readme_command_and_ci_set_up_the_same_way() -> None:
    """demo.sh and test.sh run setup.sh before anything else (test.sh with --engines: the engine venvs are built
    beside the rest); setup.sh checks packages before making .venv or starting any build; CI (.ci/run) is test.sh,
    so CI proves the demo's setup on a clean machine."""
    for script in ("demo.sh", "test.sh"):
        commands = [
            line
            for line in (ROOT / "hack" / script).read_text().splitlines()
            if line.strip() and not line.startswith(("#", "set ", "cd "))
        ]
        expected = "./hack/setup.sh --engines" if script == "test.sh" else "./hack/setup.sh"
        assert commands[0] == expected, script
    setup = (ROOT / "hack" / "setup.sh").read_text()
    assert setup.index("./hack/system-packages.sh") < setup.index("-m venv") < setup.index("build-binaries.sh")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exec ./hack/test.sh" in ci and "apt-get" not in ci


def test_setup_builds_the_real_node_after_the_control_plane_and_ci_requires_it() -> None:
    """The node binaries are built in the control plane's background job, after it (the kubelet reuses its Go build
    cache); runc's build packages and kube-router's iptables and ipset are in the default list; CI fails rather than
    skips the real-node tier."""
    setup = (ROOT / "hack" / "setup.sh").read_text()
    commands = [line.strip() for line in setup.splitlines() if not line.lstrip().startswith("#")]
    control_plane = next(i for i, c in enumerate(commands) if "localcluster/build-binaries.sh" in c)
    node = next(i for i, c in enumerate(commands) if "localcluster/build-node-binaries.sh" in c)
    assert control_plane < node
    packages = SCRIPT.read_text()
    assert "PACKAGES+=(gcc pkg-config libseccomp-dev iproute2 iptables ipset)" in packages
    ci = (ROOT / ".ci" / "run").read_text()
    assert "export WEIGHTSYNC_REQUIRE_REAL_NODE=1" in ci


def test_the_real_node_packages_are_left_out_when_nothing_builds_it() -> None:
    """Not root (the node runs only as root), WEIGHTSYNC_REAL_NODE=0 or WEIGHTSYNC_E2E=0: gcc, pkg-config and
    libseccomp-dev are not asked for; WEIGHTSYNC_REAL_NODE=1 asks for them without root too."""
    fake = "PATH=/usr/bin:/bin; dpkg-query() { return 1; }; apt-cache() { return 1; }"
    script = SCRIPT.read_text().replace("set -euo pipefail", f"set -euo pipefail; {fake}", 1)
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.skip("root without runuser: cannot run the check as another user")
    cases: list[tuple[dict[str, str], bool]] = [
        ({}, False),
        ({"WEIGHTSYNC_REAL_NODE": "1"}, True),
        ({"WEIGHTSYNC_REAL_NODE": "0"}, False),
        ({"WEIGHTSYNC_REAL_NODE": "1", "WEIGHTSYNC_E2E": "0"}, False),
    ]
    for env, asked in cases:
        prefix = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        assignments = [f"{k}={v}" for k, v in {"PATH": "/nonexistent", **env}.items()]
        result = subprocess.run(
            [*prefix, "/usr/bin/env", "-i", *assignments, "/bin/bash", "-s"],
            input=script,
            capture_output=True,
            text=True,
            cwd="/",
            timeout=60,
            check=False,
        )
        assert ("libseccomp-dev" in result.stderr) is asked, (env, result.stderr)
