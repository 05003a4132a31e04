"""The real-node tier: a kubelet (the control plane's version) on containerd 2.x, runc and the CNI bridge, next to
the kwok nodes; one pod goes Running and Ready on it (a readiness probe the kubelet sends over the bridge), two
pods reach each other over the bridge, a container runs the project's own Python (the host's venv and checkout
mounted read-only) to completion, a pod's in-cluster client reaches the API server through the ``kubernetes``
Service, and a group runs in real containers: the operator's pods with the agent image as the native sidecar, a
trainer and a stock SGLang engine, a verified round, Ready through the readiness gate, a killed engine container
restarted by the kubelet and caught up, under Pod Security ``baseline`` and the group's NetworkPolicy enforced by
kube-router (a pod of another namespace refused on every agent and Mooncake port the group's pods listen on); pods
resolve names through the node's cluster DNS (CoreDNS), and a trainer of 2 pods and a SGLang engine of TP 2 over 2
pods sync from the operator's workload identity alone.

On by default where it can run: as root (it creates a bridge, mounts overlays and cgroups), with ``ip`` and
``nsenter``, and with the node binaries built (``hack/setup.sh`` builds them after the control plane:
``build-node-binaries.sh``; the tests never build them). Elsewhere it skips with the reason in one line, unless
``WEIGHTSYNC_REQUIRE_REAL_NODE=1`` (CI: ``.ci/run``), which makes that a failure. ``WEIGHTSYNC_REAL_NODE=0`` skips it.
Its cluster is its own (one kwok node and the real one; the session's cluster starts its API server without the
kubelet client flags a real node needs), started once for the module. docs/local-cluster.md, "The real-node tier".
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync.api import names
from weightsync_tools.localcluster import binaries as binaries_mod
from weightsync_tools.localcluster import network_policies
from weightsync_tools.localcluster.cluster import ClusterState, LocalCluster
from weightsync_tools.localcluster.network_policies import NetworkPolicyEngine
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
from weightsync_tools.localcluster.session import OperatorProcess

REQUIRE = "WEIGHTSYNC_REQUIRE_REAL_NODE"
REPO = Path(__file__).resolve().parents[2]


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


def _run_to_completion(local: LocalCluster, state: ClusterState, *pods: dict[str, Any], timeout: float = 120) -> str:
    """Apply ``restartPolicy: Never`` pods, wait for them to end; their outputs (one after another), once every one
    Succeeded (else the test fails with the phase, output and description of the first that did not)."""
    local._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump_all(pods))
    deadline = time.monotonic() + timeout
    outputs = []
    for pod in pods:
        where = ["-n", str(pod["metadata"].get("namespace", "default")), str(pod["metadata"]["name"])]
        phase = ""
        while time.monotonic() < deadline:
            phase = local._kubectl(state, "get", "pod", *where, "-o", "jsonpath={.status.phase}").stdout
            if phase in ("Succeeded", "Failed"):
                break
            time.sleep(0.5)
        logs = local._kubectl(state, "logs", *where, check=False)
        described = local._kubectl(state, "get", "pod", *where, "-o", "yaml", check=False).stdout
        assert phase == "Succeeded", f"{phase}\n{logs.stdout}{logs.stderr}\n{described}"
        outputs.append(logs.stdout)
    return "".join(outputs)


def test_a_pod_runs_the_projects_python_from_the_host(real_cluster: tuple[LocalCluster, ClusterState]) -> None:
    """A container of the tiny host image (the merged-/usr links, nothing else) runs this venv's Python on this
    checkout, both mounted read-only from the host with ``/usr`` and the interpreter (hostPath volumes): the CLI's
    ``--help`` to completion (pod Succeeded)."""
    local, state = real_cluster
    pod = host_python_pod("host-python", ["-m", "weightsync_tools.cli.main", "--help"])
    logs = _run_to_completion(local, state, pod)
    assert "Usage:" in logs and "cluster" in logs, logs


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
    host, port, version = _run_to_completion(local, state, pod).split()
    assert (host, int(port)) == (service["clusterIP"], service["ports"][0]["port"]), (host, port)
    server = json.loads(local._kubectl(state, "version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    assert version == server, (version, server)


# --- a group in real containers -----------------------------------------------------------------------------------

GROUP_NS = "ws-real"
GROUP = "real"
ENGINE_PORT = 30000
#: Where the containers find the checkout (the test-only trainer, SGLang's gated CPU workarounds) and the model.
CHECKOUT, MODEL = "/checkout", "/model"


def test_pods_resolve_services_and_headless_pods_through_the_cluster_dns(
    real_cluster: tuple[LocalCluster, ClusterState],
) -> None:
    """CoreDNS on the node (the kubelet's ``clusterDNS``): a pod of the default ``dnsPolicy`` resolves the API
    server's Service to its ClusterIP and a pod of a headless Service by ``<hostname>.<service>.<namespace>.svc``
    (the form of the operator's leader addresses) to that pod's IP, through its resolv.conf's search path."""
    local, state = real_cluster
    target = _serve_pod("dns-target")
    target["metadata"]["labels"] = {"app": "dns-target"}
    target["spec"] |= {"hostname": "leader", "subdomain": "dns-group"}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dns-group", "namespace": "default"},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "dns-target"},
                        "ports": [{"port": SERVE_PORT}]}}  # fmt: skip
    local._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump_all([service, target]))
    address = _running_and_ready(local, state, "dns-target")["podIP"]
    names_to_resolve = ["kubernetes.default.svc", "leader.dns-group.default.svc"]
    code = "import socket, sys; print(*(socket.gethostbyname(n) for n in sys.argv[1:]))"
    pod = host_python_pod("resolver", ["-c", code, *names_to_resolve])
    pod["spec"]["dnsPolicy"] = "ClusterFirst"  # type: ignore[index]
    cluster_ip = json.loads(local._kubectl(state, "get", "svc", "kubernetes", "-o", "json").stdout)["spec"]["clusterIP"]
    assert _run_to_completion(local, state, pod).split() == [cluster_ip, address]


def _host_path_claim(name: str, path: Path, namespace: str) -> list[dict[str, Any]]:
    """A hostPath PersistentVolume of ``path`` and the claim bound to it: how a node's cache reaches pods under Pod
    Security ``baseline``, which refuses a pod's own ``hostPath`` volume (the volume is the administrator's)."""
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{namespace}-{name}"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(path), "type": "Directory"},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": f"{namespace}-{name}",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]


@dataclass(frozen=True)
class Containers:
    """What a group in real containers needs: the agent image (imported into the node), the SGLang venv's
    site-packages and a tiny Llama the containers' uid may read."""

    agent_image: str
    site: Path
    model: Path


@pytest.fixture(scope="module")
def containers(real_cluster: tuple[LocalCluster, ClusterState], tmp_path_factory: pytest.TempPathFactory) -> Containers:
    local, state = real_cluster
    sglang_python = os.environ.get("WEIGHTSYNC_SGLANG_PYTHON")
    if not sglang_python:
        _skip("WEIGHTSYNC_REQUIRE_SGLANG", "WEIGHTSYNC_SGLANG_PYTHON is not set (hack/test.sh sets it)")
    check = subprocess.run(["bash", str(REPO / "hack" / "build-images.sh"), "--check"], capture_output=True,
                           text=True, check=False, timeout=60)  # fmt: skip
    if check.returncode != 0:
        _skip("WEIGHTSYNC_REQUIRE_IMAGES", f"images: {check.stderr.strip()}")
    assert sglang_python
    RealNode.started(local, state).import_archive(Path(check.stdout.split()[-1]))
    values = yaml.safe_load((REPO / "charts" / "weightsync" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "weightsync" / "Chart.yaml").read_text())
    agent_image = f"{values['agentImage']['repository']}:{values['agentImage']['tag'] or chart['appVersion']}"

    from weightsync_testing.sglang_models import ensure_tiny_model

    site = subprocess.run([sglang_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()  # fmt: skip
    directory = tmp_path_factory.mktemp("containers")
    model = directory / "model"  # a copy the containers' uid may read (the cache is root's)
    shutil.copytree(ensure_tiny_model(sglang_python), model)
    for path in [directory, model, *model.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    local._kubectl(state, "apply", "-f", str(REPO / "crds" / "weightsync.io_weightsyncgroups.yaml"))
    return Containers(agent_image, Path(site), model)


def _namespace(namespace: str, containers: Containers) -> list[dict[str, Any]]:
    """A namespace enforcing Pod Security ``baseline``, with claims of the SGLang site-packages (``site``), this
    checkout (``checkout``) and the model (``model``)."""
    labels = {"pod-security.kubernetes.io/enforce": "baseline"}
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace, "labels": labels}}
    ]
    for name, path in (("site", containers.site), ("checkout", REPO), ("model", containers.model)):
        objects += _host_path_claim(name, path, namespace)
    return objects


def _template_parts(agent_image: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pod template's spec on the real node with the three claims as volumes, and a container of the agent image
    mounting them (SGLang and its torch where the image looks for them, the checkout, the model)."""
    site = {"name": "site", "persistentVolumeClaim": {"claimName": "site", "readOnly": True}}
    checkout = {"name": "checkout", "persistentVolumeClaim": {"claimName": "checkout", "readOnly": True}}
    model = {"name": "model", "persistentVolumeClaim": {"claimName": "model", "readOnly": True}}
    mounts = [
        {"name": "site", "mountPath": names.SITE_PACKAGES_PATH, "readOnly": True},
        {"name": "checkout", "mountPath": CHECKOUT, "readOnly": True},
        {"name": "model", "mountPath": MODEL, "readOnly": True},
    ]
    pod = {"nodeSelector": {"kubernetes.io/hostname": NODE_NAME}, "terminationGracePeriodSeconds": 5,
           "volumes": [site, checkout, model]}  # fmt: skip
    return pod, {"image": agent_image, "imagePullPolicy": "Never", "volumeMounts": mounts}


def _sglang_env(ranks: int) -> list[dict[str, str]]:
    """SGLang on this CPU needs weightsync's gated workarounds (docs/engines/sglang-testing.md), from the checkout."""
    from weightsync_testing import sglang_cpu

    return [
        {"name": "PYTHONPATH", "value": str(Path(CHECKOUT) / sglang_cpu.DIRECTORY.relative_to(REPO))},
        {"name": sglang_cpu.ENV_ENABLE, "value": ",".join(sglang_cpu.workarounds_for(ranks, transfer_engine=True))},
        {"name": sglang_cpu.ENV_LOG, "value": "/tmp/workarounds.log"},
    ]


def _real_group(agent_image: str) -> dict[str, Any]:
    """A trainer pod and a stock SGLang engine pod on the real node, every container of the agent image: the agent
    as the operator's native sidecar, the trainer's and the engine's programs with the SGLang venv's site-packages
    (SGLang, its torch) where the image looks for them."""
    from weightsync_testing.sglang_server import server_command

    trainer = ["sh", "-c", "python3 -m torch.distributed.run --standalone --nproc-per-node 1 "
               f"-m weightsync_testing.pod_trainer {MODEL} 1 && exec sleep 86400"]  # fmt: skip
    sglang = server_command("python3", Path(MODEL), host="0.0.0.0", port=ENGINE_PORT, bootstrap_port=6789, tp=1,
                            dtype="float32", admin_api_key="$(WEIGHTSYNC_GROUP_TOKEN)")  # fmt: skip
    return _group_object(GROUP_NS, GROUP, agent_image, trainer, sglang, _sglang_env(1), pods=1)


def _group_object(
    namespace: str, name: str, agent_image: str, trainer: list[str], sglang: list[str], sglang_env: list[Any], pods: int
) -> dict[str, Any]:
    """A p2p group on the real node of one engine: ``pods`` trainer pods running ``trainer`` and ``pods`` engine pods
    (one rank each) running ``sglang``, every container of the agent image with the three claims mounted."""
    pod, image = _template_parts(agent_image)
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSyncGroup",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "agent": {"image": agent_image, "imagePullPolicy": "Never", "sitePackages": {"claimName": "site"}},
            "trainer": {"replicas": pods, "ranksPerPod": 1, "template": {"spec": {**pod, "containers": [
                {"name": "trainer", **image, "command": trainer,
                 "env": [{"name": "PYTHONPATH", "value": f"{CHECKOUT}/agent"}]}]}}},
            "inference": {"engines": 1, "ranksPerEngine": pods, "ranksPerPod": 1, "adapter": "sglang",
                          "port": ENGINE_PORT, "template": {"spec": {**pod, "containers": [
                              {"name": "sglang", **image, "command": sglang, "env": sglang_env}]}}},
            "transfer": {"mode": "p2p", "protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": 60,
                         "targetStaging": "live"},
        },
    }  # fmt: skip


def test_a_group_in_real_containers_syncs_and_catches_a_restarted_engine_up(
    real_cluster: tuple[LocalCluster, ClusterState], containers: Containers, tmp_path: Path
) -> None:
    """The operator's pods in real containers: the agent image as the native sidecar (torch from the claim
    ``spec.agent.sitePackages`` names), a trainer that trains and publishes, a stock SGLang CPU engine; the namespace
    enforces Pod Security ``baseline`` and kube-router enforces the group's NetworkPolicy. The round is verified, the
    group turns Ready through the real kubelet's readiness gate, a pod of another namespace is refused on the group's
    agent and Mooncake ports, and an engine container killed in containerd is restarted by the kubelet and caught
    up."""
    local, state = real_cluster
    agent_image = containers.agent_image
    local._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump_all(_namespace(GROUP_NS, containers)))
    operator_log = tmp_path / "operator.log"
    operator = OperatorProcess(state.kubeconfig, operator_log)
    # NetworkPolicies enforced from before the group exists: its round then runs under the group's policy.
    policies = NetworkPolicyEngine(RealNode.started(local, state))
    unenforced = network_policies.unavailable_reason(policies.node)
    if unenforced is None:
        policies.start(state)
    elif os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1 and NetworkPolicies cannot be enforced on the real node: {unenforced}")
    operator.start()
    try:
        # Pod Security baseline is enforced here: a pod of its own hostPath is refused (the claims are how the
        # node's cache reaches the group's pods).
        host_path_pod = {
            **host_python_pod("host-path", ["-V"]),
            "metadata": {"name": "host-path", "namespace": GROUP_NS},
        }
        refused = local._kubectl(state, "apply", "-f", "-", check=False, input=yaml.safe_dump(host_path_pod))
        assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused
        local._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump(_real_group(agent_image)))
        status = _wait_for_group(local, state, lambda s: s.get("weightVersion") == 1 and _ready(s), 420)
        assert status["lastSync"]["version"] == 1 and status["lastSync"]["result"] == "Succeeded", status
        engine, trainer = f"{GROUP}-engine-0-0", f"{GROUP}-trainer-0"
        for name in (engine, trainer):  # Ready through the kubelet, with the agent's readiness gate passed
            conditions = {c["type"]: c["status"] for c in _pod(local, state, name)["status"]["conditions"]}
            assert conditions[names.CONDITION_AGENT_READY] == "True" and conditions["Ready"] == "True", conditions
        url = f"http://{_pod(local, state, engine)['status']['podIP']}:{ENGINE_PORT}"
        synced = _generate(url)
        if unenforced is None:
            _assert_the_policy_refuses_other_namespaces(local, state, agent_image, (engine, trainer))

        # The engine container killed in containerd: the kubelet restarts it (SGLang loads the checkpoint's initial
        # weights again), the agents see an engine without the committed version and catch it up.
        node = RealNode.started(local, state)
        (task,) = node.ctr("containers", "ls", "-q", 'labels."io.kubernetes.container.name"==sglang').stdout.split()
        node.ctr("tasks", "kill", "--signal=SIGKILL", task)
        _wait_for(lambda: _restarts(local, state, engine, "sglang") >= 1, 120, "the kubelet to restart SGLang")
        _wait_for(lambda: "catch-up round v1: Succeeded" in _logs(local, state, trainer), 300, "the catch-up round")
        status = _wait_for_group(local, state, lambda s: s.get("weightVersion") == 1 and _ready(s), 300)
        _wait_for(lambda: _annotation(local, state, engine) == "1", 120, "the engine pod to report version 1")
        assert _generate(url) == synced  # the restarted engine serves the synced weights, not the checkpoint's
    except BaseException:
        _diagnose(local, state, operator_log, GROUP_NS, (f"{GROUP}-trainer-0", f"{GROUP}-engine-0-0"))
        raise
    finally:
        local._kubectl(state, "delete", "wsg", "-n", GROUP_NS, GROUP, "--wait=false", check=False)
        operator.stop()
        if unenforced is None:
            policies.stop(state)


MP_NS, MP_GROUP = "ws-multipod", "mp"


def _multipod_group(agent_image: str) -> dict[str, Any]:
    """A trainer of 2 pods and one SGLang engine of TP 2 over 2 pods, in real containers, whose commands use only the
    operator's workload identity: ``torchrun --nnodes/--node-rank/--rdzv-endpoint`` (gloo across the pods) and
    SGLang's ``--nnodes/--node-rank/--dist-init-addr``; the leader's address is its stable DNS name, which the
    node's cluster DNS resolves."""
    from weightsync_testing.sglang_server import server_command

    trainer = ["sh", "-c", "python3 -m torch.distributed.run --nnodes $(WEIGHTSYNC_NNODES) "
               "--node-rank $(WEIGHTSYNC_NODE_RANK) --nproc-per-node $(WEIGHTSYNC_NPROC_PER_NODE) "
               "--rdzv-endpoint $(WEIGHTSYNC_DIST_INIT_ADDR) "
               f"-m weightsync_testing.pod_trainer {MODEL} 1 && exec sleep 86400"]  # fmt: skip
    sglang = server_command("python3", Path(MODEL), host="0.0.0.0", port=ENGINE_PORT, bootstrap_port=6789, tp=2,
                            dtype="float32", admin_api_key="$(WEIGHTSYNC_GROUP_TOKEN)",
                            extra_args=["--nnodes", "$(WEIGHTSYNC_NNODES)", "--node-rank", "$(WEIGHTSYNC_NODE_RANK)",
                                        "--dist-init-addr", "$(WEIGHTSYNC_DIST_INIT_ADDR)"])  # fmt: skip
    sglang_env = [
        *_sglang_env(2),
        {"name": "SGLANG_CPU_OMP_THREADS_BIND", "value": "$(WEIGHTSYNC_NODE_RANK)"},  # one core per engine pod
        # At TP > 1 SGLang's vocab-parallel embedding is a torch.compile'd function, which inductor builds with a C++
        # compiler: SGLang's own image has one, the agent image standing in for it here does not ("InvalidCxxCompiler:
        # No working C++ compiler found"). The same operations run eagerly.
        {"name": "TORCH_COMPILE_DISABLE", "value": "1"},
    ]
    return _group_object(MP_NS, MP_GROUP, agent_image, trainer, sglang, sglang_env, pods=2)


def test_a_two_pod_trainer_and_a_two_pod_sglang_engine_sync_in_real_containers_from_the_operators_identity(
    real_cluster: tuple[LocalCluster, ClusterState], containers: Containers, tmp_path: Path
) -> None:
    """A trainer of 2 pods (torchrun across pods, gloo) and a stock SGLang engine of TP 2 over 2 pods, in real
    containers on the real node, find each other from the operator's identity alone (the leaders' DNS names through
    the node's cluster DNS): the group turns Ready with both engine pods joined in one engine, both trainer ranks
    publish version 1, the round is verified, and SGLang's own checksums equal the trainer's bytes rank by rank."""
    from weightsync_agent.targets.engine_client import EngineClient
    from weightsync_testing.sglang_checksums import assert_tp2_engine_holds

    local, state = real_cluster
    local._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump_all(_namespace(MP_NS, containers)))
    operator_log = tmp_path / "operator.log"
    operator = OperatorProcess(state.kubeconfig, operator_log)
    operator.start()
    pods = (f"{MP_GROUP}-trainer-0", f"{MP_GROUP}-trainer-1", f"{MP_GROUP}-engine-0-0", f"{MP_GROUP}-engine-0-1")
    try:
        local._kubectl(state, "apply", "-f", "-", input=yaml.safe_dump(_multipod_group(containers.agent_image)))
        status = _wait_for_group(local, state, lambda s: s.get("weightVersion") == 1 and _ready(s), 480,
                                 namespace=MP_NS, group=MP_GROUP)  # fmt: skip
        assert status["lastSync"]["version"] == 1 and status["lastSync"]["result"] == "Succeeded", status
        assert status["trainers"] == {"desired": 2, "ready": 2}, status
        assert status["engines"] == {"desired": 2, "ready": 2, "syncPaths": {"engineReplica": 0, "trace": 2}}, status
        for index in range(2):
            said = local._kubectl(state, "logs", "-n", MP_NS, pods[index], "-c", "trainer").stdout
            outcome = json.loads(next(line for line in said.splitlines() if line.startswith('{"rank"')))
            assert outcome["world"] == 2 and outcome["version"] == 1 and outcome["ok"], outcome

        secret = local._kubectl(state, "get", "secret", "-n", MP_NS, names.group_secret(MP_GROUP), "-o",
                                f"jsonpath={{.data.{names.SECRET_TOKEN_KEY}}}").stdout  # fmt: skip
        leader = _pod(local, state, pods[2], namespace=MP_NS)["status"]["podIP"]
        engine = EngineClient(f"http://{leader}:{ENGINE_PORT}", timeout=60, api_key=base64.b64decode(secret).decode())
        assert engine.weight_version() == "1"
        assert_tp2_engine_holds(engine, containers.model, 1)
    except BaseException:
        _diagnose(local, state, operator_log, MP_NS, pods)
        raise
    finally:
        local._kubectl(state, "delete", "wsg", "-n", MP_NS, MP_GROUP, "--wait=false", check=False)
        operator.stop()


#: Connect to each ``host:port`` argument until it accepts (at most ``PROBE_SECONDS``); print what each gave last:
#: "open", "refused" (a reset: nothing listens, or kube-router's REJECT) or the error's name.
PROBE_SECONDS = 10
PROBE = f"""
import concurrent.futures, json, socket, sys, time
def connect(target):
    host, port = target.rsplit(":", 1)
    deadline, last = time.monotonic() + {PROBE_SECONDS}, "never tried"
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return "open"
        except ConnectionRefusedError:
            last = "refused"
        except OSError as error:
            last = type(error).__name__
        time.sleep(0.5)
    return last
with concurrent.futures.ThreadPoolExecutor(len(sys.argv) - 1) as pool:
    print(json.dumps(dict(zip(sys.argv[1:], pool.map(connect, sys.argv[1:])))))
"""


def _listening(node: RealNode, pod: str) -> set[int]:
    """The TCP ports something listens on in ``pod``'s network namespace (read from the host: ``/proc/PID/net/tcp``
    of one of its containers' processes shows that namespace's sockets)."""
    selector = f'labels."io.kubernetes.pod.name"=={pod}'
    containers = set(node.ctr("containers", "ls", "-q", selector).stdout.split())
    pid = next(
        line.split()[1] for line in node.ctr("tasks", "ls").stdout.splitlines()[1:] if line.split()[0] in containers
    )
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            local_address, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                ports.add(int(local_address.rsplit(":", 1)[1], 16))
    return ports


def _assert_the_policy_refuses_other_namespaces(
    local: LocalCluster, state: ClusterState, image: str, pods: tuple[str, ...]
) -> None:
    """The group's pods' agent port and every Mooncake port they listen on: a pod of the group's namespace with the
    group's label connects to each; the same pod in another namespace is refused on each (kube-router enforcing
    the operator's policy; the round before ran under it)."""
    group = json.loads(local._kubectl(state, "get", "wsg", "-n", GROUP_NS, GROUP, "-o", "json").stdout)["spec"]
    agent_port, mooncake = group["agent"]["port"], group["transfer"]["mooncakePorts"]
    node = RealNode.started(local, state)
    targets = []
    for pod in pods:
        ip, ports = _pod(local, state, pod)["status"]["podIP"], _listening(node, pod)
        data = sorted(p for p in ports if mooncake["start"] <= p <= mooncake["end"])
        assert agent_port in ports and data, (pod, sorted(ports))  # the agent and at least one Mooncake engine
        targets += [f"{ip}:{port}" for port in (agent_port, *data)]
    outsider = "ws-outsider"
    local._kubectl(state, "create", "namespace", outsider, check=False)

    def probe(namespace: str) -> dict[str, Any]:
        container = {"name": "probe", "image": image, "imagePullPolicy": "Never",
                     "command": ["python3", "-c", PROBE, *targets]}  # fmt: skip
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "probe", "namespace": namespace, "labels": {names.LABEL_GROUP: GROUP}},
                "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE_NAME}, "restartPolicy": "Never",
                         "terminationGracePeriodSeconds": 1, "containers": [container]}}  # fmt: skip

    inside, outside = (
        json.loads(out) for out in _run_to_completion(local, state, probe(GROUP_NS), probe(outsider)).splitlines()
    )
    print(f"policy probes: {len(targets)} ports of {len(pods)} pods; inside: {inside}; outside: {outside}")
    assert set(inside.values()) == {"open"}, inside
    assert "open" not in outside.values() and set(outside) == set(targets), outside
    local._kubectl(state, "delete", "pod", "-n", GROUP_NS, "probe", "--wait=false", check=False)


def _diagnose(
    local: LocalCluster, state: ClusterState, operator_log: Path, namespace: str, pods: tuple[str, ...]
) -> None:
    """What a failed group test prints: the operator's log, the namespace's pods and events, every container's log."""
    print(operator_log.read_text(errors="replace")[-3000:], file=sys.stderr)
    print(local._kubectl(state, "get", "pods", "-n", namespace, "-o", "wide", check=False).stdout, file=sys.stderr)
    print(local._kubectl(state, "get", "events", "-n", namespace, check=False).stdout[-4000:], file=sys.stderr)
    for pod in pods:
        for container in ("weightsync-agent", "trainer", "sglang"):
            out = local._kubectl(state, "logs", "-n", namespace, pod, "-c", container, check=False)
            if out.returncode == 0:
                print(f"--- {pod}/{container}\n{out.stdout[-3000:]}", file=sys.stderr)


def _ready(status: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))


def _wait_for_group(
    local: LocalCluster, state: ClusterState, done: Any, timeout: float, namespace: str = GROUP_NS, group: str = GROUP
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        got = local._kubectl(state, "get", "wsg", "-n", namespace, group, "-o", "json", check=False)
        if got.returncode == 0:
            status = json.loads(got.stdout).get("status") or {}
            if done(status):
                return status
        time.sleep(2)
    pytest.fail(f"group {group} not there in {timeout:.0f} s: {json.dumps(status)[-3000:]}")


def _pod(local: LocalCluster, state: ClusterState, name: str, namespace: str = GROUP_NS) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(local._kubectl(state, "get", "pod", "-n", namespace, name, "-o", "json").stdout)
    return found


def _restarts(local: LocalCluster, state: ClusterState, pod: str, container: str) -> int:
    statuses = _pod(local, state, pod)["status"].get("containerStatuses") or []
    return sum(int(c.get("restartCount", 0)) for c in statuses if c["name"] == container)


def _annotation(local: LocalCluster, state: ClusterState, pod: str) -> str | None:
    value = (_pod(local, state, pod)["metadata"].get("annotations") or {}).get(names.ANNOTATION_WEIGHT_VERSION)
    return str(value) if value is not None else None


def _logs(local: LocalCluster, state: ClusterState, pod: str) -> str:
    return local._kubectl(state, "logs", "-n", GROUP_NS, pod, "-c", "weightsync-agent", check=False).stdout


def _generate(url: str) -> list[int]:
    """Greedy tokens of a fixed prompt (the engine's own forward on its current weights)."""
    import urllib.request

    body = {"text": "The quick brown fox", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as answer:
        out: list[int] = json.load(answer)["output_ids"]
    return out


def _wait_for(done: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def _skip(require: str, reason: str) -> None:
    """Skip with ``reason``, or fail where ``require`` is set (CI: the SGLang venv and the images are built)."""
    if os.environ.get(require) == "1":
        pytest.fail(f"{require}=1 and {reason}")
    pytest.skip(reason)
