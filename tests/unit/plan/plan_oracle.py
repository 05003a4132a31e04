"""Brute-force oracles for the balanced planner: every assignment of targets to sources, scored.

Two enumerations, both exhaustive over what matters:

* :func:`every_assignment` lists all ``S**T`` maps target -> source (numpy, S <= 4 and T <= 8).
* :func:`every_profile` builds the per-source (load, shapes) multisets rank by rank, splitting each
  rank's ``E`` targets among the sources in every way; which engine goes where inside a rank changes
  neither loads nor shapes, and merging equal multisets keeps it small enough for T up to ~16.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np


@functools.cache
def every_assignment(sources: int, engines: int, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """(loads, shapes), each of shape (S**T, S), over every map of the T engine-major targets."""
    targets = engines * ranks
    index = np.arange(sources**targets, dtype=np.int64)
    owner = (index[:, None] // sources ** np.arange(targets, dtype=np.int64)) % sources
    loads = np.stack([(owner == s).sum(axis=1) for s in range(sources)], axis=1)
    shapes = np.stack(
        [(owner == s).reshape(-1, engines, ranks).any(axis=1).sum(axis=1) for s in range(sources)], axis=1
    )
    return loads, shapes


def _splits(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _splits(total - first, parts - 1):
            yield (first, *rest)


@functools.cache
def every_profile(sources: int, engines: int, ranks: int) -> frozenset[tuple[tuple[int, int], ...]]:
    """Every reachable sorted tuple of per-source (load, shapes)."""
    splits = list(_splits(engines, sources))
    current = {tuple((0, 0) for _ in range(sources))}
    for _ in range(ranks):
        current = {
            tuple(sorted((load + n, held + (n > 0)) for (load, held), n in zip(profile, split, strict=True)))
            for profile in current
            for split in splits
        }
    return frozenset(current)


@functools.cache
def _profiles(sources: int, engines: int, ranks: int) -> tuple[tuple[list[int], list[int]], ...]:
    if sources ** (engines * ranks) <= 70_000:
        loads, shapes = every_assignment(sources, engines, ranks)
        rows = np.unique(np.hstack([loads, shapes]), axis=0).tolist()
        return tuple((row[:sources], row[sources:]) for row in rows)
    return tuple(([lo for lo, _ in p], [sh for _, sh in p]) for p in every_profile(sources, engines, ranks))


@functools.cache
def best_even(sources: int, engines: int, ranks: int) -> tuple[int, int]:
    """Fewest (max shapes, total shapes) over assignments whose loads differ by at most one."""
    return min(
        (max(shapes), sum(shapes))
        for loads, shapes in _profiles(sources, engines, ranks)
        if max(loads) - min(loads) <= 1
    )


@functools.cache
def best_under_cap(sources: int, engines: int, ranks: int, cap: int) -> tuple[int, int] | None:
    """(lowest max load, highest min load) over assignments with at most ``cap`` shapes per source."""
    profiles = _profiles(sources, engines, ranks)
    found = [(max(loads), -min(loads)) for loads, shapes in profiles if max(shapes) <= cap]
    if not found:
        return None
    most, neg_least = min(found)
    return most, -neg_least
