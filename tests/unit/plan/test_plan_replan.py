"""``replan``: keep what still fits, move only what balance forces, stay a valid balanced plan."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from plan_builders import SpecBuilder, spec

from weightsync.plan import Plan, plan_for, replan
from weightsync.plan.replan import trim


def _forced_moves(old: Plan, new: Plan) -> int:
    """Fewest targets surviving sources must give up so every new load is q or q+1.

    Computed from the counts alone: source i keeps k_i still-existing targets; with quota q it must
    shed max(0, k_i - q), and each of the rem quotas of q+1 saves one target at a source with k_i > q.
    """
    sources, targets = new.layout.sources, new.layout.targets
    q, rem = divmod(targets, sources)
    engines, ranks = new.layout.engines, new.layout.ranks_per_engine
    kept = [
        sum(1 for e, r in old.sources[i].targets if e < engines and r < ranks)
        for i in range(min(sources, old.layout.sources))
    ]
    return sum(max(0, k - q) for k in kept) - min(rem, sum(1 for k in kept if k > q))


def _moves(old: Plan, new: Plan) -> tuple[int, int]:
    """(moved away from a source that still exists, moved because their source is gone)."""
    from_surviving = from_departed = 0
    for target, source in new.source_of.items():
        before = old.source_of.get(target)
        if before is None or before == source:
            continue
        if before < new.layout.sources:
            from_surviving += 1
        else:
            from_departed += 1
    return from_surviving, from_departed


def _even(plan: Plan) -> bool:
    return max(plan.loads()) - min(plan.loads()) <= 1


sizes = st.tuples(st.integers(1, 40), st.integers(1, 24))


@settings(max_examples=120, deadline=None)
@given(sizes, sizes, st.sampled_from([1, 2, 4, 8]))
def test_replan_keeps_balance_and_moves_only_what_it_must(
    before: tuple[int, int], after: tuple[int, int], tp: int
) -> None:
    old = plan_for(spec(before[0], before[1], tp), group="g", namespace="ns")
    new = replan(old, spec(after[0], after[1], tp))
    assert (new.group, new.namespace, new.policy) == ("g", "ns", "balanced")
    assert sorted(t for a in new.sources for t in a.targets) == sorted(new.layout.all_targets())
    assert _even(new) and new.balance.perfect and new.balance.note == ""
    from_surviving, from_departed = _moves(old, new)
    assert from_surviving == _forced_moves(old, new)
    assert new.moved_targets == from_surviving + from_departed
    assert new.revision == (old.revision if new.hash == old.hash else old.revision + 1)
    assert Plan.from_json(new.to_json()) == new


def test_same_spec_is_the_same_plan() -> None:
    old = plan_for(spec(7, 5, 4), revision=3)
    new = replan(old, spec(7, 5, 4))
    assert new == old.sealed(moved_targets=0)
    assert (new.revision, new.hash, new.moved_targets) == (3, old.hash, 0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 16), st.integers(1, 16), st.sampled_from([1, 2, 4, 8]))
def test_scale_engines_up_and_back_down(sources: int, engines: int, added: int, tp: int) -> None:
    original = plan_for(spec(sources, engines, tp))
    grown = replan(original, spec(sources, engines + added, tp))
    assert grown.moved_targets == 0
    assert _even(grown)
    shrunk = replan(grown, spec(sources, engines, tp))
    assert shrunk.hash == original.hash
    assert shrunk.revision == original.revision + 2


def test_adding_engines_keeps_one_replica_per_source() -> None:
    old = plan_for(spec(1000, 1250, 8))
    assert old.balance.max_shapes_per_source == 1
    for engines in (1251, 1300, 2000):
        new = replan(old, spec(1000, engines, 8))
        assert new.moved_targets == 0
        assert new.balance.max_shapes_per_source == 1
        assert new.balance.perfect


def test_trainer_scale_down_moves_only_the_departed() -> None:
    old = plan_for(spec(12, 6, 4))
    new = replan(old, spec(8, 6, 4))
    from_surviving, from_departed = _moves(old, new)
    assert from_departed == sum(len(a.targets) for a in old.sources[8:])
    assert from_surviving == 0
    assert new.loads() == [3] * 8


def test_trainer_scale_up_sheds_the_minimum() -> None:
    old = plan_for(spec(4, 6, 4))
    new = replan(old, spec(6, 6, 4))
    assert new.loads() == [4] * 6
    assert new.moved_targets == 4 * (6 - 4)  # each old source gives up exactly two


def test_cap_breach_falls_back_to_a_fresh_plan() -> None:
    old = plan_for(spec(4, 4, 2, cap=1))
    assert old.loads() == [2, 2, 2, 2]
    target = spec(3, 4, 2, cap=1)
    new = replan(old, target)
    fresh = plan_for(target)
    assert new.sources == fresh.sources
    assert new.balance.max_shapes_per_source == 1
    assert new.balance.note == fresh.balance.note != ""
    assert new.moved_targets == sum(1 for t, s in new.source_of.items() if old.source_of[t] != s)


def test_policy_change_is_a_fresh_plan() -> None:
    old = plan_for(spec(3, 3, 2))
    target = SpecBuilder().trainers(3).engines(3, tp=2).planner("miles").build()
    new = replan(old, target)
    assert new.policy == "miles"
    assert new.sources == plan_for(target).sources
    assert new.revision == old.revision + 1


def test_trim_drops_the_least_held_ranks_first() -> None:
    targets = [(0, 0), (1, 0), (2, 0), (0, 1), (0, 2), (1, 2)]
    kept, dropped = trim(targets, 3)
    assert kept == [(0, 0), (1, 0), (2, 0)]
    assert dropped == [(0, 2), (1, 2), (0, 1)]
    assert trim(targets, 6) == (targets, [])
