"""Chunk sizes for the balanced policy: pure integer algorithms, no plan objects.

Lay the ``T = E * R`` targets out *rank-major* (all ``E`` engines of rank 0, then rank 1, ...) and give
each source a contiguous chunk. A chunk of ``c`` targets that starts ``o`` places into a rank touches
``ceil((o + c) / E)`` ranks, so its source holds that many replica shapes. Choosing the chunk sizes and
their order is the whole problem; this module does that.

Why contiguous chunks suffice (checked exhaustively against every assignment for small layouts in
``tests/unit/plan``):

* Max shapes. A source with load ``c`` needs at least ``ceil(c / E)`` shapes, because a rank has only
  ``E`` targets. With loads ``q`` or ``q + 1`` (``q = aE + b``) any order of chunks already gets within
  one of that bound, and :func:`_tiled_order` decides exactly when the bound itself is reachable.
* Total shapes. Sources that share ranks form connected components whose loads sum to a multiple of
  ``E``; a component of ``n`` sources over ``m`` ranks needs at least ``n + m - 1`` shapes. So total
  shapes >= ``S + R - (most components)``, and a contiguous layout meets it when its chunk boundaries
  land on as many rank boundaries as possible, which :func:`_most_aligned_order` maximises.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from weightsync.plan.document import PlanError

_UNREACHABLE = -(1 << 30)


def chunk_shapes(sizes: list[int], engines: int) -> list[int]:
    """Shapes of each chunk when ``sizes`` are laid out contiguously, rank-major."""
    shapes = []
    position = 0
    for size in sizes:
        offset = position % engines
        shapes.append(-(-(offset + size) // engines) if size else 0)
        position += size
    return shapes


def even_sizes(sources: int, targets: int, engines: int) -> list[int]:
    """Chunk sizes (``q`` or ``q + 1``), in layout order, with the fewest shapes per source.

    Lexicographically optimal: first the busiest source's shapes, then the total. Needs
    ``sources <= targets``.
    """
    q, rem = divmod(targets, sources)
    if rem == 0:
        return [q] * sources  # every chunk the same size: the order is forced
    b = q % engines
    if b == 0:
        # Small chunks are whole ranks when they start on a rank boundary, so put them all first;
        # a big chunk always needs one more rank, wherever it goes.
        return [q] * (sources - rem) + [q + 1] * rem
    order = _tiled_order(sources, rem, engines, b)
    if order is None:
        order = _most_aligned_order(sources, rem, q, engines)
    return [q + big for big in order]


def _tiled_order(sources: int, rem: int, engines: int, b: int) -> list[int] | None:
    """An order in which every source holds exactly the minimum ``a + 1`` shapes, or None.

    Write each chunk as ``a`` whole ranks plus a *fraction*: ``b`` targets (small) or ``b + 1`` (big).
    A chunk holds ``a + 1`` shapes exactly when its fraction does not cross a rank boundary, and as
    the chunks are laid end to end without gaps, that means the fractions tile whole ranks: the
    ``M = (S*b + rem) / E`` fractional ranks must each be filled exactly by ``n`` chunks, of which
    ``E - n*b`` are big. Such an ``n`` must lie in ``[ceil(E/(b+1)), floor(E/b)]``, and ``M`` groups
    with sizes in that range can hold ``S`` chunks iff ``M*lo <= S <= M*hi``; the big-chunk count then
    comes out to ``rem`` by itself.
    """
    groups = (sources * b + rem) // engines
    lo, hi = -(-engines // (b + 1)), engines // b
    if lo > hi or not groups * lo <= sources <= groups * hi:
        return None
    extra, spread = divmod(sources - groups * lo, groups)
    order: list[int] = []
    for g in range(groups):
        n = lo + extra + (1 if g < spread else 0)
        bigs = engines - n * b
        order += [1] * bigs + [0] * (n - bigs)
    return order


def _most_aligned_order(sources: int, rem: int, q: int, engines: int) -> list[int]:
    """The order of ``rem`` big chunks among ``sources`` whose boundaries hit most rank boundaries.

    Used when the ``a + 1`` bound is out of reach; every order then holds at most ``a + 2`` shapes, so
    only the total is left to minimise. A DP over (chunks placed ``i``, big chunks used ``j``): the
    position ``i*q + j`` is fixed by the state, so whether a boundary lands on a rank boundary is too.
    Rows are vectorised over ``j``; the choices are kept bit-packed for the walk back.
    """
    smalls = sources - rem
    best = np.full(rem + 1, _UNREACHABLE, dtype=np.int64)
    best[0] = 0
    choices: list[np.ndarray] = []
    for i in range(1, sources + 1):
        via_big = np.empty_like(best)
        via_big[0] = _UNREACHABLE
        via_big[1:] = best[:-1]
        took_big = via_big > best  # ties keep the small chunk, so the result is deterministic
        best = np.maximum(best, via_big)
        if i - smalls > 0:
            best[: i - smalls] = _UNREACHABLE
        if i < sources:
            best[(-i * q) % engines :: engines] += 1
        choices.append(np.packbits(took_big))
    order = [0] * sources
    j = rem
    for i in range(sources, 0, -1):
        big = int(np.unpackbits(choices[i - 1], count=rem + 1)[j])
        order[i - 1] = big
        j -= big
    return order


def min_cap(sources: int, ranks: int) -> int:
    """Smallest shape cap under which any plan exists: each source covers at most ``cap`` whole ranks."""
    return -(-ranks // sources)


def capped_sizes(sources: int, targets: int, engines: int, cap: int) -> list[int]:
    """Chunk sizes that hold at most ``cap`` shapes each, for a cap too tight for an even split.

    Minimises the busiest source's load ``L``, then maximises the idlest one's ``m``. A chunk starting
    at position ``P`` may end anywhere up to ``g(P) = min(P + L, E*(P//E + cap))``; ``g`` never
    decreases, so filling every chunk to the brim reaches furthest after any number of chunks (an
    exchange argument), which makes the greedy fill an exact test for ``L``. For ``m`` see
    :func:`_step_counts`.
    """
    ranks = targets // engines
    if cap * sources < ranks:
        raise PlanError(
            f"transfer.maxReplicaShapesPerSource={cap} is too small: {sources} trainer ranks holding at most "
            f"{cap} replica shape(s) each cannot cover the {ranks} ranks of an engine; "
            f"set it to at least {min_cap(sources, ranks)}"
        )
    low, high = -(-targets // sources), cap * engines
    while low < high:
        mid = (low + high) // 2
        if _greedy_reach(sources, engines, cap, mid) >= targets:
            high = mid
        else:
            low = mid + 1
    most = low
    # A least load of 1 is always feasible: with S <= T, a layout that leaves a source idle can split
    # a chunk of two or more in place and hand it half, and halves never hold more shapes.
    floor_low, floor_high = 1, targets // sources
    while floor_low < floor_high:
        mid = (floor_low + floor_high + 1) // 2
        if _feasible(sources, targets, engines, cap, most=most, least=mid):
            floor_low = mid
        else:
            floor_high = mid - 1
    return _walk_back(sources, targets, engines, cap, most=most, least=floor_low)


def _greedy_reach(sources: int, engines: int, cap: int, most: int) -> int:
    position = 0
    for _ in range(sources):
        position = min(position + most, engines * (position // engines + cap))
    return position


def _window(position: int, engines: int, cap: int, most: int, least: int) -> tuple[int, int]:
    """Where a chunk of ``least..most`` targets that ends at ``position`` and obeys the cap may start."""
    earliest = max(0, position - most, engines * (-(-position // engines) - cap))
    return earliest, position - least


def _step_counts(targets: int, engines: int, cap: int, most: int, least: int) -> tuple[list[int], list[int]]:
    """Fewest and most chunks (each ``least..most``, ``least >= 1``) that end exactly at each position.

    Both ends of the window of predecessors never decrease, so monotone deques give the window's
    min and max in O(T). Every count between the two is reachable too (checked exhaustively for
    E, R <= 10 and cap <= 4, and on random cases in the tests), which is what lets
    :func:`_walk_back` rebuild a layout from the two bounds alone.
    """
    fewest = [0] + [-1] * targets
    most_steps = [0] + [-1] * targets
    low_q: deque[int] = deque()
    high_q: deque[int] = deque()
    pushed = 0
    for position in range(1, targets + 1):
        earliest, latest = _window(position, engines, cap, most, least)
        while pushed <= latest:
            if most_steps[pushed] >= 0:
                while low_q and fewest[low_q[-1]] >= fewest[pushed]:
                    low_q.pop()
                low_q.append(pushed)
                while high_q and most_steps[high_q[-1]] <= most_steps[pushed]:
                    high_q.pop()
                high_q.append(pushed)
            pushed += 1
        while low_q and low_q[0] < earliest:
            low_q.popleft()
        while high_q and high_q[0] < earliest:
            high_q.popleft()
        if low_q:
            fewest[position] = fewest[low_q[0]] + 1
            most_steps[position] = most_steps[high_q[0]] + 1
    return fewest, most_steps


def _feasible(sources: int, targets: int, engines: int, cap: int, *, most: int, least: int) -> bool:
    fewest, most_steps = _step_counts(targets, engines, cap, most, least)
    return 0 <= fewest[targets] <= sources <= most_steps[targets]


def _walk_back(sources: int, targets: int, engines: int, cap: int, *, most: int, least: int) -> list[int]:
    """Rebuild chunk sizes from the end, each boundary as close to an even split as the bounds allow."""
    fewest, most_steps = _step_counts(targets, engines, cap, most, least)
    sizes = [0] * sources
    position = targets
    for i in range(sources, 0, -1):
        earliest, latest = _window(position, engines, cap, most, least)
        ideal = (i - 1) * targets // sources
        candidates = [p for p in range(earliest, latest + 1) if 0 <= fewest[p] <= i - 1 <= most_steps[p]]
        if not candidates:
            raise PlanError(f"planner bug: no capped layout of {targets} targets on {sources} sources")
        start = min(candidates, key=lambda p: (abs(p - ideal), p))
        sizes[i - 1] = position - start
        position = start
    return sizes
