"""Pure manifest builders: no I/O, no clock, no environment. Same input, same objects."""

from weightsync_operator.builders.common import BuildError, BuildOptions, content_hash, owner_reference
from weightsync_operator.builders.configmap import PlanDecision, build_plan_config_map, decide_plan
from weightsync_operator.builders.desired import DesiredState, desired_state, expected_pod_names
from weightsync_operator.builders.network_policy import build_mesh_policies, build_network_policy
from weightsync_operator.builders.pods import build_engine_pod, build_trainer_pod
from weightsync_operator.builders.rbac import build_role, build_role_binding, build_service_account
from weightsync_operator.builders.secret import build_group_secret, new_token, secret_token
from weightsync_operator.builders.service import build_service

__all__ = [
    "BuildError",
    "BuildOptions",
    "DesiredState",
    "PlanDecision",
    "build_engine_pod",
    "build_group_secret",
    "build_mesh_policies",
    "build_network_policy",
    "build_plan_config_map",
    "build_role",
    "build_role_binding",
    "build_service",
    "build_service_account",
    "build_trainer_pod",
    "content_hash",
    "decide_plan",
    "desired_state",
    "expected_pod_names",
    "new_token",
    "owner_reference",
    "secret_token",
]
