"""What sync tests share: the training step, the probe tokens, and independently computed checksums."""

from __future__ import annotations

import torch

from weightsync_agent.buckets import plan_buckets
from weightsync_agent.checksums import checksum_ranges
from weightsync_agent.engines.reference.model import RankWeights, shard

TOKENS = [3, 14, 15, 92, 65, 35]


def training_step(full: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return {name: t - 0.01 * torch.randn(t.shape, generator=generator, dtype=t.dtype) for name, t in full.items()}


def expected_checksums(full: dict[str, torch.Tensor], rank: int, bucket_bytes: int, tp: int = 2) -> list[str]:
    """What engine rank ``rank`` must hold, computed independently: the model's own shard() in a local buffer."""
    weights = RankWeights(tp, rank)
    weights.load(shard(full, tp, rank))
    manifest = weights.manifest(engine=0, session_id="local:0")
    return [
        checksum_ranges([(p.remote_address, p.length) for p in b.pieces]) for b in plan_buckets(manifest, bucket_bytes)
    ]
