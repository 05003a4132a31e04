"""One engine rank's weight memory as the transport sees it: live buffer, optional staging twin, verify.

In **live** mode the manifest points at the live weights: sources write straight into what the engine
serves, so the engine must be paused while they do. In **staged** mode the manifest points at a second,
separately registered buffer with the identical layout: the engine keeps serving the previous version from
its live weights while sources write, and :meth:`RankMemory.promote` copies staging over live at commit
(one memcpy; the caller makes that atomic with respect to serving).

**Write window**: with ``windowed`` (the default), the buffer sources write into is registered with the
transport only between :meth:`RankMemory.open_window` (the round's begin, or a failed verification the sources
write again after) and :meth:`RankMemory.close_window` (the rank's verification, before it hashes, or the round's
commit or abort). Mooncake's target checks every incoming write against its *current* registrations, so
outside a round a peer's write is refused at once (rc < 0) and no byte lands, whoever the peer is: Mooncake's
ports carry no credential, this is what keeps them from being a way into the engine between rounds. The
addresses do not move (the buffers stay allocated), so manifests and the sources' pinned placements stay valid.

Verification hashes the target side of every bucket of ``plan_buckets(manifest, bucket_bytes)`` with
:func:`weightsync_agent.layout.checksums.target_checksum`, the same definition sources use over their replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.checksums import checksum_ranges, target_checksum, target_ranges
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.transport.base import Transport


class FlatWeights(Protocol):
    """A rank's parameters packed in one flat buffer (e.g. the reference model's ``RankWeights``)."""

    @property
    def buffer(self) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...

    def new_buffer(self) -> torch.Tensor: ...

    def manifest(
        self, *, engine: int, session_id: str, buffer: torch.Tensor | None = None, staging: bool = False
    ) -> Manifest: ...


@dataclass(frozen=True)
class BucketMismatch:
    index: int
    expected: str
    actual: str


@dataclass(frozen=True)
class VerifyResult:
    rank: int
    bucket_bytes: int
    buckets: int
    mismatched: tuple[BucketMismatch, ...] = ()
    error: str | None = None
    staged: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.mismatched

    def to_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "ok": self.ok,
            "bucket_bytes": self.bucket_bytes,
            "buckets": self.buckets,
            "staged": self.staged,
            "mismatched": [{"index": m.index, "expected": m.expected, "actual": m.actual} for m in self.mismatched],
            "error": self.error,
        }


@dataclass
class RankMemory:
    """Live (and optionally staging) memory of one rank, registered with that rank's transport."""

    weights: FlatWeights
    transport: Transport
    engine: int
    rank: int
    staging: torch.Tensor | None = None
    #: Writable only inside a round (the module's "Write window"); False: registered for the memory's whole life.
    windowed: bool = True
    _manifests: dict[bool, Manifest] = field(default_factory=dict)
    _registered: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.windowed:
            self._register(self.weights.buffer)

    @property
    def target(self) -> torch.Tensor:
        """The buffer sources write into now: staging in staged mode, else the live weights."""
        return self.staging if self.staging is not None else self.weights.buffer

    @property
    def writable(self) -> bool:
        """Whether a peer's write into :attr:`target` would be accepted now."""
        return self.target.data_ptr() in self._registered

    def open_window(self) -> None:
        """A round begins: accept writes into :attr:`target` until :meth:`close_window`. Idempotent."""
        if self.windowed and not self.writable:
            self._register(self.target)

    def close_window(self) -> None:
        """The rank is about to be checked, or the round ended: refuse every write again. Idempotent."""
        if self.windowed:
            for address in list(self._registered):
                self._unregister(address)

    @property
    def session_id(self) -> str:
        return self.transport.session_id

    @property
    def staged(self) -> bool:
        return self.staging is not None

    def manifest(self) -> Manifest:
        """Where sources write now: the staging buffer in staged mode, else the live weights."""
        staged = self.staged
        if staged not in self._manifests:
            self._manifests[staged] = self.weights.manifest(
                engine=self.engine, session_id=self.session_id, buffer=self.staging, staging=staged
            )
        return self._manifests[staged]

    def enable_staging(self) -> None:
        if self.staging is not None:
            return
        staging = self.weights.new_buffer()
        staging.copy_(self.weights.buffer)  # bytes nobody writes stay equal to live (none, when packed)
        if not self.windowed:
            self._register(staging)
        self.staging = staging
        self._manifests.pop(True, None)

    def disable_staging(self) -> None:
        if self.staging is None:
            return
        if self.staging.data_ptr() in self._registered:
            self._unregister(self.staging.data_ptr())
        self.staging = None
        self._manifests.pop(True, None)

    def verify(self, bucket_bytes: int, checksums: list[str], *, served: bool = False) -> VerifyResult:
        """Compare the source's per-bucket checksums with what is in this rank's target memory now; ``served``: with
        the live weights the engine computes with instead (scrubbing; the same bytes as staging after a commit)."""
        manifest = self.manifest()
        shift = self.weights.buffer.data_ptr() - self.target.data_ptr() if served else 0
        try:
            buckets = plan_buckets(manifest, bucket_bytes)
        except ValueError as exc:
            return VerifyResult(self.rank, bucket_bytes, 0, error=str(exc), staged=self.staged)
        if len(checksums) != len(buckets):
            return VerifyResult(
                self.rank,
                bucket_bytes,
                len(buckets),
                error=f"expected {len(buckets)} checksums for {bucket_bytes}-byte buckets, got {len(checksums)}",
                staged=self.staged,
            )
        mismatched = []
        for bucket, expected in zip(buckets, checksums, strict=True):
            actual = checksum_ranges((address + shift, length) for address, length in target_ranges(bucket))
            if actual != expected.lower():
                mismatched.append(BucketMismatch(bucket.index, expected, actual))
        return VerifyResult(self.rank, bucket_bytes, len(buckets), tuple(mismatched), staged=self.staged)

    def checksums(self, bucket_bytes: int) -> list[str]:
        """Per-bucket checksums of this rank's target memory now (what :meth:`verify` compares against)."""
        return [target_checksum(bucket) for bucket in plan_buckets(self.manifest(), bucket_bytes)]

    def promote(self) -> None:
        """Copy staging over live (commit in staged mode). The caller excludes concurrent serving."""
        if self.staging is None:
            raise RuntimeError(f"rank {self.rank} has no staging buffer")
        self.weights.buffer.copy_(self.staging)

    def close(self) -> None:
        for address in list(self._registered):
            self._unregister(address)
        self.staging = None
        self.transport.close()

    def _register(self, buffer: torch.Tensor) -> None:
        self.transport.register(buffer.data_ptr(), buffer.numel() * buffer.element_size())
        self._registered.append(buffer.data_ptr())

    def _unregister(self, address: int) -> None:
        self.transport.unregister(address)
        self._registered.remove(address)
