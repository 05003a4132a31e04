"""Test helpers for the source side: small layouts, fake engine ranks, an independent resharder.

``expected_local`` rebuilds a target tensor from full tensors with ``narrow`` + ``torch.cat``, which is
deliberately not how the replica stages (it copies each part into a view of the local tensor), so the
two check each other.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import torch

from weightsync.api.v1alpha1 import WeightSyncGroupSpec
from weightsync.plan import Plan, plan_for
from weightsync_agent.layout.manifest import ITEMSIZE, Manifest, Region, ShardPart, TensorEntry
from weightsync_agent.source.replica import TORCH_DTYPES
from weightsync_agent.transport.base import TransferState, TransportError

# --- Layouts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Local:
    """A target tensor: its parts, concatenated along ``cat_dim`` (in the sub-tensor each part's ``at`` picks),
    then ``padding`` zero slices."""

    name: str
    dtype: str
    parts: tuple[ShardPart, ...]
    cat_dim: int = 0
    padding: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        lead = len(self.parts[0].at)
        along: dict[tuple[int, ...], int] = {}
        for p in self.parts:
            along[p.at] = along.get(p.at, 0) + p.shape[self.cat_dim - lead]
        sub = list(self.parts[0].shape)
        sub[self.cat_dim - lead] = max(along.values()) + self.padding
        indexed = [max(p.at[i] for p in self.parts) + 1 for i in range(lead)]
        return tuple(indexed + sub)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def part(
    source: str, full_shape: Sequence[int], dim: int, start: int, length: int, at: tuple[int, ...] = ()
) -> ShardPart:
    return ShardPart(source=source, full_shape=tuple(full_shape), dim=dim, start=start, length=length, at=at)


def whole(source: str, full_shape: Sequence[int]) -> ShardPart:
    return part(source, full_shape, 0, 0, full_shape[0])


@dataclass(frozen=True)
class Full:
    name: str
    shape: tuple[int, ...]
    dtype: str


def tp_layout(model: Sequence[tuple[str, Sequence[Full]]], tp: int, rank: int) -> list[Local]:
    """Target tensors of rank ``rank`` of ``tp`` for a toy model.

    ``model`` lists ``(kind, fulls)``: ``column`` (one full, rows split), ``row`` (one full, columns
    split), ``replicated`` (one full, whole), ``fused`` (several fulls, each rows split, concatenated
    along dim 0, like qkv / gate_up), ``fused_cols`` (columns split, concatenated along dim 1), ``expert``
    (a 3-D full split along dim 0), ``padded`` (rows split in ceil(rows / tp) per rank, the last rank
    zero-padded, like SGLang's vocab), ``experts_w13`` (per expert a gate and an up full, rows split, in
    ``[experts, rows, cols]`` at ``(e,)``, like SGLang's FusedMoE) and ``experts_w2`` (per expert one
    full, columns split, along dim 2 of ``[experts, rows, cols]``).
    """
    out: list[Local] = []
    for index, (kind, fulls) in enumerate(model):
        dtype = fulls[0].dtype
        if kind == "replicated":
            f = fulls[0]
            out.append(Local(f"t{index}.{f.name}", dtype, (whole(f.name, f.shape),)))
        elif kind in ("column", "expert"):
            f = fulls[0]
            n = f.shape[0] // tp
            out.append(Local(f"t{index}.{f.name}", dtype, (part(f.name, f.shape, 0, rank * n, n),)))
        elif kind == "row":
            f = fulls[0]
            n = f.shape[1] // tp
            out.append(Local(f"t{index}.{f.name}", dtype, (part(f.name, f.shape, 1, rank * n, n),), cat_dim=1))
        elif kind == "fused":
            parts = tuple(part(f.name, f.shape, 0, rank * (f.shape[0] // tp), f.shape[0] // tp) for f in fulls)
            out.append(Local(f"t{index}.fused", dtype, parts, cat_dim=0))
        elif kind == "fused_cols":
            parts = tuple(part(f.name, f.shape, 1, rank * (f.shape[1] // tp), f.shape[1] // tp) for f in fulls)
            out.append(Local(f"t{index}.fused_cols", dtype, parts, cat_dim=1))
        elif kind == "padded":
            f = fulls[0]
            n = -(-f.shape[0] // tp)
            held = min(f.shape[0] - rank * n, n)
            parts = (part(f.name, f.shape, 0, rank * n, held),)
            out.append(Local(f"t{index}.{f.name}", dtype, parts, padding=n - held))
        elif kind == "experts_w13":  # fulls: gate0, up0, gate1, up1, ...
            n = fulls[0].shape[0] // tp
            parts = tuple(part(f.name, f.shape, 0, rank * n, n, at=(i // 2,)) for i, f in enumerate(fulls))
            out.append(Local(f"t{index}.w13", dtype, parts, cat_dim=1))
        elif kind == "experts_w2":
            n = fulls[0].shape[1] // tp
            parts = tuple(part(f.name, f.shape, 1, rank * n, n, at=(e,)) for e, f in enumerate(fulls))
            out.append(Local(f"t{index}.w2", dtype, parts, cat_dim=2))
        else:
            raise ValueError(kind)
    return out


def random_full(full: Full, generator: torch.Generator) -> torch.Tensor:
    """Random bits of the right dtype (NaNs included: compare bytes, not values)."""
    nbytes = math.prod(full.shape) * ITEMSIZE[full.dtype]
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(TORCH_DTYPES[full.dtype]).view(full.shape)


def expected_local(local: Local | TensorEntry, fulls: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per sub-tensor (``at``) the parts cut and concatenated, then zeros: with ``torch.cat``/``stack``/``pad``,
    which is not how the replica or the receiver place parts."""
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for p in local.parts:
        groups.setdefault(p.at, []).append(fulls[p.source].narrow(p.dim, p.start, p.length))
    lead = len(local.parts[0].at)
    dim = local.cat_dim - lead
    blocks = {}
    for at, pieces in groups.items():
        block = torch.cat(pieces, dim=dim)
        if local.padding:
            pad = list(block.shape)
            pad[dim] = local.padding
            block = torch.cat([block, torch.zeros(pad, dtype=block.dtype)], dim=dim)
        blocks[at] = block
    if not lead:
        return blocks[()]
    assert lead == 1, "the toy models index one leading dim"
    return torch.stack([blocks[(e,)] for e in range(len(blocks))])


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


# --- Fake engine ranks ---------------------------------------------------------------------------


class TargetMemory:
    """An engine rank's weights: one buffer with the local tensors at fixed addresses.

    ``gap`` bytes separate tensors (so buckets split into several pieces); ``regions="one"`` registers
    the whole buffer as one region, ``"each"`` one region per tensor.
    """

    def __init__(
        self,
        locals_: Sequence[Local],
        *,
        engine: int,
        rank: int,
        session_id: str,
        gap: int = 0,
        regions: str = "one",
    ) -> None:
        self.locals = list(locals_)
        offsets, cursor = [], 0
        for local in self.locals:
            offsets.append(cursor)
            cursor += local.nbytes + gap
        self.buffer = torch.zeros(max(cursor, 1), dtype=torch.uint8)
        base = self.buffer.data_ptr()
        self.offsets = dict(zip((lc.name for lc in self.locals), offsets, strict=True))
        entries = tuple(
            TensorEntry(
                name=lc.name,
                dtype=lc.dtype,
                shape=lc.shape,
                address=base + off,
                nbytes=lc.nbytes,
                cat_dim=lc.cat_dim,
                parts=lc.parts,
                padding=lc.padding,
            )
            for lc, off in zip(self.locals, offsets, strict=True)
        )
        region_list: tuple[Region, ...]
        if regions == "one":
            region_list = (Region(address=base, nbytes=self.buffer.numel()),)
        else:
            region_list = tuple(Region(address=e.address, nbytes=e.nbytes) for e in entries if e.nbytes)
        self.manifest = Manifest(engine=engine, rank=rank, session_id=session_id, tensors=entries, regions=region_list)

    @property
    def address(self) -> int:
        return int(self.buffer.data_ptr())

    def raw(self, name: str) -> torch.Tensor:
        local = next(lc for lc in self.locals if lc.name == name)
        return self.buffer.narrow(0, self.offsets[name], local.nbytes)


# --- Plans ---------------------------------------------------------------------------------------

TEMPLATE = {"spec": {"containers": [{"name": "main", "image": "x"}]}}


def make_plan(
    sources: int, engines: int, tp: int, *, timeout: int = 30, bucket_mib: int = 1, pause: str = "minimal"
) -> Plan:
    spec = WeightSyncGroupSpec.model_validate(
        {
            "trainer": {"replicas": sources, "ranksPerPod": 1, "template": TEMPLATE},
            "inference": {"engines": engines, "ranksPerEngine": tp, "ranksPerPod": tp, "template": TEMPLATE},
            "transfer": {"timeoutSeconds": timeout, "bucketSizeMiB": bucket_mib, "pause": pause},
        }
    )
    return plan_for(spec, group="t", namespace="default")


# --- An in-test transport (the Transport protocol, Mooncake-like address checks) -------------------


class FakeTransfer:
    def __init__(self, peer: str, nbytes: int) -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.state = TransferState.PENDING
        self.message: str | None = None

    def poll(self) -> TransferState:
        return self.state

    def error(self) -> str | None:
        return self.message


class FakeTransport:
    """In-process transport: writes are memmoves on a worker thread per peer.

    Like Mooncake, the *target* checks each request against its current registrations (one request
    must fit in one registered region). ``stall()`` makes a peer accept writes and never finish them.
    """

    sessions: ClassVar[dict[str, FakeTransport]] = {}
    _counter: ClassVar[int] = 0

    def __init__(self) -> None:
        FakeTransport._counter += 1
        self._session = f"fake-{FakeTransport._counter}"
        self.regions: dict[int, int] = {}
        self.submitted = 0
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._release = threading.Event()
        self._release.set()
        FakeTransport.sessions[self._session] = self

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, address: int, nbytes: int) -> None:
        for start, size in self.regions.items():
            if address < start + size and start < address + nbytes:
                raise TransportError(f"{self._session}: [{address:#x}, +{nbytes}) overlaps a registered region")
        self.regions[address] = nbytes

    def unregister(self, address: int) -> None:
        if self.regions.pop(address, None) is None:
            raise TransportError(f"{self._session}: {address:#x} is not registered")

    def covers(self, address: int, nbytes: int) -> bool:
        return any(start <= address and address + nbytes <= start + size for start, size in self.regions.items())

    def probe(self, peer: str, timeout: float) -> bool:
        return peer in FakeTransport.sessions

    def stall(self) -> None:
        self._release.clear()

    def release(self) -> None:
        self._release.set()

    def submit_write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> FakeTransfer:
        target = FakeTransport.sessions.get(peer)
        if target is None:
            raise TransportError(f"unknown peer {peer}")
        if not self.covers(local_address, nbytes):
            raise TransportError(f"local range [{local_address:#x}, +{nbytes}) is not registered")
        self.submitted += 1
        transfer = FakeTransfer(peer, nbytes)
        pool = self._pools.setdefault(peer, ThreadPoolExecutor(1, thread_name_prefix=f"fake-{peer}"))

        def work() -> None:
            if not target._release.wait(timeout=30):
                transfer.message, transfer.state = "timed out", TransferState.FAILED
                return
            if not target.covers(remote_address, nbytes):
                transfer.message = f"remote range [{remote_address:#x}, +{nbytes}) is not registered on {peer}"
                transfer.state = TransferState.FAILED
                return
            ctypes.memmove(remote_address, local_address, nbytes)
            transfer.state = TransferState.DONE

        pool.submit(work)
        return transfer

    def close(self) -> None:
        self._release.set()
        for peer in list(FakeTransport.sessions):
            other = FakeTransport.sessions[peer]
            other._release.set()
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        FakeTransport.sessions.pop(self._session, None)


# --- A toy model used by the publish and client tests --------------------------------------------

MODEL: list[tuple[str, list[Full]]] = [
    ("replicated", [Full("embed", (16, 8), "bfloat16")]),
    ("fused", [Full("q", (8, 8), "bfloat16"), Full("k", (4, 8), "bfloat16"), Full("v", (4, 8), "bfloat16")]),
    ("row", [Full("o", (8, 8), "bfloat16")]),
    ("replicated", [Full("norm", (8,), "float32")]),
    ("column", [Full("up", (16, 8), "float16")]),
    ("fused_cols", [Full("a", (4, 6), "float32"), Full("b", (4, 2), "float32")]),
]


def full_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f.name: random_full(f, gen) for _, group in MODEL for f in group}
