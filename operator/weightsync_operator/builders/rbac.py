"""The agents' identity: a ServiceAccount, and a Role that lets them read their plan and write their own pods.

Nothing more: ``configmaps`` get/list/watch on the plan ConfigMap only, and ``pods`` + ``pods/status``
get/patch on the group's own pods only (by name, so the Role follows the group as it scales). Agents
that list or watch the ConfigMap must use ``fieldSelector=metadata.name=<group>-plan``.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.api import names
from weightsync.api.v1alpha1 import WeightSyncGroup
from weightsync_operator.builders.common import JsonDict, object_meta

RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"


def build_service_account(group: WeightSyncGroup) -> JsonDict:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(group, names.agent_service_account(group.metadata.name)),
    }


def build_role(group: WeightSyncGroup, pod_names: Sequence[str]) -> JsonDict:
    name = group.metadata.name
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "Role",
        "metadata": object_meta(group, names.agent_service_account(name)),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [names.plan_config_map(name)],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": [""],
                "resources": ["pods", "pods/status"],
                "resourceNames": list(pod_names),
                "verbs": ["get", "patch"],
            },
        ],
    }


def build_role_binding(group: WeightSyncGroup) -> JsonDict:
    account = names.agent_service_account(group.metadata.name)
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "RoleBinding",
        "metadata": object_meta(group, account),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": group.metadata.namespace}],
    }
