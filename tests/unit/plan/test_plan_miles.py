"""The ``miles`` policy: the published round-robin rule, exactly."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st
from plan_builders import SpecBuilder

from weightsync.plan import Target, layout_of, plan_for, replan
from weightsync.plan.policies import miles


def reference(sources: int, engines: int, ranks: int) -> list[list[Target]]:
    """A literal transcription of miles ``RemoteTransferPlan.plan_p2p``, kept deliberately naive."""
    all_targets = [(e, r) for e in range(engines) for r in range(ranks)]
    assignments: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    last = -1
    for source_rank, (idx, target) in zip(range(sources), enumerate(all_targets), strict=False):
        last = idx
        assignments[source_rank][target[1]].append(target[0])
    cur_source_index = 0
    for engine, rank in all_targets[last + 1 :]:
        counted = [len(assignments[s][rank]) for s in range(sources)]
        if max(counted) > 0:
            _, chosen = min((val, idx) for idx, val in enumerate(counted) if val > 0)
        else:
            chosen = cur_source_index % sources
            cur_source_index += 1
        assignments[chosen][rank].append(engine)
    return [sorted((e, r) for r, es in assignments[s].items() for e in es) for s in range(sources)]


def _miles(sources: int, engines: int, tp: int) -> list[list[Target]]:
    layout = layout_of(SpecBuilder().trainers(sources).engines(engines, tp=tp).planner("miles").build())
    return [sorted(ts) for ts in miles(layout)]


def test_three_sources_three_engines_tp2() -> None:
    # (0,0)->0 (0,1)->1 (1,0)->2 one to one; (1,1): only source 1 holds rank 1; (2,0): sources 0 and 2
    # hold one rank-0 target each, tie to 0; (2,1): source 1 again.
    assert _miles(3, 3, 2) == [[(0, 0), (2, 0)], [(0, 1), (1, 1), (2, 1)], [(1, 0)]]
    plan = plan_for(SpecBuilder().trainers(3).engines(3, tp=2).planner("miles").build())
    assert plan.loads() == [2, 3, 1]
    assert not plan.balance.perfect


def test_code_docstring_example() -> None:
    # 4 sources, 2 engines x 3 ranks: (1,1) goes to source 1 and (1,2) to source 2, which hold those ranks.
    assert _miles(4, 2, 3) == [[(0, 0)], [(0, 1), (1, 1)], [(0, 2), (1, 2)], [(1, 0)]]


def test_blog_worked_example() -> None:
    # PP=4 with 8 ranks per stage is 8 sources per stage; 2 engines x 16 ranks. Source 0 writes targets
    # 0, 16 (rank 0 of both engines) and 8, 24 (rank 8): two replica shapes per training rank.
    out = _miles(8, 2, 16)
    assert out[0] == [(0, 0), (0, 8), (1, 0), (1, 8)]
    assert sorted(e * 16 + r for e, r in out[0]) == [0, 8, 16, 24]
    for source, targets in enumerate(out):
        assert targets == [(0, source), (0, source + 8), (1, source), (1, source + 8)]
    plan = plan_for(SpecBuilder().trainers(2, ranks_per_pod=4).engines(2, tp=16).planner("miles").build())
    assert plan.balance.max_shapes_per_source == 2
    assert plan.balance.total_shapes == 16


def test_more_sources_than_targets_leaves_the_rest_idle() -> None:
    out = _miles(10, 2, 2)
    assert out[:4] == [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)]]
    assert all(not ts for ts in out[4:])


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(1, 12))
def test_matches_the_published_code(sources: int, engines: int, tp: int) -> None:
    assert _miles(sources, engines, tp) == reference(sources, engines, tp)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 24), st.integers(1, 8), st.integers(1, 8), st.integers(1, 8))
def test_appending_engines_moves_nothing(sources: int, engines: int, tp: int, added: int) -> None:
    before = SpecBuilder().trainers(sources).engines(engines, tp=tp).planner("miles")
    old = plan_for(before.build(), group="g")
    new = replan(old, before.engines(engines + added, tp=tp).build())
    assert new.moved_targets == 0
    assert all(new.source_of[t] == s for t, s in old.source_of.items())
    assert new.revision == old.revision + 1


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 24), st.integers(1, 24), st.integers(1, 6), st.integers(1, 6))
def test_trainer_scale_reports_moves(before: int, after: int, engines: int, tp: int) -> None:
    old = plan_for(SpecBuilder().trainers(before).engines(engines, tp=tp).planner("miles").build())
    spec = SpecBuilder().trainers(after).engines(engines, tp=tp).planner("miles").build()
    new = replan(old, spec)
    fresh = plan_for(spec)
    assert new.sources == fresh.sources
    assert new.moved_targets == sum(1 for t, s in old.source_of.items() if fresh.source_of[t] != s)
    assert new.revision == (old.revision if before == after else old.revision + 1)
