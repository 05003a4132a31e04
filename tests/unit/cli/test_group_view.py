"""``weightsync status`` and ``weightsync rounds`` as pure rendering of a group's status, and their bad input (one
line, exit 2). Against the real API server after a real round: tests/e2e/test_cluster.py."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from rich.console import Console

from weightsync.api.v1alpha1 import WeightSyncGroupStatus
from weightsync_tools.cli.group_view import rounds_view, size, status_view

SLOW = {"peer": "engine 1 rank 0", "bytes": 2_500_000, "seconds": 0.5, "gbps": 0.04}


def sync(version: int, result: str = "Succeeded", **extra: Any) -> dict[str, Any]:
    return {
        "version": version,
        "result": result,
        "startedAt": f"2030-01-01T12:00:0{version}Z",
        "durationSeconds": 0.75,
        "bytes": 5_000_000,
        "gbps": 0.0533,
        "phases": {"prepare": 0.01, "begin": 0.02, "write": 0.5, "verify": 0.1, "commit": 0.05},
        "pausedSeconds": 0.05,
        "pausePolicy": "minimal",
        "slowestSource": {**SLOW, "peer": "source 1"},
        "slowestTarget": SLOW,
        **extra,
    }


GROUP = {
    "metadata": {"name": "demo", "namespace": "ml"},
    "spec": {"transfer": {"mode": "p2p"}},
    "status": {
        "phase": "Ready",
        "weightVersion": 2,
        "trainers": {"desired": 2, "ready": 2},
        "engines": {"desired": 2, "ready": 1, "syncPaths": {"trace": 1, "engineReplica": 2}},
        "plan": {"hash": "abc123"},
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllReady",
                "message": "every pod is ready",
                "lastTransitionTime": "2030-01-01T11:59:00Z",
            }
        ],
        "lastSync": sync(2),
        "recentSyncs": [sync(1, "Aborted", reason="engine 0 commit: HTTP 502", pausePolicy="overlap"), sync(2)],
    },
}


def text(renderable: Any) -> str:
    console = Console(record=True, width=220)
    console.print(renderable)
    return console.export_text()


def test_the_examples_here_are_statuses_the_schema_takes() -> None:
    WeightSyncGroupStatus.model_validate(GROUP["status"])


def test_status_shows_the_group_and_its_last_round_with_phases_pause_and_slowest_peers() -> None:
    shown = text(status_view(GROUP))
    assert "ml/demo" in shown and "phase Ready" in shown and "version 2" in shown
    assert "trainers 2/2 ready, engines 1/2 ready, plan abc123" in shown
    assert "AllReady" in shown and "every pod is ready" in shown
    assert "engine ranks synced: 1 by the trace (cut from the trainer's tensors), 2 through an engine replica" in shown
    assert "v2 Succeeded at 2030-01-01T12:00:02Z in 0.750 s, 5.0 MB" in shown
    assert "engines paused 0.050 s (pause: minimal)" in shown
    assert "phases: prepare 0.010 s · begin 0.020 s · write 0.500 s · verify 0.100 s · commit 0.050 s" in shown
    assert "slowest source: source 1: 2.5 MB in 0.500 s (0.04 Gb/s)" in shown
    assert "slowest target: engine 1 rank 0: 2.5 MB in 0.500 s" in shown


def test_status_of_a_group_that_never_synced_says_so() -> None:
    shown = text(status_view({"metadata": {"name": "g", "namespace": "n"}, "status": {}}))
    assert "n/g" in shown and "phase -" in shown and "none yet" in shown
    assert "engine ranks synced" not in shown  # no engine reported yet


def test_rounds_lists_newest_first_with_each_rounds_phases_and_reason() -> None:
    shown = text(rounds_view(GROUP["status"]["recentSyncs"]))
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in shown.splitlines() if "│" in line]
    lines = ["|".join(row) for row in rows if row and row[0].isdigit()]
    assert [line.split("|")[0] for line in lines] == ["2", "1"]
    assert "Aborted" in lines[1] and "engine 0 commit: HTTP 502" in lines[1]
    assert "0.500 s" in lines[0] and "engine 1 rank 0" in lines[0]
    assert "|0.050 s|minimal|" in lines[0] and "|0.050 s|overlap|" in lines[1]  # each round's pause and its policy
    assert text(rounds_view([])).strip() == "no rounds yet"


def test_sizes_read_like_sizes() -> None:
    assert [size(n) for n in (0, 999, 1000, 2_500_000, 3e12, None)] == ["0 B", "999 B", "1.0 KB", "2.5 MB",
                                                                         "3.0 TB", "-"]  # fmt: skip


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": os.devnull}
    return subprocess.run([sys.executable, "-m", "weightsync_tools.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


def test_bad_input_is_one_line_and_exit_2() -> None:
    bad_name = run("status", "Not_A_Name")
    assert bad_name.returncode == 2 and "is not a Kubernetes name" in bad_name.stderr
    no_config = run("rounds", "demo")
    assert no_config.returncode == 2 and "no usable kubeconfig" in no_config.stderr
    assert len(no_config.stderr.strip().splitlines()) == 1
