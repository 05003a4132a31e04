"""Assignment policies. Each returns, per source, the list of targets it writes. Pure."""

from __future__ import annotations

import heapq

from weightsync.plan.chunks import capped_sizes, chunk_shapes, even_sizes
from weightsync.plan.document import Layout, Target


def miles(layout: Layout) -> list[list[Target]]:
    """The published SGLang/Miles round-robin rule (miles ``RemoteTransferPlan.plan_p2p``).

    Targets are taken engine-major. The first ``min(S, T)`` go one to one; each later ``(e, r)`` goes
    to the source holding the fewest rank-``r`` targets among those already holding rank ``r`` (ties
    to the lower index), or, when nobody holds ``r`` yet, to the next source round-robin.

    A heap per rank keeps that choice O(log S); only the popped source's count changes, so the heap
    never holds stale entries.
    """
    sources = layout.sources
    targets = list(layout.all_targets())
    out: list[list[Target]] = [[] for _ in range(sources)]
    holders: dict[int, list[tuple[int, int]]] = {}  # rank -> heap of (rank-r targets held, source)
    first = min(sources, len(targets))
    for source in range(first):
        engine, rank = targets[source]
        out[source].append((engine, rank))
        heapq.heappush(holders.setdefault(rank, []), (1, source))
    next_source = 0
    for engine, rank in targets[first:]:
        heap = holders.get(rank)
        if heap:
            held, chosen = heap[0]
            heapq.heapreplace(heap, (held + 1, chosen))
        else:
            chosen = next_source
            next_source = (next_source + 1) % sources
            holders[rank] = [(1, chosen)]
        out[chosen].append((engine, rank))
    return out


def balanced(layout: Layout, *, max_shapes: int | None = None) -> tuple[list[list[Target]], str]:
    """Even loads first, then the fewest replica shapes per source; see :mod:`weightsync.plan.chunks`.

    Returns the assignment and a note, empty unless ``max_shapes`` forced an uneven split.
    """
    sources, targets, engines = layout.sources, layout.targets, layout.engines
    if sources > targets:
        return _spread(layout), ""
    sizes = even_sizes(sources, targets, engines)
    note = ""
    best = max(chunk_shapes(sizes, engines))
    if max_shapes is not None and best > max_shapes:
        sizes = capped_sizes(sources, targets, engines, max_shapes)
        q, rem = divmod(targets, sources)
        even = f"{q}" if rem == 0 else f"{q} or {q + 1}"
        note = (
            f"perfect balance is impossible with maxReplicaShapesPerSource={max_shapes}: an even split "
            f"({even} targets per source) needs {best} shapes per source. Under the cap, sources write "
            f"{min(sizes)} to {max(sizes)} targets, and the busiest one sets the sync time."
        )
    return _lay_out(sizes, engines), note


def _spread(layout: Layout) -> list[list[Target]]:
    """More sources than targets: one target each, spaced out so busy ranks land on different pods."""
    sources, targets = layout.sources, layout.targets
    out: list[list[Target]] = [[] for _ in range(sources)]
    for index, target in enumerate(layout.all_targets()):
        out[index * sources // targets].append(target)
    return out


def _lay_out(sizes: list[int], engines: int) -> list[list[Target]]:
    """Cut the rank-major target order into consecutive chunks of ``sizes``."""
    out: list[list[Target]] = []
    position = 0
    for size in sizes:
        out.append([(p % engines, p // engines) for p in range(position, position + size)])
        position += size
    return out
