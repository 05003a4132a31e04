"""Who a pod is, and the environment that says so to the user's containers (docs/workload-identity.md).

A pod's identity is derived from the spec and its indices alone: its role, its index within its trainer or engine,
its ranks, and its place in the multi-host job it is part of. One trainer is one job over ``trainer.replicas``
pods; one engine is one job over ``ranksPerEngine / ranksPerPod`` pods. Each job's pod 0 is its leader, reached by
its stable DNS name through the group's headless Service (every pod sets ``hostname``/``subdomain``), on
:data:`names.RENDEZVOUS_PORT`.

The user's containers get it as ``WEIGHTSYNC_*`` variables (:func:`workload_env`), named for the launchers'
flags so that args can take them with ``$(VAR)``: ``torchrun --nnodes $(WEIGHTSYNC_NNODES) --node-rank
$(WEIGHTSYNC_NODE_RANK) --rdzv-endpoint $(WEIGHTSYNC_DIST_INIT_ADDR)``. They include what
``WeightSyncClient.from_env`` reads in a trainer container (group, role, pod index, ranks, agent port), from the
same values the agent gets (:func:`identity_values`), so the two cannot disagree.

The operator's values win: a template's variable of one of these names is dropped (the builder puts ours first
and removes the user's), as a template is shared by every pod of its role and cannot know a pod's rank. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.api import names
from weightsync.api.v1alpha1 import WeightSyncGroup
from weightsync_operator.builders.common import BuildError, JsonDict


@dataclass(frozen=True)
class PodIdentity:
    """Who a pod is: everything rank-related, derived from the spec and the pod's indices."""

    role: names.Role
    name: str
    #: Trainer pod index, or the pod's index inside its engine: its node rank in its job.
    index: int
    engine: int | None
    #: Global trainer ranks (sources), or ranks inside the engine (targets).
    ranks: tuple[int, ...]
    #: Pods of this pod's job: the trainer's (``trainer.replicas``) or its engine's (``pods_per_engine``).
    nnodes: int
    #: Ranks of this pod's job: every trainer rank, or the engine's ranks.
    world_size: int
    #: Pod 0 of this pod's job (its name, which is also its hostname).
    leader: str

    @property
    def rank_label(self) -> str:
        return str(self.index) if self.engine is None else f"{self.engine}-{self.index}"


def trainer_identity(group: WeightSyncGroup, index: int) -> PodIdentity:
    trainer = group.spec.trainer
    if not 0 <= index < trainer.replicas:
        raise ValueError(f"trainer pod index {index} out of range 0..{trainer.replicas - 1}")
    per_pod = trainer.ranks_per_pod
    return PodIdentity(
        role="trainer",
        name=names.trainer_pod(group.metadata.name, index),
        index=index,
        engine=None,
        ranks=tuple(index * per_pod + local for local in range(per_pod)),
        nnodes=trainer.replicas,
        world_size=trainer.sources,
        leader=names.trainer_pod(group.metadata.name, 0),
    )


def engine_identity(group: WeightSyncGroup, engine: int, pod: int) -> PodIdentity:
    inference = group.spec.inference
    if inference.ranks_per_engine % inference.ranks_per_pod:
        raise BuildError(
            "InvalidLayout",
            f"inference.ranksPerEngine ({inference.ranks_per_engine}) must be a multiple of "
            f"inference.ranksPerPod ({inference.ranks_per_pod})",
        )
    if not 0 <= engine < inference.engines:
        raise ValueError(f"engine index {engine} out of range 0..{inference.engines - 1}")
    if not 0 <= pod < inference.pods_per_engine:
        raise ValueError(f"engine pod index {pod} out of range 0..{inference.pods_per_engine - 1}")
    per_pod = inference.ranks_per_pod
    return PodIdentity(
        role="engine",
        name=names.engine_pod(group.metadata.name, engine, pod),
        index=pod,
        engine=engine,
        ranks=tuple(pod * per_pod + local for local in range(per_pod)),
        nnodes=inference.pods_per_engine,
        world_size=inference.ranks_per_engine,
        leader=names.engine_pod(group.metadata.name, engine, 0),
    )


def identity_values(group: WeightSyncGroup, who: PodIdentity) -> list[tuple[str, str]]:
    """What both the agent and the user's containers are told about the pod (one source for both)."""
    values = [
        (names.ENV_GROUP, group.metadata.name),
        (names.ENV_NAMESPACE, group.metadata.namespace),
        (names.ENV_ROLE, who.role),
        (names.ENV_POD_INDEX, str(who.index)),
    ]
    if who.engine is not None:
        values.append((names.ENV_ENGINE_INDEX, str(who.engine)))
    values.append((names.ENV_RANKS, ",".join(str(r) for r in who.ranks)))
    return values


def leader_address(group: WeightSyncGroup, who: PodIdentity) -> str:
    """The stable DNS name of pod 0 of ``who``'s trainer or engine."""
    return names.pod_address(group.metadata.name, group.metadata.namespace, who.leader)


def workload_env(group: WeightSyncGroup, who: PodIdentity) -> list[JsonDict]:
    """The ``WEIGHTSYNC_*`` variables every user container of ``who``'s pod gets, in this order (first in the
    container's env, so the user's own variables may use them in ``$(VAR)``)."""
    leader = leader_address(group, who)
    port = names.RENDEZVOUS_PORT
    values = [
        *identity_values(group, who),
        # Where the trainer client finds its sidecar (spec.agent.port; the client's default is 9470).
        (names.ENV_AGENT_PORT, str(group.spec.agent.port)),
        (names.ENV_NNODES, str(who.nnodes)),
        (names.ENV_NODE_RANK, str(who.index)),
        (names.ENV_NPROC_PER_NODE, str(len(who.ranks))),
        (names.ENV_WORLD_SIZE, str(who.world_size)),
        (names.ENV_LEADER_ADDR, leader),
        (names.ENV_LEADER_PORT, str(port)),
        # Literal, not $(...) of the two above: it holds whatever order the env ends up in.
        (names.ENV_DIST_INIT_ADDR, f"{leader}:{port}"),
    ]
    return [{"name": key, "value": value} for key, value in values]
