"""The CPU workarounds (weightsync_testing/sglang_cpu) are gated, and on the TP=1 server exactly the needed
ones were applied and used, with evidence in their log and marker lines in the server log."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from weightsync_testing import sglang_cpu
from weightsync_testing.sglang_server import SglangProcess

FINDER = "import sys; print(sum(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path))"


def run(python: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_SGLANG_")}
    clean.update(PYTHONPATH=str(sglang_cpu.DIRECTORY), **env)
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=clean, timeout=60, check=False)


def test_nothing_is_hooked_unless_enabled(sglang_py: Path) -> None:
    assert run(sglang_py, FINDER).stdout.strip() == "0"
    enabled = run(sglang_py, FINDER, **{sglang_cpu.ENV_ENABLE: sglang_cpu.ROTARY_VLLM_PLACEHOLDER})
    assert enabled.stdout.strip() == "1", enabled.stderr


def test_unknown_workaround_names_fail_loudly(sglang_py: Path) -> None:
    done = run(sglang_py, "pass", **{sglang_cpu.ENV_ENABLE: "no_such_workaround"})
    assert "unknown workaround(s) ['no_such_workaround']" in done.stderr


def test_the_vllm_placeholder_refuses_to_compute(sglang_py: Path) -> None:
    done = run(sglang_py, "import _weightsync_vllm_custom_ops as m; m.rotary_embedding()")
    assert done.returncode != 0 and "placeholder vllm._custom_ops.rotary_embedding was called" in done.stderr
    # Outside a RotaryEmbedding construction there is no vllm module at all.
    assert "ModuleNotFoundError" in run(sglang_py, "import vllm").stderr


def test_tp1_server_applied_and_used_exactly_the_needed_workarounds(server: SglangProcess) -> None:
    assert server.workarounds == [sglang_cpu.ROTARY_VLLM_PLACEHOLDER, sglang_cpu.REGISTER_PER_PARAMETER]
    events = server.workaround_events()
    used = {(e["workaround"], e["pid"]) for e in events if e["event"] == "used"}
    applied = {(e["workaround"], e["pid"]) for e in events if e["event"] == "applied"}
    schedulers = {pid for _name, pid in used}
    assert len(schedulers) == 1, events  # the one scheduler process (TP rank 0) built the model
    [pid] = schedulers
    assert used == {(name, pid) for name in server.workarounds}
    assert used <= applied
    assert sglang_cpu.NO_PYNCCL not in {e["workaround"] for e in events}
    [register] = [e for e in events if e["event"] == "used" and e["workaround"] == sglang_cpu.REGISTER_PER_PARAMETER]
    assert register["parameters"] == 15  # every parameter registered with Mooncake, one region each
    log = server.log_path.read_text()
    for name in server.workarounds:
        assert f"{sglang_cpu.MARKER} used {name} " in log
