"""Trainer rank 0 in broadcast mode, as the round driver's ``SourceControl``.

``BroadcastSource(plan, manifests, engines)`` checks the manifests of every target against the plan
(as a p2p source does, with rank 0 serving all of them), then :meth:`connect` forms the group: it asks
every engine to join (its adapter's ``join_broadcast``) while it joins as group rank 0. The trainer
stages full tensors (:meth:`stage`, references, not copies: leave them unchanged until the round is
settled). How the engines take a round is their adapter's to say (``EngineAdapter.broadcast``), never a
branch on the engine kind here. Each :meth:`publish` (one attempt of a round):

1. refuses, with nothing sent and the group intact, unless every full tensor the targets need is staged;
2. sends, while a helper thread computes every target's checksums from the same tensors, as its manifest
   names them (:mod:`weightsync_agent.modes.broadcast.checksums`):

   - ``weightsync-buckets`` (the reference engine): arms every engine for the version (``arm_broadcast``),
     so a retry in the same round is received again (an engine that cannot be armed fails the attempt,
     naming it), then broadcasts the full tensors in weightsync's buckets (``transport/collective.py``);
   - ``announced-tensors`` (stock SGLang and vLLM): per chunk of whole tensors up to the bucket size, tells every
     engine the chunk's names, dtypes and shapes (``receive_broadcast``, which blocks while the engine
     receives and loads) while broadcasting each tensor once, in that order, over a torch custom process
     group (``transport/custom_group.py``, SGLang) or a raw NCCL group met by an ``ncclUniqueId``
     (``transport/nccl_uid_group.py``, vLLM; ``groups.py`` picks); the first engine that refuses or fails ends
     the attempt;
3. reports those checksums for every target: the engines verify what they cut against them and only
   then may commit, exactly as in p2p mode.

Every collective is bounded by the plan's ``timeoutSeconds`` and the round's deadline is checked
between buckets. After a failure in step 2 the group is out of step: this side closes it (so peers
blocked in a collective fail at once instead of at the timeout), asks the engines to leave it
(``leave_broadcast``, best effort), names the engines that no longer answer, and refuses until
:meth:`connect` runs again, which forms a group under a new name. Use it with ``RoundDriver(broadcast_round_plan(plan),
engines, {0: source})``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, as_completed, wait
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from weightsync.plan import Plan, Target
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.modes.broadcast.checksums import target_checksums
from weightsync_agent.modes.broadcast.groups import AnnouncedGroup, SenderGroup, sender_group
from weightsync_agent.modes.broadcast.layout import SENDER, BroadcastLayout, Receivers, broadcast_round_plan
from weightsync_agent.source.report import SourceReport
from weightsync_agent.source.writer import SourceConfigError, validate
from weightsync_agent.targets.adapter import BroadcastReception, EngineAdapter, FullTensor
from weightsync_agent.transport.base import TransportError
from weightsync_agent.transport.collective import BroadcastGroup

log = logging.getLogger("weightsync.agent.broadcast")

MiB = 1 << 20


class BroadcastStageError(ValueError):
    """A staged tensor no target uses, or with the wrong shape or dtype; nothing was staged."""


class EngineRefusedError(TransportError):
    """An engine refused or failed its part of an attempt (it answered, so it is named)."""

    def __init__(self, engine: int, message: str) -> None:
        super().__init__(message)
        self.engine = engine


class BroadcastSource:
    source = SENDER

    def __init__(
        self,
        plan: Plan,
        manifests: Mapping[Target, Manifest],
        engines: Mapping[int, EngineAdapter],
        *,
        bucket_bytes: int | None = None,
        receivers: Receivers | None = None,
        call_timeout: float = 10.0,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        try:
            self.round_plan = broadcast_round_plan(plan)
        except ValueError as exc:
            raise SourceConfigError(str(exc)) from exc
        self.targets = validate(self.round_plan, SENDER, manifests)
        missing_engines = sorted(set(range(plan.layout.engines)) - set(engines))
        if missing_engines:
            raise SourceConfigError(f"broadcast needs every engine's client; missing {missing_engines}")
        self.plan = plan
        self.manifests = {t: manifests[t] for t in self.targets}
        self.engines = dict(engines)
        receptions = {adapter.broadcast for adapter in self.engines.values()}
        if len(receptions) != 1:
            raise SourceConfigError(
                f"the engines take broadcast rounds in different ways: {sorted(map(str, receptions))}"
            )
        self.reception: BroadcastReception = receptions.pop()
        self.layout = BroadcastLayout.of(plan.layout, receivers or self.reception.receivers)
        self.bucket_bytes = bucket_bytes or plan.transfer.bucket_bytes
        self.timeout_seconds = plan.transfer.timeouts.collective
        self.call_timeout = call_timeout
        self.progress = progress
        # Every full tensor any target cuts from, with the one shape and dtype validate() made sure of.
        self.expected: dict[str, tuple[tuple[int, ...], str]] = {}
        for target in self.targets:
            for entry in self.manifests[target].tensors:
                for part in entry.parts:
                    self.expected.setdefault(part.source, (part.full_shape, entry.dtype))
        self.staged: dict[str, torch.Tensor] = {}
        self.group: SenderGroup | None = None
        self.group_name: str | None = None  # the group the engines joined, for leave_broadcast
        self.lost: str | None = None  # why the last group was torn down, for the rounds that follow
        self._checksums: tuple[int, Future[dict[Target, list[str]]]] | None = None
        self._generation = 0
        # Per engine a join, arm or receive, plus this side's own join or sends and the checksums.
        self._pool = ThreadPoolExecutor(max_workers=max(4, len(self.engines) + 3), thread_name_prefix="broadcast")

    @property
    def announced(self) -> bool:
        return self.reception.framing == "announced-tensors"

    # --- The group -------------------------------------------------------------------------------------

    def connect(self, init_method: str, *, backend: str = "auto", receivers: Receivers | None = None) -> None:
        """(Re)form the group: every engine joins while this side joins as the sender. Raises TransportError.

        ``receivers`` switches between one member per engine and one per engine rank for this group.
        """
        self.disconnect()
        if receivers is not None:
            self.layout = BroadcastLayout.of(self.plan.layout, receivers)
        timeout = self.timeout_seconds
        world = self.layout.world_size
        # A fresh name per group: an engine that still holds an earlier one (a leave that never arrived) can join.
        name = f"weightsync-{uuid.uuid4().hex[:12]}"
        told, backend, form = sender_group(self.reception, world, init_method, name, backend, timeout)
        joins = {
            self._pool.submit(
                self.engines[engine].join_broadcast,
                told,
                world,
                [m.as_json() for m in members],
                backend,
                timeout,
                name,
            ): engine
            for engine, members in self.layout.members.items()
        }
        self.group_name = name
        own: Future[SenderGroup] = self._pool.submit(form)
        try:
            for future in as_completed(joins):
                try:
                    future.result()
                except HttpCallError as exc:
                    raise TransportError(f"engine {joins[future]} could not join the broadcast group: {exc}") from exc
            self.group = own.result(timeout=timeout)
            self.lost = None
        except BaseException:
            own.add_done_callback(_close_group)  # it may still form later; nobody will use it
            raise
        log.info("broadcast group formed: %d receivers via %s", self.layout.receivers, init_method)

    def disconnect(self, why: str = "disconnected") -> None:
        self.lost = why
        group, self.group = self.group, None
        if group is not None:
            group.close()  # first: receivers still in a collective with this side fail now
        name, self.group_name = self.group_name, None
        if name is not None and self.announced:
            timeout = min(self.call_timeout, 5.0)
            leaves = [self._pool.submit(a.leave_broadcast, name, timeout) for a in self.engines.values()]
            done, _ = wait(leaves, timeout=timeout + 1.0)
            for future in done:
                if future.exception() is not None:  # best effort: the next group has another name
                    log.info("broadcast group %s: an engine did not leave: %s", name, future.exception())

    # --- Staging ---------------------------------------------------------------------------------------

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a reference to the full tensor ``name`` for the next publish (it must stay unchanged)."""
        expected = self.expected.get(name)
        if expected is None:
            raise BroadcastStageError(f"no target is cut from {name!r}; check the trainer's tensor names")
        shape, dtype = expected
        actual_dtype = str(tensor.dtype).removeprefix("torch.")
        if tuple(tensor.shape) != shape or actual_dtype != dtype:
            raise BroadcastStageError(
                f"{name}: staged as {list(tensor.shape)} {actual_dtype}, the targets expect {list(shape)} {dtype}"
            )
        self.staged[name] = tensor
        self._generation += 1

    def stage_many(self, tensors: Mapping[str, torch.Tensor]) -> None:
        unknown = sorted(set(tensors) - set(self.expected))
        if unknown:
            raise BroadcastStageError(f"no target is cut from {unknown[:5]}; nothing was staged")
        for name, tensor in tensors.items():
            self.stage(name, tensor)

    def missing(self) -> list[str]:
        return [name for name in self.expected if name not in self.staged]

    def reset(self) -> None:
        """Forget the staged tensors (after a committed round: the next version must stage everything)."""
        self.staged.clear()
        self._generation += 1

    # --- Publishing ------------------------------------------------------------------------------------

    def prepare(self, version: int, deadline: float) -> SourceReport:
        missing = self.missing()
        if missing:
            return SourceReport(
                source=self.source, ok=False, error=f"{len(missing)} full tensor(s) not staged, e.g. {missing[0]}"
            )
        return SourceReport(source=self.source, ok=True)

    def publish(self, version: int, deadline: float, *, round_id: str | None = None) -> SourceReport:
        """``round_id``: the coordinator's round, named when arming each engine (which refuses another round's)."""
        started = time.monotonic()
        group = self.group
        if group is None or group.broken is not None:
            why = f"not connected ({self.lost})" if group is None else f"the group is broken ({group.broken})"
            return self._failed(f"{why}; call connect() before the next round", started)
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            return self._failed(
                f"refusing to broadcast version {version}: {len(missing)} full tensor(s) not staged: {shown} "
                "(nothing was sent)",
                started,
            )
        checksums = self._checksums_for_staged()
        try:
            if not isinstance(group, BroadcastGroup):
                nbytes = self._send_announced(group, version, deadline)
            else:
                refused = self._arm(version, deadline, round_id)
                if refused is not None:
                    engine, why = refused
                    error = f"engine {engine} could not be armed for version {version}: {why}"
                    self.disconnect(error)  # armed engines wait for a header that will never come: release them now
                    return self._failed(error, started, engine)
                stats = group.broadcast_buckets(
                    ((name, self.staged[name]) for name in self.expected),
                    self.bucket_bytes,
                    version=version,
                    deadline=deadline,
                    progress=self.progress,
                )
                nbytes = stats.nbytes
        except EngineRefusedError as exc:
            self.disconnect(str(exc))  # the others may still be in a collective with us: release them now
            return self._failed(str(exc), started, exc.engine)
        except TransportError as exc:
            self.disconnect(str(exc))  # peers still in a collective with us fail now, not at the timeout
            silent = self._silent_engines()
            named = ", ".join(f"engine {e}" for e in silent)
            error = f"{exc}; no answer from {named}" if silent else str(exc)
            self.lost = error
            return self._failed(error, started, silent[0] if silent else None)
        try:
            digests = checksums.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            return self._failed("checksums were not ready before the round's deadline", started)
        return SourceReport(
            source=SENDER,
            ok=True,
            checksums=digests,
            bytes=nbytes * self.layout.receivers,
            seconds=time.monotonic() - started,
        )

    def _chunks(self) -> Iterator[list[str]]:
        """Whole full tensors, in order, up to ``bucket_bytes`` per chunk (a larger tensor goes alone)."""
        chunk: list[str] = []
        used = 0
        for name in self.expected:
            tensor = self.staged[name]
            nbytes = tensor.numel() * tensor.element_size()
            if chunk and used + nbytes > self.bucket_bytes:
                yield chunk
                chunk, used = [], 0
            chunk.append(name)
            used += nbytes
        if chunk:
            yield chunk

    def _send_announced(self, group: AnnouncedGroup, version: int, deadline: float) -> int:
        """``announced-tensors``: per chunk, every engine is told the tensors while they go out, in that order."""
        sent = 0
        for index, chunk in enumerate(self._chunks()):
            tensors = [FullTensor(name, self.expected[name][1], self.expected[name][0]) for name in chunk]
            left = max(0.1, deadline - time.monotonic())
            receiving = {
                self._pool.submit(adapter.receive_broadcast, version, tensors, group.group_name, left): engine
                for engine, adapter in self.engines.items()
            }
            sending = self._pool.submit(group.broadcast, [(name, self.staged[name]) for name in chunk], deadline)
            pending: set[Future[object]] = {*receiving, sending}  # type: ignore[arg-type]
            while pending:
                done, pending = wait(
                    pending, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED
                )
                if not done:
                    raise TransportError(
                        f"chunk {index} of version {version} was not loaded before the round's deadline"
                    )
                for future in done:
                    if future is sending:
                        sent += int(future.result())  # type: ignore[call-overload]  # raises TransportError
                        continue
                    engine = receiving[future]  # type: ignore[index]
                    try:
                        future.result()
                    except HttpCallError as exc:
                        raise EngineRefusedError(
                            engine, f"engine {engine} did not load chunk {index} of version {version}: {exc}"
                        ) from exc
            if self.progress is not None:
                self.progress(index, sum(t.numel() * t.element_size() for t in (self.staged[n] for n in chunk)))
        return sent

    def _arm(self, version: int, deadline: float, round_id: str | None) -> tuple[int, str] | None:
        timeout = max(0.1, min(self.call_timeout, deadline - time.monotonic()))
        arms = {
            engine: self._pool.submit(adapter.arm_broadcast, version, timeout, round_id=round_id)
            for engine, adapter in self.engines.items()
        }
        for engine, future in arms.items():
            try:
                future.result()
            except HttpCallError as exc:
                return engine, str(exc)
        return None

    def _checksums_for_staged(self) -> Future[dict[Target, list[str]]]:
        """Every target's digests for what is staged now, computed once per staged generation and layout."""
        if self._checksums is None or self._checksums[0] != self._generation:
            staged = dict(self.staged)
            self._checksums = (self._generation, self._pool.submit(self._compute_checksums, staged))
        return self._checksums[1]

    def _compute_checksums(self, staged: Mapping[str, torch.Tensor]) -> dict[Target, list[str]]:
        by_layout: dict[tuple[str, str], list[str]] = {}
        out: dict[Target, list[str]] = {}
        for target in self.targets:
            manifest = self.manifests[target]
            key = (manifest.layout_fingerprint, manifest.checksum)
            if key not in by_layout:
                by_layout[key] = target_checksums(manifest, staged, self.bucket_bytes)
            out[target] = by_layout[key]
        return out

    def _silent_engines(self) -> list[int]:
        """Engines whose HTTP server no longer answers (the usual reason a collective fails)."""
        probes = {engine: self._pool.submit(adapter.healthy, 2.0) for engine, adapter in self.engines.items()}
        silent = []
        for engine, future in probes.items():
            try:
                future.result()
            except HttpCallError:
                silent.append(engine)
        return silent

    def _failed(self, error: str, started: float, engine: int | None = None) -> SourceReport:
        log.warning("broadcast source: %s", error)
        return SourceReport(
            source=SENDER,
            ok=False,
            error=error,
            failed_target=None if engine is None else (engine, 0),
            seconds=time.monotonic() - started,
        )

    def close(self) -> None:
        self.disconnect()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> BroadcastSource:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _close_group(future: Future[SenderGroup]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()
