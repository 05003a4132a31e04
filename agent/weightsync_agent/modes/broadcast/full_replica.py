"""A replica of the trainer's full (unsharded) tensors: what trainer rank 0 stages in broadcast mode.

In broadcast mode rank 0 sends every full tensor and each engine rank cuts its own shards, so rank 0's
sidecar needs the full tensors rather than per-target layouts. Describing them as a manifest (one
whole-tensor part per tensor, at made-up addresses in one made-up region) lets the ordinary replica
machinery — shared-memory file, staged flags, exclusion between staging and sending — hold them too.
"""

from __future__ import annotations

from collections.abc import Iterable

from weightsync_agent.layout.manifest import ITEMSIZE, Manifest, ManifestError, Region, ShardPart, TensorEntry

#: Nothing is ever written to these addresses: they only give the layout a valid shape.
BASE_ADDRESS = 1 << 20
ALIGN = 64


def full_tensors(manifests: Iterable[Manifest]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every full tensor any target cuts from, with its shape and dtype; ManifestError if targets disagree."""
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for manifest in manifests:
        for entry in manifest.tensors:
            for part in entry.parts:
                seen = found.setdefault(part.source, (part.full_shape, entry.dtype))
                if seen != (part.full_shape, entry.dtype):
                    raise ManifestError(
                        f"targets disagree about {part.source}: {list(seen[0])} {seen[1]} vs "
                        f"{list(part.full_shape)} {entry.dtype} (engine {manifest.engine} rank {manifest.rank})"
                    )
    return found


def full_layout_manifest(manifests: Iterable[Manifest]) -> Manifest:
    """A manifest whose tensors are the full tensors themselves, in name order."""
    entries: list[TensorEntry] = []
    address = BASE_ADDRESS
    for name, (shape, dtype) in sorted(full_tensors(manifests).items()):
        if not shape:
            raise ManifestError(f"{name}: scalar full tensors cannot be broadcast as parts")
        nbytes = ITEMSIZE[dtype]
        for size in shape:
            nbytes *= size
        part = ShardPart(source=name, full_shape=shape, dim=0, start=0, length=shape[0])
        entries.append(TensorEntry(name=name, dtype=dtype, shape=shape, address=address, nbytes=nbytes, parts=(part,)))
        address += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    if not entries:
        raise ManifestError("the targets' manifests name no tensors")
    return Manifest(
        engine=0,
        rank=0,
        session_id="full-tensors",
        tensors=tuple(entries),
        regions=(Region(address=BASE_ADDRESS, nbytes=max(address - BASE_ADDRESS, 1)),),
    )
