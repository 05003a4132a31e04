"""Test helpers for the reference engine: a minimal source and an in-process transport.

``write_version`` is a deliberately small, independent source: it cuts the full tensors with nothing but
the manifest's ShardParts, packs them in manifest order (the replica layout), registers that replica with
a transport, writes every bucket piece as a one-sided write and returns the per-bucket checksums the
engine must verify. Tests use it to put a new version into a running engine without the real Source.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import source_checksum
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.transport.base import Transfer, Transport, wait_all
from weightsync_agent.transport.memory import MemoryTransport


def replica_for(manifest: Manifest, full: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The target's bytes for ``full``, packed in manifest order, cut using only the ShardParts."""
    chunks = []
    for entry in manifest.tensors:
        local = torch.cat([full[p.source].narrow(p.dim, p.start, p.length) for p in entry.parts], dim=entry.cat_dim)
        assert tuple(local.shape) == entry.shape, entry.name
        chunks.append(local.contiguous().view(-1).view(torch.uint8))
    return torch.cat(chunks)


@dataclass
class Written:
    checksums: list[str]
    replica: torch.Tensor  # keep alive while the target may still read the writes
    failed: list[Transfer] = field(default_factory=list)


def write_version(
    transport: Transport,
    manifest: Manifest,
    full: Mapping[str, torch.Tensor],
    bucket_bytes: int,
    *,
    corrupt_bucket: int | None = None,
    timeout: float = 30.0,
) -> Written:
    """Write ``full`` (as ``manifest``'s rank holds it) into the target; return the buckets' checksums.

    With ``corrupt_bucket=i``, bucket ``i`` is reported with its true checksum but one byte of it is
    flipped in what is sent, as if the wire or the target's memory had corrupted it.
    """
    replica = replica_for(manifest, full)
    base = replica.data_ptr()
    buckets = plan_buckets(manifest, bucket_bytes)
    checksums = [source_checksum(b, base) for b in buckets]
    transport.register(base, replica.numel())
    try:
        if corrupt_bucket is not None:
            piece = buckets[corrupt_bucket].pieces[0]
            replica[piece.replica_offset] ^= 0x5A
        transfers = [
            transport.submit_write(manifest.session_id, base + p.replica_offset, p.remote_address, p.length)
            for b in buckets
            for p in b.pieces
        ]
        failed = wait_all(transfers, time.monotonic() + timeout)
    finally:
        transport.unregister(base)
    return Written(checksums, replica, failed)


# ------------------------------------------------------------------------------ in-process transport


def new_transport() -> Transport:
    """An in-process transport session (the project's MemoryTransport)."""
    return MemoryTransport(timeout_seconds=10)
