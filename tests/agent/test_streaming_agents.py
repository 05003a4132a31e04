"""Streamed versions through the agents: ``weightsync agent`` processes, reference engine processes, Mooncake TCP.

Each trainer rank (a thread of this process, attached to its agent's replica files as trainer code in a pod
is) opens ``client.stream(v)`` and stages; its agent's source sends what is staged as it goes, reading the
stream's mark from the shared replica files, and rank 0's agent runs the round. Checked: the engines hold
an independent resharding bit-exactly, and a rank whose code raises mid-stream fails the round with no
engine claiming the version, after which a new stream of the same version lands.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
import torch
from sync_helpers import expected_checksums, group_spec, training_step

from weightsync_agent.client import WeightSyncClient
from weightsync_agent.source.writer import PublishError
from weightsync_testing.loopback_group import LoopbackGroup
from weightsync_testing.reference_engine.model import full_state


class TrainerCrashError(RuntimeError):
    pass


@pytest.fixture(scope="module")
def group() -> Iterator[LoopbackGroup]:
    spec = group_spec(protocol="tcp", bucketSizeMiB=1, timeoutSeconds=20, targetStaging="live")
    with LoopbackGroup(spec, group="t-stream").start() as running:
        yield running


def stream_all(
    clients: Sequence[WeightSyncClient], full: dict[str, torch.Tensor], version: int, *, crash: int | None = None
) -> list[object]:
    """Each rank streams ``version`` at once (a collective); rank ``crash`` raises half-way. Outcomes in rank order."""
    outcomes: list[object] = [None] * len(clients)

    def rank(index: int) -> None:
        client = clients[index]
        order = client.staging_order()
        try:
            with client.stream(version, check=False) as stream:
                for count, name in enumerate(order):
                    if index == crash and count == len(order) // 2:
                        raise TrainerCrashError(f"rank {index} lost its all-gather")
                    stream.stage(name, full[name])
            outcomes[index] = stream.outcome
        except Exception as exc:  # recorded: the test asserts on it
            outcomes[index] = exc

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return outcomes


def engines_hold(group: LoopbackGroup, full: dict[str, torch.Tensor], version: int) -> None:
    bucket_bytes = group.plan.transfer.bucket_bytes
    for index, engine in group.engines.items():
        client = engine.client()
        assert client.weight_version() == str(version), f"engine {index}"
        for rank in range(group.plan.layout.ranks_per_engine):
            assert client.checksums(rank, bucket_bytes) == expected_checksums(full, rank, bucket_bytes), (index, rank)


def test_streamed_versions_land_and_a_rank_that_raises_mid_stream_fails_the_round_untouched(
    group: LoopbackGroup,
) -> None:
    with group.clients() as clients:
        full = training_step(full_state(seed=5), 1)
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

        outcomes = stream_all(clients, nxt, 2)  # the trainer retries the version: a new stream of it
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
