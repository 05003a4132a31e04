"""Invariants of the timing model (hypothesis) and its calibration against the published table."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync_tools.simulate import H100_IB, PRESETS, SCENARIOS, Hardware, Scenario, geometry, simulate

MODES = ("broadcast", "p2p", "ours")
FAST = settings(max_examples=int(os.environ.get("SIMULATE_EXAMPLES", "40")), deadline=None)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    base = SCENARIOS[draw(st.sampled_from(PRESETS))]
    tp = draw(st.sampled_from([8, 16, 32, 64]))
    engines = draw(st.integers(1, 6))
    pp = draw(st.sampled_from([1, 2, 4, 8]))
    stage_nodes = draw(st.integers(1, 4))
    model = base.model.scaled(draw(st.sampled_from([0.05, 0.2, 1.0])))
    # The testbed's mechanisms, drawn too: a replicated embedding/LM head, one broadcast member per engine,
    # stage-everything-then-write.
    replicated = draw(st.sampled_from([0.0, 0.0625])) * model.wire_bytes
    return replace(
        base,
        model=replace(model, replicated_bytes=replicated),
        trainer_nodes=pp * stage_nodes,
        inference_nodes=engines * tp // 8,
        train_pp=pp,
        train_ep=draw(st.sampled_from([8, 16, 32])),
        infer_tp=tp,
        published=None,
        broadcast_receivers=draw(st.sampled_from(["rank", "engine"])),
        miles_schedule=draw(st.sampled_from(["per_bucket", "stage_then_write"])),
    )


@st.composite
def hardware(draw: st.DrawFn) -> Hardware:
    return H100_IB.with_overrides(collective=draw(st.sampled_from(["ring", "binomial"])))


def seconds(scenario: Scenario, hw: Hardware = H100_IB) -> dict[str, float]:
    sim = simulate(scenario, hw)
    return {mode: getattr(sim, mode).seconds for mode in MODES}


def no_slower(faster: dict[str, float], slower: dict[str, float], tolerance: float = 1e-9) -> None:
    for mode in MODES:
        assert faster[mode] <= slower[mode] * (1 + tolerance), mode


# --- Calibration: the six published numbers, one set of constants ----------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_calibration_within_25_percent(preset: str) -> None:
    sim = simulate(SCENARIOS[preset], H100_IB)
    errors = sim.errors()
    assert errors is not None
    assert abs(errors["broadcast"]) <= 0.25, errors
    assert abs(errors["p2p"]) <= 0.25, errors


def test_published_speedups_are_reproduced_in_order() -> None:
    sims = {p: simulate(SCENARIOS[p], H100_IB) for p in PRESETS}
    ratios = {p: s.broadcast.seconds / s.p2p.seconds for p, s in sims.items()}
    # Published: Kimi-K2 7.4x, GLM-5 6.9x, Qwen3-235B 3.4x.
    assert ratios["qwen3-235b"] < min(ratios["kimi-k2"], ratios["glm-5"])
    assert all(s.ours.seconds < s.p2p.seconds for s in sims.values())


# --- Invariants ---------------------------------------------------------------------------------------


@FAST
@given(scenarios(), hardware(), st.floats(1.0, 8.0))
def test_more_nic_bandwidth_is_never_slower(scenario: Scenario, hw: Hardware, factor: float) -> None:
    faster = hw.with_overrides(nic_gbps=hw.nic_gbps * factor)
    no_slower(seconds(scenario, faster), seconds(scenario, hw))


@FAST
@given(scenarios(), hardware(), st.integers(1, 8), st.integers(0, 8))
def test_more_nics_are_never_slower(scenario: Scenario, hw: Hardware, nics: int, extra: int) -> None:
    fewer = hw.with_overrides(nics_per_node=nics)
    more = hw.with_overrides(nics_per_node=nics + extra)
    no_slower(seconds(scenario, more), seconds(scenario, fewer))


@FAST
@given(scenarios(), hardware(), st.integers(1, 6))
def test_more_broadcast_members_are_never_faster(scenario: Scenario, hw: Hardware, extra: int) -> None:
    more = replace(scenario, inference_nodes=scenario.inference_nodes + extra * scenario.infer_tp // 8)
    assert simulate(more, hw).broadcast.seconds >= simulate(scenario, hw).broadcast.seconds * (1 - 1e-9)


@FAST
@given(scenarios(), st.floats(1.0, 4.0))
def test_a_bigger_model_is_never_faster(scenario: Scenario, factor: float) -> None:
    """Up to 1 %: a stage's bytes are cut into whole buckets, so a model just past a bucket boundary gets one more,
    smaller bucket, and the pipelined modes' fill (one pass through the stages of one bucket) shrinks. Hypothesis
    found ``ours`` 0.02 % faster for a 0.8 % bigger model; a grid over the strategy's space found at most 0.34 %."""
    bigger = replace(scenario, model=scenario.model.scaled(factor))
    no_slower(seconds(scenario), seconds(bigger), tolerance=0.01)


@FAST
@given(scenarios())
def test_every_target_receives_its_shard_exactly_once(scenario: Scenario) -> None:
    sim = simulate(scenario, H100_IB)
    g, model, tp = sim.geometry, scenario.model, scenario.infer_tp
    shards = g.engines * tp * g.shard_bytes
    assert math.isclose(sim.p2p.total_bytes, shards, rel_tol=1e-9)
    assert math.isclose(sim.ours.total_bytes, shards, rel_tol=1e-9)
    # Every rank holds its slice of the split part and the replicated part whole.
    extra = g.engines * (tp - 1) * model.replicated_bytes
    assert math.isclose(shards, g.engines * model.wire_bytes + extra, rel_tol=1e-9)
    # A broadcast member receives the whole model; P2P moves no more, but for the replicated part it writes
    # to every rank where one broadcast member per engine receives it once.
    slack = extra if scenario.broadcast_receivers == "engine" else 0.0
    assert sim.p2p.total_bytes <= (sim.broadcast.total_bytes + slack) * (1 + 1e-9)


@FAST
@given(scenarios())
def test_p2p_busiest_link_carries_no_more_than_broadcast(scenario: Scenario) -> None:
    sim = simulate(scenario, H100_IB)
    if sim.geometry.trainer_ranks >= sim.geometry.engines:  # fewer sources than engines: p2p fans out
        # A source feeding every rank of an engine writes the replicated part once per rank.
        slack = (scenario.infer_tp - 1) * scenario.model.replicated_bytes
        assert sim.ours.busiest_link_bytes <= (sim.broadcast.busiest_link_bytes + slack) * (1 + 1e-9)


def test_fan_out_beyond_the_trainer_is_the_documented_exception() -> None:
    one_rank = replace(SCENARIOS["qwen3-235b"], trainer_nodes=1, train_pp=1, inference_nodes=64, infer_tp=8)
    small = H100_IB.with_overrides(gpus_per_node=1, nics_per_node=1)
    sim = simulate(one_rank, small)
    assert sim.geometry.engines > sim.geometry.trainer_ranks
    assert sim.ours.busiest_link_bytes > sim.broadcast.busiest_link_bytes


@FAST
@given(scenarios())
def test_phases_add_up_and_are_never_negative(scenario: Scenario) -> None:
    sim = simulate(scenario, H100_IB)
    for mode in MODES:
        result = getattr(sim, mode)
        assert all(value >= -1e-12 for _, value in result.phases), result.phases
        assert math.isclose(sum(v for _, v in result.phases), result.seconds, rel_tol=1e-9)


@FAST
@given(scenarios())
def test_the_pipeline_never_loses_to_the_serial_bucket_loop(scenario: Scenario) -> None:
    # Per bucket, the pipeline's period (its slowest stage) never exceeds the serial loop's bucket time;
    # ours pays one pipeline fill (and target verification, which the Miles loop does not do) on top.
    sim = simulate(scenario, H100_IB)
    if sim.our_plan.max_shapes_per_source <= sim.miles_plan.max_shapes_per_source:
        ours = dict(sim.ours.phases)
        pipelined = sum(v for k, v in ours.items() if k.startswith("pipeline ("))
        serial = sum(v for k, v in sim.p2p.phases if k not in ("control", "post-process"))
        assert pipelined <= serial * (1 + 1e-9)
        assert sim.ours.seconds <= sim.p2p.seconds + ours["pipeline fill"] + 1e-9


@FAST
@given(scenarios(), st.sampled_from([2, 4]))
def test_scaling_out(scenario: Scenario, factor: int) -> None:
    small, big = simulate(scenario, H100_IB), simulate(scenario.scaled(factor), H100_IB)
    # More receivers never make the broadcast faster; every rank still receives the whole model.
    assert big.broadcast.seconds >= small.broadcast.seconds * (1 - 1e-9)
    assert math.isclose(big.broadcast.total_bytes, factor * small.broadcast.total_bytes)
    # P2P: sources and targets grow together, so no source writes more than before.
    assert max(big.our_plan.bytes_per_source) <= max(small.our_plan.bytes_per_source) * (1 + 1e-9)
    # ... so ours gets no slower unless the bigger plan needs more replica shapes per source.
    if big.our_plan.max_shapes_per_source <= small.our_plan.max_shapes_per_source:
        assert big.ours.seconds <= small.ours.seconds * (1 + 1e-9)


# --- Inputs ---------------------------------------------------------------------------------------------


def test_geometry_of_the_published_kimi_run() -> None:
    g = geometry(SCENARIOS["kimi-k2"], H100_IB)
    assert (g.trainer_ranks, g.inference_ranks, g.engines, g.stage_sources) == (256, 256, 8, 32)
    assert 31e9 < g.shard_bytes < 33e9  # notes §1.10: "about 31 GB per inference rank", "32G" per rank
    sim = simulate(SCENARIOS["kimi-k2"], H100_IB)
    assert sim.miles_plan.max_shapes_per_source == 1 and sim.miles_plan.max_targets_per_source == 8


def test_layouts_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match="TP"):
        simulate(replace(SCENARIOS["glm-5"], inference_nodes=3), H100_IB)
    with pytest.raises(ValueError, match="pipeline"):
        simulate(replace(SCENARIOS["glm-5"], trainer_nodes=1, train_pp=16), H100_IB)
    with pytest.raises(ValueError, match="scale"):
        SCENARIOS["glm-5"].scaled(0)


def test_hardware_overrides_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown"):
        H100_IB.with_overrides(warp_drive=1)
    with pytest.raises(ValueError, match="positive"):
        simulate(SCENARIOS["qwen3-235b"], H100_IB.with_overrides(nic_gbps=0.0))
    with pytest.raises(ValueError, match="at most 1"):
        simulate(SCENARIOS["qwen3-235b"], H100_IB.with_overrides(rdma_efficiency=1.5))
    assert H100_IB.with_overrides(nic_gbps=None) == H100_IB
