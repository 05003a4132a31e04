"""What sync tests share: the training step, the probe tokens, and independently computed checksums."""

from __future__ import annotations

import torch

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import checksum_ranges
from weightsync_testing.reference_engine.model import DEFAULT_CONFIG, ModelConfig, RankWeights, shard

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
    weights = RankWeights(tp, rank, config)
    weights.load(shard(full, tp, rank))
    manifest = weights.manifest(engine=0, session_id="local:0")
    return [
        checksum_ranges([(p.remote_address, p.length) for p in b.pieces]) for b in plan_buckets(manifest, bucket_bytes)
    ]
