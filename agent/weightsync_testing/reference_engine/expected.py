"""What a reference engine rank must hold for the trainer's full tensors, computed independently of any engine: the
model's own ``shard()`` (of the quantized checkpoint, for an FP8 target) loaded into a local buffer, hashed per bucket
as the engine's ``/weightsync/checksums`` and its verify hash its memory. How tests and benchmarks check that an engine
holds a version, byte for byte."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import checksum_ranges
from weightsync_testing.reference_engine.model import DEFAULT_CONFIG, ModelConfig, RankWeights, local_state


def rank_checksums(
    full: Mapping[str, torch.Tensor], rank: int, bucket_bytes: int, tp: int, config: ModelConfig = DEFAULT_CONFIG
) -> list[str]:
    """The per-bucket checksums of engine rank ``rank`` (of ``tp``) holding ``full``."""
    weights = RankWeights(tp, rank, config)
    weights.load(local_state(full, tp, rank, config))
    manifest = weights.manifest(engine=0, session_id="local:0")
    return [
        checksum_ranges([(p.remote_address, p.length) for p in b.pieces]) for b in plan_buckets(manifest, bucket_bytes)
    ]
