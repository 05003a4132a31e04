"""One real local cluster per test session: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
and kwok, built from Go modules (cached), with the chart installed by a real Helm and the operator
running as the chart's ServiceAccount.

Set WEIGHTSYNC_E2E=0 to skip this tier (it is on by default and in CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync.localcluster import binaries as binaries_mod
from weightsync.localcluster.cluster import ClusterState, LocalCluster, free_port
from weightsync.localcluster.pki import Pki, kubeconfig

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "weightsync"
SYSTEM_NS = "weightsync-system"

if os.environ.get("WEIGHTSYNC_E2E", "1") == "0":
    pytest.skip("WEIGHTSYNC_E2E=0: real-cluster tests skipped", allow_module_level=True)


@dataclass
class Kube:
    """kubectl and helm bound to one kubeconfig."""

    kubeconfig: Path
    binaries: binaries_mod.Binaries

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stderr}")
        return result

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binaries.helm), f"--kubeconfig={self.kubeconfig}", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterState, Kube]]:
    found = binaries_mod.ensure()
    directory = tmp_path_factory.mktemp("cluster")
    local = LocalCluster(directory, found)
    state = local.up(nodes=4)
    print(f"\nlocal cluster up in {state.startup_seconds} s ({directory})", file=sys.stderr)
    try:
        yield state, Kube(state.kubeconfig, found)
    finally:
        local.down()


@pytest.fixture(scope="session")
def admin(cluster: tuple[ClusterState, Kube]) -> Kube:
    return cluster[1]


@pytest.fixture(scope="session")
def chart(admin: Kube) -> str:
    """`helm install` the chart; the operator Deployment's pod goes Running on a kwok node."""
    admin.helm(
        "install",
        RELEASE,
        str(ROOT / "charts" / "weightsync"),
        "--namespace",
        SYSTEM_NS,
        "--create-namespace",
        "--wait",
        "--timeout",
        "2m",
    )
    return RELEASE


def token_kubeconfig(state: ClusterState, admin: Kube, namespace: str, service_account: str, path: Path) -> Path:
    token = admin.kubectl("-n", namespace, "create", "token", service_account, "--duration=2h").stdout.strip()
    path.write_text(kubeconfig(Pki(Path(state.directory) / "pki"), state.server, token=token, user=service_account))
    return path


class OperatorProcess:
    """`weightsync operator` as a local process, with the chart ServiceAccount's identity."""

    def __init__(self, kubeconfig_path: Path, log: Path) -> None:
        self.kubeconfig = kubeconfig_path
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "WEIGHTSYNC_RESYNC_SECONDS": "5",
            "WEIGHTSYNC_AGENT_IMAGE": "weightsync/agent:e2e",
        }
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "weightsync.cli.main",
                    "operator",
                    "--verbose",
                    "--liveness",
                    f"http://127.0.0.1:{free_port()}/healthz",
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="session")
def operator(
    cluster: tuple[ClusterState, Kube], chart: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    state, admin = cluster
    directory = tmp_path_factory.mktemp("operator")
    sa = admin.json("-n", SYSTEM_NS, "get", "deployment", "-l", f"app.kubernetes.io/instance={chart}")["items"][0]
    sa_name = sa["spec"]["template"]["spec"]["serviceAccountName"]
    path = token_kubeconfig(state, admin, SYSTEM_NS, sa_name, directory / "kubeconfig")
    proc = OperatorProcess(path, directory / "operator.log")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        print(f"\n--- operator log (tail) ---\n{proc.output()[-4000:]}", file=sys.stderr)


def load_example(name: str, namespace: str, **spec_changes: Any) -> dict[str, Any]:
    obj = yaml.safe_load((ROOT / "examples" / name).read_text())
    obj["metadata"]["namespace"] = namespace
    for dotted, value in spec_changes.items():
        cursor = obj["spec"]
        *parents, leaf = dotted.split("__")
        for part in parents:
            cursor = cursor.setdefault(part, {})
        cursor[leaf] = value
    return obj
