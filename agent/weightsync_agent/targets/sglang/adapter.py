"""The stock-SGLang adapter: SGLang as it ships, driven through its own routes; no engine patches.

SGLang publishes its live weights for one-sided writes when started with
``--remote-instance-weight-loader-start-seed-via-transfer-engine`` (docs/engines/sglang.md). A round:

| step | SGLang route |
|---|---|
| pause | ``POST /pause_generation {"mode": "retract"}``, then ``/flush_cache?timeout=…`` |
| begin | ``POST /begin_weight_update`` (a session left open by a failed round is closed first) |
| write | one-sided Mooncake writes into the published live weights |
| verify | ``POST /weights_checker {"action": "checksum"}``: every written parameter of the rank, matched by TP rank |
| rebind | a model whose manifests list ``rederived`` buffers (Gemma-2's ``gemma_weight``): ``POST
/update_weights_from_tensor`` with weightsync's custom weight loader and no tensors, so that SGLang re-derives them |
| commit | ``POST /end_weight_update``, then ``POST /update_weight_version`` — only after a verified round |
| resume | ``POST /continue_generation`` |
| abort | ``POST /end_weight_update`` to close the session; the version is never relabelled, the engine stays paused |

Broadcast mode (``transfer.mode: broadcast``) replaces the write step: every TP rank joins the trainer's torch
custom process group through ``/init_weights_update_group`` (one group rank per TP rank), and per chunk
``/update_weights_from_distributed`` receives the full HF tensors and runs SGLang's own ``load_weights`` (it
cuts its shards); the rest of the round is the same, verified against hashes the sender cut from the full
tensors. ``/destroy_weights_update_group`` leaves a group after a failure.

There is no staging area in stock SGLang: live mode only. Manifests: the engine's own pod traces the
model with the engine's SGLang code (``weightsync_engine/sglang/trace_model.py``) and joins the trace with the published
addresses (:mod:`.manifest`); everyone else fetches them from that pod's agent.
"""

from __future__ import annotations

import base64
import pickle
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import urlparse

from weightsync.api.engines import ENGINE_KINDS, Capabilities
from weightsync_agent.http.client import HttpCallError
from weightsync_agent.layout import replica_manifest
from weightsync_agent.layout.checksums import COMPARED_WITH_WEIGHT
from weightsync_agent.layout.manifest import Manifest, ManifestError
from weightsync_agent.targets.adapter import (
    AdapterSettings,
    BroadcastReception,
    FullTensor,
    Readiness,
    TargetVerdict,
    rank_offset,
)
from weightsync_agent.targets.engine_agent_calls import fetch_manifest
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_agent.targets.engine_trace import run_replica_layout, run_trace
from weightsync_agent.targets.pass_checksums import PassChecksums
from weightsync_agent.targets.sglang.manifest import (
    REBIND_LOADER,
    TraceRefusedError,
    assemble,
    checksum_scheme,
    rebinds,
)
from weightsync_agent.targets.sglang.parallelism import Parallelism

FLUSH_RETRY_SECONDS = 0.2
INIT_GROUP_ROUTE = "/init_weights_update_group"
UPDATE_ROUTE = "/update_weights_from_distributed"
REBIND_ROUTE = "/update_weights_from_tensor"
#: One TP rank's empty tensor list as SGLang's MultiprocessingSerializer writes it (a ForkingPickler pickle of ``[]``,
#: base64): SGLang's ``SafeUnpickler`` reads it back as ``[]``, so the custom weight loader gets no tensors.
EMPTY_TENSORS = base64.b64encode(pickle.dumps([], protocol=4)).decode("ascii")
NOT_PUBLISHING = (
    "SGLang does not publish its weights for one-sided writes: start it with "
    "--remote-instance-weight-loader-start-seed-via-transfer-engine and a per-instance "
    "--engine-info-bootstrap-port (SGLang turns the flag off with only a warning when the mooncake package "
    "is not importable in the engine image, or with --enable-memory-saver)"
)


class RoundMismatchError(HttpCallError):
    """A call from another round than the one this process last opened on the engine (never sent to SGLang)."""


#: Per SGLang URL, the round this process last paused or began there. Stock SGLang has no round-id field, so
#: the id is kept here, client-side: a late call of an earlier round (its driver's abort or resume, still in
#: flight after the round gave up) is refused before it reaches the engine. It lives in the coordinator's
#: process only: a call from a coordinator process that died is not stopped (docs/engines/sglang.md).
_OPEN_ROUNDS: dict[str, str] = {}
_OPEN_ROUNDS_LOCK = threading.Lock()
#: Engine URL -> the version a scrub found drifted on it: the next round may write that version again (a repair;
#: versions otherwise only move forward). Process-wide for the same reason as :data:`_OPEN_ROUNDS`.
_REPAIRS: dict[str, int] = {}


class SglangAdapter:
    kind: ClassVar[str] = "sglang"
    capabilities: ClassVar[Capabilities] = ENGINE_KINDS["sglang"].capabilities  # type: ignore[assignment]
    manifests_from_engine_agent: ClassVar[bool] = True  # SGLang publishes addresses only: its pod's agent traces
    #: Every TP rank joins the trainer's group itself and receives full HF tensors, which SGLang's own
    #: load_weights cuts into its shards (/init_weights_update_group, /update_weights_from_distributed).
    broadcast: ClassVar[BroadcastReception] = BroadcastReception("rank", "announced-tensors")
    #: The semantic gate (``GatedRound``) in live rounds only: stock SGLang has no staging area.
    gate_stagings: ClassVar[frozenset[str]] = frozenset({"live"})

    def __init__(self, settings: AdapterSettings) -> None:
        self.settings = settings
        self.client = EngineClient(settings.url, timeout=settings.call_timeout, api_key=settings.api_key)
        self.name = f"engine {settings.engine} (SGLang at {self.client.base_url})"
        self._manifests: dict[int, Manifest] = {}
        self._applied: str | None = None  # the round whose apply ended the session (its commit only labels)
        self._sums: PassChecksums[dict[int, dict[str, str]]] = PassChecksums()  # tp rank -> name -> hash, per pass
        self._traces: dict[int, dict[str, Any]] = {}
        self._layouts: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SglangAdapter({self.name})"

    # --- Discovery and readiness -------------------------------------------------------------------

    def manifest(self, rank: int) -> Manifest:
        manifest = self._assemble(rank) if self.settings.engine_side else self._fetch(rank)
        self._manifests[rank] = manifest
        return manifest

    def held_version(self, timeout: float | None = None) -> str | None:
        return self.client.weight_version(timeout=timeout)

    def healthy(self, timeout: float) -> bool:
        return self.client.health(timeout)

    def readiness(self) -> Readiness:
        try:
            manifests = [self.manifest(rank) for rank in range(self.settings.ranks)]
        except HttpCallError as exc:
            if exc.status == 400 and "transfer_engine_info" in exc.route:
                return Readiness(False, "EngineNotPublishing", f"{NOT_PUBLISHING} ({exc})")
            if exc.status in (401, 403):
                return Readiness(False, "EngineUnauthorized", f"SGLang refused this agent's admin key ({exc})")
            return Readiness(False, "EngineUnavailable", str(exc))
        except ManifestError as exc:
            return Readiness(False, "ManifestRefused", str(exc))
        replicated = sum(m.replica is not None for m in manifests)
        paths = [f"{len(manifests) - replicated} rank(s) traced"] if replicated < len(manifests) else []
        if replicated:
            paths.append(f"{replicated} rank(s) through an engine replica (SGLang's load_weights on the sources)")
        counts = {"trace": len(manifests) - replicated, "engine-replica": replicated}
        return Readiness(True, "EngineServing", f"SGLang at {self.client.base_url}: {', '.join(paths)}", counts)

    # --- The round ---------------------------------------------------------------------------------

    def _open(self, round_id: str) -> None:
        with _OPEN_ROUNDS_LOCK:
            _OPEN_ROUNDS[self.client.base_url] = round_id

    def _check_round(self, route: str, round_id: str) -> None:
        with _OPEN_ROUNDS_LOCK:
            current = _OPEN_ROUNDS.get(self.client.base_url)
        if current is not None and current != round_id:
            raise RoundMismatchError(
                route, 409, f"round id mismatch: round {current} is open on {self.client.base_url}, this call is "
                f"from round {round_id} (kept client-side: SGLang has no round id); not sent"
            )  # fmt: skip

    def pause(self, timeout: float, *, round_id: str) -> None:
        self._open(round_id)
        # retract: running requests go back to the queue and are recomputed after resume (abort would lose
        # them, in_place would keep KV that the flush below must drop).
        self.client.pause_generation("retract", timeout=timeout)
        # The prefix cache holds KV computed with the old weights: drop it. Without a timeout SGLang flushes at
        # once and, while paused, does not count the retracted (waiting) requests; with one it would wait for
        # a fully idle engine, which never comes under load. Retried briefly while a batch is still finishing.
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.request("POST", "/flush_cache", body={}, timeout=timeout)
                return
            except HttpCallError as exc:
                if exc.status != 400 or time.monotonic() + FLUSH_RETRY_SECONDS > deadline:
                    raise
            time.sleep(FLUSH_RETRY_SECONDS)

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        self._open(round_id)
        self._check_newer(version, timeout, "/begin_weight_update")
        self._sums.forget()
        try:
            self._post("/begin_weight_update", {}, timeout)
        except HttpCallError as exc:
            if exc.status != 400 or "already open" not in str(exc):
                raise
            # A failed round left its session open (it stays paused on mixed weights): close and reopen.
            self._post("/end_weight_update", {}, timeout)
            self._post("/begin_weight_update", {}, timeout)

    def verify(
        self, rank: int, version: int, checksums: Sequence[str], timeout: float, *, round_id: str
    ) -> TargetVerdict:
        self._check_round("/weights_checker", round_id)
        manifest = self._manifests.get(rank) or self.manifest(rank)
        if len(checksums) != len(manifest.tensors):
            return TargetVerdict(
                ok=False, error=f"{len(checksums)} checksums for {len(manifest.tensors)} parameters of rank {rank}"
            )
        held = self._sums.for_rank(version, rank, lambda: self._engine_checksums(timeout)).get(rank)
        if held is None:
            return TargetVerdict(ok=False, error=f"/weights_checker answered no checksums for TP rank {rank}")
        return _verdict(manifest, checksums, held)

    def apply(self, version: int, timeout: float, *, round_id: str) -> None:
        """End the weight-update session (SGLang's post-processing runs there) and keep the label: the semantic gate
        scores the canary between this and :meth:`commit`."""
        self._check_round("/end_weight_update", round_id)
        self._check_newer(version, timeout)
        self._end_session(timeout)
        self._applied = round_id

    def score(self, input_ids: Sequence[int], timeout: float, *, round_id: str) -> list[float | None]:
        self._check_round("/generate", round_id)
        return self.client.prompt_logprobs(input_ids, timeout=timeout)

    def commit(self, version: int, timeout: float, *, round_id: str) -> None:
        self._check_round("/end_weight_update", round_id)
        self._check_newer(version, timeout)
        # The version moves only here, after every rank verified; end first, so post-processing has run (in this
        # round's apply, when the semantic gate ran).
        if self._applied != round_id:
            self._end_session(timeout)
        self.client.update_weight_version(str(version), abort_all_requests=False, timeout=timeout)
        with _OPEN_ROUNDS_LOCK:
            if _REPAIRS.get(self.client.base_url, version + 1) <= version:
                del _REPAIRS[self.client.base_url]  # repaired, or overtaken: this version was verified and committed

    def scrub(self, rank: int, version: int, checksums: Sequence[str], timeout: float) -> TargetVerdict:
        """SGLang's own ``/weights_checker`` of the weights it serves now (not the round's cached pass) against the
        committed version's verified checksums. SGLang cannot be told to stop serving them: the coordinator repairs
        the engine at once, and this allows that round to write ``version`` again."""
        manifest = self._manifests.get(rank) or self.manifest(rank)
        if len(checksums) != len(manifest.tensors):
            return TargetVerdict(ok=False, error=f"{len(checksums)} checksums for {len(manifest.tensors)} parameters")
        held = self.client.weight_version(timeout=timeout)
        if held != str(version):
            return TargetVerdict(ok=True)  # another version: a catch-up's business, not a drift of this one
        served = self._engine_checksums(timeout).get(rank)
        if served is None:
            return TargetVerdict(ok=False, error=f"/weights_checker answered no checksums for TP rank {rank}")
        verdict = _verdict(manifest, checksums, served)
        if not verdict.ok:
            with _OPEN_ROUNDS_LOCK:
                _REPAIRS[self.client.base_url] = version
        return verdict

    def _check_newer(self, version: int, timeout: float, route: str = "/update_weight_version") -> None:
        held = self.client.weight_version(timeout=timeout)
        with _OPEN_ROUNDS_LOCK:
            repair = _REPAIRS.get(self.client.base_url) == version
        if repair and held == str(version):
            return  # a scrub found this version drifted here: the round writes and verifies it again
        if held is not None and held.isdigit() and version <= int(held):
            raise HttpCallError(route, 409, f"version {version} is not newer than the version SGLang holds ({held})")

    def resume(self, timeout: float, *, round_id: str) -> None:
        self._check_round("/continue_generation", round_id)
        self.client.continue_generation(timeout=timeout)

    def abort(self, version: int, timeout: float, *, round_id: str, written: bool = True) -> None:
        # SGLang tracks no dirty weights: after an abort with nothing written the driver's resume serves again.
        self._check_round("/end_weight_update", round_id)
        # Close the weight-update session only: never relabel; the engine stays paused until a round lands.
        try:
            self._post("/end_weight_update", {}, timeout)
        except HttpCallError as exc:
            if exc.status != 400:
                raise

    # --- Broadcast reception: SGLang's own routes ----------------------------------------------------

    def join_broadcast(
        self,
        init_method: str,
        world_size: int,
        members: list[dict[str, Any]],
        backend: str,
        timeout: float,
        group_name: str = "weightsync",
    ) -> None:
        # Every TP rank joins as group rank rank_offset + tp_rank (SGLang's own rule), so this engine's members
        # must be one per rank, consecutive, in rank order. Blocks until the whole group formed.
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise HttpCallError(INIT_GROUP_ROUTE, None, f"SGLang rendezvous needs tcp://HOST:PORT, got {init_method}")
        try:
            offset = rank_offset(members, self.settings.ranks)
        except ValueError as exc:
            raise HttpCallError(INIT_GROUP_ROUTE, None, f"SGLang joins {exc}") from exc
        body = {
            "master_address": url.hostname,
            "master_port": url.port,
            "rank_offset": offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._post(INIT_GROUP_ROUTE, body, timeout + self.settings.call_timeout)

    def arm_broadcast(self, version: int, timeout: float, *, round_id: str | None = None) -> None:
        raise HttpCallError(UPDATE_ROUTE, None, "SGLang is told each chunk's tensors (receive_broadcast), not armed")

    def receive_broadcast(self, version: int, tensors: Sequence[FullTensor], group_name: str, timeout: float) -> None:
        # No weight_version: SGLang would relabel on load, before verification; the version moves only in commit.
        # flush_cache off: pause already flushed, nothing runs while paused, and SGLang fails the whole call
        # when a flush finds the retracted requests queued. Loads with SGLang's own load_weights (it cuts the shards).
        body = {
            "names": [t.name for t in tensors],
            "dtypes": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": group_name,
            "flush_cache": False,
            "abort_all_requests": False,
        }
        self._post(UPDATE_ROUTE, body, timeout)

    def leave_broadcast(self, group_name: str, timeout: float) -> None:
        try:
            self._post("/destroy_weights_update_group", {"group_name": group_name}, timeout)
        except HttpCallError as exc:
            if exc.status != 400:  # 400: "does not exist" (never joined, or already destroyed)
                raise

    # --- Pieces ------------------------------------------------------------------------------------

    def _end_session(self, timeout: float) -> None:
        """End a verified round's session: first, for a model whose buffers SGLang derives from the written
        parameters (its manifests' ``rederived``), SGLang's own rebind through weightsync's custom weight loader
        (``weightsync_engine/sglang/aliases.py``), then ``/end_weight_update``. A failed rebind fails the round before
        the end: the round's failure path closes the session, never relabels, and the engine stays paused, so stale
        buffers are never served."""
        # A broadcast round ran SGLang's own load_weights on every tensor, which re-derived the buffers itself.
        if self.settings.mode == "p2p" and self._rederives():
            # flush_cache off: pause flushed, nothing ran since, and a flush finding the retracted requests queued
            # fails the call; no weight_version: the version moves in commit only.
            body = {
                "serialized_named_tensors": [EMPTY_TENSORS] * self.settings.ranks,
                "load_format": REBIND_LOADER,
                "flush_cache": False,
                "abort_all_requests": False,
            }
            self._post(REBIND_ROUTE, body, timeout)
        self._post("/end_weight_update", {}, timeout)

    def _post(self, route: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        _, answer = self.client.request("POST", route, body=body, timeout=timeout)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise HttpCallError(route, 400, str(answer.get("message")), answer)
        return answer if isinstance(answer, dict) else {}

    def _rederives(self) -> bool:
        """Whether this engine's manifests list buffers SGLang re-derives after the writes (one list per model)."""
        return any((self._manifests.get(r) or self.manifest(r)).rederived for r in range(self.settings.ranks))

    def _engine_checksums(self, timeout: float) -> dict[int, dict[str, str]]:
        """Every rank's ``{name: hash}`` (the route gathers all TP ranks; asked once per verify pass)."""
        answer = self._post("/weights_checker", {"action": "checksum"}, timeout)
        by_rank: dict[int, dict[str, str]] = {}
        for entry in answer.get("ranks") or []:
            infos = entry.get("parallelism_info") or []
            tp_rank = next((int(i["tp_rank"]) for i in infos if i.get("role", "target") == "target"), None)
            if tp_rank is not None:
                by_rank[tp_rank] = {str(k): str(v) for k, v in (entry.get("checksums") or {}).items()}
        return by_rank

    def _fetch(self, rank: int) -> Manifest:
        return fetch_manifest(self.settings, rank, self.name)

    def _assemble(self, rank: int) -> Manifest:
        info = self.client.server_info()
        info_pair = self.client.transfer_engine_info(rank)
        if not isinstance(info_pair.weights_info, dict):
            raise ManifestError(f"{self.name}: rank {rank}'s weights info is not a {{name: [ptr, numel, size]}} map")
        parallelism = Parallelism.of(info, self.name)
        device = str(info.get("device") or "cuda")
        try:
            if not parallelism.traced:  # experts or attention split otherwise than by TP: the trace does not apply
                raise TraceRefusedError(f"{self.name}: the server runs {parallelism}; the trace follows TP only")
            trace = self._trace(rank, info)
            return assemble(self.settings.engine, rank, trace, info_pair.session_id, info_pair.weights_info,
                            device=device, rebind=rebinds(info))  # fmt: skip
        except TraceRefusedError as refused:
            # The loader fuses, transforms or derives weights here: the engine replica holds what it produces.
            layout = self._replica_layout(rank, info, parallelism)
            try:
                return replica_manifest.assemble(
                    self.settings.engine,
                    rank,
                    layout,
                    info_pair.session_id,
                    info_pair.weights_info,
                    checksum=checksum_scheme(device),
                    model=str(info["model_path"]),
                )
            except TraceRefusedError as also:
                raise TraceRefusedError(f"{refused}; {also}") from also

    def _trace(self, rank: int, server_info: dict[str, Any]) -> dict[str, Any]:
        """The shard map of TP rank ``rank``, traced once with the engine's own SGLang code."""
        with self._lock:  # one trace at a time: readiness and every source ask at start-up
            if rank not in self._traces:
                self._traces[rank] = self._run_trace(rank, server_info)
            return self._traces[rank]

    def _replica_layout(self, rank: int, server_info: dict[str, Any], parallelism: Parallelism) -> dict[str, Any]:
        """Rank ``rank``'s engine-replica layout, built and checked once with the engine's own SGLang code."""
        with self._lock:
            if rank not in self._layouts:
                self._layouts[rank] = run_replica_layout(
                    "sglang",
                    model=str(server_info["model_path"]),
                    tp=parallelism.tp,
                    rank=rank,
                    dtype=str(server_info.get("dtype") or "auto"),
                    ep=parallelism.ep,
                    dp=parallelism.dp,
                    who=self.name,
                )
            return self._layouts[rank]

    def _run_trace(self, rank: int, server_info: dict[str, Any]) -> dict[str, Any]:
        return run_trace("sglang", model=str(server_info["model_path"]), tp=int(server_info.get("tp_size") or 1),
                         rank=rank, dtype=str(server_info.get("dtype") or "auto"), who=self.name)  # fmt: skip


def _verdict(manifest: Manifest, checksums: Sequence[str], held: Mapping[str, str]) -> TargetVerdict:
    """``manifest``'s tensors' hashes in ``held`` (SGLang's checker) against ``checksums``, naming the first that
    differ; a block-FP8 weight's scale has no checksum of its own (SGLang compares it through its weight)."""
    mismatched = [
        i
        for i, (t, want) in enumerate(zip(manifest.tensors, checksums, strict=True))
        if held.get(t.name) != want and not (want == COMPARED_WITH_WEIGHT and t.name not in held)
    ]
    if not mismatched:
        return TargetVerdict(ok=True)
    names = [manifest.tensors[i].name for i in mismatched[:5]]
    return TargetVerdict(ok=False, mismatched=mismatched, error=f"parameters {names} differ")
