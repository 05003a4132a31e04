"""The emulated testbed end to end: a tiny scenario in network namespaces with capped links.

2 trainer nodes -> 1 engine x TP2 (each rank on its own link), an 8 MiB model, one broadcast and one p2p
round through the real agents, coordinator and broadcast sender; afterwards every target holds exactly
the bytes of the full tensors the mode sent (checksums of the engine memory against the source's own
cut). Needs root for ``ip netns``; skipped with the reason otherwise. Leaves no namespace or link behind.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from weightsync_tools.testbed import netns, three_ways
from weightsync_tools.testbed.runner import Options, build_testbed, report_header, run
from weightsync_tools.testbed.scenario import Layout, parse_rate


def _skip_reason() -> str | None:
    try:
        netns.check_available()
    except netns.NetnsUnavailableError as exc:
        return str(exc)
    return None


def test_tiny_scenario_in_namespaces_is_bit_exact() -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    lines: list[str] = []
    options = Options(
        layout=Layout(trainers=2, engines=1, tp=2),
        mib=8,
        rounds=1,
        rate="2gbit",
        sweep=[],
        timeout_seconds=60,
    )
    report = run(options, lines.append)
    tag = netns.tag_for(os.getpid())
    assert not [n for n in netns.namespaces() if n.startswith(tag)], "namespaces left behind"
    assert not [n for n in netns.links() if n.startswith(tag)], "links left behind"
    assert report["bit_exact"] is True, report.get("not_bit_exact")
    assert report["p2p_s"] > 0 and report["broadcast_s"] > 0 and report["bound_s"] > 0
    # p2p: each trainer node sends one rank's shard; broadcast: one member (the engine), so one copy
    assert report["p2p"]["busiest_link_bytes"] < report["model_bytes"]
    assert report["broadcast"]["busiest_link_bytes"] == report["model_bytes"]
    # what the link counters saw on the busiest link is the payload plus a little protocol overhead
    counted = report["p2p"]["measured_busiest_link"]["bytes"]
    assert report["p2p"]["busiest_link_bytes"] <= counted < 1.2 * report["p2p"]["busiest_link_bytes"] + (1 << 20)
    # each engine rank received its shard over its own link (rank 1's session is on the second link)
    links = report["p2p"]["measured_links"]
    for rank in (0, 1):
        shard = report["target_bytes"][f"0/{rank}"]
        assert shard <= links[f"e0r{rank} in"] < 1.2 * shard + (1 << 20)


@pytest.mark.parametrize("mtu", [1500, 9000])
def test_every_link_and_the_bridge_carry_the_testbed_mtu(mtu: int) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    with build_testbed(small_testbed(), parse_rate("1gbit"), mtu) as testbed:
        assert _mtu([], testbed.bridge) == mtu
        for link in testbed.links.values():
            assert _mtu([], link.host_if) == mtu, link.host_if
            assert _mtu(["-n", link.namespace], link.ns_if) == mtu, link.ns_if
        assert report_header("A", small_testbed(), Options(mtu=mtu), 1)["mtu"] == mtu


def small_testbed() -> Layout:
    return Layout(trainers=1, engines=1, tp=2)


def _mtu(where: list[str], dev: str) -> int:
    shown = subprocess.run(["ip", *where, "-j", "link", "show", "dev", dev], capture_output=True, check=True)
    return int(json.loads(shown.stdout)[0]["mtu"])


def test_loopback_scenario_needs_no_root() -> None:
    report = run(
        Options(layout=Layout(trainers=2, engines=1, tp=2), mib=8, rounds=1, caps=False, sweep=[], timeout_seconds=60),
        lambda _: None,
    )
    assert report["bit_exact"] is True
    assert report["bound_s"] is None and report["p2p_over_bound"] is None


def test_three_ways_in_namespaces_are_bit_exact_and_report_every_way() -> None:
    """Scenario B's machinery at its smallest: broadcast, Miles-style and ours on one engine, one round each."""
    reason = _skip_reason()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    options = Options(layout=Layout(trainers=2, engines=1, tp=2), mib=8, rounds=1, rate="2gbit", timeout_seconds=60)
    report = three_ways.run(options, lambda _: None)
    tag = netns.tag_for(os.getpid())
    assert not [n for n in netns.namespaces() if n.startswith(tag)], "namespaces left behind"
    assert report["bit_exact"] is True, report.get("not_bit_exact")
    for way in three_ways.WAYS:
        row = report[way]
        assert row["n"] == 1 and row["median"] > 0 and row["bound_s"] > 0
        # every live round pauses its engines, for no longer than the round itself
        assert 0 < row["pause_s"] <= row["round_s"]
    for way in ("miles", "ours"):  # the trainer's time covers its staging and the round after it
        assert report[way]["median"] >= report[way]["round_s"] and report[way]["stage_s"] > 0
    assert report["broadcast"]["stage_s"] == 0
    # the emulated gather (shard groups of 2): half of every tensor came into each trainer node over its link
    assert report["gather_shards"] == 2
    for way in ("miles", "ours"):
        assert report["model_bytes"] // 2 <= report[way]["trainer_in_bytes"] < 0.6 * report["model_bytes"] + (1 << 20)
    assert report["ours_streams"] is True, "ours staged, then published: the client did not stream"
    # each row of ours ran the pause policy it names, as the coordinator recorded it
    assert [report[w]["pause_policy"] for w in three_ways.OURS] == ["overlap", "minimal", "minimal"]
    assert report["miles"]["pause_policy"] == "minimal" and report["broadcast"]["pause_policy"] is None
    # every timed window says what bound it, from each process's CPU time against the wall
    assert set(report["cpu"]) == {"broadcast+miles", *three_ways.OURS} and report["bottleneck"] in ("cpu", "links")
    assert all(w["wall_s"] > 0 and w["busiest"] for w in report["cpu"].values())
    shown = three_ways.table(report)
    assert "ours / Miles-style" in shown and "pause: minimal / Miles-style" in shown and "staged targets" in shown
