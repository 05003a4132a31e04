"""The stock-vLLM adapter: vLLM as it ships, with weightsync's backend plugin (``weightsync_engine.vllm``) selected by
``--weight-transfer-config '{"backend": "weightsync"}'``; driven through vLLM's own RL routes
(``VLLM_SERVER_DEV_MODE=1``).

Staged rounds (docs/engines/vllm.md): the plugin keeps, per worker, a receive buffer holding the checkpoint's
tensors in a file under ``$WEIGHTSYNC_VLLM_RECEIVE_DIR`` (default ``/dev/shm/weightsync-vllm``: the pod's
memory-backed ``/dev/shm``, which the operator mounts in the engine's and the agent's containers alike); sources
write into it while vLLM keeps serving. A round:

| step | vLLM route / what |
|---|---|
| begin | the version must be newer than ``/weight_info``'s; nothing else: the buffer is the staging area |
| write | one-sided Mooncake writes into the receive buffer (the manifest's addresses) |
| verify | the engine pod's agent hashes each bucket of the buffer through the file (``/v1/engine/verify``) |
| commit | ``/pause?mode=wait``, ``/start_weight_update``, ``/update_weights`` (``load_weights`` from the buffer |
|        | inside vLLM's layerwise reload), ``/finish_weight_update``, ``/update_weight_version``, ``/resume`` |
| abort | nothing to undo: the live weights were not touched (a commit that failed half-way leaves the engine paused) |

The manifest of a rank is the buffer's layout (``<dir>/dp0-pp0-tp<r>.json``, written by the plugin when the
engine pod's agent calls ``/init_weight_transfer_engine``): every checkpoint tensor whole, at its address in the
engine's worker, ``staging: true``, verified per bucket (``bucket-xxh3``). The agent asks on every manifest
request (the plugin keeps its buffer when asked again with the same settings): a vLLM that restarted answers
with a new buffer under a new Mooncake session, so its manifest's placement changes, the sources refuse their
stale manifests and refetch, and the coordinator catches the fresh engine up like any joining one. The commit
names the sessions the verified bytes were written to; a rank whose buffer is another session refuses to apply.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

import xxhash

from weightsync.api.engines import ENGINE_KINDS, Capabilities
from weightsync_agent.http.client import HttpCallError, JsonHttpClient
from weightsync_agent.layout.buckets import plan_buckets
from weightsync_agent.layout.manifest import Manifest, ManifestError, Region, ShardPart, TensorEntry
from weightsync_agent.targets.adapter import (
    AdapterSettings,
    BroadcastReception,
    FullTensor,
    Readiness,
    TargetVerdict,
)
from weightsync_agent.targets.engine_agent_calls import MANIFEST_ROUTE, MAX_MISMATCHED, fetch_manifest, remote_verify
from weightsync_agent.targets.vllm.checkpoint_quantization import channel_scales

log = logging.getLogger("weightsync.agent.vllm")

#: A commit ends this much before its timeout, so it never outlasts the driver waiting for it.
COMMIT_MARGIN = 2.0

#: Where the plugin's receive buffers live, shared by the engine's and the agent's containers. The default is in
#: the pod's ``/dev/shm``, the memory-backed ``emptyDir`` the operator mounts in every container of the pod (its
#: size is ``rdma.shmSizeGiB``: it must hold the checkpoint once per engine rank of the pod).
ENV_RECEIVE_DIR = "WEIGHTSYNC_VLLM_RECEIVE_DIR"
DEFAULT_RECEIVE_DIR = "/dev/shm/weightsync-vllm"
#: The address the plugin's Mooncake engine listens on (default: the engine URL's host, the pod's IP).
ENV_MOONCAKE_HOST = "WEIGHTSYNC_VLLM_MOONCAKE_HOST"
#: The backend name the server must be started with (``weightsync_engine.vllm.plugin.BACKEND``).
BACKEND = "weightsync"
NOT_SERVING_ROUTES = (
    "vLLM does not serve its RL routes: start it with VLLM_SERVER_DEV_MODE=1 and "
    f'--weight-transfer-config \'{{"backend": "{BACKEND}"}}\', with weightsync installed in its image'
)


def rank_tag(rank: int) -> str:
    """The plugin's name for TP rank ``rank``'s buffer (``weightsync_engine.vllm.engine.rank_tag``)."""
    return f"dp0-pp0-tp{rank}"


class VllmAdapter:
    kind: ClassVar[str] = "vllm"
    capabilities: ClassVar[Capabilities] = ENGINE_KINDS["vllm"].capabilities  # type: ignore[assignment]
    manifests_from_engine_agent: ClassVar[bool] = True  # the buffer's layout is a file in the engine's pod
    broadcast: ClassVar[BroadcastReception] = BroadcastReception("engine", "announced-tensors")  # not supported
    #: How to start vLLM when its RL routes answer 404 (readiness' ``EngineNotPublishing``).
    not_serving: ClassVar[str] = NOT_SERVING_ROUTES
    #: Where the plugin lands this adapter's bytes (``weightsync_engine.vllm.engine.PLACEMENTS``): its receive buffer.
    placement: ClassVar[str] = "buffer"
    #: The semantic gate (``GatedRound``): staged rounds, the buffer applied before the canary is scored.
    gate_stagings: ClassVar[frozenset[str]] = frozenset({"staged"})

    def __init__(self, settings: AdapterSettings) -> None:
        self.settings = settings
        self.client = JsonHttpClient(settings.url, timeout=settings.call_timeout, api_key=settings.api_key)
        self.name = f"engine {settings.engine} (vLLM at {self.client.base_url})"
        self._manifests: dict[int, Manifest] = {}
        self._lock = threading.Lock()
        self._applied: str | None = None  # the round whose gate applied the buffer (its commit only labels)

    def __repr__(self) -> str:
        return f"VllmAdapter({self.name})"

    # --- Discovery and readiness -------------------------------------------------------------------

    def manifest(self, rank: int) -> Manifest:
        manifest = self._published(rank)
        self._manifests[rank] = manifest
        return manifest

    def held_version(self, timeout: float | None = None) -> str | None:
        _, answer = self.client.request("GET", "/weight_info", timeout=timeout)
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        return None if version is None else str(version)

    def healthy(self, timeout: float) -> bool:
        try:
            self.client.request("GET", "/health", timeout=timeout)
        except HttpCallError:
            return False
        return True

    def readiness(self) -> Readiness:
        try:
            for rank in range(self.settings.ranks):
                self.manifest(rank)
        except HttpCallError as exc:
            if exc.status in (401, 403):
                return Readiness(False, "EngineUnauthorized", f"vLLM refused the group's token ({exc})")
            if exc.status == 404:
                return Readiness(False, "EngineNotPublishing", f"{self.not_serving} ({exc})")
            return Readiness(False, "EngineUnavailable", str(exc))
        except ManifestError as exc:
            return Readiness(False, "ManifestRefused", str(exc))
        return Readiness(True, "EngineServing", f"vLLM at {self.client.base_url}: {self.settings.ranks} rank(s)")

    # --- The round (staged: the engine serves until commit) ------------------------------------------

    def pause(self, timeout: float, *, round_id: str) -> None:
        self._post("/pause?mode=wait", None, timeout)

    def resume(self, timeout: float, *, round_id: str) -> None:
        self._post("/resume", None, timeout)

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        self._refuse_unless_newer(version, "/weight_info", timeout)

    def verify(
        self, rank: int, version: int, checksums: Sequence[str], timeout: float, *, round_id: str
    ) -> TargetVerdict:
        if not self.settings.engine_side:
            return remote_verify(self.settings, rank, version, checksums, timeout, round_id=round_id, who=self.name)
        manifest = self._manifests.get(rank) or self.manifest(rank)
        layout = self._read_layout(rank)
        if str(layout.get("session_id")) != manifest.session_id:
            return TargetVerdict(ok=False, error=f"rank {rank}'s receive buffer is session {layout.get('session_id')}, "
                                 f"the sources wrote session {manifest.session_id}: vLLM restarted")  # fmt: skip
        return verify_buffer(manifest, layout, self.settings.bucket_bytes, checksums)

    def apply(self, version: int, timeout: float, *, round_id: str) -> None:
        """The commit without its label and resume (the semantic gate scores the canary between this and
        :meth:`commit`): vLLM paused, the verified buffer loaded through its layerwise reload."""
        self._load(version, timeout, _budget(timeout))
        self._applied = round_id

    def score(self, input_ids: Sequence[int], timeout: float, *, round_id: str) -> list[float | None]:
        """vLLM's logprob of each of ``input_ids`` after the first: ``/v1/completions`` with ``prompt_logprobs``."""
        body = {"model": self._served_name(timeout), "prompt": list(input_ids), "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0}  # fmt: skip
        answer = self._post("/v1/completions", body, timeout)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        entries = choices[0].get("prompt_logprobs") if isinstance(choices, list) and choices else None
        if not isinstance(entries, list) or len(entries) != len(input_ids):
            raise HttpCallError("/v1/completions", 200, f"no prompt_logprobs for the {len(input_ids)} prompt tokens")
        scored: list[float | None] = []
        for entry, token in zip(entries[1:], input_ids[1:], strict=True):
            chosen = entry.get(str(token)) if isinstance(entry, dict) else None
            value = chosen.get("logprob") if isinstance(chosen, dict) else None
            scored.append(float(value) if isinstance(value, int | float) else None)
        return scored

    def _served_name(self, timeout: float) -> str:
        """The name the OpenAI routes serve the model under (``--served-model-name``, else its path): ``/v1/models``."""
        _, answer = self.client.request("GET", "/v1/models", timeout=timeout)
        models = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(models, list) or not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise HttpCallError("/v1/models", 200, f"no served model in {str(answer)[:200]}", answer)
        return str(models[0]["id"])

    def commit(self, version: int, timeout: float, *, round_id: str) -> None:
        # The commit is several vLLM calls; ``timeout`` bounds them together, ending a little before the driver
        # stops waiting, so no step of a commit the round already gave up on can land afterwards.
        left = _budget(timeout)
        if self._applied != round_id:
            self._load(version, timeout, left)
        self._applied = None
        # The label goes last, in a call of its own: the reload (the slow part) is done and vLLM is still paused
        # (or, after the gate, serving the applied weights under the old label).
        self._post("/update_weight_version", {"new_version": str(version)}, left("/update_weight_version"))
        self._post("/resume", None, timeout)

    def _load(self, version: int, timeout: float, left: Callable[[str], float]) -> None:
        """Pause vLLM and apply the verified receive buffer through its layerwise reload, keeping the label."""
        self._refuse_unless_newer(version, "/finish_weight_update", left("/weight_info"))
        sessions = self._written_sessions(left)
        try:
            self._post("/pause?mode=wait", None, left("/pause"))
        except HttpCallError:
            # The weights are untouched: serve again (a pause that timed out may still land later; the next
            # round's commit resumes then).
            with contextlib.suppress(HttpCallError):
                self._post("/resume", None, timeout)
            raise
        # A failure from here on leaves vLLM paused (its reload may have begun, or applied part of the buffer): it
        # never resumes on a mix, and reports the version it held before until a later commit completes.
        self._start_update(left)
        self._post("/update_weights", {"update_info": {"sessions": sessions}}, left("/update_weights"))
        self._post("/finish_weight_update", {}, left("/finish_weight_update"))

    def abort(self, version: int, timeout: float, *, round_id: str, written: bool = True) -> None:
        # Nothing to undo: the live weights change only inside commit (or the gate's apply), and one that failed
        # half-way left the engine paused, reporting the version it held before; after a failed gate the driver
        # pauses it again. Either way it serves again only when a later round's commit completes.
        if self._applied == round_id:
            self._applied = None

    # --- Broadcast: not yet (vLLM's own nccl backend needs an NVIDIA driver; docs/engines/vllm.md) -----------

    def join_broadcast(self, init_method: str, world_size: int, members: list[dict[str, Any]], backend: str,
                       timeout: float, group_name: str = "weightsync") -> None:  # fmt: skip
        raise HttpCallError("/init_weight_transfer_engine", None, "broadcast mode into vLLM is not built yet")

    def arm_broadcast(self, version: int, timeout: float, *, round_id: str | None = None) -> None:
        raise HttpCallError("/update_weights", None, "broadcast mode into vLLM is not built yet")

    def receive_broadcast(self, version: int, tensors: Sequence[FullTensor], group_name: str, timeout: float) -> None:
        raise HttpCallError("/update_weights", None, "broadcast mode into vLLM is not built yet")

    def leave_broadcast(self, group_name: str, timeout: float) -> None:
        pass

    # --- Pieces ------------------------------------------------------------------------------------

    def _post(self, route: str, body: dict[str, Any] | None, timeout: float) -> Any:
        _, answer = self.client.request("POST", route, body=body, timeout=timeout)
        return answer

    def _start_update(self, left: Callable[[str], float]) -> None:
        """``/start_weight_update``. After a commit that failed past its start (vLLM hung, then ran the held call)
        vLLM's worker still has that update open and refuses a new one ("start_weight_update called while a weight
        update is already active"; the route answers a bare 500, the message is only in vLLM's log). So on a 500
        the open update is finished (without a version: whatever it loaded is replaced by this commit's full
        update before anything is served) and the start asked once more. A 500 for another reason fails the
        finish too (vLLM refuses a finish without a start), and the commit fails with it."""
        try:
            self._post("/start_weight_update", None, left("/start_weight_update"))
        except HttpCallError as exc:
            if exc.status != 500:
                raise
            log.warning("%s refused /start_weight_update (%s): finishing an update left open, then starting again",
                        self.name, exc)  # fmt: skip
            self._post("/finish_weight_update", {}, left("/finish_weight_update"))
            self._post("/start_weight_update", None, left("/start_weight_update"))

    def _written_sessions(self, left: Callable[[str], float]) -> dict[str, str]:
        """The session each rank's bytes went to this round (the manifests the round's placements came from),
        checked against what the engine's agent publishes now: a vLLM that restarted since is refused here,
        before it is paused, and again by the plugin if it restarts later still."""
        sessions: dict[str, str] = {}
        for rank in range(self.settings.ranks):
            written = self._manifests.get(rank)
            now = self._published(rank, left(MANIFEST_ROUTE))
            if written is not None and written.placement != now.placement:
                raise HttpCallError(
                    "/update_weights",
                    409,
                    f"rank {rank}'s receive buffer is now session {now.session_id}, the "
                    f"verified bytes are in session {written.session_id}: vLLM restarted, nothing applied",
                )
            sessions[rank_tag(rank)] = (written or now).session_id
        return sessions

    def _refuse_unless_newer(self, version: int, route: str, timeout: float) -> None:
        held = self.held_version(timeout)
        if held is not None and held.isdigit() and version <= int(held):
            raise HttpCallError(route, 409, f"version {version} is not newer than vLLM's ({held})")

    def _published(self, rank: int, timeout: float | None = None) -> Manifest:
        """Rank ``rank``'s manifest as the engine publishes it now: from its buffer's layout in the engine's pod,
        from that pod's agent elsewhere (``timeout`` bounds that call)."""
        if self.settings.engine_side:
            return manifest_of(self.settings.engine, rank, self._current_layout(rank))
        return fetch_manifest(self.settings, rank, self.name, timeout=timeout)

    def _current_layout(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s buffer layout as the engine has it now: the plugin is asked for its buffers every time
        (it keeps them when they exist; a restarted vLLM makes new ones), then the layout file is read."""
        directory = self._receive_dir()
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ManifestError(f"{self.name}: cannot make the receive directory {directory}: {exc}") from exc
        host = os.environ.get(ENV_MOONCAKE_HOST) or urlparse(self.client.base_url).hostname or "127.0.0.1"
        request = uuid.uuid4().hex
        init_info = {"directory": directory, "host": host, "placement": self.placement, "request": request}
        with self._lock:
            try:
                self._post("/init_weight_transfer_engine", {"init_info": init_info}, self.settings.call_timeout)
            except HttpCallError as exc:
                # vLLM answers a failed init with a bare 500; the plugin publishes why it refused.
                refused = self._refusal(rank, request)
                if refused:
                    raise ManifestError(f"{self.name}: rank {rank}: {refused}") from exc
                raise
            layout = self._read_layout(rank)
        if layout.get("placement") != self.placement:
            raise ManifestError(f"{self.name}: rank {rank}'s layout is placement {layout.get('placement')!r}, "
                                f"not {self.placement!r}")  # fmt: skip
        return layout

    def _refusal(self, rank: int, request: str) -> str:
        """Why the plugin refused ``request`` for rank ``rank``, if it published a refusal for it."""
        try:
            layout = self._read_layout(rank)
        except ManifestError:
            return ""
        return str(layout.get("refused") or "") if layout.get("request") == request else ""

    def _read_layout(self, rank: int) -> dict[str, Any]:
        path = Path(self._receive_dir()) / f"{rank_tag(rank)}.json"
        try:
            layout: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ManifestError(f"{self.name}: rank {rank}'s receive buffer layout {path}: {exc}") from exc
        return layout

    @staticmethod
    def _receive_dir() -> str:
        return os.environ.get(ENV_RECEIVE_DIR) or DEFAULT_RECEIVE_DIR


def _budget(timeout: float) -> Callable[[str], float]:
    """Seconds left for the next call of a commit bounded by ``timeout`` (less :data:`COMMIT_MARGIN`); a call
    with none left is not made: :class:`HttpCallError` naming its route."""
    deadline = time.monotonic() + max(timeout - COMMIT_MARGIN, timeout / 2)

    def left(route: str) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise HttpCallError(route, None, f"not called: the commit used its {timeout:g} s")
        return remaining

    return left


def manifest_of(engine: int, rank: int, layout: dict[str, Any]) -> Manifest:
    """The manifest of a receive buffer: every checkpoint tensor whole, at its address in the engine's worker."""
    base = int(layout["address"])
    scales = channel_scales(layout)  # a quantized checkpoint's weights: the sources quantize them
    tensors = []
    for slot in layout["tensors"]:
        shape = tuple(int(d) for d in slot["shape"])
        if not shape or 0 in shape:
            raise ManifestError(f"{slot['name']}: a tensor of shape {list(shape)} has nothing to transfer")
        whole = ShardPart(source=slot["name"], full_shape=shape, dim=0, start=0, length=shape[0])
        address = base + int(slot["offset"])
        scale, scheme = scales.get(slot["name"], (None, None))
        tensors.append(TensorEntry(name=slot["name"], dtype=slot["dtype"], shape=shape, address=address,
                                   nbytes=int(slot["nbytes"]), parts=(whole,), quantize=scheme,
                                   scale=scale))  # fmt: skip
    return Manifest(
        engine=engine,
        rank=rank,
        session_id=str(layout["session_id"]),
        tensors=tuple(tensors),
        regions=(Region(address=base, nbytes=int(layout["nbytes"])),),
        staging=True,
        checksum="bucket-xxh3",
    )


def verify_buffer(
    manifest: Manifest, layout: dict[str, Any], bucket_bytes: int, checksums: Sequence[str]
) -> TargetVerdict:
    """Hash each bucket of ``manifest`` over the buffer's file (mapped read-only here, at another address than the
    engine's: offsets are the manifest's addresses less the buffer's) and compare with the sources' ``checksums``;
    the digest is :mod:`weightsync_agent.layout.checksums`' (xxh3-64 over the bucket's pieces in order)."""
    buckets = plan_buckets(manifest, bucket_bytes)
    if len(checksums) != len(buckets):
        return TargetVerdict(ok=False, error=f"{len(checksums)} checksums for {len(buckets)} buckets")
    base, nbytes = int(layout["address"]), int(layout["nbytes"])
    mismatched: list[int] = []
    with open(layout["path"], "rb") as handle, mmap.mmap(handle.fileno(), nbytes, prot=mmap.PROT_READ) as mapped:
        for bucket, want in zip(buckets, checksums, strict=True):
            hasher = xxhash.xxh3_64()
            for piece in bucket.pieces:
                offset = piece.remote_address - base
                hasher.update(mapped[offset : offset + piece.length])
            if hasher.hexdigest() != want:
                mismatched.append(bucket.index)
    if mismatched:
        return TargetVerdict(ok=False, mismatched=mismatched[:MAX_MISMATCHED],
                             error=f"{len(mismatched)} of {len(buckets)} buckets differ")  # fmt: skip
    return TargetVerdict(ok=True)
