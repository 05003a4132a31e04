"""Broadcast mode: trainer rank 0 sends every full tensor to all inference ranks in buckets, over
torch.distributed (gloo on CPU, NCCL where CUDA is), and each receiver keeps only its own slices.

The baseline the P2P transports are measured against, and a fallback where one-sided writes are not
possible. Every receiver gets every byte, so it only pays off for few receivers or fast collectives.

Protocol, one round (no round trips besides the collectives themselves, so all ranks agree from the
first message on):

1. header: ``int64[5] = [MAGIC, PROTOCOL, version, metadata bytes, metadata digest]``;
2. metadata: UTF-8 JSON ``{"buckets": [{"nbytes": n, "tensors": [[name, dtype, shape, offset], ...]}]}``,
   at most ``MAX_METADATA_BYTES``. When it is the same as the group's previous round (same digest, the
   usual case: a trainer sends the same layout every step), the header says 0 bytes and it is not sent:
   receivers reuse what they decoded last time, and a receiver that holds nothing under that digest
   fails the round and marks the group broken. This saves a broadcast, a decode and two device-to-host
   syncs per round before the first bucket can move;
3. per bucket, ``uint8`` broadcasts covering its ``nbytes``, tensors at 64-byte aligned offsets, cut
   into the segments the metadata lists per bucket (``"segments": [[[start, end], ...], ...]``; absent:
   one segment per bucket). The sender cuts them (:func:`cut`): a run of tensors that already lie in
   its memory exactly as the bucket lays them out (one storage, same relative offsets: a model's flat
   parameter buffer, the sidecar's full replica) goes straight from there; everything else is packed
   into its bucket buffer. Receivers land every segment in their bucket buffer at its offsets. The
   packing copy cost about 15 % against one raw NCCL broadcast on H100 (docs/gpu.md), hence zero-copy
   segments, the default on NCCL for runs of at least ``DIRECT_BYTES``.

Buckets hold whole tensors, packed in the order given, up to ``bucket_bytes``; a tensor larger than
that travels alone in a bucket of its own size. Both sides keep two bucket buffers, so the sender packs
bucket i+1 while bucket i is on the wire and receivers hand bucket i to ``on_bucket`` while bucket i+1
arrives. ``on_bucket`` gets ``[(name, view), ...]``; the views are only valid during the call.

The group is built from its own store, not with ``init_process_group``, so a trainer's own default
process group is left alone; ``timeout_seconds`` bounds every collective (a dead peer raises
:class:`TransportError` after it). A failed collective leaves the ranks out of step, so the group marks
itself ``broken`` and refuses every later call at once; it must be rebuilt. The sender may also pass a
``deadline`` (checked between buckets) and a ``progress`` callback; a receiver may name the ``version``
it expects, and a round for another version is drained (the ranks stay in step) and then refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore, PrefixStore, Store, TCPStore

from weightsync_agent.transport.base import TransportError

MAGIC = 0x5753_4243  # "WSBC"
PROTOCOL = 2
#: A receiver allocates what the header announces: bounded, so a corrupt header cannot exhaust memory.
MAX_METADATA_BYTES = 64 << 20
ALIGN = 64
#: On NCCL, zero-copy runs of at least this many bytes skip the packing copy (see the protocol above).
DIRECT_BYTES = 4 << 20

NamedViews = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * _dtype(self.dtype).itemsize


@dataclass(frozen=True)
class BucketPlan:
    nbytes: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class RoundStats:
    version: int
    buckets: int
    nbytes: int
    seconds: float
    #: Bucket metadata this round sent (sender) or received; 0 when the previous round's was reused.
    metadata_bytes: int = 0


def plan_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[BucketPlan]:
    """Whole tensors, in order, packed at aligned offsets into buckets of at most ``bucket_bytes``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    plans: list[BucketPlan] = []
    slots: list[Slot] = []
    seen: set[str] = set()
    used = 0
    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} given twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        start = _align(used)
        if slots and start + nbytes > bucket_bytes:
            plans.append(BucketPlan(used, tuple(slots)))
            slots, start = [], 0
        slots.append(Slot(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), start))
        used = start + nbytes
    if slots:
        plans.append(BucketPlan(used, tuple(slots)))
    return plans


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransportError(f"unknown dtype {name!r} in broadcast metadata")
    return dtype


def _views(buffer: torch.Tensor, plan: BucketPlan) -> NamedViews:
    return [
        (slot.name, buffer[slot.offset : slot.offset + slot.nbytes].view(_dtype(slot.dtype)).view(slot.shape))
        for slot in plan.slots
    ]


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` of a bucket, sent in one broadcast. ``source``: the sender's own memory
    holding exactly those bytes (zero-copy); None: packed into the bucket buffer first."""

    start: int
    end: int
    source: torch.Tensor | None = None
    #: The tensor whose storage holds ``source`` and the address it starts at (zero-copy runs only).
    holder: str | None = None
    address: int = 0


def cut(plan: BucketPlan, tensors: Mapping[str, torch.Tensor], device: torch.device, direct: int) -> list[Segment]:
    """Segments of one bucket for the sender: zero-copy runs of at least ``direct`` bytes, packed runs
    between them. ``direct`` 0: the whole bucket, packed."""
    if not plan.nbytes:
        return []
    if not direct:
        return [Segment(0, plan.nbytes)]
    # start, end, anchor, the name of the tensor whose storage holds the run
    runs: list[tuple[int, int, int | None, str | None]] = []
    for slot in plan.slots:
        if not slot.nbytes:
            continue
        tensor = tensors[slot.name]
        anchor = tensor.data_ptr() - slot.offset if tensor.device == device and tensor.is_contiguous() else None
        end = slot.offset + slot.nbytes
        holder = tensors[runs[-1][3]] if runs and runs[-1][3] is not None else None
        if runs and anchor is not None and runs[-1][2] == anchor and _same_storage(holder, tensor, anchor, end):
            start, _, _, name = runs[-1]
            runs[-1] = (start, end, anchor, name)
        elif runs and anchor is None and runs[-1][2] is None:
            runs[-1] = (runs[-1][0], end, None, None)
        else:
            runs.append((slot.offset, end, anchor, slot.name if anchor is not None else None))
    out: list[Segment] = []
    for start, end, anchor, name in runs:
        if anchor is not None and name is not None and end - start >= direct:
            address = anchor + start
            out.append(Segment(start, end, _bytes_at(tensors[name], address, end - start), name, address))
        elif out and out[-1].source is None:
            out[-1] = Segment(out[-1].start, end)
        else:
            out.append(Segment(start, end))
    return out


def _same_storage(holder: torch.Tensor | None, tensor: torch.Tensor, anchor: int, end: int) -> bool:
    """Is ``tensor`` in ``holder``'s storage, which also covers the run's bytes up to ``end``?"""
    if holder is None:
        return False
    storage = holder.untyped_storage()
    return bool(
        tensor.untyped_storage().data_ptr() == storage.data_ptr()
        and anchor + end <= storage.data_ptr() + storage.nbytes()
    )


def _bytes_at(holder: torch.Tensor, address: int, nbytes: int) -> torch.Tensor:
    storage = holder.untyped_storage()
    offset = address - storage.data_ptr()
    if offset < 0 or offset + nbytes > storage.nbytes():
        raise TransportError(f"segment of {nbytes} B at {address:#x} is outside its tensor's storage")
    return torch.empty(0, dtype=torch.uint8, device=holder.device).set_(storage, offset, (nbytes,), (1,))


Cuts = list[list[tuple[int, int]]]  # per bucket, the [start, end) of each broadcast


@dataclass(frozen=True)
class SenderLayout:
    """What a sender derives from its tensors' names, dtypes, shapes, strides and addresses and the bucket
    size: the buckets, their segments and the metadata. Reused while all of those hold (a trainer sends the
    same parameters every step), so a round starts without re-planning. Segments keep no tensor: a cached
    layout must not keep the previous round's memory alive, so zero-copy views are rebuilt per round."""

    key: tuple[Any, ...]
    plans: list[BucketPlan]
    segments: list[list[Segment]]
    meta: bytes
    digest: int

    @classmethod
    def of(
        cls, named: list[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device, direct: int
    ) -> SenderLayout:
        by_name = dict(named)
        plans = plan_buckets(named, bucket_bytes)
        segments = [
            [Segment(g.start, g.end, None, g.holder, g.address) for g in cut(plan, by_name, device, direct)]
            for plan in plans
        ]
        meta = _encode(plans, [[(g.start, g.end) for g in bucket] for bucket in segments])
        return cls(layout_key(named, bucket_bytes, device, direct), plans, segments, meta, _digest(meta))

    def sources(self, by_name: Mapping[str, torch.Tensor]) -> list[list[Segment]]:
        """The segments with their zero-copy views into this round's tensors."""
        return [
            [
                g if g.holder is None else Segment(g.start, g.end, _bytes_at(by_name[g.holder], g.address,
                                                                             g.end - g.start), g.holder, g.address)
                for g in bucket
            ]
            for bucket in self.segments
        ]  # fmt: skip


def layout_key(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device, direct: int
) -> tuple[Any, ...]:
    return (
        bucket_bytes,
        direct,
        str(device),
        tuple((n, t.dtype, t.shape, t.stride(), t.data_ptr(), t.device) for n, t in named),
    )


def _whole(plans: list[BucketPlan]) -> Cuts:
    return [[(0, p.nbytes)] if p.nbytes else [] for p in plans]


def _encode(plans: list[BucketPlan], cuts: Cuts | None = None) -> bytes:
    buckets = [{"nbytes": p.nbytes, "tensors": [[s.name, s.dtype, s.shape, s.offset] for s in p.slots]} for p in plans]
    doc: dict[str, Any] = {"buckets": buckets}
    if cuts is not None:
        doc["segments"] = [[list(c) for c in bucket] for bucket in cuts]
    return json.dumps(doc, separators=(",", ":")).encode()


def _decode(raw: bytes) -> tuple[list[BucketPlan], Cuts]:
    doc = json.loads(raw)
    plans = [
        BucketPlan(b["nbytes"], tuple(Slot(n, d, tuple(shape), off) for n, d, shape, off in b["tensors"]))
        for b in doc["buckets"]
    ]
    if "segments" not in doc:
        return plans, _whole(plans)
    cuts = [[(int(c[0]), int(c[1])) for c in bucket] for bucket in doc["segments"]]
    if len(cuts) != len(plans) or any(
        sum(e - s for s, e in bucket) > p.nbytes or any(not 0 <= s < e <= p.nbytes for s, e in bucket)
        for bucket, p in zip(cuts, plans, strict=True)
    ):
        raise TransportError("broadcast metadata: segments do not fit their buckets")
    return plans, cuts


def _digest(meta: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(meta, digest_size=8).digest(), "little", signed=True)


def _store(init_method: str, rank: int, world_size: int, source_rank: int, timeout: timedelta) -> Store:
    url = urlparse(init_method)
    if url.scheme == "tcp" and url.hostname and url.port:
        return TCPStore(url.hostname, url.port, world_size, rank == source_rank, timeout)
    if url.scheme == "file" and url.path:
        return FileStore(url.path, world_size)
    raise ValueError(f"init_method must be tcp://HOST:PORT or file:///PATH, got {init_method!r}")


class BroadcastGroup:
    """One sender (``source_rank``) and ``world_size - 1`` receivers; every rank constructs one."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        backend: str = "auto",
        timeout_seconds: float = 300.0,
        *,
        source_rank: int = 0,
        device: torch.device | str | None = None,
        direct_bytes: int | None = None,
    ) -> None:
        """``direct_bytes``: runs of tensors at least this large that already lie in memory as a bucket
        lays them out are sent from there (sender side; receivers follow the metadata). Default: 4 MiB
        on NCCL, 0 (always pack) on gloo."""
        if not 0 <= rank < world_size or not 0 <= source_rank < world_size:
            raise ValueError(f"rank {rank} / source {source_rank} outside a world of {world_size}")
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
        self.rank, self.world_size, self.source_rank, self.backend = rank, world_size, source_rank, backend
        self.direct_bytes = (DIRECT_BYTES if backend == "nccl" else 0) if direct_bytes is None else direct_bytes
        self.timeout_seconds = timeout_seconds
        timeout = timedelta(seconds=timeout_seconds)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        try:
            base = _store(init_method, rank, world_size, source_rank, timeout)
            self._store = PrefixStore("weightsync/broadcast", base)
            self._pg: Any
            if backend == "gloo":
                self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
        except (RuntimeError, dist.DistError) as exc:
            raise TransportError(f"rank {rank}: could not form the broadcast group via {init_method}: {exc}") from exc
        self._buffers: list[torch.Tensor] = []
        self.broken: str | None = None
        #: Digest of the metadata this sender last sent whole; receivers: the digest and what it decoded to.
        self._sent_digest: int | None = None
        self._layout: SenderLayout | None = None
        self._received: tuple[int, list[BucketPlan], Cuts] | None = None

    @property
    def is_source(self) -> bool:
        return self.rank == self.source_rank

    def _usable(self) -> None:
        if self.broken is not None:
            raise TransportError(
                f"rank {self.rank}: the broadcast group is broken ({self.broken}); rebuild it before the next round"
            )

    def _broadcast(self, tensor: torch.Tensor) -> Any:
        options = dist.BroadcastOptions()
        options.rootRank = self.source_rank
        return self._pg.broadcast([tensor], options)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as exc:
            self.broken = f"broadcast of {what} failed or timed out ({self.timeout_seconds:g}s): {exc}"
            raise TransportError(f"rank {self.rank}: {self.broken}; rebuild the group before the next round") from exc

    def _buffer_pair(self, nbytes: int) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].numel() < nbytes:
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._buffers

    def _send_plan(self, layout: SenderLayout, version: int) -> int:
        """Sender: the round's header, then its metadata unless the receivers hold it already (the previous
        round's); returns the metadata bytes sent."""
        size = 0 if layout.digest == self._sent_digest else len(layout.meta)
        header = torch.tensor([MAGIC, PROTOCOL, version, size, layout.digest], dtype=torch.int64).to(self.device)
        self._wait(self._broadcast(header), "the round header")
        if size:
            raw = torch.frombuffer(bytearray(layout.meta), dtype=torch.uint8).to(self.device)
            self._wait(self._broadcast(raw), "the bucket metadata")
        self._sent_digest = layout.digest
        return size

    def _receive_plan(self) -> tuple[list[BucketPlan], int, Cuts, int]:
        """Receivers: the round's buckets, version and segments, and the metadata bytes that travelled (0: the
        previous round's were reused)."""
        header = torch.zeros(5, dtype=torch.int64, device=self.device)
        self._wait(self._broadcast(header), "the round header")
        magic, protocol, version, size, digest = (int(x) for x in header.cpu())
        if magic != MAGIC or protocol != PROTOCOL:
            raise TransportError(f"rank {self.rank}: not a weightsync broadcast (magic {magic:#x}, v{protocol})")
        if not size:
            if self._received is None or self._received[0] != digest:
                self.broken = "the sender reused bucket metadata this rank never received"
                raise TransportError(f"rank {self.rank}: {self.broken}; rebuild the group before the next round")
            return self._received[1], version, self._received[2], 0
        if not 0 < size <= MAX_METADATA_BYTES:
            self.broken = f"the header announces {size} bytes of metadata (at most {MAX_METADATA_BYTES})"
            raise TransportError(f"rank {self.rank}: {self.broken}")
        raw = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._wait(self._broadcast(raw), "the bucket metadata")
        received = bytes(raw.cpu().numpy())
        if _digest(received) != digest:
            self.broken = "the bucket metadata does not match the header's digest"
            raise TransportError(f"rank {self.rank}: {self.broken}")
        decoded, decoded_cuts = _decode(received)
        self._received = (digest, decoded, decoded_cuts)
        return decoded, version, decoded_cuts, size

    def broadcast_buckets(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        *,
        version: int = 0,
        deadline: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> RoundStats:
        """Sender: send every tensor (full, as the trainer holds it) to all receivers.

        ``deadline`` (``time.monotonic()``) is checked before each bucket: past it the round stops and the
        group is broken, since receivers still expect the rest. ``progress(index, nbytes)`` is called after
        each bucket is handed to the backend (logging, metrics, fault injection in tests).
        """
        if not self.is_source:
            raise TransportError(f"rank {self.rank} is a receiver; it calls receive_buckets")
        self._usable()
        named = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        started = time.monotonic()
        by_name = dict(named)
        key = layout_key(named, bucket_bytes, self.device, self.direct_bytes)
        layout = self._layout if self._layout is not None and self._layout.key == key else None
        try:
            segmented = layout.sources(by_name) if layout is not None else None
        except TransportError:
            # Same addresses, but a run is no longer inside one storage (the tensors were reallocated apart).
            segmented = None
        if layout is None or segmented is None:
            layout = self._layout = SenderLayout.of(named, bucket_bytes, self.device, self.direct_bytes)
            segmented = layout.sources(by_name)
        meta_bytes = self._send_plan(layout, version)
        plans = layout.plans
        buffers = self._buffer_pair(max((p.nbytes for p in plans), default=0))
        in_flight: list[list[Any]] = [[], []]
        for index, plan in enumerate(plans):
            slot = index % 2
            for work in in_flight[slot]:
                self._wait(work, f"bucket {index - 2}")
            if deadline is not None and time.monotonic() >= deadline:
                self.broken = f"the round's deadline passed before bucket {index} of {len(plans)}"
                raise TransportError(f"rank {self.rank}: {self.broken}")
            buffer = buffers[slot][: plan.nbytes]
            views: dict[str, torch.Tensor] | None = None  # only where something is packed
            pieces: list[torch.Tensor] = []
            for segment in segmented[index]:
                if segment.source is None:  # pack this run into the bucket buffer
                    views = dict(_views(buffer, plan)) if views is None else views
                    for placed in plan.slots:
                        if segment.start <= placed.offset < segment.end:
                            views[placed.name].copy_(by_name[placed.name])
                    pieces.append(buffer[segment.start : segment.end])
                else:
                    pieces.append(segment.source)
            in_flight[slot] = [self._broadcast(piece) for piece in pieces]
            if progress is not None:
                progress(index, plan.nbytes)
        for slot, works in enumerate(in_flight):
            for work in works:
                self._wait(work, f"bucket slot {slot}")
        return RoundStats(version, len(plans), sum(p.nbytes for p in plans), time.monotonic() - started, meta_bytes)

    def receive_buckets(self, on_bucket: Callable[[NamedViews], None], *, version: int | None = None) -> RoundStats:
        """Receiver: call ``on_bucket`` once per bucket with views of the full tensors it holds.

        The ranks stay in step whatever happens locally: if ``on_bucket`` raises, the rest of the round is
        still received (and dropped) before the error is re-raised; with ``version``, a round for another
        version is received without calling ``on_bucket`` and then refused with :class:`TransportError`.
        """
        if self.is_source:
            raise TransportError(f"rank {self.rank} is the sender; it calls broadcast_buckets")
        self._usable()
        started = time.monotonic()
        plans, sent_version, cuts, meta_bytes = self._receive_plan()
        failure: Exception | None = None
        if version is not None and sent_version != version:
            failure = TransportError(f"rank {self.rank}: expected version {version}, the sender sent {sent_version}")
        buffers = self._buffer_pair(max((p.nbytes for p in plans), default=0))

        def receive(index: int) -> list[Any]:
            buffer = buffers[index % 2]
            return [self._broadcast(buffer[start:end]) for start, end in cuts[index]]

        works = receive(0) if plans else []
        for index, plan in enumerate(plans):
            for work in works:
                self._wait(work, f"bucket {index}")
            if index + 1 < len(plans):  # the other buffer's callback has returned: reuse it
                works = receive(index + 1)
            if failure is None:
                try:
                    on_bucket(_views(buffers[index % 2][: plan.nbytes], plan))
                except Exception as exc:  # keep receiving: the sender goes on sending this round
                    failure = exc
        if failure is not None:
            raise failure
        seconds = time.monotonic() - started
        return RoundStats(sent_version, len(plans), sum(p.nbytes for p in plans), seconds, meta_bytes)

    def close(self) -> None:
        """Tear the group down; peers blocked in a collective with this rank fail at once (gloo)."""
        self.broken = self.broken or "closed"
        self._buffers = []
        pg, self._pg = self._pg, None
        abort = getattr(pg, "abort", None)
        if self.backend == "nccl" and callable(abort):  # NCCL kernels never return on their own
            abort()
