"""Where a manifest part lands in a local tensor, as a torch view; and a local tensor cut from full ones.

Every side that cuts or places parts (the source's replica, the broadcast receiver, the broadcast
sender's checksums) goes through :func:`part_view`, so ``at`` (a sub-tensor picked by leading indices)
and the offset along ``cat_dim`` mean the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync_agent.layout.manifest import TensorEntry


def part_view(local: torch.Tensor, cat_dim: int, at: tuple[int, ...], start: int, length: int) -> torch.Tensor:
    """The view of ``local`` that a part filling ``[start, start + length)`` along ``cat_dim`` of ``local[at]`` is."""
    if not local.dim():
        return local
    sub = local[at] if at else local
    return sub.narrow(cat_dim - len(at), start, length)


def cut(entry: TensorEntry, full: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The local tensor ``entry`` describes, cut from the full tensors ``full`` (padding zero)."""
    first = full[entry.parts[0].source]
    if len(entry.parts) == 1 and not entry.padding and not entry.lead:
        return first.narrow(entry.parts[0].dim, entry.parts[0].start, entry.parts[0].length)
    out = torch.zeros(entry.shape, dtype=first.dtype, device=first.device)
    for placement in entry.placements:
        part = placement.part
        piece = full[part.source].narrow(part.dim, part.start, part.length)
        part_view(out, entry.cat_dim, part.at, placement.start, placement.length).copy_(piece)
    return out
