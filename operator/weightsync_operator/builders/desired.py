"""Everything one group needs, in the order it is applied."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from weightsync.api import names
from weightsync.api.names import Role
from weightsync.api.v1alpha1 import WeightSyncGroup, WeightSyncGroupSpec
from weightsync.plan import Plan
from weightsync_operator.builders.common import BuildOptions, JsonDict
from weightsync_operator.builders.configmap import build_plan_config_map
from weightsync_operator.builders.network_policy import build_mesh_policies, build_network_policy
from weightsync_operator.builders.pods import build_engine_pod, build_trainer_pod
from weightsync_operator.builders.rbac import build_role, build_role_binding, build_service_account
from weightsync_operator.builders.secret import build_group_secret
from weightsync_operator.builders.service import build_service


@dataclass(frozen=True)
class DesiredState:
    service_account: JsonDict
    role: JsonDict
    role_binding: JsonDict
    service: JsonDict
    config_map: JsonDict
    #: The group's credential, metadata only: the reconciler adds the token when it creates it, and never after.
    secret: JsonDict
    #: Trainer pods by index, then engine pods engine-major.
    pods: tuple[JsonDict, ...]
    #: Ingress to the group's pods; None when ``networkPolicy.enabled`` is false (the reconciler then deletes ours).
    network_policy: JsonDict | None = None
    #: Every port between the pods of a multi-pod trainer or engine (p2p groups), by role; a role left out has none.
    mesh_policies: Mapping[Role, JsonDict] = field(default_factory=dict)

    @property
    def pod_names(self) -> tuple[str, ...]:
        return tuple(str(p["metadata"]["name"]) for p in self.pods)

    def supporting_objects(self) -> tuple[JsonDict, ...]:
        """Everything but the pods and the Secret, in apply order: identity before the pods that use it, and
        the NetworkPolicy before the pods, so that no pod of the group ever runs unfenced."""
        fence = (self.network_policy, *self.mesh_policies.values()) if self.network_policy is not None else ()
        return (self.service_account, self.role, self.role_binding, self.service, self.config_map, *fence)

    def objects(self) -> tuple[JsonDict, ...]:
        return (*self.supporting_objects(), self.secret, *self.pods)


def expected_pods(spec: WeightSyncGroupSpec, name: str) -> tuple[list[str], list[str]]:
    """The one list of the pods a group should have: (trainers by index, engines engine-major)."""
    trainers = [names.trainer_pod(name, i) for i in range(spec.trainer.replicas)]
    engines = [
        names.engine_pod(name, e, j)
        for e in range(spec.inference.engines)
        for j in range(spec.inference.pods_per_engine)
    ]
    return trainers, engines


def expected_pod_names(group: WeightSyncGroup) -> tuple[str, ...]:
    """Names of every pod the group should have: trainers by index, then engines engine-major."""
    trainers, engines = expected_pods(group.spec, group.metadata.name)
    return (*trainers, *engines)


def desired_state(
    group: WeightSyncGroup, plan: Plan, options: BuildOptions | None = None, token: str | None = None
) -> DesiredState:
    """``token``: the group's, which seals the plan ConfigMap (the operator's reconciles always pass it)."""
    options = options or BuildOptions()
    spec = group.spec
    trainers = [build_trainer_pod(group, i, options) for i in range(spec.trainer.replicas)]
    engines = [
        build_engine_pod(group, e, j, options)
        for e in range(spec.inference.engines)
        for j in range(spec.inference.pods_per_engine)
    ]
    pods = (*trainers, *engines)
    return DesiredState(
        service_account=build_service_account(group),
        role=build_role(group, [str(p["metadata"]["name"]) for p in pods]),
        role_binding=build_role_binding(group),
        service=build_service(group),
        config_map=build_plan_config_map(group, plan, token),
        secret=build_group_secret(group),
        pods=pods,
        network_policy=build_network_policy(group),
        mesh_policies=build_mesh_policies(group),
    )
