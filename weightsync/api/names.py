"""Names, labels, annotations and environment variables shared by the operator and the agents.

Everything one side writes and the other reads is spelled here, once.
"""

from __future__ import annotations

from typing import Final, Literal

Role = Literal["trainer", "engine"]

# --- Object names --------------------------------------------------------------------------------


def trainer_pod(group: str, index: int) -> str:
    return f"{group}-trainer-{index}"


def engine_pod(group: str, engine: int, pod: int) -> str:
    return f"{group}-engine-{engine}-{pod}"


def plan_config_map(group: str) -> str:
    return f"{group}-plan"


def service(group: str) -> str:
    """The headless Service; pods get DNS names ``<pod>.<group>.<namespace>.svc``."""
    return group


def pod_address(group: str, namespace: str, pod: str) -> str:
    """A group's pod's stable DNS name through the headless Service (the pod's ``hostname`` is its name, its
    ``subdomain`` the Service): resolvable from any pod of the cluster, the pod itself included, without knowing the
    cluster's domain (the resolver's search path ends in it)."""
    return f"{pod}.{service(group)}.{namespace}.svc"


def agent_service_account(group: str) -> str:
    return f"{group}-agent"


def group_secret(group: str) -> str:
    """The group's credential: a Secret holding one random token under :data:`SECRET_TOKEN_KEY` (docs/security.md)."""
    return f"{group}-credentials"


def network_policy(group: str) -> str:
    """The group's NetworkPolicy: ingress to its pods (docs/security.md, "The data plane")."""
    return f"{group}-ingress"


def mesh_policy(group: str, role: str) -> str:
    """A p2p group's NetworkPolicy between the pods of its multi-pod trainer or engines (``role``): every port,
    for their launchers' rendezvous and collectives (docs/workload-identity.md)."""
    return f"{group}-{role}-mesh"


# --- Labels --------------------------------------------------------------------------------------
LABEL_GROUP: Final = "weightsync.io/group"
LABEL_ROLE: Final = "weightsync.io/role"
LABEL_RANK: Final = "weightsync.io/rank"  # trainer: pod index; engine: "<engine>-<pod>"
LABEL_ENGINE: Final = "weightsync.io/engine"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "weightsync-operator"

# --- Annotations ---------------------------------------------------------------------------------
ANNOTATION_PLAN_HASH: Final = "weightsync.io/plan-hash"
#: On the plan ConfigMap: the plan's revision (bumped whenever the hash changes).
ANNOTATION_PLAN_REVISION: Final = "weightsync.io/plan-revision"
ANNOTATION_SPEC_HASH: Final = "weightsync.io/pod-spec-hash"
#: Written by agents on their own pod: the newest version the engine fully holds (targets) or has
#: published (sources).
ANNOTATION_WEIGHT_VERSION: Final = "weightsync.io/weight-version"
#: Written by the coordinating agent on its own pod: JSON of the last round (see SyncStatus).
ANNOTATION_LAST_ROUND: Final = "weightsync.io/last-round"
#: Written by an engine's agent (pod 0 of the engine) on its own pod: the engine's HTTP base URL, where
#: sources fetch manifests and the coordinator pauses, verifies and commits.
ANNOTATION_ENGINE_URL: Final = "weightsync.io/engine-url"
#: Written by an engine's first pod's agent on its own pod once its manifests are served: JSON, how many of the engine's
#: ranks each path syncs (``{"trace": 2, "engine-replica": 0}``, docs/engines/engine-replicas.md).
ANNOTATION_SYNC_PATHS: Final = "weightsync.io/sync-paths"
#: Written by a trainer pod's agent, and by an engine's first pod's agent, on its own pod: the agent's
#: HTTP base URL (the coordinator's way to ask that pod's sources to write; where adapters whose
#: manifests the engine's agent assembles, such as SGLang's, fetch them).
ANNOTATION_AGENT_URL: Final = "weightsync.io/agent-url"
MULTUS_NETWORKS: Final = "k8s.v1.cni.cncf.io/networks"

# --- Pod readiness gate / condition written by agents --------------------------------------------
CONDITION_AGENT_READY: Final = "weightsync.io/agent-ready"

# --- Environment the operator gives each agent ---------------------------------------------------
ENV_GROUP: Final = "WEIGHTSYNC_GROUP"
ENV_NAMESPACE: Final = "WEIGHTSYNC_NAMESPACE"
ENV_ROLE: Final = "WEIGHTSYNC_ROLE"
ENV_POD_INDEX: Final = "WEIGHTSYNC_POD_INDEX"  # trainer pod index, or pod index inside its engine
ENV_ENGINE_INDEX: Final = "WEIGHTSYNC_ENGINE_INDEX"
ENV_RANKS: Final = "WEIGHTSYNC_RANKS"  # comma-separated global trainer ranks, or engine ranks
ENV_PLAN_CONFIG_MAP: Final = "WEIGHTSYNC_PLAN_CONFIGMAP"
ENV_PLAN_FILE: Final = "WEIGHTSYNC_PLAN_FILE"  # local runs without a cluster
ENV_AGENT_PORT: Final = "WEIGHTSYNC_AGENT_PORT"
ENV_DEVICES: Final = "WEIGHTSYNC_RDMA_DEVICES"
#: The engine's HTTP base URL as the engine's agent should advertise it (default: POD_IP + engine port).
ENV_ENGINE_URL: Final = "WEIGHTSYNC_ENGINE_URL"
#: Where the agent says it can be reached (default: POD_IP + agent port).
ENV_AGENT_URL: Final = "WEIGHTSYNC_AGENT_URL"
#: ``1``: peers' advertised URLs may name loopback as well as their pod's own IPs. Only the local cluster sets it
#: (its agents are local processes on 127.0.0.1, bound to pods whose ``podIP`` is kwok's); never the operator.
ENV_LOOPBACK_PEERS: Final = "WEIGHTSYNC_LOOPBACK_PEERS"
#: Local runs without a cluster: JSON ``{"engines": {"0": url}, "trainers": {"0": url}}`` naming every
#: engine's and trainer pod's URL (instead of reading pod annotations).
ENV_DIRECTORY_FILE: Final = "WEIGHTSYNC_DIRECTORY_FILE"
#: Folder holding a trainer rank's replica files (``<fingerprint>.replica``); the sidecar creates
#: them, the trainer attaches.
ENV_REPLICA_PATH: Final = "WEIGHTSYNC_REPLICA_PATH"
#: Which of ``WEIGHTSYNC_RANKS`` a trainer process is, when the pod runs several.
ENV_SOURCE_RANK: Final = "WEIGHTSYNC_SOURCE_RANK"
#: The group's credential (a bearer token): projected from the group's Secret into the agent container and
#: the engine container only. Every mutating or weight-revealing route of agents and engines requires it.
ENV_GROUP_TOKEN: Final = "WEIGHTSYNC_GROUP_TOKEN"
#: Where the agent reads the group's credential as files (``token``, ``previous``): the group's Secret as a
#: volume in the agent container only, which kubelets refresh in place, so a rotation reaches running agents.
#: Unset (local runs): the agent uses :data:`ENV_GROUP_TOKEN`.
ENV_CREDENTIALS_DIR: Final = "WEIGHTSYNC_CREDENTIALS_DIR"
CREDENTIALS_PATH: Final = "/var/run/weightsync/credentials"
ENV_POD_NAME: Final = "POD_NAME"
ENV_POD_IP: Final = "POD_IP"

# --- Workload identity: what the operator gives the user's containers --------------------------------
# Besides the agent's own group, namespace, role, pod index, engine index, ranks and agent port (what
# ``WeightSyncClient.from_env`` reads), a pod's place in its trainer or engine, named for launchers' flags
# (``torchrun --nnodes $(WEIGHTSYNC_NNODES) ...``; docs/workload-identity.md). "Node" is a pod: each launcher
# calls one host of a multi-host job a node.
#: Pods of this pod's trainer (``trainer.replicas``), or of its engine (``ranksPerEngine / ranksPerPod``).
ENV_NNODES: Final = "WEIGHTSYNC_NNODES"
#: This pod's index within its trainer or engine (= ``WEIGHTSYNC_POD_INDEX``), 0..NNODES-1.
ENV_NODE_RANK: Final = "WEIGHTSYNC_NODE_RANK"
#: Ranks (processes, GPUs) per pod: ``trainer.ranksPerPod`` or ``inference.ranksPerPod``.
ENV_NPROC_PER_NODE: Final = "WEIGHTSYNC_NPROC_PER_NODE"
#: Ranks of this pod's whole trainer (``replicas * ranksPerPod``) or engine (``ranksPerEngine``: its TP size).
ENV_WORLD_SIZE: Final = "WEIGHTSYNC_WORLD_SIZE"
#: The stable DNS name of pod 0 of this pod's trainer or engine (:func:`pod_address`).
ENV_LEADER_ADDR: Final = "WEIGHTSYNC_LEADER_ADDR"
#: The port the leader's rendezvous / dist-init store listens on (:data:`RENDEZVOUS_PORT`).
ENV_LEADER_PORT: Final = "WEIGHTSYNC_LEADER_PORT"
#: ``<leader addr>:<leader port>``: torchrun's ``--rdzv-endpoint``, SGLang's ``--dist-init-addr``.
ENV_DIST_INIT_ADDR: Final = "WEIGHTSYNC_DIST_INIT_ADDR"
#: The leader's rendezvous port: torch's own default (``MASTER_PORT``, torchrun's ``--master-port``). Outside the
#: default Mooncake range (15000-17000) and Linux's ephemeral ports; another port works with
#: ``$(WEIGHTSYNC_LEADER_ADDR):<port>``.
RENDEZVOUS_PORT: Final = 29500

#: Plan ConfigMap data key.
PLAN_KEY: Final = "plan.json"
#: Plan ConfigMap data key of the plan's seal: an HMAC of :data:`PLAN_KEY`'s text keyed with the group's token
#: (``weightsync.plan.seal``): what agents check a plan came from the operator by.
PLAN_SEAL_KEY: Final = "plan.seal"
#: The group Secret's data key holding the token.
SECRET_TOKEN_KEY: Final = "token"
#: The group Secret's data key holding the token before the last rotation, accepted until the rotation is
#: finished (``weightsync rotate-token``; docs/security.md, "Rotating the token").
SECRET_PREVIOUS_KEY: Final = "previous"
#: In a trainer rank's replica folder: the token the pod's own agent accepts from trainer code on
#: ``/v1/publish`` and ``/v1/state`` only (written by the agent, mode 0640; never the group's token).
TRAINER_TOKEN_FILE: Final = "agent.token"

#: Named port of the agent on every pod and on the headless Service.
AGENT_PORT_NAME: Final = "agent"
#: Where the memory-backed volume shared by the user's containers and the agent is mounted (it holds
#: the CPU replica).
SHM_PATH: Final = "/dev/shm"
#: Where an agent image built with ``TORCH=node`` (agent/Dockerfile) finds torch: a Python site-packages the node
#: provides, mounted read-only from the claim ``spec.agent.sitePackages`` names (docs/local-cluster.md, "Images").
SITE_PACKAGES_PATH: Final = "/opt/weightsync/node-python"

# --- The operator's own environment (set by the Helm chart) --------------------------------------
#: Agent image used when a group sets no ``spec.agent.image``.
OPERATOR_ENV_AGENT_IMAGE: Final = "WEIGHTSYNC_AGENT_IMAGE"
#: Seconds between periodic reconciles of every group (default 30).
OPERATOR_ENV_RESYNC_SECONDS: Final = "WEIGHTSYNC_RESYNC_SECONDS"


# --- Mooncake's own settings ---------------------------------------------------------------------
#: Mooncake's port range (read once per process, at its first engine; config.cpp): every Mooncake engine of a
#: process binds its handshake/RPC port and its TCP data port inside [min, max]. The agents set them from the
#: plan (``transfer.mooncakePorts``); the operator puts them into the engine container's environment, which is
#: how the reference engine and stock SGLang (whose Mooncake reads the same variables) get them.
ENV_MOONCAKE_MIN_PORT: Final = "MC_MIN_RPC_PORT"
ENV_MOONCAKE_MAX_PORT: Final = "MC_MAX_RPC_PORT"

#: How a round's reason begins when a scrub found engines serving other bytes than the committed version's
#: (agent: ``rounds/coordinator.py``; the operator turns it into a ``WeightsDrifted`` Warning event).
DRIFT_FOUND: Final = "scrub found drift"
