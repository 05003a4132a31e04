"""Streamed versions through the agents: ``weightsync agent`` processes, reference engine processes, Mooncake TCP.

Each trainer rank (a thread of this process, attached to its agent's replica files as trainer code in a pod
is) opens ``client.stream(v)`` and stages; its agent's source sends what is staged as it goes, reading the
stream's mark from the shared replica files, and rank 0's agent runs the round. Checked: the engines hold
an independent resharding bit-exactly, and a rank whose code raises mid-stream fails the round with no
engine claiming the version, after which a new stream of the same version lands. And ``transfer.pause`` with the
trainer's staging held before its last tensor (a slow gather), under each policy:

- ``minimal``: the engines serve through the staging; they pause once every byte is staged, so their pause is the
  write, verify and commit alone.
- ``overlap``: the engines pause at the first complete bucket and wait through the rest of the staging.

The hold ends on events (every rank staged all but its last tensor, every agent heard its rank publish, and under
overlap the engines paused); its length only stands for staging time, which the minimal pause must not contain.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from sync_helpers import engines_hold as hold
from sync_helpers import group_spec, training_step

from weightsync_agent.client import WeightSyncClient
from weightsync_agent.client.trainer import RoundOutcome
from weightsync_agent.rounds.remote import AgentClient
from weightsync_agent.source.writer import PublishError
from weightsync_testing.engine_harness import ReferenceEngines
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.model import ModelConfig, full_state

#: 16 MiB of float32, 1 MiB buckets: every target has several buckets, so overlap can pause before the last is staged.
MODEL = ModelConfig(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=1024)
#: The staging still to do once the engines could have been paused (what overlap adds to their pause).
HOLD_SECONDS = 0.5
#: How late a rank opens its retried stream: long enough for rank 0's round to have asked the rank's agent.
LATE_SECONDS = 1.0


class TrainerCrashError(RuntimeError):
    pass


@pytest.fixture(scope="module")
def group() -> Iterator[LoopbackGroup]:
    spec = group_spec(protocol="tcp", bucketSizeMiB=1, timeoutSeconds=20, targetStaging="live")
    model_args = ("--layers", str(MODEL.num_layers), "--model-config",
                  json.dumps({k: getattr(MODEL, k) for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                                             "intermediate_size")}))  # fmt: skip
    with LoopbackGroup(spec, group="t-stream", engines=ReferenceEngines(model_args=model_args)).start() as running:
        yield running


def start_streams(
    clients: Sequence[WeightSyncClient],
    full: dict[str, torch.Tensor],
    version: int,
    *,
    crash: int | None = None,
    late: int | None = None,
    before_last: Callable[[int], None] | None = None,
) -> tuple[list[object], Callable[[], None]]:
    """Each rank streams ``version`` in a thread of its own: rank ``crash`` raises half-way; rank ``late`` opens its
    stream only after :data:`LATE_SECONDS` (rank 0's round has asked it by then); ``before_last(rank)`` runs before a
    rank stages its last tensor. Returns the outcomes (in rank order, each filled as its rank ends) and the join."""
    outcomes: list[object] = [None] * len(clients)

    def rank(index: int) -> None:
        client = clients[index]
        order = client.staging_order()
        if index == late:
            time.sleep(LATE_SECONDS)
        try:
            with client.stream(version, check=False) as stream:
                for count, name in enumerate(order):
                    if index == crash and count == len(order) // 2:
                        raise TrainerCrashError(f"rank {index} lost its all-gather")
                    if before_last is not None and count == len(order) - 1:
                        before_last(index)
                    stream.stage(name, full[name])
            outcomes[index] = stream.outcome
        except Exception as exc:  # recorded: the test asserts on it
            outcomes[index] = exc

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()

    def join() -> None:
        for thread in threads:
            thread.join(120)

    return outcomes, join


def stream_all(
    clients: Sequence[WeightSyncClient],
    full: dict[str, torch.Tensor],
    version: int,
    *,
    crash: int | None = None,
    late: int | None = None,
) -> list[object]:
    """Each rank streams ``version`` at once (a collective; :func:`start_streams`), until every rank ended."""
    outcomes, join = start_streams(clients, full, version, crash=crash, late=late)
    join()
    return outcomes


def engines_hold(group: LoopbackGroup, full: dict[str, torch.Tensor], version: int) -> None:
    hold(group, full, version, MODEL)


def test_streamed_versions_land_and_a_rank_that_raises_mid_stream_fails_the_round_untouched(
    group: LoopbackGroup,
) -> None:
    with group.clients() as clients:
        full = training_step(full_state(seed=5, config=MODEL), 1)
        outcomes = stream_all(clients, full, 1)
        assert all(getattr(o, "ok", False) for o in outcomes), outcomes
        engines_hold(group, full, 1)

        nxt = training_step(full, 2)
        outcomes = stream_all(clients, nxt, 2, crash=1)
        assert isinstance(outcomes[1], TrainerCrashError)
        failed = outcomes[0]
        assert not getattr(failed, "ok", True), failed  # rank 0's round failed, and said why
        assert "aborted the stream" in failed.summary() or "not staged" in failed.summary(), failed.summary()  # type: ignore[attr-defined]
        for engine in group.engines.values():
            assert engine.client().weight_version() == "1"  # no engine claims what it does not fully hold

        # The trainer retries the version: a new stream of it. Rank 1 comes late, so rank 0's round asks its agent
        # while the replica still carries the aborted stream's mark: the round waits for rank 1's new stream.
        outcomes = stream_all(clients, nxt, 2, late=1)
        assert all(getattr(o, "ok", False) for o in outcomes), outcomes
        engines_hold(group, nxt, 2)

        third = training_step(nxt, 3)
        for client in clients:  # the simple form still works after streams
            client.stage_many(third)
        results: list[object] = [None, None]

        def publish(i: int) -> None:
            try:
                results[i] = clients[i].publish(3)
            except PublishError as exc:
                results[i] = exc

        threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert all(getattr(r, "ok", False) for r in results), results
        engines_hold(group, third, 3)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def stream_holding_the_last_tensor(
    clients: Sequence[WeightSyncClient], full: dict[str, torch.Tensor], version: int, release: threading.Event
) -> tuple[list[threading.Event], list[object], threading.Thread]:
    """Each rank streams ``version`` in its own thread and stops before its last tensor until ``release``."""
    held = [threading.Event() for _ in clients]

    def hold(index: int) -> None:
        held[index].set()
        release.wait(60)

    outcomes, join = start_streams(clients, full, version, before_last=hold)
    return held, outcomes, threading.Thread(target=join)


@pytest.mark.parametrize("policy", ["minimal", "overlap"])
def test_minimal_keeps_live_engines_serving_through_the_staging_and_overlap_pauses_them_through_it(
    group: LoopbackGroup, policy: str
) -> None:
    plan = group.update_transfer(pause=policy)
    group.wait_built(plan_hash=plan.hash)
    engines = {index: engine.client() for index, engine in group.engines.items()}
    pauses = {index: client.status()["pauses"] for index, client in engines.items()}
    version = group.committed() + 1
    full = training_step(full_state(seed=7, config=MODEL), version)
    agents = [AgentClient(agent.url, timeout=5.0, token=group.token) for agent in group.agents.values()]
    release = threading.Event()
    with group.clients() as clients:
        held, outcomes, joiner = stream_holding_the_last_tensor(clients, full, version, release)
        try:
            for event in held:
                assert event.wait(30), "a rank did not stage its first tensors"
            # Every rank published (the round is running and preparing); each target's first bucket is staged.
            wait_for("every agent to hear its rank", lambda: all(
                a.state()["sources"]["ready"].get(str(rank)) == version for rank, a in enumerate(agents)))  # fmt: skip
            if policy == "overlap":
                wait_for("the engines to pause", lambda: all(c.status()["paused"] for c in engines.values()))
            paused_seen = time.monotonic()
            release.wait(HOLD_SECONDS)  # the rest of the staging
            checked = time.monotonic()
            during = {index: client.status() for index, client in engines.items()}
        finally:
            release.set()
        released = time.monotonic()
        joiner.start()
        joiner.join()
    done = time.monotonic()
    outcome = outcomes[0]
    assert isinstance(outcome, RoundOutcome) and outcome.ok, outcome
    result = outcome.round
    assert result.pause_policy == policy and result.paused_seconds is not None
    after = {index: client.status() for index, client in engines.items()}
    for index in engines:
        assert after[index]["pauses"] == pauses[index] + 1  # one pause per round
        if policy == "minimal":
            # Not paused while the trainer still staged; so the one pause lies after the check, within the round.
            assert during[index]["pauses"] == pauses[index] and not during[index]["paused"], during[index]
            assert after[index]["last_pause_seconds"] <= done - checked
        else:
            # Paused before the hold began and resumed only after the last tensor: the staging is inside the pause.
            assert after[index]["last_pause_seconds"] >= released - paused_seen >= HOLD_SECONDS
    if policy == "overlap":
        assert result.paused_seconds >= released - paused_seen
    engines_hold(group, full, version)
