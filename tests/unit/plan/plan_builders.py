"""A fluent builder for ``WeightSyncGroupSpec`` in planner tests.

SpecBuilder().trainers(3).engines(3, tp=2).planner("miles").build()
"""

from __future__ import annotations

from typing import Any, Literal, Self

from weightsync.api.v1alpha1 import WeightSyncGroupSpec

TEMPLATE: dict[str, Any] = {"spec": {"containers": [{"name": "main", "image": "x"}]}}


class SpecBuilder:
    def __init__(self) -> None:
        self._trainer: dict[str, Any] = {"replicas": 1, "ranksPerPod": 1}
        self._inference: dict[str, Any] = {"engines": 1, "ranksPerEngine": 1, "ranksPerPod": 1}
        self._transfer: dict[str, Any] = {}

    def trainers(self, replicas: int, *, ranks_per_pod: int = 1) -> Self:
        self._trainer = {"replicas": replicas, "ranksPerPod": ranks_per_pod}
        return self

    def engines(self, engines: int, *, tp: int = 1, ranks_per_pod: int | None = None) -> Self:
        self._inference = {"engines": engines, "ranksPerEngine": tp, "ranksPerPod": ranks_per_pod or tp}
        return self

    def planner(self, name: Literal["balanced", "miles"]) -> Self:
        self._transfer["planner"] = name
        return self

    def cap(self, shapes: int | None) -> Self:
        if shapes is None:
            self._transfer.pop("maxReplicaShapesPerSource", None)
        else:
            self._transfer["maxReplicaShapesPerSource"] = shapes
        return self

    def bucket_mib(self, size: int) -> Self:
        self._transfer["bucketSizeMiB"] = size
        return self

    def build(self) -> WeightSyncGroupSpec:
        return WeightSyncGroupSpec.model_validate(
            {
                "trainer": {**self._trainer, "template": TEMPLATE},
                "inference": {**self._inference, "template": TEMPLATE},
                "transfer": dict(self._transfer),
            }
        )


def spec(sources: int, engines: int, tp: int, **kw: Any) -> WeightSyncGroupSpec:
    """Shorthand: ``sources`` single-rank trainer pods, ``engines`` engines of ``tp`` ranks."""
    builder = SpecBuilder().trainers(sources).engines(engines, tp=tp)
    if "planner" in kw:
        builder.planner(kw["planner"])
    if "cap" in kw:
        builder.cap(kw["cap"])
    return builder.build()
