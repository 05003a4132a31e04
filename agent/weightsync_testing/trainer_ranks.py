"""Trainer ranks in one test process: every rank stages and publishes concurrently, as a trainer's ranks do."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from weightsync_agent.client import WeightSyncClient
from weightsync_agent.rounds.canary import Canary


def publish_all(
    clients: Sequence[WeightSyncClient],
    full: Mapping[str, torch.Tensor],
    version: int,
    *,
    timeout: float = 180.0,
    canary: Canary | None = None,
    publish_timeout: float | None = None,
) -> list[object]:
    """Each rank's outcome (or the exception its publish raised), in rank order; ``canary``: rank 0's;
    ``publish_timeout``: how long each rank waits for the round's result (default: the client's, the round budget)."""
    outcomes: list[object] = [None] * len(clients)

    def rank(index: int) -> None:
        clients[index].stage_many(full)
        try:
            gate = canary if index == 0 else None
            outcomes[index] = clients[index].publish(version, check=False, canary=gate, timeout=publish_timeout)
        except Exception as exc:  # recorded: the caller asserts on it
            outcomes[index] = exc

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return outcomes


def publish_ok(
    clients: Sequence[WeightSyncClient], full: Mapping[str, torch.Tensor], version: int, *, timeout: float = 180.0
) -> list[object]:
    """:func:`publish_all`, failing (with every rank's outcome) unless every rank's round succeeded."""
    outcomes = publish_all(clients, full, version, timeout=timeout)
    if not all(getattr(o, "ok", False) for o in outcomes):
        raise AssertionError(f"round v{version} did not succeed: {[str(o) for o in outcomes]}")
    return outcomes


@contextlib.contextmanager
def trainer_clients(make: Callable[[int], WeightSyncClient], ranks: int) -> Iterator[list[WeightSyncClient]]:
    """``ranks`` trainer clients (``make(rank)``, e.g. ``LoopbackGroup.client``), closed on the way out."""
    clients: list[WeightSyncClient] = []
    try:
        clients.extend(make(rank) for rank in range(ranks))
        yield clients
    finally:
        for client in clients:
            client.close()
