"""Stock vLLM in live p2p mode: the sources write each rank's shard straight into vLLM's live parameters.

The server runs with weightsync's backend plugin as in staged mode (``--weight-transfer-config '{"backend":
"weightsync"}'``); the engine pod's agent asks it for the ``parameters`` placement: the plugin takes the model's
own parameters as its target and publishes ``{name: [data_ptr, numel, element_size]}`` under its Mooncake session
(refused, with the parameters and why, where they are not plain tensors: vLLM's CPU build, quantized models). The
agent joins that with the trace of vLLM's ``load_weights`` (:mod:`.traced`), so each source knows which slice of
which HF tensor goes to which address. No copy, no ``load_weights`` pass: the SGLang/Miles P2P design, in stock
vLLM. A round (docs/engines/vllm.md):

| step | vLLM route / what |
|---|---|
| pause | ``/pause?mode=wait`` (in-flight requests finish; vLLM drops its KV and prefix caches) |
| begin | the version must be newer than ``/weight_info``'s; ``/start_weight_update``: the plugin registers the |
|       | parameters with its Mooncake engine (they take writes only from here on) |
| write | one-sided Mooncake writes into the live parameters (the manifests' addresses) |
| verify | vLLM's sha256 of every parameter against the sources' (the plugin's worker extension through |
|        | ``/collective_rpc``, else ``/weight_checker``; a retry, after writing again, asks again) |
| commit | ``/finish_weight_update`` without a version (the plugin unregisters them), then |
|        | ``/update_weight_version``, only for the version verified here |
| resume | ``/resume`` |
| abort | an update left open is finished (unregistered, no label); the engine stays paused on weights that may be |
|       | a mix, reporting the version it held, until a round lands (restarted or joining vLLMs are caught up). |
|       | A round that wrote nothing (``written: false``) had its parameters open too: they serve again only if |
|       | vLLM's checksums, taken after they closed, still equal the committed version's; else ``resume`` refuses |

Between rounds the parameters are not registered, so Mooncake refuses any write to them: a peer that learnt the
addresses cannot change what serves. Inside a round they take writes only while vLLM is paused, and a failed round
leaves vLLM paused until a round rewrites and verifies every parameter.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import ClassVar

from weightsync_agent.http.client import HttpCallError
from weightsync_agent.layout.manifest import Manifest, ManifestError
from weightsync_agent.layout.traced_manifest import assemble
from weightsync_agent.targets.adapter import AdapterSettings
from weightsync_agent.targets.vllm.traced import VllmTracedAdapter

log = logging.getLogger(__name__)


@dataclass
class ServedState:
    """What the coordinator knows of the parameters one vLLM serves."""

    #: vLLM's checksums of every rank's parameters, known clean: the last committed version's, or taken at a begin
    #: before the parameters opened. None: not known (taken at the next begin).
    clean: dict[str, str] | None = None
    #: Why the parameters must not serve until a round lands (written and not committed, or changed while open to
    #: writes), or None.
    unclean: str | None = None


#: Per vLLM URL, in this (the coordinator's) process: adapters are made per round, the state outlives them. A new
#: coordinator process starts knowing nothing (its first begin takes vLLM's checksums as they are).
_SERVED: dict[str, ServedState] = {}
_SERVED_LOCK = threading.Lock()


def served_state(url: str) -> ServedState:
    with _SERVED_LOCK:
        return _SERVED.setdefault(url, ServedState())


class VllmLiveAdapter(VllmTracedAdapter):
    """One stock vLLM engine taking live p2p rounds into its parameters, through weightsync's backend plugin."""

    placement: ClassVar[str] = "parameters"

    def __init__(self, settings: AdapterSettings) -> None:
        super().__init__(settings)
        self.name = f"engine {settings.engine} (vLLM at {self.client.base_url}, live parameters)"
        self._served = served_state(self.client.base_url)

    def __repr__(self) -> str:
        return f"VllmLiveAdapter({self.name})"

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        super().begin(version, timeout, round_id=round_id)
        served = self._served
        if served.clean is None and served.unclean is None:
            served.clean = self._engine_checksums(timeout)  # closed to writes yet: what serves now
        self._open_once(timeout)  # the plugin registers the parameters: writable until the commit's finish

    def apply(self, version: int, timeout: float, *, round_id: str) -> None:
        super().apply(version, timeout, round_id=round_id)
        # What every rank verified serves from here (the gate resumes before the label; a failed gate aborts).
        self._served.clean, self._served.unclean = self._sums.latest(), None

    def abort(self, version: int, timeout: float, *, round_id: str, written: bool = True) -> None:
        super().abort(version, timeout, round_id=round_id, written=written)  # closes the parameters first
        served = self._served
        if written:  # a mix, or nothing known: the engine stays paused until a round lands
            served.clean = None
            served.unclean = ("a round wrote into vLLM's parameters and did not finish; they serve again only when a "
                              "round lands")  # fmt: skip
            return
        if served.unclean is not None:
            return  # already not serving: a later round's commit clears it
        # Nothing was asked to be written, but the parameters took writes from the begin: anyone who reached
        # vLLM's Mooncake port could have written them. Serve again only if they still hold what served.
        now, clean = self._engine_checksums(timeout), served.clean or {}
        changed = sorted(key for key in clean if now.get(key) != clean[key])
        if served.clean is None or changed or set(now) != set(clean):
            served.clean = None
            served.unclean = (f"vLLM's parameters {changed[:5] or 'of unknown state'} changed while open to writes in "
                              "a round that wrote nothing; they serve again only when a round lands")  # fmt: skip
            log.warning("%s: %s", self.name, served.unclean)

    def resume(self, timeout: float, *, round_id: str) -> None:
        if self._served.unclean is not None:
            raise HttpCallError("/resume", 409, self._served.unclean)
        super().resume(timeout, round_id=round_id)

    def _assemble(self, rank: int) -> Manifest:
        layout = self._current_layout(rank)
        weights_info = layout.get("weights_info")
        if not isinstance(weights_info, dict) or not layout.get("session_id"):
            raise ManifestError(f"{self.name}: rank {rank}'s published parameters name no session or weights")
        return assemble(self.settings.engine, rank, self._trace(rank), str(layout["session_id"]), weights_info,
                        checksum="tensor-sha256")  # fmt: skip
