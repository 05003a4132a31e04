"""A broadcast receiver's ``on_bucket``: cut this rank's shards out of the full tensors as they pass.

Each manifest entry is a concatenation along ``cat_dim`` of slices of full tensors (its ``parts``).
When a full tensor arrives, every part taken from it is copied straight into its place in the local
tensor, so no full tensor outlives its bucket. ``missing()`` names the parts that never came.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from weightsync_agent.layout.manifest import Placement, ShardPart, TensorEntry
from weightsync_agent.layout.placement import part_view
from weightsync_agent.transport.base import TransportError


@dataclass(frozen=True)
class _Target:
    entry: TensorEntry
    placement: Placement

    @property
    def part(self) -> ShardPart:
        return self.placement.part


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
            for placement in entry.placements:
                part = placement.part
                self._by_source.setdefault(part.source, []).append(_Target(entry, placement))
                self._missing[(entry.name, placement.index)] = part.source

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
                at = target.placement
                view = part_view(dest, entry.cat_dim, part.at, at.start, at.length)
                view.copy_(full.narrow(part.dim, part.start, part.length))
                self._missing.pop((entry.name, at.index), None)

    def missing(self) -> list[str]:
        """``"local name <- full name"`` for every part not yet received."""
        return sorted(f"{name} <- {source}" for (name, _), source in self._missing.items())
