"""Kubernetes faults on the real local cluster (issue 11, item 5): rounds go on without the API server.

Rounds never go through the Kubernetes API: agents talk to agents and engines directly. What touches the API is
reporting (pod annotations, the readiness condition) and the directory (peers' advertised URLs). So with the API
server hung (SIGSTOP: it accepts connections and never answers) or gone (stopped: connections refused), rounds must
still complete within their budget, each with a recorded result that reaches the group's status once the API server
is back, and a later round must not wait for the outage. The operator restarted in the middle of rounds changes
nothing either. Each check also asserts the invariant: no engine reports a version it does not fully hold.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from conftest import Agents, Kube, OperatorProcess, load_example, wait_for

from weightsync.api import names
from weightsync_testing.reference_engine.model import full_state
from weightsync_tools.localcluster.cluster import ClusterState, LocalCluster
from weightsync_tools.localcluster.session import PodCredentials, group_pods, secret_reader

NS = "faults"
GROUP = "chaos"
TRAINERS = [f"{GROUP}-trainer-{i}" for i in range(2)]
ENGINES = [f"{GROUP}-engine-{e}-0" for e in range(2)]
#: The group's round budget (spec.transfer.timeoutSeconds): every round ends within it, outage or not.
BUDGET = 60
#: How long the API server stays away; the issue names 60 s.
OUTAGE = 60.0


def status(admin: Kube) -> dict[str, Any]:
    return admin.json("-n", NS, "get", "wsg", GROUP).get("status") or {}


def engine_versions(agents: Agents) -> dict[str, str | None]:
    """What each engine itself says it serves, asked directly (not through the API server)."""
    return {pod: agents.engines[pod].client().weight_version() for pod in ENGINES}


def everywhere(version: int) -> dict[str, str | None]:
    return dict.fromkeys(ENGINES, str(version))


@pytest.fixture(scope="module")
def agents(
    control_plane: tuple[LocalCluster, ClusterState, Kube],
    operator: OperatorProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Agents]:
    _, state, admin = control_plane
    admin.kubectl("create", "namespace", NS)
    group = load_example("tcp-group.yaml", NS, transfer__timeoutSeconds=BUDGET)
    group["metadata"]["name"] = GROUP
    admin.kubectl("apply", "-f", "-", input=yaml.safe_dump(group))
    wait_for("the group's pods", lambda: set(group_pods(admin, NS, GROUP)) == {*TRAINERS, *ENGINES})
    agent_sa = names.agent_service_account(GROUP)
    wait_for(
        "the agents' ServiceAccount",
        lambda: admin.kubectl("-n", NS, "get", "sa", agent_sa, check=False).returncode == 0,
    )
    directory = tmp_path_factory.mktemp("fault-agents")
    running = Agents(PodCredentials(state, admin, directory / "kubeconfigs"), directory, secrets=secret_reader(admin))
    try:
        for pod in group_pods(admin, NS, GROUP).values():
            running.start(pod)
        wait_for("the group to be Ready", lambda: status(admin).get("phase") == "Ready", timeout=90)
        yield running
    finally:
        running.stop_all()
        admin.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def ready_again(admin: Kube, timeout: float = 90, cluster: tuple[LocalCluster, ClusterState] | None = None) -> None:
    """The group back to Ready; on timeout, what each pod's gate says (the fold's inputs)."""
    try:
        wait_for("the group to be Ready again", lambda: status(admin).get("phase") == "Ready", timeout=timeout)
    except AssertionError as exc:
        gates = {
            name: (pod.get("status", {}).get("phase"), pod.get("status", {}).get("conditions", []))
            for name, pod in group_pods(admin, NS, GROUP).items()
        }
        dead = cluster[0].dead(cluster[1]) if cluster else "?"
        raise AssertionError(f"{exc}\nstatus: {status(admin)}\ngates: {gates}\nexited components: {dead}") from None


def publish(agents: Agents, version: int, *, late_rank: float = 0.0) -> tuple[list[Any], float]:
    """Trainer code on both pods stages the weights for ``version`` and publishes; returns outcomes and seconds."""
    full = full_state(seed=version)
    clients = [agents.client(pod, timeout=BUDGET + 30) for pod in TRAINERS]
    outcomes: list[Any] = [None, None]

    def rank(i: int) -> None:
        if i == 1 and late_rank:
            time.sleep(late_rank)
        clients[i].stage_many(full)
        outcomes[i] = clients[i].publish(version, check=False)

    started = time.monotonic()
    try:
        threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(BUDGET + 60)
    finally:
        for client in clients:
            client.close()
    return outcomes, time.monotonic() - started


def assert_round(outcomes: list[Any], seconds: float, version: int, agents: Agents) -> None:
    assert all(o is not None and o.ok for o in outcomes), [o and o.summary() for o in outcomes]
    assert seconds < BUDGET, f"round {version} took {seconds:.1f} s, over its {BUDGET} s budget"
    assert engine_versions(agents) == everywhere(version)


def reported(admin: Kube, version: int) -> dict[str, Any]:
    """The group's status once it shows ``version`` committed, and every engine pod's annotation says so."""

    def shown() -> dict[str, Any] | None:
        current = status(admin)
        if (current.get("lastSync") or {}).get("version") != version:
            return None
        pods = group_pods(admin, NS, GROUP)
        held = [(pods[p]["metadata"].get("annotations") or {}).get(names.ANNOTATION_WEIGHT_VERSION) for p in ENGINES]
        return current if held == [str(version)] * len(ENGINES) else None

    return wait_for(f"status and pods to report version {version}", shown, timeout=60)


def test_rounds_complete_while_the_api_server_hangs(
    control_plane: tuple[LocalCluster, ClusterState, Kube], agents: Agents
) -> None:
    local, state, admin = control_plane
    assert_round(*publish(agents, 1), 1, agents)
    reported(admin, 1)
    local.freeze(state, "kube-apiserver")
    try:
        for version in (2, 3):  # the second round must not wait behind the first one's stuck reporting
            assert_round(*publish(agents, version), version, agents)
    finally:
        local.thaw(state, "kube-apiserver")
    last = reported(admin, 3)["lastSync"]
    assert last["result"] == "Succeeded"
    assert last["version"] == 3


def test_rounds_complete_while_the_api_server_is_down(
    control_plane: tuple[LocalCluster, ClusterState, Kube], agents: Agents
) -> None:
    local, state, admin = control_plane
    local.stop_component(state, "kube-apiserver")
    down_since = time.monotonic()
    try:
        for version in (4, 5):
            assert_round(*publish(agents, version), version, agents)
        time.sleep(max(0.0, OUTAGE - (time.monotonic() - down_since)))
    finally:
        local.start_component(state, "kube-apiserver")
    assert reported(admin, 5)["lastSync"]["result"] == "Succeeded"
    assert_round(*publish(agents, 6), 6, agents)
    reported(admin, 6)


def test_an_operator_restart_during_rounds_changes_nothing(
    admin: Kube, operator: OperatorProcess, agents: Agents
) -> None:
    before = {name: pod["metadata"]["uid"] for name, pod in group_pods(admin, NS, GROUP).items()}
    restarter = threading.Thread(target=lambda: (time.sleep(0.2), operator.restart()))
    restarter.start()
    for version in (7, 8):
        assert_round(*publish(agents, version), version, agents)
    restarter.join(60)
    ready_again(admin, 60)
    reported(admin, 8)
    after = {name: pod["metadata"]["uid"] for name, pod in group_pods(admin, NS, GROUP).items()}
    assert after == before  # no pod recreated


def sync_events(admin: Kube, reason: str, containing: str) -> list[dict[str, Any]]:
    events = admin.json("-n", NS, "get", "events", "--field-selector", f"reason={reason}")["items"]
    return [e for e in events if containing in e.get("message", "") and e["involvedObject"]["name"] == GROUP]


def test_a_slow_trainer_rank_keeps_the_engines_serving(agents: Agents) -> None:
    """Rank 1 stages 5 s after rank 0: the engines serve the whole time and pause only for the transfer."""
    outcomes, seconds = publish(agents, 9, late_rank=5.0)
    assert_round(outcomes, seconds, 9, agents)
    for pod in ENGINES:
        info = agents.engines[pod].client().status()
        assert not info["paused"] and info["last_pause_seconds"] < 1.0, info


def restart_pod(admin: Kube, agents: Agents, name: str) -> None:
    """What a node does when a pod is deleted: its containers stop; the operator makes a new pod; its agent starts."""
    old = group_pods(admin, NS, GROUP)[name]["metadata"]["uid"]
    agents.stop(name)
    admin.kubectl("-n", NS, "delete", "pod", name, "--wait=false")
    new = wait_for(
        f"{name} recreated",
        lambda: (pod := group_pods(admin, NS, GROUP).get(name)) and pod["metadata"]["uid"] != old and pod,
        timeout=60,
    )
    agents.start(new)


def test_a_restarted_trainer_pod_rebuilds_its_replica_and_rounds_go_on(
    control_plane: tuple[LocalCluster, ClusterState, Kube], admin: Kube, agents: Agents
) -> None:
    restart_pod(admin, agents, TRAINERS[1])
    ready_again(admin, 90, control_plane[:2])
    assert engine_versions(agents) == everywhere(9)  # nothing moved while it was away
    assert_round(*publish(agents, 10), 10, agents)
    reported(admin, 10)


def test_a_restarted_engine_is_caught_up_and_rounds_go_on(
    control_plane: tuple[LocalCluster, ClusterState, Kube], admin: Kube, agents: Agents
) -> None:
    """Engine 1's pod is recreated: its new engine starts from its initial weights, is caught up to the committed
    version by the coordinator (no publish needed), and the next round reaches both engines."""
    restart_pod(admin, agents, ENGINES[1])
    # Not ready while it serves its initial weights: its pod leaves the Services rollout clients use.
    wait_for("the restarted engine's agent to hold it back", lambda: "engine CatchingUp" in agents.log(ENGINES[1]))
    wait_for("the restarted engine to be caught up", lambda: engine_versions(agents) == everywhere(10),
             timeout=60)  # fmt: skip
    ready_again(admin, 90, control_plane[:2])
    reported(admin, 10)
    assert_round(*publish(agents, 11), 11, agents)
    reported(admin, 11)


def test_a_restarted_coordinator_keeps_the_committed_version(
    control_plane: tuple[LocalCluster, ClusterState, Kube], admin: Kube, agents: Agents
) -> None:
    """Trainer pod 0 runs the coordinator: a new one learns the committed version, and versions never go back."""
    restart_pod(admin, agents, TRAINERS[0])
    ready_again(admin, 90, control_plane[:2])
    outcomes, _ = publish(agents, 4)
    assert not any(o is not None and o.ok for o in outcomes), [o and o.summary() for o in outcomes]
    assert engine_versions(agents) == everywhere(11)
    # The refused round is a Warning Event on the group (`kubectl describe wsg`), naming the cause.
    failed = wait_for("a SyncFailed event for round v4", lambda: sync_events(admin, "SyncFailed", "round v4 "))
    assert "Failed: round not started: version 4 is not newer than committed 11" in failed[0]["message"]
    assert failed[0]["involvedObject"]["kind"] == "WeightSyncGroup" and failed[0]["type"] == "Warning"
    described = admin.kubectl("-n", NS, "describe", "wsg", GROUP).stdout
    assert "SyncFailed" in described and "not newer than committed 11" in described
    assert_round(*publish(agents, 12), 12, agents)
    reported(admin, 12)


def test_a_round_with_an_engine_down_fails_naming_it_in_an_event_and_the_next_round_repairs(
    control_plane: tuple[LocalCluster, ClusterState, Kube], admin: Kube, agents: Agents
) -> None:
    """Engine 1's pod loses its containers (agent and engine stopped): the next round fails naming engine 1, which
    `kubectl describe wsg` shows as a SyncFailed Warning Event; once the pod is recreated the version lands."""
    agents.stop(ENGINES[1])
    outcomes, _ = publish(agents, 13)
    assert not any(o is not None and o.ok for o in outcomes), [o and o.summary() for o in outcomes]
    failed = wait_for("a SyncFailed event for round v13", lambda: sync_events(admin, "SyncFailed", "round v13 "))
    assert "engine 1" in failed[0]["message"], failed[0]["message"]
    assert "SyncFailed" in admin.kubectl("-n", NS, "describe", "wsg", GROUP).stdout
    restart_pod(admin, agents, ENGINES[1])
    wait_for("the recreated engine to serve", lambda: serving(agents, ENGINES[1]), timeout=90)
    # The trainer publishes the version again until the coordinator reaches the new pod (its directory follows
    # the pods' advertised URLs: until then the round does not start, and nothing is written).
    landed = wait_for("version 13 to land", lambda: (r := publish(agents, 13)) and all(o is not None and o.ok
                      for o in r[0]) and r, timeout=120, interval=2)  # fmt: skip
    assert_round(*landed, 13, agents)
    reported(admin, 13)


def serving(agents: Agents, pod: str) -> bool:
    engine = agents.engines.get(pod)
    try:
        return engine is not None and engine.client().weight_version() is not None
    except Exception:  # not up yet
        return False
