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
|       | a mix, reporting the version it held, until a round lands (restarted or joining vLLMs are caught up) |

Between rounds the parameters are not registered, so Mooncake refuses any write to them: a peer that learnt the
addresses cannot change what serves. Inside a round they take writes only while vLLM is paused, and a failed round
leaves vLLM paused until a round rewrites and verifies every parameter.
"""

from __future__ import annotations

from typing import ClassVar

from weightsync_agent.layout.manifest import Manifest, ManifestError
from weightsync_agent.layout.traced_manifest import assemble
from weightsync_agent.targets.adapter import AdapterSettings
from weightsync_agent.targets.vllm.traced import VllmTracedAdapter


class VllmLiveAdapter(VllmTracedAdapter):
    """One stock vLLM engine taking live p2p rounds into its parameters, through weightsync's backend plugin."""

    placement: ClassVar[str] = "parameters"

    def __init__(self, settings: AdapterSettings) -> None:
        super().__init__(settings)
        self.name = f"engine {settings.engine} (vLLM at {self.client.base_url}, live parameters)"

    def __repr__(self) -> str:
        return f"VllmLiveAdapter({self.name})"

    def begin(self, version: int, timeout: float, *, round_id: str) -> None:
        super().begin(version, timeout, round_id=round_id)
        self._open_once(timeout)  # the plugin registers the parameters: writable until the commit's finish

    def _assemble(self, rank: int) -> Manifest:
        layout = self._current_layout(rank)
        weights_info = layout.get("weights_info")
        if not isinstance(weights_info, dict) or not layout.get("session_id"):
            raise ManifestError(f"{self.name}: rank {rank}'s published parameters name no session or weights")
        return assemble(self.settings.engine, rank, self._trace(rank), str(layout["session_id"]), weights_info,
                        checksum="tensor-sha256")  # fmt: skip
