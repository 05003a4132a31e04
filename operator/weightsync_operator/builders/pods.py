"""Trainer and engine pods: the user's template plus what weightsync needs.

Pods are bare (no StatefulSet): the operator owns rank identity and recreation. A pod's name carries
its ranks (``<group>-trainer-<i>``, ``<group>-engine-<e>-<j>``), and nothing in a pod depends on how
many engines the group has, so scaling engines never touches the pods that stay. A trainer pod depends on
``trainer.replicas`` only through its job's size (``WEIGHTSYNC_NNODES``, ``WEIGHTSYNC_WORLD_SIZE``): a trainer is one
job over its pods, so after the trainer is scaled its running pods are reported outdated (not killed) until they
are recreated into the new job.

What is added to the template (everything else is the user's and passes through untouched):

- metadata: labels ``weightsync.io/{group,role,rank[,engine]}``, the Multus networks annotation when
  ``rdma.networks`` is set, the owner reference, and ``weightsync.io/pod-spec-hash`` (a hash of the
  pod as built, so drift is detected without comparing against server-defaulted fields);
- the agent as a native sidecar (init container, ``restartPolicy: Always``) with its env, port and
  resources;
- the workload identity in every user container's env, first (``builders/identity.py``: group, role, pod
  index, ranks, node rank, nnodes, the leader's DNS name and rendezvous port; docs/workload-identity.md); a
  template's variable of one of those names is replaced by the operator's;
- the group's credential: the group's Secret as a read-only volume in the agent container only (at
  ``/var/run/weightsync/credentials``: ``token`` and, during a rotation, ``previous``; kubelets refresh it in
  place, so a rotation reaches running agents) and, on engine pods, ``WEIGHTSYNC_GROUP_TOKEN`` in the first user
  container's env (the engine: stock SGLang takes it as ``--admin-api-key $(WEIGHTSYNC_GROUP_TOKEN)``, once, at
  start); never in a trainer pod's user containers;
- the RDMA resource (request = limit) on the first user container and the agent;
- ``IPC_LOCK`` (merged into the user's capabilities) on every user container and the agent, only when
  the group uses RDMA (``rdma.resourceName``: memory registration needs it); a TCP group adds no capability;
- a memory-backed ``/dev/shm`` shared by every container (the CPU replica lives there), and on trainer pods the
  agent's group among the pod's ``supplementalGroups`` (the replica files and the pod-local token are group-shared);
- ``hostname``/``subdomain`` for stable DNS through the headless Service, the agent-ready readiness
  gate, the agents' ServiceAccount, ``restartPolicy: Always``, and host networking when asked;
- least privilege (docs/security.md, "Least privilege"): ``automountServiceAccountToken: false``, and the
  agents' API credentials as a projected volume mounted in the agent container only (the user's containers
  get none); the agent hardened (non-root, no privilege escalation, drop ALL, RuntimeDefault seccomp,
  read-only root filesystem with an emptyDir at /tmp), each field overridable by ``spec.agent.securityContext``;
- ``spec.agent.sitePackages``'s claim, read-only in the agent alone at /opt/weightsync/node-python: the torch of an
  agent image built without one (agent/Dockerfile, ``TORCH=node``);
- on engine pods, the engine container's volume mounts in the agent, read-only, at the same paths: the agent runs the
  engine's loader on the model the engine reports (``engine_mounts_for_agent``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.api import names
from weightsync.api.v1alpha1 import AGENT_CONTAINER, WeightSyncGroup, WeightSyncGroupSpec
from weightsync_operator.builders.common import (
    BuildError,
    BuildOptions,
    JsonDict,
    content_hash,
    group_labels,
    object_meta,
)
from weightsync_operator.builders.identity import (
    PodIdentity,
    engine_identity,
    identity_values,
    trainer_identity,
    workload_env,
)
from weightsync_operator.builders.secret import credentials_volume, token_env
from weightsync_operator.builders.template_trust import template_refusals

#: Name of the memory-backed volume the operator adds (unless the template already mounts /dev/shm).
SHM_VOLUME = "weightsync-shm"
IPC_LOCK = "IPC_LOCK"
#: The agent's API credentials: the same projection the kubelet's ``kube-api-access-*`` volume has, mounted
#: only in the agent, where ``load_incluster_config`` looks for them.
API_ACCESS_VOLUME = "weightsync-agent-api-access"
API_ACCESS_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
#: Lifetime of the projected token; the kubelet renews it at 80 % and the Kubernetes client re-reads the file.
API_TOKEN_SECONDS = 3600
#: The group's credential as files (``token``, ``previous``), only in the agent: re-read when a kubelet refreshes
#: them, which an env var never is (docs/security.md, "Rotating the token").
CREDENTIALS_VOLUME = "weightsync-agent-credentials"
#: The agent's only writable place besides /dev/shm (its root filesystem is read-only): HOME and TMPDIR.
AGENT_TMP_VOLUME = "weightsync-agent-tmp"
AGENT_TMP_PATH = "/tmp"
AGENT_TMP_SIZE = "1Gi"
#: ``spec.agent.sitePackages``'s claim, read-only in the agent alone.
SITE_PACKAGES_VOLUME = "weightsync-agent-site-packages"
#: The agent image's user (agent/Dockerfile: ``USER 65532:65532``).
AGENT_UID = 65532
#: Volumes only the agent mounts: a template's container naming one loses that mount.
AGENT_SECRET_VOLUMES = (API_ACCESS_VOLUME, CREDENTIALS_VOLUME)
AGENT_VOLUMES = (*AGENT_SECRET_VOLUMES, AGENT_TMP_VOLUME, SITE_PACKAGES_VOLUME)
AGENT_COMMAND = ["weightsync"]
AGENT_ARGS = ["agent"]


def build_trainer_pod(group: WeightSyncGroup, index: int, options: BuildOptions | None = None) -> JsonDict:
    """Trainer pod ``index`` (``<group>-trainer-<index>``)."""
    return build_pod(group, trainer_identity(group, index), options or BuildOptions())


def build_engine_pod(group: WeightSyncGroup, engine: int, pod: int, options: BuildOptions | None = None) -> JsonDict:
    """Pod ``pod`` of engine ``engine`` (``<group>-engine-<engine>-<pod>``)."""
    return build_pod(group, engine_identity(group, engine, pod), options or BuildOptions())


def agent_image(group: WeightSyncGroup, options: BuildOptions) -> str:
    image = group.spec.agent.image or options.agent_image
    if not image:
        raise BuildError(
            "NoAgentImage",
            "no agent image: set spec.agent.image, or install the operator with its default "
            f"agent image (environment variable {names.OPERATOR_ENV_AGENT_IMAGE})",
        )
    return image


def build_pod(group: WeightSyncGroup, who: PodIdentity, options: BuildOptions) -> JsonDict:
    spec = group.spec
    template = spec.trainer.template if who.role == "trainer" else spec.inference.template
    template = copy.deepcopy(template)
    tmeta: Mapping[str, Any] = template.get("metadata") or {}
    pod_spec: JsonDict = dict(template.get("spec") or {})
    containers: list[JsonDict] = [dict(c) for c in pod_spec.get("containers") or []]
    if not containers:
        raise BuildError("InvalidTemplate", f"{who.role} template has no containers")
    refused = template_refusals(group.metadata.name, who.role, template)
    if refused:
        raise BuildError("InvalidTemplate", "; ".join(refused))

    # --- metadata --------------------------------------------------------------------------------
    # The user's labels first, ours last (ours win).
    reserved = {names.LABEL_GROUP, names.LABEL_ROLE, names.LABEL_RANK, names.LABEL_ENGINE}
    labels: dict[str, str] = {
        **{k: v for k, v in (tmeta.get("labels") or {}).items() if k not in reserved},
        **group_labels(group),
        names.LABEL_ROLE: who.role,
        names.LABEL_RANK: who.rank_label,
    }
    if who.engine is not None:
        labels[names.LABEL_ENGINE] = str(who.engine)
    annotations: dict[str, str] = dict(tmeta.get("annotations") or {})
    annotations.pop(names.ANNOTATION_SPEC_HASH, None)
    if spec.rdma.networks:
        annotations[names.MULTUS_NETWORKS] = ",".join(spec.rdma.networks)
    meta = object_meta(group, who.name, annotations=annotations)
    meta["labels"] = labels

    # --- /dev/shm ----------------------------------------------------------------------------------
    volumes: list[JsonDict] = [dict(v) for v in pod_spec.get("volumes") or []]
    shm_volume = _existing_shm_volume(containers)
    if shm_volume is None:
        shm_volume = SHM_VOLUME
        volumes = [v for v in volumes if v.get("name") != SHM_VOLUME]
        volumes.append(
            {
                "name": SHM_VOLUME,
                "emptyDir": {"medium": "Memory", "sizeLimit": f"{spec.rdma.shm_size_gi_b}Gi"},
            }
        )

    # --- the agent's API credentials and scratch space (its volumes; only the agent mounts them) ----
    volumes = [v for v in volumes if v.get("name") not in AGENT_VOLUMES]
    volumes += agent_volumes(group)
    pod_spec["volumes"] = volumes

    # --- user containers ---------------------------------------------------------------------------
    rdma = spec.rdma
    identity = workload_env(group, who)
    for position, container in enumerate(containers):
        _add_shm_mount(container, shm_volume)
        for volume in AGENT_SECRET_VOLUMES:
            _drop_mount(container, volume)  # the agent's alone, even where a template names it
        if uses_rdma(spec):
            _add_capability(container, IPC_LOCK)
        if position == 0 and rdma.resource_name:
            _add_resource(container, rdma.resource_name, rdma.resource_count)
        # The engine container's token first, then its Mooncake range, then the pod's identity, then the user's.
        engine_only = [token_env(group), *mooncake_port_env(group)] if position == 0 and who.role == "engine" else []
        _put_env_first(container, [*engine_only, *identity])
    pod_spec["containers"] = containers

    # --- the agent sidecar ---------------------------------------------------------------------------
    init_containers = [dict(c) for c in pod_spec.get("initContainers") or [] if c.get("name") != AGENT_CONTAINER]
    for container in init_containers:
        for volume in AGENT_SECRET_VOLUMES:
            _drop_mount(container, volume)
        _put_env_first(container, identity)  # the user's init containers are theirs too (e.g. fetch by rank)
    agent = _agent_container(group, who, options, shm_volume)
    if who.role == "engine":
        agent["volumeMounts"] += engine_mounts_for_agent(containers[0], agent["volumeMounts"])
    init_containers.append(agent)
    pod_spec["initContainers"] = init_containers

    # --- pod-level settings ------------------------------------------------------------------------
    pod_spec["restartPolicy"] = "Always"
    pod_spec["hostname"] = who.name
    pod_spec["subdomain"] = names.service(group.metadata.name)
    pod_spec["serviceAccountName"] = names.agent_service_account(group.metadata.name)
    # No token for every container: the agent alone mounts one (agent_volumes), the user's containers get none.
    pod_spec["automountServiceAccountToken"] = False
    pod_spec.pop("serviceAccount", None)  # deprecated alias; would contradict serviceAccountName
    gates = [dict(g) for g in pod_spec.get("readinessGates") or []]
    if not any(g.get("conditionType") == names.CONDITION_AGENT_READY for g in gates):
        gates.append({"conditionType": names.CONDITION_AGENT_READY})
    pod_spec["readinessGates"] = gates
    if rdma.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    security = with_agent_group(pod_spec.get("securityContext"), agent_security_context(spec))
    if who.role == "trainer" and security:  # the files the agent shares with trainer code (with_agent_group)
        pod_spec["securityContext"] = security

    pod: JsonDict = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
    meta["annotations"] = {
        **meta.get("annotations", {}),
        names.ANNOTATION_SPEC_HASH: pod_spec_hash(pod),
    }
    return pod


def pod_spec_hash(pod: Mapping[str, Any]) -> str:
    """Hash of what the operator decides about a pod: labels, annotations (but the hash) and spec."""
    meta = pod.get("metadata") or {}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != names.ANNOTATION_SPEC_HASH}
    return content_hash({"labels": meta.get("labels") or {}, "annotations": annotations, "spec": pod.get("spec")})


def _agent_container(group: WeightSyncGroup, who: PodIdentity, options: BuildOptions, shm_volume: str) -> JsonDict:
    spec = group.spec
    agent = spec.agent
    container: JsonDict = {
        "name": AGENT_CONTAINER,
        "image": agent_image(group, options),
        "command": list(AGENT_COMMAND),
        "args": list(AGENT_ARGS),
        "restartPolicy": "Always",
        "ports": [{"name": names.AGENT_PORT_NAME, "containerPort": agent.port, "protocol": "TCP"}],
        "env": agent_env(group, who),
        "volumeMounts": [
            {"name": shm_volume, "mountPath": names.SHM_PATH},
            {"name": API_ACCESS_VOLUME, "mountPath": API_ACCESS_PATH, "readOnly": True},
            {"name": CREDENTIALS_VOLUME, "mountPath": names.CREDENTIALS_PATH, "readOnly": True},
            {"name": AGENT_TMP_VOLUME, "mountPath": AGENT_TMP_PATH},
        ],
        "securityContext": agent_security_context(spec),
    }
    if agent.site_packages is not None:
        container["volumeMounts"].append(
            {"name": SITE_PACKAGES_VOLUME, "mountPath": names.SITE_PACKAGES_PATH, "readOnly": True}
        )
    if agent.image_pull_policy:
        container["imagePullPolicy"] = agent.image_pull_policy
    if agent.resources:
        container["resources"] = {kind: dict(values) for kind, values in agent.resources.items()}
    if spec.rdma.resource_name:
        _add_resource(container, spec.rdma.resource_name, spec.rdma.resource_count)
    return container


def engine_mounts_for_agent(engine: Mapping[str, Any], agent_mounts: Sequence[Mapping[str, Any]]) -> list[JsonDict]:
    """The engine container's volume mounts, read-only, at the same paths, for the engine pod's agent: it runs the
    engine's own loader on the model the engine reports (``/server_info``'s ``model_path``: the shard-map trace, the
    engine-replica layout), so it must read what the engine reads, where the engine reads it. Left out: a mount at or
    around one of the agent's own paths (``/dev/shm``, ``/tmp``, its credentials, its site-packages) and one of the
    agent's volumes."""
    own = [str(m["mountPath"]).rstrip("/") or "/" for m in agent_mounts]
    taken = {str(m["name"]) for m in agent_mounts}

    def overlaps(path: str) -> bool:
        path = path.rstrip("/") or "/"
        return any(path == o or path.startswith(f"{o}/") or o.startswith(f"{path}/") or path == "/" for o in own)

    shared: list[JsonDict] = []
    for mount in engine.get("volumeMounts") or []:
        if mount.get("name") in taken or mount.get("name") in AGENT_VOLUMES or overlaps(str(mount.get("mountPath"))):
            continue
        copied = {k: v for k, v in mount.items() if k in ("name", "mountPath", "subPath", "subPathExpr")}
        shared.append({**copied, "readOnly": True})
    return shared


def uses_rdma(spec: WeightSyncGroupSpec) -> bool:
    """Whether the group's pods get RDMA devices, and so register memory (which needs ``IPC_LOCK``).

    ``transfer.protocol: rdma`` requires ``rdma.resourceName`` (CEL), and without the device plugin's resource a
    pod has no RDMA device, so ``auto`` falls back to TCP there: the resource is the one signal."""
    return spec.rdma.resource_name is not None


def agent_security_context(spec: WeightSyncGroupSpec) -> JsonDict:
    """Hardened defaults, overridden field by field by ``spec.agent.securityContext`` (a given ``capabilities``
    replaces ours whole)."""
    capabilities: JsonDict = {"drop": ["ALL"]}
    if uses_rdma(spec):
        capabilities["add"] = [IPC_LOCK]
    defaults: JsonDict = {
        "runAsNonRoot": True,
        "runAsUser": AGENT_UID,
        "runAsGroup": AGENT_UID,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": capabilities,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    overrides = spec.agent.security_context
    if overrides is None:
        return defaults
    return {**defaults, **overrides.model_dump(by_alias=True, exclude_none=True)}


def with_agent_group(pod_security: Mapping[str, Any] | None, agent_security: Mapping[str, Any]) -> JsonDict:
    """The pod's securityContext with the agent's group among every container's ``supplementalGroups``.

    A trainer pod's agent shares the replica files and the pod-local token with that group (0660, 0640: never
    world-readable; agent/weightsync_agent/shared_files.py), so trainer code running as any other non-root user can
    stage and publish. ``supplementalGroups`` changes no volume's ownership (``fsGroup`` would re-own the user's
    volumes); a template's ``fsGroup`` works as well (the shared files then take it). The user's settings are kept;
    the root group is never added."""
    merged: JsonDict = dict(pod_security or {})
    gid = agent_security.get("runAsGroup")
    groups = list(merged.get("supplementalGroups") or [])
    if isinstance(gid, int) and gid != 0 and gid not in groups:
        merged["supplementalGroups"] = [*groups, gid]
    return merged


def agent_volumes(group: WeightSyncGroup) -> list[JsonDict]:
    """The agent's API credentials (the kubelet's ``kube-api-access`` shape: a bound ServiceAccount token, the
    cluster CA, the namespace), the group's credential, its scratch space and, when the group names one, the claim
    holding its torch."""
    site_packages = group.spec.agent.site_packages
    claim: list[JsonDict] = []
    if site_packages is not None:
        claim.append(
            {
                "name": SITE_PACKAGES_VOLUME,
                "persistentVolumeClaim": {"claimName": site_packages.claim_name, "readOnly": True},
            }
        )
    return [
        {
            "name": API_ACCESS_VOLUME,
            "projected": {
                "defaultMode": 0o644,
                "sources": [
                    {"serviceAccountToken": {"path": "token", "expirationSeconds": API_TOKEN_SECONDS}},
                    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    {
                        "downwardAPI": {
                            "items": [
                                {
                                    "path": "namespace",
                                    "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                                }
                            ]
                        }
                    },
                ],
            },
        },
        credentials_volume(group, CREDENTIALS_VOLUME),
        {"name": AGENT_TMP_VOLUME, "emptyDir": {"sizeLimit": AGENT_TMP_SIZE}},
        *claim,
    ]


def agent_env(group: WeightSyncGroup, who: PodIdentity) -> list[JsonDict]:
    """The agent's environment: its identity in the group and where to find the plan."""
    spec = group.spec
    values = [
        *identity_values(group, who),
        (names.ENV_PLAN_CONFIG_MAP, names.plan_config_map(group.metadata.name)),
        (names.ENV_AGENT_PORT, str(spec.agent.port)),
    ]
    values.append((names.ENV_DEVICES, ",".join(spec.rdma.devices)))
    env: list[JsonDict] = [{"name": key, "value": value} for key, value in values]
    env += [
        {"name": names.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": names.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": names.ENV_CREDENTIALS_DIR, "value": names.CREDENTIALS_PATH},
    ]
    return env


def mooncake_port_env(group: WeightSyncGroup) -> list[JsonDict]:
    """``transfer.mooncakePorts`` as Mooncake's own variables, for the engine container: the reference engine's
    and stock SGLang's Mooncake engines bind inside the range the group's NetworkPolicy opens."""
    ports = group.spec.transfer.mooncake_ports
    return [
        {"name": names.ENV_MOONCAKE_MIN_PORT, "value": str(ports.start)},
        {"name": names.ENV_MOONCAKE_MAX_PORT, "value": str(ports.end)},
    ]


def _existing_shm_volume(containers: Sequence[Mapping[str, Any]]) -> str | None:
    """The volume the template already mounts at /dev/shm, if any (then the agent shares that one)."""
    for container in containers:
        for mount in container.get("volumeMounts") or []:
            if mount.get("mountPath") == names.SHM_PATH and mount.get("name"):
                return str(mount["name"])
    return None


def _add_shm_mount(container: JsonDict, volume: str) -> None:
    mounts = [dict(m) for m in container.get("volumeMounts") or []]
    if not any(m.get("mountPath") == names.SHM_PATH for m in mounts):
        mounts.append({"name": volume, "mountPath": names.SHM_PATH})
    container["volumeMounts"] = mounts


def _drop_mount(container: JsonDict, volume: str) -> None:
    if any(m.get("name") == volume for m in container.get("volumeMounts") or []):
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m.get("name") != volume]


def _put_env_first(container: JsonDict, items: Sequence[JsonDict]) -> None:
    """Put ``items`` first in the container's env, in order, dropping the user's variables of those names (ours
    win: a template's ``WEIGHTSYNC_NODE_RANK`` would give every pod the same rank; its ``WEIGHTSYNC_GROUP_TOKEN`` a
    guessable credential). ``$(VAR)`` in command and args sees every variable, but in another variable's value only
    those defined before it: first, the user's may use them. An ``envFrom`` key never overrides an ``env`` entry."""
    ours = {item["name"] for item in items}
    env = [dict(e) for e in container.get("env") or [] if e.get("name") not in ours]
    container["env"] = [*items, *env]


def _add_capability(container: JsonDict, capability: str) -> None:
    security: JsonDict = dict(container.get("securityContext") or {})
    capabilities: JsonDict = dict(security.get("capabilities") or {})
    added = list(capabilities.get("add") or [])
    if capability not in added:
        added.append(capability)
    capabilities["add"] = added
    security["capabilities"] = capabilities
    container["securityContext"] = security


def _add_resource(container: JsonDict, name: str, count: int) -> None:
    resources: JsonDict = dict(container.get("resources") or {})
    for kind in ("requests", "limits"):
        values: JsonDict = dict(resources.get(kind) or {})
        values[name] = count
        resources[kind] = values
    container["resources"] = resources
