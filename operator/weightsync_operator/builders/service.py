"""The headless Service: stable DNS ``<pod>.<group>.<namespace>.svc`` for every pod of the group."""

from __future__ import annotations

from weightsync.api import names
from weightsync.api.v1alpha1 import WeightSyncGroup
from weightsync_operator.builders.common import JsonDict, object_meta


def build_service(group: WeightSyncGroup) -> JsonDict:
    port = group.spec.agent.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(group, names.service(group.metadata.name)),
        "spec": {
            "clusterIP": "None",
            # Agents must find each other before they are ready: readiness is what they report.
            "publishNotReadyAddresses": True,
            "selector": {names.LABEL_GROUP: group.metadata.name},
            "ports": [{"name": names.AGENT_PORT_NAME, "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }
