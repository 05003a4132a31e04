"""A source (one trainer rank) writing its staged replica(s) into its planned targets.

``Source(transport, plan, source_rank, manifests, bucket_bytes)`` checks everything it can before any
byte moves: the manifests cover exactly this source's planned targets, each manifest is the target it
is filed under, targets holding the same engine rank publish the same layout, every full tensor is
expected with one shape and dtype, and targets that share a transfer session don't overlap in memory.
It then builds (or adopts) one replica per distinct layout and registers each replica buffer with the
transport once.

:meth:`Source.publish` sends bucket after bucket to every target at once (all submissions are
non-blocking), keeps at most ``max_inflight`` buckets outstanding per target, and hashes each bucket
of the replica while the transfers run. A target that fails is dropped from the rest of the publish and
named, with the bucket and the transport's words, in the result; the other targets carry on (each
target has its own window, so a stalled peer holds back only itself). Nothing waits past the deadline:
the loop polls every in-flight transfer without blocking (sleeping between polls, as
:func:`~weightsync_agent.transport.base.wait_all` does, so the transport's I/O threads get the core) and
aborts whatever is still owed when the deadline passes. The replica is only read, so a retry resends
the same bytes; staging flags are reset by the caller once the version is committed (see
:mod:`weightsync_agent.client.trainer`).

**Fencing late writes.** A publish returns (and so reports a failure) only once every write it submitted
has settled: the writes of a failed target's window, of a half-submitted bucket and of targets cut off by
the deadline are polled until the transport calls them DONE or FAILED, which it does within its own
timeout of the peer's last progress. Only then may the caller abort, retry or restage, so a write of an
aborted attempt cannot land on top of a later attempt's verified bytes. If a transport keeps a write
pending beyond ``settle_timeout`` past the deadline, the next publish waits for it (until its own
deadline) and otherwise refuses with ReplicaBusyError. docs/replica.md ("Fencing") has the reasoning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol

from weightsync.api.pause import round_schedule
from weightsync.plan import Plan, Target
from weightsync_agent.layout.buckets import Bucket, plan_buckets
from weightsync_agent.layout.checksums import source_checksum, tensor_jobs
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.source.replica import IncompleteReplicaError, Replica, ReplicaBusyError, ReplicaSet
from weightsync_agent.source.report import SourceReport, Throughput
from weightsync_agent.source.stream import Gate, StreamGate
from weightsync_agent.transport.base import Transfer, TransferState, Transport, TransportError

log = logging.getLogger("weightsync.agent.source")

MiB = 1 << 20
#: Most threads hashing one source's buckets (2 sources on a 32-core H100 host: 16 each measured best).
HASH_THREADS = 16
#: A streamed publish waits at most this long, in all, for bucket digests the trainer's process is still computing
#: (one bucket takes bucket_bytes / ~25 GB/s: 40 ms for 1 GiB); past it, or if that process died, it hashes them.
DIGEST_WAIT_SECONDS = 1.0


class SourceConfigError(ValueError):
    """The source's plan, manifests or replicas don't fit together; raised before any byte moves."""


FailureKind = Literal["transport", "submit", "deadline", "stream"]


@dataclass(frozen=True)
class PublishFailure:
    """Why a target did not receive a version: which target, which bucket, what the transport said."""

    kind: FailureKind
    target: Target
    session_id: str
    bucket: int
    buckets: int
    detail: str

    def __str__(self) -> str:
        engine, rank = self.target
        return (
            f"target engine {engine} rank {rank} ({self.session_id}), bucket {self.bucket} of "
            f"{self.buckets}: {self.kind}: {self.detail}"
        )


@dataclass
class TargetReport:
    """One target's side of a publish. ``checksums[i]`` is what the target must find in bucket ``i``."""

    target: Target
    session_id: str
    fingerprint: str
    buckets: int
    checksums: list[str] = field(default_factory=list)
    written: int = 0  # buckets the transport confirmed
    bytes: int = 0
    failure: PublishFailure | None = None
    seconds: float | None = None  # after the publish began, when this target was done (confirmed or failed)

    @property
    def ok(self) -> bool:
        return self.failure is None and self.written == self.buckets


@dataclass
class PublishResult:
    version: int
    source: int
    bucket_bytes: int
    targets: dict[Target, TargetReport]
    failures: list[PublishFailure] = field(default_factory=list)
    aborted: bool = False  # the deadline stopped the publish
    bytes: int = 0  # confirmed written, summed over targets
    seconds: float = 0.0
    checksum_seconds: float = 0.0
    #: Buckets whose checksum staging had already computed (no second pass over the replica), and those hashed here.
    digests_reused: int = 0
    digests_hashed: int = 0
    # Fencing: time spent after the last useful work waiting for abandoned writes to settle, and how many
    # were still pending when the publish stopped waiting (the next publish waits for those first).
    settle_seconds: float = 0.0
    unsettled: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures and all(r.ok for r in self.targets.values())

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        done = sum(r.ok for r in self.targets.values())
        head = (
            f"source {self.source} v{self.version}: {done}/{len(self.targets)} targets, "
            f"{self.bytes} B in {self.seconds:.3f} s ({self.gbps:.2f} GB/s)"
        )
        if self.ok:
            return head
        tail = "; ".join(str(f) for f in self.failures[:4])
        more = f" (+{len(self.failures) - 4} more)" if len(self.failures) > 4 else ""
        return f"{head}{' ABORTED at deadline' if self.aborted else ''}; failed: {tail}{more}"

    def raise_for_failure(self) -> None:
        if not self.ok:
            raise PublishError(self)

    def to_report(self) -> SourceReport:
        """The round protocol's view (:class:`weightsync_agent.rounds.driver.SourceReport`)."""
        first = self.failures[0] if self.failures else None
        return SourceReport(
            source=self.source,
            ok=self.ok,
            checksums={t: tuple(r.checksums) for t, r in self.targets.items() if r.ok},
            bytes=self.bytes,
            seconds=self.seconds,
            error=None if self.ok else self.summary(),
            failed_target=first.target if first else None,
            failed_bucket=first.bucket if first else None,
            targets={
                t: Throughput(r.bytes, self.seconds if r.seconds is None else r.seconds)
                for t, r in self.targets.items()
                if r.bytes
            },
        )


class Outcome(Protocol):
    """What a publish returns: a source's :class:`PublishResult`, or a whole round's outcome."""

    @property
    def ok(self) -> bool: ...

    def summary(self) -> str: ...


class PublishError(RuntimeError):
    """A version did not land (or was not committed); ``result`` says where and why."""

    def __init__(self, result: Outcome) -> None:
        super().__init__(result.summary())
        self.result = result


@dataclass
class _Send:
    """One bucket in flight to one target."""

    bucket: Bucket
    transfers: list[Transfer]


class Source:
    """One trainer rank's sender. ``manifests`` maps each planned ``(engine, rank)`` to its manifest."""

    def __init__(
        self,
        transport: Transport,
        plan: Plan,
        source_rank: int,
        manifests: Mapping[Target, Manifest],
        bucket_bytes: int | None = None,
        *,
        replicas: ReplicaSet | None = None,
        shm_dir: str | None = None,
        pin: bool | None = None,
        max_inflight: int = 2,
        poll_interval: float = 0.001,
        settle_timeout: float | None = None,
    ) -> None:
        self._hash_pool: ThreadPoolExecutor | None = None
        self.transport = transport
        self.plan = plan
        self.source = source_rank
        #: Hash every bucket for the targets to verify (the plan's ``transfer.verify``); without it a
        #: publish moves bytes at the transport's speed and the round skips verification.
        self.checksums = plan.transfer.verify
        self.bucket_bytes = plan.transfer.bucket_bytes if bucket_bytes is None else bucket_bytes
        if self.bucket_bytes <= 0:
            raise SourceConfigError(f"bucket size must be positive, got {self.bucket_bytes}")
        if max_inflight < 1:
            raise SourceConfigError(f"max_inflight must be at least 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self.poll_interval = poll_interval
        # How long past its deadline a publish waits for abandoned writes to settle. Transports fail a write
        # whose peer made no progress for their timeout, so that timeout plus a margin is enough.
        self.settle_timeout = (
            float(getattr(transport, "timeout_seconds", 30.0)) + 1.0 if settle_timeout is None else settle_timeout
        )
        self._publish_lock = threading.Lock()
        self._unsettled: list[tuple[Target, Transfer]] = []  # writes an earlier publish gave up waiting for
        self.manifests: dict[Target, Manifest] = dict(manifests)
        self.targets: tuple[Target, ...] = validate(plan, source_rank, self.manifests)
        fingerprints = {m.layout_fingerprint for m in self.manifests.values()}
        self._owns_replicas = replicas is None
        if replicas is None:
            replicas = ReplicaSet.for_manifests(
                (self.manifests[t] for t in self.targets),
                shm_dir=shm_dir,
                pin=pin,
                digest_grain=digest_grain(self.checksums, self.bucket_bytes, self.manifests.values()),
            )
        elif set(replicas.replicas) != fingerprints:
            raise SourceConfigError(
                f"replicas hold layouts {sorted(replicas.replicas)}, the targets need {sorted(fingerprints)}"
            )
        self.replicas = replicas
        self.buckets: dict[Target, list[Bucket]] = {
            t: plan_buckets(self.manifests[t], self.bucket_bytes) for t in self.targets
        }
        # Bucket i is the replica range [i·bucket_bytes, +nbytes): the replica packs tensors as the planner cuts
        # them. Streaming (which parts a bucket waits for) and staging's digests rely on it.
        self._bucket_slots: dict[tuple[str, int], tuple[int, ...]] = {}
        for target in self.targets:
            fingerprint = self.manifests[target].layout_fingerprint
            for bucket in self.buckets[target]:
                start = bucket.index * self.bucket_bytes
                if bucket.pieces and bucket.pieces[0].replica_offset != start:
                    raise SourceConfigError(f"bucket {bucket.index} of {target} does not start at replica byte {start}")
                self._bucket_slots[(fingerprint, bucket.index)] = self.replicas[fingerprint].layout.slots_in(
                    start, start + bucket.nbytes
                )
        self._registered: list[int] = []
        try:
            for replica in self.replicas:
                transport.register(replica.address, replica.buffer.numel())
                self._registered.append(replica.address)
        except BaseException:
            self.close()
            raise
        self.last_result: PublishResult | None = None

    # --- Queries ---------------------------------------------------------------------------------

    def replica_for(self, target: Target) -> Replica:
        return self.replicas[self.manifests[target].layout_fingerprint]

    def bucket_ready(self, target: Target, index: int) -> bool:
        """Whether every part bucket ``index`` of ``target`` overlaps is staged (so its bytes are final)."""
        fingerprint = self.manifests[target].layout_fingerprint
        return self.replicas[fingerprint].staged(self._bucket_slots[(fingerprint, index)])

    def staged_digest(self, target: Target, index: int, *, until: float | None = None) -> str | None:
        """Bucket ``index``'s checksum as staging computed it, if the replica's digest grain is this bucket size
        (waiting until ``until`` for one the trainer's process is still computing)."""
        replica = self.replica_for(target)
        if replica.digest_grain != self.bucket_bytes or self.manifests[target].checksum != "bucket-xxh3":
            return None
        return replica.digest(index, until=until)

    @property
    def bytes_per_version(self) -> int:
        """Bytes one publish moves: every target's full shard."""
        return sum(self.manifests[t].total_bytes for t in self.targets)

    # --- Publishing ------------------------------------------------------------------------------

    def publish(
        self,
        version: int,
        deadline: float | None = None,
        *,
        timeout: float | None = None,
        targets: Collection[Target] | None = None,
        require_staged: bool = True,
        stream: Gate | None = None,
    ) -> PublishResult:
        """Write the staged replica(s) to every target of this source (or only to ``targets``).

        ``deadline`` is a ``time.monotonic()`` instant; otherwise ``timeout`` seconds from now, else the
        plan's ``timeoutSeconds``. Raises :class:`IncompleteReplicaError` (nothing written) if any part
        is not staged, and ReplicaBusyError if the replica is being staged or sent elsewhere. Transport
        failures and the deadline don't raise: they are in the result (``ok`` is False).

        ``require_staged=False`` sends what the replica holds whatever its staged flags say: for a
        catch-up of a joining engine, when the caller knows the replica still holds a committed version.

        ``stream``: the trainer is still staging this version (:mod:`weightsync_agent.source.stream`); each
        target's next bucket goes out once its parts are staged, and the publish waits for the rest until the
        gate closes (then a bucket still incomplete fails it), aborts, or the deadline passes.
        """
        start = time.monotonic()
        if deadline is None:
            deadline = start + (self.plan.transfer.timeouts.round_budget if timeout is None else timeout)
        chosen = self.targets
        if targets is not None:
            unknown = set(targets) - set(self.targets)
            if unknown:
                raise SourceConfigError(
                    f"source {self.source} does not serve {sorted(unknown)}; its targets are {list(self.targets)}"
                )
            chosen = tuple(t for t in self.targets if t in set(targets))
        guard = self.replicas.publishing() if stream is None else self.replicas.streaming()
        with self._fenced(version, deadline), guard:
            missing = self.replicas.missing() if require_staged and stream is None else []
            if missing:
                shown = ", ".join(str(m) for m in missing[:5])
                more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                raise IncompleteReplicaError(
                    f"refusing to publish version {version}: {len(missing)} tensor part(s) missing from the "
                    f"replica: {shown}{more}; stage them first (nothing was written)"
                )
            run = _Run(self, version, deadline, self.poll_interval, chosen, stream)
            result = run.run()
            self._unsettled = run.unsettled
        result.seconds = time.monotonic() - start
        self.last_result = result
        (log.info if result.ok else log.warning)("%s", result.summary())
        return result

    @contextlib.contextmanager
    def _fenced(self, version: int, deadline: float) -> Iterator[None]:
        """One publish at a time, and none while a write of an earlier one may still land.

        A publish normally returns with all its writes settled; if one gave up waiting (a transport
        that kept a write pending past ``settle_timeout``), this waits for those writes until
        ``deadline``, then refuses. Nothing is written before that.
        """
        if not self._publish_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ReplicaBusyError(
                f"source {self.source}: an earlier publish is still settling its writes; version {version} was "
                "not sent (nothing was written)"
            )
        try:
            self._unsettled = _settle(self._unsettled, deadline, self.poll_interval)
            if self._unsettled:
                targets = sorted({target for target, _ in self._unsettled})
                raise ReplicaBusyError(
                    f"source {self.source}: {len(self._unsettled)} write(s) of an earlier publish to {targets} may "
                    f"still land; version {version} was not sent (nothing was written)"
                )
            yield
        finally:
            self._publish_lock.release()

    def hash_pool(self) -> ThreadPoolExecutor:
        """Threads hashing buckets while they are written (xxhash releases the GIL); made on first use."""
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(
                max_workers=min(HASH_THREADS, os.cpu_count() or 1), thread_name_prefix=f"hash-source-{self.source}"
            )
        return self._hash_pool

    def close(self) -> None:
        """Unregister the replica buffers; release the replicas too if this Source created them.

        Replicas passed in (``replicas=``) belong to the caller. A shared-memory file is never removed
        here: another process may have it mapped.
        """
        if self._hash_pool is not None:
            self._hash_pool.shutdown(wait=True)
            self._hash_pool = None
        while self._registered:
            address = self._registered.pop()
            try:
                self.transport.unregister(address)
            except TransportError as exc:
                log.warning("unregistering replica at %#x: %s", address, exc)
        if self._owns_replicas:
            self.replicas.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class InProcessSourceControl:
    """A :class:`Source` in this process as the round driver's ``SourceControl``.

    Refusals that :meth:`Source.publish` raises (incomplete or busy replica) become a failed report,
    so the coordinator names this source instead of crashing.
    """

    def __init__(self, sender: Source) -> None:
        self.sender = sender
        self.source = sender.source
        self.gate: StreamGate | None = None

    def stream(self, gate: StreamGate | None) -> None:
        """The trainer streams ``gate.version``: prepare waits for each target's first bucket (or, under
        ``transfer.pause: minimal`` into live targets, for every bucket), publish sends what is staged while the
        trainer stages the rest (None: back to stage-all-then-publish)."""
        self.gate = gate

    def _streaming(self, version: int) -> StreamGate | None:
        return self.gate if self.gate is not None and self.gate.version == version else None

    def prepare(self, version: int, deadline: float) -> SourceReport:
        gate = self._streaming(version)
        if gate is not None:
            return self._streamed_ready(gate, deadline)
        missing = self.sender.replicas.missing()
        if missing:
            error = f"{len(missing)} part(s) not staged for {version}, e.g. {missing[0]}"
            return SourceReport(source=self.source, ok=False, error=error)
        return SourceReport(source=self.source, ok=True)

    def _streamed_ready(self, gate: StreamGate, deadline: float) -> SourceReport:
        transfer = self.sender.plan.transfer
        schedule = round_schedule(transfer.target_staging, transfer.pause)
        error = streamed_ready(self.sender, gate, deadline, write_while_staging=schedule.write_while_staging)
        return SourceReport(source=self.source, ok=error is None, error=error, streamed=True)

    def publish(self, version: int, deadline: float) -> SourceReport:
        gate = self._streaming(version)
        if gate is not None and gate.state == "aborted":  # a retry after the trainer gave up: nothing to send
            error = f"the trainer aborted the stream of {version}: {gate.reason}"
            return SourceReport(source=self.source, ok=False, error=error, wrote=False)
        try:
            return self.sender.publish(version, deadline, stream=gate).to_report()
        except (IncompleteReplicaError, ReplicaBusyError) as exc:
            return SourceReport(source=self.source, ok=False, error=str(exc))


class _Run:
    """The state of one publish: a pipeline per target, all advanced together by one polling loop.

    Each live target keeps up to ``max_inflight`` buckets submitted; as soon as its oldest bucket is
    confirmed the next is submitted, so a slow or stalled target holds back only itself. Checksums are
    computed by a thread pool while the transfers run (xxhash releases the GIL), once per (layout,
    bucket) since targets sharing a layout share the replica bytes.
    """

    def __init__(
        self,
        source: Source,
        version: int,
        deadline: float,
        poll_interval: float = 0.001,
        targets: tuple[Target, ...] | None = None,
        stream: Gate | None = None,
    ) -> None:
        self.source = source
        self.stream = stream
        self.targets = source.targets if targets is None else targets
        self.transport = source.transport
        self.deadline = deadline
        self.poll_interval = poll_interval
        self.result = PublishResult(
            version=version,
            source=source.source,
            bucket_bytes=source.bucket_bytes,
            targets={
                t: TargetReport(
                    t, source.manifests[t].session_id, source.manifests[t].layout_fingerprint, len(source.buckets[t])
                )
                for t in self.targets
            },
        )
        self._hashing: dict[tuple[str, int], Future[str] | str] = {}
        self._tensor_hashing: dict[tuple[str, str], list[Future[str]]] = {}  # (layout, scheme) -> per tensor
        self._queues: dict[Target, deque[_Send]] = {t: deque() for t in self.targets}
        self._next: dict[Target, int] = dict.fromkeys(self.targets, 0)
        self.started = time.monotonic()
        self._draining: list[tuple[Target, Transfer]] = []  # given up on for the result, maybe still moving
        self.unsettled: list[tuple[Target, Transfer]] = []  # still moving when settling gave up

    def run(self) -> PublishResult:
        """Send, then settle: the result is returned only once no write this run submitted can still land."""
        self._start_hashing()
        try:
            self._send()
            self._settle_abandoned()
        finally:
            self._collect_hashes()
        return self.result

    def _start_hashing(self) -> None:
        """Hash every bucket the targets will get, in parallel and ahead of the writes.

        Checksums depend only on the replica, which is locked read-only for the whole publish, so they
        need not wait for submission. One job per (layout, bucket): targets sharing a layout share the
        bytes. Measured on an H100 host: hashing inline on one thread capped a publish at 0.16 of the
        transport's speed (docs/gpu.md).
        """
        if not self.source.checksums or self.stream is not None:
            return  # a stream's buckets are not final yet: resolved once sent (_collect_hashes)
        pool = self.source.hash_pool()
        for target in self.targets:
            fingerprint = self.result.targets[target].fingerprint
            address = self.source.replica_for(target).address
            manifest = self.source.manifests[target]
            if manifest.checksum != "bucket-xxh3":  # the engine's own hash, one job per tensor
                layout = (fingerprint, manifest.checksum)
                if layout not in self._tensor_hashing:
                    self._tensor_hashing[layout] = [pool.submit(job) for job in tensor_jobs(manifest, address)]
                continue
            for bucket in self.source.buckets[target]:
                self._checksum_job(target, bucket, address)

    def _checksum_job(self, target: Target, bucket: Bucket, address: int, until: float | None = None) -> None:
        """The digest staging filed for this bucket, else a hashing job; once per (layout, bucket)."""
        key = (self.result.targets[target].fingerprint, bucket.index)
        if key in self._hashing:
            return
        staged = self.source.staged_digest(target, bucket.index, until=until)
        if staged is not None:
            self._hashing[key] = staged
            self.result.digests_reused += 1
        else:
            self._hashing[key] = self.source.hash_pool().submit(source_checksum, bucket, address)
            self.result.digests_hashed += 1

    def _collect_hashes(self) -> None:
        if self.stream is not None and self.source.checksums:
            self._start_stream_hashing()
        if not self._hashing and not self._tensor_hashing:
            return
        began = time.monotonic()
        for target in self.targets:
            report = self.result.targets[target]
            scheme = self.source.manifests[target].checksum
            if scheme != "bucket-xxh3":
                report.checksums = [f.result() for f in self._tensor_hashing[(report.fingerprint, scheme)]]
                continue
            sent = self._next[target]  # buckets submitted; a failed target's list stops where it stopped
            report.checksums = [
                _resolved(self._hashing[(report.fingerprint, b.index)]) for b in self.source.buckets[target][:sent]
            ]
        self.result.checksum_seconds = time.monotonic() - began

    def _start_stream_hashing(self) -> None:
        """A stream's checksums, once its buckets went out (each was final when sent: no part is staged twice in a
        stream). Staging filed most of them already; the rest are hashed now, in parallel.

        Through the sidecar, the trainer's process may still be hashing the last buckets it staged: those are
        waited for, all together at most ``DIGEST_WAIT_SECONDS``, rather than read a second time."""
        until = min(self.deadline, time.monotonic() + DIGEST_WAIT_SECONDS)
        for target in self.targets:
            manifest = self.source.manifests[target]
            address = self.source.replica_for(target).address
            if manifest.checksum != "bucket-xxh3":
                layout = (self.result.targets[target].fingerprint, manifest.checksum)
                if layout not in self._tensor_hashing:
                    pool = self.source.hash_pool()
                    self._tensor_hashing[layout] = [pool.submit(job) for job in tensor_jobs(manifest, address)]
                continue
            for bucket in self.source.buckets[target][: self._next[target]]:
                self._checksum_job(target, bucket, address, until)

    def _send(self) -> None:
        while True:
            if time.monotonic() >= self.deadline:
                self._reap()  # one last look: writes may have finished while we slept
                if any(self._owed(t) for t in self.targets):
                    self._abort()
                return
            self._fill()
            if not any(self._queues.values()) and not self._awaiting_stage():
                return
            if not self._reap():
                time.sleep(self.poll_interval)

    def _awaiting_stage(self) -> bool:
        """Streaming: whether a live target waits for the trainer to stage its next bucket. Fails the targets
        that cannot get it any more (the trainer closed the stream without staging it, or aborted)."""
        if self.stream is None:
            return False
        waiting = [t for t in self.targets if self._live(t) and self._next[t] < len(self.source.buckets[t])]
        state = self.stream.state
        if state == "open" or not waiting:
            return bool(waiting)
        for target in waiting:
            index = self._next[target]
            if state == "closed" and self.source.bucket_ready(target, index):
                continue  # staged just before the close: the next _fill sends it
            if state == "aborted":
                detail = f"the trainer aborted the stream: {self.stream.reason}"
            else:
                missing = self.source.replica_for(target).missing()
                shown = ", ".join(str(m) for m in missing[:3])
                detail = f"the stream closed with {len(missing)} part(s) not staged (e.g. {shown})"
            self._fail("stream", target, index, detail)
            self._abandon(target, self._queues[target])
        return any(self._live(t) and self._next[t] < len(self.source.buckets[t]) for t in self.targets)

    # --- Pipeline ------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Top every live target's window up."""
        src = self.source
        for target in self.targets:
            queue, buckets = self._queues[target], src.buckets[target]
            while self._live(target) and len(queue) < src.max_inflight and self._next[target] < len(buckets):
                if self.stream is not None and (
                    self.stream.state == "aborted" or not src.bucket_ready(target, self._next[target])
                ):
                    break  # its parts are still being staged (or never will be: the round fails)
                bucket = buckets[self._next[target]]
                self._next[target] += 1
                transfers = self._submit(target, bucket)
                if transfers is None:
                    break
                queue.append(_Send(bucket, transfers))

    def _submit(self, target: Target, bucket: Bucket) -> list[Transfer] | None:
        src = self.source
        base = src.replica_for(target).address
        session = src.manifests[target].session_id
        transfers: list[Transfer] = []
        for piece in bucket.pieces:
            try:
                local = base + piece.replica_offset
                transfers.append(self.transport.submit_write(session, local, piece.remote_address, piece.length))
            except TransportError as exc:
                self._fail(
                    "submit", target, bucket.index, f"write of {piece.length} B to {piece.remote_address:#x}: {exc}"
                )
                self._draining.extend((target, t) for t in transfers)  # the pieces already submitted may land
                return None
        return transfers

    def _reap(self) -> bool:
        """Retire every target's confirmed head buckets; drop targets whose writes failed. Non-blocking."""
        progressed = False
        for target, queue in self._queues.items():
            while queue:
                send = queue[0]
                states = [t.poll() for t in send.transfers]
                failed = [t for t, s in zip(send.transfers, states, strict=True) if s is TransferState.FAILED]
                if failed:
                    self._fail("transport", target, send.bucket.index, self._said(failed[0], send.bucket))
                    self._abandon(target, queue)  # later buckets no longer matter, but may still land
                    progressed = True
                elif all(s is TransferState.DONE for s in states):
                    queue.popleft()
                    self._written(target, send.bucket)
                    progressed = True
                else:
                    break
        return progressed

    def _abort(self) -> None:
        """The deadline passed: every live target still owed a bucket fails, naming its first unconfirmed one."""
        self.result.aborted = True
        for target, queue in self._queues.items():
            report = self.result.targets[target]
            if self._owed(target):
                if queue:
                    send = queue[0]
                    pending = sum(t.poll() is TransferState.PENDING for t in send.transfers)
                    what = f"{pending} write(s) of this {send.bucket.nbytes} B bucket still pending at the deadline"
                    index = send.bucket.index
                elif self.stream is not None:  # the bucket never became whole: its parts were still being staged
                    what, index = "not staged by the trainer before the round's deadline", report.written
                else:
                    what, index = "not submitted before the deadline", report.written
                self._fail(
                    "deadline",
                    target,
                    index,
                    f"{what}; {report.buckets - report.written} bucket(s) unconfirmed. Submitted writes may still "
                    f"land, so the target's memory is undefined until a complete publish",
                )
            self._abandon(target, queue)

    def _abandon(self, target: Target, queue: deque[_Send]) -> None:
        """Stop counting ``queue``'s buckets toward the result; keep their writes for settling."""
        self._draining.extend((target, transfer) for send in queue for transfer in send.transfers)
        queue.clear()

    def _settle_abandoned(self) -> None:
        """The fence: wait until every abandoned write is DONE or FAILED before the result is reported.

        A write the result no longer counts may still be moving. Reported early, the failure would let
        the caller abort the round, start the next attempt or restage the replica while it lands. Each
        transport fails a write whose peer made no progress for its timeout, so this ends within
        ``settle_timeout`` past the deadline; whatever is pending then is left to the next publish.
        """
        if not self._draining:
            return
        began = time.monotonic()
        until = max(self.deadline, began) + self.source.settle_timeout
        self.unsettled = _settle(self._draining, until, self.poll_interval)
        self.result.settle_seconds = time.monotonic() - began
        self.result.unsettled = len(self.unsettled)
        if self.unsettled:
            log.error(
                "source %s v%s: %d write(s) still pending %.1f s after the deadline; the next publish waits for them",
                self.result.source,
                self.result.version,
                len(self.unsettled),
                self.source.settle_timeout,
            )

    def _owed(self, target: Target) -> bool:
        report = self.result.targets[target]
        return report.failure is None and report.written < report.buckets

    # --- Bookkeeping ---------------------------------------------------------------------------

    def _live(self, target: Target) -> bool:
        return self.result.targets[target].failure is None

    def _fail(self, kind: FailureKind, target: Target, bucket: int, detail: str) -> None:
        report = self.result.targets[target]
        if report.failure is not None:
            return
        failure = PublishFailure(kind, target, report.session_id, bucket, report.buckets, detail)
        report.failure = failure
        report.seconds = time.monotonic() - self.started
        self.result.failures.append(failure)

    def _written(self, target: Target, bucket: Bucket) -> None:
        report = self.result.targets[target]
        report.written += 1
        report.bytes += bucket.nbytes
        if report.written == report.buckets:
            report.seconds = time.monotonic() - self.started
        self.result.bytes += bucket.nbytes

    @staticmethod
    def _said(transfer: Transfer, bucket: Bucket) -> str:
        said = transfer.error() or "no detail from the transport"
        return f"write of {transfer.nbytes} B in a {bucket.nbytes} B bucket failed: {said}"


def streamed_ready(
    source: Source, gate: Gate, deadline: float, *, write_while_staging: bool, targets: Collection[Target] | None = None
) -> str | None:
    """Wait until a streamed version can be written (its ``prepare``; ``weightsync.api.pause`` decides which): with
    ``write_while_staging``, until each target's first bucket is staged (nothing is paused before the first write
    needs it); otherwise until every bucket of every target is (live engines then pause for the writes alone).
    ``targets``: those the round covers (None: all). Why not, or None."""
    chosen = [t for t in source.targets if (targets is None or t in targets) and source.buckets[t]]
    # Per target, the first bucket not seen staged yet: a stream never unstages a part, so each is checked once.
    cursor = dict.fromkeys(chosen, 0)
    wanted = {t: 1 if write_while_staging else len(source.buckets[t]) for t in chosen}
    while True:
        # The stream's state is read before its parts: a trainer that stages its last part and closes the stream
        # between the two reads must not look like one that closed with parts missing (it failed a round).
        state = gate.state
        for target in chosen:
            while cursor[target] < wanted[target] and source.bucket_ready(target, cursor[target]):
                cursor[target] += 1
        if all(cursor[t] >= wanted[t] for t in chosen):
            return None
        if state == "aborted":
            return f"the trainer aborted the stream: {gate.reason}"
        if state == "closed":
            return f"the stream closed with {len(source.replicas.missing())} part(s) not staged"
        if time.monotonic() >= deadline:
            what = "no complete bucket" if write_while_staging else "not every bucket"
            return f"trainer rank {source.source} staged {what} of {gate.version} before the deadline"
        time.sleep(source.poll_interval)


def _resolved(job: Future[str] | str) -> str:
    return job if isinstance(job, str) else job.result()


def digest_grain(verify: bool, bucket_bytes: int, manifests: Collection[Manifest]) -> int:
    """The replica digest grain for these targets: the bucket size when they verify bucket digests, else 0.

    Per-tensor schemes (stock SGLang's own hash) are computed at publish time as before."""
    return bucket_bytes if verify and all(m.checksum == "bucket-xxh3" for m in manifests) else 0


def _settle(writes: list[tuple[Target, Transfer]], until: float, poll_interval: float) -> list[tuple[Target, Transfer]]:
    """Poll ``writes`` until none is pending or ``until`` (time.monotonic) passes; returns those still pending."""
    while True:
        writes = [(target, write) for target, write in writes if write.poll() is TransferState.PENDING]
        if not writes or time.monotonic() >= until:
            return writes
        time.sleep(poll_interval)


def validate(plan: Plan, source_rank: int, manifests: Mapping[Target, Manifest]) -> tuple[Target, ...]:
    """This source's targets, in plan order, after checking the manifests against the plan and each other."""
    if not 0 <= source_rank < len(plan.sources):
        raise SourceConfigError(f"plan has {len(plan.sources)} trainer ranks; this source is rank {source_rank}")
    planned = plan.sources[source_rank].targets
    if not planned:
        raise SourceConfigError(f"the plan gives source {source_rank} no targets")
    given = set(manifests)
    absent = [t for t in planned if t not in given]
    if absent:
        raise SourceConfigError(f"source {source_rank}: no manifest for planned target(s) {absent}")
    extra = sorted(given - set(planned))
    if extra:
        owners = {t: plan.source_of.get(t) for t in extra}
        raise SourceConfigError(
            f"source {source_rank}: manifests for targets it does not serve: "
            + ", ".join(
                f"{t} (plan: source {o})" if o is not None else f"{t} (not in the plan)" for t, o in owners.items()
            )
        )
    by_rank: dict[int, tuple[Target, str]] = {}
    full: dict[str, tuple[tuple[int, ...], str, str]] = {}
    for target in planned:
        manifest = manifests[target]
        if (manifest.engine, manifest.rank) != target:
            raise SourceConfigError(
                f"manifest filed under target {target} describes engine {manifest.engine} rank {manifest.rank}"
            )
        fingerprint = manifest.layout_fingerprint
        first = by_rank.setdefault(target[1], (target, fingerprint))
        if first[1] != fingerprint:
            raise SourceConfigError(
                f"engine rank {target[1]}: target {first[0]} and target {target} publish different layouts "
                f"({first[1]} vs {fingerprint}); engines holding the same rank must shard identically"
            )
        for tensor in manifest.tensors:
            for part in tensor.parts:
                seen = full.setdefault(part.source, (part.full_shape, tensor.dtype, tensor.name))
                if seen[:2] != (part.full_shape, tensor.dtype):
                    raise SourceConfigError(
                        f"full tensor {part.source!r} is expected as {list(seen[0])} {seen[1]} by {seen[2]!r} but "
                        f"as {list(part.full_shape)} {tensor.dtype} by {tensor.name!r} of target {target}"
                    )
    _check_shared_sessions(planned, manifests)
    return tuple(planned)


def _check_shared_sessions(targets: tuple[Target, ...], manifests: Mapping[Target, Manifest]) -> None:
    """Targets behind one transfer session (one engine process serving several ranks) must not overlap."""
    sessions: dict[str, list[Target]] = {}
    for target in targets:
        sessions.setdefault(manifests[target].session_id, []).append(target)
    for session, group in sessions.items():
        if len(group) < 2:
            continue
        spans = sorted((t.address, t.end, target, t.name) for target in group for t in manifests[target].tensors)
        reach = (0, (-1, -1), "")  # furthest end so far, and whose
        for start, end, target, name in spans:
            if start < reach[0] and target != reach[1]:
                raise SourceConfigError(
                    f"targets {reach[1]} and {target} share session {session} and their tensors {reach[2]!r} and "
                    f"{name!r} overlap"
                )
            if end > reach[0]:
                reach = (end, target, name)
