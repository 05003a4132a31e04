"""A broadcast receiver's ``on_bucket``: cut this rank's shards out of the full tensors as they pass.

Each manifest entry is a concatenation along ``cat_dim`` of slices of full tensors (its ``parts``).
When a full tensor arrives, every part taken from it is copied straight into its place in the local
tensor, so no full tensor outlives its bucket. ``missing()`` names the parts that never came.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from weightsync_agent.layout.manifest import ShardPart, TensorEntry
from weightsync_agent.transport.base import TransportError


@dataclass(frozen=True)
class _Target:
    entry: TensorEntry
    part: ShardPart
    index: int
    at: int  # where the part starts along the entry's cat_dim


class ShardAssembler:
    def __init__(self, entries: Sequence[TensorEntry], destinations: Mapping[str, torch.Tensor]) -> None:
        self._destinations = destinations
        self._by_source: dict[str, list[_Target]] = {}
        self._missing: dict[tuple[str, int], str] = {}
        for entry in entries:
            if entry.name not in destinations:
                raise TransportError(f"no destination tensor for {entry.name}")
            if tuple(destinations[entry.name].shape) != entry.shape:
                raise TransportError(
                    f"{entry.name}: destination has shape {list(destinations[entry.name].shape)}, "
                    f"the manifest says {list(entry.shape)}"
                )
            at = 0
            for index, part in enumerate(entry.parts):
                self._by_source.setdefault(part.source, []).append(_Target(entry, part, index, at))
                self._missing[(entry.name, index)] = part.source
                at += part.shape[entry.cat_dim]

    def __call__(self, names_and_views: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, full in names_and_views:
            for target in self._by_source.get(name, ()):
                part, entry = target.part, target.entry
                if tuple(full.shape) != part.full_shape:
                    raise TransportError(
                        f"{entry.name}: full tensor {name} arrived with shape {list(full.shape)}, "
                        f"the manifest expects {list(part.full_shape)}"
                    )
                dest = self._destinations[entry.name]
                if full.dtype != dest.dtype:
                    raise TransportError(f"{entry.name}: {name} arrived as {full.dtype}, destination is {dest.dtype}")
                length = part.shape[entry.cat_dim]
                dest.narrow(entry.cat_dim, target.at, length).copy_(full.narrow(part.dim, part.start, part.length))
                self._missing.pop((entry.name, target.index), None)

    def missing(self) -> list[str]:
        """``"local name <- full name"`` for every part not yet received."""
        return sorted(f"{name} <- {source}" for (name, _), source in self._missing.items())
