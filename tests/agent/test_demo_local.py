"""``weightsync demo --local`` as a user runs it: exit status, the round table, the output check."""

from __future__ import annotations

import subprocess
import sys


def test_demo_local_trains_syncs_and_checks_outputs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weightsync_tools.cli.main", "demo", "--local", "--steps", "2", "--join", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={"COLUMNS": "160", "PATH": "/usr/bin:/bin", "HOME": "/tmp"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "sync rounds (one per training step)" in out
    assert out.count("Succeeded") >= 2
    assert "engines [2] hold version 2" in out
    assert "engine outputs match the trainer after every sync" in out
