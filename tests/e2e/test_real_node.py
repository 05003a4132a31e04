"""The real-node tier: a kubelet (the control plane's version) on containerd 2.x, runc and the CNI bridge, next to
the kwok nodes; one pod goes Running and Ready on it (a readiness probe the kubelet sends over the bridge), two
pods reach each other over the bridge, and a container runs the project's own Python (the host's venv and checkout
mounted read-only) to completion.

On by default where it can run: as root (it creates a bridge, mounts overlays and cgroups), with ``ip`` and
``nsenter``, and with the node binaries built (``hack/setup.sh`` builds them after the control plane:
``build-node-binaries.sh``; the tests never build them). Elsewhere it skips with the reason in one line, unless
``WEIGHTSYNC_REQUIRE_REAL_NODE=1`` (CI: ``.ci/run``), which makes that a failure. ``WEIGHTSYNC_REAL_NODE=0`` skips it.
Its cluster is its own (one kwok node and the real one; the session's cluster starts its API server without the
kubelet client flags a real node needs), started once for the module. docs/local-cluster.md, "The real-node tier".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync_tools.localcluster import binaries as binaries_mod
from weightsync_tools.localcluster.cluster import ClusterState, LocalCluster
from weightsync_tools.localcluster.realnode import (
    NODE_NAME,
    POD_SUBNET,
    SERVE_IMAGE,
    SERVE_PORT,
    NodeBinaries,
    NodeBinariesMissingError,
    RealNode,
    built_node_binaries,
    host_python_pod,
    other_real_nodes,
)

REQUIRE = "WEIGHTSYNC_REQUIRE_REAL_NODE"


def node_binaries_or_reason() -> NodeBinaries | str:
    """The built node binaries where the real node can run here; otherwise why not, in one line."""
    if os.environ.get("WEIGHTSYNC_REAL_NODE") == "0":
        return "WEIGHTSYNC_REAL_NODE=0"
    if sys.platform != "linux" or os.geteuid() != 0:
        return "the real node needs root on Linux (a bridge, overlay mounts, cgroups)"
    missing = [tool for tool in ("ip", "nsenter", "umount") if shutil.which(tool) is None]
    if missing:
        return f"the real node needs {', '.join(missing)} (iproute2, util-linux)"
    try:
        binaries = built_node_binaries()
    except NodeBinariesMissingError as error:
        return f"{error} (hack/setup.sh builds them)"
    others = other_real_nodes()
    if others:
        return f"another real node runs on this host (kubelet PID {others[0][0]}, {others[0][1]}): one per host"
    return binaries


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, ClusterState]]:
    node = node_binaries_or_reason()
    if isinstance(node, str):
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 and the real-node tier cannot run: {node}")
        pytest.skip(f"real-node tier: {node}")
    found = binaries_mod.ensure()
    local = LocalCluster(tmp_path_factory.mktemp("realnode-cluster"), found)
    state = local.up(nodes=1, real_node=node)
    print(f"\nlocal cluster with a real node up in {state.startup_seconds} s ({local.directory})", file=sys.stderr)
    try:
        yield local, state
    finally:
        local.down()


def _serve_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE_NAME},
            "terminationGracePeriodSeconds": 5,
            # The cluster runs no DNS service (the kubelet has no clusterDNS): the node's resolv.conf.
            "dnsPolicy": "Default",
            "containers": [
                {
                    "name": "serve",
                    "image": SERVE_IMAGE,
                    "imagePullPolicy": "Never",
                    "ports": [{"containerPort": SERVE_PORT}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": SERVE_PORT}, "periodSeconds": 1},
                }
            ],
        },
    }


def _running_and_ready(local: LocalCluster, state: ClusterState, name: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = json.loads(local._kubectl(state, "get", "pod", name, "-o", "json").stdout)["status"]
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        if status.get("phase") == "Running" and conditions.get("Ready") == "True":
            return status
        time.sleep(1)
    events = local._kubectl(state, "get", "events", "-o", "wide", check=False).stdout
    pytest.fail(f"pod {name} not Running and Ready in {timeout:.0f} s: {json.dumps(status)}\n{events}")


def test_pod_runs_and_is_ready_on_the_real_node(real_cluster: tuple[LocalCluster, ClusterState]) -> None:
    local, state = real_cluster
    node = json.loads(local._kubectl(state, "get", "node", NODE_NAME, "-o", "json").stdout)
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.")
    local._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump(_serve_pod("real-pod")))
    status = _running_and_ready(local, state, "real-pod")
    prefix = POD_SUBNET.rsplit(".", 1)[0] + "."
    assert str(status["podIP"]).startswith(prefix), status["podIP"]
    # The API server reaches the kubelet (logs, exec go through it).
    assert local._kubectl(state, "get", "--raw", f"/api/v1/nodes/{NODE_NAME}/proxy/healthz").stdout == "ok"
    exec_ = local._kubectl(state, "exec", "real-pod", "--", "/weightsync-pause", "serve", "x", check=False)
    assert "unknown port" in exec_.stdout + exec_.stderr, exec_
    assert "real-pod" in Path(local.directory / "logs" / "kubelet.log").read_text(errors="replace")


def test_pod_reaches_another_pod_over_the_bridge(real_cluster: tuple[LocalCluster, ClusterState]) -> None:
    """From the first pod's network namespace (nsenter into its container's process), the second pod's IP answers."""
    local, state = real_cluster
    local._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump_all([_serve_pod("pod-a"), _serve_pod("pod-b")]))
    a, b = _running_and_ready(local, state, "pod-a"), _running_and_ready(local, state, "pod-b")
    container = a["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    tasks = RealNode(local, NodeBinaries(Path(state.real_node))).ctr("tasks", "ls").stdout.splitlines()
    pid = next(line.split()[1] for line in tasks if line.startswith(container))
    url = f"http://{b['podIP']}:{SERVE_PORT}/"
    fetch = f"import urllib.request as u; print(u.build_opener(u.ProxyHandler({{}})).open({url!r}, timeout=10).read())"
    command = ["nsenter", "-t", pid, "-n", sys.executable, "-c", fetch]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert result.stdout.strip() == "b'ok\\n'", result


def test_a_pod_runs_the_projects_python_from_the_host(real_cluster: tuple[LocalCluster, ClusterState]) -> None:
    """A container of the tiny host image (the merged-/usr links, nothing else) runs this venv's Python on this
    checkout, both mounted read-only from the host with ``/usr`` and the interpreter (hostPath volumes): the CLI's
    ``--help`` to completion (pod Succeeded)."""
    local, state = real_cluster
    pod = host_python_pod("host-python", ["-m", "weightsync_tools.cli.main", "--help"])
    local._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump(pod))
    deadline = time.monotonic() + 120
    phase = ""
    while time.monotonic() < deadline:
        phase = local._kubectl(state, "get", "pod", "host-python", "-o", "jsonpath={.status.phase}").stdout
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(0.5)
    logs = local._kubectl(state, "logs", "host-python", check=False)
    described = local._kubectl(state, "get", "pod", "host-python", "-o", "yaml", check=False).stdout
    assert phase == "Succeeded", f"{phase}\n{logs.stdout}{logs.stderr}\n{described}"
    assert "Usage:" in logs.stdout and "cluster" in logs.stdout, logs


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(
    real_cluster: tuple[LocalCluster, ClusterState],
) -> None:
    """What every agent does first: ``load_incluster_config`` (the ``kubernetes`` Service's ClusterIP and port, which
    the kubelet gives the container, the ServiceAccount token and CA it mounts) and a request with that token. The
    real node has no kube-proxy: the ClusterIP is on its bridge, where a relay copies the bytes to the API server
    (TLS end to end, the certificate names the ClusterIP)."""
    local, state = real_cluster
    service = json.loads(local._kubectl(state, "get", "service", "kubernetes", "-o", "json").stdout)["spec"]
    code = (
        "import os; from kubernetes import client, config; config.load_incluster_config(); "
        "print(os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT'], "
        "client.VersionApi().get_code().git_version)"
    )
    pod = host_python_pod("in-cluster", ["-c", code])
    pod["spec"]["automountServiceAccountToken"] = True  # type: ignore[index]
    local._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump(pod))
    deadline = time.monotonic() + 120
    phase = ""
    while time.monotonic() < deadline:
        phase = local._kubectl(state, "get", "pod", "in-cluster", "-o", "jsonpath={.status.phase}").stdout
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(0.5)
    logs = local._kubectl(state, "logs", "in-cluster", check=False)
    assert phase == "Succeeded", f"{phase}\n{logs.stdout}{logs.stderr}"
    host, port, version = logs.stdout.split()
    assert (host, int(port)) == (service["clusterIP"], service["ports"][0]["port"]), logs.stdout
    server = json.loads(local._kubectl(state, "version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    assert version == server, (version, server)
