"""The group's NetworkPolicy builder: what it admits, for any spec.

The property tests evaluate the built policy the way a NetworkPolicy engine would (a connection to a group pod
is allowed if some ingress rule has a peer matching the client and a port entry matching the port) and compare
it with what docs/security.md promises, for every kind of client and every interesting port.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kubernetes_validate
import pytest
from builders import GroupBuilder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.api import names
from weightsync.api.load import SpecError, parse_group
from weightsync.api.v1alpha1 import EPHEMERAL_PORTS, MAX_PORT_RANGE
from weightsync.plan import plan_for
from weightsync_operator.builders import build_mesh_policies, build_network_policy, desired_state
from weightsync_operator.builders.pods import build_engine_pod, build_trainer_pod

# --- An evaluator of NetworkPolicy ingress, for the clients these tests care about ---------------


@dataclass(frozen=True)
class Client:
    """Who opens the connection: a pod (with labels, in a namespace with labels) or an address outside pods."""

    pod_labels: dict[str, str] | None
    namespace: str = "ns"
    namespace_labels: dict[str, str] | None = None
    ip: str = "10.0.0.1"


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    # The builder emits only matchLabels and Exists/In expressions in these tests; enough for them.
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for req in selector.get("matchExpressions") or []:
        value = labels.get(req["key"])
        if req["operator"] == "Exists" and value is None:
            return False
        if req["operator"] == "In" and value not in req.get("values", []):
            return False
    return True


def _peer_matches(peer: dict[str, Any], client: Client, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return client.pod_labels is None and peer["ipBlock"]["cidr"] == "0.0.0.0/0"
    if client.pod_labels is None:
        return False
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], client.namespace_labels or {}):
            return False
    elif client.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], client.pod_labels)


def admits(policy: dict[str, Any], client: Client, port: int) -> bool:
    namespace = policy["metadata"]["namespace"]
    for rule in policy["spec"]["ingress"]:
        if not any(_peer_matches(p, client, namespace) for p in rule.get("from", [])):
            continue
        ports = rule.get("ports")
        if ports is None:
            return True
        for entry in ports:
            assert entry["protocol"] == "TCP"
            if entry["port"] <= port <= entry.get("endPort", entry["port"]):
                return True
    return False


GROUP_POD = Client({names.LABEL_GROUP: "g", names.LABEL_ROLE: "trainer"})
OTHER_GROUP_POD = Client({names.LABEL_GROUP: "other"})
SAME_NAMESPACE_POD = Client({"app": "router"})
MONITORING_POD = Client({"app": "prometheus"}, namespace="monitoring", namespace_labels={"team": "monitoring"})
OTHER_NAMESPACE_POD = Client({"app": "router"}, namespace="elsewhere", namespace_labels={})
OUTSIDE = Client(None)
CLIENTS = [GROUP_POD, OTHER_GROUP_POD, SAME_NAMESPACE_POD, MONITORING_POD, OTHER_NAMESPACE_POD, OUTSIDE]


def _group(builder: GroupBuilder) -> Any:
    return builder.model()


def _ns(builder: GroupBuilder) -> GroupBuilder:
    builder._meta["namespace"] = "ns"
    return builder


# --- Examples --------------------------------------------------------------------------------------


def test_the_default_policy_fences_the_group() -> None:
    group = _group(_ns(GroupBuilder("g")))
    policy = build_network_policy(group)
    assert policy is not None
    assert policy["metadata"]["name"] == names.network_policy("g") == "g-ingress"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == group.metadata.uid
    assert policy["metadata"]["ownerReferences"][0]["controller"] is True
    assert policy["spec"]["podSelector"] == {"matchLabels": {names.LABEL_GROUP: "g"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    # The group's pods: agent, engine and the whole Mooncake range (default: Mooncake's own 15000-17000).
    assert policy["spec"]["ingress"][0] == {
        "from": [{"podSelector": {"matchLabels": {names.LABEL_GROUP: "g"}}}],
        "ports": [
            {"protocol": "TCP", "port": 9470},
            {"protocol": "TCP", "port": 30000},
            {"protocol": "TCP", "port": 15000, "endPort": 17000},
        ],
    }
    # Serving clients of the namespace reach the engine port, and only that; nobody else reaches anything.
    assert policy["spec"]["ingress"][1:] == [
        {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 30000}]}
    ]
    kubernetes_validate.validate(policy, "1.37.0", strict=True)


def test_broadcast_opens_every_port_to_the_group_only() -> None:
    """torch.distributed's gloo/NCCL sockets listen on ephemeral ports: the group's pods get every port."""
    policy = build_network_policy(_group(_ns(GroupBuilder("g").set("transfer.mode", "broadcast"))))
    assert policy is not None
    assert policy["spec"]["ingress"][0] == {"from": [{"podSelector": {"matchLabels": {names.LABEL_GROUP: "g"}}}]}
    for port in (1024, 29500, 40000, 60999, 65535):
        assert admits(policy, GROUP_POD, port)
        assert not admits(policy, OTHER_GROUP_POD, port)
        assert not admits(policy, OUTSIDE, port)
    kubernetes_validate.validate(policy, "1.37.0", strict=True)


def test_opted_out_groups_get_no_policy() -> None:
    builder = GroupBuilder("g").set("networkPolicy.enabled", False)
    assert build_network_policy(_group(builder)) is None
    group = _group(builder)
    state = desired_state(group, plan_for(group.spec, group="g", namespace="default"))
    assert state.network_policy is None
    assert not any(o["kind"] == "NetworkPolicy" for o in state.objects())


def test_the_policy_is_applied_before_any_pod() -> None:
    group = _group(GroupBuilder("g"))
    state = desired_state(group, plan_for(group.spec, group="g", namespace="default"))
    kinds = [o["kind"] for o in state.objects()]
    assert kinds.index("NetworkPolicy") < kinds.index("Pod")


def test_peers_are_emitted_as_the_api_server_stores_them() -> None:
    """No empty lists or maps: the reconciler compares with what it reads back and would patch forever."""
    builder = GroupBuilder("g").set(
        "networkPolicy",
        {
            "agentPeers": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}, "podSelector": {}}],
            "enginePeers": [
                {"podSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}},
                {"ipBlock": {"cidr": "10.0.0.0/8"}},
            ],
        },
    )
    policy = build_network_policy(_group(builder))
    assert policy is not None
    assert policy["spec"]["ingress"][1]["from"] == [
        {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}, "podSelector": {}}
    ]
    assert policy["spec"]["ingress"][2]["from"] == [
        {"podSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}},
        {"ipBlock": {"cidr": "10.0.0.0/8"}},
    ]


def test_the_engine_container_gets_the_mooncake_range_and_the_trainer_does_not() -> None:
    group = _group(GroupBuilder("g").set("transfer.mooncakePorts", {"start": 20000, "end": 20099}))
    engine_env = build_engine_pod(group, 0, 0)["spec"]["containers"][0]["env"]
    assert {"name": "MC_MIN_RPC_PORT", "value": "20000"} in engine_env
    assert {"name": "MC_MAX_RPC_PORT", "value": "20099"} in engine_env
    trainer = build_trainer_pod(group, 0)["spec"]["containers"][0]
    assert not any(e["name"].startswith("MC_") for e in trainer.get("env") or [])


@pytest.mark.parametrize(
    ("ports", "words"),
    [
        ({"start": 20010, "end": 20000}, "start must not be greater than end"),
        ({"start": 1023, "end": 2000}, "greater than or equal to 1024"),
        ({"start": 20000, "end": 65536}, "less than or equal to 65535"),
        ({"start": 10000, "end": 10000 + MAX_PORT_RANGE}, f"at most {MAX_PORT_RANGE} ports"),
        ({"start": 30000, "end": 33000}, "outside 32768-60999"),
        ({"start": 61000 - 100, "end": 61100}, "outside 32768-60999"),
    ],
)
def test_bad_mooncake_ranges_are_refused_with_a_reason(ports: dict[str, int], words: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_group(GroupBuilder("g").set("transfer.mooncakePorts", ports).build())
    assert words in str(caught.value)


@pytest.mark.parametrize(
    ("peer", "words"),
    [
        ({}, "every entry of enginePeers needs podSelector, namespaceSelector or ipBlock"),
        ({"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}, "ipBlock cannot be combined"),
        ({"ipBlock": {"cidr": "not a cidr"}}, "should match pattern"),
        ({"podSelector": {"matchLabels": {"k": "v" * 64}}}, "at most 63 characters"),
    ],
)
def test_bad_peers_are_refused_with_a_reason(peer: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_group(GroupBuilder("g").set("networkPolicy.enginePeers", [peer]).build())
    assert words in str(caught.value)


# --- Properties --------------------------------------------------------------------------------------

_outside_ephemeral = st.one_of(st.integers(1024, EPHEMERAL_PORTS[0] - 1), st.integers(EPHEMERAL_PORTS[1] + 1, 65535))


@st.composite
def mooncake_ranges(draw: st.DrawFn) -> tuple[int, int]:
    start = draw(_outside_ephemeral)
    limit = EPHEMERAL_PORTS[0] - 1 if start < EPHEMERAL_PORTS[0] else 65535
    end = draw(st.integers(start, min(limit, start + MAX_PORT_RANGE - 1)))
    return start, end


PEER_CHOICES = {
    "namespace": {"podSelector": {}},
    "monitoring": {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}},
    "cluster": {"namespaceSelector": {}},
    "anywhere": {"ipBlock": {"cidr": "0.0.0.0/0"}},
}


def _expected_peer(client: Client, chosen: list[str]) -> bool:
    """Does one of the named peers admit ``client``? (Written from the peers' meaning, not from the policy.)"""
    for name in chosen:
        if name == "namespace" and client.pod_labels is not None and client.namespace == "ns":
            return True
        if name == "monitoring" and (client.namespace_labels or {}).get("team") == "monitoring":
            return True
        if name == "cluster" and client.pod_labels is not None:
            return True
        if name == "anywhere" and client.pod_labels is None:
            return True
    return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["p2p", "broadcast"]),
    agent_port=st.integers(1, 65535),
    engine_port=st.integers(1, 65535),
    mooncake=mooncake_ranges(),
    agent_peers=st.lists(st.sampled_from(sorted(PEER_CHOICES)), max_size=3, unique=True),
    engine_peers=st.none() | st.lists(st.sampled_from(sorted(PEER_CHOICES)), max_size=3, unique=True),
    probe=st.integers(1, 65535),
)
def test_the_policy_admits_exactly_what_the_docs_promise(
    mode: str,
    agent_port: int,
    engine_port: int,
    mooncake: tuple[int, int],
    agent_peers: list[str],
    engine_peers: list[str] | None,
    probe: int,
) -> None:
    builder = (
        _ns(GroupBuilder("g"))
        .agent(port=agent_port)
        .set("inference.port", engine_port)
        .set("transfer.mode", mode)
        .set("transfer.mooncakePorts", {"start": mooncake[0], "end": mooncake[1]})
        .set("networkPolicy.agentPeers", [PEER_CHOICES[p] for p in agent_peers])
    )
    if engine_peers is not None:
        builder = builder.set("networkPolicy.enginePeers", [PEER_CHOICES[p] for p in engine_peers])
    engine_peers_meant = ["namespace"] if engine_peers is None else engine_peers  # the documented default
    group = _group(builder)
    policy = build_network_policy(group)
    assert policy is not None
    assert policy["spec"]["podSelector"] == {"matchLabels": {names.LABEL_GROUP: "g"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]

    ports = {agent_port, engine_port, mooncake[0], mooncake[1], probe}
    for client in CLIENTS:
        for port in ports:
            in_group = client is GROUP_POD
            group_may = in_group and (mode == "broadcast" or port in (agent_port, engine_port)
                                      or mooncake[0] <= port <= mooncake[1])  # fmt: skip
            agent_may = port == agent_port and _expected_peer(client, agent_peers)
            engine_may = port == engine_port and _expected_peer(client, engine_peers_meant)
            assert admits(policy, client, port) == (group_may or agent_may or engine_may), (client, port)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["p2p", "broadcast"]),
    mooncake=mooncake_ranges(),
    agent_peers=st.lists(st.sampled_from(sorted(PEER_CHOICES)), max_size=4, unique=True),
    engine_peers=st.lists(st.sampled_from(sorted(PEER_CHOICES)), max_size=4, unique=True),
)
def test_every_policy_is_valid_kubernetes_and_its_spec_is_valid_for_the_api(
    mode: str, mooncake: tuple[int, int], agent_peers: list[str], engine_peers: list[str]
) -> None:
    built = (
        GroupBuilder("g")
        .set("transfer.mode", mode)
        .set("transfer.mooncakePorts", {"start": mooncake[0], "end": mooncake[1]})
        .set("networkPolicy.agentPeers", [PEER_CHOICES[p] for p in agent_peers])
        .set("networkPolicy.enginePeers", [PEER_CHOICES[p] for p in engine_peers])
        .build()
    )
    group = parse_group(built)  # the schema and the CRD's CEL accept every generated spec
    policy = build_network_policy(group)
    assert policy is not None
    kubernetes_validate.validate(policy, "1.37.0", strict=True)


# --- Multi-pod jobs: the mesh policies -------------------------------------------------------------


def admitted(policies: list[dict[str, Any]], destination: dict[str, str], client: Client, port: int) -> bool:
    """NetworkPolicy semantics over several policies: a pod some policy selects takes a connection that one of the
    policies selecting it admits."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], destination)]
    assert selecting, destination  # the fence selects every pod of the group
    return any(admits(p, client, port) for p in selecting)


TRAINER = {names.LABEL_GROUP: "g", names.LABEL_ROLE: "trainer"}
ENGINE = {names.LABEL_GROUP: "g", names.LABEL_ROLE: "engine", names.LABEL_ENGINE: "0"}
OTHER_ENGINE = {**ENGINE, names.LABEL_ENGINE: "1"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["p2p", "broadcast"]),
    trainers=st.integers(1, 3),
    pods_per_engine=st.sampled_from([1, 2, 4]),
    enabled=st.booleans(),
    probe=st.integers(1, 65535),
)
def test_a_multi_pod_job_reaches_its_own_pods_on_every_port_and_no_other_role(
    mode: str, trainers: int, pods_per_engine: int, enabled: bool, probe: int
) -> None:
    group = _group(
        _ns(GroupBuilder("g"))
        .set("transfer.mode", mode)
        .set("trainer.replicas", trainers)
        .set("inference.engines", 2)
        .set("inference.ranksPerPod", 1)
        .set("inference.ranksPerEngine", pods_per_engine)
        .set("networkPolicy.enabled", enabled)
    )
    desired = desired_state(group, plan_for(group.spec, group="g", namespace="ns"))
    meshes = build_mesh_policies(group)
    assert dict(desired.mesh_policies) == meshes
    if not enabled:
        assert meshes == {} and desired.network_policy is None
        return
    assert desired.network_policy is not None
    policies = [desired.network_policy, *meshes.values()]
    assert [p["metadata"]["name"] for p in meshes.values()] == [
        names.mesh_policy("g", role) for role in ("trainer", "engine") if role in meshes
    ]
    fenced = {group.spec.agent.port, group.spec.inference.port} | set(
        range(group.spec.transfer.mooncake_ports.start, group.spec.transfer.mooncake_ports.end + 1)
    )
    p2p_port = probe in fenced
    # Written from the docs' promise: the fence's ports between any of the group's pods (every port in broadcast),
    # plus every port between a multi-pod trainer's pods and between multi-pod engines' pods (p2p).
    trainer_mesh = mode == "p2p" and trainers > 1
    engine_mesh = mode == "p2p" and pods_per_engine > 1
    for source, destination, mesh in [
        (TRAINER, TRAINER, trainer_mesh),
        (ENGINE, ENGINE, engine_mesh),
        (OTHER_ENGINE, ENGINE, engine_mesh),
        (TRAINER, ENGINE, False),
        (ENGINE, TRAINER, False),
    ]:
        want = mode == "broadcast" or p2p_port or mesh
        assert admitted(policies, destination, Client(source), probe) == want, (source, destination, probe)
    assert not admitted(policies, ENGINE, OTHER_GROUP_POD, probe) or probe == group.spec.inference.port
    for policy in meshes.values():
        kubernetes_validate.validate(policy, "1.37.0", strict=True)
