"""The trainer-facing API: stage full tensors, publish a version.

::

    client = WeightSyncClient.from_env()          # inside the trainer container
    for name, tensor in model.named_full_tensors():   # after TP/EP all-gather, HF names
        client.stage(name, tensor)
    client.publish(step)                           # raises PublishError if the version did not land

    with client.stream(step) as s:                 # or: stream, so stage and transfer overlap
        for name, tensor in gather_layer_by_layer():
            s.stage(name, tensor)                  # a bucket goes out once all its parts are staged
    # committed on exit (PublishError if not); an exception inside aborts the version and propagates

Two deployments, one API:

* **Sidecar mode** (the default under the operator): the agent sidecar builds the replica(s) from its
  targets' manifests in ``/dev/shm`` and registers them; the trainer attaches to the same files
  (:meth:`WeightSyncClient.from_env`) and only stages. It authenticates to its sidecar with the pod-local
  token the sidecar leaves in the same folder (``agent.token``): trainer code never holds the group's
  credential, and that token opens only ``/v1/publish`` and ``/v1/state`` of its own pod's agent.
  ``publish`` goes to the sidecar (:class:`SidecarPublisher`): every trainer rank calls it after staging,
  trainer rank 0's agent runs the round (pause, write, verify, commit, resume;
  :mod:`weightsync_agent.rounds.coordinator`) and every rank gets the round's result.
* **In-process mode** (tests, single-process demos, no sidecar): :meth:`WeightSyncClient.in_process`
  (or ``from_env(transport=..., manifests=...)``) builds the :class:`~weightsync_agent.source.writer.Source`
  itself and ``publish`` writes the targets directly (:class:`InProcessPublisher`). No engine is paused,
  nothing is verified by the targets and no version is committed on them: that is the round's job.
  :meth:`WeightSyncClient.coordinating` also runs the round from this process (:class:`RoundPublisher`).

The seam is :class:`Publisher`: ``publish(version, deadline) -> Outcome`` (``ok`` + ``summary()``). The
client resets the staged flags only when the outcome is ``ok``, which a round publisher must return only
once the version is *committed* on every target; on failure the replica keeps its bytes and flags so the
same version can be retried without restaging.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

import torch

from weightsync.api import names
from weightsync.api.timeouts import HTTP_CALL_SECONDS
from weightsync.plan import Plan, Target
from weightsync_agent.config import AgentConfig, AgentConfigError, replica_dir, trainer_token_file
from weightsync_agent.layout.manifest import Manifest
from weightsync_agent.modes.registry import make_mode
from weightsync_agent.rounds.canary import Canary
from weightsync_agent.rounds.driver import RoundDriver, RoundResult
from weightsync_agent.rounds.remote import AgentClient, AgentError
from weightsync_agent.source.control import SourceControl
from weightsync_agent.source.feed_window import FeedWindow
from weightsync_agent.source.replica import MissingPart, ReplicaSet
from weightsync_agent.source.stream import StreamGate
from weightsync_agent.source.writer import InProcessSourceControl, Outcome, PublishError, PublishResult, Source
from weightsync_agent.targets.adapter import EngineRound
from weightsync_agent.transport.base import Transport

ENV_REPLICA_PATH: Final = names.ENV_REPLICA_PATH
ENV_SOURCE_RANK: Final = names.ENV_SOURCE_RANK

DEFAULT_TIMEOUT_S: Final = 300.0


class ClientError(RuntimeError):
    """The client cannot do what was asked; nothing was written."""


class Publisher(Protocol):
    """Turns a staged replica into a version on the targets. ``ok`` means committed everywhere."""

    def publish(self, version: int, deadline: float, canary: Canary | None = None) -> Outcome:
        """``canary``: gate the engines' label on it (``rounds/canary.py``); a publisher without engines refuses it."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class StreamingPublisher(Protocol):
    """A publisher that can send a version while the trainer still stages it (:meth:`WeightSyncClient.stream`)."""

    def publish_streaming(self, version: int, deadline: float, gate: StreamGate) -> Outcome: ...


class InProcessPublisher:
    """Writes the targets from this process (no pause, no target verification, no commit)."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def publish(self, version: int, deadline: float, canary: Canary | None = None) -> PublishResult:
        if canary is not None:
            raise ClientError("an in-process source has no engines to score a canary: publish through a round")
        return self.source.publish(version, deadline)

    def publish_streaming(self, version: int, deadline: float, gate: StreamGate) -> PublishResult:
        return self.source.publish(version, deadline, stream=gate)

    def close(self) -> None:
        self.source.close()


@dataclass(frozen=True)
class RoundOutcome:
    """A whole sync round's result (:class:`weightsync_agent.rounds.driver.RoundResult`) as an :class:`Outcome`."""

    round: RoundResult

    @property
    def ok(self) -> bool:
        return self.round.result == "Succeeded"

    def summary(self) -> str:
        r = self.round
        text = (
            f"round v{r.version}: {r.result} after {r.attempts} attempt(s) in {r.duration_seconds:.3f} s, {r.bytes} B"
        )
        if r.paused_seconds is not None:
            text += f", engines paused {r.paused_seconds:.3f} s" + (
                f" (pause: {r.pause_policy})" if r.pause_policy else ""
            )
        if (slowest := r.slowest_target) is not None:
            (engine, rank), stat = slowest
            text += f", slowest target engine {engine} rank {rank} ({stat.seconds:.3f} s, {stat.gbps:.2f} Gb/s)"
        return f"{text}; {r.reason}" if r.reason else text


class RoundPublisher:
    """This process coordinates: pause engines, every source writes, targets verify, commit, resume.

    The driver's own timeout (the plan's ``timeoutSeconds``) bounds the round; ``deadline`` is not
    passed through because the driver takes none. Sources are any ``SourceControl``: this process's
    :class:`~weightsync_agent.source.writer.InProcessSourceControl`, or clients of other trainer ranks' agents.
    """

    def __init__(
        self, driver: RoundDriver, *, owns: Source | None = None, control: InProcessSourceControl | None = None
    ) -> None:
        self.driver = driver
        self.owns = owns
        #: This process's own source as the driver sees it; a stream hands it the gate.
        self.control = control

    def publish(self, version: int, deadline: float, canary: Canary | None = None) -> RoundOutcome:
        return RoundOutcome(self.driver.run(version, canary=canary))

    def publish_streaming(self, version: int, deadline: float, gate: StreamGate) -> RoundOutcome:
        """The round starts now: its prepare waits for this rank's first complete bucket (``transfer.pause:
        overlap``, or staged targets: engines are paused no earlier than the first write needs) or its last (``minimal``
        into live targets: the engines serve through the staging), its writes follow the staging, and it commits once
        every source sent everything and every target verified."""
        if self.control is None:
            raise ClientError("this round publisher has no in-process source to stream")
        self.control.stream(gate)
        try:
            return RoundOutcome(self.driver.run(version))
        finally:
            self.control.stream(None)

    def close(self) -> None:
        self.driver.close()
        if self.owns is not None:
            self.owns.close()


class SidecarPublisher:
    """Sidecar mode: tell this pod's agent the rank staged ``version`` and wait for the round's result.

    Every trainer rank calls ``publish(v)`` after staging (like a collective): rank 0's agent then runs
    the round, and each other rank's agent lets its source write once its own rank said so.
    """

    def __init__(self, agent_url: str, source_rank: int, replica_folder: str | os.PathLike[str] | None = None) -> None:
        self.agent_url = agent_url
        self.source_rank = source_rank
        #: Where the sidecar leaves its pod-local token; re-read on every publish (a restarted sidecar makes a new one).
        self.replica_folder = replica_folder

    def publish_streaming(self, version: int, deadline: float, gate: StreamGate) -> RoundOutcome:
        """The same call as :meth:`publish`, made when the stream opens: this rank is marked ready at once, and the
        sidecar reads the stream's progress and end from the replica files the client marks (``mark_stream``)."""
        return self.publish(version, deadline)

    def publish(self, version: int, deadline: float, canary: Canary | None = None) -> RoundOutcome:
        timeout = max(1.0, deadline - time.monotonic())
        token = None if self.replica_folder is None else read_trainer_token(self.replica_folder)
        agent = AgentClient(self.agent_url, token=token)
        try:
            return RoundOutcome(agent.publish(version, self.source_rank, timeout, canary=canary))
        except AgentError as exc:
            raise PublishError(_Unreachable(str(exc))) from exc

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _Unreachable:
    reason: str

    @property
    def ok(self) -> bool:
        return False

    def summary(self) -> str:
        return f"the weightsync agent could not run the round: {self.reason}"


def read_trainer_token(replica_folder: str | os.PathLike[str]) -> str | None:
    """The pod-local token this pod's sidecar left in the replica folder, or None (not written yet)."""
    try:
        return trainer_token_file(replica_folder).read_text().strip() or None
    except FileNotFoundError:
        return None


def wait_for_sidecar(
    agent_url: str, timeout: float, replica_folder: str | os.PathLike[str] | None = None
) -> dict[str, object]:
    """Block until the sidecar built this pod's replicas (it needs every target's manifest first).

    ``replica_folder``: where the sidecar leaves the pod-local token (re-read each try: a restarted sidecar
    writes a new one)."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        token = None if replica_folder is None else read_trainer_token(replica_folder)
        agent = AgentClient(agent_url, timeout=5.0, token=token)
        try:
            state = agent.state()
            sources = state.get("sources")
            if isinstance(sources, dict) and sources.get("built"):
                return state
            last = "replicas not built yet (waiting for the engines' manifests)"
        except AgentError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise ClientError(f"the weightsync sidecar at {agent_url} is not ready after {timeout:.0f} s: {last}")


class WeightSyncClient:
    def __init__(
        self,
        replicas: ReplicaSet,
        publisher: Publisher | None = None,
        *,
        source_rank: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.replicas = replicas
        self.publisher = publisher
        self.source_rank = source_rank
        self.timeout = timeout
        self.committed: int | None = None  # newest version published with ok
        self.last_result: Outcome | None = None

    # --- Construction ------------------------------------------------------------------------

    @classmethod
    def in_process(
        cls,
        transport: Transport,
        plan: Plan,
        source_rank: int,
        manifests: Mapping[Target, Manifest],
        *,
        bucket_bytes: int | None = None,
        shm_dir: str | os.PathLike[str] | None = None,
        pin: bool | None = None,
        max_inflight: int = 2,
    ) -> WeightSyncClient:
        """``max_inflight``: buckets on the wire per target at once, the only memory a publish or a stream adds to the
        replica (the writes read the replica in place)."""
        source = Source(
            transport,
            plan,
            source_rank,
            manifests,
            bucket_bytes,
            shm_dir=None if shm_dir is None else str(shm_dir),
            pin=pin,
            max_inflight=max_inflight,
        )
        return cls(
            source.replicas,
            InProcessPublisher(source),
            source_rank=source_rank,
            timeout=plan.transfer.timeouts.round_budget,
        )

    @classmethod
    def coordinating(
        cls,
        transport: Transport,
        plan: Plan,
        source_rank: int,
        manifests: Mapping[Target, Manifest],
        engines: Mapping[int, EngineRound],
        *,
        other_sources: Mapping[int, SourceControl] | None = None,
        shm_dir: str | os.PathLike[str] | None = None,
        pin: bool | None = None,
        call_timeout: float = HTTP_CALL_SECONDS,
        retries: int = 1,
        max_inflight: int = 2,
    ) -> WeightSyncClient:
        """This process writes its own targets *and* coordinates the round (pause, verify, commit).

        Buckets use the plan's size, which is what the targets verify against. P2P only: broadcast mode
        runs through the sidecar (or ``RoundDriver(broadcast_round_plan(plan), engines, {0:
        BroadcastSource(...)})`` in-process).
        """
        if not make_mode(plan.transfer.mode).each_rank_writes:
            raise ClientError(
                f"coordinating() writes p2p plans; this plan's mode is {plan.transfer.mode!r}: use the sidecar "
                "(from_env) or weightsync_agent.modes.broadcast.sender.BroadcastSource with broadcast_round_plan"
            )
        source = Source(
            transport,
            plan,
            source_rank,
            manifests,
            shm_dir=None if shm_dir is None else str(shm_dir),
            pin=pin,
            max_inflight=max_inflight,
        )
        control = InProcessSourceControl(source)
        try:
            driver = RoundDriver(
                plan,
                engines,
                {source_rank: control, **(other_sources or {})},
                staging=plan.transfer.target_staging,
                pause_policy=plan.transfer.pause,
                verify=plan.transfer.verify,
                timeout_seconds=plan.transfer.timeouts.round_budget,
                call_timeout=call_timeout,
                retries=retries,
            )
        except BaseException:
            source.close()
            raise
        return cls(
            source.replicas,
            RoundPublisher(driver, owns=source, control=control),
            source_rank=source_rank,
            timeout=plan.transfer.timeouts.round_budget,
        )

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        publisher: Publisher | None = None,
        transport: Transport | None = None,
        manifests: Mapping[Target, Manifest] | None = None,
        plan: Plan | None = None,
        sidecar_timeout: float = 120.0,
    ) -> WeightSyncClient:
        """Build the client from the environment the operator gives trainer pods.

        With ``transport`` and ``manifests``: in-process mode (the plan comes from ``plan`` or the
        agent env's plan file / ConfigMap; replicas are created under the replica path). Otherwise:
        wait for the sidecar (same pod, agent port) to build the replicas, attach its replica files and
        publish through it (:class:`SidecarPublisher`), or through ``publisher`` when given.
        """
        env = os.environ if env is None else env
        try:
            config = AgentConfig.from_env(env)
        except AgentConfigError as exc:
            raise ClientError(str(exc)) from exc
        if config.role != "trainer":
            raise ClientError(f"{names.ENV_ROLE} is {config.role!r}; the weight-sync client runs in trainer pods")
        rank = _source_rank(config, env)
        path = Path(env.get(ENV_REPLICA_PATH) or replica_dir(config.group, rank))
        if transport is not None or manifests is not None:
            if transport is None or manifests is None:
                raise ClientError("in-process mode needs both transport and manifests")
            if plan is None:
                from weightsync_agent.http.credential import Credential
                from weightsync_agent.plan_loader import load_plan

                # A plan file is the caller's own; a ConfigMap's plan must carry the operator's seal.
                keys = None if config.plan_file else Credential.from_sources(config.credentials_dir, config.group_token)
                plan = load_plan(config, None, keys)
            return cls.in_process(transport, plan, rank, manifests, shm_dir=path)
        timeout = plan.transfer.timeouts.round_budget if plan is not None else DEFAULT_TIMEOUT_S
        if publisher is None:
            agent_url = f"http://127.0.0.1:{config.agent_port}"
            wait_for_sidecar(agent_url, sidecar_timeout, path)
            publisher = SidecarPublisher(agent_url, rank, path)
        # A rank may hold no replica: in broadcast mode only rank 0 stages (the full tensors).
        replicas = ReplicaSet.attach(path) if any(path.glob("*.replica")) else ReplicaSet([])
        return cls(replicas, publisher, source_rank=rank, timeout=timeout)

    # --- Staging -------------------------------------------------------------------------------

    def stage(self, name: str, tensor: torch.Tensor, *, strict: bool = True) -> int:
        """Copy the full tensor ``name`` into every replica part cut from it (see ReplicaSet.stage).

        A rank without replicas (broadcast mode, ranks other than 0) stages nothing and only publishes.
        """
        if not len(self.replicas):
            return 0
        return self.replicas.stage(name, tensor, strict=strict)

    def stage_many(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        if not len(self.replicas):
            return 0
        return self.replicas.stage_many(tensors)

    def staging_order(self) -> list[str]:
        """The full tensor names in the order the buckets need them (first use in the replica layouts).

        A stream sends each target's buckets in order, so staging in this order lets each one go out as
        early as it can; any order is correct."""
        order: dict[str, None] = {}
        for replica in self.replicas:
            scales = {q.scale for q in replica.layout.quantized.values()}  # made by the source with their weights
            for slot in replica.layout.slots:
                if slot.part.source not in scales:
                    order.setdefault(slot.part.source, None)
        return list(order)

    def expected(self) -> set[str]:
        """The full tensor names the targets need."""
        return self.replicas.full_names()

    def missing(self) -> list[MissingPart]:
        return self.replicas.missing()

    # --- Publishing ----------------------------------------------------------------------------

    def publish(
        self, version: int, *, timeout: float | None = None, check: bool = True, canary: Canary | None = None
    ) -> Outcome:
        """Publish the staged replica as ``version``; on success the next version must restage everything.
        ``canary`` (trainer rank 0): the semantic gate's prompt and this trainer's logprobs for it
        (``weightsync_agent.rounds.canary``); the engines' label moves only if each scores it within its tolerance.

        Raises :class:`PublishError` (naming targets and buckets) when ``check`` and the result is not
        ok, IncompleteReplicaError when something is not staged, ClientError when there is no publisher
        or ``version`` is not newer than the last committed one.
        """
        publisher = self._publisher_for(version)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self.replicas.flush_digests()  # staging's bucket digests are filed before any publisher reads them
        self.replicas.mark_stream(version, None)  # a plain publish, even of a version whose stream failed
        # Without a canary, the two-argument call every publisher takes (a trainer's own publisher included).
        gated = canary is not None
        outcome = publisher.publish(version, deadline, canary) if gated else publisher.publish(version, deadline)
        return self._settled(version, outcome, check)

    @contextlib.contextmanager
    def stream(self, version: int, *, timeout: float | None = None, check: bool = True) -> Iterator[Stream]:
        """Publish ``version`` while it is staged: ``with client.stream(v) as s: s.stage(name, tensor) ...``.

        The round (or, in-process, the writes) starts at once; each target's next bucket is sent as soon as every
        part it overlaps is staged, so staging and transfer overlap. On a normal exit the stream closes and the
        call waits for the outcome (committed, as :meth:`publish`; PublishError when ``check`` and it is not).
        An exception inside the block aborts the version (the round fails without committing; its engines stay
        paused in live mode if anything was written, as after any failed live round) and propagates. Each part
        is staged once per stream; every part is staged anew (the staged flags are reset when it opens).
        """
        publisher = self._publisher_for(version)
        if not isinstance(publisher, StreamingPublisher):
            raise ClientError(f"{type(publisher).__name__} cannot stream: stage everything, then publish()")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self.replicas.reset()
        self.replicas.mark_stream(version, "open")  # what a sidecar reads: it sends what is staged as it goes
        gate = StreamGate(version)
        future: Future[Outcome] = Future()

        def send() -> None:
            try:
                future.set_result(publisher.publish_streaming(version, deadline, gate))
            except BaseException as exc:  # handed to the trainer's thread below
                future.set_exception(exc)

        handle = Stream(self, gate, future, FeedWindow(self.replicas))
        with self.replicas.streaming():  # this process never restages a part the stream may have sent
            worker = threading.Thread(target=send, name=f"weightsync-stream-v{version}", daemon=True)
            worker.start()
            try:
                yield handle
            except BaseException as exc:
                self.replicas.mark_stream(version, "aborted")
                gate.abort(f"{type(exc).__name__}: {exc}")
                worker.join()
                with contextlib.suppress(Exception):
                    handle.outcome = self._settled(version, future.result(), check=False)
                raise
            self.replicas.flush_digests()
            self.replicas.mark_stream(version, "closed")
            gate.close()
            worker.join()
        handle.outcome = self._settled(version, future.result(), check)

    def _publisher_for(self, version: int) -> Publisher:
        if self.publisher is None:
            raise ClientError(
                "this client can stage but has no publisher: build it with from_env() (sidecar), "
                "in_process(...) or coordinating(...)"
            )
        if self.committed is not None and version <= self.committed:
            raise ClientError(f"version {version} is not newer than the last published version {self.committed}")
        return self.publisher

    def _settled(self, version: int, result: Outcome, check: bool) -> Outcome:
        self.last_result = result
        if result.ok or (isinstance(result, RoundOutcome) and result.round.committed):
            # A round whose resume failed is not ok, but every engine committed v: the next publish is v+1.
            self.committed = version
            self.replicas.reset()
        if not result.ok and check:
            raise PublishError(result)
        return result

    def close(self, *, unlink: bool = False) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.replicas.close(unlink=unlink)

    def __enter__(self) -> WeightSyncClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Stream:
    """One streamed version, as :meth:`WeightSyncClient.stream` hands it to the trainer."""

    def __init__(
        self, client: WeightSyncClient, gate: StreamGate, future: Future[Outcome], window: FeedWindow | None = None
    ) -> None:
        self._client = client
        self._gate = gate
        self._future = future
        #: Engine replicas' feeds: staging into one waits while it holds more than its window of layers not loaded
        #: yet (source/feed_window.py).
        self.window = window
        #: The version's outcome, once the ``with`` block ended.
        self.outcome: Outcome | None = None

    @property
    def version(self) -> int:
        return self._gate.version

    def stage(self, name: str, tensor: torch.Tensor, *, strict: bool = True) -> int:
        """Stage one full tensor (as :meth:`WeightSyncClient.stage`); its buckets go out once complete.

        Raises PublishError if the version already failed (the round ended early: a target or another rank
        failed, or the deadline passed), so the trainer stops gathering for nothing. A tensor an engine replica's
        loader takes waits first while its feed holds a window of layers not loaded yet (source/feed_window.py)."""
        if self._future.done():
            outcome = self._future.result()
            raise PublishError(outcome)
        if self.window is not None and self.window.windows:
            self.window.room(name, ended=self._future.done)
        return self._client.stage(name, tensor, strict=strict)

    def stage_many(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        return sum(self.stage(name, tensor) for name, tensor in items)


def _source_rank(config: AgentConfig, env: Mapping[str, str]) -> int:
    explicit = env.get(ENV_SOURCE_RANK)
    if explicit:
        try:
            rank = int(explicit)
        except ValueError:
            raise ClientError(f"{ENV_SOURCE_RANK} must be an integer, got {explicit!r}") from None
        if rank not in config.ranks:
            raise ClientError(f"{ENV_SOURCE_RANK}={rank} is not one of this pod's ranks {list(config.ranks)}")
        return rank
    if len(config.ranks) == 1:
        return config.ranks[0]
    local = env.get("LOCAL_RANK")
    if local is not None and local.isdigit() and int(local) < len(config.ranks):
        return config.ranks[int(local)]
    raise ClientError(
        f"this pod runs trainer ranks {list(config.ranks)}; set {ENV_SOURCE_RANK} (or LOCAL_RANK) to say which "
        "one this process is"
    )
