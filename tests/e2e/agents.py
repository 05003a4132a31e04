"""Agents as local processes bound to their pods (the pods themselves run on kwok nodes: no kubelet).

Each agent gets exactly the environment the operator put in the pod's sidecar, with the downward-API
fields resolved the way the kubelet would (POD_NAME; POD_IP becomes loopback, where its data plane
listens), a free local port, and the group's agent ServiceAccount token — so the agents' Role is tested.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from weightsync.api import names
from weightsync.api.v1alpha1 import AGENT_CONTAINER
from weightsync.localcluster.cluster import free_port


def agent_env(pod: dict[str, Any]) -> dict[str, str]:
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == AGENT_CONTAINER)
    env: dict[str, str] = {}
    for item in sidecar.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field == "metadata.name":
            env[item["name"]] = pod["metadata"]["name"]
        elif field == "metadata.namespace":
            env[item["name"]] = pod["metadata"]["namespace"]
        elif field == "status.podIP":
            env[item["name"]] = "127.0.0.1"
    env[names.ENV_AGENT_PORT] = str(free_port())
    return env


class Agents:
    """The agent processes of one test module, stopped together."""

    def __init__(self, kubeconfig: Path, logs: Path) -> None:
        self.kubeconfig = kubeconfig
        self.logs = logs
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        self.stop(name)
        env = {**os.environ, **agent_env(pod), "KUBECONFIG": str(self.kubeconfig)}
        with open(self.logs / f"{name}.log", "ab") as out:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "weightsync.cli.main", "agent"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""
