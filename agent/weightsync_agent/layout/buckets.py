"""How one target's weights are cut into buckets: pure, and computed identically on both sides.

The source's replica packs the target's tensors back to back in manifest order. A bucket is a run of
pieces (replica offset -> remote address, length) of at most ``bucket_bytes``; a tensor larger than a
bucket is split. Pieces that are contiguous on both sides and inside one registered region are merged,
so a flat engine buffer becomes one transfer request per bucket. Targets verify a bucket by hashing the
same remote ranges, so both sides must derive the buckets from the same (manifest, bucket size).
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync_agent.layout.manifest import Manifest


@dataclass(frozen=True)
class Piece:
    replica_offset: int
    remote_address: int
    length: int


@dataclass(frozen=True)
class Bucket:
    index: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.length for p in self.pieces)


def replica_offsets(manifest: Manifest) -> dict[str, int]:
    """Where each tensor starts in the replica (packed in manifest order)."""
    offsets: dict[str, int] = {}
    cursor = 0
    for tensor in manifest.tensors:
        offsets[tensor.name] = cursor
        cursor += tensor.nbytes
    return offsets


def plan_buckets(manifest: Manifest, bucket_bytes: int) -> list[Bucket]:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    current: list[Piece] = []
    room = bucket_bytes
    offset = 0
    for tensor in manifest.tensors:
        done = 0
        while done < tensor.nbytes:
            take = min(room, tensor.nbytes - done)
            current = _append(manifest, current, Piece(offset + done, tensor.address + done, take))
            done += take
            room -= take
            if room == 0:
                buckets.append(Bucket(len(buckets), tuple(current)))
                current, room = [], bucket_bytes
        offset += tensor.nbytes
    if current:
        buckets.append(Bucket(len(buckets), tuple(current)))
    return buckets


def _append(manifest: Manifest, pieces: list[Piece], piece: Piece) -> list[Piece]:
    if pieces:
        last = pieces[-1]
        contiguous = (
            last.replica_offset + last.length == piece.replica_offset
            and last.remote_address + last.length == piece.remote_address
        )
        if contiguous and manifest.region_of(last.remote_address, last.length + piece.length) is not None:
            pieces[-1] = Piece(last.replica_offset, last.remote_address, last.length + piece.length)
            return pieces
    pieces.append(piece)
    return pieces
