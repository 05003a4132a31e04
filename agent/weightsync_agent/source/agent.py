"""A trainer pod's sources inside the agent sidecar: replicas in /dev/shm, one Source per trainer rank.

The sidecar fetches its targets' manifests from the engines, creates the replica files the trainer
process attaches to (:meth:`weightsync_agent.client.trainer.WeightSyncClient.from_env`), registers them with the
transport once, and writes them when the coordinator asks.

When may a source write version v? In a regular round, only once its trainer process said v is staged
(:meth:`SourceAgent.mark_ready`; every trainer rank calls ``publish(v)``, like a collective). For a
catch-up (a joining engine gets the current version) only if the replica still holds exactly the
committed version: the coordinator told this agent v was committed (:meth:`committed`, which also
clears the staged flags) and nothing was staged since. Anything else is refused with the reason, so a
joining engine can never be handed a mix of two versions under one number.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from weightsync.api.pause import round_schedule
from weightsync.plan import Plan, Target
from weightsync_agent import metrics
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.source.control import RoundScope
from weightsync_agent.source.engine_loader import EngineLoader
from weightsync_agent.source.replica import IncompleteReplicaError, ReplicaBusyError, ReplicaError, ReplicaSet
from weightsync_agent.source.report import SourceReport
from weightsync_agent.source.stream import ReplicaGate
from weightsync_agent.source.writer import Source, SourceConfigError, streamed_ready
from weightsync_agent.transport.base import Transport

log = logging.getLogger("weightsync.agent.source")

ManifestFetcher = Callable[[int, int], Manifest]  # (engine, rank) -> manifest

#: A regular round over every engine, whatever plan the source runs.
ALL = RoundScope()
#: How long a source waits before it starts an engine replica's loader again after one failed to start.
LOADER_RETRY_SECONDS = 60.0
#: How long a round's prepare waits for the sidecar to refetch manifests it found stale (an engine restarted).
REFETCH_SECONDS = 5.0


class SourceAgent:
    """The sources of one trainer pod (``ranks``), rebuilt when the plan changes."""

    def __init__(
        self,
        group: str,
        ranks: Collection[int],
        make_transport: Callable[[], Transport],
        replica_root: Callable[[int], Path],
        *,
        pin: bool | None = None,
    ) -> None:
        self.group = group
        self.ranks = tuple(sorted(ranks))
        self.make_transport = make_transport
        self.replica_root = replica_root
        self.pin = pin
        self.plan: Plan | None = None
        self.sources: dict[int, Source] = {}
        self.transports: dict[int, Transport] = {}
        self.replicas: dict[int, ReplicaSet] = {}
        #: Per rank, the loader of each engine replica among its replicas (source/engine_loader.py).
        self.loaders: dict[int, list[EngineLoader]] = {}
        #: An engine replica whose loader failed to start (fingerprint -> when, why): not tried again for
        #: LOADER_RETRY_SECONDS (each try imports the engine and builds its model).
        self._loader_failed: dict[str, tuple[float, str]] = {}
        #: (rank, loader name) -> the version its engine replica was last loaded for.
        self._loaded_for: dict[tuple[int, str], int] = {}
        self.held: dict[int, int | None] = dict.fromkeys(self.ranks)  # committed version the replica holds
        self.ready_version: dict[int, int] = {}
        #: The round each rank last prepared (the coordinator's round id): a publish naming another is refused.
        self.prepared_round: dict[int, str] = {}
        #: Per rank, the last regular round it was asked to prepare: (round id, version, ``time.monotonic``). A rank
        #: waiting for that round's result knows it started, and when its budget ends.
        self.prepared_regular: dict[int, tuple[str, int, float]] = {}
        #: Every target manifest fetched for the plan (broadcast mode: all targets, on rank 0's pod).
        self.manifests: dict[Target, Manifest] = {}
        #: A round found an engine publishing other addresses than a manifest here (it restarted): the
        #: agent refetches every manifest and rebuilds before the next round (sidecar/runtime.py).
        self.stale = False
        #: Called when a round finds the manifests stale: the sidecar refetches at once instead of at its next tick.
        self.on_stale: Callable[[], None] | None = None
        self._cond = threading.Condition()
        self._locks = {rank: threading.Lock() for rank in self.ranks}

    # --- Building (the sync mode decides what to build: weightsync_agent.modes) ----------------------

    @property
    def built(self) -> bool:
        """Whether a plan's sources were built (the mode adopted it)."""
        return self.plan is not None

    def rank_lock(self, rank: int) -> threading.Lock:
        """Held while ``rank``'s replica or source changes, and while it writes."""
        return self._locks[rank]

    def replica_set(self, rank: int, layouts: Collection[Manifest], *, digest_grain: int = 0) -> ReplicaSet:
        """``rank``'s replicas for these layouts: kept (with their bytes) when the layouts did not change,
        otherwise created afresh (the old files are unlinked and the rank holds no committed version).

        ``digest_grain``: staging hashes chunks of that size (``writer.digest_grain``); a kept replica keeps its
        grain, and a Source whose bucket size differs hashes at publish time instead."""
        fingerprints = {m.layout_fingerprint for m in layouts}
        old = self.replicas.get(rank)
        if old is not None and set(old.replicas) == fingerprints:
            return old
        if old is not None:
            self._drop_replicas(rank)
        self.held[rank] = None
        for fingerprint in fingerprints & set(self._loader_failed):
            failed_at, why = self._loader_failed[fingerprint]
            wait = LOADER_RETRY_SECONDS - (time.monotonic() - failed_at)
            if wait > 0:
                raise ReplicaError(f"{why} (tried again in {wait:.0f} s)")
        replicas = ReplicaSet.for_manifests(
            layouts, shm_dir=self.replica_root(rank), pin=self.pin, digest_grain=digest_grain
        )
        self.replicas[rank] = replicas
        loaders: list[EngineLoader] = []
        try:
            for replica in replicas:
                if replica.layout.replica is not None:
                    try:
                        loaders.append(EngineLoader(replica, replicas.feed_for(replica)))
                    except ReplicaError as exc:
                        self._loader_failed[replica.fingerprint] = (time.monotonic(), str(exc))
                        raise
                    self._loader_failed.pop(replica.fingerprint, None)
        except BaseException:
            for loader in loaders:
                loader.close()
            self._drop_replicas(rank)
            raise
        self.loaders[rank] = loaders
        return replicas

    def _drop_replicas(self, rank: int) -> None:
        for loader in self.loaders.pop(rank, []):
            loader.close()
            self._loaded_for.pop((rank, loader.name), None)
        replicas = self.replicas.pop(rank, None)
        if replicas is not None:
            replicas.close(unlink=True)

    def install_source(self, rank: int, plan: Plan, manifests: dict[Target, Manifest], replicas: ReplicaSet) -> None:
        """A new Source for ``rank`` (its transport is kept across plans; the replicas are ours, not the Source's)."""
        old = self.sources.pop(rank, None)
        if old is not None:
            old.close()  # unregisters
        transport = self.transports.get(rank) or self.make_transport()
        self.transports[rank] = transport
        self.sources[rank] = Source(transport, plan, rank, manifests, replicas=replicas, pin=self.pin)

    def drop_rank(self, rank: int) -> None:
        """``rank`` writes nothing under the new plan: no Source, no replica files."""
        source = self.sources.pop(rank, None)
        if source is not None:
            source.close()
        self._drop_replicas(rank)
        self.held[rank] = None

    def drop_sources(self) -> None:
        for source in self.sources.values():
            source.close()
        self.sources.clear()

    def adopt(self, plan: Plan, manifests: dict[Target, Manifest]) -> None:
        """The mode built everything ``plan`` needs here; ``manifests``: every target manifest it fetched."""
        self.manifests = manifests
        self.plan = plan
        with self._cond:
            self.stale = False
            self._cond.notify_all()

    # --- The trainer's side ----------------------------------------------------------------------

    def mark_ready(self, rank: int, version: int) -> None:
        """The trainer process staged ``version`` into ``rank``'s replica."""
        self._check_rank(rank)
        with self._cond:
            self.ready_version[rank] = version
            self._cond.notify_all()

    def taken_part(self, rank: int, version: int, since: float) -> tuple[str, float] | None:
        """The round of ``version`` that asked ``rank`` to prepare at or after ``since`` (``time.monotonic``), and when:
        (round id, time), or None."""
        found = self.prepared_regular.get(rank)
        if found is None or found[1] != version or found[2] < since:
            return None
        return found[0], found[2]

    def withdraw(self, rank: int, version: int) -> None:
        """Trainer rank ``rank``'s publish of ``version`` ended without the version committing: it no longer offers
        it. A later round of ``version`` waits for the rank's next publish (a retry restages, or streams anew) instead
        of taking what this one left: an aborted stream's mark, or a replica the trainer may be restaging."""
        with self._cond:
            if self.ready_version.get(rank) == version:
                del self.ready_version[rank]

    # --- The coordinator's side ------------------------------------------------------------------

    def prepare(self, rank: int, version: int, deadline: float, scope: RoundScope = ALL) -> SourceReport:
        """Whether ``publish`` of ``version`` can run (see ``SourceControl.prepare``); writes nothing."""
        gate = None
        try:
            source, targets = self._round_source(rank, scope)
            moved = self._moved(source, scope, targets)
            if moved is not None and not scope.catch_up and self._refetched(deadline):
                # The engine restarted since the manifests were fetched; the sidecar fetched them again just now, so
                # this round need not fail for it. (A catch-up does not wait: it runs on the sidecar's own tick,
                # which does the refetch, right after it; the next tick's catch-up finds them fresh.)
                source, targets = self._round_source(rank, scope)
                moved = self._moved(source, scope, targets)
            if moved is not None:
                return moved
            if scope.round_id is not None:
                self.prepared_round[rank] = scope.round_id
                if not scope.catch_up:
                    self.prepared_regular[rank] = (scope.round_id, version, time.monotonic())
            if scope.catch_up:
                with self._locks[rank]:
                    self._check_holds(rank, source, version)
            else:
                self.wait_ready(rank, version, deadline)
                with self._locks[rank]:
                    self._load_engine_replicas(rank, version, deadline)
                gate = self._stream(rank, version)
                if gate is not None:  # a streamed version: ready at its first complete buckets, or at its last
                    schedule = round_schedule(source.plan.transfer.target_staging, source.plan.transfer.pause)
                    error = streamed_ready(
                        source, gate, deadline, write_while_staging=schedule.write_while_staging, targets=targets
                    )
                    if error is not None:
                        return SourceReport(source=rank, ok=False, error=error)
        except (SourceConfigError, TimeoutError, ReplicaError, ReplicaBusyError) as exc:
            return SourceReport(source=rank, ok=False, error=str(exc))
        return SourceReport(source=rank, ok=True, streamed=gate is not None)

    def publish(self, rank: int, version: int, deadline: float, scope: RoundScope = ALL) -> SourceReport:
        """Write ``rank``'s targets within ``scope``; failures come back as a report.

        A rank this agent does not run raises (a 400 over HTTP) before any metric is touched: the rank is a
        metric label, and labels must come from the plan, never from whatever a request names."""
        self._check_rank(rank)
        try:
            source, targets = self._round_source(rank, scope)
            moved = self._moved(source, scope, targets)
            if moved is not None:
                return moved
            with self._locks[rank]:
                self._check_round(rank, scope)
                gate = None
                if scope.catch_up:
                    self._check_holds(rank, source, version)
                else:
                    self.wait_ready(rank, version, deadline)
                    self._load_engine_replicas(rank, version, deadline)
                    gate = self._stream(rank, version)
                if gate is not None and gate.state == "aborted":
                    raise SourceConfigError(f"source {rank}: {gate.reason}; version {version} was not sent")
                result = source.publish(
                    version, deadline, targets=targets, require_staged=not scope.catch_up, stream=gate
                )
        except (SourceConfigError, IncompleteReplicaError, ReplicaBusyError, TimeoutError) as exc:
            # Each is raised before the first write (source.publish checks the replica before it writes).
            metrics.SOURCE_FAILURES.labels(self.group, str(rank)).inc()
            return SourceReport(source=rank, ok=False, error=str(exc), wrote=False)
        except ReplicaError as exc:  # not known to come before the first write
            metrics.SOURCE_FAILURES.labels(self.group, str(rank)).inc()
            return SourceReport(source=rank, ok=False, error=str(exc))
        metrics.SOURCE_BYTES.labels(self.group, str(rank)).inc(result.bytes)
        metrics.SOURCE_SECONDS.labels(self.group, str(rank)).observe(result.seconds)
        if not result.ok:
            metrics.SOURCE_FAILURES.labels(self.group, str(rank)).inc()
        return result.to_report()

    def committed(self, rank: int, version: int) -> None:
        """Every engine verified and committed ``version``: the replica holds it; the next must restage."""
        self._check_rank(rank)
        replicas = self.replicas.get(rank)
        with self._locks[rank]:
            if replicas is not None:
                replicas.reset()
            self.held[rank] = version

    # --- Internals -------------------------------------------------------------------------------

    def _round_source(self, rank: int, scope: RoundScope) -> tuple[Source, list[Target] | None]:
        """``rank``'s Source and the targets ``scope`` covers (None: all); SourceConfigError if it cannot serve."""
        self._check_rank(rank)
        source = self.sources.get(rank)
        if source is None or self.plan is None:
            raise SourceConfigError(f"source {rank} is not built yet (waiting for its targets' manifests)")
        if scope.plan_hash is not None and scope.plan_hash != self.plan.hash:
            raise SourceConfigError(
                f"source {rank} runs plan {self.plan.hash} (revision {self.plan.revision}), the coordinator "
                f"plan {scope.plan_hash}; it rebuilds once every target of the new plan answers"
            )
        return source, None if scope.engines is None else [t for t in source.targets if scope.covers(t[0])]

    def _load_engine_replicas(self, rank: int, version: int, deadline: float) -> None:
        """Fill ``rank``'s engine replicas from what the trainer staged for ``version`` (the caller holds the rank's
        lock): each one's loader runs the engine's ``load_weights`` over its feed. A replica already loaded for
        ``version`` is left as it is (a retry, or the publish after its prepare); any other version loads again, also
        after a failed round, whose feed stays staged: the replica then holds what the feed holds, as a traced
        replica holds what was staged last.

        A feed whose engine checked that its layers load one at a time (``EngineReplica.layer_groups``) is loaded a
        layer as soon as the trainer staged it, and every loaded layer's memory is given back (``Replica.release``):
        streamed, the feed holds the layers staged and not yet loaded, not the model. Other feeds load once every
        tensor is staged, and are given back after."""
        todo: dict[str, list[EngineLoader]] = {}
        for loader in self.loaders.get(rank, []):
            if loader.replica.is_complete() and self._loaded_for.get((rank, loader.name)) == version:
                continue
            todo.setdefault(loader.feed.fingerprint, []).append(loader)
        for loaders in todo.values():
            feed = loaders[0].feed
            groups = loaders[0].layer_groups
            if not groups or any(other.layer_groups != groups for other in loaders):
                groups = [[t.name for t in feed.layout.tensors]]
            streamed = feed.stream_state(version) is not None
            # Streamed, the trainer goes on staging other layers: each part is staged once per stream, so a staged
            # layer does not change under its load. Otherwise everything is staged and the feed is held meanwhile.
            with contextlib.nullcontext() if streamed else feed.publishing():
                seconds = self._load_groups(rank, version, deadline, loaders, groups)
            for loader in loaders:
                loader.replica.mark_loaded()
                self._loaded_for[(rank, loader.name)] = version
                how = f"{len(groups)} layer groups" if len(groups) > 1 else "one load"
                log.info("source %d: %s loaded for version %d in %.3f s (%s)", rank, loader.name, version, seconds, how)

    @staticmethod
    def _load_groups(
        rank: int, version: int, deadline: float, loaders: list[EngineLoader], groups: list[list[str]]
    ) -> float:
        """Load each of ``groups`` into every one of ``loaders`` (which read one feed) once it is staged, whichever is
        staged first, then give its feed memory back; the seconds the loads took."""
        feed = loaders[0].feed
        slots = [feed.layout.slots_of(group) for group in groups]
        left = list(range(len(groups)))
        seconds = 0.0
        while left:
            ready = [g for g in left if feed.staged(slots[g])]
            if not ready:
                if feed.stream_state(version) == "aborted":
                    raise ReplicaError(f"source {rank}: the trainer aborted its stream of version {version}")
                if time.monotonic() >= deadline:
                    missing = feed.missing()
                    raise TimeoutError(
                        f"source {rank}: {len(missing)} tensor(s) the engine replica's loader takes were not staged "
                        f"before the round's deadline (first: {', '.join(m.source for m in missing[:3])})"
                    )
                time.sleep(0.01)
                continue
            for index in ready:
                gone = feed.released(groups[index])
                if gone:
                    raise ReplicaError(
                        f"source {rank}: the feed of {', '.join(gone[:3])} was given back after an earlier version's "
                        f"load and not staged since; stage every tensor for version {version}"
                    )
                for loader in loaders:
                    seconds += loader.load(max(deadline - time.monotonic(), 1.0), groups[index])
                feed.release(groups[index])
                left.remove(index)
        return seconds

    def _stream(self, rank: int, version: int) -> ReplicaGate | None:
        """The trainer process streams ``version`` into ``rank``'s replicas (its client marked the shared files)."""
        replicas = self.replicas.get(rank)
        if replicas is None or replicas.stream_state(version) is None:
            return None
        return ReplicaGate(replicas, version)

    def _check_rank(self, rank: int) -> None:
        if rank not in self.ranks:
            raise SourceConfigError(f"this agent runs trainer ranks {list(self.ranks)}, not {rank}")

    def wait_ready(self, rank: int, version: int, deadline: float) -> None:
        """Wait until trainer rank ``rank``'s latest publish is ``version``: a version is adopted only when every rank
        publishes it. A rank whose latest is newer is not ready either: its replica holds that version's bytes, which
        must not go out as ``version`` (it may still publish ``version``, e.g. after its newer one was refused)."""
        with self._cond:
            while self.ready_version.get(rank, -1) != version:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"trainer rank {rank} did not stage version {version} before the round's deadline "
                        f"(last staged: {self.ready_version.get(rank)})"
                    )
                self._cond.wait(min(left, 1.0))

    def _moved(self, source: Source, scope: RoundScope, targets: Collection[Target] | None) -> SourceReport | None:
        """A refusal if an engine now publishes its weights elsewhere than this source's manifest says.

        After an engine restart the old addresses are freed memory (or another tensor's) in a new process behind
        a new session: nothing is written there. The agent refetches its manifests on its next tick."""
        for target in source.targets if targets is None else targets:
            pinned, held = scope.placement(target), source.manifests[target].placement
            if pinned is None or pinned == held:
                continue
            self.stale = True
            metrics.SOURCE_FAILURES.labels(self.group, str(source.source)).inc()
            error = (
                f"engine {target[0]} rank {target[1]} publishes its weights elsewhere than this source's manifest "
                f"(placement {pinned}, manifest {held}; session {source.manifests[target].session_id}): it restarted "
                "or re-registered them; nothing written, the manifests are refetched for the next round"
            )
            log.warning("source %d: %s", source.source, error)
            if self.on_stale is not None:
                self.on_stale()
            return SourceReport(source=source.source, ok=False, error=error, failed_target=target, wrote=False)
        return None

    def _refetched(self, deadline: float) -> bool:
        """Wait (up to :data:`REFETCH_SECONDS`, and the round's ``deadline``) for the sidecar to refetch the
        manifests a round found stale; whether it did."""
        until = min(deadline, time.monotonic() + REFETCH_SECONDS)
        with self._cond:
            while self.stale:
                left = until - time.monotonic()
                if left <= 0 or self.on_stale is None:
                    return False
                self._cond.wait(left)
        return True

    def _check_round(self, rank: int, scope: RoundScope) -> None:
        """A coordinator prepares each round before it publishes; a publish from another round (one a dead or
        superseded coordinator started, arriving late) must not write while a newer round owns the engines."""
        prepared = self.prepared_round.get(rank)
        if scope.round_id is not None and prepared is not None and scope.round_id != prepared:
            raise SourceConfigError(
                f"source {rank} was asked to publish for round {scope.round_id}, but the round it prepared last is "
                f"{prepared}: a late call from an older round writes nothing"
            )

    def _check_holds(self, rank: int, source: Source, version: int) -> None:
        if self.held.get(rank) != version:
            raise SourceConfigError(
                f"source {rank} cannot catch up engines to version {version}: its replica holds "
                f"{self.held.get(rank)} (committed versions only)"
            )
        if len(source.replicas.missing()) != source.replicas.parts:
            raise SourceConfigError(
                f"source {rank} cannot catch up engines to version {version}: the trainer has started staging "
                "the next version; joiners get it at the next round"
            )

    def state(self) -> dict[str, object]:
        return {
            "ranks": list(self.ranks),
            "built": self.built,
            "plan": None if self.plan is None else {"revision": self.plan.revision, "hash": self.plan.hash},
            "held": {str(r): v for r, v in self.held.items()},
            "ready": {str(r): v for r, v in self.ready_version.items()},
            "replicas": {str(r): str(self.replica_root(r)) for r in self.ranks},
            # Which targets' replicas an engine loader fills (the engine-replica path), whether it ran since the
            # last commit, in how many layer groups it loads (1: once every feed is staged), and the memory its feed
            # holds now (what the trainer staged and the loader has not taken yet).
            "engineReplicas": {
                str(r): [
                    {
                        "loader": loader.name,
                        "loaded": loader.replica.is_complete(),
                        "layerGroups": max(len(loader.layer_groups), 1),
                        "feedHeldBytes": loader.feed.held_bytes(),
                    }
                    for loader in loaders
                ]
                for r, loaders in self.loaders.items()
                if loaders
            },
        }

    def close(self) -> None:
        self.drop_sources()
        for transport in self.transports.values():
            transport.close()
        self.transports.clear()
        for rank in list(self.replicas):
            self._drop_replicas(rank)
