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
import functools
import hashlib
from collections.abc import Callable, Iterable

import torch
import xxhash

from weightsync_agent.layout.buckets import Bucket, replica_offsets
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.layout.quantize import SCALE_SUFFIX, dequantize
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


#: The checksum of a block-FP8 weight's scale: none of its own; the engine compares it through its weight.
COMPARED_WITH_WEIGHT = ""


def fp8_pairs(manifest: Manifest) -> dict[str, str]:
    """Block-FP8 weights and their scales (``<name>_scale_inv``, float32), weight name -> scale name: what SGLang's
    weight checker hashes together, as the dequantized weight (``utils/weight_checker.py``: a ``(weight,
    weight_scale_inv)`` pair of an FP8 block-quantized module; the scale gets no checksum of its own)."""
    by_name = manifest.by_name()
    pairs = {}
    for tensor in manifest.tensors:
        scale = by_name.get(f"{tensor.name}{SCALE_SUFFIX}")
        fp8 = tensor.dtype == "float8_e4m3fn" and len(tensor.shape) >= 2  # fused experts: [experts, out, in]
        if fp8 and scale is not None and scale.dtype == "float32" and len(scale.shape) == len(tensor.shape):
            pairs[tensor.name] = scale.name
    return pairs


def dequantized_bytes(weight: torch.Tensor, scale: torch.Tensor) -> bytes:
    """What SGLang's checker hashes for a block-FP8 weight (``Fp8BlockComparable.dequantize`` in 0.5.23): the weight
    times its scale repeated over square blocks of ``in // scale columns`` (over the last two dims: fused experts
    keep their leading one), in float32, cast to bfloat16."""
    cols = weight.shape[-1]
    block = cols // scale.shape[-1]
    if not block or cols % scale.shape[-1]:
        raise ValueError(
            f"cannot infer the FP8 block of a {list(weight.shape)} weight from a {list(scale.shape)} scale"
        )
    dequantized = dequantize(weight, scale, (block, block)).to(torch.bfloat16).contiguous()
    return dequantized.view(torch.uint8).numpy().tobytes()


def tensor_jobs(manifest: Manifest, replica_address: int) -> list[Callable[[], str]]:
    """Per tensor, in manifest order, a call computing the hash ``manifest.checksum`` names over the replica's bytes
    (a pool runs them side by side); a block-FP8 weight's over its dequantized value, its scale's
    :data:`COMPARED_WITH_WEIGHT` (:func:`fp8_pairs`)."""
    ranges = dict(zip((t.name for t in manifest.tensors), tensor_ranges(manifest, replica_address), strict=True))
    pairs = fp8_pairs(manifest)
    scales = set(pairs.values())
    by_name = manifest.by_name()
    scheme = manifest.checksum
    jobs: list[Callable[[], str]] = []
    for tensor in manifest.tensors:
        address, nbytes = ranges[tensor.name]
        if tensor.name in scales:
            jobs.append(lambda: COMPARED_WITH_WEIGHT)
        elif tensor.name in pairs:
            scale = by_name[pairs[tensor.name]]
            weight_at, scale_at = (address, nbytes, tensor.shape), (*ranges[scale.name], scale.shape)
            jobs.append(functools.partial(_dequantized_checksum, scheme, weight_at, scale_at))
        else:
            jobs.append(functools.partial(tensor_checksum, scheme, address, nbytes))
    return jobs


def tensor_checksums(manifest: Manifest, replica_address: int) -> list[str]:
    """:func:`tensor_jobs`, run here."""
    return [job() for job in tensor_jobs(manifest, replica_address)]


def _dequantized_checksum(
    scheme: str, weight_at: tuple[int, int, tuple[int, ...]], scale_at: tuple[int, int, tuple[int, ...]]
) -> str:
    weight = _typed(weight_at[0], weight_at[1], torch.float8_e4m3fn, weight_at[2])
    scale = _typed(scale_at[0], scale_at[1], torch.float32, scale_at[2])
    return TENSOR_HASHES[scheme](dequantized_bytes(weight, scale))


def _typed(address: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A copy of ``nbytes`` at ``address`` as a ``dtype`` tensor of ``shape`` (replica offsets need not be aligned)."""
    return torch.frombuffer(bytearray(view(address, nbytes)), dtype=torch.uint8).view(dtype).view(shape)


def target_checksum(bucket: Bucket) -> str:
    """What a target computes for ``bucket`` over its own memory, to compare with the source's."""
    return checksum_ranges(target_ranges(bucket))
