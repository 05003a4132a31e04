"""Per-bucket checksums, computed the same way on both sides of a transfer.

A bucket's checksum is xxh3-64 (hex) over the concatenation of its pieces' bytes, in piece order. The
source hashes its replica (``replica base + piece.replica_offset``), the target hashes its own memory
(``piece.remote_address``); both derive the buckets from the same ``(manifest, bucket_bytes)`` with
:func:`weightsync_agent.layout.buckets.plan_buckets`, so equal digests mean the bucket landed bit-exactly.

Hashing reads process memory in place: each range is wrapped in a read-only ``memoryview`` over the raw
address (no copy), and xxhash releases the GIL while it hashes, so a checksum can overlap transfers
that run on other threads. Because the digest is over the concatenated bytes, how a bucket is cut into
pieces (merged or not) does not change it.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable, Iterable

import xxhash

from weightsync_agent.layout.buckets import Bucket, replica_offsets
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.layout.sglang_hash.tensor_hash import sglang_cpu_hash, sglang_gpu_hash

_PyBUF_READ = 0x100
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_view.restype = ctypes.py_object


def view(address: int, nbytes: int) -> memoryview:
    """A read-only, zero-copy view of ``nbytes`` at ``address`` in this process.

    The caller guarantees the memory stays mapped while the view is used.
    """
    if address <= 0 or nbytes < 0:
        raise ValueError(f"bad memory range: address {address:#x}, {nbytes} bytes")
    mv: memoryview = _memory_view(address, nbytes, _PyBUF_READ)
    return mv


def checksum_ranges(ranges: Iterable[tuple[int, int]]) -> str:
    """xxh3-64 hex digest of the concatenated bytes of ``(address, length)`` ranges, in order."""
    hasher = xxhash.xxh3_64()
    for address, length in ranges:
        if length:
            hasher.update(view(address, length))
    return str(hasher.hexdigest())


def source_ranges(bucket: Bucket, replica_address: int) -> list[tuple[int, int]]:
    """The replica ranges a source sends for ``bucket``."""
    return [(replica_address + p.replica_offset, p.length) for p in bucket.pieces]


def target_ranges(bucket: Bucket) -> list[tuple[int, int]]:
    """The target memory ranges ``bucket`` lands in."""
    return [(p.remote_address, p.length) for p in bucket.pieces]


def source_checksum(bucket: Bucket, replica_address: int) -> str:
    """What the source reports for ``bucket``: its replica bytes."""
    return checksum_ranges(source_ranges(bucket, replica_address))


#: Per-tensor schemes (``Manifest.checksum``): the engine's own hash of one tensor's bytes.
TENSOR_HASHES: dict[str, Callable[[memoryview | bytes], str]] = {
    "tensor-sha256-8": sglang_cpu_hash,
    "tensor-sglang-gpu": sglang_gpu_hash,
    "tensor-sha256": lambda data: hashlib.sha256(data).hexdigest(),  # vLLM's /weight_checker (weight_checksum.py)
}


def tensor_ranges(manifest: Manifest, replica_address: int) -> list[tuple[int, int]]:
    """Each tensor's ``(address, nbytes)`` in the replica, in manifest order."""
    offsets = replica_offsets(manifest)
    return [(replica_address + offsets[t.name], t.nbytes) for t in manifest.tensors]


def tensor_checksum(scheme: str, address: int, nbytes: int) -> str:
    """The per-tensor hash ``scheme`` names, over ``nbytes`` at ``address`` (read in place)."""
    hasher = TENSOR_HASHES.get(scheme)
    if hasher is None:
        raise ValueError(f"{scheme} is not a per-tensor scheme")
    return hasher(view(address, nbytes) if nbytes else b"")


def tensor_checksums(manifest: Manifest, replica_address: int) -> list[str]:
    """Per tensor, in manifest order, the hash ``manifest.checksum`` names, over the replica's bytes."""
    return [tensor_checksum(manifest.checksum, a, n) for a, n in tensor_ranges(manifest, replica_address)]


def target_checksum(bucket: Bucket) -> str:
    """What a target computes for ``bucket`` over its own memory, to compare with the source's."""
    return checksum_ranges(target_ranges(bucket))
