"""The README's first command, `weightsync demo`, runs to the end on its own embedded cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_demo_runs_the_main_job(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "weightsync_tools.cli.main", "demo", "--dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "COLUMNS": "160"},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "demo   Ready   True    2          2         p2p" in out
    assert "demo   Ready   True    2          3         p2p" in out
    assert "2 sources → 3 engines × TP2" in out
    assert "replan moved 0 existing target(s); revision 2" in out
    # Three training steps, a verified round after each, the status shows it; the joiner catches up.
    for step in (1, 2, 3):
        assert f"step {step}: loss" in out and f"round v{step}: Succeeded" in out
    assert "status.lastSync: version 3 Succeeded" in out
    assert "demo   Ready   True    2          2         p2p    3         Succeeded" in out
    assert "every engine serves the trainer's weights" in out
    # Torn down: nothing of the demo cluster is left running.
    state = (tmp_path / "demo" / "state.json").read_text()
    assert '"processes": []' in state
