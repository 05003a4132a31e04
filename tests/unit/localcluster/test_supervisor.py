"""LocalCluster's process controls, on real processes (``sleep`` stands in for a control-plane binary)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from weightsync_tools.localcluster.binaries import Binaries
from weightsync_tools.localcluster.cluster import ClusterState, LocalCluster

SLEEP = Path(shutil.which("sleep") or "/bin/sleep")


def cluster(tmp_path: Path) -> tuple[LocalCluster, ClusterState]:
    binaries = Binaries(*(SLEEP for _ in range(8)))
    local = LocalCluster(tmp_path, binaries)
    local.logs.mkdir(parents=True)
    state = ClusterState(str(tmp_path), apiserver_port=0, etcd_port=0)
    local._start(state, "kube-scheduler", SLEEP, ["600"])
    return local, state


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_the_supervisor_starts_an_exited_component_again_with_its_arguments(tmp_path: Path) -> None:
    local, state = cluster(tmp_path)
    local.supervise(state, interval=0.1)
    try:
        first = local.component(state, "kube-scheduler").pid
        os.kill(first, signal.SIGKILL)  # it exits on its own, as kube-scheduler does on a corrupt cache
        assert eventually(lambda: local.component(state, "kube-scheduler").pid != first and not local.dead(state))
        revived = local.component(state, "kube-scheduler")
        assert revived.args == ["600"]
        assert Path(f"/proc/{revived.pid}/cmdline").read_bytes().split(b"\0")[1] == b"600"
    finally:
        local.down(state)
    assert local.dead(state) == [] and state.processes == []


def test_a_component_stopped_on_purpose_stays_stopped_until_started(tmp_path: Path) -> None:
    local, state = cluster(tmp_path)
    local.supervise(state, interval=0.1)
    try:
        local.stop_component(state, "kube-scheduler")
        time.sleep(0.5)
        assert local.dead(state) == ["kube-scheduler"]
        local.start_component(state, "kube-scheduler")
        assert local.dead(state) == []
    finally:
        local.down(state)
