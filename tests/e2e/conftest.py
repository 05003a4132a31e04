"""One real local cluster per test session: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
and kwok, built from Go modules (cached), with the chart installed by a real Helm and the operator
running as the chart's ServiceAccount.

Set WEIGHTSYNC_E2E=0 to skip this tier (it is on by default and in CI).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync_testing.sglang_env import SglangEnvError, SglangEnvUnavailable, sglang_python
from weightsync_tools.localcluster import binaries as binaries_mod
from weightsync_tools.localcluster.cluster import ClusterState, LocalCluster
from weightsync_tools.localcluster.session import (
    Agents,
    Kube,
    OperatorProcess,
    install_chart,
    token_kubeconfig,
    wait_for,
)

__all__ = ["Agents", "Kube", "OperatorProcess", "token_kubeconfig", "wait_for"]

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "weightsync"
SYSTEM_NS = "weightsync-system"

if os.environ.get("WEIGHTSYNC_E2E", "1") == "0":
    pytest.skip("WEIGHTSYNC_E2E=0: real-cluster tests skipped", allow_module_level=True)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, ClusterState, Kube]]:
    """The cluster with its process controls (fault tests stop, freeze and restart its components)."""
    found = binaries_mod.ensure()
    directory = tmp_path_factory.mktemp("cluster")
    local = LocalCluster(directory, found)
    state = local.up(nodes=4)
    print(f"\nlocal cluster up in {state.startup_seconds} s ({directory})", file=sys.stderr)
    local.supervise(state)  # as a kubelet restarts a control plane's static pods (kube-scheduler exits on purpose)
    try:
        yield local, state, Kube(state.kubeconfig, found)
    finally:
        local.down()


@pytest.fixture(scope="session")
def cluster(control_plane: tuple[LocalCluster, ClusterState, Kube]) -> tuple[ClusterState, Kube]:
    return control_plane[1], control_plane[2]


@pytest.fixture(scope="session")
def admin(cluster: tuple[ClusterState, Kube]) -> Kube:
    return cluster[1]


@pytest.fixture(scope="session")
def chart(admin: Kube) -> str:
    """`helm install` the chart; the operator Deployment's pod goes Running on a kwok node."""
    install_chart(admin, release=RELEASE, namespace=SYSTEM_NS)
    return RELEASE


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


@pytest.fixture(scope="session")
def sglang_py() -> Path:
    """As tests/engines/sglang/conftest.py: skip only where the venv cannot be built, never under CI's REQUIRE."""
    try:
        return sglang_python()
    except SglangEnvUnavailable as error:
        if os.environ.get("WEIGHTSYNC_REQUIRE_SGLANG") == "1":
            pytest.fail(f"WEIGHTSYNC_REQUIRE_SGLANG=1 and the SGLang venv cannot be built: {error}")
        pytest.skip(f"stock SGLang venv cannot be built here ({error})")
    except SglangEnvError as error:
        pytest.fail(str(error))
