"""Which versions the coordinator adopts (docs/security.md, "Round integrity"): forward only, at most
``transfer.maxVersionStep`` ahead, and only once every trainer rank published that very version.

Before: one publish of 2^53 - 1 committed it, and every later version was refused for good (a one-rank trainer is its
own quorum); a rank whose latest publish was newer than the round's version counted as ready for it; a committed
version the coordinator's pod reported lifted the engines' own word however far. The real processes:
``tests/security/test_bounds.py::test_a_huge_version_cannot_lock_the_group_out``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_engine_versions import plan

from weightsync.api.v1alpha1 import DEFAULT_MAX_VERSION_STEP, MAX_WEIGHT_VERSION
from weightsync.plan import Plan
from weightsync_agent.directory import StaticDirectory
from weightsync_agent.rounds.coordinator import Coordinator
from weightsync_agent.rounds.versions import credible_floor, version_refusal
from weightsync_agent.source.agent import SourceAgent

versions = st.integers(0, MAX_WEIGHT_VERSION)
steps = st.integers(1, MAX_WEIGHT_VERSION)


@given(versions, st.none() | versions, steps)
def test_a_version_is_adopted_only_forward_and_within_the_step(version: int, committed: int | None, step: int) -> None:
    refused = version_refusal(version, committed, step)
    base = 0 if committed is None else committed
    expected = (committed is not None and version <= committed) or version - base > step
    assert (refused is not None) == expected
    if refused is not None and version > base:
        assert "maxVersionStep" in refused and str(base + step) in refused  # says what it would take


@given(st.none() | versions, steps)
def test_the_next_versions_are_never_refused(committed: int | None, step: int) -> None:
    base = 0 if committed is None else committed
    for version in {base + 1, base + min(step, 1000), base + step}:
        if version <= MAX_WEIGHT_VERSION:
            assert version_refusal(version, committed, step) is None


def test_the_pods_floor_lifts_the_engines_word_by_at_most_the_step() -> None:
    assert credible_floor(12, 10, 5) and credible_floor(3, 10, 5)
    assert not credible_floor(MAX_WEIGHT_VERSION, 10, DEFAULT_MAX_VERSION_STEP)
    assert credible_floor(MAX_WEIGHT_VERSION, None, 1)  # every engine restarted: the floor is all there is


def sources(ranks: tuple[int, ...] = (0,)) -> SourceAgent:
    return SourceAgent("g", ranks, make_transport=lambda: None, replica_root=lambda r: Path("/nonexistent"))  # type: ignore[arg-type,return-value]


class Engine:
    """An engine adapter as far as learning the committed version goes."""

    def __init__(self, held: str | None) -> None:
        self.held = held

    def held_version(self, timeout: float | None = None) -> str | None:
        return self.held


def coordinator(held: dict[int, str | None], recall: int | None = None) -> Coordinator:
    local = sources()
    local.adopt(plan(len(held)), {})
    made = Coordinator("g", local, StaticDirectory({}, {}), recall=lambda: recall)
    engines = {e: Engine(v) for e, v in held.items()}

    def adapter(_: Plan, engine: int) -> Any:
        return engines[engine]

    made._adapter = adapter  # type: ignore[method-assign]
    return made


def test_a_version_too_far_ahead_is_refused_and_the_committed_version_kept() -> None:
    c = coordinator({0: "5", 1: "5"})
    result = c.run_round(MAX_WEIGHT_VERSION)
    assert not result.started and not result.committed
    assert "maxVersionStep" in result.reason and "committed 5" in result.reason, result.reason
    assert c.committed == 5
    # Final: a rank asking for that round gets the refusal at once, not after the retry grace.
    started = time.monotonic()
    assert c.wait(MAX_WEIGHT_VERSION, 0.0, asked_at=time.time()) is result
    assert time.monotonic() - started < 0.5
    assert version_refusal(6, c.committed, DEFAULT_MAX_VERSION_STEP) is None  # the trainer's next version is not


def test_the_pods_floor_does_not_lift_the_committed_version_past_the_step() -> None:
    c = coordinator({0: "7", 1: "default"}, recall=MAX_WEIGHT_VERSION)
    assert c._recover(c.own_sources.plan) is None
    assert c.committed == 7
    close = coordinator({0: "7", 1: "default"}, recall=9)  # engine 0 restarted after v9 committed: 9 is credible
    assert close._recover(close.own_sources.plan) is None
    assert close.committed == 9


def test_a_rank_whose_latest_publish_is_another_version_is_not_ready() -> None:
    agent = sources((0, 1))
    agent.mark_ready(1, MAX_WEIGHT_VERSION)  # its replica holds that version's bytes
    with pytest.raises(TimeoutError, match=f"last staged: {MAX_WEIGHT_VERSION}"):
        agent.wait_ready(1, 5, time.monotonic() + 0.2)
    later = threading.Timer(0.05, agent.mark_ready, (1, 5))  # it publishes the round's version after all
    later.start()
    agent.wait_ready(1, 5, time.monotonic() + 5)
    later.join()
