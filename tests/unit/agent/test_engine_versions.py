"""The coordinator learns engine versions instead of asking every engine every tick (docs/agent.md, "Engine
versions"): which engines one catch-up tick asks, as rounds, reports and answers come in. Pure bookkeeping: the
asks themselves are covered by the catch-up tests with real engines (tests/agent/test_agents.py, tests/e2e)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync_agent.directory import StaticDirectory
from weightsync_agent.rounds.coordinator import SWEEP_PER_TICK, Coordinator
from weightsync_agent.source.agent import SourceAgent


def plan(engines: int) -> Plan:
    sleeper = {"spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 1, "ranksPerPod": 1, "template": sleeper},
            "inference": {"engines": engines, "ranksPerEngine": 1, "ranksPerPod": 1, "adapter": "reference",
                          "template": sleeper},
        }
    )  # fmt: skip
    return plan_for(spec, group="g")


def coordinator() -> Coordinator:
    local = SourceAgent("g", [0], make_transport=lambda: None, replica_root=lambda r: Path("/nonexistent"))  # type: ignore[arg-type,return-value]
    return Coordinator("g", local, StaticDirectory({}, {}))


def test_a_fresh_coordinator_asks_every_engine_then_one_per_tick() -> None:
    c, p = coordinator(), plan(8)
    assert c._to_ask(p) == list(range(8))  # never heard from any
    c._learnt(range(8), "3")
    turns = [c._to_ask(p) for _ in range(8)]
    assert all(len(asked) == SWEEP_PER_TICK for asked in turns)
    assert sorted(e for asked in turns for e in asked) == list(range(8))  # each in turn


def test_reports_and_failed_rounds_make_engines_suspect() -> None:
    c, p = coordinator(), plan(4)
    c._learnt(range(4), "3")
    c.heard(1, "3")  # says what the coordinator believes: nothing to ask
    assert set(c._to_ask(p)) <= {c._sweep}
    c.heard(2, None)  # restarted on its initial weights
    asked = c._to_ask(p)
    assert 2 in asked and len(asked) <= 1 + SWEEP_PER_TICK
    assert 2 in c._to_ask(p), "an engine stays suspect until a round or an answer clears it"
    c._learnt([2], "3")
    assert 2 not in c._to_ask(p) or c._sweep == 2
    c._doubt([0, 3])  # a round covering them failed
    assert {0, 3} <= set(c._to_ask(p))


def test_a_scale_out_asks_the_new_engines_and_a_scale_in_forgets_the_old() -> None:
    c = coordinator()
    c._learnt(range(4), "3")
    assert {4, 5} <= set(c._to_ask(plan(6)))
    c._learnt(range(6), "3")
    c.heard(5, None)
    asked = c._to_ask(plan(2))
    assert max(asked) < 2 and set(c._held) == {0, 1}


@given(st.integers(1, 64), st.integers(0, 200))
def test_an_idle_tick_asks_a_bounded_number_of_engines(engines: int, ticks: int) -> None:
    c, p = coordinator(), plan(engines)
    c._learnt(range(engines), "1")
    for _ in range(ticks % 7):
        assert len(c._to_ask(p)) <= SWEEP_PER_TICK
