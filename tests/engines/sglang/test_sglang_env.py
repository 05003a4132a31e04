"""The SGLang venv builder (weightsync_testing.sglang_env): a matching stamp returns at once; an unreachable
package index is reported as such (the only reason the tier may skip), in one line naming the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync_testing import sglang_env

UNREACHABLE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": ""}


def test_a_matching_stamp_returns_without_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requirements = tmp_path / "req.txt"
    requirements.write_text("sglang==0.5.23\n")
    venv = sglang_env.env_dir(tmp_path)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    base = getattr(sys, "_base_executable", sys.executable)
    (venv / sglang_env.STAMP).write_text(json.dumps(sglang_env.stamp_key(requirements, base)))
    monkeypatch.delenv("PYTHON", raising=False)
    assert sglang_env.ensure_sglang_env(tmp_path, requirements=requirements) == venv / "bin" / "python"

    # Another requirements file is another stamp: a rebuild, which here cannot reach the index.
    requirements.write_text("sglang==0.5.23\ntorch==2.14.1\n")
    for name, value in UNREACHABLE.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(sglang_env.SglangEnvUnavailable):
        sglang_env.ensure_sglang_env(tmp_path, requirements=requirements, quiet=True)


def test_an_unreachable_index_exits_2_with_one_line(tmp_path: Path) -> None:
    requirements = tmp_path / "req.txt"
    requirements.write_text("sglang==0.5.23\n")
    env = {**os.environ, **UNREACHABLE}
    script = Path(sglang_env.__file__)
    command = [sys.executable, str(script), "--cache", str(tmp_path), "--requirements", str(requirements), "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()
    log = sglang_env.env_dir(tmp_path).parent / "sglang-0.5.23.log"
    assert line.startswith("sglang-env: installing the pinned packages failed: pip exited 1: ")
    assert line.endswith(f"(full log: {log})") and "Connection refused" in log.read_text()
