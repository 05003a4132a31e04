"""Workload identity: the ``WEIGHTSYNC_*`` variables every user container gets (builders/identity.py,
docs/workload-identity.md), and the stable DNS name its leader is reached by."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from builders import DEFAULT_AGENT_IMAGE, GroupBuilder, container, template
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.api import names
from weightsync.api.load import load_groups
from weightsync.api.v1alpha1 import AGENT_CONTAINER
from weightsync.plan import plan_for
from weightsync_agent.config import AgentConfig
from weightsync_operator.builders import BuildOptions, build_engine_pod, build_service, build_trainer_pod, desired_state

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
#: Every name the operator sets in a user container, in the order it sets them (the engine index only on engines).
IDENTITY = (
    names.ENV_GROUP,
    names.ENV_NAMESPACE,
    names.ENV_ROLE,
    names.ENV_POD_INDEX,
    names.ENV_ENGINE_INDEX,
    names.ENV_RANKS,
    names.ENV_AGENT_PORT,
    names.ENV_NNODES,
    names.ENV_NODE_RANK,
    names.ENV_NPROC_PER_NODE,
    names.ENV_WORLD_SIZE,
    names.ENV_LEADER_ADDR,
    names.ENV_LEADER_PORT,
    names.ENV_DIST_INIT_ADDR,
)


def identity_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env") or [] if e["name"] in IDENTITY}


def user_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    return [*(c for c in spec.get("initContainers") or [] if c["name"] != AGENT_CONTAINER), *spec["containers"]]


def test_a_trainer_pod_is_told_its_place_in_its_trainer() -> None:
    group = GroupBuilder("g", namespace="rl").trainers(3, ranks_per_pod=4).agent(port=9500).model()
    env = build_trainer_pod(group, 2)["spec"]["containers"][0]["env"]
    leader = "g-trainer-0.g.rl.svc"
    assert env == [
        {"name": "WEIGHTSYNC_GROUP", "value": "g"},
        {"name": "WEIGHTSYNC_NAMESPACE", "value": "rl"},
        {"name": "WEIGHTSYNC_ROLE", "value": "trainer"},
        {"name": "WEIGHTSYNC_POD_INDEX", "value": "2"},
        {"name": "WEIGHTSYNC_RANKS", "value": "8,9,10,11"},
        {"name": "WEIGHTSYNC_AGENT_PORT", "value": "9500"},
        {"name": "WEIGHTSYNC_NNODES", "value": "3"},
        {"name": "WEIGHTSYNC_NODE_RANK", "value": "2"},
        {"name": "WEIGHTSYNC_NPROC_PER_NODE", "value": "4"},
        {"name": "WEIGHTSYNC_WORLD_SIZE", "value": "12"},
        {"name": "WEIGHTSYNC_LEADER_ADDR", "value": leader},
        {"name": "WEIGHTSYNC_LEADER_PORT", "value": "29500"},
        {"name": "WEIGHTSYNC_DIST_INIT_ADDR", "value": f"{leader}:29500"},
    ]


def test_an_engine_pod_is_told_its_place_in_its_engine_after_its_token_and_mooncake_range() -> None:
    user = container("engine", env=[{"name": "MASTER_ADDR", "value": "$(WEIGHTSYNC_LEADER_ADDR)"}])
    group = GroupBuilder("g").engines(3, tp=8, ranks_per_pod=4).engine_template(template(user)).model()
    env = build_engine_pod(group, 2, 1)["spec"]["containers"][0]["env"]
    assert [e["name"] for e in env[:3]] == [names.ENV_GROUP_TOKEN, names.ENV_MOONCAKE_MIN_PORT,
                                           names.ENV_MOONCAKE_MAX_PORT]  # fmt: skip
    # Before the user's own variables: a value may use $(VAR) only of variables defined before it.
    assert env[-1] == user["env"][0]
    assert [e["name"] for e in env[3:-1]] == list(IDENTITY)
    assert identity_of({"env": env}) == {
        names.ENV_GROUP: "g",
        names.ENV_NAMESPACE: "default",
        names.ENV_ROLE: "engine",
        names.ENV_POD_INDEX: "1",
        names.ENV_ENGINE_INDEX: "2",
        names.ENV_RANKS: "4,5,6,7",
        names.ENV_AGENT_PORT: "9470",
        names.ENV_NNODES: "2",
        names.ENV_NODE_RANK: "1",
        names.ENV_NPROC_PER_NODE: "4",
        names.ENV_WORLD_SIZE: "8",
        names.ENV_LEADER_ADDR: "g-engine-2-0.g.default.svc",
        names.ENV_LEADER_PORT: "29500",
        names.ENV_DIST_INIT_ADDR: "g-engine-2-0.g.default.svc:29500",
    }


@pytest.mark.parametrize("role", ["trainer", "engine"])
def test_every_user_container_gets_it_and_the_agent_keeps_its_own(role: str) -> None:
    tpl = template(container("main"), container("helper"), initContainers=[container("fetch")])
    group = GroupBuilder("g").trainer_template(tpl).engine_template(tpl).engines(1, tp=2, ranks_per_pod=1).model()
    pod = build_trainer_pod(group, 0) if role == "trainer" else build_engine_pod(group, 0, 1)
    first = identity_of(pod["spec"]["containers"][0])
    assert [c["name"] for c in user_containers(pod)] == ["fetch", "main", "helper"]
    assert all(identity_of(c) == first for c in user_containers(pod))
    agent = next(c for c in pod["spec"]["initContainers"] if c["name"] == AGENT_CONTAINER)
    assert names.ENV_NODE_RANK not in {e["name"] for e in agent["env"]}  # the agent's env is its own, as before
    shared = (names.ENV_GROUP, names.ENV_NAMESPACE, names.ENV_ROLE, names.ENV_POD_INDEX, names.ENV_RANKS)
    assert {k: first[k] for k in shared} == {e["name"]: e["value"] for e in agent["env"] if e["name"] in shared}


def test_the_operators_values_win_over_a_templates_of_the_same_name() -> None:
    """A template is shared by every pod of its role, so a value it gives one of these names is wrong on all but
    (at most) one pod: ours replace it, exactly once each, and the user's other variables stay, after ours."""
    spoof = [
        {"name": names.ENV_NODE_RANK, "value": "0"},
        {"name": names.ENV_LEADER_ADDR, "value": "attacker.example.com"},
        {"name": names.ENV_ROLE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": names.ENV_SOURCE_RANK, "value": "3"},  # the user's to set: not ours
        {"name": "RDZV", "value": "$(WEIGHTSYNC_DIST_INIT_ADDR)"},
    ]
    tpl = template(container("trainer", env=spoof), initContainers=[container("fetch", env=spoof)])
    group = GroupBuilder("g").trainers(2, ranks_per_pod=4).trainer_template(tpl).model()
    pod = build_trainer_pod(group, 1)
    for c in user_containers(pod):
        env = c["env"]
        listed = [e["name"] for e in env]
        assert len(listed) == len(set(listed)), c["name"]
        assert identity_of(c)[names.ENV_NODE_RANK] == "1"
        assert identity_of(c)[names.ENV_LEADER_ADDR] == "g-trainer-0.g.default.svc"
        assert identity_of(c)[names.ENV_ROLE] == "trainer"
        assert env[-2:] == spoof[-2:]


layouts = st.tuples(
    st.integers(1, 6),  # trainer replicas
    st.integers(1, 8),  # trainer ranks per pod
    st.integers(1, 4),  # engines
    st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (8, 2), (8, 8), (16, 4)]),  # ranks per engine, per pod
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts, st.sampled_from(["default", "rl-team"]))
def test_any_layout_gives_every_job_unique_node_ranks_and_one_leader_its_pods_can_resolve(
    layout: tuple[int, int, int, tuple[int, int]], namespace: str
) -> None:
    replicas, trainer_rpp, engines, (rpe, engine_rpp) = layout
    builder = (
        GroupBuilder("g", namespace=namespace)
        .trainers(replicas, ranks_per_pod=trainer_rpp)
        .engines(engines, tp=rpe, ranks_per_pod=engine_rpp)
    )
    group = builder.model()
    state = desired_state(group, plan_for(group.spec, group="g", namespace=namespace))
    service = build_service(group)
    jobs: dict[str, list[tuple[dict[str, Any], dict[str, str]]]] = defaultdict(list)
    for pod in state.pods:
        env = identity_of(pod["spec"]["containers"][0])
        job = env[names.ENV_ROLE] + env.get(names.ENV_ENGINE_INDEX, "")
        jobs[job].append((pod, env))
    assert len(jobs) == 1 + engines
    for job, members in jobs.items():
        sizes = {
            (env[names.ENV_NNODES], env[names.ENV_NPROC_PER_NODE], env[names.ENV_WORLD_SIZE]) for _, env in members
        }
        ((nnodes, nproc, world),) = sizes  # one job size, agreed by all its pods
        expected = (replicas, trainer_rpp) if job == "trainer" else (rpe // engine_rpp, engine_rpp)
        assert (int(nnodes), int(nproc)) == expected and int(world) == int(nnodes) * int(nproc)
        # Node ranks: each of 0..NNODES-1 exactly once, and the pod's index in its trainer or engine.
        assert sorted(int(env[names.ENV_NODE_RANK]) for _, env in members) == list(range(int(nnodes)))
        assert all(env[names.ENV_NODE_RANK] == env[names.ENV_POD_INDEX] for _, env in members)
        # Its ranks: NPROC_PER_NODE of them, the node's slice of the job's.
        ranks = sorted(int(r) for _, env in members for r in env[names.ENV_RANKS].split(","))
        assert ranks == list(range(int(world)))
        # One leader: node rank 0's pod, named as the headless Service resolves it (hostname.subdomain.ns.svc).
        ((leader_pod, _),) = [(p, env) for p, env in members if env[names.ENV_NODE_RANK] == "0"]
        spec = leader_pod["spec"]
        resolvable = f"{spec['hostname']}.{spec['subdomain']}.{namespace}.svc"
        assert spec["subdomain"] == service["metadata"]["name"]
        assert service["spec"]["selector"].items() <= leader_pod["metadata"]["labels"].items()
        assert {env[names.ENV_LEADER_ADDR] for _, env in members} == {resolvable}
        assert {env[names.ENV_DIST_INIT_ADDR] for _, env in members} == {f"{resolvable}:{names.RENDEZVOUS_PORT}"}
        assert {env[names.ENV_LEADER_PORT] for _, env in members} == {str(names.RENDEZVOUS_PORT)}
    # Followers start before their leader is Ready (its readiness waits for the engine): its name must resolve then.
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True


def test_a_trainer_containers_identity_is_what_the_weight_sync_client_reads() -> None:
    """``WeightSyncClient.from_env`` runs in the trainer's container, not the agent's: it needs the same group,
    role, pod index, ranks and agent port the sidecar got."""
    group = GroupBuilder("g").trainers(3, ranks_per_pod=2).agent(port=9555).model()
    env = identity_of(build_trainer_pod(group, 1)["spec"]["containers"][0])
    config = AgentConfig.from_env(env)
    assert (config.group, config.role, config.pod_index, config.ranks, config.agent_port) == (
        "g", "trainer", 1, (2, 3), 9555
    )  # fmt: skip


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_examples_use_only_variables_their_containers_get(path: Path) -> None:
    """``$(VAR)`` of an undefined variable stays as it is, silently: a misspelt name would reach the launcher."""
    (group,) = load_groups(path)
    options = BuildOptions(agent_image=DEFAULT_AGENT_IMAGE)
    for pod in (build_trainer_pod(group, 0, options), build_engine_pod(group, 0, 0, options)):
        for c in user_containers(pod):
            defined = {e["name"] for e in c.get("env") or []}
            text = " ".join([*(c.get("command") or []), *(c.get("args") or []),
                             *(str(e.get("value", "")) for e in c.get("env") or [])])  # fmt: skip
            used = set(re.findall(r"\$\((WEIGHTSYNC_[A-Z_]+)\)", text))
            assert used <= defined, (path.name, c["name"], used - defined)
