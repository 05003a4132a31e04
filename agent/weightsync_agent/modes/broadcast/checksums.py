"""What a target must hold, as the checksums its manifest names, computed by the sender from the full tensors.

In broadcast mode the sender has no replica: it sends full tensors and every receiver cuts its own
shards. For the round's verify step it still reports, per target, what the target's manifest says its engine
verifies (``Manifest.checksum``): either the engine's own hash of every local tensor (``tensor-sha256-8`` for
stock SGLang on CPU, as a p2p source hashes its replica: :func:`tensor_checksums`), or the xxh3-64 of every bucket of
``plan_buckets(manifest, bucket_bytes)`` — the same digests a p2p source computes over its replica
(:mod:`weightsync_agent.layout.checksums`), so targets verify both modes identically. Here the bytes come from
cutting each local tensor out of the full ones (``ShardPart``s concatenated along ``cat_dim``), one
local tensor at a time, so no replica is ever held; the cut is the sender's own, independent of how the
receivers did theirs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import xxhash

from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import TENSOR_HASHES
from weightsync_agent.layout.manifest import Manifest, TensorEntry
from weightsync_agent.layout.placement import cut


def local_bytes(entry: TensorEntry, full: Mapping[str, torch.Tensor]) -> memoryview:
    """The bytes of one local tensor, cut from ``full`` as its manifest entry says (on the CPU)."""
    flat = cut(entry, full).detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def _packed(manifest: Manifest, full: Mapping[str, torch.Tensor]) -> Iterator[tuple[int, memoryview]]:
    """``(replica offset, bytes)`` of every local tensor, in manifest (packing) order."""
    offset = 0
    for entry in manifest.tensors:
        if entry.nbytes:
            yield offset, local_bytes(entry, full)
        offset += entry.nbytes


def layout_checksums(manifest: Manifest, full: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[str]:
    """Per-bucket digests of the target described by ``manifest``, had it received ``full`` exactly."""
    tensors = _packed(manifest, full)
    start, data = 0, memoryview(b"")
    digests: list[str] = []
    for bucket in plan_buckets(manifest, bucket_bytes):
        hasher = xxhash.xxh3_64()
        for piece in bucket.pieces:
            position, end = piece.replica_offset, piece.replica_offset + piece.length
            while position < end:
                while position >= start + len(data):  # pieces run in packing order: only move forward
                    start, data = next(tensors)
                take = min(end, start + len(data)) - position
                hasher.update(data[position - start : position - start + take])
                position += take
        digests.append(str(hasher.hexdigest()))
    return digests


def tensor_checksums(manifest: Manifest, full: Mapping[str, torch.Tensor]) -> list[str]:
    """Per local tensor, in manifest order, the engine's own hash ``manifest.checksum`` names."""
    hasher = TENSOR_HASHES.get(manifest.checksum)
    if hasher is None:
        raise ValueError(f"{manifest.checksum} is not a per-tensor scheme")
    return [hasher(local_bytes(entry, full) if entry.nbytes else b"") for entry in manifest.tensors]


def target_checksums(manifest: Manifest, full: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[str]:
    """What the target described by ``manifest`` verifies against, had it received ``full`` exactly."""
    if manifest.checksum == "bucket-xxh3":
        return layout_checksums(manifest, full, bucket_bytes)
    return tensor_checksums(manifest, full)
