"""Real API server: Helm install, schema/CEL rejections, and a group's whole life under the operator."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, SYSTEM_NS, Agents, Kube, OperatorProcess, load_example, wait_for

from weightsync.api import names
from weightsync.api.load import parse_group
from weightsync.plan import Plan, plan_for
from weightsync_agent.rounds.remote import AgentClient, AgentError
from weightsync_operator.builders import build_mesh_policies, build_network_policy
from weightsync_testing.reference_engine.model import full_state, shard
from weightsync_tools.localcluster.session import PodCredentials, group_pods, secret_reader

INVALID = sorted((ROOT / "tests" / "fixtures" / "invalid").glob("*.yaml"))
NS = "e2e"


def expectation(path: Path) -> str:
    found = dict(re.findall(r"^# (expect(?:-local|-server)?): (.+)$", path.read_text(), flags=re.M))
    return found.get("expect-server") or found["expect"]


# --- Install -------------------------------------------------------------------------------------


def test_chart_installs_crd_and_operator(admin: Kube, chart: str) -> None:
    crd = admin.json("get", "crd", "weightsyncgroups.weightsync.io")
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established["Established"] == "True"
    deployment = admin.json("-n", SYSTEM_NS, "get", "deployment", chart)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["status"].get("availableReplicas") == 1


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "replicaCount=2"], "replicaCount"),
        (["--set", "metrics.port=99999"], "/metrics/port"),
        (["--set", "watchNamespaces[0]=Bad_NS"], "/watchNamespaces/0"),
        (["--set", "unknownKey=1"], "unknownKey"),
    ],
)
def test_helm_install_rejects_bad_values(admin: Kube, values: list[str], message: str) -> None:
    result = admin.helm(
        "install",
        "bad-values",
        str(ROOT / "charts" / "weightsync"),
        "-n",
        "bad-values",
        "--create-namespace",
        *values,
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert "bad-values" not in admin.helm("list", "-A", "-q").stdout.split()


# --- Validation on the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def invalid_ns(admin: Kube, chart: str) -> str:
    admin.kubectl("create", "namespace", "e2e-invalid")
    return "e2e-invalid"


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_api_server_rejects_invalid_group(admin: Kube, invalid_ns: str, path: Path) -> None:
    result = admin.kubectl("-n", invalid_ns, "apply", "-f", str(path), check=False)
    assert result.returncode != 0, f"{path.name} was accepted"
    assert expectation(path) in result.stderr, result.stderr
    assert admin.kubectl("-n", invalid_ns, "get", "wsg", "-o", "name").stdout.strip() == ""


def test_immutable_fields_are_enforced_by_the_server(admin: Kube, invalid_ns: str) -> None:
    obj = load_example("tcp-group.yaml", invalid_ns)
    obj["metadata"]["name"] = "immutable"
    admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))
    try:
        result = admin.kubectl(
            "-n",
            invalid_ns,
            "patch",
            "wsg",
            "immutable",
            "--type=merge",
            "-p",
            '{"spec":{"inference":{"ranksPerEngine":4}}}',
            check=False,
        )
        assert result.returncode != 0
        assert "inference.ranksPerEngine is immutable" in result.stderr
        scaled = admin.kubectl(
            "-n",
            invalid_ns,
            "patch",
            "wsg",
            "immutable",
            "--type=merge",
            "-p",
            '{"spec":{"inference":{"engines":3}}}',
            check=False,
        )
        assert scaled.returncode == 0, scaled.stderr
    finally:
        admin.kubectl("-n", invalid_ns, "delete", "wsg", "immutable", "--wait=false")


# --- A group's life ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group_ns(admin: Kube, operator: OperatorProcess) -> str:
    admin.kubectl("create", "namespace", NS)
    return NS


def pods(admin: Kube, group: str) -> dict[str, dict[str, Any]]:
    return group_pods(admin, NS, group)


def status(admin: Kube, group: str) -> dict[str, Any]:
    return admin.json("-n", NS, "get", "wsg", group).get("status") or {}


def stored_plan(admin: Kube, group: str) -> Plan:
    cm = admin.json("-n", NS, "get", "configmap", names.plan_config_map(group))
    return Plan.from_json(cm["data"][names.PLAN_KEY])


@pytest.fixture(scope="module")
def agents(cluster: Any, admin: Kube, group_ns: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agents]:
    state, _ = cluster
    directory = tmp_path_factory.mktemp("agents")
    wait_for(
        "the agents' ServiceAccount",
        lambda: admin.kubectl("-n", NS, "get", "sa", "demo-agent", check=False).returncode == 0,
    )
    running = Agents(PodCredentials(state, admin, directory / "kubeconfigs"), directory, secrets=secret_reader(admin))
    try:
        yield running
    finally:
        running.stop_all()


RDMA_GROUP = "rdma"


def test_rdma_group_pods_carry_everything_rdma_needs(admin: Kube, group_ns: str) -> None:
    obj = load_example("rdma-group.yaml", NS, trainer__replicas=2, inference__engines=2)
    obj["metadata"]["name"] = RDMA_GROUP
    obj["spec"]["rdma"]["networks"] = ["e2e/rdma-net"]
    admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))
    expected = {"rdma-trainer-0", "rdma-trainer-1", "rdma-engine-0-0", "rdma-engine-1-0"}
    found = wait_for("the RDMA group's pods", lambda: (p := pods(admin, RDMA_GROUP)) and set(p) == expected and p)
    for pod in found.values():
        spec = pod["spec"]
        sidecar = next(c for c in spec["initContainers"] if c["name"] == "weightsync-agent")
        assert sidecar["restartPolicy"] == "Always"
        user = spec["containers"][0]
        for container in (user, sidecar):
            assert container["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
            assert container["resources"]["requests"]["rdma/hca_shared_devices_a"] == "1"
            assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
            assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
        shm = next(v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory")
        assert shm["emptyDir"]["sizeLimit"] == "64Gi"
        assert pod["metadata"]["annotations"][names.MULTUS_NETWORKS] == "e2e/rdma-net"
        assert {"conditionType": names.CONDITION_AGENT_READY} in spec["readinessGates"]
        labels = pod["metadata"]["labels"]
        assert labels[names.LABEL_GROUP] == RDMA_GROUP and labels[names.LABEL_ROLE] in ("trainer", "engine")
    # The scheduler placed them on the fake GPU/RDMA nodes and kwok runs them.
    wait_for(
        "RDMA pods running",
        lambda: all(p["status"].get("phase") == "Running" for p in pods(admin, RDMA_GROUP).values()),
    )
    admin.kubectl("-n", NS, "delete", "wsg", RDMA_GROUP)
    wait_for("the RDMA group's pods to go", lambda: not pods(admin, RDMA_GROUP), timeout=90)


def test_an_adapter_without_support_is_refused_not_provisioned(
    admin: Kube, group_ns: str, operator: OperatorProcess
) -> None:
    """The production-shaped example asking stock SGLang for staged writes (it has no staging area): the API
    server accepts it, the operator refuses it on the status, with a Warning event, and creates no pods."""
    name = "no-adapter"
    obj = load_example("rdma-group.yaml", NS)
    obj["metadata"]["name"] = name
    assert obj["spec"]["inference"]["adapter"] == "sglang"
    obj["spec"]["transfer"]["targetStaging"] = "staged"
    admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))
    try:
        final = wait_for(
            "the group to be refused", lambda: (s := status(admin, name)).get("phase") == "Failed" and s, timeout=60
        )
        conditions = {c["type"]: c for c in final["conditions"]}
        ready = conditions["Ready"]
        assert ready["status"] == "False" and ready["reason"] == "AdapterLacksCapability", ready
        assert "sglang" in ready["message"] and "targetStaging 'staged'" in ready["message"]
        degraded = conditions["Degraded"]
        assert degraded["status"] == "True" and degraded["reason"] == "AdapterLacksCapability"
        assert conditions["PlanReady"]["status"] == "False"
        events = wait_for(
            "the AdapterLacksCapability event",
            lambda: admin.json(
                "-n",
                NS,
                "get",
                "events",
                "--field-selector",
                f"involvedObject.name={name},reason=AdapterLacksCapability",
            )["items"],
        )
        assert events[0]["type"] == "Warning" and "sglang" in events[0]["message"]
        # Still nothing after further reconciles (resync every 5 s): refused, not merely slow.
        seen = operator.reconciles()
        wait_for("two more reconciles", lambda: operator.reconciles() >= seen + 2, timeout=45)
        assert pods(admin, name) == {}
        assert admin.kubectl("-n", NS, "get", "configmap", names.plan_config_map(name), check=False).returncode != 0
        assert status(admin, name)["phase"] == "Failed"
    finally:
        admin.kubectl("-n", NS, "delete", "wsg", name, "--wait=false")


def test_group_comes_up_and_agents_report_ready(admin: Kube, group_ns: str, agents: Agents | None = None) -> None:
    admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(load_example("tcp-group.yaml", NS)))
    expected = {"demo-trainer-0", "demo-trainer-1", "demo-engine-0-0", "demo-engine-1-0"}
    created = wait_for("the group's pods", lambda: (p := pods(admin, "demo")) and set(p) == expected and p)
    # As the API server stored them: each user container knows its place in its trainer or engine (2 trainer pods;
    # each engine one pod) and its leader's stable name, the pod's own hostname.subdomain (docs/workload-identity.md).
    for name, pod in created.items():
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        leader, rank = name.rsplit("-", 1)[0] + "-0", name.rsplit("-", 1)[1]
        assert (env[names.ENV_NODE_RANK], env[names.ENV_NNODES]) == (rank, "2" if "trainer" in name else "1"), name
        assert env[names.ENV_DIST_INIT_ADDR] == f"{leader}.demo.{NS}.svc:{names.RENDEZVOUS_PORT}", name
        assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (name, "demo")
    # The plan ConfigMap is the planner's output for this spec.
    group = parse_group(admin.json("-n", NS, "get", "wsg", "demo"))
    plan = stored_plan(admin, "demo")
    assert plan.hash == plan_for(group.spec, group="demo", namespace=NS).hash
    assert plan.revision == 1
    # Nobody is ready before the agents say so, even though kwok marks the pods Ready.
    first = wait_for("a first status", lambda: (s := status(admin, "demo")).get("plan") and s)
    assert first["trainers"]["ready"] == 0 and first["engines"]["ready"] == 0


#: The group's credential as first seen: later reconciles must leave it exactly so.
FIRST_SECRET: dict[str, Any] = {}


def token_holders(pod: dict[str, Any]) -> set[str]:
    """Containers (init or not) whose env references a Secret or that mount one; none may take it wholesale."""
    mounted = {v["name"] for v in pod["spec"].get("volumes") or [] if "secret" in v}
    holders = set()
    for c in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
        assert not any("secretRef" in e for e in c.get("envFrom") or []), c["name"]
        if any("secretKeyRef" in (e.get("valueFrom") or {}) for e in c.get("env") or []):
            holders.add(c["name"])
        if mounted & {m["name"] for m in c.get("volumeMounts") or []}:
            assert c["name"] == "weightsync-agent", c["name"]  # the Secret volume is the agent's alone
            holders.add(c["name"])
    return holders


def test_the_group_credential_is_a_secret_the_group_owns_held_by_agents_and_engines_only(
    admin: Kube, group_ns: str
) -> None:
    uid = admin.json("-n", NS, "get", "wsg", "demo")["metadata"]["uid"]
    secret = wait_for("the group's Secret", lambda: admin.json("-n", NS, "get", "secret", names.group_secret("demo")))
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == uid and owner["kind"] == "WeightSyncGroup" and owner["controller"] is True
    assert set(secret["data"]) == {names.SECRET_TOKEN_KEY} and len(secret["data"][names.SECRET_TOKEN_KEY]) >= 40
    FIRST_SECRET.update(secret)
    for name, pod in pods(admin, "demo").items():
        engine_container = pod["spec"]["containers"][0]["name"]
        expected = {"weightsync-agent", engine_container} if "-engine-" in name else {"weightsync-agent"}
        assert token_holders(pod) == expected, name
        refs = [
            e["valueFrom"]["secretKeyRef"]
            for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]
            for e in c.get("env") or []
            if "secretKeyRef" in (e.get("valueFrom") or {})
        ]
        assert all(r == {"name": "demo-credentials", "key": names.SECRET_TOKEN_KEY} for r in refs), refs


def network_policy(admin: Kube, group: str) -> dict[str, Any] | None:
    result = admin.kubectl("-n", NS, "get", "networkpolicy", names.network_policy(group), "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def expected_policy_spec(admin: Kube, group: str) -> dict[str, Any]:
    built = build_network_policy(parse_group(admin.json("-n", NS, "get", "wsg", group)))
    assert built is not None
    return dict(built["spec"])


def test_the_group_network_policy_fences_its_pods(admin: Kube, group_ns: str) -> None:
    """The policy's *content* on the real API server: this local cluster has no CNI, so nothing enforces
    NetworkPolicies here (kwok pods have no network at all); what a policy engine would do with it is
    tested by tests/operator/test_network_policy.py's evaluator."""
    uid = admin.json("-n", NS, "get", "wsg", "demo")["metadata"]["uid"]
    policy = wait_for("the group's NetworkPolicy", lambda: network_policy(admin, "demo"))
    (owner,) = policy["metadata"]["ownerReferences"]
    assert owner["uid"] == uid and owner["kind"] == "WeightSyncGroup" and owner["controller"] is True
    spec = policy["spec"]
    assert spec == expected_policy_spec(admin, "demo")
    assert spec["podSelector"] == {"matchLabels": {names.LABEL_GROUP: "demo"}}
    assert spec["policyTypes"] == ["Ingress"]
    own, engine_clients = spec["ingress"]
    assert own["from"] == [{"podSelector": {"matchLabels": {names.LABEL_GROUP: "demo"}}}]
    assert own["ports"] == [
        {"protocol": "TCP", "port": 9470},
        {"protocol": "TCP", "port": 30000},
        {"protocol": "TCP", "port": 15000, "endPort": 17000},
    ]
    assert engine_clients == {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 30000}]}
    # Every pod of the group is selected by it, and its engine container knows the range the policy opens.
    for pod in pods(admin, "demo").values():
        assert pod["metadata"]["labels"][names.LABEL_GROUP] == "demo"
        if "-engine-" in pod["metadata"]["name"]:
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}
            assert (env[names.ENV_MOONCAKE_MIN_PORT], env[names.ENV_MOONCAKE_MAX_PORT]) == ("15000", "17000")
    # A trainer over several pods gets its mesh (every port between its own pods); single-pod engines none.
    group = parse_group(admin.json("-n", NS, "get", "wsg", "demo"))
    for role, built in build_mesh_policies(group).items():
        stored = admin.json("-n", NS, "get", "networkpolicy", names.mesh_policy("demo", role))
        assert stored["spec"] == built["spec"] and stored["metadata"]["ownerReferences"][0]["uid"] == uid
    assert ("trainer" in build_mesh_policies(group)) == (group.spec.trainer.replicas > 1)
    FIRST_POLICY.update(policy)


#: The group's NetworkPolicy as first seen: reconciles must not rewrite it needlessly.
FIRST_POLICY: dict[str, Any] = {}


def test_an_edited_or_deleted_network_policy_is_restored(admin: Kube, group_ns: str) -> None:
    name = names.network_policy("demo")
    # Someone opens the group to everyone: the next reconcile (a resync, 5 s here) puts the rules back.
    admin.kubectl("-n", NS, "patch", "networkpolicy", name, "--type", "merge", "-p", '{"spec": {"ingress": [{}]}}')
    wait_for(
        "the edited policy restored",
        lambda: (p := network_policy(admin, "demo")) and p["spec"] == expected_policy_spec(admin, "demo"),
        timeout=45,
    )
    old_uid = FIRST_POLICY["metadata"]["uid"]
    admin.kubectl("-n", NS, "delete", "networkpolicy", name, "--wait=true")
    restored = wait_for(
        "the deleted policy recreated",
        lambda: (p := network_policy(admin, "demo")) and p["metadata"]["uid"] != old_uid and p,
        timeout=45,
    )
    assert restored["spec"] == expected_policy_spec(admin, "demo")
    FIRST_POLICY.clear()
    FIRST_POLICY.update(restored)


def test_a_broadcast_group_opens_every_port_to_its_own_pods_and_can_opt_out(admin: Kube, group_ns: str) -> None:
    """gloo/NCCL listen on ephemeral ports: a broadcast group's pods reach each other on every port; nobody else
    does. ``networkPolicy.enabled: false`` makes the operator delete the policy it made."""
    obj = load_example("tcp-group.yaml", NS)
    obj["metadata"]["name"] = "bcast"
    obj["spec"]["transfer"]["mode"] = "broadcast"
    obj["spec"]["transfer"]["mooncakePorts"] = {"start": 20000, "end": 20999}
    admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))
    try:
        policy = wait_for("the broadcast group's NetworkPolicy", lambda: network_policy(admin, "bcast"))
        assert policy["spec"] == expected_policy_spec(admin, "bcast")
        own, engine_clients = policy["spec"]["ingress"]
        assert own == {"from": [{"podSelector": {"matchLabels": {names.LABEL_GROUP: "bcast"}}}]}  # every port
        assert engine_clients["ports"] == [{"protocol": "TCP", "port": 30000}]

        admin.kubectl("-n", NS, "patch", "wsg", "bcast", "--type", "merge", "-p",
                      '{"spec": {"networkPolicy": {"enabled": false}}}')  # fmt: skip
        wait_for("the opted-out group's policy deleted", lambda: network_policy(admin, "bcast") is None, timeout=45)
    finally:
        admin.kubectl("-n", NS, "delete", "wsg", "bcast", "--wait=true")
    wait_for(
        "the broadcast group's pods gone",
        lambda: not pods(admin, "bcast"),
        timeout=120,
    )


def test_agents_make_the_group_ready(admin: Kube, group_ns: str, agents: Agents) -> None:
    for pod in pods(admin, "demo").values():
        agents.start(pod)
    final = wait_for(
        "the group to be Ready", lambda: (s := status(admin, "demo")).get("phase") == "Ready" and s, timeout=90
    )
    assert final["trainers"] == {"desired": 2, "ready": 2}
    assert final["engines"] == {"desired": 2, "ready": 2}
    table = admin.kubectl("-n", NS, "get", "wsg").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "READY", "TRAINERS", "ENGINES", "MODE", "VERSION", "LAST-SYNC", "AGE"]
    assert table[1].split()[:6] == ["demo", "Ready", "True", "2", "2", "p2p"]


def publish_everywhere(agents: Agents, version: int, seed: int) -> list[Any]:
    """Trainer code on both trainer pods: stage a model's full tensors, publish ``version`` (a collective)."""
    full = full_state(seed=seed)
    clients = [agents.client(f"demo-trainer-{i}") for i in range(2)]
    outcomes: list[Any] = [None, None]

    def rank(i: int) -> None:
        clients[i].stage_many(full)
        outcomes[i] = clients[i].publish(version, check=False)

    try:
        threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        for client in clients:
            client.close()
    return outcomes


def engine_annotation(admin: Kube, pod: str) -> str | None:
    found = admin.json("-n", NS, "get", "pod", pod)
    value = (found["metadata"].get("annotations") or {}).get(names.ANNOTATION_WEIGHT_VERSION)
    return str(value) if value is not None else None


def test_a_sync_round_through_the_agents_shows_in_status(admin: Kube, group_ns: str, agents: Agents) -> None:
    # Without the credential, rank 0's agent refuses to publish (issue 11's hijack); trainer code's client publishes
    # with the pod-local token its agent leaves in the replica folder.
    rank0 = f"http://127.0.0.1:{agents.envs['demo-trainer-0'][names.ENV_AGENT_PORT]}"
    hijack = urllib.request.Request(
        rank0 + "/v1/publish", json.dumps({"version": 10**15, "rank": 0}).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(hijack, timeout=10)
    assert refused.value.code == 401
    outcomes = publish_everywhere(agents, 1, seed=5)
    assert all(o is not None and o.ok for o in outcomes), [o and o.summary() for o in outcomes]
    final = wait_for(
        "status.lastSync for version 1",
        lambda: (s := status(admin, "demo")).get("lastSync", {}).get("version") == 1 and s,
    )
    last = final["lastSync"]
    assert last["result"] == "Succeeded" and last["durationSeconds"] > 0
    # The round's record: seconds per phase, the engines' pause window, the slowest source and target.
    assert {"prepare", "pause", "begin", "write", "verify", "commit", "resume"} <= set(last["phases"])
    assert 0 < last["pausedSeconds"] <= last["durationSeconds"]
    assert last["slowestSource"]["peer"].startswith("source ") and last["slowestTarget"]["peer"].startswith("engine ")
    assert final["recentSyncs"][-1]["version"] == 1
    shown = weightsync_cli(admin, "status", "demo", "-n", NS)
    assert shown.returncode == 0, shown.stderr
    assert "v1 Succeeded" in shown.stdout and "phases: prepare" in shown.stdout and "engines paused" in shown.stdout
    assert f"slowest target: {last['slowestTarget']['peer']}" in shown.stdout
    listed = weightsync_cli(admin, "rounds", "demo", "-n", NS, "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)[0]["phases"]["write"] == last["phases"]["write"]
    # The coordinator's metrics endpoint exports the same record (open, like the probes).
    with urllib.request.urlopen(rank0 + "/metrics", timeout=10) as answer:
        exported = answer.read().decode()
    for series in ('weightsync_agent_round_phase_seconds_count{group="demo",kind="regular",phase="write"} 1.0',
                   'weightsync_agent_round_paused_seconds_count{group="demo",kind="regular"} 1.0',
                   'weightsync_agent_round_slowest_seconds{group="demo",role="target"}'):  # fmt: skip
        assert series in exported, series
    plan = stored_plan(admin, "demo")
    reference = full_state(seed=5)
    per_rank = {r: sum(t.numel() * t.element_size() for t in shard(reference, 2, r).values()) for r in range(2)}
    assert last["bytes"] == plan.layout.engines * sum(per_rank.values())  # every engine rank got its shard once
    # The engines' agents report the version each engine now holds.
    for pod in ("demo-engine-0-0", "demo-engine-1-0"):
        wait_for(f"{pod} to report version 1", lambda pod=pod: engine_annotation(admin, pod) == "1")
    # The status follows the pods' reports within a status interval (pod events are coalesced, one reconcile
    # per group per second at most), so the column is waited for, not read at once.
    wait_for(
        "kubectl get wsg to show version 1, Succeeded",
        lambda: admin.kubectl("-n", NS, "get", "wsg", "demo").stdout.splitlines()[1].split()[6:8] == ["1", "Succeeded"],
    )


def test_scaling_engines_replans_and_creates_pods(admin: Kube, group_ns: str, agents: Agents) -> None:
    admin.kubectl("-n", NS, "patch", "wsg", "demo", "--type=merge", "-p", '{"spec":{"inference":{"engines":3}}}')
    wait_for("the third engine's pod", lambda: "demo-engine-2-0" in pods(admin, "demo"))
    plan = wait_for("plan revision 2", lambda: (p := stored_plan(admin, "demo")).revision == 2 and p)
    assert plan.layout.engines == 3
    agents.start(pods(admin, "demo")["demo-engine-2-0"])
    final = wait_for(
        "3 engines ready",
        lambda: (
            (s := status(admin, "demo"))["engines"] == {"desired": 3, "ready": 3} and s.get("phase") == "Ready" and s
        ),
        timeout=90,
    )
    assert final["plan"]["revision"] == 2 and final["plan"]["targets"] == 6
    # The joiner gets the committed version from the trainers' replicas, on its own; the group is Ready only once
    # it holds it (before, Ready=False with reason EnginesBehind: it served its initial weights).
    assert engine_annotation(admin, "demo-engine-2-0") == "1" and final["weightVersion"] == 1
    assert next(c for c in final["conditions"] if c["type"] == "Ready")["reason"] == "AllPodsReady"
    events = admin.kubectl(
        "-n", NS, "get", "events", "--field-selector", "involvedObject.name=demo", "-o", "jsonpath={.items[*].reason}"
    ).stdout.split()
    assert "PlanUpdated" in events


def test_scaling_down_deletes_pods(admin: Kube, group_ns: str, agents: Agents) -> None:
    admin.kubectl("-n", NS, "patch", "wsg", "demo", "--type=merge", "-p", '{"spec":{"inference":{"engines":1}}}')
    wait_for(
        "surplus engine pods to go",
        lambda: set(pods(admin, "demo")) == {"demo-trainer-0", "demo-trainer-1", "demo-engine-0-0"},
    )
    agents.stop("demo-engine-1-0")
    agents.stop("demo-engine-2-0")
    plan = wait_for("plan revision 3", lambda: (p := stored_plan(admin, "demo")).revision == 3 and p)
    assert plan.layout.engines == 1
    wait_for("status for 1 engine", lambda: status(admin, "demo")["engines"] == {"desired": 1, "ready": 1})
    role = admin.json("-n", NS, "get", "role", "demo-agent")
    pod_rule = next(r for r in role["rules"] if "pods" in r["resources"])
    assert set(pod_rule["resourceNames"]) == {"demo-trainer-0", "demo-trainer-1", "demo-engine-0-0"}


def test_a_deleted_pod_is_recreated(admin: Kube, group_ns: str, agents: Agents) -> None:
    old_uid = pods(admin, "demo")["demo-trainer-1"]["metadata"]["uid"]
    admin.kubectl("-n", NS, "delete", "pod", "demo-trainer-1", "--wait=true")
    recreated = wait_for(
        "demo-trainer-1 to come back",
        lambda: (p := pods(admin, "demo").get("demo-trainer-1")) and p["metadata"]["uid"] != old_uid and p,
    )
    agents.start(recreated)
    wait_for("the group Ready again", lambda: status(admin, "demo").get("phase") == "Ready", timeout=90)


def test_a_restarted_coordinator_agent_goes_on_from_the_committed_version(
    admin: Kube, group_ns: str, agents: Agents
) -> None:
    """Trainer rank 0's agent restarts (issue 11: the committed version was forgotten and versions could go back):
    it learns version 1 from the engine (and its pod's own annotation), refuses 1 again, and 2 lands."""
    agents.start(pods(admin, "demo")["demo-trainer-0"])  # stops the running agent first: a restart
    env = agents.envs["demo-trainer-0"]
    # The group token as the agents read it (their mounted Secret), not from their env.
    coordinator = AgentClient(f"http://127.0.0.1:{env[names.ENV_AGENT_PORT]}", token=secret_tokens(admin)[0])

    def learnt() -> bool:
        try:
            state = coordinator.state(timeout=5)
        except AgentError:
            return False
        return bool((state.get("sources") or {}).get("built")) and state.get("committed") == 1

    wait_for("the restarted coordinator to learn committed version 1", learnt, timeout=60)
    for name in ("demo-trainer-0", "demo-trainer-1"):
        code = agents.processes[name].poll()
        assert code is None, f"{name}'s agent exited ({code}):\n{agents.log(name)[-3000:]}"
    again = publish_everywhere(agents, 1, seed=5)
    alive = {name: agents.processes[name].poll() for name in ("demo-trainer-0", "demo-trainer-1")}
    assert all(o is not None and not o.ok for o in again), (alive, agents.log("demo-trainer-1")[-2000:])
    assert "version 1 is not newer than committed 1" in (again[0].round.reason or "")
    assert engine_annotation(admin, "demo-engine-0-0") == "1"
    outcomes = publish_everywhere(agents, 2, seed=6)
    assert all(o is not None and o.ok for o in outcomes), [o and o.summary() for o in outcomes]
    final = wait_for(
        "the group Ready at version 2",
        lambda: (s := status(admin, "demo")).get("weightVersion") == 2 and s.get("phase") == "Ready" and s,
    )
    assert final["lastSync"]["version"] == 2 and final["lastSync"]["result"] == "Succeeded"


def test_operator_restart_resumes_without_duplicates(admin: Kube, group_ns: str, operator: OperatorProcess) -> None:
    before = {name: p["metadata"]["uid"] for name, p in pods(admin, "demo").items()}
    revision = stored_plan(admin, "demo").revision
    operator.restart()
    # The resumed operator reconciles the group on resume, then on every resync (5 s here).
    wait_for("the resumed operator to reconcile the group twice", lambda: operator.reconciles() >= 2, timeout=45)
    after = {name: p["metadata"]["uid"] for name, p in pods(admin, "demo").items()}
    assert after == before
    assert stored_plan(admin, "demo").revision == revision
    all_pods = admin.json("-n", NS, "get", "pods")["items"]
    assert len(all_pods) == len(before)


def test_the_network_policy_survives_reconciles_unchanged(admin: Kube, group_ns: str) -> None:
    """Many reconciles later (scaling, a recreated pod, an operator restart), nobody rewrote the policy: what the
    operator builds is what the API server stores, so it never patches it needlessly."""
    assert FIRST_POLICY, "the policy tests ran first"
    now = network_policy(admin, "demo")
    assert now is not None
    assert now["metadata"]["resourceVersion"] == FIRST_POLICY["metadata"]["resourceVersion"]


def test_the_credential_survives_reconciles_unchanged(admin: Kube, group_ns: str) -> None:
    # By now the group was scaled up and down, a pod recreated and the operator restarted: many reconciles.
    assert FIRST_SECRET, "the Secret test ran first"
    now = admin.json("-n", NS, "get", "secret", names.group_secret("demo"))
    assert now["data"] == FIRST_SECRET["data"]
    assert now["metadata"]["resourceVersion"] == FIRST_SECRET["metadata"]["resourceVersion"]
    assert now["metadata"]["uid"] == FIRST_SECRET["metadata"]["uid"]


def rotate_token(admin: Kube, *args: str) -> subprocess.CompletedProcess[str]:
    """``weightsync rotate-token demo`` as a user runs it: with their kubeconfig (here the admin's)."""
    return weightsync_cli(admin, "rotate-token", "demo", "-n", NS, *args)


def weightsync_cli(admin: Kube, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``weightsync`` CLI as a user runs it: with their kubeconfig (here the admin's)."""
    return subprocess.run(
        [sys.executable, "-m", "weightsync_tools.cli.main", *args],
        env={**os.environ, "KUBECONFIG": str(admin.kubeconfig)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def secret_tokens(admin: Kube) -> tuple[str | None, str | None]:
    data = admin.json("-n", NS, "get", "secret", names.group_secret("demo")).get("data") or {}
    decode = lambda key: base64.b64decode(data[key]).decode() if key in data else None  # noqa: E731
    return decode(names.SECRET_TOKEN_KEY), decode(names.SECRET_PREVIOUS_KEY)


def answer(url: str, token: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_rotating_the_token_keeps_the_group_and_its_trainers_running(
    admin: Kube, group_ns: str, agents: Agents
) -> None:
    """docs/security.md, "Rotating the token": rotate-token, a round (engines still on the old admin key), a
    rolling restart of the engine pods only, --finish, a round; trainer pods and their agents never restart."""
    # Last in the group's life but its deletion: the credential's earlier checks compare against the first token.
    trainers = {n: p["metadata"]["uid"] for n, p in pods(admin, "demo").items() if "-trainer-" in n}
    engines = sorted(n for n in pods(admin, "demo") if "-engine-" in n)
    assert engines and len(trainers) == 2
    pids = {n: agents.processes[n].pid for n in trainers}
    committed = int(status(admin, "demo")["lastSync"]["version"])
    old, previous = secret_tokens(admin)
    assert old and previous is None

    started = rotate_token(admin)
    assert started.returncode == 0, started.stderr
    new, previous = secret_tokens(admin)
    assert previous == old and new and new != old
    again = rotate_token(admin)  # a second rotation inside the window would lock out engines still on `old`
    assert again.returncode == 1 and "already holds a previous token" in again.stderr, again.stderr
    early = rotate_token(admin, "--finish")  # both engine pods started before the rotation
    assert early.returncode == 1, early.stderr
    assert all(pod in early.stderr for pod in engines), early.stderr
    assert secret_tokens(admin) == (new, old)

    agents.sync_credentials()  # the kubelets refresh the agents' Secret volumes
    during = committed + 1
    outcomes = publish_everywhere(agents, during, seed=6)
    assert all(o is not None and o.ok for o in outcomes), [o and o.summary() for o in outcomes]
    for pod in engines:
        wait_for(f"{pod} to report v{during}", lambda pod=pod: engine_annotation(admin, pod) == str(during))
    assert "accepted the previous one" in agents.log("demo-trainer-0")  # the engines' old key, through the window

    # The rolling restart: one engine pod at a time; the coordinator catches each up to the committed version.
    for pod in engines:
        old_uid = pods(admin, "demo")[pod]["metadata"]["uid"]
        admin.kubectl("-n", NS, "delete", "pod", pod, "--wait=true")
        recreated = wait_for(
            f"{pod} to come back",
            lambda pod=pod, old_uid=old_uid: (
                (p := pods(admin, "demo").get(pod)) and p["metadata"]["uid"] != old_uid and p
            ),
        )
        agents.start(recreated)  # its engine starts with the Secret's current token
        wait_for(
            f"{pod} caught up to v{during}", lambda pod=pod: engine_annotation(admin, pod) == str(during), timeout=90
        )

    finished = rotate_token(admin, "--finish")
    assert finished.returncode == 0, finished.stderr
    assert secret_tokens(admin) == (new, None)
    agents.sync_credentials()
    time.sleep(3)  # the agents re-read their files on their next tick (1 s here)
    for name in agents.processes:  # every running agent (the scaled-down pods' are gone)
        env = agents.envs[name]
        state = f"http://127.0.0.1:{env[names.ENV_AGENT_PORT]}/v1/state"
        assert answer(state, old) == 401 and answer(state, new) == 200, name
        if names.ENV_ENGINE_URL in env:
            assert answer(env[names.ENV_ENGINE_URL] + "/weightsync/status", old) == 401, name
    after = during + 1
    outcomes = publish_everywhere(agents, after, seed=7)
    assert all(o is not None and o.ok for o in outcomes), [o and o.summary() for o in outcomes]
    wait_for(f"status.lastSync for v{after}", lambda: status(admin, "demo").get("lastSync", {}).get("version") == after)
    # The trainers never restarted: same pods, same agent processes.
    assert {n: p["metadata"]["uid"] for n, p in pods(admin, "demo").items() if "-trainer-" in n} == trainers
    assert {n: agents.processes[n].pid for n in trainers} == pids
    assert all(agents.processes[n].poll() is None for n in trainers)


def test_deleting_the_group_removes_everything_it_owned(admin: Kube, group_ns: str, agents: Agents) -> None:
    admin.kubectl("-n", NS, "delete", "wsg", "demo")
    agents.stop_all()

    def gone() -> bool:
        left = admin.kubectl(
            "-n",
            NS,
            "get",
            "pods,services,configmaps,secrets,serviceaccounts,roles,rolebindings,networkpolicies",
            "-l",
            f"{names.LABEL_GROUP}=demo",
            "-o",
            "name",
        ).stdout.split()
        named = admin.kubectl(
            "-n",
            NS,
            "get",
            "configmap/demo-plan",
            "secret/demo-credentials",
            f"networkpolicy/{names.network_policy('demo')}",
            "service/demo",
            "sa/demo-agent",
            "role/demo-agent",
            "rolebinding/demo-agent",
            check=False,
        )
        return not left and named.returncode != 0 and named.stdout.strip() == ""

    wait_for("garbage collection of the group's objects", gone, timeout=120)


def test_operator_logged_no_errors(operator: OperatorProcess) -> None:
    """Everything above ran without the operator logging a single error (RBAC denials would show here).

    No filter: a cold start once showed kopf's ERROR-level retries of ``429 storage is (re)initializing`` (the API
    server's watch cache of the just-installed CRD still filling); the operator now waits that out before kopf
    starts watching (``weightsync_operator.kube.wait_until_served``), so it must not appear."""
    errors = [line for line in operator.output().splitlines() if "[ERROR" in line]
    assert errors == []
