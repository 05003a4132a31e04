"""The pure manifest builders: every object a group needs, field by field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from builders import DEFAULT_AGENT_IMAGE, GroupBuilder, container, template
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_workload_identity import IDENTITY

from weightsync.api import names
from weightsync.api.v1alpha1 import AGENT_CONTAINER
from weightsync.plan import Plan, plan_for
from weightsync.plan.seal import seal
from weightsync_operator.builders import (
    BuildError,
    BuildOptions,
    build_engine_pod,
    build_group_secret,
    build_plan_config_map,
    build_role,
    build_role_binding,
    build_service,
    build_service_account,
    build_trainer_pod,
    decide_plan,
    desired_state,
    expected_pod_names,
)
from weightsync_operator.builders.pods import pod_spec_hash


def agent_of(pod: dict[str, Any]) -> dict[str, Any]:
    (agent,) = [c for c in pod["spec"]["initContainers"] if c["name"] == AGENT_CONTAINER]
    return agent


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in agent_of(pod)["env"]}


def workload_env_of(pod: dict[str, Any], container: int = 0) -> dict[str, str]:
    """The ``WEIGHTSYNC_*`` identity a user container got (the token and Mooncake's variables left out)."""
    env = pod["spec"]["containers"][container]["env"]
    return {e["name"]: e["value"] for e in env if e["name"] in IDENTITY_NAMES}


#: Every workload identity variable (tests/operator/test_workload_identity.py checks their values and order).
IDENTITY_NAMES = frozenset(IDENTITY)


def state_for(builder: GroupBuilder, options: BuildOptions | None = None) -> Any:
    group = builder.model()
    return desired_state(group, plan_for(group.spec, group=group.metadata.name, namespace="default"), options)


# --- names and counts --------------------------------------------------------------------------


def test_pod_names_and_order() -> None:
    state = state_for(GroupBuilder("demo").trainers(2).engines(2, tp=4, ranks_per_pod=2))
    assert state.pod_names == (
        "demo-trainer-0",
        "demo-trainer-1",
        "demo-engine-0-0",
        "demo-engine-0-1",
        "demo-engine-1-0",
        "demo-engine-1-1",
    )
    assert state.pod_names == expected_pod_names(
        GroupBuilder("demo").trainers(2).engines(2, tp=4, ranks_per_pod=2).model()
    )


def test_out_of_range_indices_are_refused() -> None:
    group = GroupBuilder().trainers(2).engines(1, tp=2, ranks_per_pod=1).model()
    with pytest.raises(ValueError):
        build_trainer_pod(group, 2)
    with pytest.raises(ValueError):
        build_engine_pod(group, 1, 0)
    with pytest.raises(ValueError):
        build_engine_pod(group, 0, 2)


# --- the agent sidecar ---------------------------------------------------------------------------


def test_agent_is_a_native_sidecar() -> None:
    pod = build_trainer_pod(GroupBuilder().agent(port=9999, pull_policy="IfNotPresent").model(), 0)
    agent = agent_of(pod)
    assert agent["restartPolicy"] == "Always"
    assert agent["image"] == DEFAULT_AGENT_IMAGE
    assert agent["imagePullPolicy"] == "IfNotPresent"
    assert agent["command"] == ["weightsync"] and agent["args"] == ["agent"]
    assert agent["ports"] == [{"name": "agent", "containerPort": 9999, "protocol": "TCP"}]
    assert all(c["name"] != AGENT_CONTAINER for c in pod["spec"]["containers"])


def test_agent_image_defaults_to_the_operators_and_is_required() -> None:
    group = GroupBuilder().agent(image=None).model()
    pod = build_trainer_pod(group, 0, BuildOptions(agent_image="op/agent:1"))
    assert agent_of(pod)["image"] == "op/agent:1"
    with pytest.raises(BuildError) as caught:
        build_trainer_pod(group, 0, BuildOptions())
    assert caught.value.reason == "NoAgentImage"
    assert names.OPERATOR_ENV_AGENT_IMAGE in caught.value.message


def test_agent_comes_after_the_users_init_containers_and_replaces_a_stale_one() -> None:
    tpl = template(container("trainer"), initContainers=[container("fetch"), container(AGENT_CONTAINER, "old")])
    pod = build_trainer_pod(GroupBuilder().trainer_template(tpl).model(), 0)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["fetch", AGENT_CONTAINER]
    assert agent_of(pod)["image"] == DEFAULT_AGENT_IMAGE


def test_agent_resources_come_from_the_spec() -> None:
    resources = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
    pod = build_trainer_pod(GroupBuilder().agent(resources=resources).model(), 0)
    assert agent_of(pod)["resources"] == resources
    assert "resources" not in agent_of(build_trainer_pod(GroupBuilder().model(), 0))


def test_trainer_agent_env() -> None:
    group = GroupBuilder("g").trainers(3, ranks_per_pod=4).devices("mlx5_0", "mlx5_1").agent(port=9500).model()
    env = env_of(build_trainer_pod(group, 2))
    assert env == {
        names.ENV_GROUP: "g",
        names.ENV_NAMESPACE: "default",
        names.ENV_ROLE: "trainer",
        names.ENV_POD_INDEX: "2",
        names.ENV_RANKS: "8,9,10,11",
        names.ENV_PLAN_CONFIG_MAP: "g-plan",
        names.ENV_AGENT_PORT: "9500",
        names.ENV_DEVICES: "mlx5_0,mlx5_1",
        names.ENV_POD_NAME: {"fieldRef": {"fieldPath": "metadata.name"}},
        names.ENV_POD_IP: {"fieldRef": {"fieldPath": "status.podIP"}},
        names.ENV_CREDENTIALS_DIR: names.CREDENTIALS_PATH,
    }


def test_engine_agent_env() -> None:
    group = GroupBuilder("g").engines(3, tp=8, ranks_per_pod=4).adapter("reference", port=31000).model()
    env = env_of(build_engine_pod(group, 2, 1))
    assert env[names.ENV_ROLE] == "engine"
    assert env[names.ENV_ENGINE_INDEX] == "2"
    assert env[names.ENV_POD_INDEX] == "1"
    assert env[names.ENV_RANKS] == "4,5,6,7"
    # The engine's port and kind reach agents through the plan only (one channel): not also the env.
    assert not {"WEIGHTSYNC_ENGINE_PORT", "WEIGHTSYNC_ADAPTER"} & set(env)
    assert env[names.ENV_DEVICES] == ""
    assert names.ENV_ENGINE_INDEX not in env_of(build_trainer_pod(group, 0))


# --- The group's credential --------------------------------------------------------------------------

TOKEN_REF = {"secretKeyRef": {"name": "g-credentials", "key": names.SECRET_TOKEN_KEY}}


def _token_holders(pod: dict[str, Any]) -> set[str]:
    """The containers (init or not) whose env references the group's Secret, by any variable, or that mount it."""
    secret_volumes = {v["name"] for v in pod["spec"].get("volumes", []) if "secret" in v}
    holders = set()
    for c in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
        for e in c.get("env") or []:
            if "secretKeyRef" in (e.get("valueFrom") or {}):
                holders.add(c["name"])
        if secret_volumes & {m["name"] for m in c.get("volumeMounts") or []}:
            holders.add(c["name"])
        assert not c.get("envFrom"), "no container gets the Secret wholesale"
    return holders


def test_the_agent_reads_the_token_from_the_secret_mounted_read_only() -> None:
    tpl = template(container("main", volumeMounts=[{"name": "weightsync-agent-credentials", "mountPath": "/x"}]))
    group = GroupBuilder("g").trainer_template(tpl).engine_template(copy.deepcopy(tpl)).model()
    # The engine container ("main" of the engine pod) still gets the env: an engine reads its admin key at start.
    for pod, holders in ((build_trainer_pod(group, 0), {AGENT_CONTAINER}),
                         (build_engine_pod(group, 0, 0), {AGENT_CONTAINER, "main"})):  # fmt: skip
        agent = agent_of(pod)
        mount = next(m for m in agent["volumeMounts"] if m["mountPath"] == names.CREDENTIALS_PATH)
        assert mount["readOnly"] is True
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
        # The whole Secret (token and, in a rotation, previous), which kubelets refresh in place.
        assert volume["secret"] == {"secretName": "g-credentials", "defaultMode": 0o444, "optional": False}
        assert env_of(pod)[names.ENV_CREDENTIALS_DIR] == names.CREDENTIALS_PATH
        assert names.ENV_GROUP_TOKEN not in env_of(pod)  # an env var would never follow a rotation
        # A template's container naming the volume loses that mount: the credential is the agent's alone.
        assert _token_holders(pod) == holders
        assert "/x" not in _mounts(pod["spec"]["containers"][0])


def test_the_group_secret_is_owned_by_the_group_and_holds_one_token() -> None:
    group = GroupBuilder("g").model()
    secret = build_group_secret(group, "s3cret")
    assert secret["metadata"]["name"] == names.group_secret("g") == "g-credentials"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == group.metadata.uid
    assert secret["metadata"]["ownerReferences"][0]["controller"] is True
    assert secret["type"] == "Opaque"
    assert secret["data"] == {names.SECRET_TOKEN_KEY: "czNjcmV0"}  # base64("s3cret")
    # What a reconcile may patch on an existing Secret: metadata, never data.
    assert "data" not in build_group_secret(group)
    with pytest.raises(ValueError):
        build_group_secret(group, "")


def test_new_tokens_are_random_and_long() -> None:
    from weightsync_operator.builders import new_token, secret_token

    tokens = {new_token() for _ in range(50)}
    assert len(tokens) == 50 and all(len(t) >= 43 for t in tokens)
    token = tokens.pop()
    assert secret_token(build_group_secret(GroupBuilder("g").model(), token)) == token
    assert secret_token({"data": {}}) is None and secret_token({"data": {"token": "%%%"}}) is None


def test_the_token_reaches_the_agent_and_the_engine_container_only() -> None:
    trainer_tpl = template(container("trainer", env=[{"name": "A", "value": "1"}]), container("logger"))
    engine_tpl = template(container("engine", env=[{"name": "B", "value": "$(WEIGHTSYNC_GROUP_TOKEN)"}]),
                          container("metrics"))  # fmt: skip
    group = GroupBuilder("g").trainer_template(trainer_tpl).engine_template(engine_tpl).model()
    trainer = build_trainer_pod(group, 0)
    assert _token_holders(trainer) == {AGENT_CONTAINER}
    trainer_env = trainer["spec"]["containers"][0]["env"]
    assert trainer_env[-1] == {"name": "A", "value": "1"} and not any("valueFrom" in e for e in trainer_env)
    engine = build_engine_pod(group, 0, 0)
    assert _token_holders(engine) == {AGENT_CONTAINER, "engine"}
    assert not any("secretKeyRef" in (e.get("valueFrom") or {}) for e in agent_of(engine)["env"])
    engine_env = engine["spec"]["containers"][0]["env"]
    # First, so the user's own variables may reference it with $(WEIGHTSYNC_GROUP_TOKEN).
    assert engine_env[0] == {"name": names.ENV_GROUP_TOKEN, "valueFrom": TOKEN_REF}
    assert engine_env[-1] == {"name": "B", "value": "$(WEIGHTSYNC_GROUP_TOKEN)"}
    # A user's own variable of that name is replaced, not duplicated.
    shadow = template(container("engine", env=[{"name": names.ENV_GROUP_TOKEN, "value": "guessable"}]))
    env = build_engine_pod(GroupBuilder("g").engine_template(shadow).model(), 0, 0)["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == names.ENV_GROUP_TOKEN] == [
        {"name": names.ENV_GROUP_TOKEN, "valueFrom": TOKEN_REF}
    ]


def test_the_desired_state_holds_the_secrets_metadata_only() -> None:
    state = state_for(GroupBuilder("g").trainers(1).engines(1))
    assert state.secret == build_group_secret(GroupBuilder("g").model())
    assert state.secret not in state.supporting_objects()  # created with a token by the reconciler, once
    assert state.secret in state.objects()


# --- Least privilege: API credentials and the agent's securityContext ---------------------------

API_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
HARDENED = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _mounts(c: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}


@pytest.mark.parametrize("role", ["trainer", "engine"])
def test_only_the_agent_gets_api_credentials(role: str) -> None:
    tpl = template(container("main"), container("helper"), initContainers=[container("fetch")])
    group = GroupBuilder("g").trainer_template(tpl).engine_template(copy.deepcopy(tpl)).model()
    pod = build_trainer_pod(group, 0) if role == "trainer" else build_engine_pod(group, 0, 0)
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == "g-agent"
    volumes = {v["name"]: v for v in spec["volumes"]}
    api_volume = _mounts(agent_of(pod))[API_PATH]
    # The kubelet's kube-api-access shape, so load_incluster_config reads it unchanged.
    sources = volumes[api_volume]["projected"]["sources"]
    token = sources[0]["serviceAccountToken"]
    assert token["path"] == "token" and 600 <= token["expirationSeconds"] <= 3600
    assert "audience" not in token  # the API server's own audience
    assert sources[1] == {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}
    assert sources[2]["downwardAPI"]["items"] == [
        {"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}
    ]
    assert next(m for m in agent_of(pod)["volumeMounts"] if m["mountPath"] == API_PATH)["readOnly"] is True
    # Nobody else mounts it, nor anything at the credentials' path.
    for c in [*spec["initContainers"], *spec["containers"]]:
        if c["name"] != AGENT_CONTAINER:
            assert api_volume not in _mounts(c).values() and API_PATH not in _mounts(c), c["name"]


def test_a_template_asking_for_the_token_still_gets_none() -> None:
    sneaky = {"name": "weightsync-agent-api-access", "mountPath": "/creds"}
    tpl = template(
        container("trainer", volumeMounts=[sneaky]),
        initContainers=[container("fetch", volumeMounts=[sneaky])],
        automountServiceAccountToken=True,
    )
    pod = build_trainer_pod(GroupBuilder().trainer_template(tpl).model(), 0)
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert sneaky not in pod["spec"]["containers"][0]["volumeMounts"]
    assert sneaky not in pod["spec"]["initContainers"][0]["volumeMounts"]


@pytest.mark.parametrize(
    ("asks", "said"),
    [
        (
            {"metadata": {"annotations": {names.ANNOTATION_AGENT_URL: "http://evil:1"}}},
            "sets annotations ['weightsync.io/agent-url']: keys under weightsync.io/ are the operator's",
        ),
        (
            {"volumes": [{"name": "sa", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}]},
            "volume 'sa' mounts a ServiceAccount token",
        ),
        (
            {"volumes": [{"name": "s", "secret": {"secretName": "g-credentials"}}]},
            "volume 's' mounts the group's Secret g-credentials",
        ),
        (
            {"volumes": [{"name": "p", "projected": {"sources": [{"secret": {"name": "g-credentials"}}]}}]},
            "volume 'p' mounts the group's Secret g-credentials",
        ),
        (
            {"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "g-credentials", "key": "token"}}}]},
            "container 'trainer' reads the group's Secret g-credentials (env T)",
        ),
        (
            {"envFrom": [{"secretRef": {"name": "g-credentials"}}]},
            "container 'trainer' reads the group's Secret g-credentials (envFrom)",
        ),
    ],
    ids=["annotation", "sa-token", "secret-volume", "projected-secret", "secret-env", "secret-envfrom"],
)
def test_a_template_reaching_for_a_credential_is_refused_naming_the_route(asks: dict[str, Any], said: str) -> None:
    """The review's routes to the agent's or the group's credential from a user's container: each is refused (the
    group gets InvalidTemplate), naming it; the same template without it builds."""
    meta = asks.get("metadata", {})
    pod_level = {k: v for k, v in asks.items() if k == "volumes"}
    in_container = {k: v for k, v in asks.items() if k in ("env", "envFrom")}
    tpl = template(container("trainer", **in_container), **pod_level)
    tpl["metadata"] = {**tpl.get("metadata", {}), **meta}
    group = GroupBuilder("g").trainer_template(tpl).model()
    with pytest.raises(BuildError) as refused:
        build_trainer_pod(group, 0)
    assert refused.value.reason == "InvalidTemplate" and said in refused.value.message, refused.value.message
    other = template(container("trainer", env=[{"name": "X", "valueFrom": {"secretKeyRef": {"name": "mine",
                                                                                           "key": "k"}}}]))  # fmt: skip
    other["metadata"] = {"annotations": {"team.example.com/owner": "ml"}}
    assert build_trainer_pod(GroupBuilder("g").trainer_template(other).model(), 0)  # their own Secret: fine


def test_the_vllm_examples_key_comes_from_the_token_the_operator_puts_first() -> None:
    """Kubernetes expands ``$(VAR)`` in an env value only from variables defined before it: the examples' VLLM_API_KEY
    (the key in vLLM's environment, not on its command line) must follow the operator's WEIGHTSYNC_GROUP_TOKEN."""
    from weightsync.api.load import load_groups

    root = Path(__file__).resolve().parents[2] / "examples"
    for path in sorted(root.glob("vllm-*.yaml")):
        (group,) = load_groups(path)
        pod = build_engine_pod(group, 0, 0, BuildOptions(agent_image=DEFAULT_AGENT_IMAGE))
        container = pod["spec"]["containers"][0]
        env = [item["name"] for item in container["env"]]
        assert env.index(names.ENV_GROUP_TOKEN) < env.index("VLLM_API_KEY"), path.name
        assert "--api-key" not in container.get("args", []) + container.get("command", []), path.name


def test_the_agent_is_hardened_by_default_and_writes_only_tmp_and_shm() -> None:
    pod = build_trainer_pod(GroupBuilder().model(), 0)
    agent = agent_of(pod)
    assert agent["securityContext"] == HARDENED
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    writable = {path for path, name in _mounts(agent).items() if "emptyDir" in volumes[name]}
    assert writable == {"/tmp", names.SHM_PATH}
    assert volumes[_mounts(agent)["/tmp"]]["emptyDir"].get("medium") != "Memory"  # scratch space costs no RAM


def test_the_agents_uid_is_the_agent_images_user() -> None:
    dockerfile = (Path(__file__).resolve().parents[2] / "agent" / "Dockerfile").read_text()
    (user,) = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert user == f"{HARDENED['runAsUser']}:{HARDENED['runAsGroup']}"


_OVERRIDES: dict[str, Any] = {
    "runAsUser": st.integers(0, 2**31 - 1),
    "runAsGroup": st.integers(0, 2**31 - 1),
    "runAsNonRoot": st.booleans(),
    "allowPrivilegeEscalation": st.booleans(),
    "readOnlyRootFilesystem": st.booleans(),
    "capabilities": st.fixed_dictionaries(
        {},
        optional={
            "add": st.lists(st.sampled_from(["IPC_LOCK", "NET_RAW", "SYS_NICE"]), max_size=3),
            "drop": st.lists(st.sampled_from(["ALL", "NET_RAW"]), max_size=2),
        },
    ),
    "seccompProfile": st.sampled_from(
        [{"type": "RuntimeDefault"}, {"type": "Unconfined"}, {"type": "Localhost", "localhostProfile": "p.json"}]
    ),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=_OVERRIDES), st.booleans())
def test_the_agents_security_context_is_overridden_field_by_field(overrides: dict[str, Any], rdma: bool) -> None:
    builder = GroupBuilder().agent(security_context=overrides)
    if rdma:
        builder = builder.rdma("rdma/ib")
    pod = build_engine_pod(builder.model(), 0, 0)
    defaults = copy.deepcopy(HARDENED)
    if rdma:
        defaults["capabilities"]["add"] = ["IPC_LOCK"]
    assert agent_of(pod)["securityContext"] == {**defaults, **overrides}
    kubernetes_validate.validate(pod, "1.37.0", strict=True)


@pytest.mark.parametrize(
    ("user", "agent", "expected"),
    [
        (None, {}, {"supplementalGroups": [65532]}),
        ({"fsGroup": 2000, "supplementalGroups": [5]}, {}, {"fsGroup": 2000, "supplementalGroups": [5, 65532]}),
        ({"supplementalGroups": [65532], "runAsUser": 1000}, {}, {"supplementalGroups": [65532], "runAsUser": 1000}),
        (None, {"runAsGroup": 4242}, {"supplementalGroups": [4242]}),
        (None, {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False}, None),  # never the root group
    ],
)
def test_trainer_code_of_any_user_shares_the_agents_group(
    user: dict[str, Any] | None, agent: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    """Issue 26: the replica files and the pod-local token are shared with the agent's group (0660, 0640), so every
    container of a trainer pod gets that group (``supplementalGroups``: no volume is re-owned, as ``fsGroup`` would);
    the user's own pod securityContext is kept. Engine pods share no file with the agent: unchanged."""
    extra = {} if user is None else {"securityContext": user}
    builder = GroupBuilder().agent(security_context=agent).trainer_template(template(container("trainer"), **extra))
    group = builder.model()
    trainer = build_trainer_pod(group, 0)
    assert trainer["spec"].get("securityContext") == expected
    assert "securityContext" not in build_engine_pod(group, 0, 0)["spec"]
    kubernetes_validate.validate(trainer, "1.37.0", strict=True)


@pytest.mark.parametrize(
    "bad",
    [
        {"privileged": True},  # not in the bounded schema: the agent can't be made privileged through the group
        {"capabilities": {"add": ["ipc_lock"]}},
        {"capabilities": {"add": ["IPC_LOCK"] * 17}},
        {"seccompProfile": {"type": "Localhost"}},
        {"seccompProfile": {"type": "RuntimeDefault", "localhostProfile": "p.json"}},
        {"runAsUser": -1},
        {"runAsNonRoot": "yes"},
    ],
)
def test_the_security_context_schema_is_bounded(bad: dict[str, Any]) -> None:
    from weightsync.api.load import SpecError, parse_group

    with pytest.raises(SpecError):
        parse_group(GroupBuilder().agent(security_context=bad).build())


@pytest.mark.parametrize("role", ["trainer", "engine"])
def test_the_site_packages_claim_is_read_only_in_the_agent_alone(role: str) -> None:
    """``spec.agent.sitePackages`` gives an agent image built without torch (``TORCH=node``) the node's: the claim,
    read-only, at the path the image's ``.pth`` line names, in the agent only; a template's volume of that name is
    replaced; without the field nothing is added."""
    squatter = {"name": "weightsync-agent-site-packages", "emptyDir": {}}
    tpl = template(container("main"), volumes=[squatter])
    builder = GroupBuilder("g").trainer_template(tpl).engine_template(copy.deepcopy(tpl))
    plain = builder.model()
    group = builder.agent(site_packages={"claimName": "torch-site"}).model()
    pod = build_trainer_pod(group, 0) if role == "trainer" else build_engine_pod(group, 0, 0)
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "weightsync-agent-site-packages"]
    assert volume == {
        "name": "weightsync-agent-site-packages",
        "persistentVolumeClaim": {"claimName": "torch-site", "readOnly": True},
    }
    (mount,) = [m for m in agent_of(pod)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount == {"name": volume["name"], "mountPath": names.SITE_PACKAGES_PATH, "readOnly": True}
    for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]:
        if c["name"] != AGENT_CONTAINER:
            assert volume["name"] not in _mounts(c).values(), c["name"]
    without = build_trainer_pod(plain, 0) if role == "trainer" else build_engine_pod(plain, 0, 0)
    assert names.SITE_PACKAGES_PATH not in _mounts(agent_of(without))
    assert all("persistentVolumeClaim" not in v for v in without["spec"]["volumes"])


def test_the_engine_pods_agent_reads_what_the_engine_reads_read_only() -> None:
    """The agent traces the model the engine reports, at the engine's path: the engine container's mounts, read-only
    (a writable one too), at the same paths; none at or around the agent's own paths; none on trainer pods."""
    mounts = [
        {"name": "models", "mountPath": "/models/", "mountPropagation": "HostToContainer"},
        {"name": "hf", "mountPath": "/root/.cache/huggingface", "subPath": "hub", "readOnly": True},
        {"name": "scratch", "mountPath": "/tmp/engine"},  # inside the agent's /tmp
        {"name": "everything", "mountPath": "/"},
        {"name": "weightsync-agent-credentials", "mountPath": "/creds"},  # an agent volume: dropped everywhere
    ]
    volumes = [{"name": n, "emptyDir": {}} for n in ("models", "hf", "scratch", "everything")]
    tpl = template(container("engine", volumeMounts=mounts), container("sidecar"), volumes=volumes)
    group = GroupBuilder("g").engine_template(tpl).trainer_template(copy.deepcopy(tpl)).model()
    agent = agent_of(build_engine_pod(group, 0, 0))
    shared = [m for m in agent["volumeMounts"] if m["name"] in ("models", "hf", "scratch", "everything")]
    assert shared == [
        {"name": "models", "mountPath": "/models/", "readOnly": True},
        {"name": "hf", "mountPath": "/root/.cache/huggingface", "subPath": "hub", "readOnly": True},
    ]
    assert len({m["mountPath"].rstrip("/") for m in agent["volumeMounts"]}) == len(agent["volumeMounts"])
    trainer_agent = agent_of(build_trainer_pod(group, 0))
    assert not [m for m in trainer_agent["volumeMounts"] if m["name"] in ("models", "hf")]


def test_the_site_packages_path_is_where_the_agent_image_looks() -> None:
    dockerfile = (Path(__file__).resolve().parents[2] / "agent" / "Dockerfile").read_text()
    assert f"echo {names.SITE_PACKAGES_PATH} > " in dockerfile


@pytest.mark.parametrize("bad", [{"claimName": ""}, {"claimName": "Torch_Site"}, {"claimName": "a" * 254}, {}])
def test_the_site_packages_claim_is_a_bounded_name(bad: dict[str, Any]) -> None:
    from weightsync.api.load import SpecError, parse_group

    with pytest.raises(SpecError):
        parse_group(GroupBuilder().agent(site_packages=bad).build())


# --- RDMA, capabilities, shm, networking ---------------------------------------------------------


def test_rdma_request_and_limit_on_the_first_container_and_the_agent_only() -> None:
    tpl = template(container("trainer", resources={"limits": {"nvidia.com/gpu": 8}}), container("logger"))
    pod = build_trainer_pod(GroupBuilder().trainer_template(tpl).rdma("rdma/hca_shared_devices_a", 2).model(), 0)
    first, second = pod["spec"]["containers"]
    assert first["resources"] == {
        "limits": {"nvidia.com/gpu": 8, "rdma/hca_shared_devices_a": 2},
        "requests": {"rdma/hca_shared_devices_a": 2},
    }
    assert "resources" not in second
    assert agent_of(pod)["resources"] == {
        "requests": {"rdma/hca_shared_devices_a": 2},
        "limits": {"rdma/hca_shared_devices_a": 2},
    }


def test_no_rdma_resource_without_a_resource_name() -> None:
    pod = build_engine_pod(GroupBuilder().model(), 0, 0)
    assert "resources" not in pod["spec"]["containers"][0]
    assert "resources" not in agent_of(pod)


def test_ipc_lock_is_merged_with_the_users_capabilities_when_the_group_uses_rdma() -> None:
    caps = {"capabilities": {"add": ["NET_ADMIN"], "drop": ["ALL"]}, "runAsUser": 1000}
    tpl = template(
        container("trainer", securityContext=caps),
        container("side", securityContext={"capabilities": {"add": ["IPC_LOCK"]}}),
    )
    pod = build_trainer_pod(GroupBuilder().trainer_template(tpl).rdma("rdma/ib").model(), 0)
    first, second = pod["spec"]["containers"]
    assert first["securityContext"] == {
        "capabilities": {"add": ["NET_ADMIN", "IPC_LOCK"], "drop": ["ALL"]},
        "runAsUser": 1000,
    }
    assert second["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert agent_of(pod)["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_a_tcp_group_adds_no_capability_to_anyone() -> None:
    caps = {"capabilities": {"add": ["NET_ADMIN"]}}
    tpl = template(container("trainer", securityContext=caps), container("side"))
    pod = build_trainer_pod(GroupBuilder().trainer_template(tpl).set("transfer.protocol", "tcp").model(), 0)
    first, second = pod["spec"]["containers"]
    assert first["securityContext"] == caps  # the user's own, untouched
    assert "securityContext" not in second
    assert agent_of(pod)["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_multus_annotation_only_when_networks_are_given() -> None:
    with_networks = build_engine_pod(GroupBuilder().networks("rdma-net", "other/rdma-net2").model(), 0, 0)
    assert with_networks["metadata"]["annotations"][names.MULTUS_NETWORKS] == "rdma-net,other/rdma-net2"
    without = build_engine_pod(GroupBuilder().model(), 0, 0)
    assert names.MULTUS_NETWORKS not in without["metadata"]["annotations"]


def test_shm_is_memory_backed_sized_and_mounted_everywhere() -> None:
    tpl = template(container("trainer"), container("logger"))
    pod = build_trainer_pod(GroupBuilder().trainer_template(tpl).shm(64).model(), 0)
    assert {"name": "weightsync-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["spec"]["volumes"]
    for c in [*pod["spec"]["containers"], agent_of(pod)]:
        assert {"name": "weightsync-shm", "mountPath": "/dev/shm"} in c["volumeMounts"], c["name"]


def test_a_template_that_already_mounts_shm_keeps_its_volume_and_the_agent_shares_it() -> None:
    mount = {"name": "my-shm", "mountPath": "/dev/shm"}
    tpl = template(
        container("trainer", volumeMounts=[mount]),
        container("logger"),
        volumes=[{"name": "my-shm", "emptyDir": {"medium": "Memory"}}],
    )
    pod = build_trainer_pod(GroupBuilder().trainer_template(tpl).model(), 0)
    shm_volumes = [v["name"] for v in pod["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert shm_volumes == ["my-shm"]
    assert pod["spec"]["containers"][0]["volumeMounts"] == [mount]
    assert pod["spec"]["containers"][1]["volumeMounts"] == [mount]
    assert [m for m in agent_of(pod)["volumeMounts"] if m["mountPath"] == "/dev/shm"] == [mount]


def test_host_network() -> None:
    pod = build_trainer_pod(GroupBuilder().host_network().model(), 0)
    assert pod["spec"]["hostNetwork"] is True
    assert pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    plain = build_trainer_pod(GroupBuilder().model(), 0)
    assert "hostNetwork" not in plain["spec"] and "dnsPolicy" not in plain["spec"]


# --- identity, ownership, DNS, readiness ---------------------------------------------------------


def test_labels_keep_the_users_but_ours_win() -> None:
    tpl = template(container("engine"), labels={"team": "rl", names.LABEL_GROUP: "spoofed", names.LABEL_ENGINE: "9"})
    pod = build_engine_pod(GroupBuilder("g").engines(2, tp=2, ranks_per_pod=1).engine_template(tpl).model(), 1, 1)
    assert pod["metadata"]["labels"] == {
        "team": "rl",
        names.LABEL_GROUP: "g",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
        names.LABEL_ROLE: "engine",
        names.LABEL_RANK: "1-1",
        names.LABEL_ENGINE: "1",
    }
    trainer = build_trainer_pod(GroupBuilder("g").trainers(2).model(), 1)["metadata"]["labels"]
    assert trainer[names.LABEL_ROLE] == "trainer" and trainer[names.LABEL_RANK] == "1"
    assert names.LABEL_ENGINE not in trainer


def test_owner_reference_makes_the_group_the_controller() -> None:
    group = GroupBuilder("g").uid("u-123").model()
    state = desired_state(group, plan_for(group.spec, group="g", namespace="default"))
    for obj in state.objects():
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "weightsync.io/v1alpha1",
                "kind": "WeightSyncGroup",
                "name": "g",
                "uid": "u-123",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], obj["kind"]
        assert obj["metadata"]["namespace"] == "default"


def test_pod_level_settings() -> None:
    tpl = template(container("trainer"), readinessGates=[{"conditionType": "example.com/warm"}], restartPolicy="Never")
    pod = build_trainer_pod(GroupBuilder("g").trainer_template(tpl).model(), 0)
    spec = pod["spec"]
    assert spec["hostname"] == "g-trainer-0"
    assert spec["subdomain"] == "g"
    assert spec["serviceAccountName"] == "g-agent"
    assert spec["restartPolicy"] == "Always"
    assert spec["readinessGates"] == [
        {"conditionType": "example.com/warm"},
        {"conditionType": names.CONDITION_AGENT_READY},
    ]


def test_user_containers_are_untouched_but_for_what_weightsync_adds() -> None:
    user = container(
        "trainer",
        "trainer:1",
        command=["python", "train.py"],
        env=[{"name": "A", "value": "1"}],
        ports=[{"containerPort": 8000}],
        resources={"limits": {"nvidia.com/gpu": 8}},
    )
    tpl = template(user, nodeSelector={"gpu": "h100"}, tolerations=[{"key": "gpu", "operator": "Exists"}])
    pod = build_trainer_pod(GroupBuilder().trainer_template(copy.deepcopy(tpl)).model(), 0)
    built = pod["spec"]["containers"][0]
    for key in ("name", "image", "command", "ports", "resources"):
        assert built[key] == user[key]
    # The pod's identity first (tests/operator/test_workload_identity.py), then the user's.
    assert built["env"][-1:] == user["env"] and set(workload_env_of(pod)) == {e["name"] for e in built["env"][:-1]}
    assert set(built) - set(user) == {"volumeMounts"}  # and securityContext with IPC_LOCK, only under RDMA
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert pod["spec"]["tolerations"] == tpl["spec"]["tolerations"]


def test_spec_hash_detects_drift_but_not_scaling() -> None:
    base = GroupBuilder("g").trainers(2).engines(2, tp=4, ranks_per_pod=2)
    pod = build_trainer_pod(base.model(), 1)
    assert pod["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH] == pod_spec_hash(pod)
    assert build_trainer_pod(GroupBuilder("g").trainers(2).engines(7, tp=4, ranks_per_pod=2).model(), 1) == pod
    engine = build_engine_pod(base.model(), 1, 1)
    assert build_engine_pod(GroupBuilder("g").trainers(5).engines(7, tp=4, ranks_per_pod=2).model(), 1, 1) == engine
    # A trainer is one job over its pods: scaling it changes its pods' job size (WEIGHTSYNC_NNODES and
    # WEIGHTSYNC_WORLD_SIZE) and nothing else, so the running ones are reported outdated (their launcher's world is
    # the old one) until they are recreated.
    scaled = build_trainer_pod(GroupBuilder("g").trainers(5).engines(2, tp=4, ranks_per_pod=2).model(), 1)
    assert scaled["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH] != pod_spec_hash(pod)
    old_size = {names.ENV_NNODES: "2", names.ENV_WORLD_SIZE: "2"}
    assert {k: workload_env_of(scaled)[k] for k in old_size} == {names.ENV_NNODES: "5", names.ENV_WORLD_SIZE: "5"}
    for item in scaled["spec"]["containers"][0]["env"]:
        item["value"] = old_size.get(item["name"], item.get("value"))
    scaled["metadata"]["annotations"] = pod["metadata"]["annotations"]
    assert scaled == pod
    changed = build_trainer_pod(GroupBuilder("g").trainers(2).agent(image="other:2").model(), 1)
    assert changed["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH] != pod_spec_hash(pod)


# --- Service, ConfigMap, RBAC --------------------------------------------------------------------


def test_service_is_headless_and_publishes_not_ready_pods() -> None:
    svc = build_service(GroupBuilder("g").agent(port=9500).model())
    assert svc["metadata"]["name"] == "g"
    assert svc["spec"] == {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": {names.LABEL_GROUP: "g"},
        "ports": [{"name": "agent", "port": 9500, "targetPort": 9500, "protocol": "TCP"}],
    }


def test_plan_config_map() -> None:
    group = GroupBuilder("g").trainers(2).engines(2, tp=2).model()
    plan = plan_for(group.spec, group="g", namespace="default")
    cm = build_plan_config_map(group, plan)
    assert cm["metadata"]["name"] == "g-plan"
    assert cm["metadata"]["annotations"] == {
        names.ANNOTATION_PLAN_HASH: plan.hash,
        names.ANNOTATION_PLAN_REVISION: "1",
    }
    assert Plan.from_json(cm["data"][names.PLAN_KEY]) == plan
    assert names.PLAN_SEAL_KEY not in cm["data"]  # rendered without the group's token: no seal
    sealed = build_plan_config_map(group, plan, "the-token")
    assert sealed["data"][names.PLAN_SEAL_KEY] == seal("the-token", sealed["data"][names.PLAN_KEY])


def test_a_stored_plan_not_sealed_with_the_groups_token_is_not_replanned_from() -> None:
    """Whoever may edit the plan ConfigMap can write a self-consistent plan; the operator replans only from one its
    own token sealed, and otherwise plans afresh at the next revision (which its agents then take)."""
    builder = GroupBuilder("g").trainers(2).engines(2)
    first = decide_plan(builder.model().spec, group="g", namespace="default", config_map=None, token="t").plan
    ours = build_plan_config_map(builder.model(), first, "t")
    assert decide_plan(builder.model().spec, group="g", namespace="default", config_map=ours, token="t").plan == first
    forged = first.sealed(transfer=first.transfer.model_copy(update={"verify": False}))
    for cm in (build_plan_config_map(builder.model(), forged), build_plan_config_map(builder.model(), forged, "x")):
        decision = decide_plan(builder.model().spec, group="g", namespace="default", config_map=cm, token="t")
        assert decision.previous is None and "not sealed with the group's token" in decision.note
        assert decision.plan.transfer.verify and decision.plan.revision == forged.revision + 1


def test_role_grants_the_plan_and_the_groups_pods_and_nothing_more() -> None:
    group = GroupBuilder("g").trainers(1).engines(2).model()
    role = build_role(group, expected_pod_names(group))
    assert role["metadata"]["name"] == "g-agent"
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["g-plan"],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": [""],
            "resources": ["pods", "pods/status"],
            "resourceNames": ["g-trainer-0", "g-engine-0-0", "g-engine-1-0"],
            "verbs": ["get", "patch"],
        },
    ]
    binding = build_role_binding(group)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "g-agent"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "g-agent", "namespace": "default"}]
    assert build_service_account(group)["metadata"]["name"] == "g-agent"


def test_role_follows_scaling() -> None:
    small, large = (state_for(GroupBuilder("g").engines(n)) for n in (1, 3))
    assert small.role["rules"][1]["resourceNames"] == ["g-trainer-0", "g-engine-0-0"]
    assert large.role["rules"][1]["resourceNames"] == [
        "g-trainer-0",
        "g-engine-0-0",
        "g-engine-1-0",
        "g-engine-2-0",
    ]


def test_every_object_is_valid_kubernetes() -> None:
    state = state_for(
        GroupBuilder("g")
        .trainers(2, ranks_per_pod=2)
        .engines(2, tp=2, ranks_per_pod=1)
        .rdma("rdma/hca_shared_devices_a")
        .networks("rdma-net")
        .devices("mlx5_0")
        .agent(resources={"requests": {"cpu": "500m"}})
    )
    for obj in state.objects():
        kubernetes_validate.validate(obj, "1.37.0", strict=True)


# --- Plan decisions ------------------------------------------------------------------------------


def _config_map_of(builder: GroupBuilder, plan: Plan) -> dict[str, Any]:
    return build_plan_config_map(builder.model(), plan)


def test_first_plan_is_revision_one() -> None:
    spec = GroupBuilder("g").trainers(2).engines(2).model().spec
    decision = decide_plan(spec, group="g", namespace="default", config_map=None)
    assert decision.plan.revision == 1 and decision.previous is None and decision.changed


def test_same_spec_keeps_the_stored_plan_and_revision() -> None:
    builder = GroupBuilder("g").trainers(2).engines(2)
    first = decide_plan(builder.model().spec, group="g", namespace="default", config_map=None).plan
    again = decide_plan(builder.model().spec, group="g", namespace="default", config_map=_config_map_of(builder, first))
    assert again.plan == first and not again.changed


def test_scaling_bumps_the_revision_once() -> None:
    builder = GroupBuilder("g").trainers(2).engines(2, tp=2)
    first = decide_plan(builder.model().spec, group="g", namespace="default", config_map=None).plan
    bigger = builder.engines(4, tp=2)
    scaled = decide_plan(bigger.model().spec, group="g", namespace="default", config_map=_config_map_of(bigger, first))
    assert scaled.changed and scaled.previous == first
    assert scaled.plan.revision == 2
    assert scaled.plan.layout.engines == 4
    settled = decide_plan(
        bigger.model().spec, group="g", namespace="default", config_map=_config_map_of(bigger, scaled.plan)
    )
    assert settled.plan.revision == 2 and not settled.changed


@pytest.mark.parametrize("garbage", ["{not json", json.dumps({"schemaVersion": "weightsync.io/plan/v1", "hash": "x"})])
def test_an_unreadable_stored_plan_is_replaced_with_a_newer_revision(garbage: str) -> None:
    builder = GroupBuilder("g")
    cm = {
        "metadata": {"annotations": {names.ANNOTATION_PLAN_REVISION: "7"}},
        "data": {names.PLAN_KEY: garbage},
    }
    decision = decide_plan(builder.model().spec, group="g", namespace="default", config_map=cm)
    assert decision.previous is None and decision.plan.revision == 8
    assert "unreadable" in decision.note


# --- Properties ----------------------------------------------------------------------------------

layouts = st.tuples(
    st.integers(1, 6),  # trainer replicas
    st.integers(1, 4),  # trainer ranks per pod
    st.integers(1, 6),  # engines
    st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 4)]),  # (ranks per engine, per pod)
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts)
def test_any_layout_gives_unique_pods_and_every_rank_exactly_once(
    layout: tuple[int, int, int, tuple[int, int]],
) -> None:
    replicas, trainer_rpp, engines, (rpe, engine_rpp) = layout
    builder = (
        GroupBuilder("g")
        .trainers(replicas, ranks_per_pod=trainer_rpp)
        .engines(engines, tp=rpe, ranks_per_pod=engine_rpp)
    )
    state = state_for(builder)
    assert len(set(state.pod_names)) == len(state.pods) == replicas + engines * (rpe // engine_rpp)
    assert set(state.role["rules"][1]["resourceNames"]) == set(state.pod_names)

    trainer_ranks: list[int] = []
    engine_ranks: dict[int, list[int]] = {}
    for pod in state.pods:
        env = env_of(pod)
        ranks = [int(r) for r in env[names.ENV_RANKS].split(",")]
        assert pod["spec"]["hostname"] == pod["metadata"]["name"]
        if env[names.ENV_ROLE] == "trainer":
            trainer_ranks += ranks
        else:
            engine_ranks.setdefault(int(env[names.ENV_ENGINE_INDEX]), []).extend(ranks)
    assert sorted(trainer_ranks) == list(range(replicas * trainer_rpp))
    assert sorted(engine_ranks) == list(range(engines))
    for ranks in engine_ranks.values():
        assert sorted(ranks) == list(range(rpe))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(1, 5), st.integers(1, 6)), min_size=2, max_size=4),
    st.sampled_from(["balanced", "miles"]),
)
def test_replanning_settles_after_each_change(steps: list[tuple[int, int]], policy: str) -> None:
    """The operator replans from the stored plan on every reconcile: that must reach a fixpoint at
    once, or the plan (and its revision) would churn while nothing changes."""
    cm: dict[str, Any] | None = None
    revision = 0
    for trainers, engines in steps:
        builder = GroupBuilder("g").trainers(trainers).engines(engines, tp=2).planner(policy)
        spec = builder.model().spec
        decision = decide_plan(spec, group="g", namespace="default", config_map=cm)
        assert decision.plan.revision == revision + (1 if decision.changed else 0)
        revision = decision.plan.revision
        cm = build_plan_config_map(builder.model(), decision.plan)
        again = decide_plan(spec, group="g", namespace="default", config_map=cm)
        assert not again.changed and again.plan == decision.plan


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts, st.sampled_from(["tcp", "auto"]))
def test_a_tcp_group_adds_nothing_pod_security_baseline_forbids(
    layout: tuple[int, int, int, tuple[int, int]], protocol: str
) -> None:
    """What weightsync adds to a group without RDMA: no capability, no host namespace, no privilege, no hostPath,
    for every pod of any layout (the real API server's PodSecurity check: tests/e2e/test_least_privilege.py)."""
    replicas, trainer_rpp, engines, (rpe, engine_rpp) = layout
    builder = (
        GroupBuilder("g")
        .trainers(replicas, ranks_per_pod=trainer_rpp)
        .engines(engines, tp=rpe, ranks_per_pod=engine_rpp)
        .set("transfer.protocol", protocol)
    )
    for pod in state_for(builder).pods:
        spec = pod["spec"]
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec)
        shared = {"supplementalGroups": [65532]} if pod["metadata"]["labels"][names.LABEL_ROLE] == "trainer" else None
        assert spec.get("securityContext") == shared  # only the agent's group: the files it shares with trainer code
        assert all(set(v) - {"name"} <= {"emptyDir", "projected", "secret"} for v in spec["volumes"])
        for c in [*spec["initContainers"], *spec["containers"]]:
            security = c.get("securityContext") or {}
            assert not security.get("privileged") and not (security.get("capabilities") or {}).get("add"), c["name"]
            assert not any("hostPort" in p for p in c.get("ports") or [])
        assert agent_of(pod)["securityContext"] == HARDENED
