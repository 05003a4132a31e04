"""The source's CPU replica: one buffer laid out byte for byte like a target rank's weights.

A :class:`Replica` holds every local tensor of one *shape* (one target layout, identified by the
manifest's ``layout_fingerprint``) packed back to back in manifest order, exactly as
:func:`weightsync_agent.layout.buckets.replica_offsets` says, so each bucket is a run of plain memory copies
into the target's registered memory. The trainer *stages* full (unsharded) tensors into it; the replica
cuts them the way the target holds them (slice along ``part.dim``, place along ``cat_dim``, in the
sub-tensor ``part.at`` picks), which covers TP row/column shards, fused qkv / gate_up, replicated
tensors and fused MoE experts. Padding (``TensorEntry.padding``) is never written: the buffer starts as
zeros, which is what the engine holds there.

Staging is all-or-nothing per call: dtype and shape are checked for every part the full tensor feeds
before any byte is written. The replica records which parts are staged; publishing refuses an
incomplete replica. The buffer is pinned when CUDA is present, and can live in a file under
``/dev/shm`` so the trainer process (which stages) and the agent sidecar (which publishes) share it.
A :class:`ReplicaSet` holds one replica per distinct layout among a source's targets and fans
:meth:`ReplicaSet.stage` out to all of them.

Shared-memory file format (little-endian), one file per replica::

    [0, 64)            header: magic, json length, data offset, data bytes, part count,
                       bitmap offset, xxh3-64 of the JSON, digest grain (0: no digests)
    [64, 64 + json)    JSON: {"fingerprint": ..., "tensors": [TensorEntry without address, ...]}
    [bitmap, +parts)   one byte per shard part: 1 = staged for the current version, 2 = staged and its bytes given
                       back after an engine replica's loader took them (a feed: ``Replica.release``)
    [stream, +16)      the version the trainer streams and its state (0 none, 1 open, 2 closed, 3 aborted)
    [digests, +8·n)    per chunk of ``grain`` bytes: xxh3-64 of the chunk as staged (64-aligned)
    [valid, +n)        per chunk: 1 = its digest describes the bytes the replica holds now
    [data, +bytes)     the replica (page-aligned)

**Digests at staging** (verification at line rate). A bucket of ``bucket_bytes`` is exactly the replica
range ``[i·bucket_bytes, (i+1)·bucket_bytes)`` (the replica packs tensors as the bucket planner cuts
them), so its checksum (:mod:`weightsync_agent.layout.checksums`: xxh3-64 over the bucket's bytes) is a
function of the replica alone. With a ``digest_grain`` equal to the plan's bucket size, staging hashes
each chunk the moment its last part is written, while the bytes were just touched, and files the digest
next to the staged flags, where the publisher (this process or the sidecar) reads it instead of a second
pass over the replica. A write into a chunk clears its digest first; a chunk is hashed only when every
part of every tensor it overlaps is staged. A digest is a cache: a publisher hashes any chunk whose
digest is not valid.

A publisher takes an exclusive ``flock`` on the file for the duration of a publish, and staging takes a
shared one, so a process can't stage into a replica that another process is sending (and vice versa):
both fail at once with :class:`ReplicaBusyError` rather than wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import mmap
import os
import struct
import threading
import time
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Final

import torch
import xxhash

from weightsync_agent.layout.buckets import replica_offsets
from weightsync_agent.layout.checksums import view
from weightsync_agent.layout.manifest import ITEMSIZE, Manifest, ShardPart, TensorEntry
from weightsync_agent.layout.placement import part_view
from weightsync_agent.layout.quantize import fp8_block, fp8_channel, int8_channel
from weightsync_agent.shared_files import SHARED_READ_WRITE, make_shared_folders, open_shared
from weightsync_agent.source.stream import StreamState

log = logging.getLogger("weightsync.agent.replica")

TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

MAGIC: Final = b"WSREPLC1"
_HEADER = struct.Struct("<8sQQQQQQQ")  # 64 bytes; the last field was reserved (0) before digests
_DATA_ALIGN: Final = 4096
REPLICA_SUFFIX: Final = ".replica"
#: The file of a feed replica: the trainer's full tensors an engine replica's loader takes (module doc).
FEED_SUFFIX: Final = ".feed"
#: The source of an engine-replica tensor's one slot: written whole by the engine's loader, never staged.
LOADED_BY_ENGINE: Final = "(engine replica) "


class ReplicaError(ValueError):
    """Staging or building a replica was refused; nothing was written."""


class ReplicaBusyError(RuntimeError):
    """The replica is being published (or staged) by someone else right now."""


class IncompleteReplicaError(ReplicaError):
    """A publish was asked for while some shard parts are not staged for this version."""


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


def _chunks(nbytes: int, grain: int) -> int:
    return -(-nbytes // grain) if grain > 0 else 0


#: Threads hashing staged chunks in the staging process (xxhash releases the GIL), so staging runs at the speed
#: of its copies: one xxh3 thread (~25 GB/s) is slower than a device-to-host copy (~54 GB/s on an H200).
DIGEST_THREADS: Final = 8


@functools.cache
def _digest_executor() -> ThreadPoolExecutor:
    """One pool per process, made on first use."""
    workers = max(1, min(DIGEST_THREADS, os.cpu_count() or 1))
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="replica-digest")


def _stream_offset(bitmap_offset: int, parts: int) -> int:
    return _align(bitmap_offset + max(parts, 1), 64)


_STREAM_CODES: Final[dict[StreamState, int]] = {"open": 1, "closed": 2, "aborted": 3}
_STREAM_STATES: Final[dict[int, StreamState]] = {v: k for k, v in _STREAM_CODES.items()}

#: A chunk's state in the digest table's flag byte.
_NO_DIGEST, _DIGEST_VALID, _DIGEST_HASHING = 0, 1, 2
#: A staged flag: the part was staged for this version and its bytes given back after the engine replica's loader
#: took them (``Replica.release``): staged for what reads the flags, gone for what would read the bytes.
RELEASED: Final = 2


# --- Layout ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalTensor:
    """One target tensor as the replica holds it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    cat_dim: int
    parts: tuple[ShardPart, ...]
    offset: int  # in the replica

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


@dataclass(frozen=True)
class PartSlot:
    """Where one shard part goes: the tensor, and the offset along its ``cat_dim`` (in ``tensor[part.at]``)."""

    index: int  # position in the staged bitmap
    tensor: LocalTensor
    part: ShardPart
    cat_start: int

    @property
    def cat_length(self) -> int:
        return self.part.shape[self.tensor.cat_dim - len(self.part.at)] if self.tensor.shape else 1


@dataclass(frozen=True)
class Quantized:
    """How staging makes a quantized weight from the trainer's float tensor of its name (``layout/quantize.py``)."""

    scheme: str  # "fp8-block" (block set) | "int8-channel" | "fp8-channel"
    block: tuple[int, int] | None
    scale: str  # the tensor (or feed) its scale goes to


@dataclass(frozen=True)
class _StagedWrite:
    """``tensor`` into ``slots`` of ``replica``; ``origin`` ``(dim, start)``: ``tensor`` is the full tensor's slice from
    ``start`` along ``dim`` (a quantized cut), not the whole."""

    replica: Replica
    slots: tuple[PartSlot, ...]
    tensor: torch.Tensor
    origin: tuple[int, int] | None = None


def _tile_span(slots: Sequence[PartSlot], shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int, int]:
    """``(dim, start, end)``: the tile rows (or columns) of a full tensor of ``shape`` that ``slots`` cut from, when
    they all cut along one dim; else the whole tensor along dim 0."""
    dims = {slot.part.dim for slot in slots}
    if len(dims) != 1:
        return 0, 0, shape[0]
    (dim,) = dims
    tile = block[dim]
    start = min(slot.part.start for slot in slots) // tile * tile
    end = min(shape[dim], -(-max(slot.part.start + slot.part.length for slot in slots) // tile) * tile)
    return dim, start, end


@dataclass(frozen=True)
class MissingPart:
    tensor: str
    source: str
    fingerprint: str

    def __str__(self) -> str:
        return f"{self.tensor} (from {self.source})"


def _layout_json(tensors: Iterable[TensorEntry]) -> list[dict[str, Any]]:
    # As Manifest.layout_fingerprint describes tensors (exclude_none).
    return [t.model_dump(mode="json", exclude={"address"}, exclude_none=True) for t in tensors]


def _fingerprint(layout: list[dict[str, Any]], replica: dict[str, Any] | None = None) -> str:
    # The same digest as Manifest.layout_fingerprint, recomputable from a replica file's header.
    described: list[Any] = [*layout, replica] if replica is not None else list(layout)
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def _loaded_part(name: str, nbytes: int) -> ShardPart:
    """The one slot of an engine-replica tensor: its bytes, written whole by the engine's loader."""
    return ShardPart(
        source=LOADED_BY_ENGINE + name, full_shape=(max(nbytes, 1),), dim=0, start=0, length=max(nbytes, 1)
    )


class ReplicaLayout:
    """The byte layout of one target shape: tensors at their replica offsets, and their parts.

    ``replica``: the engine replica (``Manifest.replica``, as JSON) whose loader fills this layout's tensors; each
    then has one slot, filed as staged when the loader ran (:meth:`Replica.mark_loaded`), never staged by a cut."""

    def __init__(
        self, layout: list[dict[str, Any]], fingerprint: str | None = None, replica: dict[str, Any] | None = None
    ) -> None:
        self.json = layout
        self.replica = replica
        self.fingerprint = fingerprint or _fingerprint(layout, replica)
        tensors: list[LocalTensor] = []
        cursor = 0
        for raw in layout:
            try:
                dtype = str(raw["dtype"])
                shape = tuple(int(x) for x in raw["shape"])
                nbytes = int(raw["nbytes"])
                loaded = raw.get("path", "trace") == "engine-replica"
                if loaded != (replica is not None):
                    raise ValueError("engine-replica tensors and an engine replica go together")
                parts = (
                    (_loaded_part(str(raw["name"]), nbytes),)
                    if loaded
                    else tuple(ShardPart.model_validate(p) for p in raw["parts"])
                )
                tensor = LocalTensor(str(raw["name"]), dtype, shape, nbytes, int(raw["cat_dim"]), parts, cursor)
            except (KeyError, TypeError, ValueError) as exc:
                raise ReplicaError(f"malformed replica layout entry {raw!r:.200}: {exc}") from exc
            if dtype not in TORCH_DTYPES:
                raise ReplicaError(f"{tensor.name}: unsupported dtype {dtype}")
            expected = ITEMSIZE[dtype]
            for dim in shape:
                expected *= dim
            if expected != nbytes:
                raise ReplicaError(f"{tensor.name}: {nbytes} bytes does not match {list(shape)} of {dtype}")
            tensors.append(tensor)
            cursor += nbytes
        self.tensors: tuple[LocalTensor, ...] = tuple(tensors)
        self.nbytes = cursor
        slots: list[PartSlot] = []
        for tensor in self.tensors:
            along: dict[tuple[int, ...], int] = {}  # per destination sub-tensor (fused experts: per expert)
            for part in tensor.parts:
                slot = PartSlot(len(slots), tensor, part, along.get(part.at, 0))
                slots.append(slot)
                along[part.at] = slot.cat_start + slot.cat_length
        self.slots: tuple[PartSlot, ...] = tuple(slots)
        #: Quantized trainer tensors: source name -> how staging makes what this layout's parts cut from it (an
        #: engine replica's FP8 block feeds, a traced FP8 block target, a staged target's INT8 channels), and the
        #: source its scale's parts cut from (the weight's parts and its scale entry's pair up, in order).
        self.quantized: dict[str, Quantized] = {}
        by_name = {t.name: t for t in self.tensors}
        for raw in layout:
            if raw.get("quantize") in ("fp8-block", "int8-channel", "fp8-channel"):
                block = (int(raw["block"][0]), int(raw["block"][1])) if raw["quantize"] == "fp8-block" else None
                weight, scale = by_name[str(raw["name"])], by_name.get(str(raw["scale"]))
                if scale is None or len(scale.parts) != len(weight.parts):
                    raise ReplicaError(f"{weight.name}: its scale entry {raw['scale']} does not cut as it does")
                for part, scale_part in zip(weight.parts, scale.parts, strict=True):
                    self.quantized[part.source] = Quantized(str(raw["quantize"]), block, scale_part.source)
        by_source: dict[str, list[PartSlot]] = {}
        for slot in self.slots:
            if replica is None:  # an engine replica's slots are the loader's, never a staged tensor's
                by_source.setdefault(slot.part.source, []).append(slot)
        self.by_source: dict[str, tuple[PartSlot, ...]] = {k: tuple(v) for k, v in by_source.items()}

        self._starts = [t.offset for t in self.tensors]
        self._tensor_slots: dict[str, tuple[int, ...]] = {}
        for slot in self.slots:
            self._tensor_slots[slot.tensor.name] = (*self._tensor_slots.get(slot.tensor.name, ()), slot.index)

    def slots_in(self, start: int, end: int) -> tuple[int, ...]:
        """Every part slot of every tensor overlapping the replica bytes ``[start, end)``.

        A part may be strided inside its tensor (a row-parallel shard), so a byte range is ready only when
        every part of each tensor it touches is staged."""
        out: list[int] = []
        i = max(0, bisect_right(self._starts, start) - 1)
        while i < len(self.tensors) and self.tensors[i].offset < end:
            tensor = self.tensors[i]
            if tensor.offset + tensor.nbytes > start and tensor.nbytes:
                out.extend(self._tensor_slots.get(tensor.name, ()))
            i += 1
        return tuple(out)

    def slots_of(self, names: Iterable[str]) -> tuple[int, ...]:
        """The part slots of the tensors ``names`` (a feed's: each tensor is one whole part)."""
        wanted = set(names)
        return tuple(slot.index for slot in self.slots if slot.tensor.name in wanted)

    def chunks_of(self, tensor: LocalTensor, grain: int) -> range:
        """The chunks of ``grain`` bytes ``tensor``'s bytes fall in."""
        if not grain or not tensor.nbytes:
            return range(0)
        return range(tensor.offset // grain, (tensor.offset + tensor.nbytes - 1) // grain + 1)

    @classmethod
    def of(cls, manifest: Manifest) -> ReplicaLayout:
        replica = None if manifest.replica is None else manifest.replica.model_dump(mode="json")
        layout = cls(_layout_json(manifest.tensors), manifest.layout_fingerprint, replica)
        offsets = replica_offsets(manifest)
        for tensor in layout.tensors:  # the replica must pack exactly as the bucket planner assumes
            if offsets[tensor.name] != tensor.offset:
                raise ReplicaError(f"{tensor.name}: replica offset {tensor.offset} != planned {offsets[tensor.name]}")
        return layout

    @cached_property
    def by_name(self) -> dict[str, LocalTensor]:
        return {t.name: t for t in self.tensors}

    def full_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Full tensor name -> (full shape, dtype) this layout expects from the trainer."""
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for source, slots in self.by_source.items():
            out.setdefault(source, (slots[0].part.full_shape, slots[0].tensor.dtype))
        return out

    @classmethod
    def of_feeds(cls, replica: Mapping[str, Any]) -> ReplicaLayout:
        """The feed layout of an engine replica: each trainer tensor its loader takes, whole, in feed order."""
        layout = []
        for feed in replica["feeds"]:
            shape = [int(d) for d in feed["shape"]]
            if not shape or not all(shape):
                raise ReplicaError(f"{feed['name']}: an engine replica takes no 0-d or empty trainer tensor {shape}")
            nbytes = ITEMSIZE[str(feed["dtype"])] * math.prod(shape)
            whole = {"source": feed["name"], "full_shape": shape, "dim": 0, "start": 0, "length": shape[0]}
            entry = {"name": feed["name"], "dtype": feed["dtype"], "shape": shape, "nbytes": nbytes, "cat_dim": 0,
                     "parts": [whole]}  # fmt: skip
            if feed.get("quantize"):
                entry |= {"quantize": feed["quantize"], "block": list(feed["block"]), "scale": feed["scale"]}
            layout.append(entry)
        return cls(layout)


# --- The replica -----------------------------------------------------------------------------------


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _cuda_host_register(address: int, nbytes: int) -> bool:
    if not nbytes:
        return False
    rc = _cudart().cudaHostRegister(address, nbytes, 0)
    if int(rc) != 0:
        log.warning("cudaHostRegister of %d bytes at %#x failed (%s); the replica stays pageable", nbytes, address, rc)
        return False
    return True


class Replica:
    """One CPU buffer holding one target shape's weights, plus which parts are staged.

    ``Replica(manifest)`` allocates an anonymous buffer; ``Replica.create(manifest, shm_path=...)``
    backs it with a file another process can :meth:`attach`. ``pin`` defaults to
    ``torch.cuda.is_available()``. The buffer's address never changes, so it is registered with a
    transport once.
    """

    def __init__(self, layout: Manifest | ReplicaLayout, *, pin: bool | None = None, digest_grain: int = 0) -> None:
        self._init(layout if isinstance(layout, ReplicaLayout) else ReplicaLayout.of(layout))
        pin = torch.cuda.is_available() if pin is None else pin
        self.buffer = torch.zeros(max(self.layout.nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        self._staged = torch.zeros(max(len(self.layout.slots), 1), dtype=torch.uint8)
        self.pinned = pin
        chunks = _chunks(self.layout.nbytes, digest_grain)
        flags = memoryview(self._staged.numpy())  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
        self._stream_word = memoryview(bytearray(16)).cast("Q")
        self._views += [flags, self._stream_word]
        self._setup_digests(digest_grain, flags, memoryview(bytearray(8 * chunks)), memoryview(bytearray(chunks)))

    def _init(self, layout: ReplicaLayout) -> None:
        self.layout = layout
        self.shm_path: Path | None = None
        self._fd: int | None = None
        self._mmap: mmap.mmap | None = None
        self._host_registered = False
        self._lock = threading.Lock()
        self._publishing = False
        self._streaming = 0  # streaming() holders: the client's stream and, in-process, its Source
        self._closed = False
        self._views: list[memoryview] = []
        self.digest_grain = 0
        #: Where the replica bytes start in its file (0 for an anonymous buffer): an engine replica's loader maps the
        #: file and binds the engine's parameters there.
        self.data_offset = 0

    def _setup_digests(self, grain: int, flags: memoryview, digests: memoryview, valid: memoryview) -> None:
        """``flags``: the staged bitmap, a byte per part; ``digests`` / ``valid``: the chunk table (module doc)."""
        self.digest_grain = grain
        self._flags = flags
        self._digests = digests.cast("Q") if len(digests) else digests
        self._valid = valid
        self._views += [self._digests, self._valid]
        chunks = _chunks(self.layout.nbytes, grain)
        # In this process only: a chunk's write generation (a hash of an older generation is never filed) and the
        # hashing job staging started for it.
        self._generation = [0] * chunks
        self._pending: dict[int, Future[None]] = {}
        self._chunk_slots = [
            self.layout.slots_in(c * grain, min((c + 1) * grain, self.layout.nbytes)) for c in range(chunks)
        ]

    # --- Construction ------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        layout: Manifest | ReplicaLayout,
        *,
        shm_path: str | os.PathLike[str] | None = None,
        pin: bool | None = None,
        digest_grain: int = 0,
    ) -> Replica:
        """``digest_grain``: hash every chunk of that many bytes as staging completes it (the plan's bucket size,
        so the chunks are the buckets); 0 for none (``verify: false``, or a per-tensor checksum scheme)."""
        if digest_grain < 0:
            raise ReplicaError(f"digest grain must be >= 0, got {digest_grain}")
        if shm_path is None:
            return cls(layout, pin=pin, digest_grain=digest_grain)
        layout = layout if isinstance(layout, ReplicaLayout) else ReplicaLayout.of(layout)
        meta: dict[str, Any] = {"fingerprint": layout.fingerprint, "tensors": layout.json}
        if layout.replica is not None:
            meta["replica"] = layout.replica
        body = json.dumps(meta).encode()
        bitmap_offset = _align(_HEADER.size + len(body), 64)
        parts = len(layout.slots)
        digest_offset = _stream_offset(bitmap_offset, parts) + 64
        data_offset = _align(digest_offset + 9 * _chunks(layout.nbytes, digest_grain), _DATA_ALIGN)
        size = data_offset + max(layout.nbytes, 1)
        path = Path(shm_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = open_shared(tmp, os.O_RDWR | os.O_TRUNC, SHARED_READ_WRITE)  # the trainer stages into it: group rw
        try:
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size) as mm:
                header = _HEADER.pack(
                    MAGIC,
                    len(body),
                    data_offset,
                    layout.nbytes,
                    parts,
                    bitmap_offset,
                    xxhash.xxh3_64_intdigest(body),
                    digest_grain,
                )
                mm[: _HEADER.size] = header
                mm[_HEADER.size : _HEADER.size + len(body)] = body
            os.replace(tmp, path)  # attachers never see a half-written header
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return cls._map(path, layout, pin=torch.cuda.is_available() if pin is None else pin)

    @classmethod
    def attach(cls, shm_path: str | os.PathLike[str], *, pin: bool | None = None) -> Replica:
        """Map a replica another process created; sees (and makes) the same bytes and staged flags."""
        path = Path(shm_path)
        try:
            with path.open("rb") as handle:
                head = handle.read(_HEADER.size)
                if len(head) < _HEADER.size:
                    raise ReplicaError(f"{path}: too short to be a replica file")
                magic, body_len, _, _, _, _, digest, _ = _HEADER.unpack(head)
                if magic != MAGIC:
                    raise ReplicaError(f"{path}: not a weightsync replica file (magic {magic!r})")
                body = handle.read(body_len)
        except OSError as exc:
            raise ReplicaError(f"cannot read replica file {path}: {exc}") from exc
        if len(body) != body_len or xxhash.xxh3_64_intdigest(body) != digest:
            raise ReplicaError(f"{path}: replica header is corrupt (checksum mismatch)")
        meta = json.loads(body)
        layout = ReplicaLayout(meta["tensors"], meta["fingerprint"], meta.get("replica"))
        if _fingerprint(layout.json, layout.replica) != layout.fingerprint:
            raise ReplicaError(f"{path}: layout does not match its fingerprint {layout.fingerprint}")
        return cls._map(path, layout, pin=torch.cuda.is_available() if pin is None else pin)

    @classmethod
    def _map(cls, path: Path, layout: ReplicaLayout, *, pin: bool) -> Replica:
        self = cls.__new__(cls)
        self._init(layout)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        _, _, data_offset, data_nbytes, parts, bitmap_offset, _, grain = _HEADER.unpack(mm[: _HEADER.size])
        chunks = _chunks(data_nbytes, grain)
        stream_offset = _stream_offset(bitmap_offset, parts)
        digest_offset = stream_offset + 64
        if (
            data_nbytes != layout.nbytes
            or parts != len(layout.slots)
            or size < data_offset + max(data_nbytes, 1)
            or digest_offset + 9 * chunks > data_offset
        ):
            mm.close()
            os.close(fd)
            raise ReplicaError(f"{path}: file size or header does not match its layout")
        self.shm_path, self._fd, self._mmap = path, fd, mm
        self.data_offset = data_offset
        self.buffer = torch.frombuffer(mm, dtype=torch.uint8, count=max(data_nbytes, 1), offset=data_offset)
        self._staged = torch.frombuffer(mm, dtype=torch.uint8, count=max(parts, 1), offset=bitmap_offset)
        whole = memoryview(mm)
        flags = whole[bitmap_offset : bitmap_offset + max(parts, 1)]
        self._views += [whole, flags]
        table = digest_offset + 8 * chunks
        self._stream_word = whole[stream_offset : stream_offset + 16].cast("Q")
        self._views.append(self._stream_word)
        self._setup_digests(grain, flags, whole[digest_offset:table], whole[table : table + chunks])
        self.pinned = False
        if pin:
            self._host_registered = _cuda_host_register(self.address, self.buffer.numel())
            self.pinned = self._host_registered
        return self

    # --- Queries ---------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        return self.layout.fingerprint

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def address(self) -> int:
        """Start of the replica bytes (what a transport registers; bucket offsets are relative to it)."""
        return int(self.buffer.data_ptr())

    def full_names(self) -> set[str]:
        """The trainer's tensor names this replica takes (a quantized feed's scales come with their weights)."""
        return set(self.layout.by_source) - {q.scale for q in self.layout.quantized.values()}

    def tensor(self, name: str) -> torch.Tensor:
        """The local tensor ``name`` as the target will hold it.

        A view into the replica when its offset is aligned for its dtype, else a copy.
        """
        try:
            tensor = self.layout.by_name[name]
        except KeyError:
            raise ReplicaError(f"replica {self.fingerprint} has no tensor {name!r}") from None
        typed = self._typed(tensor)
        return typed if typed is not None else self._typed_copy(tensor)

    def raw(self, name: str) -> torch.Tensor:
        """The bytes of local tensor ``name`` (a uint8 view)."""
        tensor = self.layout.by_name[name]
        return self.buffer.narrow(0, tensor.offset, tensor.nbytes)

    def missing(self) -> list[MissingPart]:
        """Shard parts not staged since the last :meth:`reset`, in layout order."""
        flags = self._staged.tolist()
        return [
            MissingPart(s.tensor.name, s.part.source, self.fingerprint) for s in self.layout.slots if not flags[s.index]
        ]

    def staged(self, slots: Iterable[int]) -> bool:
        """Whether every part slot in ``slots`` is staged (cheap: reads the shared bitmap)."""
        flags = self._flags
        return all(flags[i] for i in slots)

    @property
    def chunks(self) -> int:
        """How many digest chunks the replica has (0 without a digest grain)."""
        return len(self._chunk_slots)

    def digest(self, chunk: int, *, until: float | None = None) -> str | None:
        """The xxh3-64 (hex, as :mod:`~weightsync_agent.layout.checksums` writes it) of ``chunk`` as staged, or None
        when staging has not completed it since its bytes last changed.

        A hash this process's staging started is waited for; one another process (the trainer's) is still
        computing is waited for until ``until`` (``time.monotonic``), then reads as None: the caller hashes the
        chunk itself (the other process may have died mid-hash)."""
        pending = self._pending.get(chunk)
        if pending is not None:
            pending.result()
        while until is not None and self._valid[chunk] == _DIGEST_HASHING and time.monotonic() < until:
            time.sleep(0.0005)
        if self._valid[chunk] != _DIGEST_VALID:
            return None
        value = int(self._digests[chunk])
        return f"{value:016x}" if self._valid[chunk] == _DIGEST_VALID else None

    def flush_digests(self) -> None:
        """Wait for every hash this process's staging started (before another process reads the table)."""
        for pending in list(self._pending.values()):
            pending.result()

    def is_complete(self) -> bool:
        return not self.layout.slots or bool(self._staged[: len(self.layout.slots)].all())

    # --- Staging ---------------------------------------------------------------------------------

    def check(self, full_name: str, full: torch.Tensor) -> tuple[PartSlot, ...]:
        """The parts ``full`` feeds here; ReplicaError (naming the tensor) if any would not fit."""
        slots = self.layout.by_source.get(full_name, ())
        if not isinstance(full, torch.Tensor):
            raise ReplicaError(f"cannot stage {full_name!r}: expected a torch.Tensor, got {type(full).__name__}")
        for slot in slots:
            want = slot.tensor.torch_dtype
            if full.dtype != want:
                raise ReplicaError(
                    f"cannot stage {full_name!r} into {slot.tensor.name!r}: dtype {full.dtype} differs from the "
                    f"target's {want} (cast before staging; weightsync does not convert)"
                )
            if tuple(full.shape) != slot.part.full_shape:
                raise ReplicaError(
                    f"cannot stage {full_name!r} into {slot.tensor.name!r}: shape {list(full.shape)} differs from "
                    f"the full shape the target expects, {list(slot.part.full_shape)}"
                )
        return slots

    def stage(self, full_name: str, full: torch.Tensor) -> int:
        """Write every part cut from ``full`` into its local tensor; returns how many parts were written.

        Nothing is written when a check fails. A name no local tensor uses writes nothing and returns 0
        (see :meth:`ReplicaSet.stage` for the strict form).
        """
        slots = self.check(full_name, full)
        if slots:
            with self._staging():
                self._check_restage(slots)
                self._write(slots, full)
        return len(slots)

    def _check_restage(self, slots: tuple[PartSlot, ...]) -> None:
        """While a stream sends this replica, a part staged in it may already be on the wire: refuse a second write."""
        if self._streaming and any(self._flags[s.index] for s in slots):
            again = next(s for s in slots if self._flags[s.index])
            raise ReplicaBusyError(
                f"{again.tensor.name!r} (from {again.part.source!r}) was already staged in this stream and may be "
                "sent already; each part is staged once per streamed version"
            )

    def _write(
        self, slots: tuple[PartSlot, ...], full: torch.Tensor | None, origin: tuple[int, int] | None = None
    ) -> None:
        """Copy (the caller holds ``_lock``), then hash the chunks this completed, on the digest threads; ``full``
        None: the bytes are written already (an engine replica's loader), only file the slots as staged. ``origin``:
        as :class:`_StagedWrite`'s."""
        grain = self.digest_grain
        touched = sorted({c for slot in slots for c in self.layout.chunks_of(slot.tensor, grain)})
        for chunk in touched:  # the bytes change: no stale digest may be read, or filed, from now on
            self._generation[chunk] += 1
            self._valid[chunk] = _NO_DIGEST
        if full is None:
            for slot in slots:
                self._staged[slot.index] = 1
        else:
            self._copy(slots, full, origin)
        for chunk in touched:
            if self.staged(self._chunk_slots[chunk]):
                self._valid[chunk] = _DIGEST_HASHING
                self._pending[chunk] = _digest_executor().submit(self._hash_chunk, chunk, self._generation[chunk])

    def mark_loaded(self) -> None:
        """An engine replica's loader wrote every tensor (in another process, through the shared file): file each
        slot as staged and hash the chunks, as staging does after a copy."""
        if self.layout.replica is None:
            raise ReplicaError(f"replica {self.fingerprint} is not an engine replica: its tensors are staged")
        with self._staging():
            self._write(self.layout.slots, None)

    def _hash_chunk(self, chunk: int, generation: int) -> None:
        """Hash ``chunk`` (outside the lock: staging goes on), then file it unless it was written again meanwhile."""
        grain = self.digest_grain
        start = chunk * grain
        length = min(grain, self.layout.nbytes - start)
        value = xxhash.xxh3_64_intdigest(view(self.address + start, length))
        with self._lock:
            if self._closed or self._generation[chunk] != generation:
                return  # a later write cleared it; its own job files the digest
            self._digests[chunk] = value
            self._valid[chunk] = _DIGEST_VALID  # after the digest: a reader in another process checks the flag

    def _copy(self, slots: tuple[PartSlot, ...], full: torch.Tensor, origin: tuple[int, int] | None = None) -> None:
        with torch.no_grad():
            source = full.detach()
            for slot in slots:
                tensor = slot.tensor
                shift = origin[1] if origin is not None and origin[0] == slot.part.dim else 0
                piece = source.narrow(slot.part.dim, slot.part.start - shift, slot.part.length)
                typed = self._typed(tensor)
                if typed is not None:
                    self._place(typed, slot).copy_(piece)
                else:  # offset not aligned for the dtype: go through an aligned copy
                    scratch = self._typed_copy(tensor)
                    self._place(scratch, slot).copy_(piece)
                    self.raw(tensor.name).copy_(scratch.reshape(-1).view(torch.uint8))
                self._staged[slot.index] = 1

    @staticmethod
    def _place(local: torch.Tensor, slot: PartSlot) -> torch.Tensor:
        return part_view(local, slot.tensor.cat_dim, slot.part.at, slot.cat_start, slot.cat_length)

    def _typed(self, tensor: LocalTensor) -> torch.Tensor | None:
        itemsize = ITEMSIZE[tensor.dtype]
        if tensor.offset % itemsize:
            return None
        return self.raw(tensor.name).view(tensor.torch_dtype).view(tensor.shape)

    def _typed_copy(self, tensor: LocalTensor) -> torch.Tensor:
        out = torch.empty(tensor.shape, dtype=tensor.torch_dtype)
        out.reshape(-1).view(torch.uint8).copy_(self.raw(tensor.name))
        return out

    def release(self, names: Iterable[str]) -> int:
        """Give back the memory of tensors ``names`` (a feed's, once every engine replica reading it loaded them):
        the file's pages under them return to the system (``MADV_REMOVE``; the file keeps its size and reads as zeros
        there), and their parts stay filed as staged for this version, as :data:`RELEASED`, so a publish of it still
        finds the feed complete while a load that would read them again is refused (:meth:`released`). Staging them
        again writes them anew. Returns the bytes given back (whole pages inside the tensors' merged ranges)."""
        wanted = set(names)
        with self._lock:
            self._check_open()
            for slot in self.layout.slots:
                if slot.tensor.name in wanted and self._flags[slot.index]:
                    self._flags[slot.index] = RELEASED
            if self._mmap is None:
                return 0
            # Runs of neighbouring released tensors go as one range (the pages they share go too); a tensor kept
            # between them ends a run, and only whole pages inside a run are given back.
            merged: list[list[int]] = []
            joined = False
            for tensor in sorted(self.layout.tensors, key=lambda t: t.offset):
                if tensor.name not in wanted:
                    joined = False
                elif joined:
                    merged[-1][1] = tensor.offset + tensor.nbytes
                else:
                    merged.append([tensor.offset, tensor.offset + tensor.nbytes])
                    joined = True
            freed = 0
            for start, end in merged:
                first = _align(self.data_offset + start, mmap.PAGESIZE)
                last = (self.data_offset + end) // mmap.PAGESIZE * mmap.PAGESIZE
                if last > first:
                    self._mmap.madvise(mmap.MADV_REMOVE, first, last - first)
                    freed += last - first
            return freed

    def held_bytes(self) -> int:
        """The memory the replica's file holds now (its allocated blocks; a feed's shrink as layers are given back),
        or its size for a buffer without a file."""
        if self._fd is None:
            return self.buffer.numel()
        return os.fstat(self._fd).st_blocks * 512

    def released(self, names: Iterable[str]) -> list[str]:
        """Which of tensors ``names`` were given back (:meth:`release`) and not staged since."""
        wanted = set(names)
        flags = self._flags
        gone = {s.tensor.name for s in self.layout.slots if s.tensor.name in wanted and flags[s.index] == RELEASED}
        return sorted(gone)

    def reset(self) -> None:
        """Forget what was staged (the bytes stay): the next version must stage every part again."""
        with self._staging():
            self._staged.zero_()

    # --- Exclusion between staging and publishing ------------------------------------------------

    @contextlib.contextmanager
    def _staging(self) -> Iterator[None]:
        with self._lock:
            self._check_open()
            if self._publishing:
                raise ReplicaBusyError(
                    f"replica {self.fingerprint} is being published; stage the next version after publish returns"
                )
            self._flock(fcntl.LOCK_SH, "staged")
            try:
                yield
            finally:
                self._flock(fcntl.LOCK_UN, "")

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        """Hold the replica read-only while it is sent; ReplicaBusyError if it is being staged or sent."""
        with self._lock:
            self._check_open()
            if self._publishing or self._streaming:
                raise ReplicaBusyError(f"replica {self.fingerprint} is already being published")
            self._flock(fcntl.LOCK_EX, "published")
            self._publishing = True
        try:
            yield
        finally:
            with self._lock:
                self._publishing = False
                self._flock(fcntl.LOCK_UN, "")

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """Send while the trainer stages (a streamed version): staging stays open, but a part staged once may
        not be staged again until the stream ends (its bucket may be on the wire). No file lock is taken: the
        stager's process holds its replicas in this mode for the stream (the client does), so it is the one
        that refuses a restage; the sending process (the sidecar) enters it too, to refuse a plain publish."""
        with self._lock:
            self._check_open()
            if self._publishing:
                raise ReplicaBusyError(f"replica {self.fingerprint} is already being published")
            self._streaming += 1
        try:
            yield
        finally:
            with self._lock:
                self._streaming -= 1

    def mark_stream(self, version: int, state: StreamState | None) -> None:
        """File in the shared file that the trainer streams ``version`` (None: no stream), for the sidecar."""
        self._stream_word[1] = 0  # never a torn (old version, new state) pair for a reader
        self._stream_word[0] = version
        self._stream_word[1] = 0 if state is None else _STREAM_CODES[state]

    def stream_state(self, version: int) -> StreamState | None:
        """The state of the trainer's stream of ``version``, if it streams that version."""
        code = int(self._stream_word[1])
        if not code or int(self._stream_word[0]) != version:
            return None
        return _STREAM_STATES[code]

    def _flock(self, op: int, doing: str) -> None:
        if self._fd is None:
            return
        if op == fcntl.LOCK_UN:
            fcntl.flock(self._fd, op)
            return
        try:
            fcntl.flock(self._fd, op | fcntl.LOCK_NB)
        except BlockingIOError:
            other = "published" if op == fcntl.LOCK_SH else "staged or published"
            raise ReplicaBusyError(
                f"replica {self.shm_path} cannot be {doing} now: another process has it {other}"
            ) from None

    def _check_open(self) -> None:
        if self._closed:
            raise ReplicaError(f"replica {self.fingerprint} is closed")

    # --- Teardown --------------------------------------------------------------------------------

    def close(self, *, unlink: bool = False) -> None:
        """Release the buffer (and the file mapping); ``unlink`` also removes the shm file."""
        if unlink and self.shm_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.shm_path.unlink()  # the mapping stays valid until it is closed below
        if self._closed:
            return
        self.flush_digests()  # a hash still reading the buffer must finish before it is unmapped
        self._closed = True
        if self._host_registered:
            _cudart().cudaHostUnregister(self.address)
            self._host_registered = False
        del self.buffer
        del self._staged
        for held in reversed(self._views):  # exported views would keep the mapping from closing
            held.release()
        self._views.clear()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # views handed out by tensor() are still alive; the GC unmaps later
                log.debug("replica %s: mapping still referenced; left to the garbage collector", self.shm_path)
        if self._fd is not None:
            os.close(self._fd)

    def __repr__(self) -> str:
        where = f" at {self.shm_path}" if self.shm_path else ""
        return f"Replica({self.fingerprint}, {len(self.layout.tensors)} tensors, {self.nbytes} B{where})"


# --- One replica per distinct layout ---------------------------------------------------------------


class ReplicaSet:
    """The replicas of one source: one per distinct target layout (fingerprint), shared by all targets
    with that layout, and for engine replicas the feed replicas their loaders read (``feeds``: the trainer stages
    into them; no target is written from them). :meth:`stage` checks against every replica, then writes into every
    replica."""

    def __init__(self, replicas: Iterable[Replica], feeds: Iterable[Replica] = ()) -> None:
        self.replicas: dict[str, Replica] = {}
        self.feeds: dict[str, Replica] = {}
        for into, given in ((self.replicas, replicas), (self.feeds, feeds)):
            for replica in given:
                if replica.fingerprint in into:
                    raise ReplicaError(f"two replicas with layout {replica.fingerprint}; one is enough")
                into[replica.fingerprint] = replica

    @classmethod
    def for_manifests(
        cls,
        manifests: Iterable[Manifest],
        *,
        shm_dir: str | os.PathLike[str] | None = None,
        pin: bool | None = None,
        digest_grain: int = 0,
    ) -> ReplicaSet:
        """One replica per distinct ``layout_fingerprint``; files ``<shm_dir>/<fingerprint>.replica``, and for engine
        replicas one feed replica per distinct feed layout, ``<shm_dir>/<fingerprint>.feed``.

        ``digest_grain``: see :meth:`Replica.create` (the plan's bucket size when targets verify bucket digests)."""
        layouts: dict[str, ReplicaLayout] = {}
        feed_layouts: dict[str, ReplicaLayout] = {}
        for manifest in manifests:
            if manifest.layout_fingerprint not in layouts:
                layout = ReplicaLayout.of(manifest)
                layouts[manifest.layout_fingerprint] = layout
                if layout.replica is not None:
                    feed = ReplicaLayout.of_feeds(layout.replica)
                    feed_layouts.setdefault(feed.fingerprint, feed)
        made: list[Replica] = []
        try:
            for suffix, kinds in ((REPLICA_SUFFIX, layouts), (FEED_SUFFIX, feed_layouts)):
                for fingerprint, layout in kinds.items():
                    path = None if shm_dir is None else Path(shm_dir) / f"{fingerprint}{suffix}"
                    if path is not None:
                        make_shared_folders(path.parent)
                    grain = digest_grain if suffix == REPLICA_SUFFIX else 0  # no target is written from a feed
                    made.append(Replica.create(layout, shm_path=path, pin=pin, digest_grain=grain))
        except BaseException:
            for replica in made:
                replica.close(unlink=True)
            raise
        return cls(made[: len(layouts)], made[len(layouts) :])

    @classmethod
    def attach(cls, shm_dir: str | os.PathLike[str], *, pin: bool | None = None) -> ReplicaSet:
        """Every ``*.replica`` and ``*.feed`` file in ``shm_dir`` (as :meth:`for_manifests` wrote them)."""
        paths = sorted(Path(shm_dir).glob(f"*{REPLICA_SUFFIX}"))
        if not paths:
            raise ReplicaError(f"no replica files ({REPLICA_SUFFIX}) in {shm_dir}")
        feeds = sorted(Path(shm_dir).glob(f"*{FEED_SUFFIX}"))
        return cls((Replica.attach(p, pin=pin) for p in paths), (Replica.attach(p, pin=False) for p in feeds))

    def __iter__(self) -> Iterator[Replica]:
        """The target replicas (what sources write from)."""
        return iter(self.replicas.values())

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, fingerprint: str) -> Replica:
        return self.replicas[fingerprint]

    def every(self) -> list[Replica]:
        """The target replicas and the feed replicas."""
        return [*self.replicas.values(), *self.feeds.values()]

    def feed_for(self, replica: Replica) -> Replica:
        """The feed replica engine replica ``replica``'s loader reads."""
        if replica.layout.replica is None:
            raise ReplicaError(f"replica {replica.fingerprint} is not an engine replica: it has no feed")
        fingerprint = ReplicaLayout.of_feeds(replica.layout.replica).fingerprint
        try:
            return self.feeds[fingerprint]
        except KeyError:
            raise ReplicaError(f"engine replica {replica.fingerprint} has no feed replica {fingerprint}") from None

    @property
    def nbytes(self) -> int:
        """CPU memory this source spends on replicas: the sum over its shapes of one shard each, and the feeds."""
        return sum(r.nbytes for r in self.every())

    @property
    def parts(self) -> int:
        """How many slots every replica has in all (what :meth:`missing` lists right after a reset)."""
        return sum(len(r.layout.slots) for r in self.every())

    def full_names(self) -> set[str]:
        return set().union(*(r.full_names() for r in self.every()))

    def stage(self, full_name: str, full: torch.Tensor, *, strict: bool = True) -> int:
        """Stage ``full`` into every replica that uses it; returns the parts written across replicas.

        Every replica checks first; if any refuses, nothing is written anywhere. With ``strict``, a
        name no target tensor is cut from is an error (usually a naming mismatch with the engine).
        """
        plans = [plan for replica in self.every() for plan in self._plans(replica, full_name, full)]
        if strict and not any(plan.slots for plan in plans):
            raise ReplicaError(f"no target tensor of this source is cut from {full_name!r}")
        plans = [plan for plan in plans if plan.slots]
        with contextlib.ExitStack() as stack:
            for replica in {id(p.replica): p.replica for p in plans}.values():  # every one free before any is written
                stack.enter_context(replica._staging())
            for plan in plans:
                plan.replica._check_restage(plan.slots)
            for plan in plans:
                plan.replica._write(plan.slots, plan.tensor, plan.origin)
        return sum(len(plan.slots) for plan in plans)

    @staticmethod
    def _plans(replica: Replica, name: str, full: torch.Tensor) -> list[_StagedWrite]:
        """What staging ``full`` writes into ``replica``: its parts, or for a quantized weight the quantized weight and
        its scale (quantized here, where the trainer stages: on its device)."""
        quantized = replica.layout.quantized.get(name)
        if quantized is None:
            return [_StagedWrite(replica, replica.check(name, full), full)]
        if not isinstance(full, torch.Tensor) or full.dim() != 2 or not full.is_floating_point():
            raise ReplicaError(
                f"cannot stage {name!r}: the engine's checkpoint quantizes it ({quantized.scheme}); stage a 2-D float "
                "tensor"
            )
        if quantized.block is None:
            scale_dtype = TORCH_DTYPES[replica.layout.by_name[quantized.scale].dtype]  # the checkpoint's
            channel = fp8_channel if quantized.scheme == "fp8-channel" else int8_channel
            weight, scale = channel(full.detach(), scale_dtype)
            return [_StagedWrite(replica, replica.check(name, weight.cpu()), weight.cpu()),
                    _StagedWrite(replica, replica.check(quantized.scale, scale.cpu()), scale.cpu())]  # fmt: skip
        # Only the tiles this replica's cut covers (a TP shard's rows): the same bytes as quantizing the whole tensor
        # (tiles start at row and column 0; the manifest holds cuts to tile edges), a fraction of the work.
        slots = replica.layout.by_source.get(name, ())
        dim, low, high = _tile_span(slots, tuple(full.shape), quantized.block)
        for slot in slots:
            if tuple(full.shape) != slot.part.full_shape:
                raise ReplicaError(
                    f"cannot stage {name!r} into {slot.tensor.name!r}: shape {list(full.shape)} differs from the full "
                    f"shape the target expects, {list(slot.part.full_shape)}"
                )
        weight, scale = fp8_block(full.detach().narrow(dim, low, high - low), quantized.block)
        tile = quantized.block[dim]
        scale_slots = replica.layout.by_source.get(quantized.scale, ())
        return [_StagedWrite(replica, slots, weight.cpu(), (dim, low)),
                _StagedWrite(replica, scale_slots, scale.cpu(), (dim, low // tile))]  # fmt: skip

    def stage_many(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        return sum(self.stage(name, tensor) for name, tensor in items)

    def missing(self) -> list[MissingPart]:
        return [m for r in self.every() for m in r.missing()]

    def mark_stream(self, version: int, state: StreamState | None) -> None:
        for replica in self.every():
            replica.mark_stream(version, state)

    def stream_state(self, version: int) -> StreamState | None:
        """The trainer's stream of ``version`` as the replica files say (every replica carries the same mark)."""
        for replica in self.every():
            return replica.stream_state(version)
        return None

    def flush_digests(self) -> None:
        """Wait for the bucket digests this process's staging is still computing."""
        for replica in self.every():
            replica.flush_digests()

    def reset(self) -> None:
        for replica in self.every():
            replica.reset()

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        """The target replicas held read-only while they are sent (an engine replica's loader holds its feed)."""
        with contextlib.ExitStack() as stack:
            for replica in self:
                stack.enter_context(replica.publishing())
            yield

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for replica in self.every():
                stack.enter_context(replica.streaming())
            yield

    def close(self, *, unlink: bool = False) -> None:
        for replica in self.every():
            replica.close(unlink=unlink)
