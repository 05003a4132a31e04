"""How the broadcast sender forms its end of the group, by the engines' declared reception (modes/broadcast/groups)."""

from __future__ import annotations

import pytest
import torch

from weightsync_agent.modes.broadcast.groups import sender_group
from weightsync_agent.targets.adapter import BroadcastReception
from weightsync_agent.transport.base import TransportError
from weightsync_agent.transport.nccl_uid_group import unique_id_of

INIT = "tcp://127.0.0.1:1"


def test_weightsync_buckets_and_a_torch_store_are_met_at_the_senders_address() -> None:
    told, backend, _ = sender_group(BroadcastReception("engine", "weightsync-buckets"), 3, INIT, "g", "auto", 5.0)
    assert (told, backend) == (INIT, "auto")  # weightsync's own group resolves "auto" itself
    told, backend, _ = sender_group(BroadcastReception("rank", "announced-tensors"), 3, INIT, "g", "auto", 5.0)
    assert told == INIT and backend == ("nccl" if torch.cuda.is_available() else "gloo")  # the engines' routes


def test_an_nccl_unique_id_group_tells_the_engines_a_fresh_id_not_an_address() -> None:
    reception = BroadcastReception("rank", "announced-tensors", "nccl-unique-id")
    first, backend, form = sender_group(reception, 2, INIT, "g", "auto", 5.0)
    second, _, _ = sender_group(reception, 2, INIT, "g", "auto", 5.0)
    assert backend == "nccl" and len(unique_id_of(first)) == 128 and first != second
    if not torch.cuda.is_available():
        with pytest.raises(TransportError, match="no CUDA device"):
            form()
