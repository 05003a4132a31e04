"""The ``WeightSyncGroup`` API (``weightsync.io/v1alpha1``), defined once.

These pydantic models are the single definition of the resource: the CRD in ``crds/`` is generated
from them (``weightsync crd``), the operator and the CLI parse objects with them, and the CEL rules
attached here are what the API server enforces. Field names are the camelCase names users write in
YAML; Python code uses the snake_case attributes.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, AliasGenerator, BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from weightsync.api.cel import CelRule
from weightsync.api.engines import Adapter, Request, Staging, SyncModeName
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

_CONTAINER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "x-kubernetes-preserve-unknown-fields": True,
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1}, "image": {"type": "string"}},
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
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
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
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and c["name"] for c in containers):
        raise ValueError("template.spec.containers: every container needs a name")
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
        description="How the agent talks to the engine: a real SGLang server, or weightsync's reference engine.",
        json_schema_extra=rules(immutable("inference.adapter", "the engine kind cannot change under its agents")),
    )
    port: int = Field(default=30000, ge=1, le=65535, description="The engine's HTTP port inside the pod.")

    @property
    def targets(self) -> int:
        return self.engines * self.ranks_per_engine

    @property
    def pods_per_engine(self) -> int:
        return self.ranks_per_engine // self.ranks_per_pod


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


class AgentSpec(SpecModel):
    """The weightsync agent sidecar."""

    image: str | None = Field(
        default=None,
        min_length=1,
        description="Agent image; defaults to the one the operator was installed with.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    resources: Annotated[dict[str, dict[str, int | str]], WithJsonSchema(_RESOURCES_SCHEMA)] | None = Field(
        default=None, description="ResourceRequirements for the sidecar (requests/limits)."
    )
    port: int = Field(default=9470, ge=1, le=65535, description="Agent HTTP port (control, metrics).")


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


class PlanStatus(ApiModel):
    hash: str = ""
    revision: int = Field(default=0, ge=0, description="Bumped every time the plan changes.")
    policy: str = ""
    sources: int = Field(default=0, ge=0)
    targets: int = Field(default=0, ge=0)
    max_targets_per_source: int = Field(default=0, ge=0)
    max_shapes_per_source: int = Field(default=0, ge=0)
    balanced: bool = True
    moved_targets: int = Field(default=0, ge=0, description="Targets that changed source at the last replan.")
    config_map: str = ""


class SyncStatus(ApiModel):
    version: int = Field(ge=0)
    result: Literal["Succeeded", "Failed", "Aborted"]
    started_at: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    duration_seconds: float | None = Field(default=None, ge=0)
    bytes: int | None = Field(default=None, ge=0)
    gbps: float | None = Field(default=None, ge=0, description="Gigabits per second over the whole round.")
    reason: str | None = Field(default=None, description="Why a round failed: which peer, which bucket.")
    engines_paused: bool | None = Field(
        default=None,
        description="The round left the engines paused (a failed live round, or a failed resume): they serve again "
        "after the next successful round.",
    )


class WeightSyncGroupStatus(ApiModel):
    observed_generation: int | None = Field(default=None, ge=0)
    phase: Phase | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    trainers: ReplicaCounts = Field(default_factory=ReplicaCounts)
    engines: ReplicaCounts = Field(default_factory=ReplicaCounts)
    plan: PlanStatus | None = None
    weight_version: int | None = Field(default=None, ge=0, description="Newest version every engine fully holds.")
    last_sync: SyncStatus | None = None


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
