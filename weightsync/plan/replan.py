"""Incremental re-planning for the balanced policy: keep what still fits, place the rest. Pure.

When engines or trainer replicas come and go, a fresh plan could reshuffle most targets, and every
moved target costs its new source a replica it may not hold yet. This keeps each surviving source's
targets up to its new quota and places only the orphans.

Minimal movement: the quotas are ``q`` or ``q + 1`` and must sum to ``T``; a surviving source that
keeps ``k_i`` targets loses ``max(0, k_i - quota_i)`` of them, and that sum is smallest when the
``q + 1`` quotas go to the sources keeping the most (swapping a larger ``k`` onto a larger quota never
raises it). Every other target of a surviving source stays put.
"""

from __future__ import annotations

import heapq
from collections import Counter

from weightsync.plan.document import Layout, Plan, Target


def quotas(kept: list[int], targets: int, *, wanted: list[bool] | None = None) -> list[int]:
    """``q`` or ``q + 1`` per source, the ``q + 1`` going to those that keep the most.

    Among sources that keep equally many, ``wanted`` ones come first (see :func:`wanted_sources`),
    then the lower index.
    """
    q, rem = divmod(targets, len(kept))
    out = [q] * len(kept)
    prefer = wanted or [False] * len(kept)
    for source in sorted(range(len(kept)), key=lambda s: (-kept[s], not prefer[s], s))[:rem]:
        out[source] += 1
    return out


def wanted_sources(carried: list[list[Target]], orphans: Counter[int], q: int) -> list[bool]:
    """Sources that, given a ``q + 1`` quota, could take an orphan of a rank they already hold.

    Up to ``orphans[r]`` holders of each rank ``r`` are picked (lower index first), so that when
    engines are added the spare quota lands where the new targets' ranks already live and no source
    needs a new replica. Only a tie-breaker: it never changes how many targets stay put.
    """
    wanted = [False] * len(carried)
    left = Counter(orphans)
    for source, targets in enumerate(carried):
        if len(targets) > q:
            continue
        for rank in sorted({r for _, r in targets}):
            if left[rank] > 0:
                left[rank] -= 1
                wanted[source] = True
                break
    return wanted


def trim(targets: list[Target], quota: int) -> tuple[list[Target], list[Target]]:
    """Split a source's targets into (kept, dropped), dropping the ranks it holds fewest of first.

    Dropping whole ranks first frees replica shapes, not just load.
    """
    if len(targets) <= quota:
        return targets, []
    held = Counter(rank for _, rank in targets)
    ordered = sorted(targets, key=lambda t: (-held[t[1]], t[1], t[0]))
    return ordered[:quota], ordered[quota:]


def rebalance(old: Plan, layout: Layout) -> list[list[Target]]:
    """``old``'s assignment carried over to ``layout``: quotas kept, orphans placed.

    Orphans (targets of departed sources, trimmed targets and new targets) are placed rank-major,
    each on a source below quota that already holds its rank if there is one (no new replica), else
    on the least loaded source below quota; ties go to the lower index.
    """
    engines, ranks = layout.engines, layout.ranks_per_engine
    carried: list[list[Target]] = []
    for source in range(layout.sources):
        previous = old.sources[source].targets if source < len(old.sources) else ()
        carried.append([(e, r) for e, r in previous if e < engines and r < ranks])
    surviving = {t for ts in carried for t in ts}
    homeless = Counter(r for r in range(ranks) for e in range(engines) if (e, r) not in surviving)
    q = layout.targets // layout.sources
    wanted = wanted_sources(carried, homeless, q)
    quota = quotas([len(ts) for ts in carried], layout.targets, wanted=wanted)
    out: list[list[Target]] = []
    for source, targets in enumerate(carried):
        kept, _ = trim(targets, quota[source])
        out.append(kept)
    placed = {t for ts in out for t in ts}
    orphans = [(e, r) for r in range(ranks) for e in range(engines) if (e, r) not in placed]
    _place(out, quota, orphans)
    return out


def _place(out: list[list[Target]], quota: list[int], orphans: list[Target]) -> None:
    """Greedy placement with lazy heaps keyed by (load, source).

    ``anyone`` gets a fresh entry at every load change, so its stale entries are dropped. A rank's
    heap is refreshed only for the rank just placed; elsewhere an entry may be stale, and since loads
    only grow it then sorts too early, so popping it and re-pushing it with the current load keeps the
    top correct without touching every heap a source is in.
    """
    load = [len(ts) for ts in out]
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for source, targets in enumerate(out):
        if load[source] < quota[source]:
            for rank in {r for _, r in targets}:
                by_rank.setdefault(rank, []).append((load[source], source))
    for heap in by_rank.values():
        heapq.heapify(heap)
    anyone = [(load[s], s) for s in range(len(out)) if load[s] < quota[s]]
    heapq.heapify(anyone)
    for target in orphans:
        rank = target[1]
        chosen = _pop_open(by_rank.get(rank), load, quota, refresh=True)
        if chosen is None:
            chosen = _pop_open(anyone, load, quota, refresh=False)
            if chosen is None:  # quotas sum to the target count, so someone always has room
                raise AssertionError("no source below quota")
            by_rank.setdefault(rank, [])
        out[chosen].append(target)
        load[chosen] += 1
        if load[chosen] < quota[chosen]:
            heapq.heappush(by_rank[rank], (load[chosen], chosen))
            heapq.heappush(anyone, (load[chosen], chosen))


def _pop_open(heap: list[tuple[int, int]] | None, load: list[int], quota: list[int], *, refresh: bool) -> int | None:
    """Remove and return the least loaded source below quota; full sources' entries are dropped."""
    while heap:
        entry_load, source = heapq.heappop(heap)
        if load[source] >= quota[source]:
            continue
        if entry_load != load[source]:
            if refresh:
                heapq.heappush(heap, (load[source], source))
            continue
        return source
    return None


def moved_targets(old: Plan, new: Plan) -> int:
    """Targets present in both plans whose source changed (a departed source counts as a change)."""
    before = old.source_of
    return sum(1 for target, source in new.source_of.items() if before.get(target, source) != source)
