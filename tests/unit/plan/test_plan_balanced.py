"""The ``balanced`` policy: even loads, then the fewest replica shapes, checked against brute force."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_builders import SpecBuilder, spec
from plan_oracle import best_even, best_under_cap

from weightsync.plan import Plan, PlanError, plan_for
from weightsync.plan.chunks import _step_counts, _window, chunk_shapes, even_sizes

SMALL = [
    (sources, engines, ranks)
    for sources in range(1, 5)
    for engines in range(1, 9)
    for ranks in range(1, 9)
    if engines * ranks <= 8
]


def _shapes(plan: Plan) -> tuple[int, int]:
    return plan.balance.max_shapes_per_source, plan.balance.total_shapes


def _loads_even(plan: Plan) -> bool:
    loads = plan.loads()
    q, rem = divmod(plan.layout.targets, plan.layout.sources)
    return sorted(loads) == sorted([q + 1] * rem + [q] * (plan.layout.sources - rem))


@pytest.mark.parametrize(("sources", "engines", "ranks"), SMALL)
def test_every_small_layout_matches_every_assignment(sources: int, engines: int, ranks: int) -> None:
    """S <= 4, T <= 8: the oracle scores all S**T maps of targets to sources."""
    plan = plan_for(spec(sources, engines, ranks))
    assert _loads_even(plan)
    assert _shapes(plan) == best_even(sources, engines, ranks)
    assert plan.balance.perfect and plan.balance.note == ""


@st.composite
def medium(draw: st.DrawFn) -> tuple[int, int, int]:
    """Up to 8 sources and 16 targets: past the sweep, still cheap for the rank-by-rank oracle."""
    engines = draw(st.integers(1, 8))
    ranks = draw(st.integers(1, 16 // engines))
    sources = draw(st.integers(1, 8))
    return sources, engines, ranks


@settings(max_examples=60, deadline=None)
@given(medium())
def test_shapes_are_optimal_beyond_the_sweep(layout: tuple[int, int, int]) -> None:
    """Against the rank-by-rank enumeration (exhaustive up to engine order within a rank)."""
    sources, engines, ranks = layout
    plan = plan_for(spec(sources, engines, ranks))
    assert _loads_even(plan)
    assert _shapes(plan) == best_even(sources, engines, ranks)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 300), st.integers(1, 64), st.sampled_from([1, 2, 3, 4, 8, 16]))
def test_loads_differ_by_at_most_one(sources: int, engines: int, tp: int) -> None:
    plan = plan_for(spec(sources, engines, tp))
    assert sorted(t for a in plan.sources for t in a.targets) == sorted(plan.layout.all_targets())
    assert _loads_even(plan)
    assert plan.balance.perfect
    q = max(plan.loads())
    # Never worse than the a-priori bound 1 + ceil(q/E); never better than ceil(q/E).
    assert -(-q // engines) <= plan.balance.max_shapes_per_source <= 1 + -(-q // engines)


def test_more_sources_than_targets_spreads_them() -> None:
    plan = plan_for(spec(10, 2, 2))
    busy = [a.source for a in plan.sources if a.targets]
    assert busy == [0, 2, 5, 7]  # floor(i * 10 / 4)
    assert plan.balance.max_shapes_per_source == 1
    assert plan.balance.perfect


def test_three_by_tp2_is_even() -> None:
    plan = plan_for(spec(3, 3, 2))
    assert plan.loads() == [2, 2, 2]
    # Loads of 2 cannot stay inside a rank of 3 targets everywhere: one source must straddle.
    assert _shapes(plan) == (2, 4)


def test_ten_thousand_targets_on_a_thousand_sources() -> None:
    plan = plan_for(spec(1000, 1250, 8))
    assert plan.loads() == [10] * 1000
    assert _shapes(plan) == (1, 1000)


# --- The shape cap ---------------------------------------------------------------------------------


CAPPED = [*SMALL, (5, 3, 4), (6, 3, 4), (3, 4, 2), (6, 4, 3)]


@pytest.mark.parametrize(("sources", "engines", "ranks"), CAPPED)
def test_cap_against_every_assignment(sources: int, engines: int, ranks: int) -> None:
    best = best_even(sources, engines, ranks)[0]
    for cap in range(1, best + 1):
        expected = best_under_cap(sources, engines, ranks, cap)
        build = SpecBuilder().trainers(sources).engines(engines, tp=ranks).cap(cap)
        if expected is None:
            with pytest.raises(PlanError, match=f"at least {-(-ranks // sources)}"):
                plan_for(build.build())
            continue
        plan = plan_for(build.build())
        assert plan.balance.max_shapes_per_source <= cap
        if cap == best:
            assert _shapes(plan) == best_even(sources, engines, ranks)
            assert plan.balance.note == ""
        else:
            assert (max(plan.loads()), min(plan.loads())) == expected
            assert not plan.balance.perfect
            assert "perfect balance is impossible" in plan.balance.note
            assert f"{min(plan.loads())} to {max(plan.loads())} targets" in plan.balance.note


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(1, 48), st.sampled_from([1, 2, 3, 4, 6, 8, 16]), st.integers(1, 6))
def test_cap_is_never_exceeded(sources: int, engines: int, tp: int, cap: int) -> None:
    uncapped = plan_for(spec(sources, engines, tp))
    build = SpecBuilder().trainers(sources).engines(engines, tp=tp).cap(cap)
    if cap * sources < tp:
        with pytest.raises(PlanError, match="maxReplicaShapesPerSource"):
            plan_for(build.build())
        return
    plan = plan_for(build.build())
    assert plan.balance.max_shapes_per_source <= cap
    if cap >= uncapped.balance.max_shapes_per_source:
        assert plan.sources == uncapped.sources
        assert plan.balance.note == ""
    else:
        assert plan.balance.note.startswith("perfect balance is impossible")
        assert not plan.balance.perfect


def test_impossible_cap_names_the_minimum() -> None:
    with pytest.raises(PlanError, match="cannot cover the 16 ranks of an engine; set it to at least 4"):
        plan_for(SpecBuilder().trainers(4).engines(2, tp=16).cap(3).build())


# --- Internals the docstrings lean on --------------------------------------------------------------


def test_step_counts_are_intervals() -> None:
    """Every chunk count between the fewest and the most reaches a position (exact bitset check)."""
    rng = random.Random(7)
    for _ in range(300):
        engines, ranks, cap = rng.randint(1, 8), rng.randint(1, 8), rng.randint(1, 3)
        targets = engines * ranks
        most = rng.randint(1, cap * engines)
        least = rng.randint(1, most)
        fewest, most_steps = _step_counts(targets, engines, cap, most, least)
        counts = [1] + [0] * targets  # bit i: reachable in exactly i chunks
        for position in range(1, targets + 1):
            earliest, latest = _window(position, engines, cap, most, least)
            for start in range(earliest, latest + 1):
                counts[position] |= counts[start] << 1
            bits = [i for i in range(counts[position].bit_length()) if counts[position] >> i & 1]
            if bits:
                assert bits == list(range(fewest[position], most_steps[position] + 1))
            else:
                assert most_steps[position] == -1


@pytest.mark.parametrize(
    ("sources", "targets", "engines"),
    [(4, 6, 3), (7, 24, 3), (10, 24, 3), (2467, 12288, 96)],
)
def test_even_sizes_keep_their_promise(sources: int, targets: int, engines: int) -> None:
    sizes = even_sizes(sources, targets, engines)
    assert sum(sizes) == targets
    assert max(sizes) - min(sizes) <= 1
    q = targets // sources
    assert max(chunk_shapes(sizes, engines)) <= 1 + -(-q // engines)
