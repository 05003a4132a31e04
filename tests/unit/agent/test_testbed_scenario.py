"""The testbed's pure parts: rates, layout and addresses, link loads, the lower bound, gloo's tree."""

from __future__ import annotations

import math
import os

import pytest

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import plan_for
from weightsync_tools.testbed import netns
from weightsync_tools.testbed.scenario import (
    Layout,
    MiB,
    Stats,
    binomial_sends,
    bound_seconds,
    broadcast_link_loads,
    busiest,
    format_rate,
    model_shape,
    p2p_link_loads,
    parse_points,
    parse_rate,
)

TEMPLATE = {"spec": {"containers": [{"name": "main"}]}}


@pytest.mark.parametrize(
    ("text", "bits"),
    [("1gbit", 10**9), ("500mbit", 5 * 10**8), ("2.5gbit", 25 * 10**8), ("100kbit", 10**5), ("1000000", 10**6)],
)
def test_parse_rate(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "fast", "1gbps", "10bit", "-1gbit"])
def test_parse_rate_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rate(text)


def test_format_rate_round_trips() -> None:
    for text in ("1gbit", "500mbit", "100kbit", "1500bit"):
        assert format_rate(parse_rate(text)) == text


def test_layout_nodes_and_addresses() -> None:
    layout = Layout(trainers=4, engines=2, tp=2)
    assert layout.trainer_nodes == ["t0", "t1", "t2", "t3"]
    assert layout.engine_nodes == ["e0r0", "e0r1", "e1r0", "e1r1"]  # one node per engine rank
    addresses = [layout.address(n, 7) for n in layout.nodes]
    assert addresses[0] == "10.231.7.10" and addresses[-1] == "10.231.7.103"
    assert len(set(addresses)) == len(addresses)
    with pytest.raises(ValueError):
        Layout(trainers=1, engines=100, tp=2).address("e99r1", 7)


def test_p2p_loads_scenario_a() -> None:
    """4 trainer ranks, 2 engines x TP2: the balanced plan gives each trainer node one target."""
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": 4, "template": TEMPLATE},
            "inference": {"engines": 2, "ranksPerEngine": 2, "ranksPerPod": 2, "adapter": "reference",
                          "template": TEMPLATE},
        }
    )  # fmt: skip
    plan = plan_for(spec, group="g", namespace="n")
    sizes = {t: 272 * MiB for t in plan.layout.all_targets()}
    loads = p2p_link_loads({a.source: a.targets for a in plan.sources}, sizes)
    assert {k: v for k, v in loads.items() if k[1] == "out"} == {(f"t{i}", "out"): 272 * MiB for i in range(4)}
    assert {k: v for k, v in loads.items() if k[1] == "in"} == {
        (n, "in"): 272 * MiB for n in ("e0r0", "e0r1", "e1r0", "e1r1")
    }
    assert bound_seconds(loads, 10**9) == pytest.approx(272 * MiB * 8 / 1e9)


def test_p2p_loads_add_up_per_source() -> None:
    loads = p2p_link_loads({0: [(0, 0), (1, 0)], 1: [(0, 1)]}, {(0, 0): 10, (1, 0): 20, (0, 1): 5})
    assert loads == {("t0", "out"): 30, ("t1", "out"): 5, ("e0r0", "in"): 10, ("e1r0", "in"): 20, ("e0r1", "in"): 5}
    assert busiest(loads) == (("t0", "out"), 30)
    assert bound_seconds(loads, 8) == 30.0


@pytest.mark.parametrize("world", range(1, 18))
def test_binomial_tree_reaches_everyone_once(world: int) -> None:
    pairs = binomial_sends(world)
    receivers = [r for _, r in pairs]
    assert sorted(receivers) == list(range(1, world))  # every non-root receives exactly once
    root_sends = sum(1 for s, _ in pairs if s == 0)
    assert root_sends == (math.ceil(math.log2(world)) if world > 1 else 0)
    # a rank sends only after it received (rounds are in order)
    have = {0}
    for sender, receiver in pairs:
        assert sender in have
        have.add(receiver)


def test_binomial_tree_matches_gloo_for_five() -> None:
    """gloo/broadcast.cc, world 5: round 0: 0->1; round 1: 0->2, 1->3; round 2: 0->4."""
    assert binomial_sends(5) == [(0, 1), (0, 2), (1, 3), (0, 4)]
    assert binomial_sends(3, root=1) == [(1, 2), (1, 0)]


def test_broadcast_loads() -> None:
    # scenario A, one member per engine (on its rank-0 node): rank 0 sends the model twice
    loads = broadcast_link_loads(["e0r0", "e1r0"], "t0", 100)
    assert loads == {("t0", "out"): 200, ("e0r0", "in"): 100, ("e1r0", "in"): 100}
    # 8 engines: world 9, the root sends 4 times; members forward the rest
    loads = broadcast_link_loads([f"e{e}r0" for e in range(8)], "t0", 100)
    assert busiest(loads) == (("t0", "out"), 400)
    assert sum(v for (n, d), v in loads.items() if d == "in") == 800
    # members sharing a node exchange without a link
    assert broadcast_link_loads(["a", "a"], "t0", 10) == {("t0", "out"): 20, ("a", "in"): 20}


def test_bound_needs_a_load() -> None:
    with pytest.raises(ValueError):
        bound_seconds({}, 10**9)


def test_stats() -> None:
    stats = Stats.of([3.0, 1.0, 2.0, 10.0])
    assert (stats.n, stats.median, stats.min, stats.max) == (4, 2.5, 1.0, 10.0)
    with pytest.raises(ValueError):
        Stats.of([])


def test_parse_points() -> None:
    assert parse_points("1-8") == list(range(1, 9))
    assert parse_points("8, 1,2,4,2") == [1, 2, 4, 8]
    for bad in ("", "0", "9", "1-9"):
        with pytest.raises(ValueError):
            parse_points(bad)


@pytest.mark.parametrize("mib", [8, 64, 128, 512])
def test_model_shape_size(mib: int) -> None:
    shape = model_shape(mib)
    h, layers, vocab = shape["hidden_size"], shape["num_layers"], shape["vocab_size"]
    total = (15 * h * h * layers + 2 * vocab * h) * 4
    assert abs(total - mib * MiB) <= 15 * h * h * 4  # within one layer
    assert shape["num_heads"] * shape["head_dim"] == h


def test_netns_names() -> None:
    tag = netns.tag_for(4_194_304)  # pid_max on 64-bit Linux
    assert tag.startswith("wsb-") and len(f"{tag}-e7r1") <= 15  # interface names are at most 15 bytes
    assert netns._pid_of(f"{tag}-t0") == 4_194_304
    assert netns._pid_of(f"{tag}-br") == 4_194_304
    assert netns._pid_of("eth0") is None
    assert netns.burst_bytes(10**9) >= 10**9 // 8 // 250  # at least one kernel tick at the rate
    before = {"t0": (100, 50)}
    assert netns.counter_delta(before, {"t0": (150, 80)}) == {("t0", "in"): 50, ("t0", "out"): 30}


def test_cli_refuses_bad_arguments_before_touching_the_network() -> None:
    from typer.testing import CliRunner

    from weightsync_tools.cli.main import app

    runner = CliRunner()
    for args in (["bench", "--sweep", "0"], ["bench", "--scenario", "Z", "--sweep", ""], ["bench", "--rate", "x"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
    assert netns.namespaces() == [n for n in netns.namespaces() if not n.startswith(netns.tag_for(os.getpid()))]


def test_without_root_the_bench_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from weightsync_tools.cli.main import app

    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # netns reads os.geteuid at call time
    with pytest.raises(netns.NetnsUnavailableError, match="needs root"):
        netns.check_available()
    result = CliRunner().invoke(app, ["bench", "--sweep", ""])
    assert result.exit_code == 2
    assert "skipped" in result.output and "--no-caps" in result.output


def test_three_ways_ratios_follow_the_medians() -> None:
    from weightsync_tools.testbed.three_ways import _ratios

    def way(median: float, stage: float, write: float, bound: float | None = 1.0) -> dict[str, float | None]:
        return {"median": median, "stage_s": stage, "round_s": write, "bound_s": bound}

    report = {"broadcast": way(30.0, 0.0, 30.0), "miles": way(8.0, 3.0, 5.0), "ours": way(5.5, 3.0, 5.0, 5.0)}
    out = _ratios(report)
    assert out["ours_over_miles"] == 5.5 / 8.0 and out["broadcast_over_ours"] == 30.0 / 5.5
    assert out["ours_over_bound"] == 5.5 / 5.0
    assert out["streaming_over_slower_half"] == 5.5 / 5.0  # writing alone (5 s) is the slower half
    assert out["targets"] == {
        "ours_over_miles_met": True,
        "broadcast_over_ours_met": True,
        "ours_over_bound_met": True,
        "streaming_over_slower_half_met": True,
    }
    slow = _ratios({**report, "ours": way(7.9, 3.0, 5.0, None)})
    assert slow["ours_over_bound"] is None and slow["targets"]["ours_over_bound_met"] is None
    assert not slow["targets"]["ours_over_miles_met"] and not slow["targets"]["streaming_over_slower_half_met"]


def test_three_ways_judges_each_pause_policys_pause() -> None:
    """pause: minimal against Miles-style's pause and the write's link bound; staged targets against 0.2 s."""
    from weightsync_tools.testbed.three_ways import _ratios

    def way(median: float, pause: float, bound: float = 4.5) -> dict[str, float]:
        return {"median": median, "stage_s": 4.3, "round_s": 4.7, "bound_s": bound, "pause_s": pause}

    report = {"broadcast": way(27.5, 27.4), "miles": way(9.0, 4.7), "ours": way(5.1, 4.9),
              "ours_minimal": way(9.1, 4.8), "ours_staged": way(5.2, 0.05)}  # fmt: skip
    out = _ratios(report)
    assert out["overlap_pause_over_miles_pause"] == 4.9 / 4.7 and out["minimal_over_miles"] == 9.1 / 9.0
    assert out["minimal_pause_over_miles_pause"] == 4.8 / 4.7 and out["minimal_pause_over_bound"] == 4.8 / 4.5
    assert out["staged_pause_s"] == 0.05
    assert out["targets"]["minimal_pause_over_miles_met"] and out["targets"]["minimal_pause_over_bound_met"]
    assert out["targets"]["staged_pause_met"]
    worse = _ratios({**report, "ours_minimal": way(9.1, 5.2), "ours_staged": way(5.2, 0.3)})
    assert not worse["targets"]["minimal_pause_over_miles_met"] and not worse["targets"]["minimal_pause_over_bound_met"]
    assert not worse["targets"]["staged_pause_met"]
    assert "minimal_pause_over_miles_pause" not in _ratios({k: report[k] for k in ("broadcast", "miles", "ours")})
