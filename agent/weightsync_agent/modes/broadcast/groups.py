"""How the sender forms its end of a broadcast group, by the engines' :class:`BroadcastReception`.

Each way is one function here, picked by the reception's ``framing`` and ``rendezvous``; it returns what the engines
are told to join (their adapters' ``join_broadcast`` ``init_method``) and a callable that forms this side as group
rank 0, which blocks until every member joined, so the sender runs it beside the engines' joins:

- ``weightsync-buckets``: weightsync's own group (``transport/collective.py``) at ``init_method``;
- ``announced-tensors`` over a ``torch-store``: a torch custom process group at ``init_method`` (stock SGLang);
- ``announced-tensors`` over an ``nccl-unique-id``: a raw NCCL group from a freshly minted ``ncclUniqueId``; the
  engines are told the id (``nccl-uid:<base64>``), not an address (stock vLLM's ``nccl`` backend).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from weightsync_agent.modes.broadcast.layout import SENDER
from weightsync_agent.targets.adapter import BroadcastReception
from weightsync_agent.transport.collective import BroadcastGroup
from weightsync_agent.transport.custom_group import CustomGroupSender, resolve_backend
from weightsync_agent.transport.nccl_uid_group import UniqueIdGroupSender, mint, rendezvous_of


class AnnouncedGroup(Protocol):
    """A sender's group whose receivers are told each chunk's tensors, then get one broadcast per tensor."""

    group_name: str
    broken: str | None

    def broadcast(self, tensors: Iterable[tuple[str, torch.Tensor]], deadline: float | None = None) -> int: ...

    def close(self, why: str = "closed") -> None: ...


SenderGroup = BroadcastGroup | AnnouncedGroup


def sender_group(
    reception: BroadcastReception, world_size: int, init_method: str, group_name: str, backend: str, timeout: float
) -> tuple[str, str, Callable[[], SenderGroup]]:
    """``(what the engines join, the backend they are told, a callable forming this side)``."""
    if reception.framing == "weightsync-buckets":
        return init_method, backend, lambda: BroadcastGroup(SENDER, world_size, init_method, backend, timeout)
    if reception.rendezvous == "nccl-unique-id":
        unique_id = mint()
        return rendezvous_of(unique_id), "nccl", lambda: UniqueIdGroupSender(world_size, unique_id, group_name, timeout)
    concrete = resolve_backend(backend)  # the engines' routes take a concrete torch backend
    return init_method, concrete, lambda: CustomGroupSender(world_size, init_method, group_name, concrete, timeout)
