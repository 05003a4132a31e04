"""The sender's end of a torch.distributed "custom process group", the convention RL engines join by.

SGLang's ``/init_weights_update_group`` (and OpenRLHF, verl, vLLM's older RLHF examples) form the trainer's
weight-update group with ``init_custom_process_group``: a ``tcp://`` rendezvous whose store is prefixed
with the group's name, then torch's own ``_new_process_group_helper`` (which adds ``"<name>/"`` and the
device to the prefix). The sender must form its end exactly the same way, or the ranks never meet in the
store: this module does, as group rank 0. Receivers then expect one plain ``broadcast`` per tensor, from
rank 0, in an order agreed beforehand over another channel (SGLang: the ``names`` of
``/update_weights_from_distributed``); there is no header on the wire.

The helpers are torch's private API, exactly as the engines call them (checked between torch 2.15 here and
the 2.14.1 that SGLang 0.5.23 pins). ``timeout_seconds`` bounds this side's collectives; the receivers keep
torch's default (30 min), which no stock route lets us set. So on any failure this side **drops** its group:
that closes its sockets, and receivers blocked in a broadcast fail at once ("Connection reset by peer")
instead of holding their engine for half an hour.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from weightsync_agent.transport.base import TransportError

SENDER = 0


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
    return backend


class CustomGroupSender:
    """Group rank 0 of a custom process group named ``group_name``; blocks until the whole world joined."""

    def __init__(
        self, world_size: int, init_method: str, group_name: str, backend: str = "auto", timeout_seconds: float = 300.0
    ) -> None:
        from torch.distributed.distributed_c10d import (  # the engines' own recipe (module docstring)
            Backend,
            GroupName,
            PrefixStore,
            _new_process_group_helper,
            _world,
        )
        from torch.distributed.rendezvous import rendezvous

        if world_size < 2:
            raise ValueError(f"a broadcast group needs at least one receiver, world size {world_size}")
        self.world_size, self.group_name = world_size, group_name
        self.backend = resolve_backend(backend)
        self.timeout_seconds = timeout_seconds
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        timeout = timedelta(seconds=timeout_seconds)
        try:
            store, _, _ = next(rendezvous(init_method, SENDER, world_size, timeout=timeout))
            store.set_timeout(timeout)
            pg, _ = _new_process_group_helper(
                world_size,
                SENDER,
                [],
                Backend(self.backend),
                PrefixStore(group_name, store),
                group_name=GroupName(group_name),
                backend_options=None,
                timeout=timeout,
            )
            _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        except (RuntimeError, ValueError, dist.DistError) as exc:
            raise TransportError(f"could not form custom group {group_name!r} via {init_method}: {exc}") from exc
        self._pg: Any = pg
        self.broken: str | None = None

    def broadcast(self, tensors: Iterable[tuple[str, torch.Tensor]], deadline: float | None = None) -> int:
        """One broadcast per tensor, in order; the bytes sent. Any failure breaks (and drops) the group."""
        if self.broken is not None or self._pg is None:
            raise TransportError(f"custom group {self.group_name!r} is broken ({self.broken}); form it again")
        sent = 0
        for name, tensor in tensors:
            if deadline is not None and time.monotonic() >= deadline:
                self._break(f"the round's deadline passed before {name}")
            data = tensor if tensor.device == self.device else tensor.to(self.device)
            options = dist.BroadcastOptions()
            options.rootRank = SENDER
            try:
                self._pg.broadcast([data.contiguous()], options).wait()
            except (RuntimeError, dist.DistError) as exc:
                self._break(f"broadcast of {name} failed or timed out ({self.timeout_seconds:g}s): {exc}")
            sent += tensor.numel() * tensor.element_size()
        return sent

    def _break(self, why: str) -> None:
        self.close(why)
        raise TransportError(f"custom group {self.group_name!r}: {why}")

    def close(self, why: str = "closed") -> None:
        """Drop the group: its sockets close, so receivers still in a broadcast with this rank fail now."""
        self.broken = self.broken or why
        pg, self._pg = self._pg, None
        if pg is None:
            return
        if self.backend == "nccl":
            abort = getattr(pg, "abort", None)
            if callable(abort):  # NCCL kernels never return on their own
                abort()
        with contextlib.suppress(RuntimeError, ValueError, AssertionError):  # already gone
            dist.destroy_process_group(pg)
        del pg  # dropping the last reference is what closes the sockets
