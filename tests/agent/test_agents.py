"""Sync rounds through the agents: ``weightsync agent`` processes, reference engine processes, Mooncake TCP.

The trainer side is this test process: per trainer rank it attaches to that rank's replica files (built
by its agent from the engines' manifests), stages and calls ``publish(v)`` on every rank, as trainer
code does in a pod. Rank 0's agent coordinates. Checked: bytes on every engine rank equal an independent
resharding of the trainer's tensors, forward outputs match, a killed source agent fails the round
without any engine claiming the version and a retry after restarting it lands, and a joining engine
gets the committed version from the replicas without the others being paused.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from sync_helpers import TOKENS, expected_checksums, group_spec, training_step

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync_agent.rounds.remote import AgentClient, AgentError
from weightsync_agent.source.writer import PublishError
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.model import forward_full, full_state
from weightsync_testing.trainer_ranks import publish_all


def spec(staging: str = "live", mode: str = "p2p", verify: bool = True) -> WeightSyncGroupSpec:
    return group_spec(
        mode=mode, protocol="tcp", bucketSizeMiB=1, timeoutSeconds=20, targetStaging=staging, verify=verify
    )


@pytest.fixture(params=["live", "staged"])
def group(request: pytest.FixtureRequest) -> Iterator[LoopbackGroup]:
    with LoopbackGroup(spec(request.param), group=f"t-{request.param}").start() as running:
        yield running


def assert_engines_hold(group: LoopbackGroup, full: dict[str, torch.Tensor], version: int) -> None:
    bucket_bytes = group.plan.transfer.bucket_bytes
    logits = forward_full(full, TOKENS)
    for index, engine in group.engines.items():
        client = engine.client()
        assert client.weight_version() == str(version), f"engine {index}"
        for rank in range(group.plan.layout.ranks_per_engine):
            assert client.checksums(rank, bucket_bytes) == expected_checksums(full, rank, bucket_bytes), (index, rank)
        torch.testing.assert_close(torch.tensor(client.forward(TOKENS)), logits, rtol=1e-5, atol=1e-5)


def test_rounds_through_agents_are_bit_exact_and_reported(group: LoopbackGroup) -> None:
    clients = [group.client(rank) for rank in range(2)]
    full = full_state(seed=3)
    try:
        for version in (1, 2):
            full = training_step(full, version)
            outcomes = publish_all(clients, full, version)
            for outcome in outcomes:
                assert getattr(outcome, "ok", False), outcome
            assert_engines_hold(group, full, version)
        state = AgentClient(group.agents[0].url, token=group.token).state()
        assert state["coordinator"] and state["committed"] == 2
        metrics = AgentClient(group.agents[0].url, token=group.token).http.request("GET", "/metrics")[1]
        assert 'weightsync_agent_rounds_total{group="t-' in metrics
        assert "weightsync_agent_weight_version" in metrics and " 2.0" in metrics
        counted = set(re.findall(r'weightsync_agent_round_phase_seconds_count\{group="t-[^"]*",kind="regular",'
                                 r'phase="(\w+)"\} 2\.0', metrics))  # fmt: skip
        assert {"prepare", "begin", "write", "verify", "commit"} <= counted, counted  # pause, resume: live only
        assert "weightsync_agent_round_paused_seconds_count" in metrics
        assert 'weightsync_agent_round_slowest_seconds{group="t-' in metrics and 'role="target"' in metrics
        peer_series = r'weightsync_agent_round_peer_bytes\{group="t-[^"]*",peer="([^"]+)",role="\w+"\}'
        peers = set(re.findall(peer_series, metrics))
        assert peers == {"source 0", "source 1", *(f"engine {e} rank {r}" for e in range(2) for r in range(2))}, peers
    finally:
        for client in clients:
            client.close()


def test_a_source_agent_killed_while_the_round_waits_fails_it_untouched_and_a_retry_lands(group: LoopbackGroup) -> None:
    clients = [group.client(rank) for rank in range(2)]
    try:
        full = training_step(full_state(seed=3), 1)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, full, 1))
        before = {i: e.client().weight_version() for i, e in group.engines.items()}
        # Rank 0 publishes v2 and the round asks every source to prepare; source 1's agent waits for its
        # trainer, and is killed while the round waits for it.
        full2 = training_step(full, 2)
        clients[0].stage_many(full2)
        outcomes: list[object] = []
        publisher = threading.Thread(target=lambda: outcomes.append(clients[0].publish(2, check=False)))
        publisher.start()
        time.sleep(1.0)
        assert publisher.is_alive(), "the round did not wait for source 1"
        group.agents[1].stop(kill=True)
        publisher.join(60)
        outcome = outcomes[0]
        assert not outcome.ok  # type: ignore[attr-defined]
        reason = outcome.round.reason or ""  # type: ignore[attr-defined]
        assert reason.startswith("round not started: source 1"), reason
        for index, engine in group.engines.items():
            assert engine.client().weight_version() == before[index]  # nobody claims v2
            assert engine.client().status().get("round") is None  # never paused or begun: it kept serving
        # The agent comes back (same pod, same replica files); every rank publishes v2 again.
        group.restart_agent(1)
        clients[1].close()
        clients[1] = group.client(1)
        outcomes = publish_all(clients, full2, 2)
        assert all(getattr(o, "ok", False) for o in outcomes), outcomes
        assert_engines_hold(group, full2, 2)
    finally:
        for client in clients:
            client.close()


def wait_committed(group: LoopbackGroup, version: int, within: float = 60.0) -> None:
    """Until rank 0's agent (the coordinator) says ``version`` is committed."""
    deadline = time.monotonic() + within
    while True:
        try:
            if AgentClient(group.agents[0].url, timeout=5.0, token=group.token).state()["committed"] == version:
                return
        except AgentError:
            pass
        assert time.monotonic() < deadline, f"the coordinator did not learn committed version {version}"
        time.sleep(0.2)


def test_a_restarted_coordinator_goes_on_from_the_committed_version(group: LoopbackGroup) -> None:
    """Trainer rank 0's agent (the coordinator) is killed between rounds and again mid-round; each time it comes
    back it learns the committed version from the engines: an old version is refused with every engine untouched,
    and the next version lands (issue 11: versions went backwards after a coordinator restart)."""
    clients = [group.client(rank) for rank in range(2)]
    try:
        full = training_step(full_state(seed=3), 1)
        for version in (1, 2):
            full = training_step(full, version)
            assert all(getattr(o, "ok", False) for o in publish_all(clients, full, version))
        # Between rounds.
        group.restart_agent(0)
        wait_committed(group, 2)
        clients[0].close()
        clients[0] = group.client(0)  # a fresh trainer process: it knows no version of its own
        clients[0].stage_many(full)
        for old in (1, 2):
            outcome = clients[0].publish(old, check=False)
            assert not outcome.ok and f"version {old} is not newer than committed 2" in (outcome.round.reason or "")  # type: ignore[attr-defined]
        for engine in group.engines.values():
            status = engine.client().status()
            assert status["weight_version"] == "2" and status["round"] is None and not status["paused"]
        # Mid-round: rank 0 publishes v3 and the round waits for rank 1, which has not staged it yet.
        full3 = training_step(full, 3)
        clients[0].stage_many(full3)
        failures: list[BaseException] = []

        def publish_3() -> None:
            try:
                clients[0].publish(3, check=False)
            except PublishError as exc:  # its agent dies under it
                failures.append(exc)

        publisher = threading.Thread(target=publish_3)
        publisher.start()
        time.sleep(1.0)
        assert publisher.is_alive(), "the round did not wait for rank 1"
        group.agents[0].stop(kill=True)
        publisher.join(60)
        assert failures and "could not run the round" in str(failures[0])
        for engine in group.engines.values():  # never paused: it waited for rank 1 before anything else
            assert engine.client().status()["round"] is None
        group.restart_agent(0)
        wait_committed(group, 2)
        clients[0].close()
        clients[0] = group.client(0)
        outcomes: list[object] = publish_all(clients, full3, 3)
        assert all(getattr(o, "ok", False) for o in outcomes), outcomes
        assert_engines_hold(group, full3, 3)
        state = AgentClient(group.agents[0].url, token=group.token).state()
        assert state["committed"] == 3
    finally:
        for client in clients:
            client.close()


def test_a_joining_engine_gets_the_committed_version_without_pausing_the_others(group: LoopbackGroup) -> None:
    clients = [group.client(rank) for rank in range(2)]
    try:
        full = training_step(full_state(seed=3), 1)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, full, 1))
        plan = group.scale_engines(3)
        group.wait_built(60, plan_hash=plan.hash)
        joiner = group.engines[2].client()
        deadline = time.monotonic() + 60
        while joiner.weight_version() != "1":
            assert time.monotonic() < deadline, "the joiner did not catch up"
            for index in (0, 1):  # the others keep serving throughout
                status = group.engines[index].client().status()
                assert not status["paused"] and status["weight_version"] == "1"
            time.sleep(0.2)
        assert_engines_hold(group, full, 1)
        # The next version reaches all three engines.
        full2 = training_step(full, 2)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, full2, 2))
        assert_engines_hold(group, full2, 2)
        # Restarted again and a round at once, before a tick refetched anything: each source refetches inside the
        # round's prepare, and the round lands the first time (the fault matrix's first round after a restart
        # failed: "publishes its weights elsewhere ... refetched for the next round").
        group.restart_engine(0)
        full3 = training_step(full2, 3)
        outcomes = publish_all(clients, full3, 3)
        assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
        assert_engines_hold(group, full3, 3)
    finally:
        for client in clients:
            client.close()


def test_a_restarted_engine_is_never_written_at_its_old_addresses_and_is_caught_up(group: LoopbackGroup) -> None:
    """An engine crashes and comes back on its port with its checkpoint, at new addresses behind a new Mooncake
    session. The sources' manifests name the dead process: the round pins where the engine publishes now, every
    source refuses its stale manifest (nothing written) and refetches, the coordinator catches the engine up to
    the committed version, and the next version reaches every engine."""
    clients = [group.client(rank) for rank in range(2)]
    try:
        full = training_step(full_state(seed=3), 1)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, full, 1))
        before = group.engines[0].client().manifest(0)
        logs = {pod: len(agent.log_text()) for pod, agent in group.agents.items()}
        group.restart_engine(0)
        engine = group.engines[0].client()
        after = engine.manifest(0)
        assert after.placement != before.placement and after.session_id != before.session_id
        deadline = time.monotonic() + 60
        while engine.weight_version() != "1":
            assert time.monotonic() < deadline, f"the restarted engine is still at {engine.weight_version()}"
            time.sleep(0.2)
        assert_engines_hold(group, full, 1)
        fresh = "".join(agent.log_text()[logs[pod] :] for pod, agent in group.agents.items())
        assert "publishes its weights elsewhere than this source's manifest" in fresh, fresh[-3000:]
        assert before.session_id not in fresh.replace(f"session {before.session_id})", ""), fresh[-3000:]
        full2 = training_step(full, 2)
        assert all(getattr(o, "ok", False) for o in publish_all(clients, full2, 2))
        assert_engines_hold(group, full2, 2)
        # Restarted again and a round at once, before a tick refetched anything: each source refetches inside the
        # round's prepare, and the round lands the first time (the fault matrix's first round after a restart
        # failed: "publishes its weights elsewhere ... refetched for the next round").
        group.restart_engine(0)
        full3 = training_step(full2, 3)
        outcomes = publish_all(clients, full3, 3)
        assert all(getattr(o, "ok", False) for o in outcomes), [str(o) for o in outcomes]
        assert_engines_hold(group, full3, 3)
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("staging", ["live", "staged"])
def test_broadcast_mode_through_agents(staging: str) -> None:
    """mode broadcast: rank 0's agent sends the full tensors from its replica; rank 1 stages nothing."""
    with LoopbackGroup(spec(staging, mode="broadcast"), group=f"b-{staging}").start() as group:
        clients = [group.client(rank) for rank in range(2)]
        try:
            assert len(clients[1].replicas) == 0 and len(clients[0].replicas) == 1
            full = full_state(seed=3)
            for version in (1, 2):
                full = training_step(full, version)
                outcomes = publish_all(clients, full, version)
                assert all(getattr(o, "ok", False) for o in outcomes), outcomes
                assert_engines_hold(group, full, version)
        finally:
            for client in clients:
                client.close()


def test_verify_off_commits_on_the_transports_word() -> None:
    """transfer.verify: false: no checksums are computed or checked; the bytes still land exactly."""
    with LoopbackGroup(spec("staged", verify=False), group="noverify").start() as group:
        clients = [group.client(rank) for rank in range(2)]
        try:
            full = training_step(full_state(seed=3), 1)
            outcomes = publish_all(clients, full, 1)
            assert all(getattr(o, "ok", False) for o in outcomes), outcomes
            assert_engines_hold(group, full, 1)
        finally:
            for client in clients:
                client.close()
