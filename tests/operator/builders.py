"""Fluent builders for operator tests (in the style of LWS's test/wrappers).

    GroupBuilder("demo").trainers(2, ranks_per_pod=1).engines(2, tp=2, ranks_per_pod=1)
        .rdma("rdma/hca_shared_devices_a").networks("rdma-net").build()

gives a WeightSyncGroup object as the API server would hand it to the operator (metadata with name,
namespace, uid and generation). ``PodState(pod)`` dresses a built pod with what the kubelet and the
agents would later write on it (scheduled, ready, annotations, failures).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Self

from weightsync.api import names
from weightsync.api.v1alpha1 import WeightSyncGroup

DEFAULT_AGENT_IMAGE = "registry.example/weightsync:test"


def container(name: str, image: str = "busybox", **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": image, **extra}


def template(*containers: dict[str, Any], labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"spec": {"containers": list(containers), **spec}}
    if labels:
        out["metadata"] = {"labels": labels}
    return out


class GroupBuilder:
    def __init__(self, name: str = "demo", namespace: str = "default") -> None:
        self._meta: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "generation": 1,
        }
        self._spec: dict[str, Any] = {
            "trainer": {"replicas": 1, "ranksPerPod": 1, "template": template(container("trainer"))},
            "inference": {
                "engines": 1,
                "ranksPerEngine": 1,
                "ranksPerPod": 1,
                "template": template(container("engine")),
                # Not the API's default (sglang): this version has no SGLang adapter, so the operator
                # refuses such groups (AdapterUnavailable). ``.adapter("sglang")`` asks for that.
                "adapter": "reference",
            },
            "agent": {"image": DEFAULT_AGENT_IMAGE},
        }

    # --- identity -------------------------------------------------------------------------------

    def uid(self, uid: str) -> Self:
        self._meta["uid"] = uid
        return self

    def generation(self, generation: int) -> Self:
        self._meta["generation"] = generation
        return self

    # --- layout ---------------------------------------------------------------------------------

    def trainers(self, replicas: int, *, ranks_per_pod: int = 1) -> Self:
        self._spec["trainer"].update(replicas=replicas, ranksPerPod=ranks_per_pod)
        return self

    def engines(self, engines: int, *, tp: int = 1, ranks_per_pod: int | None = None) -> Self:
        """``tp``: ranks per engine; ``ranks_per_pod`` defaults to the whole engine in one pod."""
        self._spec["inference"].update(
            engines=engines, ranksPerEngine=tp, ranksPerPod=ranks_per_pod if ranks_per_pod is not None else tp
        )
        return self

    def trainer_template(self, value: dict[str, Any]) -> Self:
        self._spec["trainer"]["template"] = value
        return self

    def engine_template(self, value: dict[str, Any]) -> Self:
        self._spec["inference"]["template"] = value
        return self

    def adapter(self, adapter: str, *, port: int | None = None) -> Self:
        self._spec["inference"]["adapter"] = adapter
        if port is not None:
            self._spec["inference"]["port"] = port
        return self

    def planner(self, policy: str, *, max_shapes: int | None = None) -> Self:
        transfer = self._spec.setdefault("transfer", {})
        transfer["planner"] = policy
        if max_shapes is not None:
            transfer["maxReplicaShapesPerSource"] = max_shapes
        return self

    # --- RDMA -----------------------------------------------------------------------------------

    def _rdma(self) -> dict[str, Any]:
        rdma: dict[str, Any] = self._spec.setdefault("rdma", {})
        return rdma

    def rdma(self, resource_name: str, count: int = 1) -> Self:
        self._rdma().update(resourceName=resource_name, resourceCount=count)
        return self

    def networks(self, *networks: str) -> Self:
        self._rdma()["networks"] = list(networks)
        return self

    def host_network(self, on: bool = True) -> Self:
        self._rdma()["hostNetwork"] = on
        return self

    def devices(self, *devices: str) -> Self:
        self._rdma()["devices"] = list(devices)
        return self

    def shm(self, gib: int) -> Self:
        self._rdma()["shmSizeGiB"] = gib
        return self

    # --- agent ----------------------------------------------------------------------------------

    def agent(
        self,
        *,
        image: str | None = DEFAULT_AGENT_IMAGE,
        port: int | None = None,
        resources: dict[str, Any] | None = None,
        pull_policy: str | None = None,
        security_context: dict[str, Any] | None = None,
        site_packages: dict[str, Any] | None = None,
    ) -> Self:
        agent: dict[str, Any] = {}
        if security_context is not None:
            agent["securityContext"] = security_context
        if site_packages is not None:
            agent["sitePackages"] = site_packages
        if image is not None:
            agent["image"] = image
        if port is not None:
            agent["port"] = port
        if resources is not None:
            agent["resources"] = resources
        if pull_policy is not None:
            agent["imagePullPolicy"] = pull_policy
        self._spec["agent"] = agent
        return self

    # --- escape hatch for invalid specs ------------------------------------------------------------

    def set(self, path: str, value: Any) -> Self:
        """Set a raw spec field by dotted camelCase path, e.g. ``.set("inference.adapter", "vllm")``."""
        *parents, leaf = path.split(".")
        node = self._spec
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        return self

    # --- output ---------------------------------------------------------------------------------

    def build(self) -> dict[str, Any]:
        return {
            "apiVersion": "weightsync.io/v1alpha1",
            "kind": "WeightSyncGroup",
            "metadata": copy.deepcopy(self._meta),
            "spec": copy.deepcopy(self._spec),
        }

    def model(self) -> WeightSyncGroup:
        return WeightSyncGroup.model_validate(self.build())


class PodState:
    """What the cluster and the agents later write on a built pod."""

    def __init__(self, pod: dict[str, Any]) -> None:
        self._pod = copy.deepcopy(pod)
        self._pod.setdefault("status", {"phase": "Pending", "conditions": []})
        self._pod["metadata"].setdefault("uid", f"pod-uid-{pod['metadata']['name']}")

    def _condition(self, type_: str, status: str, **extra: Any) -> None:
        conditions = [c for c in self._pod["status"]["conditions"] if c["type"] != type_]
        conditions.append({"type": type_, "status": status, **extra})
        self._pod["status"]["conditions"] = conditions

    def scheduled(self, node: str = "node-1") -> Self:
        self._pod["spec"]["nodeName"] = node
        self._condition("PodScheduled", "True")
        return self

    def unschedulable(self, message: str) -> Self:
        self._condition("PodScheduled", "False", reason="Unschedulable", message=message)
        return self

    def running(self) -> Self:
        self.scheduled()
        self._pod["status"]["phase"] = "Running"
        return self

    def ready(self) -> Self:
        self.running()
        self._condition(names.CONDITION_AGENT_READY, "True")
        self._condition("Ready", "True")
        return self

    def not_ready(self) -> Self:
        self.running()
        self._condition("Ready", "False")
        return self

    def failed(self, reason: str = "Evicted", message: str = "The node was low on resource: memory.") -> Self:
        self._pod["status"].update(phase="Failed", reason=reason, message=message)
        return self

    def crash_looping(self, container_name: str = "trainer", restarts: int = 3) -> Self:
        self.running()
        self._pod["status"]["containerStatuses"] = [
            {
                "name": container_name,
                "restartCount": restarts,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}},
            }
        ]
        return self

    def terminating(self) -> Self:
        self._pod["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
        return self

    def annotate(self, key: str, value: str) -> Self:
        self._pod["metadata"].setdefault("annotations", {})[key] = value
        return self

    def weight_version(self, version: int) -> Self:
        return self.annotate(names.ANNOTATION_WEIGHT_VERSION, str(version))

    def last_round(self, **fields: Any) -> Self:
        return self.annotate(names.ANNOTATION_LAST_ROUND, json.dumps(fields))

    def build(self) -> dict[str, Any]:
        return copy.deepcopy(self._pod)
