"""Trainer ranks in one test process: every rank stages and publishes concurrently, as a trainer's ranks do."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

from weightsync_agent.client import WeightSyncClient


def publish_all(
    clients: Sequence[WeightSyncClient], full: Mapping[str, torch.Tensor], version: int, *, timeout: float = 180.0
) -> list[object]:
    """Each rank's outcome (or the exception its publish raised), in rank order."""
    outcomes: list[object] = [None] * len(clients)

    def rank(index: int) -> None:
        clients[index].stage_many(full)
        try:
            outcomes[index] = clients[index].publish(version, check=False)
        except Exception as exc:  # recorded: the caller asserts on it
            outcomes[index] = exc

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return outcomes
