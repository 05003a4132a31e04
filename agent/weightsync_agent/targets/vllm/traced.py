"""What vLLM's live-weight rounds share, whichever way the bytes come: the traced shard map and vLLM's own checksums.

In broadcast mode (vLLM's ``nccl`` backend, :mod:`.nccl_adapter`) and in live p2p mode (the plugin's
``parameters`` placement, :mod:`.live_adapter`) the bytes land in vLLM's live parameters, so:

* a rank's manifest lists vLLM's own parameters (fused ``qkv_proj``, ``gate_up_proj``), each cut from the HF
  tensors as the trace of vLLM's ``load_weights`` says (run by the engine pod's agent with the engine's Python;
  model, TP size and dtype from ``/server_info``), checksum ``tensor-sha256``;
* verification is vLLM's sha256 of each parameter's bytes, keyed ``dp0:pp0:pcp0:tp<r>:<name>``, asked once per
  verify pass (one call gathers every rank) against what the sources hashed: through the plugin's worker extension
  (``/collective_rpc`` ``weightsync_checksums``: the same digests, many parameters at once) where the server was
  started with it, else ``/weight_checker {"action": "checksum"}`` (one parameter at a time: 20.8 s for an 8B
  model's 15.7 GB on an H200);
* vLLM's update is open (``/start_weight_update``) while the bytes arrive and is finished, without a label, before
  the label moves (broadcast: before the checksums, as vLLM's reload must complete first);
* the label moves only in commit (``/update_weight_version``), and only for the version verified here; a live round
  that failed its verification and writes again (the driver's retries) is verified anew
  (:class:`~weightsync_agent.targets.pass_checksums.PassChecksums`);
* an abort finishes an update left open, never labels, and leaves the engine paused on weights that may be a mix.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

from weightsync_agent.http.client import HttpCallError
from weightsync_agent.layout.manifest import Manifest, ManifestError
from weightsync_agent.targets.adapter import AdapterSettings, TargetVerdict
from weightsync_agent.targets.engine_agent_calls import MAX_MISMATCHED, fetch_manifest
from weightsync_agent.targets.engine_trace import run_trace
from weightsync_agent.targets.pass_checksums import PassChecksums
from weightsync_agent.targets.vllm.adapter import VllmAdapter

log = logging.getLogger("weightsync.agent.vllm")

#: The plugin's worker-extension method that returns ``/weight_checker``'s checksums, computed in parallel
#: (``weightsync_engine.vllm.worker_extension.DIGEST_METHOD``; the agent does not import the plugin).
DIGEST_METHOD = "weightsync_checksums"


class VllmTracedAdapter(VllmAdapter):
    """A vLLM engine whose rounds land in its live parameters, verified by vLLM's own per-parameter checksums."""

    gate_stagings: ClassVar[frozenset[str]] = frozenset({"live"})

    def __init__(self, settings: AdapterSettings) -> None:
        super().__init__(settings)
        self._traces: dict[int, dict[str, Any]] = {}
        self._sums: PassChecksums[dict[str, str]] = PassChecksums()  # key -> sha256, per verify pass
        self._open_update = False  # this adapter's /start_weight_update is not finished yet
        self._digest_rpc = True  # until the server shows it lacks the plugin's worker extension
        self._round_lock = threading.Lock()

    # --- Discovery -----------------------------------------------------------------------------------

    def manifest(self, rank: int) -> Manifest:
        engine_side = self.settings.engine_side
        manifest = self._assemble(rank) if engine_side else fetch_manifest(self.settings, rank, self.name)
        self._manifests[rank] = manifest
        return manifest

    def _assemble(self, rank: int) -> Manifest:
        """Rank ``rank``'s manifest, made in the engine's pod: its trace joined with where the bytes go."""
        raise NotImplementedError

    # --- The round ---------------------------------------------------------------------------------

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        self._refuse_unless_newer(version, "/weight_info", timeout)
        self._sums.forget()

    def verify(
        self, rank: int, version: int, checksums: Sequence[str], timeout: float, *, round_id: str
    ) -> TargetVerdict:
        manifest = self._manifests.get(rank) or self.manifest(rank)
        if len(checksums) != len(manifest.tensors):
            return TargetVerdict(
                ok=False, error=f"{len(checksums)} checksums for {len(manifest.tensors)} parameters of rank {rank}"
            )
        held = self._sums.for_rank(version, rank, lambda: self._engine_checksums(timeout))
        prefix = f"dp0:pp0:pcp0:tp{rank}:"
        mismatched = [i for i, (t, want) in enumerate(zip(manifest.tensors, checksums, strict=True))
                      if held.get(prefix + t.name) != want]  # fmt: skip
        if mismatched:
            names = [manifest.tensors[i].name for i in mismatched[:5]]
            return TargetVerdict(ok=False, mismatched=mismatched[:MAX_MISMATCHED], error=f"parameters {names} differ")
        return TargetVerdict(ok=True)

    def apply(self, version: int, timeout: float, *, round_id: str) -> None:
        """Finish the weight update (vLLM's own post-processing runs there), keeping the label: the semantic gate
        scores the canary between this and :meth:`commit`."""
        self._refuse_unless_newer(version, "/finish_weight_update", timeout)
        if not self._sums.holds(version):
            raise HttpCallError("/finish_weight_update", 409, f"version {version} was not verified here")
        with self._round_lock:
            self._close_update(timeout)
        self._applied = round_id

    def commit(self, version: int, timeout: float, *, round_id: str) -> None:
        if self._applied != round_id:  # the gate's apply already checked, finished and post-processed
            self.apply(version, timeout, round_id=round_id)
        self._applied = None
        self._post("/update_weight_version", {"new_version": str(version)}, timeout)

    def abort(self, version: int, timeout: float, *, round_id: str, written: bool = True) -> None:
        # Close an update left open (no label): the weights may be a mix, so the engine stays paused, reporting the
        # version it held, until a round lands.
        self._applied = None
        with self._round_lock:
            try:
                self._close_update(timeout)
            except HttpCallError as exc:
                # vLLM's worker drops an update whose receive failed ("finish_weight_update called without a
                # matching start_weight_update"); one still open is finished by the next start.
                self._open_update = False
                log.info("%s: no update left to finish after the failed round (%s)", self.name, exc)

    # --- Pieces ------------------------------------------------------------------------------------

    def _open_once(self, timeout: float) -> None:
        """``/start_weight_update`` unless this adapter's update is open already (a start left open by a hung
        round is finished first: ``VllmAdapter._start_update``)."""
        with self._round_lock:
            if not self._open_update:
                self._start_update(lambda _route: timeout)
                self._open_update = True

    def _close_update(self, timeout: float) -> None:
        """Finish this adapter's open update, without a label (called under the round lock)."""
        if self._open_update:
            self._post("/finish_weight_update", {}, timeout)
            self._open_update = False

    def _settle(self, timeout: float) -> None:
        """What must happen before vLLM's checksums say what will serve (called under the round lock)."""

    def _engine_checksums(self, timeout: float) -> dict[str, str]:
        """vLLM's sha256 of every parameter of every rank, once the round's bytes settled: through the plugin's
        worker extension when the server has it (the same digests, in parallel), else ``/weight_checker``."""
        with self._round_lock:
            self._settle(timeout)
            if self._digest_rpc:
                try:
                    return self._rpc_checksums(timeout)
                except HttpCallError as exc:
                    if exc.status in (None, 401, 403):
                        raise
                    self._digest_rpc = False  # started without --worker-extension-cls: say so once, use vLLM's route
                    log.warning("%s: no weightsync worker extension (%s); verifying through /weight_checker, one "
                                "parameter at a time (docs/engines/vllm.md)", self.name, exc)  # fmt: skip
            answer = self._post("/weight_checker", {"action": "checksum"}, timeout)
        sums = answer.get("checksums") if isinstance(answer, dict) else None
        if not isinstance(sums, dict):
            raise HttpCallError("/weight_checker", 200, f"no checksums in {str(answer)[:200]}", answer)
        return {str(k): str(v) for k, v in sums.items()}

    def _rpc_checksums(self, timeout: float) -> dict[str, str]:
        """Every worker's ``weightsync_checksums`` (``weightsync_engine.vllm.worker_extension``), by
        ``/collective_rpc``."""
        answer = self._post("/collective_rpc", {"method": DIGEST_METHOD, "timeout": timeout}, timeout)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise HttpCallError("/collective_rpc", 200, f"no checksums in {str(answer)[:200]}", answer)
        return {str(k): str(v) for worker in results for k, v in worker.items()}

    def _trace(self, rank: int) -> dict[str, Any]:
        """The shard map of TP rank ``rank``, traced once with the engine's own vLLM code."""
        with self._lock:  # one trace at a time: readiness and every source ask at start-up
            if rank not in self._traces:
                served = self._served_model()
                self._traces[rank] = run_trace("vllm", model=served["model"], tp=int(served["tp"]), rank=rank,
                                               dtype=served["dtype"], who=self.name)  # fmt: skip
            return self._traces[rank]

    def _served_model(self) -> dict[str, str]:
        """Model directory, TP size and dtype of the running server (``/server_info``, dev mode)."""
        _, answer = self.client.request("GET", "/server_info", query={"config_format": "json"})
        config = (answer or {}).get("vllm_config") if isinstance(answer, dict) else None
        return served_model(config, self.name)


def served_model(config: Any, who: str) -> dict[str, str]:
    """Model directory, TP size and dtype from a vLLM server's ``vllm_config``; ManifestError where the trace, which
    follows TP only, does not describe its live parameters: expert parallelism splits the experts by expert (at EP
    equal to TP a TP cut has as many elements and would pass every size check), and data parallelism runs several
    TP groups in one server."""
    if not isinstance(config, dict):
        raise ManifestError(f"{who}: /server_info has no vllm_config")
    model, parallel = config.get("model_config") or {}, config.get("parallel_config") or {}
    if not model.get("model"):
        raise ManifestError(f"{who}: /server_info names no model")
    staged = "transfer.targetStaging: staged (vLLM's own loader takes the checkpoint tensors, whatever its layout)"
    if parallel.get("enable_expert_parallel"):
        raise ManifestError(
            f"{who}: vLLM runs expert parallelism (--enable-expert-parallel): its experts are split by expert, which "
            f"the trace (TP only) does not describe; sync it with {staged}"
        )
    if int(parallel.get("data_parallel_size") or 1) > 1:
        raise ManifestError(
            f"{who}: vLLM runs {parallel['data_parallel_size']} data-parallel replicas in one server, which the "
            f"trace (one TP group) does not describe; run one engine per replica, or sync with {staged}"
        )
    return {
        "model": str(model["model"]),
        "tp": str(int(parallel.get("tensor_parallel_size") or 1)),
        "dtype": str(model.get("dtype") or "auto").removeprefix("torch."),
    }
