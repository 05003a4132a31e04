"""The mechanisms the testbed needs, as parameters of the one timing model: gloo's binomial tree, one
broadcast member per engine, a replicated embedding/LM head, and stage-everything-then-write."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync_tools.simulate import H100_IB, SCENARIOS, Scenario, simulate
from weightsync_tools.simulate.model import binomial_children, binomial_critical_path
from weightsync_tools.testbed.scenario import binomial_sends

FAST = settings(max_examples=int(os.environ.get("SIMULATE_EXAMPLES", "40")), deadline=None)
BINOMIAL = H100_IB.with_overrides(collective="binomial", engine_rpc_s_per_rank=0.0)


def engines_of(base: Scenario, engines: int) -> Scenario:
    return replace(base, inference_nodes=engines * base.infer_tp // 8, broadcast_receivers="engine", published=None)


@FAST
@given(st.integers(1, 12))
def test_binomial_sender_sends_as_often_as_gloos_tree(engines: int) -> None:
    """The sender's link carries the model once per send of rank 0 in gloo's tree (the testbed's own
    ``binomial_sends``, written from gloo/broadcast.cc), so the wire time is that many model transfers."""
    sc = engines_of(SCENARIOS["qwen3-235b"], engines)
    sim = simulate(sc, BINOMIAL)
    root_sends = sum(1 for sender, _ in binomial_sends(engines + 1) if sender == 0)
    assert sim.broadcast.busiest_link_bytes == root_sends * sc.model.wire_bytes
    line = BINOMIAL.nic_bytes_per_s * BINOMIAL.nics_per_node * BINOMIAL.nccl_efficiency
    assert math.isclose(dict(sim.broadcast.phases)["wire"], root_sends * sc.model.wire_bytes / line, rel_tol=1e-9)
    # The fill is the last bucket's way down the tree beyond the sender's own sends.
    path = binomial_critical_path(binomial_children(engines + 1))
    bucket = sim.geometry.bucket_wire_bytes / line
    assert math.isclose(dict(sim.broadcast.phases)["tree fill"], (path - root_sends) * bucket, abs_tol=1e-9)


@FAST
@given(st.integers(1, 64))
def test_binomial_children_are_gloos_tree(world: int) -> None:
    """gloo/broadcast.cc's rule: in round i, every rank with no bit set above i and bit i clear sends to rank | 2^i;
    every member receives once, from a lower rank."""
    children = binomial_children(world)
    assert sorted(c for kids in children for c in kids) == list(range(1, world))
    for parent, kids in enumerate(children):
        for child in kids:
            step = child - parent
            assert step & (step - 1) == 0 and parent & step == 0 and parent < step, (parent, child)


def test_binomial_children_of_eight_and_five() -> None:
    assert binomial_children(8) == [[1, 2, 4], [3, 5], [6], [7], [], [], [], []]
    assert binomial_children(5) == [[1, 2, 4], [3], [], [], []]


@FAST
@given(st.integers(1, 64))
def test_critical_path_lies_between_the_senders_link_and_lock_step_rounds(world: int) -> None:
    children = binomial_children(world)
    sends = len(children[0])
    path = binomial_critical_path(children)
    assert sends <= path <= sends * (sends + 1) // 2


@pytest.mark.parametrize("dim", range(6))
def test_critical_path_of_a_full_tree(dim: int) -> None:
    """W = 2^d: the path 0 -> 1 -> 3 -> 7 ... waits d + (d-1) + ... + 1 transfers, each rank on it sharing
    its link with all its children."""
    assert binomial_critical_path(binomial_children(2**dim)) == dim * (dim + 1) // 2


@pytest.mark.parametrize("collective", ["ring", "binomial"])
def test_members_per_engine_receive_once_per_engine(collective: str) -> None:
    hw = BINOMIAL.with_overrides(collective=collective)
    ranks = replace(SCENARIOS["qwen3-235b"], published=None)
    engines = replace(ranks, broadcast_receivers="engine")
    by_rank, by_engine = simulate(ranks, hw), simulate(engines, hw)
    assert by_rank.broadcast.total_bytes == by_engine.broadcast.total_bytes * ranks.infer_tp
    assert by_engine.broadcast.seconds < by_rank.broadcast.seconds  # a shallower tree, a shorter ring


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_replicated_part_goes_whole_to_every_rank(tp: int) -> None:
    model = replace(SCENARIOS["qwen3-235b"].model, replicated_bytes=1e9)
    assert model.shard_bytes(tp) == (model.wire_bytes - 1e9) / tp + 1e9
    assert model.shard_bytes(1) == model.wire_bytes


def test_replicated_part_is_checked() -> None:
    with pytest.raises(ValueError, match="replicated"):
        replace(SCENARIOS["qwen3-235b"].model, replicated_bytes=-1.0)
    with pytest.raises(ValueError, match="replicated"):
        replace(SCENARIOS["qwen3-235b"].model, replicated_bytes=1e15)


@pytest.mark.parametrize("preset", list(SCENARIOS))
def test_stage_then_write_is_staging_plus_a_round(preset: str) -> None:
    """Staging everything first never beats the pipeline, which does the same work with overlap, and costs
    exactly its staging (gather and replica load) on top of a round over staged replicas."""
    sc = replace(SCENARIOS[preset], miles_schedule="stage_then_write", published=None)
    sim = simulate(sc, H100_IB)
    phases = dict(sim.p2p.phases)
    staging = phases["gather"] + phases["replica load"]
    assert staging > 0
    round_s = sum(v for k, v in phases.items() if k.startswith("round: "))
    assert math.isclose(sim.p2p.seconds, phases["control"] + staging + round_s + phases["post-process"])
    if sim.our_plan.max_shapes_per_source <= sim.miles_plan.max_shapes_per_source:
        assert sim.ours.seconds <= sim.p2p.seconds
    # Staging costs the same bytes as in Miles' own loop, only not overlapped with the writes.
    loop = dict(simulate(replace(sc, miles_schedule="per_bucket"), H100_IB).p2p.phases)
    assert math.isclose(staging, loop["gather"] + loop["replica load"], rel_tol=1e-9)


def test_unknown_collective_is_refused() -> None:
    with pytest.raises(ValueError, match="collective"):
        simulate(SCENARIOS["qwen3-235b"], H100_IB.with_overrides(collective="tree"))
