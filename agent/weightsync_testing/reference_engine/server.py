"""The reference engine's HTTP server: one process per engine, all its TP ranks inside, SGLang-shaped routes.

Like SGLang, one server fronts every tensor-parallel rank of the engine; per-rank routes take ``?rank=r``.
Each rank has its own flat weight buffer (live, plus a staging twin in staged mode) and its own transport
session, so sources write to ``(engine, rank)`` exactly as they would to SGLang ranks.

SGLang routes (same paths and payloads; see docs/reference-engine.md for the sources):

* ``GET /health``, ``GET /health_generate``: 200 while serving, 503 while shutting down.
* ``GET /remote_instance_transfer_engine_info?rank=r`` (and the deprecated ``/get_...`` alias):
  ``{"rank": r, "remote_instance_transfer_engine_info": [session_id, manifest]}``, our
  :class:`~weightsync_agent.layout.manifest.Manifest` (JSON) in the slot where SGLang puts ``weights_info_dict``.
* ``POST /pause_generation {"mode": "abort"|"retract"|"in_place"}``, ``POST /continue_generation {}``.
* ``POST /update_weight_version {"new_version": v}``: a commit of ``v`` (see the invariant below).
* ``GET /model_info`` (and ``/get_model_info``), ``GET /weight_version`` (and ``/get_weight_version``),
  ``GET /server_info`` (and ``/get_server_info``): all report ``weight_version``.
* ``POST /generate {"input_ids": [...], "sampling_params": {"max_new_tokens": n}}``: greedy tokens, computed
  off the event loop (one forward at a time, :data:`MAX_QUEUED_FORWARDS` waiting at most), so control routes
  answer while it runs; a pause stops it at its next token (503).
* ``GET|POST /flush_cache``: accepted (no cache here).

Extension routes under ``/weightsync/``: ``status``, ``stage``, ``begin``, ``verify``, ``commit``,
``abort``, ``forward``, ``checksums?rank=r&bucket_bytes=n`` (per-bucket xxh3 of what the rank's target
memory holds now: how tests and operators check an engine's bytes without copying them out), and for
broadcast mode (``transfer.mode: broadcast``):

* ``POST /weightsync/broadcast {"init_method": "tcp://host:port", "world_size": W, "members": [{"group_rank":
  g, "ranks": [r, ...]}], "backend": "auto", "timeout_seconds": T}``: join the group (answers once the whole
  world has joined; joining again replaces the old group);
* ``POST /weightsync/broadcast/receive {"version": v}``: needs the open round ``v``; starts receiving it in the
  background into the live weights (live) or the staging twin (staged), each rank cutting its own shards
  from the full tensors. ``verify`` of a rank waits for the receive to end and fails if it did not
  deliver every part; ``commit`` is refused while it runs.

**Credential**: started with a token (``WEIGHTSYNC_GROUP_TOKEN`` in its environment, as the operator projects
the group's Secret into the engine container; ``serve_in_thread(token=...)``), every route but
:data:`OPEN_ROUTES` requires ``Authorization: Bearer <token>`` (401 otherwise): health, read-only model and
version info and generation stay open, as on a stock SGLang started with only ``--admin-api-key``. Without a
token every route is open, as on a stock SGLang started without one (tests that drive an engine directly).

**Invariant**: the reported weight version changes only on commit, and commit is refused unless, in the
round for that version, the last verify of every rank succeeded for every bucket. A round is opened with
``begin``. In live mode (sources write into the served weights) ``begin`` needs the engine paused and marks
the live weights dirty: generation stays refused until a verified commit, even after an abort, because a
partial write cannot be undone. In staged mode the engine keeps serving the previous version from its live
weights during the round; commit copies staging over live and sets the version in one step of the event
loop, so no request sees a mix.

**Write window**: each rank's memory is registered with its transport only while a round is open and that rank
is not verified: from ``begin`` to the rank's successful ``verify`` (``status`` reports it as ``writable``). Mooncake
refuses a write into memory that is not registered, so between rounds a peer that learned the addresses still lands
no byte (Mooncake's ports carry no credential; docs/security.md, "The data plane"), and a write after a rank's
checksums were taken cannot change what its commit labels: ``verify`` closes the rank's window *before* it hashes.
A failed verify opens it again (same addresses: the sources' manifests name them) for the sources' rewrite; a
``begin`` opens every rank again, ``commit`` and ``abort`` close every rank.

**Bounds** (docs/security.md, "Bounds"): bodies over ``MAX_BODY_BYTES`` are refused (413) before parsing; every
field is checked (versions: integers in [0, 2^53) or labels of at most 128 characters; ``bucket_bytes`` at least
``MIN_BUCKET_BYTES`` and at most ``MAX_BUCKETS`` buckets per answer; lists and strings capped), and every refusal,
aiohttp's own included, is a 4xx in the one error shape.

**Round ids**: the coordinator names each round with an id (``round_id`` in the bodies of pause, continue,
begin, verify, commit, abort and broadcast/receive). ``begin`` records it; a verify, commit, abort or receive
naming another id than the open round's is refused (409, naming both), so a late abort of an earlier round of
the same version never cancels the round that superseded it; a continue naming another round than the pause
that holds the engine is refused likewise. Calls without an id (tests, an operator by hand) are taken as before.
The engine remembers the last :data:`ENDED_ROUNDS_KEPT` ids of rounds that ended here (aborted, committed, or
resumed with no round of that id open) and refuses (409) a ``pause`` or ``begin`` naming one of them: a coordinator
that gave up on a slow call has resumed or aborted the engine already, so that call landing late would leave the
engine paused, or a round open, for nobody. A late pause still lands on live weights a round left dirty (they must
not serve anyway), and a resume with its own round open (the semantic gate scoring its canary) does not end it.
An abort saying ``"written": false`` (the coordinator asked no source to write) puts back whether the live
weights were dirty before the round's begin, so generation can continue.

**Versions only move forward**: a begin or commit of an integer version not newer than the integer version the
engine holds is refused (409); ``"default"`` (the initial weights) is older than every integer.

Run: ``python -m weightsync_testing.reference_engine.server --engine E --tp 2 --port P --seed S
--transport mooncake|memory --host 127.0.0.1``. Prints one JSON ready line on stdout; exits cleanly on
SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from weightsync.api import names
from weightsync.api.v1alpha1 import MAX_RANKS
from weightsync_agent.http.bounds import (
    MAX_BUCKETS,
    MAX_LABEL_CHARS,
    MAX_REQUEST_SECONDS,
    MAX_VERSION,
    MIN_BUCKET_BYTES,
    short,
)
from weightsync_agent.http.listener import CappedSite, bounded_runner
from weightsync_agent.http.server import (
    BackgroundServer,
    auth_middleware,
    bounded_app,
    error_response,
    http_exception_response,
    refuse_oversized,
)
from weightsync_agent.modes.broadcast.layout import Member
from weightsync_agent.transport.base import Transport, TransportError
from weightsync_testing.reference_engine.broadcast_receiver import BroadcastReceiver, Destination, Reception
from weightsync_testing.reference_engine.model import (
    DEFAULT_CONFIG,
    ModelConfig,
    RankWeights,
    forward_tp,
    full_state,
    greedy,
    local_state,
)
from weightsync_testing.reference_engine.rank_memory import RankMemory, VerifyResult

MODEL_PATH = "weightsync/reference-transformer"
PAUSE_MODES = ("abort", "retract", "in_place")
MAX_TOKENS = 4096  # prompt and completion together: greedy decoding recomputes the whole sequence per token
#: Generations waiting for the one forward thread; one more is answered 503 at once.
MAX_QUEUED_FORWARDS = 32
#: ``init_method`` (``tcp://host:port``) and ``backend`` of a broadcast join.
MAX_INIT_METHOD_CHARS = 512
#: A round id is the coordinator's uuid4 hex; anything much longer is not one.
MAX_ROUND_ID = 64
#: Ended round ids remembered to refuse their late pause or begin: a call arrives late by at most the coordinator's
#: HTTP timeout, during which it runs a round or two, not dozens.
ENDED_ROUNDS_KEPT = 64


log = logging.getLogger(__name__)


class EngineError(Exception):
    """A refused request: HTTP status, message and extra JSON fields."""

    def __init__(self, status: int, text: str, **extra: Any) -> None:
        super().__init__(text)
        self.status = status
        self.message = text
        self.extra = extra


@dataclass
class Round:
    version: str
    staged: bool
    verified: dict[int, VerifyResult] = field(default_factory=dict)
    reception: Reception | None = None  # broadcast mode: the latest receive of this round
    verify: bool = True  # False: the group set transfer.verify false; commit needs no checksums
    round_id: str | None = None  # the coordinator's id for the round; calls naming another are refused
    dirty_before: bool = False  # live_dirty before this round's begin (restored by an abort with nothing written)
    applied: bool = False  # the semantic gate's apply ran: the written weights may serve, unlabelled
    #: Per rank, the checksums its target verified against in this round: (bucket bytes, checksums).
    sums: dict[int, tuple[int, list[str]]] = field(default_factory=dict)


#: Bucket size of the checksums the engine takes of its own live weights (``clean_sums``).
CLEAN_BUCKET = 4 << 20


class ReferenceEngine:
    """The engine's state machine, without HTTP: every method is synchronous and raises EngineError."""

    def __init__(
        self,
        *,
        engine: int,
        tp: int,
        seed: int,
        transports: Sequence[Transport],
        config: ModelConfig = DEFAULT_CONFIG,
        weight_version: str = "default",
        transport_kind: str = "custom",
    ) -> None:
        if len(transports) != tp:
            raise ValueError(f"need one transport per rank: tp={tp}, got {len(transports)}")
        self.engine = engine
        self.tp = tp
        self.config = config
        self.transport_kind = transport_kind
        full = full_state(seed, config)
        self.weights = [RankWeights(tp, rank, config) for rank in range(tp)]
        for rank, weights in enumerate(self.weights):
            weights.load(local_state(full, tp, rank, config))
        self.memory: list[RankMemory] = []
        try:  # from here on the engine owns the transports: on failure, close them all
            for rank, weights in enumerate(self.weights):
                self.memory.append(RankMemory(weights, transports[rank], engine, rank))
        except Exception:
            for memory in self.memory:
                memory.close()
            for transport in transports[len(self.memory) :]:
                transport.close()
            raise
        self.weight_version = weight_version
        self.paused = False
        self.pause_mode: str | None = None
        self.paused_by: str | None = None  # the round id of the pause that holds the engine, if it named one
        #: Round ids that ended here (aborted, committed, resumed after their round): their late pause or begin is
        #: refused (the module's "Round ids").
        self.ended_rounds: deque[str] = deque(maxlen=ENDED_ROUNDS_KEPT)
        #: When the current pause began (monotonic), and how long the last finished one lasted: what a
        #: rollout client lost to a round, measured where it happens.
        self.paused_since: float | None = None
        self.last_pause_seconds: float | None = None
        self.pauses = 0
        self.live_dirty = False
        self.scrub_drifts = 0  # scrubs that found the live weights differing from the held version's checksums
        self.scrub_paused = False  # a scrub stopped generation; the commit that repairs the weights ends that pause
        #: Per rank, checksums of the live weights as they serve (bucket bytes, checksums): what an abort with
        #: nothing written re-verifies the live memory against before it may serve again. None: not known yet
        #: (computed at the next live begin, before the memory opens to writes).
        self.clean_sums: dict[int, tuple[int, list[str]]] | None = None
        self.round: Round | None = None
        self.broadcast: BroadcastReceiver | None = None
        self.shutting_down = False
        self.closed = False
        #: Held by a forward pass (off the event loop) and by whatever changes the served weights under it
        #: (commit's promotion, a pause's drain): a forward sees one version, all or nothing.
        self.compute = threading.Lock()
        self.forwards = ThreadPoolExecutor(1, thread_name_prefix=f"engine{engine}-forward")
        self.queued_forwards = 0

    # ----------------------------------------------------------------------------------- SGLang-shaped

    def transfer_engine_info(self, rank: int | None) -> dict[str, Any]:
        if rank is None or rank < 0:
            raise EngineError(400, "Missing or invalid rank parameter")
        if rank >= self.tp:
            raise EngineError(400, f"Failed to get transfer engine info for rank {rank}")
        memory = self.memory[rank]
        manifest = memory.manifest().model_dump(mode="json", by_alias=True)
        return {"rank": rank, "remote_instance_transfer_engine_info": [memory.session_id, manifest]}

    def pause(self, mode: str, round_id: str | None = None) -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise EngineError(400, f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        if round_id is not None and round_id in self.ended_rounds and (self.paused or not self.live_dirty):
            # Its coordinator gave up on this call and resumed or aborted the engine: pausing now would leave it
            # paused for nobody, or take the pause of the round now running. Only weights that must not serve and
            # still do (a gate's abort that came before its pause) are better paused by anyone.
            raise self._ended_round(round_id, "pause")
        # Requests here are synchronous, so nothing is in flight: abort, retract and in_place coincide.
        if not self.paused:
            self.paused_since = time.monotonic()
            self.pauses += 1
        self.paused, self.pause_mode, self.paused_by = True, mode, round_id
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, round_id: str | None = None) -> dict[str, Any]:
        if round_id is not None and self.paused_by is not None and round_id != self.paused_by:
            # A round that is over (its coordinator late or dead) must not unpause the round now writing.
            raise EngineError(
                409,
                f"round {round_id} cannot continue generation: round {self.paused_by} paused it",
                round=self.paused_by,
            )
        if self.live_dirty:
            raise EngineError(
                409,
                "live weights were written by an unfinished or aborted round; "
                "commit a verified version before continuing generation",
                weight_version=self.weight_version,
            )
        if self.paused_since is not None:
            self.last_pause_seconds = time.monotonic() - self.paused_since
            self.paused_since = None
        self.paused, self.pause_mode, self.paused_by = False, None, None
        if self.round is None or self.round.round_id != round_id:
            # Resumed with its round still open is the semantic gate scoring its canary: it may pause again.
            self._end_round(round_id)
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _end_round(self, round_id: str | None) -> None:
        if round_id is not None and round_id not in self.ended_rounds:
            self.ended_rounds.append(round_id)

    def _ended_round(self, round_id: str, call: str) -> EngineError:
        return EngineError(
            409,
            f"round {round_id} already ended on this engine (aborted, committed or resumed): its late {call} is "
            "refused",
            round_id=round_id,
        )

    def update_weight_version(self, new_version: str) -> dict[str, Any]:
        """SGLang's route; here it is a commit, so it cannot claim a version that was not verified."""
        if new_version == self.weight_version and not self.live_dirty and self.round is None:
            return {"success": True, "message": f"Weight version is {new_version}", "new_version": new_version}
        try:
            self.commit(new_version)
        except EngineError as exc:
            raise EngineError(400, exc.message, success=False, message=exc.message, **exc.extra) from exc
        return {"success": True, "message": f"Weight version updated to {new_version}", "new_version": new_version}

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": MODEL_PATH,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
        }

    def server_info(self) -> dict[str, Any]:
        return {
            "model_path": MODEL_PATH,
            "tp_size": self.tp,
            "pp_size": 1,
            "dp_size": 1,
            "ep_size": 1,
            "weight_version": self.weight_version,
            "version": "weightsync-reference",
            "engine": self.engine,
            "transport": self.transport_kind,
            "model_config": {k: v for k, v in vars(self.config).items()},
            "internal_states": [],
        }

    def forward(self, tokens: Sequence[int]) -> tuple[torch.Tensor, str]:
        """Logits of ``tokens`` and the version they came from. Blocking: call off the event loop."""
        with self.compute:
            version = self.weight_version
            try:
                return self._logits(tokens), version
            except ValueError as exc:
                raise EngineError(400, str(exc)) from exc

    def _logits(self, tokens: Sequence[int]) -> torch.Tensor:
        # Checked before every token: a pause (any mode) stops a running generation at its next token, so the
        # pause's drain waits one token, not a whole generation.
        if self.paused:
            raise EngineError(503, f"generation is paused (mode {self.pause_mode})", paused=True)
        return forward_tp([w.params for w in self.weights], tokens, self.config)

    def generate(self, input_ids: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
        """Greedy tokens. Blocking (holds :attr:`compute`): call off the event loop."""
        if not 0 <= max_new_tokens <= MAX_TOKENS - len(input_ids):
            raise EngineError(400, f"len(input_ids) + max_new_tokens must be at most {MAX_TOKENS}")
        with self.compute:
            version = self.weight_version
            try:
                output = greedy(self._logits, input_ids, max_new_tokens)
            except ValueError as exc:
                raise EngineError(400, str(exc)) from exc
        return {
            "output_ids": output,
            "meta_info": {
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(output),
                "finish_reason": {"type": "length", "length": max_new_tokens},
                "weight_version": version,
            },
        }

    async def run_forward(self, work: Callable[[], Any]) -> Any:
        """``work`` (a forward or a generation) on the forward thread; 503 when too many wait for it."""
        if self.queued_forwards >= MAX_QUEUED_FORWARDS:
            raise EngineError(503, f"{self.queued_forwards} generations are waiting already; retry later", busy=True)
        self.queued_forwards += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.forwards, work)
        finally:
            self.queued_forwards -= 1

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold :attr:`compute` on the event loop: waits (off the loop) for a running forward to end."""
        loop = asyncio.get_running_loop()
        acquired = loop.run_in_executor(None, self.compute.acquire)
        try:
            await asyncio.shield(acquired)
        except asyncio.CancelledError:  # the lock is still taken, later: give it back then
            acquired.add_done_callback(lambda _: self.compute.release())
            raise
        try:
            yield
        finally:
            self.compute.release()

    # ------------------------------------------------------------------------------------ weightsync

    def status(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "tp_size": self.tp,
            "weight_version": self.weight_version,
            "paused": self.paused,
            "pause_mode": self.pause_mode,
            "paused_by": self.paused_by,
            "pauses": self.pauses,
            "last_pause_seconds": self.last_pause_seconds,
            "staged": self.staged,
            "live_dirty": self.live_dirty,
            "scrub_drifts": self.scrub_drifts,
            "round": None
            if self.round is None
            else {
                "version": self.round.version,
                "staged": self.round.staged,
                "round_id": self.round.round_id,
                "verified": {str(r): v.ok for r, v in sorted(self.round.verified.items())},
            },
            "sessions": [m.session_id for m in self.memory],
            # Per rank: where the weights it computes with start (the manifest names the staging twin when staged).
            "live_addresses": [m.weights.buffer.data_ptr() for m in self.memory],
            # Per rank: whether its memory accepts transport writes now (only inside a round).
            "writable": [m.writable for m in self.memory],
            "broadcast": None if self.broadcast is None else self.broadcast.status(),
        }

    @property
    def staged(self) -> bool:
        return self.memory[0].staged

    def set_staged(self, enabled: bool) -> dict[str, Any]:
        if self.round is not None:
            raise EngineError(409, f"round for version {self.round.version} is open; commit or abort it first")
        for memory in self.memory:
            if enabled:
                memory.enable_staging()
            else:
                memory.disable_staging()
        return {"staged": self.staged}

    def begin(self, version: str, verify: bool = True, round_id: str | None = None) -> dict[str, Any]:
        """Open round ``version``, superseding any open round.

        A begin comes from the coordinator about to write. One that died mid-round leaves its round open
        and its successor must be able to start, with the same version or another. The new round starts
        with no rank verified (also when it repeats the open version), so its commit needs every rank
        verified after this begin: whatever the dead round wrote counts only if it hashes right then.
        ``verify=False`` (a group with ``transfer.verify: false``) lets the commit go without checksums:
        the user chose the transport's completion as the only evidence.
        """
        if round_id is not None and round_id in self.ended_rounds:
            # Its coordinator gave up on this call and aborted the round: opening it now would open the memory to
            # writes, and in live mode mark the weights dirty, for a round nobody runs.
            raise self._ended_round(round_id, "begin")
        current = self.round
        if current is not None and current.reception is not None and current.reception.running:
            # Its bytes would keep landing under the new round: wait for the receive to end.
            raise EngineError(409, f"version {current.version} is still being received over the broadcast group")
        if version == self.weight_version and not self.live_dirty:
            raise EngineError(409, f"engine already holds version {version}")
        self._check_newer(version)
        dirty_before = self.live_dirty
        if not self.staged:
            if not self.paused:
                raise EngineError(409, "live mode writes into the served weights: pause generation first")
            if not dirty_before and self.clean_sums is None:
                # Hashed while the memory takes no write yet: the reference an abort re-verifies against.
                self.clean_sums = {m.rank: (CLEAN_BUCKET, m.checksums(CLEAN_BUCKET)) for m in self.memory}
            self.live_dirty = True
        self._open_windows()
        self.round = Round(version, self.staged, verify=verify, round_id=round_id, dirty_before=dirty_before)
        resumed = current is not None and current.version == version
        superseded = current.version if current is not None and not resumed else None
        return {"version": version, "staged": self.staged, "resumed": resumed, "superseded": superseded}

    def verify(
        self, rank: int, version: str, bucket_bytes: int, checksums: list[str], round_id: str | None = None
    ) -> dict[str, Any]:
        self._check_buckets_of(rank, bucket_bytes, checksums, "verify")
        current = self._open_round(version, round_id)
        memory = self.memory[rank]
        close_failure = self._close_window_of(memory)
        received = None if current.reception is None else current.reception.error_for(rank)
        if close_failure is not None:  # still open to writes: bytes that hash right now may not be what commits
            result = VerifyResult(rank, bucket_bytes, 0, error=close_failure, staged=current.staged)
        elif received is not None:  # broadcast: this rank does not hold the round, whatever its bytes hash to
            result = VerifyResult(rank, bucket_bytes, 0, error=received, staged=current.staged)
        else:
            result = memory.verify(bucket_bytes, checksums)
        if not result.ok:
            result = self._reopen_window_of(memory, result)
        current.verified[rank] = result  # the LAST verify of a rank is what commit looks at
        if result.ok:
            current.sums[rank] = (bucket_bytes, list(checksums))
        else:
            current.sums.pop(rank, None)
        return {"version": version, **result.to_json()}

    def _no_round(self, version: str) -> EngineError:
        open_version = None if self.round is None else self.round.version
        return EngineError(409, f"no open round for version {version}", round=open_version)

    def _open_round(self, version: str, round_id: str | None) -> Round:
        """The open round a call for ``version`` (from round ``round_id``, if it names one) addresses."""
        current = self.round
        if current is None or current.version != version:
            raise self._no_round(version)
        if round_id is not None and round_id != current.round_id:
            raise EngineError(
                409,
                f"round id mismatch: the open round of version {version} is {current.round_id}, this call is from "
                f"round {round_id} (an earlier or foreign round)",
                round=current.version,
                round_id=current.round_id,
            )
        return current

    def scrub(self, rank: int, version: str, bucket_bytes: int, checksums: list[str]) -> dict[str, Any]:
        """Scrubbing (docs/agent.md): does ``rank``'s live memory still hash to ``checksums``, the ones that verified
        the held ``version``? A drift stops generation at once and marks the weights dirty, so they are not served
        again until a round writes and verifies them (a repair of ``version`` is then allowed: see begin)."""
        self._check_buckets_of(rank, bucket_bytes, checksums, "scrub")
        if self.round is not None:
            raise EngineError(409, f"round {self.round.version} is open: scrubbing waits for it to end")
        if version != self.weight_version:
            raise EngineError(409, f"this engine holds version {self.weight_version}, not {version}")
        result = self.memory[rank].verify(bucket_bytes, checksums, served=True)
        if not result.ok:
            self.live_dirty = True
            self.pause("abort")  # nothing is served from weights known to differ from the version's
            self.scrub_paused = True
            self.scrub_drifts += 1
        return {"version": version, **result.to_json()}

    def _check_buckets_of(self, rank: int, bucket_bytes: int, checksums: list[str], what: str) -> None:
        """A verify's or a scrub's rank, bucket size and checksum count are ones this engine can check."""
        if not 0 <= rank < self.tp:
            raise EngineError(400, f"rank {rank} outside tp={self.tp}")
        check_buckets(bucket_bytes, self.weights[rank].nbytes)
        if len(checksums) > MAX_BUCKETS:
            raise EngineError(400, f"at most {MAX_BUCKETS} checksums per {what}, got {len(checksums)}")

    def _check_newer(self, version: str) -> None:
        """Versions only move forward: refuse an integer version not newer than the integer one held (the held one
        again only to repair live weights a failed round left dirty)."""
        held = self.weight_version
        if not (version.isdigit() and held.isdigit()):
            return
        if int(version) < int(held) or (int(version) == int(held) and not self.live_dirty):
            raise EngineError(409, f"version {version} is not newer than the version this engine holds ({held})")

    def apply(self, version: str, round_id: str | None = None) -> dict[str, Any]:
        """The semantic gate's apply (docs/agent.md): the open live round's verified weights may serve (generation can
        continue, to score the canary) while the label stays; the round stays open for its commit, the label. An
        abort after it marks the weights dirty again (they are a version nobody labelled)."""
        current = self._open_round(version, round_id)
        if current.staged:
            raise EngineError(409, "a staged round's weights serve only from its commit: the gate needs live staging")
        self._check_committable(current)
        current.applied = True
        self.live_dirty = False
        return {"success": True, "weight_version": self.weight_version}

    def _check_committable(self, current: Round) -> None:
        version = current.version
        self._check_newer(version)
        if current.reception is not None and current.reception.running:
            raise EngineError(409, f"version {version} is still being received over the broadcast group")
        unverified = [r for r in range(self.tp) if r not in current.verified] if current.verify else []
        failed = [r for r, result in sorted(current.verified.items()) if not result.ok]
        if unverified or failed:
            raise EngineError(
                409,
                f"version {version} is not verified on every rank (unverified {unverified}, failed {failed})",
                unverified_ranks=unverified,
                failed_ranks=failed,
            )

    def commit(self, version: str, round_id: str | None = None) -> dict[str, Any]:
        current = self._open_round(version, round_id)
        self._check_committable(current)
        # No await from here to the end: forward runs on the same event loop, so it sees all or nothing.
        if current.staged:
            for memory in self.memory:
                memory.promote()
            if self.scrub_paused:  # a staged round does not pause or resume: the repair it was ends the scrub's pause
                self.paused, self.pause_mode, self.paused_by = False, None, None
        self.scrub_paused = False
        self.weight_version = version
        self.live_dirty = False
        # What now serves is what every rank verified (a round without checksums: hashed at the next begin).
        self.clean_sums = dict(current.sums) if len(current.sums) == self.tp else None
        self.round = None
        self._close_windows()
        self._end_round(current.round_id)
        return {"success": True, "weight_version": version}

    def _open_windows(self) -> None:
        """Writable from now until commit or abort (rank_memory's "Write window"): Mooncake refuses every
        write into memory that is not registered, so between rounds no peer, credential or not, lands a byte."""
        try:
            for memory in self.memory:
                memory.open_window()
        except TransportError as exc:
            self._close_windows()
            raise EngineError(500, f"could not open the ranks' memory to writes: {exc}") from exc

    def _close_window_of(self, memory: RankMemory) -> str | None:
        """Close one rank's memory to writes before its check, so what the check sees is what a commit labels;
        why it could not be closed, or None."""
        try:
            memory.close_window()
        except TransportError as exc:
            log.exception("engine %d rank %d: could not unregister its memory", self.engine, memory.rank)
            return f"could not close rank {memory.rank}'s memory to writes before verifying it: {exc}"
        return None

    def _reopen_window_of(self, memory: RankMemory, failed: VerifyResult) -> VerifyResult:
        """After a failed check the coordinator's retry has the sources write the rank again, at the addresses
        their manifests name: the buffers never moved, so registering them again makes those addresses writable."""
        try:
            memory.open_window()
        except TransportError as exc:
            log.exception("engine %d rank %d: could not register its memory again", self.engine, memory.rank)
            why = failed.error or f"buckets {[m.index for m in failed.mismatched]} differ"
            return dataclasses.replace(failed, error=f"{why}; its memory could not be opened to writes again: {exc}")
        return failed

    def _close_windows(self) -> None:
        for memory in self.memory:
            try:
                memory.close_window()
            except TransportError:
                log.exception("engine %d rank %d: could not unregister its memory", self.engine, memory.rank)

    def abort(self, version: str | None, round_id: str | None = None, *, written: bool = True) -> dict[str, Any]:
        """Close the open round. ``written=False``: the coordinator asked no source to write in it, so the live
        weights are as dirty as they were before its begin (a clean engine may continue generating)."""
        # An abort is the coordinator giving its round up, also when it finds nothing to close here (its begin may
        # still be on the way) or another round open: whatever of that round lands late is refused.
        self._end_round(round_id)
        current = self.round
        if current is None:
            return {"aborted": None, "live_dirty": self.live_dirty, "weight_version": self.weight_version}
        if version is not None and version != current.version:
            raise EngineError(409, f"open round is for version {current.version}, not {version}")
        if round_id is not None and round_id != current.round_id:
            raise EngineError(
                409,
                f"round id mismatch: the open round of version {current.version} is {current.round_id}, this abort "
                f"is from round {round_id}; the open round goes on",
                round=current.version,
                round_id=current.round_id,
            )
        if written and current.applied:
            self.live_dirty = True  # the gate applied them, then failed: they serve no more until a round lands
        self.round = None
        self._close_windows()
        self._end_round(current.round_id)
        drifted: list[int] = []
        if not written and current.reception is None:
            # No source was asked to write, but in live mode the memory took writes from the begin: anyone who
            # reached the transport could have written it. It serves again only if it still holds, bucket for
            # bucket, what served before (checked after the window closed: no write lands during the check).
            drifted = [] if current.staged else self._drifted_ranks()
            self.live_dirty = current.dirty_before or bool(drifted)
        # Staged: the live weights were never touched; the staging bytes are simply overwritten next round.
        return {"aborted": current.version, "live_dirty": self.live_dirty, "weight_version": self.weight_version,
                "drifted_ranks": drifted}  # fmt: skip

    def _drifted_ranks(self) -> list[int]:
        """The ranks whose live memory no longer holds :attr:`clean_sums` (every rank when those are unknown)."""
        if self.clean_sums is None:
            return list(range(self.tp))
        drifted = [rank for rank, (bucket, sums) in sorted(self.clean_sums.items())
                   if not self.memory[rank].verify(bucket, sums).ok]  # fmt: skip
        if drifted:
            log.warning("engine %d: ranks %s changed while open to writes in a round that wrote nothing; they "
                        "serve no more until a round lands", self.engine, drifted)  # fmt: skip
        return drifted

    # ---------------------------------------------------------------------------------- broadcast mode

    def join_broadcast(
        self, members: Sequence[Member], *, world_size: int, init_method: str, backend: str, timeout_seconds: float
    ) -> dict[str, Any]:
        """Join (or re-join) the broadcast group. Blocks until the whole world has joined: call off the loop."""
        filled = sorted(r for m in members for r in m.ranks)
        if filled != list(range(self.tp)):
            raise EngineError(400, f"members must fill every rank 0..{self.tp - 1} exactly once, got {filled}")
        if self.broadcast is not None and self.broadcast.busy:
            raise EngineError(409, "a broadcast round is still being received; join again when it has ended")
        old, self.broadcast = self.broadcast, None
        if old is not None:
            old.close()
        try:
            receiver = BroadcastReceiver(
                members,
                world_size=world_size,
                init_method=init_method,
                backend=backend,
                timeout_seconds=timeout_seconds,
            )
        except (TransportError, ValueError) as exc:
            raise EngineError(502, f"could not join the broadcast group: {exc}") from exc
        self.broadcast = receiver
        return {"joined": True, **receiver.status()}

    def receive_broadcast(self, version: str, round_id: str | None = None) -> dict[str, Any]:
        """Start receiving the open round's version over the broadcast group (returns at once)."""
        current = self._open_round(version, round_id)
        if self.broadcast is None:
            raise EngineError(409, "not in a broadcast group: POST /weightsync/broadcast first")
        try:
            number = int(version)
        except ValueError as exc:
            raise EngineError(400, f"broadcast rounds carry integer versions, not {version!r}") from exc
        destinations = {}
        for rank, memory in enumerate(self.memory):
            buffer = memory.staging if memory.staging is not None else self.weights[rank].buffer
            destinations[rank] = Destination(memory.manifest().tensors, self.weights[rank].views(buffer))
        try:
            current.reception = self.broadcast.receive(number, destinations)
        except TransportError as exc:
            raise EngineError(409, str(exc)) from exc
        current.verified.clear()  # earlier verifies were of bytes this receive overwrites
        return {"receiving": version, "staged": current.staged}

    def pending_reception(self) -> Reception | None:
        reception = None if self.round is None else self.round.reception
        return reception if reception is not None and reception.running else None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.broadcast is not None:
            self.broadcast.close()
        for memory in self.memory:
            memory.close()
        self.forwards.shutdown(wait=False, cancel_futures=True)


def check_buckets(bucket_bytes: int, nbytes: int) -> None:
    """A checksum request's bucket size: at least MIN_BUCKET_BYTES, and at most MAX_BUCKETS buckets of the rank
    (one 64-bit checksum, about 19 bytes of JSON, per bucket: ``bucket_bytes=1`` made an answer 20 times the size
    of the rank it describes; from MIN_BUCKET_BYTES on an answer is at most a third of it)."""
    if bucket_bytes < MIN_BUCKET_BYTES:
        raise EngineError(400, f"bucket_bytes must be at least {MIN_BUCKET_BYTES}, got {bucket_bytes}")
    if -(-nbytes // bucket_bytes) > MAX_BUCKETS:
        raise EngineError(
            400, f"bucket_bytes {bucket_bytes} cuts this rank's {nbytes} bytes into more than {MAX_BUCKETS} buckets"
        )


# ------------------------------------------------------------------------------------------------- HTTP


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    refuse_oversized(request)
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(400, f"invalid JSON body: {exc}") from exc
    except RecursionError:
        raise EngineError(400, "invalid JSON body: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EngineError(400, "request body must be a JSON object")
    return data


def _bucket_checksums(body: dict[str, Any]) -> list[str]:
    """A verify's or a scrub's ``checksums``: at most :data:`MAX_BUCKETS` xxh3-64 hex strings."""
    checksums = body.get("checksums")
    if not isinstance(checksums, list) or len(checksums) > MAX_BUCKETS:
        raise EngineError(400, f"checksums must be a list of at most {MAX_BUCKETS} xxh3-64 hex strings")
    if not all(isinstance(c, str) and len(c) <= 32 for c in checksums):
        raise EngineError(400, "checksums must be a list of xxh3-64 hex strings")
    return checksums


def _int(value: Any, what: str, low: int = 0, high: int = MAX_VERSION) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise EngineError(400, f"{what} must be an integer in [{low}, {high}], got {short(value)}")
    return value


def _version(value: Any, what: str = "version") -> str:
    """A version label: an integer in [0, 2^53) or a non-empty string of at most MAX_LABEL_CHARS characters."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(_int(value, what))
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LABEL_CHARS:
        raise EngineError(400, f"{what} must be a non-empty string of at most {MAX_LABEL_CHARS} characters")
    return value


def _round_id(body: dict[str, Any]) -> str | None:
    value = body.get("round_id")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ROUND_ID:
        raise EngineError(400, f"round_id must be a string of 1 to {MAX_ROUND_ID} characters")
    return value


def _token_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value or len(value) > MAX_TOKENS:
        raise EngineError(400, f"{what} must be a non-empty list of at most {MAX_TOKENS} token ids")
    return [_int(v, what) for v in value]


def _text(value: Any, what: str, limit: int) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise EngineError(400, f"{what} must be a non-empty string of at most {limit} characters")
    return value


def _query_rank(request: web.Request) -> int | None:
    raw = request.query.get("rank")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


#: Open even when the engine has a token: probes, what a serving client reads, and inference (no weights leave,
#: nothing changes). Everything else (pause, resume, flush, version, the ``/weightsync/`` round routes, the
#: transfer info naming the weights' addresses) needs the credential.
OPEN_ROUTES: tuple[str, ...] = (
    "/health",
    "/health_generate",
    "/model_info",
    "/get_model_info",
    "/weight_version",
    "/get_weight_version",
    "/server_info",
    "/get_server_info",
    "/generate",
)


def build_app(engine: ReferenceEngine, token: str | None = None) -> web.Application:
    """The aiohttp application serving ``engine``; with ``token``, every route but :data:`OPEN_ROUTES` needs it."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except EngineError as exc:
            return error_response(exc.status, exc.message, **exc.extra)
        except web.HTTPException as exc:
            return http_exception_response(exc)

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=503 if engine.shutting_down else 200)

    async def transfer_info(request: web.Request) -> web.Response:
        return web.json_response(engine.transfer_engine_info(_query_rank(request)))

    async def pause(request: web.Request) -> web.Response:
        body = await _body(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise EngineError(400, f"Invalid mode: {short(mode)}. Expected one of {list(PAUSE_MODES)}.")
        answer = engine.pause(mode, _round_id(body))
        async with engine.exclusive():  # a running generation stops at its next token: then nothing runs
            pass
        return web.json_response(answer)

    async def resume(request: web.Request) -> web.Response:
        body = await _body(request)
        return web.json_response(engine.resume(_round_id(body)))

    async def update_version(request: web.Request) -> web.Response:
        body = await _body(request)
        return web.json_response(engine.update_weight_version(_version(body.get("new_version"), "new_version")))

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response(engine.model_info())

    async def weight_version(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": engine.weight_version})

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response(engine.server_info())

    async def flush_cache(_: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n")

    async def generate(request: web.Request) -> web.Response:
        body = await _body(request)
        if "input_ids" not in body:
            raise EngineError(400, "this engine has no tokenizer: send input_ids")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise EngineError(400, "sampling_params must be an object")
        max_new = _int(params.get("max_new_tokens", 16), "max_new_tokens", 0, MAX_TOKENS)
        tokens = _token_list(body["input_ids"], "input_ids")
        if engine.paused:  # refused at once, without queueing behind a running generation
            raise EngineError(503, f"generation is paused (mode {engine.pause_mode})", paused=True)
        return web.json_response(await engine.run_forward(functools.partial(engine.generate, tokens, max_new)))

    async def status(_: web.Request) -> web.Response:
        return web.json_response(engine.status())

    async def stage(request: web.Request) -> web.Response:
        body = await _body(request)
        enabled = body.get("enabled")
        if not isinstance(enabled, bool):
            raise EngineError(400, "enabled must be true or false")
        return web.json_response(engine.set_staged(enabled))

    async def begin(request: web.Request) -> web.Response:
        body = await _body(request)
        verify = body.get("verify", True)
        if not isinstance(verify, bool):
            raise EngineError(400, "verify must be true or false")
        return web.json_response(engine.begin(_version(body.get("version")), verify, _round_id(body)))

    async def verify(request: web.Request) -> web.Response:
        body = await _body(request)
        checksums = _bucket_checksums(body)
        reception = engine.pending_reception()
        if reception is not None and engine.broadcast is not None:
            # The sender is done when verify comes; this rank may still be cutting the last bucket.
            received = asyncio.shield(asyncio.wrap_future(reception.done))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(received, engine.broadcast.timeout_seconds)
        result = engine.verify(
            _int(body.get("rank"), "rank", 0, engine.tp - 1),
            _version(body.get("version")),
            _int(body.get("bucket_bytes"), "bucket_bytes", 1),
            checksums,
            _round_id(body),
        )
        return web.json_response(result)

    async def apply(request: web.Request) -> web.Response:
        body = await _body(request)
        async with engine.exclusive():
            return web.json_response(engine.apply(_version(body.get("version")), _round_id(body)))

    async def commit(request: web.Request) -> web.Response:
        body = await _body(request)
        version = _version(body.get("version"))
        round_id = _round_id(body)
        async with engine.exclusive():  # staged: the promotion never lands under a running forward
            return web.json_response(engine.commit(version, round_id))

    async def abort(request: web.Request) -> web.Response:
        body = await _body(request)
        raw = body.get("version")
        written = body.get("written", True)
        if not isinstance(written, bool):
            raise EngineError(400, "written must be true or false")
        return web.json_response(engine.abort(None if raw is None else _version(raw), _round_id(body), written=written))

    async def join_broadcast(request: web.Request) -> web.Response:
        body = await _body(request)
        raw_members = body.get("members")
        if not isinstance(raw_members, list) or not 0 < len(raw_members) <= engine.tp:
            raise EngineError(400, f"members must be a non-empty list of at most {engine.tp} {{group_rank, ranks}}")
        world_size = _int(body.get("world_size"), "world_size", 1, MAX_RANKS + 1)
        members = []
        for raw in raw_members:
            if not isinstance(raw, dict) or not isinstance(raw.get("ranks"), list) or len(raw["ranks"]) > engine.tp:
                raise EngineError(400, f"each member is {{group_rank: int, ranks: [at most {engine.tp} ints]}}")
            ranks = tuple(_int(r, "members[].ranks[]", 0, engine.tp - 1) for r in raw["ranks"])
            members.append(Member(_int(raw.get("group_rank"), "members[].group_rank", 0, world_size - 1), ranks))
        init_method = _text(body.get("init_method"), "init_method", MAX_INIT_METHOD_CHARS)
        backend = _text(body.get("backend", "auto"), "backend", 32)
        timeout = body.get("timeout_seconds", 300)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_REQUEST_SECONDS:
            raise EngineError(400, f"timeout_seconds must be a number in (0, {MAX_REQUEST_SECONDS:.0f}]")
        join = functools.partial(
            engine.join_broadcast,
            members,
            world_size=world_size,
            init_method=init_method,
            backend=backend,
            timeout_seconds=float(timeout),
        )
        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, join))

    async def receive_broadcast(request: web.Request) -> web.Response:
        body = await _body(request)
        return web.json_response(engine.receive_broadcast(_version(body.get("version")), _round_id(body)))

    async def scrub(request: web.Request) -> web.Response:
        body = await _body(request)
        checksums = _bucket_checksums(body)
        rank = _int(body.get("rank"), "rank", 0, engine.tp - 1)
        bucket_bytes = _int(body.get("bucket_bytes"), "bucket_bytes", 1)
        return web.json_response(engine.scrub(rank, _version(body.get("version")), bucket_bytes, checksums))

    async def checksums(request: web.Request) -> web.Response:
        rank = _query_rank(request)
        if rank is None or not 0 <= rank < engine.tp:
            raise EngineError(400, f"rank must be one of 0..{engine.tp - 1}")
        try:
            bucket_bytes = int(request.query.get("bucket_bytes", ""))
        except ValueError:
            raise EngineError(400, "bucket_bytes must be an integer") from None
        check_buckets(bucket_bytes, engine.weights[rank].nbytes)
        return web.json_response({"rank": rank, "checksums": engine.memory[rank].checksums(bucket_bytes)})

    async def forward(request: web.Request) -> web.Response:
        body = await _body(request)
        tokens = _token_list(body.get("tokens"), "tokens")
        if engine.paused:
            raise EngineError(503, f"generation is paused (mode {engine.pause_mode})", paused=True)
        logits, version = await engine.run_forward(functools.partial(engine.forward, tokens))
        return web.json_response(
            {"logits": logits.tolist(), "next_token": int(logits[-1].argmax()), "weight_version": version}
        )

    middlewares = [errors] if not token else [auth_middleware(token, open_routes=OPEN_ROUTES), errors]
    app = bounded_app(middlewares)
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/health_generate", health),
            web.get("/remote_instance_transfer_engine_info", transfer_info),
            web.get("/get_remote_instance_transfer_engine_info", transfer_info),
            web.post("/pause_generation", pause),
            web.post("/continue_generation", resume),
            web.post("/update_weight_version", update_version),
            web.get("/model_info", model_info),
            web.get("/get_model_info", model_info),
            web.get("/weight_version", weight_version),
            web.get("/get_weight_version", weight_version),
            web.get("/server_info", server_info),
            web.get("/get_server_info", server_info),
            web.get("/flush_cache", flush_cache),
            web.post("/flush_cache", flush_cache),
            web.post("/generate", generate),
            web.get("/weightsync/status", status),
            web.post("/weightsync/stage", stage),
            web.post("/weightsync/begin", begin),
            web.post("/weightsync/verify", verify),
            web.post("/weightsync/commit", commit),
            web.post("/weightsync/apply", apply),
            web.post("/weightsync/abort", abort),
            web.post("/weightsync/forward", forward),
            web.get("/weightsync/checksums", checksums),
            web.post("/weightsync/scrub", scrub),
            web.post("/weightsync/broadcast", join_broadcast),
            web.post("/weightsync/broadcast/receive", receive_broadcast),
        ]
    )
    return app


def serve_in_thread(
    engine: ReferenceEngine, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None
) -> BackgroundServer:
    """``engine``'s app on a :class:`BackgroundServer` (not started): tests and in-process transports."""
    return BackgroundServer(build_app(engine, token), host, port, name="reference-engine")


# ------------------------------------------------------------------------------------------- transports


def make_transport(
    kind: str,
    *,
    host: str,
    protocol: str = "tcp",
    devices: str = "",
    force_tcp: bool = False,
    timeout_seconds: float = 30.0,
    ports: tuple[int, int] | None = None,
) -> Transport:
    """A fresh transport session of ``kind`` (``mooncake`` or ``memory``) for one engine rank. ``ports``: Mooncake's
    port range (None: MC_MIN_RPC_PORT/MC_MAX_RPC_PORT from the environment, as the operator sets them)."""
    if kind == "mooncake":
        from weightsync_agent.transport.mooncake import MooncakeTransport

        return MooncakeTransport(
            host, protocol, devices, force_tcp=force_tcp, timeout_seconds=timeout_seconds, ports=ports
        )
    if kind == "memory":
        from weightsync_agent.transport.memory import MemoryTransport

        return MemoryTransport(timeout_seconds=timeout_seconds)
    raise ValueError(f"unknown transport {kind!r} (mooncake or memory)")


# ------------------------------------------------------------------------------------------------- main


def port_range(text: str) -> tuple[int, int]:
    start, sep, end = text.partition("-")
    if not sep or not start.isdigit() or not end.isdigit():
        raise argparse.ArgumentTypeError(f"want START-END, got {text!r}")
    return int(start), int(end)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="weightsync-reference-engine", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--engine", type=int, required=True, help="engine index")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks in this engine")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: pick a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address and transport host")
    parser.add_argument(
        "--rank-hosts",
        default="",
        help="transport host per rank, comma-separated (default: --host for every rank; the testbed puts each "
        "rank on its own emulated node link)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights (full_state(seed))")
    parser.add_argument("--weight-version", default="default", help="version label of the initial weights")
    parser.add_argument("--transport", choices=("mooncake", "memory"), default="mooncake")
    parser.add_argument("--protocol", choices=("tcp", "rdma", "auto"), default="tcp", help="Mooncake protocol")
    parser.add_argument("--devices", default="", help="Mooncake device names (RDMA NICs), comma-separated")
    parser.add_argument("--force-tcp", action="store_true", help="TCP even where Mooncake finds RDMA NICs")
    parser.add_argument("--transfer-timeout", type=float, default=30.0, help="transport timeout, seconds")
    parser.add_argument(
        "--mooncake-ports",
        type=port_range,
        default=None,
        metavar="START-END",
        help="where Mooncake listens (default: MC_MIN_RPC_PORT/MC_MAX_RPC_PORT, else Mooncake's 15000-17000)",
    )
    parser.add_argument("--staged", action="store_true", help="start in staged mode")
    parser.add_argument("--layers", type=int, default=DEFAULT_CONFIG.num_layers, help="transformer blocks")
    parser.add_argument(
        "--model-config",
        type=json.loads,
        default={},
        help='more ModelConfig fields as JSON, e.g. \'{"hidden_size": 1024, "head_dim": 128}\' (benchmarks)',
    )
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> int:
    config = ModelConfig(**{"num_layers": args.layers, **args.model_config})
    transports: list[Transport] = []
    rank_hosts = [h.strip() for h in args.rank_hosts.split(",") if h.strip()] or [args.host] * args.tp
    if len(rank_hosts) != args.tp:
        raise SystemExit(f"--rank-hosts names {len(rank_hosts)} hosts for tp={args.tp}")
    try:
        for rank in range(args.tp):
            transports.append(
                make_transport(
                    args.transport,
                    host=rank_hosts[rank],
                    protocol=args.protocol,
                    devices=args.devices,
                    force_tcp=args.force_tcp,
                    timeout_seconds=args.transfer_timeout,
                    ports=args.mooncake_ports,
                )
            )
    except Exception:
        for transport in transports:
            transport.close()
        raise
    engine = ReferenceEngine(
        engine=args.engine,
        tp=args.tp,
        seed=args.seed,
        transports=transports,
        config=config,
        weight_version=args.weight_version,
        transport_kind=args.transport,
    )
    token = os.environ.get(names.ENV_GROUP_TOKEN) or None
    if token is None:
        print("warning: no WEIGHTSYNC_GROUP_TOKEN: every route of this engine is open", file=sys.stderr, flush=True)
    runner = bounded_runner(build_app(engine, token))  # the agents' header-read bound and connection cap
    try:
        if args.staged:
            engine.set_staged(True)
        await runner.setup()
        site = CappedSite(runner, args.host, args.port)
        await site.start()
        port = site.port
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        ready = {
            "event": "ready",
            "engine": args.engine,
            "tp": args.tp,
            "url": f"http://{args.host}:{port}",
            "port": port,
            "pid": os.getpid(),
            "transport": args.transport,
            "sessions": [m.session_id for m in engine.memory],
            "weight_version": engine.weight_version,
            "staged": engine.staged,
        }
        print(json.dumps(ready), flush=True)
        await stop.wait()
        engine.shutting_down = True
    finally:
        await runner.cleanup()
        engine.close()
    print(json.dumps({"event": "stopped", "engine": args.engine}), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
