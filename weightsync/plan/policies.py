"""Assignment policies. Each returns, per source, the list of targets it writes. Pure."""

from __future__ import annotations

from weightsync.plan.document import Layout, Target


def miles(layout: Layout) -> list[list[Target]]:
    """The published SGLang/Miles round-robin rule (RemoteTransferPlan.plan_p2p)."""
    sources = layout.sources
    targets = list(layout.all_targets())
    out: list[list[Target]] = [[] for _ in range(sources)]
    holders: dict[int, list[int]] = {}  # engine rank -> sources already holding it
    count: dict[tuple[int, int], int] = {}  # (source, engine rank) -> targets of that rank
    first = min(sources, len(targets))
    for i in range(first):
        engine, rank = targets[i]
        out[i].append((engine, rank))
        holders.setdefault(rank, []).append(i)
        count[(i, rank)] = count.get((i, rank), 0) + 1
    next_source = first % sources
    for engine, rank in targets[first:]:
        if rank in holders:
            chosen = min(holders[rank], key=lambda s: (count[(s, rank)], s))
        else:
            chosen = next_source
            next_source = (next_source + 1) % sources
            holders.setdefault(rank, []).append(chosen)
        out[chosen].append((engine, rank))
        count[(chosen, rank)] = count.get((chosen, rank), 0) + 1
    return out


def balanced(layout: Layout, *, max_shapes: int | None = None) -> tuple[list[list[Target]], str]:
    """Even loads, few shapes. (Placeholder: contiguous rank-major chunks.)"""
    sources = layout.sources
    ordered = [(e, r) for r in range(layout.ranks_per_engine) for e in range(layout.engines)]
    q, rem = divmod(len(ordered), sources)
    out: list[list[Target]] = []
    pos = 0
    for i in range(sources):
        size = q + (1 if i < rem else 0)
        out.append(ordered[pos : pos + size])
        pos += size
    return out, ""
