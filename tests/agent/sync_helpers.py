"""What sync tests share: the training step, the probe tokens, and independently computed checksums."""

from __future__ import annotations

import torch

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.expected import rank_checksums
from weightsync_testing.reference_engine.model import DEFAULT_CONFIG, ModelConfig

TOKENS = [3, 14, 15, 92, 65, 35]
TP = 2
ENGINES = 2
TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}


def group_spec(**transfer: object) -> WeightSyncGroupSpec:
    """The sync tests' group: 2 trainer ranks -> 2 reference engines x TP2, one pod each; ``transfer``
    as in the spec's YAML (``targetStaging="live"``, ``mode="broadcast"``, ...)."""
    return WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 2, "template": TEMPLATE},
            "inference": {
                "engines": ENGINES,
                "ranksPerEngine": TP,
                "ranksPerPod": TP,
                "adapter": "reference",
                "template": TEMPLATE,
            },
            "transfer": transfer,
        }
    )


def training_step(full: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return {name: t - 0.01 * torch.randn(t.shape, generator=generator, dtype=t.dtype) for name, t in full.items()}


def expected_checksums(
    full: dict[str, torch.Tensor], rank: int, bucket_bytes: int, tp: int = TP, config: ModelConfig = DEFAULT_CONFIG
) -> list[str]:
    """What engine rank ``rank`` must hold, computed independently: the model's own shard() in a local buffer."""
    return rank_checksums(full, rank, bucket_bytes, tp, config)


def engines_hold(
    group: LoopbackGroup, full: dict[str, torch.Tensor], version: int, config: ModelConfig = DEFAULT_CONFIG
) -> None:
    """Every engine of ``group`` reports ``version`` and holds ``full`` (its ``config``'s form) on every rank."""
    bucket_bytes = group.plan.transfer.bucket_bytes
    for index, engine in group.engines.items():
        client = engine.client()
        assert client.weight_version() == str(version), f"engine {index}"
        for rank in range(group.plan.layout.ranks_per_engine):
            want = expected_checksums(full, rank, bucket_bytes, config=config)
            assert client.checksums(rank, bucket_bytes) == want, (index, rank)
