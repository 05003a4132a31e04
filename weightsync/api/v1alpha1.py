"""The ``WeightSyncGroup`` API (``weightsync.io/v1alpha1``), defined once.

These pydantic models are the single definition of the resource: the CRD in ``crds/`` is generated
from them (``weightsync crd``), the operator and the CLI parse objects with them, and the CEL rules
attached here are what the API server enforces. Field names are the camelCase names users write in
YAML; Python code uses the snake_case attributes.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, AliasGenerator, BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from weightsync.api.cel import CelRule
from weightsync.api.engines import Adapter, Request, Staging, SyncModeName
from weightsync.api.pause import PausePolicy
from weightsync.api.timeouts import Timeouts

GROUP = "weightsync.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "WeightSyncGroup"
PLURAL = "weightsyncgroups"
SINGULAR = "weightsyncgroup"
SHORT_NAMES = ("wsg",)
CATEGORIES = ("weightsync",)

#: Name of the agent sidecar container the operator adds to every pod.
AGENT_CONTAINER = "weightsync-agent"

#: Longest group name: pod names ``<group>-engine-<e>-<j>`` must stay valid hostnames (63 characters).
MAX_NAME_LENGTH = 40
#: Most ranks on either side of one group; also bounds the plan's size.
MAX_RANKS = 16384
#: Largest weight version: versions travel as JSON numbers, which a float or JavaScript reader rounds above 2^53.
MAX_WEIGHT_VERSION = 2**53 - 1
#: Default ``transfer.maxVersionStep``: how far past the committed version (or past 0, before any) a published
#: version may jump. Versions only move forward, so one huge version (a bug, or a trainer rank's code gone wrong)
#: would otherwise refuse every later one for good; 2^20 steps is more than any training run publishes.
DEFAULT_MAX_VERSION_STEP = 1 << 20
#: The longest scrub period (a day); 0 turns scrubbing off.
MAX_SCRUB_SECONDS = 86400


def rules(*items: CelRule) -> dict[str, Any]:
    """``json_schema_extra`` payload that carries CEL rules into the generated CRD."""
    return {"x-kubernetes-validations": [item.to_schema() for item in items]}


def immutable(path: str, why: str) -> CelRule:
    return CelRule(rule="self == oldSelf", message=f"{path} is immutable: {why}")


#: Planner policies (weightsync/plan/policies.py), spelled once.
Planner = Literal["balanced", "miles"]

#: A Multus network reference: ``[namespace/]name[@interface]`` (namespace a DNS label, name a lower-case DNS
#: subdomain, interface a Linux interface name), so nothing else reaches the pod annotation.
MULTUS_NETWORK: Final = (
    r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/)?[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?(@[A-Za-z0-9_.-]{1,15})?$"
)


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=AliasGenerator(validation_alias=to_camel, serialization_alias=to_camel),
        populate_by_name=True,
        extra="forbid",
    )


class SpecModel(ApiModel):
    """Spec objects are parsed strictly: "2" is not an integer here, as it is not on the API server."""

    model_config = ConfigDict(strict=True)


# --- Pod templates -------------------------------------------------------------------------------
# The full PodTemplateSpec schema is the API server's business; we check only what we rely on
# (at least one container, named) and preserve the rest untouched.

#: A container name, a label value: what the API server will demand of the pods, checked when the group is applied
#: (not when the operator first creates a pod and the group is already accepted).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
#: An image reference: registry/path:tag@digest characters only (no spaces, quotes or control characters).
IMAGE_REF = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$"

_CONTAINER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "x-kubernetes-preserve-unknown-fields": True,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": DNS_LABEL},
        "image": {"type": "string", "maxLength": 512, "pattern": IMAGE_REF},
    },
}

POD_TEMPLATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "A PodTemplateSpec for the user's own container(s); the operator adds the agent sidecar, "
    "RDMA resources and labels to it.",
    "required": ["spec"],
    "properties": {
        "metadata": {
            "type": "object",
            "properties": {
                "labels": {
                    "type": "object",
                    "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE},
                },
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "required": ["containers"],
            "properties": {
                "containers": {"type": "array", "minItems": 1, "items": _CONTAINER_SCHEMA},
                "initContainers": {"type": "array", "items": _CONTAINER_SCHEMA},
            },
            "x-kubernetes-validations": [
                CelRule(
                    rule=f"!self.containers.exists(c, c.name == '{AGENT_CONTAINER}')",
                    message=f"container name '{AGENT_CONTAINER}' is reserved for the sidecar the operator adds",
                ).to_schema(),
            ],
        },
    },
}


def _check_template(value: dict[str, Any]) -> dict[str, Any]:
    """The schema's checks on a template, for parsing outside the API server (same wording)."""
    spec = value.get("spec")
    if not isinstance(spec, dict):
        raise ValueError("template.spec is required: a PodSpec with your container")
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise ValueError("template.spec.containers should have at least 1 items: the pod needs your container")
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            if not isinstance(container, dict) or not isinstance(container.get("name"), str) or not container["name"]:
                raise ValueError(f"template.spec.{key}: every container needs a name")
            name, image = container["name"], container.get("image")
            if len(name) > 63 or not re.match(DNS_LABEL, name):
                raise ValueError(f"template.spec.{key}: container name {name[:80]!r} should match {DNS_LABEL!r}")
            if isinstance(image, str) and (len(image) > 512 or not re.match(IMAGE_REF, image)):
                raise ValueError(f"template.spec.{key}: image {image[:80]!r} should match {IMAGE_REF!r}")
    labels = (value.get("metadata") or {}).get("labels") or {}
    for key, label in labels.items() if isinstance(labels, dict) else ():
        if not isinstance(label, str) or len(label) > 63 or not re.match(LABEL_VALUE, label):
            raise ValueError(f"template.metadata.labels.{key}: {str(label)[:80]!r} should match {LABEL_VALUE!r}")
    return value


PodTemplate = Annotated[dict[str, Any], AfterValidator(_check_template), WithJsonSchema(POD_TEMPLATE_SCHEMA)]


# --- Spec ----------------------------------------------------------------------------------------


class TrainerSpec(SpecModel):
    """The training side: every trainer rank is a source of weights."""

    replicas: int = Field(ge=1, le=4096, description="Trainer pods.")
    ranks_per_pod: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Trainer ranks (GPUs) per pod; each rank is one source in the plan.",
        json_schema_extra=rules(immutable("trainer.ranksPerPod", "rank identity is fixed for a group's life")),
    )
    template: PodTemplate

    @property
    def sources(self) -> int:
        return self.replicas * self.ranks_per_pod


class InferenceSpec(SpecModel):
    """The inference side: every (engine, engine rank) pair is a target in the plan."""

    engines: int = Field(ge=1, le=4096, description="Inference engines (data-parallel replicas).")
    ranks_per_engine: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Ranks per engine (its tensor-parallel size); each rank holds one shard of the weights.",
        json_schema_extra=rules(
            immutable("inference.ranksPerEngine", "an engine's shard layout cannot change while it runs")
        ),
    )
    ranks_per_pod: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Engine ranks (GPUs) per inference pod.",
        json_schema_extra=rules(immutable("inference.ranksPerPod", "rank identity is fixed for a group's life")),
    )
    template: PodTemplate
    adapter: Adapter = Field(
        default="sglang",
        description="How the agent talks to the engine: a stock SGLang server, a stock vLLM server with weightsync's "
        "backend plugin, or weightsync's reference engine.",
        json_schema_extra=rules(immutable("inference.adapter", "the engine kind cannot change under its agents")),
    )
    port: int = Field(default=30000, ge=1, le=65535, description="The engine's HTTP port inside the pod.")

    @property
    def targets(self) -> int:
        return self.engines * self.ranks_per_engine

    @property
    def pods_per_engine(self) -> int:
        return self.ranks_per_engine // self.ranks_per_pod


#: Mooncake refuses a port range that touches Linux's ephemeral range (32768-60999) and silently falls back to
#: 15000-17000 instead (``ValidatePortRange`` in Mooncake's config.cpp): refused here, where users see why.
EPHEMERAL_PORTS: Final = (32768, 60999)
#: Most ports one Mooncake range may span: bounds what a NetworkPolicy opens.
MAX_PORT_RANGE: Final = 4096


class PortRange(SpecModel):
    """An inclusive range of TCP ports."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            CelRule(rule="self.start <= self.end", message="start must not be greater than end", field_path=".start"),
            CelRule(
                rule=f"self.end - self.start < {MAX_PORT_RANGE}",
                message=f"the range may span at most {MAX_PORT_RANGE} ports",
                field_path=".end",
            ),
            CelRule(
                rule=f"self.end < {EPHEMERAL_PORTS[0]} || self.start > {EPHEMERAL_PORTS[1]}",
                message=f"the range must lie outside {EPHEMERAL_PORTS[0]}-{EPHEMERAL_PORTS[1]} (Linux's ephemeral "
                "ports, which Mooncake refuses: it would silently fall back to 15000-17000)",
                field_path=".start",
            ),
        )
    )

    start: int = Field(ge=1024, le=65535, description="First port (1024-65535).")
    end: int = Field(ge=1024, le=65535, description="Last port, inclusive (1024-65535).")

    @property
    def size(self) -> int:
        return self.end - self.start + 1


class TransferSpec(SpecModel):
    """How weights move."""

    mode: SyncModeName = Field(
        default="p2p",
        description="p2p: every trainer rank writes its planned targets (one-sided RDMA/TCP writes). "
        "broadcast: trainer rank 0 broadcasts to every inference rank (torch.distributed).",
    )
    protocol: Literal["auto", "rdma", "tcp"] = Field(
        default="auto", description="Transport for p2p: RDMA when a NIC is present (auto), or forced."
    )
    planner: Planner = Field(
        default="balanced",
        description="balanced: even bytes per source, fewest replica shapes. "
        "miles: the published SGLang/Miles round-robin rule.",
    )
    max_replica_shapes_per_source: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Cap on distinct engine-rank replicas one trainer rank holds in CPU memory (balanced only).",
    )
    bucket_size_mi_b: int = Field(
        default=512,
        ge=1,
        le=16384,
        alias="bucketSizeMiB",
        description="Bytes per transfer bucket, in MiB (1 to 16384).",
    )
    timeout_seconds: int = Field(
        default=300, ge=1, le=86400, description="A sync round that takes longer than this is aborted."
    )
    verify: bool = Field(default=True, description="Targets verify per-bucket checksums before a version commits.")
    target_staging: Staging = Field(
        default="live",
        description="live: write into the engine's weights while it is paused. "
        "staged: write into a staging area, copy on commit; the engine keeps serving meanwhile.",
    )
    mooncake_ports: PortRange = Field(
        default_factory=lambda: PortRange(start=15000, end=17000),
        json_schema_extra={"default": {"start": 15000, "end": 17000}},
        description="Where every Mooncake engine of the group listens (its handshake/RPC port and its TCP data "
        "port, two per engine; an agent opens one engine per peer it writes to): the agents, the reference engine "
        "and stock SGLang (through MC_MIN_RPC_PORT/MC_MAX_RPC_PORT) bind inside it, and the group's NetworkPolicy "
        "opens it to the group's pods only. Default: Mooncake's own 15000-17000.",
    )
    max_version_step: int = Field(
        default=DEFAULT_MAX_VERSION_STEP,
        ge=1,
        le=MAX_WEIGHT_VERSION,
        description="How far a published version may jump past the committed one (past 0 before any is committed): "
        "a version further ahead is refused, the committed version kept. Versions only move forward, so this "
        "keeps one huge version from refusing every later one. Default 2^20; raise it for versions that are not "
        "step counts (timestamps).",
    )
    scrub_seconds: int = Field(
        default=0,
        ge=0,
        le=MAX_SCRUB_SECONDS,
        description="Scrubbing: every this many seconds, between rounds, the coordinator has each engine's own checker "
        "hash the weights it serves and compares them with the committed version's verified checksums; an engine "
        "that drifted (a foreign write, a flipped bit) is named in the status and repaired from the replicas by a "
        "catch-up, without a new version. Each scrub costs one checksum pass over every engine's weights. 0 (the "
        "default): off. Engines whose adapter has no out-of-round checker (vLLM) are not scrubbed.",
    )
    pause: PausePolicy = Field(
        default="minimal",
        description="When live engines are paused for a version the trainer streams (stages while its sources "
        "already write). minimal (the default): the engines keep serving until every byte of the version is staged, "
        "then pause only for the write, verify and commit; a round from stage to commit takes staging plus writing. "
        "overlap: the engines pause at the first write and wait through the rest of the staging; the shortest "
        "round, the longest pause. Staged targets (targetStaging: staged) get both either way: the writes stream into "
        "the staging area while the engines serve, and they pause only to apply. Each round records which ran "
        "(status.lastSync.pausePolicy).",
    )

    @property
    def request(self) -> Request:
        """What this transfer asks of the engines' adapter (checked by ``weightsync.api.engines.refusal``)."""
        return Request(mode=self.mode, staging=self.target_staging, verify=self.verify)

    @property
    def timeouts(self) -> Timeouts:
        """Every timeout of a round, each with one job, from ``timeoutSeconds``."""
        return Timeouts.of(self.timeout_seconds)

    @property
    def bucket_bytes(self) -> int:
        """``bucketSizeMiB`` in bytes: the one place the unit is converted."""
        return self.bucket_size_mi_b << 20


_EXTENDED_RESOURCE = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


class RdmaSpec(SpecModel):
    """RDMA plumbing; every cluster's device plugin names things differently, so nothing is assumed."""

    resource_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=_EXTENDED_RESOURCE,
        description="Extended resource of the RDMA device plugin, e.g. rdma/hca_shared_devices_a or rdma/ib.",
    )
    resource_count: int = Field(default=1, ge=1, le=64, description="How many of resourceName each pod requests.")
    networks: list[Annotated[str, Field(min_length=1, max_length=253, pattern=MULTUS_NETWORK)]] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        max_length=16,
        description="Multus networks for the k8s.v1.cni.cncf.io/networks annotation: [namespace/]name[@interface], "
        "namespace a DNS label, name a NetworkAttachmentDefinition name (lower-case DNS subdomain).",
    )
    host_network: bool = Field(default=False, description="Run pods in the host's network namespace.")
    devices: list[Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        max_length=32,
        description="NIC names (e.g. mlx5_0) the transfer engine may use; empty lets it discover them.",
    )
    shm_size_gi_b: int = Field(
        default=16,
        ge=1,
        le=4096,
        alias="shmSizeGiB",
        description="Size of the memory-backed /dev/shm, in GiB (it holds the CPU replica).",
    )


_QUANTITIES: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",  # noqa: E501
    },
}
_RESOURCES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"requests": _QUANTITIES, "limits": _QUANTITIES},
}


_CAPABILITY = r"^[A-Z][A-Z0-9_]{0,31}$"


class Capabilities(SpecModel):
    """Linux capabilities, as in a container's securityContext (``ALL``, ``IPC_LOCK``, ...)."""

    add: list[Annotated[str, Field(pattern=_CAPABILITY)]] | None = Field(default=None, max_length=16)
    drop: list[Annotated[str, Field(pattern=_CAPABILITY)]] | None = Field(default=None, max_length=16)


class SeccompProfile(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=rules(
            CelRule(
                rule="(self.type == 'Localhost') == has(self.localhostProfile)",
                message="seccompProfile.localhostProfile is required with type Localhost, and only with it",
            )
        )
    )

    type: Literal["RuntimeDefault", "Localhost", "Unconfined"]
    localhost_profile: str | None = Field(default=None, min_length=1, max_length=253)


class AgentSecurityContext(SpecModel):
    """The agent container's securityContext: each field given replaces the operator's hardened default for it
    (docs/security.md, "Least privilege"); the fields not listed here (``privileged``, ``procMount``, ...)
    cannot be set, so the agent can be loosened only as far as these say."""

    run_as_user: int | None = Field(default=None, ge=0, le=2**31 - 1)
    run_as_group: int | None = Field(default=None, ge=0, le=2**31 - 1)
    run_as_non_root: bool | None = None
    allow_privilege_escalation: bool | None = None
    read_only_root_filesystem: bool | None = None
    capabilities: Capabilities | None = Field(
        default=None, description="Replaces the default (drop ALL, add IPC_LOCK when the group uses RDMA) whole."
    )
    seccomp_profile: SeccompProfile | None = None


#: A PersistentVolumeClaim's name (a DNS-1123 subdomain).
_CLAIM_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class AgentSitePackages(SpecModel):
    """A Python site-packages holding torch for an agent image built without it (``TORCH=node``)."""

    claim_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=_CLAIM_NAME,
        description="A PersistentVolumeClaim in the group's namespace, mounted read-only in the agent container only "
        "at /opt/weightsync/node-python; it must hold a site-packages for the image's Python (3.11) with torch.",
    )


class AgentSpec(SpecModel):
    """The weightsync agent sidecar."""

    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        pattern=IMAGE_REF,
        description="Agent image; defaults to the one the operator was installed with.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    resources: Annotated[dict[str, dict[str, int | str]], WithJsonSchema(_RESOURCES_SCHEMA)] | None = Field(
        default=None, description="ResourceRequirements for the sidecar (requests/limits)."
    )
    port: int = Field(default=9470, ge=1, le=65535, description="Agent HTTP port (control, metrics).")
    security_context: AgentSecurityContext | None = Field(
        default=None,
        description="Overrides of the agent container's hardened securityContext (non-root uid 65532, no privilege "
        "escalation, drop ALL, RuntimeDefault seccomp, read-only root filesystem), field by field.",
    )
    site_packages: AgentSitePackages | None = Field(
        default=None,
        description="For an agent image built with TORCH=node (no torch of its own): where its torch comes from.",
    )


# --- Network policy ------------------------------------------------------------------------------
# A NetworkPolicyPeer as Kubernetes defines it, bounded: selectors of at most 16 labels/expressions.

_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
LabelKey = Annotated[str, Field(min_length=1, max_length=317, pattern=_LABEL_KEY)]
LabelValue = Annotated[str, Field(max_length=63, pattern=_LABEL_VALUE)]


class SelectorRequirement(SpecModel):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[LabelValue] = Field(default_factory=list, json_schema_extra={"default": []}, max_length=64)


class LabelSelector(SpecModel):
    """metav1.LabelSelector; empty selects everything (every pod, or every namespace)."""

    # Keys and values are checked by the API server when the operator applies the policy; here only sizes.
    match_labels: Annotated[
        dict[Annotated[str, Field(max_length=317)], Annotated[str, Field(max_length=63)]],
        WithJsonSchema(
            {
                "type": "object",
                "maxProperties": 16,
                "additionalProperties": {"type": "string", "maxLength": 63},
            }
        ),
    ] = Field(default_factory=dict, max_length=16)
    match_expressions: list[SelectorRequirement] = Field(
        default_factory=list, json_schema_extra={"default": []}, max_length=16
    )


#: The shape of an IPv4 or IPv6 CIDR; the API server checks the addresses when the operator applies the policy.
Cidr = Annotated[str, Field(min_length=9, max_length=49, pattern=r"^[0-9a-fA-F:.]+/[0-9]{1,3}$")]


class IpBlock(SpecModel):
    cidr: Cidr = Field(description="e.g. 10.0.0.0/8")
    except_: list[Cidr] = Field(default_factory=list, alias="except", json_schema_extra={"default": []}, max_length=16)


class NetworkPeer(SpecModel):
    """A networking.k8s.io/v1 NetworkPolicyPeer: pods (of this namespace, or of the selected namespaces) or an
    IP block. ``podSelector: {}`` is every pod of the group's namespace; ``namespaceSelector: {}`` every pod."""

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IpBlock | None = None


#: Every pod of the group's namespace: who may reach the engines' serving port unless the spec says otherwise.
SAME_NAMESPACE: Final[dict[str, Any]] = {"podSelector": {}}


def _peer_rules(field: str) -> list[CelRule]:
    # On the list's parent, not on the peer: the local checker (weightsync.api.load) does not descend arrays. The
    # API server also checks the rules against the parent's schema default ({}), where the lists are absent.
    return [
        CelRule(
            rule=f"!has(self.{field}) || "
            f"self.{field}.all(p, has(p.podSelector) || has(p.namespaceSelector) || has(p.ipBlock))",
            message=f"every entry of {field} needs podSelector, namespaceSelector or ipBlock",
            field_path=f".{field}",
        ),
        CelRule(
            rule=f"!has(self.{field}) || "
            f"self.{field}.all(p, !has(p.ipBlock) || !(has(p.podSelector) || has(p.namespaceSelector)))",
            message=f"{field}: ipBlock cannot be combined with podSelector or namespaceSelector in one entry",
            field_path=f".{field}",
        ),
    ]


class NetworkPolicySpec(SpecModel):
    """The group's NetworkPolicy (ingress to the group's pods; docs/security.md, "The data plane")."""

    model_config = ConfigDict(json_schema_extra=rules(*_peer_rules("agentPeers"), *_peer_rules("enginePeers")))

    enabled: bool = Field(
        default=True,
        description="Create the group's NetworkPolicy. false: none (clusters whose users manage their own); "
        "the operator then deletes the one it made.",
    )
    agent_peers: list[NetworkPeer] = Field(
        default_factory=list,
        json_schema_extra={"default": []},
        max_length=16,
        description="Who besides the group's own pods may reach the agent port (GET /metrics for Prometheus, "
        "e.g. a namespaceSelector for the monitoring namespace). Every route but /healthz and /metrics needs "
        "the group's credential anyway.",
    )
    engine_peers: list[NetworkPeer] = Field(
        default_factory=lambda: [NetworkPeer.model_validate(SAME_NAMESPACE)],
        json_schema_extra={"default": [{"podSelector": {}}]},  # SAME_NAMESPACE, as JSON
        max_length=16,
        description="Who besides the group's own pods may reach the engines' serving port (inference.port: "
        "rollout routers calling /generate). Default: every pod of the group's namespace; "
        "[{namespaceSelector: {}}] opens it to every pod of the cluster, [] to the group only. Admin routes need "
        "the group's credential whatever this says.",
    )


class EventsSpec(SpecModel):
    """Which rounds become Events on the group (the operator's; not part of the plan, so changing it replans
    nothing)."""

    slow_round_percent: int = Field(
        default=50,
        ge=1,
        le=100,
        description="A round that takes more than this percentage of transfer.timeoutSeconds gets a SlowSync "
        "warning Event on the group, naming its slowest phase, source and target.",
    )


_SPEC_RULES = rules(
    CelRule(
        rule="self.inference.ranksPerEngine % self.inference.ranksPerPod == 0",
        message="inference.ranksPerEngine must be a multiple of inference.ranksPerPod: an engine spans whole pods",
        field_path=".inference.ranksPerPod",
    ),
    CelRule(
        rule="self.transfer.protocol != 'rdma' || has(self.rdma.resourceName)",
        message="rdma.resourceName is required when transfer.protocol is rdma "
        "(the RDMA device plugin's resource, e.g. rdma/hca_shared_devices_a)",
        field_path=".rdma",
    ),
    CelRule(
        rule="!(self.rdma.hostNetwork && size(self.rdma.networks) > 0)",
        message="rdma.networks and rdma.hostNetwork are mutually exclusive: "
        "with hostNetwork the pods already use the host's NICs",
        field_path=".rdma.networks",
    ),
    CelRule(
        rule="!has(self.transfer.maxReplicaShapesPerSource) || self.transfer.planner == 'balanced'",
        message="transfer.maxReplicaShapesPerSource applies only to planner: balanced",
        field_path=".transfer.maxReplicaShapesPerSource",
    ),
    CelRule(
        rule=f"self.trainer.replicas * self.trainer.ranksPerPod <= {MAX_RANKS}",
        message=f"trainer.replicas * trainer.ranksPerPod must be at most {MAX_RANKS} trainer ranks",
        field_path=".trainer.replicas",
    ),
    CelRule(
        rule=f"self.inference.engines * self.inference.ranksPerEngine <= {MAX_RANKS}",
        message=f"inference.engines * inference.ranksPerEngine must be at most {MAX_RANKS} inference ranks",
        field_path=".inference.engines",
    ),
)


class WeightSyncGroupSpec(SpecModel):
    model_config = ConfigDict(json_schema_extra=_SPEC_RULES)

    trainer: TrainerSpec
    inference: InferenceSpec
    # The explicit schema defaults make the API server fill these in, so CEL rules can read them.
    transfer: TransferSpec = Field(default_factory=TransferSpec, json_schema_extra={"default": {}})
    rdma: RdmaSpec = Field(default_factory=RdmaSpec, json_schema_extra={"default": {}})
    agent: AgentSpec = Field(default_factory=AgentSpec, json_schema_extra={"default": {}})
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec, json_schema_extra={"default": {}})
    events: EventsSpec = Field(default_factory=EventsSpec, json_schema_extra={"default": {}})

    @property
    def sources(self) -> int:
        return self.trainer.sources

    @property
    def targets(self) -> int:
        return self.inference.targets


# --- Status --------------------------------------------------------------------------------------

Phase = Literal["Pending", "Provisioning", "Ready", "Syncing", "Degraded", "Failed"]
ConditionType = Literal["Ready", "Progressing", "Degraded", "PlanReady"]


class Condition(ApiModel):
    """metav1.Condition."""

    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(default=None, ge=0)


class ReplicaCounts(ApiModel):
    desired: int = Field(default=0, ge=0)
    ready: int = Field(default=0, ge=0)


class SyncPaths(ApiModel):
    """How many engine ranks each path syncs (docs/engines/engine-replicas.md), as the engines' agents report."""

    trace: int = Field(default=0, ge=0, description="Ranks whose weights sources cut from the trainer's tensors.")
    engine_replica: int = Field(
        default=0, ge=0, description="Ranks written from an engine replica: the engine's own loader on the sources."
    )


class EngineCounts(ReplicaCounts):
    sync_paths: SyncPaths | None = Field(default=None, description="Absent until an engine's agent reported.")


class PlanStatus(ApiModel):
    hash: str = Field(default="", max_length=64)
    revision: int = Field(default=0, ge=0, description="Bumped every time the plan changes.")
    policy: str = Field(default="", max_length=64)
    sources: int = Field(default=0, ge=0)
    targets: int = Field(default=0, ge=0)
    max_targets_per_source: int = Field(default=0, ge=0)
    max_shapes_per_source: int = Field(default=0, ge=0)
    balanced: bool = True
    moved_targets: int = Field(default=0, ge=0, description="Targets that changed source at the last replan.")
    config_map: str = Field(default="", max_length=253)


#: Rounds kept in ``status.recentSyncs`` (bounded: the status is one etcd object).
RECENT_SYNCS: Final = 10
#: A round's reason in ``status.recentSyncs`` is clipped to this (``lastSync`` keeps it whole).
RECENT_REASON_CHARS: Final = 512


class SyncPhases(ApiModel):
    """Seconds a round spent in each phase (a phase that did not run is absent)."""

    prepare: float | None = Field(default=None, ge=0, description="Waiting for every source to hold the version.")
    pause: float | None = Field(default=None, ge=0, description="Pausing the engines (live rounds).")
    begin: float | None = Field(default=None, ge=0, description="Opening the round on every engine.")
    write: float | None = Field(default=None, ge=0, description="The sources' writes (all attempts).")
    verify: float | None = Field(default=None, ge=0, description="The targets' verification (all attempts).")
    commit: float | None = Field(default=None, ge=0, description="Committing the version on every engine.")
    resume: float | None = Field(default=None, ge=0, description="Resuming the engines (live rounds).")
    gate: float | None = Field(
        default=None, ge=0, description="Scoring the trainer's canary on every engine (rounds with a canary)."
    )


class PeerSync(ApiModel):
    """What one peer (a source, or an engine rank as a target) moved in a round."""

    peer: str = Field(max_length=64, description='"source 3", or "engine 2 rank 1".')
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0, description="From the start of the writes until its last byte landed.")
    gbps: float = Field(ge=0, description="Gigabits per second.")


class SyncStatus(ApiModel):
    version: int = Field(ge=0)
    result: Literal["Succeeded", "Failed", "Aborted"]
    started_at: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    duration_seconds: float | None = Field(default=None, ge=0)
    bytes: int | None = Field(default=None, ge=0)
    gbps: float | None = Field(default=None, ge=0, description="Gigabits per second over the whole round.")
    reason: str | None = Field(
        default=None, max_length=32768, description="Why a round failed: which peer, which bucket."
    )
    engines_paused: bool | None = Field(
        default=None,
        description="The round left the engines paused (a failed live round, or a failed resume): they serve again "
        "after the next successful round.",
    )
    phases: SyncPhases | None = None
    paused_seconds: float | None = Field(
        default=None,
        ge=0,
        description="How long the round kept engines from serving: a live round from pause to resume; a staged "
        "round its commit (the most an engine applying staged weights inside a pause can have been paused).",
    )
    pause_policy: PausePolicy | None = Field(
        default=None,
        description="When the round paused the engines (transfer.pause as it applied to the round): minimal, for "
        "the writes only (staged rounds: only to apply); overlap, from the first write of a streamed version on.",
    )
    slowest_source: PeerSync | None = Field(default=None, description="The source whose writes took longest.")
    slowest_target: PeerSync | None = Field(default=None, description="The engine rank that was written last.")
    gate_gap: float | None = Field(
        default=None,
        ge=0,
        description="A round whose semantic gate passed: the largest difference (nats) any engine showed between its "
        "logprob of a canary token and the trainer's, within the canary's tolerance.",
    )


class WeightSyncGroupStatus(ApiModel):
    observed_generation: int | None = Field(default=None, ge=0)
    phase: Phase | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    trainers: ReplicaCounts = Field(default_factory=ReplicaCounts)
    engines: EngineCounts = Field(default_factory=EngineCounts)
    plan: PlanStatus | None = None
    weight_version: int | None = Field(default=None, ge=0, description="Newest version every engine fully holds.")
    last_sync: SyncStatus | None = None
    recent_syncs: list[SyncStatus] = Field(
        default_factory=list,
        max_length=RECENT_SYNCS,
        description=f"The last {RECENT_SYNCS} rounds, oldest first (reasons clipped to {RECENT_REASON_CHARS} "
        "characters): what `weightsync rounds` shows.",
    )


class ObjectMeta(BaseModel):
    """The part of metav1.ObjectMeta the operator reads; the rest passes through."""

    model_config = ConfigDict(extra="allow")

    name: str = ""
    namespace: str = "default"
    uid: str = ""
    generation: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class WeightSyncGroup(BaseModel):
    """A whole object, as read from the API server or a YAML file."""

    model_config = ConfigDict(extra="ignore")

    api_version: str = Field(default=API_VERSION, alias="apiVersion")
    kind: str = KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: WeightSyncGroupSpec
    status: WeightSyncGroupStatus | None = None


#: Rules on ``metadata.name``, at the root of the schema (the only metadata CEL may read). They carry no
#: fieldPath: the CRD schema leaves metadata to the API server, so there is no path to point into.
ROOT_RULES = rules(
    CelRule(
        rule="self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        message="name must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter): "
        "it names the group's Service and pods",
    ),
    CelRule(
        rule=f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        message=f"name must be at most {MAX_NAME_LENGTH} characters, "
        "so that pod names <name>-engine-<e>-<j> stay valid hostnames",
    ),
)
