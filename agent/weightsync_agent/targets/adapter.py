"""The engine-adapter seam: everything the agent needs from one kind of inference engine.

One adapter object stands for one engine (all its ranks). The round driver, the coordinator, the sources
and the engine pod's agent talk to engines only through :class:`EngineAdapter`; each engine kind is one
folder under ``targets/`` with one class, registered in :mod:`weightsync_agent.targets.registry` under its
``inference.adapter`` name. What a kind can do (sync modes, target staging, verification, catch-up) is
declared once, in the contract :mod:`weightsync.api.engines`, which the operator checks specs against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from weightsync.api.engines import Capabilities, Staging, SyncModeName
from weightsync.api.timeouts import HTTP_CALL_SECONDS
from weightsync_agent.http.credential import ApiKey
from weightsync_agent.layout.manifest import Manifest


@dataclass(frozen=True)
class TargetVerdict:
    """One target's (engine rank's) answer to "does what landed match these checksums?"."""

    ok: bool
    mismatched: Sequence[int] = ()
    error: str | None = None


#: One broadcast group rank per engine process (it fills all the engine's ranks), or one per engine rank.
Receivers = Literal["engine", "rank"]


@dataclass(frozen=True)
class BroadcastReception:
    """How an engine kind takes broadcast rounds; the sender (``modes/broadcast``) follows it.

    - ``"weightsync-buckets"``: the engine joins weightsync's own group (``transport/collective.py``) and,
      once armed (``arm_broadcast``), receives a round as a header, metadata and buckets (the reference engine);
    - ``"announced-tensors"``: the engine joins a torch *custom process group* named by the sender
      (``transport/custom_group.py``) and is told each chunk's full tensors (``receive_broadcast``, which
      blocks until they are received and loaded), then gets one plain broadcast per tensor, in that order
      (stock SGLang's ``/init_weights_update_group`` and ``/update_weights_from_distributed``).

    ``rendezvous`` (announced tensors only): how the group is met. ``"torch-store"``: a ``tcp://`` torch store
    (SGLang); ``"nccl-unique-id"``: a raw ``ncclUniqueId`` the sender mints, told to the engines as
    ``nccl-uid:<base64>`` (stock vLLM's ``nccl`` backend; ``transport/nccl_uid_group.py``).
    """

    receivers: Receivers
    framing: Literal["weightsync-buckets", "announced-tensors"]
    rendezvous: Literal["torch-store", "nccl-unique-id"] = "torch-store"


def rank_offset(members: Sequence[dict[str, Any]], ranks: int) -> int:
    """The group rank of TP rank 0, for engines whose every TP rank joins as ``rank_offset + tp_rank`` (stock SGLang
    and vLLM): ``members`` must be one per TP rank, consecutive, in rank order; ValueError otherwise."""
    ordered = sorted(members, key=lambda m: int(m["group_rank"]))
    offset = int(ordered[0]["group_rank"]) if ordered else 0
    wanted = [{"group_rank": offset + r, "ranks": [r]} for r in range(ranks)]
    if [{"group_rank": int(m["group_rank"]), "ranks": [int(r) for r in m["ranks"]]} for m in ordered] != wanted:
        raise ValueError(f"one group rank per TP rank from an offset; got members {list(members)}")
    return offset


@dataclass(frozen=True)
class FullTensor:
    """A full (unsharded) tensor of a broadcast chunk, as the sender will send it."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Readiness:
    """Whether the engine can take part in rounds; ``reason`` is CamelCase (the pod condition's reason)."""

    ready: bool
    reason: str
    message: str = ""
    #: How many of the engine's ranks each path syncs (``trace``, ``engine-replica``), when the manifests say.
    paths: Mapping[str, int] | None = None


@dataclass(frozen=True)
class AdapterSettings:
    """What an adapter is built from: where its engine answers and the plan's transfer settings."""

    engine: int
    url: str
    ranks: int
    bucket_bytes: int
    verify: bool = True
    staging: Staging = "live"
    #: The plan's ``transfer.mode`` (a kind may take each mode through another of the engine's backends).
    mode: SyncModeName = "p2p"
    #: Bound on one HTTP call to the engine (docs/architecture.md, "Timeouts").
    call_timeout: float = HTTP_CALL_SECONDS
    #: The agent of the engine's first pod, for kinds whose manifests that agent assembles (SGLang).
    agent_url: str | None = None
    #: True in the engine's own pod: the adapter may inspect the engine locally (trace its model).
    engine_side: bool = False
    #: The group's credential (``WEIGHTSYNC_GROUP_TOKEN``), sent as a bearer token on every call to the engine
    #: (stock SGLang takes it as its ``--admin-api-key``) and to the engine's agent.
    api_key: ApiKey = field(default=None, repr=False)


class EngineRound(Protocol):
    """An engine's part of a round, as the driver runs it (test fakes implement just this).

    Every call names the round (``round_id``, minted by the coordinator): an engine that can hold it (the reference
    engine) refuses a call naming another round than the open one; one that cannot (stock SGLang) has its adapter
    keep the id and refuse client-side.
    """

    name: str

    def pause(self, timeout: float, *, round_id: str) -> None: ...

    def resume(self, timeout: float, *, round_id: str) -> None: ...

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        """Open round ``version``: from here until commit or abort the engine expects writes."""
        ...

    def verify(
        self, rank: int, version: int, checksums: Sequence[str], timeout: float, *, round_id: str
    ) -> TargetVerdict: ...

    def commit(self, version: int, timeout: float, *, round_id: str) -> None: ...

    def abort(self, version: int, timeout: float, *, round_id: str, written: bool = True) -> None:
        """Close round ``version`` without committing. ``written=False``: no source was asked to write in it, so
        the engine's live weights are as they were before its begin (it may serve again)."""
        ...


@runtime_checkable
class ClosesAtVerify(Protocol):
    """An engine that closes each rank's write window when it verifies it (the reference engine: nothing can change
    verified bytes before the commit). A live retry rewrites every target, so it reopens the round first."""

    def reopen(self, version: int, timeout: float, *, round_id: str) -> None:
        """Open round ``version`` (``round_id``, still open here) to writes again, forgetting what it verified."""
        ...


@dataclass(frozen=True)
class LeftRound:
    """A round an engine still holds that no running coordinator knows: its coordinator stopped during it (trainer rank
    0's agent killed or restarted). ``version``: the round it holds open (None: it only holds the engine paused)."""

    round_id: str
    version: int | None
    paused: bool


@runtime_checkable
class LeftRoundProbe(Protocol):
    """An engine that says which round holds it (the reference engine: its status names the open round and the round
    that paused it), so a coordinator that starts can close what its predecessor left open instead of leaving the
    engine paused for nobody while the group's status calls it serving."""

    def left_round(self, timeout: float) -> LeftRound | None:
        """The round that holds this engine open or paused, if any."""
        ...

    def close_left(self, left: LeftRound, timeout: float) -> bool:
        """End ``left`` without committing, not knowing what was written in it: the engine serves again only if its
        live memory still holds, bucket for bucket, what it verified last (it re-verifies after closing the window);
        else it stays paused until a round lands. True when it serves again."""
        ...


@runtime_checkable
class HealthProbe(Protocol):
    """An engine that answers a health check (every adapter): the driver asks it to name a hung engine."""

    def healthy(self, timeout: float) -> bool: ...


@runtime_checkable
class GatedRound(Protocol):
    """An engine that can take the semantic gate (``rounds/canary.py``): apply a version without labelling it, then
    score a prompt with the applied weights. After :meth:`apply` in a round, that round's ``commit`` only labels."""

    #: The ``transfer.targetStaging`` values this adapter's gate works in (the driver refuses a canary otherwise).
    gate_stagings: ClassVar[frozenset[str]]

    def apply(self, version: int, timeout: float, *, round_id: str) -> None:
        """Make the written ``version`` what the engine computes with (its own post-processing included), keeping
        the label it reports."""
        ...

    def score(self, input_ids: Sequence[int], timeout: float, *, round_id: str) -> list[float | None]:
        """The logprob the engine gives each of ``input_ids`` after the first (teacher forcing); the engine must be
        serving (resumed)."""
        ...


@runtime_checkable
class ScrubbedEngine(Protocol):
    """An engine whose served weights can be checked between rounds (scrubbing, ``transfer.scrubSeconds``): its own
    checker hashes what it serves now, and the result is compared with the committed version's verified checksums."""

    def scrub(self, rank: int, version: int, checksums: Sequence[str], timeout: float) -> TargetVerdict:
        """Rank ``rank``'s served weights against ``checksums`` (what verified ``version``'s commit), outside any
        round. A mismatch also lets the next round write ``version`` into this engine again (a repair: versions
        otherwise only move forward), and an engine that can stops serving the drifted weights until then."""
        ...


class EngineAdapter(EngineRound, Protocol):
    """One engine of one kind: discovery, readiness, the round, and (if it can) broadcast reception."""

    kind: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    #: Whether the engine pod's agent assembles the manifests (then sources fetch them from that agent).
    manifests_from_engine_agent: ClassVar[bool]
    #: How the engine takes broadcast rounds (when ``broadcast`` is among its capabilities' modes).
    broadcast: ClassVar[BroadcastReception]
    settings: AdapterSettings

    def __init__(self, settings: AdapterSettings) -> None: ...

    def manifest(self, rank: int) -> Manifest:
        """Rank ``rank``'s target manifest (names, dtypes, shapes, shard map, addresses, transfer session)."""
        ...

    def held_version(self, timeout: float | None = None) -> str | None:
        """The version the engine fully holds (it changes only on a verified commit)."""
        ...

    def readiness(self) -> Readiness:
        """Whether the engine answers and serves usable manifests for every rank."""
        ...

    def healthy(self, timeout: float) -> bool: ...

    def join_broadcast(self, init_method: str, world_size: int, members: list[dict[str, Any]], backend: str,
                       timeout: float, group_name: str) -> None:  # fmt: skip
        """Broadcast mode: join the trainer's torch.distributed group ``group_name`` as ``members``."""
        ...

    def arm_broadcast(self, version: int, timeout: float, *, round_id: str | None = None) -> None:
        """Broadcast mode, ``weightsync-buckets``: expect the buckets of ``version`` on the group (in round
        ``round_id``: the engine refuses to arm another round than its open one)."""
        ...

    def receive_broadcast(self, version: int, tensors: Sequence[FullTensor], group_name: str, timeout: float) -> None:
        """Broadcast mode, ``announced-tensors``: receive ``tensors`` (one broadcast each, in order) and load
        them into the live weights; returns once loaded. Never changes the version the engine reports."""
        ...

    def leave_broadcast(self, group_name: str, timeout: float) -> None:
        """Broadcast mode: drop the group ``group_name`` (after a failure or a re-form); best effort."""
        ...


class AdapterUnavailableError(LookupError):
    """No adapter for this engine kind in this version (the message says why)."""
