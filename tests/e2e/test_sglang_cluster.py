"""A group of stock SGLang engine pods on the local cluster, their agents driving real SGLang servers.

``examples/sglang-group.yaml`` (adapter ``sglang``), shrunk to one TP=1 engine and two trainer pods, applied with
kubectl and reconciled by the operator running under the chart's ServiceAccount. Each engine pod's "containers"
are a stock SGLang 0.5.23 server on the tiny Llama (CPU, the pinned venv) plus the pod's agent, which traces the
model with SGLang's own code and assembles the manifests; the trainer pods' agents fetch them through the pod
annotation the engine's agent wrote. Checked: the group goes Ready only when the agents say so; a round published
by trainer code lands (status.lastSync, the pod's version annotation, SGLang's ``/model_info``), SGLang's own
``/weights_checker`` equals the trainer's bytes, and ``kubectl get wsg`` shows the version.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Agents, Kube, OperatorProcess, load_example, wait_for

from weightsync.api import names
from weightsync.api.load import parse_group
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_testing.engine_harness import SglangEngines
from weightsync_testing.sglang_env import SglangEnvError, SglangEnvUnavailable, sglang_python
from weightsync_testing.sglang_models import ensure_tiny_model, trained_state
from weightsync_testing.trainer_ranks import publish_all
from weightsync_tools.localcluster.session import PodCredentials, group_pods, secret_reader

pytest.importorskip("safetensors.torch")

NS = "e2e-sglang"
GROUP = "qwen3-rl"  # the example's name


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
def sglang_group(
    cluster: Any, admin: Kube, operator: OperatorProcess, sglang_py: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agents, Path]]:
    state, _ = cluster
    model_dir = ensure_tiny_model(sglang_py, "llama", seed=0, dtype="float32")
    directory = tmp_path_factory.mktemp("sglang-agents")
    admin.kubectl("create", "namespace", NS)
    obj = load_example(
        "sglang-group.yaml",
        NS,
        trainer__ranksPerPod=1,
        inference__engines=1,
        inference__ranksPerEngine=1,
        inference__ranksPerPod=1,
        transfer__bucketSizeMiB=1,
        transfer__timeoutSeconds=60,
    )
    admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))
    group = parse_group(admin.json("-n", NS, "get", "wsg", GROUP))
    wait_for(
        "the SGLang group's pods",
        lambda: set(group_pods(admin, NS, GROUP)) == {f"{GROUP}-{p}" for p in ("trainer-0", "trainer-1", "engine-0-0")},
    )
    wait_for(
        "the agents' ServiceAccount",
        lambda: admin.kubectl("-n", NS, "get", "sa", f"{GROUP}-agent", check=False).returncode == 0,
    )
    harness = SglangEngines(model_dir, python=str(sglang_py), dtype="float32", log_dir=directory / "sglang")
    credentials = PodCredentials(state, admin, directory / "kubeconfigs")
    agents = Agents(credentials, directory, engines=(harness, group.spec), secrets=secret_reader(admin))
    try:
        for pod in group_pods(admin, NS, GROUP).values():
            agents.start(pod)
        yield agents, model_dir
    finally:
        agents.stop_all()
        admin.kubectl("delete", "namespace", NS, "--wait=false")


def status(admin: Kube) -> dict[str, Any]:
    return admin.json("-n", NS, "get", "wsg", GROUP).get("status") or {}


def test_sglang_engine_pods_sync_through_their_agents(admin: Kube, sglang_group: tuple[Agents, Path]) -> None:
    agents, model_dir = sglang_group
    ready = wait_for(
        "the SGLang group Ready, its engine's path reported",
        lambda: (s := status(admin)).get("phase") == "Ready" and "syncPaths" in s["engines"] and s,
        timeout=240,
    )
    assert ready["trainers"] == {"desired": 2, "ready": 2}
    # The tiny Llama's every parameter is a cut of the trainer's tensors: its one rank is synced by the trace.
    assert ready["engines"] == {"desired": 1, "ready": 1, "syncPaths": {"trace": 1, "engineReplica": 0}}
    engine_pod = admin.json("-n", NS, "get", "pod", f"{GROUP}-engine-0-0")
    assert engine_pod["metadata"]["annotations"][names.ANNOTATION_AGENT_URL]  # where trainers fetch manifests

    full = trained_state(model_dir, 1)
    clients = [agents.client(f"{GROUP}-trainer-{i}", timeout=120) for i in range(2)]
    try:
        outcomes = publish_all(clients, full, 1)
    finally:
        for client in clients:
            client.close()
    assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]

    final = wait_for("status.lastSync 1", lambda: (s := status(admin)).get("lastSync", {}).get("version") == 1 and s)
    assert final["lastSync"]["result"] == "Succeeded"
    wait_for(  # the engine's agent reports what SGLang holds, on its next tick
        "the engine pod's version annotation",
        lambda: (
            admin.json("-n", NS, "get", "pod", f"{GROUP}-engine-0-0")["metadata"]["annotations"].get(
                names.ANNOTATION_WEIGHT_VERSION
            )
            == "1"
        ),
    )
    env = agents.envs[f"{GROUP}-engine-0-0"]
    engine = EngineClient(env[names.ENV_ENGINE_URL], timeout=60, api_key=agents.engine_tokens[f"{GROUP}-engine-0-0"])
    assert engine.weight_version() == "1"
    _, answer = engine.request("POST", "/weights_checker", body={"action": "checksum"}, timeout=60)
    held = answer["ranks"][0]["checksums"]
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight", "lm_head.weight"):
        assert held[name] == hashlib.sha256(full[name].numpy().tobytes()).digest()[:8].hex(), name
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
