"""The sender's end of an NCCL group formed from a raw ``ncclUniqueId``, the way vLLM's ``nccl`` backend joins one.

vLLM's ``/init_weight_transfer_engine`` takes ``nccl_unique_id_b64`` (the 128 bytes of ``ncclGetUniqueId``) for
trainers without vLLM: every worker calls ``ncclCommInitRank`` with it at ``rank_offset`` + its own rank, then issues
a one-element float32 sum ``all_reduce`` (``PyNcclCommunicator.from_unique_id_bytes``' warm-up), then waits in
``/update_weights`` for one ``ncclBroadcast`` from rank 0 per announced tensor, in order. This module is rank 0 of
that protocol, through :mod:`weightsync_agent.transport.nccl_library` (no vLLM, no torch store).

:func:`mint` makes the id (and what engines are told, :func:`rendezvous_of`); :class:`UniqueIdGroupSender` joins as
rank 0 (waiting until the world joined, bounded by the group's timeout: the communicator is non-blocking, so a
join that never completes is aborted), answers the warm-up, and broadcasts. Each broadcast is
waited for on its CUDA stream with the group's timeout and NCCL's asynchronous error checked meanwhile; a timeout, an
error or the round's deadline **aborts** the communicator (``ncclCommAbort``), so receivers blocked in it fail instead
of holding their engine. A new group needs a new id.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import time
from collections.abc import Callable, Iterable

import torch

from weightsync_agent.transport.base import TransportError
from weightsync_agent.transport.nccl_library import (
    NCCL_DTYPES,
    NCCL_IN_PROGRESS,
    NCCL_SUCCESS,
    UNIQUE_ID_BYTES,
    NcclError,
    NcclLibrary,
)

SENDER = 0
#: What an ``init_method`` carrying a unique id looks like (``nccl-uid:<standard base64>``).
SCHEME = "nccl-uid:"
POLL_SECONDS = 0.001


def mint(library: NcclLibrary | None = None) -> bytes:
    """A fresh unique id for one group."""
    try:
        return (library or NcclLibrary()).unique_id()
    except NcclError as exc:
        raise TransportError(f"cannot mint an NCCL unique id: {exc}") from exc


def rendezvous_of(unique_id: bytes) -> str:
    """The ``init_method`` engines are told: the id in standard (not URL-safe) base64, as vLLM decodes it."""
    return SCHEME + base64.b64encode(unique_id).decode()


def unique_id_of(init_method: str) -> bytes:
    """The id inside an ``init_method`` made by :func:`rendezvous_of`; ValueError for anything else."""
    if not init_method.startswith(SCHEME):
        raise ValueError(f"an NCCL unique-id rendezvous starts with {SCHEME!r}, got {init_method[:40]!r}")
    try:
        raw = base64.b64decode(init_method.removeprefix(SCHEME), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"an NCCL unique id travels as standard base64: {exc}") from exc
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


class UniqueIdGroupSender:
    """Group rank 0 of a unique-id NCCL group named ``group_name``; returns once the whole world joined, raises
    TransportError (the communicator aborted) when it has not within ``timeout_seconds``."""

    def __init__(
        self,
        world_size: int,
        unique_id: bytes,
        group_name: str,
        timeout_seconds: float = 300.0,
        *,
        library: NcclLibrary | None = None,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"a broadcast group needs at least one receiver, world size {world_size}")
        if not torch.cuda.is_available():
            raise TransportError(f"NCCL group {group_name!r}: no CUDA device in this process")
        self.world_size, self.group_name = world_size, group_name
        self.timeout_seconds = timeout_seconds
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.broken: str | None = None
        self._nccl = library or NcclLibrary()
        self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        try:
            # Non-blocking, so a member that never joins costs the timeout, then an abort: never a thread blocked
            # in NCCL's init for good.
            self._comm: ctypes.c_void_p | None = self._nccl.init_rank_nonblocking(world_size, unique_id, SENDER)
        except NcclError as exc:
            raise TransportError(f"could not form NCCL group {group_name!r}: {exc}") from exc
        self._settle("joining", time.monotonic() + timeout_seconds)
        # vLLM's members all_reduce one float32 right after joining: answer it, or every rank deadlocks.
        warm_up = torch.zeros(1, dtype=torch.float32, device=self.device)

        def all_reduce(comm: ctypes.c_void_p, stream: int) -> None:
            self._nccl.all_reduce_sum(warm_up.data_ptr(), 1, "float32", comm, stream)

        self._collective("the warm-up all_reduce", all_reduce, None)

    def broadcast(self, tensors: Iterable[tuple[str, torch.Tensor]], deadline: float | None = None) -> int:
        """One ``ncclBroadcast`` per tensor, in order; the bytes sent. Any failure aborts (breaks) the group."""
        sent = 0
        for name, tensor in tensors:
            if self.broken is not None or self._comm is None:
                raise TransportError(f"NCCL group {self.group_name!r} is broken ({self.broken}); form it again")
            if deadline is not None and time.monotonic() >= deadline:
                self._break(f"the round's deadline passed before {name}")
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in NCCL_DTYPES:
                self._break(f"{name}: NCCL has no type for {dtype}")
            with torch.cuda.stream(self._stream):
                data = tensor.to(self.device, non_blocking=True).contiguous()

            def send(comm: ctypes.c_void_p, stream: int, data: torch.Tensor = data, dtype: str = dtype) -> None:
                self._nccl.broadcast(data.data_ptr(), data.numel(), dtype, SENDER, comm, stream)

            self._collective(f"the broadcast of {name}", send, deadline)
            sent += tensor.numel() * tensor.element_size()
        return sent

    def _collective(self, what: str, enqueue: Callable[[ctypes.c_void_p, int], None], deadline: float | None) -> None:
        """Enqueue one collective on this group's stream and wait for it (the group's timeout, the deadline)."""
        if self._comm is None:
            raise TransportError(f"NCCL group {self.group_name!r} is broken ({self.broken}); form it again")
        limit = time.monotonic() + self.timeout_seconds
        if deadline is not None:
            limit = min(limit, deadline)
        try:
            enqueue(self._comm, self._stream.cuda_stream)
        except NcclError as exc:
            self._break(f"{what} failed: {exc}")
        self._settle(what, limit)  # the call itself (non-blocking: it may still be enqueueing)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self._stream)
        while not done.query():  # type: ignore[no-untyped-call]
            error = self._nccl.async_error(self._comm)
            if error is not None:
                self._break(f"{what} failed: {error}")
            if time.monotonic() >= limit:
                self._break(f"{what} did not finish in time ({self.timeout_seconds:g} s or the round's deadline)")
            time.sleep(POLL_SECONDS)

    def _settle(self, what: str, limit: float) -> None:
        """Wait until the communicator's last call is no longer in progress; an error or ``limit`` breaks the group."""
        assert self._comm is not None
        while True:
            state = self._nccl.state(self._comm)
            if state == NCCL_SUCCESS:
                return
            if state != NCCL_IN_PROGRESS:
                self._break(f"{what} failed: {self._nccl.error_text(state)}")
            if time.monotonic() >= limit:
                self._break(f"{what} did not complete in time ({self.timeout_seconds:g} s or the round's deadline)")
            time.sleep(POLL_SECONDS)

    def _break(self, why: str) -> None:
        self.close(why)
        raise TransportError(f"NCCL group {self.group_name!r}: {why}")

    def close(self, why: str = "closed") -> None:
        """Abort the communicator: receivers still in a collective with this rank fail now."""
        self.broken = self.broken or why
        comm, self._comm = self._comm, None
        if comm is not None:
            with contextlib.suppress(NcclError):  # already torn down by an asynchronous error: nothing to free
                self._nccl.abort(comm)
