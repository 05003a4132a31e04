"""What one source wrote in one attempt of a round: the message sources send back to the coordinator."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from weightsync.plan import Target


@dataclass(frozen=True)
class Throughput:
    """Bytes one peer moved in a round, and the seconds it took (from the start of the writes to the last byte)."""

    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Gigabits per second (what links are rated in)."""
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class SourceReport:
    """What a source wrote: per target, the checksum of every bucket (what the target must verify)."""

    source: int
    ok: bool
    checksums: Mapping[Target, Sequence[str]] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    failed_target: Target | None = None
    failed_bucket: int | None = None
    #: Per target written: its bytes, and the seconds from the start of this source's writes until its last bucket
    #: landed (empty where the sender cannot tell targets apart, as a broadcast cannot).
    targets: Mapping[Target, Throughput] = field(default_factory=dict)
    #: False only when the source is sure it wrote nothing in this attempt (it refused before its first write:
    #: another plan or round, a stale manifest, nothing staged); the driver then knows live weights are clean.
    wrote: bool = True
    #: A prepare's answer: the trainer streams this version, so the source writes while it stages (what makes a
    #: live round under ``transfer.pause: overlap`` pause its engines through staging).
    streamed: bool = False
