"""A trainer of 2 pods and a stock SGLang engine of 2 pods (TP 2 across pods) complete a verified round from the
operator's workload identity alone.

The group is applied with kubectl and reconciled by the operator; its pods run on kwok nodes, which have no container
runtime, so this test is their kubelet: every pod gets a network namespace at the IP kwok gave it, with its group's
pod names resolving there (``weightsync_testing.pod_sandbox``), and runs its containers as local processes from the
pod's own spec — the environment and ``$(VAR)``-expanded command a kubelet would give them
(``weightsync_testing.container_spec``), nothing else. The templates use only the identity variables:
``torchrun --nnodes $(WEIGHTSYNC_NNODES) --node-rank $(WEIGHTSYNC_NODE_RANK) --rdzv-endpoint
$(WEIGHTSYNC_DIST_INIT_ADDR) ...`` (gloo across the two trainer pods) and ``sglang.launch_server --nnodes ...
--node-rank ... --dist-init-addr $(WEIGHTSYNC_DIST_INIT_ADDR)`` (one TP-2 engine whose ranks are in two pods). The
agents run in their pods' namespaces at the pods' IPs. Checked: both SGLang pods join one engine (its
``/weights_checker`` answers for 2 ranks), the group turns Ready, both trainer ranks publish version 1 and the round
succeeds (verified by SGLang's own checksums on both ranks, which also equal the trainer's bytes rank by rank), and
the status, the engine pod's annotation, the engine and ``kubectl get wsg`` (Ready, version 1) say so. (It replaced a
one-pod version of this test, whose agents ran on loopback next to a harness-started SGLang.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Agents, Kube, OperatorProcess, wait_for

from weightsync.api import names
from weightsync.api.v1alpha1 import AGENT_CONTAINER
from weightsync_agent.engine_python import ENV_ENGINE_PYTHON
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_testing import sglang_cpu
from weightsync_testing.container_spec import PodFacts, container_argv, container_env
from weightsync_testing.pod_sandbox import PodSandboxes, PodSandboxUnavailableError, check_available
from weightsync_testing.sglang_checksums import assert_tp2_engine_holds
from weightsync_testing.sglang_models import ensure_tiny_model
from weightsync_testing.sglang_server import server_command
from weightsync_tools.localcluster.session import PodCredentials, group_picture, group_pods, secret_reader

pytest.importorskip("safetensors.torch")

NS = "e2e-multipod"
GROUP = "mp"
ENGINE_PORT = 30000
#: What a container's image would put in its environment besides the spec's (the host is the image here).
IMAGE_ENV = ("PATH", "HOME", "LANG", "TMPDIR")


def group_object(sglang_py: Path, model_dir: Path, workarounds_log: Path) -> dict[str, Any]:
    trainer = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "$(WEIGHTSYNC_NNODES)",
               "--node-rank", "$(WEIGHTSYNC_NODE_RANK)", "--nproc-per-node", "$(WEIGHTSYNC_NPROC_PER_NODE)",
               "--rdzv-endpoint", "$(WEIGHTSYNC_DIST_INIT_ADDR)",
               "-m", "weightsync_testing.pod_trainer", str(model_dir), "1"]  # fmt: skip
    sglang = server_command(sglang_py, model_dir, host="0.0.0.0", port=ENGINE_PORT, bootstrap_port=6789, tp=2,
                            dtype="float32", admin_api_key="$(WEIGHTSYNC_GROUP_TOKEN)",
                            extra_args=["--nnodes", "$(WEIGHTSYNC_NNODES)", "--node-rank", "$(WEIGHTSYNC_NODE_RANK)",
                                        "--dist-init-addr", "$(WEIGHTSYNC_DIST_INIT_ADDR)"])  # fmt: skip
    # SGLang on this CPU needs weightsync's gated workarounds (docs/engines/sglang-testing.md), one core per pod.
    workarounds = sglang_cpu.workarounds_for(2, transfer_engine=True, mla=False)
    sglang_env = [
        {"name": "PYTHONPATH", "value": str(sglang_cpu.DIRECTORY)},
        {"name": sglang_cpu.ENV_ENABLE, "value": ",".join(workarounds)},
        {"name": sglang_cpu.ENV_LOG, "value": str(workarounds_log)},
        {"name": "SGLANG_CPU_OMP_THREADS_BIND", "value": "$(WEIGHTSYNC_NODE_RANK)"},
    ]
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSyncGroup",
        "metadata": {"name": GROUP, "namespace": NS},
        "spec": {
            "trainer": {"replicas": 2, "ranksPerPod": 1, "template": {"spec": {"containers": [
                {"name": "trainer", "image": "local/trainer", "command": trainer}]}}},
            "inference": {"engines": 1, "ranksPerEngine": 2, "ranksPerPod": 1, "adapter": "sglang",
                          "port": ENGINE_PORT, "template": {"spec": {"containers": [
                              {"name": "sglang", "image": "local/sglang", "command": sglang, "env": sglang_env}]}}},
            "transfer": {"mode": "p2p", "protocol": "tcp", "bucketSizeMiB": 1, "timeoutSeconds": 60,
                         "targetStaging": "live"},
        },
    }  # fmt: skip


class Kubelet:
    """Runs pods' containers as their specs say, in the pods' network namespaces; stops them together."""

    def __init__(self, network: PodSandboxes, secrets: Any, logs: Path) -> None:
        self.network, self.secrets, self.logs = network, secrets, logs
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def run(self, pod: dict[str, Any]) -> subprocess.Popen[bytes]:
        name = pod["metadata"]["name"]
        (container,) = [c for c in pod["spec"]["containers"] if c["name"] != AGENT_CONTAINER]
        facts = PodFacts(name, pod["metadata"]["namespace"], pod["status"]["podIP"], pod["spec"].get("nodeName", ""))
        env = container_env(container, facts, self.secrets)
        argv = container_argv(container, env)
        image = {k: os.environ[k] for k in IMAGE_ENV if k in os.environ}
        with open(self.logs / f"{name}-{container['name']}.log", "ab") as out:
            process = subprocess.Popen([*self.network.wrap(name), *argv], env={**image, **env}, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.processes[name] = process
        return process

    def log(self, name: str, container: str) -> str:
        path = self.logs / f"{name}-{container}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:  # SGLang's follower node waits for its leader's shutdown broadcast: not worth 20 s here
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture(scope="module")
def pods(
    cluster: Any, admin: Kube, operator: OperatorProcess, sglang_py: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, dict[str, Any]], Kubelet, Agents, Path]]:
    try:
        check_available()
    except PodSandboxUnavailableError as error:
        pytest.skip(f"pod sandboxes: {error}")
    state, _ = cluster
    model_dir = ensure_tiny_model(sglang_py, "llama", seed=0, dtype="float32")
    directory = tmp_path_factory.mktemp("multipod")
    admin.kubectl("create", "namespace", NS)
    admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(group_object(sglang_py, model_dir, directory / "wa.jsonl")))
    expected = {f"{GROUP}-trainer-0", f"{GROUP}-trainer-1", f"{GROUP}-engine-0-0", f"{GROUP}-engine-0-1"}
    try:
        running = wait_for(
            "the group's 4 pods with IPs",
            lambda: (
                (p := group_pods(admin, NS, GROUP)).keys() == expected
                and all(x.get("status", {}).get("podIP") for x in p.values())
                and p
            ),
            timeout=120,
        )
    except AssertionError as error:  # a CI run once timed out here: say what the cluster and the operator saw
        picture = group_picture(admin, NS, GROUP)
        raise AssertionError(f"{error}\n{picture}\n--- operator log (tail) ---\n{operator.output()[-3000:]}") from None
    wait_for(
        "the agents' ServiceAccount",
        lambda: admin.kubectl("-n", NS, "get", "sa", f"{GROUP}-agent", check=False).returncode == 0,
    )
    hosts = {f"{n}.{GROUP}.{NS}.svc": p["status"]["podIP"] for n, p in running.items()}
    network = PodSandboxes(api_port=state.apiserver_port).open()
    secrets = secret_reader(admin)
    kubelet = Kubelet(network, secrets, directory)
    agents = Agents(PodCredentials(state, admin, directory / "kubeconfigs"), directory, secrets=secrets,
                    network=network, engine_agent_env={ENV_ENGINE_PYTHON: str(sglang_py)})  # fmt: skip
    try:
        for name, pod in running.items():
            network.add(name, pod["status"]["podIP"], hosts)
        for name in sorted(running):  # the engine's leader first, as a scheduler may start them in any order
            if "-engine-" in name:
                kubelet.run(running[name])
        for pod in running.values():
            agents.start(pod)
        yield running, kubelet, agents, model_dir
    finally:
        kubelet.stop_all()
        agents.stop_all()
        network.close()
        admin.kubectl("delete", "namespace", NS, "--wait=false")


def status(admin: Kube) -> dict[str, Any]:
    return admin.json("-n", NS, "get", "wsg", GROUP).get("status") or {}


def test_a_two_pod_trainer_and_a_two_pod_sglang_engine_sync_from_the_operators_identity(
    admin: Kube, pods: tuple[dict[str, dict[str, Any]], Kubelet, Agents, Path]
) -> None:
    running, kubelet, agents, model_dir = pods
    leader = running[f"{GROUP}-engine-0-0"]
    engine = EngineClient(f"http://{leader['status']['podIP']}:{ENGINE_PORT}", timeout=60,
                          api_key=agents.engine_tokens.get(f"{GROUP}-engine-0-0"))  # fmt: skip
    ready = wait_for(
        "the group Ready (both SGLang pods joined one engine, every agent ready)",
        lambda: (s := status(admin)).get("phase") == "Ready" and s,
        timeout=300,
    )
    assert ready["trainers"] == {"desired": 2, "ready": 2}, ready
    # The engine's two pods, each rank synced by the trace of SGLang's own loader
    assert ready["engines"] == {"desired": 2, "ready": 2, "syncPaths": {"engineReplica": 0, "trace": 2}}, ready
    _, answer = engine.request("POST", "/weights_checker", body={"action": "checksum"}, timeout=60)
    assert len(answer["ranks"]) == 2, answer  # TP 2, one rank in each pod

    trainers = [kubelet.run(running[f"{GROUP}-trainer-{i}"]) for i in range(2)]
    for index, process in enumerate(trainers):
        try:
            code = process.wait(timeout=240)
        except subprocess.TimeoutExpired:
            code = None
        said = kubelet.log(f"{GROUP}-trainer-{index}", "trainer")
        assert code == 0, f"trainer pod {index} exited {code}:\n{said[-3000:]}"
        outcome = json.loads(next(line for line in said.splitlines() if line.startswith('{"rank"')))
        assert outcome["world"] == 2 and outcome["version"] == 1 and outcome["ok"], outcome

    final = wait_for("status.lastSync 1", lambda: (s := status(admin)).get("lastSync", {}).get("version") == 1 and s)
    assert final["lastSync"]["result"] == "Succeeded", final["lastSync"]
    assert engine.weight_version() == "1"
    assert_tp2_engine_holds(engine, model_dir, 1)
    wait_for(  # the engine's agent reports what SGLang holds, on its next tick
        "the engine pod's version annotation",
        lambda: (
            admin.json("-n", NS, "get", "pod", f"{GROUP}-engine-0-0")["metadata"]["annotations"].get(
                names.ANNOTATION_WEIGHT_VERSION
            )
            == "1"
        ),
    )
    # The operator folds the pod's new annotation into the phase on its next reconcile: Syncing until then.
    row = wait_for(
        "kubectl get wsg: Ready, version 1",
        lambda: (
            (r := admin.kubectl("-n", NS, "get", "wsg", GROUP).stdout.splitlines()[1].split())[:3]
            == [GROUP, "Ready", "True"]
            and r
        ),
    )
    assert row[6] == "1", row
