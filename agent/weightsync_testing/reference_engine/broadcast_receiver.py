"""An engine's side of broadcast mode: join the group, receive a round, cut every rank's shards.

An engine process joins with its members (see :mod:`weightsync_agent.modes.broadcast.layout`): one group rank
that fills all its tensor-parallel ranks, or one per rank. :meth:`BroadcastReceiver.receive` starts a
round in the background — one thread per member, each receiving every bucket and handing the full
tensors to a :class:`~weightsync_testing.reference_engine.assemble.ShardAssembler` per rank it fills, which copies
exactly that rank's slices (TP cut, qkv / gate_up fusion, as the manifest's shard parts say) into the
rank's destination: the live weights or the staging twin. Nothing here decides whether those bytes may
be served: the engine verifies them against the sender's checksums and commits, as in p2p mode.

A round's outcome is per rank: the receive error of its member, or the parts that never arrived. Any
failed collective breaks the member's group (the ranks are out of step); the receiver then refuses new
rounds until the engine joins again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from weightsync_agent.layout.manifest import TensorEntry
from weightsync_agent.modes.broadcast.layout import Member
from weightsync_agent.transport.base import TransportError
from weightsync_agent.transport.collective import BroadcastGroup, NamedViews
from weightsync_testing.reference_engine.assemble import ShardAssembler


@dataclass(frozen=True)
class Destination:
    """Where one engine rank's shards go: its manifest entries and a tensor (view) per entry name."""

    entries: Sequence[TensorEntry]
    tensors: Mapping[str, torch.Tensor]


@dataclass
class Reception:
    """One round being received; ``done`` resolves when every member has finished."""

    version: int
    ranks: tuple[int, ...]
    done: Future[None] = field(default_factory=Future)
    errors: dict[int, str] = field(default_factory=dict)  # rank -> why it does not hold the round
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def running(self) -> bool:
        return not self.done.done()

    def error_for(self, rank: int) -> str | None:
        if self.running:
            return f"still receiving version {self.version} over the broadcast group"
        return self.errors.get(rank)

    def as_json(self) -> dict[str, object]:
        return {
            "version": self.version,
            "running": self.running,
            "errors": {str(r): e for r, e in sorted(self.errors.items())},
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 4),
        }


class BroadcastReceiver:
    """The groups of one engine process. Construction joins them (blocks until the whole world has)."""

    def __init__(
        self,
        members: Sequence[Member],
        *,
        world_size: int,
        init_method: str,
        backend: str = "auto",
        timeout_seconds: float = 300.0,
    ) -> None:
        if not members:
            raise ValueError("an engine joins the broadcast group with at least one member")
        self.members = tuple(members)
        self.world_size = world_size
        self.init_method = init_method
        self.timeout_seconds = timeout_seconds
        self.groups: list[BroadcastGroup] = []
        # Every member's group forms only once the whole world has joined, so they must join concurrently.
        with ThreadPoolExecutor(max_workers=len(self.members)) as pool:
            futures = [
                pool.submit(BroadcastGroup, m.group_rank, world_size, init_method, backend, timeout_seconds)
                for m in self.members
            ]
        errors: list[str] = []
        for member, future in zip(self.members, futures, strict=True):
            try:
                self.groups.append(future.result())
            except TransportError as exc:
                errors.append(f"group rank {member.group_rank}: {exc}")
        if errors:
            self.close()
            raise TransportError("; ".join(errors))
        self.last: Reception | None = None

    @property
    def broken(self) -> str | None:
        for member, group in zip(self.members, self.groups, strict=True):
            if group.broken is not None:
                return f"group rank {member.group_rank}: {group.broken}"
        return None

    @property
    def busy(self) -> bool:
        return self.last is not None and self.last.running

    def receive(self, version: int, destinations: Mapping[int, Destination]) -> Reception:
        """Start receiving round ``version`` into ``destinations`` (rank -> where); returns at once."""
        if self.busy:
            raise TransportError(f"version {self.last.version if self.last else '?'} is still being received")
        broken = self.broken
        if broken is not None:
            raise TransportError(f"the broadcast group is broken ({broken}); join again")
        wanted = sorted(r for m in self.members for r in m.ranks)
        if sorted(destinations) != wanted:
            raise ValueError(f"destinations are for ranks {sorted(destinations)}, the members fill {wanted}")
        reception = Reception(version, tuple(wanted))
        remaining = [len(self.members)]
        lock = threading.Lock()
        started = time.monotonic()

        def run(member: Member, group: BroadcastGroup) -> None:
            try:
                self._receive_member(reception, member, group, destinations)
            except BaseException as exc:  # a thread must report, never die silently
                for rank in member.ranks:
                    reception.errors.setdefault(rank, f"receive failed: {exc!r}")
            finally:
                with lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    reception.seconds = time.monotonic() - started
                    reception.done.set_result(None)

        self.last = reception
        for member, group in zip(self.members, self.groups, strict=True):
            name = f"broadcast-receive-{member.group_rank}"
            threading.Thread(target=run, args=(member, group), name=name, daemon=True).start()
        return reception

    @staticmethod
    def _receive_member(
        reception: Reception, member: Member, group: BroadcastGroup, destinations: Mapping[int, Destination]
    ) -> None:
        assemblers = {r: ShardAssembler(destinations[r].entries, destinations[r].tensors) for r in member.ranks}

        def on_bucket(views: NamedViews) -> None:
            for assembler in assemblers.values():
                assembler(views)

        try:
            stats = group.receive_buckets(on_bucket, version=reception.version)
        except TransportError as exc:
            for rank in member.ranks:
                reception.errors[rank] = str(exc)
            return
        reception.nbytes += stats.nbytes
        for rank, assembler in assemblers.items():
            missing = assembler.missing()
            if missing:
                shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                reception.errors[rank] = f"the round for version {reception.version} lacked {shown}"

    def status(self) -> dict[str, object]:
        return {
            "world_size": self.world_size,
            "members": [m.as_json() for m in self.members],
            "broken": self.broken,
            "last": None if self.last is None else self.last.as_json(),
        }

    def close(self) -> None:
        for group in self.groups:
            group.close()
